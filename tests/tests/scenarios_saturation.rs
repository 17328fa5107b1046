//! 11. Saturation without collapse: a multi-tenant load past what the pods can serve.
//!
//! Tenants each have a long system prompt; the pods' caches hold some tenants each, the cluster
//! holds them all. Past saturation every pod has requests waiting. A router that then falls back
//! to the shortest queue (what a load-aware router without a cache view does;
//! docs/decisions/0002-saturation-in-time.md) sprays each tenant's prompts over
//! every pod: every pod must hold every tenant, caches thrash, every miss is a full prefill, and
//! the queues grow faster still. kvsight keeps each tenant where its cache is, skipping a loaded
//! pod only when a sibling would start the request sooner counting the prefill it must redo.
//!
//! Measured on the pods' own counters and the client's clock: kvsight's hit rate past saturation
//! stays near its unsaturated level, and its TTFT p90 beats the shortest queue's on the same
//! requests.

use std::time::Duration;

use kvsight_sim::engine::EngineConfig;
use kvsight_sim::own_tokenizer::{SeededRng, guidelines_preamble, question};
use kvsight_testbed::cluster::{
    BlindMode, BlindRouter, Cluster, ClusterConfig, PodCounters, PodSpec, WAIT,
    own_tokenizer_or_skip,
};
use serde_json::{Value, json};

const MODEL: &str = "scenario-model";
const PODS: usize = 4;
const TENANTS: usize = 12;
/// Requests per run; the same sequence for every router at a given rate.
const REQUESTS: usize = 160;
/// Arrival rates (requests per second): one the pods serve at ease, one past what they can.
const CALM: f64 = 10.0;
const SATURATED: f64 = 60.0;

/// Slow enough that a few concurrent requests fill a pod: 4 sequences, 15 ms decode steps,
/// 8k prefill tokens/s (a tenant's miss costs ~80 ms of prefill, a hit ~10 ms).
fn engine(seed: u64) -> EngineConfig {
    EngineConfig::builder()
        .compile_stall(Duration::ZERO)
        .max_num_seqs(4)
        .decode_base(Duration::from_millis(15))
        .prefill_tokens_per_s(8_000.0)
        // Half of the tenants' system prompts per pod (with room for the running requests).
        .num_gpu_blocks(400)
        .seed(seed)
        .build()
        .expect("a valid engine config")
}

/// One request per line: a tenant's system prompt, a question. Seeded: identical for every run.
fn requests() -> Vec<Value> {
    let systems: Vec<String> = (0..TENANTS)
        .map(|t| guidelines_preamble(30, 1000 + t as u64))
        .collect();
    let mut rng = SeededRng::new(42);
    (0..REQUESTS)
        .map(|_| {
            let t = rng.below(TENANTS);
            let prompt = format!("{}Tenant {t} asks: {}", systems[t], question(&mut rng));
            json!({"model": MODEL, "prompt": prompt, "max_tokens": 16, "ignore_eos": true,
                   "stream": true})
        })
        .collect()
}

/// Poisson arrival offsets at `rate` requests per second.
fn arrivals(rate: f64) -> Vec<Duration> {
    let mut rng = SeededRng::new(7);
    let mut t = 0.0f64;
    (0..REQUESTS)
        .map(|_| {
            let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            t += -(1.0 - u).ln() / rate;
            Duration::from_secs_f64(t)
        })
        .collect()
}

fn pod_urls(cluster: &Cluster) -> Vec<String> {
    cluster.pods.iter().map(|p| p.vllm_url()).collect()
}

/// The cluster's hit rate and the requests' TTFT p90 for one run.
struct Run {
    hit_rate: f64,
    ttft_p90: Duration,
    waited: bool,
}

async fn run(
    cluster: &Cluster,
    send: impl Fn(Value) -> tokio::task::JoinHandle<Duration>,
    rate: f64,
) -> Run {
    for p in &cluster.pods {
        let url = format!("{}/reset_prefix_cache", p.vllm_url());
        assert!(
            cluster
                .http
                .post(url)
                .send()
                .await
                .unwrap()
                .status()
                .is_success()
        );
    }
    let before = cluster.all_counters().await.unwrap();
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    // Whether at some point every pod had requests waiting (the load saturated the cluster),
    // watched on the engines' own gauges while the requests go out.
    let done = tokio_util::sync::CancellationToken::new();
    let watcher = {
        let (http, urls, done) = (cluster.http.clone(), pod_urls(cluster), done.clone());
        tokio::spawn(async move {
            while !done.is_cancelled() {
                let mut waiting = 0;
                for u in &urls {
                    let text =
                        kvsight_harness::http::get_text(&http, &format!("{u}/metrics")).await;
                    let c = kvsight_testbed::cluster::parse_counters(&text).unwrap();
                    waiting += usize::from(c.waiting > 0.0);
                }
                if waiting == urls.len() {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            false
        })
    };
    for (body, at) in requests().into_iter().zip(arrivals(rate)) {
        tokio::time::sleep_until(started + at).await;
        tasks.push(send(body));
    }
    let mut ttfts = Vec::new();
    for t in tasks {
        ttfts.push(t.await.unwrap());
    }
    done.cancel();
    let waited = watcher.await.unwrap();
    let after = cluster.all_counters().await.unwrap();
    let total =
        after
            .iter()
            .zip(&before)
            .map(|(a, b)| a.since(b))
            .fold(PodCounters::default(), |s, c| PodCounters {
                prefix_queries: s.prefix_queries + c.prefix_queries,
                prefix_hits: s.prefix_hits + c.prefix_hits,
                ..s
            });
    ttfts.sort();
    Run {
        hit_rate: total.hit_rate().unwrap_or(0.0),
        ttft_p90: ttfts[ttfts.len() * 9 / 10],
        waited,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_saturation_kvsight_keeps_its_hit_rate_and_beats_the_shortest_queue() {
    if own_tokenizer_or_skip(
        "past_saturation_kvsight_keeps_its_hit_rate_and_beats_the_shortest_queue",
    )
    .is_none()
    {
        return;
    }
    let pods = (0..PODS)
        .map(|i| PodSpec::new(&format!("pod-{i}"), MODEL, engine(i as u64)).unwrap())
        .collect();
    let mut cfg = ClusterConfig::new(pods);
    cfg.scrape_interval = Duration::from_millis(50);
    let cluster = Cluster::start(cfg).await.unwrap();
    cluster.wait_all_routable(WAIT).await.unwrap();
    cluster.wait_tokenizer(MODEL, WAIT).await.unwrap();
    let router = format!("{}/v1/completions", cluster.routers[0].url());
    let via_kvsight = |body: Value| {
        let (http, url) = (cluster.http.clone(), router.clone());
        tokio::spawn(async move {
            let r = kvsight_testbed::cluster::post_json(&http, &url, &body)
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", r.text);
            r.ttfb
        })
    };
    let shortest = std::sync::Arc::new(
        BlindRouter::new(pod_urls(&cluster), BlindMode::ShortestQueue).unwrap(),
    );
    let via_shortest_queue = |body: Value| {
        let b = shortest.clone();
        tokio::spawn(async move {
            let (_, r) = b.post("/v1/completions", &body).await.unwrap();
            assert_eq!(r.status, 200, "{}", r.text);
            r.ttfb
        })
    };

    let calm = run(&cluster, via_kvsight, CALM).await;
    let kvsight = run(&cluster, via_kvsight, SATURATED).await;
    let blind = run(&cluster, via_shortest_queue, SATURATED).await;
    println!(
        "saturation: kvsight at {CALM} req/s hit {:.2} TTFT p90 {:?}; at {SATURATED} req/s hit {:.2} TTFT p90 {:?} (every pod waiting at once: {}); shortest queue at {SATURATED} req/s hit {:.2} TTFT p90 {:?} (every pod waiting at once: {})",
        calm.hit_rate,
        calm.ttft_p90,
        kvsight.hit_rate,
        kvsight.ttft_p90,
        kvsight.waited,
        blind.hit_rate,
        blind.ttft_p90,
        blind.waited
    );
    assert!(
        kvsight.waited && blind.waited,
        "the load must saturate every pod for this to mean anything"
    );
    assert!(
        kvsight.hit_rate >= 0.85 * calm.hit_rate,
        "kvsight's hit rate past saturation ({:.2}) fell below 85 % of its unsaturated level ({:.2})",
        kvsight.hit_rate,
        calm.hit_rate
    );
    assert!(
        kvsight.hit_rate > blind.hit_rate + 0.1,
        "kvsight {:.2} vs shortest queue {:.2}",
        kvsight.hit_rate,
        blind.hit_rate
    );
    assert!(
        kvsight.ttft_p90 < blind.ttft_p90,
        "TTFT p90: kvsight {:?} vs shortest queue {:?}",
        kvsight.ttft_p90,
        blind.ttft_p90
    );
    cluster.shutdown().await;
}
