//! The whole sidecar ([`kvsight_sidecar::run_with`]) against vllm-sim over real loopback sockets:
//! HTTP, the ZMQ KV-event PUB and replay sockets, and QUIC to a test router. The sidecar is
//! configured exactly as in a pod (URLs and endpoints only); it does not know the engine is a
//! simulator. The simulator's engine is the ground truth: after a workload with evictions, a
//! dropped range of events, a sequence restart or an old wire layout, the sidecar's mirror must
//! hold exactly the engine's resident blocks and the router's filter must contain all of them.
//! Warm-up must absorb compile stalls before `/ready`, and facts and load must be the engine's.

use std::collections::BTreeSet;
use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvsight_harness::TempDir;
use kvsight_protocol::bloom::BloomFilter;
use kvsight_protocol::hash::{ChainSeed, hash_chain};
use kvsight_protocol::messages::*;
use kvsight_sidecar::config::{Args, Config};
use kvsight_sidecar::kv_events::subscriber::{SubscriberStatus, lock};
use kvsight_sidecar::state::Shared;
use kvsight_sidecar::{Listeners, run_with};
use kvsight_sim::engine::EngineConfig;
use kvsight_sim::kv_events::{Layout, ReplayLayout};
use kvsight_sim::server::{SimConfig, SimPod, SimPodHandle};
use kvsight_transport::dev_certs::{DevCa, SecretDir};
use kvsight_transport::{FramedRecv, FramedSend, TlsMaterial, server};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(15);

/// Polls `cond` until it holds, bounded by [`WAIT`]; for state without change notification.
async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + WAIT;
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A small engine: few blocks so a workload evicts, a fast clock, no compile stalls unless asked.
fn engine(num_gpu_blocks: usize) -> EngineConfig {
    EngineConfig::builder()
        .block_size(16)
        .num_gpu_blocks(num_gpu_blocks)
        .max_model_len(512)
        .compile_stall(Duration::ZERO)
        .time_scale(0.05)
        .build()
        .unwrap()
}

fn sim_config(engine: EngineConfig) -> SimConfig {
    SimConfig {
        engine,
        ..SimConfig::loopback_with_events()
    }
}

/// What the test router has built from the sidecar's snapshot and deltas.
#[derive(Default)]
struct RouterView {
    hello: Option<Hello>,
    filter: Option<BloomFilter>,
    resident: u64,
    snapshots: u64,
    error: Option<String>,
}

/// A QUIC router that welcomes one sidecar and keeps its filter view up to date.
struct TestRouter {
    addr: SocketAddr,
    view: Arc<Mutex<RouterView>>,
    _endpoint: quinn::Endpoint,
}

impl TestRouter {
    fn start(tls: &TlsMaterial) -> TestRouter {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = socket.local_addr().unwrap();
        let endpoint = server(socket, tls).unwrap();
        let view = Arc::new(Mutex::new(RouterView::default()));
        let (ep, v) = (endpoint.clone(), Arc::clone(&view));
        tokio::spawn(async move {
            while let Some(incoming) = ep.accept().await {
                let v = Arc::clone(&v);
                tokio::spawn(async move {
                    let Ok(conn) = incoming.await else { return };
                    let Ok((send, recv)) = conn.accept_bi().await else {
                        return;
                    };
                    let (mut send, mut recv) = (FramedSend::new(send), FramedRecv::new(recv));
                    let Ok(Some(SidecarMessage::Hello(hello))) =
                        recv.recv::<SidecarMessage>().await
                    else {
                        return;
                    };
                    v.lock().unwrap().hello = Some(hello);
                    let welcome = RouterMessage::Welcome(Welcome {
                        protocol_version: PROTOCOL_VERSION,
                        router_id: "router-0".to_owned(),
                    });
                    if send.send(&welcome).await.is_err() {
                        return;
                    }
                    while let Ok(Some(m)) = recv.recv::<SidecarMessage>().await {
                        let mut view = v.lock().unwrap();
                        match m {
                            SidecarMessage::CacheSnapshot(s) => {
                                match BloomFilter::from_snapshot(&s) {
                                    Ok(f) => {
                                        view.filter = Some(f);
                                        view.resident = s.resident_blocks;
                                        view.snapshots += 1;
                                    }
                                    Err(e) => view.error = Some(format!("snapshot: {e}")),
                                }
                            }
                            SidecarMessage::CacheDelta(d) => {
                                let applied = match view.filter.as_mut() {
                                    Some(f) => f.apply_delta(&d).map_err(|e| e.to_string()),
                                    None => Err("delta before snapshot".to_owned()),
                                };
                                match applied {
                                    Ok(()) => view.resident = d.resident_blocks,
                                    Err(e) => view.error = Some(format!("delta: {e}")),
                                }
                            }
                            _ => {}
                        }
                    }
                });
            }
        });
        TestRouter {
            addr,
            view,
            _endpoint: endpoint,
        }
    }
}

/// One pod: vllm-sim plus the sidecar in front of it, and optionally a router.
struct Pod {
    sim: SimPodHandle,
    shared: Arc<Shared>,
    base: String,
    router: Option<TestRouter>,
    /// The CA and the Secret-like folder the sidecar's TLS files are read from (with a router).
    tls: Option<(DevCa, SecretDir)>,
    http: reqwest::Client,
    stop: CancellationToken,
    task: JoinHandle<Result<(), kvsight_sidecar::RunError>>,
    _dir: TempDir,
}

impl Drop for Pod {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Starts the sidecar against `sim`; `warmup` is a plan's JSON or `None` to skip warm-up.
async fn start_pod(name: &str, sim: SimPodHandle, with_router: bool, warmup: Option<&str>) -> Pod {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("info,quinn=warn,quinn_proto=warn,rustls=warn")
        .try_init();
    let dir = TempDir::new(&format!("e2e-{name}")).unwrap();
    let mut args: Vec<String> = [
        "kvsight-sidecar",
        "--pod-name",
        "pod-0",
        "--vllm-url",
        &sim.base_url(),
        "--kv-events-endpoint",
        sim.kv_endpoint().unwrap(),
        "--kv-events-replay-endpoint",
        sim.replay_endpoint().unwrap(),
        "--scrape-interval",
        "20ms",
        "--publish-interval",
        "10ms",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    match warmup {
        None => args.extend(["--warmup".to_owned(), "none".to_owned()]),
        Some(plan) => {
            let path = dir.path().join("plan.json");
            std::fs::write(&path, plan).unwrap();
            args.extend(["--warmup".to_owned(), path.display().to_string()]);
        }
    }
    let (router, tls) = if with_router {
        let ca = DevCa::new("e2e-ca").unwrap();
        let mut secret = SecretDir::new(name).unwrap();
        secret
            .publish_leaf(&ca.issue("pod-0", &["pod-0"]).unwrap(), &ca)
            .unwrap();
        let router = TestRouter::start(&ca.material("router", &["127.0.0.1"]).unwrap());
        let files = secret.files();
        let p = |f: &std::path::Path| f.display().to_string();
        args.extend([
            "--router".to_owned(),
            router.addr.to_string(),
            "--tls-cert".to_owned(),
            p(&files.cert),
            "--tls-key".to_owned(),
            p(&files.key),
            "--tls-ca".to_owned(),
            p(&files.ca),
        ]);
        (Some(router), Some((ca, secret)))
    } else {
        (None, None)
    };
    let cfg: Config = <Args as clap::Parser>::parse_from(args)
        .validate(|_| None)
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let shared = Arc::new(Shared::default());
    let stop = CancellationToken::new();
    let task = tokio::spawn(run_with(
        Listeners {
            http: listener,
            debug: None,
        },
        cfg,
        stop.clone(),
        Arc::clone(&shared),
    ));
    Pod {
        sim,
        shared,
        base,
        router,
        tls,
        http: reqwest::Client::new(),
        stop,
        task,
        _dir: dir,
    }
}

/// A sidecar with a router on `sim`'s engine, Ready.
async fn ready_pod(name: &str, sim: SimConfig) -> Pod {
    let sim = SimPod::start(sim).await.unwrap();
    let pod = start_pod(name, sim, true, None).await;
    pod.ready().await;
    pod
}

impl Pod {
    /// Drops the engine's next two KV-event batches, runs `workload(first, n, len)` and checks
    /// the mirror caught up with the engine; the subscriber's status before.
    async fn workload_over_a_gap(&self, first: u32, n: u32, len: usize) -> SubscriberStatus {
        let before = self.status();
        let next = before.last_seq.map_or(0, |s| s + 1);
        self.sim.drop_kv_seqs(Some(next..next + 2));
        self.workload(first, n, len).await;
        self.assert_mirror_matches().await;
        before
    }

    async fn ready(&self) {
        let mut rx = self.shared.watch_phase();
        tokio::time::timeout(WAIT, rx.wait_for(|p| *p == Phase::Ready))
            .await
            .unwrap_or_else(|_| panic!("not Ready in time, at {:?}", self.shared.phase()))
            .unwrap();
        assert!(!self.task.is_finished(), "sidecar stopped");
    }

    fn status(&self) -> SubscriberStatus {
        self.shared.subscriber.get().unwrap().borrow().clone()
    }

    /// The subscriber counted an engine restart since `before` and is back on an exact view.
    fn assert_restart_seen(&self, before: &SubscriberStatus) {
        let after = self.status();
        assert!(
            after.restarts > before.restarts,
            "restart not seen: {after:?}"
        );
        assert_eq!(after.view, CacheView::Exact);
    }

    /// The mirror's resident set as (vLLM hash → canonical hash) keys.
    fn mirror_keys(&self) -> BTreeSet<u64> {
        lock(self.shared.mirror.get().unwrap())
            .blocks()
            .map(|(k, _)| k)
            .collect()
    }

    async fn sim_keys(&self) -> BTreeSet<u64> {
        self.sim
            .resident_block_hashes()
            .await
            .unwrap()
            .into_iter()
            .collect()
    }

    /// A completion sent straight to vLLM (not through a router), as token ids.
    async fn complete(&self, prompt: Vec<u32>, max_tokens: u32) -> Duration {
        complete(self.http.clone(), self.sim.base_url(), prompt, max_tokens).await
    }

    /// `n` distinct prompts of `len` tokens (no shared first block), four at a time.
    async fn workload(&self, first: u32, n: u32, len: usize) {
        for chunk in (first..first + n).collect::<Vec<_>>().chunks(4) {
            let tasks: Vec<_> = chunk
                .iter()
                .map(|&i| {
                    tokio::spawn(complete(
                        self.http.clone(),
                        self.sim.base_url(),
                        prompt(i, len),
                        4,
                    ))
                })
                .collect();
            for t in tasks {
                tokio::time::timeout(WAIT, t).await.unwrap().unwrap();
            }
        }
    }

    /// Waits until the engine is idle and the mirror equals its resident set, then checks the
    /// router's filter holds every resident block's canonical hash.
    async fn assert_mirror_matches(&self) {
        let deadline = Instant::now() + WAIT;
        loop {
            let (sim, mirror) = (self.sim_keys().await, self.mirror_keys());
            if sim == mirror {
                break;
            }
            if Instant::now() > deadline {
                let missing: Vec<_> = sim.difference(&mirror).take(8).collect();
                let extra: Vec<_> = mirror.difference(&sim).take(8).collect();
                panic!(
                    "mirror ({}) != engine ({}): missing {missing:?}, extra {extra:?}",
                    mirror.len(),
                    sim.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            !self.mirror_keys().is_empty(),
            "workload left nothing cached"
        );
        let Some(router) = &self.router else { return };
        let canonical: Vec<u64> = lock(self.shared.mirror.get().unwrap())
            .blocks()
            .map(|(_, c)| c)
            .collect();
        let want = canonical.len() as u64;
        // The pool is full after evictions, so the resident count alone does not show that the
        // last delta arrived: wait (bounded) until the filter has caught up, then name a miss.
        let deadline = Instant::now() + WAIT;
        loop {
            let missing = {
                let v = router.view.lock().unwrap();
                assert_eq!(
                    v.error, None,
                    "router could not apply the sidecar's updates"
                );
                match v.filter.as_ref() {
                    Some(f) if v.resident == want => {
                        canonical.iter().find(|c| !f.contains(**c)).copied()
                    }
                    _ => Some(0),
                }
            };
            let Some(miss) = missing else { break };
            assert!(
                Instant::now() < deadline,
                "router filter misses block {miss:#x} (or its resident count is not {want})"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// POSTs a token-id completion to vLLM and returns the time to the whole answer.
async fn complete(
    http: reqwest::Client,
    base: String,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> Duration {
    let t = Instant::now();
    let r = http
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(
            serde_json::json!({
                "model": "vllm-sim", "prompt": prompt, "max_tokens": max_tokens,
                "ignore_eos": true,
            })
            .to_string(),
        )
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let body = r.text().await.unwrap();
    assert_eq!(status, 200, "{body}");
    t.elapsed()
}

impl Pod {
    /// The router's own view of prompt `i`: the canonical chain a router computes from the
    /// prompt's tokens alone (no LoRA, no salt). The last prompts of a workload were freed last,
    /// so LRU eviction leaves them resident: every full block of theirs must be in the mirror
    /// and in the router's filter — a check of the canonical hashing that does not use the
    /// mirror's own translation.
    fn assert_router_predicts_hit(&self, i: u32, len: usize) {
        let chain = hash_chain(&ChainSeed::BASE, &prompt(i, len), 16);
        assert_eq!(chain.len(), len / 16);
        let mirror: BTreeSet<u64> = lock(self.shared.mirror.get().unwrap())
            .blocks()
            .map(|(_, c)| c)
            .collect();
        let view = self.router.as_ref().unwrap().view.lock().unwrap();
        let filter = view.filter.as_ref().unwrap();
        for (n, h) in chain.iter().enumerate() {
            assert!(mirror.contains(h), "prompt {i} block {n} not in the mirror");
            assert!(
                filter.contains(*h),
                "prompt {i} block {n} not in the router filter"
            );
        }
    }
}

/// Prompt `i`: token ids that differ from every other prompt's in the first two positions.
fn prompt(i: u32, len: usize) -> Vec<u32> {
    let mut p = vec![1 + i / 200, 1 + i % 200];
    p.extend((0..len.saturating_sub(2) as u32).map(|j| 1 + (i * 7 + j) % 240));
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mirror_and_router_filter_equal_the_engine_cache_after_evictions() {
    let pod = ready_pod("evict", sim_config(engine(48))).await;
    // 40 prompts of 7 blocks each through a 47-block pool: most get evicted.
    pod.workload(0, 40, 100).await;
    pod.assert_mirror_matches().await;
    pod.assert_router_predicts_hit(39, 100);
    let stats = lock(pod.shared.mirror.get().unwrap()).stats().clone();
    assert!(stats.blocks_removed > 0, "no evictions: {stats:?}");
    assert_eq!(pod.status().view, CacheView::Exact);
    let hello = pod
        .router
        .as_ref()
        .unwrap()
        .view
        .lock()
        .unwrap()
        .hello
        .clone();
    assert_eq!(hello.unwrap().engine.num_gpu_blocks, 48);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_kv_events_are_recovered_through_replay() {
    let pod = ready_pod("drop", sim_config(engine(64))).await;
    pod.workload(0, 4, 60).await;
    pod.assert_mirror_matches().await;
    // The 3 chunks of 4 prompts publish at least 3 batches (one per chunk, more when the engine
    // splits a chunk over steps). Drop 2: a gap shows only when a later batch arrives live.
    let before = pod.workload_over_a_gap(100, 12, 60).await;
    let after = pod.status();
    assert!(after.gaps > before.gaps, "no gap seen: {after:?}");
    assert!(
        after.replays_recovered > before.replays_recovered,
        "replay counter did not move: {after:?}"
    );
    assert_eq!(after.view, CacheView::Exact);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_resets_and_resyncs_the_mirror() {
    let pod = ready_pod("restart", sim_config(engine(64))).await;
    pod.workload(0, 8, 60).await;
    pod.assert_mirror_matches().await;
    let before = pod.status();
    // A restarted vLLM has an empty cache and counts from seq 0 with an empty replay buffer.
    let r = pod
        .http
        .post(format!("{}/reset_prefix_cache", pod.sim.base_url()))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    eventually("mirror cleared", || {
        let empty = pod.mirror_keys().is_empty();
        async move { empty }
    })
    .await;
    pod.sim.restart_kv_sequence();
    pod.workload(200, 8, 60).await;
    pod.assert_mirror_matches().await;
    pod.assert_restart_seen(&before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_layout_engine_works_the_same() {
    let mut cfg = sim_config(engine(48));
    let kv = cfg.kv_events.as_mut().unwrap();
    kv.layout = Layout::Array;
    kv.replay_layout = ReplayLayout::Old;
    let pod = ready_pod("old", cfg).await;
    pod.workload(0, 20, 100).await;
    pod.assert_mirror_matches().await;
    // At least one batch per chunk of 4 prompts, so a live batch follows the 2 dropped ones.
    let before = pod.workload_over_a_gap(100, 12, 100).await;
    pod.assert_router_predicts_hit(111, 100);
    let after = pod.status();
    assert!(
        after.replays_recovered > before.replays_recovered,
        "{after:?}"
    );
    assert_eq!(
        lock(pod.shared.mirror.get().unwrap())
            .stats()
            .malformed_events,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warmup_absorbs_compile_stalls_before_ready() {
    const STALL: Duration = Duration::from_millis(600);
    let stalling = || {
        EngineConfig::builder()
            .block_size(16)
            .num_gpu_blocks(256)
            .max_model_len(512)
            .compile_stall(STALL)
            .time_scale(1.0)
            .build()
            .unwrap()
    };
    // The first request on an unwarmed engine pays the stall: the reference.
    let fresh = SimPod::start(sim_config(stalling())).await.unwrap();
    let fresh_pod = start_pod("fresh", fresh, false, None).await;
    fresh_pod.ready().await;
    let cold = fresh_pod.complete(prompt(7, 100), 2).await;
    assert!(cold >= STALL, "an unwarmed engine answered in {cold:?}");
    drop(fresh_pod);

    let sim = SimPod::start(sim_config(stalling())).await.unwrap();
    // Hold the engine so warm-up is observably in progress.
    sim.set_hung(true);
    let plan = r#"[{"prompt_tokens": 100, "max_tokens": 2, "concurrency": 1}]"#;
    let pod = start_pod("warm", sim, false, Some(plan)).await;
    let mut rx = pod.shared.watch_phase();
    tokio::time::timeout(WAIT, rx.wait_for(|p| *p == Phase::Warming))
        .await
        .unwrap()
        .unwrap();
    let ready = |pod: &Pod| {
        let url = format!("{}/ready", pod.base);
        let http = pod.http.clone();
        async move {
            http.get(url)
                .send()
                .await
                .map_or(0, |r| r.status().as_u16())
        }
    };
    assert_eq!(ready(&pod).await, 503, "ready during warm-up");
    pod.sim.set_hung(false);
    pod.ready().await;
    assert_eq!(ready(&pod).await, 200);
    let warm = pod.complete(prompt(9, 100), 2).await;
    assert!(
        warm < STALL / 2,
        "a warmed engine still stalled: {warm:?} (cold {cold:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn facts_and_load_come_from_the_engine() {
    let mut cfg = sim_config(engine(96));
    cfg.served_model_names = vec!["vllm-sim".to_owned(), "alias".to_owned()];
    cfg.lora_modules = vec![("sql-lora".to_owned(), "/adapters/sql".to_owned())];
    let pod = ready_pod("facts", cfg).await;
    let facts = pod.shared.facts.get().unwrap();
    assert_eq!(facts.engine.block_size, 16);
    assert_eq!(facts.engine.num_gpu_blocks, 96);
    assert_eq!(facts.engine.max_model_len, 512);
    assert_eq!(facts.models.first().map(String::as_str), Some("vllm-sim"));
    assert!(
        facts.models.contains(&"alias".to_owned()),
        "{:?}",
        facts.models
    );
    assert_eq!(facts.lora_adapters, vec!["sql-lora".to_owned()]);

    // Requests sent straight to vLLM while it is hung: running/waiting rise, none is a router's.
    pod.sim.set_hung(true);
    let mut reqs = Vec::new();
    for i in 0..3 {
        let (http, url) = (
            pod.http.clone(),
            format!("{}/v1/completions", pod.sim.base_url()),
        );
        reqs.push(tokio::spawn(async move {
            http.post(url)
                .header("content-type", "application/json")
                .body(
                    serde_json::json!({"model": "vllm-sim", "prompt": prompt(i, 40), "max_tokens": 2})
                        .to_string(),
                )
                .send()
                .await
                .map(|r| r.status().as_u16())
        }));
    }
    eventually("load to show 3 unrouted requests", || {
        let load = pod.shared.load.borrow().as_ref().map(|s| s.load.clone());
        let ok = load.is_some_and(|l| l.running + l.waiting == 3 && l.unrouted == 3);
        async move { ok }
    })
    .await;
    pod.sim.set_hung(false);
    for r in reqs {
        assert_eq!(
            tokio::time::timeout(WAIT, r)
                .await
                .unwrap()
                .unwrap()
                .unwrap(),
            200
        );
    }
    eventually("load back to idle", || {
        let load = pod.shared.load.borrow().as_ref().map(|s| s.load.clone());
        let ok = load.is_some_and(|l| l.running + l.waiting == 0 && l.unrouted == 0);
        async move { ok }
    })
    .await;
}

/// A real restart: the simulated vLLM process stops and a new one (empty cache, seq from 0)
/// binds the same HTTP, PUB and replay ports. The sidecar must notice through its sockets alone:
/// the old PUB connection ends (the simulator's shutdown closes every socket, as a process exit
/// does), its SUB reconnects to the new process and the sequence restarting at 0 tells it the
/// cache it mirrors is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_process_replaced_on_the_same_ports_resyncs() {
    let mut pod = ready_pod("replace", sim_config(engine(64))).await;
    pod.workload(0, 12, 60).await;
    pod.assert_mirror_matches().await;
    let before = pod.status();
    // At least one batch per chunk of 4 concurrent prompts (how many more depends on how the
    // engine happened to batch them); the new process's seq 0 is then clearly a step back.
    assert!(before.last_seq.is_some_and(|s| s >= 2), "{before:?}");

    let addrs = |s: &SimPodHandle| {
        (
            s.http_addr(),
            s.kv_endpoint().map(str::to_owned),
            s.replay_endpoint().map(str::to_owned),
        )
    };
    let old_addrs = addrs(&pod.sim);
    // A placeholder on other ports holds the field while the old process restarts.
    let placeholder = SimPod::start(SimConfig::default()).await.unwrap();
    let fresh = std::mem::replace(&mut pod.sim, placeholder)
        .restart(Duration::from_secs(1))
        .await
        .expect("the old pod's ports are free once its shutdown returns");
    assert_eq!(addrs(&fresh), old_addrs);
    pod.sim = fresh;
    // A real vLLM takes seconds to start serving, long enough for the SUB to reconnect; the
    // simulator serves at once, and a PUB drops what it publishes before a peer subscribes. Wait
    // for the SUB's resubscription, which also proves it saw the old connection end.
    pod.sim
        .publisher()
        .unwrap()
        .wait_for_subscriptions(1, WAIT)
        .await
        .expect("the sidecar's SUB reconnects to the new process");
    // The new process's cache is empty: a sidecar that kept the old view fails here.
    pod.workload(300, 8, 60).await;
    pod.assert_mirror_matches().await;
    pod.assert_router_predicts_hit(307, 48);
    pod.assert_restart_seen(&before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewed_tls_files_are_taken_up_by_the_running_sidecar() {
    let mut pod = ready_pod("tls-renew", sim_config(engine(48))).await;
    let reloads = |outcome: &str| {
        pod.shared
            .metrics
            .tls_reloads
            .get_or_create(&vec![("outcome", outcome.to_owned())])
            .get()
    };
    assert_eq!(reloads("applied"), 0);
    let (ca, secret) = pod.tls.as_mut().unwrap();
    // A certificate with another leaf's key first (refused), then a proper renewal.
    let (a, b) = (
        ca.issue("pod-0", &["pod-0"]).unwrap(),
        ca.issue("pod-0", &["pod-0"]).unwrap(),
    );
    secret.publish(&a.cert, &b.key, &ca.ca_pem()).unwrap();
    let deadline = Instant::now() + WAIT;
    while reloads("rejected") == 0 {
        assert!(
            Instant::now() < deadline,
            "the mismatched pair was never looked at"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        reloads("applied"),
        0,
        "a mismatched pair must not be applied"
    );
    let (ca, secret) = pod.tls.as_mut().unwrap();
    secret.publish_leaf(&a, ca).unwrap();
    while reloads("applied") == 0 {
        assert!(Instant::now() < deadline, "the renewal was never applied");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!pod.task.is_finished(), "the sidecar kept running");
}
