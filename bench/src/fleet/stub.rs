//! Each emulated pod's HTTP side: a tiny OpenAI stub on the pod's own loopback address that
//! answers completions and chat completions at once (one token, streamed or not) and
//! `/tokenize` with the project's own tokenizer, the one the routers are configured with, so
//! their tokenizer check agrees and prompts are hashed exactly.
//!
//! Serving a prompt stores its blocks in the pod's filter (see [`Pod::store_prompt`]), as vLLM's
//! prefix cache does: the next request sharing the prefix finds it there through the router.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvsight_protocol::hash::{ChainSeed, hash_chain};
use kvsight_tokenizer::{ChatRequest, ModelTokenizer};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::swarm::{Pod, Stats};
use super::{BLOCK_SIZE, MODEL};

#[derive(Clone)]
struct Stub {
    pod: Arc<Pod>,
    tokenizer: Arc<ModelTokenizer>,
    stats: Arc<Stats>,
}

/// Serves pod `pod`'s stub on `listener` until `cancel`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    pod: Arc<Pod>,
    tokenizer: Arc<ModelTokenizer>,
    stats: Arc<Stats>,
    cancel: CancellationToken,
) {
    let app = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/tokenize", post(tokenize))
        .route("/health", get(|| async { "ok" }))
        .route(
            "/v1/models",
            get(|| async {
                axum::Json(json!({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
            }),
        )
        .with_state(Stub {
            pod,
            tokenizer,
            stats,
        });
    let _ = axum::serve(listener, app)
        .with_graceful_shutdown(cancel.cancelled_owned())
        .await;
}

/// A request the stub cannot read, answered as vLLM does (400, OpenAI-shaped).
struct BadRequest(String);

impl IntoResponse for BadRequest {
    fn into_response(self) -> Response {
        (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"object": "error", "message": self.0, "type": "BadRequestError", "code": 400})),
        )
            .into_response()
    }
}

fn bad_request(message: String) -> BadRequest {
    BadRequest(message)
}

fn parse(body: &[u8]) -> Result<Value, BadRequest> {
    serde_json::from_slice(body).map_err(|e| bad_request(format!("invalid JSON: {e}")))
}

impl Stub {
    fn completion_tokens(&self, body: &Value) -> Result<Vec<u32>, BadRequest> {
        let prompt = body
            .get("prompt")
            .and_then(Value::as_str)
            .ok_or_else(|| bad_request("`prompt` must be a string".into()))?;
        let add_special = body
            .get("add_special_tokens")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let tokens = if add_special {
            self.tokenizer.encode_completion(prompt)
        } else {
            self.tokenizer.encode(prompt, false)
        };
        tokens.map_err(|e| bad_request(e.to_string()))
    }

    fn chat_tokens(&self, body: &Value) -> Result<Vec<u32>, BadRequest> {
        let chat = ChatRequest::from_body(body).map_err(|e| bad_request(e.to_string()))?;
        self.tokenizer
            .encode_chat(&chat.messages, chat.add_generation_prompt, &chat.extras)
            .map_err(|e| bad_request(e.to_string()))
    }

    /// Caches the prompt's blocks and answers one token.
    fn generate(&self, body: &Value, tokens: &[u32], chat: bool) -> Response {
        self.stats.http_requests.fetch_add(1, Ordering::Relaxed);
        let seed = ChainSeed {
            lora: None,
            cache_salt: body.get("cache_salt").and_then(Value::as_str),
        };
        self.pod
            .store_prompt(&hash_chain(&seed, tokens, BLOCK_SIZE as usize));
        let usage = json!({
            "prompt_tokens": tokens.len(),
            "completion_tokens": 1,
            "total_tokens": tokens.len() + 1,
        });
        let (object, choice) = if chat {
            (
                "chat.completion",
                json!({"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}),
            )
        } else {
            (
                "text_completion",
                json!({"index": 0, "text": "ok", "finish_reason": "length"}),
            )
        };
        let stream = body.get("stream").and_then(Value::as_bool) == Some(true);
        if !stream {
            return axum::Json(json!({
                "id": "fleet-0",
                "object": object,
                "model": MODEL,
                "choices": [choice],
                "usage": usage,
            }))
            .into_response();
        }
        let (object, delta) = if chat {
            (
                "chat.completion.chunk",
                json!({"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}),
            )
        } else {
            (
                "text_completion",
                json!({"index": 0, "text": "ok", "finish_reason": "length"}),
            )
        };
        let chunk = json!({"id": "fleet-0", "object": object, "model": MODEL, "choices": [delta]});
        let last = json!({"id": "fleet-0", "object": object, "model": MODEL, "choices": [], "usage": usage});
        let text = format!("data: {chunk}\n\ndata: {last}\n\ndata: [DONE]\n\n");
        Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .body(Body::from(text))
            .unwrap_or_else(|e| bad_request(e.to_string()).into_response())
    }
}

/// Counts a request in flight on the pod (its load reports show it running).
struct InFlight<'a>(&'a Pod);

impl<'a> InFlight<'a> {
    fn new(pod: &'a Pod) -> Self {
        pod.inflight.fetch_add(1, Ordering::Relaxed);
        InFlight(pod)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn completions(State(s): State<Stub>, body: axum::body::Bytes) -> Response {
    let _running = InFlight::new(&s.pod);
    let body = match parse(&body) {
        Ok(b) => b,
        Err(r) => return r.into_response(),
    };
    match s.completion_tokens(&body) {
        Ok(tokens) => s.generate(&body, &tokens, false),
        Err(r) => r.into_response(),
    }
}

async fn chat(State(s): State<Stub>, body: axum::body::Bytes) -> Response {
    let _running = InFlight::new(&s.pod);
    let body = match parse(&body) {
        Ok(b) => b,
        Err(r) => return r.into_response(),
    };
    match s.chat_tokens(&body) {
        Ok(tokens) => s.generate(&body, &tokens, true),
        Err(r) => r.into_response(),
    }
}

/// vLLM's `/tokenize`: chat when the body has `messages`, else a completion prompt.
async fn tokenize(State(s): State<Stub>, body: axum::body::Bytes) -> Response {
    let body = match parse(&body) {
        Ok(b) => b,
        Err(r) => return r.into_response(),
    };
    let tokens = if body.get("messages").is_some() {
        s.chat_tokens(&body)
    } else {
        s.completion_tokens(&body)
    };
    match tokens {
        Ok(tokens) => axum::Json(json!({
            "count": tokens.len(),
            "max_model_len": s.pod.hello.engine.max_model_len,
            "tokens": tokens,
            "token_strs": null,
        }))
        .into_response(),
        Err(r) => r.into_response(),
    }
}
