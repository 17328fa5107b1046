//! LoRA on the real engine: two adapters with random weights made here, loaded at run time
//! (`/v1/load_lora_adapter`), reported by the sidecars, hashed by the router under the
//! adapter's chain root exactly as the engine caches them, and routed by `loraAffinity` to the
//! pod where the engine reports the adapter running.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use super::{Engine, ModelRun, Options, Sight, debug_pods, engine_exposition, post};

/// The adapters' rank (also `--max-lora-rank`).
pub(super) const RANK: u32 = 8;

/// The weight the LoRA run's router gives `loraAffinity`: at the default (1) one running
/// request elsewhere (`runningRequests`, 2) outweighs a warm adapter.
pub(super) const AFFINITY_WEIGHT: f64 = 5.0;

/// Adapter A (loaded on every engine) and adapter B (on the first engine only).
pub(super) fn names(model: &str) -> (String, String) {
    (format!("{model}-lora-a"), format!("{model}-lora-b"))
}

/// Writes both adapters (once per model folder) and loads them into the running engines.
pub(super) async fn load(
    opts: &Options,
    http: &reqwest::Client,
    model: &str,
    model_dir: &Path,
    engines: &[Engine],
) -> Result<()> {
    let (a, b) = names(model);
    let mut dirs: Vec<PathBuf> = Vec::new();
    for (seed, adapter) in [&a, &b].into_iter().enumerate() {
        let dir = opts.work.join("models").join(adapter);
        if !dir.join("adapter_config.json").exists() {
            let out = std::process::Command::new(&opts.python)
                .arg(opts.scripts.join("make_tiny_lora.py"))
                .arg(model_dir)
                .arg(&dir)
                .args([
                    "--rank",
                    &RANK.to_string(),
                    "--seed",
                    &(seed + 1).to_string(),
                ])
                .output()
                .context("running make_tiny_lora.py")?;
            if !out.status.success() {
                bail!(
                    "make_tiny_lora.py failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        dirs.push(dir);
    }
    for (i, e) in engines.iter().enumerate() {
        for (adapter, dir) in [&a, &b].into_iter().zip(&dirs) {
            if adapter == &b && i != 0 {
                continue;
            }
            let r = http
                .post(format!("{}/v1/load_lora_adapter", e.url()))
                .header("content-type", "application/json")
                .body(json!({"lora_name": adapter, "lora_path": dir}).to_string())
                .timeout(Duration::from_secs(120))
                .send()
                .await?;
            let status = r.status();
            let text = r.text().await?;
            // vLLM's CPU build refusing LoRA is a finding: its words go into the log verbatim.
            if !status.is_success() {
                bail!("engine {i} refused /v1/load_lora_adapter {adapter}: HTTP {status}: {text}");
            }
            println!("real-vllm: {model}: engine {i}: {}", text.trim());
        }
    }
    Ok(())
}

/// The adapters an engine lists in `/v1/models` (cards with a parent), sorted.
async fn engine_adapters(http: &reqwest::Client, engine: &str) -> Result<Vec<String>> {
    let bytes = http
        .get(format!("{engine}/v1/models"))
        .send()
        .await?
        .bytes()
        .await?;
    let v: Value = serde_json::from_slice(&bytes)?;
    let mut out: Vec<String> = v["data"]
        .as_array()
        .context("no data")?
        .iter()
        .filter(|c| !c["parent"].is_null())
        .filter_map(|c| c["id"].as_str().map(str::to_owned))
        .collect();
    out.sort();
    Ok(out)
}

/// The adapters `engine` reports running (`vllm:lora_requests_info`, read as the sidecar does).
async fn running_adapters(http: &reqwest::Client, engine: &str) -> Result<Vec<String>> {
    let text = engine_exposition(http, engine).await?;
    Ok(kvsight_sidecar::scrape::parse(&text)?
        .lora
        .map(|l| l.running)
        .unwrap_or_default())
}

impl ModelRun<'_> {
    /// The LoRA checks: adapters reported, Sight for adapter requests, `loraAffinity`.
    pub(super) async fn lora_checks(&mut self, http: &reqwest::Client) -> Result<()> {
        let (a, b) = names(&self.name);
        // Reported: each pod's adapters, as its sidecar told the router, equal its engine's.
        let pods = debug_pods(http, &self.admin_url).await?;
        let mut reported = Vec::new();
        let mut equal = true;
        for (i, e) in self.engines.iter().enumerate() {
            let key = format!("real-vllm/{}-{i}", self.name);
            let mut router: Vec<String> = pods
                .iter()
                .find(|p| p["pod"] == key.as_str())
                .and_then(|p| p["lora_adapters"].as_array())
                .map(|v| {
                    v.iter()
                        .filter_map(|s| s.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            router.sort();
            let engine = engine_adapters(http, &e.url()).await?;
            let want: Vec<String> = if i == 0 {
                vec![a.clone(), b.clone()]
            } else {
                vec![a.clone()]
            };
            equal &= router == engine && engine == want;
            reported.push(format!("{key}: router {router:?}, engine {engine:?}"));
        }
        self.check("LoRA adapters reported", equal, reported.join("; "));

        // Sight for adapter requests: B lives on pod 0 only, A on both.
        let mut s = Sight::default();
        let mut b_pods = std::collections::BTreeSet::new();
        let url = format!("{}/v1/completions", self.router_url);
        let chat_url = format!("{}/v1/chat/completions", self.router_url);
        let preamble = kvsight_sim::own_tokenizer::guidelines_preamble(30, 700);
        let mut rng = kvsight_sim::own_tokenizer::SeededRng::new(71);
        for (adapter, tag) in [(&b, "B"), (&a, "A")] {
            for n in 0..4 {
                let body = json!({"model": adapter, "prompt": format!("{preamble}Adapter question {n}: {}", kvsight_sim::own_tokenizer::question(&mut rng)), "max_tokens": 2});
                let (v, d) = post(http, &url, &body).await?;
                if adapter == &b {
                    b_pods.insert(
                        d.as_ref()
                            .and_then(|d| d["pod"].as_str())
                            .map(str::to_owned),
                    );
                }
                s.add(format!("{tag} shared {n}"), &v, d.as_ref());
            }
            let mut messages = vec![
                json!({"role": "system", "content": format!("You are adapter {tag}. Answer briefly.")}),
            ];
            for turn in 0..3 {
                messages.push(json!({"role": "user", "content": kvsight_sim::own_tokenizer::paragraph(&mut rng)}));
                let body = json!({"model": adapter, "messages": messages, "max_tokens": 2});
                let (v, d) = post(http, &chat_url, &body).await?;
                if adapter == &b {
                    b_pods.insert(
                        d.as_ref()
                            .and_then(|d| d["pod"].as_str())
                            .map(str::to_owned),
                    );
                }
                s.add(format!("{tag} chat {turn}"), &v, d.as_ref());
                messages.push(json!({"role": "assistant", "content": kvsight_sim::own_tokenizer::question(&mut rng)}));
            }
        }
        self.check("LoRA Sight (predicted = cached)", s.ok(), s.detail());
        let pod0 = format!("real-vllm/{}-0", self.name);
        self.check(
            "LoRA B only where loaded",
            b_pods.len() == 1 && b_pods.contains(&Some(pod0.clone())),
            format!("adapter B (loaded on {pod0} only) went to {b_pods:?}"),
        );

        let affinity = self.lora_affinity(http, &a).await;
        let (ok, figure) = match affinity {
            Ok(x) => x,
            Err(e) => (false, e.to_string()),
        };
        self.check("loraAffinity routes to the warm pod", ok, figure);
        Ok(())
    }

    /// A long generation with adapter `a` runs on one pod (P); once P's sidecar has reported it
    /// (the engine's `vllm:lora_requests_info`), requests for `a` whose prefix both pods cache
    /// must go to P, with the winner's `loraAffinity` score 1, although P is the busier pod.
    async fn lora_affinity(&mut self, http: &reqwest::Client, a: &str) -> Result<(bool, String)> {
        let prefix = kvsight_sim::own_tokenizer::guidelines_preamble(20, 701);
        // The same prefix cached under `a` on both pods, sent straight to each engine, so the
        // prefix scorers tie.
        for e in &self.engines {
            let body = json!({"model": a, "prompt": format!("{prefix}Seed."), "max_tokens": 1});
            post(http, &format!("{}/v1/completions", e.url()), &body).await?;
        }
        let url = format!("{}/v1/completions", self.router_url);
        let long = {
            let (http, url) = (http.clone(), url.clone());
            let body = json!({"model": a, "prompt": "A long story about adapters, told slowly.", "max_tokens": 1500, "ignore_eos": true});
            tokio::spawn(async move { post(&http, &url, &body).await })
        };
        // P is where the engine itself reports the adapter running.
        let deadline = Instant::now() + Duration::from_secs(60);
        let p = loop {
            let mut found = None;
            for (i, e) in self.engines.iter().enumerate() {
                if running_adapters(http, &e.url())
                    .await?
                    .iter()
                    .any(|x| x == a)
                {
                    found = Some(i);
                }
            }
            if let Some(i) = found {
                break i;
            }
            if long.is_finished() || Instant::now() > deadline {
                long.abort();
                bail!("no engine reported {a} running");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let key = format!("real-vllm/{}-{p}", self.name);
        // Two more load reports from P's sidecar: the second was scraped after the engine
        // reported the adapter running.
        let seq = |pods: &[Value]| {
            pods.iter()
                .find(|x| x["pod"] == key.as_str())
                .and_then(|x| x["load"]["seq"].as_u64())
        };
        let s0 = seq(&debug_pods(http, &self.admin_url).await?).unwrap_or(0);
        let deadline = Instant::now() + Duration::from_secs(10);
        while seq(&debug_pods(http, &self.admin_url).await?).unwrap_or(0) < s0 + 2 {
            if Instant::now() > deadline {
                long.abort();
                bail!("{key} sent no load report within 10 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut picks = Vec::new();
        let mut ok = true;
        for n in 0..3 {
            let body =
                json!({"model": a, "prompt": format!("{prefix}Follow-up {n}."), "max_tokens": 1});
            let (_, d) = post(http, &url, &body).await?;
            let d = d.context("no decision header")?;
            let pod = d["pod"].as_str().unwrap_or_default().to_owned();
            let score = d["scores"]["loraAffinity"].as_f64();
            ok &= pod == key && score == Some(1.0) && d["least_request"] != true;
            picks.push(format!("{pod} (loraAffinity {score:?})"));
        }
        let still_running = !long.is_finished();
        long.abort();
        Ok((
            ok && still_running,
            format!(
                "{a} running on {key} (engine-reported); 3 follow-ups with a prefix both pods \
                 cache went to {}; loraAffinity weight {AFFINITY_WEIGHT}{}",
                picks.join(", "),
                if still_running {
                    ""
                } else {
                    "; the long generation ended before the follow-ups were routed"
                }
            ),
        ))
    }
}
