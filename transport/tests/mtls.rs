//! Real QUIC over loopback: mutual TLS admits only peers with a certificate from the CA, and a
//! peer sending garbage loses its own connection while the endpoint carries on.

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use kvsight_protocol::messages::*;
use kvsight_transport::dev_certs::DevCa;
use kvsight_transport::{FramedRecv, FramedSend, TlsMaterial, TransportError, client, server};

const LIMIT: Duration = Duration::from_secs(10);

fn welcome() -> RouterMessage {
    RouterMessage::Welcome(Welcome {
        protocol_version: PROTOCOL_VERSION,
        router_id: "router-0".into(),
    })
}

fn hello_frame() -> SidecarMessage {
    SidecarMessage::Goodbye(Goodbye {
        reason: CloseReason::Shutdown,
        message: "hi".into(),
    })
}

/// A router endpoint that answers each stream's first message with `Welcome`, and reports what
/// it saw on each connection.
fn spawn_router(
    tls: &TlsMaterial,
) -> (
    SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<Result<SidecarMessage, String>>,
) {
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = socket.local_addr().unwrap();
    let endpoint = server(socket, tls).unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(incoming) = endpoint.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let conn = match incoming.await {
                    Ok(c) => c,
                    Err(e) => return tx.send(Err(format!("handshake: {e}"))).unwrap_or(()),
                };
                let Ok((send, recv)) = conn.accept_bi().await else {
                    return;
                };
                let (mut send, mut recv) = (FramedSend::new(send), FramedRecv::new(recv));
                match recv.recv::<SidecarMessage>().await {
                    Ok(Some(m)) => {
                        send.send(&welcome()).await.unwrap();
                        let _ = tx.send(Ok(m));
                        // Keep the connection until the peer closes it.
                        let _ = conn.closed().await;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        let _ = tx.send(Err(format!("frame: {e}")));
                        conn.close(CloseReason::ProtocolViolation.code().into(), b"bad frame");
                    }
                }
            });
        }
    });
    (addr, rx)
}

async fn talk(
    tls: &TlsMaterial,
    addr: SocketAddr,
    name: &str,
) -> Result<RouterMessage, TransportError> {
    let endpoint = client("127.0.0.1:0".parse().unwrap(), tls)?;
    let conn = endpoint.connect(addr, name)?.await?;
    let (send, recv) = conn.open_bi().await?;
    let (mut send, mut recv) = (FramedSend::new(send), FramedRecv::new(recv));
    send.send(&hello_frame()).await?;
    let reply = recv
        .recv::<RouterMessage>()
        .await?
        .ok_or(TransportError::StreamClosed)?;
    conn.close(0u32.into(), b"done");
    Ok(reply)
}

/// `pod` gets no answer, and the router saw a failed handshake (not a bad frame).
async fn assert_refused_at_handshake(
    pod: &TlsMaterial,
    addr: SocketAddr,
    seen: &mut tokio::sync::mpsc::UnboundedReceiver<Result<SidecarMessage, String>>,
) {
    let result = tokio::time::timeout(LIMIT, talk(pod, addr, "kvsight-router"))
        .await
        .unwrap();
    assert!(result.is_err(), "a refused pod got {result:?}");
    let event = tokio::time::timeout(LIMIT, seen.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(&event, Err(e) if e.starts_with("handshake")),
        "{event:?}"
    );
}

#[tokio::test]
async fn certificates_from_the_ca_are_admitted() {
    let ca = DevCa::new("kvsight-test-ca").unwrap();
    let (addr, mut seen) = spawn_router(
        &ca.material("router", &["kvsight-router", "127.0.0.1"])
            .unwrap(),
    );
    let pod = ca.material("pod-a", &["pod-a"]).unwrap();
    let reply = tokio::time::timeout(LIMIT, talk(&pod, addr, "kvsight-router"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply, welcome());
    assert_eq!(seen.recv().await.unwrap().unwrap(), hello_frame());
}

#[tokio::test]
async fn a_pod_certificate_from_another_ca_never_gets_a_stream() {
    let ca = DevCa::new("kvsight-test-ca").unwrap();
    let rogue = DevCa::new("rogue-ca").unwrap();
    let (addr, mut seen) = spawn_router(&ca.material("router", &["kvsight-router"]).unwrap());
    // The rogue pod trusts the real CA (so it accepts the router) but its own cert is rogue.
    let leaf = rogue.issue("pod-x", &["pod-x"]).unwrap();
    let pod = TlsMaterial::from_pem(
        leaf.cert.as_bytes(),
        leaf.key.as_bytes(),
        ca.ca_pem().as_bytes(),
    )
    .unwrap();
    assert_refused_at_handshake(&pod, addr, &mut seen).await;
}

#[tokio::test]
async fn a_router_certificate_from_another_ca_is_refused_by_the_pod() {
    let ca = DevCa::new("kvsight-test-ca").unwrap();
    let rogue = DevCa::new("rogue-ca").unwrap();
    let leaf = rogue.issue("router", &["kvsight-router"]).unwrap();
    let rogue_router = TlsMaterial::from_pem(
        leaf.cert.as_bytes(),
        leaf.key.as_bytes(),
        ca.ca_pem().as_bytes(),
    )
    .unwrap();
    let (addr, _seen) = spawn_router(&rogue_router);
    let pod = ca.material("pod-a", &["pod-a"]).unwrap();
    let result = tokio::time::timeout(LIMIT, talk(&pod, addr, "kvsight-router"))
        .await
        .unwrap();
    assert!(
        matches!(result, Err(TransportError::Connection(_))),
        "{result:?}"
    );
    // And the right CA but the wrong name is refused too.
    let (addr, _seen) = spawn_router(&ca.material("router", &["kvsight-router"]).unwrap());
    let result = tokio::time::timeout(LIMIT, talk(&pod, addr, "someone-else"))
        .await
        .unwrap();
    assert!(
        matches!(result, Err(TransportError::Connection(_))),
        "{result:?}"
    );
}

#[tokio::test]
async fn garbage_closes_one_connection_and_the_endpoint_carries_on() {
    let ca = DevCa::new("kvsight-test-ca").unwrap();
    let (addr, mut seen) = spawn_router(&ca.material("router", &["kvsight-router"]).unwrap());
    let pod = ca.material("pod-a", &["pod-a"]).unwrap();
    let endpoint = client("127.0.0.1:0".parse().unwrap(), &pod).unwrap();
    let conn = endpoint
        .connect(addr, "kvsight-router")
        .unwrap()
        .await
        .unwrap();
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    send.write_all(&[0, 0, 0, 3, 0xff, 0xff, 0xff])
        .await
        .unwrap();
    let event = tokio::time::timeout(LIMIT, seen.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(&event, Err(e) if e.starts_with("frame")),
        "{event:?}"
    );
    let reason = tokio::time::timeout(LIMIT, conn.closed()).await.unwrap();
    assert!(
        matches!(&reason, quinn::ConnectionError::ApplicationClosed(c) if u64::from(c.error_code) == u64::from(CloseReason::ProtocolViolation.code())),
        "{reason:?}"
    );
    // A well-behaved pod still gets in.
    let reply = tokio::time::timeout(LIMIT, talk(&pod, addr, "kvsight-router"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply, welcome());
}

#[tokio::test]
async fn with_a_pinned_name_a_certificate_of_the_same_ca_for_another_name_is_refused() {
    // One CA that also signs other workloads' certificates (a shared ClusterIssuer).
    let ca = DevCa::new("shared-ca").unwrap();
    let router = ca
        .material("router", &["kvsight-router"])
        .unwrap()
        .requiring_peer_name("kvsight-sidecar.llm")
        .unwrap();
    let (addr, mut seen) = spawn_router(&router);
    let sidecar = ca.material("sidecar", &["kvsight-sidecar.llm"]).unwrap();
    let reply = tokio::time::timeout(LIMIT, talk(&sidecar, addr, "kvsight-router"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply, welcome());
    assert_eq!(seen.recv().await.unwrap().unwrap(), hello_frame());

    let other = ca.material("billing", &["billing.payments"]).unwrap();
    assert_refused_at_handshake(&other, addr, &mut seen).await;
}

#[test]
fn a_pinned_name_that_is_not_a_dns_name_is_a_configuration_error() {
    let ca = DevCa::new("ca").unwrap();
    let err = ca
        .material("router", &["kvsight-router"])
        .unwrap()
        .requiring_peer_name("not a name!")
        .unwrap_err();
    assert!(err.to_string().contains("peer name"), "{err}");
}
