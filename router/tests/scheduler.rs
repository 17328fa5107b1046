//! The scheduler's decisions on a registry fed with real protocol messages (hellos, loads,
//! filter snapshots built by the sidecar-side counting filter). Each test states the behaviour a
//! blind router gets wrong.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvsight_protocol::bloom::{CountingFilter, FilterParams};
use kvsight_protocol::hash::{ChainSeed, hash_chain};
use kvsight_protocol::messages::*;
use kvsight_router::config::{PoolConfig, RouterConfig, SchedulerConfig};
use kvsight_router::pods::{ConnId, Registry};
use kvsight_router::scheduler::scorers::ScorerKind;
use kvsight_router::scheduler::{
    Decision, PickError, PickRequest, PromptHashes, Scheduler, cached_tokens,
};

use common::MODEL;

const BS: u32 = 16;

/// The shared test hello at a made-up URL, with prefix caching as asked and a short load
/// interval.
fn hello(name: &str, caching: bool) -> Hello {
    let mut h = common::hello(name, &format!("http://{name}:8000"), &[]);
    h.engine.block_size = BS;
    h.engine.prefix_caching = caching;
    h.load_interval_ms = 100;
    h
}

/// A Ready load with no prefix-cache history.
fn load(running: u32, waiting: u32, kv: f32) -> Load {
    Load {
        kv_usage: kv,
        prefix_cache_queries: 0,
        prefix_cache_hits: 0,
        ..common::load(Phase::Ready, running, waiting)
    }
}

struct Cluster {
    reg: Registry,
    conns: Vec<(String, ConnId)>,
    now: Instant,
}

impl Cluster {
    /// `pods` pods, Ready, idle, with empty filters.
    fn new(pods: usize, caching: bool) -> Self {
        let now = Instant::now();
        let mut reg = Registry::new();
        let mut conns = Vec::new();
        for i in 0..pods {
            let (key, conn) = reg.register(hello(&format!("pod-{i}"), caching), now);
            reg.apply_load(&key, conn, load(0, 0, 0.0), now).unwrap();
            let f = CountingFilter::new(FilterParams::for_capacity(1000, 0.01)).unwrap();
            reg.apply_snapshot(&key, conn, &f.snapshot()).unwrap();
            conns.push((key, conn));
        }
        Cluster { reg, conns, now }
    }

    /// Pod `i` now holds exactly these canonical blocks.
    fn holds(&mut self, i: usize, blocks: &[u64]) {
        let mut f = CountingFilter::new(FilterParams::for_capacity(1000, 0.01)).unwrap();
        for &b in blocks {
            f.insert(b);
        }
        let _ = f.take_delta();
        let (key, conn) = &self.conns[i];
        self.reg.apply_snapshot(key, *conn, &f.snapshot()).unwrap();
    }

    fn report(&mut self, i: usize, l: Load) {
        let (key, conn) = self.conns[i].clone();
        self.reg.apply_load(&key, conn, l, self.now).unwrap();
    }

    /// Time passes and every pod reports idle again (its requests finished).
    fn settle(&mut self) {
        self.now += Duration::from_millis(50);
        for i in 0..self.conns.len() {
            let key = self.conns[i].0.clone();
            while self.reg.get(&key).is_some_and(|p| p.inflight > 0) {
                self.reg.record_done(&key, self.now, self.now);
            }
            self.report(i, load(0, 0, 0.0));
        }
    }

    fn pick(&mut self, s: &Scheduler, tokens: &[u32]) -> Result<String, PickError> {
        let req = req(tokens);
        s.pick(&mut self.reg, &req, self.now).map(|d| d.pod)
    }
}

/// A request for `MODEL` with these tokens and nothing else set.
fn req(tokens: &[u32]) -> PickRequest<'_> {
    PickRequest {
        model: MODEL,
        pool: None,
        prompt_tokens: tokens.len() as u32,
        tokens: Some(tokens),
        cache_salt: None,
        exclude: &[],
    }
}

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| seed * 100_000 + i).collect()
}

/// Chat session `k`: a 640-token system prompt every session shares (40 blocks), then 460
/// tokens of its own.
fn session(k: u32) -> Vec<u32> {
    let mut p = prompt(50, 640);
    p.extend(prompt(60 + k, 460));
    p
}

fn sched(prefix: f64) -> Scheduler {
    let mut cfg = SchedulerConfig::default();
    cfg.weights.prefix = prefix;
    Scheduler::new(&cfg)
}

#[test]
fn shared_prefix_concentrates_and_prefix_weight_zero_spreads() {
    let p = prompt(1, 700);
    let chain = hash_chain(&ChainSeed::BASE, &p, BS as usize);
    let mut c = Cluster::new(3, true);
    c.holds(2, &chain);
    let s = sched(3.0);
    for _ in 0..6 {
        assert_eq!(c.pick(&s, &p).unwrap(), "ns/pod-2");
        c.settle();
    }
    // `prefix: 0` turns off every prefix preference (the cache's and `affinity`, this router's
    // memory of where a prefix went).
    let s0 = sched(0.0);
    let mut counts = BTreeMap::new();
    for _ in 0..6 {
        *counts.entry(c.pick(&s0, &p).unwrap()).or_insert(0) += 1;
        c.settle();
    }
    assert_eq!(
        counts.len(),
        3,
        "prefix 0 spreads serial requests: {counts:?}"
    );
    assert!(counts.values().all(|&n| n == 2), "{counts:?}");
}

#[test]
fn a_burst_with_a_new_prefix_lands_together_through_pending_blocks() {
    let mut c = Cluster::new(4, true);
    let s = sched(3.0);
    // No report arrives between the picks: only pending blocks tie them together.
    let first = c.pick(&s, &prompt(7, 512)).unwrap();
    for _ in 0..3 {
        assert_eq!(c.pick(&s, &prompt(7, 512)).unwrap(), first);
    }
    // After the TTL, pending blocks no longer attract (nothing was confirmed by the pod).
    c.now += Duration::from_secs(3);
    for i in 0..4 {
        c.report(i, load(0, 0, 0.0));
    }
    let d = {
        let p = prompt(7, 512);
        let req = req(&p);
        s.pick(&mut c.reg, &req, c.now).unwrap()
    };
    assert_eq!(d.matched_blocks, 0);
}

/// The saturation rule in time (`scheduler::saturation`): a loaded pod that holds the prompt is
/// skipped only when a sibling would start the request sooner, counting the prefill the sibling
/// must redo; when every pod is loaded, the cache still decides. A router that falls back to the
/// shortest queue sprays prompts away from their caches exactly when misses cost the most.
#[test]
fn a_busy_pod_is_skipped_only_when_a_sibling_starts_the_request_sooner() {
    let p = prompt(2, 2000); // 125 blocks, cached on pod-0
    let chain = hash_chain(&ChainSeed::BASE, &p, BS as usize);
    let s = sched(3.0);

    // Every slot taken on pod-0, the others idle: a free pod starts at once, pod-0 only after
    // the queue that taking a slot implies... but with no request waiting, pod-0's backlog is
    // only its own 16 uncached tokens against 2000 on a sibling: it keeps the request.
    let mut c = Cluster::new(3, true);
    c.holds(0, &chain);
    c.report(0, load(8, 0, 0.1));
    let d = {
        let req = req(&p);
        s.pick(&mut c.reg, &req, c.now).unwrap()
    };
    assert_eq!(d.pod, "ns/pod-0", "busy but still the soonest start: {d:?}");
    assert!(!d.all_saturated);

    // Five requests of this size waiting on pod-0 (nothing routed there yet, so each is assumed
    // as large as this prompt): 10,000 tokens ahead of it against 2,000 on an idle pod.
    let mut c = Cluster::new(3, true);
    c.holds(0, &chain);
    c.report(0, load(8, 5, 0.1));
    let d = {
        let req = req(&p);
        s.pick(&mut c.reg, &req, c.now).unwrap()
    };
    assert_ne!(d.pod, "ns/pod-0", "a long queue is worth skipping: {d:?}");
    assert_eq!(d.predicted_cached_tokens, 0);

    // Pod-0 has served this prompt (the router knows its requests there need little prefill):
    // the same five waiting requests are 5 × 16 tokens, far less than 2000: not skipped, it
    // competes. The scorers then decide; every slot taken and five waiting against idle
    // siblings outweighs the prefix at the default weights (the wait for a slot is decode time,
    // which the prefill backlog does not count); with no queue it keeps it (the
    // first case above).
    let mut c = Cluster::new(3, true);
    c.holds(0, &chain);
    for _ in 0..3 {
        assert_eq!(c.pick(&s, &p).unwrap(), "ns/pod-0");
        c.settle();
    }
    c.report(0, load(8, 5, 0.1));
    let d = {
        let req = req(&p);
        s.pick(&mut c.reg, &req, c.now).unwrap()
    };
    assert_eq!(d.saturation_skipped, 0, "pod-0 starts it soonest: {d:?}");
    assert!(!d.all_saturated);
}

/// A load report says how many requests wait on a pod, not why: a queue held up by running
/// requests that hold every KV block for minutes (load that bypassed the router) looks as short
/// as any. A streamed request of this router still waiting there for its first token shows how
/// long the queue really takes; the wait ends with that token (or the request).
#[test]
fn a_pod_where_a_stream_waits_long_for_its_first_token_is_skipped() {
    let p = prompt(2, 2000); // 125 blocks, cached on pod-0
    let chain = hash_chain(&ChainSeed::BASE, &p, BS as usize);
    let s = sched(3.0);
    // A stream sent to pod-0 800 ms ago, its first token come or not; every pod has reported
    // since, and pod-0's slots are taken with nothing waiting: by the report alone it starts
    // the prompt soonest (16 uncached tokens against 2000; the first case of the test above).
    let setup = |started: bool| {
        let mut c = Cluster::new(3, true);
        c.holds(0, &chain);
        let sent = c.now;
        c.reg.record_awaiting("ns/pod-0", sent);
        c.now += Duration::from_millis(800);
        for i in 1..3 {
            c.report(i, load(0, 0, 0.1));
        }
        c.report(0, load(8, 0, 0.1));
        if started {
            c.reg.record_started("ns/pod-0", sent);
        }
        c
    };
    let pick = |c: &mut Cluster| {
        let req = req(&p);
        s.pick(&mut c.reg, &req, c.now).unwrap()
    };
    let mut c = setup(false);
    let waited = c.reg.get("ns/pod-0").unwrap().oldest_awaiting(c.now);
    assert_eq!(waited, Duration::from_millis(800));
    let d = pick(&mut c);
    assert_ne!(
        d.pod, "ns/pod-0",
        "0.8 s of waiting against a 0.2 s prefill: {d:?}"
    );
    assert_eq!(d.saturation_skipped, 1, "{d:?}");
    // Its first token came: the queue moves, pod-0 keeps the prompt.
    let mut c = setup(true);
    assert_eq!(
        c.reg.get("ns/pod-0").unwrap().oldest_awaiting(c.now),
        Duration::ZERO
    );
    let d = pick(&mut c);
    assert_eq!(d.pod, "ns/pod-0", "{d:?}");
    // A request that ends without a first token (an error, a client gone) stops waiting too.
    let sent = c.now;
    c.reg.record_awaiting("ns/pod-1", sent);
    c.now += Duration::from_millis(100);
    assert_eq!(
        c.reg.get("ns/pod-1").unwrap().oldest_awaiting(c.now),
        Duration::from_millis(100)
    );
    c.reg.record_done("ns/pod-1", sent, c.now);
    assert_eq!(
        c.reg.get("ns/pod-1").unwrap().oldest_awaiting(c.now),
        Duration::ZERO
    );
}

#[test]
fn when_every_pod_is_loaded_the_cache_still_decides() {
    let p = prompt(3, 2000);
    let chain = hash_chain(&ChainSeed::BASE, &p, BS as usize);
    let mut c = Cluster::new(3, true);
    c.holds(1, &chain);
    c.report(0, load(8, 2, 0.5));
    c.report(1, load(8, 4, 0.5));
    c.report(2, load(8, 3, 0.5));
    let req = req(&p);
    let d = sched(3.0).pick(&mut c.reg, &req, c.now).unwrap();
    assert!(d.all_saturated, "{d:?}");
    assert_eq!(
        d.pod, "ns/pod-1",
        "the shortest queue (pod-0) would compute the whole prompt again"
    );
    assert!(d.predicted_ttft_s > 0.0);
    // With the prefix weight at 0, the lighter pods win again.
    let d = sched(0.0).pick(&mut c.reg, &req, c.now).unwrap();
    assert_eq!(d.pod, "ns/pod-0");
}

#[test]
fn a_pod_whose_cache_cannot_hold_the_prompt_is_skipped_while_another_can() {
    let p = prompt(4, 3200); // 200 blocks of a 1000-block cache
    let chain = hash_chain(&ChainSeed::BASE, &p[..1600], BS as usize);
    let mut c = Cluster::new(2, true);
    c.holds(0, &chain); // half cached on pod-0, whose cache is nearly all taken by running requests
    c.report(0, load(1, 0, 0.95));
    c.report(1, load(1, 0, 0.5));
    assert_eq!(c.pick(&sched(3.0), &p).unwrap(), "ns/pod-1");
    // Both full: the request still goes somewhere, where the cache is.
    let mut c = Cluster::new(2, true);
    c.holds(0, &chain);
    c.report(0, load(1, 0, 0.95));
    c.report(1, load(1, 0, 0.95));
    let req = req(&p);
    let d = sched(3.0).pick(&mut c.reg, &req, c.now).unwrap();
    assert!(d.all_saturated);
    assert_eq!(d.pod, "ns/pod-0");
}

#[test]
fn projected_kv_use_keeps_long_prompts_off_a_full_cache() {
    let p = prompt(3, 1600); // 100 blocks = 10 % of a 1000-block cache
    let chain = hash_chain(&ChainSeed::BASE, &p[..800], BS as usize);
    let mut c = Cluster::new(2, true);
    c.holds(0, &chain); // half the prompt cached on pod-0...
    c.report(0, load(1, 0, 0.86)); // ...but 86 % + 5 % new blocks > 90 %
    assert_eq!(c.pick(&sched(3.0), &p).unwrap(), "ns/pod-1");
    // Prompts sent since the last report count too: pod-1 holds a shared preamble, each request
    // adds 50 new blocks (5 %); the third would take pod-1 past 90 % before any report says so.
    let mut c = Cluster::new(2, true);
    let preamble = prompt(4, 800);
    c.holds(1, &hash_chain(&ChainSeed::BASE, &preamble, BS as usize));
    c.report(0, load(0, 0, 0.1));
    c.report(1, load(0, 0, 0.78));
    c.now += Duration::from_millis(1);
    // Only the prefix weight, so the saturation filter alone can move the third request.
    let mut cfg = SchedulerConfig::default();
    for w in [
        &mut cfg.weights.queue,
        &mut cfg.weights.kv_cache,
        &mut cfg.weights.running_requests,
        &mut cfg.weights.lru,
    ] {
        *w = 0.0;
    }
    let s = Scheduler::new(&cfg);
    let picks: Vec<String> = (0..3)
        .map(|i| {
            let mut p = preamble.clone();
            p.extend(prompt(40 + i, 800));
            c.pick(&s, &p).unwrap()
        })
        .collect();
    assert_eq!(picks, ["ns/pod-1", "ns/pod-1", "ns/pod-0"]);
}

#[test]
fn load_that_bypassed_the_router_is_seen() {
    let mut c = Cluster::new(2, true);
    // Someone runs a benchmark on pod-0 with kubectl exec: vLLM reports it, the router never sent it.
    c.report(0, load(6, 0, 0.3));
    let s = sched(3.0);
    for i in 0..3 {
        assert_eq!(c.pick(&s, &prompt(10 + i, 200)).unwrap(), "ns/pod-1");
        c.now += Duration::from_millis(10);
        c.report(0, load(6, 0, 0.3));
        c.report(1, load(0, 0, 0.0));
    }
}

#[test]
fn prefix_caching_off_uses_least_request_and_spreads() {
    let p = prompt(6, 700);
    let mut c = Cluster::new(3, false);
    let s = sched(3.0);
    let mut counts = BTreeMap::new();
    for _ in 0..9 {
        let req = req(&p);
        let d = s.pick(&mut c.reg, &req, c.now).unwrap();
        assert!(d.least_request);
        assert!(
            d.scores
                .iter()
                .all(|(n, _)| ["queue", "runningRequests", "lru"].contains(n)),
            "{:?}",
            d.scores
        );
        *counts.entry(d.pod).or_insert(0) += 1;
        c.settle();
    }
    assert!(counts.values().all(|&n| n == 3), "{counts:?}");
}

#[test]
fn not_ready_stale_draining_and_too_long() {
    let mut c = Cluster::new(2, true);
    let s = sched(3.0);
    let mut l = load(0, 0, 0.0);
    l.phase = Phase::Draining;
    c.report(0, l.clone());
    l.phase = Phase::Warming;
    c.report(1, l);
    assert_eq!(
        c.pick(&s, &prompt(1, 10)),
        Err(PickError::NoReadyPod(MODEL.into()))
    );
    c.report(1, load(0, 0, 0.0));
    assert_eq!(c.pick(&s, &prompt(1, 10)).unwrap(), "ns/pod-1");
    // Reports stop: after three intervals (100 ms each) but no sooner than 1 s, the pod is stale.
    c.now += Duration::from_millis(999);
    assert_eq!(c.pick(&s, &prompt(1, 10)).unwrap(), "ns/pod-1");
    c.now += Duration::from_millis(2);
    assert_eq!(
        c.pick(&s, &prompt(1, 10)),
        Err(PickError::NoReadyPod(MODEL.into()))
    );
    c.report(1, load(0, 0, 0.0));
    assert_eq!(
        c.pick(&s, &prompt(1, 4096)),
        Err(PickError::TooLong {
            prompt_tokens: 4096
        })
    );
    assert!(c.pick(&s, &prompt(1, 4095)).is_ok());
    // A pool window smaller than the pods' max_model_len.
    let pool = PoolConfig {
        name: "short".into(),
        models: vec![MODEL.into()],
        pod_selector: BTreeMap::new(),
        context_window: Some(1000),
        fallback: None,
    };
    let p = prompt(1, 1000);
    let req = PickRequest {
        model: MODEL,
        pool: Some(&pool),
        prompt_tokens: 1000,
        tokens: Some(&p),
        cache_salt: None,
        exclude: &[],
    };
    assert_eq!(
        s.pick(&mut c.reg, &req, c.now),
        Err(PickError::TooLong {
            prompt_tokens: 1000
        })
    );
    // An unknown model is not "too long".
    let req = PickRequest {
        model: "other",
        ..req
    };
    assert_eq!(
        s.pick(&mut c.reg, &req, c.now),
        Err(PickError::NoReadyPod("other".into()))
    );
}

#[test]
fn lora_requests_gather_where_the_adapter_is_loaded_and_salt_separates_chains() {
    let mut c = Cluster::new(2, true);
    let mut l = load(0, 0, 0.0);
    l.lora_running = vec!["sql-lora".into()];
    c.report(1, l);
    let p = prompt(8, 64);
    let req = PickRequest {
        model: "sql-lora",
        pool: None,
        prompt_tokens: 64,
        tokens: Some(&p),
        cache_salt: None,
        exclude: &[],
    };
    let s = sched(3.0);
    assert_eq!(s.pick(&mut c.reg, &req, c.now).unwrap().pod, "ns/pod-1");
    // A base-model chain on pod-0 does not count for a salted request.
    let chain = hash_chain(&ChainSeed::BASE, &p, BS as usize);
    c.holds(0, &chain);
    let salted = PickRequest {
        model: MODEL,
        cache_salt: Some("tenant"),
        ..req
    };
    let d = s.pick(&mut c.reg, &salted, c.now).unwrap();
    assert_eq!(d.matched_blocks, 0);
    let plain = PickRequest {
        cache_salt: None,
        ..salted
    };
    let d = s.pick(&mut c.reg, &plain, c.now).unwrap();
    assert_eq!(
        (d.pod.as_str(), d.matched_blocks, d.predicted_cached_tokens),
        ("ns/pod-0", 4, 48)
    );
}

/// Every weight in the config file reaches its own scorer: raising one kind's weight (written
/// under its config key) by 2 raises the pick's total by twice that scorer's value and changes no
/// scorer's value, for every kind. A weight joined to no scorer (a renamed scorer) would leave
/// the total where it was.
#[test]
fn every_weight_in_the_config_reaches_its_scorer() {
    let decide = |raised: Option<ScorerKind>| -> Decision {
        let weights: Vec<String> = ScorerKind::ALL
            .iter()
            .map(|&k| format!("{}: {}", k.key(), if raised == Some(k) { 3 } else { 1 }))
            .collect();
        let yaml = format!("scheduler: {{weights: {{{}}}}}", weights.join(", "));
        let cfg = RouterConfig::from_yaml(&yaml).unwrap();
        let s = Scheduler::new(&cfg.scheduler);
        // One pod, so every scorer has a value that can move the total: a first request
        // leaves the pod the prefix's home and 3 of the second prompt's 12 blocks pending.
        let mut c = Cluster::new(1, true);
        let base = prompt(31, 200);
        let mut first = base[..3 * BS as usize].to_vec();
        first.extend(prompt(32, 100));
        c.pick(&s, &first).unwrap();
        c.settle();
        c.report(0, load(0, 0, 0.4));
        s.pick(&mut c.reg, &req(&base), c.now).unwrap()
    };
    let base = decide(None);
    assert_eq!(
        base.scores.len(),
        ScorerKind::ALL.len(),
        "{:?}",
        base.scores
    );
    for kind in ScorerKind::ALL {
        let value = base
            .scores
            .iter()
            .find(|(k, _)| *k == kind.key())
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("{kind:?} is reported: {:?}", base.scores));
        assert!(value > 0.0, "{kind:?} contributes on this cluster");
        let raised = decide(Some(kind));
        assert_eq!(raised.scores, base.scores, "{kind:?}: the values stay");
        let gained = raised.total - base.total;
        assert!(
            (gained - 2.0 * value).abs() < 1e-9,
            "{kind:?}: weight +2 adds {gained}, its value is {value}"
        );
    }
    // The values differ where they can, so a weight joined to another kind's scorer shows too.
    let value = |k: &str| base.scores.iter().find(|(n, _)| *n == k).unwrap().1;
    assert_eq!(value("prefix"), 0.25);
    assert!((value("kvCache") - 0.6).abs() < 1e-6);
}

#[test]
fn cached_tokens_follow_vllms_last_token_rule() {
    assert_eq!(
        cached_tokens(4, 16, 64),
        48,
        "a fully cached prompt recomputes its last block"
    );
    assert_eq!(cached_tokens(4, 16, 65), 64);
    assert_eq!(cached_tokens(2, 16, 100), 32);
    assert_eq!(cached_tokens(0, 16, 100), 0);
}

#[test]
fn excluded_pods_are_not_picked_and_decisions_explain_themselves() {
    let mut c = Cluster::new(2, true);
    let p = prompt(9, 64);
    let excl = vec!["ns/pod-0".to_string()];
    let req = PickRequest {
        model: MODEL,
        pool: None,
        prompt_tokens: 64,
        tokens: Some(&p),
        cache_salt: None,
        exclude: &excl,
    };
    let d = sched(3.0).pick(&mut c.reg, &req, c.now).unwrap();
    assert_eq!(d.pod, "ns/pod-1");
    assert_eq!(d.candidates, 1);
    assert_eq!(
        d.scores.len(),
        7,
        "every scorer with a weight is reported: {:?}",
        d.scores
    );
    assert_eq!(c.reg.get("ns/pod-1").unwrap().inflight, 1);
}

#[test]
fn requests_that_finished_since_the_last_report_no_longer_count_as_load() {
    let mut c = Cluster::new(2, true);
    let s = sched(3.0);
    // Two serial short requests after the last report, each finished before the next; no new
    // report arrives in between.
    for n in 0..2 {
        c.now += Duration::from_millis(1);
        let pod = c.pick(&s, &prompt(100 + n, 64)).unwrap();
        c.reg.record_done(&pod, c.now, c.now);
        let p = c.reg.get(&pod).unwrap().projection();
        assert_eq!(p.running, 0, "a finished request is not running: {p:?}");
        assert_eq!(p.kv_usage, 0.0, "nor holding blocks: {p:?}");
    }
    // One still in flight counts.
    c.now += Duration::from_millis(1);
    let pod = c.pick(&s, &prompt(200, 64)).unwrap();
    let p = c.reg.get(&pod).unwrap().projection();
    assert_eq!((p.running, p.sent_since_sample), (1, 1), "{p:?}");
    assert!(p.kv_usage > 0.0);
}

#[test]
fn a_request_sent_just_before_a_sample_still_counts_until_the_engine_can_have_seen_it() {
    let mut c = Cluster::new(1, true);
    let s = sched(3.0);
    let pod = c.pick(&s, &prompt(300, 64)).unwrap();
    // A report sampled 20 ms later does not include it yet (still in transit or tokenizing).
    c.now += Duration::from_millis(20);
    c.report(0, load(0, 0, 0.0));
    assert_eq!(c.reg.get(&pod).unwrap().projection().running, 1);
    // One sampled well after it does.
    c.now += Duration::from_millis(200);
    c.report(0, load(1, 0, 0.0));
    let p = c.reg.get(&pod).unwrap().projection();
    assert_eq!((p.running, p.sent_since_sample), (1, 0), "{p:?}");
}

#[test]
fn a_request_sent_inside_the_admission_lag_stops_counting_once_it_finished_after_the_sample() {
    let mut c = Cluster::new(1, true);
    let s = sched(3.0);
    let sent = c.now;
    let pod = c.pick(&s, &prompt(310, 64)).unwrap();
    // The engine admitted it at once: a report sampled 20 ms later counts it running. The
    // router cannot know that it did, so while the request is in flight it counts it on top
    // (twice, the safe side).
    c.now += Duration::from_millis(20);
    c.report(0, load(1, 0, 0.0));
    assert_eq!(c.reg.get(&pod).unwrap().projection().running, 2);
    // It finishes 5 ms later. The report still says running 1 until the next one (an interval
    // later), but a request sent before the sample and finished after it is one the report
    // counted: the pod is idle now. (It read running 1 here, and a sequence of short requests
    // went to the pod that had not served the last one.)
    c.now += Duration::from_millis(5);
    c.reg.record_done(&pod, sent, c.now);
    let p = c.reg.get(&pod).unwrap().projection();
    assert_eq!(
        (p.running, p.waiting, p.sent_since_sample),
        (0, 0, 0),
        "{p:?}"
    );
    assert_eq!(p.kv_usage, 0.0, "{p:?}");
    // A request that finished before the next report's sample is not in that report: nothing
    // is subtracted from it.
    let sent = c.now;
    c.pick(&s, &prompt(311, 64)).unwrap();
    c.now += Duration::from_millis(5);
    c.reg.record_done(&pod, sent, c.now);
    c.now += Duration::from_millis(200);
    c.report(0, load(1, 0, 0.0));
    assert_eq!(c.reg.get(&pod).unwrap().projection().running, 1);
}

#[test]
fn pending_blocks_confirmed_by_the_pod_then_evicted_are_not_credited_for_the_rest_of_the_ttl() {
    let mut c = Cluster::new(2, true);
    let s = sched(3.0);
    let tokens = prompt(7, 160);
    let chain = hash_chain(&ChainSeed::BASE, &tokens, BS as usize);
    let pod = c.pick(&s, &tokens).unwrap();
    let i = if pod == "ns/pod-0" { 0 } else { 1 };
    let matched = |c: &Cluster| c.reg.get(&pod).unwrap().matched_blocks(&chain, None, c.now);
    assert_eq!(matched(&c), chain.len(), "pending right after the pick");
    // The pod's events confirm the chain; then other traffic evicts it, well within the TTL.
    c.holds(i, &chain);
    assert_eq!(matched(&c), chain.len());
    c.holds(i, &[]);
    assert_eq!(
        matched(&c),
        0,
        "an evicted prefix is not credited from pending memory"
    );
}

#[test]
fn a_request_the_last_report_counted_stops_counting_when_it_finishes() {
    let mut c = Cluster::new(2, true);
    let s = sched(3.0);
    let sent = c.now;
    let pod = c.pick(&s, &prompt(400, 64)).unwrap();
    let i = if pod == "ns/pod-0" { 0 } else { 1 };
    // A report sampled well after the send counts it as running.
    c.now += Duration::from_millis(200);
    c.report(i, load(1, 0, 0.0));
    assert_eq!(c.reg.get(&pod).unwrap().projection().running, 1);
    // It finishes before the next report: the pod is idle now, not for another interval.
    c.reg.record_done(&pod, sent, c.now);
    let p = c.reg.get(&pod).unwrap().projection();
    assert_eq!((p.running, p.waiting), (0, 0), "{p:?}");
    // Load the router did not send stays: the report's other running request is not ours.
    let sent2 = c.now;
    let pod2 = c.pick(&s, &prompt(401, 64)).unwrap();
    let j = if pod2 == "ns/pod-0" { 0 } else { 1 };
    c.now += Duration::from_millis(200);
    c.report(j, load(3, 0, 0.0));
    c.reg.record_done(&pod2, sent2, c.now);
    assert_eq!(c.reg.get(&pod2).unwrap().projection().running, 2);
}

#[test]
fn pending_memory_keeps_the_newest_chains_per_first_block_and_one_copy_of_a_repeat() {
    use kvsight_router::pods::MAX_PENDING_PER_FIRST_BLOCK;
    let mut c = Cluster::new(1, true);
    let s = sched(3.0);
    // Prompts sharing their first 3 blocks (a system prompt), then differing.
    let prompt_n = |n: u32| -> Vec<u32> {
        let mut t = prompt(9, 48);
        t.extend(prompt(1000 + n, 32));
        t
    };
    let n_total = MAX_PENDING_PER_FIRST_BLOCK as u32 + 4;
    for n in 0..n_total {
        c.pick(&s, &prompt_n(n)).unwrap();
        // A repeat of the same prompt is one entry, refreshed.
        c.pick(&s, &prompt_n(n)).unwrap();
    }
    let pod = c.reg.get("ns/pod-0").unwrap();
    let matched = |n: u32| {
        let chain = hash_chain(&ChainSeed::BASE, &prompt_n(n), BS as usize);
        (pod.matched_blocks(&chain, None, c.now), chain.len())
    };
    let (m, len) = matched(n_total - 1);
    assert_eq!(m, len, "the newest chain is pending in full");
    let (m, len) = matched(0);
    assert_eq!(
        m, 3,
        "the oldest was dropped; its shared prefix still matches a newer chain"
    );
    assert!(len > 3);
}

/// The router hashes a prompt before it takes the registry lock, from the pods it saw then; a pod
/// with another block size that joined in between is still matched on its own chain.
#[test]
fn hashes_made_before_a_pod_with_another_block_size_joined_still_match_it() {
    let mut c = Cluster::new(1, true);
    let p = prompt(3, 640);
    let r = req(&p);
    let mut hashes = PromptHashes::new(&Scheduler::hash_plan(&c.reg, &r), r.tokens);

    let mut h = hello("pod-32", true);
    h.engine.block_size = 32;
    let (key, conn) = c.reg.register(h, c.now);
    c.reg
        .apply_load(&key, conn, load(0, 0, 0.0), c.now)
        .unwrap();
    let mut f = CountingFilter::new(FilterParams::for_capacity(1000, 0.01)).unwrap();
    for b in hash_chain(&ChainSeed::BASE, &p, 32) {
        f.insert(b);
    }
    let _ = f.take_delta();
    c.reg.apply_snapshot(&key, conn, &f.snapshot()).unwrap();

    let d = sched(3.0)
        .pick_prepared(&mut c.reg, &r, &mut hashes, c.now)
        .unwrap();
    assert_eq!(d.pod, "ns/pod-32");
    assert_eq!((d.matched_blocks, d.chain_len), (20, 20));
    assert_eq!(
        d.predicted_cached_tokens, 608,
        "640 tokens less the last block"
    );
}

/// Hashes made while no pod served `sql-lora` as an adapter used the base seed; once one does,
/// the adapter's chains differ, and the stale hashes are dropped rather than matched.
#[test]
fn hashes_made_under_a_seed_the_pods_no_longer_imply_are_recomputed() {
    let p = prompt(4, 320);
    let r = PickRequest {
        model: "sql-lora",
        ..req(&p)
    };
    let mut hashes = PromptHashes::new(&Scheduler::hash_plan(&Registry::new(), &r), r.tokens);

    let mut c = Cluster::new(2, true);
    let seed = ChainSeed {
        lora: Some("sql-lora"),
        cache_salt: None,
    };
    c.holds(1, &hash_chain(&seed, &p, BS as usize));
    let d = sched(3.0)
        .pick_prepared(&mut c.reg, &r, &mut hashes, c.now)
        .unwrap();
    assert_eq!(d.pod, "ns/pod-1");
    assert_eq!(d.matched_blocks, 20);
}

/// Hashes are tied to the token list they were made from: given another prompt's hashes (same
/// length, same seed), the pick hashes the request's own tokens.
#[test]
fn hashes_of_another_prompt_of_the_same_length_are_not_used() {
    let mut c = Cluster::new(2, true);
    let (a, b) = (prompt(5, 320), prompt(6, 320));
    c.holds(0, &hash_chain(&ChainSeed::BASE, &a, BS as usize));
    c.holds(1, &hash_chain(&ChainSeed::BASE, &b, BS as usize));
    let ra = req(&a);
    let mut hashes = PromptHashes::new(&Scheduler::hash_plan(&c.reg, &ra), ra.tokens);
    let d = sched(3.0)
        .pick_prepared(&mut c.reg, &req(&b), &mut hashes, c.now)
        .unwrap();
    assert_eq!((d.pod.as_str(), d.matched_blocks), ("ns/pod-1", 20));
}

/// Past saturation a prefix is often evicted from every pod between two of its requests; a
/// router that then places it by load alone scatters it, and every pod ends up holding every
/// tenant. The `affinity` weight sends it back to its home, the pod this router first sent it to
/// — a preference among loaded pods that lapses after `affinityTtlSeconds`.
#[test]
fn a_prefix_no_cache_holds_returns_to_its_home_until_the_home_is_forgotten() {
    let p = prompt(5, 1200);
    let s = with_affinity(1.0);
    // Equally loaded pods, so without a home the pod picked longest ago (`lru`) would win. The
    // prefix is routed once, then `after` passes (beyond the pending TTL: no cache and no
    // pending block speaks for it any more).
    let routed_once_then = |after: Duration| {
        let mut c = Cluster::new(3, true);
        let all_loaded = |c: &mut Cluster| {
            for i in 0..3 {
                c.report(i, load(8, 2, 0.5));
            }
        };
        all_loaded(&mut c);
        let home = c.pick(&s, &p).unwrap();
        c.now += after;
        all_loaded(&mut c);
        (c, home)
    };
    let (mut c, home) = routed_once_then(Duration::from_secs(3));
    let d = {
        let req = req(&p);
        s.pick(&mut c.reg, &req, c.now).unwrap()
    };
    assert!(d.all_saturated, "{d:?}");
    assert_eq!(d.matched_blocks, 0, "nothing cached anywhere: {d:?}");
    assert_eq!(d.pod, home, "the prefix goes home: {d:?}");

    // Without the weight, the tie-breaker decides.
    let (mut c, home) = routed_once_then(Duration::from_secs(3));
    let d = {
        let req = req(&p);
        with_affinity(0.0).pick(&mut c.reg, &req, c.now).unwrap()
    };
    assert_ne!(d.pod, home, "{d:?}");

    // Once the home is older than the TTL, it is no home.
    let ttl = SchedulerConfig::default().affinity_ttl();
    let (mut c, home) = routed_once_then(ttl + Duration::from_secs(1));
    let d = {
        let req = req(&p);
        s.pick(&mut c.reg, &req, c.now).unwrap()
    };
    assert_ne!(d.pod, home, "{d:?}");
}

/// The scheduler with `affinity` at `w` (everything else default).
fn with_affinity(w: f64) -> Scheduler {
    let mut cfg = SchedulerConfig::default();
    cfg.weights.affinity = w;
    Scheduler::new(&cfg)
}

/// A pick excluding some pods: the test's way of forcing where a prompt lands.
fn pick_excluding(c: &mut Cluster, s: &Scheduler, p: &[u32], exclude: &[&str]) -> Decision {
    let exclude: Vec<String> = exclude.iter().map(|e| format!("ns/{e}")).collect();
    let req = PickRequest {
        exclude: &exclude,
        ..req(p)
    };
    s.pick(&mut c.reg, &req, c.now).unwrap()
}

/// A home is sticky: sending a prefix elsewhere for load does not move it, so when no cache
/// holds the prefix any more it returns to the pod it first lived on — not to wherever load last
/// pushed it (which would make every pod a home of every tenant in turn).
#[test]
fn a_prefix_sent_elsewhere_for_load_keeps_its_first_home() {
    let p = prompt(6, 1200);
    let s = with_affinity(3.0);
    let mut c = Cluster::new(3, true);
    let home = pick_excluding(&mut c, &s, &p, &["pod-1", "pod-2"]).pod;
    assert_eq!(home, "ns/pod-0");
    c.settle();
    let moved = pick_excluding(&mut c, &s, &p, &["pod-0", "pod-2"]).pod;
    assert_eq!(moved, "ns/pod-1");
    // Past the pending TTL nothing speaks for the prefix; pod-1 (where it went last) is the
    // lightest, pod-0 and pod-2 equally loaded by counts. pod-2's free KV pool (50 blocks) cannot
    // take the prompt's 75 without evicting: the caches are starved, and homes count in full
    // (`homes::eviction_share`).
    c.now += Duration::from_secs(3);
    c.report(0, load(8, 2, 0.5));
    c.report(1, load(6, 2, 0.5));
    c.report(2, load(8, 2, 0.95));
    let d = {
        let req = req(&p);
        s.pick(&mut c.reg, &req, c.now).unwrap()
    };
    assert_eq!(d.matched_blocks, 0, "nothing cached anywhere: {d:?}");
    assert_eq!(d.pod, "ns/pod-0", "the first home, not the last pod: {d:?}");
    let home_score = d.scores.iter().find(|(k, _)| *k == "affinity").unwrap().1;
    assert_eq!(home_score, 1.0, "sent there whole before: {d:?}");
}

/// A busy home may start a prompt a little later than a free sibling and still compete: by up
/// to twenty of the sibling's own prefills of it (`HOME_SLACK_PREFILLS`; a move pays the prefill
/// now and again for what the copy evicts). A longer queue is still skipped, and with `affinity`
/// off the free sibling always wins. Where every sibling's free KV pool holds the prompt many
/// times over, the copy evicts nothing anyone is likely to ask for again: the home's claim
/// shrinks to the share of that pool the copy takes, and the free sibling wins.
#[test]
fn a_busy_home_competes_while_its_queue_is_shorter_than_a_prefill_elsewhere() {
    let p = prompt(7, 2000); // 125 blocks
    let short: Vec<Vec<u32>> = (0..12).map(|i| prompt(100 + i, 200)).collect();
    // Routes `p` to pod-0 once, then short prompts there until the size pod-0 assumes for each
    // waiting request (the smoothed uncached tokens routed there) is about 700 tokens; past the
    // pending TTL every pod runs 6 requests (of 8 slots) and pod-0 has `waiting` more.
    let setup = |s: &Scheduler, waiting: u32, starved: bool| {
        let mut c = Cluster::new(3, true);
        pick_excluding(&mut c, s, &p, &["pod-1", "pod-2"]);
        for q in &short {
            pick_excluding(&mut c, s, q, &["pod-1", "pod-2"]);
        }
        c.settle();
        c.now += Duration::from_secs(3);
        for i in 0..3 {
            c.report(i, load(6, 0, 0.3));
        }
        c.report(0, load(6, waiting, 0.3));
        if starved {
            // pod-2's cache is nearly all held by running requests: it cannot take the prompt
            // (full, left out), and a move there would evict. pod-1 has room.
            c.report(2, load(6, 0, 0.95));
        }
        c
    };
    let pick = |c: &mut Cluster, s: &Scheduler| {
        let req = req(&p);
        s.pick(&mut c.reg, &req, c.now).unwrap()
    };
    // Four waiting requests of ~700 tokens ahead plus 2000 against 2000 on a free sibling, and a
    // slack of twenty prefills (40,000): the home competes, and its home score outweighs its longer
    // queue.
    let s = with_affinity(3.0);
    let d = pick(&mut setup(&s, 4, true), &s);
    assert_eq!(d.pod, "ns/pod-0", "{d:?}");
    assert!(!d.all_saturated && d.saturation_skipped == 1, "{d:?}");
    let home_score = d.scores.iter().find(|(k, _)| *k == "affinity").unwrap().1;
    assert_eq!(home_score, 1.0, "{d:?}");
    // Eighty waiting (~56,000 tokens ahead): more than the slack; skipped (with the full pod-2).
    let d = pick(&mut setup(&s, 80, true), &s);
    assert_ne!(d.pod, "ns/pod-0", "{d:?}");
    assert_eq!(d.saturation_skipped, 2, "{d:?}");
    // Both siblings with 700 free blocks for the prompt's 125: a claim of 0.18, and pod-1 or
    // pod-2 starts it sooner.
    let d = pick(&mut setup(&s, 4, false), &s);
    assert_ne!(d.pod, "ns/pod-0", "{d:?}");
    // `affinity` off: no slack, the free sibling starts it sooner.
    let s = with_affinity(0.0);
    let d = pick(&mut setup(&s, 1, true), &s);
    assert_ne!(d.pod, "ns/pod-0", "{d:?}");
}

/// A prefix no pod is home to (and no pod caches a quarter of) goes where it will have room to
/// stay: the pod whose working set — the blocks of the prefixes it is home to that were sent
/// there again, or lately — is lightest, so equal tenants end up evenly spread and a long
/// prompt counts for its length. With `affinity` off the pod picked longest ago (`lru`) wins
/// among equally loaded pods; a prefix sent once long ago no longer weighs on its pod.
#[test]
fn a_new_prefix_goes_where_the_lightest_working_set_lives() {
    for w in [3.0, 0.0] {
        let s = with_affinity(w);
        let mut c = Cluster::new(3, true);
        // pod-0 home to two prompts of 62 blocks (depths 1 – 32 each), pod-2 to one; pod-1
        // only served a prompt shorter than a block (no chain, no home) and is the pod picked
        // last.
        pick_excluding(&mut c, &s, &prompt(1, 1000), &["pod-1", "pod-2"]);
        pick_excluding(&mut c, &s, &prompt(2, 1000), &["pod-1", "pod-2"]);
        pick_excluding(&mut c, &s, &prompt(3, 1000), &["pod-0", "pod-1"]);
        pick_excluding(&mut c, &s, &prompt(4, 10), &["pod-0", "pod-2"]);
        c.settle();
        let d = {
            let p = prompt(5, 1000);
            let req = req(&p);
            s.pick(&mut c.reg, &req, c.now).unwrap()
        };
        if w > 0.0 {
            assert_eq!(c.reg.homes().working_set("ns/pod-0"), 64);
            assert_eq!(c.reg.homes().working_set("ns/pod-2"), 32);
            assert_eq!(d.pod, "ns/pod-1", "the lightest working set: {d:?}");
            let room = d.scores.iter().find(|(k, _)| *k == "affinity").unwrap().1;
            assert_eq!(room, 1.0, "{d:?}");
        } else {
            assert_eq!(d.pod, "ns/pod-0", "picked longest ago: {d:?}");
            assert_eq!(c.reg.homes().working_set("ns/pod-0"), 0, "homes off");
        }
    }
    // Eleven seconds on, prompt 1 sent home again: it counts for as long as it stays homed,
    // the prompts sent once (2, 3 and 5) no longer do.
    let s = with_affinity(3.0);
    let mut c = Cluster::new(3, true);
    pick_excluding(&mut c, &s, &prompt(1, 1000), &["pod-1", "pod-2"]);
    pick_excluding(&mut c, &s, &prompt(2, 1000), &["pod-1", "pod-2"]);
    pick_excluding(&mut c, &s, &prompt(3, 1000), &["pod-0", "pod-1"]);
    c.now += Duration::from_secs(11);
    c.settle();
    pick_excluding(&mut c, &s, &prompt(1, 1000), &["pod-1", "pod-2"]);
    assert_eq!(c.reg.homes().working_set("ns/pod-0"), 32);
    assert_eq!(c.reg.homes().working_set("ns/pod-2"), 0);
    c.settle();
    let d = {
        let p = prompt(6, 1000);
        let req = req(&p);
        s.pick(&mut c.reg, &req, c.now).unwrap()
    };
    assert_ne!(d.pod, "ns/pod-0", "{d:?}");
}

/// Room is a difference between working sets, against what the lightest leaves free: one
/// prefix more on a pod weighs more when its sibling already homes two than when it homes none,
/// so the last tenants of a filling fleet are spread by working set and not by a moment's load.
/// Scored as a share of the heaviest, the 3-against-2 gap would be worth two thirds of the
/// 1-against-0 gap; as a difference against a quarter of the whole cache, the same
/// (docs/decisions/0011-room-floor.md).
#[test]
fn one_prefix_more_weighs_more_as_the_caches_fill() {
    // `lru` off: every pick here happens at one instant, so which pod it deems picked longest
    // ago is not the point.
    let mut cfg = SchedulerConfig::default();
    cfg.weights.lru = 0.0;
    let s = Scheduler::new(&cfg);
    // pod-0 homes `k + 1` prompts of 128 blocks, pod-1 `k`; the margin of pod-1 (the lighter)
    // over pod-0 for a new prompt.
    let margin = |k: u32| {
        let mut c = Cluster::new(2, true);
        for i in 0..k {
            pick_excluding(&mut c, &s, &prompt(10 + i, 2048), &["pod-0"]);
        }
        for i in 0..=k {
            pick_excluding(&mut c, &s, &prompt(20 + i, 2048), &["pod-1"]);
        }
        c.settle();
        let blocks = |pod: &str| c.reg.homes().working_set(pod);
        assert_eq!(blocks("ns/pod-0"), 128 * u64::from(k + 1));
        assert_eq!(blocks("ns/pod-1"), 128 * u64::from(k));
        let p = prompt(30, 2048);
        let d = s.pick(&mut c.reg, &req(&p), c.now).unwrap();
        assert_eq!(d.pod, "ns/pod-1", "the lighter working set: {d:?}");
        d.margin
    };
    let (first, deeper) = (margin(0), margin(2));
    // 0.128 of a cache apart against a quarter of what the lighter leaves: of all of it first,
    // of 0.744 of it then (the ratio form gave 3 × 0.512, then 3 × 0.333; a quarter of the
    // whole cache 3 × 0.512 both times).
    assert!((first - 3.0 * 0.512).abs() < 1e-6, "{first}");
    let expected = 3.0 * 0.128 / (0.25 * 0.744);
    assert!((deeper - expected).abs() < 1e-6, "{first} then {deeper}");
    assert!(deeper > first + 0.5, "{first} then {deeper}");
}

/// A pod whose queue stands still (this router's oldest stream there has waited long for its
/// first token) serves fewer of its homes, so its working set looks lightest: a new prefix is
/// not homed there while it would start the prompt later than the soonest pod plus a home's
/// slack (`saturation::room_cutoff`) — even though it still competes on the other scorers.
#[test]
fn a_new_prefix_is_not_homed_on_a_pod_whose_queue_stands_still() {
    let s = with_affinity(3.0);
    let p = prompt(9, 1000);
    // Every pod busy (8 waiting); pod-0 home to two prompts, pod-2 to one, pod-1 to none,
    // and a stream sent to pod-1 `stuck` ago still awaits its first token.
    let setup = |stuck: Duration| {
        let mut c = Cluster::new(3, true);
        pick_excluding(&mut c, &s, &prompt(1, 1000), &["pod-1", "pod-2"]);
        pick_excluding(&mut c, &s, &prompt(2, 1000), &["pod-1", "pod-2"]);
        pick_excluding(&mut c, &s, &prompt(3, 1000), &["pod-0", "pod-1"]);
        c.settle();
        let sent = c.now;
        c.reg.record_awaiting("ns/pod-1", sent);
        c.now += stuck.max(Duration::from_secs(3)); // past the pending TTL
        for i in 0..3 {
            c.report(i, load(8, 8, 0.3));
        }
        if stuck.is_zero() {
            c.reg.record_started("ns/pod-1", sent);
        }
        c
    };
    // The others: 8 waiting of ~1000 tokens at 10,000 tokens/s, then the prompt's own 0.1 s:
    // 0.9 s. pod-1 after 3 s of waiting: 3.1 s, inside the saturated outlier cut (4 × 1.0 s) but
    // past the room cut (0.9 s + 20 × 0.1 s).
    let mut c = setup(Duration::from_secs(3));
    let d = s.pick(&mut c.reg, &req(&p), c.now).unwrap();
    assert!(d.all_saturated, "{d:?}");
    assert_eq!(d.saturation_skipped, 0, "pod-1 still competes: {d:?}");
    assert_eq!(
        d.pod, "ns/pod-2",
        "the lighter of the pods that move: {d:?}"
    );
    // Its queue moves: pod-1 is the lightest and takes the prefix.
    let mut c = setup(Duration::ZERO);
    let d = s.pick(&mut c.reg, &req(&p), c.now).unwrap();
    assert_eq!(d.pod, "ns/pod-1", "{d:?}");
}

/// A pod that leaves takes its homes with it: its prefixes are placed afresh (and a pod that
/// returns under the same name is not their home any more).
#[test]
fn homes_of_a_pod_that_left_are_forgotten() {
    let s = with_affinity(3.0);
    let mut c = Cluster::new(2, true);
    let p = prompt(8, 1000);
    pick_excluding(&mut c, &s, &p, &["pod-1"]);
    let (key, conn) = c.conns[0].clone();
    assert!(c.reg.homes().count(&key) > 0);
    assert!(c.reg.unregister(&key, conn));
    assert_eq!(c.reg.homes().count(&key), 0);
    assert!(c.reg.homes().is_empty());
}

/// A system prompt every session starts with ends up on every pod: its home is worth nothing
/// there (it counts only beyond what most other pods hold), so a new session goes where the
/// fewest prefixes live instead of piling onto the pod that served the first session. A tenant's
/// prefix that a sibling holds too (moved once for load) keeps its home.
#[test]
fn a_prefix_most_pods_hold_is_nobodys_home() {
    let s = with_affinity(3.0);
    let mut c = Cluster::new(4, true);
    let first = pick_excluding(&mut c, &s, &session(0), &["pod-1", "pod-2", "pod-3"]);
    assert_eq!(first.pod, "ns/pod-0");
    // The system prompt's home (depths 1 – 32) is pod-0's; the others hold it (pending) once a
    // session went to each.
    pick_excluding(&mut c, &s, &session(1), &["pod-0", "pod-2", "pod-3"]);
    pick_excluding(&mut c, &s, &session(2), &["pod-0", "pod-1", "pod-3"]);
    pick_excluding(&mut c, &s, &session(3), &["pod-0", "pod-1", "pod-2"]);
    c.settle();
    let d = {
        let p = session(4);
        s.pick(&mut c.reg, &req(&p), c.now).unwrap()
    };
    assert_eq!(
        d.matched_blocks, 40,
        "every pod holds the system prompt: {d:?}"
    );
    // Pod-0 may still win on the other scorers (it was picked longest ago), not as a home.
    let home_score = d.scores.iter().find(|(k, _)| *k == "affinity").unwrap().1;
    // Roomy caches (the copies stay): the commons count in full, and what is left is a
    // move's eviction share squared (`homes::claim`), under 0.001 here.
    assert!(
        home_score < 1e-3,
        "the system prompt is nobody's home: {d:?}"
    );

    // A tenant's prompt: home pod-0, moved once to pod-1; both hold it, pod-2 and pod-3 not.
    let t = prompt(70, 1100);
    pick_excluding(&mut c, &s, &t, &["pod-1", "pod-2", "pod-3"]);
    pick_excluding(&mut c, &s, &t, &["pod-0", "pod-2", "pod-3"]);
    // Starved caches: pod-2's and pod-3's free pools (50 blocks) cannot take the prompt's 68.
    c.report(2, load(0, 0, 0.95));
    c.report(3, load(0, 0, 0.95));
    let d = s.pick(&mut c.reg, &req(&t), c.now).unwrap();
    assert_eq!(
        d.pod, "ns/pod-0",
        "a sibling's copy does not take the home: {d:?}"
    );
    let home_score = d.scores.iter().find(|(k, _)| *k == "affinity").unwrap().1;
    assert_eq!(home_score, 1.0, "{d:?}");
}

/// Before the other pods hold a shared system prompt, its home must not draw every new session:
/// a home carrying more than three times the pods' mean load (plus one) claims nothing, so new
/// sessions spread and the prompt becomes common.
#[test]
fn a_home_carrying_most_of_the_load_claims_nothing() {
    let s = with_affinity(3.0);
    let setup = |others: u32| {
        let mut c = Cluster::new(4, true);
        pick_excluding(&mut c, &s, &session(0), &["pod-1", "pod-2", "pod-3"]);
        c.settle();
        c.now += Duration::from_secs(3); // past the pending TTL: only pod-0's home remains
        c.report(0, load(7, 0, 0.3));
        for i in 1..4 {
            c.report(i, load(others, 0, 0.1));
        }
        // Starved caches (homes count in full): pod-3's KV is nearly all in use.
        c.report(3, load(others, 0, 0.95));
        c
    };
    let pick = |c: &mut Cluster| {
        let p = session(1);
        s.pick(&mut c.reg, &req(&p), c.now).unwrap()
    };
    // Loads [7, 1, 1, 1] (of 8 slots): mean 2.5, 7 <= 8.5; the home wins on affinity over
    // lighter pods.
    let d = pick(&mut setup(1));
    assert_eq!(d.pod, "ns/pod-0", "{d:?}");
    // [7, 0, 0, 0]: mean 1.75, 7 > 6.25; overloaded, a lighter pod takes the new session.
    let d = pick(&mut setup(0));
    assert_ne!(d.pod, "ns/pod-0", "{d:?}");
}

/// Two router replicas over the same pods, each with its own registry; every pick's placement
/// queued for the other as the pod's sidecar would relay it.
struct Replicas {
    sides: [Cluster; 2],
    outboxes: [Vec<tokio::sync::mpsc::Receiver<Routed>>; 2],
}

impl Replicas {
    fn new(pods: usize) -> Self {
        let mut sides = [Cluster::new(pods, true), Cluster::new(pods, true)];
        let outboxes = [0, 1].map(|r| {
            let c = &mut sides[r];
            c.conns
                .clone()
                .into_iter()
                .map(|(key, conn)| {
                    let (tx, rx) = tokio::sync::mpsc::channel(64);
                    c.reg.attach_outbox(&key, conn, tx);
                    rx
                })
                .collect()
        });
        Replicas { sides, outboxes }
    }

    /// Replica `from`'s placements so far reach the other replica `after` their making.
    fn relay(&mut self, from: usize, after: Duration) -> usize {
        let to = 1 - from;
        let mut n = 0;
        for (i, rx) in self.outboxes[from].iter_mut().enumerate() {
            let mut entries = Vec::new();
            while let Ok(routed) = rx.try_recv() {
                entries.push(Placement {
                    age_ms: after.as_millis() as u32,
                    routed,
                });
            }
            n += entries.len();
            let c = &mut self.sides[to];
            let (key, conn) = c.conns[i].clone();
            let policy = with_affinity(3.0).peer_policy().unwrap();
            c.reg
                .apply_placements(&key, conn, &entries, c.now, Duration::ZERO, policy)
                .unwrap();
        }
        n
    }
}

/// Replicas pick on their own sends and the pods' reports; a tenant whose requests arrive
/// through different replicas lands wherever each replica's own memory points, and in a
/// KV-starved fleet every such copy evicts another tenant. With placements relayed through the
/// sidecars, a replica follows a prefix another one placed before any report could show it —
/// even when its own traffic makes it prefer another pod for a new prefix.
#[test]
fn a_replica_follows_a_prefix_another_replica_placed_before_any_report() {
    let s = with_affinity(3.0);
    let (tenant, other) = (prompt(21, 1200), prompt(22, 1200));
    for share in [true, false] {
        let mut r = Replicas::new(3);
        // Replica 1 places another tenant; replica 0, not yet told, places this one.
        let other_pod = r.sides[1].pick(&s, &other).unwrap();
        let home = r.sides[0].pick(&s, &tenant).unwrap();
        assert_eq!(
            home, other_pod,
            "both chose the same empty pod by themselves"
        );
        if share {
            assert_eq!(r.relay(0, Duration::from_millis(2)), 1);
            assert_eq!(r.relay(1, Duration::from_millis(2)), 1);
        }
        // The tenant's next request arrives through replica 1.
        let d = {
            let req = req(&tenant);
            s.pick(&mut r.sides[1].reg, &req, r.sides[1].now).unwrap()
        };
        if share {
            assert_eq!(d.pod, home, "follows the other replica's placement: {d:?}");
            assert_eq!(
                d.matched_blocks, d.chain_len,
                "its chain is pending there: {d:?}"
            );
            assert_eq!(d.placement_shared, Some(true));
            // Both replicas' homes agree, and both count both tenants in that pod's working set.
            for c in &r.sides {
                let chain = hash_chain(&ChainSeed::BASE, &tenant, BS as usize);
                let found = c.reg.homes().find(&chain, c.now, Duration::from_secs(120));
                assert_eq!(found.map(|f| f.pod), Some(home.as_str()));
                assert_eq!(c.reg.homes().working_set(&home), 128);
            }
        } else {
            assert_ne!(d.pod, home, "its own memory points elsewhere: {d:?}");
            assert_eq!(d.placement_shared, Some(true), "queued, never relayed here");
        }
    }
}

/// Another replica's sends count in a pod's projected load, as this router's own do, until a
/// report sampled after them (and the admission lag) includes them.
#[test]
fn another_replicas_sends_count_as_load_until_a_report_includes_them() {
    let s = with_affinity(3.0);
    let mut r = Replicas::new(2);
    for k in 0..3 {
        r.sides[0].pick(&s, &prompt(30 + k, 800)).unwrap();
    }
    assert_eq!(r.relay(0, Duration::from_millis(5)), 3);
    let key = "ns/pod-0";
    let peer_view = r.sides[1].reg.get(key).unwrap().projection();
    let own_view = r.sides[0].reg.get(key).unwrap().projection();
    let picked_here = own_view.sent_since_sample;
    assert!(picked_here > 0, "{own_view:?}");
    assert_eq!(peer_view.sent_since_sample, picked_here, "{peer_view:?}");
    assert_eq!(peer_view.sent_prefill_tokens, own_view.sent_prefill_tokens);
    assert!((peer_view.kv_usage - own_view.kv_usage).abs() < 1e-9);
    // A report sampled well after them: the engine's own numbers include them now.
    r.sides[1].now += Duration::from_millis(500);
    r.sides[1].report(0, load(3, 0, 0.2));
    let after = r.sides[1].reg.get(key).unwrap().projection();
    assert_eq!(
        (after.sent_since_sample, after.running),
        (0, 3),
        "{after:?}"
    );
}

/// A replica that restarts has no memory of where prefixes live; the pods' sidecars tell it
/// (their recent placements, sent after the snapshot), so a tenant whose prefix no cache holds
/// any more returns to the home the running replicas know, not to a pod of the new replica's
/// choosing — which the others would never agree to.
#[test]
fn a_restarted_replica_learns_the_homes_from_the_sidecars_memory() {
    let s = with_affinity(3.0);
    let tenant = prompt(40, 1200);
    let mut r = Replicas::new(3);
    let home = pick_excluding(&mut r.sides[0], &s, &tenant, &["pod-0", "pod-1"]).pod;
    assert_eq!(home, "ns/pod-2");
    let routed = r.outboxes[0][2].try_recv().unwrap();
    for restored in [true, false] {
        let mut fresh = Cluster::new(3, true);
        fresh.now += Duration::from_secs(30);
        for i in 0..3 {
            fresh.report(i, load(0, 0, 0.0));
        }
        if restored {
            let (key, conn) = fresh.conns[2].clone();
            let entry = RecentPlacement::of(&routed, 30_000);
            let handed = fresh
                .reg
                .apply_recent(
                    &key,
                    conn,
                    &[entry],
                    fresh.now,
                    Duration::ZERO,
                    Duration::from_secs(120),
                )
                .unwrap();
            assert_eq!(handed, 0, "nothing to hand over in an empty memory");
        }
        let d = fresh.pick(&s, &tenant).unwrap();
        if restored {
            assert_eq!(d, home, "the home the other replicas know");
        } else {
            assert_ne!(d, home, "a pod of its own choosing");
        }
    }
}

/// In a fleet larger than `COMMONS_SAMPLE` the commons come from a sample of the other pods'
/// matches, not from matching every pod: a prefix most pods hold is still nobody's home, and a
/// tenant's prefix only its home holds still claims in full.
#[test]
fn the_commons_of_a_large_fleet_come_from_a_sample_and_still_tell_shared_from_own() {
    use kvsight_router::scheduler::COMMONS_SAMPLE;
    let pods = 3 * COMMONS_SAMPLE;
    let s = with_affinity(3.0);
    let others: Vec<String> = (1..pods).map(|i| format!("pod-{i}")).collect();
    let others: Vec<&str> = others.iter().map(String::as_str).collect();
    let t = prompt(71, 1100);
    let chain = hash_chain(&ChainSeed::BASE, &t, BS as usize);
    for shared in [true, false] {
        let mut c = Cluster::new(pods, true);
        assert_eq!(pick_excluding(&mut c, &s, &t, &others).pod, "ns/pod-0");
        c.settle();
        // Past the pending TTL: only the filters speak.
        c.now += Duration::from_secs(3);
        // Free pools of 136 blocks: a copy of the prompt's 68 would take half of one.
        for i in 0..pods {
            c.report(i, load(0, 0, 0.864));
            if shared || i == 0 {
                c.holds(i, &chain);
            }
        }
        let d = s.pick(&mut c.reg, &req(&t), c.now).unwrap();
        let home = d.scores.iter().find(|(k, _)| *k == "affinity").unwrap().1;
        if shared {
            assert!(home < 1e-9, "held by every pod: nobody's home: {d:?}");
        } else {
            // `homes::claim` with half a pool evicted and nothing common: 0.5.
            assert_eq!(d.pod, "ns/pod-0", "{d:?}");
            assert!((home - 0.5).abs() < 0.02, "{d:?}");
        }
    }
}
