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
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use kvsight_protocol::Phase;

use crate::error::ApiError;
use crate::proxy::{self, Kind};
use crate::state::State;
use crate::tokenize::Verdict;

type S = AxState<Arc<State>>;

/// The router's HTTP application.
pub fn app(state: Arc<State>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/tokenize", post(tokenize))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/debug/pods", get(debug_pods))
        .fallback(not_found)
        // The limit is enforced per request from the live config (it may be reloaded), with an
        // OpenAI-shaped 413 instead of axum's plain-text one.
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
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
/// (approximate pseudo-tokens are never shown to a client).
async fn tokenize(AxState(state): S, req: Request) -> Result<Response, ApiError> {
    let live = state.live();
    let (parts, body) = req.into_parts();
    let (bytes, json, model) = proxy::read_request(&state, &live, &parts.headers, body).await?;
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
            .map(|p| p.hello.pod.url.clone());
        (max_len, ready)
    };
    if let Some(tok) = state.tokenizers.get(&model) {
        let chat = json.get("messages").is_some();
        let tokens = if chat {
            tok.encode_chat(&json)
        } else {
            match json.get("prompt") {
                Some(Value::String(s)) => tok.encode_completion(s),
                _ => {
                    return Err(ApiError::BadParam {
                        message: "`prompt` (a string) or `messages` is required".into(),
                        param: "prompt",
                    });
                }
            }
        }
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
        return Ok(axum::Json(
            json!({"count": tokens.len(), "max_model_len": target.0, "tokens": tokens}),
        )
        .into_response());
    }
    let url = target
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
    let resp = tokio::time::timeout(live.config.timeouts.request(), send)
        .await
        .map_err(|_| ApiError::Deadline(live.config.timeouts.request()))?
        .map_err(|e| ApiError::Upstream {
            pod: url.clone(),
            message: e.to_string(),
        })?;
    let status = resp.status();
    let headers = proxy::end_to_end(resp.headers());
    let body = resp.bytes().await.map_err(|e| ApiError::Upstream {
        pod: url,
        message: e.to_string(),
    })?;
    let mut out = Response::new(Body::from(body));
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    Ok(out)
}
