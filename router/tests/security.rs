//! What a client of the API can make the router spend or see, over real loopback sockets against
//! the router's own server (`kvsight_router::server::serve`) and vllm-sim pods: request bodies
//! are read in bounded memory and every field the chat template renders counts as prompt; heavy
//! work waits in its own pool while probes answer; a client that stops reading is cut off; the
//! API shows no admin surface and no decision header unless configured; a 502 keeps the pod's
//! address to itself; the head limit holds for a head sent in one write; a pod's answer read
//! whole is bounded in time.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use common::*;
use kvsight_router::State;
use kvsight_sim::engine::EngineConfig;
use kvsight_sim::server::{SimConfig, SimPod, SimPodHandle};

/// Bound on every wait for the router in these tests.
const WAIT: Duration = Duration::from_secs(20);

/// The router's real server on `127.0.0.1:0` with `yaml` as config, built like the binary's
/// (no decision header unless asked), with a Ready pod at each of `pods`.
async fn router(yaml: &str, pods: &[&str]) -> Running {
    let cfg = config_or_default(yaml);
    let st = State::new(cfg, "r".into(), None, CancellationToken::new()).unwrap();
    for (i, url) in pods.iter().enumerate() {
        add_pod(&st, &format!("p{i}"), url, &[], 0);
    }
    serve_router(st).await
}

/// A vllm-sim pod serving [`MODEL`], steps a thousand times faster than the cost model.
async fn sim() -> SimPodHandle {
    SimPod::start(SimConfig {
        served_model_names: vec![MODEL.into()],
        engine: EngineConfig::builder()
            .compile_stall(Duration::ZERO)
            .time_scale(0.001)
            .max_model_len(65536)
            .num_gpu_blocks(8192)
            .build()
            .unwrap(),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

fn http() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// Waits, bounded (WAIT in 10 ms steps), until `cond` holds.
async fn until(what: &str, cond: impl FnMut() -> bool) {
    until_within(what, WAIT, cond).await;
}

/// The answer to one request on a fresh connection: status and body (bounded in time).
async fn raw(addr: SocketAddr, bytes: &[u8]) -> (u16, String, String) {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(bytes).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(WAIT, tcp.read_to_end(&mut buf))
        .await
        .expect("the router answers in time")
        .unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap();
    (status, head.to_owned(), body.to_owned())
}

/// Every field vLLM's chat template renders, and token ids, count toward `promptBytes`: 2 KiB in
/// any one of them is refused under a 1 KiB limit before a pod sees it.
#[tokio::test]
async fn prompt_bytes_count_every_field_the_template_renders_and_token_ids() {
    let pod = sim().await;
    let r = router("limits: {promptBytes: 1024}", &[&pod.base_url()]).await;
    let text = "word ".repeat(410);
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let ids: Vec<u32> = (0..500).collect();
    let bodies = [
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": msgs, "tools": [{"type": "function",
                "function": {"name": "f", "description": text, "parameters": {}}}]}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": msgs, "documents": [{"title": "t", "text": text}]}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": msgs, "chat_template_kwargs": {"system": text}}),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": ids, "max_tokens": 1}),
        ),
    ];
    for (i, (path, body)) in bodies.iter().enumerate() {
        let (status, head, answer) = raw(r.addr, &post_request(path, &body.to_string(), "")).await;
        assert_eq!(status, 400, "{body}: {head}\n{answer}");
        let v: Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(v["error"]["param"], "prompt", "{v}");
        assert_eq!(
            metric(
                &r.state,
                r#"kvsight_router_refused_total{reason="prompt_bytes"}"#
            ),
            (i + 1) as f64
        );
    }
    // Within the limit the same shapes pass.
    let body = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1});
    let (status, head, _) = raw(
        r.addr,
        &post_request("/v1/completions", &body.to_string(), ""),
    )
    .await;
    assert_eq!(status, 200, "{head}");
}

/// Large prompts are tokenized in the heavy pool: while one runs and more wait, `/health`
/// answers at once (before any of them is done); over the queue, a request is refused 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_while_heavy_work_is_queued_and_a_full_queue_is_503() {
    let Some(files) = own_files("health_answers_while_heavy_work_is_queued") else {
        return;
    };
    let r = router(
        "limits: {heavyWorkers: 1, heavyQueue: 2}",
        &["http://127.0.0.1:9"],
    )
    .await;
    r.state.tokenizers.insert(
        MODEL,
        files.digest(),
        kvsight_router::tokenize::model_tokenizer(&files).unwrap(),
    );
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(40_000);
    let body = json!({"model": MODEL, "prompt": prompt}).to_string();
    let url = format!("http://{}/tokenize", r.addr);
    let tasks: Vec<_> = (0..3)
        .map(|_| {
            let (url, body) = (url.clone(), body.clone());
            tokio::spawn(async move { http().post(url).body(body).send().await.unwrap() })
        })
        .collect();
    // One running, two waiting: the pool and its queue are full.
    until("three heavy jobs admitted", || {
        metric(&r.state, "kvsight_router_heavy_jobs") >= 3.0
    })
    .await;
    let health = http()
        .get(format!("http://{}/health", r.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    assert!(
        tasks.iter().all(|t| !t.is_finished()),
        "/health waited for the tokenizing"
    );
    let busy = http().post(&url).body(body.clone()).send().await.unwrap();
    assert_eq!(busy.status(), 503);
    assert_eq!(busy.headers()["retry-after"], "1");
    let v: Value = serde_json::from_slice(&busy.bytes().await.unwrap()).unwrap();
    assert_eq!(v["error"]["code"], 503, "{v}");
    assert_eq!(
        metric(
            &r.state,
            r#"kvsight_router_refused_total{reason="heavy_queue"}"#
        ),
        1.0
    );
    for t in tasks {
        let resp = tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("the queued work finishes")
            .unwrap();
        assert_eq!(resp.status(), 200);
        let v: Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
        assert!(v["count"].as_u64().unwrap() > 300_000, "{}", v["count"]);
    }
}

/// A client that stops reading a stream is cut off after `clientWriteSeconds`: the connection
/// closes and the pod's request is aborted, long before `requestSeconds`.
#[tokio::test]
async fn a_client_that_stops_reading_is_cut_off_and_the_pod_request_aborted() {
    let pod = sim().await;
    let r = router(
        "timeouts: {clientWriteSeconds: 0.5, requestSeconds: 3600}",
        &[&pod.base_url()],
    )
    .await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut tcp = socket.connect(r.addr).await.unwrap();
    let body = json!({"model": MODEL, "prompt": "Tell me everything", "max_tokens": 60000,
                      "ignore_eos": true, "stream": true});
    tcp.write_all(&post_request("/v1/completions", &body.to_string(), ""))
        .await
        .unwrap();
    let mut first = [0u8; 64];
    let n = tcp.read(&mut first).await.unwrap();
    assert!(
        String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&first[..n])
    );
    // Then the client reads nothing more.
    until("the stalled client to be cut off", || {
        metric(
            &r.state,
            r#"kvsight_router_refused_total{reason="client_write_time"}"#,
        ) >= 1.0
    })
    .await;
    let running = || async {
        let text =
            kvsight_harness::http::get_text(&http(), &format!("{}/metrics", pod.base_url())).await;
        text.lines()
            .find(|l| l.starts_with("vllm:num_requests_running"))
            .and_then(|l| l.rsplit(' ').next())
            .map_or(-1.0, |v| v.parse::<f64>().unwrap())
    };
    let end = Instant::now() + WAIT;
    while running().await != 0.0 {
        assert!(Instant::now() < end, "the pod's request was not aborted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(tcp);
}

/// The API listener serves no admin surface, and `x-kvsight-debug` is ignored unless the
/// operator turned the decision header on.
#[tokio::test]
async fn the_api_shows_no_admin_surface_and_ignores_the_debug_header() {
    let pod = sim().await;
    let r = router("", &[&pod.base_url()]).await;
    for path in ["/metrics", "/debug/pods"] {
        let (status, head, body) = raw(
            r.addr,
            format!("GET {path} HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert_eq!(status, 404, "{path}: {head}");
        assert!(!body.contains(&pod.base_url()), "{body}");
    }
    let body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 1}).to_string();
    let (status, head, _) = raw(
        r.addr,
        &post_request("/v1/completions", &body, "x-kvsight-debug: 1\r\n"),
    )
    .await;
    assert_eq!(status, 200, "{head}");
    assert!(
        !head.to_ascii_lowercase().contains("x-kvsight-decision"),
        "{head}"
    );
}

/// A pod that accepts the connection and closes it: the 502 names the pod, never its address
/// (on the proxied paths and on a forwarded `/tokenize`).
#[tokio::test]
async fn a_502_does_not_name_the_pods_address() {
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = dead.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = dead.accept().await {
            drop(tcp);
        }
    });
    let r = router("", &[&format!("http://{addr}")]).await;
    let body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 1}).to_string();
    for path in ["/v1/completions", "/tokenize"] {
        let (status, head, answer) = raw(r.addr, &post_request(path, &body, "")).await;
        assert_eq!(status, 502, "{path}: {head}\n{answer}");
        assert!(!answer.contains(&addr.to_string()), "{path}: {answer}");
        assert!(!answer.contains("127.0.0.1"), "{path}: {answer}");
        let v: Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(v["error"]["code"], 502, "{v}");
    }
}

/// `limits.headerBytes` holds for a head that arrives in one write (hyper's own bound applies to
/// its read buffer, which one large read can pass).
#[tokio::test]
async fn a_head_over_the_limit_is_431_even_in_one_write() {
    let r = router("", &[]).await;
    let mut req = String::from("GET /v1/models HTTP/1.1\r\nHost: r\r\n");
    for i in 0..25 {
        req.push_str(&format!("x-filler-{i}: {}\r\n", "a".repeat(4000)));
    }
    req.push_str("Connection: close\r\n\r\n");
    assert!(req.len() > 100_000 && req.len() < 110_000);
    let (status, head, body) = raw(r.addr, req.as_bytes()).await;
    assert_eq!(status, 431, "{head}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], 431, "{v}");
}

/// A pod whose `/tokenize` answer stalls mid-body: the router gives up after
/// `bodyReadSeconds` with a 502, not after `requestSeconds`.
#[tokio::test]
async fn a_forwarded_tokenize_answer_is_read_within_the_body_read_timeout() {
    let stalled = Router::new().route(
        "/tokenize",
        post(|| async {
            let first = futures_util::stream::once(async {
                Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"{\"tokens\":[1,"))
            });
            let never = futures_util::stream::pending();
            axum::response::Response::builder()
                .header("content-type", "application/json")
                .body(Body::from_stream(futures_util::StreamExt::chain(
                    first, never,
                )))
                .unwrap()
        }),
    );
    let pod = format!("http://{}", serve(stalled).await);
    let r = router(
        "timeouts: {bodyReadSeconds: 0.3, requestSeconds: 3600}",
        &[&pod],
    )
    .await;
    let body = json!({"model": MODEL, "prompt": "hi"}).to_string();
    let (status, head, answer) = raw(r.addr, &post_request("/tokenize", &body, "")).await;
    assert_eq!(status, 502, "{head}\n{answer}");
    assert!(answer.contains("did not arrive"), "{answer}");
}
