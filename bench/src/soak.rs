//! `kvsight-bench soak` (what `cargo xtask soak --minutes N` runs): hours of production
//! squeezed into minutes, on loopback only.
//!
//! Two kvsight router processes, eight `vllm-sim` processes with a real sidecar process each
//! (the bench's pods: [`crate::cluster`]), and a thousand streaming clients — tokio tasks of
//! this process, half on each replica — that each send a completion, read its stream to the
//! end, and send the next. Every ten seconds one fault or change is injected, in turn: an
//! engine crashes (SIGKILL) and its container restarts on the same ports, both routers' config
//! file is rewritten (a hot reload), a pod leaves (its sidecar drains and says Goodbye, the
//! engine stops once idle) and joins again (a fresh engine and sidecar).
//!
//! At the end: requests served, failures split into those an injected crash explains and the
//! rest (the target is none), every long-lived process's open descriptors after the warm-up and
//! at the end (stable) and its resident memory sampled every ten seconds — growth under 10 %
//! from a third of the run to its end, judged in runs of ten minutes or more (before that,
//! bounded structures are still filling: see [`MEMORY_FROM`]) — and the routers' p99 added
//! latency. A missed target makes the command fail.
//!
//! Every loop is bounded: clients stop sending at the end and each request has a timeout,
//! every wait on a process or a condition has a deadline.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use serde_json::json;

use crate::client;
use crate::cluster::{Binaries, Certs, Pod, PodsConfig};
use crate::cost::CostModel;
use crate::procs::Proc;
use crate::routers::{Kind, KvsightRouter};
use crate::workload::MODEL;

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    pub minutes: f64,
    pub clients: usize,
    pub pods: usize,
    /// Wall seconds per simulated second of the pods' H100 cost model.
    pub time_scale: f64,
    /// Where logs, certificates and `soak.json` go.
    pub out: PathBuf,
    pub bins: Binaries,
}

/// Router replicas; clients alternate between them.
const ROUTERS: usize = 2;
/// Wall time between two injected events.
const EVENT_EVERY: Duration = Duration::from_secs(10);
/// Tenants sharing a system prompt each: what gives the routers a prefix to follow.
const TENANTS: usize = 32;
/// Generated tokens per request. At the default time scale (20) a decode step of the cost model
/// with ~125 running sequences takes ~0.2 s of wall time, so a request streams for ~25 s and
/// 1,000 clients keep ~1,000 streams open while the routers see ~40 new requests a second —
/// what two shared cores can carry beside 18 other processes.
const MAX_TOKENS: u32 = 128;
/// No request may take longer (a stuck stream is a failure, not a hang of the soak).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(180);
/// KV blocks per pod: ~125 sequences of ~300 tokens, plus every tenant's prompt.
const KV_BLOCKS: u32 = 6_000;
/// Resident memory may grow by less than this share between [`MEMORY_FROM`] of the run and
/// its end.
const RSS_GROWTH_LIMIT: f64 = 0.10;
/// Where the memory baseline is taken, as a share of the run. The growth of the first minutes
/// levels off, while a leak grows on (the 30-minute run in docs/bench/README.md, "Soak").
const MEMORY_FROM: f64 = 1.0 / 3.0;
/// Shorter runs are still filling at [`MEMORY_FROM`]: their memory is reported, not judged.
const MEMORY_MIN_MINUTES: f64 = 10.0;
/// Open descriptors may grow by at most this share (plus [`FD_SLACK`]): they follow the
/// number of open connections, which the fixed client count keeps level.
const FD_GROWTH_LIMIT: f64 = 0.10;
const FD_SLACK: usize = 32;

/// What one request saw, for attributing failures.
#[derive(Debug, Clone)]
struct Failure {
    start: Instant,
    end: Instant,
    /// The pod the router chose (`x-kvsight-decision`), when it answered with headers.
    pod: Option<String>,
    message: String,
}

#[derive(Debug, Default)]
struct Tally {
    ok: u64,
    failures: Vec<Failure>,
}

/// One engine crash: from just before the SIGKILL to its exit.
#[derive(Debug, Clone)]
struct Crash {
    pod: String,
    from: Instant,
    to: Instant,
}

/// One process's figures: memory from a third of the run to its end, descriptors from the
/// warm-up to the end.
#[derive(Debug, Clone, Serialize)]
pub struct ProcFigures {
    pub name: String,
    /// Seconds into the run of the memory baseline (see [`MEMORY_FROM`]).
    pub rss_from_s: f64,
    pub rss_start_mib: f64,
    pub rss_end_mib: f64,
    pub rss_growth: f64,
    /// Whether the run was long enough for the growth to count (see [`MEMORY_MIN_MINUTES`]).
    pub rss_judged: bool,
    pub fds_start: usize,
    /// The median over the last third of the run.
    pub fds_end: usize,
    /// `(seconds since the start, RSS MiB, open fds)` at every event tick from the warm-up
    /// on: what tells a structure filling up to its bound (growth that levels off) from a leak
    /// (growth that does not).
    pub timeline: Vec<(f64, f64, usize)>,
}

/// The soak's outcome (written to `soak.json`).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub minutes: f64,
    pub clients: usize,
    pub pods: usize,
    pub routers: usize,
    pub time_scale: f64,
    pub requests_served: u64,
    pub failed: usize,
    /// Failures an injected crash explains: the request was in flight on the crashed engine.
    pub failed_injected: usize,
    pub failed_outside: usize,
    pub outside_examples: Vec<String>,
    pub events: Vec<String>,
    pub processes: Vec<ProcFigures>,
    pub added_latency_p99_ms: Option<f64>,
    pub added_latency_count: u64,
    /// Targets missed; empty when the soak passed.
    pub misses: Vec<String>,
}

/// Runs the soak; `Err` when it could not run, a report with `misses` when it ran and failed.
pub async fn run(opts: &Options) -> Result<Report> {
    let total = Duration::from_secs_f64(opts.minutes * 60.0);
    if total < Duration::from_secs(30) {
        bail!("--minutes must be at least 0.5");
    }
    if opts.pods < 4 {
        bail!("--pods must be at least 4 (two stay, two leave and join, one crashes)");
    }
    // Long enough for the ramp, every tenant's first prefill and the allocators' first growth.
    let warm_up = (total / 4).clamp(Duration::from_secs(15), Duration::from_secs(60));
    std::fs::create_dir_all(&opts.out)?;
    let logs = opts.out.join("logs");
    let _ = std::fs::remove_dir_all(&logs);
    let tokenizer_dir = kvsight_sim::own_tokenizer::ensure_dir()?;
    let cost = CostModel::h100_8b(opts.time_scale);
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(4 * opts.clients)
        .tcp_nodelay(true)
        .build()?;
    let certs = Certs::new(&opts.out.join("certs"))?;

    let routers: Vec<KvsightRouter> = (0..ROUTERS)
        .map(|i| {
            KvsightRouter::start_replica(
                Kind::Kvsight,
                &format!("router-{i}"),
                &opts.bins,
                &certs,
                &logs,
            )
        })
        .collect::<Result<_>>()?;
    let quic: Vec<String> = routers.iter().map(|r| r.quic.clone()).collect();
    // Engines without compile stalls, so nothing needs warming: a joining pod is Ready within
    // a report interval instead of after a warm-up plan that, at this time scale, would outlast
    // the interval between events.
    let cfg = PodsConfig::warm(
        &opts.bins,
        &cost,
        KV_BLOCKS,
        &tokenizer_dir,
        &certs,
        &logs,
        &quic,
    );
    let mut cluster = Cluster::start(opts, cfg, http, routers).await?;
    println!(
        "soak: {} clients, {ROUTERS} routers, {} pods, time scale {}, {:.1} min (warm-up {} s)",
        opts.clients,
        opts.pods,
        opts.time_scale,
        opts.minutes,
        warm_up.as_secs()
    );

    let started = Instant::now();
    let end = started + total;
    let tally = Arc::new(Mutex::new(Tally::default()));
    let clients = cluster.spawn_clients(opts.clients, started, warm_up, end, &tally);

    // After the warm-up: the baseline of every long-lived process.
    tokio::time::sleep_until((started + warm_up).into()).await;
    let baseline = cluster.watched();
    let mut timeline: Vec<(f64, Vec<(String, Sample)>)> =
        vec![(started.elapsed().as_secs_f64(), baseline.clone())];
    let faults = cluster.inject_faults(started, end, &mut timeline).await?;
    tokio::time::sleep_until(end.into()).await;
    // Under the same load as the baseline: clients are still streaming.
    let last = cluster.watched();
    timeline.push((started.elapsed().as_secs_f64(), last.clone()));
    let mut buckets = Vec::new();
    for r in &cluster.routers {
        buckets.push(added_latency_buckets(&metrics(r, &cluster.http).await?));
    }
    drain(clients).await?;

    let tally = std::mem::take(&mut *tally.lock().unwrap_or_else(|e| e.into_inner()));
    let report = judge(
        opts,
        &tally,
        &faults.crashes,
        faults.events,
        &baseline,
        &last,
        &timeline,
        &buckets,
    );
    cluster.stop().await;
    std::fs::write(
        opts.out.join("soak.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    Ok(report)
}

/// Clients send nothing after `end`; what is in flight finishes (bounded by its timeout).
async fn drain(mut clients: tokio::task::JoinSet<()>) -> Result<()> {
    let drained = tokio::time::timeout(REQUEST_TIMEOUT + Duration::from_secs(10), async {
        while clients.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        clients.abort_all();
        bail!("clients did not finish within their request timeout");
    }
    Ok(())
}

/// The soak's routers and pods, and the client that reaches them.
struct Cluster<'a> {
    cfg: PodsConfig<'a>,
    http: reqwest::Client,
    routers: Vec<KvsightRouter>,
    /// `None` while a pod is out.
    pods: Vec<Option<Pod>>,
    /// Pods below this index keep their sidecar for the whole run; the last two leave and join.
    stable: usize,
}

/// The injected events so far, and the state the next one starts from.
#[derive(Default)]
struct Faults {
    events: Vec<String>,
    crashes: Vec<Crash>,
    /// The pod that left and has not joined again.
    out: Option<usize>,
    config_variant: bool,
}

impl<'a> Cluster<'a> {
    /// Starts `opts.pods` pods and waits until each is ready and every router routes to all.
    async fn start(
        opts: &Options,
        cfg: PodsConfig<'a>,
        http: reqwest::Client,
        mut routers: Vec<KvsightRouter>,
    ) -> Result<Cluster<'a>> {
        let mut pods: Vec<Option<Pod>> = Vec::new();
        for i in 0..opts.pods {
            pods.push(Some(Pod::start(&format!("pod-{i}"), &cfg, &http).await?));
        }
        for p in pods.iter_mut().flatten() {
            p.wait_ready(&http, Duration::from_secs(60)).await?;
        }
        for r in &mut routers {
            r.wait_pods(&http, opts.pods, Duration::from_secs(60))
                .await?;
        }
        Ok(Cluster {
            cfg,
            http,
            routers,
            pods,
            stable: opts.pods - 2,
        })
    }

    fn spawn_clients(
        &self,
        n: usize,
        started: Instant,
        warm_up: Duration,
        end: Instant,
        tally: &Arc<Mutex<Tally>>,
    ) -> tokio::task::JoinSet<()> {
        let urls: Arc<[String]> = self.routers.iter().map(|r| r.url.clone()).collect();
        let mut clients = tokio::task::JoinSet::new();
        for i in 0..n {
            // Spread the first requests over half the warm-up: a thousand cold prefills at once
            // would measure the ramp, not the steady state.
            let first = started + warm_up / 2 * (i as u32) / (n as u32);
            clients.spawn(client_loop(
                i,
                self.http.clone(),
                Arc::clone(&urls),
                first,
                end,
                Arc::clone(tally),
            ));
        }
        clients
    }

    /// The figures of every process that lives for the whole run.
    fn watched(&self) -> Vec<(String, Sample)> {
        let mut v: Vec<(String, Sample)> = self
            .routers
            .iter()
            .map(|r| (r.proc.name.clone(), Sample::of(&r.proc)))
            .collect();
        for p in self.pods[..self.stable].iter().flatten() {
            if let Some(s) = &p.sidecar {
                v.push((s.name.clone(), Sample::of(s)));
            }
        }
        v
    }

    /// Injected events, one every EVENT_EVERY, until one interval before the end; a sample of
    /// the watched processes after each.
    async fn inject_faults(
        &mut self,
        started: Instant,
        end: Instant,
        timeline: &mut Vec<(f64, Vec<(String, Sample)>)>,
    ) -> Result<Faults> {
        let mut faults = Faults::default();
        let mut step = 0usize;
        while Instant::now() + EVENT_EVERY < end {
            let began = Instant::now();
            let t = started.elapsed().as_secs_f64();
            let what = self.inject(step, t, &mut faults).await?;
            println!("soak: {what}");
            faults.events.push(what);
            timeline.push((started.elapsed().as_secs_f64(), self.watched()));
            step += 1;
            // Spaced from this event's start: a leave waits for the engine's streams to end
            // (~25 s) and the events after it must not then fire back to back.
            tokio::time::sleep_until((began + EVENT_EVERY).max(Instant::now()).into()).await;
        }
        if let Some(j) = faults.out.take() {
            self.pods[j] = Some(join(j, &self.cfg, &self.http).await?);
            faults.events.push(format!(
                "{:.0}s pod-{j} joined",
                started.elapsed().as_secs_f64()
            ));
        }
        Ok(faults)
    }

    /// Event `step` of the cycle crash, reload, leave, join; what happened, at `t` seconds.
    async fn inject(&mut self, step: usize, t: f64, faults: &mut Faults) -> Result<String> {
        let (cfg, http, stable) = (&self.cfg, &self.http, self.stable);
        Ok(match step % 4 {
            0 => {
                let k = (step / 4) % stable;
                let pod = self.pods[k].as_mut().context("a stable pod is out")?;
                let from = Instant::now();
                pod.crash_and_restart_sim(cfg, http)
                    .await
                    .with_context(|| format!("restarting {}", pod.name))?;
                let to = Instant::now();
                faults.crashes.push(Crash {
                    pod: format!("bench/{}", pod.name),
                    from,
                    to,
                });
                format!("{t:.0}s crash+restart engine of pod-{k}")
            }
            1 => {
                faults.config_variant = !faults.config_variant;
                reload(&self.routers, http, faults.config_variant).await?;
                format!(
                    "{t:.0}s config reload (variant {})",
                    u8::from(faults.config_variant)
                )
            }
            2 => {
                let j = stable + (step / 4) % 2;
                let pod = self.pods[j].take().context("the leaving pod is out")?;
                pod.leave(http, REQUEST_TIMEOUT).await?;
                faults.out = Some(j);
                format!("{t:.0}s pod-{j} left")
            }
            _ => {
                let j = faults.out.take().context("no pod is out")?;
                self.pods[j] = Some(join(j, cfg, http).await?);
                format!("{t:.0}s pod-{j} joined")
            }
        })
    }

    async fn stop(self) {
        for p in self.pods.into_iter().flatten() {
            p.stop().await;
        }
        for r in self.routers {
            r.proc.stop(Duration::from_secs(3)).await;
        }
    }
}

async fn join(j: usize, cfg: &PodsConfig<'_>, http: &reqwest::Client) -> Result<Pod> {
    let mut pod = Pod::start(&format!("pod-{j}"), cfg, http).await?;
    pod.wait_ready(http, Duration::from_secs(60)).await?;
    Ok(pod)
}

/// Rewrites every router's config file (by rename, as a ConfigMap update does) and waits until
/// each counted one more applied reload.
async fn reload(routers: &[KvsightRouter], http: &reqwest::Client, variant: bool) -> Result<()> {
    let text = if variant {
        "scheduler:\n  weights: {prefix: 2, queue: 2}\n"
    } else {
        "{}\n"
    };
    let mut before = Vec::new();
    for r in routers {
        before.push(applied_reloads(r, http).await?);
    }
    for r in routers {
        let tmp = r.config.with_extension("yaml.tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &r.config)?;
    }
    for (r, b) in routers.iter().zip(before) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while applied_reloads(r, http).await? <= b {
            if Instant::now() >= deadline {
                bail!("{} did not apply the new config within 20 s", r.proc.name);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

async fn metrics(r: &KvsightRouter, http: &reqwest::Client) -> Result<String> {
    crate::client::metrics_text(http, &r.admin).await
}

async fn applied_reloads(r: &KvsightRouter, http: &reqwest::Client) -> Result<f64> {
    Ok(metrics(r, http)
        .await?
        .lines()
        .find_map(|l| l.strip_prefix(r#"kvsight_router_config_reloads_total{outcome="applied"} "#))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0))
}

/// One client: request after request until `end`, each streamed to its end.
async fn client_loop(
    i: usize,
    http: reqwest::Client,
    urls: Arc<[String]>,
    first: Instant,
    end: Instant,
    tally: Arc<Mutex<Tally>>,
) {
    tokio::time::sleep_until(first.into()).await;
    let url = format!("{}/v1/completions", urls[i % urls.len()]);
    let tenant = i % TENANTS;
    let mut n = 0usize;
    while Instant::now() < end {
        let body = json!({
            "model": MODEL,
            "prompt": format!("{}Client {i} question {n}: what should I check first?", system_prompt(tenant)),
            "max_tokens": MAX_TOKENS,
            "ignore_eos": true,
            "stream": true,
        });
        let start = Instant::now();
        let outcome = tokio::time::timeout(
            REQUEST_TIMEOUT,
            client::one(&http, &url, bytes::Bytes::from(body.to_string()), &[]),
        )
        .await;
        let finished = Instant::now();
        let failure = match outcome {
            Ok(o) => o.error.map(|message| Failure {
                start,
                end: finished,
                pod: o
                    .decision
                    .as_ref()
                    .and_then(|d| d["pod"].as_str())
                    .map(str::to_owned),
                message,
            }),
            Err(_) => Some(Failure {
                start,
                end: finished,
                pod: None,
                message: format!("no answer within {REQUEST_TIMEOUT:?}"),
            }),
        };
        {
            let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
            match failure {
                None => t.ok += 1,
                Some(f) => t.failures.push(f),
            }
        }
        n += 1;
        // A short, varied pause, as between a user's turns; it also de-synchronises clients
        // that a crash cut at the same moment.
        let think = Duration::from_millis(((i * 37 + n * 101) % 500) as u64);
        tokio::time::sleep(think).await;
    }
}

/// A tenant's system prompt, ~150 tokens with the project's tokenizer.
fn system_prompt(tenant: usize) -> String {
    let mut s = format!("You are the support assistant of tenant {tenant}. ");
    for rule in 0..8 {
        s.push_str(&format!(
            "Rule {rule} of tenant {tenant}: answer briefly, cite the manual, never guess. "
        ));
    }
    s
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    rss: Option<u64>,
    fds: Option<usize>,
}

impl Sample {
    fn of(p: &Proc) -> Sample {
        Sample {
            rss: p.rss_bytes(),
            fds: p.open_fds(),
        }
    }
}

/// `(le, cumulative count)` of `kvsight_router_added_latency_seconds`.
fn added_latency_buckets(text: &str) -> Vec<(f64, f64)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("kvsight_router_added_latency_seconds_bucket{le=\""))
        .filter_map(|rest| {
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.trim().parse().ok()?))
        })
        .collect()
}

/// The p99 of the routers' histograms together (the upper bound of the bucket holding it) and
/// the number of observations.
fn p99(routers: &[Vec<(f64, f64)>]) -> (Option<f64>, u64) {
    let mut merged: Vec<(f64, f64)> = Vec::new();
    for b in routers {
        for &(le, c) in b {
            match merged.iter_mut().find(|(l, _)| *l == le) {
                Some(m) => m.1 += c,
                None => merged.push((le, c)),
            }
        }
    }
    merged.sort_by(|a, b| a.0.total_cmp(&b.0));
    let count = merged.last().map_or(0.0, |m| m.1);
    let p = merged
        .iter()
        .find(|(_, c)| *c >= 0.99 * count && count > 0.0)
        .map(|(le, _)| *le);
    (p, count as u64)
}

fn judge(
    opts: &Options,
    tally: &Tally,
    crashes: &[Crash],
    events: Vec<String>,
    baseline: &[(String, Sample)],
    last: &[(String, Sample)],
    timeline: &[(f64, Vec<(String, Sample)>)],
    buckets: &[Vec<(f64, f64)>],
) -> Report {
    let mut misses = Vec::new();
    // A failure is the injection's when the request was in flight on the engine that crashed:
    // the router named that pod (decision header, or the 502's message) and the request began
    // before the engine was gone and ended after the kill began.
    let injected = |f: &Failure| {
        crashes.iter().any(|c| {
            let on_it = f.pod.as_deref() == Some(c.pod.as_str()) || f.message.contains(&c.pod);
            on_it && f.start <= c.to && f.end >= c.from
        })
    };
    let outside: Vec<&Failure> = tally.failures.iter().filter(|f| !injected(f)).collect();
    let failed_injected = tally.failures.len() - outside.len();
    if !outside.is_empty() {
        misses.push(format!(
            "{} failures outside injected faults (target 0)",
            outside.len()
        ));
    }
    if tally.ok == 0 {
        misses.push("no request was served".into());
    }
    let mut processes = Vec::new();
    for (name, start) in baseline {
        processes.extend(proc_figures(opts, name, start, last, timeline, &mut misses));
    }
    let (p99_s, count) = p99(buckets);
    Report {
        minutes: opts.minutes,
        clients: opts.clients,
        pods: opts.pods,
        routers: ROUTERS,
        time_scale: opts.time_scale,
        requests_served: tally.ok,
        failed: tally.failures.len(),
        failed_injected,
        failed_outside: outside.len(),
        outside_examples: outside
            .iter()
            .take(10)
            .map(|f| {
                format!(
                    "{:?} after {:.1}s: {}",
                    f.pod,
                    (f.end - f.start).as_secs_f64(),
                    f.message
                )
            })
            .collect(),
        events,
        processes,
        added_latency_p99_ms: p99_s.map(|s| s * 1e3),
        added_latency_count: count,
        misses,
    }
}

/// One long-lived process's memory and descriptor figures, judged against their limits; `None`
/// (and a miss) when it was gone at the end or had no `/proc` figures.
fn proc_figures(
    opts: &Options,
    name: &str,
    start: &Sample,
    last: &[(String, Sample)],
    timeline: &[(f64, Vec<(String, Sample)>)],
    misses: &mut Vec<String>,
) -> Option<ProcFigures> {
    let memory_from = opts.minutes * 60.0 * MEMORY_FROM;
    let memory_judged = opts.minutes >= MEMORY_MIN_MINUTES;
    let Some((_, end)) = last.iter().find(|(n, _)| n == name) else {
        misses.push(format!("{name} was gone at the end"));
        return None;
    };
    let curve: Vec<(f64, f64, usize)> = timeline
        .iter()
        .filter_map(|(t, samples)| {
            let (_, s) = samples.iter().find(|(n, _)| n == name)?;
            Some((*t, s.rss? as f64 / 1048576.0, s.fds?))
        })
        .collect();
    // Descriptors follow the connections open at the moment (streams in flight, idle
    // pooled ones, a crashed engine's clients reconnecting): one sample swings by ±10 %
    // (961–1,158 in a 30-minute run). The median of the last third of the run shows a
    // trend; a leak moves it, a swing does not.
    let mut late_fds: Vec<usize> = curve
        .iter()
        .filter(|(t, _, _)| *t >= 2.0 * opts.minutes * 60.0 / 3.0)
        .map(|&(_, _, f)| f)
        .collect();
    late_fds.sort_unstable();
    let (Some(&(from_s, r0, _)), Some(r1), Some(f0), Some(f1)) = (
        curve
            .iter()
            .find(|(t, _, _)| *t >= memory_from)
            .or(curve.first()),
        end.rss,
        start.fds,
        late_fds.get(late_fds.len() / 2).copied().or(end.fds),
    ) else {
        misses.push(format!("{name}: no /proc figures"));
        return None;
    };
    let r1 = r1 as f64 / 1048576.0;
    let growth = r1 / r0 - 1.0;
    if memory_judged && growth >= RSS_GROWTH_LIMIT {
        misses.push(format!(
            "{name}: RSS grew {:.1} % from {from_s:.0} s to the end (limit {:.0} %)",
            growth * 100.0,
            RSS_GROWTH_LIMIT * 100.0
        ));
    }
    let fd_limit = f0 + (f0 as f64 * FD_GROWTH_LIMIT) as usize + FD_SLACK;
    if f1 > fd_limit {
        misses.push(format!(
            "{name}: open descriptors {f0} -> {f1} (median of the last third; limit {fd_limit})"
        ));
    }
    Some(ProcFigures {
        name: name.to_owned(),
        rss_from_s: from_s,
        rss_start_mib: r0,
        rss_end_mib: r1,
        rss_growth: growth,
        rss_judged: memory_judged,
        fds_start: f0,
        fds_end: f1,
        timeline: curve,
    })
}

/// The report as the lines the command prints.
pub fn summary(r: &Report) -> String {
    let mut s = format!(
        "soak: {:.1} min, {} clients, {} routers, {} pods (time scale {})\n\
         soak: requests served {}, failed {} ({} injected: in flight on a crashed engine; {} outside injected faults)\n",
        r.minutes,
        r.clients,
        r.routers,
        r.pods,
        r.time_scale,
        r.requests_served,
        r.failed,
        r.failed_injected,
        r.failed_outside
    );
    for e in &r.outside_examples {
        s.push_str(&format!("soak:   outside: {e}\n"));
    }
    s.push_str(&format!("soak: events: {}\n", r.events.join(", ")));
    for p in &r.processes {
        s.push_str(&format!(
            "soak: {:<16} RSS {:.1} MiB at {:.0} s -> {:.1} MiB ({:+.1} %{}), open fds {} -> {} (median of the last third)\n",
            p.name,
            p.rss_start_mib,
            p.rss_from_s,
            p.rss_end_mib,
            p.rss_growth * 100.0,
            if p.rss_judged {
                ""
            } else {
                "; run too short to judge memory"
            },
            p.fds_start,
            p.fds_end
        ));
        // The curve at about every quarter of the run: levelling off is a structure filling to
        // its bound, a straight line is a leak.
        let n = p.timeline.len();
        if n > 0 {
            let picks: Vec<String> = (0..=4)
                .map(|q| &p.timeline[(q * (n - 1)) / 4])
                .map(|(t, rss, fds)| format!("{t:.0} s {rss:.1} MiB {fds} fds"))
                .collect();
            s.push_str(&format!(
                "soak: {:<16} curve: {}\n",
                p.name,
                picks.join(" | ")
            ));
        }
    }
    s.push_str(&format!(
        "soak: added latency p99 {} over {} requests (routers' kvsight_router_added_latency_seconds, bucket bound)\n",
        r.added_latency_p99_ms
            .map_or("n/a".into(), |v| format!("<= {v:.2} ms")),
        r.added_latency_count
    ));
    if r.misses.is_empty() {
        s.push_str("soak: every target met\n");
    } else {
        for m in &r.misses {
            s.push_str(&format!("soak: MISSED: {m}\n"));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(minutes: f64) -> Options {
        Options {
            minutes,
            clients: 10,
            pods: 4,
            time_scale: 20.0,
            out: PathBuf::new(),
            bins: Binaries {
                vllm_sim: PathBuf::new(),
                sidecar: PathBuf::new(),
                router: PathBuf::new(),
                bench: PathBuf::new(),
            },
        }
    }

    fn sample(mib: u64, fds: usize) -> Sample {
        Sample {
            rss: Some(mib << 20),
            fds: Some(fds),
        }
    }

    /// A router whose memory grows 40 -> 46 MiB by a third of the run, then by `late` MiB.
    fn judged(minutes: f64, late: u64) -> Report {
        let run = minutes * 60.0;
        let at = |t: f64, mib: u64| (t, vec![("router-0".to_owned(), sample(mib, 100))]);
        let timeline = [
            at(run / 4.0, 40),
            at(run / 3.0, 46),
            at(run / 2.0, 46 + late / 2),
            at(run, 46 + late),
        ];
        let tally = Tally {
            ok: 1,
            failures: Vec::new(),
        };
        judge(
            &options(minutes),
            &tally,
            &[],
            Vec::new(),
            &timeline[0].1,
            &timeline[3].1,
            &timeline,
            &[],
        )
    }

    #[test]
    fn memory_is_judged_from_a_third_of_a_long_enough_run() {
        // Filling before the third (+15 %), level after: passes.
        let r = judged(10.0, 2);
        assert!(r.misses.is_empty(), "{:?}", r.misses);
        assert_eq!(r.processes[0].rss_start_mib, 46.0);
        assert_eq!(r.processes[0].rss_from_s, 200.0);
        // Growing on after the third (+13 %): a leak, missed.
        let r = judged(10.0, 6);
        assert_eq!(r.misses.len(), 1, "{:?}", r.misses);
        assert!(
            r.misses[0].contains("router-0: RSS grew 13.0 %"),
            "{:?}",
            r.misses
        );
        // The same growth in a 1-minute run is reported, not judged.
        let r = judged(1.0, 6);
        assert!(r.misses.is_empty(), "{:?}", r.misses);
        assert!(!r.processes[0].rss_judged);
        assert!(summary(&r).contains("run too short to judge memory"));
    }

    #[test]
    fn p99_is_the_bound_of_the_bucket_holding_it_over_both_routers() {
        let text = "kvsight_router_added_latency_seconds_bucket{le=\"0.001\"} 90\n\
                    kvsight_router_added_latency_seconds_bucket{le=\"0.002\"} 98\n\
                    kvsight_router_added_latency_seconds_bucket{le=\"0.004\"} 100\n\
                    kvsight_router_added_latency_seconds_bucket{le=\"+Inf\"} 100\n";
        let b = added_latency_buckets(text);
        assert_eq!(b.len(), 4);
        let (p, n) = p99(&[b.clone(), b]);
        assert_eq!(n, 200);
        assert_eq!(p, Some(0.004));
        assert_eq!(p99(&[]), (None, 0));
    }
}
