//! `mixed_faults`: what production adds to a multi-tenant load, the same for every router.
//!
//! - **Load that bypasses the router**: long generations posted straight to pod 0 (a benchmark
//!   run with `kubectl exec`, another gateway); only a router that reads the engine sees them.
//! - **A cold pod joins**: a new pod whose engine stalls to compile each new shape, as a freshly
//!   scheduled vLLM does. kvsight learns of it from its sidecar, which warms it up before
//!   reporting Ready; the peers are told of it as an endpoint controller would tell them — once
//!   vLLM's `/health` answers (their own APIs: smg and sglang-router `POST /workers`,
//!   vllm-router `POST /add_worker`) — and forget it after the run.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::json;

use crate::cluster::{Pod, PodsConfig};
use crate::routers::Kind;
use crate::workload::MODEL;

/// Generations posted straight to pod 0.
pub const EXEC_REQUESTS: usize = 6;
/// Compile stall of the cold pod per new shape, simulated ms.
pub const COLD_STALL_MS: f64 = 1500.0;

/// Posts `n` long generations straight to `url` and waits for them (their outcomes are not
/// the router's: only their effect on the other requests is measured).
pub async fn exec_load(
    http: reqwest::Client,
    url: String,
    n: usize,
    prompt_tokens: u32,
    output: u32,
) {
    // A JoinSet, so that aborting this task (the run is over) drops every request: the pod
    // aborts them and the next run starts on an idle pod instead of waiting for them.
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        // Unique prompts: a benchmark's own, sharing nothing with the tenants.
        let prompt = format!("Benchmark run {i}. ")
            + &"measure the throughput of this engine ".repeat(prompt_tokens as usize / 6);
        let body = json!({
            "model": MODEL, "prompt": prompt, "max_tokens": output, "ignore_eos": true,
        });
        let http = http.clone();
        let url = format!("{url}/v1/completions");
        tasks.spawn(async move {
            let _ = http
                .post(url)
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await
                .and_then(|r| r.error_for_status());
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// A cold pod started mid-run, and how the router under test was told.
pub struct ColdPod {
    pub pod: Pod,
    /// The worker id each replica of a peer gave it (smg, sglang-router), to remove it by.
    worker_ids: Vec<Option<String>>,
}

impl ColdPod {
    /// Starts the pod (its sidecar warms it up and reports to the kvsight routers); for a peer,
    /// adds it to every replica once vLLM's `/health` answers.
    pub async fn join(
        name: &str,
        cfg: &PodsConfig<'_>,
        kind: Kind,
        router_urls: &[String],
        http: &reqwest::Client,
    ) -> Result<ColdPod> {
        let pod = Pod::start(name, cfg, http).await?;
        let mut worker_ids = Vec::with_capacity(router_urls.len());
        for url in router_urls {
            worker_ids.push(add_worker(kind, url, &pod.url, http).await?);
        }
        Ok(ColdPod { pod, worker_ids })
    }

    /// Removes the pod from every replica of a peer, then stops it.
    pub async fn leave(
        self,
        kind: Kind,
        router_urls: &[String],
        http: &reqwest::Client,
    ) -> Result<()> {
        let mut r = Ok(());
        for (url, id) in router_urls.iter().zip(&self.worker_ids) {
            let removed = remove_worker(kind, url, &self.pod.url, id.as_deref(), http).await;
            r = r.and(removed);
        }
        self.pod.stop().await;
        r
    }
}

async fn add_worker(
    kind: Kind,
    router: &str,
    worker: &str,
    http: &reqwest::Client,
) -> Result<Option<String>> {
    let r = match kind {
        k if k.is_kvsight() => return Ok(None),
        Kind::SmgCacheAware | Kind::SmgPowerOfTwo | Kind::SglangCacheAware => {
            let body = http
                .post(format!("{router}/workers"))
                .header("content-type", "application/json")
                .body(json!({"url": worker}).to_string())
                .send()
                .await?
                .error_for_status()?
                .bytes()
                .await?;
            let v: serde_json::Value = serde_json::from_slice(&body).context("the worker id")?;
            return Ok(v["worker_id"].as_str().map(str::to_owned));
        }
        _ => {
            http.post(format!("{router}/add_worker?url={}", query_value(worker)))
                .send()
                .await?
        }
    };
    let status = r.status();
    let text = r.text().await.unwrap_or_default();
    if !status.is_success() && !text.contains("already exists") {
        bail!("adding {worker} to {}: HTTP {status}: {text}", kind.name());
    }
    Ok(None)
}

async fn remove_worker(
    kind: Kind,
    router: &str,
    worker: &str,
    id: Option<&str>,
    http: &reqwest::Client,
) -> Result<()> {
    let r = match (kind, id) {
        (k, _) if k.is_kvsight() => return Ok(()),
        (Kind::SmgCacheAware | Kind::SmgPowerOfTwo | Kind::SglangCacheAware, Some(id)) => {
            http.delete(format!("{router}/workers/{id}")).send().await?
        }
        _ => {
            http.post(format!(
                "{router}/remove_worker?url={}",
                query_value(worker)
            ))
            .send()
            .await?
        }
    };
    if !r.status().is_success() {
        bail!(
            "removing {worker} from {}: HTTP {}",
            kind.name(),
            r.status()
        );
    }
    // Give the peer a moment to stop health-checking it (no request goes there meanwhile).
    tokio::time::sleep(Duration::from_millis(200)).await;
    Ok(())
}

/// Percent-encodes a URL for a query string.
fn query_value(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
