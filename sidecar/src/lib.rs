//! kvsight-sidecar: runs beside each vLLM pod, mirrors the engine's KV-cache events, scrapes its
//! metrics, warms the pod before it reports Ready and publishes limits, load and a Bloom filter of
//! resident blocks to every router replica over QUIC with mutual TLS.
//!
//! Layout: sans-I/O cores ([`kv_events::decode`], [`mirror`], [`scrape`]) under async shells
//! ([`kv_events::subscriber`], [`engine`], [`load`], [`publisher`], [`warmup`], [`server`]);
//! [`run`] wires them: Starting (wait for `/health`, read facts, subscribe) → Warming (warm-up
//! plan) → Ready → on `shutdown`, Draining (tell routers at once, wait for vLLM to empty or the
//! grace period) → Goodbye with `CloseReason::Drained`.
//!
//! Shutdown is a tree: `shutdown` (the caller's, e.g. SIGTERM) starts the drain; `stop`, a token
//! of our own, ends every task once the drain is over; a [`TaskTracker`] bounds the wait for them.

pub mod config;
pub mod counters;
pub mod engine;
pub mod kv_events;
pub mod load;
pub mod memory;
pub mod metrics;
pub mod mirror;
pub mod publisher;
pub mod scrape;
pub mod server;
pub mod state;
pub mod warmup;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvsight_protocol::messages::{CloseReason, Hello, PROTOCOL_VERSION, Phase, PodIdentity};
use kvsight_transport::TlsMaterial;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, WarmupSource};
use crate::engine::{Facts, VllmClient};
use crate::kv_events::subscriber::{KvSubscriber, SharedMirror, SubscriberConfig};
use crate::mirror::Mirror;
use crate::publisher::Publisher;
use crate::state::Shared;

/// How often vLLM's `/health` is polled once up.
const HEALTH_INTERVAL: Duration = Duration::from_secs(1);
/// How often start-up steps (health, facts, subscribe) are retried.
const RETRY_INTERVAL: Duration = Duration::from_millis(200);
/// Longest wait for tasks to end after the drain.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Sockets bound before [`run`] (so tests bind `127.0.0.1:0` and read the port back).
#[derive(Debug)]
pub struct Listeners {
    /// `/live`, `/ready`, `/metrics`.
    pub http: TcpListener,
    /// `/debug/state`; `None` serves it nowhere.
    pub debug: Option<TcpListener>,
}

/// Why the sidecar could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("TLS material: {0}")]
    Tls(#[from] kvsight_transport::TransportError),
    #[error("TLS files: {0}")]
    TlsWatch(#[from] kvsight_process::files::WatchError),
    #[error("warm-up plan: {0}")]
    Warmup(#[from] warmup::WarmupError),
    #[error("KV-cache filter for {blocks} blocks: {source}")]
    Filter {
        blocks: u64,
        source: kvsight_protocol::bloom::FilterError,
    },
}

/// Runs the sidecar until `shutdown` has been handled (drained) or start-up fails.
pub async fn run(
    listeners: Listeners,
    config: Config,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    run_with(listeners, config, shutdown, Arc::new(Shared::default())).await
}

/// [`run`] with caller-provided shared state (tests watch phase and metrics through it).
pub async fn run_with(
    listeners: Listeners,
    config: Config,
    shutdown: CancellationToken,
    shared: Arc<Shared>,
) -> Result<(), RunError> {
    // Everything that can be checked without vLLM is checked before any work starts.
    let tls = config.tls.as_ref().map(|t| t.load()).transpose()?;
    let plan_file = match &config.warmup {
        WarmupSource::File(p) => Some(warmup::load_plan(p)?),
        _ => None,
    };

    let tasks = Tasks {
        stop: CancellationToken::new(),
        tracker: TaskTracker::new(),
    };
    let checked = Checked { tls, plan_file };
    let result = start_and_serve(listeners, &config, &shared, &shutdown, &tasks, checked).await;
    // Serve HTTP until the end so probes see Draining; then stop everything, bounded.
    let Tasks { stop, tracker } = tasks;
    stop.cancel();
    tracker.close();
    if tokio::time::timeout(STOP_GRACE, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("tasks still running after {STOP_GRACE:?}; exiting anyway");
    }
    result
}

/// What [`run_with`] read and checked before any work starts (a bad file fails the start
/// before vLLM is even asked).
struct Checked {
    tls: Option<TlsMaterial>,
    /// The warm-up plan, when it comes from a file.
    plan_file: Option<Vec<warmup::WarmupStep>>,
}

/// The tasks [`start_and_serve`] spawns: [`run_with`] cancels `stop` and waits on `tracker`,
/// bounded, once it returns.
struct Tasks {
    stop: CancellationToken,
    tracker: TaskTracker,
}

/// Starts the HTTP server, waits for vLLM, subscribes, publishes, warms up, reports Ready, and
/// drains when `shutdown` is cancelled: the pod's phases in order.
async fn start_and_serve(
    listeners: Listeners,
    config: &Config,
    shared: &Arc<Shared>,
    shutdown: &CancellationToken,
    tasks: &Tasks,
    checked: Checked,
) -> Result<(), RunError> {
    let Checked { tls, plan_file } = checked;
    serve_http(listeners, shared, tasks);
    let client = VllmClient::new(&config.vllm_url);
    let Some((facts, mirror)) = start_engine_view(&client, config, shared, shutdown, tasks).await?
    else {
        return Ok(());
    };
    // Routers hear Goodbye only after the drain: `close` is cancelled at its end (or by stop).
    let close = tasks.stop.child_token();
    // Lives as long as this function: renewed certificates reach the next handshakes.
    let _tls_watch = publish(config, shared, tasks, &facts, mirror, tls, &close)?;
    warm_until_shutdown(&client, config, shared, shutdown, &facts, plan_file).await;
    drain(config, shared).await;
    close.cancel();
    Ok(())
}

/// The health, readiness and metrics endpoints, and the debug endpoint when it has a listener
/// of its own, until the tasks stop.
fn serve_http(listeners: Listeners, shared: &Arc<Shared>, tasks: &Tasks) {
    let debug = listeners
        .debug
        .map(|l| (l, server::debug_app(Arc::clone(shared))));
    for (listener, app) in
        std::iter::once((listeners.http, server::app(Arc::clone(shared)))).chain(debug)
    {
        let stop = tasks.stop.clone();
        tasks.tracker.spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
            if let Err(e) = served {
                tracing::error!(error = %e, "HTTP server failed");
            }
        });
    }
}

/// Starting: waits for vLLM's health and facts, builds the mirror, subscribes to KV events and
/// starts the load and health loops. `None` when shut down first.
async fn start_engine_view(
    client: &VllmClient,
    config: &Config,
    shared: &Arc<Shared>,
    shutdown: &CancellationToken,
    tasks: &Tasks,
) -> Result<Option<(Facts, SharedMirror)>, RunError> {
    let Tasks { stop, tracker } = tasks;
    if !client.wait_healthy(RETRY_INTERVAL, shutdown).await {
        return Ok(None);
    }
    shared.set_healthy(true);
    let facts = loop {
        match client
            .facts(config.max_num_seqs, config.max_num_batched_tokens)
            .await
        {
            Ok(f) => break f,
            Err(e) => tracing::info!(error = %e, "engine facts not available yet"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            () = tokio::time::sleep(RETRY_INTERVAL) => {}
        }
    };
    tracing::info!(?facts, "engine facts");
    let blocks = facts.engine.num_gpu_blocks;
    let mirror = Arc::new(Mutex::new(
        Mirror::new(blocks).map_err(|source| RunError::Filter { blocks, source })?,
    ));
    let _ = shared.mirror.set(Arc::clone(&mirror));
    let _ = shared.facts.set(facts.clone());

    let sub_config = SubscriberConfig {
        endpoint: config.kv_events_endpoint.clone(),
        replay_endpoint: config.kv_events_replay_endpoint.clone(),
        topic: config.kv_events_topic.clone(),
        replay_timeout: Duration::from_secs(5),
    };
    let subscriber = loop {
        match KvSubscriber::connect(
            sub_config.clone(),
            Arc::clone(&mirror),
            Arc::clone(&shared.metrics),
        )
        .await
        {
            Ok(s) => break s,
            Err(e) => tracing::warn!(error = %e, "cannot subscribe to KV events yet"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            () = tokio::time::sleep(RETRY_INTERVAL) => {}
        }
    };
    let subscriber = subscriber.resync_on(Arc::clone(&shared.engine_restarted));
    let _ = shared.subscriber.set(subscriber.status());
    tracker.spawn(subscriber.run(stop.clone()));
    tracker.spawn(load::run_load(
        client.clone(),
        Arc::clone(shared),
        config.scrape_interval,
        stop.clone(),
    ));
    tracker.spawn(load::run_health(
        client.clone(),
        Arc::clone(shared),
        HEALTH_INTERVAL,
        stop.clone(),
    ));
    Ok(Some((facts, mirror)))
}

/// The publisher: routers learn about the pod as soon as its facts are known. Returns the
/// certificate watch, which must live as long as the pod serves.
fn publish(
    config: &Config,
    shared: &Arc<Shared>,
    tasks: &Tasks,
    facts: &Facts,
    mirror: SharedMirror,
    tls: Option<TlsMaterial>,
    close: &CancellationToken,
) -> Result<Option<kvsight_process::files::DirWatch>, RunError> {
    let Tasks { stop, tracker } = tasks;
    let tokenizer_dir = config.tokenizer_dir.clone().or_else(|| {
        facts
            .root
            .as_ref()
            .map(std::path::PathBuf::from)
            .filter(|p| p.is_dir())
    });
    let tokenizer =
        tokenizer_dir.and_then(|dir| match kvsight_process::tokenizer_dir::read(&dir) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "no tokenizer to hand out");
                None
            }
        });
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        instance_id: instance_id(),
        pod: PodIdentity {
            name: config.pod_name.clone(),
            namespace: config.pod_namespace.clone(),
            url: config.advertise_url.clone(),
            labels: config.pod_labels.clone(),
        },
        engine: facts.engine.clone(),
        models: facts.models.clone(),
        lora_adapters: facts.lora_adapters.clone(),
        tokenizer: None,
        sidecar_version: env!("CARGO_PKG_VERSION").to_owned(),
        load_interval_ms: u32::try_from(config.scrape_interval.as_millis()).unwrap_or(u32::MAX),
    };
    let publisher = Publisher::new(Arc::clone(shared), mirror, hello, tokenizer);
    tracker.spawn(Arc::clone(&publisher).run_ticker(config.publish_interval, stop.clone()));
    let Some(tls) = tls else { return Ok(None) };
    let (material, current) = tokio::sync::watch::channel(tls.clone());
    let mut watch = None;
    if let Some(files) = config.tls.clone() {
        let metrics = Arc::clone(&shared.metrics);
        watch = Some(files.watch(
            &tls,
            move |new| {
                // Built once here only to refuse what a handshake could not use.
                kvsight_transport::client_config(&new)?;
                material.send_replace(new);
                Ok(())
            },
            move |outcome| metrics.count_tls_reload(outcome.label()),
        )?);
    }
    tracker.spawn(publisher.run_routers(
        current,
        config.routers.clone(),
        config.router_resolve_interval,
        close.clone(),
        tracker.clone(),
    ));
    Ok(watch)
}

/// Warming, then Ready (or Unhealthy) until shutdown; warmed again whenever the engine comes
/// back after a restart.
async fn warm_until_shutdown(
    client: &VllmClient,
    config: &Config,
    shared: &Arc<Shared>,
    shutdown: &CancellationToken,
    facts: &Facts,
    plan_file: Option<Vec<warmup::WarmupStep>>,
) {
    shared.set_phase(Phase::Warming);
    let plan = match (&config.warmup, plan_file) {
        (WarmupSource::Skip, _) => Vec::new(),
        (_, Some(p)) => p,
        (_, None) => warmup::default_plan(facts.engine.max_model_len),
    };
    let mut phases = shared.watch_phase();
    loop {
        if let Some(model) = facts.models.first() {
            let report =
                warmup::run_plan(client, model, &plan, facts.engine.max_model_len, shutdown).await;
            shared.metrics.warmup_seconds.set(report.seconds);
            tracing::info!(?report, "warm-up done");
        }
        if shutdown.is_cancelled() {
            return;
        }
        shared.set_phase(if shared.healthy() {
            Phase::Ready
        } else {
            Phase::Unhealthy
        });
        // The health loop moves an Unhealthy pod whose engine answers again to Warming: the
        // engine restarted (a vLLM container restart leaves the sidecar running), so it is
        // warmed again, as at start, before users reach it.
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = phases.wait_for(|p| *p == Phase::Warming) => {
                if changed.is_err() {
                    return;
                }
                tracing::info!("vLLM answers again: warming it up before Ready");
            }
        }
    }
}

/// Draining: waits, bounded by the drain grace, for a load sample taken after the drain began
/// to show the engine idle; routers are then told the pod drained.
async fn drain(config: &Config, shared: &Arc<Shared>) {
    shared.set_phase(Phase::Draining);
    let drain_start = Instant::now();
    let mut load_rx = shared.load.subscribe();
    let idle = load_rx.wait_for(|s| {
        s.as_ref().is_some_and(|s| {
            s.sampled_at > drain_start && s.load.running == 0 && s.load.waiting == 0
        })
    });
    match tokio::time::timeout(config.drain_grace, idle).await {
        Ok(_) => tracing::info!("vLLM is idle: drained"),
        Err(_) => {
            tracing::warn!(grace = ?config.drain_grace, "drain grace over with requests still running")
        }
    }
    shared.set_close_reason(CloseReason::Drained);
}

/// Random per process start (routers tell a restarted sidecar from a reconnect).
fn instance_id() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one((std::process::id(), std::time::SystemTime::now()))
}
