//! `cargo xtask demo`: the classic endpoint-picking validation on a loopback cluster.
//!
//! Three experiments, each judged only by what the simulated engines themselves count (deltas of
//! `vllm:request_success_total` and `vllm:prefix_cache_{hits,queries}_total` read before and after
//! each batch), never by what the router believes it did:
//!
//! 1. `shared_prefix`: 12 serial completions sharing a ~700-token preamble must all land on one
//!    pod, whose prefix-cache hit rate must reach 85 %.
//! 2. `unique_prefix`: the same with a request-specific first line (no two prompts share a block):
//!    every pod must serve at least 3 of the 12.
//! 3. `prefix_weight_zero`: the routers' config file is rewritten with `prefix: 0` (hot reload,
//!    no restart) and batch 1 is sent again: it must spread like batch 2.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::cluster::{Cluster, ClusterConfig, ClusterError, PodSpec, WAIT, Warmup};
use kvsight_sim::engine::EngineConfig;

/// The served model name.
pub const MODEL: &str = "kvsight-demo";
/// Requests per experiment.
pub const BATCH: usize = 12;
/// Least share of a spread batch each pod must serve (for 2 pods: 3 of 12).
const MIN_SPREAD: f64 = 0.25;
/// Least prefix-cache hit rate of the pod a shared-prefix batch concentrated on.
const MIN_HIT_RATE: f64 = 0.85;

/// What to run.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    pub pods: usize,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions { pods: 2 }
    }
}

/// One experiment's outcome.
#[derive(Debug, Clone)]
pub struct Experiment {
    pub name: &'static str,
    pub expectation: String,
    /// Requests each pod's engine finished during the batch, by pod name.
    pub requests_per_pod: BTreeMap<String, u64>,
    /// Prefix-cache hit rate during the batch, by pod name (`None`: the pod saw no prompt).
    pub hit_rate_per_pod: BTreeMap<String, Option<f64>>,
    /// The hit rate of the pod that served the most requests.
    pub hit_rate: Option<f64>,
    pub elapsed: Duration,
    pub ok: bool,
}

impl Experiment {
    fn to_json(&self) -> Value {
        json!({
            "name": self.name,
            "expectation": self.expectation,
            "requests_per_pod": self.requests_per_pod,
            "hit_rate": self.hit_rate.map(round3),
            "hit_rate_per_pod": self.hit_rate_per_pod.iter()
                .map(|(k, v)| (k.clone(), json!(v.map(round3)))).collect::<serde_json::Map<_, _>>(),
            "elapsed_ms": self.elapsed.as_millis() as u64,
            "ok": self.ok,
        })
    }
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// The whole run.
#[derive(Debug, Clone)]
pub struct DemoReport {
    pub preamble_tokens: usize,
    pub experiments: Vec<Experiment>,
}

impl DemoReport {
    pub fn ok(&self) -> bool {
        self.experiments.iter().all(|e| e.ok)
    }

    /// The `--json` form: `{"experiments":[…],"ok":bool}`.
    pub fn to_json(&self) -> Value {
        json!({
            "preamble_tokens": self.preamble_tokens,
            "experiments": self.experiments.iter().map(Experiment::to_json).collect::<Vec<_>>(),
            "ok": self.ok(),
        })
    }

    /// A table for people.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "kvsight demo: {BATCH} serial requests per experiment, preamble {} tokens\n\n",
            self.preamble_tokens
        ));
        out.push_str(&format!(
            "{:<20} {:<28} {:<22} {:>8}  {:<7} expectation\n",
            "experiment", "requests per pod", "hit rate per pod", "time", "verdict"
        ));
        for e in &self.experiments {
            let reqs: Vec<String> = e
                .requests_per_pod
                .iter()
                .map(|(p, n)| format!("{p}={n}"))
                .collect();
            let hits: Vec<String> = e
                .hit_rate_per_pod
                .values()
                .map(|h| h.map_or("-".to_owned(), |h| format!("{:.0}%", h * 100.0)))
                .collect();
            out.push_str(&format!(
                "{:<20} {:<28} {:<22} {:>6}ms  {:<7} {}\n",
                e.name,
                reqs.join(" "),
                hits.join(" "),
                e.elapsed.as_millis(),
                if e.ok { "PASS" } else { "FAIL" },
                e.expectation
            ));
        }
        out.push_str(&format!(
            "\noverall: {}\n",
            if self.ok() { "PASS" } else { "FAIL" }
        ));
        out
    }
}

/// The demo's pods: vLLM-like defaults (16-token blocks, compile stalls the sidecar's warm-up
/// absorbs before Ready), sped up 10× so the demo stays short.
pub fn pod_specs(pods: usize) -> Result<Vec<PodSpec>, ClusterError> {
    (0..pods)
        .map(|i| {
            let engine = EngineConfig::builder()
                .num_gpu_blocks(4096)
                .max_model_len(4096)
                .seed(i as u64)
                .time_scale(0.1)
                .build()
                .map_err(|e| ClusterError::Pod {
                    pod: format!("pod-{i}"),
                    message: e.to_string(),
                })?;
            let mut spec = PodSpec::new(&format!("pod-{i}"), MODEL, engine)?;
            spec.warmup = Warmup::Default;
            Ok(spec)
        })
        .collect()
}

/// The shared preamble: 40 numbered guidelines.
pub fn preamble() -> String {
    const SUBJECTS: [&str; 8] = [
        "Each plan",
        "Every incident",
        "The forecast",
        "Each migration",
        "The handbook",
        "Every escalation",
        "The checklist",
        "Each review",
    ];
    const ACTIONS: [&str; 5] = [
        "names an owner and a deadline",
        "is clear to a new engineer",
        "has a tested rollback",
        "states the metric that proves it",
        "is checked by another team",
    ];
    let mut s = String::from(
        "You are the operations assistant of a large infrastructure team. Follow these guidelines \
         in every answer.\n",
    );
    for i in 0..40 {
        s.push_str(&format!(
            "{}. {} {}.\n",
            i + 1,
            SUBJECTS[i % SUBJECTS.len()],
            ACTIONS[(i / SUBJECTS.len() + i) % ACTIONS.len()]
        ));
    }
    s
}

/// Request `n` of batch 1 (and 3).
pub fn shared_prompt(n: usize) -> String {
    format!("{}Question {n}: name one factor.", preamble())
}

/// Request `n` of batch 2: a request-specific first line, so no two prompts share a block.
pub fn unique_prompt(n: usize) -> String {
    const PLACES: [&str; 12] = [
        "Lisbon", "Osaka", "Nairobi", "Denver", "Tallinn", "Lima", "Perth", "Quebec", "Bergen",
        "Cairo", "Hanoi", "Zagreb",
    ];
    format!(
        "Ticket {} from the {} office, filed on day {} of the quarter.\n{}Question {n}: name one \
         factor.",
        n * 7919 % 1000,
        PLACES[n % PLACES.len()],
        n * 13 + 5,
        preamble()
    )
}

/// Runs the experiments on a started cluster whose routers are reachable.
pub async fn run_experiments(cluster: &mut Cluster) -> Result<DemoReport, ClusterError> {
    let preamble_tokens = count_tokens(cluster, &preamble()).await?;
    let mut experiments = Vec::new();
    experiments.push(
        batch(cluster, "shared_prefix", shared_prompt, |e| {
            let (busiest, n) = busiest(e);
            format!(
                "all {BATCH} on one pod (got {n} on {busiest}), its hit rate >= {:.0}%",
                MIN_HIT_RATE * 100.0
            )
        })
        .await?,
    );
    experiments.push(batch(cluster, "unique_prefix", unique_prompt, spread_expectation).await?);
    let yaml = std::fs::read_to_string(cluster.router_config_path()).map_err(|source| {
        ClusterError::Io {
            what: "reading router.yaml".into(),
            source,
        }
    })?;
    cluster
        .reload_router_config(&with_prefix_weight_zero(&yaml)?)
        .await?;
    experiments.push(
        batch(
            cluster,
            "prefix_weight_zero",
            shared_prompt,
            spread_expectation,
        )
        .await?,
    );

    // Verdicts.
    let pods = cluster.pods.len() as f64;
    for e in &mut experiments {
        let (_, most) = busiest(e);
        e.ok = match e.name {
            "shared_prefix" => {
                most == BATCH as u64 && e.hit_rate.is_some_and(|h| h >= MIN_HIT_RATE)
            }
            _ => {
                let least = (BATCH as f64 * MIN_SPREAD.min(1.0 / pods)).floor() as u64;
                e.requests_per_pod.values().all(|&n| n >= least)
                    && e.requests_per_pod.len() == cluster.pods.len()
            }
        };
    }
    Ok(DemoReport {
        preamble_tokens,
        experiments,
    })
}

fn spread_expectation(e: &Experiment) -> String {
    let pods = e.requests_per_pod.len().max(1) as f64;
    let least = (BATCH as f64 * MIN_SPREAD.min(1.0 / pods)).floor();
    format!("every pod serves >= {least} of {BATCH}")
}

fn busiest(e: &Experiment) -> (String, u64) {
    e.requests_per_pod
        .iter()
        .max_by_key(|(_, n)| **n)
        .map(|(p, n)| (p.clone(), *n))
        .unwrap_or_default()
}

/// The routers' config with the prefix weight set to 0 and every other setting kept. JSON is
/// YAML, so the rewritten file is the parsed document printed as JSON.
pub fn with_prefix_weight_zero(yaml: &str) -> Result<String, ClusterError> {
    let mut doc: Value = serde_saphyr::from_str(yaml).map_err(|e| ClusterError::Router {
        index: 0,
        message: format!("router.yaml: {e}"),
    })?;
    if !doc.is_object() {
        doc = json!({});
    }
    let scheduler = doc
        .as_object_mut()
        .map(|d| d.entry("scheduler").or_insert_with(|| json!({})))
        .and_then(Value::as_object_mut);
    if let Some(weights) = scheduler
        .map(|s| s.entry("weights").or_insert_with(|| json!({})))
        .and_then(Value::as_object_mut)
    {
        weights.insert("prefix".into(), json!(0));
    }
    Ok(format!("{doc:#}\n"))
}

/// Sends one batch of serial completions and reads the engines' counters around it.
async fn batch(
    cluster: &Cluster,
    name: &'static str,
    prompt: fn(usize) -> String,
    expectation: fn(&Experiment) -> String,
) -> Result<Experiment, ClusterError> {
    let before = cluster.all_counters().await?;
    let started = Instant::now();
    for n in 0..BATCH {
        let body = json!({
            "model": MODEL,
            "prompt": prompt(n),
            "max_tokens": 4,
            "temperature": 0,
        });
        let r = cluster.post(0, "/v1/completions", &body).await?;
        if r.status != 200 {
            return Err(ClusterError::Router {
                index: 0,
                message: format!("{name} request {n}: HTTP {}: {}", r.status, r.text),
            });
        }
    }
    let elapsed = started.elapsed();
    // Wait for the engines' totals so a slow metrics path cannot shift a request into the next
    // batch.
    let deltas = cluster.counters_after(&before, BATCH as f64, WAIT).await?;
    let mut e = Experiment {
        name,
        expectation: String::new(),
        requests_per_pod: BTreeMap::new(),
        hit_rate_per_pod: BTreeMap::new(),
        hit_rate: None,
        elapsed,
        ok: false,
    };
    for (pod, d) in cluster.pods.iter().zip(&deltas) {
        e.requests_per_pod
            .insert(pod.spec.name.clone(), d.requests.round() as u64);
        e.hit_rate_per_pod
            .insert(pod.spec.name.clone(), d.hit_rate());
    }
    let (top, _) = busiest(&e);
    e.hit_rate = e.hit_rate_per_pod.get(&top).copied().flatten();
    e.expectation = expectation(&e);
    Ok(e)
}

/// Counts the tokens of `text` with the router's `/tokenize` (the engine's ids).
async fn count_tokens(cluster: &Cluster, text: &str) -> Result<usize, ClusterError> {
    let r = cluster
        .post(
            0,
            "/tokenize",
            &json!({"model": MODEL, "prompt": text, "add_special_tokens": false}),
        )
        .await?;
    let v: Value = serde_json::from_str(&r.text).unwrap_or(Value::Null);
    v["count"]
        .as_u64()
        .map(|c| c as usize)
        .ok_or_else(|| ClusterError::Router {
            index: 0,
            message: format!("/tokenize: HTTP {}: {}", r.status, r.text),
        })
}

/// Starts the demo cluster and waits until the router can route on every pod's real state.
pub async fn start_cluster(options: &DemoOptions) -> Result<Cluster, ClusterError> {
    let cluster = Cluster::start(ClusterConfig::new(pod_specs(options.pods)?)).await?;
    cluster.wait_all_routable(Duration::from_secs(60)).await?;
    // The router learns each model's tokenizer from the sidecars; until then it would route in
    // approximate mode. Wait for exact mode so the demo shows the real thing.
    cluster.wait_tokenizer(MODEL, WAIT).await?;
    Ok(cluster)
}
