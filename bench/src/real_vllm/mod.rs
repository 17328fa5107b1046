//! `cargo xtask real-vllm`: kvsight in front of real vLLM engines (vLLM's CPU build, tiny models
//! with random weights made here), every claim checked against the engine's own answers.
//!
//! Per model: two engines, one real sidecar beside each (configured by its flags as in a pod),
//! one real router, mutual TLS from a throw-away CA, and an independent subscriber to each
//! engine's KV events decoding with vLLM's own structs. Each check prints its figure:
//!
//! - the engine facts the sidecar read (block size, KV blocks, version) are the engine's;
//! - the sidecar ran its warm-up before it answered `/ready`, and both pods became routable;
//! - the router's tokenizer check agrees with the engine, and the router's `/tokenize` equals
//!   vLLM's on a varied set of prompts;
//! - Sight: the cached prompt tokens the router predicts equal what vLLM reports in
//!   `usage.prompt_tokens_details.cached_tokens` (shared prefix, multi-turn chat, unique and
//!   concurrent batch traffic), and the shared prefix stays on one pod;
//! - the sidecar's resident-block count equals the independent subscriber's;
//! - LoRA (first model): two adapters made here and loaded at run time, one on each engine and
//!   one on the first only; the sidecars report them, adapter requests are predicted exactly
//!   (hashed under the adapter's root) and go only where the adapter is loaded, and
//!   `loraAffinity` sends an adapter's requests to the pod where the engine reports it running
//!   (`lora.rs`);
//! - requests sent straight to an engine show as its `unrouted` load within a report of the
//!   engine counting them, and new routed requests go to the other pod meanwhile;
//! - an engine killed and started again on the same ports is noticed and predictions are exact
//!   again afterwards;
//! - every vLLM metric the sidecar reads is exported by the real engine.
//!
//! Before all of that, the differential (`fidelity.rs`): the simulator against a real engine of
//! the same shape, on a serial and a concurrent trace.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

pub mod fidelity;
mod lora;

use crate::cluster::Certs;
use crate::procs::{Proc, free_tcp_port, free_udp_port, wait_ok};

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The Python of the virtualenv holding vLLM.
    pub python: PathBuf,
    /// `tests/python` (the model maker and the independent subscriber).
    pub scripts: PathBuf,
    /// Working folder (models, certificates, logs).
    pub work: PathBuf,
    pub router: PathBuf,
    pub sidecar: PathBuf,
    /// Served model name and the tokenizer folder of each model to check.
    pub models: Vec<(String, PathBuf)>,
    /// The vLLM version the engines must report.
    pub vllm_version: String,
    /// Check an engine restart for the first model (about a minute: one more engine start).
    pub restart: bool,
    /// Run the differential (simulator against vLLM) with the first model.
    pub fidelity: bool,
    /// Where the differential's figures go as markdown (`docs/bench/sim-fidelity.md`); the JSON
    /// always goes to `work/fidelity.json`.
    pub fidelity_doc: Option<PathBuf>,
    /// Run only the differential.
    pub fidelity_only: bool,
}

/// One check's verdict.
#[derive(Debug, Clone)]
pub struct Check {
    pub model: String,
    pub name: &'static str,
    pub ok: bool,
    pub figure: String,
}

/// The KV block size the engines run with (the CPU kernels need a multiple of 32).
const BLOCK_SIZE: u32 = 32;
const MAX_MODEL_LEN: u32 = 2048;

/// Runs every check for every model; the checks that failed are in the result.
pub async fn run(opts: &Options) -> Result<Vec<Check>> {
    let http = reqwest::Client::builder().no_proxy().build()?;
    let logs = opts.work.join("logs");
    let _ = std::fs::remove_dir_all(&logs);
    let certs = Certs::new(&opts.work.join("certs"))?;
    let mut checks = Vec::new();
    for (index, (name, tokenizer)) in opts.models.iter().enumerate() {
        let model_dir = make_model(opts, name, tokenizer)?;
        if opts.fidelity && index == 0 {
            checks.extend(differential(opts, &http, name, &model_dir, &logs).await?);
        }
        if opts.fidelity_only {
            break;
        }
        // The first model also runs LoRA and the engine restart.
        let first = index == 0;
        let mut m = ModelRun::start(opts, &certs, &logs, name, &model_dir, &http, first).await?;
        let r = m.checks(&http, opts.restart && first).await;
        checks.append(&mut m.checks);
        m.stop().await;
        r?;
    }
    Ok(checks)
}

/// Runs the differential and turns its figures into checks; writes them as JSON and markdown.
async fn differential(
    opts: &Options,
    http: &reqwest::Client,
    name: &str,
    model_dir: &Path,
    logs: &Path,
) -> Result<Vec<Check>> {
    let t = Instant::now();
    let f = fidelity::run(opts, http, name, model_dir, logs).await?;
    fidelity::write(
        &f,
        &opts.work.join("fidelity.json"),
        opts.fidelity_doc.as_ref(),
        &opts.vllm_version,
    )?;
    let mut checks = Vec::new();
    let mut check = |check: &'static str, ok: bool, figure: String| {
        println!(
            "real-vllm: {name} {check:<32} {} — {figure}",
            if ok { "PASS" } else { "FAIL" }
        );
        checks.push(Check {
            model: name.to_owned(),
            name: check,
            ok,
            figure,
        });
    };
    check(
        "fidelity: same prompt tokens",
        f.prompt_tokens_equal,
        "every request tokenized to the same length by both engines".into(),
    );
    check(
        "fidelity: serial cached tokens",
        f.serial_cached_tokens_equal,
        format!(
            "{} of {} requests agree (vLLM {} vs sim {} cached tokens){}",
            f.serial_cached_agree,
            f.serial_requests,
            f.serial_cached_tokens_vllm,
            f.serial_cached_tokens_sim,
            f.serial_first_cached_difference
                .as_ref()
                .map_or(String::new(), |d| format!("; first difference: {d}"))
        ),
    );
    check(
        "fidelity: serial KV events",
        f.serial_events_equal,
        format!(
            "{} per-block events from vLLM ({} evictions), {} from the sim{}",
            f.serial_events_vllm,
            f.serial_evictions_vllm,
            f.serial_events_sim,
            f.serial_first_event_difference
                .as_ref()
                .map_or(", in the same order".into(), |d| format!("; {d}"))
        ),
    );
    check(
        "fidelity: serial prefix counters",
        f.serial_queries.0 == f.serial_queries.1 && f.serial_hits.0 == f.serial_hits.1,
        format!(
            "queries vLLM {} sim {}, hits vLLM {} sim {}",
            f.serial_queries.0, f.serial_queries.1, f.serial_hits.0, f.serial_hits.1
        ),
    );
    check(
        "fidelity: concurrent hit rate",
        f.hit_rate_ok(),
        format!(
            "{} requests, {} clients: vLLM {:.4}, sim {:.4} (counters: vLLM {}/{}, sim {}/{})",
            f.concurrent_requests,
            fidelity::CLIENTS,
            f.hit_rate_vllm,
            f.hit_rate_sim,
            f.concurrent_hits.0,
            f.concurrent_queries.0,
            f.concurrent_hits.1,
            f.concurrent_queries.1
        ),
    );
    check(
        "fidelity: concurrent preemptions",
        f.preemptions_ok(),
        format!(
            "vLLM {}, sim {}; running/waiting means vLLM {:.2}/{:.2}, sim {:.2}/{:.2}; {:.0} s vs {:.0} s",
            f.preemptions_vllm,
            f.preemptions_sim,
            f.gauges_vllm.mean_running,
            f.gauges_vllm.mean_waiting,
            f.gauges_sim.mean_running,
            f.gauges_sim.mean_waiting,
            f.concurrent_seconds.0,
            f.concurrent_seconds.1,
        ),
    );
    println!(
        "real-vllm: fidelity: {:.0} s in all",
        t.elapsed().as_secs_f64()
    );
    Ok(checks)
}

/// Writes (once per tokenizer) a tiny Llama with random weights around `tokenizer`.
fn make_model(opts: &Options, name: &str, tokenizer: &Path) -> Result<PathBuf> {
    let dir = opts.work.join("models").join(name);
    let digest = {
        use sha2::Digest as _;
        let mut h = sha2::Sha256::new();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            h.update(
                std::fs::read(tokenizer.join(f))
                    .with_context(|| format!("{f} in {}", tokenizer.display()))?,
            );
        }
        format!("{:x}", h.finalize())
    };
    let stamp = dir.join(".kvsight-tokenizer-sha256");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(digest.as_str()) {
        return Ok(dir);
    }
    let _ = std::fs::remove_dir_all(&dir);
    run_script(
        "make_tiny_model.py",
        std::process::Command::new(&opts.python)
            .arg(opts.scripts.join("make_tiny_model.py"))
            .arg(tokenizer)
            .arg(&dir),
    )?;
    std::fs::write(&stamp, digest)?;
    Ok(dir)
}

/// The scheduling and KV-cache flags an engine starts with.
#[derive(Debug, Clone, Copy)]
pub struct EngineShape {
    pub block_size: u32,
    /// `--num-gpu-blocks-override`; `None` = what the KV space gives.
    pub num_gpu_blocks: Option<u32>,
    pub max_num_seqs: u32,
    /// `--max-num-batched-tokens`; `None` = vLLM's default.
    pub max_num_batched_tokens: Option<u32>,
    pub max_model_len: u32,
}

/// The shape of the engines behind the router.
const ROUTED: EngineShape = EngineShape {
    block_size: BLOCK_SIZE,
    num_gpu_blocks: None,
    max_num_seqs: 16,
    max_num_batched_tokens: None,
    max_model_len: MAX_MODEL_LEN,
};

/// One engine: its ports and process.
struct Engine {
    index: usize,
    port: u16,
    kv_port: u16,
    replay_port: u16,
    proc: Option<Proc>,
}

impl Engine {
    /// An engine not started yet, on free ports; `index` names its log and picks its core.
    fn new(index: usize) -> Result<Engine> {
        Ok(Engine {
            index,
            port: free_tcp_port()?,
            kv_port: free_tcp_port()?,
            replay_port: free_tcp_port()?,
            proc: None,
        })
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Starts vLLM's OpenAI server with `shape`; with `lora` (the largest adapter rank), LoRA
    /// is enabled and adapters can be loaded at run time.
    fn start(
        &mut self,
        opts: &Options,
        name: &str,
        model: &Path,
        logs: &Path,
        shape: &EngineShape,
        lora: Option<u32>,
    ) -> Result<()> {
        let kv = json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            // vLLM binds a wildcard endpoint (and connects to any other).
            "endpoint": format!("tcp://*:{}", self.kv_port),
            "replay_endpoint": format!("tcp://*:{}", self.replay_port),
        });
        let args: Vec<String> = vec![
            "-m".into(),
            "vllm.entrypoints.openai.api_server".into(),
            "--model".into(),
            model.display().to_string(),
            "--served-model-name".into(),
            name.into(),
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            self.port.to_string(),
            "--dtype".into(),
            "float32".into(),
            "--block-size".into(),
            shape.block_size.to_string(),
            "--max-model-len".into(),
            shape.max_model_len.to_string(),
            "--max-num-seqs".into(),
            shape.max_num_seqs.to_string(),
            "--enable-prefix-caching".into(),
            "--enable-prompt-tokens-details".into(),
            "--kv-events-config".into(),
            kv.to_string(),
        ];
        let mut args = args;
        if let Some(n) = shape.num_gpu_blocks {
            args.extend(["--num-gpu-blocks-override".into(), n.to_string()]);
        }
        if let Some(n) = shape.max_num_batched_tokens {
            args.extend(["--max-num-batched-tokens".into(), n.to_string()]);
        }
        if let Some(rank) = lora {
            args.extend([
                "--enable-lora".into(),
                "--max-lora-rank".into(),
                rank.to_string(),
                "--max-loras".into(),
                "1".into(),
            ]);
        }
        let env = [
            // 1 GiB of KV cache on CPU; each engine pinned to its own core.
            ("VLLM_CPU_KVCACHE_SPACE", "1".to_owned()),
            ("VLLM_CPU_OMP_THREADS_BIND", (self.index % 2).to_string()),
            ("HF_HUB_OFFLINE", "1".into()),
            ("TRANSFORMERS_OFFLINE", "1".into()),
            ("VLLM_NO_USAGE_STATS", "1".into()),
            ("DO_NOT_TRACK", "1".into()),
            ("TOKENIZERS_PARALLELISM", "false".into()),
            // `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` exist only with this.
            ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1".into()),
        ];
        self.proc = Some(Proc::spawn(
            &format!("vllm-{name}-{}", self.index),
            &opts.python,
            &args,
            &env,
            logs,
        )?);
        Ok(())
    }

    async fn wait_healthy(&mut self, http: &reqwest::Client) -> Result<()> {
        let url = format!("{}/health", self.url());
        let proc = self.proc.as_mut().context("engine not started")?;
        wait_ok(http, &url, &mut [proc], Duration::from_secs(600)).await
    }
}

/// The independent KV-event subscriber of one engine.
struct Subscriber {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl Subscriber {
    /// Subscribes to the PUB socket at `endpoint`, filling gaps from `replay`.
    async fn start(opts: &Options, endpoint: &str, replay: &str) -> Result<Subscriber> {
        let mut child = tokio::process::Command::new(&opts.python)
            .arg(opts.scripts.join("kv_event_counter.py"))
            .arg(endpoint)
            .arg(replay)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting kv_event_counter.py")?;
        let stdin = child.stdin.take().context("stdin")?;
        let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
        // It imports vLLM (and torch): tens of seconds on two cores, minutes on a fresh
        // machine whose page cache has never seen those files.
        let first = tokio::time::timeout(Duration::from_secs(300), lines.next_line())
            .await
            .context("kv_event_counter.py did not start")??;
        if first.as_deref() != Some("ready") {
            bail!("kv_event_counter.py: {first:?}");
        }
        Ok(Subscriber {
            child,
            stdin,
            lines,
        })
    }

    async fn ask(&mut self, command: &str) -> Result<Value> {
        self.stdin
            .write_all(format!("{command}\n").as_bytes())
            .await?;
        let line = tokio::time::timeout(Duration::from_secs(10), self.lines.next_line())
            .await
            .context("kv_event_counter.py did not answer")??
            .context("kv_event_counter.py exited")?;
        Ok(serde_json::from_str(&line)?)
    }

    async fn resident(&mut self) -> Result<u64> {
        self.ask("count").await?["resident"]
            .as_u64()
            .context("no count")
    }

    /// The events decoded since the previous call, in order (see `kv_event_counter.py`).
    async fn events(&mut self) -> Result<Vec<Value>> {
        match self.ask("events").await?["events"].take() {
            Value::Array(v) => Ok(v),
            other => bail!("kv_event_counter.py: events {other}"),
        }
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// The router's three listeners.
struct RouterPorts {
    http: u16,
    quic: u16,
    admin: u16,
}

/// The router under test, its config's weights neutral for base-model requests.
fn spawn_router(
    opts: &Options,
    certs: &Certs,
    logs: &Path,
    name: &str,
    lora: bool,
    ports: &RouterPorts,
) -> Result<Proc> {
    let (http_port, quic_port, admin_port) = (ports.http, ports.quic, ports.admin);
    let config = opts.work.join("router.yaml");
    // Weights are neutral for base-model requests (every pod scores the same).
    let weights = if lora {
        format!(
            "scheduler:\n  weights:\n    loraAffinity: {}\n",
            lora::AFFINITY_WEIGHT
        )
    } else {
        "{}\n".to_owned()
    };
    std::fs::write(&config, weights)?;
    let mut args = vec![
        "--listen".into(),
        format!("127.0.0.1:{http_port}"),
        "--quic-listen".into(),
        format!("127.0.0.1:{quic_port}"),
        "--config".into(),
        config.display().to_string(),
        "--router-id".into(),
        "real-vllm".into(),
        "--admin-listen".into(),
        format!("127.0.0.1:{admin_port}"),
        // The checks read each pick from the answer.
        "--decision-header".into(),
    ];
    args.extend(certs.leaf_flags("router")?);
    Proc::spawn(
        &format!("router-{name}"),
        &opts.router,
        &args,
        &[("RUST_LOG", "info".into())],
        logs,
    )
}

/// Both engines started, and answering `/health`.
async fn start_engines(
    opts: &Options,
    name: &str,
    model_dir: &Path,
    logs: &Path,
    http: &reqwest::Client,
    lora: bool,
) -> Result<Vec<Engine>> {
    let mut engines = Vec::new();
    for index in 0..2 {
        let mut e = Engine::new(index)?;
        e.start(
            opts,
            name,
            model_dir,
            logs,
            &ROUTED,
            lora.then_some(lora::RANK),
        )?;
        engines.push(e);
    }
    let t = Instant::now();
    for e in &mut engines {
        e.wait_healthy(http).await?;
    }
    println!(
        "real-vllm: {name}: both engines answer /health after {:.0} s",
        t.elapsed().as_secs_f64()
    );
    Ok(engines)
}

/// An independent subscriber (vLLM's own structs) on each engine's KV events.
async fn start_subscribers(opts: &Options, engines: &[Engine]) -> Result<Vec<Subscriber>> {
    // Each subscriber imports vLLM (tens of seconds): the two start side by side.
    let endpoints: Vec<(String, String)> = engines
        .iter()
        .map(|e| {
            (
                format!("tcp://127.0.0.1:{}", e.kv_port),
                format!("tcp://127.0.0.1:{}", e.replay_port),
            )
        })
        .collect();
    let (a, b) = tokio::join!(
        Subscriber::start(opts, &endpoints[0].0, &endpoints[0].1),
        Subscriber::start(opts, &endpoints[1].0, &endpoints[1].1)
    );
    Ok(vec![a?, b?])
}

/// A sidecar per engine, connected to the router's QUIC port; each with its `/ready` URL base.
fn spawn_sidecars(
    opts: &Options,
    certs: &Certs,
    logs: &Path,
    name: &str,
    model_dir: &Path,
    engines: &[Engine],
    quic_port: u16,
) -> Result<Vec<(Proc, String)>> {
    let mut sidecars = Vec::new();
    for e in engines {
        let listen = free_tcp_port()?;
        let pod = format!("{name}-{}", e.index);
        let mut args: Vec<String> = vec![
            "--pod-name".into(),
            pod.clone(),
            "--pod-namespace".into(),
            "real-vllm".into(),
            "--vllm-url".into(),
            e.url(),
            "--advertise-url".into(),
            e.url(),
            "--kv-events-endpoint".into(),
            format!("tcp://127.0.0.1:{}", e.kv_port),
            "--kv-events-replay-endpoint".into(),
            format!("tcp://127.0.0.1:{}", e.replay_port),
            "--listen".into(),
            format!("127.0.0.1:{listen}"),
            "--router".into(),
            format!("127.0.0.1:{quic_port}"),
            "--tokenizer-dir".into(),
            model_dir.display().to_string(),
            "--max-num-seqs".into(),
            "16".into(),
        ];
        args.extend(certs.leaf_flags(&pod)?);
        let p = Proc::spawn(
            &format!("sidecar-{pod}"),
            &opts.sidecar,
            &args,
            &[("RUST_LOG", "info".into())],
            logs,
        )?;
        sidecars.push((p, format!("http://127.0.0.1:{listen}")));
    }
    Ok(sidecars)
}

/// A running model: engines, sidecars, router, subscribers, and the checks so far.
struct ModelRun<'a> {
    opts: &'a Options,
    name: String,
    model_dir: PathBuf,
    logs: PathBuf,
    engines: Vec<Engine>,
    sidecars: Vec<(Proc, String)>,
    subscribers: Vec<Subscriber>,
    router: Proc,
    router_url: String,
    /// The router's admin listener (`/debug/pods`, `/metrics`).
    admin_url: String,
    checks: Vec<Check>,
    /// LoRA enabled, adapters loaded (see `lora.rs`).
    lora: bool,
}

impl<'a> ModelRun<'a> {
    async fn start(
        opts: &'a Options,
        certs: &Certs,
        logs: &Path,
        name: &str,
        model_dir: &Path,
        http: &reqwest::Client,
        lora: bool,
    ) -> Result<ModelRun<'a>> {
        let ports = RouterPorts {
            http: free_tcp_port()?,
            quic: free_udp_port()?,
            admin: free_tcp_port()?,
        };
        let router = spawn_router(opts, certs, logs, name, lora, &ports)?;
        let engines = start_engines(opts, name, model_dir, logs, http, lora).await?;
        // Loaded at run time, before the sidecars read the engines' facts.
        if lora {
            lora::load(opts, http, name, model_dir, &engines).await?;
        }
        let subscribers = start_subscribers(opts, &engines).await?;
        let sidecars = spawn_sidecars(opts, certs, logs, name, model_dir, &engines, ports.quic)?;
        Ok(ModelRun {
            opts,
            name: name.to_owned(),
            model_dir: model_dir.to_owned(),
            logs: logs.to_owned(),
            engines,
            sidecars,
            subscribers,
            router,
            router_url: format!("http://127.0.0.1:{}", ports.http),
            admin_url: format!("http://127.0.0.1:{}", ports.admin),
            checks: Vec::new(),
            lora,
        })
    }

    fn check(&mut self, name: &'static str, ok: bool, figure: String) {
        println!(
            "real-vllm: {} {:<32} {} — {figure}",
            self.name,
            name,
            if ok { "PASS" } else { "FAIL" }
        );
        self.checks.push(Check {
            model: self.name.clone(),
            name,
            ok,
            figure,
        });
    }

    async fn checks(&mut self, http: &reqwest::Client, restart: bool) -> Result<()> {
        self.check_warmup(http).await?;
        self.check_pods(http).await?;
        self.check_tokenizer(http).await?;
        self.check_sight(http).await?;
        self.check_resident(http).await?;
        if self.lora {
            self.lora_checks(http).await?;
        }
        self.check_bypass(http).await?;
        if restart {
            self.check_restart(http).await?;
        }
        self.check_metrics_found(http).await
    }

    /// The engines served the warm-up before the sidecars turned Ready.
    async fn check_warmup(&mut self, http: &reqwest::Client) -> Result<()> {
        // Warm-up before Ready: when a sidecar's /ready first answers 200, its engine has
        // already served the warm-up requests.
        let mut served = Vec::new();
        for i in 0..self.sidecars.len() {
            let url = format!("{}/ready", self.sidecars[i].1);
            let deadline = Instant::now() + Duration::from_secs(600);
            loop {
                if http
                    .get(&url)
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success())
                {
                    break;
                }
                if let Some(why) = self.sidecars[i].0.exited() {
                    bail!("{why}");
                }
                if Instant::now() > deadline {
                    bail!("{url} never answered 200");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            served.push(
                engine_metric(http, &self.engines[i].url(), "vllm:request_success_total").await?,
            );
        }
        self.check(
            "warm-up before /ready",
            served.iter().all(|&n| n > 0.0),
            format!("requests the engines had served when /ready turned 200: {served:?}"),
        );

        Ok(())
    }

    /// Both pods are routable, with their engines' facts.
    async fn check_pods(&mut self, http: &reqwest::Client) -> Result<()> {
        let pods = wait_pods(http, &self.admin_url, 2).await;
        self.check(
            "both pods Ready",
            pods.is_ok(),
            format!(
                "{:?}",
                pods.as_ref().map(|p| p.len()).map_err(|e| e.to_string())
            ),
        );
        let pods = pods?;
        let mut facts = Vec::new();
        let mut facts_ok = true;
        for (p, e) in pods.iter().zip(&self.engines) {
            let blocks =
                engine_label(http, &e.url(), "vllm:cache_config_info", "num_gpu_blocks").await?;
            let got = (
                p["block_size"].as_u64(),
                p["engine"]["num_gpu_blocks"]
                    .as_u64()
                    .map(|b| b.to_string()),
                p["engine"]["version"].as_str().map(str::to_owned),
            );
            facts_ok &= got
                == (
                    Some(u64::from(BLOCK_SIZE)),
                    blocks.clone(),
                    Some(self.opts.vllm_version.clone()),
                );
            facts.push(format!(
                "{}: {:?} (engine: {blocks:?} blocks)",
                p["pod"], got
            ));
        }
        self.check("engine facts", facts_ok, facts.join("; "));

        Ok(())
    }

    /// The router trusts the model's tokenizer, and tokenizes as the engine does.
    async fn check_tokenizer(&mut self, http: &reqwest::Client) -> Result<()> {
        // The tokenizer check agrees with the engine.
        let verdict = wait_verdict(http, &self.admin_url, &self.name).await;
        let v = verdict
            .as_ref()
            .map(|v| v.to_string())
            .unwrap_or_else(|e| e.to_string());
        self.check(
            "tokenizer verdict",
            verdict.as_ref().is_ok_and(|v| v["verdict"] == "agrees"),
            v,
        );

        // /tokenize: the router's equals the engine's.
        let (same, total, first_diff) = self.tokenize_set(http).await?;
        self.check(
            "/tokenize equals vLLM's",
            same == total,
            format!(
                "{same} of {total}{}",
                first_diff.map_or(String::new(), |d| format!("; first difference: {d}"))
            ),
        );

        Ok(())
    }

    /// Sight on a fresh cache, and a shared prefix kept on one pod.
    async fn check_sight(&mut self, http: &reqwest::Client) -> Result<()> {
        let sight = self.sight(http, 0).await?;
        self.check("Sight (predicted = cached)", sight.ok(), sight.detail());
        self.check(
            "shared prefix on one pod",
            sight.shared_pods == 1,
            format!(
                "the shared-prefix requests went to {} pod(s)",
                sight.shared_pods
            ),
        );

        Ok(())
    }

    /// Resident blocks agree between each sidecar and an independent subscriber.
    async fn check_resident(&mut self, http: &reqwest::Client) -> Result<()> {
        // Resident blocks: sidecar vs the independent subscriber, once both are quiet.
        let mut figures = Vec::new();
        let mut equal = true;
        for i in 0..self.engines.len() {
            let (ours, theirs) = self.resident_pair(http, i).await?;
            equal &= ours == theirs;
            figures.push(format!(
                "engine {i}: sidecar {ours}, vLLM's structs {theirs}"
            ));
        }
        self.check("resident blocks", equal, figures.join("; "));

        Ok(())
    }

    /// Load sent straight to an engine is seen and routed around.
    async fn check_bypass(&mut self, http: &reqwest::Client) -> Result<()> {
        // Bypassing load: generations sent straight to engine 1.
        let b = self.bypass(http).await?;
        self.check(
            "bypass load seen",
            b.most >= 2 && b.reports <= 2,
            format!(
                "3 generations posted straight to engine 1; the router saw unrouted = {} in the \
                 load report {} after the one current when the engine first counted one \
                 running ({:.0} ms later); at most {} while they ran",
                b.first, b.reports, b.millis, b.most
            ),
        );
        self.check(
            "bypass load steers away",
            b.steered == b.sent && b.sent > 0,
            format!(
                "{} of {} new routed requests went to the other pod while it ran",
                b.steered, b.sent
            ),
        );

        Ok(())
    }

    /// An engine restarted with an empty cache is noticed.
    async fn check_restart(&mut self, http: &reqwest::Client) -> Result<()> {
        // Restart: engine 1 killed and started again on its ports, its cache gone. The same
        // traffic again: a view that still had engine 1's old blocks would predict hits there.
        let t = Instant::now();
        let back = self.restart_engine(http, 1).await;
        self.check(
            "engine restart noticed",
            back.is_ok(),
            format!(
                "{} (routable again after {:.0} s)",
                back.as_ref().map_or_else(|e| e.to_string(), |s| s.clone()),
                t.elapsed().as_secs_f64()
            ),
        );
        let sight = self.sight(http, 0).await?;
        self.check("Sight after the restart", sight.ok(), sight.detail());
        Ok(())
    }

    /// Every vLLM metric the sidecar reads is exported.
    async fn check_metrics_found(&mut self, http: &reqwest::Client) -> Result<()> {
        let mut missing = Vec::new();
        for (_, url) in &self.sidecars {
            let text = crate::client::metrics_text(http, url).await?;
            for s in kvsight_sidecar::scrape::samples(&text)? {
                if s.name == "kvsight_sidecar_engine_metrics_missing" && s.value > 0.0 {
                    missing.push(s.labels.get("metric").cloned().unwrap_or_default());
                }
            }
        }
        self.check(
            "vLLM metrics all found",
            missing.is_empty(),
            if missing.is_empty() {
                "none missing".into()
            } else {
                format!("missing: {missing:?}")
            },
        );
        Ok(())
    }

    /// The router's `/tokenize` against the engine's on a varied set; (equal, total, first
    /// difference).
    async fn tokenize_set(&self, http: &reqwest::Client) -> Result<(usize, usize, Option<String>)> {
        let texts = [
            "Hello world",
            " leading space",
            "  two leading spaces and\ttabs\tinside",
            "line one\nline two\n\nline four",
            "unicode: café naïve Ångström 東京 Привет",
            "emoji: 🚀🔥 ok 👍🏽",
            "special tokens in text: <|user|> <s> </s> <|end|> <|bos|>",
            "numbers 1234567 and 3.14159 and 1e-9",
            "code: def f(x):\n    return x ** 2  # square",
            &"a long text with repetition. ".repeat(60),
        ];
        let mut bodies: Vec<Value> = texts
            .iter()
            .map(|t| json!({"model": self.name, "prompt": t}))
            .collect();
        bodies.push(json!({"model": self.name, "messages": [
            {"role": "system", "content": "You are terse.  Answer in one line."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": " 4"},
            {"role": "user", "content": " And 3+3?\n"},
        ]}));
        bodies.push(json!({"model": self.name, "messages": [
            {"role": "user", "content": "Hi <|end|> there"},
        ]}));
        let (mut same, mut first) = (0, None);
        for b in &bodies {
            let ours = post(http, &format!("{}/tokenize", self.router_url), b).await?;
            let theirs = post(http, &format!("{}/tokenize", self.engines[0].url()), b).await?;
            if ours.0["tokens"] == theirs.0["tokens"] && !theirs.0["tokens"].is_null() {
                same += 1;
            } else if first.is_none() {
                first = Some(format!(
                    "{b}: router {} vs vLLM {}",
                    ours.0["tokens"], theirs.0["tokens"]
                ));
            }
        }
        Ok((same, bodies.len(), first))
    }

    /// Sends the Sight traffic through the router; `round` varies the prompts.
    async fn sight(&self, http: &reqwest::Client, round: u64) -> Result<Sight> {
        let mut s = Sight::default();
        let url = format!("{}/v1/completions", self.router_url);
        let chat_url = format!("{}/v1/chat/completions", self.router_url);
        let preamble = kvsight_sim::own_tokenizer::guidelines_preamble(40, 100 + round);
        let mut shared_pods = std::collections::BTreeSet::new();
        for n in 0..10 {
            let body = json!({"model": self.name, "prompt": format!("{preamble}Question {n}: name one factor."), "max_tokens": 4});
            let (v, d) = post(http, &url, &body).await?;
            s.add(format!("shared {n}"), &v, d.as_ref());
            if let Some(p) = d.as_ref().and_then(|d| d["pod"].as_str()) {
                shared_pods.insert(p.to_owned());
            }
        }
        s.shared_pods = shared_pods.len();
        // Multi-turn chat: three sessions of four turns.
        let mut rng = kvsight_sim::own_tokenizer::SeededRng::new(7 + round);
        for session in 0..3 {
            let mut messages = vec![
                json!({"role": "system", "content": format!("You are assistant number {session}. Keep answers short.")}),
            ];
            for turn in 0..4 {
                messages.push(json!({"role": "user", "content": kvsight_sim::own_tokenizer::paragraph(&mut rng)}));
                let body = json!({"model": self.name, "messages": messages, "max_tokens": 4});
                let (v, d) = post(http, &chat_url, &body).await?;
                s.add(format!("chat {session}.{turn}"), &v, d.as_ref());
                messages.push(json!({"role": "assistant", "content": kvsight_sim::own_tokenizer::question(&mut rng)}));
            }
        }
        // Unique prompts.
        for n in 0..6 {
            let body = json!({"model": self.name, "prompt": format!("Document {round}-{n}. {}", kvsight_sim::own_tokenizer::paragraph(&mut rng)), "max_tokens": 4});
            let (v, d) = post(http, &url, &body).await?;
            s.add(format!("unique {n}"), &v, d.as_ref());
        }
        // A batch: eight at once sharing a new preamble.
        let batch_preamble = kvsight_sim::own_tokenizer::guidelines_preamble(30, 200 + round);
        let tasks: Vec<_> = (0..8)
            .map(|n| {
                let (http, url) = (http.clone(), url.clone());
                let body = json!({"model": self.name, "prompt": format!("{batch_preamble}Batch item {n}."), "max_tokens": 4});
                tokio::spawn(async move { post(&http, &url, &body).await })
            })
            .collect();
        for (n, t) in tasks.into_iter().enumerate() {
            let (v, d) = t.await??;
            s.add_batch(format!("batch {n}"), &v, d.as_ref());
        }
        Ok(s)
    }

    /// (sidecar's resident blocks, the subscriber's) for engine `i`, read once both stopped
    /// changing.
    async fn resident_pair(&mut self, http: &reqwest::Client, i: usize) -> Result<(u64, u64)> {
        let mut last = (u64::MAX, u64::MAX);
        for _ in 0..50 {
            let text = crate::client::metrics_text(http, &self.sidecars[i].1).await?;
            let ours = kvsight_sidecar::scrape::samples(&text)?
                .iter()
                .find(|s| s.name == "kvsight_sidecar_resident_blocks")
                .map_or(0, |s| s.value as u64);
            let theirs = self.subscribers[i].resident().await?;
            if (ours, theirs) == last {
                return Ok(last);
            }
            last = (ours, theirs);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(last)
    }

    /// Posts three long generations straight to engine 1 (as a benchmark run through
    /// `kubectl exec` would), measures how soon the router sees them as engine 1's `unrouted`
    /// load, and routes new requests while they run.
    async fn bypass(&self, http: &reqwest::Client) -> Result<Bypass> {
        let url = format!("{}/v1/completions", self.engines[1].url());
        let tasks: Vec<_> = (0..3)
            .map(|n| {
                let (http, url) = (http.clone(), url.clone());
                let body = json!({"model": self.name, "prompt": format!("A benchmark run {n} from kubectl exec."), "max_tokens": 1000, "ignore_eos": true});
                tokio::spawn(async move { post(&http, &url, &body).await })
            })
            .collect();
        let result = self.watch_bypass(http, &tasks).await;
        for t in tasks {
            t.abort();
        }
        result
    }

    async fn watch_bypass(&self, http: &reqwest::Client, tasks: &[Posting]) -> Result<Bypass> {
        let pod = format!("real-vllm/{}-1", self.name);
        let other = format!("real-vllm/{}-0", self.name);
        let engine = self.engines[1].url();
        let of = |pods: &[Value], key: &str| -> (u64, u64) {
            pods.iter()
                .find(|p| p["pod"] == pod.as_str())
                .map_or((0, 0), |p| {
                    (
                        p["load"]["seq"].as_u64().unwrap_or(0),
                        p[key].as_u64().unwrap_or(0),
                    )
                })
        };
        // The moment the engine itself counts a request running, and the report then current.
        let deadline = Instant::now() + Duration::from_secs(60);
        let (t0, s0) = loop {
            if engine_metric(http, &engine, "vllm:num_requests_running").await? >= 1.0 {
                let pods = debug_pods(http, &self.admin_url).await?;
                break (Instant::now(), of(&pods, "unrouted").0);
            }
            if Instant::now() > deadline || tasks.iter().all(|t| t.is_finished()) {
                bail!("engine 1 never counted the generations running");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let mut b = Bypass::default();
        loop {
            let (seq, unrouted) = of(&debug_pods(http, &self.admin_url).await?, "unrouted");
            if unrouted > 0 {
                b.first = unrouted;
                b.reports = seq.saturating_sub(s0);
                b.millis = t0.elapsed().as_secs_f64() * 1e3;
                break;
            }
            if Instant::now() > deadline || tasks.iter().all(|t| t.is_finished()) {
                bail!("the router never saw engine 1's unrouted load");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Routed requests with prompts no pod caches: the load alone decides.
        let url = format!("{}/v1/completions", self.router_url);
        for n in 0..3 {
            let body = json!({"model": self.name, "prompt": format!("Fresh request {n} while a benchmark runs elsewhere."), "max_tokens": 1});
            let (_, d) = post(http, &url, &body).await?;
            b.sent += 1;
            if d.as_ref().and_then(|d| d["pod"].as_str()) == Some(other.as_str()) {
                b.steered += 1;
            }
            b.most = b
                .most
                .max(of(&debug_pods(http, &self.admin_url).await?, "unrouted").1);
        }
        if tasks.iter().any(|t| t.is_finished()) {
            bail!("a bypassing generation ended before the routed requests were sent");
        }
        Ok(b)
    }

    /// Kills engine `i` and starts it again on the same ports; Ok once the router routes to it
    /// again (its view rebuilt).
    async fn restart_engine(&mut self, http: &reqwest::Client, i: usize) -> Result<String> {
        if let Some(p) = self.engines[i].proc.take() {
            p.stop(Duration::from_millis(100)).await;
        }
        let (opts, name, dir, logs) = (
            self.opts,
            self.name.clone(),
            self.model_dir.clone(),
            self.logs.clone(),
        );
        self.engines[i].start(opts, &name, &dir, &logs, &ROUTED, None)?;
        self.engines[i].wait_healthy(http).await?;
        wait_pods(http, &self.admin_url, 2).await?;
        let pod = format!("real-vllm/{}-{i}", self.name);
        let p = debug_pods(http, &self.admin_url)
            .await?
            .into_iter()
            .find(|p| p["pod"] == pod.as_str())
            .context("pod gone")?;
        Ok(format!(
            "{pod}: filter resident blocks {}",
            p["filter"]["resident_blocks"]
        ))
    }

    async fn stop(self) {
        self.router.stop(Duration::from_secs(3)).await;
        for (p, _) in self.sidecars {
            p.stop(Duration::from_secs(3)).await;
        }
        for e in self.engines {
            if let Some(p) = e.proc {
                p.stop(Duration::from_secs(10)).await;
            }
        }
        for s in self.subscribers {
            s.stop().await;
        }
    }
}

/// A request being posted in the background: its answer and the router's decision.
type Posting = tokio::task::JoinHandle<Result<(Value, Option<Value>)>>;

/// What the bypass check saw.
#[derive(Debug, Default)]
struct Bypass {
    /// `unrouted` in the first report that showed any, how many reports after the one current
    /// when the engine first counted a request running, and how long after.
    first: u64,
    reports: u64,
    millis: f64,
    /// The most `unrouted` seen while the routed requests were sent.
    most: u64,
    /// Routed requests sent meanwhile, and how many went to the other pod.
    sent: usize,
    steered: usize,
}

/// Predictions against the engine's answers.
#[derive(Debug, Default)]
struct Sight {
    /// Requests sent one after another: each prediction must equal the engine's count.
    total: usize,
    exact: usize,
    predicted: u64,
    cached: u64,
    /// The requests whose prediction missed.
    misses: Vec<Miss>,
    /// The concurrent batch, judged by its sum: the router credits the batch's shared prefix to
    /// every request after the first it routes, but which request reaches the engine first is
    /// the network's choice (separate connections), so the engine may hand the hit to another
    /// member of the batch. The sum is the same either way; a view that misses the prefix or a
    /// split batch changes it.
    batch: (u64, u64),
    shared_pods: usize,
}

/// A request whose prediction missed (or whose answer lacked one of the two counts).
#[derive(Debug)]
struct Miss {
    which: String,
    predicted: Option<u64>,
    cached: Option<u64>,
    /// A member of the concurrent batch: its misses fail the check, whereas sequential misses
    /// are allowed up to 1 %.
    in_batch: bool,
}

/// (predicted, cached) of one answer, when both are present.
fn sight_pair(resp: &Value, decision: Option<&Value>) -> (Option<u64>, Option<u64>) {
    (
        decision.and_then(|d| d["predicted_cached_tokens"].as_u64()),
        resp["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
    )
}

impl Sight {
    fn add(&mut self, which: String, resp: &Value, decision: Option<&Value>) {
        self.total += 1;
        let (predicted, cached) = sight_pair(resp, decision);
        if let (Some(p), Some(c)) = (predicted, cached) {
            self.cached += c;
            self.predicted += p;
            if c == p {
                self.exact += 1;
                return;
            }
        }
        self.misses.push(Miss {
            which,
            predicted,
            cached,
            in_batch: false,
        });
    }

    fn add_batch(&mut self, which: String, resp: &Value, decision: Option<&Value>) {
        match sight_pair(resp, decision) {
            (Some(p), Some(c)) => {
                self.batch.0 += p;
                self.batch.1 += c;
            }
            (predicted, cached) => self.misses.push(Miss {
                which,
                predicted,
                cached,
                in_batch: true,
            }),
        }
    }

    /// Every sequential request exact (at most 1 % off), and the batch exact in sum.
    fn ok(&self) -> bool {
        self.exact as f64 >= 0.99 * self.total as f64
            && self.batch.0 == self.batch.1
            && !self.misses.iter().any(|m| m.in_batch)
    }

    /// A check's detail: the counts and every miss.
    fn detail(&self) -> String {
        let misses: String = self
            .misses
            .iter()
            .map(|m| {
                format!(
                    "; {}: predicted {:?}, cached {:?}",
                    m.which, m.predicted, m.cached
                )
            })
            .collect();
        format!(
            "{} of {} sequential requests exact ({:.1} %), predicted {} vs cached {} tokens in all; \
             concurrent batch predicted {} vs cached {} tokens in sum{misses}",
            self.exact,
            self.total,
            100.0 * self.exact as f64 / self.total.max(1) as f64,
            self.predicted,
            self.cached,
            self.batch.0,
            self.batch.1,
        )
    }
}

/// POSTs JSON asking for kvsight's decision; returns the body and the decision.
async fn post(http: &reqwest::Client, url: &str, body: &Value) -> Result<(Value, Option<Value>)> {
    let r = http
        .post(url)
        .header("content-type", "application/json")
        .header("x-kvsight-debug", "1")
        .body(body.to_string())
        .timeout(Duration::from_secs(300))
        .send()
        .await?;
    let decision = r
        .headers()
        .get("x-kvsight-decision")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| serde_json::from_str(v).ok());
    let status = r.status();
    let bytes = r.bytes().await?;
    if !status.is_success() {
        bail!("{url}: HTTP {status}: {}", String::from_utf8_lossy(&bytes));
    }
    Ok((serde_json::from_slice(&bytes)?, decision))
}

/// A Python helper script run to its end; its standard error in the error when it fails.
fn run_script(name: &str, cmd: &mut std::process::Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("running {name}"))?;
    if !out.status.success() {
        bail!("{name} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// `GET url` read as JSON, whatever its status.
async fn get_json(http: &reqwest::Client, url: &str) -> Result<Value> {
    let bytes = http.get(url).send().await?.bytes().await?;
    Ok(serde_json::from_slice(&bytes)?)
}

async fn debug_pods(http: &reqwest::Client, router: &str) -> Result<Vec<Value>> {
    let v = get_json(http, &format!("{router}/debug/pods")).await?;
    Ok(v["pods"].as_array().cloned().unwrap_or_default())
}

/// Waits until `n` pods are Ready with a filter; returns them in pod-name order.
async fn wait_pods(http: &reqwest::Client, router: &str, n: usize) -> Result<Vec<Value>> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if let Ok(mut pods) = debug_pods(http, router).await {
            pods.retain(|p| p["phase"] == "ready" && !p["filter"].is_null() && p["stale"] == false);
            if pods.len() >= n {
                pods.sort_by(|a, b| a["pod"].as_str().cmp(&b["pod"].as_str()));
                return Ok(pods);
            }
        }
        if Instant::now() > deadline {
            bail!("{n} pods not routable within 300 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the router has checked `model`'s tokenizer; returns its entry.
async fn wait_verdict(http: &reqwest::Client, router: &str, model: &str) -> Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let v = get_json(http, &format!("{router}/debug/pods")).await?;
        let t = &v["tokenizers"][model];
        if !t.is_null() && t["verdict"] != "unchecked" {
            return Ok(t.clone());
        }
        if Instant::now() > deadline {
            bail!("no tokenizer verdict for {model} within 120 s: {t}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The engine's `/metrics` exposition.
async fn engine_exposition(http: &reqwest::Client, engine: &str) -> Result<String> {
    crate::client::metrics_text(http, engine).await
}

/// The sum of a vLLM metric's samples.
async fn engine_metric(http: &reqwest::Client, engine: &str, name: &str) -> Result<f64> {
    let text = engine_exposition(http, engine).await?;
    Ok(kvsight_sidecar::scrape::samples(&text)?
        .iter()
        .filter(|s| s.name == name)
        .map(|s| s.value)
        .sum())
}

/// One label of a vLLM info metric.
async fn engine_label(
    http: &reqwest::Client,
    engine: &str,
    name: &str,
    label: &str,
) -> Result<Option<String>> {
    let text = engine_exposition(http, engine).await?;
    Ok(kvsight_sidecar::scrape::samples(&text)?
        .iter()
        .find(|s| s.name == name)
        .and_then(|s| s.labels.get(label).cloned()))
}
