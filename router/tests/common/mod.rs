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
    let mut reg = state.registry();
    let (key, conn) = reg.register(hello(name, url, labels), Instant::now());
    reg.apply_load(&key, conn, load(Phase::Ready, running, 0), Instant::now())
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
