//! `cargo xtask bench`: kvsight against the routers people run today, on the same simulated pods,
//! with the same requests, at rates through and past saturation.
//!
//! Per workload the bench starts the pods (`vllm-sim` with a GPU-calibrated cost model, see
//! [`crate::cost`]) with a real sidecar each, and every kvsight variant (sidecars report to all
//! of them from the start, as to the replicas of one deployment). Then, one router at a time,
//! one rate at a time: every pod's prefix cache is reset, the pods drain, the workload's
//! requests are sent open-loop, and the figures are taken from the pods' own counters, the
//! client's clock and the router's processes. Peers are installed from PyPI into a virtualenv
//! under `target/bench/`; one that cannot be installed is reported and left out.
//!
//! With `--router-replicas R` every router runs as R processes (kvsight: R routers with their
//! own router ids, every sidecar connected to all; a peer: R processes with their own state, as
//! users run them) and the clients spread their requests over them ([`Spread`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvsight_sidecar::counters::PodCounters;
use serde_json::json;

use crate::client::{self, Spread, Targets};
use crate::cluster::{self, Binaries, Certs, Pod, PodsConfig};
use crate::cost::{self, CostModel};
use crate::faults;
use crate::procs::Proc;
use crate::report::{self, RunInputs, RunResult};
use crate::routers::{self, Kind as RouterKind, KvsightDeployment};
use crate::workload::{self, Kind as WorkloadKind, Workload};

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    pub workloads: Vec<WorkloadKind>,
    pub routers: Vec<RouterKind>,
    /// Rates per workload (requests per simulated second); empty: each workload's own.
    pub rates: Vec<f64>,
    pub pods: usize,
    pub time_scale: f64,
    pub quick: bool,
    /// `target/` of the workspace (the peers' venv lives under it).
    pub target: PathBuf,
    /// Where results, charts and logs go.
    pub out: PathBuf,
    pub bins: Binaries,
    pub engine: cost::EngineOverrides,
    pub tenants: workload::TenantShape,
    /// Requests per run, when not each workload's own.
    pub count: Option<usize>,
    /// Workloads the variant routers (not [`RouterKind::is_headline`]) run on; `None`: all.
    pub variants_on: Option<Vec<WorkloadKind>>,
    /// Processes of each router, and how clients spread over them.
    pub router_replicas: usize,
    pub client_spread: Spread,
}

impl Options {
    /// Whether `router` runs on `workload`.
    pub fn pairs(&self, router: RouterKind, workload: WorkloadKind) -> bool {
        router.is_headline()
            || (router == RouterKind::KvsightFlow && WorkloadKind::FLOW.contains(&workload))
            || self
                .variants_on
                .as_ref()
                .is_none_or(|w| w.contains(&workload))
    }
}

/// Everything a run produced.
#[derive(Debug)]
pub struct Outcome {
    pub runs: Vec<RunResult>,
    pub markdown: String,
}

/// The sidecars' load-report interval (their default): how long a placement can go unseen by
/// the other replicas through the pods' own reports.
const REPORT_INTERVAL: Duration = Duration::from_millis(100);

/// What every workload shares: the output folder, the tokenizer, the cost model, the peers.
struct Bench<'o> {
    opts: &'o Options,
    logs: PathBuf,
    tokenizer_dir: PathBuf,
    tok: kvsight_tokenizer::ModelTokenizer,
    cost: CostModel,
    http: reqwest::Client,
    /// The routers that could be started (peers that failed to install are left out).
    routers: Vec<RouterKind>,
    peer_versions: BTreeMap<String, String>,
    peers_bin: PathBuf,
    certs: Certs,
}

/// Runs the bench; writes `results.json`, `results.md` and the charts into `opts.out`.
pub async fn run(opts: Options) -> Result<Outcome> {
    let started = Instant::now();
    let bench = Bench::prepare(&opts)?;
    let mut runs: Vec<RunResult> = Vec::new();
    let mut ttfts: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    for &wk in &opts.workloads {
        bench.workload(wk, &mut runs, &mut ttfts).await?;
    }
    let markdown = report::markdown(&runs);
    let results = json!({
        "runs": runs,
        "cost_model": bench.cost,
        "pods": opts.pods,
        "router_replicas": opts.router_replicas,
        "client_spread": opts.client_spread.name(),
        "peers": bench.peer_versions,
        "quick": opts.quick,
        "seconds": started.elapsed().as_secs_f64(),
    });
    std::fs::write(
        opts.out.join("results.json"),
        serde_json::to_string_pretty(&results)?,
    )?;
    std::fs::write(opts.out.join("results.md"), &markdown)?;
    draw(&opts.out, &runs, &ttfts)?;
    Ok(Outcome { runs, markdown })
}

/// A workload's cluster: the pods and every kvsight variant's replicas.
struct Fleet {
    pods: Vec<Pod>,
    kvsight: Vec<KvsightDeployment>,
    workers: Vec<routers::Worker>,
    /// The QUIC addresses the sidecars report to (a cold pod's sidecar too).
    quic: Vec<String>,
}

/// The router a run measures: its replicas' URLs and processes.
struct UnderTest<'f> {
    urls: Vec<String>,
    /// A peer's or baseline's processes (kvsight's live in the [`Fleet`]).
    own: Vec<Proc>,
    kvsight: Option<&'f KvsightDeployment>,
}

impl UnderTest<'_> {
    fn procs(&self) -> Vec<&Proc> {
        match self.kvsight {
            Some(d) => d.replicas.iter().map(|r| &r.proc).collect(),
            None => self.own.iter().collect(),
        }
    }

    async fn stop(self) {
        futures_util::future::join_all(
            self.own.into_iter().map(|p| p.stop(Duration::from_secs(3))),
        )
        .await;
    }
}

impl<'o> Bench<'o> {
    fn prepare(opts: &'o Options) -> Result<Bench<'o>> {
        std::fs::create_dir_all(&opts.out)?;
        // One run, one time scale: a second `set` (a library caller's second run) keeps it.
        let _ = routers::BENCH_TIME_SCALE.set(opts.time_scale);
        let logs = opts.out.join("logs");
        let _ = std::fs::remove_dir_all(&logs);
        let http = reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(1024)
            .build()?;
        // Peers: install, and leave out what cannot be installed.
        let mut routers = opts.routers.clone();
        let mut peer_versions: BTreeMap<String, String> = BTreeMap::new();
        let mut peers_bin = PathBuf::new();
        if routers.iter().any(|r| r.package().is_some()) {
            let (bin, versions) = routers::install_peers(&opts.target)?;
            peers_bin = bin;
            for (pkg, v) in versions {
                match v {
                    Ok(v) => {
                        peer_versions.insert(pkg, v);
                    }
                    Err(why) => {
                        eprintln!(
                            "bench: peer {pkg} cannot be installed ({why}); going on without it"
                        );
                        routers.retain(|r| r.package() != Some(pkg.as_str()));
                    }
                }
            }
        }
        Ok(Bench {
            opts,
            tokenizer_dir: kvsight_sim::own_tokenizer::ensure_dir()?,
            tok: kvsight_sim::own_tokenizer::load()?,
            cost: CostModel::h100_8b(opts.time_scale).with(&opts.engine),
            http,
            routers,
            peer_versions,
            peers_bin,
            certs: Certs::new(&opts.out.join("certs"))?,
            logs,
        })
    }

    /// Every router at every rate on one workload.
    async fn workload(
        &self,
        wk: WorkloadKind,
        runs: &mut Vec<RunResult>,
        ttfts: &mut BTreeMap<(String, String), Vec<f64>>,
    ) -> Result<()> {
        let opts = self.opts;
        let mut w = workload::build(
            wk,
            &self.cost,
            &self.tok,
            opts.pods,
            opts.quick,
            opts.tenants,
            opts.count,
        );
        if let Some(b) = self.cost.kv_blocks {
            w.num_gpu_blocks = b;
        }
        let rates = if !opts.rates.is_empty() {
            opts.rates.clone()
        } else if opts.quick {
            w.rates[1..].to_vec()
        } else {
            w.rates.clone()
        };
        println!(
            "bench: {} — {} requests per run, {} shared prompts ({} tokens), {} KV blocks per pod, rates {:?}, {} router replica(s) {}",
            wk.name(),
            w.count,
            w.shared_prompts,
            w.shared_tokens,
            w.num_gpu_blocks,
            rates,
            opts.router_replicas,
            opts.client_spread.name(),
        );
        let here: Vec<RouterKind> = self
            .routers
            .iter()
            .copied()
            .filter(|&r| opts.pairs(r, wk))
            .collect();
        let mut fleet = self.start_fleet(&w, &here).await?;
        for &rk in &here {
            // Variants, where they run on a subset, run at the two highest rates: below
            // saturation every router is level, and the full run must fit in 30 minutes.
            let router_rates = if opts.variants_on.is_some() && !rk.is_headline() {
                &rates[rates.len().saturating_sub(2)..]
            } else {
                &rates[..]
            };
            for (i, &rate) in router_rates.iter().enumerate() {
                let run = self.one_run(&w, rk, rate, i == 0, &mut fleet).await?;
                if rate == *rates.last().expect("rates") {
                    ttfts.insert((wk.name().to_owned(), rk.name().to_owned()), run.ttfts_s);
                }
                runs.push(run.result);
            }
        }
        for p in fleet.pods {
            p.stop().await;
        }
        for d in fleet.kvsight {
            d.stop().await;
        }
        Ok(())
    }

    fn pods_config<'a>(&'a self, w: &Workload, quic: &'a [String]) -> PodsConfig<'a> {
        PodsConfig::warm(
            &self.opts.bins,
            &self.cost,
            w.num_gpu_blocks,
            &self.tokenizer_dir,
            &self.certs,
            &self.logs,
            quic,
        )
    }

    /// Starts every kvsight variant's replicas, then the pods (sidecars reporting to all of
    /// them), and waits until every replica routes to every pod.
    async fn start_fleet(&self, w: &Workload, here: &[RouterKind]) -> Result<Fleet> {
        let (opts, http) = (self.opts, &self.http);
        let mut kvsight: Vec<KvsightDeployment> = here
            .iter()
            .filter(|r| r.is_kvsight())
            .map(|&r| {
                KvsightDeployment::start(
                    r,
                    opts.router_replicas,
                    &opts.bins,
                    &self.certs,
                    &self.logs,
                )
            })
            .collect::<Result<_>>()?;
        let quic: Vec<String> = kvsight.iter().flat_map(|d| d.quic()).collect();
        let cfg = self.pods_config(w, &quic);
        let mut pods = Vec::new();
        for i in 0..opts.pods {
            pods.push(Pod::start(&format!("pod-{i}"), &cfg, http).await?);
        }
        for p in &mut pods {
            p.wait_ready(http, Duration::from_secs(60)).await?;
        }
        for d in &mut kvsight {
            d.wait_pods(http, pods.len(), Duration::from_secs(60))
                .await?;
        }
        let workers = pods.iter().map(Pod::worker).collect();
        Ok(Fleet {
            pods,
            kvsight,
            workers,
            quic,
        })
    }

    /// A fresh process (or R) of `rk` for one run: no router carries memory of the previous
    /// run's placements into a run whose caches were reset (peers' prefix trees would; so would
    /// kvsight's affinity). kvsight's replicas restart on their ports (the sidecars reconnect).
    async fn start_router<'f>(
        &self,
        rk: RouterKind,
        kvsight: &'f mut [KvsightDeployment],
        workers: &[routers::Worker],
        pods: usize,
    ) -> Result<UnderTest<'f>> {
        if let Some(d) = kvsight.iter_mut().find(|d| d.kind == rk) {
            d.restart(&self.http, pods).await?;
            let d: &KvsightDeployment = d;
            return Ok(UnderTest {
                urls: d.urls(),
                own: Vec::new(),
                kvsight: Some(d),
            });
        }
        let mut own = Vec::new();
        let mut urls = Vec::new();
        for _ in 0..self.opts.router_replicas.max(1) {
            let (p, url) = routers::start_other(
                rk,
                &self.opts.bins,
                &self.peers_bin,
                workers,
                self.cost.block_size,
                &self.logs,
                &self.http,
            )
            .await?;
            own.push(p);
            urls.push(url);
        }
        Ok(UnderTest {
            urls,
            own,
            kvsight: None,
        })
    }

    /// One router at one rate: reset the caches, drain, send the workload, read the figures.
    async fn one_run(
        &self,
        w: &Workload,
        rk: RouterKind,
        rate: f64,
        first: bool,
        fleet: &mut Fleet,
    ) -> Result<OneRun> {
        let (opts, http, cost) = (self.opts, &self.http, &self.cost);
        // Where a run's wall time goes (router start, probes, reset and drain vs the load),
        // printed with its figures: the full run's length is mostly these.
        let run_start = Instant::now();
        let Fleet {
            pods,
            kvsight,
            workers,
            quic,
        } = fleet;
        let pods: &[Pod] = pods;
        let cold_cfg = PodsConfig {
            compile_stall_ms: faults::COLD_STALL_MS,
            warmup: true,
            ..self.pods_config(w, quic)
        };
        // The caches are reset before the router starts too: a sidecar forgets the placements
        // it remembers for routers that connect later when its engine's cache is reset, and a
        // fresh router must not learn the previous run's.
        for p in pods {
            p.reset_cache(http).await?;
        }
        let router = self.start_router(rk, kvsight, workers, pods.len()).await?;
        // Added latency is probed once per router, before its first rate.
        let added_ms = if first {
            Some(added_latency(http, pods, &router.urls[0], 21).await? * 1000.0)
        } else {
            None
        };
        let targets = Targets {
            urls: router.urls.clone(),
            spread: opts.client_spread,
        };
        let plan = w.plan(rate, cost.time_scale);
        for p in pods {
            p.reset_cache(http).await?;
        }
        cluster::wait_idle(pods, http, Duration::from_secs(120)).await?;
        let before = counters(pods, http).await?;
        // kvsight's metrics are on its replicas' admin listeners.
        let admins: Option<Vec<String>> = router
            .kvsight
            .filter(|_| rk.predicts())
            .map(|d| d.replicas.iter().map(|r| r.admin.clone()).collect());
        let stale0 = match &admins {
            Some(a) => staleness_buckets(http, a).await.ok(),
            None => None,
        };
        let procs = router.procs();
        let cpu0: f64 = procs.iter().map(|p| p.cpu_seconds()).sum();
        for p in &procs {
            p.reset_peak_rss();
        }
        let t0 = Instant::now();
        let setup_s = (t0 - run_start).as_secs_f64();
        let (outcomes, cold) = self
            .send_load(w, rk, &plan, &targets, pods, &cold_cfg)
            .await?;
        let wall_s = t0.elapsed().as_secs_f64();
        let cpu_s = procs.iter().map(|p| p.cpu_seconds()).sum::<f64>() - cpu0;
        let rss = procs.iter().map(|p| p.peak_rss_bytes()).max().unwrap_or(0);
        let mut delta: Vec<PodCounters> = counters(pods, http)
            .await?
            .iter()
            .zip(&before)
            .map(|(a, b)| a.since(b))
            .collect();
        if let Some(cold) = cold {
            delta.push(cold.pod.counters(http).await?);
            cold.leave(rk, &router.urls, http).await?;
        }
        let staleness_ms = match (stale0, &admins) {
            (Some(b0), Some(a)) => staleness_buckets(http, a)
                .await
                .ok()
                .and_then(|b1| staleness_quantiles(&b0, &b1)),
            _ => None,
        };
        let replicas = router.urls.len();
        router.stop().await;
        write_outcomes(&opts.out, rk, w.kind, rate, &plan, &outcomes)?;
        let r = RunResult::new(&RunInputs {
            router: rk.name(),
            workload: w.kind.name(),
            rate,
            router_replicas: replicas,
            client_spread: opts.client_spread.name(),
            split_placements: rk
                .predicts()
                .then(|| split_placements(&plan.requests, &outcomes, REPORT_INTERVAL)),
            outcomes: &outcomes,
            pods: &delta,
            wall_s,
            time_scale: cost.time_scale,
            slo_wall_s: cost.ttft_slo_wall_s(),
            cpu_s,
            rss_bytes: rss,
            added_latency_ms: added_ms,
            predicts: rk.predicts(),
            staleness_ms,
            groups: &plan.requests.iter().map(|r| r.group).collect::<Vec<_>>(),
            flow_control: rk.flow_control(),
        });
        print_groups(&r);
        print_run(&r, run_start.elapsed().as_secs_f64(), setup_s, wall_s);
        let ttfts_s = outcomes
            .iter()
            .filter_map(|o| o.ttft_s.map(|t| t / cost.time_scale))
            .collect();
        Ok(OneRun { result: r, ttfts_s })
    }
}

impl Bench<'_> {
    /// Sends the plan's requests open loop to the router's replicas; on `mixed_faults` also
    /// load that bypasses the router (20 % into the run, on the first pod) and a cold pod
    /// joining (at 30 %), which is returned to be counted and removed.
    async fn send_load(
        &self,
        w: &Workload,
        rk: RouterKind,
        plan: &workload::Plan,
        targets: &Targets,
        pods: &[Pod],
        cold_cfg: &PodsConfig<'_>,
    ) -> Result<(Vec<client::Outcome>, Option<faults::ColdPod>)> {
        let (http, cost) = (&self.http, &self.cost);
        let client = client::run(http, targets, &plan.requests, Duration::from_secs(600));
        if w.kind != WorkloadKind::MixedFaults {
            return Ok((client.await, None));
        }
        let span = plan.requests.last().map_or(Duration::ZERO, |r| r.at);
        let exec = tokio::spawn({
            let (http, url) = (http.clone(), pods[0].url.clone());
            let (prompt, output) = (cost.tokens(8000), cost.tokens(4000));
            async move {
                tokio::time::sleep(span / 5).await;
                faults::exec_load(http, url, faults::EXEC_REQUESTS, prompt, output).await;
            }
        });
        let join = async {
            tokio::time::sleep(span * 3 / 10).await;
            faults::ColdPod::join("pod-cold", cold_cfg, rk, &targets.urls, http).await
        };
        let (outcomes, cold) = tokio::join!(client, join);
        // The bypassing load has done its job once the measured requests are done.
        exec.abort();
        Ok((outcomes, Some(cold?)))
    }
}

/// One line per group of a run's requests (workloads with groups).
fn print_groups(r: &RunResult) {
    for (name, g) in &r.groups {
        println!(
            "bench:   group {name:<12} requests {:>4} shed {:>4} errors {:>3} ttft p50 {:>7} p90 {:>7} out tok/s {:.0}",
            g.requests,
            g.shed,
            g.errors,
            g.ttft_p50_s.map_or("–".into(), |v| format!("{v:.3}")),
            g.ttft_p90_s.map_or("–".into(), |v| format!("{v:.3}")),
            g.output_tokens_per_s,
        );
    }
}

/// One line per run: the figures, and where its wall time went.
fn print_run(r: &RunResult, total_s: f64, setup_s: f64, load_s: f64) {
    println!(
        "bench: {:<14} {:>5} req/s {:<24} hit {:>5} ttft p50 {:>7} p90 {:>7} p99 {:>7} load CoV {:>5} splits {:>4} errors {}{} [wall {total_s:.1} s: setup {setup_s:.1}, load {load_s:.1}]",
        r.workload,
        r.rate,
        r.router,
        r.hit_rate.map_or("–".into(), |v| format!("{v:.2}")),
        r.ttft_p50_s.map_or("–".into(), |v| format!("{v:.3}")),
        r.ttft_p90_s.map_or("–".into(), |v| format!("{v:.3}")),
        r.ttft_p99_s.map_or("–".into(), |v| format!("{v:.3}")),
        r.load_cov
            .requests
            .map_or("–".into(), |v| format!("{v:.2}")),
        r.split_placements.map_or("–".into(), |v| v.to_string()),
        r.errors,
        r.first_error
            .as_deref()
            .map_or(String::new(), |e| format!(" (first: {e})")),
    );
}

/// One run's figures and its TTFTs (simulated seconds, for the CDF chart).
struct OneRun {
    result: RunResult,
    ttfts_s: Vec<f64>,
}

/// Requests a replica sent to another pod than the one a *different* replica had sent the same
/// tenant or session to within `window` before (by send offset): two replicas disagreeing on
/// where one prefix goes, before the pods' reports could show them each other's placement.
/// Requests without a decision (errors) are left out.
pub fn split_placements(
    requests: &[workload::Request],
    outcomes: &[client::Outcome],
    window: Duration,
) -> usize {
    // Per key: the last (send offset, replica, pod) seen, in send order.
    let mut last: HashMap<u32, (Duration, usize, String)> = HashMap::new();
    let mut splits = 0;
    for (r, o) in requests.iter().zip(outcomes) {
        let Some(pod) = o
            .decision
            .as_ref()
            .and_then(|d| d["pod"].as_str())
            .map(str::to_owned)
        else {
            continue;
        };
        if let Some((at, replica, prev)) = last.get(&r.key)
            && *replica != o.replica
            && r.at.saturating_sub(*at) <= window
            && *prev != pod
        {
            splits += 1;
        }
        last.insert(r.key, (r.at, o.replica, pod));
    }
    splits
}

/// The routers' `kvsight_router_view_staleness_seconds` histograms, summed over replicas:
/// (upper bound, cumulative count) per bucket.
async fn staleness_buckets(http: &reqwest::Client, routers: &[String]) -> Result<Vec<(f64, f64)>> {
    let mut sum: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for router in routers {
        let text = crate::client::metrics_text(http, router).await?;
        for s in kvsight_sidecar::scrape::samples(&text)? {
            if s.name == "kvsight_router_view_staleness_seconds_bucket"
                && let Some(le) = s.labels.get("le")
            {
                let le: f64 = le.parse().unwrap_or(f64::INFINITY);
                sum.entry(le.to_bits()).or_insert((le, 0.0)).1 += s.value;
            }
        }
    }
    let mut out: Vec<(f64, f64)> = sum.into_values().collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(out)
}

/// p50 and p99 (ms) of what the histogram counted between two reads: linear within a bucket,
/// as Prometheus' `histogram_quantile` does.
fn staleness_quantiles(before: &[(f64, f64)], after: &[(f64, f64)]) -> Option<(f64, f64)> {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|&(le, c)| {
            let c0 = before.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1);
            (le, c - c0)
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let q = |q: f64| {
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for &(le, c) in &delta {
            if c >= rank {
                if !le.is_finite() {
                    return lower.0;
                }
                let span = c - lower.1;
                let frac = if span > 0.0 {
                    (rank - lower.1) / span
                } else {
                    1.0
                };
                return lower.0 + (le - lower.0) * frac;
            }
            lower = (le, c);
        }
        lower.0
    };
    Some((q(0.5) * 1000.0, q(0.99) * 1000.0))
}

/// Every request's outcome, with kvsight's decision and the start of its body, one JSON line
/// each (`outcomes/<router>-<workload>-<rate>.jsonl`), for looking into a run.
fn write_outcomes(
    out: &Path,
    rk: RouterKind,
    wk: WorkloadKind,
    rate: f64,
    plan: &workload::Plan,
    outcomes: &[client::Outcome],
) -> Result<()> {
    let dir = out.join("outcomes");
    std::fs::create_dir_all(&dir)?;
    let lines: String = outcomes
        .iter()
        .zip(&plan.requests)
        .map(|(o, r)| {
            let head = String::from_utf8_lossy(&r.body[..r.body.len().min(120)]).into_owned();
            json!({
                "request": head,
                "key": r.key,
                "sent_at_s": r.at.as_secs_f64(),
                "replica": o.replica,
                "group": r.group,
                "status": o.status,
                "prompt_tokens": r.prompt_tokens,
                "ttft_s": o.ttft_s,
                "e2e_s": o.e2e_s,
                "engine_cached_tokens": o.cached_tokens,
                "error": o.error,
                "decision": o.decision,
            })
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(
        dir.join(format!("{}-{}-{rate}.jsonl", rk.name(), wk.name())),
        lines,
    )?;
    Ok(())
}

async fn counters(pods: &[Pod], http: &reqwest::Client) -> Result<Vec<PodCounters>> {
    let mut v = Vec::with_capacity(pods.len());
    for p in pods {
        v.push(p.counters(http).await?);
    }
    Ok(v)
}

/// What a router adds to the time to first token, wall seconds: tiny one-token completions sent
/// one at a time, alternately straight to a pod (each pod in turn) and through the router; the
/// median of the pairs' differences, so drift of the machine cancels.
async fn added_latency(
    http: &reqwest::Client,
    pods: &[Pod],
    router: &str,
    n: usize,
) -> Result<f64> {
    let mut diffs = Vec::with_capacity(n);
    for i in 0..n {
        let one = |base: String, tag: &'static str| {
            let body = json!({
                "model": workload::MODEL, "prompt": format!("Probe {tag} {i}: say hello."),
                "max_tokens": 1, "stream": true,
            });
            let r = workload::Request {
                at: Duration::ZERO,
                path: "/v1/completions",
                body: bytes::Bytes::from(body.to_string()),
                prompt_tokens: 0,
                key: 0,
                headers: Vec::new(),
                group: None,
            };
            async move {
                let o = client::run(
                    http,
                    &Targets::one(&base),
                    std::slice::from_ref(&r),
                    Duration::from_secs(30),
                )
                .await;
                match &o[0] {
                    client::Outcome {
                        ttft_s: Some(t),
                        error: None,
                        ..
                    } => Ok(*t),
                    o => Err(anyhow::anyhow!(
                        "probe through {base} failed: {:?}",
                        o.error
                    )),
                }
            }
        };
        let direct = one(pods[i % pods.len()].url.clone(), "direct").await?;
        let via = one(router.to_owned(), "routed").await?;
        diffs.push(via - direct);
    }
    report::quantile(&mut diffs, 0.5).context("no probe")
}

/// The charts: TTFT p90 and hit rate against the rate, per workload; the TTFT CDF at the top
/// rate.
fn draw(
    out: &Path,
    runs: &[RunResult],
    ttfts: &BTreeMap<(String, String), Vec<f64>>,
) -> Result<()> {
    let workloads: Vec<&str> = {
        let mut w: Vec<&str> = runs.iter().map(|r| r.workload.as_str()).collect();
        w.dedup();
        w
    };
    for wk in workloads {
        let mut by_router: BTreeMap<&str, Vec<&RunResult>> = BTreeMap::new();
        for r in runs.iter().filter(|r| r.workload == wk) {
            by_router.entry(r.router.as_str()).or_default().push(r);
        }
        let series = |f: &dyn Fn(&RunResult) -> Option<f64>| -> Vec<crate::charts::Series> {
            by_router
                .iter()
                .map(|(name, rs)| crate::charts::Series {
                    name: (*name).to_owned(),
                    points: rs.iter().filter_map(|r| Some((r.rate, f(r)?))).collect(),
                })
                .collect()
        };
        crate::charts::lines(
            &out.join(format!("ttft_p90_{wk}.svg")),
            &format!("{wk}: TTFT p90 vs arrival rate"),
            "requests / s",
            "TTFT p90 (s)",
            &series(&|r| r.ttft_p90_s),
        )?;
        crate::charts::lines(
            &out.join(format!("hit_rate_{wk}.svg")),
            &format!("{wk}: prefix-cache hit rate (pods' counters)"),
            "requests / s",
            "hit rate",
            &series(&|r| r.hit_rate),
        )?;
        let cdfs: Vec<crate::charts::Series> = ttfts
            .iter()
            .filter(|((w, _), _)| w == wk)
            .map(|((_, r), v)| crate::charts::Series {
                name: r.clone(),
                points: crate::charts::cdf(v.clone()),
            })
            .collect();
        crate::charts::lines(
            &out.join(format!("ttft_cdf_{wk}.svg")),
            &format!("{wk}: TTFT CDF at the highest rate"),
            "TTFT (s)",
            "share of requests",
            &cdfs,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(at_ms: u64, key: u32) -> workload::Request {
        workload::Request {
            at: Duration::from_millis(at_ms),
            path: "/v1/completions",
            body: bytes::Bytes::new(),
            prompt_tokens: 0,
            key,
            headers: Vec::new(),
            group: None,
        }
    }

    fn out(replica: usize, pod: &str) -> client::Outcome {
        client::Outcome {
            replica,
            decision: Some(json!({ "pod": pod })),
            ..client::Outcome::default()
        }
    }

    #[test]
    fn a_split_is_another_replica_sending_the_same_key_elsewhere_within_the_window() {
        let w = Duration::from_millis(100);
        let reqs = [req(0, 1), req(50, 1), req(60, 2), req(70, 2), req(400, 1)];
        let outs = [
            out(0, "a"),
            out(1, "b"), // other replica, other pod, 50 ms later: a split
            out(0, "a"),
            out(0, "b"), // same replica: its own choice, not a split
            out(2, "a"), // other replica and pod, but 350 ms later: the reports showed it
        ];
        assert_eq!(split_placements(&reqs, &outs, w), 1);
        let same_pod = [out(0, "a"), out(1, "a")];
        assert_eq!(split_placements(&reqs[..2], &same_pod, w), 0);
    }
}
