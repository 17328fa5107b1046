//! Helpers shared by the router's integration tests: pods registered straight into the registry,
//! small axum servers standing in for vLLM pods on loopback, and the router app served on
//! `127.0.0.1:0`.
#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use kvsight_harness::messages;
use kvsight_protocol::messages::*;
use kvsight_router::State;
use kvsight_router::config::RouterConfig;
use kvsight_router::pods::ConnId;
use tokio_util::sync::CancellationToken;

pub mod quic;

pub const MODEL: &str = messages::MODEL;

pub fn hello(name: &str, url: &str, labels: &[(&str, &str)]) -> Hello {
    let h = messages::hello(name, url);
    Hello {
        pod: PodIdentity {
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>(),
            ..h.pod
        },
        engine: EngineFacts {
            max_num_seqs: 8,
            max_num_batched_tokens: Some(2048),
            ..messages::engine()
        },
        lora_adapters: vec!["sql-lora".into()],
        ..h
    }
}

/// A pod's `Hello` (at `http://127.0.0.1:9`) that asks for a load report every 50 ms.
pub fn fast_hello(name: &str) -> Hello {
    let mut h = hello(name, "http://127.0.0.1:9", &[]);
    h.load_interval_ms = 50;
    h
}

pub fn load(phase: Phase, running: u32, waiting: u32) -> Load {
    Load {
        phase,
        running,
        waiting,
        prefix_cache_queries: 10,
        prefix_cache_hits: 5,
        ..messages::idle_load()
    }
}

/// A router state with the decision header on (the tests read the router's choices from it).
pub fn state(cfg: RouterConfig) -> Arc<State> {
    let st = State::new(cfg, "test-router".into(), None, CancellationToken::new()).unwrap();
    st.set_decision_header(true);
    st
}

/// The API with the admin surface behind it on one test server, for tests that read metrics or
/// `/debug/pods` beside their requests (the router itself never serves both on one listener).
pub fn app_and_admin(st: Arc<State>) -> axum::Router {
    kvsight_router::app(st.clone()).fallback_service(kvsight_router::http::admin_app(st))
}

/// Registers a Ready pod at `url` with the given load.
pub fn add_pod(
    state: &State,
    name: &str,
    url: &str,
    labels: &[(&str, &str)],
    running: u32,
) -> (String, ConnId) {
    add_hello(state, hello(name, url, labels), Phase::Ready, running)
}

/// Registers the pod `hello` describes, in `phase` with `running` requests.
pub fn add_hello(state: &State, hello: Hello, phase: Phase, running: u32) -> (String, ConnId) {
    let mut reg = state.registry();
    let (key, conn) = reg.register(hello, Instant::now());
    reg.apply_load(&key, conn, load(phase, running, 0), Instant::now())
        .unwrap();
    (key, conn)
}

/// Serves `router` on a fresh loopback port.
pub async fn serve(router: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    addr
}

/// A loopback address where nothing listens (bound, then closed): connecting is refused.
pub fn refused_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    format!("http://{addr}")
}

pub fn config_yaml(yaml: &str) -> RouterConfig {
    let dir = std::env::temp_dir().join(format!(
        "kvsight-router-test-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("c.yaml");
    std::fs::write(&p, yaml).unwrap();
    let cfg = RouterConfig::load(&p).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    cfg
}

pub fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    t ^ N.fetch_add(1, Ordering::Relaxed)
}

/// `yaml` as the router's config; the default for an empty string.
pub fn config_or_default(yaml: &str) -> RouterConfig {
    if yaml.is_empty() {
        RouterConfig::default()
    } else {
        RouterConfig::from_yaml(yaml).unwrap()
    }
}

/// The router's real HTTP server on `127.0.0.1:0`, stopped on drop.
pub struct Running {
    pub addr: SocketAddr,
    pub state: Arc<State>,
    pub _stop: tokio_util::sync::DropGuard,
}

/// Serves `st`'s API with the router's own server (limits, timeouts, drain) on a fresh
/// loopback port.
pub async fn serve_router(st: Arc<State>) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(kvsight_router::server::serve(
        listener,
        kvsight_router::app(st.clone()),
        st.clone(),
        stop.clone(),
    ));
    Running {
        addr,
        state: st,
        _stop: stop.drop_guard(),
    }
}

/// A sample of the router's metrics (`name{labels}` exactly as rendered), 0 when absent.
pub fn metric(st: &State, series: &str) -> f64 {
    let text = st.metrics.render(&st.registry(), &[], Instant::now());
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// Waits, at most `within` (in 10 ms steps), until `cond` holds.
pub async fn until_within(what: &str, within: std::time::Duration, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// The project's own tokenizer files, or `None` (the test says "skipped") when they cannot be
/// built here.
pub fn own_files(test: &str) -> Option<kvsight_protocol::tokenizer_transfer::TokenizerFiles> {
    kvsight_harness::or_skip(test, kvsight_sim::own_tokenizer::ensure_dir())
        .map(|dir| kvsight_process::tokenizer_dir::read(&dir).unwrap())
}

/// The project's Llama-2-shaped tokenizer files (sentencepiece-style: transformers 5 rebuilds
/// it), or `None` (the test says "skipped") when they cannot be built here.
pub fn llama2_files(test: &str) -> Option<kvsight_protocol::tokenizer_transfer::TokenizerFiles> {
    kvsight_harness::or_skip(test, kvsight_sim::llama2_tokenizer::ensure_dir())
        .map(|dir| kvsight_process::tokenizer_dir::read(&dir).unwrap())
}

/// A `POST` of a JSON `body` as raw bytes, with `extra` header lines, closing the connection.
pub fn post_request(path: &str, body: &str, extra: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n{extra}Connection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// `files` as the simulator takes them, to serve the same tokenizer the router reads.
pub fn sim_tokenizer(
    files: &kvsight_protocol::tokenizer_transfer::TokenizerFiles,
) -> kvsight_sim::server::TokenizerFiles {
    kvsight_sim::server::TokenizerFiles {
        tokenizer_json: files.tokenizer_json.clone(),
        tokenizer_config: files.tokenizer_config.clone().unwrap_or_default(),
    }
}
