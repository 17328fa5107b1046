//! The headers a request and its answer carry on: end-to-end ones only, and the decision
//! header a client may ask for.

use axum::http::header::{self, HeaderMap};
use serde_json::{Value, json};

use crate::scheduler::Decision;

/// Headers that describe one hop, never forwarded (RFC 9110 §7.6.1), plus the ones the client
/// library recomputes.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Copies end-to-end headers: drops hop-by-hop ones and any the `Connection` header names.
pub fn end_to_end(src: &HeaderMap) -> HeaderMap {
    let named: Vec<String> = src
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .collect();
    let mut out = HeaderMap::with_capacity(src.len());
    for (name, value) in src {
        let n = name.as_str();
        if HOP_BY_HOP.contains(&n) || named.iter().any(|x| x == n) {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

/// The `x-kvsight-decision` value: compact JSON naming the pod, each scorer's value, the margin
/// and the predicted cached prompt tokens.
pub fn decision_header(d: &Decision, mode: &str) -> String {
    let scores: serde_json::Map<String, Value> = d
        .scores
        .iter()
        .map(|(n, v)| ((*n).to_owned(), json!(round(*v))))
        .collect();
    json!({
        "pod": d.pod,
        "scores": scores,
        "total": round(d.total),
        "margin": round(d.margin),
        "predicted_cached_tokens": d.predicted_cached_tokens,
        "matched_blocks": d.matched_blocks,
        "chain_len": d.chain_len,
        "predicted_ttft_s": round(d.predicted_ttft_s),
        "all_saturated": d.all_saturated,
        "least_request": d.least_request,
        "candidates": d.candidates,
        "prefix_mode": mode,
    })
    .to_string()
}

fn round(v: f64) -> f64 {
    (v * 1e4).round() / 1e4
}
