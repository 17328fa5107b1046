//! What a router that cannot see would do — the baseline every scenario compares kvsight with.
//!
//! It knows the pods' URLs and the requests it has in flight itself, nothing else: no engine
//! load, no cache contents, no warm-up state, no traffic that bypassed it. That is what a
//! round-robin Kubernetes Service or a least-request load balancer (Envoy's, a gateway's default
//! picker) sees.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::Value;

use super::{ClusterError, Routed, post_json};

/// How the blind router picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlindMode {
    /// The next pod in turn.
    RoundRobin,
    /// The pod with the fewest of *this router's* requests in flight; ties go to the first pod.
    LeastRequest,
    /// The pod with the shortest queue by the engines' own counts (waiting, then running, read
    /// from each pod's `/metrics` at the pick): what a load-aware router without a cache view
    /// falls back to when every pod is saturated (docs/decisions/0002-saturation-in-time.md).
    ShortestQueue,
}

/// A picker over fixed pod URLs that sends straight to vLLM.
#[derive(Debug)]
pub struct BlindRouter {
    urls: Vec<String>,
    mode: BlindMode,
    inflight: Mutex<Vec<u32>>,
    next: AtomicUsize,
    http: reqwest::Client,
}

impl BlindRouter {
    /// `urls` are the pods' vLLM base URLs, in the order ties are broken.
    pub fn new(urls: Vec<String>, mode: BlindMode) -> Result<BlindRouter, ClusterError> {
        Ok(BlindRouter {
            inflight: Mutex::new(vec![0; urls.len()]),
            urls,
            mode,
            next: AtomicUsize::new(0),
            http: reqwest::Client::builder().no_proxy().build()?,
        })
    }

    /// Picks a pod and counts the request in flight there, under one lock so concurrent picks
    /// see each other; `queues` are the engines' (waiting, running) for the shortest queue.
    fn start(&self, queues: &[(u64, u64)]) -> usize {
        let mut inflight = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        let i = match self.mode {
            BlindMode::RoundRobin => self.next.fetch_add(1, Ordering::Relaxed) % self.urls.len(),
            BlindMode::LeastRequest => (0..self.urls.len())
                .min_by_key(|&i| (inflight[i], i))
                .unwrap_or(0),
            BlindMode::ShortestQueue => (0..self.urls.len())
                .min_by_key(|&i| (queues.get(i).copied().unwrap_or_default(), inflight[i], i))
                .unwrap_or(0),
        };
        inflight[i] += 1;
        i
    }

    /// Every pod's (waiting, running) from its own `/metrics`.
    async fn queues(&self) -> Result<Vec<(u64, u64)>, ClusterError> {
        let mut out = Vec::with_capacity(self.urls.len());
        for url in &self.urls {
            let text = self
                .http
                .get(format!("{url}/metrics"))
                .send()
                .await?
                .text()
                .await?;
            let c = super::parse_counters(&text).map_err(|message| ClusterError::Pod {
                pod: url.clone(),
                message,
            })?;
            out.push((c.waiting as u64, c.running as u64));
        }
        Ok(out)
    }

    fn finish(&self, i: usize) {
        let mut inflight = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        inflight[i] = inflight[i].saturating_sub(1);
    }

    /// Picks a pod and POSTs `body` to `path` there; returns the pod's index and the outcome.
    pub async fn post(&self, path: &str, body: &Value) -> Result<(usize, Routed), ClusterError> {
        let queues = match self.mode {
            BlindMode::ShortestQueue => self.queues().await?,
            _ => Vec::new(),
        };
        let i = self.start(&queues);
        let result = post_json(&self.http, &format!("{}{path}", self.urls[i]), body).await;
        self.finish(i);
        Ok((i, result?))
    }
}

/// A connection-level (L4) balancer, as a Kubernetes Service with kube-proxy or a TCP load
/// balancer works: each accepted connection is sent, whole, to the next backend in turn; bytes
/// are copied both ways until either side closes. It never sees a request, so a kept-alive
/// connection stays on the pod it was given, whatever joins later.
#[derive(Debug)]
pub struct L4Balancer {
    addr: std::net::SocketAddr,
    targets: std::sync::Arc<Mutex<Vec<std::net::SocketAddr>>>,
    task: tokio::task::JoinHandle<()>,
}

impl L4Balancer {
    /// Listens on an ephemeral loopback port and balances over `targets`.
    pub async fn start(targets: Vec<std::net::SocketAddr>) -> Result<L4Balancer, ClusterError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|source| ClusterError::Io {
                what: "binding the L4 balancer".into(),
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| ClusterError::Io {
            what: "the L4 balancer's address".into(),
            source,
        })?;
        let targets = std::sync::Arc::new(Mutex::new(targets));
        let list = std::sync::Arc::clone(&targets);
        let task = tokio::spawn(async move {
            let mut next = 0usize;
            while let Ok((mut client, _)) = listener.accept().await {
                let target = {
                    let t = list.lock().unwrap_or_else(|e| e.into_inner());
                    if t.is_empty() {
                        continue;
                    }
                    next += 1;
                    t[(next - 1) % t.len()]
                };
                tokio::spawn(async move {
                    if let Ok(mut upstream) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                    }
                });
            }
        });
        Ok(L4Balancer {
            addr,
            targets,
            task,
        })
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// A backend joins (new connections may be sent to it).
    pub fn add_target(&self, target: std::net::SocketAddr) {
        self.targets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(target);
    }
}

impl Drop for L4Balancer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
