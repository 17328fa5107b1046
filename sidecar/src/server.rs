//! The health/metrics HTTP server on `--listen`: `/live`, `/ready` (the pod's readinessProbe) and
//! `/metrics`; `/debug/state` is on its own listener (`--debug-listen`, off unless set, loopback
//! in the chart), since it shows the pod's routers and engine to whoever reaches it. [`app`] and
//! [`debug_app`] build the routers without a socket so handlers are testable with `oneshot`.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;

use crate::kv_events::subscriber::lock;
use crate::state::Shared;

/// The probes and metrics, on `--listen`.
pub fn app(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/live", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .with_state(shared)
}

/// `/debug/state`, on `--debug-listen`.
pub fn debug_app(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/debug/state", get(debug_state))
        .with_state(shared)
}

async fn ready(State(s): State<Arc<Shared>>) -> Response {
    if s.ready() {
        (StatusCode::OK, "ready").into_response()
    } else {
        let why = format!("phase {} healthy {}", s.phase().as_str(), s.healthy());
        (StatusCode::SERVICE_UNAVAILABLE, why).into_response()
    }
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(),
    )
        .into_response()
}

async fn debug_state(State(s): State<Arc<Shared>>) -> Response {
    let facts = s.facts.get().map(|f| {
        json!({
            "models": f.models,
            "lora_adapters": f.lora_adapters,
            "root": f.root,
            "block_size": f.engine.block_size,
            "num_gpu_blocks": f.engine.num_gpu_blocks,
            "prefix_caching": f.engine.prefix_caching,
            "max_num_seqs": f.engine.max_num_seqs,
            "max_model_len": f.engine.max_model_len,
            "engine_version": f.engine.engine_version,
        })
    });
    let (resident, filter_version) = s
        .mirror
        .get()
        .map(|m| {
            let m = lock(m);
            (Some(m.resident()), Some(m.filter().version()))
        })
        .unwrap_or((None, None));
    let sub = s.subscriber.get().map(|rx| rx.borrow().clone());
    let load = s.load.borrow().as_ref().map(|l| {
        json!({
            "running": l.load.running,
            "waiting": l.load.waiting,
            "kv_usage": l.load.kv_usage,
            "unrouted": l.load.unrouted,
            "prefill_tokens_per_s": l.load.prefill_tokens_per_s,
            "sample_age_ms": l.sampled_at.elapsed().as_millis() as u64,
        })
    });
    let body = json!({
        "phase": s.phase().as_str(),
        "healthy": s.healthy(),
        "engine": facts,
        "resident_blocks": resident,
        "filter_version": filter_version,
        "last_seq": sub.as_ref().and_then(|s| s.last_seq),
        "cache_view": sub.as_ref().map(|s| format!("{:?}", s.view)),
        "kv_gaps": sub.as_ref().map(|s| s.gaps),
        "kv_restarts": sub.as_ref().map(|s| s.restarts),
        "kv_losses": sub.as_ref().map(|s| s.losses),
        "load": load,
        "routers": s.routers(),
    });
    axum::Json(body).into_response()
}
