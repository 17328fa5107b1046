//! The whole sidecar ([`kvsight_sidecar::run_with`] and the binary) against a minimal stand-in
//! for vLLM's HTTP server (health, models, version, metrics, completions) and the testbed's KV
//! publisher, over loopback: warm-up runs before `/ready` turns 200, draining holds until vLLM is
//! idle and ends with a Drained goodbye, SIGTERM drains the binary, bad config exits 64.
//!
//! The stand-in exists because the vllm-sim HTTP server is built on another branch; it serves
//! only what the sidecar reads, in vLLM's formats.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use kvsight_protocol::messages::Phase;
use kvsight_sidecar::config::{Args, Config};
use kvsight_sidecar::state::Shared;
use kvsight_sidecar::{Listeners, run_with};
use kvsight_sim::kv_events::{KvEventPublisher, PublisherConfig};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

#[derive(Default)]
struct FakeVllm {
    running: AtomicU64,
    waiting: AtomicU64,
    completions: AtomicU64,
    healthy: AtomicBool,
    /// Completions wait for a permit, so a test can look at the sidecar mid-warm-up.
    gate: Option<Semaphore>,
}

async fn start_vllm(fake: Arc<FakeVllm>) -> SocketAddr {
    fake.healthy.store(true, Ordering::Relaxed);
    let app = Router::new()
        .route(
            "/health",
            get(|State(f): State<Arc<FakeVllm>>| async move {
                if f.healthy.load(Ordering::Relaxed) {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            }),
        )
        .route(
            "/version",
            get(|| async { axum::Json(serde_json::json!({"version": "0.33.0"})) }),
        )
        .route(
            "/v1/models",
            get(|| async {
                axum::Json(serde_json::json!({"object": "list", "data": [
                    {"id": "tiny", "object": "model", "created": 0, "owned_by": "vllm",
                     "root": "/nonexistent/tiny", "parent": null, "max_model_len": 2048,
                     "permission": []},
                    {"id": "sql-lora", "object": "model", "created": 0, "owned_by": "vllm",
                     "root": "/adapters/sql", "parent": "tiny", "max_model_len": null,
                     "permission": []}
                ]}))
            }),
        )
        .route(
            "/metrics",
            get(|State(f): State<Arc<FakeVllm>>| async move {
                format!(
                    "vllm:num_requests_running{{engine=\"0\",model_name=\"tiny\"}} {}\n\
                     vllm:num_requests_waiting{{engine=\"0\",model_name=\"tiny\"}} {}\n\
                     vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"tiny\"}} 0.25\n\
                     vllm:cache_config_info{{block_size=\"16\",enable_prefix_caching=\"True\",\
                     engine=\"0\",num_gpu_blocks=\"512\",prefix_caching_hash_algo=\"sha256\"}} 1.0\n",
                    f.running.load(Ordering::Relaxed),
                    f.waiting.load(Ordering::Relaxed),
                )
            }),
        )
        .route(
            "/v1/completions",
            post(
                |State(f): State<Arc<FakeVllm>>, body: axum::Json<serde_json::Value>| async move {
                    if let Some(gate) = &f.gate {
                        gate.acquire().await.unwrap().forget();
                    }
                    let prompt = body["prompt"].as_array().map_or(0, Vec::len);
                    assert!(prompt > 0 && prompt < 2048, "prompt of {prompt} tokens");
                    f.completions.fetch_add(1, Ordering::Relaxed);
                    axum::Json(serde_json::json!({"id": "cmpl-1", "object": "text_completion",
                        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}))
                },
            ),
        )
        .with_state(fake);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

async fn kv_publisher() -> KvEventPublisher {
    KvEventPublisher::bind(PublisherConfig::loopback(""))
        .await
        .unwrap()
}

fn config(vllm: SocketAddr, kv: &KvEventPublisher, extra: &[&str]) -> Config {
    let url = format!("http://{vllm}");
    let mut args = vec![
        "kvsight-sidecar",
        "--pod-name",
        "pod-0",
        "--vllm-url",
        &url,
        "--kv-events-endpoint",
        kv.endpoint(),
        "--scrape-interval",
        "20ms",
    ];
    args.extend_from_slice(extra);
    <Args as clap::Parser>::parse_from(args)
        .validate(|_| None)
        .unwrap()
}

async fn get_status(url: &str) -> u16 {
    reqwest::get(url)
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

async fn phase(shared: &Shared, want: Phase) {
    let mut rx = shared.watch_phase();
    tokio::time::timeout(WAIT, rx.wait_for(|p| *p == want))
        .await
        .unwrap_or_else(|_| panic!("phase {want:?} not reached, at {:?}", shared.phase()))
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warmup_runs_before_ready_and_drain_waits_for_idle() {
    let fake = Arc::new(FakeVllm {
        gate: Some(Semaphore::new(0)),
        ..FakeVllm::default()
    });
    let vllm = start_vllm(Arc::clone(&fake)).await;
    let kv = kv_publisher().await;
    let dir = std::env::temp_dir().join(format!("kvsight-warmup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("plan.json");
    std::fs::write(
        &plan,
        r#"[{"prompt_tokens": 16, "max_tokens": 2, "concurrency": 2},
            {"prompt_tokens": 5000, "max_tokens": 1, "concurrency": 1}]"#,
    )
    .unwrap();
    let cfg = config(
        vllm,
        &kv,
        &["--warmup", plan.to_str().unwrap(), "--drain-grace", "20s"],
    );
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", http.local_addr().unwrap());
    let debug = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let debug_base = format!("http://{}", debug.local_addr().unwrap());
    let shared = Arc::new(Shared::default());
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(run_with(
        Listeners {
            http,
            debug: Some(debug),
        },
        cfg,
        shutdown.clone(),
        Arc::clone(&shared),
    ));

    phase(&shared, Phase::Warming).await;
    assert_eq!(get_status(&format!("{base}/live")).await, 200);
    assert_eq!(get_status(&format!("{base}/ready")).await, 503);
    assert_eq!(fake.completions.load(Ordering::Relaxed), 0);
    // Facts were read from /v1/models and cache_config_info.
    let facts = shared.facts.get().unwrap();
    assert_eq!(facts.engine.block_size, 16);
    assert_eq!(facts.engine.num_gpu_blocks, 512);
    assert_eq!(facts.engine.max_model_len, 2048);
    assert_eq!(facts.engine.engine_version, "0.33.0");
    assert_eq!(facts.models, vec!["tiny".to_owned()]);
    assert_eq!(facts.lora_adapters, vec!["sql-lora".to_owned()]);

    fake.gate.as_ref().unwrap().add_permits(3);
    phase(&shared, Phase::Ready).await;
    assert_eq!(fake.completions.load(Ordering::Relaxed), 3);
    assert_eq!(get_status(&format!("{base}/ready")).await, 200);
    let metrics = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kvsight_sidecar_phase{phase=\"ready\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("kvsight_sidecar_warmup_seconds"));
    // Only on the debug listener.
    assert_eq!(get_status(&format!("{base}/debug/state")).await, 404);
    let state: serde_json::Value = serde_json::from_str(
        &reqwest::get(format!("{debug_base}/debug/state"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(state["phase"], "ready");
    assert_eq!(state["engine"]["num_gpu_blocks"], 512);

    // Load bypassing routers shows as unrouted.
    fake.running.store(2, Ordering::Relaxed);
    fake.waiting.store(1, Ordering::Relaxed);
    let mut load = shared.load.subscribe();
    tokio::time::timeout(
        WAIT,
        load.wait_for(|l| l.as_ref().is_some_and(|l| l.load.unrouted == 3)),
    )
    .await
    .expect("unrouted load reported")
    .unwrap();

    // Drain: Draining at once, /ready 503, and run() waits for vLLM to be idle.
    shutdown.cancel();
    phase(&shared, Phase::Draining).await;
    assert_eq!(get_status(&format!("{base}/ready")).await, 503);
    tokio::time::timeout(
        WAIT,
        load.wait_for(|l| l.as_ref().is_some_and(|l| l.load.phase == Phase::Draining)),
    )
    .await
    .expect("Draining reported in Load")
    .unwrap();
    assert!(!task.is_finished(), "drain must wait for running requests");
    fake.running.store(0, Ordering::Relaxed);
    fake.waiting.store(0, Ordering::Relaxed);
    tokio::time::timeout(WAIT, task)
        .await
        .expect("drained in time")
        .unwrap()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_drains_on_sigterm() {
    let fake = Arc::new(FakeVllm::default());
    let vllm = start_vllm(Arc::clone(&fake)).await;
    let kv = kv_publisher().await;
    // A free port for --listen (the child binds it itself).
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let listen = format!("127.0.0.1:{port}");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvsight-sidecar"))
        .args([
            "--pod-name",
            "pod-0",
            "--vllm-url",
            &format!("http://{vllm}"),
            "--kv-events-endpoint",
            kv.endpoint(),
            "--listen",
            &listen,
            "--warmup",
            "none",
            "--scrape-interval",
            "20ms",
            "--drain-grace",
            "10s",
        ])
        .kill_on_drop(true)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let ready = format!("http://{listen}/ready");
    let deadline = Instant::now() + WAIT;
    while get_status(&ready).await != 200 {
        assert!(Instant::now() < deadline, "binary never became ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = child.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("binary exited after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

#[test]
fn bad_config_exits_64_naming_the_field() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvsight-sidecar"))
        .args(["--pod-name", "p", "--scrape-interval", "soon"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("scrape-interval"), "{stderr}");
}
