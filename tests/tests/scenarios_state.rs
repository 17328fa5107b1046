//! Scenarios about the router's view staying true to the engines' real caches (scenarios 7 and
//! 9 of docs/bench/README.md's table), on a loopback cluster: vllm-sim pods, real sidecars,
//! real routers.
//!
//! - **Eviction truth**: once other traffic evicted a shared prefix from pod A, kvsight stops
//!   crediting A with it (its prediction of cached tokens matches what A's engine then reports),
//!   while a router working from its own memory of what it sent (approximate mode, the blind
//!   behaviour) keeps preferring A and predicts a cache hit that the engine does not have.
//! - **KV events lost beyond the replay buffer**: the sidecar declares its history lost, resets
//!   its mirror and rebuilds it from new events; the router never credits a pod with blocks it
//!   evicted meanwhile, and routes on what the engine stores afterwards.
//! - **Restarts**: a restarted router rebuilds its view from the sidecars' snapshots within 2 s;
//!   a restarted sidecar learns the cache its engine already holds before routers route on it;
//!   a restarted engine (empty cache, same ports) is no longer credited with its old blocks.

use std::time::{Duration, Instant};

use kvsight_testbed::cluster::{
    Cluster, ClusterConfig, PodSpec, Routed, WAIT, eventually, fast_engine, own_tokenizer_or_skip,
};
use kvsight_testbed::demo::{preamble, unique_prompt};
use serde_json::{Value, json};

const MODEL: &str = "kvsight-demo";
const BLOCK: usize = 16;

/// Small pools (127 usable blocks of 16) so a few unrelated prompts evict everything older; a
/// fast clock; no compile stalls.
fn pods(n: usize) -> Vec<PodSpec> {
    (0..n)
        .map(|i| {
            let engine = fast_engine(BLOCK, 128, 1024, 0.01, i as u64);
            PodSpec::new(&format!("pod-{i}"), MODEL, engine).unwrap()
        })
        .collect()
}

fn question(n: usize) -> String {
    format!("{}Question {n}: name one factor.", preamble())
}

fn completion(prompt: &str) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
}

async fn start(exact: bool, pending_ttl: f64) -> Cluster {
    let mut cfg = ClusterConfig::new(pods(2));
    cfg.router_tokenizers = exact;
    cfg.router_yaml = format!("scheduler:\n  pendingTtlSeconds: {pending_ttl}\n");
    let cluster = Cluster::start(cfg).await.unwrap();
    cluster.wait_all_routable(WAIT).await.unwrap();
    if exact {
        cluster.wait_tokenizer(MODEL, WAIT).await.unwrap();
    }
    cluster
}

/// Sends the first question through router 0; returns the key and index of the pod it went to,
/// which from then on holds the shared preamble.
async fn first_question(cluster: &Cluster) -> (String, usize) {
    cluster
        .routed_to(0, "/v1/completions", &completion(&question(0)))
        .await
        .unwrap()
}

/// The canonical chain of `prompt` as the engine tokenizes it.
async fn chain_of(cluster: &Cluster, prompt: &str) -> Vec<u64> {
    cluster.chain_of(MODEL, prompt, BLOCK).await.unwrap()
}

/// Leading blocks of `chain` router `r` believes pod `key` holds in its cache (pending excluded).
fn filter_run(cluster: &Cluster, r: usize, key: &str, chain: &[u64]) -> usize {
    cluster.routers[r]
        .state
        .registry()
        .get(key)
        .and_then(|p| p.filter.as_ref().map(|f| f.longest_prefix(chain)))
        .unwrap_or(0)
}

/// Whether pod `i`'s sidecar mirror holds the canonical block `hash`.
fn mirror_holds(cluster: &Cluster, i: usize, hash: u64) -> bool {
    let shared = &cluster.pods[i].sidecar().shared;
    shared.mirror.get().is_some_and(|m| {
        kvsight_sidecar::kv_events::subscriber::lock(m)
            .blocks()
            .any(|(_, c)| c == hash)
    })
}

/// Sends `prompt` through router 0 and returns the decision and the prompt tokens the chosen
/// pod's engine actually found cached (its `vllm:prefix_cache_hits` delta).
async fn routed_with_hits(cluster: &Cluster, prompt: &str) -> (Routed, usize, f64) {
    let before = cluster.all_counters().await.unwrap();
    let r = cluster
        .post(0, "/v1/completions", &completion(prompt))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text);
    let pod = cluster.pod_index(r.pod.as_deref().unwrap()).unwrap();
    let after = cluster.pod_counters(pod).await.unwrap();
    let hits = after.since(&before[pod]).prefix_hits;
    (r, pod, hits)
}

fn predicted(r: &Routed) -> f64 {
    r.decision.as_ref().unwrap()["predicted_cached_tokens"]
        .as_f64()
        .unwrap()
}

/// Sends question `n` through router 0 and asserts that, after a restart of `restarted`, it still
/// goes to pod `a`, which holds the preamble, with cached tokens predicted and (nearly all)
/// found by the engine.
async fn assert_prefix_still_goes_to(cluster: &Cluster, a: usize, n: usize, restarted: &str) {
    let (r, pod, hits) = routed_with_hits(cluster, &question(n)).await;
    assert_eq!(
        pod, a,
        "after a {restarted} restart the prefix still goes to A: {:?}",
        r.decision
    );
    assert!(
        predicted(&r) > 0.0 && hits >= predicted(&r) * 0.9,
        "predicted {} hits {hits}",
        predicted(&r)
    );
}

/// Waits until router 0 credits pod `key` with none of `chain`: not in its filter, not pending.
async fn view_drops(cluster: &Cluster, key: &str, chain: &[u64]) {
    eventually("the router's view of A to drop the prefix", WAIT, || {
        let now = Instant::now();
        let run = filter_run(cluster, 0, key, chain);
        let pending = cluster.routers[0]
            .state
            .registry()
            .get(key)
            .map_or(0, |p| p.pending_blocks(chain, now));
        async move { run == 0 && pending == 0 }
    })
    .await
    .unwrap();
}

/// One run of the eviction scenario; returns (prediction, engine hits) for the request sent
/// after the eviction, and whether it went to the pod that had held the prefix.
async fn eviction_run(exact: bool) -> (f64, f64, bool) {
    // The approximate router gets a long memory, as routers that keep their own prefix trees do.
    let cluster = start(exact, if exact { 0.3 } else { 60.0 }).await;
    let (a_key, a) = first_question(&cluster).await;
    let (second, _, hits) = routed_with_hits(&cluster, &question(1)).await;
    assert_eq!(
        second.pod.as_deref(),
        Some(a_key.as_str()),
        "a shared prefix lands together"
    );
    let chain = chain_of(&cluster, &question(2)).await;
    let prefix_blocks = preamble().len() / 8 / BLOCK; // a lower bound: ~4+ chars per token
    assert!(
        hits > (prefix_blocks * BLOCK) as f64,
        "the second request hit the cache: {hits}"
    );
    assert!(mirror_holds(&cluster, a, chain[0]));

    // Other traffic, straight to A's engine (another gateway, a batch job), evicts the prefix.
    for n in 100..106 {
        let url = format!("{}/v1/completions", cluster.pods[a].vllm_url());
        let r = kvsight_testbed::cluster::post_json(
            &cluster.http,
            &url,
            &completion(&unique_prompt(n)),
        )
        .await
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text);
    }
    // The truth, from A's sidecar mirror (which equals the engine's resident set).
    eventually("A's mirror to drop the prefix", WAIT, || {
        let gone = !mirror_holds(&cluster, a, chain[0]);
        async move { gone }
    })
    .await
    .unwrap();
    if exact {
        // kvsight's view follows within a publish interval (and pending blocks expired).
        view_drops(&cluster, &a_key, &chain).await;
    }
    let (after, pod, hits) = routed_with_hits(&cluster, &question(2)).await;
    let p = predicted(&after);
    eprintln!(
        "eviction truth ({}): chose {} (held the prefix: {}), predicted {p} cached tokens, engine \
         found {hits}",
        if exact { "exact" } else { "approximate" },
        after.pod.as_deref().unwrap(),
        pod == a
    );
    cluster.shutdown().await;
    (p, hits, pod == a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_truth_kvsight_stops_crediting_the_evicted_pod_approximate_memory_does_not() {
    if own_tokenizer_or_skip(
        "eviction_truth_kvsight_stops_crediting_the_evicted_pod_approximate_memory_does_not",
    )
    .is_none()
    {
        return;
    }
    let (exact_predicted, exact_hits, _) = eviction_run(true).await;
    let (approx_predicted, approx_hits, approx_chose_a) = eviction_run(false).await;
    // kvsight: no pod holds the prefix any more, and it says so; the engine agrees.
    assert_eq!(
        exact_predicted, 0.0,
        "kvsight must not credit an evicted prefix"
    );
    assert!(exact_hits < (4 * BLOCK) as f64, "engine hits {exact_hits}");
    // Router memory: still sends the prefix to A and expects hundreds of cached tokens there, but
    // the engine finds (almost) none — the blind spot kvsight removes.
    assert!(approx_chose_a, "approximate memory keeps preferring A");
    assert!(
        approx_predicted >= 400.0,
        "approximate prediction {approx_predicted}"
    );
    assert!(
        approx_hits < (4 * BLOCK) as f64,
        "engine hits {approx_hits}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_of_router_sidecar_and_engine_leave_routing_true() {
    if own_tokenizer_or_skip("restarts_of_router_sidecar_and_engine_leave_routing_true").is_none() {
        return;
    }
    let mut cluster = start(true, 0.3).await;
    let (a_key, a) = first_question(&cluster).await;
    let chain = chain_of(&cluster, &question(1)).await;
    let held = chain.len() - 1; // every full block of the preamble, not the question's tail
    eventually("the router to see the prefix on A", WAIT, || {
        let run = filter_run(&cluster, 0, &a_key, &chain);
        async move { run + 2 >= held }
    })
    .await
    .unwrap();

    // 1. Router restart: a new process on the same ports learns every pod and filter from the
    //    sidecars' reconnect + snapshot.
    let t0 = Instant::now();
    cluster.restart_router(0).await.unwrap();
    let restarted = Instant::now();
    cluster
        .wait_all_routable(Duration::from_secs(10))
        .await
        .unwrap();
    let rebuilt = restarted.elapsed();
    cluster.wait_tokenizer(MODEL, WAIT).await.unwrap();
    eprintln!(
        "router restart: stop+start {:?}, view rebuilt {rebuilt:?} after start",
        restarted - t0
    );
    assert!(
        rebuilt < Duration::from_secs(2),
        "view rebuilt in {rebuilt:?}"
    );
    assert!(filter_run(&cluster, 0, &a_key, &chain) + 2 >= held);
    assert_prefix_still_goes_to(&cluster, a, 1, "router").await;

    // 2. Sidecar restart (drain, Goodbye, new process on the same port): its first snapshot
    //    already holds what the engine cached before it started.
    cluster.restart_sidecar(a).await.unwrap();
    cluster.wait_routable(&[a], WAIT).await.unwrap();
    assert!(
        filter_run(&cluster, 0, &a_key, &chain) + 2 >= held,
        "the new sidecar's first snapshot holds the engine's cache"
    );
    assert_prefix_still_goes_to(&cluster, a, 2, "sidecar").await;

    // 3. Engine restart (new process, empty cache, same ports), idle afterwards: the sidecar
    //    notices from the engine's counters and the router stops crediting A at once.
    cluster.restart_sim(a).await.unwrap();
    eventually(
        "the router's view of A to empty after the engine restart",
        WAIT,
        || {
            let run = filter_run(&cluster, 0, &a_key, &chain);
            async move { run == 0 }
        },
    )
    .await
    .unwrap();
    cluster.wait_routable(&[a], WAIT).await.unwrap();
    let (r, _, hits) = routed_with_hits(&cluster, &question(3)).await;
    eprintln!(
        "after the engine restart: predicted {} engine hits {hits}",
        predicted(&r)
    );
    assert_eq!(
        predicted(&r),
        0.0,
        "no pod holds the prefix: {:?}",
        r.decision
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_lost_beyond_the_replay_buffer_rebuild_the_view_and_routing_stays_true() {
    let Some(_) = own_tokenizer_or_skip(
        "kv_events_lost_beyond_the_replay_buffer_rebuild_the_view_and_routing_stays_true",
    ) else {
        return;
    };
    // The engines keep only their last 2 batches for replay (vLLM's buffer is bounded too).
    let mut specs = pods(2);
    for s in &mut specs {
        if let Some(kv) = s.sim.kv_events.as_mut() {
            kv.buffer_steps = 2;
        }
    }
    let mut cfg = ClusterConfig::new(specs);
    cfg.router_yaml = "scheduler:\n  pendingTtlSeconds: 0.3\n".into();
    let cluster = Cluster::start(cfg).await.unwrap();
    cluster.wait_all_routable(WAIT).await.unwrap();
    cluster.wait_tokenizer(MODEL, WAIT).await.unwrap();
    let (a_key, a) = first_question(&cluster).await;
    let chain = chain_of(&cluster, &question(1)).await;
    let held = chain.len() - 1;
    eventually("the router to see the prefix on A", WAIT, || {
        let run = filter_run(&cluster, 0, &a_key, &chain);
        async move { run + 2 >= held }
    })
    .await
    .unwrap();

    // From now on none of A's KV events reaches its sidecar live, while other traffic straight
    // to A's engine evicts the prefix: the eviction's events are lost, and many more batches
    // than the replay buffer holds go by.
    let status = cluster.pods[a]
        .sidecar()
        .shared
        .subscriber
        .get()
        .unwrap()
        .clone();
    let losses = status.borrow().losses;
    cluster.pods[a].sim().drop_kv_seqs(Some(0..u64::MAX));
    let direct = format!("{}/v1/completions", cluster.pods[a].vllm_url());
    for n in 100..106 {
        let r = kvsight_testbed::cluster::post_json(
            &cluster.http,
            &direct,
            &completion(&unique_prompt(n)),
        )
        .await
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text);
    }
    cluster.pods[a].sim().drop_kv_seqs(None);
    // The next batch arrives live: a gap that the replay buffer no longer covers.
    let r = kvsight_testbed::cluster::post_json(
        &cluster.http,
        &direct,
        &completion(&unique_prompt(106)),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text);
    eventually("A's sidecar to declare its history lost", WAIT, || {
        let lost = status.borrow().losses > losses;
        async move { lost }
    })
    .await
    .unwrap();
    // The view is rebuilt from what follows: the evicted prefix is no longer credited to A.
    view_drops(&cluster, &a_key, &chain).await;
    let (after, pod, hits) = routed_with_hits(&cluster, &question(2)).await;
    // And what the engines store from now on is seen: the prefix, cached again where it went,
    // is predicted there and found there.
    let (again, pod_again, hits_again) = routed_with_hits(&cluster, &question(3)).await;
    eprintln!(
        "history lost on {a_key}: then predicted {} / engine found {hits} on pod {pod}; next \
         predicted {} / found {hits_again} on pod {pod_again}",
        predicted(&after),
        predicted(&again)
    );
    assert!(
        predicted(&after) <= hits + BLOCK as f64,
        "no credit for blocks the engine lost: {:?}",
        after.decision
    );
    assert_eq!(pod_again, pod, "the prefix stays where it is now cached");
    assert!(
        predicted(&again) > 0.0 && hits_again >= predicted(&again) * 0.9,
        "predicted {} hits {hits_again}",
        predicted(&again)
    );
    cluster.shutdown().await;
}
