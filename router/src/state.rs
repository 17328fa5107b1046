//! Everything the handlers and the QUIC listener share: the one registry lock (picks happen
//! under it so concurrent picks see each other), the live config + scheduler (swapped whole on a
//! reload, so a request keeps the snapshot it started with), the HTTP client, the tokenizers and
//! the metrics.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::body::BodyBudget;
use crate::config::RouterConfig;
use crate::heavy::Heavy;
use crate::identity::Owners;
use crate::metrics::Metrics;
use crate::pods::Registry;
use crate::scheduler::Scheduler;
use crate::tokenize::{TokenizerLoader, Tokenizers};

/// A config and the scheduler built from it; replaced together.
#[derive(Debug)]
pub struct Live {
    pub config: RouterConfig,
    pub scheduler: Scheduler,
}

impl Live {
    pub fn new(config: RouterConfig) -> Self {
        let scheduler = Scheduler::new(&config.scheduler);
        Live { config, scheduler }
    }
}

/// Shared state of one router replica.
#[derive(Debug)]
pub struct State {
    registry: Mutex<Registry>,
    live: RwLock<Arc<Live>>,
    pub client: reqwest::Client,
    pub metrics: Metrics,
    /// Bytes held by request bodies in flight (`limits.inflightBodyBytes`).
    pub bodies: BodyBudget,
    /// The pool CPU-heavy work runs in.
    pub heavy: Heavy,
    /// Which certificate holds each live pod name.
    pub owners: Owners,
    /// Whether `x-kvsight-debug: 1` is answered with `x-kvsight-decision` (off unless the
    /// operator turns it on: the header shows scores and pod names).
    decision_header: AtomicBool,
    pub tokenizers: Tokenizers,
    /// Flow control's queue ([`crate::flow`]); idle while `flowControl.enabled` is off.
    pub flow: crate::flow::FlowControl,
    /// This replica's name, sent to sidecars in `Welcome`.
    pub router_id: String,
    /// Set when shutdown began: `/ready` answers 503 and new requests are refused.
    draining: AtomicBool,
    /// Cancelled when shutdown began; stream pumps watch only their own deadline.
    pub shutdown: CancellationToken,
    /// Every spawned stream pump and connection task, so shutdown can wait for them.
    pub tracker: TaskTracker,
    request_ids: AtomicU64,
    id_seed: u64,
    /// Counts handled reload attempts, so tests (and operators) can wait for one.
    reloads: tokio::sync::watch::Sender<u64>,
}

/// Connections kept open per pod: enough for a burst of streams without a handshake each.
const POOL_IDLE_PER_HOST: usize = 256;

impl State {
    pub fn new(
        config: RouterConfig,
        router_id: String,
        loader: Option<TokenizerLoader>,
        shutdown: CancellationToken,
    ) -> Result<Arc<Self>, reqwest::Error> {
        let client = reqwest::Client::builder()
            .connect_timeout(config.timeouts.connect())
            .pool_max_idle_per_host(POOL_IDLE_PER_HOST)
            .pool_idle_timeout(Duration::from_secs(90))
            .tcp_nodelay(true)
            // Pods are addressed by IP; a proxy from the environment would only add a hop.
            .no_proxy()
            .build()?;
        let id_seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()).rotate_left(32);
        let registry = Registry::new();
        let flow = crate::flow::FlowControl::new(registry.changes());
        let metrics = Metrics::new();
        let bodies = BodyBudget::new(metrics.inflight_body_bytes.clone());
        let heavy = Heavy::new(
            config.limits.heavy_workers,
            config.limits.heavy_queue,
            metrics.heavy_jobs.clone(),
            metrics.heavy_jobs_running.clone(),
        );
        Ok(Arc::new(State {
            registry: Mutex::new(registry),
            flow,
            live: RwLock::new(Arc::new(Live::new(config))),
            client,
            metrics,
            bodies,
            heavy,
            owners: Owners::default(),
            decision_header: AtomicBool::new(false),
            tokenizers: Tokenizers::new(loader),
            router_id,
            draining: AtomicBool::new(false),
            shutdown,
            tracker: TaskTracker::new(),
            request_ids: AtomicU64::new(0),
            id_seed,
            reloads: tokio::sync::watch::Sender::new(0),
        }))
    }

    /// The registry, even if a panicking holder poisoned the lock (its data stays consistent:
    /// every mutation is a single call).
    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn live(&self) -> Arc<Live> {
        self.live.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Swaps in a new config; requests already running keep the one they started with.
    pub fn swap_config(&self, config: RouterConfig) {
        let live = Arc::new(Live::new(config));
        *self.live.write().unwrap_or_else(|e| e.into_inner()) = live;
        // Queued requests are picked under the new budgets (or all let go if it turned off).
        self.flow.kick();
    }

    /// Turns the `x-kvsight-decision` answer to `x-kvsight-debug: 1` on or off.
    pub fn set_decision_header(&self, on: bool) {
        self.decision_header.store(on, Ordering::Relaxed);
    }

    /// Whether `x-kvsight-debug: 1` is honoured.
    pub fn decision_header(&self) -> bool {
        self.decision_header.load(Ordering::Relaxed)
    }

    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub(crate) fn note_reload(&self) {
        self.reloads.send_modify(|n| *n += 1);
    }

    /// Number of handled config reload attempts (applied or rejected), watchable.
    pub fn reload_events(&self) -> tokio::sync::watch::Receiver<u64> {
        self.reloads.subscribe()
    }

    /// A new request id, unique per replica and unlikely to collide across replicas.
    pub fn new_request_id(&self) -> String {
        let n = self.request_ids.fetch_add(1, Ordering::Relaxed);
        format!("kvs-{:016x}{:08x}", self.id_seed, n)
    }
}
