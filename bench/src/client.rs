//! The load generator: an open loop. Every request is sent at its planned offset whether or not
//! earlier ones finished (a saturated router meets the same arrivals as an idle one), streamed,
//! and timed from the client's side: time to the first generated text, to the end, the usage the
//! engine reported, and — from kvsight — the prediction it made.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::Value;

use crate::workload::Request;

/// `GET {base}/metrics`: a router's, sidecar's or engine's Prometheus exposition.
pub async fn metrics_text(http: &reqwest::Client, base: &str) -> anyhow::Result<String> {
    Ok(http
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?)
}

/// How clients reach several router replicas.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Spread {
    /// Request by request in turn, as a Kubernetes Service or a gateway without affinity does.
    #[default]
    RoundRobin,
    /// Each tenant or session always to the same replica, as a gateway hashing a header does.
    Pinned,
}

impl Spread {
    pub fn name(self) -> &'static str {
        match self {
            Spread::RoundRobin => "round_robin",
            Spread::Pinned => "pinned",
        }
    }
}

/// The router replicas a run sends to, and how requests are spread over them.
#[derive(Debug, Clone)]
pub struct Targets {
    pub urls: Vec<String>,
    pub spread: Spread,
}

impl Targets {
    /// One router.
    pub fn one(url: &str) -> Targets {
        Targets {
            urls: vec![url.to_owned()],
            spread: Spread::RoundRobin,
        }
    }

    /// The replica request `i` (sent by `key`) goes to.
    pub fn replica(&self, i: usize, key: u32) -> usize {
        let n = self.urls.len().max(1);
        match self.spread {
            Spread::RoundRobin => i % n,
            Spread::Pinned => key as usize % n,
        }
    }
}

/// What one request saw.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Which router replica it was sent to.
    pub replica: usize,
    /// Seconds from sending to the first generated text; `None` without any.
    pub ttft_s: Option<f64>,
    /// Seconds from sending to the end of the stream.
    pub e2e_s: f64,
    pub completion_tokens: u32,
    /// `usage.prompt_tokens_details.cached_tokens` as the engine reported it.
    pub cached_tokens: Option<u32>,
    /// kvsight's `x-kvsight-decision` prediction, and the whole header.
    pub predicted_cached_tokens: Option<u32>,
    pub decision: Option<Value>,
    /// HTTP status, an error event in the stream or a transport failure.
    pub error: Option<String>,
    /// The HTTP status, when an answer came.
    pub status: Option<u16>,
}

impl Outcome {
    /// Answered 429: a router's flow control shed it.
    pub fn shed(&self) -> bool {
        self.status == Some(429)
    }
}

/// Sends every request of `plan` to its replica of `targets` at its offset; returns the
/// outcomes in plan order.
pub async fn run(
    http: &reqwest::Client,
    targets: &Targets,
    requests: &[Request],
    deadline: Duration,
) -> Vec<Outcome> {
    let start = tokio::time::Instant::now();
    let bases: Vec<Arc<str>> = targets
        .urls
        .iter()
        .map(|u| Arc::from(u.trim_end_matches('/')))
        .collect();
    let mut tasks = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        tokio::time::sleep_until(start + r.at).await;
        let http = http.clone();
        let replica = targets.replica(i, r.key);
        let url = format!("{}{}", bases[replica], r.path);
        let body = r.body.clone();
        let headers = r.headers.clone();
        tasks.push(tokio::spawn(async move {
            let o = match tokio::time::timeout(deadline, one(&http, &url, body, &headers)).await {
                Ok(o) => o,
                Err(_) => Outcome {
                    e2e_s: deadline.as_secs_f64(),
                    error: Some(format!("no answer within {deadline:?}")),
                    ..Outcome::default()
                },
            };
            Outcome { replica, ..o }
        }));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.unwrap_or_else(|e| Outcome {
            error: Some(format!("client task: {e}")),
            ..Outcome::default()
        }));
    }
    out
}

/// Sends one streamed request (with `headers`) and reads its answer to the end.
pub async fn one(
    http: &reqwest::Client,
    url: &str,
    body: bytes::Bytes,
    headers: &[(&'static str, String)],
) -> Outcome {
    let t0 = Instant::now();
    let mut o = Outcome::default();
    let mut req = http
        .post(url)
        .header("content-type", "application/json")
        .header("x-kvsight-debug", "1");
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let resp = req.body(body).send().await;
    let resp = match resp {
        Ok(r) => r,
        Err(e) => {
            o.error = Some(format!("send: {e}"));
            o.e2e_s = t0.elapsed().as_secs_f64();
            return o;
        }
    };
    if let Some(d) = resp
        .headers()
        .get("x-kvsight-decision")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| serde_json::from_str::<Value>(v).ok())
    {
        o.predicted_cached_tokens = d["predicted_cached_tokens"]
            .as_u64()
            .and_then(|v| u32::try_from(v).ok());
        o.decision = Some(d);
    }
    let status = resp.status();
    o.status = Some(status.as_u16());
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        o.error = Some(format!(
            "HTTP {status}: {}",
            text.chars().take(200).collect::<String>()
        ));
        o.e2e_s = t0.elapsed().as_secs_f64();
        return o;
    }
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                o.error = Some(format!("stream: {e}"));
                break;
            }
        };
        buf.extend_from_slice(&chunk);
        // Whole events only: `data: …\n\n`.
        while let Some(end) = find(&buf, b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let Some(data) = event.strip_prefix(b"data: ") else {
                continue;
            };
            let data = &data[..data.len() - 2];
            if data == b"[DONE]" {
                done = true;
                continue;
            }
            let Ok(v) = serde_json::from_slice::<Value>(data) else {
                o.error = Some("unparsable event".into());
                continue;
            };
            if let Some(e) = v.get("error") {
                o.error = Some(format!("error event: {e}"));
                continue;
            }
            if o.ttft_s.is_none() && has_text(&v) {
                o.ttft_s = Some(t0.elapsed().as_secs_f64());
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                o.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as u32;
                o.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .map(|v| v as u32);
            }
        }
    }
    if !done && o.error.is_none() {
        o.error = Some("stream ended without [DONE]".into());
    }
    o.e2e_s = t0.elapsed().as_secs_f64();
    o
}

/// Whether a chunk carries generated tokens: any completion choice (vLLM sends one per output,
/// even when the tokens decode to no text yet), a chat delta with content. Chat's first chunk,
/// which announces the role, also comes with the first token in vLLM, but only content counts.
fn has_text(v: &Value) -> bool {
    v["choices"].as_array().is_some_and(|cs| {
        cs.iter().any(|c| {
            c["text"].is_string()
                || c["delta"]["content"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
        })
    })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
