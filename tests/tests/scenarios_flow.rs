//! Scenario tests of request flow through kvsight on a loopback cluster (scenarios 4, 5, 6 and
//! 10 of docs/bench/README.md's table), each compared with what a router without kvsight's
//! signals would do:
//!
//! - **long/short pools**: a prompt over the short pool's window is answered by the long pool
//!   (one hop, counted in `kvsight_router_retries_total`), also when only the engine's own 400
//!   reveals it; a prompt over every window gets vLLM's own 400; short requests in a split pool
//!   never wait behind a long prefill, unlike behind a blind round-robin over the same pods.
//! - **timeout chain**: `timeouts.requestSeconds` cuts a stream with an SSE error event (no
//!   made-up `finish_reason`) and a non-streamed request with a 504, and no engine ever receives a
//!   second copy — where a client talking to vLLM directly would wait for the whole generation.
//! - **scale-up under keep-alive**: one client on one reused HTTP/1 connection reaches a pod added
//!   while it sends, within a second of the pod becoming routable — while through a
//!   connection-level (L4) balancer the same kind of connection stays pinned to the pod it was
//!   given first and the new pod gets none of its requests.
//! - **two router replicas**: load sent through one replica is visible to the other within a
//!   report interval, which then routes new work away from the busy pod — where a blind
//!   least-request balancer that only knows its own in-flight requests piles onto the first pod.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvsight_sim::engine::EngineConfig;
use kvsight_testbed::cluster::{
    BlindMode, BlindRouter, Cluster, ClusterConfig, L4Balancer, PodCounters, PodSpec, Routed, WAIT,
    decision_of, eventually, own_tokenizer_or_skip, post_json, send_json,
};
use serde_json::{Value, json};

const MODEL: &str = "scenario-model";

/// An engine without compile stalls (the pods skip warm-up, and a stall would add a random
/// half second to whichever request first hits a new batch shape).
fn engine(max_model_len: usize, time_scale: f64, seed: u64) -> EngineConfig {
    EngineConfig::builder()
        .max_model_len(max_model_len)
        .compile_stall(Duration::ZERO)
        .time_scale(time_scale)
        .seed(seed)
        .build()
        .unwrap()
}

fn pod(name: &str, engine: EngineConfig) -> PodSpec {
    PodSpec::new(name, MODEL, engine).unwrap()
}

/// Sidecar load reports every 200 ms: slow enough that four clusters in parallel on 2 cores
/// keep up, fast enough that the replicas scenario sees load within one interval.
const REPORT_INTERVAL: Duration = Duration::from_millis(200);

fn config(pods: Vec<PodSpec>) -> ClusterConfig {
    let mut cfg = ClusterConfig::new(pods);
    cfg.scrape_interval = REPORT_INTERVAL;
    cfg
}

/// The body of `GET path` on router `r`'s admin listener.
async fn router_get(cluster: &Cluster, r: usize, path: &str) -> String {
    kvsight_harness::http::get_text(
        &cluster.http,
        &format!("{}{path}", cluster.routers[r].admin_url()),
    )
    .await
}

/// Sum of a router metric's samples whose labels include every `(key, value)` of `labels`.
async fn router_metric(cluster: &Cluster, r: usize, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = router_get(cluster, r, "/metrics").await;
    kvsight_sidecar::scrape::samples(&text)
        .unwrap()
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            labels
                .iter()
                .all(|(k, v)| s.labels.get(k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .sum()
}

/// Engine-counted requests (any finish reason, aborts included) of every pod since `before`.
async fn requests_since(cluster: &Cluster, before: &[PodCounters]) -> Vec<f64> {
    let now = cluster.all_counters().await.unwrap();
    now.iter()
        .zip(before)
        .map(|(a, b)| a.since(b).requests)
        .collect()
}

/// Starts a cluster and returns once every pod is routable and every router routes in exact
/// mode.
async fn start(cfg: ClusterConfig) -> Cluster {
    let cluster = Cluster::start(cfg).await.unwrap();
    cluster.wait_all_routable(WAIT).await.unwrap();
    // Exact prefix mode and exact prompt lengths.
    cluster.wait_tokenizer(MODEL, WAIT).await.unwrap();
    cluster
}

/// Prompt tokens of `text` as a completion (special tokens added), by the router's `/tokenize`.
async fn count_tokens(cluster: &Cluster, text: &str) -> usize {
    let r = cluster
        .post(0, "/tokenize", &json!({"model": MODEL, "prompt": text}))
        .await
        .unwrap();
    let v: Value = serde_json::from_str(&r.text).unwrap();
    v["count"]
        .as_u64()
        .unwrap_or_else(|| panic!("/tokenize: {}", r.text)) as usize
}

/// A prompt of `copies` demo preambles (about 700 tokens each) under a line of its own, so no two
/// prompts with different `n` share a cached block.
fn long_prompt(n: usize, copies: usize) -> String {
    let mut s = format!("Ticket {n} (unique {}):\n", n * 7919 % 10007);
    for _ in 0..copies {
        s.push_str(&kvsight_testbed::demo::preamble());
    }
    s
}

fn short_prompt(tag: &str, n: usize) -> String {
    format!("{tag} request {n}: name one colour of the sky at dusk.")
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// A response still streaming, kept open so its request keeps running on its pod.
struct OpenStream {
    pod: String,
    _resp: reqwest::Response,
}

/// POSTs a streamed completion to `url` and returns once its first event arrived (the engine has
/// prefilled it and it is running); the router's choice comes from the decision header.
async fn open_stream(http: &reqwest::Client, url: &str, body: &Value) -> OpenStream {
    let mut resp = send_json(http, url, body).await.unwrap();
    assert_eq!(resp.status(), 200);
    let decision = decision_of(&resp).expect("a decision header");
    let pod = decision["pod"].as_str().unwrap().to_owned();
    let first = tokio::time::timeout(WAIT, resp.chunk())
        .await
        .expect("the first event in time")
        .unwrap();
    assert!(first.is_some(), "the stream ended before its first event");
    OpenStream { pod, _resp: resp }
}

// ---------------------------------------------------------------------------------------------
// Scenario 4: long/short pools.

const POOLS_YAML: &str = "\
pools:
  - name: short
    models: [scenario-model]
    podSelector: {pool: short}
    contextWindow: 1024
    fallback: long
  - name: long
    models: [scenario-model]
    podSelector: {pool: long}
";

/// Both pods in one pool: long prompts still fit only the long pod, short ones go anywhere.
const MIXED_YAML: &str = "\
pools:
  - name: mixed
    models: [scenario-model]
";

/// Short requests measured per phase; long senders running beside them.
const SHORTS: usize = 12;
const LONG_SENDERS: usize = 1;
/// A short request slower than this waited behind a long prefill step (a long prompt's prefill
/// step takes about 0.7 s at this prefill rate; an unobstructed short request about 50 ms).
const WAITED: Duration = Duration::from_millis(200);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_short_pools_fall_back_once_and_keep_short_requests_off_long_prefills() {
    if own_tokenizer_or_skip(
        "long_short_pools_fall_back_once_and_keep_short_requests_off_long_prefills",
    )
    .is_none()
    {
        return;
    }
    let started = Instant::now();
    // Prefill at 2,000 tokens/s so a long prompt's prefill step is long enough to be seen.
    let slow_prefill = |len, seed| {
        let mut e = engine(len, 1.0, seed);
        e.cost.prefill_tokens_per_s = 2_000.0;
        e
    };
    let mut cfg = config(vec![
        pod("pod-0", slow_prefill(1024, 0)).label("pool", "short"),
        pod("pod-1", slow_prefill(4096, 1)).label("pool", "long"),
    ]);
    cfg.router_yaml = POOLS_YAML.to_owned();
    let mut cluster = start(cfg).await;
    let long_key = cluster.pods[1].key();

    let over_short = long_prompt(1, 2);
    let over_all = long_prompt(2, 7);
    let over_short_len = count_tokens(&cluster, &over_short).await;
    let over_all_len = count_tokens(&cluster, &over_all).await;
    assert!(
        (1024..4096).contains(&over_short_len),
        "{over_short_len} tokens"
    );
    assert!(over_all_len > 4096, "{over_all_len} tokens");
    let retries = |reason: &'static str| {
        let c = &cluster;
        async move { router_metric(c, 0, "kvsight_router_retries_total", &[("reason", reason)]).await }
    };

    // (a) Over the short window, counted by the router: it hops to the long pool before any pod
    // sees the prompt.
    let before = cluster.all_counters().await.unwrap();
    let r = cluster
        .post(
            0,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": over_short, "max_tokens": 2}),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.pod.as_deref(), Some(long_key.as_str()));
    assert_eq!(retries("too_long_direct").await, 1.0);
    assert_eq!(retries("context_fallback").await, 0.0);

    // (b) A batch whose first prompt fits the short pool but whose second does not: the router
    // routes a batch on its first element, so the short pod gets it and only vLLM's own
    // context-length 400 reveals it does not fit; the router resends it once to the fallback
    // pool before any byte reached the client.
    let r = cluster
        .post(
            0,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": ["Name one colour.", long_prompt(3, 2)],
                    "max_tokens": 2}),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.pod.as_deref(), Some(long_key.as_str()));
    assert_eq!(retries("context_fallback").await, 1.0);
    assert_eq!(retries("too_long_direct").await, 1.0);
    let served = requests_since(&cluster, &before).await;
    assert_eq!(
        served,
        [0.0, 3.0],
        "the short pod refuses before any work; the long one served (a) and both prompts of (b)"
    );

    // (c) Over every window: vLLM's own 400, in its own words, after exactly one hop.
    let r = cluster
        .post(
            0,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": over_all, "max_tokens": 2}),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 400, "{}", r.text);
    let err: Value = serde_json::from_str(&r.text).unwrap();
    let want = format!(
        "This model's maximum context length is 4096 tokens. However, your prompt contains \
         {over_all_len} input tokens, which exceeds this limit even without any output tokens. \
         Please reduce the length of the input prompt. (parameter=input_tokens, \
         value={over_all_len})"
    );
    assert_eq!(
        err,
        json!({"error": {"message": want, "type": "BadRequestError", "param": "input_tokens",
                         "code": 400}})
    );
    assert_eq!(retries("too_long_direct").await, 2.0);
    assert_eq!(retries("context_fallback").await, 1.0);

    // (d) Short-request latency while long prompts stream into the long pod, three ways.
    let split = short_latencies(&cluster, Shorts::Router, "split").await;
    let blind = BlindRouter::new(
        cluster.pods.iter().map(|p| p.vllm_url()).collect(),
        BlindMode::RoundRobin,
    )
    .unwrap();
    let blind = short_latencies(&cluster, Shorts::Blind(&blind), "blind").await;
    cluster.reload_router_config(MIXED_YAML).await.unwrap();
    let mixed = short_latencies(&cluster, Shorts::Router, "mixed").await;
    for (name, p) in [
        ("split pools (kvsight)", &split),
        ("one mixed pool (kvsight)", &mixed),
        ("one mixed pool (blind round-robin)", &blind),
    ] {
        eprintln!(
            "pools: {name}: short requests p50 {:?} p99 {:?}, {} of {SHORTS} on the long pod, {} \
             waited > {WAITED:?}; {} long prompts served beside them",
            percentile(&p.latencies, 0.5),
            percentile(&p.latencies, 0.99),
            p.on_long,
            p.waited,
            p.longs,
        );
    }
    assert_eq!(
        split.on_long, 0,
        "split pools keep short requests off {long_key}"
    );
    assert!(split.longs >= 1 && blind.longs >= 1 && mixed.longs >= 1);
    assert!(
        blind.waited >= 2,
        "the blind baseline must show the effect: {} waited",
        blind.waited
    );
    assert!(
        split.waited < blind.waited,
        "split: {} short requests waited behind a long prefill, blind: {}",
        split.waited,
        blind.waited
    );
    eprintln!("pools: scenario took {:?}", started.elapsed());
    cluster.shutdown().await;
}

/// How the short requests of a phase are sent.
enum Shorts<'a> {
    Router,
    Blind(&'a BlindRouter),
}

struct Phase {
    latencies: Vec<Duration>,
    /// Short requests that ran on the long pod.
    on_long: usize,
    /// Short requests slower than [`WAITED`].
    waited: usize,
    /// Long prompts completed meanwhile.
    longs: usize,
}

/// Sends [`SHORTS`] serial short requests while [`LONG_SENDERS`] tasks keep long prompts flowing
/// through router 0 (they fit only the long pod, in both configs).
async fn short_latencies(cluster: &Cluster, how: Shorts<'_>, tag: &str) -> Phase {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let url = format!("{}/v1/completions", cluster.routers[0].url());
    let mut senders = Vec::new();
    for s in 0..LONG_SENDERS {
        let (stop, done, url, http) = (
            stop.clone(),
            done.clone(),
            url.clone(),
            cluster.http.clone(),
        );
        let tag = tag.to_owned();
        senders.push(tokio::spawn(async move {
            // Bounded: at most 50 prompts or 60 s per sender.
            let until = Instant::now() + Duration::from_secs(60);
            for n in 0..50 {
                if stop.load(Ordering::Relaxed) || Instant::now() > until {
                    break;
                }
                let prompt = format!("{tag} {s}: {}", long_prompt(100 * s + n + 10, 2));
                let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
                let r = post_json(&http, &url, &body).await.unwrap();
                assert_eq!(r.status, 200, "{tag} long {n} on {:?}: {}", r.pod, r.text);
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    // Start measuring once long prompts flow. (Not from the pod's `num_requests_running`: the
    // simulator refreshes it after a step's outcome, so a one-token request is never seen.)
    eventually("a long prompt to complete", WAIT, || {
        let n = done.load(Ordering::Relaxed);
        async move { n >= 1 }
    })
    .await
    .unwrap();
    let long_key = cluster.pods[1].key();
    let mut latencies = Vec::new();
    let mut on_long = 0;
    for n in 0..SHORTS {
        let body = json!({"model": MODEL, "prompt": short_prompt(tag, n), "max_tokens": 2});
        let (pod, r): (bool, Routed) = match how {
            Shorts::Router => {
                let r = cluster.post(0, "/v1/completions", &body).await.unwrap();
                (r.pod.as_deref() == Some(long_key.as_str()), r)
            }
            Shorts::Blind(b) => {
                let (i, r) = b.post("/v1/completions", &body).await.unwrap();
                (i == 1, r)
            }
        };
        assert_eq!(r.status, 200, "{}", r.text);
        on_long += usize::from(pod);
        latencies.push(r.total);
    }
    stop.store(true, Ordering::Relaxed);
    for s in senders {
        s.await.unwrap();
    }
    latencies.sort();
    Phase {
        waited: latencies.iter().filter(|d| **d > WAITED).count(),
        latencies,
        on_long,
        longs: done.load(Ordering::Relaxed),
    }
}

// ---------------------------------------------------------------------------------------------
// Scenario 5: timeout chain.

/// The router's one deadline; the generation below takes about ten times longer.
const DEADLINE: Duration = Duration::from_secs(1);
/// 1,000 tokens at 10 ms per decode step (time scale 1): about 10 s.
const SLOW_MAX_TOKENS: u32 = 1000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_deadline_cuts_streams_and_answers_504_without_resending() {
    if own_tokenizer_or_skip("request_deadline_cuts_streams_and_answers_504_without_resending")
        .is_none()
    {
        return;
    }
    let started = Instant::now();
    // Two pods, so a resend would have somewhere to go.
    let mut cfg = config(vec![
        pod("pod-0", engine(4096, 1.0, 0)),
        pod("pod-1", engine(4096, 1.0, 1)),
    ]);
    cfg.router_yaml = format!("timeouts: {{requestSeconds: {}}}\n", DEADLINE.as_secs_f64());
    let cluster = start(cfg).await;
    let before = cluster.all_counters().await.unwrap();

    let body = |prompt: &str, stream: bool| json!({"model": MODEL, "prompt": prompt, "max_tokens": SLOW_MAX_TOKENS, "stream": stream});
    let stream_body = body("Tell a very long story about a lighthouse keeper.", true);
    let plain_body = body("Tell a very long story about a mountain guide.", false);
    let (streamed, plain) = tokio::join!(
        cluster.post(0, "/v1/completions", &stream_body),
        cluster.post(0, "/v1/completions", &plain_body),
    );
    let (streamed, plain) = (streamed.unwrap(), plain.unwrap());
    eprintln!(
        "timeout: deadline {DEADLINE:?}; streamed request ended after {:?} (first event {:?}), \
         non-streamed after {:?}; the whole generation would take about 10 s",
        streamed.total, streamed.ttfb, plain.total
    );

    // The stream: tokens, then one error event and [DONE]; no event claims the answer finished.
    assert_eq!(streamed.status, 200, "{}", streamed.text);
    let events: Vec<&str> = streamed
        .text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .collect();
    assert!(events.iter().all(|e| e.starts_with("data: ")), "{events:?}");
    assert_eq!(events.last().copied(), Some("data: [DONE]"));
    assert!(
        events.len() >= 3,
        "tokens, the error event and [DONE]: {events:?}"
    );
    let datas: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(&e["data: ".len()..]).unwrap())
        .collect();
    let (error, tokens) = datas.split_last().unwrap();
    assert_eq!(error["error"]["code"], 504, "{error}");
    assert_eq!(error["error"]["type"], "GatewayTimeoutError", "{error}");
    assert!(error["error"]["message"].is_string(), "{error}");
    assert!(
        !tokens.is_empty(),
        "some tokens streamed before the deadline"
    );
    for t in tokens {
        assert!(t.get("error").is_none(), "one error event only: {t}");
        for c in t["choices"].as_array().unwrap() {
            assert!(c["finish_reason"].is_null(), "a made-up finish_reason: {t}");
        }
    }

    // The non-streamed request: a 504 in vLLM's error shape.
    assert_eq!(plain.status, 504, "{}", plain.text);
    let err: Value = serde_json::from_str(&plain.text).unwrap();
    let e = err["error"].as_object().unwrap();
    assert_eq!(
        e.keys().map(String::as_str).collect::<Vec<_>>(),
        ["message", "type", "param", "code"]
    );
    assert_eq!(err["error"]["type"], "GatewayTimeoutError");
    assert_eq!(err["error"]["code"], 504);
    assert!(err["error"]["param"].is_null());

    // Both ended at the deadline, not at the generation's end (generous: noisy machine).
    for r in [&streamed, &plain] {
        assert!(
            r.total >= DEADLINE,
            "ended before the deadline: {:?}",
            r.total
        );
        assert!(
            r.total < DEADLINE * 5,
            "the deadline did not cut it: {:?}",
            r.total
        );
    }

    // The engines abort what the router dropped (counted as finished with reason `abort`): once
    // nothing runs or waits anywhere, exactly two requests reached the engines — one copy each.
    eventually("the engines to abort both requests", WAIT, || async {
        let now = cluster.all_counters().await.unwrap();
        let total: f64 = now
            .iter()
            .zip(&before)
            .map(|(a, b)| a.since(b).requests)
            .sum();
        total >= 2.0 && now.iter().all(|c| c.running + c.waiting == 0.0)
    })
    .await
    .unwrap();
    let per_pod = requests_since(&cluster, &before).await;
    assert_eq!(
        per_pod.iter().sum::<f64>(),
        2.0,
        "requests per pod: {per_pod:?}"
    );
    let metric = |name: &'static str, labels: &'static [(&'static str, &'static str)]| {
        let c = &cluster;
        async move { router_metric(c, 0, name, labels).await }
    };
    assert_eq!(metric("kvsight_router_retries_total", &[]).await, 0.0);
    assert_eq!(
        metric(
            "kvsight_router_stream_cuts_total",
            &[("reason", "deadline")]
        )
        .await,
        1.0
    );
    assert_eq!(
        metric("kvsight_router_requests_total", &[("code", "504")]).await,
        1.0
    );
    eprintln!("timeout: scenario took {:?}", started.elapsed());
    cluster.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Scenario 6: scale-up under keep-alive.

/// An HTTP/1.1 client on exactly one TCP connection, as a client with a keep-alive pool of one
/// behaves: every request reuses it, and a server closing it fails the next request. (reqwest's
/// pool may open a second connection when a request follows a response too closely, before the
/// first connection is back in the pool, so it cannot prove "one connection".)
struct OneConnection {
    stream: tokio::io::BufReader<tokio::net::TcpStream>,
    host: String,
}

impl OneConnection {
    async fn connect(addr: std::net::SocketAddr) -> OneConnection {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        OneConnection {
            stream: tokio::io::BufReader::new(stream),
            host: addr.to_string(),
        }
    }

    /// POSTs JSON asking for the decision header; returns the status and the chosen pod.
    async fn post(&mut self, path: &str, body: &Value) -> (u16, Option<String>) {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        let body = body.to_string();
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
             x-kvsight-debug: 1\r\ncontent-length: {}\r\n\r\n",
            self.host,
            body.len()
        );
        let s = self.stream.get_mut();
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(body.as_bytes()).await.unwrap();
        let mut status = 0;
        let mut len = None;
        let mut pod = None;
        // Bounded: a response head of at most 100 lines.
        for i in 0..100 {
            let mut line = String::new();
            let n = self.stream.read_line(&mut line).await.unwrap();
            assert!(n > 0, "the server closed the kept-alive connection");
            let line = line.trim_end();
            if i == 0 {
                status = line.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap();
                continue;
            }
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').unwrap();
            let value = value.trim();
            match name.to_ascii_lowercase().as_str() {
                "content-length" => len = value.parse::<usize>().ok(),
                "transfer-encoding" => panic!("expected a sized body, got {value}"),
                "connection" if value.eq_ignore_ascii_case("close") => {
                    panic!("the server asked to close the connection")
                }
                "x-kvsight-decision" => {
                    let d: Value = serde_json::from_str(value).unwrap();
                    pod = d["pod"].as_str().map(str::to_owned);
                }
                _ => {}
            }
        }
        let mut rest = vec![0; len.expect("a content-length")];
        self.stream.read_exact(&mut rest).await.unwrap();
        (status, pod)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_client_reaches_a_pod_added_while_it_sends() {
    if own_tokenizer_or_skip("keep_alive_client_reaches_a_pod_added_while_it_sends").is_none() {
        return;
    }
    let started = Instant::now();
    let mut cluster = start(config(vec![
        pod("pod-0", engine(4096, 0.1, 0)),
        pod("pod-1", engine(4096, 0.1, 1)),
    ]))
    .await;

    let mut client = OneConnection::connect(cluster.routers[0].http_addr).await;
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let sender = {
        let (stop, sent) = (stop.clone(), sent.clone());
        tokio::spawn(async move {
            let mut log: Vec<(Instant, String)> = Vec::new();
            let until = Instant::now() + Duration::from_secs(45);
            // Bounded in count and time; unique prompts so prefix affinity pins nothing.
            for n in 0..5000 {
                if stop.load(Ordering::Relaxed) || Instant::now() > until {
                    break;
                }
                let body = json!({"model": MODEL, "prompt": short_prompt("keep-alive", n),
                                  "max_tokens": 2});
                let (status, pod) = client.post("/v1/completions", &body).await;
                assert_eq!(status, 200);
                log.push((Instant::now(), pod.unwrap()));
                sent.fetch_add(1, Ordering::Relaxed);
            }
            log
        })
    };
    eventually("the client to send a few requests", WAIT, || {
        let n = sent.load(Ordering::Relaxed);
        async move { n >= 5 }
    })
    .await
    .unwrap();
    let new = cluster
        .add_pod(pod("pod-2", engine(4096, 0.1, 2)))
        .await
        .unwrap();
    let key = cluster.pods[new].key();
    let router = &cluster.routers[0];
    eventually("the router to see the new pod routable", WAIT, || {
        let ok = router.routable(&key);
        async move { ok }
    })
    .await
    .unwrap();
    let routable_at = Instant::now();
    let sent_then = sent.load(Ordering::Relaxed);
    // Keep sending a little past the new pod's first request, bounded.
    eventually(
        "the new pod to serve a request",
        Duration::from_secs(10),
        || async {
            cluster
                .pod_counters(new)
                .await
                .is_ok_and(|c| c.requests >= 1.0)
        },
    )
    .await
    .unwrap();
    stop.store(true, Ordering::Relaxed);
    let log = sender.await.unwrap();

    let first_new = log
        .iter()
        .find(|(_, p)| *p == key)
        .map(|(at, _)| *at)
        .expect("a request routed to the new pod");
    let delay = first_new.saturating_duration_since(routable_at);
    let after: Vec<&String> = log.iter().skip(sent_then).map(|(_, p)| p).collect();
    let on_new = after.iter().filter(|p| ***p == key).count();
    eprintln!(
        "scale-up: {} requests on one connection; first request answered by the new pod \
         {delay:?} after it became routable; {on_new} of the {} requests sent after that went to \
         it; scenario took {:?}",
        log.len(),
        after.len(),
        started.elapsed()
    );
    assert!(delay < Duration::from_secs(1), "{delay:?}");
    let mut pods: Vec<&String> = log.iter().map(|(_, p)| p).collect();
    pods.sort();
    pods.dedup();
    assert_eq!(
        pods.len(),
        3,
        "every pod served the one connection: {pods:?}"
    );

    // The blind behaviour: the same kind of client through a connection-level balancer over the
    // first two pods; the third joins its backends while the connection is open.
    let l4 = L4Balancer::start(vec![
        cluster.pods[0].vllm_addr(),
        cluster.pods[1].vllm_addr(),
    ])
    .await
    .unwrap();
    let mut client = OneConnection::connect(l4.addr()).await;
    let before = cluster.all_counters().await.unwrap();
    for n in 0..3 {
        let body = json!({"model": MODEL, "prompt": short_prompt("l4", n), "max_tokens": 2});
        assert_eq!(client.post("/v1/completions", &body).await.0, 200);
    }
    l4.add_target(cluster.pods[new].vllm_addr());
    for n in 3..12 {
        let body = json!({"model": MODEL, "prompt": short_prompt("l4", n), "max_tokens": 2});
        assert_eq!(client.post("/v1/completions", &body).await.0, 200);
    }
    let l4_counts: Vec<f64> = cluster
        .counters_after(&before, 12.0, WAIT)
        .await
        .unwrap()
        .iter()
        .map(|d| d.requests)
        .collect();
    eprintln!("scale-up, L4 balancer: requests per pod on the kept-alive connection {l4_counts:?}");
    assert_eq!(
        l4_counts[new], 0.0,
        "the L4 balancer never reaches the new pod: {l4_counts:?}"
    );
    assert!(
        l4_counts.contains(&12.0),
        "one pod took the whole connection: {l4_counts:?}"
    );
    cluster.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Scenario 10: two router replicas.

/// Long generations sent through router 0 (same prompt: prefix affinity keeps them together).
/// More than [`PROBES`]: a router counts its own requests sent since a pod's last report as
/// running there even once they finished, so serial probes inflate the idle pod's projection by
/// up to one per probe within a report interval.
const LONG_STREAMS: usize = 8;
/// Short requests then sent through router 1, one at a time.
const PROBES: usize = 6;

/// Pod key → `load.running` as router `r` reports it on `/debug/pods`.
async fn debug_running(cluster: &Cluster, r: usize) -> Vec<(String, u64)> {
    let text = router_get(cluster, r, "/debug/pods").await;
    let v: Value = serde_json::from_str(&text).unwrap();
    v["pods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["pod"].as_str().unwrap().to_owned(),
                p["load"]["running"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_router_sees_first_routers_load_and_routes_away() {
    if own_tokenizer_or_skip("second_router_sees_first_routers_load_and_routes_away").is_none() {
        return;
    }
    let started = Instant::now();
    let mut cfg = config(vec![
        pod("pod-0", engine(4096, 1.0, 0)),
        pod("pod-1", engine(4096, 1.0, 1)),
    ]);
    cfg.routers = 2;
    let report_interval = cfg.scrape_interval;
    let cluster = start(cfg).await;

    // Both replicas hold the same pods, all Ready.
    let keys = |r: usize| {
        let mut k: Vec<String> = cluster.routers[r]
            .state
            .registry()
            .pods()
            .map(|p| p.key.clone())
            .collect();
        k.sort();
        k
    };
    assert_eq!(keys(0), keys(1));
    assert_eq!(keys(0).len(), 2);
    for r in &cluster.routers {
        for p in &cluster.pods {
            assert!(
                r.routable(&p.key()),
                "router {} sees {} Ready",
                r.index,
                p.key()
            );
        }
    }

    // Long generations through router 0, each running before the next is sent.
    let url0 = format!("{}/v1/completions", cluster.routers[0].url());
    let prompt = long_prompt(0, 1);
    let mut streams = Vec::new();
    for _ in 0..LONG_STREAMS {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 3000, "stream": true});
        streams.push(open_stream(&cluster.http, &url0, &body).await);
    }
    let loaded_at = Instant::now();
    let placed = |key: &str| streams.iter().filter(|s| s.pod == key).count() as u64;
    let busy = (0..cluster.pods.len())
        .max_by_key(|&i| placed(&cluster.pods[i].key()))
        .unwrap();
    let busy_key = cluster.pods[busy].key();
    let idle_key = cluster.pods[1 - busy].key();
    assert!(
        placed(&busy_key) >= placed(&idle_key) + 2,
        "router 0 concentrated its shared-prefix streams: {} vs {}",
        placed(&busy_key),
        placed(&idle_key)
    );

    // Router 1 sent nothing, yet it sees what runs on each pod, from the pods' own reports.
    eventually("router 1 to see router 0's load", WAIT, || async {
        let seen = debug_running(&cluster, 1).await;
        seen.iter().all(|(k, n)| *n == placed(k))
    })
    .await
    .unwrap();
    let visible_after = loaded_at.elapsed();

    // New work through router 1 goes to the idle pod; a blind least-request balancer that knows
    // only its own in-flight requests breaks the tie towards the first pod.
    let mut kvsight_on_busy = 0;
    for n in 0..PROBES {
        let body = json!({"model": MODEL, "prompt": short_prompt("replica", n), "max_tokens": 2});
        let r = cluster.post(1, "/v1/completions", &body).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text);
        kvsight_on_busy += usize::from(r.pod.as_deref() == Some(busy_key.as_str()));
    }
    let blind = BlindRouter::new(
        cluster.pods.iter().map(|p| p.vllm_url()).collect(),
        BlindMode::LeastRequest,
    )
    .unwrap();
    let mut blind_on_busy = 0;
    for n in 0..PROBES {
        let body = json!({"model": MODEL, "prompt": short_prompt("blind", n), "max_tokens": 2});
        let (i, r) = blind.post("/v1/completions", &body).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text);
        blind_on_busy += usize::from(i == busy);
    }
    eprintln!(
        "replicas: {} streams via router 0 on {busy_key}, visible on router 1 after \
         {visible_after:?} (report interval {report_interval:?}); router 1 sent {kvsight_on_busy} \
         of {PROBES} new requests to the busy pod, blind least-request {blind_on_busy}; scenario \
         took {:?}",
        placed(&busy_key),
        started.elapsed()
    );
    assert!(
        visible_after < report_interval + Duration::from_secs(1),
        "{visible_after:?}"
    );
    assert_eq!(
        kvsight_on_busy, 0,
        "router 1 must route away from {busy_key}"
    );
    if busy == 0 {
        assert_eq!(
            blind_on_busy, PROBES,
            "the blind baseline piles onto the first pod"
        );
    }
    drop(streams);
    cluster.shutdown().await;
}
