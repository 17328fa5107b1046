//! What a sidecar certificate lets its holder do, over real QUIC with mutual TLS against the
//! router's `serve`: register only the pod names its URI SANs grant, never take a live name
//! from another certificate, have a tokenizer taken only when the router asked for it for a
//! model the pod serves (never over a configured one), keep a connection no longer than the
//! certificate is valid, stay within the caps on connections and pods, and send no oversized
//! `Hello`.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;

use common::*;
use kvsight_protocol::messages::*;
use kvsight_protocol::tokenizer_transfer::TokenizerFiles;
use kvsight_router::config::RouterConfig;
use kvsight_router::{Listeners, RunConfig, State, build_state, serve};
use kvsight_transport::dev_certs::DevCa;
use kvsight_transport::{FramedRecv, FramedSend, TlsMaterial, client, pod_uri};

struct Running {
    state: Arc<State>,
    quic: SocketAddr,
    _stop: tokio_util::sync::DropGuard,
}

async fn start(ca: &DevCa, yaml: &str, configured: Option<&std::path::Path>) -> Running {
    let mut config = if yaml.is_empty() {
        RouterConfig::default()
    } else {
        RouterConfig::from_yaml(yaml).unwrap()
    };
    if let Some(dir) = configured {
        config.tokenizers.insert(MODEL.into(), dir.to_owned());
    }
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let quic = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let quic_addr = quic.local_addr().unwrap();
    let cfg = RunConfig {
        config,
        config_path: None,
        tls: ca.material("router", &["kvsight-router"]).unwrap(),
        tls_files: None,
        router_id: "r".into(),
        ready_delay: Duration::ZERO,
        grace: Duration::from_secs(1),
        tokenizer_loader: Some(kvsight_router::tokenize::default_loader()),
        decision_header: false,
    };
    let stop = CancellationToken::new();
    let state = build_state(&cfg, &stop).unwrap();
    let listeners = Listeners {
        http,
        quic,
        admin: None,
    };
    tokio::spawn(serve(listeners, cfg, state.clone(), stop.clone()));
    Running {
        state,
        quic: quic_addr,
        _stop: stop.drop_guard(),
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
        tokio::time::timeout(Duration::from_secs(10), self.recv.recv::<RouterMessage>())
            .await
            .expect("a message in time")
            .expect("a frame")
            .expect("the stream is open")
    }

    /// Says Hello for pod `name` (namespace `ns`) and returns the answer.
    async fn hello(&mut self, hello: Hello) -> RouterMessage {
        self.send.send(&SidecarMessage::Hello(hello)).await.unwrap();
        self.next().await
    }
}

fn hello_for(name: &str) -> Hello {
    let mut h = hello(name, "http://127.0.0.1:9", &[]);
    h.load_interval_ms = 50;
    h
}

fn metric(st: &State, series: &str) -> f64 {
    let text = st.metrics.render(&st.registry(), &[], Instant::now());
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn refused(st: &State, reason: &str) -> f64 {
    metric(
        st,
        &format!("kvsight_router_sidecars_refused_total{{reason=\"{reason}\"}}"),
    )
}

#[tokio::test]
async fn a_sidecar_registers_only_the_pod_names_its_certificate_grants() {
    let ca = DevCa::new("ca").unwrap();
    let r = start(&ca, "", None).await;
    let grant_a = pod_uri("ns", "a");
    let tls = ca.material("pod-a", &["pod-a", &grant_a]).unwrap();
    let mut thief = connect(&tls, r.quic).await.unwrap();
    let m = thief.hello(hello_for("b")).await;
    assert!(
        matches!(&m, RouterMessage::Refused(x) if x.reason.contains("does not grant")),
        "{m:?}"
    );
    assert!(r.state.registry().get("ns/b").is_none());
    assert_eq!(refused(&r.state, "identity"), 1.0);
    // Without any grant, nothing registers.
    let bare = ca.material("bare", &["bare"]).unwrap();
    let mut nobody = connect(&bare, r.quic).await.unwrap();
    assert!(matches!(
        nobody.hello(hello_for("a")).await,
        RouterMessage::Refused(_)
    ));
    assert_eq!(refused(&r.state, "identity"), 2.0);
    let mut own = connect(&tls, r.quic).await.unwrap();
    assert!(matches!(
        own.hello(hello_for("a")).await,
        RouterMessage::Welcome(_)
    ));
}

#[tokio::test]
async fn a_live_name_held_by_another_certificate_is_refused_and_counted() {
    let ca = DevCa::new("ca").unwrap();
    let r = start(&ca, "", None).await;
    let grant = pod_uri("ns", "*");
    let first = ca.material("one", &["one", &grant]).unwrap();
    let other = ca.material("two", &["two", &grant]).unwrap();
    let mut a = connect(&first, r.quic).await.unwrap();
    assert!(matches!(
        a.hello(hello_for("a")).await,
        RouterMessage::Welcome(_)
    ));
    let conn = r.state.registry().get("ns/a").unwrap().conn;
    let mut b = connect(&other, r.quic).await.unwrap();
    let m = b.hello(hello_for("a")).await;
    assert!(
        matches!(&m, RouterMessage::Refused(x) if x.reason.contains("another certificate")),
        "{m:?}"
    );
    assert_eq!(refused(&r.state, "name_taken"), 1.0);
    assert_eq!(r.state.registry().get("ns/a").unwrap().conn, conn);
    // The same certificate reconnecting takes its own name over.
    let mut again = connect(&first, r.quic).await.unwrap();
    assert!(matches!(
        again.hello(hello_for("a")).await,
        RouterMessage::Welcome(_)
    ));
    // Once no connection holds it, another certificate may register it.
    drop((a, again));
    let st = r.state.clone();
    until("the name to be released", || {
        st.registry().get("ns/a").is_none()
    })
    .await;
    let mut c = connect(&other, r.quic).await.unwrap();
    assert!(matches!(
        c.hello(hello_for("a")).await,
        RouterMessage::Welcome(_)
    ));
}

#[tokio::test]
async fn identity_any_accepts_certificates_without_grants() {
    let ca = DevCa::new("ca").unwrap();
    let r = start(&ca, "pods: {identity: any}", None).await;
    let bare = ca.material("bare", &["bare"]).unwrap();
    let mut sc = connect(&bare, r.quic).await.unwrap();
    assert!(matches!(
        sc.hello(hello_for("a")).await,
        RouterMessage::Welcome(_)
    ));
}

/// Reads messages up to the first `Inflight`: what the router sent first on the connection.
async fn first_messages(sc: &mut Sidecar) -> Vec<RouterMessage> {
    let mut out = Vec::new();
    loop {
        match sc.next().await {
            RouterMessage::Inflight(_) => return out,
            m => out.push(m),
        }
    }
}

async fn send_tokenizer(sc: &mut Sidecar, model: &str, files: &TokenizerFiles) {
    for chunk in files.chunks(model) {
        sc.send
            .send(&SidecarMessage::TokenizerChunk(chunk))
            .await
            .unwrap();
    }
}

/// A tokenizer with another vocabulary than the own one (a different digest).
fn other_files(files: &TokenizerFiles) -> TokenizerFiles {
    let mut json: serde_json::Value = serde_json::from_slice(&files.tokenizer_json).unwrap();
    json["added_tokens"] = serde_json::json!([]);
    TokenizerFiles {
        tokenizer_json: serde_json::to_vec(&json).unwrap(),
        ..files.clone()
    }
}

#[tokio::test]
async fn tokenizers_are_taken_only_as_asked_for_a_served_model_and_never_over_a_configured_one() {
    let Some(dir) = kvsight_harness::or_skip(
        "tokenizers_are_taken_only_as_asked",
        kvsight_sim::own_tokenizer::ensure_dir(),
    ) else {
        return;
    };
    let files = kvsight_process::tokenizer_dir::read(&dir).unwrap();
    let other = other_files(&files);
    assert_ne!(other.digest(), files.digest());
    let ca = DevCa::new("ca").unwrap();
    let tls = ca.material("pod", &["pod", &pod_uri("ns", "*")]).unwrap();
    let info = |f: &TokenizerFiles| TokenizerInfo {
        digest: f.digest(),
        total_bytes: f.total_bytes(),
    };

    // The model's tokenizer comes from the config: not asked for, and not replaced when sent.
    let r = start(&ca, "", Some(&dir)).await;
    let mut sc = connect(&tls, r.quic).await.unwrap();
    let mut h = hello_for("a");
    h.tokenizer = Some(info(&other));
    assert!(matches!(sc.hello(h).await, RouterMessage::Welcome(_)));
    let first = first_messages(&mut sc).await;
    assert!(
        !first
            .iter()
            .any(|m| matches!(m, RouterMessage::TokenizerRequest(_))),
        "{first:?}"
    );
    send_tokenizer(&mut sc, MODEL, &other).await;
    // A model the pod does not serve, never asked for.
    send_tokenizer(&mut sc, "someone-elses-model", &other).await;
    let st = r.state.clone();
    until("both tokenizers refused", || {
        metric(
            &st,
            r#"kvsight_router_tokenizers_refused_total{reason="unsolicited"}"#,
        ) >= 2.0
    })
    .await;
    assert!(r.state.tokenizers.has(MODEL, Some(&files.digest())));
    assert!(!r.state.tokenizers.has("someone-elses-model", None));

    // Without a configured one, the tokenizer asked for is taken.
    let r = start(&ca, "", None).await;
    let mut sc = connect(&tls, r.quic).await.unwrap();
    let mut h = hello_for("a");
    h.tokenizer = Some(info(&files));
    assert!(matches!(sc.hello(h).await, RouterMessage::Welcome(_)));
    let first = first_messages(&mut sc).await;
    assert!(
        first
            .iter()
            .any(|m| matches!(m, RouterMessage::TokenizerRequest(t) if t.model == MODEL)),
        "{first:?}"
    );
    send_tokenizer(&mut sc, MODEL, &files).await;
    let (st, digest) = (r.state.clone(), files.digest());
    until("the tokenizer asked for", || {
        st.tokenizers.has(MODEL, Some(&digest))
    })
    .await;
}

#[tokio::test]
async fn a_connection_is_closed_when_its_certificate_expires() {
    let ca = DevCa::new("ca").unwrap();
    let r = start(&ca, "", None).await;
    let leaf = ca
        .issue_until(
            "short",
            &["short", &pod_uri("ns", "a")],
            Some(SystemTime::now() + Duration::from_secs(3)),
        )
        .unwrap();
    let tls = ca.material_of(&leaf).unwrap();
    let mut sc = connect(&tls, r.quic).await.unwrap();
    assert!(matches!(
        sc.hello(hello_for("a")).await,
        RouterMessage::Welcome(_)
    ));
    assert!(r.state.registry().get("ns/a").is_some());
    let st = r.state.clone();
    until("the expired connection to close", || {
        st.registry().get("ns/a").is_none()
    })
    .await;
    assert_eq!(refused(&r.state, "certificate_expired"), 1.0);
    tokio::time::timeout(Duration::from_secs(5), sc.conn.closed())
        .await
        .expect("the router closed the connection");
}

#[tokio::test]
async fn connections_and_pods_over_their_caps_are_refused() {
    let ca = DevCa::new("ca").unwrap();
    let r = start(&ca, "pods: {maxConnections: 2, maxPods: 1}", None).await;
    let tls = ca.material("pod", &["pod", &pod_uri("ns", "*")]).unwrap();
    let mut a = connect(&tls, r.quic).await.unwrap();
    assert!(matches!(
        a.hello(hello_for("a")).await,
        RouterMessage::Welcome(_)
    ));
    // A second connection, not yet registered, takes the second slot: a third is refused at
    // the handshake.
    let mut b = connect(&tls, r.quic).await.unwrap();
    assert!(connect(&tls, r.quic).await.is_err());
    assert_eq!(refused(&r.state, "connections"), 1.0);
    let m = b.hello(hello_for("b")).await;
    assert!(
        matches!(&m, RouterMessage::Refused(x) if x.reason.contains("pods registered")),
        "{m:?}"
    );
    assert_eq!(refused(&r.state, "pods"), 1.0);
    drop((a, b));
}

#[tokio::test]
async fn an_oversized_hello_is_refused_as_a_protocol_violation() {
    let ca = DevCa::new("ca").unwrap();
    let r = start(&ca, "pods: {identity: any}", None).await;
    let tls = ca.material("pod", &["pod"]).unwrap();
    let mut big = hello_for("a");
    big.lora_adapters = (0..5000).map(|i| format!("adapter-{i}")).collect();
    let mut sc = connect(&tls, r.quic).await.unwrap();
    sc.send.send(&SidecarMessage::Hello(big)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), sc.conn.closed())
        .await
        .expect("the router closed the connection");
    assert!(r.state.registry().get("ns/a").is_none());
    assert_eq!(refused(&r.state, "protocol"), 1.0);
}
