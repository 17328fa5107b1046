//! The branch-and-bound search against the plain ranking (every pod's match computed by the
//! linear scan, then a sort) on random clusters: identical decisions, including with tiny,
//! false-positive-heavy filters, holes in the cached chain, pending chains, saturation, mixed
//! block sizes and a scorer normalised across matches.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvsight_protocol::bloom::{BloomFilter, FilterParams};
use kvsight_protocol::hash::{ChainSeed, hash_chain};
use kvsight_protocol::messages::*;
use proptest::collection::vec;
use proptest::prelude::*;

use super::search::Ranked;
use super::*;
use crate::config::SchedulerConfig;

/// The reference: every open candidate's real match, every total, sorted.
fn plain_rank(
    _sched: &Scheduler,
    ctx: &Ctx<'_>,
    used: &[&Weighted],
    open: &mut [Candidate<'_>],
    m: &mut PromptHashes<'_>,
) -> Ranked {
    for c in open.iter_mut() {
        m.resolve(c, ctx.req, ctx.now);
    }
    let n = open.len();
    let mut values = vec![0.0; used.len() * n];
    for (k, w) in used.iter().enumerate() {
        w.scorer.scores(ctx, open, &mut values[k * n..(k + 1) * n]);
    }
    let totals: Vec<f64> = (0..n)
        .map(|i| {
            used.iter()
                .enumerate()
                .map(|(k, w)| w.weight * values[k * n + i])
                .sum()
        })
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        totals[b]
            .total_cmp(&totals[a])
            .then_with(|| open[a].pod.key.cmp(&open[b].pod.key))
    });
    Ranked {
        best: (order[0], totals[order[0]]),
        runner_up: order.get(1).map(|&j| (j, totals[j])),
        values,
    }
}

#[derive(Debug, Clone)]
struct PodSpec {
    block_size: u32,
    caching: bool,
    /// `None`: no filter received yet.
    filter_capacity: Option<usize>,
    /// Leading blocks of the base chain held.
    held: usize,
    /// Further blocks of the base chain held (holes before them).
    scattered: Vec<usize>,
    /// Unrelated blocks held (fill: false positives in tiny filters).
    others: u64,
    running: u32,
    waiting: u32,
    kv: f32,
    max_num_seqs: u32,
}

fn pod_spec() -> impl Strategy<Value = PodSpec> {
    (
        prop_oneof![4 => Just(16u32), 1 => Just(32u32)],
        prop_oneof![6 => Just(true), 1 => Just(false)],
        prop_oneof![
            1 => Just(None),
            3 => Just(Some(4usize)),
            3 => Just(Some(32usize)),
            3 => Just(Some(2_000usize)),
        ],
        0usize..48,
        vec(0usize..48, 0..4),
        prop_oneof![Just(0u64), Just(8), Just(200)],
        (
            0u32..6,
            0u32..2,
            0.0f32..0.95,
            prop_oneof![Just(4u32), Just(64)],
        ),
    )
        .prop_map(
            |(block_size, caching, filter_capacity, held, scattered, others, l)| PodSpec {
                block_size,
                caching,
                filter_capacity,
                held,
                scattered,
                others,
                running: l.0,
                waiting: l.1,
                kv: l.2,
                max_num_seqs: l.3,
            },
        )
}

fn hello(i: usize, s: &PodSpec) -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        instance_id: i as u64,
        pod: PodIdentity {
            name: format!("pod-{i}"),
            namespace: "ns".into(),
            url: format!("http://pod-{i}:8000"),
            labels: BTreeMap::new(),
        },
        engine: EngineFacts {
            block_size: s.block_size,
            num_gpu_blocks: 400,
            prefix_caching: s.caching,
            max_num_seqs: s.max_num_seqs,
            max_model_len: 4096,
            max_num_batched_tokens: None,
            engine_version: "0.33.0".into(),
        },
        models: vec!["m".into()],
        lora_adapters: vec![],
        tokenizer: None,
        sidecar_version: "test".into(),
        load_interval_ms: 3_600_000,
    }
}

fn build(specs: &[PodSpec], base: &[u32], now: Instant) -> Registry {
    let mut reg = Registry::new();
    for (i, s) in specs.iter().enumerate() {
        let (key, conn) = reg.register(hello(i, s), now);
        let load = Load {
            seq: 1,
            sample_age_ms: 0,
            phase: Phase::Ready,
            cache_view: CacheView::Exact,
            running: s.running,
            waiting: s.waiting,
            kv_usage: s.kv,
            unrouted: 0,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            preemptions: 0,
            prefill_tokens_per_s: Some(1_000.0 * (i as f32 + 1.0)),
            lora_running: vec![],
            lora_waiting: vec![],
        };
        reg.apply_load(&key, conn, load, now).unwrap();
        let Some(cap) = s.filter_capacity else {
            continue;
        };
        let chain = hash_chain(&ChainSeed::BASE, base, s.block_size as usize);
        let held = chain.iter().take(s.held);
        let scattered = s.scattered.iter().filter_map(|&b| chain.get(b));
        let others = (0..s.others).map(|k| k.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64);
        let keys = held.chain(scattered).copied().chain(others);
        let f = BloomFilter::from_keys(FilterParams::for_capacity(cap, 0.01), keys).unwrap();
        reg.apply_snapshot(&key, conn, &f.snapshot()).unwrap();
    }
    reg
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn search_decides_exactly_like_matching_every_pod(
        specs in vec(pod_spec(), 1..10),
        // (prefix of the base prompt kept, extra tokens, ms until the pick)
        picks in vec((0usize..800, 0u32..40, 1u64..400), 1..6),
        weights in (0.0f64..4.0, 0.0f64..2.0, prop_oneof![Just(0.0f64), 0.1f64..2.0], 0.0f64..0.5),
        pending_ttl_ms in prop_oneof![Just(0u64), Just(150), Just(5_000)],
    ) {
        let mut cfg = SchedulerConfig::default();
        cfg.weights.prefix = weights.0;
        cfg.weights.queue = weights.1;
        cfg.weights.predicted_latency = weights.2;
        cfg.weights.lru = weights.3;
        cfg.pending_ttl_seconds = pending_ttl_ms as f64 / 1000.0;
        let sched = Scheduler::new(&cfg);
        let base: Vec<u32> = (0..768).collect();
        let mut now = Instant::now();
        let mut fast = build(&specs, &base, now);
        let mut plain = build(&specs, &base, now);
        for (keep, extra, ms) in picks {
            now += Duration::from_millis(ms);
            let mut tokens = base[..keep.min(base.len())].to_vec();
            tokens.extend((0..extra).map(|t| 100_000 + t + ms as u32));
            let req = PickRequest {
                model: "m",
                pool: None,
                prompt_tokens: tokens.len() as u32,
                tokens: Some(&tokens),
                cache_salt: None,
                exclude: &[],
            };
            // The search side hashes as the router does, before the pick.
            let mut hashes = PromptHashes::new(&Scheduler::hash_plan(&fast, &req), req.tokens);
            let got = sched.pick_prepared(&mut fast, &req, &mut hashes, now);
            let want = sched.pick_ranked_by(
                &mut plain,
                &req,
                &mut PromptHashes::default(),
                now,
                plain_rank,
            );
            prop_assert_eq!(got, want);
        }
    }
}
