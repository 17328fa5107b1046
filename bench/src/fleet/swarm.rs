//! The sidecar swarm: N emulated pods in one process, each publishing to every router as a
//! sidecar does, on kvsight-transport and kvsight-protocol directly.
//!
//! Per pod: a counting Bloom filter sized for the engine's KV blocks and filled with
//! `resident_blocks` keys; an emulated engine storing `changes_per_s` new blocks per second and
//! evicting as many of its oldest (one step task drives every pod, every [`ENGINE_STEP`]); a
//! publisher taking one delta per publish interval (stamped with the age of its oldest change,
//! as the sidecar stamps vLLM's batches) and a load report per load interval; one QUIC endpoint
//! bound to the pod's own loopback address with the pod's own certificate, and one connection per
//! router (`Hello` → `Welcome` → `CacheSnapshot` → `CacheDelta`s and `Load`s, a snapshot again on
//! `ResyncRequest` or when it falls behind the deltas, reconnecting with a bounded backoff); and
//! the OpenAI stub ([`super::stub`]) on the same address.
//!
//! `GET /stats` on the control address reports what was sent and every error; the swarm runs
//! until SIGTERM or SIGINT, then says `Goodbye` on every connection (bounded by [`CLOSE_GRACE`]).

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvsight_protocol::bloom::{CacheDelta, CountingFilter, FilterParams};
use kvsight_protocol::messages::{
    CacheView, CloseReason, EngineFacts, Goodbye, Hello, Load, PROTOCOL_VERSION, Phase,
    PodIdentity, RouterMessage, SidecarMessage,
};
use kvsight_protocol::splitmix::splitmix64;
use kvsight_transport::{FramedRecv, FramedSend, TlsMaterial};
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch};
use tokio::time::{MissedTickBehavior, timeout};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::certs::FleetCerts;
use super::{BLOCK_SIZE, MODEL, NAMESPACE, pod_ip, pod_name};

/// How often the emulated engines store and evict blocks (vLLM publishes a batch per step).
pub const ENGINE_STEP: Duration = Duration::from_millis(10);
/// Deltas buffered per connection before it counts as fallen behind (the sidecar's bound).
const DELTA_BACKLOG: usize = 64;
/// Longest wait for a handshake or a `Welcome`: thousands of connections open at once.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Reconnect delays: doubling from the first to the last.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Bound on the goodbyes at shutdown.
pub const CLOSE_GRACE: Duration = Duration::from_secs(3);
/// Blocks the stub stores per pod for the prompts it served, at most (the engine's own churn
/// keeps the rest of the cache moving).
const MAX_SERVED_BLOCKS: usize = 50_000;

/// What the swarm emulates and where it publishes.
#[derive(Debug, Clone)]
pub struct SwarmOptions {
    pub pods: usize,
    /// The routers' QUIC addresses; every pod connects to each.
    pub routers: Vec<SocketAddr>,
    /// The folder [`FleetCerts::issue`] wrote.
    pub certs: PathBuf,
    /// KV blocks of each engine (the filter is sized for them, as the sidecar sizes it).
    pub gpu_blocks: u64,
    /// Blocks resident in each engine's cache.
    pub resident_blocks: u64,
    /// Blocks each engine stores per second, each evicting its oldest block.
    pub changes_per_s: f64,
    /// Between two deltas (the sidecar's `--publish-interval`, default 50 ms).
    pub publish_interval: Duration,
    /// Between two load reports (the sidecar's `--scrape-interval`, default 100 ms).
    pub load_interval: Duration,
    /// Where `GET /stats` answers.
    pub control: SocketAddr,
}

/// What `GET /stats` returns.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StatsReport {
    pub pods: usize,
    /// Every pod's filter is built and its stub listens.
    pub ready: bool,
    /// Connections welcomed by a router and not ended.
    pub connected: i64,
    pub welcomed: u64,
    pub snapshots: u64,
    pub deltas: u64,
    pub loads: u64,
    /// Snapshots sent again because a connection fell behind the deltas or a router asked.
    pub resyncs: u64,
    /// Connections that failed or ended while the swarm was running.
    pub errors: u64,
    pub first_error: Option<String>,
    /// OpenAI requests the stubs answered.
    pub http_requests: u64,
    /// Bytes of frames sent to each router, in the order of `--router`.
    pub bytes_per_router: Vec<u64>,
}

/// Counters every task adds to.
#[derive(Debug)]
pub struct Stats {
    started: Instant,
    pods: usize,
    ready: std::sync::atomic::AtomicBool,
    connected: AtomicI64,
    welcomed: AtomicU64,
    snapshots: AtomicU64,
    deltas: AtomicU64,
    loads: AtomicU64,
    resyncs: AtomicU64,
    errors: AtomicU64,
    first_error: Mutex<Option<String>>,
    pub(crate) http_requests: AtomicU64,
    bytes: Vec<AtomicU64>,
}

impl Stats {
    fn new(pods: usize, routers: usize) -> Self {
        Stats {
            started: Instant::now(),
            pods,
            ready: Default::default(),
            connected: AtomicI64::new(0),
            welcomed: AtomicU64::new(0),
            snapshots: AtomicU64::new(0),
            deltas: AtomicU64::new(0),
            loads: AtomicU64::new(0),
            resyncs: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            first_error: Mutex::new(None),
            http_requests: AtomicU64::new(0),
            bytes: (0..routers).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn error(&self, what: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        eprintln!(
            "swarm: {:.1} s: {what}",
            self.started.elapsed().as_secs_f64()
        );
        lock(&self.first_error).get_or_insert(what);
    }

    /// The counters now.
    pub fn report(&self) -> StatsReport {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsReport {
            pods: self.pods,
            ready: self.ready.load(Ordering::Relaxed),
            connected: self.connected.load(Ordering::Relaxed),
            welcomed: get(&self.welcomed),
            snapshots: get(&self.snapshots),
            deltas: get(&self.deltas),
            loads: get(&self.loads),
            resyncs: get(&self.resyncs),
            errors: get(&self.errors),
            first_error: lock(&self.first_error).clone(),
            http_requests: get(&self.http_requests),
            bytes_per_router: self.bytes.iter().map(get).collect(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One emulated pod.
#[derive(Debug)]
pub struct Pod {
    pub index: usize,
    pub hello: Hello,
    /// Keys of this pod's engine differ from every other pod's.
    seed: u64,
    state: Mutex<PodState>,
    deltas: broadcast::Sender<Arc<CacheDelta>>,
    /// The latest load report and when it was sampled.
    load: watch::Sender<Option<(Load, Instant)>>,
    /// Requests the stub is answering.
    pub(crate) inflight: AtomicU32,
}

#[derive(Debug)]
struct PodState {
    filter: CountingFilter,
    /// The engine's own blocks `key(lo) .. key(hi)` are resident: it stores at `hi` and evicts
    /// at `lo`, oldest first.
    lo: u64,
    hi: u64,
    /// Fraction of a block due at the next step.
    carry: f64,
    /// When the oldest change not yet in a delta happened.
    oldest_unsent: Option<Instant>,
    /// Blocks of the prompts the stub served (prefix caching), each inserted once.
    served: HashSet<u64>,
}

impl Pod {
    fn key(&self, n: u64) -> u64 {
        splitmix64(self.seed ^ splitmix64(n))
    }

    fn state(&self) -> MutexGuard<'_, PodState> {
        lock(&self.state)
    }

    /// One engine step of `dt`: the blocks due are stored and as many of the oldest evicted.
    fn step(&self, dt: Duration, rate: f64, now: Instant) {
        let mut s = self.state();
        let due = s.carry + rate * dt.as_secs_f64();
        let n = due.floor();
        s.carry = due - n;
        for _ in 0..n as u64 {
            let (stored, evicted) = (self.key(s.hi), self.key(s.lo));
            s.filter.insert(stored);
            s.filter.remove(evicted);
            s.hi += 1;
            s.lo += 1;
        }
        if n >= 1.0 {
            s.oldest_unsent.get_or_insert(now);
        }
    }

    /// The stub served a prompt whose block chain is `chain`: its blocks are now cached, as
    /// vLLM's prefix cache keeps them (up to [`MAX_SERVED_BLOCKS`] per pod).
    pub(crate) fn store_prompt(&self, chain: &[u64]) {
        let mut s = self.state();
        let mut stored = false;
        for &h in chain {
            if s.served.len() >= MAX_SERVED_BLOCKS {
                break;
            }
            if s.served.insert(h) {
                s.filter.insert(h);
                stored = true;
            }
        }
        if stored {
            s.oldest_unsent.get_or_insert_with(Instant::now);
        }
    }

    /// The next delta, stamped with the age of its oldest change.
    fn take_delta(&self) -> Option<CacheDelta> {
        let mut s = self.state();
        let mut delta = s.filter.take_delta()?;
        delta.age_ms = s
            .oldest_unsent
            .take()
            .map(|t| u32::try_from(t.elapsed().as_millis()).unwrap_or(u32::MAX));
        Some(delta)
    }

    fn kv_usage(&self, gpu_blocks: u64) -> f32 {
        let s = self.state();
        let used = (s.hi - s.lo) + s.served.len() as u64;
        (used as f64 / gpu_blocks.max(1) as f64).min(1.0) as f32
    }
}

/// Runs the swarm until SIGTERM or SIGINT.
pub async fn run(opts: SwarmOptions) -> Result<()> {
    if opts.pods > super::MAX_PODS {
        bail!("--pods {} is past {}", opts.pods, super::MAX_PODS);
    }
    if opts.resident_blocks > opts.gpu_blocks {
        bail!(
            "--resident-blocks {} is more than --gpu-blocks {}",
            opts.resident_blocks,
            opts.gpu_blocks
        );
    }
    let stats = Arc::new(Stats::new(opts.pods, opts.routers.len()));
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    // The control address first, so the driver sees the swarm alive while filters fill.
    let control = tokio::net::TcpListener::bind(opts.control)
        .await
        .with_context(|| format!("binding the control address {}", opts.control))?;
    tracker.spawn(serve_control(control, stats.clone(), cancel.clone()));

    let tokenizer = Arc::new(kvsight_sim::own_tokenizer::load()?);
    let certs = FleetCerts {
        dir: opts.certs.clone(),
    };
    let started = Instant::now();
    let mut pods = Vec::with_capacity(opts.pods);
    for i in 0..opts.pods {
        let listener = tokio::net::TcpListener::bind((pod_ip(i), 0))
            .await
            .with_context(|| format!("binding pod {i}'s HTTP stub on {}", pod_ip(i)))?;
        let url = format!("http://{}", listener.local_addr()?);
        let pod = Arc::new(build_pod(i, &opts, url)?);
        tracker.spawn(super::stub::serve(
            listener,
            pod.clone(),
            tokenizer.clone(),
            stats.clone(),
            cancel.clone(),
        ));
        pods.push(pod);
    }
    eprintln!(
        "swarm: {} pods with {} resident blocks each built in {:.1} s",
        opts.pods,
        opts.resident_blocks,
        started.elapsed().as_secs_f64()
    );
    tracker.spawn(engine_steps(
        pods.clone(),
        opts.changes_per_s,
        cancel.clone(),
    ));
    for pod in &pods {
        tracker.spawn(publish(pod.clone(), opts.clone(), cancel.clone()));
        let tls = certs.pod(pod.index).load()?;
        let bind = SocketAddr::new(IpAddr::V4(pod_ip(pod.index)), 0);
        let endpoint = kvsight_transport::client(bind, &tls)?;
        for (j, &addr) in opts.routers.iter().enumerate() {
            tracker.spawn(connection(
                pod.clone(),
                endpoint.clone(),
                tls.clone(),
                j,
                addr,
                stats.clone(),
                cancel.clone(),
            ));
        }
    }
    stats.ready.store(true, Ordering::Relaxed);
    eprintln!(
        "swarm: {} connections opening to {} routers",
        opts.pods * opts.routers.len(),
        opts.routers.len()
    );

    terminated().await?;
    eprintln!("swarm: terminating");
    cancel.cancel();
    tracker.close();
    let _ = timeout(CLOSE_GRACE, tracker.wait()).await;
    Ok(())
}

async fn terminated() -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        r = tokio::signal::ctrl_c() => r?,
    }
    Ok(())
}

fn build_pod(i: usize, opts: &SwarmOptions, url: String) -> Result<Pod> {
    let params = FilterParams::for_capacity(
        usize::try_from(opts.gpu_blocks).unwrap_or(usize::MAX),
        kvsight_protocol::bloom::DEFAULT_FP_RATE,
    );
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        instance_id: splitmix64(i as u64 ^ 0x5eed),
        pod: PodIdentity {
            name: pod_name(i),
            namespace: NAMESPACE.into(),
            url,
            labels: Default::default(),
        },
        engine: EngineFacts {
            block_size: BLOCK_SIZE,
            num_gpu_blocks: opts.gpu_blocks,
            prefix_caching: true,
            max_num_seqs: 256,
            max_model_len: 32_768,
            max_num_batched_tokens: Some(8_192),
            engine_version: "0.33.0".into(),
        },
        models: vec![MODEL.into()],
        lora_adapters: vec![],
        tokenizer: None,
        sidecar_version: "fleet-swarm".into(),
        load_interval_ms: u32::try_from(opts.load_interval.as_millis()).unwrap_or(u32::MAX),
    };
    let mut pod = Pod {
        index: i,
        hello,
        seed: splitmix64(0xf1ee7 ^ i as u64),
        state: Mutex::new(PodState {
            filter: CountingFilter::new(params)?,
            lo: 0,
            hi: 0,
            carry: 0.0,
            oldest_unsent: None,
            served: HashSet::new(),
        }),
        deltas: broadcast::channel(DELTA_BACKLOG).0,
        load: watch::channel(None).0,
        inflight: AtomicU32::new(0),
    };
    {
        let keys: Vec<u64> = (0..opts.resident_blocks).map(|n| pod.key(n)).collect();
        let s = pod.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for k in keys {
            s.filter.insert(k);
        }
        s.hi = opts.resident_blocks;
        // The fill is the state before the first snapshot, not a change to publish.
        let _ = s.filter.take_delta();
    }
    Ok(pod)
}

/// Every pod's engine, one step per [`ENGINE_STEP`].
async fn engine_steps(pods: Vec<Arc<Pod>>, rate: f64, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(ENGINE_STEP);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut last = Instant::now();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        let dt = now - last;
        last = now;
        for pod in &pods {
            pod.step(dt, rate, now);
        }
    }
}

/// One pod's deltas and load reports, each on its own interval; pods start at staggered
/// phases, as sidecars started at different times do.
async fn publish(pod: Arc<Pod>, opts: SwarmOptions, cancel: CancellationToken) {
    let phase = |every: Duration| {
        let k = splitmix64(pod.index as u64) % 1_000;
        tokio::time::Instant::now() + every.mul_f64(k as f64 / 1_000.0)
    };
    let mut deltas = tokio::time::interval_at(phase(opts.publish_interval), opts.publish_interval);
    deltas.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut loads = tokio::time::interval_at(phase(opts.load_interval), opts.load_interval);
    loads.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut rng = splitmix64(pod.index as u64 ^ 0x10ad);
    let mut queries = 0u64;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = deltas.tick() => {
                if let Some(d) = pod.take_delta() {
                    // No receiver is fine: a connection starts from a snapshot.
                    let _ = pod.deltas.send(Arc::new(d));
                }
            }
            _ = loads.tick() => {
                rng = splitmix64(rng);
                queries += 20_000;
                let running = pod.inflight.load(Ordering::Relaxed) + (rng % 4) as u32;
                let load = Load {
                    running,
                    kv_usage: pod.kv_usage(opts.gpu_blocks),
                    prefix_cache_queries: queries,
                    prefix_cache_hits: queries / 2,
                    prefill_tokens_per_s: Some(20_000.0),
                    phase: Phase::Ready,
                    cache_view: CacheView::Exact,
                    ..Load::idle()
                };
                pod.load.send_replace(Some((load, Instant::now())));
            }
        }
    }
}

/// One pod's connection to router `j`, reconnecting until `cancel`; every failure and every end
/// while running is an error.
async fn connection(
    pod: Arc<Pod>,
    endpoint: quinn::Endpoint,
    tls: TlsMaterial,
    j: usize,
    addr: SocketAddr,
    stats: Arc<Stats>,
    cancel: CancellationToken,
) {
    let config = match kvsight_transport::client_config(&tls) {
        Ok(c) => c,
        Err(e) => return stats.error(format!("{}: client config: {e}", pod.hello.pod.name)),
    };
    let mut backoff = MIN_BACKOFF;
    while !cancel.is_cancelled() {
        let started = Instant::now();
        let result = connect_once(&pod, &endpoint, config.clone(), j, addr, &stats, &cancel).await;
        if cancel.is_cancelled() {
            return;
        }
        let why = match result {
            Ok(()) => "connection ended".to_owned(),
            Err(e) => format!("{e:#}"),
        };
        stats.error(format!(
            "{} → router {j} ({addr}): {why}",
            pod.hello.pod.name
        ));
        if started.elapsed() > MAX_BACKOFF {
            backoff = MIN_BACKOFF;
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One connection's life; `Ok` when the router said goodbye or the swarm is stopping.
async fn connect_once(
    pod: &Pod,
    endpoint: &quinn::Endpoint,
    config: quinn::ClientConfig,
    j: usize,
    addr: SocketAddr,
    stats: &Stats,
    cancel: &CancellationToken,
) -> Result<()> {
    let connecting = endpoint.connect_with(config, addr, "localhost")?;
    let conn = tokio::select! {
        () = cancel.cancelled() => return Ok(()),
        c = timeout(HANDSHAKE_TIMEOUT, connecting) => c.context("handshake timed out")??,
    };
    let (send, recv) = conn.open_bi().await?;
    let (mut tx, mut rx) = (FramedSend::new(send), FramedRecv::new(recv));
    let bytes = &stats.bytes[j];
    let sent = |n: usize| {
        bytes.fetch_add(n as u64, Ordering::Relaxed);
    };
    sent(tx.send(&SidecarMessage::Hello(pod.hello.clone())).await?);
    let answer = tokio::select! {
        () = cancel.cancelled() => return Ok(()),
        a = timeout(HANDSHAKE_TIMEOUT, rx.recv::<RouterMessage>()) => a.context("no Welcome")??,
    };
    match answer {
        Some(RouterMessage::Welcome(_)) => {}
        Some(RouterMessage::Refused(r)) => bail!("refused: {}", r.reason),
        Some(_) => bail!("a message before Welcome"),
        None => bail!("the router closed the stream before Welcome"),
    }
    stats.welcomed.fetch_add(1, Ordering::Relaxed);
    stats.connected.fetch_add(1, Ordering::Relaxed);
    let _connected = Connected(&stats.connected);

    // Subscribe before the snapshot so that no delta after it is missed.
    let mut deltas = pod.deltas.subscribe();
    // The published state and its version, under one lock.
    let snapshot = |stats: &Stats| {
        stats.snapshots.fetch_add(1, Ordering::Relaxed);
        let snap = pod.state().filter.snapshot();
        (snap.version, SidecarMessage::CacheSnapshot(snap))
    };
    let (mut version, first_snapshot) = snapshot(stats);
    sent(tx.send(&first_snapshot).await?);
    let mut load_rx = pod.load.subscribe();
    let mut load_seq = 0u64;
    let mut stamp = |(load, sampled): (Load, Instant)| {
        load_seq += 1;
        SidecarMessage::Load(Load {
            seq: load_seq,
            sample_age_ms: u32::try_from(sampled.elapsed().as_millis()).unwrap_or(u32::MAX),
            ..load
        })
    };
    let first = load_rx.borrow_and_update().clone();
    if let Some(first) = first {
        sent(tx.send(&stamp(first)).await?);
        stats.loads.fetch_add(1, Ordering::Relaxed);
    }
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => {
                let bye = SidecarMessage::Goodbye(Goodbye {
                    reason: CloseReason::Shutdown,
                    message: "swarm stopping".into(),
                });
                if let Ok(n) = tx.send(&bye).await {
                    sent(n);
                }
                let _ = tx.finish();
                let _ = timeout(Duration::from_millis(500), rx.recv::<RouterMessage>()).await;
                conn.close(CloseReason::Shutdown.code().into(), b"goodbye");
                return Ok(());
            }
            msg = rx.recv::<RouterMessage>() => match msg? {
                None => bail!("the router closed the stream"),
                // An emulated pod has no other router replicas to tell of picks.
                Some(
                    RouterMessage::Inflight(_)
                    | RouterMessage::TokenizerRequest(_)
                    | RouterMessage::Routed(_),
                ) => {}
                Some(RouterMessage::ResyncRequest) => {
                    stats.resyncs.fetch_add(1, Ordering::Relaxed);
                    let (v, snap) = snapshot(stats);
                    version = v;
                    sent(tx.send(&snap).await?);
                }
                Some(RouterMessage::Goodbye(g)) => bail!("the router said goodbye ({:?})", g.reason),
                Some(RouterMessage::Welcome(_) | RouterMessage::Refused(_)) => {
                    bail!("a second Welcome or Refused")
                }
            },
            d = deltas.recv() => match d {
                Ok(d) if d.base_version == version => {
                    sent(tx.send(&SidecarMessage::CacheDelta((*d).clone())).await?);
                    stats.deltas.fetch_add(1, Ordering::Relaxed);
                    version = d.version;
                }
                // Already contained in the snapshot sent.
                Ok(d) if d.version <= version => {}
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {
                    stats.resyncs.fetch_add(1, Ordering::Relaxed);
                    let (v, snap) = snapshot(stats);
                    version = v;
                    sent(tx.send(&snap).await?);
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            },
            changed = load_rx.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
                let latest = load_rx.borrow_and_update().clone();
                if let Some(latest) = latest {
                    sent(tx.send(&stamp(latest)).await?);
                    stats.loads.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

/// Counts a welcomed connection until dropped.
struct Connected<'a>(&'a AtomicI64);

impl Drop for Connected<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn serve_control(
    listener: tokio::net::TcpListener,
    stats: Arc<Stats>,
    cancel: CancellationToken,
) {
    let app = axum::Router::new().route(
        "/stats",
        axum::routing::get(move || {
            let stats = stats.clone();
            async move { axum::Json(stats.report()) }
        }),
    );
    let _ = axum::serve(listener, app)
        .with_graceful_shutdown(cancel.cancelled_owned())
        .await;
}
