//! vLLM's OpenAI-compatible wire shapes: the one error type every handler returns (always
//! `{"error": {"message", "type", "param", "code"}}`, as vLLM 0.10.2+ does), and the JSON bodies
//! of completion and chat responses and stream chunks, with fields in the order pydantic
//! serializes vLLM 0.33's models (`model_dump_json` with the same `exclude_unset` /
//! `exclude_none` choices vLLM makes for each kind of message).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

/// An OpenAI-shaped error with its HTTP status.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) kind: &'static str,
    pub(crate) message: String,
    pub(crate) param: Option<String>,
}

impl ApiError {
    pub(crate) fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message: message.into(),
            param: param.map(str::to_owned),
        }
    }

    /// A request-body validation failure: FastAPI's handler names the type by the HTTP phrase.
    pub(crate) fn validation(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            kind: "Bad Request",
            ..Self::bad_request(message, param)
        }
    }

    pub(crate) fn not_found_model(model: &str, served: &[String]) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: format!(
                "The model `{model}` does not exist. Valid aliases: {}.",
                served.join(", ")
            ),
            param: Some("model".to_owned()),
        }
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "InternalServerError",
            message: message.into(),
            param: None,
        }
    }

    /// The body, as serialized inside an HTTP error or an SSE `data:` line.
    pub(crate) fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status.as_u16(),
            }
        })
    }
    /// The body as an SSE `data:` payload. vLLM writes stream errors with Python's
    /// `json.dumps` defaults (`", "` and `": "` separators, non-ASCII escaped), unlike its
    /// compact HTTP error bodies.
    pub(crate) fn stream_body(&self) -> String {
        python_dumps(&self.body())
    }
}

/// `json.dumps(value)` with Python's default separators and `ensure_ascii=True`.
pub(crate) fn python_dumps(v: &Value) -> String {
    let mut out = String::new();
    dump(v, &mut out);
    out
}

fn dump(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                dump_str(k, out);
                out.push_str(": ");
                dump(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                dump(v, out);
            }
            out.push(']');
        }
        Value::String(s) => dump_str(s, out),
        other => out.push_str(&other.to_string()),
    }
}

fn dump_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// `UsageInfo` as vLLM builds it; `cached` is set only with `--enable-prompt-tokens-details`.
pub(crate) fn usage(prompt: usize, completion: usize, cached: Option<usize>, full: bool) -> Value {
    let mut u = Map::new();
    u.insert("prompt_tokens".into(), prompt.into());
    u.insert("total_tokens".into(), (prompt + completion).into());
    u.insert("completion_tokens".into(), completion.into());
    match cached {
        Some(c) => {
            let mut details = Map::new();
            details.insert("cached_tokens".into(), c.into());
            if full {
                details.insert("created_cache_tokens".into(), Value::Null);
                details.insert("multimodal_tokens".into(), Value::Null);
            }
            u.insert("prompt_tokens_details".into(), Value::Object(details));
        }
        None if full => {
            u.insert("prompt_tokens_details".into(), Value::Null);
        }
        None => {}
    }
    if full {
        u.insert("completion_tokens_details".into(), Value::Null);
    }
    Value::Object(u)
}

/// One finished choice of a non-streaming completion.
pub(crate) fn completion_choice(index: usize, text: &str, finish: &str) -> Value {
    json!({
        "index": index,
        "text": text,
        "logprobs": null,
        "finish_reason": finish,
        "stop_reason": null,
        "token_ids": null,
        "prompt_logprobs": null,
        "prompt_token_ids": null,
        "routed_experts": null,
        "weight_versions": null,
    })
}

/// A non-streaming completion response (`model_dump_json()`: every field).
pub(crate) fn completion_response(
    id: &str,
    created: u64,
    model: &str,
    choices: Vec<Value>,
    usage: Value,
) -> Value {
    json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": null,
        "system_fingerprint": null,
        "usage": usage,
        "kv_transfer_params": null,
        "ec_transfer_params": null,
        "metrics": null,
    })
}

/// A completion stream chunk (`exclude_unset=True`: the fields vLLM passes explicitly).
pub(crate) fn completion_chunk(
    id: &str,
    created: u64,
    model: &str,
    index: usize,
    text: &str,
    finish: Option<&str>,
) -> Value {
    json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": index,
            "text": text,
            "logprobs": null,
            "finish_reason": finish,
            "stop_reason": null,
            "prompt_token_ids": null,
            "token_ids": null,
            "weight_versions": null,
        }],
        "kv_transfer_params": null,
    })
}

/// The final usage chunk of a stream (`exclude_none=True`).
pub(crate) fn usage_chunk(
    id: &str,
    object: &str,
    created: u64,
    model: &str,
    usage: Value,
) -> Value {
    json!({
        "id": id,
        "object": object,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    })
}

/// A non-streaming chat completion response.
pub(crate) fn chat_response(
    id: &str,
    created: u64,
    model: &str,
    text: &str,
    finish: &str,
    usage: Value,
) -> Value {
    json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "refusal": null,
                "annotations": null,
                "audio": null,
                "function_call": null,
                "reasoning": null,
            },
            "logprobs": null,
            "finish_reason": finish,
            "stop_reason": null,
            "token_ids": null,
            "routed_experts": null,
            "weight_versions": null,
        }],
        "service_tier": null,
        "system_fingerprint": null,
        "usage": usage,
        "prompt_logprobs": null,
        "prompt_token_ids": null,
        "prompt_text": null,
        "kv_transfer_params": null,
        "ec_transfer_params": null,
        "metrics": null,
    })
}

/// The first chat chunk: the assistant role with empty content.
pub(crate) fn chat_role_chunk(id: &str, created: u64, model: &str) -> Value {
    json!({
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": null,
            "finish_reason": null,
        }],
        "prompt_token_ids": null,
    })
}

/// A chat content chunk; the last one carries `finish_reason` and `stop_reason`.
pub(crate) fn chat_chunk(
    id: &str,
    created: u64,
    model: &str,
    text: &str,
    finish: Option<&str>,
) -> Value {
    let mut choice = Map::new();
    choice.insert("index".into(), 0.into());
    choice.insert("delta".into(), json!({ "content": text }));
    choice.insert("logprobs".into(), Value::Null);
    choice.insert(
        "finish_reason".into(),
        finish.map_or(Value::Null, |f| f.into()),
    );
    if finish.is_some() {
        choice.insert("stop_reason".into(), Value::Null);
    }
    choice.insert("token_ids".into(), Value::Null);
    json!({
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [Value::Object(choice)],
        "kv_transfer_params": null,
    })
}

/// `cache_salt` checks of vLLM 0.33 (`validate_cache_salt`).
pub(crate) fn validate_cache_salt(salt: Option<&Value>) -> Result<Option<String>, ApiError> {
    let Some(salt) = salt else { return Ok(None) };
    if salt.is_null() {
        return Ok(None);
    }
    let Some(s) = salt.as_str().filter(|s| !s.is_empty()) else {
        return Err(ApiError::validation(
            "Parameter 'cache_salt' must be a non-empty string if provided.",
            Some("cache_salt"),
        ));
    };
    if s.chars().count() > 128 || s.contains(['@', '/', '\\', '\0']) {
        return Err(ApiError::validation(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', \
             '/', '\\\\', or NUL.",
            Some("cache_salt"),
        ));
    }
    Ok(Some(s.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_dumps_matches_json_dumps_defaults() {
        let v = json!({"a": [1, null, true], "b": "é\"\n", "c": {"d": 2.5}});
        assert_eq!(
            python_dumps(&v),
            r#"{"a": [1, null, true], "b": "\u00e9\"\n", "c": {"d": 2.5}}"#
        );
    }
}
