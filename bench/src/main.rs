//! `kvsight-bench`: `run` measures kvsight against the peers (what `cargo xtask bench` calls);
//! `blind` is the blind baseline router the bench starts as a process of its own.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use kvsight_bench::{Options, blind, cluster::Binaries, routers, workload};

#[derive(Debug, Parser)]
#[command(
    name = "kvsight-bench",
    about = "kvsight against today's routers, side by side"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Runs the comparison and writes results.json, results.md and SVG charts.
    Run {
        /// 3 routers (kvsight, smg-cache_aware, round-robin), multi_tenant, 2 rates.
        #[arg(long)]
        quick: bool,
        /// Workloads to run (default: all; --quick: multi_tenant).
        #[arg(long, value_delimiter = ',')]
        workloads: Vec<workload::Kind>,
        /// Routers to compare (default: all; --quick: kvsight, smg-cache-aware, round-robin).
        #[arg(long, value_delimiter = ',')]
        routers: Vec<routers::Kind>,
        /// Arrival rates, requests per simulated second (default: each workload's).
        #[arg(long, value_delimiter = ',')]
        rates: Vec<f64>,
        /// Simulated pods.
        #[arg(long, default_value_t = 8)]
        pods: usize,
        /// Wall-clock seconds per simulated second.
        #[arg(long, default_value_t = 2.0)]
        time_scale: f64,
        /// The workspace's target directory.
        #[arg(long)]
        target: PathBuf,
        /// Output folder (default: TARGET/bench).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Folder holding vllm-sim, kvsight-router and kvsight-sidecar (release builds).
        #[arg(long)]
        bin_dir: PathBuf,
    },
    /// A blind router: round robin or least request over fixed workers.
    Blind {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        mode: blind::Mode,
        #[arg(long = "worker", required = true)]
        workers: Vec<String>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.cmd {
        Cmd::Blind {
            listen,
            mode,
            workers,
        } => rt.block_on(blind::serve(listen, workers, mode)),
        Cmd::Run {
            quick,
            workloads,
            routers,
            rates,
            pods,
            time_scale,
            target,
            out,
            bin_dir,
        } => {
            let workloads = match (workloads.is_empty(), quick) {
                (false, _) => workloads,
                (true, true) => vec![workload::Kind::MultiTenant],
                (true, false) => workload::Kind::ALL.to_vec(),
            };
            let routers = match (routers.is_empty(), quick) {
                (false, _) => routers,
                (true, true) => vec![
                    routers::Kind::Kvsight,
                    routers::Kind::SmgCacheAware,
                    routers::Kind::RoundRobin,
                ],
                (true, false) => routers::Kind::ALL.to_vec(),
            };
            let bins = Binaries {
                vllm_sim: bin_dir.join("vllm-sim"),
                sidecar: bin_dir.join("kvsight-sidecar"),
                router: bin_dir.join("kvsight-router"),
                bench: std::env::current_exe()?,
            };
            let out = out.unwrap_or_else(|| target.join("bench"));
            let opts = Options {
                workloads,
                routers,
                rates,
                pods,
                time_scale,
                quick,
                target,
                out: out.clone(),
                bins,
            };
            let outcome = rt.block_on(kvsight_bench::run(opts))?;
            println!("\n{}", outcome.markdown);
            println!(
                "bench: {} runs; results in {}",
                outcome.runs.len(),
                out.join("results.json").display()
            );
            Ok(())
        }
    }
}
