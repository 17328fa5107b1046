//! Reading the request: the body under the live limits, parsed and checked as vLLM would, and
//! its prompt tokenized, once for every attempt.

use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::header::{self, HeaderMap, HeaderValue};
use tokio::time::{Instant as TokioInstant, timeout};
use tracing::warn;

use super::{DEBUG, Kind, REQUEST_ID, Route, end_to_end};
use crate::body::{self, BodyKind, Hold, ParsedBody, PromptInput};
use crate::config::PoolConfig;
use crate::error::ApiError;
use crate::heavy::INLINE_BYTES;
use crate::state::{Live, State};
use crate::tokenize::{self, Prompt};

/// A body read and checked: its bytes (forwarded as they came), what the router read from them,
/// and its share of the body budget, held until the request has been sent on.
#[derive(Debug)]
pub struct ReadRequest {
    pub bytes: Bytes,
    pub parsed: ParsedBody,
    pub hold: Hold,
}

/// Reads a generation or `/tokenize` body under the live limits and parses what the router
/// needs from it: a declared `Content-Length` over `limits.bodyBytes` is refused before any
/// byte is read, the body is held within `limits.inflightBodyBytes` for the replica and must
/// arrive within `timeouts.bodyReadSeconds`, and nesting, chat messages, prompt bytes and JSON
/// values are bounded before anything is parsed into values or tokenized. A large body is
/// parsed in the heavy pool. Every refusal is counted by reason and logged.
pub async fn read_request(
    state: &State,
    live: &Live,
    headers: &HeaderMap,
    body: Body,
    kind: BodyKind,
) -> Result<ReadRequest, ApiError> {
    let result = read_checked(state, live, headers, body, kind).await;
    if let Err(e) = &result
        && let Some(reason) = e.refusal()
    {
        state.metrics.refused(reason);
        warn!(reason, error = %e, "request refused");
    }
    result
}

async fn read_checked(
    state: &State,
    live: &Live,
    headers: &HeaderMap,
    body: Body,
    kind: BodyKind,
) -> Result<ReadRequest, ApiError> {
    let limits = &live.config.limits;
    let limit = limits.body_bytes;
    // hyper has already refused a malformed or repeated Content-Length (400), so one value is
    // left; one that does not parse as a number cannot be over the limit.
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    let read_time = live.config.timeouts.body_read();
    let read = body::read_body(
        body,
        limit,
        declared,
        &state.bodies,
        limits.inflight_body_bytes,
    );
    let (bytes, mut hold) = timeout(read_time, read)
        .await
        .map_err(|_| ApiError::BodyTimeout(read_time))??;
    let parsed = if bytes.len() <= INLINE_BYTES {
        body::parse_request(&bytes, limits, kind)?
    } else {
        let (b, l) = (bytes.clone(), limits.clone());
        state
            .heavy
            .run(move || body::parse_request(&b, &l, kind))
            .await??
    };
    if !hold.grow(parsed.parsed_bytes(), limits.inflight_body_bytes) {
        return Err(ApiError::BodyBudget {
            limit: limits.inflight_body_bytes,
        });
    }
    Ok(ReadRequest {
        bytes,
        parsed,
        hold,
    })
}

/// Tokenizes `input` for `model`: on this worker for a small body, in the heavy pool for a
/// large one.
pub async fn tokenize_prompt(
    state: &Arc<State>,
    model: &str,
    input: PromptInput,
    body_len: usize,
) -> Result<Prompt, ApiError> {
    let bad = |e: tokenize::TokenizeError| ApiError::BadRequest(e.to_string());
    if body_len <= INLINE_BYTES {
        return tokenize::prompt_tokens(&state.tokenizers, model, input).map_err(bad);
    }
    let (st, model) = (state.clone(), model.to_owned());
    state
        .heavy
        .run(move || tokenize::prompt_tokens(&st.tokenizers, &model, input))
        .await?
        .map_err(bad)
}

/// The model whose tokenizer a request for `model` is tokenized with: vLLM tokenizes an
/// adapter's request with its base model's tokenizer (the adapters it loads carry none), so an
/// adapter name without a tokenizer of its own borrows its base's.
fn tokenizer_model(state: &State, model: &str) -> String {
    if state.tokenizers.get(model).is_some() {
        return model.to_owned();
    }
    state
        .registry()
        .pods()
        .find(|p| p.is_lora(model))
        .and_then(|p| p.hello.models.first().cloned())
        .unwrap_or_else(|| model.to_owned())
}

/// A request read, checked and tokenized: what every attempt sends and picks by.
pub(super) struct Prepared {
    pub(super) kind: Kind,
    pub(super) model: String,
    pub(super) body: Bytes,
    /// The body's share of the body budget, given back when the request has been sent on.
    pub(super) _hold: Hold,
    pub(super) prompt: Prompt,
    pub(super) cache_salt: Option<String>,
    /// The headers sent to the pod (end-to-end ones, the request id, no debug flag).
    pub(super) headers: HeaderMap,
    /// The client asked for the `x-kvsight-decision` header.
    pub(super) debug: bool,
    pub(super) deadline: TokioInstant,
    /// When tokenizing began: the router's added latency runs from here to the pod's request.
    pub(super) started: Instant,
}

/// Reads and checks the request and tokenizes its prompt, once for every attempt; also the
/// pool its model is served by, if one is configured.
pub(super) async fn prepare<'a>(
    state: &Arc<State>,
    live: &'a Live,
    kind: Kind,
    in_headers: &HeaderMap,
    body: Body,
    request_id: &str,
    route: &mut Route,
) -> Result<(Arc<Prepared>, Option<&'a PoolConfig>), ApiError> {
    let deadline = TokioInstant::now() + live.config.timeouts.request();
    if state.is_draining() {
        return Err(ApiError::ShuttingDown);
    }
    let body_kind = match kind {
        Kind::Completion => BodyKind::Completion,
        Kind::Chat => BodyKind::Chat,
    };
    let ReadRequest {
        bytes,
        parsed,
        hold,
    } = read_request(state, live, in_headers, body, body_kind).await?;
    // Read as vLLM will read it, and refused here as vLLM would refuse it (before a pod is
    // picked and charged with the request). The answer's content type, not this flag, decides
    // how a cut stream ends: the pod's answer is the truth.
    parsed.stream.map_err(|e| ApiError::BadParam {
        message: e.validation_message("stream"),
        param: "body.stream",
    })?;
    let model = parsed.model;
    let pool = live.config.pool_for(&model);
    if pool.is_none() && !state.registry().pods().any(|p| p.serves(&model)) {
        return Err(ApiError::UnknownModel(model));
    }
    route.set(pool, "");

    let started = Instant::now();
    let prompt = tokenize_prompt(
        state,
        &tokenizer_model(state, &model),
        parsed.input,
        bytes.len(),
    )
    .await?;
    state
        .metrics
        .tokenize_seconds
        .observe(started.elapsed().as_secs_f64());
    state.metrics.mode(&model, prompt_mode(&prompt));

    let mut headers = end_to_end(in_headers);
    for h in [header::HOST, header::CONTENT_LENGTH] {
        headers.remove(h);
    }
    headers.remove(DEBUG);
    if let Ok(v) = HeaderValue::from_str(request_id) {
        headers.insert(REQUEST_ID, v);
    }
    let req = Arc::new(Prepared {
        kind,
        cache_salt: parsed.cache_salt,
        model,
        body: bytes,
        _hold: hold,
        prompt,
        headers,
        debug: state.decision_header()
            && in_headers.get(DEBUG).is_some_and(|v| v.as_bytes() == b"1"),
        deadline,
        started,
    });
    Ok((req, pool))
}

pub(super) fn prompt_mode(prompt: &Prompt) -> &'static str {
    if prompt.exact { "exact" } else { "approximate" }
}
