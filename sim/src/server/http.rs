//! The HTTP face of a simulated pod: vLLM 0.33's OpenAI-compatible routes, `/metrics`, health,
//! and the simulator's `/sim/faults` admin route. `app(state)` builds the router separately from
//! serving so the handlers can be driven without a socket. Every error leaves through
//! [`ApiError`], so bodies are always vLLM-shaped; errors found before generation starts are
//! plain HTTP errors even for streaming requests, later ones become an SSE error event.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvsight_protocol::openai::optional_bool;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use super::SimConfig;
use super::driver::{Command, Event, Shared, wall_clock};
use super::openai::{self, ApiError};
use super::text::Codec;
use crate::engine::{Request, check_prompt_len};

/// Everything the handlers share.
#[derive(Clone)]
pub(crate) struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    config: SimConfig,
    codec: Codec,
    commands: mpsc::UnboundedSender<Command>,
    shared: Arc<Shared>,
    publisher: Option<Arc<crate::kv_events::KvEventPublisher>>,
    /// LoRA name → vLLM's `lora_int_id` (1-based, in flag order).
    loras: HashMap<String, u64>,
    next_id: AtomicU64,
    /// Distinguishes ids of pods in one process.
    nonce: u64,
}

impl AppState {
    pub(crate) fn new(
        config: SimConfig,
        codec: Codec,
        commands: mpsc::UnboundedSender<Command>,
        shared: Arc<Shared>,
        publisher: Option<Arc<crate::kv_events::KvEventPublisher>>,
    ) -> Self {
        let loras = config
            .lora_modules
            .iter()
            .enumerate()
            .map(|(i, (name, _))| (name.clone(), i as u64 + 1))
            .collect();
        let nonce = xxhash_rust::xxh3::xxh3_64_with_seed(
            &wall_clock().to_bits().to_le_bytes(),
            config.engine.seed,
        ) ^ (Arc::as_ptr(&shared) as u64);
        Self {
            inner: Arc::new(Inner {
                config,
                codec,
                commands,
                shared,
                publisher,
                loras,
                next_id: AtomicU64::new(0),
                nonce,
            }),
        }
    }
}

/// The router with every route a vLLM 0.33 OpenAI server answers that the simulator models.
pub(crate) fn app(state: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions/render", post(render_completion))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/tokenize", post(tokenize))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ping", get(health).post(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/sim/faults", post(faults))
        .with_state(state)
}

fn parse_body(body: &Bytes) -> Result<Value, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(ApiError::validation(
            "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': \
             'Input should be a valid dictionary or object to extract fields from'}",
            Some("body"),
        )),
        Err(e) => {
            // FastAPI reports the character offset of the JSON error in `loc`.
            let pos = body
                .split(|b| *b == b'\n')
                .take(e.line().saturating_sub(1))
                .map(|l| l.len() + 1)
                .sum::<usize>()
                + e.column().saturating_sub(1);
            Err(ApiError::validation(
                format!(
                    "1 validation error:\n  {{'type': 'json_invalid', 'loc': 'body.{pos}', 'msg': \
                     'JSON decode error', 'input': {{}}, 'ctx': {{'error': '{}'}}}}",
                    json_error_reason(&e)
                ),
                Some(&format!("body.{pos}")),
            ))
        }
    }
}

fn json_error_reason(e: &serde_json::Error) -> &'static str {
    match e.classify() {
        serde_json::error::Category::Eof => "Expecting value",
        _ => "Expecting property name enclosed in double quotes",
    }
}

impl Inner {
    /// The model the request names: `Ok(None)` for a base model, `Ok(Some(lora))` for an adapter.
    fn resolve_model(&self, body: &Value) -> Result<(String, Option<(String, u64)>), ApiError> {
        let base = self.config.model_name().to_owned();
        let model = match body.get("model") {
            None | Some(Value::Null) => return Ok((base, None)),
            Some(Value::String(m)) => m.clone(),
            Some(_) => {
                return Err(ApiError::validation(
                    "1 validation error:\n  {'type': 'string_type', 'loc': 'body.model', 'msg': \
                     'Input should be a valid string'}",
                    Some("body.model"),
                ));
            }
        };
        if self.config.served_model_names.contains(&model) {
            return Ok((model, None));
        }
        if let Some(id) = self.loras.get(&model) {
            return Ok((model.clone(), Some((model, *id))));
        }
        Err(ApiError::not_found_model(
            &model,
            &self.config.served_model_names,
        ))
    }

    fn next_request_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:016x}{n:016x}", self.nonce)
    }

    /// The prompts of a completion request, tokenized.
    fn completion_prompts(&self, body: &Value) -> Result<Vec<Vec<u32>>, ApiError> {
        let bad = || {
            ApiError::validation(
                "1 validation error:\n  {'type': 'value_error', 'loc': 'body.prompt', 'msg': \
                 'prompt must be a string, a list of strings, a list of token ids or a list of \
                 lists of token ids'}",
                Some("body.prompt"),
            )
        };
        let ids = |v: &[Value]| -> Result<Vec<u32>, ApiError> {
            v.iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(bad)
                })
                .collect()
        };
        match body.get("prompt") {
            Some(Value::String(s)) => Ok(vec![self.encode(s)?]),
            Some(Value::Array(items)) if items.is_empty() => Err(bad()),
            Some(Value::Array(items)) => match &items[0] {
                Value::String(_) => items
                    .iter()
                    .map(|i| i.as_str().ok_or_else(bad).and_then(|s| self.encode(s)))
                    .collect(),
                Value::Number(_) => Ok(vec![ids(items)?]),
                Value::Array(_) => items
                    .iter()
                    .map(|i| i.as_array().ok_or_else(bad).and_then(|a| ids(a)))
                    .collect(),
                _ => Err(bad()),
            },
            _ => Err(bad()),
        }
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.codec
            .encode_completion(text)
            .map_err(|e| ApiError::bad_request(e, None))
    }

    fn chat_prompt(&self, body: &Value) -> Result<Vec<u32>, ApiError> {
        if !body.get("messages").is_some_and(Value::is_array) {
            return Err(ApiError::validation(
                "1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': \
                 'Field required'}",
                Some("body.messages"),
            ));
        }
        self.codec
            .encode_chat(body)
            .map_err(|e| ApiError::bad_request(e, None))
    }

    fn check_len(&self, prompt: &[u32]) -> Result<(), ApiError> {
        check_prompt_len(prompt.len(), self.config.engine.max_model_len)
            .map_err(|e| ApiError::bad_request(e.to_string(), e.param()))
    }
}

/// What both generation endpoints extract from a body.
struct GenParams {
    max_tokens: Option<usize>,
    stream: bool,
    include_usage: bool,
    cache_salt: Option<String>,
    ignore_eos: bool,
}

fn gen_params(body: &Value, chat: bool) -> Result<GenParams, ApiError> {
    let n = body.get("n").and_then(Value::as_u64).unwrap_or(1);
    if n != 1 {
        return Err(ApiError::bad_request(
            "vllm-sim supports only n=1.",
            Some("n"),
        ));
    }
    let max_key = if chat && body.get("max_completion_tokens").is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_tokens = match body.get(max_key) {
        None | Some(Value::Null) => (!chat).then_some(16),
        Some(v) => match v.as_u64() {
            Some(0) | None => {
                return Err(ApiError::bad_request(
                    format!("{max_key} must be at least 1, got {v}."),
                    Some(max_key),
                ));
            }
            Some(m) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
        },
    };
    // Booleans as vLLM's pydantic models read them: `"yes"` streams, `"maybe"` is a 400.
    let flag = |obj: &Value, field: &str, loc: &str| {
        optional_bool(obj, field, false).map_err(|e| {
            ApiError::validation(e.validation_message(loc), Some(&format!("body.{loc}")))
        })
    };
    let stream = flag(body, "stream", "stream")?;
    let include_usage = match body.get("stream_options") {
        Some(opts) if opts.is_object() => {
            flag(opts, "include_usage", "stream_options.include_usage")?
        }
        _ => false,
    } && stream;
    Ok(GenParams {
        max_tokens,
        stream,
        include_usage,
        cache_salt: openai::validate_cache_salt(body.get("cache_salt"))?,
        ignore_eos: flag(body, "ignore_eos", "ignore_eos")?,
    })
}

/// Per-prompt progress of one HTTP request.
#[derive(Default, Clone)]
struct Choice {
    ids: Vec<u32>,
    text: String,
    tokens: usize,
    cached: usize,
    finish: Option<&'static str>,
}

struct Submitted {
    id: String,
    created: u64,
    model: String,
    prompt_lens: Vec<usize>,
    /// engine request id → choice index.
    index: HashMap<String, usize>,
    events: mpsc::UnboundedReceiver<Event>,
    state: AppState,
}

/// A request whose client went away is aborted, as vLLM does for streamed and non-streamed
/// answers alike: a dropped handler (hyper drops it when the connection closes) must not leave
/// its generation running. Aborting a request that already finished is a no-op in the engine.
impl Drop for Submitted {
    fn drop(&mut self) {
        for id in self.index.keys() {
            let _ = self.state.inner.commands.send(Command::Abort(id.clone()));
        }
    }
}

fn submit(
    state: &AppState,
    prefix: &str,
    model: String,
    lora: Option<(String, u64)>,
    prompts: Vec<Vec<u32>>,
    params: &GenParams,
) -> Result<Submitted, ApiError> {
    let inner = &state.inner;
    if inner.shared.is_dead() {
        return Err(ApiError::internal(super::driver::ENGINE_DEAD_MESSAGE));
    }
    for p in &prompts {
        inner.check_len(p)?;
    }
    let id = inner.next_request_id(prefix);
    let (sink, events) = mpsc::unbounded_channel();
    let mut index = HashMap::new();
    let prompt_lens = prompts.iter().map(Vec::len).collect();
    for (i, prompt) in prompts.into_iter().enumerate() {
        let engine_id = format!("{id}-{i}");
        let max_tokens = params.max_tokens.unwrap_or_else(|| {
            inner
                .config
                .engine
                .max_model_len
                .saturating_sub(prompt.len())
        });
        let request = Request {
            id: engine_id.clone(),
            prompt_token_ids: prompt,
            max_tokens,
            lora_name: lora.as_ref().map(|(n, _)| n.clone()),
            lora_id: lora.as_ref().map(|(_, id)| *id),
            cache_salt: params.cache_salt.clone(),
            ignore_eos: params.ignore_eos,
            report_reused_blocks: None,
        };
        index.insert(engine_id, i);
        inner
            .commands
            .send(Command::Submit {
                request,
                sink: sink.clone(),
            })
            .map_err(|_| ApiError::internal(super::driver::ENGINE_DEAD_MESSAGE))?;
    }
    Ok(Submitted {
        id,
        created: wall_clock() as u64,
        model,
        prompt_lens,
        index,
        events,
        state: state.clone(),
    })
}

impl Submitted {
    /// Waits for the next piece of output: `(choice index, new text)`, `Ok(None)` when every
    /// choice finished.
    async fn next(&mut self, choices: &mut [Choice]) -> Result<Option<(usize, String)>, String> {
        loop {
            if choices.iter().all(|c| c.finish.is_some()) {
                return Ok(None);
            }
            match self.events.recv().await {
                None => return Err(super::driver::ENGINE_DEAD_MESSAGE.to_owned()),
                Some(Event::Error(e)) => return Err(e),
                Some(Event::Output(out)) => {
                    let Some(&i) = self.index.get(&out.id) else {
                        continue;
                    };
                    let c = &mut choices[i];
                    c.ids.extend_from_slice(&out.new_token_ids);
                    // Decode everything so far and send the growth, as vLLM's incremental
                    // detokenizer does (a token may complete a multi-byte character).
                    let full = self.state.inner.codec.decode(&c.ids);
                    let text = full
                        .strip_prefix(c.text.as_str())
                        .map_or_else(|| full.clone(), str::to_owned);
                    c.text = full;
                    c.tokens += out.new_token_ids.len();
                    c.cached = out.num_cached_tokens;
                    c.finish = out.finished.map(|f| f.as_str());
                    return Ok(Some((i, text)));
                }
            }
        }
    }

    fn usage(&self, choices: &[Choice], full: bool) -> Value {
        let cached = self
            .state
            .inner
            .config
            .enable_prompt_tokens_details
            .then(|| choices.iter().map(|c| c.cached).sum());
        openai::usage(
            self.prompt_lens.iter().sum(),
            choices.iter().map(|c| c.tokens).sum(),
            cached,
            full,
        )
    }

    /// Aborts whatever is still running (the client is gone or the request failed).
    /// Waits for every choice to finish (non-streaming answers).
    async fn run_to_end(&mut self, choices: &mut [Choice]) -> Result<(), ApiError> {
        loop {
            match self.next(choices).await {
                Ok(Some(_)) => {}
                Ok(None) => return Ok(()),
                Err(e) => {
                    self.abort_rest(choices);
                    return Err(ApiError::internal(e));
                }
            }
        }
    }

    /// Streams the answer as vLLM does: an optional first chunk, one chunk per output (made by
    /// `chunk`), an error event if the engine fails mid-stream, the usage chunk when asked for,
    /// then `[DONE]`. A client that goes away aborts what is still running.
    fn stream(
        mut self,
        mut choices: Vec<Choice>,
        include_usage: bool,
        object: &'static str,
        first: Option<Value>,
        chunk: impl Fn(&Submitted, usize, &str, Option<&str>) -> Value + Send + 'static,
    ) -> Response {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        tokio::spawn(async move {
            // vLLM sends the first chunk (chat's role) on the engine's first output, not on
            // admission: a client's time to first chunk is its time to first token.
            let mut first = first;
            loop {
                match self.next(&mut choices).await {
                    Ok(Some((i, text))) => {
                        if let Some(f) = first.take()
                            && tx.send(data(&f)).await.is_err()
                        {
                            self.abort_rest(&choices);
                            return;
                        }
                        let c = chunk(&self, i, &text, choices[i].finish);
                        if tx.send(data(&c)).await.is_err() {
                            self.abort_rest(&choices);
                            return;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        self.abort_rest(&choices);
                        let _ = tx.send(error_event(&ApiError::internal(e))).await;
                        let _ = tx.send(Bytes::from_static(DONE)).await;
                        return;
                    }
                }
            }
            if include_usage {
                let usage = self.usage(&choices, false);
                let c = openai::usage_chunk(&self.id, object, self.created, &self.model, usage);
                let _ = tx.send(data(&c)).await;
            }
            let _ = tx.send(Bytes::from_static(DONE)).await;
        });
        sse_response(rx)
    }

    fn abort_rest(&self, choices: &[Choice]) {
        for (id, &i) in &self.index {
            if choices[i].finish.is_none() {
                let _ = self.state.inner.commands.send(Command::Abort(id.clone()));
            }
        }
    }
}

fn sse_response(rx: mpsc::Receiver<Bytes>) -> Response {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn data(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

const DONE: &[u8] = b"data: [DONE]\n\n";

fn error_event(e: &ApiError) -> Bytes {
    Bytes::from(format!("data: {}\n\n", e.stream_body()))
}

async fn completions(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    let inner = &state.inner;
    let (model, lora) = inner.resolve_model(&body)?;
    let params = gen_params(&body, false)?;
    let prompts = inner.completion_prompts(&body)?;
    let n = prompts.len();
    let mut sub = submit(&state, "cmpl", model, lora, prompts, &params)?;
    let mut choices = vec![Choice::default(); n];
    if !params.stream {
        sub.run_to_end(&mut choices).await?;
        let body = openai::completion_response(
            &sub.id,
            sub.created,
            &sub.model,
            choices
                .iter()
                .enumerate()
                .map(|(i, c)| openai::completion_choice(i, &c.text, c.finish.unwrap_or("length")))
                .collect(),
            sub.usage(&choices, true),
        );
        return Ok(axum::Json(body).into_response());
    }
    Ok(sub.stream(
        choices,
        params.include_usage,
        "text_completion",
        None,
        |sub, i, text, finish| {
            openai::completion_chunk(&sub.id, sub.created, &sub.model, i, text, finish)
        },
    ))
}

async fn chat_completions(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    let inner = &state.inner;
    let (model, lora) = inner.resolve_model(&body)?;
    let params = gen_params(&body, true)?;
    let prompt = inner.chat_prompt(&body)?;
    let mut sub = submit(&state, "chatcmpl", model, lora, vec![prompt], &params)?;
    let mut choices = vec![Choice::default()];
    if !params.stream {
        sub.run_to_end(&mut choices).await?;
        let body = openai::chat_response(
            &sub.id,
            sub.created,
            &sub.model,
            &choices[0].text,
            choices[0].finish.unwrap_or("length"),
            sub.usage(&choices, true),
        );
        return Ok(axum::Json(body).into_response());
    }
    let first = openai::chat_role_chunk(&sub.id, sub.created, &sub.model);
    Ok(sub.stream(
        choices,
        params.include_usage,
        "chat.completion.chunk",
        Some(first),
        |sub, _, text, finish| openai::chat_chunk(&sub.id, sub.created, &sub.model, text, finish),
    ))
}

async fn tokenize(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    let inner = &state.inner;
    inner.resolve_model(&body)?;
    let tokens = if body.get("messages").is_some() {
        inner.chat_prompt(&body)?
    } else {
        let add_special = body
            .get("add_special_tokens")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let Some(prompt) = body.get("prompt").and_then(Value::as_str) else {
            return Err(ApiError::validation(
                "1 validation error:\n  {'type': 'missing', 'loc': 'body.prompt', 'msg': \
                 'Field required'}",
                Some("body.prompt"),
            ));
        };
        if add_special {
            inner.encode(prompt)?
        } else {
            inner
                .codec
                .encode_plain(prompt)
                .map_err(|e| ApiError::bad_request(e, None))?
        }
    };
    Ok(axum::Json(json!({
        "count": tokens.len(),
        "max_model_len": inner.config.engine.max_model_len,
        "tokens": tokens,
        "token_strs": null,
    }))
    .into_response())
}

fn render_one(inner: &Inner, model: &str, tokens: Vec<u32>) -> Value {
    json!({
        "request_id": inner.next_request_id("render"),
        "token_ids": tokens,
        "model": model,
    })
}

async fn render_completion(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    let inner = &state.inner;
    let (model, _) = inner.resolve_model(&body)?;
    let prompts = inner.completion_prompts(&body)?;
    let out: Vec<Value> = prompts
        .into_iter()
        .map(|p| render_one(inner, &model, p))
        .collect();
    Ok(axum::Json(Value::Array(out)).into_response())
}

async fn render_chat(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    let inner = &state.inner;
    let (model, _) = inner.resolve_model(&body)?;
    let prompt = inner.chat_prompt(&body)?;
    Ok(axum::Json(render_one(inner, &model, prompt)).into_response())
}

async fn models(State(state): State<AppState>) -> Response {
    let inner = &state.inner;
    let created = wall_clock() as u64;
    let base = inner.config.model_name().to_owned();
    let permission = |n: u64| {
        json!([{
            "id": format!("modelperm-{:016x}{n:016x}", inner.nonce),
            "object": "model_permission",
            "created": created,
            "allow_create_engine": false,
            "allow_sampling": true,
            "allow_logprobs": true,
            "allow_search_indices": false,
            "allow_view": true,
            "allow_fine_tuning": false,
            "organization": "*",
            "group": null,
            "is_blocking": false,
        }])
    };
    let mut data = Vec::new();
    let mut n = 0;
    for name in &inner.config.served_model_names {
        n += 1;
        data.push(json!({
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": base,
            "parent": null,
            "max_model_len": inner.config.engine.max_model_len,
            "permission": permission(n),
        }));
    }
    for (name, path) in &inner.config.lora_modules {
        n += 1;
        data.push(json!({
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": path,
            "parent": base,
            "max_model_len": null,
            "permission": permission(n),
        }));
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn health(State(state): State<AppState>) -> StatusCode {
    if state.inner.shared.is_dead() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

async fn version() -> Response {
    axum::Json(json!({"version": super::VLLM_VERSION})).into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    let text = state.inner.shared.metrics().render();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn reset_prefix_cache(State(state): State<AppState>) -> Result<StatusCode, ApiError> {
    let (reply, rx) = oneshot::channel();
    state
        .inner
        .commands
        .send(Command::ResetPrefixCache(reply))
        .map_err(|_| ApiError::internal(super::driver::ENGINE_DEAD_MESSAGE))?;
    match rx.await {
        Ok(true) => Ok(StatusCode::OK),
        Ok(false) => Err(ApiError::internal(
            "Failed to reset prefix cache: requests are running.",
        )),
        Err(_) => Err(ApiError::internal(super::driver::ENGINE_DEAD_MESSAGE)),
    }
}

/// `POST /sim/faults` with any of `{"dead": bool, "hung": bool, "slowdown": f64,
/// "drop_kv_seqs": [start, end] | null, "restart_kv_sequence": true}`.
async fn faults(State(state): State<AppState>, body: Bytes) -> Result<StatusCode, ApiError> {
    let body = parse_body(&body)?;
    let inner = &state.inner;
    let send = |c| {
        inner
            .commands
            .send(c)
            .map_err(|_| ApiError::internal(super::driver::ENGINE_DEAD_MESSAGE))
    };
    if let Some(dead) = body.get("dead").and_then(Value::as_bool) {
        send(Command::SetDead(dead))?;
    }
    if let Some(hung) = body.get("hung").and_then(Value::as_bool) {
        send(Command::SetHung(hung))?;
    }
    if let Some(f) = body.get("slowdown").and_then(Value::as_f64) {
        if !(f.is_finite() && f >= 0.0) {
            return Err(ApiError::bad_request(
                "slowdown must be >= 0",
                Some("slowdown"),
            ));
        }
        send(Command::SetSlowdown(f))?;
    }
    if let Some(p) = &inner.publisher {
        match body.get("drop_kv_seqs") {
            Some(Value::Null) => p.set_live_drop(None),
            Some(Value::Array(r)) => match (
                r.first().and_then(Value::as_u64),
                r.get(1).and_then(Value::as_u64),
            ) {
                (Some(a), Some(b)) => p.set_live_drop(Some(a..b)),
                _ => {
                    return Err(ApiError::bad_request(
                        "drop_kv_seqs must be [start, end]",
                        Some("drop_kv_seqs"),
                    ));
                }
            },
            _ => {}
        }
        if body.get("restart_kv_sequence").and_then(Value::as_bool) == Some(true) {
            p.restart_sequence();
        }
    }
    Ok(StatusCode::OK)
}
