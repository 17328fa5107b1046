//! The kvsight-sidecar binary: parse and validate config (exit 64 naming the field), bind, wire
//! SIGTERM/Ctrl-C to the drain, hand freed memory back periodically, run.

use std::process::ExitCode;

use clap::Parser;
use kvsight_process::exit::{config_error, run_to_exit};
use kvsight_sidecar::config::Args;
use kvsight_sidecar::{Listeners, run};
use tokio_util::sync::CancellationToken;

const PROGRAM: &str = "kvsight-sidecar";

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVSIGHT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let config = match args.validate(|k| std::env::var(k).ok()) {
        Ok(c) => c,
        Err(e) => return config_error(PROGRAM, e),
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.worker_threads(2);
    run_to_exit(PROGRAM, runtime, serve(config), |_| false)
}

async fn serve(config: kvsight_sidecar::config::Config) -> anyhow::Result<()> {
    // Handlers first: a SIGTERM right after the port is announced must drain, not kill.
    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    kvsight_process::signal::on_termination(move || signal.cancel());
    let http = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| anyhow::anyhow!("binding --listen {}: {e}", config.listen))?;
    tracing::info!(listen = %http.local_addr()?, "health and metrics");
    let debug = match config.debug_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| anyhow::anyhow!("binding --debug-listen {addr}: {e}"))?,
        ),
        None => None,
    };
    // Process-wide, so the binary's business rather than `run`'s: tests start many sidecars in
    // one process. Ends with the drain's start; the last seconds of a stopping pod need no trim.
    tokio::spawn(kvsight_sidecar::memory::trim_every(
        config.memory_trim_interval,
        shutdown.clone(),
    ));
    run(Listeners { http, debug }, config, shutdown).await?;
    Ok(())
}
