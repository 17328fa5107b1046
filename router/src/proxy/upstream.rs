//! A pod's answer read whole (an error body, or the answer of a non-generation path), and how
//! its errors are told apart and reported.

use std::time::Duration;

use axum::body::Bytes;
use serde_json::Value;
use tokio::time::timeout;

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
