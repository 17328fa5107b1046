//! One OpenAI request end to end: read the body under the limit, parse `model` and the prompt,
//! choose the pool, tokenize, pick, forward, and stream the answer back — all under one deadline
//! (`timeouts.requestSeconds`). Before the pod's response began a failure is a 504/502 error
//! body; after, the stream ends with `data: {"error":…}` + `data: [DONE]` so a client can tell a
//! cut answer from a whole one. Retries happen only where no generation can have started: a
//! refused connection (one other pod) and vLLM's context-length 400 from a pool with a fallback
//! (resent once to the fallback pool, before any byte reached the client).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::StatusCode;
use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::{Instant as TokioInstant, sleep_until, timeout, timeout_at};
use tokio_stream::wrappers::ReceiverStream;
use tracing::{Instrument, field, info_span, warn};

use crate::body::{self, BodyKind, Hold, ParsedBody, PromptInput};
use crate::config::PoolConfig;
use crate::error::{ApiError, error_body};
use crate::flow;
use crate::heavy::INLINE_BYTES;
use crate::scheduler::{Decision, Gate, PickError, PickRequest, PromptHashes, Scheduler};
use crate::sight::UsageTap;
use crate::state::{Live, State};
use crate::tokenize::{self, Prompt};

pub const REQUEST_ID: &str = "x-request-id";
pub const DEBUG: &str = "x-kvsight-debug";
pub const DECISION: &str = "x-kvsight-decision";

/// The two generation endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

impl Kind {
    pub fn path(self) -> &'static str {
        match self {
            Kind::Completion => "/v1/completions",
            Kind::Chat => "/v1/chat/completions",
        }
    }
}

/// Headers that describe one hop, never forwarded (RFC 9110 §7.6.1), plus the ones the client
/// library recomputes.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Copies end-to-end headers: drops hop-by-hop ones and any the `Connection` header names.
pub fn end_to_end(src: &HeaderMap) -> HeaderMap {
    let named: Vec<String> = src
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .collect();
    let mut out = HeaderMap::with_capacity(src.len());
    for (name, value) in src {
        let n = name.as_str();
        if HOP_BY_HOP.contains(&n) || named.iter().any(|x| x == n) {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

pub use crate::body::json_deeper_than;

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

/// Why a body read whole from a pod was not read.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamBodyError {
    #[error("the answer exceeds {0} bytes")]
    TooLarge(usize),
    #[error("the answer did not arrive within {0:?}")]
    Timeout(Duration),
    #[error("the answer broke off: {0}")]
    Broken(String),
}

/// Reads a pod's answer whole: at most `cap` bytes, within `within`.
pub async fn read_upstream_body(
    mut resp: reqwest::Response,
    cap: usize,
    within: Duration,
) -> Result<Bytes, UpstreamBodyError> {
    if resp.content_length().is_some_and(|n| n > cap as u64) {
        return Err(UpstreamBodyError::TooLarge(cap));
    }
    let read = async {
        let mut buf = Vec::new();
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| UpstreamBodyError::Broken(error_chain(&e.without_url())))?
        {
            if buf.len() + chunk.len() > cap {
                return Err(UpstreamBodyError::TooLarge(cap));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    };
    timeout(within, read)
        .await
        .map_err(|_| UpstreamBodyError::Timeout(within))?
}

/// Largest error body read from a pod (to tell vLLM's context-length 400 from another).
pub const MAX_ERROR_BODY_BYTES: usize = 1 << 20;

/// Calls `record_done` for the pod when the request ends, whatever the outcome (also when the
/// client goes away mid-stream and the pump is dropped).
struct Done {
    state: Arc<State>,
    pod: String,
    sent_at: Instant,
}

impl Drop for Done {
    fn drop(&mut self) {
        self.state
            .registry()
            .record_done(&self.pod, self.sent_at, Instant::now());
    }
}

/// Entry point of both generation endpoints.
pub async fn handle(state: Arc<State>, kind: Kind, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let request_id = parts
        .headers
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 200)
        .map(str::to_owned)
        .unwrap_or_else(|| state.new_request_id());
    let span =
        info_span!("request", request_id = %request_id, pool = field::Empty, pod = field::Empty);
    let rid = HeaderValue::from_str(&request_id).ok();
    let mut resp = async {
        let mut route = Route::default();
        let resp = forward(&state, kind, &parts.headers, body, &request_id, &mut route)
            .await
            .unwrap_or_else(IntoResponse::into_response);
        // The one place a request is counted, however it ended: by the pool and pod it reached
        // and the status the client gets.
        state
            .metrics
            .request(&route.pool, &route.pod, resp.status().as_u16());
        resp
    }
    .instrument(span)
    .await;
    if let Some(rid) = rid {
        resp.headers_mut().insert(REQUEST_ID, rid);
    }
    resp
}

/// How far a request got: the pool and pod its metrics and span are labelled with (empty while
/// not chosen, e.g. for a body refused before any pool was looked at).
#[derive(Debug, Default)]
struct Route {
    pool: String,
    pod: String,
}

impl Route {
    fn set(&mut self, pool: Option<&PoolConfig>, pod: &str) {
        self.pool = pool.map_or_else(String::new, |p| p.name.clone());
        self.pod = pod.to_owned();
        let span = tracing::Span::current();
        span.record("pool", self.pool.as_str());
        if !pod.is_empty() {
            span.record("pod", pod);
        }
    }
}

/// A request read, checked and tokenized: what every attempt sends and picks by.
struct Prepared {
    kind: Kind,
    model: String,
    body: Bytes,
    /// The body's share of the body budget, given back when the request has been sent on.
    _hold: Hold,
    prompt: Prompt,
    cache_salt: Option<String>,
    /// The headers sent to the pod (end-to-end ones, the request id, no debug flag).
    headers: HeaderMap,
    /// The client asked for the `x-kvsight-decision` header.
    debug: bool,
    deadline: TokioInstant,
    /// When tokenizing began: the router's added latency runs from here to the pod's request.
    started: Instant,
}

/// Why a request is tried again. Only where no generation can have started, and each reason
/// at most once per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RetryReason {
    /// The pod refused the connection: one other pod may take the request.
    ConnectRefused,
    /// vLLM's context-length 400 from a pool with a fallback: resent once to the fallback pool.
    ContextFallback,
}

impl RetryReason {
    /// The `reason` label of `kvsight_router_retries_total`.
    fn label(self) -> &'static str {
        match self {
            RetryReason::ConnectRefused => "connect_refused",
            RetryReason::ContextFallback => "context_fallback",
        }
    }
}

/// Where the next attempt goes, and why.
#[derive(Debug)]
enum Retry<'a> {
    /// In the pool the refused attempt picked in, avoiding `pod`.
    ConnectRefused {
        pool: Option<&'a PoolConfig>,
        pod: String,
    },
    /// In the fallback pool, any pod.
    ContextFallback { pool: &'a PoolConfig },
}

impl Retry<'_> {
    fn reason(&self) -> RetryReason {
        match self {
            Retry::ConnectRefused { .. } => RetryReason::ConnectRefused,
            Retry::ContextFallback { .. } => RetryReason::ContextFallback,
        }
    }
}

/// One try at a pod: the pool to pick in, the pods to avoid, the retries already taken.
#[derive(Debug)]
struct Attempt<'a> {
    pool: Option<&'a PoolConfig>,
    exclude: Vec<String>,
    spent: Vec<RetryReason>,
}

impl<'a> Attempt<'a> {
    fn first(pool: Option<&'a PoolConfig>) -> Self {
        Attempt {
            pool,
            exclude: Vec::new(),
            spent: Vec::new(),
        }
    }

    fn may_retry(&self, reason: RetryReason) -> bool {
        !self.spent.contains(&reason)
    }

    fn next(mut self, retry: Retry<'a>) -> Self {
        self.spent.push(retry.reason());
        match retry {
            Retry::ConnectRefused { pool, pod } => {
                self.pool = pool;
                self.exclude.push(pod);
            }
            Retry::ContextFallback { pool } => {
                self.pool = Some(pool);
                self.exclude.clear();
            }
        }
        self
    }
}

/// What an attempt ended in.
enum Step<'a> {
    /// The answer for the client (a stream from the pod, or the pod's whole error).
    Answer(Response),
    Retry(Retry<'a>),
}

/// Reads and checks the request, tokenizes it, then runs attempts until one gives an answer.
async fn forward(
    state: &Arc<State>,
    kind: Kind,
    in_headers: &HeaderMap,
    body: Body,
    request_id: &str,
    route: &mut Route,
) -> Result<Response, ApiError> {
    let live = state.live();
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
    } = read_request(state, &live, in_headers, body, body_kind).await?;
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

    let mut attempt = Attempt::first(pool);
    loop {
        match try_once(state, &live, &req, &attempt, route).await? {
            Step::Answer(resp) => return Ok(resp),
            Step::Retry(retry) => {
                state.metrics.retry(retry.reason().label());
                attempt = attempt.next(retry);
            }
        }
    }
}

fn prompt_mode(prompt: &Prompt) -> &'static str {
    if prompt.exact { "exact" } else { "approximate" }
}

/// Picks a pod for `attempt` and sends the request there: the answer, or the retry it calls for.
async fn try_once<'a>(
    state: &Arc<State>,
    live: &'a Live,
    req: &Arc<Prepared>,
    attempt: &Attempt<'a>,
    route: &mut Route,
) -> Result<Step<'a>, ApiError> {
    route.set(attempt.pool, "");
    let Placed { decision, pool } = admit(state, live, req, attempt).await?;
    route.set(pool, &decision.pod);
    let done = Done {
        state: state.clone(),
        pod: decision.pod.clone(),
        // The pick's moment, microseconds ago (the registry compares it with report samples).
        sent_at: Instant::now(),
    };
    let added = req.started.elapsed();
    let url = format!("{}{}", decision.url.trim_end_matches('/'), req.kind.path());
    let send = state
        .client
        .post(url)
        .headers(req.headers.clone())
        .body(req.body.clone())
        .send();
    let past_deadline = || ApiError::Deadline(live.config.timeouts.request());
    // The pod's URL stays out of the client's answer: it names the cluster's inside.
    let upstream_failed = |e: reqwest::Error| ApiError::Upstream {
        pod: decision.pod.clone(),
        message: error_chain(&e.without_url()),
    };
    let upstream = match timeout_at(req.deadline, send).await {
        Err(_) => return Err(past_deadline()),
        Ok(Err(e)) if e.is_connect() && attempt.may_retry(RetryReason::ConnectRefused) => {
            warn!(pod = %decision.pod, error = %e, "connection refused, retrying on another pod");
            return Ok(Step::Retry(Retry::ConnectRefused {
                pool,
                pod: decision.pod,
            }));
        }
        Ok(Err(e)) => return Err(upstream_failed(e)),
        Ok(Ok(r)) => r,
    };
    let fallback = pool
        .and_then(|p| p.fallback.as_deref())
        .and_then(|n| live.config.pool(n));
    if upstream.status() == StatusCode::BAD_REQUEST
        && attempt.may_retry(RetryReason::ContextFallback)
        && let Some(fallback) = fallback
    {
        // A 400 is small and final: read it to see whether it is the context-length error.
        let status = upstream.status();
        let up_headers = end_to_end(upstream.headers());
        let within = live
            .config
            .timeouts
            .body_read()
            .min(req.deadline.saturating_duration_since(TokioInstant::now()));
        let body = read_upstream_body(upstream, MAX_ERROR_BODY_BYTES, within)
            .await
            .map_err(|e| ApiError::Upstream {
                pod: decision.pod.clone(),
                message: e.to_string(),
            })?;
        if is_context_length_error(&body) {
            return Ok(Step::Retry(Retry::ContextFallback { pool: fallback }));
        }
        let mut resp = Response::new(Body::from(body));
        *resp.status_mut() = status;
        *resp.headers_mut() = up_headers;
        return Ok(Step::Answer(resp));
    }
    state
        .metrics
        .added_latency_seconds
        .observe(added.as_secs_f64());
    let header = req
        .debug
        .then(|| decision_header(&decision, prompt_mode(&req.prompt)));
    Ok(Step::Answer(stream_back(
        state,
        upstream,
        done,
        req.deadline,
        header,
        decision.predicted_cached_tokens,
    )))
}

/// A pick and the pool it was made in (the request's, or its fallback when the prompt was too
/// long for every pod of the request's pool).
struct Placed<'a> {
    decision: Decision,
    pool: Option<&'a PoolConfig>,
}

/// Picks for the attempt. The first attempt of a request passes flow control when it is on
/// ([`flow`]): it may wait in this replica's queue, or be answered 429 at once; a retry was
/// admitted with its first attempt.
async fn admit<'a>(
    state: &Arc<State>,
    live: &'a Live,
    req: &Arc<Prepared>,
    attempt: &Attempt<'a>,
) -> Result<Placed<'a>, ApiError> {
    if !live.config.flow_control.enabled || !attempt.spent.is_empty() {
        return pick(state, live, req, attempt, None);
    }
    let (prepared, pool) = (req.clone(), attempt.pool.map(|p| p.name.clone()));
    // Run when the request leaves the queue, in the config of that moment.
    let try_pick: flow::TryPick = Box::new(move |state, live, gate| {
        let pool = pool.as_deref().and_then(|n| live.config.pool(n));
        let placed = pick(state, live, &prepared, &Attempt::first(pool), Some(gate))?;
        Ok(flow::Admitted {
            decision: placed.decision,
            pool: placed.pool.map(|p| p.name.clone()),
            picked_at: Instant::now(),
        })
    });
    let ticket = flow::Ticket {
        model: &req.model,
        headers: &req.headers,
        prompt_tokens: u32::try_from(req.prompt.tokens.len()).unwrap_or(u32::MAX),
        body: &req.body,
        deadline: req.deadline,
    };
    let a = flow::admit(state, live, ticket, try_pick).await?;
    let pool = a.pool.as_deref().and_then(|n| live.config.pool(n));
    Ok(Placed {
        decision: a.decision,
        pool,
    })
}

/// Picks in the attempt's pool; a prompt too long for it goes to the pool's fallback, or —
/// without one — to a pod anyway, so the client gets vLLM's own 400 text. With a wait budget
/// (flow control's gate), [`ApiError::OverBudget`] when no pod can take the request within it.
fn pick<'a>(
    state: &State,
    live: &'a Live,
    prepared: &Prepared,
    attempt: &Attempt<'a>,
    gate: Option<Gate>,
) -> Result<Placed<'a>, ApiError> {
    let mut pool = attempt.pool;
    let mut hopped = false;
    loop {
        let req = PickRequest {
            model: &prepared.model,
            pool,
            prompt_tokens: u32::try_from(prepared.prompt.tokens.len()).unwrap_or(u32::MAX),
            tokens: Some(&prepared.prompt.tokens),
            cache_salt: prepared.cache_salt.as_deref(),
            exclude: &attempt.exclude,
        };
        match run_pick(state, live, &req, gate) {
            Ok(decision) => return Ok(Placed { decision, pool }),
            Err(PickError::NoReadyPod(m)) => return Err(ApiError::NoReadyPod(m)),
            Err(PickError::OverBudget { wait_s }) => return Err(ApiError::OverBudget { wait_s }),
            Err(PickError::TooLong { .. }) => {
                let fb = pool
                    .and_then(|p| p.fallback.as_deref())
                    .and_then(|n| live.config.pool(n));
                match fb {
                    Some(fb) if !hopped => {
                        state.metrics.retry("too_long_direct");
                        hopped = true;
                        pool = Some(fb);
                    }
                    _ => {
                        // No pool fits: let an engine say so in its own words.
                        let req = PickRequest {
                            prompt_tokens: 0,
                            tokens: None,
                            ..req
                        };
                        return run_pick(state, live, &req, gate)
                            .map(|decision| Placed { decision, pool })
                            .map_err(|e| match e {
                                PickError::OverBudget { wait_s } => ApiError::OverBudget { wait_s },
                                e => ApiError::NoReadyPod(e.to_string()),
                            });
                    }
                }
            }
        }
    }
}

fn run_pick(
    state: &State,
    live: &Live,
    req: &PickRequest<'_>,
    gate: Option<Gate>,
) -> Result<Decision, PickError> {
    let t = Instant::now();
    // Hashing happens between two short holds of the registry lock, not under it: the pods'
    // shapes rarely change in between, and the pick computes what a newcomer needs.
    let plan = Scheduler::hash_plan(&state.registry(), req);
    let mut hashes = PromptHashes::new(&plan, req.tokens);
    let result = {
        let mut reg = state.registry();
        match gate {
            None => live
                .scheduler
                .pick_prepared(&mut reg, req, &mut hashes, Instant::now()),
            Some(gate) => {
                live.scheduler
                    .pick_within(&mut reg, req, &mut hashes, Instant::now(), gate)
            }
        }
    };
    state
        .metrics
        .pick_seconds
        .observe(t.elapsed().as_secs_f64());
    if let Ok(d) = &result {
        state
            .metrics
            .saturation_skips
            .inc_by(d.saturation_skipped as u64);
        match d.placement_shared {
            Some(true) => state.metrics.placements("shared", 1),
            Some(false) => state.metrics.placements("unsent", 1),
            None => {}
        }
    }
    if let Ok(d) = &result
        && d.chain_len > 0
    {
        state
            .metrics
            .prefix_match_ratio
            .observe(d.matched_blocks as f64 / d.chain_len as f64);
    }
    result
}

/// Whether a 400 body is vLLM's "prompt does not fit" error.
pub fn is_context_length_error(body: &[u8]) -> bool {
    let msg = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .unwrap_or_default();
    msg.contains("maximum context length") || msg.contains("The decoder prompt (length")
}

/// An error and its sources, on one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// The `x-kvsight-decision` value: compact JSON naming the pod, each scorer's value, the margin
/// and the predicted cached prompt tokens.
pub fn decision_header(d: &Decision, mode: &str) -> String {
    let scores: serde_json::Map<String, Value> = d
        .scores
        .iter()
        .map(|(n, v)| ((*n).to_owned(), json!(round(*v))))
        .collect();
    json!({
        "pod": d.pod,
        "scores": scores,
        "total": round(d.total),
        "margin": round(d.margin),
        "predicted_cached_tokens": d.predicted_cached_tokens,
        "matched_blocks": d.matched_blocks,
        "chain_len": d.chain_len,
        "predicted_ttft_s": round(d.predicted_ttft_s),
        "all_saturated": d.all_saturated,
        "least_request": d.least_request,
        "candidates": d.candidates,
        "prefix_mode": mode,
    })
    .to_string()
}

fn round(v: f64) -> f64 {
    (v * 1e4).round() / 1e4
}

/// Chunks buffered between the upstream reader and the client: small, so a slow client slows
/// the reader instead of growing memory.
const STREAM_BUFFER: usize = 16;

fn stream_back(
    state: &Arc<State>,
    upstream: reqwest::Response,
    done: Done,
    deadline: TokioInstant,
    decision: Option<String>,
    predicted_cached_tokens: u32,
) -> Response {
    let status = upstream.status();
    let mut headers = end_to_end(upstream.headers());
    let sse = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if sse {
        // An error event may be appended, so the length is not known in advance.
        headers.remove(header::CONTENT_LENGTH);
        // Until its first event, the request shows how long the pod's queue really takes
        // (`Pod::oldest_awaiting`); the pump ends the wait.
        state.registry().record_awaiting(&done.pod, done.sent_at);
    }
    if let Some(v) = decision.and_then(|d| HeaderValue::from_str(&d).ok()) {
        headers.insert(HeaderName::from_static(DECISION), v);
    }
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    let sight = Sight {
        predicted_cached_tokens,
        tap: UsageTap::new(sse),
    };
    let pump = pump(state.clone(), upstream, tx, deadline, sse, done, sight);
    state
        .tracker
        .spawn(pump.instrument(tracing::Span::current()));
    let mut resp = Response::new(Body::from_stream(ReceiverStream::new(rx)));
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp
}

/// What the pick predicted the pod finds cached, and the reader of what the engine reports
/// (`usage` in the answer), compared when the answer ends whole.
struct Sight {
    predicted_cached_tokens: u32,
    tap: UsageTap,
}

/// Copies the upstream body to the client chunk by chunk until it ends, the deadline passes,
/// the pod fails or the client goes away.
async fn pump(
    state: Arc<State>,
    upstream: reqwest::Response,
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
    deadline: TokioInstant,
    sse: bool,
    done: Done,
    mut sight: Sight,
) {
    let mut body = upstream.bytes_stream();
    // Whether the bytes sent so far end between two SSE events.
    let mut at_boundary = true;
    // A stream's first event is its first token: the pod's queue has let it through.
    let mut awaiting = sse;
    let cut: Option<(&'static str, ApiError)> = loop {
        // Checked every turn too: a body that is always ready would starve the timer arm.
        if TokioInstant::now() >= deadline {
            break Some(("deadline", ApiError::Deadline(Duration::ZERO)));
        }
        let next = tokio::select! {
            biased;
            n = body.next() => n,
            _ = sleep_until(deadline) => break Some(("deadline", ApiError::Deadline(Duration::ZERO))),
            // The client left while the pod is silent (a long prefill): stop now, so dropping
            // the upstream body aborts the generation instead of finishing it for nobody.
            _ = tx.closed() => break None,
        };
        match next {
            None => break None,
            Some(Ok(chunk)) => {
                if chunk.is_empty() {
                    continue;
                }
                if awaiting {
                    awaiting = false;
                    state.registry().record_started(&done.pod, done.sent_at);
                }
                at_boundary = chunk.ends_with(b"\n\n") || chunk.ends_with(b"\r\n\r\n");
                sight.tap.feed(&chunk);
                match timeout_at(deadline, tx.send(Ok(chunk))).await {
                    Ok(Ok(())) => {}
                    // The client went away: dropping the upstream body cancels the generation.
                    Ok(Err(_)) => break None,
                    Err(_) => break Some(("deadline", ApiError::Deadline(Duration::ZERO))),
                }
            }
            Some(Err(e)) => {
                break Some((
                    "upstream",
                    ApiError::Upstream {
                        pod: done.pod.clone(),
                        message: error_chain(&e.without_url()),
                    },
                ));
            }
        }
    };
    drop(body);
    if cut.is_none()
        && let Some(engine) = sight.tap.finish()
    {
        state
            .metrics
            .sight(&done.pod, sight.predicted_cached_tokens, engine);
    }
    if let Some((reason, err)) = cut {
        state.metrics.cut(reason);
        warn!(reason, error = %err, "stream cut");
        if sse {
            let message = match &err {
                ApiError::Deadline(_) => {
                    "the request deadline passed; the answer is incomplete".to_owned()
                }
                other => format!("{other}; the answer is incomplete"),
            };
            let mut ev = String::new();
            if !at_boundary {
                ev.push_str("\n\n");
            }
            ev.push_str("data: ");
            ev.push_str(&error_body(err.status(), &message, None).to_string());
            ev.push_str("\n\ndata: [DONE]\n\n");
            // The deadline has passed: give the last event a short, bounded chance.
            let _ = timeout(Duration::from_secs(1), tx.send(Ok(Bytes::from(ev)))).await;
        } else {
            // A JSON body cannot carry a late error: abort it so the client sees a broken body.
            let _ = tx.try_send(Err(std::io::Error::other(err.to_string())));
        }
    }
    drop(done);
}
