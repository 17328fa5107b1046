//! Does the router tokenize as the engine does? Every tokenizer the router holds (from the config
//! or from a sidecar) is compared once with a Ready pod's own `POST /tokenize`, on a chat and a
//! completion probe, before it is trusted for good.
//!
//! Why: the router's hashes match a pod's blocks only if its token ids are the engine's, id for
//! id. The same `tokenizer.json` does not guarantee that: an engine running transformers 5
//! tokenizes sentencepiece-style Llama-family models differently from the 4.x semantics the
//! router follows (and vLLM pins), and a chat template or special-token setting can differ between the files a router was given and
//! the ones the engine loaded. A skewed tokenizer does not fail loudly: every prefix simply stops
//! matching, and routing quietly degrades to load balancing. With a verdict of
//! [`Verdict::Differs`] the model is routed in approximate mode instead (its own prefix memory,
//! which works without the engine's ids), `/tokenize` is forwarded to a pod, and the difference
//! is logged and counted (`kvsight_router_tokenizer_checks_total{outcome="differs"}`).
//!
//! Until its verdict, a tokenizer is used: the check needs a Ready pod, and a wrong tokenizer
//! costs cache affinity for a few seconds, never a wrong answer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use kvsight_protocol::Phase;

use crate::state::State;
use crate::tokenize::{Due, PromptTokenizer, TokenizeError, Verdict};

/// How often unchecked tokenizers are looked for: a new one waits at most this long once a pod
/// serving its model is Ready. Cheap when there is nothing to check (one read lock).
pub const CHECK_INTERVAL: Duration = Duration::from_millis(500);

/// Time allowed for one pod's `/tokenize` answer.
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest wait between checks of a tokenizer whose pods do not answer (the wait starts at
/// [`CHECK_INTERVAL`] and doubles per failure in a row).
pub const MAX_RETRY_WAIT: Duration = Duration::from_secs(30);

/// A completion probe: text where tokenizer versions and settings are known to part ways —
/// leading and repeated spaces, tabs and newlines, digits, punctuation runs, code, accents,
/// CJK, emoji, and text that looks like special tokens.
const PROBE_TEXT: &str = " Hello  world!\tTabs,\n\nnewlines and   spaces — 1234567 + 89.5e-3 = ?\n\
    def f(x):\n    return x**2  # café, naïve, Ångström\n東京の天気は? 🚀🔥 </s> <|im_end|> [INST] \
    don't won't they'll 'quoted' \"double\" ...!!! ¿Qué? Привет мир";

/// A chat probe: a system prompt (when `system`), two turns and a pending user turn.
fn probe_chat(model: &str, system: bool) -> Value {
    let mut messages = vec![
        json!({"role": "user", "content": "What's 2+2? Reply with\n\n a digit."}),
        json!({"role": "assistant", "content": " 4"}),
        json!({"role": "user", "content": PROBE_TEXT}),
    ];
    if system {
        messages.insert(
            0,
            json!({"role": "system", "content": "You are a terse assistant.  Answer in one line."}),
        );
    }
    json!({"model": model, "messages": messages, "add_generation_prompt": true})
}

/// Runs [`check_pending`] every [`CHECK_INTERVAL`] until `stop` is cancelled.
pub async fn run(state: Arc<State>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(CHECK_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A check in progress is dropped at shutdown rather than awaited (a pod may take up to
    // CHECK_TIMEOUT to answer).
    while stop
        .run_until_cancelled(async {
            tick.tick().await;
            check_pending(&state).await
        })
        .await
        .is_some()
    {}
}

/// Compares every tokenizer not yet checked — or checked only against other engine versions
/// than a Ready pod serving its model now runs — with such a pod, and records the verdicts. A
/// model without such a pod waits (tried again next time); one whose pod does not answer is
/// tried again after a wait that doubles per failure in a row, up to [`MAX_RETRY_WAIT`].
/// Returns how many verdicts were recorded.
pub async fn check_pending(state: &State) -> usize {
    let mut decided = 0;
    for due in state.tokenizers.due(Instant::now()) {
        let Due {
            model,
            digest,
            tok,
            agreed_versions,
        } = due;
        let Some((url, version)) = pod_to_ask(state, &model, &agreed_versions) else {
            continue;
        };
        let verdict = match compare(&state.client, &url, &model, tok.as_ref()).await {
            Ok(v) => v,
            Err(e) => {
                let failures = state.tokenizers.check_failed(
                    &model,
                    &digest,
                    Instant::now(),
                    CHECK_INTERVAL,
                    MAX_RETRY_WAIT,
                );
                state.metrics.tokenizer_check(&model, "error");
                // Said once per set of files; the retries that follow are counted, not logged.
                if failures == 1 {
                    warn!(%model, %url, error = %e, "tokenizer check: no answer, will retry");
                } else {
                    debug!(%model, %url, error = %e, failures, "tokenizer check: no answer");
                }
                continue;
            }
        };
        match &verdict {
            Verdict::Agrees => {
                state.metrics.tokenizer_check(&model, "agrees");
                info!(%model, %url, engine_version = %version, "tokenizer agrees with the engine");
            }
            Verdict::Differs(why) => {
                state.metrics.tokenizer_check(&model, "differs");
                warn!(%model, %url, engine_version = %version, difference = %why,
                      "tokenizer differs from the engine's: routing this model in approximate mode");
            }
            Verdict::Unchecked => continue,
        }
        state
            .tokenizers
            .set_verdict(&model, &digest, &version, verdict);
        decided += 1;
    }
    decided
}

/// The least busy Ready, fresh pod serving `model` whose engine version is not among `agreed`:
/// its URL and version.
fn pod_to_ask(state: &State, model: &str, agreed: &[String]) -> Option<(String, String)> {
    let now = Instant::now();
    let reg = state.registry();
    reg.pods()
        .filter(|p| p.serves(model) && p.phase() == Phase::Ready && !p.is_stale(now))
        .filter(|p| !agreed.contains(&p.hello.engine.engine_version))
        .min_by_key(|p| p.inflight)
        .map(|p| {
            (
                p.hello.pod.url.clone(),
                p.hello.engine.engine_version.clone(),
            )
        })
}

/// Why a pod gave no ids for a probe.
enum ProbeError {
    /// A 4xx: the engine rejects this request (a template without a system role, a model
    /// without a chat template); another probe may still be compared.
    Refused(String),
    /// No answer, a 5xx or an unreadable one: try the whole check again later.
    NoAnswer(String),
}

/// The pod's ids against the tokenizer's: a chat (with a system message, or without one when
/// the engine's template refuses system roles; skipped when the engine refuses chat
/// altogether) and a completion.
async fn compare(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    tok: &dyn PromptTokenizer,
) -> Result<Verdict, String> {
    let mut refusals = Vec::new();
    for body in [probe_chat(model, true), probe_chat(model, false)] {
        match engine_ids(client, url, &body).await {
            Ok(engine) => {
                if let Some(why) = judge(tok.encode_chat(&body), &engine) {
                    return Ok(Verdict::Differs(format!("chat: {why}")));
                }
                refusals.clear();
                break;
            }
            Err(ProbeError::Refused(why)) => refusals.push(why),
            Err(ProbeError::NoAnswer(e)) => return Err(e),
        }
    }
    if !refusals.is_empty() {
        warn!(%model, %url, refusals = ?refusals,
              "tokenizer check: the engine refused the chat probes; comparing completions only");
    }
    let completion = json!({"model": model, "prompt": PROBE_TEXT});
    let engine = match engine_ids(client, url, &completion).await {
        Ok(ids) => ids,
        Err(ProbeError::Refused(e) | ProbeError::NoAnswer(e)) => return Err(e),
    };
    if let Some(why) = judge(tok.encode_completion(PROBE_TEXT), &engine) {
        return Ok(Verdict::Differs(format!("completion: {why}")));
    }
    Ok(Verdict::Agrees)
}

/// The difference between the router's encoding and the engine's ids, if any.
fn judge(ours: Result<Vec<u32>, TokenizeError>, engine: &[u32]) -> Option<String> {
    match ours {
        Ok(ours) => difference(&ours, engine),
        Err(e) => Some(format!("the router cannot encode what the engine did: {e}")),
    }
}

/// vLLM's `/tokenize` answer's `tokens`.
async fn engine_ids(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
) -> Result<Vec<u32>, ProbeError> {
    let no_answer = |e: String| ProbeError::NoAnswer(e);
    let resp = client
        .post(format!("{}/tokenize", url.trim_end_matches('/')))
        .timeout(CHECK_TIMEOUT)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body.to_string())
        .send()
        .await
        .map_err(|e| no_answer(e.to_string()))?;
    let status = resp.status();
    let text = resp.text().await.map_err(|e| no_answer(e.to_string()))?;
    if !status.is_success() {
        let why = format!(
            "HTTP {status}: {}",
            text.chars().take(200).collect::<String>()
        );
        return Err(if status.is_client_error() {
            ProbeError::Refused(why)
        } else {
            ProbeError::NoAnswer(why)
        });
    }
    let v: Value = serde_json::from_str(&text).map_err(|e| no_answer(format!("not JSON: {e}")))?;
    serde_json::from_value(v["tokens"].clone())
        .map_err(|e| no_answer(format!("no `tokens` list: {e}")))
}

/// Where two id lists part, in words; `None` when equal.
fn difference(ours: &[u32], engine: &[u32]) -> Option<String> {
    let at = ours.iter().zip(engine).take_while(|(a, b)| a == b).count();
    if at == ours.len() && at == engine.len() {
        return None;
    }
    Some(format!(
        "ids part at token {at} (router {:?}, engine {:?}; {} vs {} tokens)",
        ours.get(at),
        engine.get(at),
        ours.len(),
        engine.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn difference_names_the_first_token_that_parts() {
        assert_eq!(difference(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(
            difference(&[1, 2, 3], &[1, 9, 3]).unwrap(),
            "ids part at token 1 (router Some(2), engine Some(9); 3 vs 3 tokens)"
        );
        assert_eq!(
            difference(&[1, 2], &[1, 2, 3]).unwrap(),
            "ids part at token 2 (router None, engine Some(3); 2 vs 3 tokens)"
        );
    }
}
