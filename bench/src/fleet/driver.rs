//! The measurement driver: per N × R, R `kvsight-router` processes and one swarm process
//! (`kvsight-bench swarm`), then three windows.
//!
//! 1. **Connect**: until every router shows every pod routable (Ready, with its filter).
//! 2. **Ingest** (no requests), after a warm-up: each router's CPU over the window (ingest
//!    alone), its RSS at the end, the view's staleness (`kvsight_router_view_staleness_seconds`
//!    counted in the window, all replicas together), the bytes and deltas each router received,
//!    the swarm's CPU, and how busy the whole machine was (the figures are only as good as the
//!    cores left to the routers).
//! 3. **Requests** at low load: one request at a time, round robin over the routers, each a
//!    completion of about 8,200 tokens (a 512-block chain at 16 tokens per block) sharing one of
//!    four long documents, streamed every other time; the pick (`kvsight_router_pick_seconds`)
//!    and the latency the router adds (`kvsight_router_added_latency_seconds`) counted in the
//!    window, all replicas together.
//!
//! Errors: swarm connections that failed or ended, requests that did not answer 2xx, sidecars a
//! router refused, prompts hashed in approximate mode, and a window that could not be measured.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use super::certs::{FleetCerts, router_name};
use super::histogram::{Buckets, counter, counter_with};
use super::swarm::StatsReport;
use super::{MODEL, SIDECAR_NAME};
use crate::procs::{Proc, free_tcp_port, free_udp_port, wait_ok};

/// Documents the request prompts share (each request is one of them plus its own question).
const DOCUMENTS: usize = 4;
/// Tokens of each document: with the question the prompt is a little over 512 blocks of 16.
const DOCUMENT_TOKENS: usize = 8_160;

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    pub pods: Vec<usize>,
    pub routers: Vec<usize>,
    pub gpu_blocks: u64,
    pub resident_blocks: u64,
    pub changes_per_s: f64,
    pub publish_interval: Duration,
    pub load_interval: Duration,
    pub warmup: Duration,
    pub ingest: Duration,
    /// Requests of the low-load window.
    pub requests: usize,
    /// Bound on the connect window.
    pub connect_within: Duration,
    pub out: PathBuf,
    pub router_bin: PathBuf,
    /// This program (`kvsight-bench swarm`).
    pub bench_bin: PathBuf,
    /// The command line, for the report.
    pub command: String,
}

/// One N × R cell; `None` where a figure could not be measured (then `errors` says why).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Row {
    pub pods: usize,
    pub routers: usize,
    /// The pick of a ~512-block chain in the routers, from their histogram (bucket bounds double:
    /// read within a factor of two).
    pub pick_p50_us: Option<f64>,
    pub pick_p99_us: Option<f64>,
    /// Body read → sent to the pod: tokenizing ~8,200 tokens, hashing, the pick.
    pub added_latency_p50_ms: Option<f64>,
    pub added_latency_p99_ms: Option<f64>,
    /// The tokenizing part of it (`kvsight_router_tokenize_seconds`).
    pub tokenize_p50_ms: Option<f64>,
    pub tokenize_p99_ms: Option<f64>,
    /// The largest replica's resident memory at the end of the ingest window.
    pub router_rss_mib: Option<f64>,
    /// CPU of one router for ingest alone, in cores (mean over replicas).
    pub router_ingest_cpu_cores: Option<f64>,
    pub staleness_p50_s: Option<f64>,
    pub staleness_p99_s: Option<f64>,
    /// The whole swarm's CPU over the ingest window, in cores.
    pub swarm_cpu_cores: Option<f64>,
    pub swarm_rss_mib: Option<f64>,
    /// Frame bytes each router received per second (mean over replicas).
    pub bytes_per_s_per_router: Option<f64>,
    /// Deltas each router received per second.
    pub deltas_per_s_per_router: Option<f64>,
    /// Swarm start → every pod routable on every router.
    pub connect_s: Option<f64>,
    /// Cores busy on the whole machine during the ingest window (routers, swarm and anything
    /// else running).
    pub machine_busy_cores: Option<f64>,
    pub requests: usize,
    /// UDP datagrams the kernel dropped for a full receive buffer over the whole cell, connect
    /// window included (`RcvbufErrors` of `/proc/net/snmp`: machine-wide).
    pub udp_rcvbuf_errors: Option<u64>,
    /// Snapshots sent again (a router asked, or a connection fell behind the deltas).
    pub resyncs: u64,
    /// Swarm connections that failed before every pod was routable (counted in `errors` too).
    pub connect_errors: u64,
    pub errors: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
}

/// Runs every N × R cell and writes `fleet.json` and `fleet.md` into `opts.out`.
pub async fn run(opts: &Options) -> Result<Vec<Row>> {
    std::fs::create_dir_all(&opts.out)?;
    let max_pods = opts.pods.iter().copied().max().unwrap_or(0);
    let max_routers = opts.routers.iter().copied().max().unwrap_or(0);
    let work = opts.out.join("fleet");
    let t = Instant::now();
    let certs = FleetCerts::issue(&work.join("certs"), max_routers, max_pods)?;
    println!(
        "fleet: {max_routers} router and {max_pods} pod certificates issued in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let tokenizer_dir = kvsight_sim::own_tokenizer::ensure_dir()?;
    let prompts = Prompts::new()?;
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(64)
        .build()?;
    let mut rows = Vec::new();
    for &n in &opts.pods {
        for &r in &opts.routers {
            println!("fleet: {n} pods × {r} routers");
            let cell = Cell {
                opts,
                certs: &certs,
                tokenizer_dir: &tokenizer_dir,
                prompts: &prompts,
                http: &http,
                logs: work.join(format!("logs/{n}x{r}")),
            };
            let row = match cell.run(n, r).await {
                Ok(row) => row,
                Err(e) => Row {
                    pods: n,
                    routers: r,
                    errors: 1,
                    first_error: Some(format!("{e:#}")),
                    ..Row::default()
                },
            };
            println!("fleet: {}", summary(&row));
            rows.push(row);
            // Written after every cell: a long run that fails late keeps what it measured.
            write(opts, &rows)?;
        }
    }
    Ok(rows)
}

/// One cell's line in the log.
fn summary(r: &Row) -> String {
    let f = |v: Option<f64>, digits: usize| v.map_or("-".into(), |v| format!("{v:.digits$}"));
    format!(
        "{} pods × {} routers: pick p99 {} µs, added p99 {} ms, router RSS {} MiB, ingest CPU {} cores, staleness p99 {} s, swarm CPU {} cores, {} KB/s per router, machine {} cores busy, UDP drops {}, errors {}{}",
        r.pods,
        r.routers,
        f(r.pick_p99_us, 0),
        f(r.added_latency_p99_ms, 2),
        f(r.router_rss_mib, 0),
        f(r.router_ingest_cpu_cores, 3),
        f(r.staleness_p99_s, 3),
        f(r.swarm_cpu_cores, 2),
        f(r.bytes_per_s_per_router.map(|b| b / 1e3), 0),
        f(r.machine_busy_cores, 2),
        r.udp_rcvbuf_errors.map_or("-".into(), |d| d.to_string()),
        r.errors,
        r.first_error
            .as_deref()
            .map_or(String::new(), |e| format!(" (first: {e})")),
    )
}

struct Cell<'a> {
    opts: &'a Options,
    certs: &'a FleetCerts,
    tokenizer_dir: &'a Path,
    prompts: &'a Prompts,
    http: &'a reqwest::Client,
    logs: PathBuf,
}

/// A router process and its addresses.
struct Router {
    proc: Proc,
    url: String,
    quic: String,
    /// Its admin listener: `/metrics` and `/debug/pods`.
    admin: String,
}

impl Router {
    /// Where this router's `/metrics` and `/debug/pods` answer.
    fn admin_url(&self) -> &str {
        &self.admin
    }

    async fn metrics(&self, http: &reqwest::Client) -> Result<String> {
        let r = http
            .get(format!("{}/metrics", self.admin_url()))
            .timeout(Duration::from_secs(10))
            .send()
            .await?
            .error_for_status()?;
        Ok(r.text().await?)
    }

    /// Pods Ready with a filter, as the router shows them.
    async fn routable(&self, http: &reqwest::Client) -> Result<usize> {
        let body = http
            .get(format!("{}/debug/pods", self.admin_url()))
            .timeout(Duration::from_secs(10))
            .send()
            .await?
            .bytes()
            .await?;
        let v: serde_json::Value = serde_json::from_slice(&body)?;
        Ok(v["pods"].as_array().map_or(0, |pods| {
            pods.iter()
                .filter(|p| p["phase"] == "ready" && !p["filter"].is_null())
                .count()
        }))
    }
}

/// The routers' request histograms and their sidecar refusals at one moment.
#[derive(Default)]
struct RequestMetrics {
    pick: Buckets,
    added: Buckets,
    tokenize: Buckets,
    refused: f64,
}

/// What one reading of every process gives.
struct Reading {
    at: Instant,
    router_cpu: Vec<f64>,
    swarm_cpu: f64,
    swarm: StatsReport,
    staleness: Buckets,
    machine: Option<(u64, u64)>,
}

impl Cell<'_> {
    async fn run(&self, n: usize, r: usize) -> Result<Row> {
        let opts = self.opts;
        let mut routers = Vec::with_capacity(r);
        for j in 0..r {
            routers.push(self.start_router(j)?);
        }
        for router in &mut routers {
            wait_ok(
                self.http,
                &format!("{}/health", router.url),
                &mut [&mut router.proc],
                Duration::from_secs(30),
            )
            .await?;
        }
        let drops_before = udp_rcvbuf_errors();
        let control = format!("127.0.0.1:{}", free_tcp_port()?);
        let mut swarm = self.start_swarm(n, &routers, &control)?;
        let stats_url = format!("http://{control}/stats");

        // Connect.
        let started = Instant::now();
        let deadline = started + opts.connect_within;
        loop {
            let mut all = true;
            for router in &routers {
                all &= router.routable(self.http).await.unwrap_or(0) >= n;
            }
            if all {
                break;
            }
            self.check_alive(&mut routers, &mut swarm)?;
            if Instant::now() >= deadline {
                let counts =
                    futures_util::future::join_all(routers.iter().map(|x| x.routable(self.http)))
                        .await;
                bail!(
                    "not every pod routable within {:?}: {:?} of {n} per router; swarm: {:?}",
                    opts.connect_within,
                    counts
                        .into_iter()
                        .map(|c| c.unwrap_or(0))
                        .collect::<Vec<_>>(),
                    swarm_stats(self.http, &stats_url).await.ok()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let connect_s = started.elapsed().as_secs_f64();
        let connect_errors = swarm_stats(self.http, &stats_url).await?.errors;
        println!("fleet: every pod routable on every router after {connect_s:.1} s");

        // Ingest: a warm-up, then the window (both fixed lengths of measurement).
        self.watch(&mut routers, &mut swarm, opts.warmup).await?;
        let before = self.read(&routers, &swarm, &stats_url).await?;
        self.watch(&mut routers, &mut swarm, opts.ingest).await?;
        let after = self.read(&routers, &swarm, &stats_url).await?;
        let rss_mib = |p: &Proc| p.rss_bytes().map(|b| b as f64 / (1 << 20) as f64);
        let router_rss_mib = routers
            .iter()
            .filter_map(|x| rss_mib(&x.proc))
            .reduce(f64::max);
        let swarm_rss_mib = rss_mib(&swarm);
        let wall = (after.at - before.at).as_secs_f64();
        let ingest_cpu = after
            .router_cpu
            .iter()
            .zip(&before.router_cpu)
            .map(|(a, b)| (a - b) / wall)
            .sum::<f64>()
            / r as f64;
        let bytes = after
            .swarm
            .bytes_per_router
            .iter()
            .zip(&before.swarm.bytes_per_router)
            .map(|(a, b)| a.saturating_sub(*b) as f64)
            .sum::<f64>()
            / r as f64
            / wall;
        let deltas =
            after.swarm.deltas.saturating_sub(before.swarm.deltas) as f64 / r as f64 / wall;
        let staleness = after.staleness.since(&before.staleness);
        let machine_busy_cores = match (before.machine, after.machine) {
            (Some((b0, _)), Some((b1, _))) => Some((b1 - b0) as f64 / 100.0 / wall),
            _ => None,
        };

        // Requests at low load.
        let before_requests = self.request_metrics(&routers).await?;
        let mut request_errors = Vec::new();
        for i in 0..opts.requests {
            let router = &routers[i % r];
            if let Err(e) = self.request(router, i).await {
                request_errors.push(format!("request {i} via {}: {e:#}", router.proc.name));
            }
        }
        let after_requests = self.request_metrics(&routers).await?;
        let pick = after_requests.pick.since(&before_requests.pick);
        let added = after_requests.added.since(&before_requests.added);
        let tokenize = after_requests.tokenize.since(&before_requests.tokenize);
        let mut approximate = 0.0;
        for router in &routers {
            let text = router.metrics(self.http).await?;
            approximate += counter_with(
                &text,
                "kvsight_router_prefix_mode_total",
                "mode",
                "approximate",
            )?;
        }
        self.check_alive(&mut routers, &mut swarm)?;
        let last = swarm_stats(self.http, &stats_url).await?;

        // Errors.
        let mut errors = last.errors;
        let mut first_error = last.first_error.clone();
        let mut note = |count: u64, what: String| {
            if count > 0 {
                errors += count;
                first_error.get_or_insert(what);
            }
        };
        note(
            request_errors.len() as u64,
            request_errors.first().cloned().unwrap_or_default(),
        );
        // Over the whole life of the routers, connect window included.
        let refused = after_requests.refused;
        note(
            refused as u64,
            format!("routers refused {refused} sidecar connections"),
        );
        note(
            approximate as u64,
            format!("{approximate} prompts hashed in approximate mode"),
        );
        if pick.total() < opts.requests as f64 {
            note(
                1,
                format!(
                    "{} picks counted for {} requests",
                    pick.total(),
                    opts.requests
                ),
            );
        }

        let udp_drops = match (drops_before, udp_rcvbuf_errors()) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            _ => None,
        };
        // Stop: the swarm says goodbye first, then the routers drain.
        swarm.stop(Duration::from_secs(5)).await;
        for router in routers {
            router.proc.stop(Duration::from_secs(5)).await;
        }
        Ok(Row {
            pods: n,
            routers: r,
            pick_p50_us: pick.quantile(0.5).map(|v| v * 1e6),
            pick_p99_us: pick.quantile(0.99).map(|v| v * 1e6),
            added_latency_p50_ms: added.quantile(0.5).map(|v| v * 1e3),
            added_latency_p99_ms: added.quantile(0.99).map(|v| v * 1e3),
            tokenize_p50_ms: tokenize.quantile(0.5).map(|v| v * 1e3),
            tokenize_p99_ms: tokenize.quantile(0.99).map(|v| v * 1e3),
            router_rss_mib,
            router_ingest_cpu_cores: Some(ingest_cpu),
            staleness_p50_s: staleness.quantile(0.5),
            staleness_p99_s: staleness.quantile(0.99),
            swarm_cpu_cores: Some((after.swarm_cpu - before.swarm_cpu) / wall),
            swarm_rss_mib,
            bytes_per_s_per_router: Some(bytes),
            deltas_per_s_per_router: Some(deltas),
            connect_s: Some(connect_s),
            machine_busy_cores,
            requests: opts.requests,
            udp_rcvbuf_errors: udp_drops,
            resyncs: last.resyncs,
            connect_errors,
            errors,
            first_error,
        })
    }

    fn start_router(&self, j: usize) -> Result<Router> {
        let name = router_name(j);
        let (http, quic, admin) = (free_tcp_port()?, free_udp_port()?, free_tcp_port()?);
        std::fs::create_dir_all(&self.logs)?;
        let config = self.logs.join(format!("{name}.yaml"));
        std::fs::write(
            &config,
            format!(
                "tokenizers:\n  {MODEL}: {}\n",
                serde_json::to_string(&self.tokenizer_dir.display().to_string())?
            ),
        )?;
        let tls = self.certs.router(j);
        let path = |p: &Path| p.display().to_string();
        let args: Vec<String> = vec![
            "--listen".into(),
            format!("127.0.0.1:{http}"),
            "--quic-listen".into(),
            format!("127.0.0.1:{quic}"),
            "--admin-listen".into(),
            format!("127.0.0.1:{admin}"),
            "--config".into(),
            path(&config),
            "--router-id".into(),
            name.clone(),
            "--grace-seconds".into(),
            "2".into(),
            "--tls-cert".into(),
            path(&tls.cert),
            "--tls-key".into(),
            path(&tls.key),
            "--tls-ca".into(),
            path(&tls.ca),
            "--sidecar-name".into(),
            SIDECAR_NAME.into(),
        ];
        let proc = Proc::spawn(
            &name,
            &self.opts.router_bin,
            &args,
            &[("RUST_LOG", "warn".into())],
            &self.logs,
        )?;
        Ok(Router {
            proc,
            url: format!("http://127.0.0.1:{http}"),
            quic: format!("127.0.0.1:{quic}"),
            admin: format!("http://127.0.0.1:{admin}"),
        })
    }

    fn start_swarm(&self, n: usize, routers: &[Router], control: &str) -> Result<Proc> {
        let o = self.opts;
        let mut args: Vec<String> = vec![
            "swarm".into(),
            "--pods".into(),
            n.to_string(),
            "--certs".into(),
            self.certs.dir.display().to_string(),
            "--gpu-blocks".into(),
            o.gpu_blocks.to_string(),
            "--resident-blocks".into(),
            o.resident_blocks.to_string(),
            "--changes-per-s".into(),
            o.changes_per_s.to_string(),
            "--publish-interval-ms".into(),
            o.publish_interval.as_millis().to_string(),
            "--load-interval-ms".into(),
            o.load_interval.as_millis().to_string(),
            "--control".into(),
            control.into(),
        ];
        for r in routers {
            args.extend(["--router".into(), r.quic.clone()]);
        }
        Proc::spawn("swarm", &o.bench_bin, &args, &[], &self.logs)
    }

    fn check_alive(&self, routers: &mut [Router], swarm: &mut Proc) -> Result<()> {
        if let Some(why) = swarm.exited() {
            bail!("{why}");
        }
        for r in routers {
            if let Some(why) = r.proc.exited() {
                bail!("{why}");
            }
        }
        Ok(())
    }

    /// Lets `window` pass, checking every second that every process still runs.
    async fn watch(
        &self,
        routers: &mut [Router],
        swarm: &mut Proc,
        window: Duration,
    ) -> Result<()> {
        let end = tokio::time::Instant::now() + window;
        while tokio::time::Instant::now() < end {
            self.check_alive(routers, swarm)?;
            tokio::time::sleep_until(end.min(tokio::time::Instant::now() + Duration::from_secs(1)))
                .await;
        }
        self.check_alive(routers, swarm)
    }

    async fn read(&self, routers: &[Router], swarm: &Proc, stats_url: &str) -> Result<Reading> {
        let mut staleness = Buckets::default();
        for r in routers {
            let text = r.metrics(self.http).await?;
            staleness = staleness.add(&Buckets::parse(
                &text,
                "kvsight_router_view_staleness_seconds",
            )?);
        }
        Ok(Reading {
            at: Instant::now(),
            router_cpu: routers.iter().map(|r| r.proc.cpu_seconds()).collect(),
            swarm_cpu: swarm.cpu_seconds(),
            swarm: swarm_stats(self.http, stats_url).await?,
            staleness,
            machine: machine_ticks(),
        })
    }

    /// The request histograms and sidecar refusals, all replicas together.
    async fn request_metrics(&self, routers: &[Router]) -> Result<RequestMetrics> {
        let mut m = RequestMetrics::default();
        for r in routers {
            let text = r.metrics(self.http).await?;
            let h = |name: &str| Buckets::parse(&text, name);
            m.pick = m.pick.add(&h("kvsight_router_pick_seconds")?);
            m.added = m.added.add(&h("kvsight_router_added_latency_seconds")?);
            m.tokenize = m.tokenize.add(&h("kvsight_router_tokenize_seconds")?);
            m.refused += counter(&text, "kvsight_router_sidecars_refused_total")?;
        }
        Ok(m)
    }

    /// Request `i` through `router`: a completion, streamed every other time, read to its end.
    async fn request(&self, router: &Router, i: usize) -> Result<()> {
        let body = serde_json::json!({
            "model": MODEL,
            "prompt": self.prompts.prompt(i),
            "max_tokens": 1,
            "stream": i % 2 == 1,
        });
        let resp = self
            .http
            .post(format!("{}/v1/completions", router.url))
            .header("content-type", "application/json")
            .body(body.to_string())
            .timeout(Duration::from_secs(30))
            .send()
            .await?;
        let status = resp.status();
        let text = resp.text().await?;
        if !status.is_success() {
            bail!("{status}: {}", text.chars().take(300).collect::<String>());
        }
        if i % 2 == 1 && !text.contains("[DONE]") {
            bail!("the stream ended before [DONE]");
        }
        Ok(())
    }
}

async fn swarm_stats(http: &reqwest::Client, url: &str) -> Result<StatsReport> {
    let body = http
        .get(url)
        .timeout(Duration::from_secs(10))
        .send()
        .await?
        .error_for_status()?
        .bytes()
        .await?;
    Ok(serde_json::from_slice(&body)?)
}

/// The machine's count of UDP datagrams dropped for a full receive buffer.
fn udp_rcvbuf_errors() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/net/snmp").ok()?;
    let mut udp = text.lines().filter(|l| l.starts_with("Udp: "));
    let (names, values) = (udp.next()?, udp.next()?);
    let i = names.split_whitespace().position(|n| n == "RcvbufErrors")?;
    values.split_whitespace().nth(i)?.parse().ok()
}

/// (busy, total) clock ticks of the whole machine since boot, from `/proc/stat`.
fn machine_ticks() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = text.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = cpu
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal ...
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4)?;
    Some((total - idle, total))
}

/// The long prompts: [`DOCUMENTS`] documents of about [`DOCUMENT_TOKENS`] tokens.
struct Prompts {
    documents: Vec<String>,
}

impl Prompts {
    fn new() -> Result<Prompts> {
        use kvsight_sim::own_tokenizer::{SeededRng, paragraph};
        let tok = kvsight_sim::own_tokenizer::load()?;
        let mut documents = Vec::with_capacity(DOCUMENTS);
        for d in 0..DOCUMENTS {
            let mut rng = SeededRng::new(0xd0c ^ d as u64);
            let mut text = format!("Document {d}.\n\n");
            // Paragraphs add about a hundred tokens each: measure every few.
            loop {
                for _ in 0..8 {
                    text.push_str(&paragraph(&mut rng));
                    text.push_str("\n\n");
                }
                let n = tok
                    .encode_completion(&text)
                    .context("tokenizing a document")?
                    .len();
                if n >= DOCUMENT_TOKENS {
                    break;
                }
                if text.len() > 1 << 20 {
                    bail!("a document passed 1 MiB before {DOCUMENT_TOKENS} tokens");
                }
            }
            documents.push(text);
        }
        Ok(Prompts { documents })
    }

    fn prompt(&self, i: usize) -> String {
        format!(
            "{}Question {i}: which of these matters most, and why?",
            self.documents[i % DOCUMENTS]
        )
    }
}

/// Writes `fleet.json` (the rows and how they were made) and `fleet.md` (the table).
pub fn write(opts: &Options, rows: &[Row]) -> Result<()> {
    let json = serde_json::json!({
        "command": opts.command,
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "gpu_blocks": opts.gpu_blocks,
        "resident_blocks": opts.resident_blocks,
        "changes_per_s": opts.changes_per_s,
        "publish_interval_ms": opts.publish_interval.as_millis() as u64,
        "load_interval_ms": opts.load_interval.as_millis() as u64,
        "ingest_s": opts.ingest.as_secs_f64(),
        "requests": opts.requests,
        "rows": rows,
    });
    std::fs::write(
        opts.out.join("fleet.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    std::fs::write(opts.out.join("fleet.md"), markdown(opts, rows))?;
    Ok(())
}

/// The table of the rows.
pub fn markdown(opts: &Options, rows: &[Row]) -> String {
    let f = |v: Option<f64>, digits: usize| v.map_or("–".into(), |v| format!("{v:.digits$}"));
    let mut s = format!(
        "`{}` — {} resident blocks per pod ({} KV blocks), {} block changes/s per pod, deltas every {} ms, loads every {} ms; ingest window {:.0} s; {} requests at low load (one at a time, ~8,200-token prompts: 512-block chains)\n\n",
        opts.command,
        opts.resident_blocks,
        opts.gpu_blocks,
        opts.changes_per_s,
        opts.publish_interval.as_millis(),
        opts.load_interval.as_millis(),
        opts.ingest.as_secs_f64(),
        opts.requests,
    );
    s.push_str("| pods | routers | pick p50 / p99 µs | added p50 / p99 ms | of which tokenize p50 / p99 ms | router RSS MiB | ingest CPU (cores per router) | staleness p50 / p99 ms | swarm CPU (cores) | KB/s per router | machine busy (cores) | connect s | UDP drops | errors |\n");
    s.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} / {} | {} / {} | {} / {} | {} | {} | {} / {} | {} | {} | {} | {} | {} | {} |\n",
            r.pods,
            r.routers,
            f(r.pick_p50_us, 0),
            f(r.pick_p99_us, 0),
            f(r.added_latency_p50_ms, 2),
            f(r.added_latency_p99_ms, 2),
            f(r.tokenize_p50_ms, 2),
            f(r.tokenize_p99_ms, 2),
            f(r.router_rss_mib, 0),
            f(r.router_ingest_cpu_cores, 3),
            f(r.staleness_p50_s.map(|v| v * 1e3), 0),
            f(r.staleness_p99_s.map(|v| v * 1e3), 0),
            f(r.swarm_cpu_cores, 2),
            f(r.bytes_per_s_per_router.map(|b| b / 1e3), 0),
            f(r.machine_busy_cores, 2),
            f(r.connect_s, 1),
            r.udp_rcvbuf_errors.map_or("–".into(), |d| d.to_string()),
            r.errors,
        ));
    }
    for r in rows.iter().filter(|r| r.first_error.is_some()) {
        s.push_str(&format!(
            "\n{} × {}: {}\n",
            r.pods,
            r.routers,
            r.first_error.as_deref().unwrap_or_default()
        ));
    }
    s
}

/// What makes a run incomplete for `--quick`: a figure missing or any error.
pub fn incomplete(rows: &[Row]) -> Vec<String> {
    rows.iter()
        .filter_map(|r| {
            let missing: Vec<&str> = [
                ("pick_p99_us", r.pick_p99_us),
                ("router_rss_mib", r.router_rss_mib),
                ("staleness_p99_s", r.staleness_p99_s),
                ("router_ingest_cpu_cores", r.router_ingest_cpu_cores),
                ("bytes_per_s_per_router", r.bytes_per_s_per_router),
                ("added_latency_p99_ms", r.added_latency_p99_ms),
            ]
            .into_iter()
            .filter(|(_, v)| v.is_none())
            .map(|(k, _)| k)
            .collect();
            (!missing.is_empty() || r.errors > 0).then(|| {
                format!(
                    "{} pods × {} routers: missing {missing:?}, {} errors{}",
                    r.pods,
                    r.routers,
                    r.errors,
                    r.first_error
                        .as_deref()
                        .map_or(String::new(), |e| format!(" (first: {e})"))
                )
            })
        })
        .collect()
}
