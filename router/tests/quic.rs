//! The QUIC listener with a test sidecar (kvsight-transport client + dev CA) against a running
//! router (`serve` on loopback): registration, load, snapshot and delta (with a resync on a gap),
//! in-flight reports, version refusal, a rogue certificate never registered, and the shutdown
//! close.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvsight_protocol::bloom::{CountingFilter, FilterParams};
use kvsight_protocol::messages::*;
use kvsight_router::config::RouterConfig;
use kvsight_router::{Listeners, RunConfig, State, build_state, serve};
use kvsight_transport::dev_certs::{DevCa, SecretDir};
use kvsight_transport::{FramedRecv, FramedSend, TlsFiles, TlsMaterial, client};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use tokio_util::sync::CancellationToken;

use common::*;

struct Running {
    state: Arc<State>,
    quic: SocketAddr,
    http: SocketAddr,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), kvsight_router::RunError>>,
}

/// The URI SAN granting a sidecar certificate every pod name of the tests' namespace.
const POD_GRANT: &str = "kvsight://pod/ns/*";

async fn start(ca: &DevCa) -> Running {
    start_with(ca, None).await
}

async fn start_with(
    ca: &DevCa,
    tokenizer_loader: Option<kvsight_router::tokenize::TokenizerLoader>,
) -> Running {
    let tls = ca.material("router", &["kvsight-router"]).unwrap();
    start_run(tls, None, tokenizer_loader).await
}

async fn start_run(
    tls: TlsMaterial,
    tls_files: Option<TlsFiles>,
    tokenizer_loader: Option<kvsight_router::tokenize::TokenizerLoader>,
) -> Running {
    start_config(tls, tls_files, tokenizer_loader, RouterConfig::default()).await
}

async fn start_config(
    tls: TlsMaterial,
    tls_files: Option<TlsFiles>,
    tokenizer_loader: Option<kvsight_router::tokenize::TokenizerLoader>,
    config: RouterConfig,
) -> Running {
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let quic = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let (http_addr, quic_addr) = (http.local_addr().unwrap(), quic.local_addr().unwrap());
    let cfg = RunConfig {
        config,
        config_path: None,
        tls,
        tls_files,
        router_id: "r1".into(),
        ready_delay: Duration::ZERO,
        grace: Duration::from_secs(2),
        tokenizer_loader,
        decision_header: false,
    };
    let shutdown = CancellationToken::new();
    let state = build_state(&cfg, &shutdown).unwrap();
    let task = tokio::spawn(serve(
        Listeners {
            http,
            quic,
            admin: None,
        },
        cfg,
        state.clone(),
        shutdown.clone(),
    ));
    Running {
        state,
        quic: quic_addr,
        http: http_addr,
        shutdown,
        task,
    }
}

struct Sidecar {
    conn: quinn::Connection,
    send: FramedSend,
    recv: FramedRecv,
    _endpoint: quinn::Endpoint,
}

async fn connect(tls: &TlsMaterial, addr: SocketAddr) -> anyhow::Result<Sidecar> {
    let endpoint = client("127.0.0.1:0".parse()?, tls)?;
    let conn = endpoint.connect(addr, "kvsight-router")?.await?;
    let (send, recv) = conn.open_bi().await?;
    Ok(Sidecar {
        conn,
        send: FramedSend::new(send),
        recv: FramedRecv::new(recv),
        _endpoint: endpoint,
    })
}

impl Sidecar {
    async fn next(&mut self) -> RouterMessage {
        tokio::time::timeout(Duration::from_secs(5), self.recv.recv::<RouterMessage>())
            .await
            .expect("router message within 5 s")
            .unwrap()
            .expect("stream open")
    }

    /// The next message that is not a periodic `Inflight`.
    async fn next_not_inflight(&mut self) -> RouterMessage {
        for _ in 0..200 {
            match self.next().await {
                RouterMessage::Inflight(_) => continue,
                m => return m,
            }
        }
        panic!("only Inflight messages");
    }
}

fn fast_hello(name: &str) -> Hello {
    let mut h = hello(name, "http://127.0.0.1:9", &[]);
    h.load_interval_ms = 50;
    h
}

/// Polls `cond` (bounded: 500 × 10 ms) — the registry has no change notification.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test]
async fn a_sidecar_registers_reports_and_leaves() {
    let ca = DevCa::new("kvsight-test-ca").unwrap();
    let r = start(&ca).await;
    let pod_tls = ca.material("pod-a", &["pod-a", POD_GRANT]).unwrap();
    let mut sc = connect(&pod_tls, r.quic).await.unwrap();
    sc.send
        .send(&SidecarMessage::Hello(fast_hello("a")))
        .await
        .unwrap();
    match sc.next().await {
        RouterMessage::Welcome(w) => {
            assert_eq!(w.protocol_version, PROTOCOL_VERSION);
            assert_eq!(w.router_id, "r1");
        }
        m => panic!("expected Welcome, got {m:?}"),
    }
    let st = r.state.clone();
    eventually("registration", || st.registry().get("ns/a").is_some()).await;

    sc.send
        .send(&SidecarMessage::Load(load(Phase::Ready, 2, 1)))
        .await
        .unwrap();
    let mut f = CountingFilter::new(FilterParams::for_capacity(1000, 0.01)).unwrap();
    f.insert(42);
    sc.send
        .send(&SidecarMessage::CacheSnapshot(f.snapshot()))
        .await
        .unwrap();
    f.insert(43);
    let delta = f.take_delta().expect("a change makes a delta");
    sc.send
        .send(&SidecarMessage::CacheDelta(delta))
        .await
        .unwrap();
    eventually("load and filter", || {
        st.registry().get("ns/a").is_some_and(|p| {
            p.phase() == Phase::Ready
                && p.filter
                    .as_ref()
                    .is_some_and(|fl| fl.contains(42) && fl.contains(43))
        })
    })
    .await;

    // The router reports its in-flight count for the pod, periodically.
    match sc.next().await {
        RouterMessage::Inflight(i) => assert_eq!(i.requests, 0),
        m => panic!("expected Inflight, got {m:?}"),
    }

    // A delta that does not follow the filter's version: the router asks for a snapshot.
    let gap = CacheDelta {
        base_version: 1000,
        version: 1001,
        resident_blocks: 1,
        toggles: vec![1],
        age_ms: None,
    };
    sc.send
        .send(&SidecarMessage::CacheDelta(gap))
        .await
        .unwrap();
    assert_eq!(sc.next_not_inflight().await, RouterMessage::ResyncRequest);

    sc.send
        .send(&SidecarMessage::Goodbye(Goodbye {
            reason: CloseReason::Drained,
            message: "bye".into(),
        }))
        .await
        .unwrap();
    eventually("unregistration", || st.registry().get("ns/a").is_none()).await;
    r.shutdown.cancel();
    r.task.await.unwrap().unwrap();
}

impl Sidecar {
    /// The router's leaf certificate on this connection.
    fn router_cert(&self) -> CertificateDer<'static> {
        let chain = self
            .conn
            .peer_identity()
            .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
            .expect("the router presented a certificate");
        chain[0].clone()
    }

    /// Hello, and the answer is Welcome.
    async fn register(&mut self, name: &str) {
        self.send
            .send(&SidecarMessage::Hello(fast_hello(name)))
            .await
            .unwrap();
        let m = self.next().await;
        assert!(matches!(m, RouterMessage::Welcome(_)), "{m:?}");
    }
}

#[tokio::test]
async fn a_renewed_router_certificate_reaches_new_sidecars_without_a_restart() {
    let ca = DevCa::new("kvsight-test-ca").unwrap();
    let leaf = || ca.issue("router", &["kvsight-router"]).unwrap();
    let (first, renewed) = (leaf(), leaf());
    let mut dir = SecretDir::new("router-renew").unwrap();
    dir.publish_leaf(&first, &ca).unwrap();
    let r = start_run(dir.files().load().unwrap(), Some(dir.files()), None).await;
    let pod_tls = ca.material("pod-a", &["pod-a", POD_GRANT]).unwrap();
    let mut a = connect(&pod_tls, r.quic).await.unwrap();
    a.register("a").await;
    assert_eq!(
        a.router_cert(),
        CertificateDer::from_pem_slice(first.cert.as_bytes()).unwrap()
    );

    dir.publish_leaf(&renewed, &ca).unwrap();
    let applied = || {
        r.state
            .metrics
            .tls_reloads
            .get_or_create(&vec![("outcome", "applied".to_owned())])
            .get()
    };
    eventually("the renewal to be applied", || applied() == 1).await;
    let mut b = connect(&pod_tls, r.quic).await.unwrap();
    b.register("b").await;
    assert_eq!(
        b.router_cert(),
        CertificateDer::from_pem_slice(renewed.cert.as_bytes()).unwrap(),
        "a sidecar connecting after the renewal must see the renewed certificate"
    );
    assert!(
        a.conn.close_reason().is_none(),
        "the first pod's connection must carry on"
    );
    eventually("both pods registered", || r.state.registry().len() == 2).await;
    r.shutdown.cancel();
    r.task.await.unwrap().unwrap();
}

#[tokio::test]
async fn another_protocol_version_is_refused_naming_both() {
    let ca = DevCa::new("kvsight-test-ca").unwrap();
    let r = start(&ca).await;
    let mut sc = connect(
        &ca.material("pod-a", &["pod-a", POD_GRANT]).unwrap(),
        r.quic,
    )
    .await
    .unwrap();
    let mut h = fast_hello("a");
    h.protocol_version = PROTOCOL_VERSION + 98;
    sc.send.send(&SidecarMessage::Hello(h)).await.unwrap();
    match sc.next().await {
        RouterMessage::Refused(refused) => {
            let theirs = (PROTOCOL_VERSION + 98).to_string();
            assert!(refused.reason.contains(&theirs), "{}", refused.reason);
            assert!(
                refused
                    .reason
                    .contains(&format!("version {PROTOCOL_VERSION}")),
                "{}",
                refused.reason
            );
        }
        m => panic!("expected Refused, got {m:?}"),
    }
    assert!(r.state.registry().is_empty());
    r.shutdown.cancel();
    r.task.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_pod_with_a_rogue_certificate_is_never_registered_nor_sent_requests() {
    let ca = DevCa::new("kvsight-test-ca").unwrap();
    let rogue = DevCa::new("rogue-ca").unwrap();
    let r = start(&ca).await;
    // The rogue pod trusts the real CA (so it would accept the router) but its own certificate
    // is signed by another CA.
    let leaf = rogue.issue("pod-x", &["pod-x"]).unwrap();
    let tls = TlsMaterial::from_pem(
        leaf.cert.as_bytes(),
        leaf.key.as_bytes(),
        ca.ca_pem().as_bytes(),
    )
    .unwrap();
    let attempt = async {
        let mut sc = connect(&tls, r.quic).await?;
        sc.send
            .send(&SidecarMessage::Hello(fast_hello("x")))
            .await?;
        let m = sc.recv.recv::<RouterMessage>().await?;
        anyhow::Ok(m)
    };
    let outcome = tokio::time::timeout(Duration::from_secs(10), attempt)
        .await
        .expect("the attempt ends within 10 s");
    assert!(
        !matches!(outcome, Ok(Some(RouterMessage::Welcome(_)))),
        "rogue pod welcomed: {outcome:?}"
    );
    assert!(r.state.registry().is_empty());
    // And so a request for its model finds no pod.
    let resp = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(format!("http://{}/v1/completions", r.http))
        .body(r#"{"model":"m","prompt":"x"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    r.shutdown.cancel();
    r.task.await.unwrap().unwrap();
}

#[tokio::test]
async fn shutdown_says_goodbye_and_closes_with_the_shutdown_code() {
    let ca = DevCa::new("kvsight-test-ca").unwrap();
    let r = start(&ca).await;
    let mut sc = connect(
        &ca.material("pod-a", &["pod-a", POD_GRANT]).unwrap(),
        r.quic,
    )
    .await
    .unwrap();
    sc.send
        .send(&SidecarMessage::Hello(fast_hello("a")))
        .await
        .unwrap();
    assert!(matches!(sc.next().await, RouterMessage::Welcome(_)));
    r.shutdown.cancel();
    match sc.next_not_inflight().await {
        RouterMessage::Goodbye(g) => assert_eq!(g.reason, CloseReason::Shutdown),
        m => panic!("expected Goodbye, got {m:?}"),
    }
    let closed = tokio::time::timeout(Duration::from_secs(5), sc.conn.closed())
        .await
        .unwrap();
    match closed {
        quinn::ConnectionError::ApplicationClosed(c) => {
            assert_eq!(
                u64::from(c.error_code),
                u64::from(CloseReason::Shutdown.code())
            );
        }
        e => panic!("expected an application close, got {e:?}"),
    }
    r.task.await.unwrap().unwrap();
    assert!(r.state.is_draining());
}

#[tokio::test]
async fn shutdown_lets_an_in_flight_stream_finish_and_refuses_new_requests() {
    use axum::body::{Body, Bytes};
    let ca = DevCa::new("kvsight-test-ca").unwrap();
    let r = start(&ca).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    let rx = Arc::new(std::sync::Mutex::new(Some(rx)));
    let pod = axum::Router::new().route(
        "/v1/completions",
        axum::routing::post(move || {
            let rx = rx.lock().unwrap().take().unwrap();
            async move {
                axum::response::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(
                        tokio_stream::wrappers::ReceiverStream::new(rx),
                    ))
                    .unwrap()
            }
        }),
    );
    let pod_url = format!("http://{}", common::serve(pod).await);
    add_pod(&r.state, "a", &pod_url, &[], 0);
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let mut resp = http
        .post(format!("http://{}/v1/completions", r.http))
        .body(r#"{"model":"m","prompt":"x","stream":true}"#)
        .send()
        .await
        .unwrap();
    tx.send(Ok(Bytes::from_static(b"data: {\"a\":1}\n\n")))
        .await
        .unwrap();
    assert!(resp.chunk().await.unwrap().is_some());

    r.shutdown.cancel();
    eventually("drain begins", || r.state.is_draining()).await;
    // The stream still runs to its natural end.
    tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n")))
        .await
        .unwrap();
    drop(tx);
    let rest = tokio::time::timeout(Duration::from_secs(5), resp.text())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rest, "data: [DONE]\n\n");
    tokio::time::timeout(Duration::from_secs(5), r.task)
        .await
        .expect("run returns once the stream ended, before the grace period")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn the_router_fetches_a_missing_tokenizer_from_the_sidecar() {
    let Some(dir) = kvsight_harness::or_skip(
        "the_router_fetches_a_missing_tokenizer_from_the_sidecar",
        kvsight_sim::own_tokenizer::ensure_dir(),
    ) else {
        return;
    };
    let files = kvsight_process::tokenizer_dir::read(&dir).unwrap();
    let ca = DevCa::new("kvsight-test-ca").unwrap();
    let r = start_with(&ca, Some(kvsight_router::tokenize::default_loader())).await;
    let mut sc = connect(
        &ca.material("pod-a", &["pod-a", POD_GRANT]).unwrap(),
        r.quic,
    )
    .await
    .unwrap();
    let mut h = fast_hello("a");
    h.tokenizer = Some(TokenizerInfo {
        digest: files.digest(),
        total_bytes: files.total_bytes(),
    });
    sc.send.send(&SidecarMessage::Hello(h)).await.unwrap();
    assert!(matches!(sc.next().await, RouterMessage::Welcome(_)));
    match sc.next_not_inflight().await {
        RouterMessage::TokenizerRequest(req) => assert_eq!(req.model, MODEL),
        m => panic!("expected TokenizerRequest, got {m:?}"),
    }
    assert!(!r.state.tokenizers.has(MODEL, None));
    for chunk in files.chunks(MODEL) {
        sc.send
            .send(&SidecarMessage::TokenizerChunk(chunk))
            .await
            .unwrap();
    }
    let st = r.state.clone();
    let digest = files.digest();
    eventually("tokenizer installed", || {
        st.tokenizers.has(MODEL, Some(&digest))
    })
    .await;
    r.shutdown.cancel();
    r.task.await.unwrap().unwrap();
}

/// The closing code of a connection the router closed.
async fn close_code(sc: &Sidecar) -> Option<u64> {
    let err = tokio::time::timeout(Duration::from_secs(5), sc.conn.closed())
        .await
        .expect("the router closes the connection within 5 s");
    match err {
        quinn::ConnectionError::ApplicationClosed(c) => Some(c.error_code.into_inner()),
        other => panic!("closed by {other:?}"),
    }
}

/// A `Load` with a NaN KV use would make every threshold comparison false (never saturated),
/// so the decoder refuses it: that one connection is closed as a protocol violation, its pod
/// leaves, and the router and the other pods carry on.
#[tokio::test]
async fn a_load_with_nan_kv_usage_closes_that_connection_only() {
    let ca = DevCa::new("kvsight-test-ca").unwrap();
    let r = start(&ca).await;
    let tls = ca.material("pod", &["pod", POD_GRANT]).unwrap();
    let mut good = connect(&tls, r.quic).await.unwrap();
    good.register("good").await;
    let mut bad = connect(&tls, r.quic).await.unwrap();
    bad.register("bad").await;
    let st = r.state.clone();
    eventually("both registered", || st.registry().len() == 2).await;

    bad.send
        .send(&SidecarMessage::Load(Load {
            kv_usage: f32::NAN,
            ..load(Phase::Ready, 0, 0)
        }))
        .await
        .unwrap();
    assert_eq!(
        close_code(&bad).await,
        Some(CloseReason::ProtocolViolation.code().into())
    );
    eventually("the bad pod leaves", || {
        st.registry().get("ns/bad").is_none()
    })
    .await;

    // The other connection still works: its next report is applied.
    good.send
        .send(&SidecarMessage::Load(load(Phase::Ready, 3, 0)))
        .await
        .unwrap();
    eventually("the good pod's report", || {
        st.registry()
            .get("ns/good")
            .and_then(|p| p.load.as_ref().map(|l| l.load.running))
            == Some(3)
    })
    .await;
    r.shutdown.cancel();
    r.task.await.unwrap().unwrap();
}

/// A valid certificate proves a sidecar, not where its pod is: a Hello advertising another
/// host than the connection's address (peer 127.0.0.1, URL on 127.0.0.2 — both loopback) is
/// refused, counted and never registered, unless the config allows that host.
#[tokio::test]
async fn a_sidecar_advertising_another_host_than_its_own_is_refused() {
    let ca = DevCa::new("kvsight-test-ca").unwrap();
    let router_tls = ca.material("router", &["kvsight-router"]).unwrap();
    let r = start_run(router_tls, None, None).await;
    let tls = ca.material("pod", &["pod", POD_GRANT]).unwrap();
    for url in [
        "http://127.0.0.2:8000",
        "http://[::2]:8000",
        "not a url",
        "file:///etc/passwd",
    ] {
        let mut sc = connect(&tls, r.quic).await.unwrap();
        let hello = Hello {
            pod: PodIdentity {
                url: url.into(),
                ..fast_hello("thief").pod
            },
            ..fast_hello("thief")
        };
        sc.send.send(&SidecarMessage::Hello(hello)).await.unwrap();
        match sc.next().await {
            RouterMessage::Refused(why) => {
                assert!(why.reason.contains("advertised pod URL"), "{}", why.reason)
            }
            m => panic!("{url}: expected Refused, got {m:?}"),
        }
        assert_eq!(
            close_code(&sc).await,
            Some(CloseReason::ProtocolViolation.code().into())
        );
    }
    assert!(r.state.registry().is_empty());
    let metrics = r
        .state
        .metrics
        .render(&r.state.registry(), &[], std::time::Instant::now());
    assert!(
        metrics.contains("kvsight_router_sidecars_refused_total{reason=\"advertised_url\"} 4"),
        "{metrics}"
    );
    // Its own address, by IP or by a name resolving to it, is welcome.
    for url in ["http://127.0.0.1:8000", "http://localhost:8000"] {
        let mut sc = connect(&tls, r.quic).await.unwrap();
        let hello = Hello {
            pod: PodIdentity {
                url: url.into(),
                ..fast_hello("own").pod
            },
            ..fast_hello("own")
        };
        sc.send.send(&SidecarMessage::Hello(hello)).await.unwrap();
        let m = sc.next().await;
        assert!(matches!(m, RouterMessage::Welcome(_)), "{url}: {m:?}");
    }
    r.shutdown.cancel();
    r.task.await.unwrap().unwrap();

    // Allowed explicitly: welcome.
    let router_tls = ca.material("router", &["kvsight-router"]).unwrap();
    let config = RouterConfig::from_yaml("pods: {allowAdvertisedHosts: [127.0.0.2]}").unwrap();
    let r = start_config(router_tls, None, None, config).await;
    let mut sc = connect(&tls, r.quic).await.unwrap();
    let hello = Hello {
        pod: PodIdentity {
            url: "http://127.0.0.2:8000".into(),
            ..fast_hello("nat").pod
        },
        ..fast_hello("nat")
    };
    sc.send.send(&SidecarMessage::Hello(hello)).await.unwrap();
    let m = sc.next().await;
    assert!(matches!(m, RouterMessage::Welcome(_)), "{m:?}");
    r.shutdown.cancel();
    r.task.await.unwrap().unwrap();
}
