//! The pod's answer pumped back to the client chunk by chunk, under the request's deadline; a
//! cut stream ends so that the client can tell it from a whole one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::header::{self, HeaderName, HeaderValue};
use axum::response::Response;
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio::time::{Instant as TokioInstant, sleep_until, timeout, timeout_at};
use tokio_stream::wrappers::ReceiverStream;
use tracing::{Instrument, warn};

use super::DECISION;
use super::headers::end_to_end;
use super::upstream::error_chain;
use crate::error::{ApiError, error_body};
use crate::sight::UsageTap;
use crate::state::State;

/// Calls `record_done` for the pod when the request ends, whatever the outcome (also when the
/// client goes away mid-stream and the pump is dropped).
pub(super) struct Done {
    pub(super) state: Arc<State>,
    pub(super) pod: String,
    pub(super) sent_at: Instant,
}

impl Drop for Done {
    fn drop(&mut self) {
        self.state
            .registry()
            .record_done(&self.pod, self.sent_at, Instant::now());
    }
}

/// Chunks buffered between the upstream reader and the client: small, so a slow client slows
/// the reader instead of growing memory.
const STREAM_BUFFER: usize = 16;

pub(super) fn stream_back(
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
