//! `vllm-sim`: one simulated vLLM pod on real sockets. Parses vLLM-named flags, starts the pod,
//! prints where it listens, and runs until SIGINT/SIGTERM (or, with `--export-tokenizer`, writes
//! its tokenizer files and exits). Exit code 64 on a bad flag.

use clap::Parser;
use kvsight_process::exit::EXIT_CONFIG;
use kvsight_sim::server::{Args, SimPod};

/// A bad flag: the exit code the router and the sidecar use for a wrong configuration.
const EXIT_USAGE: i32 = EXIT_CONFIG as i32;

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let export = args.export_tokenizer.clone();
    let config = match args.into_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vllm-sim: {e}");
            std::process::exit(EXIT_USAGE);
        }
    };
    if let Some(dir) = export {
        let Some(files) = &config.tokenizer else {
            eprintln!("vllm-sim: --export-tokenizer: `--tokenizer builtin` has no files");
            std::process::exit(EXIT_USAGE);
        };
        if let Err(e) = files.to_dir(&dir) {
            eprintln!("vllm-sim: --export-tokenizer {}: {e}", dir.display());
            std::process::exit(1);
        }
        eprintln!("vllm-sim: tokenizer written to {}", dir.display());
        return;
    }
    // Handlers before the pod starts: a SIGTERM right after "HTTP on" must shut down cleanly.
    let terminated = kvsight_process::signal::termination();
    let pod = match SimPod::start(config).await {
        Ok(pod) => pod,
        Err(e) => {
            eprintln!("vllm-sim: {e}");
            std::process::exit(1);
        }
    };
    eprintln!("vllm-sim: HTTP on {}", pod.base_url());
    if let Some(ep) = pod.kv_endpoint() {
        eprintln!("vllm-sim: KV events on {ep}");
    }
    if let Some(ep) = pod.replay_endpoint() {
        eprintln!("vllm-sim: KV replay on {ep}");
    }
    // The same signals the sidecar and router drain on.
    terminated.await;
    pod.shutdown(std::time::Duration::from_secs(5)).await;
}
