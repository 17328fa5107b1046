//! `cargo xtask bench`: kvsight against the routers people run today, on the same simulated pods,
//! with the same requests, at rates through and past saturation.
//!
//! Per workload the bench starts the pods (`vllm-sim` with a GPU-calibrated cost model, see
//! [`cost`]) with a real sidecar each, and every kvsight variant (sidecars report to all of them
//! from the start, as to the replicas of one deployment). Then, one router at a time, one rate at
//! a time: every pod's prefix cache is reset, the pods drain, the workload's requests are sent
//! open-loop, and the figures are taken from the pods' own counters, the client's clock and the
//! router's process. Peers are installed from PyPI into a virtualenv under `target/bench/`; one
//! that cannot be installed is reported and left out.

pub mod blind;
pub mod charts;
pub mod client;
pub mod cluster;
pub mod cost;
pub mod faults;
pub mod fleet;
pub mod procs;
pub mod real_vllm;
pub mod report;
pub mod routers;
pub mod soak;
pub mod workload;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvsight_sidecar::counters::PodCounters;
use serde_json::json;

use crate::cluster::{Binaries, Certs, Pod, PodsConfig};
use crate::cost::CostModel;
use crate::report::{RunInputs, RunResult};
use crate::routers::{Kind as RouterKind, KvsightRouter};
use crate::workload::Kind as WorkloadKind;

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
}

impl Options {
    /// Whether `router` runs on `workload`.
    pub fn pairs(&self, router: RouterKind, workload: WorkloadKind) -> bool {
        router.is_headline()
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

/// Runs the bench; writes `results.json`, `results.md` and the charts into `opts.out`.
pub async fn run(opts: Options) -> Result<Outcome> {
    let started = Instant::now();
    std::fs::create_dir_all(&opts.out)?;
    let logs = opts.out.join("logs");
    let _ = std::fs::remove_dir_all(&logs);
    let tokenizer_dir = kvsight_sim::own_tokenizer::ensure_dir()?;
    let tok = kvsight_sim::own_tokenizer::load()?;
    let cost = CostModel::h100_8b(opts.time_scale).with(&opts.engine);
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
                    eprintln!("bench: peer {pkg} cannot be installed ({why}); going on without it");
                    routers.retain(|r| r.package() != Some(pkg.as_str()));
                }
            }
        }
    }

    let certs = Certs::new(&opts.out.join("certs"))?;
    let mut runs: Vec<RunResult> = Vec::new();
    let mut ttfts: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    for &wk in &opts.workloads {
        let mut w = workload::build(
            wk,
            &cost,
            &tok,
            opts.pods,
            opts.quick,
            opts.tenants,
            opts.count,
        );
        if let Some(b) = cost.kv_blocks {
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
            "bench: {} — {} requests per run, {} shared prompts ({} tokens), {} KV blocks per pod, rates {:?}",
            wk.name(),
            w.count,
            w.shared_prompts,
            w.shared_tokens,
            w.num_gpu_blocks,
            rates
        );
        let here: Vec<RouterKind> = routers
            .iter()
            .copied()
            .filter(|&r| opts.pairs(r, wk))
            .collect();
        let mut kv_routers: Vec<KvsightRouter> = here
            .iter()
            .filter(|r| r.is_kvsight())
            .map(|&r| KvsightRouter::start(r, &opts.bins, &certs, &logs))
            .collect::<Result<_>>()?;
        let quic: Vec<String> = kv_routers.iter().map(|r| r.quic.clone()).collect();
        let pods_cfg = PodsConfig::warm(
            &opts.bins,
            &cost,
            w.num_gpu_blocks,
            &tokenizer_dir,
            &certs,
            &logs,
            &quic,
        );
        let cold_cfg = PodsConfig {
            compile_stall_ms: faults::COLD_STALL_MS,
            warmup: true,
            ..pods_cfg
        };
        let mut pods = Vec::new();
        for i in 0..opts.pods {
            pods.push(Pod::start(&format!("pod-{i}"), &pods_cfg, &http).await?);
        }
        for p in &mut pods {
            p.wait_ready(&http, Duration::from_secs(60)).await?;
        }
        for r in &mut kv_routers {
            r.wait_pods(&http, pods.len(), Duration::from_secs(60))
                .await?;
        }
        let workers: Vec<routers::Worker> = pods.iter().map(Pod::worker).collect();

        for &rk in &here {
            // A fresh router process for every run: no router carries memory of the previous
            // run's placements into a run whose caches were reset (peers' prefix trees would;
            // so would kvsight's affinity).
            let starter = Starter {
                http: &http,
                bins: &opts.bins,
                peers_bin: &peers_bin,
                workers: &workers,
                block_size: cost.block_size,
                logs: &logs,
                pods: pods.len(),
            };
            // Where a run's wall time goes (router start, probes, reset and drain vs the load),
            // printed with its figures: the full run's length is mostly these.
            let mut run_start = Instant::now();
            let (mut other, mut url) = starter.start(rk, &mut kv_routers).await?;
            let added_ms = Some(added_latency(&http, &pods, &url, 21).await? * 1000.0);
            // Variants, where they run on a subset, run at the two highest rates: below
            // saturation every router is level, and the full run must fit in 30 minutes.
            let router_rates = if opts.variants_on.is_some() && !rk.is_headline() {
                &rates[rates.len().saturating_sub(2)..]
            } else {
                &rates[..]
            };
            for (run_index, &rate) in router_rates.iter().enumerate() {
                if run_index > 0 {
                    if let Some(p) = other.take() {
                        p.stop(Duration::from_secs(3)).await;
                    }
                    (other, url) = starter.start(rk, &mut kv_routers).await?;
                }
                let proc = match &other {
                    Some(p) => p,
                    None => {
                        &kv_routers
                            .iter()
                            .find(|r| r.kind == rk)
                            .expect("started")
                            .proc
                    }
                };
                let plan = w.plan(rate, cost.time_scale);
                for p in &pods {
                    p.reset_cache(&http).await?;
                }
                cluster::wait_idle(&pods, &http, Duration::from_secs(120)).await?;
                let before = counters(&pods, &http).await?;
                let stale0 = if rk.predicts() {
                    staleness_buckets(&http, &url).await.ok()
                } else {
                    None
                };
                let cpu0 = proc.cpu_seconds();
                proc.reset_peak_rss();
                let t0 = Instant::now();
                let setup_s = (t0 - run_start).as_secs_f64();
                let span = plan.requests.last().map_or(Duration::ZERO, |r| r.at);
                // mixed_faults: load that bypasses the router at 20 % of the arrivals, a cold pod
                // joining at 30 %.
                let faults = (wk == WorkloadKind::MixedFaults).then(|| {
                    let exec = tokio::spawn({
                        let (http, url) = (http.clone(), pods[0].url.clone());
                        let (prompt, output) = (cost.tokens(8000), cost.tokens(4000));
                        async move {
                            tokio::time::sleep(span / 5).await;
                            faults::exec_load(http, url, faults::EXEC_REQUESTS, prompt, output)
                                .await;
                        }
                    });
                    (exec, span * 3 / 10)
                });
                let client = client::run(&http, &url, &plan.requests, Duration::from_secs(600));
                let (outcomes, cold) = match &faults {
                    None => (client.await, None),
                    Some((_, join_at)) => {
                        let join = async {
                            tokio::time::sleep(*join_at).await;
                            faults::ColdPod::join("pod-cold", &cold_cfg, rk, &url, &http).await
                        };
                        let (outcomes, cold) = tokio::join!(client, join);
                        (outcomes, Some(cold?))
                    }
                };
                let wall_s = t0.elapsed().as_secs_f64();
                let cpu_s = proc.cpu_seconds() - cpu0;
                let rss = proc.peak_rss_bytes();
                // The bypassing load has done its job once the measured requests are done.
                if let Some((exec, _)) = faults {
                    exec.abort();
                }
                let mut delta: Vec<PodCounters> = counters(&pods, &http)
                    .await?
                    .iter()
                    .zip(&before)
                    .map(|(a, b)| a.since(b))
                    .collect();
                if let Some(cold) = cold {
                    delta.push(cold.pod.counters(&http).await?);
                    cold.leave(rk, &url, &http).await?;
                }
                let staleness_ms = match stale0 {
                    Some(b0) => staleness_buckets(&http, &url)
                        .await
                        .ok()
                        .and_then(|b1| staleness_quantiles(&b0, &b1)),
                    None => None,
                };
                write_outcomes(&opts.out, rk, wk, rate, &plan, &outcomes)?;
                let r = RunResult::new(&RunInputs {
                    router: rk.name(),
                    workload: wk.name(),
                    rate,
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
                });
                println!(
                    "bench: {:<14} {:>5} req/s {:<24} hit {:>5} ttft p50 {:>7} p90 {:>7} p99 {:>7} errors {}{} [wall {:.1} s: setup {:.1}, load {:.1}]",
                    wk.name(),
                    rate,
                    rk.name(),
                    r.hit_rate.map_or("–".into(), |v| format!("{v:.2}")),
                    r.ttft_p50_s.map_or("–".into(), |v| format!("{v:.3}")),
                    r.ttft_p90_s.map_or("–".into(), |v| format!("{v:.3}")),
                    r.ttft_p99_s.map_or("–".into(), |v| format!("{v:.3}")),
                    r.errors,
                    r.first_error
                        .as_deref()
                        .map_or(String::new(), |e| format!(" (first: {e})")),
                    run_start.elapsed().as_secs_f64(),
                    setup_s,
                    wall_s,
                );
                run_start = Instant::now();
                if rate == *rates.last().expect("rates") {
                    ttfts.insert(
                        (wk.name().to_owned(), rk.name().to_owned()),
                        outcomes
                            .iter()
                            .filter_map(|o| o.ttft_s.map(|t| t / cost.time_scale))
                            .collect(),
                    );
                }
                runs.push(r);
            }
            if let Some(p) = other {
                p.stop(Duration::from_secs(3)).await;
            }
        }
        for p in pods {
            p.stop().await;
        }
        for r in kv_routers {
            r.proc.stop(Duration::from_secs(3)).await;
        }
    }

    let markdown = report::markdown(&runs);
    let results = json!({
        "runs": runs,
        "cost_model": cost,
        "pods": opts.pods,
        "peers": peer_versions,
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

/// The router's `kvsight_router_view_staleness_seconds` histogram: (upper bound, cumulative
/// count) per bucket.
async fn staleness_buckets(http: &reqwest::Client, router: &str) -> Result<Vec<(f64, f64)>> {
    let text = http
        .get(format!("{router}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    let mut out = Vec::new();
    for s in kvsight_sidecar::scrape::samples(&text)? {
        if s.name == "kvsight_router_view_staleness_seconds_bucket"
            && let Some(le) = s.labels.get("le")
        {
            let le = le.parse().unwrap_or(f64::INFINITY);
            out.push((le, s.value));
        }
    }
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

/// Starts (or restarts) a router under test.
struct Starter<'a> {
    http: &'a reqwest::Client,
    bins: &'a Binaries,
    peers_bin: &'a Path,
    workers: &'a [routers::Worker],
    block_size: u32,
    logs: &'a Path,
    pods: usize,
}

impl Starter<'_> {
    /// A fresh process of `rk`: a kvsight variant restarted on its ports (the sidecars
    /// reconnect), a peer or baseline started anew. Returns the peer's process and the URL.
    async fn start(
        &self,
        rk: RouterKind,
        kv_routers: &mut [KvsightRouter],
    ) -> Result<(Option<procs::Proc>, String)> {
        if let Some(r) = kv_routers.iter_mut().find(|r| r.kind == rk) {
            r.restart(self.http, self.pods).await?;
            return Ok((None, r.url.clone()));
        }
        let (p, url) = routers::start_other(
            rk,
            self.bins,
            self.peers_bin,
            self.workers,
            self.block_size,
            self.logs,
            self.http,
        )
        .await?;
        Ok((Some(p), url))
    }
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
            };
            async move {
                let o = client::run(
                    http,
                    &base,
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
        let series = |f: &dyn Fn(&RunResult) -> Option<f64>| -> Vec<charts::Series> {
            by_router
                .iter()
                .map(|(name, rs)| charts::Series {
                    name: (*name).to_owned(),
                    points: rs.iter().filter_map(|r| Some((r.rate, f(r)?))).collect(),
                })
                .collect()
        };
        charts::lines(
            &out.join(format!("ttft_p90_{wk}.svg")),
            &format!("{wk}: TTFT p90 vs arrival rate"),
            "requests / s",
            "TTFT p90 (s)",
            &series(&|r| r.ttft_p90_s),
        )?;
        charts::lines(
            &out.join(format!("hit_rate_{wk}.svg")),
            &format!("{wk}: prefix-cache hit rate (pods' counters)"),
            "requests / s",
            "hit rate",
            &series(&|r| r.hit_rate),
        )?;
        let cdfs: Vec<charts::Series> = ttfts
            .iter()
            .filter(|((w, _), _)| w == wk)
            .map(|((_, r), v)| charts::Series {
                name: r.clone(),
                points: charts::cdf(v.clone()),
            })
            .collect();
        charts::lines(
            &out.join(format!("ttft_cdf_{wk}.svg")),
            &format!("{wk}: TTFT CDF at the highest rate"),
            "TTFT (s)",
            "share of requests",
            &cdfs,
        )?;
    }
    Ok(())
}
