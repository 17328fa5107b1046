//! `kvsight-bench`: `run` measures kvsight against the peers (what `cargo xtask bench` calls);
//! `blind` is the blind baseline router the bench starts as a process of its own.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use kvsight_bench::client::Spread;
use kvsight_bench::{Options, blind, cluster::Binaries, routers, workload};
use tokio::runtime::Runtime;

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
    Run(RunArgs),
    /// kvsight in front of real vLLM engines (what `cargo xtask real-vllm` runs once vLLM is
    /// installed); exits 1 when a check fails.
    RealVllm(RealVllmArgs),
    /// The soak (what `cargo xtask soak` runs): streaming clients through router replicas to
    /// simulated pods while engines crash, pods leave and join and the config is reloaded;
    /// exits 1 when a target is missed.
    Soak(SoakArgs),
    /// Fleet scale (what `cargo xtask fleet` runs): R kvsight-router processes fed by a swarm
    /// of N emulated pods, for every N × R; writes fleet.json and fleet.md.
    Fleet(FleetArgs),
    /// The sidecar swarm the fleet bench starts: N emulated pods publishing to every router
    /// until SIGTERM.
    Swarm(SwarmArgs),
    /// Prints the folders of the project's own tokenizer and its Llama-2-shaped one (training
    /// them on first use), one per line.
    TokenizerDirs,
    /// A blind router: round robin or least request over fixed workers.
    Blind(BlindArgs),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// 3 routers (kvsight, smg-cache_aware, round-robin), multi_tenant, 2 rates.
    #[arg(long)]
    quick: bool,
    /// Workloads to run (default: all; --quick: multi_tenant).
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<workload::Kind>,
    /// Routers to compare (default: all, the variants on multi_tenant only; --quick: kvsight,
    /// smg-cache-aware, round-robin).
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
    /// Requests per run (default: each workload's).
    #[arg(long)]
    count: Option<usize>,
    /// Run the variant routers (kvsight's ablations, the peers' secondary policies,
    /// least-request) on every workload, not only multi_tenant.
    #[arg(long)]
    all_pairs: bool,
    #[command(flatten)]
    engine: kvsight_bench::cost::EngineOverrides,
    /// multi_tenant's shape.
    #[command(flatten)]
    tenants: workload::TenantShape,
    /// Processes of each router (kvsight: replicas with their own router ids, every sidecar
    /// connected to all; a peer: independent processes, as users run them).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    router_replicas: u16,
    /// How clients spread requests over the replicas.
    #[arg(long, value_enum, default_value_t = Spread::RoundRobin)]
    client_spread: Spread,
}

#[derive(Debug, clap::Args)]
struct RealVllmArgs {
    /// The Python of the virtualenv holding vLLM.
    #[arg(long)]
    python: PathBuf,
    /// tests/python of the workspace.
    #[arg(long)]
    scripts: PathBuf,
    /// Working folder.
    #[arg(long)]
    work: PathBuf,
    /// Folder holding kvsight-router and kvsight-sidecar.
    #[arg(long)]
    bin_dir: PathBuf,
    /// A model to serve, as NAME=TOKENIZER_DIR (repeat); default: the project's own
    /// byte-level BPE tokenizer and its Llama-2-shaped one.
    #[arg(long = "model")]
    models: Vec<String>,
    /// The version the engines must report.
    #[arg(long)]
    vllm_version: String,
    /// Leave out the engine-restart check.
    #[arg(long)]
    no_restart: bool,
    /// Leave out the differential (the simulator against vLLM).
    #[arg(long)]
    no_fidelity: bool,
    /// Write the differential's figures as markdown here (e.g. docs/bench/sim-fidelity.md).
    #[arg(long)]
    fidelity_doc: Option<PathBuf>,
    /// Run only the differential (and no routed checks).
    #[arg(long)]
    fidelity_only: bool,
}

#[derive(Debug, clap::Args)]
struct SoakArgs {
    /// Length of the load, wall minutes.
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    /// Concurrent streaming clients (tokio tasks of this process).
    #[arg(long, default_value_t = 1000)]
    clients: usize,
    /// Simulated pods (each a vllm-sim and a sidecar process).
    #[arg(long, default_value_t = 8)]
    pods: usize,
    /// Wall seconds per simulated second of the pods' cost model.
    #[arg(long, default_value_t = 20.0)]
    time_scale: f64,
    /// Output folder (logs, certificates, soak.json).
    #[arg(long)]
    out: PathBuf,
    /// Folder holding vllm-sim, kvsight-router and kvsight-sidecar (release builds).
    #[arg(long)]
    bin_dir: PathBuf,
}

#[derive(Debug, clap::Args)]
struct FleetArgs {
    /// 200 pods into 2 routers for 20 s; fails when a figure is missing or anything erred.
    #[arg(long)]
    quick: bool,
    /// Pod counts (default 100,300,1000; --quick: 200).
    #[arg(long, value_delimiter = ',')]
    pods: Vec<usize>,
    /// Router replica counts (default 1,4,10; --quick: 2).
    #[arg(long, value_delimiter = ',')]
    routers: Vec<usize>,
    #[command(flatten)]
    swarm: SwarmShape,
    /// Seconds of ingest before the window.
    #[arg(long, default_value_t = 5.0)]
    warmup_seconds: f64,
    /// Seconds of the ingest window (default 30; --quick: 20).
    #[arg(long)]
    ingest_seconds: Option<f64>,
    /// Requests of the low-load window (default 400; --quick: 100).
    #[arg(long)]
    requests: Option<usize>,
    /// Bound on every pod becoming routable on every router.
    #[arg(long, default_value_t = 300.0)]
    connect_seconds: f64,
    /// Output folder (fleet.json, fleet.md, fleet/ with certificates and logs).
    #[arg(long)]
    out: PathBuf,
    /// Folder holding kvsight-router (a release build).
    #[arg(long)]
    bin_dir: PathBuf,
}

#[derive(Debug, clap::Args)]
struct SwarmArgs {
    /// Emulated pods.
    #[arg(long)]
    pods: usize,
    /// A router's QUIC address (repeat).
    #[arg(long = "router", required = true)]
    routers: Vec<SocketAddr>,
    /// The certificate folder the fleet bench issued.
    #[arg(long)]
    certs: PathBuf,
    #[command(flatten)]
    shape: SwarmShape,
    /// Where `GET /stats` answers.
    #[arg(long)]
    control: SocketAddr,
}

#[derive(Debug, clap::Args)]
struct BlindArgs {
    #[arg(long)]
    listen: SocketAddr,
    #[arg(long)]
    mode: blind::Mode,
    #[arg(long = "worker", required = true)]
    workers: Vec<String>,
}

/// What each emulated pod holds and how fast it changes.
#[derive(Debug, Clone, Copy, clap::Args)]
struct SwarmShape {
    /// KV blocks of each engine (the filter is sized for them).
    #[arg(long, default_value_t = 125_000)]
    gpu_blocks: u64,
    /// Blocks resident in each engine.
    #[arg(long, default_value_t = 100_000)]
    resident_blocks: u64,
    /// Blocks each engine stores per second (each evicting its oldest).
    #[arg(long, default_value_t = 500.0)]
    changes_per_s: f64,
    /// Milliseconds between deltas (the sidecar's default).
    #[arg(long, default_value_t = 50)]
    publish_interval_ms: u64,
    /// Milliseconds between load reports (the sidecar's default scrape interval).
    #[arg(long, default_value_t = 100)]
    load_interval_ms: u64,
}

fn main() -> std::process::ExitCode {
    // One line with the cause, never a backtrace (anyhow prints one when RUST_BACKTRACE is set,
    // pushing the cause out of the tail of a CI log).
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvsight-bench: FAILED: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.cmd {
        Cmd::Blind(a) => rt.block_on(blind::serve(a.listen, a.workers, a.mode)),
        Cmd::Soak(a) => soak(&rt, a),
        Cmd::Swarm(a) => swarm(&rt, a),
        Cmd::Fleet(a) => fleet(&rt, a),
        Cmd::TokenizerDirs => {
            println!("{}", kvsight_sim::own_tokenizer::ensure_dir()?.display());
            println!("{}", kvsight_sim::llama2_tokenizer::ensure_dir()?.display());
            Ok(())
        }
        Cmd::RealVllm(a) => real_vllm(&rt, a),
        Cmd::Run(a) => bench(&rt, a),
    }
}

/// The release binaries in `bin_dir`, and this one.
fn binaries(bin_dir: &std::path::Path) -> anyhow::Result<Binaries> {
    Ok(Binaries {
        vllm_sim: bin_dir.join("vllm-sim"),
        sidecar: bin_dir.join("kvsight-sidecar"),
        router: bin_dir.join("kvsight-router"),
        bench: std::env::current_exe()?,
    })
}

fn soak(rt: &Runtime, a: SoakArgs) -> anyhow::Result<()> {
    let opts = kvsight_bench::soak::Options {
        minutes: a.minutes,
        clients: a.clients,
        pods: a.pods,
        time_scale: a.time_scale,
        out: a.out,
        bins: binaries(&a.bin_dir)?,
    };
    let report = rt.block_on(kvsight_bench::soak::run(&opts))?;
    print!("{}", kvsight_bench::soak::summary(&report));
    if !report.misses.is_empty() {
        anyhow::bail!("soak: {}", report.misses.join("; "));
    }
    Ok(())
}

fn swarm(rt: &Runtime, a: SwarmArgs) -> anyhow::Result<()> {
    let shape = a.shape;
    rt.block_on(kvsight_bench::fleet::swarm::run(
        kvsight_bench::fleet::swarm::SwarmOptions {
            pods: a.pods,
            routers: a.routers,
            certs: a.certs,
            gpu_blocks: shape.gpu_blocks,
            resident_blocks: shape.resident_blocks,
            changes_per_s: shape.changes_per_s,
            publish_interval: Duration::from_millis(shape.publish_interval_ms),
            load_interval: Duration::from_millis(shape.load_interval_ms),
            control: a.control,
        },
    ))
}

fn fleet(rt: &Runtime, a: FleetArgs) -> anyhow::Result<()> {
    let quick = a.quick;
    let opts = fleet_options(a)?;
    let rows = rt.block_on(kvsight_bench::fleet::driver::run(&opts))?;
    println!("\n{}", kvsight_bench::fleet::driver::markdown(&opts, &rows));
    println!(
        "fleet: {} rows in {}",
        rows.len(),
        opts.out.join("fleet.json").display()
    );
    let incomplete = kvsight_bench::fleet::driver::incomplete(&rows);
    if quick && !incomplete.is_empty() {
        anyhow::bail!("fleet --quick: {}", incomplete.join("; "));
    }
    Ok(())
}

/// The fleet bench's options: the flags, with `--quick`'s or the full run's defaults.
fn fleet_options(a: FleetArgs) -> anyhow::Result<kvsight_bench::fleet::driver::Options> {
    let quick = a.quick;
    let or = |v: Vec<usize>, quick_v: usize, full: &[usize]| match (v.is_empty(), quick) {
        (false, _) => v,
        (true, true) => vec![quick_v],
        (true, false) => full.to_vec(),
    };
    let secs = |name: &str, v: f64| {
        Duration::try_from_secs_f64(v)
            .map_err(|_| anyhow::anyhow!("--{name}: {v} is not a number of seconds"))
    };
    let command = std::iter::once("kvsight-bench".to_owned())
        .chain(std::env::args().skip(1))
        .collect::<Vec<_>>()
        .join(" ");
    let swarm = a.swarm;
    Ok(kvsight_bench::fleet::driver::Options {
        pods: or(a.pods, 200, &[100, 300, 1000]),
        routers: or(a.routers, 2, &[1, 4, 10]),
        gpu_blocks: swarm.gpu_blocks,
        resident_blocks: swarm.resident_blocks,
        changes_per_s: swarm.changes_per_s,
        publish_interval: Duration::from_millis(swarm.publish_interval_ms),
        load_interval: Duration::from_millis(swarm.load_interval_ms),
        warmup: secs("warmup-seconds", a.warmup_seconds)?,
        ingest: secs(
            "ingest-seconds",
            a.ingest_seconds.unwrap_or(if quick { 20.0 } else { 30.0 }),
        )?,
        requests: a.requests.unwrap_or(if quick { 100 } else { 400 }),
        connect_within: secs("connect-seconds", a.connect_seconds)?,
        out: a.out,
        router_bin: a.bin_dir.join("kvsight-router"),
        bench_bin: std::env::current_exe()?,
        command,
    })
}

fn real_vllm(rt: &Runtime, a: RealVllmArgs) -> anyhow::Result<()> {
    let opts = kvsight_bench::real_vllm::Options {
        models: real_vllm_models(&a.models)?,
        python: a.python,
        scripts: a.scripts,
        work: a.work,
        router: a.bin_dir.join("kvsight-router"),
        sidecar: a.bin_dir.join("kvsight-sidecar"),
        vllm_version: a.vllm_version,
        restart: !a.no_restart,
        fidelity: !a.no_fidelity,
        fidelity_doc: a.fidelity_doc,
        fidelity_only: a.fidelity_only,
    };
    let checks = rt.block_on(kvsight_bench::real_vllm::run(&opts))?;
    let failed: Vec<_> = checks.iter().filter(|c| !c.ok).collect();
    println!(
        "real-vllm: {} checks, {} failed",
        checks.len(),
        failed.len()
    );
    for c in &failed {
        println!("real-vllm: FAILED {} {}: {}", c.model, c.name, c.figure);
    }
    if !failed.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}

/// `--model NAME=TOKENIZER_DIR` flags, or the project's own two tokenizers when none is given.
fn real_vllm_models(models: &[String]) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let mut parsed = Vec::new();
    for m in models {
        let (name, dir) = m
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("--model {m:?}: use NAME=TOKENIZER_DIR"))?;
        parsed.push((name.to_owned(), PathBuf::from(dir)));
    }
    if parsed.is_empty() {
        // The project's own byte-level BPE, and a Llama-2-shaped (sentencepiece-style)
        // tokenizer that transformers 5 rebuilds.
        parsed.push((
            "tiny-bpe".to_owned(),
            kvsight_sim::own_tokenizer::ensure_dir()?,
        ));
        parsed.push((
            "tiny-sp".to_owned(),
            kvsight_sim::llama2_tokenizer::ensure_dir()?,
        ));
    }
    Ok(parsed)
}

fn bench(rt: &Runtime, a: RunArgs) -> anyhow::Result<()> {
    let (quick, router_replicas) = (a.quick, a.router_replicas);
    let opts = bench_options(a)?;
    let out = opts.out.clone();
    let expected = opts
        .workloads
        .iter()
        .map(|&w| opts.routers.iter().filter(|&&r| opts.pairs(r, w)).count())
        .sum::<usize>();
    let outcome = rt.block_on(kvsight_bench::run(opts))?;
    println!("\n{}", outcome.markdown);
    println!(
        "bench: {} runs; results in {}",
        outcome.runs.len(),
        out.join("results.json").display()
    );
    if quick {
        check_quick_bench(&outcome, expected, usize::from(router_replicas))?;
    }
    Ok(())
}

/// The bench's options: the flags, with `--quick`'s or the full run's defaults.
fn bench_options(a: RunArgs) -> anyhow::Result<Options> {
    let quick = a.quick;
    let workloads = match (a.workloads.is_empty(), quick) {
        (false, _) => a.workloads,
        (true, true) => vec![workload::Kind::MultiTenant],
        (true, false) => workload::Kind::ALL.to_vec(),
    };
    // Named routers run on every named workload; by default the variants run on
    // multi_tenant only, which keeps the full run within 30 minutes on 2 cores.
    let variants_on =
        (a.routers.is_empty() && !quick && !a.all_pairs).then(|| vec![workload::Kind::MultiTenant]);
    let routers = match (a.routers.is_empty(), quick) {
        (false, _) => a.routers,
        (true, true) => vec![
            routers::Kind::Kvsight,
            routers::Kind::SmgCacheAware,
            routers::Kind::RoundRobin,
        ],
        (true, false) => routers::Kind::ALL.to_vec(),
    };
    Ok(Options {
        workloads,
        routers,
        rates: a.rates,
        pods: a.pods,
        time_scale: a.time_scale,
        quick,
        out: a.out.unwrap_or_else(|| a.target.join("bench")),
        target: a.target,
        bins: binaries(&a.bin_dir)?,
        engine: a.engine,
        tenants: a.tenants,
        count: a.count,
        variants_on,
        router_replicas: usize::from(a.router_replicas),
        client_spread: a.client_spread,
    })
}

/// The smoke test CI runs: every router produced its figures, without errors.
fn check_quick_bench(
    outcome: &kvsight_bench::Outcome,
    expected: usize,
    router_replicas: usize,
) -> anyhow::Result<()> {
    let incomplete: Vec<String> = outcome
        .runs
        .iter()
        .filter(|r| {
            r.hit_rate.is_none()
                || r.ttft_p90_s.is_none()
                || r.errors > 0
                || r.load_cov.requests.is_none()
                || (r.router.starts_with("kvsight") && r.split_placements.is_none())
                || r.router_replicas != router_replicas
        })
        .map(|r| {
            format!(
                "{} {} {}: {:?}",
                r.router, r.workload, r.rate, r.first_error
            )
        })
        .collect();
    let pairs: std::collections::BTreeSet<(&str, &str)> = outcome
        .runs
        .iter()
        .map(|r| (r.router.as_str(), r.workload.as_str()))
        .collect();
    if !incomplete.is_empty() || pairs.len() < expected {
        anyhow::bail!(
            "bench --quick: {} of {expected} router × workload pairs ran; incomplete runs: {incomplete:?}",
            pairs.len()
        );
    }
    Ok(())
}
