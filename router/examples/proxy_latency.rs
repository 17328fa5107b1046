//! Added proxy latency with 200 concurrent streams: a stand-in pod streams each answer as an LLM
//! does — one SSE event per token, paced (`TOKEN_INTERVAL`) — and 200 clients keep one stream
//! each in flight, first straight to the pod, then through the router (one pod registered). For
//! every request we time the first event (what a user waits for) and the whole answer; the
//! router's added latency is the difference of the two runs' percentiles. Everything runs in one
//! process on loopback, so client, router and pod share the cores; with paced streams the cores
//! are not saturated, so the difference is the router's own cost per request and per event.
//!
//! `cargo run --release -p kvsight-router --example proxy_latency [streams] [requests-per-stream]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::post;
use axum::serve::ListenerExt;
use kvsight_harness::messages;
use kvsight_protocol::messages::*;
use kvsight_router::config::RouterConfig;
use kvsight_router::{State, app};
use tokio_util::sync::CancellationToken;

/// Tokens per answer and the time between two tokens (≈ 50 tokens/s, a mid-size model's decode).
const EVENTS: usize = 16;
const TOKEN_INTERVAL: Duration = Duration::from_millis(20);

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
            let events = futures_util::stream::unfold(0usize, |i| async move {
                if i > EVENTS {
                    return None;
                }
                if i > 0 {
                    tokio::time::sleep(TOKEN_INTERVAL).await;
                }
                let event = if i == EVENTS {
                    Bytes::from_static(b"data: [DONE]\n\n")
                } else {
                    Bytes::from(format!(
                        "data: {{\"choices\":[{{\"index\":0,\"text\":\"t{i}\"}}]}}\n\n"
                    ))
                };
                Some((Ok::<_, std::io::Error>(event), i + 1))
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(events))
                .unwrap()
        }),
    ))
    .await
}

fn hello(url: &str) -> Hello {
    Hello {
        pod: PodIdentity {
            namespace: "bench".into(),
            ..messages::hello("p", url).pod
        },
        engine: EngineFacts {
            num_gpu_blocks: 100_000,
            max_num_seqs: 1024,
            max_model_len: 32_768,
            ..messages::engine()
        },
        sidecar_version: "bench".into(),
        load_interval_ms: 3_600_000,
        ..messages::hello("p", url)
    }
}

/// First-event and whole-answer latencies of every request, each sorted.
struct Timings {
    first: Vec<Duration>,
    whole: Vec<Duration>,
}

/// One client per target, reused from the warm-up on, so the measured requests find their
/// connections open (200 simultaneous connects would otherwise land in the p99).
fn client(streams: usize) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(streams)
        .build()
        .unwrap()
}

async fn run(client: &reqwest::Client, url: &str, streams: usize, per: usize) -> Timings {
    let body =
        r#"{"model":"m","prompt":"Hello, how are you today? Tell me about caches.","stream":true}"#;
    let mut tasks = Vec::new();
    // Users do not arrive in lockstep: stream i starts i/streams of one answer's duration late,
    // so the 200 streams' token events spread over time instead of landing as one burst.
    let answer = TOKEN_INTERVAL * EVENTS as u32;
    for i in 0..streams {
        let (client, url) = (client.clone(), format!("{url}/v1/completions"));
        let start = answer * i as u32 / streams as u32;
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(start).await;
            let mut out = Vec::with_capacity(per);
            for _ in 0..per {
                let t = Instant::now();
                let mut resp = client.post(&url).body(body).send().await.unwrap();
                let mut first = None;
                let mut text = Vec::new();
                while let Some(chunk) = resp.chunk().await.unwrap() {
                    first.get_or_insert_with(|| t.elapsed());
                    text.extend_from_slice(&chunk);
                }
                assert!(text.ends_with(b"data: [DONE]\n\n"));
                out.push((first.unwrap(), t.elapsed()));
            }
            out
        }));
    }
    let (mut first, mut whole) = (Vec::new(), Vec::new());
    for t in tasks {
        for (f, w) in t.await.unwrap() {
            first.push(f);
            whole.push(w);
        }
    }
    first.sort();
    whole.sort();
    Timings { first, whole }
}

fn pct(v: &[Duration], p: usize) -> Duration {
    v[(v.len() * p / 100).min(v.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
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
        let load = messages::idle_load();
        reg.apply_load(&key, conn, load, Instant::now()).unwrap();
    }
    let router = serve(app(Arc::clone(&state))).await;
    // Warm both paths (connection pools) before measuring.
    let (to_pod, to_router) = (client(streams), client(streams));
    run(&to_pod, &pod, streams, 2).await;
    run(&to_router, &router, streams, 2).await;
    let direct = run(&to_pod, &pod, streams, per).await;
    let via = run(&to_router, &router, streams, per).await;
    println!(
        "{streams} concurrent streams x {per} requests, {EVENTS} SSE events {:?} apart",
        TOKEN_INTERVAL
    );
    println!("         first event p50 / p99       whole answer p50 / p99");
    for (name, t) in [("direct", &direct), ("router", &via)] {
        println!(
            "{name:<8} {} / {}        {} / {}",
            ms(pct(&t.first, 50)),
            ms(pct(&t.first, 99)),
            ms(pct(&t.whole, 50)),
            ms(pct(&t.whole, 99))
        );
    }
    let added = |a: &[Duration], b: &[Duration], p| ms(pct(a, p).saturating_sub(pct(b, p)));
    println!(
        "added by the router: first event p50 {} p99 {}; whole answer p50 {} p99 {}",
        added(&via.first, &direct.first, 50),
        added(&via.first, &direct.first, 99),
        added(&via.whole, &direct.whole, 50),
        added(&via.whole, &direct.whole, 99)
    );
}
