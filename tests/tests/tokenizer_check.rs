//! The router's tokenizer check end to end: a vllm-sim pod on transformers 5, a real sidecar
//! sending the tokenizer files, a router over QUIC. The check's single-process tests are in
//! `router/tests/tokenizer_check.rs`; this one needs the sidecar too, so it lives here.

use std::time::{Duration, Instant};

use kvsight_protocol::hash::{ChainSeed, hash_chain};
use kvsight_router::tokenize::Verdict;
use kvsight_sim::engine::EngineConfig;
use kvsight_testbed::cluster::{Cluster, ClusterConfig, PodSpec, WAIT, eventually, post_json};
use kvsight_testbed::demo::preamble;
use kvsight_tokenizer::Dialect;
use serde_json::Value;
use serde_json::json;

const MODEL: &str = "m";

/// End to end (vllm-sim on transformers 5, a real sidecar sending the files, a router over QUIC):
/// the router chooses the rebuilt dialect, so its block hashes are the engine's — the pod's
/// filter matches a shared system prompt and the cached tokens it predicts are the ones the
/// engine finds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transformers5_engine_is_routed_exactly_with_cached_tokens_predicted_right() {
    let test = "a_transformers5_engine_is_routed_exactly_with_cached_tokens_predicted_right";
    let Some(dir) = kvsight_harness::or_skip(test, kvsight_sim::llama2_tokenizer::ensure_dir())
    else {
        return;
    };
    const BLOCK: usize = 16;
    let engine = EngineConfig::builder()
        .block_size(BLOCK)
        .num_gpu_blocks(1024)
        .max_model_len(4096)
        .compile_stall(Duration::ZERO)
        .time_scale(0.01)
        .build()
        .unwrap();
    let mut pod = PodSpec::new("pod-0", MODEL, engine).unwrap();
    pod.tokenizer_dir = Some(dir);
    pod.sim.tokenizer_dialect = Dialect::Transformers5Rebuilt;
    let mut cfg = ClusterConfig::new(vec![pod]);
    // Predictions from the pod's filter alone: the router's memory of what it sent expires.
    cfg.router_yaml = "scheduler:\n  pendingTtlSeconds: 0.2\n".into();
    let cluster = Cluster::start(cfg).await.unwrap();
    cluster.wait_all_routable(WAIT).await.unwrap();
    cluster.wait_tokenizer(MODEL, WAIT).await.unwrap();
    let state = &cluster.routers[0].state;
    assert_eq!(
        state.tokenizers.verdict(MODEL),
        Some(Verdict::Agrees(Dialect::Transformers5Rebuilt))
    );

    let system = preamble();
    let chat = |n: usize| {
        json!({"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": format!("Question {n}: name one factor.")}]})
    };
    // The engine's own chains for both chats.
    let chain = |ids: Value| {
        let ids: Vec<u32> = serde_json::from_value(ids).unwrap();
        hash_chain(&ChainSeed::BASE, &ids, BLOCK)
    };
    let engine_ids = |n: usize| {
        let url = format!("{}/tokenize", cluster.pods[0].vllm_url());
        async move {
            let http = reqwest::Client::builder().no_proxy().build().unwrap();
            let a = post_json(&http, &url, &chat(n)).await.unwrap();
            assert_eq!(a.status, 200, "{}", a.text);
            serde_json::from_str::<Value>(&a.text).unwrap()["tokens"].clone()
        }
    };
    let (first, second) = (chain(engine_ids(1).await), chain(engine_ids(2).await));
    let shared = first
        .iter()
        .zip(&second)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(shared >= 20, "the system prompt fills {shared} blocks");

    let r = cluster
        .post(0, "/v1/chat/completions", &chat(1))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.decision.as_ref().unwrap()["prefix_mode"], "exact");
    let key = cluster.pods[0].key();
    eventually("the pod's filter to hold the first chat", WAIT, || {
        let now = Instant::now();
        let reg = state.registry();
        let pod = reg.get(&key);
        let held = pod
            .and_then(|p| p.filter.as_ref().map(|f| f.longest_prefix(&second)))
            .unwrap_or(0);
        let pending = pod.map_or(0, |p| p.pending_blocks(&second, now));
        async move { held == shared && pending == 0 }
    })
    .await
    .unwrap();

    let before = cluster.pod_counters(0).await.unwrap();
    let r = cluster
        .post(0, "/v1/chat/completions", &chat(2))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text);
    let hits = cluster
        .pod_counters(0)
        .await
        .unwrap()
        .since(&before)
        .prefix_hits;
    let predicted = r.decision.as_ref().unwrap()["predicted_cached_tokens"]
        .as_f64()
        .unwrap();
    eprintln!("{test}: {shared} shared blocks, predicted {predicted}, engine found {hits}");
    assert_eq!(predicted, (shared * BLOCK) as f64);
    assert_eq!(
        hits, predicted,
        "the engine found what the router predicted"
    );
    cluster.shutdown().await;
}
