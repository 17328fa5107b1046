//! kvsight-router: the backend a gateway sends every OpenAI request to. It tokenizes the prompt,
//! matches the block-hash chain against every pod's Bloom filter, filters saturated pods, scores
//! the rest with configured weights and streams the answer back under one deadline. Pods join
//! over QUIC ([`quic`]); the HTTP surface is [`http::app`]; [`run`] wires both with a config
//! watcher and a graceful shutdown (`/ready` 503 → stop accepting → drain streams within a grace
//! period → close QUIC).

pub mod body;
pub mod config;
pub mod error;
pub mod flow;
pub mod heavy;
pub mod homes;
pub mod http;
pub mod identity;
pub mod metrics;
pub mod pods;
pub mod proxy;
pub mod quic;
pub mod reload;
pub mod scheduler;
pub mod server;
pub mod sight;
pub mod state;
pub mod tokenize;
pub mod tokenizer_check;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use kvsight_transport::{TlsFiles, TlsMaterial, TransportError};

pub use http::app;
pub use state::State;

use crate::config::RouterConfig;
use crate::tokenize::TokenizerLoader;

/// The sockets the router serves, bound by the caller (so tests bind `127.0.0.1:0`).
#[derive(Debug)]
pub struct Listeners {
    /// The OpenAI API and the probes ([`http::app`]).
    pub http: tokio::net::TcpListener,
    pub quic: std::net::UdpSocket,
    /// `/metrics`, `/debug/pods` and the probes ([`http::admin_app`]); `None` serves them
    /// nowhere. Never the API's listener: the admin surface names pods and their addresses.
    pub admin: Option<tokio::net::TcpListener>,
}

/// Everything [`run`] needs besides sockets.
pub struct RunConfig {
    pub config: RouterConfig,
    /// The file `config` came from; watched for changes when set.
    pub config_path: Option<PathBuf>,
    pub tls: TlsMaterial,
    /// The files `tls` came from; watched, and new handshakes use renewed material, when set.
    pub tls_files: Option<TlsFiles>,
    /// This replica's name (sent to sidecars in `Welcome`).
    pub router_id: String,
    /// Time between `/ready` turning 503 and closing the HTTP listener, so load balancers stop
    /// sending first. Default 0 (a Kubernetes preStop hook usually covers it).
    pub ready_delay: Duration,
    /// Bound on letting in-flight streams finish after the listener closed.
    pub grace: Duration,
    /// Builds tokenizers from files sidecars send; `None` keeps approximate prefix mode for
    /// models whose tokenizer is not configured locally.
    pub tokenizer_loader: Option<TokenizerLoader>,
    /// Answer `x-kvsight-debug: 1` with the `x-kvsight-decision` header (pod, scores). Off by
    /// default: the header tells any client which pods exist and how loaded they are.
    pub decision_header: bool,
}

impl std::fmt::Debug for RunConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunConfig")
            .field("config_path", &self.config_path)
            .field("router_id", &self.router_id)
            .field("grace", &self.grace)
            .finish_non_exhaustive()
    }
}

/// Why the router could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("QUIC endpoint: {0}")]
    Quic(#[from] TransportError),
    #[error("HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("file watcher: {0}")]
    Reload(#[from] reload::ReloadError),
    #[error("HTTP server: {0}")]
    Http(#[source] std::io::Error),
    #[error("tokenizers.{model}: {message}")]
    Tokenizer { model: String, message: String },
}

/// Builds the shared state for `cfg` (exposed so tests can look inside a running router).
/// Local tokenizers named in the config are loaded here, before any port serves.
pub fn build_state(cfg: &RunConfig, shutdown: &CancellationToken) -> Result<Arc<State>, RunError> {
    let state = State::new(
        cfg.config.clone(),
        cfg.router_id.clone(),
        cfg.tokenizer_loader.clone(),
        shutdown.clone(),
    )?;
    state.set_decision_header(cfg.decision_header);
    for (model, dir) in &cfg.config.tokenizers {
        let err = |message: String| RunError::Tokenizer {
            model: model.clone(),
            message,
        };
        let files = kvsight_process::tokenizer_dir::read(dir)
            .map_err(|e| err(format!("{}: {e}", dir.display())))?;
        let tok = tokenize::model_tokenizer(&files).map_err(|e| err(e.to_string()))?;
        state
            .tokenizers
            .insert_configured(model, files.digest(), tok);
        info!(%model, dir = %dir.display(), "local tokenizer loaded");
    }
    Ok(state)
}

/// Runs the router until `shutdown` is cancelled, then drains.
pub async fn run(
    listeners: Listeners,
    cfg: RunConfig,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let state = build_state(&cfg, &shutdown)?;
    serve(listeners, cfg, state, shutdown).await
}

/// [`run`] with a state built by [`build_state`].
pub async fn serve(
    listeners: Listeners,
    cfg: RunConfig,
    state: Arc<State>,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    // QUIC outlives the HTTP drain (streams still report in-flight counts), so it has its own
    // token instead of being a child of `shutdown`.
    let quic_stop = CancellationToken::new();
    let endpoint = kvsight_transport::server(listeners.quic, &cfg.tls)?;
    // Lives until the end of `serve`: renewed certificates reach new sidecar handshakes.
    let _tls_watch = match cfg.tls_files.clone() {
        Some(files) => {
            let (ep, st) = (endpoint.clone(), state.clone());
            Some(files.watch(
                &cfg.tls,
                move |material| {
                    ep.set_server_config(Some(kvsight_transport::server_config(&material)?));
                    Ok(())
                },
                move |outcome| st.metrics.tls_reload(outcome.label()),
            )?)
        }
        None => None,
    };
    let quic_task = tokio::spawn(quic::serve(endpoint, state.clone(), quic_stop.clone()));
    let watch_stop = shutdown.child_token();
    if let Some(path) = cfg.config_path.clone()
        && let Err(e) = reload::spawn_watcher(state.clone(), path, watch_stop.clone())
    {
        // A failed start cancels what it started.
        quic_stop.cancel();
        let _ = quic_task.await;
        return Err(e.into());
    }

    let check_task = tokio::spawn(tokenizer_check::run(state.clone(), watch_stop.clone()));
    // The admin listener outlives the HTTP drain: `/ready` answers 503 there too, and metrics
    // stay readable until the router stops.
    let admin_stop = CancellationToken::new();
    let admin_task = listeners.admin.map(|admin| {
        tokio::spawn(server::serve(
            admin,
            http::admin_app(state.clone()),
            state.clone(),
            admin_stop.clone(),
        ))
    });

    let http_stop = CancellationToken::new();
    let server = server::serve(
        listeners.http,
        app(state.clone()),
        state.clone(),
        http_stop.clone(),
    );
    let mut server = std::pin::pin!(server);
    let result = tokio::select! {
        r = &mut server => r.map_err(RunError::Http),
        _ = shutdown.cancelled() => Ok(()),
    };
    if result.is_ok() {
        info!("shutdown: /ready answers 503");
        state.begin_drain();
        tokio::time::sleep(cfg.ready_delay).await;
        http_stop.cancel();
        let drained = tokio::time::timeout(cfg.grace, async {
            let _ = (&mut server).await;
            state.tracker.close();
            state.tracker.wait().await;
        })
        .await;
        if drained.is_err() {
            warn!(grace = ?cfg.grace, "in-flight streams did not finish within the grace period");
        }
    }
    watch_stop.cancel();
    let _ = check_task.await;
    quic_stop.cancel();
    let _ = quic_task.await;
    admin_stop.cancel();
    if let Some(task) = admin_task {
        let _ = task.await;
    }
    info!("router stopped");
    result
}
