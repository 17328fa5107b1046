//! The simulator's outside: everything a client, the sidecar or a scraper sees of a vLLM pod.
//! [`SimPod::start`] runs one simulated pod on its own thread and tokio runtime — an engine
//! driver task around the sans-I/O [`Engine`](super::engine::Engine), vLLM 0.33's OpenAI HTTP API
//! and `/metrics` on an axum listener, and (optionally) the KV-event publisher — and returns a
//! [`SimPodHandle`] with the bound addresses and the fault knobs. Many pods can run in one
//! process; each binds its own ports, and stopping a pod drops its runtime, which closes every
//! socket it had, as a process exit would.

mod cli;
mod driver;
mod http;
mod metrics;
mod openai;
mod text;

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use kvsight_tokenizer::Dialect;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::engine::{ConfigError, Engine, EngineConfig};
use super::kv_events::{KvEventPublisher, Layout, PublishError, PublisherConfig, ReplayLayout};

pub use cli::{Args, KvEventsConfig, KvEventsConfigError};

/// The version `GET /version` reports and the API shapes follow.
pub const VLLM_VERSION: &str = "0.33.0";

/// One simulated pod's configuration: the engine, the served names, the KV-event wiring and the
/// HTTP address. Build it from [`Args`] (`vllm-sim`'s flags) or by hand.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The engine inside.
    pub engine: EngineConfig,
    /// `--served-model-name`; the first is the name in metrics and responses. Default
    /// `["vllm-sim"]`.
    pub served_model_names: Vec<String>,
    /// `--lora-modules NAME=PATH`: adapters served as extra model cards. Default none.
    pub lora_modules: Vec<(String, String)>,
    /// `--max-loras` as reported by `vllm:lora_requests_info`. Default 1.
    pub max_loras: usize,
    /// HTTP listen address. Default `127.0.0.1:0`.
    pub http_addr: SocketAddr,
    /// KV-event publisher; `None` = events off (vLLM without `--kv-events-config`). Default
    /// `None`.
    pub kv_events: Option<PublisherConfig>,
    /// `--enable-prompt-tokens-details`: usage carries `prompt_tokens_details.cached_tokens`.
    /// Default false.
    pub enable_prompt_tokens_details: bool,
    /// `--tokenizer DIR`'s content (`tokenizer.json`, `tokenizer_config.json`); `None` = the
    /// built-in byte-level codec. Default `None`.
    pub tokenizer: Option<TokenizerFiles>,
    /// `--tokenizer-dialect`: how the engine reads the tokenizer files. vLLM < 0.32 runs
    /// transformers 4 (`Transformers4`); vLLM >= 0.32 runs transformers 5, which reads them as
    /// they are (`Transformers5`: `model_type` phi3, mistral, …) or rebuilds a sentencepiece-style
    /// Llama tokenizer (`Transformers5Rebuilt`: `model_type` llama, or no config.json). Default
    /// `Transformers4`.
    pub tokenizer_dialect: Dialect,
    /// `--stream-interval`: streamed outputs carry this many tokens (the first one alone).
    /// Default 1.
    pub stream_interval: usize,
}

/// The two files vLLM reads from a model directory to tokenize and render chats.
#[derive(Debug, Clone)]
pub struct TokenizerFiles {
    /// `tokenizer.json` bytes.
    pub tokenizer_json: Vec<u8>,
    /// `tokenizer_config.json` bytes (holds `chat_template`).
    pub tokenizer_config: Vec<u8>,
}

impl TokenizerFiles {
    /// Reads `tokenizer.json` and `tokenizer_config.json` from a model directory.
    pub fn from_dir(dir: &std::path::Path) -> std::io::Result<Self> {
        Ok(Self {
            tokenizer_json: std::fs::read(dir.join("tokenizer.json"))?,
            tokenizer_config: std::fs::read(dir.join("tokenizer_config.json"))?,
        })
    }

    /// Writes the files into `dir` (created if missing), as [`Self::from_dir`] reads them.
    pub fn to_dir(&self, dir: &std::path::Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("tokenizer.json"), &self.tokenizer_json)?;
        std::fs::write(dir.join("tokenizer_config.json"), &self.tokenizer_config)
    }

    /// The project's own tokenizer (trained once, cached under `target/`), as `vllm-sim` uses
    /// by default; give the router the same files so both sides tokenize alike.
    pub fn own() -> Result<Self, crate::own_tokenizer::OwnTokenizerError> {
        let dir = crate::own_tokenizer::ensure_dir()?;
        Self::from_dir(&dir)
            .map_err(|source| crate::own_tokenizer::OwnTokenizerError::Io { path: dir, source })
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            engine: EngineConfig::default(),
            served_model_names: vec!["vllm-sim".to_owned()],
            lora_modules: Vec::new(),
            max_loras: 1,
            http_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            kv_events: None,
            enable_prompt_tokens_details: false,
            tokenizer: None,
            tokenizer_dialect: Dialect::default(),
            stream_interval: 1,
        }
    }
}

impl SimConfig {
    /// Defaults plus KV events on ephemeral loopback ports (PUB + replay), map layout.
    pub fn loopback_with_events() -> Self {
        Self {
            kv_events: Some(PublisherConfig::loopback("")),
            ..Self::default()
        }
    }

    /// The first served model name.
    pub fn model_name(&self) -> &str {
        self.served_model_names
            .first()
            .map_or("vllm-sim", String::as_str)
    }
}

/// Why a pod could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The engine configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// No served model name.
    #[error("served_model_names must not be empty")]
    NoModelName,
    /// The tokenizer files cannot be used.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The HTTP listener could not bind.
    #[error("cannot bind HTTP on {addr}: {source}")]
    Bind {
        /// The requested address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The KV-event sockets could not start.
    #[error(transparent)]
    Publisher(#[from] PublishError),
    /// The pod's own thread or runtime could not be created.
    #[error("cannot run the pod's thread: {0}")]
    Runtime(#[source] std::io::Error),
}

/// Entry point for running simulated pods.
#[derive(Debug)]
pub struct SimPod;

impl SimPod {
    /// Starts a pod on a thread of its own running its own tokio runtime: binds HTTP (and the
    /// KV-event sockets when configured), spawns the engine driver and the server, and returns
    /// once all are listening. Callable from any async context.
    ///
    /// Why a runtime per pod: a real vLLM pod is a process, and when it exits the kernel closes
    /// every socket it had. Inside one shared runtime nothing can give that guarantee — axum
    /// spawns a task per connection and one per SSE stream, and the `zeromq` crate spawns accept
    /// and handshake tasks and keeps accepted connections in state its socket shares with them,
    /// none of which end when the tasks we spawned end. Dropping the pod's runtime drops every
    /// task it runs, whoever spawned it, and with them every socket.
    pub async fn start(config: SimConfig) -> Result<SimPodHandle, StartError> {
        if config.served_model_names.is_empty() {
            return Err(StartError::NoModelName);
        }
        let (started_tx, started_rx) = oneshot::channel();
        let (stop, stop_rx) = oneshot::channel();
        let (exited_tx, exited) = oneshot::channel();
        let pod_config = config.clone();
        std::thread::Builder::new()
            .name("vllm-sim-pod".to_owned())
            .spawn(move || run_pod(pod_config, started_tx, stop_rx, exited_tx))
            .map_err(StartError::Runtime)?;
        let running = started_rx.await.map_err(|_| {
            StartError::Runtime(std::io::Error::other(
                "the pod's thread ended before the pod started",
            ))
        })??;
        let mut restart_config = config;
        restart_config.http_addr = running.http_addr;
        if let (Some(pc), Some(p)) = (restart_config.kv_events.as_mut(), &running.publisher) {
            *pc = pc.with_bound_ports(p);
        }
        Ok(SimPodHandle {
            http_addr: running.http_addr,
            kv_endpoint: running.publisher.as_ref().map(|p| p.endpoint().to_owned()),
            replay_endpoint: running
                .publisher
                .as_ref()
                .and_then(|p| p.replay_endpoint().map(str::to_owned)),
            restart_config,
            publisher: running.publisher,
            commands: running.commands,
            shared: running.shared,
            stop: Some(stop),
            exited: Some(exited),
        })
    }
}

/// What the pod's thread hands back once everything listens.
struct Running {
    http_addr: SocketAddr,
    publisher: Option<Arc<KvEventPublisher>>,
    commands: mpsc::UnboundedSender<driver::Command>,
    shared: Arc<driver::Shared>,
}

/// The parts only the pod's own runtime touches, for a graceful stop.
struct Serving {
    stop_http: oneshot::Sender<()>,
    server: JoinHandle<()>,
    publisher: Option<Arc<KvEventPublisher>>,
}

/// The body of a pod's thread: builds the runtime, starts the pod in it, serves until the handle
/// asks for a stop (graceful, with its grace) or is dropped (immediate), then drops the runtime
/// and says so on `exited`.
fn run_pod(
    config: SimConfig,
    started: oneshot::Sender<Result<Running, StartError>>,
    stop: oneshot::Receiver<Duration>,
    exited: oneshot::Sender<()>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            let _ = started.send(Err(StartError::Runtime(e)));
            return;
        }
    };
    runtime.block_on(async move {
        let serving = match serve(config).await {
            Ok((running, serving)) => {
                if started.send(Ok(running)).is_err() {
                    // The caller stopped waiting for the start: nobody holds a handle.
                    return;
                }
                serving
            }
            Err(e) => {
                let _ = started.send(Err(e));
                return;
            }
        };
        // An error means the handle was dropped: stop at once, like a killed process.
        if let Ok(grace) = stop.await {
            serving.stop_gracefully(grace).await;
        }
    });
    // Every task still in the runtime (driver, connections, streams, the zeromq crate's accept
    // and peer tasks) is dropped here, closing its sockets, before `exited` reports the stop.
    drop(runtime);
    let _ = exited.send(());
}

/// Binds everything and spawns the driver and the HTTP server into the current runtime.
async fn serve(config: SimConfig) -> Result<(Running, Serving), StartError> {
    let codec = text::Codec::new(config.tokenizer.as_ref(), config.tokenizer_dialect)
        .map_err(StartError::Tokenizer)?;
    let mut engine_config = config.engine.clone();
    if let Some(vocab) = codec.vocab_size().and_then(|v| u32::try_from(v).ok()) {
        // Generated ids must be ids the tokenizer can decode.
        engine_config.vocab_size = engine_config.vocab_size.min(vocab).max(1);
    }
    let engine = Engine::new(engine_config)?;
    let publisher = match &config.kv_events {
        Some(pc) => Some(Arc::new(KvEventPublisher::bind(pc.clone()).await?)),
        None => None,
    };
    let listener = TcpListener::bind(config.http_addr)
        .await
        .map_err(|source| StartError::Bind {
            addr: config.http_addr,
            source,
        })?;
    let http_addr = listener.local_addr().map_err(|source| StartError::Bind {
        addr: config.http_addr,
        source,
    })?;
    let shared = Arc::new(driver::Shared::new(&config));
    let (commands, rx) = mpsc::unbounded_channel();
    // The driver ends with the runtime; nothing needs its handle.
    drop(tokio::spawn(
        driver::Driver::new(
            engine,
            rx,
            shared.clone(),
            publisher.clone(),
            config.stream_interval,
        )
        .run(),
    ));
    let state = http::AppState::new(
        config,
        codec,
        commands.clone(),
        shared.clone(),
        publisher.clone(),
    );
    let (stop_http, stop_rx) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let app = http::app(state);
        // A serve error means the listener died; the handle's `/health` checks will show it.
        // vLLM serves through asyncio, which sets TCP_NODELAY on every connection; without it a stream's small writes wait for
        // the reader's delayed ACKs and every router behind the simulator looks ~40 ms slower.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop_rx.await;
            })
            .await;
    });
    Ok((
        Running {
            http_addr,
            publisher: publisher.clone(),
            commands,
            shared,
        },
        Serving {
            stop_http,
            server,
            publisher,
        },
    ))
}

impl Serving {
    /// Stops accepting HTTP connections, lets open responses finish and queued KV events leave,
    /// all within one `grace`.
    async fn stop_gracefully(self, grace: Duration) {
        let deadline = tokio::time::Instant::now() + grace;
        let _ = self.stop_http.send(());
        // Past the deadline the runtime's drop ends whatever is still open.
        let _ = tokio::time::timeout_at(deadline, self.server).await;
        if let Some(p) = &self.publisher {
            let _ = tokio::time::timeout_at(deadline, p.flush()).await;
        }
    }
}

/// A running simulated pod. Dropping it stops the pod at once (every socket closes shortly after,
/// on the pod's thread); [`shutdown`](Self::shutdown) stops it gracefully and returns only once
/// every socket is closed.
pub struct SimPodHandle {
    http_addr: SocketAddr,
    kv_endpoint: Option<String>,
    replay_endpoint: Option<String>,
    /// The configuration with the ports this pod bound, for [`restart`](Self::restart).
    restart_config: SimConfig,
    publisher: Option<Arc<KvEventPublisher>>,
    commands: mpsc::UnboundedSender<driver::Command>,
    shared: Arc<driver::Shared>,
    /// Dropped (with the handle) = stop now; sent = stop with this grace.
    stop: Option<oneshot::Sender<Duration>>,
    /// Resolves once the pod's runtime, and so every socket, is gone.
    exited: Option<oneshot::Receiver<()>>,
}

impl std::fmt::Debug for SimPodHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimPodHandle")
            .field("http_addr", &self.http_addr)
            .field("kv_endpoint", &self.kv_endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .finish_non_exhaustive()
    }
}

impl SimPodHandle {
    /// The bound HTTP address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    /// The KV-event PUB endpoint as bound (`tcp://127.0.0.1:PORT`), if events are on.
    pub fn kv_endpoint(&self) -> Option<&str> {
        self.kv_endpoint.as_deref()
    }

    /// The replay ROUTER endpoint, if configured.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The publisher, for waiting on subscriptions or reading its counters.
    pub fn publisher(&self) -> Option<&KvEventPublisher> {
        self.publisher.as_deref()
    }

    /// Fault: the engine dies. `/health` answers 503, in-flight requests end with an error (an
    /// SSE error event for streams), new requests get vLLM's engine-dead 500. `false` revives it
    /// (not something vLLM can do; useful to reuse a pod across test phases).
    pub fn set_dead(&self, dead: bool) {
        let _ = self.commands.send(driver::Command::SetDead(dead));
    }

    /// Fault: the engine stops stepping (requests queue, streams stall) until un-hung. `/health`
    /// still answers 200, as vLLM v1's only checks for a dead engine core.
    pub fn set_hung(&self, hung: bool) {
        let _ = self.commands.send(driver::Command::SetHung(hung));
    }

    /// Fault: every step takes `factor` times longer (on top of the engine's `time_scale`).
    /// Non-finite or negative factors are ignored.
    pub fn set_slowdown(&self, factor: f64) {
        if factor.is_finite() && factor >= 0.0 {
            let _ = self.commands.send(driver::Command::SetSlowdown(factor));
        }
    }

    /// Fault: KV-event batches whose seq falls in `range` are not sent live (they stay in the
    /// replay buffer, as when a subscriber misses them). `None` clears it.
    pub fn drop_kv_seqs(&self, range: Option<Range<u64>>) {
        if let Some(p) = &self.publisher {
            p.set_live_drop(range);
        }
    }

    /// Fault: the publisher's next seq is 0 again and its replay buffer is empty, as after a
    /// vLLM restart.
    pub fn restart_kv_sequence(&self) {
        if let Some(p) = &self.publisher {
            p.restart_sequence();
        }
    }

    /// Test ground truth: the hashes of every block the engine's prefix cache holds right now
    /// (vLLM's integer block hashes, as the KV events carry them), read by the driver between
    /// steps so it matches the events published so far. `None` when the driver has stopped.
    pub async fn resident_block_hashes(&self) -> Option<Vec<u64>> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(driver::Command::ResidentBlocks(tx))
            .ok()?;
        rx.await.ok()
    }

    /// The configuration a restart uses: the first one, with the ports as bound.
    pub fn restart_config(&self) -> &SimConfig {
        &self.restart_config
    }

    /// Whether the engine is currently dead.
    pub fn is_dead(&self) -> bool {
        self.shared.is_dead()
    }

    /// Stops the pod as a process exit would, after a grace period: stops accepting HTTP
    /// connections, lets open responses finish and queued KV events leave for at most `grace`
    /// in all, then ends everything. When this returns, every socket of the pod is closed: the
    /// HTTP listener and its connections, the KV-event PUB listener and its subscribers'
    /// connections (they see the disconnect), the replay socket. The same addresses can be bound
    /// again at once.
    pub async fn shutdown(mut self, grace: Duration) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(grace);
        }
        if let Some(exited) = self.exited.take() {
            // An error only means the pod's thread ended without saying so (a panic): its
            // runtime, and so its sockets, are gone as well.
            let _ = exited.await;
        }
    }

    /// What a vLLM restart looks like from outside: the pod shuts down (see
    /// [`shutdown`](Self::shutdown)) and a new one starts with the same configuration on the
    /// same addresses — HTTP, PUB and replay ports, even those first chosen by the OS — with an
    /// empty cache, fresh metrics, no faults, and KV-event seqs starting at 0 again. Fails only if
    /// another socket took one of the ports in between.
    pub async fn restart(self, grace: Duration) -> Result<SimPodHandle, StartError> {
        let config = self.restart_config.clone();
        self.shutdown(grace).await;
        SimPod::start(config).await
    }
}

/// Maps `--kv-events-format` and `--replay-layout` words to the publisher's enums.
pub(crate) fn parse_layouts(format: &str, replay: &str) -> Option<(Layout, ReplayLayout)> {
    let layout = match format {
        "map" => Layout::Map,
        "array" => Layout::Array,
        _ => return None,
    };
    let replay = match replay {
        "new" => ReplayLayout::New,
        "old" => ReplayLayout::Old,
        _ => return None,
    };
    Some((layout, replay))
}
