//! HTTP as the tests speak it to a router or a pod: a JSON POST asking for the router's decision
//! header (`x-kvsight-debug: 1`), its answer read whole and timed; a GET read as text.

use std::time::{Duration, Instant};

use serde_json::Value;

/// A request's outcome.
#[derive(Debug, Clone)]
pub struct Routed {
    pub status: u16,
    /// The pod the router chose (its key), when a router answered with a decision.
    pub pod: Option<String>,
    /// The whole `x-kvsight-decision` value.
    pub decision: Option<Value>,
    /// Time to the first body byte (for a stream: the first token's event).
    pub ttfb: Duration,
    /// Time to the last byte.
    pub total: Duration,
    pub text: String,
}

/// GETs `url` and reads its body as text; a test's failure when either fails.
pub async fn get_text(http: &reqwest::Client, url: &str) -> String {
    let resp = http.get(url).send().await.expect("GET sent");
    resp.text().await.expect("GET body read")
}

/// POSTs JSON to `url` asking for the router's decision header; the body is left to read.
pub async fn send_json(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
) -> reqwest::Result<reqwest::Response> {
    http.post(url)
        .header("content-type", "application/json")
        .header("x-kvsight-debug", "1")
        .body(body.to_string())
        .send()
        .await
}

/// The router's `x-kvsight-decision` header, parsed.
pub fn decision_of(resp: &reqwest::Response) -> Option<Value> {
    resp.headers()
        .get("x-kvsight-decision")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| serde_json::from_str(v).ok())
}

/// POSTs JSON to `url` asking for the router's decision header, timing the first body byte.
pub async fn post_json(http: &reqwest::Client, url: &str, body: &Value) -> reqwest::Result<Routed> {
    let started = Instant::now();
    let mut resp = send_json(http, url, body).await?;
    let status = resp.status().as_u16();
    let decision = decision_of(&resp);
    let mut bytes = Vec::new();
    let mut ttfb = None;
    while let Some(chunk) = resp.chunk().await? {
        ttfb.get_or_insert_with(|| started.elapsed());
        bytes.extend_from_slice(&chunk);
    }
    let total = started.elapsed();
    Ok(Routed {
        status,
        pod: decision
            .as_ref()
            .and_then(|d| d["pod"].as_str())
            .map(str::to_owned),
        decision,
        ttfb: ttfb.unwrap_or(total),
        total,
        text: String::from_utf8_lossy(&bytes).into_owned(),
    })
}
