//! The proxy over real loopback sockets: small axum servers stand in for vLLM pods, the router
//! app is served on `127.0.0.1:0`, and a reqwest client plays the OpenAI client. Covers SSE
//! passthrough chunk by chunk, the cut-stream error event (deadline and upstream death), 504
//! before the first byte, the two allowed retries and hot reload.

mod common;

use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use common::*;
use kvsight_router::config::RouterConfig;

type Chunk = Result<Bytes, io::Error>;

/// What a fake pod saw: headers and body of each request.
type Seen = mpsc::UnboundedReceiver<(HeaderMap, Bytes)>;

/// A pod whose `/v1/completions` streams whatever the test pushes into the returned sender.
async fn streaming_pod() -> (String, mpsc::Sender<Chunk>, Seen) {
    let (tx, rx) = mpsc::channel::<Chunk>(8);
    let (seen_tx, seen) = mpsc::unbounded_channel();
    let rx = Arc::new(Mutex::new(Some(rx)));
    let router = Router::new().route(
        "/v1/completions",
        post(move |headers: HeaderMap, body: Bytes| {
            let rx = rx.lock().unwrap().take();
            let _ = seen_tx.send((headers, body));
            async move {
                let Some(rx) = rx else {
                    return StatusCode::CONFLICT.into_response();
                };
                Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(
                        tokio_stream::wrappers::ReceiverStream::new(rx),
                    ))
                    .unwrap()
            }
        }),
    );
    let addr = serve(router).await;
    (format!("http://{addr}"), tx, seen)
}

/// A pod answering every completion with `status` and `body` (JSON), naming itself in a header.
async fn fixed_pod(name: &'static str, status: StatusCode, body: Value) -> String {
    let router = Router::new().route(
        "/v1/completions",
        post(move || {
            let body = body.clone();
            async move { (status, [("x-pod", name)], axum::Json(body)).into_response() }
        }),
    );
    format!("http://{}", serve(router).await)
}

/// A pod that never answers.
async fn silent_pod() -> String {
    let router = Router::new().route("/v1/completions", post(std::future::pending::<StatusCode>));
    format!("http://{}", serve(router).await)
}

async fn router_for(cfg: RouterConfig) -> (Arc<kvsight_router::State>, String) {
    let st = state(cfg);
    let addr = serve(app_and_admin(st.clone())).await;
    (st, format!("http://{addr}"))
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

const BODY: &str =
    r#"{"model":"m","prompt":"Hello there, general Kenobi","stream":true,"max_tokens":5}"#;

async fn metrics(router: &str) -> String {
    kvsight_harness::http::get_text(&client(), &format!("{router}/metrics")).await
}

/// Reads the rest of a response body, bounded in time.
async fn rest(resp: reqwest::Response) -> String {
    tokio::time::timeout(Duration::from_secs(10), resp.text())
        .await
        .expect("body ends within 10 s")
        .unwrap()
}

/// The rest of a response body, parsed as JSON.
async fn rest_json(resp: reqwest::Response) -> Value {
    serde_json::from_str(&rest(resp).await).unwrap()
}

/// The next chunk of a response body: it must come within 5 s and the body must not be over.
async fn next_chunk(resp: &mut reqwest::Response) -> Bytes {
    tokio::time::timeout(Duration::from_secs(5), resp.chunk())
        .await
        .expect("chunk forwarded while the stream is open")
        .unwrap()
        .unwrap()
}

/// Posts `BODY` as a completion to the router, as a client would.
async fn complete(router: &str) -> reqwest::Response {
    client()
        .post(format!("{router}/v1/completions"))
        .body(BODY)
        .send()
        .await
        .unwrap()
}

/// A router with `cfg` whose only pod, `ns/a`, is a [`streaming_pod`].
async fn router_with_streaming_pod(
    cfg: RouterConfig,
) -> (
    Arc<kvsight_router::State>,
    String,
    mpsc::Sender<Chunk>,
    Seen,
) {
    let (pod, tx, seen) = streaming_pod().await;
    let (st, router) = router_for(cfg).await;
    add_pod(&st, "a", &pod, &[], 0);
    (st, router, tx, seen)
}

/// How many requests the router counts in flight on `ns/a`.
fn inflight(st: &kvsight_router::State) -> u32 {
    st.registry().get("ns/a").unwrap().inflight
}

/// Waits until `ns/a` has nothing in flight, at most 5 s (the router records a request as done
/// on its own task, right after the response ends), and asserts that it got there.
async fn assert_inflight_settles_to_zero(st: &kvsight_router::State) {
    for _ in 0..500 {
        if inflight(st) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(inflight(st), 0);
}

/// Asserts that the router's `/metrics` contain `line`.
async fn assert_metrics_contain(router: &str, line: &str) {
    let m = metrics(router).await;
    assert!(m.contains(line), "{m}");
}

/// The `kvsight_router_requests_total` samples, label sets only (every value must be 1 here:
/// a request is counted once however many attempts it took).
async fn requests_counted(router: &str) -> Vec<String> {
    let m = metrics(router).await;
    m.lines()
        .filter_map(|l| l.strip_prefix("kvsight_router_requests_total"))
        .map(|l| {
            let (labels, value) = l.rsplit_once(' ').unwrap();
            assert_eq!(value, "1", "{m}");
            labels.to_owned()
        })
        .collect()
}

#[tokio::test]
async fn sse_passes_through_chunk_by_chunk_with_request_id_and_unchanged_body() {
    let (st, router, tx, mut seen) = router_with_streaming_pod(RouterConfig::default()).await;
    let mut resp = client()
        .post(format!("{router}/v1/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", "req-42")
        .header("x-kvsight-debug", "1")
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "req-42");
    let decision: Value =
        serde_json::from_str(resp.headers()["x-kvsight-decision"].to_str().unwrap()).unwrap();
    assert_eq!(decision["pod"], "ns/a");
    assert!(decision["scores"].is_object(), "{decision}");
    assert_eq!(decision["prefix_mode"], "approximate");
    let (headers, body) = seen.recv().await.unwrap();
    assert_eq!(body, BODY.as_bytes(), "the body is forwarded unchanged");
    assert_eq!(headers["x-request-id"], "req-42");
    assert!(headers.get("x-kvsight-debug").is_none());
    // Each chunk reaches the client before the next one exists: nothing is buffered whole.
    for i in 0..3 {
        let ev = format!("data: {{\"choices\":[{{\"text\":\"t{i}\"}}]}}\n\n");
        tx.send(Ok(Bytes::from(ev.clone()))).await.unwrap();
        assert_eq!(next_chunk(&mut resp).await, ev.as_bytes());
    }
    tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n")))
        .await
        .unwrap();
    drop(tx);
    assert_eq!(rest(resp).await, "data: [DONE]\n\n");
    // record_done ran: nothing in flight any more (the pump finishes right after the body).
    assert_inflight_settles_to_zero(&st).await;
}

/// Until its first event, a streamed request waits on its pod (`Pod::oldest_awaiting`, what the
/// scheduler reads as the pod's real queue); the first event ends the wait.
#[tokio::test]
async fn a_stream_waits_on_its_pod_until_its_first_event() {
    let (st, router, tx, _seen) = router_with_streaming_pod(RouterConfig::default()).await;
    let waited = |st: &kvsight_router::State| {
        st.registry()
            .get("ns/a")
            .unwrap()
            .oldest_awaiting(std::time::Instant::now())
    };
    assert_eq!(waited(&st), Duration::ZERO);
    // The pod's headers are in, its first token not yet.
    let mut resp = complete(&router).await;
    assert_eq!(resp.status(), 200);
    assert!(waited(&st) > Duration::ZERO, "the stream waits");
    let ev = "data: {\"choices\":[{\"text\":\"t0\"}]}\n\n";
    tx.send(Ok(Bytes::from_static(ev.as_bytes())))
        .await
        .unwrap();
    // The router records the start before it forwards the event.
    assert_eq!(next_chunk(&mut resp).await, ev.as_bytes());
    assert_eq!(
        waited(&st),
        Duration::ZERO,
        "its first event ended the wait"
    );
    drop(tx);
    rest(resp).await;
    assert_inflight_settles_to_zero(&st).await;
}

fn assert_cut(text: &str, code: u16) {
    assert!(
        !text.contains("finish_reason"),
        "no made-up finish_reason: {text}"
    );
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{text}");
    let err = events[events.len() - 2]
        .strip_prefix("data: ")
        .expect("error event is an SSE data line");
    let v: Value = serde_json::from_str(err).unwrap();
    assert_eq!(v["error"]["code"], json!(code), "{v}");
}

#[tokio::test]
async fn the_deadline_cuts_a_started_stream_with_an_error_event() {
    let (_st, router, tx, _seen) =
        router_with_streaming_pod(config_yaml("timeouts:\n  requestSeconds: 0.5\n")).await;
    let resp = complete(&router).await;
    // Half an event, then silence: the error event must start on its own line.
    tx.send(Ok(Bytes::from_static(
        b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"cho",
    )))
    .await
    .unwrap();
    let text = rest(resp).await;
    assert!(
        text.starts_with("data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"cho\n\n"),
        "{text}"
    );
    assert_cut(&text, 504);
    assert_metrics_contain(
        &router,
        r#"kvsight_router_stream_cuts_total{reason="deadline"} 1"#,
    )
    .await;
    drop(tx);
}

#[tokio::test]
async fn upstream_death_mid_stream_ends_with_an_error_event() {
    let (_st, router, tx, _seen) = router_with_streaming_pod(RouterConfig::default()).await;
    let mut resp = complete(&router).await;
    tx.send(Ok(Bytes::from_static(
        b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
    )))
    .await
    .unwrap();
    // The client has the first event before the engine dies.
    let first = next_chunk(&mut resp).await;
    assert!(first.starts_with(b"data: {\"choices\""));
    tx.send(Err(io::Error::other("engine died"))).await.unwrap();
    let text = rest(resp).await;
    assert_cut(&text, 502);
    assert_metrics_contain(
        &router,
        r#"kvsight_router_stream_cuts_total{reason="upstream"} 1"#,
    )
    .await;
}

#[tokio::test]
async fn the_deadline_before_the_first_byte_is_an_openai_504() {
    let pod = silent_pod().await;
    let (st, router) = router_for(config_yaml("timeouts:\n  requestSeconds: 0.3\n")).await;
    add_pod(&st, "a", &pod, &[], 0);
    let resp = complete(&router).await;
    assert_eq!(resp.status(), 504);
    let v = rest_json(resp).await;
    assert_eq!(v["error"]["code"], 504);
    assert_eq!(v["error"]["type"], "GatewayTimeoutError");
    assert_eq!(inflight(&st), 0);
}

#[tokio::test]
async fn a_refused_connection_is_retried_once_on_another_pod() {
    let good = fixed_pod("b", StatusCode::OK, json!({"choices": []})).await;
    let (st, router) = router_for(RouterConfig::default()).await;
    // The vanished pod looks idle, the live one busy, so the vanished one is picked first.
    add_pod(&st, "a", &refused_url(), &[], 0);
    add_pod(&st, "b", &good, &[], 6);
    let resp = complete(&router).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-pod"], "b");
    assert_metrics_contain(
        &router,
        r#"kvsight_router_retries_total{reason="connect_refused"} 1"#,
    )
    .await;
    // Counted once, under the pod that answered.
    let counted = requests_counted(&router).await;
    assert!(
        matches!(&counted[..], [l] if l.contains(r#"pod="ns/b""#) && l.contains(r#"code="200""#)),
        "{counted:?}"
    );
    assert_eq!(inflight(&st), 0);
}

#[tokio::test]
async fn a_second_refusal_is_a_502_not_a_third_try() {
    let (st, router) = router_for(RouterConfig::default()).await;
    add_pod(&st, "a", &refused_url(), &[], 0);
    add_pod(&st, "b", &refused_url(), &[], 0);
    add_pod(&st, "c", &refused_url(), &[], 0);
    let resp = complete(&router).await;
    assert_eq!(resp.status(), 502);
    let v = rest_json(resp).await;
    assert_eq!(v["error"]["code"], 502);
    let counted = requests_counted(&router).await;
    assert!(
        matches!(&counted[..], [l] if l.contains(r#"code="502""#)),
        "{counted:?}"
    );
}

fn context_error() -> Value {
    json!({"error": {"message": "This model's maximum context length is 4096 tokens. However, your prompt contains 5000 input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=5000)", "type": "BadRequestError", "param": "input_tokens", "code": 400}})
}

const POOLS: &str = "pools:
  - name: short
    models: [m]
    podSelector: {pool: short}
    fallback: long
  - name: long
    models: [m]
    podSelector: {pool: long}
";

#[tokio::test]
async fn a_context_length_400_is_resent_once_to_the_fallback_pool() {
    let small = fixed_pod("small", StatusCode::BAD_REQUEST, context_error()).await;
    let large = fixed_pod(
        "large",
        StatusCode::OK,
        json!({"choices": [{"text": "ok"}]}),
    )
    .await;
    let (st, router) = router_for(config_yaml(POOLS)).await;
    add_pod(&st, "small", &small, &[("pool", "short")], 0);
    add_pod(&st, "large", &large, &[("pool", "long")], 0);
    let resp = complete(&router).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-pod"], "large");
    assert_metrics_contain(
        &router,
        r#"kvsight_router_retries_total{reason="context_fallback"} 1"#,
    )
    .await;
    let counted = requests_counted(&router).await;
    assert!(
        matches!(&counted[..], [l] if l.contains(r#"pool="long""#) && l.contains(r#"pod="ns/large""#) && l.contains(r#"code="200""#)),
        "{counted:?}"
    );
}

#[tokio::test]
async fn without_a_fallback_vllms_own_400_reaches_the_client_unchanged() {
    let small = fixed_pod("small", StatusCode::BAD_REQUEST, context_error()).await;
    let (st, router) = router_for(RouterConfig::default()).await;
    add_pod(&st, "small", &small, &[], 0);
    let resp = complete(&router).await;
    assert_eq!(resp.status(), 400);
    let v = rest_json(resp).await;
    assert_eq!(v, context_error());
    assert!(
        !metrics(&router)
            .await
            .contains("kvsight_router_retries_total{")
    );
}

#[tokio::test]
async fn config_reload_applies_a_valid_file_and_rejects_an_invalid_one() {
    let dir = std::env::temp_dir().join(format!("kvsight-reload-{}", rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("router.yaml");
    std::fs::write(&path, "scheduler:\n  weights:\n    prefix: 3\n").unwrap();
    let cfg = RouterConfig::load(&path).unwrap();
    let st = state(cfg);
    let stop = tokio_util::sync::CancellationToken::new();
    kvsight_router::reload::spawn_watcher(st.clone(), path.clone(), stop.clone()).unwrap();
    let mut events = st.reload_events();
    let wait = |n: u64, events: &mut tokio::sync::watch::Receiver<u64>| {
        let mut events = events.clone();
        async move {
            tokio::time::timeout(Duration::from_secs(10), events.wait_for(|v| *v >= n))
                .await
                .expect("reload handled within 10 s")
                .unwrap();
        }
    };

    // Valid: `prefix: 0` (a spread) is live afterwards.
    replace(&path, "scheduler:\n  weights:\n    prefix: 0\n");
    wait(1, &mut events).await;
    assert_eq!(st.live().config.scheduler.weights.prefix, 0.0);

    // Invalid: negative timeout. Rejected, counted, the old config stays.
    replace(&path, "timeouts:\n  requestSeconds: -1\n");
    wait(2, &mut events).await;
    assert_eq!(st.live().config.scheduler.weights.prefix, 0.0);
    let m = st
        .metrics
        .render(&st.registry(), &[], std::time::Instant::now());
    assert!(
        m.contains(r#"kvsight_router_config_reloads_total{outcome="applied"} 1"#),
        "{m}"
    );
    assert!(
        m.contains(r#"kvsight_router_config_reloads_total{outcome="rejected"} 1"#),
        "{m}"
    );
    stop.cancel();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Replaces the file's content by rename, as a ConfigMap update does: a write in place is seen
/// half done (truncated, then written), which is a reload of its own.
fn replace(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("yaml.tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Sends `n` completions sharing a long prefix and returns which pod answered each.
async fn route_batch(router: &str, n: usize, tag: &str) -> Vec<String> {
    let prefix = "You are a careful assistant. Always answer in full sentences. ".repeat(8);
    let mut pods = Vec::new();
    for i in 0..n {
        let body = json!({"model": "m", "prompt": format!("{prefix} Question {tag} {i}?")});
        let resp = client()
            .post(format!("{router}/v1/completions"))
            .header("x-kvsight-debug", "1")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        pods.push(resp.headers()["x-pod"].to_str().unwrap().to_owned());
    }
    pods
}

#[tokio::test]
async fn a_shared_prefix_concentrates_and_prefix_zero_spreads_after_a_reload() {
    let (st, router) = router_for(RouterConfig::default()).await;
    for name in ["p0", "p1", "p2", "p3"] {
        let url = fixed_pod(name, StatusCode::OK, json!({"choices": []})).await;
        add_pod(&st, name, &url, &[], 0);
    }
    // No tokenizer: approximate mode, the router's own memory of what it sent.
    let first = route_batch(&router, 8, "a").await;
    assert!(
        first.iter().all(|p| *p == first[0]),
        "concentrated: {first:?}"
    );

    let mut cfg = st.live().config.clone();
    cfg.scheduler.weights.prefix = 0.0;
    st.swap_config(cfg);
    let second = route_batch(&router, 8, "b").await;
    let distinct: std::collections::BTreeSet<_> = second.iter().collect();
    assert!(distinct.len() >= 3, "spread with prefix: 0: {second:?}");
    assert_metrics_contain(
        &router,
        r#"kvsight_router_prefix_mode_total{model="m",mode="approximate"} 16"#,
    )
    .await;
}

#[tokio::test]
async fn saturated_pods_are_skipped() {
    let (st, router) = router_for(RouterConfig::default()).await;
    let busy = fixed_pod("busy", StatusCode::OK, json!({})).await;
    let free = fixed_pod("free", StatusCode::OK, json!({})).await;
    let (key, conn) = add_pod(&st, "busy", &busy, &[], 0);
    // Waiting ≥ 1 saturates a pod (default maxWaiting 1), whatever its cache holds.
    st.registry()
        .apply_load(
            &key,
            conn,
            load(kvsight_protocol::messages::Phase::Ready, 8, 3),
            std::time::Instant::now(),
        )
        .unwrap();
    add_pod(&st, "free", &free, &[], 0);
    let pods = route_batch(&router, 4, "s").await;
    assert!(pods.iter().all(|p| p == "free"), "{pods:?}");
}

#[tokio::test]
async fn a_client_leaving_mid_stream_releases_the_pod_and_closes_upstream() {
    let (st, router, tx, _seen) = router_with_streaming_pod(RouterConfig::default()).await;
    let mut resp = complete(&router).await;
    tx.send(Ok(Bytes::from_static(b"data: {\"a\":1}\n\n")))
        .await
        .unwrap();
    assert!(resp.chunk().await.unwrap().is_some());
    assert_eq!(inflight(&st), 1);
    drop(resp);
    // The pod is silent; the router still notices, drops the upstream body (the pod's stream
    // receiver goes away) and records the request as done.
    tokio::time::timeout(Duration::from_secs(5), tx.closed())
        .await
        .expect("upstream closed after the client left");
    assert_inflight_settles_to_zero(&st).await;
}
