//! The one HTTP error type. Every error the router itself produces leaves as vLLM's
//! OpenAI-shaped body (`{"error":{"message","type","param","code"}}`, every field present, `code`
//! = the status), so a client cannot tell a router error from an engine error by its shape.

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Errors answered to the client before a response from a pod began.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("the request body did not arrive within {0:?}")]
    BodyTimeout(Duration),
    #[error("the request body nests JSON arrays and objects deeper than {limit} levels")]
    TooDeep { limit: usize },
    #[error("the request has {count} messages; this router accepts at most {limit}")]
    TooManyMessages { count: usize, limit: usize },
    #[error("the prompt text is {bytes} bytes; this router accepts at most {limit}")]
    PromptTooLarge { bytes: usize, limit: usize },
    #[error("the request head exceeds the limit of {limit} bytes")]
    HeadTooLarge { limit: usize },
    #[error("this router has {limit} connections open; retry shortly")]
    TooManyConnections { limit: usize },
    #[error(
        "this router holds {limit} bytes of request bodies in flight, its limit; retry shortly"
    )]
    BodyBudget { limit: usize },
    #[error(
        "the request has {count} JSON values in the fields the chat template reads; this router accepts at most {limit}"
    )]
    TooManyValues { count: usize, limit: usize },
    #[error("this router's {limit} queued slots for heavy work are taken; retry shortly")]
    Busy { limit: usize },
    #[error("{0}")]
    BadRequest(String),
    #[error("{message}")]
    BadParam {
        message: String,
        param: &'static str,
    },
    #[error("The model `{0}` does not exist.")]
    UnknownModel(String),
    #[error("no ready pod serves model `{0}`")]
    NoReadyPod(String),
    #[error("the router is shutting down")]
    ShuttingDown,
    #[error("the request deadline of {0:?} passed before the pod answered")]
    Deadline(Duration),
    #[error("upstream pod {pod} failed: {message}")]
    Upstream { pod: String, message: String },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Internal(String),
    /// Flow control answered at once instead of letting the request wait ([`crate::flow`]).
    #[error("{message}")]
    Shed {
        reason: &'static str,
        retry_after_s: u64,
        message: String,
    },
    /// Flow control's gate: no pod can take the request within its wait budget now. The
    /// request waits in the queue; a client sees this only as a [`ApiError::Shed`].
    #[error("every pod is predicted to make the request wait {wait_s:.3} s, over its budget")]
    OverBudget { wait_s: f64 },
}

/// Seconds a client should wait before retrying when no pod is ready: about one report interval.
pub const RETRY_AFTER_SECS: u32 = 1;

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::HeadTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::BadRequest(_)
            | ApiError::BadParam { .. }
            | ApiError::TooDeep { .. }
            | ApiError::TooManyMessages { .. }
            | ApiError::TooManyValues { .. }
            | ApiError::PromptTooLarge { .. } => StatusCode::BAD_REQUEST,
            ApiError::UnknownModel(_) | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::NoReadyPod(_)
            | ApiError::ShuttingDown
            | ApiError::BodyBudget { .. }
            | ApiError::Busy { .. }
            | ApiError::TooManyConnections { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Deadline(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Upstream { .. } => StatusCode::BAD_GATEWAY,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Shed { .. } | ApiError::OverBudget { .. } => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    fn param(&self) -> Option<&'static str> {
        match self {
            ApiError::UnknownModel(_) => Some("model"),
            ApiError::BadParam { param, .. } => Some(param),
            ApiError::TooManyMessages { .. } => Some("messages"),
            ApiError::TooManyValues { .. } => Some("messages"),
            ApiError::PromptTooLarge { .. } => Some("prompt"),
            _ => None,
        }
    }

    /// The `reason` label of `kvsight_router_refused_total` when this error is a client bound
    /// being enforced, `None` for every other error.
    pub fn refusal(&self) -> Option<&'static str> {
        Some(match self {
            ApiError::BodyTooLarge { .. } => "body_bytes",
            ApiError::BodyTimeout(_) => "body_read_time",
            ApiError::TooDeep { .. } => "json_depth",
            ApiError::TooManyMessages { .. } => "chat_messages",
            ApiError::PromptTooLarge { .. } => "prompt_bytes",
            ApiError::TooManyConnections { .. } => "connections",
            ApiError::BodyBudget { .. } => "inflight_body_bytes",
            ApiError::TooManyValues { .. } => "json_values",
            ApiError::Busy { .. } => "heavy_queue",
            _ => return None,
        })
    }

    /// The `{"error":{…}}` object, also used for the SSE event that ends a cut stream.
    pub fn body(&self) -> serde_json::Value {
        error_body(self.status(), &self.to_string(), self.param())
    }
}

/// vLLM's error object for `status`.
pub fn error_body(status: StatusCode, message: &str, param: Option<&str>) -> serde_json::Value {
    let kind = match status.as_u16() {
        400 => "BadRequestError",
        404 => "NotFoundError",
        408 => "RequestTimeoutError",
        413 => "RequestEntityTooLarge",
        431 => "RequestHeaderFieldsTooLarge",
        429 => "RateLimitError",
        502 => "BadGatewayError",
        503 => "ServiceUnavailableError",
        504 => "GatewayTimeoutError",
        _ => "InternalServerError",
    };
    json!({"error": {"message": message, "type": kind, "param": param, "code": status.as_u16()}})
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut resp = (status, axum::Json(self.body())).into_response();
        if matches!(
            self,
            ApiError::BodyTooLarge { .. }
                | ApiError::BodyTimeout(_)
                | ApiError::BodyBudget { .. }
                | ApiError::HeadTooLarge { .. }
                | ApiError::TooManyConnections { .. }
        ) {
            // The rest of the body (or the connection) is not worth reading: close it.
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if matches!(
            self,
            ApiError::NoReadyPod(_)
                | ApiError::ShuttingDown
                | ApiError::TooManyConnections { .. }
                | ApiError::BodyBudget { .. }
                | ApiError::Busy { .. }
        ) {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
        }
        match self {
            ApiError::Shed { retry_after_s, .. } => {
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
            }
            ApiError::OverBudget { .. } => {
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
            }
            _ => {}
        }
        resp
    }
}
