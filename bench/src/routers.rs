//! The routers under test: kvsight's variants, the peers people run today (installed from PyPI
//! into a virtualenv under `target/bench/`), and the blind baselines. Each runs as its own
//! process; the load goes to its HTTP port.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::cluster::{Binaries, Certs};
use crate::procs::{Proc, free_tcp_port, free_udp_port, wait_ok};
use crate::workload::MODEL;

/// Every router the bench knows, in the order results list them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub enum Kind {
    /// kvsight, default config: real sidecars, real router.
    Kvsight,
    /// kvsight in approximate mode: router-side memory of what it sent, no tokenizer.
    KvsightApprox,
    /// kvsight with the prefix weight at 0.
    KvsightPrefix0,
    /// kvsight scoring with LMetric's product: uncached prompt tokens × batch size.
    KvsightLmetric,
    /// kvsight with flow control on ([`flow_config`]).
    KvsightFlow,
    /// smg (Shepherd Model Gateway), cache_aware policy.
    SmgCacheAware,
    /// smg, power of two choices.
    SmgPowerOfTwo,
    /// sglang-router, cache_aware policy.
    SglangCacheAware,
    /// vllm-router, cache_aware policy.
    VllmRouterCacheAware,
    /// vllm-router, kv_aware policy: it subscribes to the pods' KV events itself.
    VllmRouterKvAware,
    /// Round robin over the pods.
    RoundRobin,
    /// Least of its own in-flight requests.
    LeastRequest,
}

impl Kind {
    pub const ALL: [Kind; 12] = [
        Kind::Kvsight,
        Kind::KvsightApprox,
        Kind::KvsightPrefix0,
        Kind::KvsightLmetric,
        Kind::KvsightFlow,
        Kind::SmgCacheAware,
        Kind::SmgPowerOfTwo,
        Kind::SglangCacheAware,
        Kind::VllmRouterCacheAware,
        Kind::VllmRouterKvAware,
        Kind::RoundRobin,
        Kind::LeastRequest,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Kvsight => "kvsight",
            Kind::KvsightApprox => "kvsight-approx",
            Kind::KvsightPrefix0 => "kvsight-prefix0",
            Kind::KvsightLmetric => "kvsight-lmetric",
            Kind::KvsightFlow => "kvsight-flow",
            Kind::SmgCacheAware => "smg-cache_aware",
            Kind::SmgPowerOfTwo => "smg-power_of_two",
            Kind::SglangCacheAware => "sglang-cache_aware",
            Kind::VllmRouterCacheAware => "vllm-router-cache_aware",
            Kind::VllmRouterKvAware => "vllm-router-kv_aware",
            Kind::RoundRobin => "round-robin",
            Kind::LeastRequest => "least-request",
        }
    }

    /// The router a user would deploy (kvsight's default, each peer's cache-aware policy) or a
    /// blind baseline everyone knows (round robin). The others are variants — kvsight's
    /// ablations and the peers' secondary policies — that answer "which part matters" and
    /// need only the workload that separates them (a full run gives them `multi_tenant`).
    pub fn is_headline(self) -> bool {
        matches!(
            self,
            Kind::Kvsight
                | Kind::SmgCacheAware
                | Kind::SglangCacheAware
                | Kind::VllmRouterCacheAware
                | Kind::RoundRobin
        )
    }

    /// kvsight routers run for a whole workload (sidecars report to them from the start).
    pub fn is_kvsight(self) -> bool {
        matches!(
            self,
            Kind::Kvsight
                | Kind::KvsightApprox
                | Kind::KvsightPrefix0
                | Kind::KvsightLmetric
                | Kind::KvsightFlow
        )
    }

    /// The PyPI package a peer comes from.
    pub fn package(self) -> Option<&'static str> {
        match self {
            Kind::SmgCacheAware | Kind::SmgPowerOfTwo => Some("smg"),
            Kind::SglangCacheAware => Some("sglang-router"),
            Kind::VllmRouterCacheAware | Kind::VllmRouterKvAware => Some("vllm-router"),
            _ => None,
        }
    }

    /// Whether the router reports its predictions (`x-kvsight-decision`).
    pub fn predicts(self) -> bool {
        self.is_kvsight()
    }

    /// Whether the router runs with flow control.
    pub fn flow_control(self) -> bool {
        self == Kind::KvsightFlow
    }

    /// The kvsight config file for a variant.
    fn kvsight_config(self) -> String {
        if self == Kind::KvsightFlow {
            return flow_config(*BENCH_TIME_SCALE.get().unwrap_or(&2.0));
        }
        match self {
            Kind::KvsightPrefix0 => "scheduler:\n  weights: {prefix: 0}\n",
            Kind::KvsightLmetric => {
                "scheduler:\n  weights: {prefix: 0, queue: 0, kvCache: 0, runningRequests: 0, lmetric: 1, lru: 0.01}\n"
            }
            _ => "{}\n",
        }
        .to_owned()
    }
}

/// The bench's time scale, for configs whose durations are wall-clock (flow control's budgets);
/// set once by the run before any router starts.
pub static BENCH_TIME_SCALE: std::sync::OnceLock<f64> = std::sync::OnceLock::new();

/// kvsight-flow's config: the default router with flow control on. Budgets in simulated
/// seconds, scaled to wall-clock by `time_scale` (the router's clock is the wall's). The wait
/// budget keeps each pod's predicted wait under 50 ms (simulated): pods stay busy (the next
/// request is sent the moment one finishes) while their own queues stay short; the queue's
/// order then decides who waits.
pub fn flow_config(time_scale: f64) -> String {
    let s = |sim: f64| sim * time_scale;
    format!(
        "flowControl:\n  enabled: true\n  classes:\n    \
         - {{name: interactive, priority: 2, ttftBudgetSeconds: {}, maxWaitSeconds: {}}}\n    \
         - {{name: standard, priority: 1, ttftBudgetSeconds: {}, maxWaitSeconds: {}}}\n    \
         - {{name: batch, priority: 0, ttftBudgetSeconds: {}, maxWaitSeconds: {}, \
         kvCeiling: {}}}\n",
        s(FLOW_WAIT_BUDGET_S),
        s(2.0),
        s(FLOW_WAIT_BUDGET_S),
        s(30.0),
        s(FLOW_WAIT_BUDGET_S),
        s(600.0),
        FLOW_BATCH_KV_CEILING,
    )
}

/// kvsight-flow's `kvCeiling` for batch, the router's default one.
pub const FLOW_BATCH_KV_CEILING: f64 = 0.7;

/// kvsight-flow's `ttftBudgetSeconds`, simulated seconds.
pub const FLOW_WAIT_BUDGET_S: f64 = 0.05;

/// The pinned peer versions.
pub const PEERS: [(&str, &str); 3] = [
    ("smg", "1.13.0"),
    ("sglang-router", "0.3.2"),
    ("vllm-router", "0.1.17"),
];

/// Each peer package and its installed version, or why it could not be installed.
pub type PeerVersions = Vec<(String, Result<String, String>)>;

/// The peers' virtualenv: made once under `target/bench/peers`, each package installed on its
/// own so that one that cannot be installed leaves the others. Returns the venv's `bin/` and
/// what was installed.
pub fn install_peers(target: &Path) -> Result<(PathBuf, PeerVersions)> {
    let venv = target.join("bench/peers");
    let bin = venv.join("bin");
    let python = bin.join("python");
    if !python.exists() {
        let st = std::process::Command::new("python3")
            .arg("-m")
            .arg("venv")
            .arg(&venv)
            .status()
            .context("python3 -m venv")?;
        if !st.success() {
            bail!("python3 -m venv {} failed ({st})", venv.display());
        }
    }
    let mut out = Vec::new();
    for (pkg, version) in PEERS {
        let have = installed_version(&python, pkg);
        let result = if have.as_deref() == Some(version) {
            Ok(version.to_owned())
        } else {
            let o = std::process::Command::new(&python)
                .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
                .arg(format!("{pkg}=={version}"))
                .output()
                .context("pip")?;
            if o.status.success() {
                Ok(version.to_owned())
            } else {
                let err = String::from_utf8_lossy(&o.stderr);
                Err(err.lines().last().unwrap_or("pip failed").to_owned())
            }
        };
        out.push((pkg.to_owned(), result));
    }
    Ok((bin, out))
}

fn installed_version(python: &Path, pkg: &str) -> Option<String> {
    let o = std::process::Command::new(python)
        .args([
            "-c",
            &format!("import importlib.metadata as m; print(m.version({pkg:?}))"),
        ])
        .output()
        .ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_owned())
}

/// A kvsight router process with its ports.
pub struct KvsightRouter {
    pub kind: Kind,
    pub proc: Proc,
    pub url: String,
    /// The admin listener's base URL: `/metrics`, `/debug/pods`.
    pub admin: String,
    pub quic: String,
    /// Its config file, watched: rewriting it reloads the router.
    pub config: PathBuf,
    program: PathBuf,
    args: Vec<String>,
    logs: PathBuf,
}

impl KvsightRouter {
    /// Starts the variant; sidecars are given `quic` to report to.
    pub fn start(kind: Kind, bins: &Binaries, certs: &Certs, logs: &Path) -> Result<KvsightRouter> {
        Self::start_replica(kind, kind.name(), bins, certs, logs)
    }

    /// Starts the variant as replica `name` (its router id, certificate, config file and log):
    /// replicas of one deployment must not share a router id, since sidecars count each
    /// router's in-flight requests apart.
    pub fn start_replica(
        kind: Kind,
        name: &str,
        bins: &Binaries,
        certs: &Certs,
        logs: &Path,
    ) -> Result<KvsightRouter> {
        let (http, quic, admin) = (free_tcp_port()?, free_udp_port()?, free_tcp_port()?);
        let config = certs.dir.join(format!("{name}.yaml"));
        // An experiment may replace the default variant's config.
        let text = match (kind, std::env::var("KVSIGHT_BENCH_CONFIG")) {
            (Kind::Kvsight, Ok(text)) => text,
            (Kind::KvsightFlow, _) => match std::env::var("KVSIGHT_BENCH_FLOW_CONFIG") {
                Ok(text) => text,
                Err(_) => kind.kvsight_config(),
            },
            _ => kind.kvsight_config(),
        };
        std::fs::write(&config, text)?;
        let mut args = vec![
            "--listen".into(),
            format!("127.0.0.1:{http}"),
            "--quic-listen".into(),
            format!("127.0.0.1:{quic}"),
            "--config".into(),
            config.display().to_string(),
            "--router-id".into(),
            name.into(),
            "--grace-seconds".into(),
            "2".into(),
            "--admin-listen".into(),
            format!("127.0.0.1:{admin}"),
            // The bench reads each pick from the answer.
            "--decision-header".into(),
        ];
        if kind == Kind::KvsightApprox {
            args.push("--no-sidecar-tokenizers".into());
        }
        args.extend(certs.leaf_flags(name)?);
        let proc = Self::spawn(name, &bins.router, &args, logs)?;
        Ok(KvsightRouter {
            kind,
            proc,
            url: format!("http://127.0.0.1:{http}"),
            admin: format!("http://127.0.0.1:{admin}"),
            quic: format!("127.0.0.1:{quic}"),
            config,
            program: bins.router.clone(),
            args,
            logs: logs.to_owned(),
        })
    }

    fn spawn(name: &str, program: &Path, args: &[String], logs: &Path) -> Result<Proc> {
        Proc::spawn(name, program, args, &[("RUST_LOG", "warn".into())], logs)
    }

    /// A fresh process on the same ports (the sidecars reconnect): every run starts with no
    /// memory of earlier runs, as every peer does.
    pub async fn restart(&mut self, http: &reqwest::Client, pods: usize) -> Result<()> {
        self.proc.terminate(Duration::from_secs(3)).await;
        self.respawn()?;
        self.wait_pods(http, pods, Duration::from_secs(60)).await
    }

    /// Starts the process again on the same ports and flags (the old one must have ended).
    fn respawn(&mut self) -> Result<()> {
        let name = self.proc.name.clone();
        self.proc = Self::spawn(&name, &self.program, &self.args, &self.logs)?;
        Ok(())
    }

    /// Waits until every pod is routable through this router (Ready, with its filter).
    pub async fn wait_pods(
        &mut self,
        http: &reqwest::Client,
        pods: usize,
        within: Duration,
    ) -> Result<()> {
        wait_ok(
            http,
            &format!("{}/health", self.url),
            &mut [&mut self.proc],
            within,
        )
        .await?;
        let deadline = std::time::Instant::now() + within;
        loop {
            let body = http
                .get(format!("{}/debug/pods", self.admin))
                .send()
                .await?
                .bytes()
                .await?;
            let routable = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["pods"].as_array().cloned())
                .map_or(0, |pods| {
                    pods.iter()
                        .filter(|p| p["phase"] == "ready" && !p["filter"].is_null())
                        .count()
                });
            if routable >= pods {
                return Ok(());
            }
            if let Some(why) = self.proc.exited() {
                bail!("{why}");
            }
            if std::time::Instant::now() >= deadline {
                bail!(
                    "{}: {routable} of {pods} pods routable after {within:?}",
                    self.kind.name()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The replicas of one kvsight variant, as one Deployment runs them: each with its own router id,
/// ports and config file; every sidecar reports to all of them.
pub struct KvsightDeployment {
    pub kind: Kind,
    pub replicas: Vec<KvsightRouter>,
}

impl KvsightDeployment {
    /// Starts `n` replicas of `kind`. One replica keeps the variant's name as its router id
    /// (what single-router results always said); several are `<name>-<i>`.
    pub fn start(
        kind: Kind,
        n: usize,
        bins: &Binaries,
        certs: &Certs,
        logs: &Path,
    ) -> Result<KvsightDeployment> {
        let replicas = (0..n.max(1))
            .map(|i| {
                let name = if n <= 1 {
                    kind.name().to_owned()
                } else {
                    format!("{}-{i}", kind.name())
                };
                KvsightRouter::start_replica(kind, &name, bins, certs, logs)
            })
            .collect::<Result<_>>()?;
        Ok(KvsightDeployment { kind, replicas })
    }

    /// Every replica's QUIC address, for the sidecars.
    pub fn quic(&self) -> impl Iterator<Item = String> + '_ {
        self.replicas.iter().map(|r| r.quic.clone())
    }

    pub fn urls(&self) -> Vec<String> {
        self.replicas.iter().map(|r| r.url.clone()).collect()
    }

    /// Waits until every replica routes to `pods` pods.
    pub async fn wait_pods(
        &mut self,
        http: &reqwest::Client,
        pods: usize,
        within: Duration,
    ) -> Result<()> {
        for r in &mut self.replicas {
            r.wait_pods(http, pods, within).await?;
        }
        Ok(())
    }

    /// Every replica as a fresh process on its ports (stopped together first, so no replica
    /// carries placements it heard from another one into the next run).
    pub async fn restart(&mut self, http: &reqwest::Client, pods: usize) -> Result<()> {
        futures_util::future::join_all(
            self.replicas
                .iter_mut()
                .map(|r| r.proc.terminate(Duration::from_secs(3))),
        )
        .await;
        for r in &mut self.replicas {
            r.respawn()?;
        }
        self.wait_pods(http, pods, Duration::from_secs(60)).await
    }

    pub async fn stop(self) {
        futures_util::future::join_all(
            self.replicas
                .into_iter()
                .map(|r| r.proc.stop(Duration::from_secs(3))),
        )
        .await;
    }
}

/// A pod as a peer is told about it.
#[derive(Debug, Clone)]
pub struct Worker {
    pub url: String,
    /// vLLM's KV-event PUB and replay endpoints (for peers that subscribe themselves).
    pub kv_events: String,
    pub kv_replay: String,
}

/// Starts a peer or a blind baseline in front of `workers`; waits until it answers.
pub async fn start_other(
    kind: Kind,
    bins: &Binaries,
    peers_bin: &Path,
    workers: &[Worker],
    block_size: u32,
    logs: &Path,
    http: &reqwest::Client,
) -> Result<(Proc, String)> {
    let port = free_tcp_port()?;
    // Each peer also serves Prometheus metrics, on 29000 unless told otherwise.
    let metrics_port = free_tcp_port()?.to_string();
    let host = "127.0.0.1".to_owned();
    let (program, mut args): (PathBuf, Vec<String>) = match kind {
        Kind::SmgCacheAware | Kind::SmgPowerOfTwo => (
            peers_bin.join("smg"),
            vec![
                "launch".into(),
                "--host".into(),
                host,
                "--port".into(),
                port.to_string(),
                "--prometheus-port".into(),
                metrics_port,
            ],
        ),
        Kind::SglangCacheAware => (
            peers_bin.join("python"),
            vec![
                "-m".into(),
                "sglang_router.launch_router".into(),
                "--host".into(),
                host,
                "--port".into(),
                port.to_string(),
                "--prometheus-port".into(),
                metrics_port,
            ],
        ),
        Kind::VllmRouterCacheAware | Kind::VllmRouterKvAware => (
            peers_bin.join("vllm-router"),
            vec![
                "--host".into(),
                host,
                "--port".into(),
                port.to_string(),
                "--prometheus-port".into(),
                metrics_port,
            ],
        ),
        Kind::RoundRobin | Kind::LeastRequest => (
            bins.bench.clone(),
            vec![
                "blind".into(),
                "--listen".into(),
                format!("127.0.0.1:{port}"),
                "--mode".into(),
                if kind == Kind::RoundRobin {
                    "round-robin"
                } else {
                    "least-request"
                }
                .into(),
            ],
        ),
        _ => bail!("{} is a kvsight router", kind.name()),
    };
    match kind {
        Kind::RoundRobin | Kind::LeastRequest => {
            for w in workers {
                args.extend(["--worker".into(), w.url.clone()]);
            }
        }
        _ => {
            args.push("--worker-urls".into());
            args.extend(workers.iter().map(|w| w.url.clone()));
            args.push("--policy".into());
            args.push(
                match kind {
                    Kind::SmgPowerOfTwo => "power_of_two",
                    Kind::VllmRouterKvAware => "kv_aware",
                    _ => "cache_aware",
                }
                .into(),
            );
            if kind == Kind::VllmRouterKvAware {
                for w in workers {
                    args.push("--kv-event-source".into());
                    args.push(format!("{}={}", w.url, w.kv_events));
                    args.push("--kv-event-replay-source".into());
                    args.push(format!("{}={}", w.url, w.kv_replay));
                }
                args.extend([
                    "--kv-event-block-size".into(),
                    block_size.to_string(),
                    "--kv-event-model".into(),
                    MODEL.into(),
                ]);
            }
        }
    }
    let mut proc = Proc::spawn(kind.name(), &program, &args, &[], logs)?;
    let url = format!("http://127.0.0.1:{port}");
    // Ready when a request for the model reaches a worker through it.
    wait_ok(
        http,
        &format!("{url}/v1/models"),
        &mut [&mut proc],
        Duration::from_secs(60),
    )
    .await
    .with_context(|| format!("{} did not come up", kind.name()))?;
    Ok((proc, url))
}
