//! One OpenAI request end to end: read the body under the limit, parse `model` and the prompt,
//! choose the pool, tokenize, pick, forward, and stream the answer back — all under one deadline
//! (`timeouts.requestSeconds`). Before the pod's response began a failure is a 504/502 error
//! body; after, the stream ends with `data: {"error":…}` + `data: [DONE]` so a client can tell a
//! cut answer from a whole one. Retries happen only where no generation can have started: a
//! refused connection (one other pod) and vLLM's context-length 400 from a pool with a fallback
//! (resent once to the fallback pool, before any byte reached the client).
//!
//! The files by job: [`request`] reads, checks and tokenizes the body; [`attempt`] tries pods
//! (the retries and the fallback pool); [`admit`] picks, through flow control when it is on;
//! [`stream`] pumps the pod's answer back; [`upstream`] reads a pod's whole answer and
//! [`headers`] builds the headers sent on.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::http::HeaderMap;
use axum::http::header::HeaderValue;
use axum::response::{IntoResponse, Response};
use tracing::{Instrument, field, info_span};

use crate::config::PoolConfig;
use crate::error::ApiError;
use crate::state::State;

mod admit;
mod attempt;
mod headers;
mod request;
mod stream;
mod upstream;

pub use crate::body::json_deeper_than;
pub use headers::{decision_header, end_to_end};
pub use request::{ReadRequest, read_request, tokenize_prompt};
pub use upstream::{
    MAX_ERROR_BODY_BYTES, UpstreamBodyError, error_chain, is_context_length_error,
    read_upstream_body,
};

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
pub(super) struct Route {
    pool: String,
    pod: String,
}

impl Route {
    pub(super) fn set(&mut self, pool: Option<&PoolConfig>, pod: &str) {
        self.pool = pool.map_or_else(String::new, |p| p.name.clone());
        self.pod = pod.to_owned();
        let span = tracing::Span::current();
        span.record("pool", self.pool.as_str());
        if !pod.is_empty() {
            span.record("pod", pod);
        }
    }
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
    let (req, pool) =
        request::prepare(state, &live, kind, in_headers, body, request_id, route).await?;
    attempt::run(state, &live, &req, pool, route).await
}
