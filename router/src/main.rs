//! The kvsight-router binary: parse flags and the config file (exit 64 naming the field when
//! either is wrong), bind, run until SIGTERM/Ctrl-C, drain. `--check-config` only parses and
//! validates the config file, like `nginx -t` (the Helm chart's CI runs it on rendered configs).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tokio_util::sync::CancellationToken;

use kvsight_process::exit::{config_error, run_to_exit};
use kvsight_router::config::RouterConfig;
use kvsight_router::{Listeners, RunConfig, RunError};
use kvsight_transport::TlsFiles;

const PROGRAM: &str = "kvsight-router";

#[derive(Debug, Parser)]
#[command(
    name = "kvsight-router",
    version,
    about = "Routes OpenAI requests to vLLM pods by their real KV-cache state"
)]
struct Args {
    /// HTTP listen address.
    #[arg(long, env = "KVSIGHT_LISTEN", default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// Admin listen address: /metrics, /debug/pods and the probes, never on --listen. Loopback
    /// by default; the Helm chart opens it to Prometheus only (NetworkPolicy).
    #[arg(long, env = "KVSIGHT_ADMIN_LISTEN", default_value = "127.0.0.1:9091")]
    admin_listen: SocketAddr,
    /// Answer `x-kvsight-debug: 1` with the `x-kvsight-decision` header (chosen pod, scores).
    /// Off by default: it shows any client of the API the pods and their load.
    #[arg(long, env = "KVSIGHT_DECISION_HEADER")]
    decision_header: bool,
    /// QUIC listen address for sidecars.
    #[arg(long, env = "KVSIGHT_QUIC_LISTEN", default_value = "0.0.0.0:4433")]
    quic_listen: SocketAddr,
    /// This router's certificate (PEM).
    #[arg(
        long,
        env = "KVSIGHT_TLS_CERT",
        required_unless_present = "check_config"
    )]
    tls_cert: Option<PathBuf>,
    /// This router's private key (PEM).
    #[arg(
        long,
        env = "KVSIGHT_TLS_KEY",
        required_unless_present = "check_config"
    )]
    tls_key: Option<PathBuf>,
    /// The CA that signs sidecar certificates (PEM).
    #[arg(long, env = "KVSIGHT_TLS_CA", required_unless_present = "check_config")]
    tls_ca: Option<PathBuf>,
    /// A DNS name every sidecar certificate must also be valid for (a SAN), on top of chaining
    /// to --tls-ca. Set it whenever the CA also issues certificates to other workloads.
    #[arg(long, env = "KVSIGHT_SIDECAR_NAME")]
    sidecar_name: Option<String>,
    /// Config file (YAML or TOML), reloaded on change. Without it: defaults, no pools.
    #[arg(long, env = "KVSIGHT_CONFIG")]
    config: Option<PathBuf>,
    /// This replica's name, shown to sidecars (default: the host name).
    #[arg(long, env = "KVSIGHT_ROUTER_ID")]
    router_id: Option<String>,
    /// Seconds in-flight streams get to finish after SIGTERM.
    #[arg(long, env = "KVSIGHT_GRACE_SECONDS", default_value_t = 30.0)]
    grace_seconds: f64,
    /// Seconds between /ready turning 503 and closing the listener.
    #[arg(long, env = "KVSIGHT_READY_DELAY_SECONDS", default_value_t = 0.0)]
    ready_delay_seconds: f64,
    /// Never build tokenizers from the files sidecars offer: models without a tokenizer in
    /// --config are routed in approximate mode (router-side memory of what it sent). For
    /// comparing the two modes, or where only configured tokenizers may run.
    #[arg(long, env = "KVSIGHT_NO_SIDECAR_TOKENIZERS")]
    no_sidecar_tokenizers: bool,
    /// Only parse and validate --config, print `OK` or the error, exit 0 or 64 (like `nginx -t`).
    #[arg(long, requires = "config")]
    check_config: bool,
}

fn secs(field: &str, v: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(v)
        .map_err(|_| format!("--{field}: {v} is not a valid number of seconds"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.check_config {
        return check_config(&args);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let cfg = match prepare(&args) {
        Ok(c) => c,
        Err(msg) => return config_error(PROGRAM, format_args!("configuration error: {msg}")),
    };
    run_to_exit(
        PROGRAM,
        tokio::runtime::Builder::new_multi_thread(),
        serve(&args, cfg),
        // A configured tokenizer folder that cannot be read is a configuration error too.
        |e: &anyhow::Error| matches!(e.downcast_ref(), Some(RunError::Tokenizer { .. })),
    )
}

/// `--check-config`: the same load and validation as at start and on every hot reload.
fn check_config(args: &Args) -> ExitCode {
    let path = args.config.as_deref().expect("clap requires --config");
    match RouterConfig::load(path) {
        Ok(_) => {
            println!("{}: OK", path.display());
            ExitCode::SUCCESS
        }
        Err(e) => config_error(PROGRAM, format_args!("configuration error: {e}")),
    }
}

/// Everything checked before a port is bound.
fn prepare(args: &Args) -> Result<RunConfig, String> {
    let config = match &args.config {
        Some(p) => RouterConfig::load(p).map_err(|e| e.to_string())?,
        None => RouterConfig::default(),
    };
    let (Some(cert), Some(key), Some(ca)) = (&args.tls_cert, &args.tls_key, &args.tls_ca) else {
        unreachable!("clap requires the TLS files unless --check-config");
    };
    let tls_files = TlsFiles {
        cert: cert.clone(),
        key: key.clone(),
        ca: ca.clone(),
    };
    let tls = tls_files
        .load()
        .map_err(|e| format!("--tls-cert/--tls-key/--tls-ca: {e}"))?;
    let tls = match &args.sidecar_name {
        Some(name) => tls
            .requiring_peer_name(name)
            .map_err(|e| format!("--sidecar-name: {e}"))?,
        None => tls,
    };
    let router_id = args
        .router_id
        .clone()
        .unwrap_or_else(|| std::env::var("HOSTNAME").unwrap_or_else(|_| "kvsight-router".into()));
    Ok(RunConfig {
        config,
        config_path: args.config.clone(),
        tls,
        tls_files: Some(tls_files),
        router_id,
        ready_delay: secs("ready-delay-seconds", args.ready_delay_seconds)?,
        grace: secs("grace-seconds", args.grace_seconds)?,
        tokenizer_loader: (!args.no_sidecar_tokenizers)
            .then(kvsight_router::tokenize::default_loader),
        decision_header: args.decision_header,
    })
}

async fn serve(args: &Args, cfg: RunConfig) -> anyhow::Result<()> {
    // Handlers first: a SIGTERM right after the ports are bound must drain, not kill.
    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    kvsight_process::signal::on_termination(move || signal.cancel());
    let http = tokio::net::TcpListener::bind(args.listen).await?;
    let quic = std::net::UdpSocket::bind(args.quic_listen)?;
    let admin = tokio::net::TcpListener::bind(args.admin_listen).await?;
    let listeners = Listeners {
        http,
        quic,
        admin: Some(admin),
    };
    kvsight_router::run(listeners, cfg, shutdown).await?;
    Ok(())
}
