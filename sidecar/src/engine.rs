//! The local vLLM server over HTTP: health, the model list, version, `/metrics` and completions
//! for warm-up, and reading the engine facts a `Hello` carries.
//!
//! HTTP client: reqwest without default features. vLLM is plain HTTP on localhost, so no TLS
//! stack is linked; reqwest gives pooling and timeouts on top of hyper without hand-written
//! connection code.

use std::time::Duration;

use kvsight_protocol::messages::EngineFacts;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::scrape::{self, EngineMetrics, ScrapeError};

/// Errors of the vLLM boundary.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("{what}: {source}")]
    Http {
        what: &'static str,
        source: reqwest::Error,
    },
    #[error("{what}: HTTP {status}")]
    Status { what: &'static str, status: u16 },
    #[error("{what}: unexpected body: {why}")]
    Body { what: &'static str, why: String },
    #[error("/metrics: {0}")]
    Metrics(#[from] ScrapeError),
    #[error("/metrics has no vllm:cache_config_info")]
    NoCacheConfig,
    #[error("/v1/models lists no base model")]
    NoModel,
}

/// A client for the local vLLM.
#[derive(Debug, Clone)]
pub struct VllmClient {
    http: reqwest::Client,
    base: String,
}

/// One card of `/v1/models`.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct ModelCard {
    pub id: String,
    #[serde(default)]
    pub root: Option<String>,
    #[serde(default)]
    pub parent: Option<String>,
    #[serde(default)]
    pub max_model_len: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct ModelList {
    data: Vec<ModelCard>,
}

#[derive(Debug, Deserialize)]
struct Version {
    version: String,
}

/// What the engine told us at start.
#[derive(Debug, Clone, PartialEq)]
pub struct Facts {
    pub engine: EngineFacts,
    /// Served names of the base model, primary first.
    pub models: Vec<String>,
    pub lora_adapters: Vec<String>,
    /// The base model's `root` (a local directory or a hub id).
    pub root: Option<String>,
}

impl VllmClient {
    /// A client for `base` (e.g. `http://127.0.0.1:8000`). Request timeouts are per call.
    pub fn new(base: &str) -> Self {
        VllmClient {
            http: reqwest::Client::new(),
            base: base.trim_end_matches('/').to_owned(),
        }
    }

    async fn get(&self, what: &'static str, timeout: Duration) -> Result<String, UpstreamError> {
        let resp = self
            .http
            .get(format!("{}{what}", self.base))
            .timeout(timeout)
            .send()
            .await
            .map_err(|source| UpstreamError::Http { what, source })?;
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(UpstreamError::Status { what, status });
        }
        resp.text()
            .await
            .map_err(|source| UpstreamError::Http { what, source })
    }

    /// `GET /health` answers 200.
    pub async fn health(&self) -> Result<(), UpstreamError> {
        self.get("/health", Duration::from_secs(2)).await.map(drop)
    }

    /// `GET /v1/models`.
    pub async fn models(&self) -> Result<Vec<ModelCard>, UpstreamError> {
        let what = "/v1/models";
        let body = self.get(what, Duration::from_secs(5)).await?;
        let list: ModelList = serde_json::from_str(&body).map_err(|e| UpstreamError::Body {
            what,
            why: e.to_string(),
        })?;
        Ok(list.data)
    }

    /// `GET /version`.
    pub async fn version(&self) -> Result<String, UpstreamError> {
        let what = "/version";
        let body = self.get(what, Duration::from_secs(5)).await?;
        let v: Version = serde_json::from_str(&body).map_err(|e| UpstreamError::Body {
            what,
            why: e.to_string(),
        })?;
        Ok(v.version)
    }

    /// `GET /metrics`, parsed.
    pub async fn metrics(&self, timeout: Duration) -> Result<EngineMetrics, UpstreamError> {
        let body = self.get("/metrics", timeout).await?;
        Ok(scrape::parse(&body)?)
    }

    /// `POST /v1/completions` with a token-id prompt; waits for the whole answer.
    pub async fn complete_tokens(
        &self,
        model: &str,
        prompt: &[u32],
        max_tokens: u32,
        timeout: Duration,
    ) -> Result<(), UpstreamError> {
        let what = "/v1/completions";
        let body = serde_json::json!({
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            // Warm-up must run every decode step it asks for.
            "ignore_eos": true,
        });
        let resp = self
            .http
            .post(format!("{}{what}", self.base))
            .timeout(timeout)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|source| UpstreamError::Http { what, source })?;
        let status = resp.status().as_u16();
        // Drain the body so the connection is reused.
        let _ = resp.bytes().await;
        if status != 200 {
            return Err(UpstreamError::Status { what, status });
        }
        Ok(())
    }

    /// Polls `/health` until it answers 200 (true) or `cancel` fires (false).
    pub async fn wait_healthy(&self, poll: Duration, cancel: &CancellationToken) -> bool {
        let mut logged = false;
        loop {
            match self.health().await {
                Ok(()) => return true,
                Err(e) if !logged => {
                    tracing::info!(error = %e, "waiting for vLLM /health");
                    logged = true;
                }
                Err(_) => {}
            }
            tokio::select! {
                () = cancel.cancelled() => return false,
                () = tokio::time::sleep(poll) => {}
            }
        }
    }

    /// Reads the engine's facts: models (served names, LoRA cards, max_model_len), the cache
    /// config from `/metrics` and the version.
    pub async fn facts(
        &self,
        max_num_seqs: u32,
        max_num_batched_tokens: Option<u32>,
    ) -> Result<Facts, UpstreamError> {
        let cards = self.models().await?;
        let (base, lora): (Vec<_>, Vec<_>) = cards
            .into_iter()
            .partition(|c| c.parent.is_none() || c.parent.as_deref() == Some(c.id.as_str()));
        let first = base.first().ok_or(UpstreamError::NoModel)?;
        let max_model_len =
            base.iter()
                .find_map(|c| c.max_model_len)
                .ok_or(UpstreamError::Body {
                    what: "/v1/models",
                    why: "no max_model_len".into(),
                })?;
        let root = first.root.clone();
        let metrics = self.metrics(Duration::from_secs(5)).await?;
        let cache = metrics.cache_config.ok_or(UpstreamError::NoCacheConfig)?;
        // /version is missing on some builds behind proxies; the facts stay useful without it.
        let engine_version = self.version().await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "vLLM /version unavailable");
            "unknown".to_owned()
        });
        Ok(Facts {
            engine: EngineFacts {
                block_size: cache.block_size,
                num_gpu_blocks: cache.num_gpu_blocks,
                prefix_caching: cache.enable_prefix_caching,
                max_num_seqs,
                max_model_len,
                max_num_batched_tokens,
                engine_version,
            },
            models: base.iter().map(|c| c.id.clone()).collect(),
            lora_adapters: lora.into_iter().map(|c| c.id).collect(),
            root,
        })
    }
}
