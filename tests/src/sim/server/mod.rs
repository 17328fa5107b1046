//! The simulator's outside: everything a client, the sidecar or a scraper sees of a vLLM pod.
//! [`SimPod::start`] runs one simulated pod inside the caller's tokio runtime — an engine driver
//! task around the sans-I/O [`Engine`](super::engine::Engine), vLLM 0.33's OpenAI HTTP API and
//! `/metrics` on an axum listener, and (optionally) the KV-event publisher — and returns a
//! [`SimPodHandle`] with the bound addresses and the fault knobs. Many pods can run in one
//! process; each binds its own ports, and dropping the handle stops everything it started.

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
}

/// Entry point for running simulated pods.
#[derive(Debug)]
pub struct SimPod;

impl SimPod {
    /// Starts a pod inside the current tokio runtime: binds HTTP (and the KV-event sockets when
    /// configured), spawns the engine driver and the server, and returns once all are listening.
    pub async fn start(config: SimConfig) -> Result<SimPodHandle, StartError> {
        if config.served_model_names.is_empty() {
            return Err(StartError::NoModelName);
        }
        let codec = text::Codec::new(config.tokenizer.as_ref()).map_err(StartError::Tokenizer)?;
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
        let driver =
            tokio::spawn(driver::Driver::new(engine, rx, shared.clone(), publisher.clone()).run());
        let state = http::AppState::new(
            config.clone(),
            codec,
            commands.clone(),
            shared.clone(),
            publisher.clone(),
        );
        let (stop, stop_rx) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let app = http::app(state);
            // A serve error means the listener died; the handle's `/health` checks will show it.
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stop_rx.await;
                })
                .await;
        });
        Ok(SimPodHandle {
            http_addr,
            kv_endpoint: publisher.as_ref().map(|p| p.endpoint().to_owned()),
            replay_endpoint: publisher
                .as_ref()
                .and_then(|p| p.replay_endpoint().map(str::to_owned)),
            publisher,
            commands,
            shared,
            stop: Some(stop),
            tasks: vec![driver, server],
        })
    }
}

/// A running simulated pod. Dropping it stops the server, the driver and the publisher.
pub struct SimPodHandle {
    http_addr: SocketAddr,
    kv_endpoint: Option<String>,
    replay_endpoint: Option<String>,
    publisher: Option<Arc<KvEventPublisher>>,
    commands: mpsc::UnboundedSender<driver::Command>,
    shared: Arc<driver::Shared>,
    stop: Option<oneshot::Sender<()>>,
    tasks: Vec<JoinHandle<()>>,
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

    /// Whether the engine is currently dead.
    pub fn is_dead(&self) -> bool {
        self.shared.is_dead()
    }

    /// Stops accepting connections, lets open responses finish for at most `grace`, then stops
    /// the driver and the publisher.
    pub async fn shutdown(mut self, grace: Duration) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.tasks.pop() {
            let _ = tokio::time::timeout(grace, server).await;
        }
        if let Some(p) = &self.publisher {
            let _ = tokio::time::timeout(grace, p.flush()).await;
        }
    }
}

impl Drop for SimPodHandle {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
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
