//! Certificate renewal without a restart: TLS files laid out as Kubernetes mounts a Secret
//! (`..data` symlink swapped to a new folder) are watched; after a swap, new handshakes use the
//! new material, established connections carry on, unusable files are refused and the material in
//! use stays, and a new CA bundle changes who is admitted.

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use kvsight_transport::dev_certs::{DevCa, IssuedPem, SecretDir};
use kvsight_transport::{TlsMaterial, TlsReload, client, server, server_config};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use tokio::sync::mpsc;

const LIMIT: Duration = Duration::from_secs(10);
const ROUTER_NAME: &str = "kvsight-router";

fn der(pem: &str) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
}

/// A router endpoint whose material comes from `dir` (requiring the sidecar name `pinned`, if
/// any) and is reloaded from it; every reload outcome arrives on the returned channel.
fn spawn_router(
    dir: &SecretDir,
    pinned: Option<&str>,
) -> (
    SocketAddr,
    quinn::Endpoint,
    kvsight_process::files::DirWatch,
    mpsc::UnboundedReceiver<TlsReload>,
) {
    let mut material = dir.files().load().unwrap();
    if let Some(name) = pinned {
        material = material.requiring_peer_name(name).unwrap();
    }
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = socket.local_addr().unwrap();
    let endpoint = server(socket, &material).unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let ep = endpoint.clone();
    let watch = dir
        .files()
        .watch(
            &material,
            move |material| {
                ep.set_server_config(Some(server_config(&material)?));
                Ok(())
            },
            move |outcome| {
                let _ = tx.send(outcome.clone());
            },
        )
        .unwrap();
    let accepting = endpoint.clone();
    tokio::spawn(async move {
        while let Some(incoming) = accepting.accept().await {
            tokio::spawn(async move {
                let Ok(conn) = incoming.await else { return };
                // One round trip proves the pod was admitted: in TLS 1.3 the client finishes
                // its handshake before the server has judged the client's certificate.
                if let Ok((mut send, mut recv)) = conn.accept_bi().await
                    && recv.read_to_end(16).await.is_ok()
                {
                    let _ = send.write_all(b"ok").await;
                    let _ = send.finish();
                }
                // Hold the connection until the peer closes it.
                let _ = conn.closed().await;
            });
        }
    });
    (addr, endpoint, watch, rx)
}

/// Connects as a pod with `pod`, makes one round trip, and returns the connection and the
/// router's leaf certificate.
async fn connect(
    pod: &TlsMaterial,
    addr: SocketAddr,
) -> Result<(quinn::Connection, CertificateDer<'static>), String> {
    let endpoint = client("127.0.0.1:0".parse().unwrap(), pod).map_err(|e| e.to_string())?;
    let connecting = endpoint
        .connect(addr, ROUTER_NAME)
        .map_err(|e| e.to_string())?;
    let conn = tokio::time::timeout(LIMIT, connecting)
        .await
        .map_err(|_| "handshake timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let round_trip = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        send.write_all(b"hi").await.map_err(|e| e.to_string())?;
        send.finish().map_err(|e| e.to_string())?;
        recv.read_to_end(16).await.map_err(|e| e.to_string())
    };
    let answer = tokio::time::timeout(LIMIT, round_trip)
        .await
        .map_err(|_| "round trip timed out".to_string())??;
    if answer != b"ok" {
        return Err(format!("unexpected answer {answer:?}"));
    }
    let chain = conn
        .peer_identity()
        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
        .ok_or("no peer certificate")?;
    Ok((conn, chain[0].clone()))
}

/// The next outcome other than `Unchanged` (events for the `..data_tmp` link and the old folder
/// may settle separately from the swap itself).
async fn next_outcome(rx: &mut mpsc::UnboundedReceiver<TlsReload>) -> TlsReload {
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let outcome = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .expect("no reload outcome within the limit")
            .expect("the watcher stopped");
        if outcome != TlsReload::Unchanged {
            return outcome;
        }
    }
}

fn router_leaf(ca: &DevCa) -> IssuedPem {
    ca.issue("router", &[ROUTER_NAME]).unwrap()
}

/// A router serving the first of two leaves of one CA from a Secret-like folder, watched.
struct Router {
    ca: DevCa,
    first: IssuedPem,
    second: IssuedPem,
    dir: SecretDir,
    addr: SocketAddr,
    outcomes: mpsc::UnboundedReceiver<TlsReload>,
    _endpoint: quinn::Endpoint,
    _watch: kvsight_process::files::DirWatch,
}

impl Router {
    fn start(tag: &str) -> Router {
        let ca = DevCa::new("kvsight-test-ca").unwrap();
        let (first, second) = (router_leaf(&ca), router_leaf(&ca));
        let mut dir = SecretDir::new(tag).unwrap();
        dir.publish_leaf(&first, &ca).unwrap();
        let (addr, endpoint, watch, outcomes) = spawn_router(&dir, None);
        Router {
            ca,
            first,
            second,
            dir,
            addr,
            outcomes,
            _endpoint: endpoint,
            _watch: watch,
        }
    }
}

#[tokio::test]
async fn a_renewed_router_certificate_is_used_by_new_handshakes_and_old_connections_stay() {
    let mut r = Router::start("renew");
    let (ca, first, renewed, addr) = (&r.ca, &r.first, &r.second, r.addr);
    let pod = ca.material("pod-a", &["pod-a"]).unwrap();

    let (old_conn, presented) = connect(&pod, addr).await.unwrap();
    assert_eq!(presented, der(&first.cert));

    r.dir.publish_leaf(renewed, ca).unwrap();
    assert_eq!(next_outcome(&mut r.outcomes).await, TlsReload::Applied);
    let (_new_conn, presented) = connect(&pod, addr).await.unwrap();
    assert_eq!(
        presented,
        der(&renewed.cert),
        "a handshake after the swap must present the renewed certificate"
    );
    assert!(
        old_conn.close_reason().is_none(),
        "the connection made before the renewal must carry on: {:?}",
        old_conn.close_reason()
    );
}

#[tokio::test]
async fn files_that_cannot_be_used_are_refused_and_the_material_in_use_stays() {
    let mut r = Router::start("reject");
    let (ca, good, other, addr) = (&r.ca, &r.first, &r.second, r.addr);
    let pod = ca.material("pod-a", &["pod-a"]).unwrap();

    // A certificate with another certificate's key: parseable PEM, unusable pair.
    r.dir.publish(&other.cert, &good.key, &ca.ca_pem()).unwrap();
    let outcome = next_outcome(&mut r.outcomes).await;
    assert!(
        matches!(&outcome, TlsReload::Rejected(why) if why.contains("key")),
        "{outcome:?}"
    );
    // Not PEM at all.
    r.dir
        .publish("not a certificate", &good.key, &ca.ca_pem())
        .unwrap();
    assert!(matches!(
        next_outcome(&mut r.outcomes).await,
        TlsReload::Rejected(_)
    ));
    let (_conn, presented) = connect(&pod, addr).await.unwrap();
    assert_eq!(presented, der(&good.cert), "the material in use must stay");

    // The next good renewal still goes through.
    r.dir.publish_leaf(other, ca).unwrap();
    assert_eq!(next_outcome(&mut r.outcomes).await, TlsReload::Applied);
    let (_conn, presented) = connect(&pod, addr).await.unwrap();
    assert_eq!(presented, der(&other.cert));
}

#[tokio::test]
async fn a_rotated_ca_bundle_changes_which_pods_are_admitted() {
    let (old_ca, new_ca) = (
        DevCa::new("kvsight-old-ca").unwrap(),
        DevCa::new("kvsight-new-ca").unwrap(),
    );
    let first = router_leaf(&old_ca);
    let mut dir = SecretDir::new("rotate").unwrap();
    dir.publish_leaf(&first, &old_ca).unwrap();
    let (addr, _endpoint, _watch, mut outcomes) = spawn_router(&dir, None);
    let old_pod = old_ca.material("pod-old", &["pod-old"]).unwrap();
    let new_pod = new_ca.material("pod-new", &["pod-new"]).unwrap();
    assert!(connect(&old_pod, addr).await.is_ok());
    assert!(connect(&new_pod, addr).await.is_err());

    // The router moves to the new CA: its own leaf and the bundle pods must chain to.
    let renewed = router_leaf(&new_ca);
    dir.publish_leaf(&renewed, &new_ca).unwrap();
    assert_eq!(next_outcome(&mut outcomes).await, TlsReload::Applied);
    let (_conn, presented) = connect(&new_pod, addr)
        .await
        .expect("a pod of the new CA must be admitted after the rotation");
    assert_eq!(presented, der(&renewed.cert));
    // A pod still holding an old-CA certificate, though it trusts the router's new one: only
    // the router's new bundle can turn it away.
    let stale = old_ca.issue("pod-stale", &["pod-stale"]).unwrap();
    let stale_pod = TlsMaterial::from_pem(
        stale.cert.as_bytes(),
        stale.key.as_bytes(),
        new_ca.ca_pem().as_bytes(),
    )
    .unwrap();
    assert!(
        connect(&stale_pod, addr).await.is_err(),
        "a pod certificate of the old CA must no longer be admitted"
    );
    assert!(connect(&old_pod, addr).await.is_err());
}

#[tokio::test]
async fn a_renewal_that_landed_before_the_watch_started_is_applied_at_once() {
    let ca = DevCa::new("kvsight-test-ca").unwrap();
    let (first, renewed) = (router_leaf(&ca), router_leaf(&ca));
    let mut dir = SecretDir::new("early").unwrap();
    dir.publish_leaf(&first, &ca).unwrap();
    // Loaded at process start...
    let in_use = dir.files().load().unwrap();
    // ...renewed while the process was still starting (no watch yet)...
    dir.publish_leaf(&renewed, &ca).unwrap();
    // ...and the watch, when it starts, compares the files with what is in use.
    let (tx, mut outcomes) = mpsc::unbounded_channel();
    let _watch = dir
        .files()
        .watch(
            &in_use,
            |_| Ok(()),
            move |o| {
                let _ = tx.send(o.clone());
            },
        )
        .unwrap();
    let first_look = tokio::time::timeout(LIMIT, outcomes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first_look, TlsReload::Applied);
}

#[tokio::test]
async fn a_pinned_sidecar_name_stays_pinned_across_renewals() {
    let ca = DevCa::new("shared-ca").unwrap();
    let (first, renewed) = (router_leaf(&ca), router_leaf(&ca));
    let mut dir = SecretDir::new("pinned").unwrap();
    dir.publish_leaf(&first, &ca).unwrap();
    let (addr, _endpoint, _watch, mut outcomes) = spawn_router(&dir, Some("kvsight-sidecar.llm"));
    let sidecar = ca.material("sidecar", &["kvsight-sidecar.llm"]).unwrap();
    let other = ca.material("billing", &["billing.payments"]).unwrap();
    assert!(connect(&sidecar, addr).await.is_ok());
    assert!(connect(&other, addr).await.is_err());

    dir.publish_leaf(&renewed, &ca).unwrap();
    assert_eq!(next_outcome(&mut outcomes).await, TlsReload::Applied);
    let (_conn, presented) = connect(&sidecar, addr).await.unwrap();
    assert_eq!(presented, der(&renewed.cert));
    assert!(
        connect(&other, addr).await.is_err(),
        "the renewed material must keep the pinned sidecar name"
    );
}
