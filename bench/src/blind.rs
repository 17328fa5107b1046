//! The blind baselines as an HTTP router process: round robin, or least request over its own
//! in-flight count only — what a Kubernetes Service or a gateway's default picker does. Requests
//! are forwarded unchanged and answers streamed back as they come. Workers can be added and
//! removed (`POST /add_worker?url=`, `/remove_worker?url=`), as an endpoint controller would.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::serve::ListenerExt;
use futures_util::StreamExt;

/// How the blind router picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    RoundRobin,
    LeastRequest,
}

struct Blind {
    /// Each worker's URL and this router's requests in flight there.
    workers: Mutex<Vec<(String, u32)>>,
    mode: Mode,
    next: AtomicUsize,
    http: reqwest::Client,
}

impl Blind {
    fn pick(&self) -> Option<String> {
        let mut workers = self.workers.lock().unwrap_or_else(|e| e.into_inner());
        let n = workers.len();
        if n == 0 {
            return None;
        }
        // Rotates where ties start, so an idle cluster is not all sent to the first pod.
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        let i = match self.mode {
            Mode::RoundRobin => turn % n,
            Mode::LeastRequest => (0..n)
                .min_by_key(|&i| (workers[i].1, (i + n - turn % n) % n))
                .unwrap_or(0),
        };
        workers[i].1 += 1;
        Some(workers[i].0.clone())
    }

    fn done(&self, url: &str) {
        let mut workers = self.workers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = workers.iter_mut().find(|w| w.0 == url) {
            w.1 = w.1.saturating_sub(1);
        }
    }
}

/// Decrements the pod's in-flight count when the answer's body is dropped (finished or cut).
struct Guard(Arc<Blind>, String);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.done(&self.1);
    }
}

#[derive(serde::Deserialize)]
struct WorkerQuery {
    url: String,
}

async fn add_worker(
    State(b): State<Arc<Blind>>,
    axum::extract::Query(q): axum::extract::Query<WorkerQuery>,
) -> StatusCode {
    let mut workers = b.workers.lock().unwrap_or_else(|e| e.into_inner());
    if !workers.iter().any(|w| w.0 == q.url) {
        workers.push((q.url, 0));
    }
    StatusCode::OK
}

async fn remove_worker(
    State(b): State<Arc<Blind>>,
    axum::extract::Query(q): axum::extract::Query<WorkerQuery>,
) -> StatusCode {
    b.workers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|w| w.0 != q.url);
    StatusCode::OK
}

/// Serves until the process is killed.
pub async fn serve(listen: SocketAddr, workers: Vec<String>, mode: Mode) -> anyhow::Result<()> {
    anyhow::ensure!(!workers.is_empty(), "no --worker given");
    let state = Arc::new(Blind {
        workers: Mutex::new(workers.into_iter().map(|w| (w, 0)).collect()),
        mode,
        next: AtomicUsize::new(0),
        http: reqwest::Client::builder().no_proxy().build()?,
    });
    let app = Router::new()
        .route("/health", axum::routing::get(|| async { "ok" }))
        .route("/add_worker", axum::routing::post(add_worker))
        .route("/remove_worker", axum::routing::post(remove_worker))
        .fallback(forward)
        .with_state(state);
    // TCP_NODELAY as the kvsight router sets it: a stream is many small writes, and with Nagle's
    // algorithm each waits for the client's delayed ACK of the one before (~40 ms), which would
    // be charged to this baseline as "added latency".
    let listener = tokio::net::TcpListener::bind(listen).await?.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).await?;
    Ok(())
}

async fn forward(
    State(b): State<Arc<Blind>>,
    method: axum::http::Method,
    uri: Uri,
    headers: HeaderMap,
    body: bytes::Bytes,
) -> Response {
    let Some(worker) = b.pick() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "no worker").into_response();
    };
    let url = format!(
        "{}{}",
        worker.trim_end_matches('/'),
        uri.path_and_query().map_or("/", |p| p.as_str())
    );
    let guard = Guard(b.clone(), worker);
    let mut req = b.http.request(method, url).body(body);
    if let Some(ct) = headers.get("content-type") {
        req = req.header("content-type", ct);
    }
    let up = match req.send().await {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    };
    let status = up.status();
    let ct = up.headers().get("content-type").cloned();
    let stream = up.bytes_stream().map(move |c| {
        let _keep = &guard;
        c
    });
    let mut resp = Response::new(Body::from_stream(stream));
    *resp.status_mut() = status;
    if let Some(ct) = ct {
        resp.headers_mut().insert("content-type", ct);
    }
    resp
}
