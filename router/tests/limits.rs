//! Everything a client controls is bounded, checked over real loopback sockets
//! against the router's own server (`kvsight_router::server::serve`), most with hand-written
//! bytes on a `TcpStream` so nothing between the test and the router fixes the request up:
//! declared and trickled bodies, slow and oversized heads, JSON depth, chat messages, prompt
//! bytes, the connection cap; that the router is no open proxy; hop-by-hop headers; and
//! `Content-Length` / `Transfer-Encoding` framing.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use axum::routing::post;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use common::*;
use kvsight_router::State;

/// Bound on every wait for the router in these tests.
const WAIT: Duration = Duration::from_secs(10);

/// What the stand-in pod saw: path, headers, body.
type Seen = mpsc::UnboundedReceiver<(String, HeaderMap, Bytes)>;

/// A pod answering every completion 200, with hop-by-hop headers of its own in the answer.
async fn pod() -> (String, Seen) {
    let (tx, seen) = mpsc::unbounded_channel();
    let record = |path: &'static str| {
        let tx = tx.clone();
        post(move |headers: HeaderMap, body: Bytes| {
            let _ = tx.send((path.to_owned(), headers, body));
            async {
                (
                    [
                        ("connection", "x-pod-secret"),
                        ("x-pod-secret", "1"),
                        ("keep-alive", "timeout=5"),
                        ("proxy-authenticate", "Basic"),
                        ("x-pod-visible", "1"),
                    ],
                    axum::Json(json!({"choices": [{"text": "ok"}]})),
                )
                    .into_response()
            }
        })
    };
    let app = Router::new()
        .route("/v1/completions", record("/v1/completions"))
        .route("/v1/chat/completions", record("/v1/chat/completions"))
        // Anything else the router forwarded is recorded too, for the tests to see.
        .fallback(
            move |uri: axum::http::Uri, headers: HeaderMap, body: Bytes| {
                let _ = tx.send((uri.to_string(), headers, body));
                async { axum::http::StatusCode::IM_A_TEAPOT }
            },
        );
    (format!("http://{}", serve(app).await), seen)
}

/// The router's real server on `127.0.0.1:0` with `yaml` as config and one Ready pod at `pod`.
async fn router(yaml: &str, pod: Option<&str>) -> Running {
    let cfg = config_or_default(yaml);
    let st = state(cfg);
    if let Some(url) = pod {
        add_pod(&st, "a", url, &[], 0);
    }
    serve_router(st).await
}

/// The router's answer on a raw connection: status, head, body.
struct Answer {
    status: u16,
    head: String,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {:?}", self.body))
    }
}

/// Reads one answer: the head, then `Content-Length` bytes of body (or up to EOF).
async fn read_answer(tcp: &mut TcpStream) -> Option<Answer> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let read = async {
        loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                let len = head.lines().find_map(|l| {
                    let (n, v) = l.split_once(':')?;
                    n.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                });
                if len.is_some_and(|n| buf.len() >= end + 4 + n) {
                    break;
                }
            }
            match tcp.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    };
    tokio::time::timeout(WAIT, read)
        .await
        .expect("the router answers or closes in time");
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some(Answer {
        status,
        body: String::from_utf8_lossy(&buf[end + 4..]).into_owned(),
        head,
    })
}

/// Sends `bytes` on a new connection and reads the answer.
async fn raw(addr: SocketAddr, bytes: &[u8]) -> Answer {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(bytes).await.unwrap();
    read_answer(&mut tcp).await.expect("an HTTP answer")
}

/// `kvsight_router_refused_total{reason}`, read from the metrics.
fn refused(st: &State, reason: &str) -> u64 {
    let text = st
        .metrics
        .render(&st.registry(), &[], std::time::Instant::now());
    let key = format!("kvsight_router_refused_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(key.as_str()))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// Waits (bounded: 500 × 10 ms) for a refusal counted when a connection task ends.
async fn refused_eventually(st: &State, reason: &str, want: u64) {
    for _ in 0..500 {
        if refused(st, reason) >= want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "refused{{reason={reason}}} stayed at {}",
        refused(st, reason)
    );
}

fn assert_openai_error(a: &Answer, code: u16) {
    assert_eq!(a.status, code, "{} {}", a.head, a.body);
    let e = a.json();
    assert_eq!(e["error"]["code"], code, "{e}");
    for f in ["message", "type", "param"] {
        assert!(e["error"].get(f).is_some(), "{f} missing in {e}");
    }
}

/// A 200 MiB `Content-Length` followed by 1 MiB and a pause: the declared size alone is refused,
/// at once (a router reading on would hold the connection for as long as the client waits).
#[tokio::test]
async fn a_declared_body_over_the_limit_is_413_at_once_without_reading_it() {
    let r = router("", None).await;
    let mut tcp = TcpStream::connect(r.addr).await.unwrap();
    tcp.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n\
          Content-Length: 209715200\r\n\r\n{\"model\":\"m\",\"prompt\":\"",
    )
    .await
    .unwrap();
    // Then the client pauses, body unfinished: the answer must not wait for the rest.
    let t = Instant::now();
    let a = read_answer(&mut tcp).await.expect("an answer");
    assert_openai_error(&a, 413);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(refused(&r.state, "body_bytes"), 1);
}

#[tokio::test]
async fn a_trickling_body_is_cut_after_the_body_read_timeout() {
    let r = router("timeouts: {bodyReadSeconds: 0.3}", None).await;
    let mut tcp = TcpStream::connect(r.addr).await.unwrap();
    tcp.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Length: 100\r\n\r\n{\"mo",
    )
    .await
    .unwrap();
    let t = Instant::now();
    let a = read_answer(&mut tcp).await.expect("an answer");
    assert_openai_error(&a, 408);
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(a.header("connection"), Some("close"));
    assert_eq!(refused(&r.state, "body_read_time"), 1);
}

#[tokio::test]
async fn a_slow_request_head_is_closed_after_the_header_read_timeout() {
    let r = router("timeouts: {headerReadSeconds: 0.3}", None).await;
    let mut tcp = TcpStream::connect(r.addr).await.unwrap();
    tcp.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n")
        .await
        .unwrap();
    let t = Instant::now();
    // hyper closes without an answer (or a 408): either way the connection ends.
    let mut rest = Vec::new();
    tokio::time::timeout(WAIT, tcp.read_to_end(&mut rest))
        .await
        .expect("the router closes the connection in time")
        .ok();
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
    assert!(
        rest.is_empty() || rest.starts_with(b"HTTP/1.1 408"),
        "{rest:?}"
    );
    refused_eventually(&r.state, "header_read_time", 1).await;
}

#[tokio::test]
async fn too_many_headers_or_too_large_a_head_is_431() {
    let r = router("limits: {headers: 10, headerBytes: 8192}", None).await;
    let many: String = (0..20).map(|i| format!("X-H{i}: v\r\n")).collect();
    let a = raw(r.addr, &post_request("/v1/completions", "{}", &many)).await;
    assert_eq!(a.status, 431, "{}", a.head);
    let big = format!("X-Big: {}\r\n", "a".repeat(10_000));
    let a = raw(r.addr, &post_request("/v1/completions", "{}", &big)).await;
    assert_eq!(a.status, 431, "{}", a.head);
    refused_eventually(&r.state, "header_bytes", 2).await;
    // Within both limits, the request reaches the handler.
    let a = raw(r.addr, &post_request("/v1/completions", "{}", "X-A: 1\r\n")).await;
    assert_openai_error(&a, 400);
}

#[tokio::test]
async fn json_nested_deeper_than_the_limit_is_400_before_parsing() {
    let (url, mut seen) = pod().await;
    let r = router("limits: {jsonDepth: 8}", Some(&url)).await;
    // Depth 8 (the object + 7 arrays) passes; 9 does not. Brackets in strings do not count.
    let body = |n: usize| {
        format!(
            r#"{{"model":"m","prompt":"[[[[[[[[[[","x":{}0{}}}"#,
            "[".repeat(n),
            "]".repeat(n)
        )
    };
    let a = raw(r.addr, &post_request("/v1/completions", &body(7), "")).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(seen.try_recv().is_ok());
    let a = raw(r.addr, &post_request("/v1/completions", &body(8), "")).await;
    assert_openai_error(&a, 400);
    assert_eq!(refused(&r.state, "json_depth"), 1);
    assert!(
        seen.try_recv().is_err(),
        "a refused request reached the pod"
    );
}

#[tokio::test]
async fn more_chat_messages_than_the_limit_is_400() {
    let (url, mut seen) = pod().await;
    let r = router("limits: {chatMessages: 3}", Some(&url)).await;
    let body = |n: usize| {
        let messages: Vec<Value> = (0..n)
            .map(|i| json!({"role": "user", "content": format!("m{i}")}))
            .collect();
        json!({"model": "m", "messages": messages}).to_string()
    };
    let a = raw(r.addr, &post_request("/v1/chat/completions", &body(3), "")).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(seen.try_recv().is_ok());
    let a = raw(r.addr, &post_request("/v1/chat/completions", &body(4), "")).await;
    assert_openai_error(&a, 400);
    assert_eq!(a.json()["error"]["param"], "messages");
    assert_eq!(refused(&r.state, "chat_messages"), 1);
    assert!(seen.try_recv().is_err());
}

#[tokio::test]
async fn prompt_text_over_the_limit_is_400_before_tokenizing() {
    let (url, mut seen) = pod().await;
    let r = router("limits: {promptBytes: 100}", Some(&url)).await;
    let prompt = |n: usize| json!({"model": "m", "prompt": "a".repeat(n)}).to_string();
    let a = raw(r.addr, &post_request("/v1/completions", &prompt(100), "")).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(seen.try_recv().is_ok());
    let a = raw(r.addr, &post_request("/v1/completions", &prompt(101), "")).await;
    assert_openai_error(&a, 400);
    assert_eq!(a.json()["error"]["param"], "prompt");
    // Chat text counts; an image's bytes do not.
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", "A".repeat(5000))}},
    ]}]})
    .to_string();
    let a = raw(r.addr, &post_request("/v1/chat/completions", &chat, "")).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "b".repeat(101)}]});
    let a = raw(
        r.addr,
        &post_request("/v1/chat/completions", &chat.to_string(), ""),
    )
    .await;
    assert_openai_error(&a, 400);
    assert_eq!(refused(&r.state, "prompt_bytes"), 2);
}

/// A request on a kept-alive connection, answered.
async fn keep_alive_request(tcp: &mut TcpStream) -> Answer {
    tcp.write_all(b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n")
        .await
        .unwrap();
    read_answer(tcp).await.expect("an answer")
}

#[tokio::test]
async fn connections_over_the_limit_get_503_with_retry_after() {
    let r = router("limits: {connections: 2}", None).await;
    let mut first = TcpStream::connect(r.addr).await.unwrap();
    let mut second = TcpStream::connect(r.addr).await.unwrap();
    // Both are served (so both hold a slot) and stay open.
    assert_eq!(keep_alive_request(&mut first).await.status, 200);
    assert_eq!(keep_alive_request(&mut second).await.status, 200);
    let a = raw(r.addr, b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n").await;
    assert_openai_error(&a, 503);
    assert_eq!(a.header("retry-after"), Some("1"));
    assert_eq!(refused(&r.state, "connections"), 1);
    // A slot frees when a connection closes (the router notices the close on its own time).
    drop(first);
    for attempt in 0.. {
        let a = raw(r.addr, b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n").await;
        if a.status == 200 {
            break;
        }
        assert!(attempt < 200, "no slot freed: {}", a.status);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(keep_alive_request(&mut second).await.status, 200);
}

#[tokio::test]
async fn stream_is_read_as_vllm_reads_it_and_a_bad_one_never_reaches_a_pod() {
    let (url, mut seen) = pod().await;
    let r = router("", Some(&url)).await;
    for bad in [json!([1]), json!("maybe"), json!(2)] {
        let body = json!({"model": "m", "prompt": "x", "stream": bad}).to_string();
        let a = raw(r.addr, &post_request("/v1/completions", &body, "")).await;
        assert_openai_error(&a, 400);
        assert_eq!(a.json()["error"]["param"], "body.stream");
    }
    assert!(seen.try_recv().is_err(), "an invalid request reached a pod");
    for good in [json!("yes"), json!(0), json!(null), json!("OFF")] {
        let body = json!({"model": "m", "prompt": "x", "stream": good}).to_string();
        let a = raw(r.addr, &post_request("/v1/completions", &body, "")).await;
        assert_eq!(a.status, 200, "stream {good}: {}", a.body);
        assert!(seen.try_recv().is_ok());
    }
}

/// Only the OpenAI paths kvsight serves are forwarded, only to registered pods: an
/// absolute-form request target or a `Host` naming another server changes nothing.
#[tokio::test]
async fn the_router_is_no_open_proxy() {
    let (url, mut seen) = pod().await;
    let r = router("", Some(&url)).await;
    let elsewhere = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    elsewhere.set_nonblocking(true).unwrap();
    let other = elsewhere.local_addr().unwrap();
    let body = r#"{"model":"m","prompt":"x"}"#;
    let request = format!(
        "POST http://{other}/v1/completions HTTP/1.1\r\nHost: {other}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let a = raw(r.addr, request.as_bytes()).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let (path, headers, _) = seen.try_recv().expect("the registered pod got it");
    assert_eq!(path, "/v1/completions");
    assert_ne!(
        headers.get("host").and_then(|h| h.to_str().ok()),
        Some(other.to_string().as_str())
    );
    assert!(
        elsewhere.accept().is_err(),
        "the router connected to the host the client named"
    );
    for path in [
        "/v1/embeddings",
        "/v1/completions/../../admin",
        "/reset_prefix_cache",
        "/sim/faults",
        "//evil.example/v1/completions",
    ] {
        let a = raw(r.addr, &post_request(path, body, "")).await;
        assert_eq!(a.status, 404, "{path}: {} {}", a.head, a.body);
    }
    assert!(seen.try_recv().is_err(), "a non-OpenAI path reached a pod");
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) and those the `Connection` header names are dropped
/// in both directions.
#[tokio::test]
async fn hop_by_hop_headers_are_stripped_both_ways() {
    let (url, mut seen) = pod().await;
    let r = router("", Some(&url)).await;
    let body = r#"{"model":"m","prompt":"x"}"#;
    let extra = "Keep-Alive: timeout=5\r\nProxy-Authorization: Basic eA==\r\n\
                 Proxy-Connection: keep-alive\r\nTE: trailers\r\nTrailer: X-T\r\n\
                 X-Client-Secret: 1\r\nX-Visible: 1\r\n";
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Length: {}\r\n{extra}\
         Connection: keep-alive, X-Client-Secret\r\n\r\n{body}",
        body.len()
    );
    let mut tcp = TcpStream::connect(r.addr).await.unwrap();
    tcp.write_all(request.as_bytes()).await.unwrap();
    let a = read_answer(&mut tcp).await.expect("an answer");
    assert_eq!(a.status, 200, "{}", a.body);
    let (_, headers, _) = seen.try_recv().unwrap();
    for h in [
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "x-client-secret",
        "upgrade",
    ] {
        assert!(headers.get(h).is_none(), "{h} reached the pod: {headers:?}");
    }
    assert_eq!(headers.get("x-visible").unwrap(), "1");
    for h in ["x-pod-secret", "keep-alive", "proxy-authenticate"] {
        assert!(a.header(h).is_none(), "{h} reached the client: {}", a.head);
    }
    assert_eq!(a.header("x-pod-visible"), Some("1"));
}

/// Request framing the router and a pod could read differently is refused or made
/// unambiguous by hyper before the router sees it, and the router re-frames what it forwards.
#[tokio::test]
async fn conflicting_content_length_is_400_and_transfer_encoding_wins_over_it() {
    let (url, mut seen) = pod().await;
    let r = router("", Some(&url)).await;
    let body = r#"{"model":"m","prompt":"x"}"#;
    let twice = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Length: {}\r\n\
         Content-Length: 5\r\n\r\n{body}",
        body.len()
    );
    assert_eq!(raw(r.addr, twice.as_bytes()).await.status, 400);
    let invalid = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Length: +{}\r\n\r\n{body}",
        body.len()
    );
    assert_eq!(raw(r.addr, invalid.as_bytes()).await.status, 400);
    let not_chunked = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: router\r\nTransfer-Encoding: gzip\r\n\r\n{body}"
    );
    assert_eq!(raw(r.addr, not_chunked.as_bytes()).await.status, 400);
    assert!(seen.try_recv().is_err());
    // Both headers: the body is read by Transfer-Encoding alone (RFC 9112 §6.1), so bytes
    // hidden after the chunked body are not a second request, and the connection closes after
    // the answer. The pod gets the body with the router's own Content-Length.
    let smuggled = "GET /debug/pods HTTP/1.1\r\nHost: router\r\n\r\n";
    let both = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Length: 4\r\n\
         Transfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n{smuggled}",
        body.len()
    );
    let mut tcp = TcpStream::connect(r.addr).await.unwrap();
    tcp.write_all(both.as_bytes()).await.unwrap();
    let a = read_answer(&mut tcp).await.expect("an answer");
    assert_eq!(a.status, 200, "{}", a.body);
    let (_, headers, got) = seen.try_recv().unwrap();
    assert_eq!(got, body.as_bytes());
    assert_eq!(
        headers.get("content-length").unwrap(),
        &body.len().to_string()
    );
    assert!(headers.get("transfer-encoding").is_none());
    assert!(
        read_answer(&mut tcp).await.is_none(),
        "the bytes after the chunked body were answered as a request"
    );
}
