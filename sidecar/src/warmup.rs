//! Warm-up: before the pod reports Ready, drive the local vLLM through its normal API with the
//! prompt shapes users will send, so CUDA-graph captures and compile stalls happen now rather
//! than in the first users' requests.
//!
//! A plan is a JSON list of steps `{"prompt_tokens", "max_tokens", "concurrency"}`; each step
//! sends `concurrency` completions at once with token-id prompts (no tokenizer needed). Prompts
//! are distinct pseudo-random ids in a range every real vocabulary has, so the prefix cache does
//! not turn a long prefill into a cache hit. A failed request is logged and counted, never fatal:
//! an engine that cannot serve warm-up shows it in `/health`.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Deserialize;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::engine::VllmClient;

/// Token ids warm-up prompts are drawn from: low ids exist in every vocabulary we know.
const TOKEN_RANGE: std::ops::Range<u32> = 100..1100;
/// Longest wait for one warm-up request (a first compile can take minutes).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

/// One step of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WarmupStep {
    pub prompt_tokens: u32,
    #[serde(default = "one")]
    pub max_tokens: u32,
    #[serde(default = "one")]
    pub concurrency: u32,
}

fn one() -> u32 {
    1
}

/// A plan that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum WarmupError {
    #[error("reading warm-up plan {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("warm-up plan {path}: {why}")]
    Invalid { path: String, why: String },
}

/// What a warm-up did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WarmupReport {
    pub requests: u64,
    pub failed: u64,
    pub seconds: f64,
}

/// Reads a plan file.
pub fn load_plan(path: &Path) -> Result<Vec<WarmupStep>, WarmupError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| WarmupError::Read {
        path: p.clone(),
        source,
    })?;
    let plan: Vec<WarmupStep> = serde_json::from_str(&text).map_err(|e| WarmupError::Invalid {
        path: p.clone(),
        why: e.to_string(),
    })?;
    if plan
        .iter()
        .any(|s| s.prompt_tokens == 0 || s.concurrency == 0 || s.max_tokens == 0)
    {
        return Err(WarmupError::Invalid {
            path: p,
            why: "prompt_tokens, max_tokens and concurrency must be positive".into(),
        });
    }
    Ok(plan)
}

/// The built-in plan: short prompts at growing batch sizes (decode graphs), then prompts of
/// growing length up to just under `max_model_len` (prefill shapes, chunked prefill).
pub fn default_plan(max_model_len: u32) -> Vec<WarmupStep> {
    let mut plan = vec![
        WarmupStep {
            prompt_tokens: 16,
            max_tokens: 16,
            concurrency: 1,
        },
        WarmupStep {
            prompt_tokens: 64,
            max_tokens: 16,
            concurrency: 8,
        },
        WarmupStep {
            prompt_tokens: 128,
            max_tokens: 8,
            concurrency: 32,
        },
    ];
    let mut len = 512;
    while len < max_model_len {
        plan.push(WarmupStep {
            prompt_tokens: len,
            max_tokens: 4,
            concurrency: 2,
        });
        len *= 4;
    }
    plan.push(WarmupStep {
        prompt_tokens: max_model_len.saturating_sub(8).max(1),
        max_tokens: 4,
        concurrency: 1,
    });
    plan
}

/// Prompt `n` of a warm-up: deterministic, distinct per (step, n).
pub fn prompt(step: usize, n: u32, len: u32) -> Vec<u32> {
    let mut x = (step as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::from(n);
    let span = u64::from(TOKEN_RANGE.end - TOKEN_RANGE.start);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            TOKEN_RANGE.start + (x % span) as u32
        })
        .collect()
}

/// Runs `plan` against `model`; stops early (returning what was done) on `cancel`.
pub async fn run_plan(
    client: &VllmClient,
    model: &str,
    plan: &[WarmupStep],
    max_model_len: u32,
    cancel: &CancellationToken,
) -> WarmupReport {
    let start = Instant::now();
    let mut report = WarmupReport::default();
    for (i, step) in plan.iter().enumerate() {
        // vLLM rejects prompts of max_model_len tokens or more.
        let len = step
            .prompt_tokens
            .min(max_model_len.saturating_sub(1))
            .max(1);
        let mut set = JoinSet::new();
        for n in 0..step.concurrency {
            let client = client.clone();
            let model = model.to_owned();
            let tokens = prompt(i, n, len);
            let max_tokens = step.max_tokens;
            set.spawn(async move {
                client
                    .complete_tokens(&model, &tokens, max_tokens, REQUEST_TIMEOUT)
                    .await
            });
        }
        let step_start = Instant::now();
        loop {
            let next = tokio::select! {
                () = cancel.cancelled() => {
                    set.abort_all();
                    report.seconds = start.elapsed().as_secs_f64();
                    return report;
                }
                n = set.join_next() => n,
            };
            let Some(result) = next else { break };
            report.requests += 1;
            match result {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    report.failed += 1;
                    tracing::warn!(step = i, error = %e, "warm-up request failed");
                }
                Err(e) => {
                    report.failed += 1;
                    tracing::warn!(step = i, error = %e, "warm-up task failed");
                }
            }
        }
        tracing::info!(
            step = i,
            prompt_tokens = len,
            max_tokens = step.max_tokens,
            concurrency = step.concurrency,
            seconds = step_start.elapsed().as_secs_f64(),
            "warm-up step done"
        );
    }
    report.seconds = start.elapsed().as_secs_f64();
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_plan_covers_short_and_long() {
        let plan = default_plan(4096);
        assert!(plan.iter().any(|s| s.prompt_tokens <= 16));
        assert!(plan.iter().any(|s| s.prompt_tokens >= 4000));
        assert!(plan.iter().all(|s| s.prompt_tokens < 4096));
    }

    #[test]
    fn prompts_are_distinct_and_in_range() {
        let a = prompt(0, 0, 64);
        let b = prompt(0, 1, 64);
        assert_ne!(a, b);
        assert!(a.iter().all(|t| TOKEN_RANGE.contains(t)));
    }
}
