//! The router's HTTP surface: `fn app(state) -> Router`, separate from serving so handler tests
//! run through `oneshot` without a socket. Generation endpoints live in [`crate::proxy`]; the rest
//! (`/tokenize`, `/v1/models`, probes, metrics, `/debug/pods`) are here. Every error leaves
//! through [`ApiError`], OpenAI-shaped.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State as AxState};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use kvsight_protocol::Phase;

use crate::body::{BodyKind, PromptInput};
use crate::error::ApiError;
use crate::heavy::INLINE_BYTES;
use crate::proxy::{self, Kind, ReadRequest};
use crate::state::State;
use crate::tokenize::Verdict;

type S = AxState<Arc<State>>;

/// The router's API: the OpenAI paths kvsight serves, and the probes. Everything an operator
/// reads about the fleet (metrics, `/debug/pods`) is on [`admin_app`] instead, on its own
/// listener, so a client of the API never sees pod addresses, loads or tokenizer digests.
pub fn app(state: Arc<State>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/tokenize", post(tokenize))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .fallback(not_found)
        // The limit is enforced per request from the live config (it may be reloaded), with an
        // OpenAI-shaped 413 instead of axum's plain-text one.
        .layer(DefaultBodyLimit::disable())
        .layer(middleware::from_fn_with_state(state.clone(), head_limit))
        .with_state(state)
}

/// The admin surface, for the admin listener (loopback by default; in the chart, reachable by
/// Prometheus only): `/metrics`, `/debug/pods`, and the probes.
pub fn admin_app(state: Arc<State>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/debug/pods", get(debug_pods))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), head_limit))
        .with_state(state)
}

/// Refuses a request whose head is over `limits.headerBytes` (431), counted as hyper would
/// write it: hyper's own bound applies to its read buffer, and a head that arrives in one
/// large read can pass it.
async fn head_limit(AxState(state): S, req: Request, next: Next) -> Response {
    let limit = state.live().config.limits.header_bytes;
    let line = req.method().as_str().len()
        + req.uri().path_and_query().map_or(1, |p| p.as_str().len())
        + "  HTTP/1.1\r\n".len();
    let head = req.headers().iter().fold(line + 2, |n, (k, v)| {
        n + k.as_str().len() + v.len() + ": \r\n".len()
    });
    if head > limit {
        let e = ApiError::HeadTooLarge { limit };
        state.metrics.refused("header_bytes");
        tracing::warn!(head, limit, "request head over the limit refused");
        return e.into_response();
    }
    next.run(req).await
}

async fn completions(AxState(state): S, req: Request) -> Response {
    proxy::handle(state, Kind::Completion, req).await
}

async fn chat(AxState(state): S, req: Request) -> Response {
    proxy::handle(state, Kind::Chat, req).await
}

async fn not_found(req: Request) -> ApiError {
    ApiError::NotFound(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn ready(AxState(state): S) -> Response {
    if state.is_draining() {
        ApiError::ShuttingDown.into_response()
    } else {
        StatusCode::OK.into_response()
    }
}

async fn metrics(AxState(state): S) -> Response {
    let text = {
        let tokenizers = state.tokenizers.models();
        let reg = state.registry();
        state.metrics.render(&reg, &tokenizers, Instant::now())
    };
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// vLLM's `/v1/models`: one card per served name of a Ready pod, plus one per LoRA adapter with
/// `parent` = the pod's primary model.
async fn models(AxState(state): S) -> axum::Json<Value> {
    let now = Instant::now();
    let mut cards: BTreeMap<String, Value> = BTreeMap::new();
    let reg = state.registry();
    for pod in reg
        .pods()
        .filter(|p| p.phase() == Phase::Ready && !p.is_stale(now))
    {
        let len = pod.hello.engine.max_model_len;
        let primary = pod.hello.models.first().cloned().unwrap_or_default();
        for m in &pod.hello.models {
            cards.entry(m.clone()).or_insert_with(|| {
                json!({"id": m, "object": "model", "created": 0, "owned_by": "vllm",
                       "root": primary, "parent": null, "max_model_len": len, "permission": []})
            });
        }
        for l in &pod.hello.lora_adapters {
            cards.entry(l.clone()).or_insert_with(|| {
                json!({"id": l, "object": "model", "created": 0, "owned_by": "vllm",
                       "root": l, "parent": primary, "max_model_len": null, "permission": []})
            });
        }
    }
    axum::Json(json!({"object": "list", "data": cards.into_values().collect::<Vec<_>>()}))
}

/// Each pod's state as this replica sees it.
async fn debug_pods(AxState(state): S) -> axum::Json<Value> {
    let now = Instant::now();
    let reg = state.registry();
    let pods: Vec<Value> = reg
        .pods()
        .map(|p| {
            let proj = p.projection();
            let load = p.load.as_ref().map(|s| {
                let l = &s.load;
                json!({"seq": l.seq, "running": l.running, "waiting": l.waiting,
                       "kv_usage": l.kv_usage, "unrouted": l.unrouted,
                       "cache_view": format!("{:?}", l.cache_view),
                       "prefix_cache_queries": l.prefix_cache_queries,
                       "prefix_cache_hits": l.prefix_cache_hits,
                       "prefill_tokens_per_s": l.prefill_tokens_per_s})
            });
            json!({
                "pod": p.key,
                "url": p.hello.pod.url,
                "models": p.hello.models,
                "lora_adapters": p.hello.lora_adapters,
                "phase": p.phase().as_str(),
                "stale": p.is_stale(now),
                "report_age_seconds": p.report_age(now).as_secs_f64(),
                "load": load,
                "projection": {"running": proj.running, "waiting": proj.waiting,
                               "kv_usage": proj.kv_usage, "sent_since_sample": proj.sent_since_sample},
                "unrouted": p.load.as_ref().map(|s| s.load.unrouted),
                "filter": p.filter.as_ref().map(|f| json!({
                    "version": f.version(), "fill": f.fill_ratio(),
                    "resident_blocks": f.resident_blocks()})),
                "inflight": p.inflight,
                "block_size": p.hello.engine.block_size,
                "prefix_caching": p.hello.engine.prefix_caching,
                "engine": {
                    "version": p.hello.engine.engine_version,
                    "num_gpu_blocks": p.hello.engine.num_gpu_blocks,
                    "max_num_seqs": p.hello.engine.max_num_seqs,
                    "max_model_len": p.hello.engine.max_model_len,
                    "max_num_batched_tokens": p.hello.engine.max_num_batched_tokens,
                },
            })
        })
        .collect();
    drop(reg);
    let tokenizers: BTreeMap<String, Value> = state
        .tokenizers
        .models()
        .into_iter()
        .map(|t| {
            let (v, why) = match t.verdict {
                Verdict::Unchecked => ("unchecked", None),
                Verdict::Agrees(_) => ("agrees", None),
                Verdict::Differs(why) => ("differs", Some(why)),
            };
            let dialects: Vec<&str> = t.dialects.iter().map(|d| d.as_str()).collect();
            (
                t.model,
                json!({"digest": t.digest, "verdict": v, "difference": why,
                       "agreed_engine_versions": t.agreed_versions,
                       "dialect": t.dialect.as_str(), "dialects": dialects}),
            )
        })
        .collect();
    axum::Json(json!({"pods": pods, "tokenizers": tokenizers}))
}

/// vLLM's `POST /tokenize`. Answered locally with the model's tokenizer when the router has it;
/// otherwise forwarded to a Ready pod serving the model, so the ids are always the engine's
/// (approximate pseudo-tokens are never shown to a client). A large body is parsed and
/// tokenized in the heavy pool, and the answer is written without building a value per token.
async fn tokenize(AxState(state): S, req: Request) -> Result<Response, ApiError> {
    let live = state.live();
    let (parts, body) = req.into_parts();
    let ReadRequest {
        bytes,
        parsed,
        hold: _hold,
    } = proxy::read_request(&state, &live, &parts.headers, body, BodyKind::Tokenize).await?;
    let model = parsed.model;
    let now = Instant::now();
    let target = {
        let reg = state.registry();
        let serving: Vec<_> = reg.pods().filter(|p| p.serves(&model)).collect();
        if serving.is_empty() && live.config.pool_for(&model).is_none() {
            return Err(ApiError::UnknownModel(model));
        }
        let max_len = serving
            .iter()
            .map(|p| p.hello.engine.max_model_len)
            .min()
            .or_else(|| live.config.pool_for(&model).and_then(|p| p.context_window));
        let ready = serving
            .iter()
            .filter(|p| p.phase() == Phase::Ready && !p.is_stale(now))
            .min_by_key(|p| p.inflight)
            .map(|p| (p.key.clone(), p.hello.pod.url.clone()));
        (max_len, ready)
    };
    if let Some(tok) = state.tokenizers.get(&model) {
        let input = parsed.input;
        if !matches!(input, PromptInput::Chat(_) | PromptInput::Text(_)) {
            return Err(ApiError::BadParam {
                message: "`prompt` (a string) or `messages` is required".into(),
                param: "prompt",
            });
        }
        let max_model_len = target.0;
        let job = move || -> Result<Vec<u8>, ApiError> {
            let tokens = match input {
                PromptInput::Chat(fields) => tok.encode_chat(&fields),
                PromptInput::Text(s) => tok.encode_completion(&s),
                _ => Ok(Vec::new()),
            }
            .map_err(|e| ApiError::BadRequest(e.to_string()))?;
            let answer = TokenizeAnswer {
                count: tokens.len(),
                max_model_len,
                tokens: &tokens,
            };
            serde_json::to_vec(&answer).map_err(|e| ApiError::Internal(e.to_string()))
        };
        let body = if bytes.len() <= INLINE_BYTES {
            job()?
        } else {
            state.heavy.run(job).await??
        };
        return Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response());
    }
    let (pod, url) = target
        .1
        .ok_or_else(|| ApiError::NoReadyPod(model.clone()))?;
    let mut headers = proxy::end_to_end(&parts.headers);
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    let send = state
        .client
        .post(format!("{}/tokenize", url.trim_end_matches('/')))
        .headers(headers)
        .body(bytes)
        .send();
    let deadline = live.config.timeouts.request();
    let upstream = |message: String| ApiError::Upstream {
        pod: pod.clone(),
        message,
    };
    let resp = tokio::time::timeout(deadline, send)
        .await
        .map_err(|_| ApiError::Deadline(deadline))?
        .map_err(|e| upstream(proxy::error_chain(&e.without_url())))?;
    let status = resp.status();
    let headers = proxy::end_to_end(resp.headers());
    let body = proxy::read_upstream_body(
        resp,
        MAX_TOKENIZE_ANSWER_BYTES,
        live.config.timeouts.body_read(),
    )
    .await
    .map_err(|e| upstream(e.to_string()))?;
    let mut out = Response::new(Body::from(body));
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    Ok(out)
}

/// Largest `/tokenize` answer read from a pod: the ids of a prompt of `limits.promptBytes`
/// (8 MiB by default) written as JSON, with room to spare.
pub const MAX_TOKENIZE_ANSWER_BYTES: usize = 64 << 20;

/// vLLM's `/tokenize` answer, serialized straight from the ids.
#[derive(serde::Serialize)]
struct TokenizeAnswer<'a> {
    count: usize,
    max_model_len: Option<u32>,
    tokens: &'a [u32],
}
