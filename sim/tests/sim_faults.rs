//! vllm-sim's KV events and fault knobs over real sockets: what a subscriber of the pod sees
//! while requests run, and the failures reliability tests inject (dead engine, hang, slow down,
//! lost KV-event seqs, a publisher restart, a whole pod restart), through both the handle and
//! `POST /sim/faults`.

mod sim_support;

use std::time::Duration;

use kvsight_sim::engine::EngineConfig;
use kvsight_sim::kv_events::ReplayLayout;
use kvsight_sim::kv_events::client::{self, Subscriber};
use kvsight_sim::server::{SimConfig, SimPod, SimPodHandle};
use rmpv::Value as Mp;
use serde_json::json;
use sim_support::{WAIT, get, metric, post_json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn engine(time_scale: f64) -> EngineConfig {
    EngineConfig::builder()
        .compile_stall(Duration::ZERO)
        .time_scale(time_scale)
        .build()
        .expect("engine config")
}

/// A pod without KV events.
async fn pod(engine: EngineConfig) -> SimPodHandle {
    SimPod::start(SimConfig {
        engine,
        ..SimConfig::default()
    })
    .await
    .expect("pod starts")
}

async fn pod_with_events(engine: EngineConfig) -> (SimPodHandle, Subscriber) {
    let pod = SimPod::start(SimConfig {
        engine,
        ..SimConfig::loopback_with_events()
    })
    .await
    .expect("pod starts");
    let publisher = pod.publisher().expect("events on");
    let before = publisher.subscriptions_seen();
    let sub = Subscriber::connect(pod.kv_endpoint().expect("endpoint"), "")
        .await
        .expect("SUB connects");
    publisher
        .wait_for_subscriptions(before + 1, WAIT)
        .await
        .expect("subscription arrives");
    (pod, sub)
}

/// The events of one payload as `(type, map)` pairs.
fn events(payload: &[u8]) -> Vec<(String, Mp)> {
    let batch = rmpv::decode::read_value(&mut &payload[..]).expect("msgpack");
    let arr = batch.as_array().expect("batch array");
    assert_eq!(arr.len(), 3, "[ts, events, rank]");
    assert!(arr[0].is_f64());
    assert_eq!(arr[2].as_u64(), Some(0));
    arr[1]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| {
            let ty = field(e, "type").as_str().expect("type").to_owned();
            (ty, e.clone())
        })
        .collect()
}

fn field<'a>(map: &'a Mp, key: &str) -> &'a Mp {
    map.as_map()
        .expect("event map")
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no {key} in {map}"))
}

async fn complete(pod: &SimPodHandle, prompt: &[u32], max_tokens: u32) -> serde_json::Value {
    let r = post_json(
        pod.http_addr(),
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": max_tokens}),
    )
    .await
    .expect("request");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json().expect("json")
}

#[tokio::test]
async fn kv_events_reach_a_subscriber_and_replay() -> anyhow::Result<()> {
    // 9 blocks = 8 usable: a second long prompt must evict the first one's cached blocks.
    let (pod, mut sub) = pod_with_events(EngineConfig {
        num_gpu_blocks: 9,
        max_model_len: 128,
        ..engine(0.001)
    })
    .await;
    let a: Vec<u32> = (100..164).collect();
    complete(&pod, &a, 1).await;
    let f = sub.recv(WAIT).await?;
    assert_eq!(f.seq, 0);
    let ev = events(&f.payload);
    assert_eq!(ev[0].0, "BlockStored");
    let stored = &ev[0].1;
    assert_eq!(
        field(stored, "block_hashes").as_array().map(Vec::len),
        Some(4)
    );
    assert!(field(stored, "parent_block_hash").is_nil());
    let tokens: Vec<u64> = field(stored, "token_ids")
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Mp::as_u64)
        .collect();
    assert_eq!(tokens, (100..164).collect::<Vec<u64>>());
    assert_eq!(field(stored, "block_size").as_u64(), Some(16));
    assert_eq!(field(stored, "medium").as_str(), Some("GPU"));

    let b: Vec<u32> = (5000..5100).collect();
    complete(&pod, &b, 1).await;
    let mut removed = 0;
    let mut last_seq = f.seq;
    for _ in 0..20 {
        let Ok(f) = sub.recv(Duration::from_millis(500)).await else {
            break;
        };
        last_seq = f.seq;
        removed += events(&f.payload)
            .iter()
            .filter(|(t, _)| t == "BlockRemoved")
            .count();
    }
    assert!(removed >= 1, "eviction must publish BlockRemoved");

    let r = sim_support::request(pod.http_addr(), "POST", "/reset_prefix_cache", None).await?;
    assert_eq!(r.status, 200);
    let f = sub.recv(WAIT).await?;
    assert_eq!(f.seq, last_seq + 1);
    assert_eq!(events(&f.payload)[0].0, "AllBlocksCleared");

    let replayed = replay_from_zero(pod.replay_endpoint().expect("replay"), 1000).await?;
    assert_eq!(replayed.len() as u64, f.seq + 1);
    assert_eq!(replayed[0].seq, 0);
    Ok(())
}

#[tokio::test]
async fn dropped_and_restarted_kv_sequences() -> anyhow::Result<()> {
    let (pod, mut sub) = pod_with_events(engine(0.001)).await;
    // Seq 0 is lost live (still in the replay buffer); the subscriber sees 1 first.
    pod.drop_kv_seqs(Some(0..1));
    complete(&pod, &(0..40).collect::<Vec<u32>>(), 1).await;
    complete(&pod, &(1000..1040).collect::<Vec<u32>>(), 1).await;
    let f = sub.recv(WAIT).await?;
    assert_eq!(f.seq, 1);
    let replayed = replay_from_zero(pod.replay_endpoint().expect("replay"), 100).await?;
    assert_eq!(replayed.first().map(|r| r.seq), Some(0));

    // A restart: the next batch is seq 0 again, with no epoch, as vLLM does.
    pod.drop_kv_seqs(None);
    let r = post_json(
        pod.http_addr(),
        "/sim/faults",
        &json!({"restart_kv_sequence": true}),
    )
    .await?;
    assert_eq!(r.status, 200);
    complete(&pod, &(2000..2040).collect::<Vec<u32>>(), 1).await;
    let f = sub.recv(WAIT).await?;
    assert_eq!(f.seq, 0);
    Ok(())
}

/// Everything the pod's replay socket still holds from seq 0 on, at most `max` batches.
async fn replay_from_zero(
    endpoint: &str,
    max: usize,
) -> Result<Vec<client::Frames>, client::ClientError> {
    client::replay(endpoint, 0, ReplayLayout::New, WAIT, max).await
}

/// Polls `/metrics` until `pred` holds; bounded.
async fn wait_metrics(pod: &SimPodHandle, pred: impl Fn(&str) -> bool) -> String {
    for _ in 0..400 {
        let text = get(pod.http_addr(), "/metrics")
            .await
            .expect("metrics")
            .text();
        if pred(&text) {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("metrics condition never held");
}

/// Polls `/metrics` until the gauge `name` reads `value`; bounded.
async fn wait_gauge(pod: &SimPodHandle, name: &str, value: f64) -> String {
    wait_metrics(pod, |m| metric(m, name) == Some(value)).await
}

/// Starts a 2 000-token streamed completion on `pod` and returns once the engine runs it (at
/// real-time 10 ms steps it is still running seconds later).
async fn running_long_stream(
    pod: &SimPodHandle,
) -> tokio::task::JoinHandle<anyhow::Result<sim_support::Reply>> {
    let addr = pod.http_addr();
    let stream = tokio::spawn(async move {
        post_json(
            addr,
            "/v1/completions",
            &json!({"prompt": [1, 2, 3], "max_tokens": 2000, "stream": true}),
        )
        .await
    });
    wait_gauge(pod, "vllm:num_requests_running", 1.0).await;
    stream
}

#[tokio::test]
async fn dead_engine_fails_streams_and_health() -> anyhow::Result<()> {
    // Real-time 10 ms steps: a 2 000-token generation is still running when the engine dies.
    let pod = pod(engine(1.0)).await;
    let addr = pod.http_addr();
    let stream = running_long_stream(&pod).await;
    pod.set_dead(true);
    let reply = tokio::time::timeout(WAIT, stream).await???;
    assert_eq!(reply.status, 200);
    let events = reply.sse_events()?;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    // vLLM writes stream errors with Python's json.dumps: spaces after separators.
    assert_eq!(
        events[events.len() - 2],
        "{\"error\": {\"message\": \"The server had an error while processing your \
         request.\", \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}"
    );
    assert!(
        events.len() >= 3,
        "some tokens were streamed before the error"
    );

    assert_eq!(get(addr, "/health").await?.status, 503);
    let r = post_json(addr, "/v1/completions", &json!({"prompt": "x"})).await?;
    assert_eq!(r.status, 500);
    assert_eq!(
        r.text(),
        "{\"error\":{\"message\":\"The server had an error while processing your request.\",\
         \"type\":\"InternalServerError\",\"param\":null,\"code\":500}}"
    );

    let r = post_json(addr, "/sim/faults", &json!({"dead": false})).await?;
    assert_eq!(r.status, 200);
    assert_eq!(get(addr, "/health").await?.status, 200);
    let r = post_json(addr, "/sim/faults", &json!({"dead": true})).await?;
    assert_eq!(r.status, 200);
    assert_eq!(get(addr, "/health").await?.status, 503);
    Ok(())
}

#[tokio::test]
async fn hung_engine_holds_requests_until_released() -> anyhow::Result<()> {
    let pod = pod(engine(0.001)).await;
    let addr = pod.http_addr();
    pod.set_hung(true);
    let req = tokio::spawn(async move {
        post_json(
            addr,
            "/v1/completions",
            &json!({"prompt": [1, 2], "max_tokens": 3}),
        )
        .await
    });
    // Submitted but never scheduled: it waits, and health still answers.
    wait_gauge(&pod, "vllm:num_requests_waiting", 1.0).await;
    assert_eq!(get(addr, "/health").await?.status, 200);
    assert!(!req.is_finished());
    pod.set_hung(false);
    let reply = tokio::time::timeout(WAIT, req).await???;
    assert_eq!(reply.json()?["usage"]["completion_tokens"], 3);
    Ok(())
}

#[tokio::test]
async fn slowdown_stretches_latency() -> anyhow::Result<()> {
    let pod = pod(engine(0.001)).await;
    let e2e = |m: &str| metric(m, "vllm:e2e_request_latency_seconds_sum").unwrap_or(0.0);
    complete(&pod, &[1, 2, 3], 5).await;
    let fast = e2e(&get(pod.http_addr(), "/metrics").await?.text());
    // 10 ms steps × 0.001 × 2 000 = 20 ms per step: 5 tokens take ≥ 100 ms.
    pod.set_slowdown(2000.0);
    complete(&pod, &[4, 5, 6], 5).await;
    let slow = e2e(&get(pod.http_addr(), "/metrics").await?.text()) - fast;
    assert!(slow >= 0.1, "slow e2e {slow}");
    assert!(slow > fast * 5.0, "slow {slow} vs fast {fast}");
    Ok(())
}

#[tokio::test]
async fn client_disconnect_aborts_the_request() -> anyhow::Result<()> {
    let pod = pod(engine(1.0)).await;
    let client = running_long_stream(&pod).await;
    // Dropping the task closes the connection mid-stream.
    client.abort();
    let m = wait_gauge(&pod, "vllm:num_requests_running", 0.0).await;
    assert!(
        m.contains("vllm:request_success_total{engine=\"0\",finished_reason=\"abort\",model_name=\"vllm-sim\"} 1.0"),
        "{m}"
    );
    Ok(())
}

/// Sends `head` on a fresh connection to `addr` and reads until the end of the response headers,
/// so the server is known to hold the connection (and the request) before the test goes on.
async fn open_request(addr: std::net::SocketAddr, head: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(head.as_bytes()).await.expect("write");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(WAIT, async {
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = stream.read(&mut buf).await.expect("read");
            assert!(n > 0, "closed before the headers");
            seen.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("response headers");
    stream
}

/// Whether the peer closed `stream`: reads (and discards) whatever is still in flight until EOF or
/// a reset, `false` if the connection is still open after `WAIT`.
async fn closed_by_peer(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    tokio::time::timeout(WAIT, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

/// `restart` is a process restart: when the old pod's shutdown returns, every socket it had is
/// closed — an SSE stream stuck on a hung engine past the grace, an idle keep-alive connection,
/// raw connections to the PUB and replay ports — and the new pod binds the very same ports
/// (first chosen by the OS) without a retry. A SUB connected across the restart sees the old
/// connection end, reconnects by itself, and receives the new process's events from seq 0.
#[tokio::test]
async fn restart_closes_every_socket_and_rebinds_the_same_ports() -> anyhow::Result<()> {
    let (pod, mut sub) = pod_with_events(engine(0.001)).await;
    complete(&pod, &(0..40).collect::<Vec<u32>>(), 1).await;
    assert_eq!(sub.recv(WAIT).await?.seq, 0);
    complete(&pod, &(100..140).collect::<Vec<u32>>(), 1).await;
    assert_eq!(sub.recv(WAIT).await?.seq, 1);
    let (http, kv, replay) = (
        pod.http_addr(),
        pod.kv_endpoint().expect("kv").to_owned(),
        pod.replay_endpoint().expect("replay").to_owned(),
    );
    let port = |endpoint: &str| -> std::net::SocketAddr {
        endpoint
            .strip_prefix("tcp://")
            .and_then(|a| a.parse().ok())
            .expect("tcp endpoint")
    };

    // A hung engine keeps this stream open forever: only a forced close can end it.
    pod.set_hung(true);
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 50, "stream": true}).to_string();
    let mut stream = open_request(
        http,
        &format!(
            "POST /v1/completions HTTP/1.1\r\nHost: pod\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
    .await;
    let mut idle = open_request(http, "GET /health HTTP/1.1\r\nHost: pod\r\n\r\n").await;
    let mut raw_pub = TcpStream::connect(port(&kv)).await?;
    let mut raw_replay = TcpStream::connect(port(&replay)).await?;

    let pod = pod.restart(Duration::from_millis(100)).await?;
    assert!(closed_by_peer(&mut stream).await, "SSE stream left open");
    assert!(
        closed_by_peer(&mut idle).await,
        "keep-alive connection left open"
    );
    assert!(
        closed_by_peer(&mut raw_pub).await,
        "PUB connection left open"
    );
    assert!(
        closed_by_peer(&mut raw_replay).await,
        "replay connection left open"
    );
    assert_eq!(pod.http_addr(), http);
    assert_eq!(pod.kv_endpoint(), Some(kv.as_str()));
    assert_eq!(pod.replay_endpoint(), Some(replay.as_str()));

    // A new process: empty cache, not hung, seqs from 0, an empty replay buffer.
    assert_eq!(pod.resident_block_hashes().await, Some(Vec::new()));
    let replayed = replay_from_zero(&replay, 10).await?;
    assert!(replayed.is_empty(), "{replayed:?}");
    // The SUB notices the old connection's end only while it reads, so read while the new pod
    // waits for its resubscription and then serves a request.
    let publisher = pod.publisher().expect("events on");
    let (received, served) = tokio::join!(sub.recv(WAIT), async {
        publisher.wait_for_subscriptions(1, WAIT).await?;
        complete(&pod, &(0..40).collect::<Vec<u32>>(), 1).await;
        anyhow::Ok(())
    });
    served?;
    let f = received?;
    assert_eq!(f.seq, 0);
    assert_eq!(events(&f.payload)[0].0, "BlockStored");
    pod.shutdown(Duration::from_millis(100)).await;
    Ok(())
}
