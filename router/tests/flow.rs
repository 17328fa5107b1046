//! Flow control over real loopback HTTP with a `vllm-sim` pod registered by hand: the pod's load
//! reports (applied straight to the registry, as the QUIC listener applies them) open and close
//! the admission gate, so what queues and when it leaves is decided by the test, not by timing.
//! With every class's budget at 0, a pod takes a request only while nothing of this router's
//! is running on it: queued requests then leave one at a time, each when the one before
//! finished, and the order they finish in is the order the queue let them go.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvsight_protocol::messages::{Load, Phase};
use kvsight_router::State;
use kvsight_router::config::RouterConfig;
use kvsight_router::pods::ConnId;
use kvsight_sim::server::{SimConfig, SimPod, SimPodHandle};
use serde_json::{Value, json};

use common::*;

const GATED: &str = "
flowControl:
  enabled: true
  defaultClass: lo
  classes:
    - {name: hi, priority: 5, ttftBudgetSeconds: 0, maxWaitSeconds: 60}
    - {name: lo, priority: 0, ttftBudgetSeconds: 0, maxWaitSeconds: 60}
";

/// Bound on every wait of these tests.
const WAIT: Duration = Duration::from_secs(30);

struct Setup {
    st: Arc<State>,
    router: String,
    key: String,
    conn: ConnId,
    _sim: SimPodHandle,
}

impl Setup {
    async fn new(cfg: RouterConfig) -> Setup {
        let sim = SimPod::start(SimConfig {
            served_model_names: vec![MODEL.into()],
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let st = state(cfg);
        let (key, conn) = {
            let mut reg = st.registry();
            reg.register(hello("sim", &sim.base_url(), &[]), Instant::now())
        };
        let router = format!("http://{}", serve(kvsight_router::app(st.clone())).await);
        let s = Setup {
            st,
            router,
            key,
            conn,
            _sim: sim,
        };
        s.report(0);
        s
    }

    /// The pod reports `waiting` requests (none of this router's): with any waiting, no pod
    /// can start a request at once and the gate is closed.
    fn report(&self, waiting: u32) {
        self.report_load(load(Phase::Ready, 0, waiting));
    }

    /// The pod reports nothing waiting and its KV cache `kv_usage` full.
    fn report_kv(&self, kv_usage: f32) {
        self.report_load(Load {
            kv_usage,
            ..load(Phase::Ready, 0, 0)
        });
    }

    fn report_load(&self, l: Load) {
        self.st
            .registry()
            .apply_load(&self.key, self.conn, l, Instant::now())
            .unwrap();
    }

    /// A request of this router has waited `ago` for its first token on the pod (load that the
    /// counts do not show): the pod is free by its counts, and predicted to make a new request
    /// wait that long.
    fn stall(&self, ago: Duration) -> Instant {
        let at = Instant::now() - ago;
        self.st.registry().record_awaiting(&self.key, at);
        at
    }

    async fn wait_queued(&self, n: usize) {
        let mut w = self.st.flow.watch_queued();
        tokio::time::timeout(WAIT, w.wait_for(|q| *q == n))
            .await
            .unwrap_or_else(|_| panic!("{n} queued within {WAIT:?}: {}", self.st.flow.queued()))
            .unwrap();
    }

    /// Sends a completion in its own task; its tag is pushed onto `done` when its answer ends.
    fn send(
        &self,
        tag: &str,
        headers: &[(&'static str, &str)],
        max_tokens: u32,
        done: &Arc<Mutex<Vec<String>>>,
    ) -> tokio::task::JoinHandle<(u16, String)> {
        let mut req = reqwest::Client::builder()
            .no_proxy()
            .build()
            .unwrap()
            .post(format!("{}/v1/completions", self.router))
            .body(
                json!({"model": MODEL, "prompt": format!("Say {tag}."), "max_tokens": max_tokens})
                    .to_string(),
            );
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let (tag, done) = (tag.to_owned(), done.clone());
        tokio::spawn(async move {
            let resp = req.send().await.unwrap();
            let status = resp.status().as_u16();
            let text = resp.text().await.unwrap();
            done.lock().unwrap().push(tag);
            (status, text)
        })
    }
}

async fn all_ok(tasks: Vec<tokio::task::JoinHandle<(u16, String)>>) {
    for t in tasks {
        let (status, text) = tokio::time::timeout(WAIT, t).await.unwrap().unwrap();
        assert_eq!(status, 200, "{text}");
    }
}

#[tokio::test]
async fn a_higher_priority_leaves_the_queue_first() {
    let s = Setup::new(config_yaml(GATED)).await;
    s.report(3);
    let done = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..3 {
        tasks.push(s.send(&format!("lo{i}"), &[], 4, &done));
        s.wait_queued(2 * i + 1).await;
        let h = [("x-kvsight-priority", "hi")];
        tasks.push(s.send(&format!("hi{i}"), &h, 4, &done));
        s.wait_queued(2 * i + 2).await;
    }
    // The pod's queue is gone: the queue leaves one request at a time.
    s.report(0);
    all_ok(tasks).await;
    let order = done.lock().unwrap().clone();
    assert_eq!(order, ["hi0", "hi1", "hi2", "lo0", "lo1", "lo2"]);
}

#[tokio::test]
async fn a_class_over_its_kv_ceiling_waits_while_a_higher_one_goes() {
    let cfg = "
flowControl:
  enabled: true
  defaultClass: lo
  classes:
    - {name: hi, priority: 5, ttftBudgetSeconds: 60, maxWaitSeconds: 60}
    - {name: lo, priority: 0, ttftBudgetSeconds: 60, maxWaitSeconds: 60, kvCeiling: 0.5}
";
    let s = Setup::new(config_yaml(cfg)).await;
    // Free by every other measure (nothing waiting, under kvThreshold), but over lo's ceiling.
    s.report_kv(0.6);
    let done = Arc::new(Mutex::new(Vec::new()));
    let lo = s.send("lo", &[], 4, &done);
    s.wait_queued(1).await;
    let hi = s.send("hi", &[("x-kvsight-priority", "hi")], 4, &done);
    all_ok(vec![hi]).await;
    assert_eq!(s.st.flow.queued(), 1, "lo still waits under its ceiling");
    // The cache drains: lo leaves on the report.
    s.report_kv(0.3);
    all_ok(vec![lo]).await;
    assert_eq!(*done.lock().unwrap(), ["hi", "lo"]);
    assert_eq!(s.st.flow.queued(), 0);
}

#[tokio::test]
async fn tenants_share_by_tokens_not_by_requests() {
    let s = Setup::new(config_yaml(GATED)).await;
    s.report(3);
    let done = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    // `big` asks for 40 output tokens a request, `small` for 4: by tokens, `small` gets about
    // four turns to each of `big`'s; by requests they would alternate.
    for i in 0..4 {
        let h = [("x-kvsight-tenant", "big")];
        tasks.push(s.send(&format!("big{i}"), &h, 40, &done));
        s.wait_queued(i + 1).await;
    }
    for i in 0..8 {
        let h = [("x-kvsight-tenant", "small")];
        tasks.push(s.send(&format!("small{i}"), &h, 4, &done));
        s.wait_queued(5 + i).await;
    }
    s.report(0);
    all_ok(tasks).await;
    let order = done.lock().unwrap().clone();
    let small_first_six = order[..6].iter().filter(|t| t.starts_with("small")).count();
    assert!(small_first_six >= 4, "{order:?}");
    // Within a tenant, in order (equal deadlines: first come, first served).
    let smalls: Vec<&String> = order.iter().filter(|t| t.starts_with("small")).collect();
    let mut sorted = smalls.clone();
    sorted.sort();
    assert_eq!(smalls, sorted);
}

#[tokio::test]
async fn a_full_queue_answers_429_with_retry_after_at_once() {
    let cfg = format!("{GATED}  maxQueuedRequests: 1\n");
    let s = Setup::new(config_yaml(&cfg)).await;
    s.report(3);
    let done = Arc::new(Mutex::new(Vec::new()));
    let first = s.send("first", &[], 4, &done);
    s.wait_queued(1).await;
    let t0 = Instant::now();
    let resp = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(format!("{}/v1/completions", s.router))
        .body(json!({"model": MODEL, "prompt": "Say second.", "max_tokens": 4}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    let retry: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    let body: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(body["error"]["code"], 429, "{body}");
    assert_eq!(body["error"]["type"], "RateLimitError", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("queue is full"),
        "{body}"
    );
    // At once: the first request still waits.
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(s.st.flow.queued(), 1);
    // A higher priority takes the full queue's place: the queued one is answered 429.
    let hi = s.send("hi", &[("x-kvsight-priority", "hi")], 4, &done);
    let (status, text) = tokio::time::timeout(WAIT, first).await.unwrap().unwrap();
    assert_eq!(status, 429, "{text}");
    assert!(text.contains("higher priority"), "{text}");
    s.report(0);
    all_ok(vec![hi]).await;
    let metrics = s.st.metrics.render(&s.st.registry(), &[], Instant::now());
    for line in [
        r#"kvsight_router_flow_shed_total{class="lo",reason="queue_full"} 1"#,
        r#"kvsight_router_flow_shed_total{class="lo",reason="displaced"} 1"#,
        r#"kvsight_router_flow_admitted_total{class="hi",path="queued"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} in:\n{metrics}");
    }
}

#[tokio::test]
async fn a_client_that_leaves_while_queued_leaves_the_queue() {
    let s = Setup::new(config_yaml(GATED)).await;
    s.report(3);
    let done = Arc::new(Mutex::new(Vec::new()));
    let gone = s.send("gone", &[], 4, &done);
    s.wait_queued(1).await;
    let stays = s.send("stays", &[], 4, &done);
    s.wait_queued(2).await;
    // The client goes away: its connection closes.
    gone.abort();
    s.wait_queued(1).await;
    s.report(0);
    all_ok(vec![stays]).await;
    assert_eq!(*done.lock().unwrap(), ["stays"]);
    // Nothing of the departed request reached the pod or stays counted on it.
    let reg = s.st.registry();
    assert_eq!(reg.get(&s.key).unwrap().inflight, 0);
}

#[tokio::test]
async fn a_reload_applies_to_queued_requests() {
    let dir = std::env::temp_dir().join(format!("kvsight-flow-reload-{}", rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("router.yaml");
    std::fs::write(&path, GATED).unwrap();
    let s = Setup::new(RouterConfig::load(&path).unwrap()).await;
    s.stall(Duration::from_secs(5));
    let done = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..3 {
        tasks.push(s.send(&format!("r{i}"), &[], 4, &done));
        s.wait_queued(i + 1).await;
    }
    // A wider budget: the pod's five seconds are within it, so all three leave, without any
    // capacity freeing.
    let wide = GATED.replace("ttftBudgetSeconds: 0,", "ttftBudgetSeconds: 30,");
    std::fs::write(&path, &wide).unwrap();
    let mut last = Some(GATED.as_bytes().to_vec());
    assert_eq!(
        kvsight_router::reload::reload_once(&s.st, &path, &mut last),
        kvsight_router::reload::Outcome::Applied
    );
    all_ok(tasks).await;
    assert_eq!(s.st.flow.queued(), 0);
    // Turned off by a reload, flow control lets every queued request go as well.
    let mut tasks = Vec::new();
    std::fs::write(&path, GATED).unwrap();
    kvsight_router::reload::reload_once(&s.st, &path, &mut last);
    for i in 0..2 {
        tasks.push(s.send(&format!("o{i}"), &[], 4, &done));
        s.wait_queued(i + 1).await;
    }
    std::fs::write(&path, GATED.replace("enabled: true", "enabled: false")).unwrap();
    kvsight_router::reload::reload_once(&s.st, &path, &mut last);
    all_ok(tasks).await;
    let _ = std::fs::remove_dir_all(&dir);
}
