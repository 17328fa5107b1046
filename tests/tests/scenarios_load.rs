//! Scenarios about load the router did not send, warm-up, KV pressure and prefix caching
//! turned off. Each runs a loopback cluster (vllm-sim pods, real sidecars, a real router) and sends
//! the same traffic through a router that cannot see — [`BlindRouter`], or kvsight with the
//! relevant signal disabled by its config — and judges both by what the engines themselves count
//! or by the time clients wait:
//!
//! 1. `exec_load_*`: generations posted straight to pod 0 (not through any router) fill its
//!    sequence slots; kvsight sees them as `kvsight_router_unrouted` and sends new work to pod 1,
//!    while a least-request balancer (which only knows its own in-flight requests) keeps picking
//!    pod 0 and its users queue behind the hidden load.
//! 2. `cold_pod_*`: a pod joining with compile stalls pending gets no user request until its
//!    sidecar's warm-up absorbed them (`/ready` is 503 meanwhile); a round-robin balancer sends
//!    users straight into the stall of an un-warmed pod.
//! 3. `long_prompts_*`: concurrent long prompts sharing a prefix fit the sequence slots but not the
//!    KV pool of one pod; with the projected-KV saturation filter no pod preempts, with the filter
//!    opened to 1.0 and prefix affinity alone deciding, everything piles onto one pod and it
//!    preempts.
//! 8. `prefix_caching_off_*`: pods without prefix caching (the sidecar reports it) get
//!    least-request scoring, so shared-prefix traffic spreads; the same traffic on caching pods
//!    concentrates on the pod that holds the prefix.

use std::time::{Duration, Instant};

use kvsight_protocol::messages::Phase;
use kvsight_sim::engine::{EngineConfig, EngineConfigBuilder};
use kvsight_sim::server::{SimConfig, SimPod};
use kvsight_testbed::cluster::{
    BlindMode, BlindRouter, Cluster, ClusterConfig, PodCounters, PodSpec, Routed, WAIT, Warmup,
    eventually, own_tokenizer_or_skip,
};
use serde_json::json;

const MODEL: &str = "scenario-model";

/// Reads one gauge of a Prometheus exposition by name and `pod` label; `None` when absent.
async fn pod_gauge(http: &reqwest::Client, url: &str, name: &str, pod: &str) -> Option<f64> {
    let text = http
        .get(format!("{url}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    kvsight_sidecar::scrape::samples(&text)
        .ok()?
        .into_iter()
        .find(|s| s.name == name && s.labels.get("pod").map(String::as_str) == Some(pod))
        .map(|s| s.value)
}

/// `len` token ids in a range every vocabulary has, distinct per `seed` from the first block on,
/// so prompts built from different seeds never share a cached block.
fn token_ids(seed: u64, len: usize) -> Vec<u32> {
    let mut x = seed.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            100 + (x % 1000) as u32
        })
        .collect()
}

fn engine(b: EngineConfigBuilder) -> EngineConfig {
    b.build().expect("a valid engine config")
}

/// The cluster's defaults with slower load reports (less CPU for four clusters in parallel on
/// 2 cores; a pod still counts as stale only after 1 s without a report).
fn config(pods: Vec<PodSpec>) -> ClusterConfig {
    let mut c = ClusterConfig::new(pods);
    c.scrape_interval = Duration::from_millis(200);
    c
}

/// `pod-0` and `pod-1`, their engines `configure`d, without compile stalls and seeded by index.
fn two_pods(configure: impl Fn(EngineConfigBuilder) -> EngineConfigBuilder) -> Vec<PodSpec> {
    (0..2)
        .map(|i| {
            let e = engine(
                configure(EngineConfig::builder())
                    .compile_stall(Duration::ZERO)
                    .seed(i),
            );
            PodSpec::new(&format!("pod-{i}"), MODEL, e).unwrap()
        })
        .collect()
}

/// Starts a cluster and returns once every pod is routable.
async fn start(cfg: ClusterConfig) -> Cluster {
    let cluster = Cluster::start(cfg).await.unwrap();
    cluster.wait_all_routable(WAIT).await.unwrap();
    cluster
}

/// How router 0 sees a pod now, for failure messages.
fn router_view(cluster: &Cluster, key: &str) -> String {
    let now = Instant::now();
    cluster.routers[0]
        .state
        .registry()
        .get(key)
        .map_or("not registered".into(), |p| {
            format!(
                "{key}: phase {:?}, stale {}, report age {:?}, projection {:?}",
                p.phase(),
                p.is_stale(now),
                p.report_age(now),
                p.projection()
            )
        })
}

fn assert_ok(r: &Routed, what: &str) {
    assert_eq!(r.status, 200, "{what}: HTTP {}: {}", r.status, r.text);
}

// ---------------------------------------------------------------------------------------------
// 1. exec load

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_load_bypassing_the_router_sends_new_work_elsewhere() {
    if own_tokenizer_or_skip("exec_load_bypassing_the_router_sends_new_work_elsewhere").is_none() {
        return;
    }
    const SLOTS: usize = 4;
    // Unscaled 10 ms decode steps: the hidden generations below last about 6 s, long enough for
    // both the kvsight and the blind half to run while pod 0 is full.
    const HIDDEN_TOKENS: u64 = 560;
    let cluster = start(config(two_pods(|b| b.max_num_seqs(SLOTS)))).await;
    let a = cluster.pods[0].key();
    let b = cluster.pods[1].key();
    cluster.wait_tokenizer(MODEL, WAIT).await.unwrap();

    // Batch jobs, a cron, another gateway: load on pod 0 that no router sent.
    let hidden_started = Instant::now();
    let mut hidden = tokio::task::JoinSet::new();
    for n in 0..SLOTS {
        let http = cluster.http.clone();
        let url = format!("{}/v1/completions", cluster.pods[0].vllm_url());
        let body = json!({
            "model": MODEL, "prompt": format!("Nightly batch job {n}: summarise the logs."),
            "max_tokens": HIDDEN_TOKENS, "ignore_eos": true,
        });
        hidden.spawn(async move { kvsight_testbed::cluster::post_json(&http, &url, &body).await });
    }
    let router_url = cluster.routers[0].admin_url();
    eventually("the router to report pod 0's unrouted load", WAIT, || {
        let (http, url, a) = (&cluster.http, &router_url, &a);
        async move {
            pod_gauge(http, url, "kvsight_router_unrouted", a)
                .await
                .is_some_and(|v| v >= SLOTS as f64)
        }
    })
    .await
    .unwrap();
    let unrouted = pod_gauge(&cluster.http, &router_url, "kvsight_router_unrouted", &a)
        .await
        .unwrap();

    // kvsight: every new request goes to pod 1.
    let user = |n: usize| {
        json!({
            "model": MODEL, "prompt": format!("User question {n}: what is a KV cache?"),
            "max_tokens": 4, "stream": true,
        })
    };
    let mut kv_ttft = Vec::new();
    for n in 0..5 {
        let r = cluster.post(0, "/v1/completions", &user(n)).await.unwrap();
        assert_ok(&r, "kvsight user request");
        assert_eq!(
            r.pod.as_deref(),
            Some(b.as_str()),
            "request {n}: {:?}; router's view now: {}",
            r.decision,
            router_view(&cluster, &b)
        );
        kv_ttft.push(r.ttfb);
    }

    // The blind half only means something while pod 0 is still full of hidden work.
    let c0 = cluster.pod_counters(0).await.unwrap();
    assert_eq!(
        c0.running as usize,
        SLOTS,
        "the hidden generations ended before the blind half began ({:?} after they started): \
         the machine is too slow for this test's timing",
        hidden_started.elapsed()
    );
    let blind = BlindRouter::new(
        cluster.pods.iter().map(|p| p.vllm_url()).collect(),
        BlindMode::LeastRequest,
    )
    .unwrap();
    let mut blind_ttft = Vec::new();
    for n in 0..3 {
        let (i, r) = blind.post("/v1/completions", &user(100 + n)).await.unwrap();
        assert_ok(&r, "blind user request");
        assert_eq!(
            i, 0,
            "a least-request balancer with nothing in flight picks its first pod"
        );
        blind_ttft.push(r.ttfb);
    }
    while let Some(done) = hidden.join_next().await {
        assert_ok(&done.unwrap().unwrap(), "hidden generation");
    }

    let kv_max = kv_ttft.iter().max().copied().unwrap();
    eprintln!(
        "exec_load: unrouted(pod-0)={unrouted}; kvsight: 5/5 to pod-1, TTFT max {kv_max:?} \
         ({kv_ttft:?}); blind least-request: 3/3 to pod-0, TTFT {blind_ttft:?}"
    );
    // The first blind user waited for a hidden generation to free a slot (seconds); kvsight's
    // users started at once on the idle pod (milliseconds). A 1 s floor and a 4x ratio leave
    // room for a noisy machine on both sides.
    assert!(
        blind_ttft[0] >= Duration::from_secs(1),
        "blind TTFT {blind_ttft:?}"
    );
    assert!(
        blind_ttft[0] > kv_max * 4,
        "blind {blind_ttft:?} vs kvsight {kv_ttft:?}"
    );
    cluster.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// 2. cold pod

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_pod_gets_no_user_until_warm_while_blind_users_hit_the_stall() {
    if own_tokenizer_or_skip("cold_pod_gets_no_user_until_warm_while_blind_users_hit_the_stall")
        .is_none()
    {
        return;
    }
    // Every step runs at a tenth of its cost; a first-seen shape bucket stalls 1.5 s of real time.
    const SCALE: f64 = 0.1;
    const STALL: Duration = Duration::from_millis(1500);
    // Users send 40-token prompts: prefill bucket 64, then decode bucket 1. The warm-up plan
    // sends the same shape, so it pays both stalls before the pod reports Ready.
    const PROMPT: usize = 40;
    let cold_engine = |seed: u64| {
        engine(
            EngineConfig::builder()
                .time_scale(SCALE)
                .compile_stall(STALL.div_f64(SCALE))
                .seed(seed),
        )
    };
    let warm = engine(
        EngineConfig::builder()
            .time_scale(SCALE)
            .compile_stall(Duration::ZERO),
    );
    let mut cluster = start(config(vec![PodSpec::new("pod-0", MODEL, warm).unwrap()])).await;
    let warm_key = cluster.pods[0].key();
    // Distinct from the first block on, so no prefix-cache hit shrinks a prefill into a new
    // (stalling) bucket.
    let user = |n: u64| {
        json!({
            "model": MODEL, "prompt": token_ids(1_000 + n, PROMPT), "max_tokens": 4, "stream": true,
        })
    };

    let mut spec = PodSpec::new("pod-1", MODEL, cold_engine(1)).unwrap();
    spec.warmup = Warmup::Plan(
        json!([{"prompt_tokens": PROMPT, "max_tokens": 4, "concurrency": 1}]).to_string(),
    );
    let joined = Instant::now();
    let cold = cluster.add_pod(spec).await.unwrap();
    let cold_key = cluster.pods[cold].key();
    let ready_url = format!("{}/ready", cluster.pods[cold].sidecar().url());

    // Users keep arriving (every 100 ms) while pod 1 warms up.
    let mut pace = tokio::time::interval(Duration::from_millis(100));
    let mut kv_ttft = Vec::new();
    let (mut during, mut ready_503) = (0u64, 0u32);
    while !cluster.routers[0].routable(&cold_key) {
        assert!(
            joined.elapsed() < WAIT,
            "pod-1 not routable after {WAIT:?}: {}",
            router_view(&cluster, &cold_key)
        );
        pace.tick().await;
        let ready = cluster.http.get(&ready_url).send().await.unwrap().status();
        let r = cluster
            .post(0, "/v1/completions", &user(during))
            .await
            .unwrap();
        assert_ok(&r, "user request during warm-up");
        // Phases only move forward here (Starting, Warming, Ready): read after the fact, a phase
        // that is not yet Ready was not Ready when the router picked or `/ready` answered.
        let phase = cluster.pods[cold].sidecar().phase();
        if phase != Phase::Ready {
            assert_eq!(ready.as_u16(), 503, "/ready while {phase:?}");
            ready_503 += 1;
            assert_eq!(
                r.pod.as_deref(),
                Some(warm_key.as_str()),
                "a user request reached pod-1 while its sidecar was {phase:?}"
            );
        }
        kv_ttft.push(r.ttfb);
        during += 1;
    }
    let warm_up = joined.elapsed();
    // Now both pods take users; pod 1 must serve some (LRU alternates idle pods).
    let mut on_cold = 0;
    for n in 0..6 {
        pace.tick().await;
        let r = cluster
            .post(0, "/v1/completions", &user(500 + n))
            .await
            .unwrap();
        assert_ok(&r, "user request after warm-up");
        on_cold += usize::from(r.pod.as_deref() == Some(cold_key.as_str()));
        kv_ttft.push(r.ttfb);
    }

    // Blind: round robin over the warm pod and a fresh pod of the same engine, not warmed.
    let unwarmed = SimPod::start(SimConfig {
        engine: cold_engine(2),
        served_model_names: vec![MODEL.to_owned()],
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let blind = BlindRouter::new(
        vec![cluster.pods[0].vllm_url(), unwarmed.base_url()],
        BlindMode::RoundRobin,
    )
    .unwrap();
    let mut blind_cold_ttft = Vec::new();
    for n in 0..4 {
        let (i, r) = blind.post("/v1/completions", &user(900 + n)).await.unwrap();
        assert_ok(&r, "blind user request");
        if i == 1 {
            blind_cold_ttft.push(r.ttfb);
        }
    }
    unwarmed.shutdown(Duration::from_secs(2)).await;

    let kv_max = kv_ttft.iter().max().copied().unwrap();
    let blind_max = blind_cold_ttft.iter().max().copied().unwrap();
    eprintln!(
        "cold_pod: warm-up to routable {warm_up:?}; {during} user requests during it, all on \
         pod-0, /ready 503 on {ready_503} checks; after: {on_cold}/6 on pod-1; kvsight TTFT max \
         {kv_max:?} over {} requests; blind round robin on the un-warmed pod: TTFT {:?}",
        kv_ttft.len(),
        blind_cold_ttft
    );
    assert!(ready_503 >= 1, "never saw /ready 503 during warm-up");
    // The warm-up paid both stalls (prefill and decode shape) before Ready.
    assert!(warm_up >= STALL * 2, "warm-up took only {warm_up:?}");
    assert!(on_cold >= 1, "pod-1 got no user after it was Ready");
    // A stall is a sleep, never shorter: the blind user waits at least that long.
    assert!(blind_max >= STALL, "blind TTFT {blind_cold_ttft:?}");
    assert!(kv_max < STALL / 2, "kvsight TTFT max {kv_max:?}");
    cluster.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// 3. long prompts and KV

/// Scorer weights that make cache affinity the only preference, so the KV filter is the only
/// thing that can send a prompt elsewhere.
const AFFINITY_WEIGHTS: &str = "{prefix: 10, queue: 0, kvCache: 0, runningRequests: 0, \
                                loraAffinity: 0, predictedLatency: 0, lru: 0}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_kv_filter_avoids_the_preemptions_prefix_affinity_causes() {
    if own_tokenizer_or_skip("long_prompts_kv_filter_avoids_the_preemptions_prefix_affinity_causes")
        .is_none()
    {
        return;
    }
    // 256 usable blocks of 16 tokens per pod. Each prompt: 20 shared prefix blocks + 36 own
    // blocks (896 tokens), then 128 output tokens (8 more blocks). Six at once on one pod: the
    // prompts fit (20 + 6*36 = 236 blocks) but their growth does not (+48 > 20 free): preemptions.
    // kvsight projects 56/257, then +36/257 per prompt sharing the prefix: the sixth would reach
    // 0.918 > 0.9, so it goes to the other pod, and five grow within 200 + 40 = 240 blocks.
    const BLOCKS: usize = 257;
    const PREFIX: usize = 320;
    const OWN: usize = 576;
    const OUTPUT: usize = 128;
    const N: u64 = 6;
    const SLOTS: usize = 8;
    let specs = two_pods(|b| {
        b.num_gpu_blocks(BLOCKS)
            .max_num_seqs(SLOTS)
            // Decoding the 128 tokens takes about 0.7 s: a burst that reached the pod spread
            // over less than that is concurrent there.
            .time_scale(0.5)
    });
    let kvsight_yaml = format!("scheduler:\n  weights: {AFFINITY_WEIGHTS}\n");
    let affinity_yaml = format!(
        "scheduler:\n  weights: {AFFINITY_WEIGHTS}\n  saturation: {{maxWaiting: 1000, \
         kvThreshold: 1.0}}\n"
    );
    let mut cfg = config(specs);
    cfg.router_yaml = kvsight_yaml;
    let mut cluster = start(cfg).await;

    // One burst: N concurrent prompts sharing a prefix (distinct per burst, so the second burst
    // finds nothing of the first in any cache).
    async fn burst(cluster: &Cluster, seed: u64) -> (Vec<String>, Vec<PodCounters>) {
        let before = cluster.all_counters().await.unwrap();
        let prefix = token_ids(seed, PREFIX);
        let posts = (0..N).map(|k| {
            let mut prompt = prefix.clone();
            prompt.extend(token_ids(seed * 1_000 + k + 1, OWN));
            let body = json!({
                "model": MODEL, "prompt": prompt, "max_tokens": OUTPUT, "ignore_eos": true,
            });
            async move { cluster.post(0, "/v1/completions", &body).await.unwrap() }
        });
        let routed = futures_util::future::join_all(posts).await;
        let pods = routed
            .iter()
            .map(|r| {
                assert_ok(r, "long prompt");
                r.pod.clone().unwrap_or_default()
            })
            .collect();
        (
            pods,
            cluster
                .counters_after(&before, N as f64, WAIT)
                .await
                .unwrap(),
        )
    }
    // The router's view of both pods' KV use back near zero before the next burst.
    async fn drained(cluster: &Cluster) {
        let state = std::sync::Arc::clone(&cluster.routers[0].state);
        eventually("both pods' KV to drain", WAIT, || {
            let idle = state
                .registry()
                .pods()
                .all(|p| p.projection().kv_usage < 0.05);
            async move { idle }
        })
        .await
        .unwrap();
    }

    let (kv_pods, kv_deltas) = burst(&cluster, 7).await;
    drained(&cluster).await;
    cluster.reload_router_config(&affinity_yaml).await.unwrap();
    let (aff_pods, aff_deltas) = burst(&cluster, 8).await;

    let count = |pods: &[String], i: usize| {
        let key = cluster.pods[i].key();
        pods.iter().filter(|p| **p == key).count()
    };
    let preempted = |d: &[PodCounters]| d.iter().map(|d| d.preemptions).collect::<Vec<_>>();
    eprintln!(
        "long_prompts: kvsight (kvThreshold 0.9): pods {}/{} preemptions {:?}; pure affinity \
         (kvThreshold 1.0): pods {}/{} preemptions {:?}",
        count(&kv_pods, 0),
        count(&kv_pods, 1),
        preempted(&kv_deltas),
        count(&aff_pods, 0),
        count(&aff_pods, 1),
        preempted(&aff_deltas),
    );
    // Seen once in 14 parallel runs: all six on pod 0. Suspected cause: a load report arriving
    // mid-burst drops the router's record of prompts sent before `sampled_at` although the
    // engine had not admitted them yet (router/src/pods.rs `apply_load`), so the projection
    // forgets their blocks.
    assert!(
        kv_deltas.iter().all(|d| d.preemptions == 0.0),
        "kvsight: pods {kv_pods:?}, preemptions {:?}",
        preempted(&kv_deltas)
    );
    assert!(
        count(&kv_pods, 0).min(count(&kv_pods, 1)) >= 1,
        "kvsight kept every prompt on one pod: {kv_pods:?}"
    );
    assert!(
        aff_pods.iter().all(|p| *p == aff_pods[0]),
        "pure affinity should pile the burst on one pod: {aff_pods:?}"
    );
    assert!(
        aff_deltas.iter().map(|d| d.preemptions).sum::<f64>() >= 1.0,
        "pure affinity caused no preemption: {:?}",
        preempted(&aff_deltas)
    );
    cluster.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// 8. prefix caching off

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_caching_off_spreads_what_caching_pods_concentrate() {
    if own_tokenizer_or_skip("prefix_caching_off_spreads_what_caching_pods_concentrate").is_none() {
        return;
    }
    const BATCH: usize = 12;
    // Per pod: requests its engine finished during the batch; and whether every decision said
    // least-request scoring.
    async fn run(caching: bool) -> (Vec<f64>, bool) {
        let specs = two_pods(|b| b.enable_prefix_caching(caching).time_scale(0.1));
        let cluster = start(config(specs)).await;
        cluster.wait_tokenizer(MODEL, WAIT).await.unwrap();
        let before = cluster.all_counters().await.unwrap();
        let mut least_request = true;
        for n in 0..BATCH {
            let body = json!({
                "model": MODEL, "prompt": kvsight_testbed::demo::shared_prompt(n),
                "max_tokens": 4, "temperature": 0,
            });
            let r = cluster.post(0, "/v1/completions", &body).await.unwrap();
            assert_ok(&r, "shared-prefix request");
            least_request &= r
                .decision
                .as_ref()
                .and_then(|d| d["least_request"].as_bool())
                .unwrap_or(false);
        }
        let deltas = cluster
            .counters_after(&before, BATCH as f64, WAIT)
            .await
            .unwrap();
        cluster.shutdown().await;
        (deltas.iter().map(|d| d.requests).collect(), least_request)
    }

    let (off, off_lr) = run(false).await;
    let (on, on_lr) = run(true).await;
    eprintln!(
        "prefix_caching_off: {BATCH} serial shared-prefix requests per pod: caching off {off:?} \
         (least-request scoring: {off_lr}), caching on {on:?} (least-request: {on_lr})"
    );
    assert!(
        off_lr,
        "caching off: not every decision used least-request scoring"
    );
    assert!(!on_lr, "caching on: least-request scoring was used");
    assert!(
        off.iter().all(|&n| n >= (BATCH / 4) as f64),
        "caching off should spread: {off:?}"
    );
    assert!(
        on.contains(&(BATCH as f64)),
        "caching on should concentrate: {on:?}"
    );
}
