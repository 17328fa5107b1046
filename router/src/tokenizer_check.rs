//! Does the router tokenize as the engine does, and in which dialect? Every tokenizer the
//! router holds (from the config or from a sidecar) is compared once with a Ready pod's own
//! `POST /tokenize`, on chat and completion probes, before it is trusted for good.
//!
//! Why: the router's hashes match a pod's blocks only if its token ids are the engine's, id for
//! id. The same `tokenizer.json` does not guarantee that. vLLM >= 0.32 tokenizes with
//! transformers 5, which rebuilds sentencepiece-style Llama-family tokenizers (different ids
//! for text at the start of a prompt and after every special token) and ignores the config's
//! BOS/EOS flags — depending on the model's `config.json`, which the router does not see. So
//! each tokenizer is compared in every dialect that gives ids of its own for its files
//! ([`PromptTokenizer::dialects`]; transformers 4 first, what the router uses until the check),
//! and the first the engine agrees with is kept ([`Verdict::Agrees`] names it). A chat template
//! or special-token setting can also differ between the files a router was given and the ones
//! the engine loaded. A skewed tokenizer does not fail loudly: every prefix simply stops
//! matching, and routing quietly degrades to load balancing. With a verdict of
//! [`Verdict::Differs`] (no dialect agrees) the model is routed in approximate mode instead (its
//! own prefix memory, which works without the engine's ids), `/tokenize` is forwarded to a pod,
//! and the difference is logged and counted
//! (`kvsight_router_tokenizer_checks_total{outcome="differs"}`).
//!
//! One dialect serves all pods of a model: once an engine version agreed with one, a pod of
//! another version that agrees only with another dialect (a fleet half upgraded to transformers
//! 5) makes the model approximate.
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
/// a leading space (transformers 5's rebuilt Llama tokenizers read ` Hello` as `▁Hello`,
/// transformers 4 as `▁ ▁Hello`), repeated spaces, tabs and newlines, digits, punctuation
/// runs, code, accents, CJK, emoji, and text that looks like special tokens.
const PROBE_TEXT: &str = " Hello  world!\tTabs,\n\nnewlines and   spaces — 1234567 + 89.5e-3 = ?\n\
    def f(x):\n    return x**2  # café, naïve, Ångström\n東京の天気は? 🚀🔥 </s> <|im_end|> [INST] \
    don't won't they'll 'quoted' \"double\" ...!!! ¿Qué? Привет мир";

/// A completion probe that starts with a letter: where a dialect prepends no "▁" at all
/// (`add_prefix_space: false`), and the plain case all others must agree on.
const PROBE_TEXT_UNSPACED: &str = "Hello,\tworld\n  Be brief.";

/// A chat probe: a system prompt (when `system`), two turns and a pending user turn. Every
/// message body comes right after the template's role tokens: where transformers 5's rebuilt
/// Llama tokenizers put no "▁".
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
/// than a Ready pod serving its model now runs — with such a pod, in each of its dialects, and
/// records the verdicts (and the dialect chosen). A model without such a pod waits (tried again
/// next time); one whose pod does not answer is tried again after a wait that doubles per
/// failure in a row, up to [`MAX_RETRY_WAIT`]. Returns how many verdicts were recorded.
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
        let answers = match engine_answers(&state.client, &url, &model).await {
            Ok(answers) => answers,
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
        let (verdict, chosen) = choose(tok, &answers, &agreed_versions).await;
        match &verdict {
            Verdict::Agrees(dialect) => {
                state.metrics.tokenizer_check(&model, "agrees");
                info!(%model, %url, engine_version = %version, %dialect,
                      "tokenizer agrees with the engine");
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
            .set_verdict(&model, &digest, &version, verdict, chosen);
        decided += 1;
    }
    decided
}

/// The verdict on `tok` given the engine's answers: the first of its dialects that gives every
/// answer's ids (the one in use first), and the tokenizer in that dialect when it is another.
/// Engines that already agreed (`agreed_versions`) tie the model to the dialect in use.
async fn choose(
    tok: Arc<dyn PromptTokenizer>,
    answers: &[Answer],
    agreed_versions: &[String],
) -> (Verdict, Option<Arc<dyn PromptTokenizer>>) {
    let current = tok.dialect();
    let Some(why) = disagreement(tok.as_ref(), answers) else {
        return (Verdict::Agrees(current), None);
    };
    let mut differences = vec![why];
    for dialect in tok.dialects().into_iter().filter(|d| *d != current) {
        // Reading tokenizer.json again takes milliseconds of CPU: not on the runtime's threads.
        let base = Arc::clone(&tok);
        let built = tokio::task::spawn_blocking(move || base.in_dialect(dialect))
            .await
            .map_err(|e| e.to_string())
            .and_then(|built| built.map_err(|e| e.to_string()));
        let candidate = match built {
            Ok(candidate) => candidate,
            Err(e) => {
                differences.push(format!("{dialect}: cannot build it: {e}"));
                continue;
            }
        };
        match disagreement(candidate.as_ref(), answers) {
            None if agreed_versions.is_empty() => {
                return (Verdict::Agrees(dialect), Some(candidate));
            }
            None => {
                return (
                    Verdict::Differs(format!(
                        "{}; this engine agrees with {dialect}, engine versions {} with {current}: \
                         one dialect cannot serve both",
                        differences[0],
                        agreed_versions.join(", ")
                    )),
                    None,
                );
            }
            Some(why) => differences.push(format!("{dialect}: {why}")),
        }
    }
    (Verdict::Differs(differences.join("; ")), None)
}

/// Where `tok` parts from the engine's answers, if anywhere.
fn disagreement(tok: &dyn PromptTokenizer, answers: &[Answer]) -> Option<String> {
    answers.iter().find_map(|answer| {
        let ours = match answer.kind {
            ProbeKind::Chat => tok.encode_chat(&answer.body),
            ProbeKind::Completion(text) => tok.encode_completion(text),
        };
        judge(ours, &answer.engine).map(|why| format!("{}: {why}", answer.kind.label()))
    })
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

/// What a probe asked the engine.
#[derive(Clone, Copy)]
enum ProbeKind {
    /// The body's `messages`, rendered and encoded without special tokens.
    Chat,
    /// This prompt, encoded with special tokens.
    Completion(&'static str),
}

impl ProbeKind {
    fn label(self) -> &'static str {
        match self {
            ProbeKind::Chat => "chat",
            ProbeKind::Completion(_) => "completion",
        }
    }
}

/// One probe and the engine's ids for it.
struct Answer {
    kind: ProbeKind,
    body: Value,
    engine: Vec<u32>,
}

/// The pod's ids for every probe: a chat (with a system message, or without one when the
/// engine's template refuses system roles; skipped when the engine refuses chat altogether)
/// and two completions (one starting with a space, one with a letter). Asked once, compared
/// with every dialect.
async fn engine_answers(
    client: &reqwest::Client,
    url: &str,
    model: &str,
) -> Result<Vec<Answer>, String> {
    let mut answers = Vec::new();
    let mut refusals = Vec::new();
    for body in [probe_chat(model, true), probe_chat(model, false)] {
        match engine_ids(client, url, &body).await {
            Ok(engine) => {
                answers.push(Answer {
                    kind: ProbeKind::Chat,
                    body,
                    engine,
                });
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
    for text in [PROBE_TEXT, PROBE_TEXT_UNSPACED] {
        let body = json!({"model": model, "prompt": text});
        let engine = match engine_ids(client, url, &body).await {
            Ok(ids) => ids,
            Err(ProbeError::Refused(e) | ProbeError::NoAnswer(e)) => return Err(e),
        };
        answers.push(Answer {
            kind: ProbeKind::Completion(text),
            body,
            engine,
        });
    }
    Ok(answers)
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
