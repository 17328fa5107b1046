//! The attempts of one request: pick a pod, send, and either answer or retry — only where no
//! generation can have started, each reason at most once.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::StatusCode;
use axum::response::Response;
use tokio::time::{Instant as TokioInstant, timeout_at};
use tracing::warn;

use super::Route;
use super::admit::{Placed, admit};
use super::headers::{decision_header, end_to_end};
use super::request::{Prepared, prompt_mode};
use super::stream::{Done, stream_back};
use super::upstream::{
    MAX_ERROR_BODY_BYTES, error_chain, is_context_length_error, read_upstream_body,
};
use crate::config::PoolConfig;
use crate::error::ApiError;
use crate::state::{Live, State};

/// Why a request is tried again. Only where no generation can have started, and each reason
/// at most once per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RetryReason {
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
pub(super) struct Attempt<'a> {
    pub(super) pool: Option<&'a PoolConfig>,
    pub(super) exclude: Vec<String>,
    pub(super) spent: Vec<RetryReason>,
}

impl<'a> Attempt<'a> {
    pub(super) fn first(pool: Option<&'a PoolConfig>) -> Self {
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

/// Runs attempts until one gives an answer.
pub(super) async fn run<'a>(
    state: &Arc<State>,
    live: &'a Live,
    req: &Arc<Prepared>,
    pool: Option<&'a PoolConfig>,
    route: &mut Route,
) -> Result<Response, ApiError> {
    let mut attempt = Attempt::first(pool);
    loop {
        match try_once(state, live, req, &attempt, route).await? {
            Step::Answer(resp) => return Ok(resp),
            Step::Retry(retry) => {
                state.metrics.retry(retry.reason().label());
                attempt = attempt.next(retry);
            }
        }
    }
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
