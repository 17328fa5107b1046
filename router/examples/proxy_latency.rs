//! Added proxy latency: 200 concurrent streaming clients call a stand-in pod directly, then
//! through the router (one pod registered), and the p50/p99 request latencies are compared.
//! Everything runs in one process on loopback, so client, router and pod share the cores.
//!
//! `cargo run --release -p kvsight-router --example proxy_latency [streams] [requests-per-stream]`

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::post;
use axum::serve::ListenerExt;
use kvsight_protocol::messages::*;
use kvsight_router::config::RouterConfig;
use kvsight_router::{State, app};
use tokio_util::sync::CancellationToken;

const EVENTS: usize = 8;

async fn serve(router: Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    // As `kvsight_router::run` serves: TCP_NODELAY on every accepted socket.
    let l = l.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(l, router).await });
    format!("http://{addr}")
}

async fn pod() -> String {
    serve(Router::new().route(
        "/v1/completions",
        post(|| async {
            let events = (0..EVENTS)
                .map(|i| {
                    Ok::<_, std::io::Error>(Bytes::from(format!(
                        "data: {{\"choices\":[{{\"index\":0,\"text\":\"t{i}\"}}]}}\n\n"
                    )))
                })
                .chain(std::iter::once(Ok(Bytes::from_static(b"data: [DONE]\n\n"))));
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(futures_util::stream::iter(events)))
                .unwrap()
        }),
    ))
    .await
}

fn hello(url: &str) -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        instance_id: 1,
        pod: PodIdentity {
            name: "p".into(),
            namespace: "bench".into(),
            url: url.into(),
            labels: BTreeMap::new(),
        },
        engine: EngineFacts {
            block_size: 16,
            num_gpu_blocks: 100_000,
            prefix_caching: true,
            max_num_seqs: 1024,
            max_model_len: 32_768,
            max_num_batched_tokens: None,
            engine_version: "0.33.0".into(),
        },
        models: vec!["m".into()],
        lora_adapters: vec![],
        tokenizer: None,
        sidecar_version: "bench".into(),
        load_interval_ms: 3_600_000,
    }
}

async fn run(url: &str, streams: usize, per: usize) -> Vec<Duration> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(streams)
        .build()
        .unwrap();
    let body =
        r#"{"model":"m","prompt":"Hello, how are you today? Tell me about caches.","stream":true}"#;
    let mut tasks = Vec::new();
    for _ in 0..streams {
        let (client, url) = (client.clone(), format!("{url}/v1/completions"));
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::with_capacity(per);
            for _ in 0..per {
                let t = Instant::now();
                let text = client
                    .post(&url)
                    .body(body)
                    .send()
                    .await
                    .unwrap()
                    .text()
                    .await
                    .unwrap();
                assert!(text.ends_with("data: [DONE]\n\n"));
                out.push(t.elapsed());
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort();
    all
}

fn pct(v: &[Duration], p: usize) -> Duration {
    v[(v.len() * p / 100).min(v.len() - 1)]
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let streams: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(200);
    let per: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(20);
    let pod = pod().await;
    let state = State::new(
        RouterConfig::default(),
        "bench".into(),
        None,
        CancellationToken::new(),
    )
    .unwrap();
    {
        let mut reg = state.registry();
        let (key, conn) = reg.register(hello(&pod), Instant::now());
        let load = Load {
            seq: 1,
            sample_age_ms: 0,
            phase: Phase::Ready,
            cache_view: CacheView::Exact,
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            unrouted: 0,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            preemptions: 0,
            prefill_tokens_per_s: None,
            lora_running: vec![],
            lora_waiting: vec![],
        };
        reg.apply_load(&key, conn, load, Instant::now()).unwrap();
    }
    let router = serve(app(Arc::clone(&state))).await;
    // Warm both paths (connection pools) before measuring.
    run(&pod, streams, 2).await;
    run(&router, streams, 2).await;
    let direct = run(&pod, streams, per).await;
    let via = run(&router, streams, per).await;
    println!("{streams} concurrent streams x {per} requests, {EVENTS} SSE events each");
    println!(
        "direct : p50 {:?} p99 {:?}",
        pct(&direct, 50),
        pct(&direct, 99)
    );
    println!("router : p50 {:?} p99 {:?}", pct(&via, 50), pct(&via, 99));
    println!(
        "added at p50: {:?}",
        pct(&via, 50).saturating_sub(pct(&direct, 50))
    );
}
