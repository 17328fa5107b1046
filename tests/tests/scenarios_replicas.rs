//! Router replicas share where they place prefixes, through the pods' sidecars (the shared
//! truth), on a loopback cluster: real routers, real sidecars relaying over QUIC with mutual
//! TLS, vllm-sim pods.
//!
//! A replica that never sent a prompt knows, within a round trip, the pod another replica sent
//! it to — as that prompt's home, and in the pod's projected load — so the tenant's next request
//! through it follows, long before the pod's own reports could say anything. A replica that
//! restarts is told where prefixes live by the sidecars. With `sharePlacements: false` nothing
//! is relayed.

use std::time::{Duration, Instant};

use kvsight_testbed::cluster::{
    Cluster, ClusterConfig, PodSpec, WAIT, eventually, fast_engine, own_tokenizer_or_skip,
};
use kvsight_testbed::demo::unique_prompt;
use serde_json::{Value, json};

const MODEL: &str = "kvsight-demo";
const BLOCK: usize = 16;

fn pods(n: usize) -> Vec<PodSpec> {
    (0..n)
        .map(|i| {
            let engine = fast_engine(BLOCK, 512, 2048, 0.05, i as u64);
            PodSpec::new(&format!("pod-{i}"), MODEL, engine).unwrap()
        })
        .collect()
}

/// The pod router `r` holds as `chain`'s home, if any.
fn home_on(cluster: &Cluster, r: usize, chain: &[u64]) -> Option<String> {
    let reg = cluster.routers[r].state.registry();
    reg.homes()
        .find(chain, Instant::now(), Duration::from_secs(120))
        .map(|f| f.pod.to_owned())
}

/// A sidecar counter `kvsight_sidecar_placements_total{outcome}` of pod `i`.
fn relayed(cluster: &Cluster, i: usize, outcome: &str) -> f64 {
    let text = cluster.pods[i].sidecar().shared.metrics.render();
    kvsight_sidecar::scrape::samples(&text)
        .unwrap()
        .iter()
        .filter(|s| s.name == "kvsight_sidecar_placements_total")
        .filter(|s| s.labels.get("outcome").is_some_and(|o| o == outcome))
        .map(|s| s.value)
        .sum()
}

/// Router `r`'s `kvsight_router_placements_total{outcome}`.
fn placements(cluster: &Cluster, r: usize, outcome: &str) -> f64 {
    let state = &cluster.routers[r].state;
    let text = state.metrics.render(&state.registry(), &[], Instant::now());
    kvsight_sidecar::scrape::samples(&text)
        .unwrap()
        .iter()
        .filter(|s| s.name == "kvsight_router_placements_total")
        .filter(|s| s.labels.get("outcome").is_some_and(|o| o == outcome))
        .map(|s| s.value)
        .sum()
}

fn completion(prompt: &str) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_through_one_replica_reaches_the_other_through_the_sidecar() {
    if own_tokenizer_or_skip(
        "a_placement_through_one_replica_reaches_the_other_through_the_sidecar",
    )
    .is_none()
    {
        return;
    }
    let mut cfg = ClusterConfig::new(pods(2));
    cfg.routers = 2;
    let mut cluster = Cluster::start(cfg).await.unwrap();
    cluster.wait_all_routable(WAIT).await.unwrap();
    cluster.wait_tokenizer(MODEL, WAIT).await.unwrap();

    let prompt = unique_prompt(1);
    let chain = cluster.chain_of(MODEL, &prompt, BLOCK).await.unwrap();
    assert!(chain.len() > 8, "a prompt of several blocks");
    let (key, i) = cluster
        .routed_to(0, "/v1/completions", &completion(&prompt))
        .await
        .unwrap();
    // Router 1 never saw this prompt: only the relay can have told it where it lives.
    eventually("router 1 to learn the prompt's home", WAIT, || async {
        home_on(&cluster, 1, &chain).as_deref() == Some(key.as_str())
    })
    .await
    .unwrap();
    assert_eq!(placements(&cluster, 0, "shared"), 1.0);
    assert_eq!(placements(&cluster, 1, "received"), 1.0);
    assert_eq!(relayed(&cluster, i, "received"), 1.0);
    assert_eq!(relayed(&cluster, i, "relayed"), 1.0, "to router 1 only");
    assert_eq!(relayed(&cluster, 1 - i, "received"), 0.0);
    // The tenant's next request, through router 1, goes there.
    let (again, _) = cluster
        .routed_to(1, "/v1/completions", &completion(&prompt))
        .await
        .unwrap();
    assert_eq!(again, key);
    eventually("router 0 to hear of router 1's placement", WAIT, || async {
        relayed(&cluster, i, "relayed") == 2.0
    })
    .await
    .unwrap();

    // A restarted replica starts with no memory; the sidecars tell it where prefixes live.
    cluster.restart_router(1).await.unwrap();
    eventually(
        "the restarted router 1 to learn the prompt's home",
        WAIT,
        || async { home_on(&cluster, 1, &chain).as_deref() == Some(key.as_str()) },
    )
    .await
    .unwrap();

    // Sharing off on both replicas: a new prompt through router 0 is not relayed.
    cluster
        .reload_router_config("scheduler:\n  sharePlacements: false\n")
        .await
        .unwrap();
    let other = unique_prompt(2);
    let other_chain = cluster.chain_of(MODEL, &other, BLOCK).await.unwrap();
    cluster
        .routed_to(0, "/v1/completions", &completion(&other))
        .await
        .unwrap();
    // Counted as the pick is made, before the answer: nothing was handed to a sidecar.
    assert_eq!(
        placements(&cluster, 0, "shared"),
        1.0,
        "nothing more shared"
    );
    assert!(home_on(&cluster, 0, &other_chain).is_some());
    assert_eq!(home_on(&cluster, 1, &other_chain), None);
    cluster.shutdown().await;
}
