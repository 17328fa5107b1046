//! The pods every router is measured against: `vllm-sim` processes with the calibrated cost model,
//! each with a real `kvsight-sidecar` process beside it (KV events over ZMQ, metrics, warm-up,
//! QUIC with mutual TLS to the kvsight routers). Peers are given the pods' URLs and ignore the
//! sidecars; kvsight routers learn the pods from them, as in a cluster.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kvsight_sidecar::counters::{PodCounters, parse_counters};
use kvsight_transport::dev_certs::DevCa;

use crate::cost::CostModel;
use crate::procs::{Proc, free_tcp_port, wait_ok};
use crate::workload::MODEL;

/// The release binaries the bench runs.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub vllm_sim: PathBuf,
    pub sidecar: PathBuf,
    pub router: PathBuf,
    /// This program, for the blind baselines (`kvsight-bench blind`).
    pub bench: PathBuf,
}

/// One simulated pod and its sidecar.
pub struct Pod {
    pub name: String,
    pub url: String,
    pub sim: Proc,
    pub sidecar: Option<Proc>,
    pub sidecar_url: String,
    kv_port: u16,
    replay_port: u16,
    port: u16,
}

/// Certificates for the sidecars and the kvsight routers, from one throw-away CA.
pub struct Certs {
    pub dir: PathBuf,
    ca: DevCa,
}

impl Certs {
    pub fn new(dir: &Path) -> Result<Certs> {
        let ca = DevCa::new("kvsight-bench-ca")?;
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("ca.pem"), ca.ca_pem())?;
        Ok(Certs {
            dir: dir.to_owned(),
            ca,
        })
    }

    /// Writes `<name>.pem` and `<name>-key.pem` (valid for loopback) and returns the three paths
    /// as flags.
    pub fn leaf_flags(&self, name: &str) -> Result<Vec<String>> {
        // A sidecar's certificate grants it its pod name, in the namespaces the bench and
        // real-vllm runs give their pods (routers check it; a router ignores these).
        let grants = ["bench", "real-vllm"].map(|ns| kvsight_transport::pod_uri(ns, name));
        self.ca.write_leaves(
            &self.dir,
            &[(
                name,
                &["127.0.0.1", "localhost", name, &grants[0], &grants[1]],
            )],
        )?;
        Ok(vec![
            "--tls-cert".into(),
            self.dir.join(format!("{name}.pem")).display().to_string(),
            "--tls-key".into(),
            self.dir
                .join(format!("{name}-key.pem"))
                .display()
                .to_string(),
            "--tls-ca".into(),
            self.dir.join("ca.pem").display().to_string(),
        ])
    }
}

/// What the pods are started with.
pub struct PodsConfig<'a> {
    pub bins: &'a Binaries,
    pub cost: &'a CostModel,
    pub num_gpu_blocks: u32,
    pub tokenizer_dir: &'a Path,
    pub certs: &'a Certs,
    pub logs: &'a Path,
    /// QUIC addresses of the kvsight routers the sidecars report to.
    pub routers: &'a [String],
    /// Compile stalls of a cold pod, simulated ms (0 for the warm fleet).
    pub compile_stall_ms: f64,
    /// The sidecar warms the pod before Ready (`--warmup` default) rather than `none`.
    pub warmup: bool,
}

impl<'a> PodsConfig<'a> {
    /// The warm fleet: engines without compile stalls, sidecars that skip warm-up (nothing to
    /// warm), reporting to `routers`.
    pub fn warm(
        bins: &'a Binaries,
        cost: &'a CostModel,
        num_gpu_blocks: u32,
        tokenizer_dir: &'a Path,
        certs: &'a Certs,
        logs: &'a Path,
        routers: &'a [String],
    ) -> PodsConfig<'a> {
        PodsConfig {
            bins,
            cost,
            num_gpu_blocks,
            tokenizer_dir,
            certs,
            logs,
            routers,
            compile_stall_ms: 0.0,
            warmup: false,
        }
    }
}

impl Pod {
    /// Starts `vllm-sim` and waits for its `/health`, then the sidecar (not waited for).
    pub async fn start(name: &str, cfg: &PodsConfig<'_>, http: &reqwest::Client) -> Result<Pod> {
        let (port, kv_port, replay_port) = (free_tcp_port()?, free_tcp_port()?, free_tcp_port()?);
        let mut pod = Pod {
            name: name.to_owned(),
            url: format!("http://127.0.0.1:{port}"),
            sim: start_sim(name, cfg, port, kv_port, replay_port)?,
            sidecar: None,
            sidecar_url: String::new(),
            kv_port,
            replay_port,
            port,
        };
        wait_ok(
            http,
            &format!("{}/health", pod.url),
            &mut [&mut pod.sim],
            Duration::from_secs(30),
        )
        .await?;
        pod.start_sidecar(cfg)?;
        Ok(pod)
    }

    fn start_sidecar(&mut self, cfg: &PodsConfig<'_>) -> Result<()> {
        let listen = free_tcp_port()?;
        let mut args: Vec<String> = vec![
            "--pod-name".into(),
            self.name.clone(),
            "--pod-namespace".into(),
            "bench".into(),
            "--vllm-url".into(),
            self.url.clone(),
            "--advertise-url".into(),
            self.url.clone(),
            "--kv-events-endpoint".into(),
            format!("tcp://127.0.0.1:{}", self.kv_port),
            "--kv-events-replay-endpoint".into(),
            format!("tcp://127.0.0.1:{}", self.replay_port),
            "--listen".into(),
            format!("127.0.0.1:{listen}"),
            "--max-num-seqs".into(),
            cfg.cost.max_num_seqs.to_string(),
            "--max-num-batched-tokens".into(),
            cfg.cost.max_num_batched_tokens.to_string(),
            "--tokenizer-dir".into(),
            cfg.tokenizer_dir.display().to_string(),
            "--drain-grace".into(),
            "2s".into(),
        ];
        if !cfg.warmup {
            args.extend(["--warmup".into(), "none".into()]);
        }
        for r in cfg.routers {
            args.extend(["--router".into(), r.clone()]);
        }
        args.extend(cfg.certs.leaf_flags(&self.name)?);
        self.sidecar = Some(Proc::spawn(
            &format!("sidecar-{}", self.name),
            &cfg.bins.sidecar,
            &args,
            &[("RUST_LOG", "warn".into())],
            cfg.logs,
        )?);
        self.sidecar_url = format!("http://127.0.0.1:{listen}");
        Ok(())
    }

    /// Waits for the sidecar's `/ready` (warm-up done).
    pub async fn wait_ready(&mut self, http: &reqwest::Client, within: Duration) -> Result<()> {
        let url = format!("{}/ready", self.sidecar_url);
        let Some(sidecar) = self.sidecar.as_mut() else {
            bail!("{} has no sidecar", self.name);
        };
        wait_ok(http, &url, &mut [&mut self.sim, sidecar], within).await
    }

    /// The engine's counters now.
    pub async fn counters(&self, http: &reqwest::Client) -> Result<PodCounters> {
        let text = http
            .get(format!("{}/metrics", self.url))
            .timeout(Duration::from_secs(10))
            .send()
            .await?
            .text()
            .await?;
        parse_counters(&text).map_err(|e| anyhow::anyhow!("{}: metrics: {e}", self.name))
    }

    /// `POST /reset_prefix_cache` (vLLM refuses while requests run: retried, bounded).
    pub async fn reset_cache(&self, http: &reqwest::Client) -> Result<()> {
        for _ in 0..200 {
            let r = http
                .post(format!("{}/reset_prefix_cache", self.url))
                .send()
                .await?;
            if r.status().is_success() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("{}: the prefix cache could not be reset", self.name)
    }

    /// The engine crashes (SIGKILL: every stream it serves is cut) and its container restarts
    /// on the same ports with an empty cache; the sidecar keeps running and must notice. A port
    /// still held a moment after the kill makes the new process exit: retried, bounded.
    pub async fn crash_and_restart_sim(
        &mut self,
        cfg: &PodsConfig<'_>,
        http: &reqwest::Client,
    ) -> Result<()> {
        self.sim.kill().await;
        let mut last = None;
        for _ in 0..10 {
            self.sim = start_sim(&self.name, cfg, self.port, self.kv_port, self.replay_port)?;
            let health = format!("{}/health", self.url);
            match wait_ok(http, &health, &mut [&mut self.sim], Duration::from_secs(30)).await {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("{}: no restart attempt", self.name)))
    }

    /// Leaves as a scaled-down pod does: the sidecar drains (routers stop sending at once) and
    /// says Goodbye, then the engine is stopped only once it has finished what it was serving,
    /// so that leaving cuts no request (bounded by `within`).
    pub async fn leave(mut self, http: &reqwest::Client, within: Duration) -> Result<()> {
        if let Some(s) = self.sidecar.take() {
            s.stop(Duration::from_secs(10)).await;
        }
        let idle = wait_idle(std::slice::from_ref(&self), http, within).await;
        self.sim.stop(Duration::from_secs(3)).await;
        idle
    }

    pub async fn stop(self) {
        if let Some(s) = self.sidecar {
            s.stop(Duration::from_secs(3)).await;
        }
        self.sim.stop(Duration::from_secs(3)).await;
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The pod as a peer router is told about it.
    pub fn worker(&self) -> crate::routers::Worker {
        crate::routers::Worker {
            url: self.url.clone(),
            kv_events: format!("tcp://127.0.0.1:{}", self.kv_port),
            kv_replay: format!("tcp://127.0.0.1:{}", self.replay_port),
        }
    }
}

fn start_sim(
    name: &str,
    cfg: &PodsConfig<'_>,
    port: u16,
    kv_port: u16,
    replay_port: u16,
) -> Result<Proc> {
    let mut args: Vec<String> = vec![
        "--port".into(),
        port.to_string(),
        "--served-model-name".into(),
        MODEL.into(),
        "--tokenizer".into(),
        cfg.tokenizer_dir.display().to_string(),
        "--enable-prompt-tokens-details".into(),
        "--kv-events-config".into(),
        serde_json::json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            // vLLM binds only a wildcard endpoint (it connects to any other).
            "endpoint": format!("tcp://*:{kv_port}"),
            "replay_endpoint": format!("tcp://*:{replay_port}"),
        })
        .to_string(),
        "--compile-stall-ms".into(),
        cfg.compile_stall_ms.to_string(),
        "--seed".into(),
        // A different block-hash root per pod, as separate vLLM processes have.
        name.bytes().map(u64::from).sum::<u64>().to_string(),
    ];
    args.extend(cfg.cost.sim_flags(cfg.num_gpu_blocks));
    Proc::spawn(name, &cfg.bins.vllm_sim, &args, &[], cfg.logs)
}

/// Sum of the pods' counters.
pub fn total(counters: &[PodCounters]) -> PodCounters {
    counters
        .iter()
        .fold(PodCounters::default(), |a, c| PodCounters {
            requests: a.requests + c.requests,
            prefix_queries: a.prefix_queries + c.prefix_queries,
            prefix_hits: a.prefix_hits + c.prefix_hits,
            preemptions: a.preemptions + c.preemptions,
            prompt_tokens: a.prompt_tokens + c.prompt_tokens,
            running: a.running + c.running,
            waiting: a.waiting + c.waiting,
        })
}

/// Waits until no pod runs or queues anything (the previous run drained).
pub async fn wait_idle(pods: &[Pod], http: &reqwest::Client, within: Duration) -> Result<()> {
    let deadline = std::time::Instant::now() + within;
    loop {
        let mut busy = false;
        for p in pods {
            let c = p.counters(http).await.context("reading counters")?;
            busy |= c.running > 0.0 || c.waiting > 0.0;
        }
        if !busy {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            bail!("the pods did not drain within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
