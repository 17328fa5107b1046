//! Hot paths of the router: a pick over 64 pods for a 512-block chain (cold, partial and the
//! worst case where every pod holds the whole chain), given the chain's hashes as the router
//! computes them before taking the registry lock, and once more with the hashing of the 8,192
//! tokens included; the same pick over a fleet of 1,000 pods holding 80,000 blocks each (cold,
//! a few pods holding the chain, partial, and every pod holding it), each also with `affinity: 0`
//! (no home: the home's exact match of every pod left out); and tokenize + hash of a ~2k-token
//! chat with the project's own tokenizer (byte-level BPE, the tokenizer's fast path) and, when
//! the fixture is beside the checkout, with Phi-3-mini's (sentencepiece-style: `tokenizers`' full
//! pipeline). Besides criterion's figures, each pick case prints its p50 and p99 over 20 000
//! single picks (2 000 at 1,000 pods; criterion reports means, the target is a p99).
//!
//! Every pod reports a fresh load before each timed pick (untimed), as sidecars do between
//! picks: without it the picks pile up as "sent since the sample", every pod ends up saturated
//! after a few thousand picks and the bench measures the all-saturated fallback instead of the
//! case it names.
//!
//! `cargo bench -p kvsight-router --bench pick`; `KVSIGHT_PICK_ONLY=1000x512_cold` builds and
//! samples only the pick cases whose name holds that text (criterion's own filter only skips
//! its timing, and the 1,000-pod clusters take seconds to build).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use kvsight_harness::messages;
use kvsight_process::tokenizer_dir::read as read_dir;
use kvsight_protocol::bloom::{BloomFilter, FilterParams};
use kvsight_protocol::hash::{ChainSeed, hash_chain};
use kvsight_protocol::messages::*;
use kvsight_router::config::SchedulerConfig;
use kvsight_router::pods::{ConnId, Registry};
use kvsight_router::scheduler::{PickRequest, PromptHashes, Scheduler};
use kvsight_router::tokenize::model_tokenizer;

const BLOCKS: usize = 512;
const BS: u32 = 16;

/// One shape of cluster the pick is measured on.
struct Fleet {
    pods: usize,
    /// Blocks each pod holds besides the chain's (its filter is sized for 100,000).
    other_blocks: u64,
    /// Single picks timed for the printed p50 / p99.
    samples: usize,
}

/// The cluster of one model the router usually fronts.
const SMALL: Fleet = Fleet {
    pods: 64,
    other_blocks: 20_000,
    samples: 20_000,
};

/// A fleet at the scale `cargo xtask fleet` measures with real processes: 1,000 pods whose
/// caches are mostly full.
const LARGE: Fleet = Fleet {
    pods: 1_000,
    other_blocks: 80_000,
    samples: 2_000,
};

/// How many leading blocks of the chain pod `i` holds.
type Held = fn(usize) -> usize;

fn hello(i: usize) -> Hello {
    Hello {
        instance_id: i as u64,
        engine: EngineFacts {
            block_size: BS,
            num_gpu_blocks: 100_000,
            max_model_len: 32_768,
            max_num_batched_tokens: Some(8192),
            ..messages::engine()
        },
        sidecar_version: "bench".into(),
        load_interval_ms: 3_600_000,
        ..messages::hello(
            &format!("pod-{i}"),
            &format!("http://10.0.{}.{}:8000", i / 250, i % 250),
        )
    }
}

fn load(i: usize) -> Load {
    Load {
        running: (i % 7) as u32,
        kv_usage: 0.3,
        prefill_tokens_per_s: Some(20_000.0),
        ..messages::idle_load()
    }
}

/// `fleet.pods` Ready pods; pod `i` holds the first `held(i)` blocks of `chain` plus
/// `fleet.other_blocks` other blocks.
fn registry(
    fleet: &Fleet,
    chain: &[u64],
    held: impl Fn(usize) -> usize,
) -> (Registry, Vec<(String, ConnId)>) {
    let now = Instant::now();
    let mut reg = Registry::new();
    let mut conns = Vec::with_capacity(fleet.pods);
    let params = FilterParams::for_capacity(100_000, 0.01);
    for i in 0..fleet.pods {
        let (key, conn) = reg.register(hello(i), now);
        reg.apply_load(&key, conn, load(i), now).unwrap();
        let other =
            (0..fleet.other_blocks).map(|k| k.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64);
        let keys = chain[..held(i)].iter().copied().chain(other);
        let f = BloomFilter::from_keys(params, keys).unwrap();
        reg.apply_snapshot(&key, conn, &f.snapshot()).unwrap();
        conns.push((key, conn));
    }
    (reg, conns)
}

/// Every pod reports its load again and the picked requests finished: what was sent before is
/// now in the engine's numbers (sends younger than the router's admission lag would otherwise
/// still count on top, and thousands of picks per second would pile up as projected load).
fn report_all(reg: &mut Registry, conns: &[(String, ConnId)]) {
    let now = Instant::now();
    for (i, (key, conn)) in conns.iter().enumerate() {
        while reg.get(key).is_some_and(|p| p.inflight > 0) {
            reg.record_done(key, now, now);
        }
        reg.apply_load(key, *conn, load(i), now).unwrap();
    }
}

fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    (
        samples[samples.len() / 2],
        samples[samples.len() * 99 / 100],
    )
}

/// The named pick benches of one case that `only` selects: (name, scheduler, hashing included).
/// Hashing only on the small cold case, where it weighs most (it does not depend on the number
/// of pods); `affinity: 0` only on the fleet.
fn variants<'s>(
    fleet: &Fleet,
    name: &str,
    sched: &'s Scheduler,
    no_home: &'s Scheduler,
    only: &str,
) -> Vec<(String, &'s Scheduler, bool)> {
    let small = fleet.pods == SMALL.pods;
    [
        ("", sched, false),
        ("_with_hashing", sched, true),
        ("_affinity_off", no_home, false),
    ]
    .into_iter()
    .filter(|&(label, _, hashing)| {
        (!hashing || (name == "cold" && small)) && (label != "_affinity_off" || !small)
    })
    .map(|(label, s, hashing)| (format!("pick_{}x512_{name}{label}", fleet.pods), s, hashing))
    .filter(|(bench, _, _)| bench.contains(only))
    .collect()
}

fn pick_bench(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..BLOCKS as u32 * BS).map(|t| t % 50_000).collect();
    let chain = hash_chain(
        &ChainSeed {
            lora: None,
            cache_salt: None,
        },
        &tokens,
        BS as usize,
    );
    // Pending entries would make every pod match after a few picks; expire them at once so each
    // case keeps its shape.
    let cfg = SchedulerConfig {
        pending_ttl_seconds: 1e-9,
        ..SchedulerConfig::default()
    };
    let sched = Scheduler::new(&cfg);
    // The same without the prompt's home (`affinity: 0`): how much of a fleet-scale pick the
    // home's exact matching of every pod costs.
    let mut no_home = cfg.clone();
    no_home.weights.affinity = 0.0;
    let no_home = Scheduler::new(&no_home);
    let req = PickRequest {
        model: "m",
        pool: None,
        prompt_tokens: tokens.len() as u32,
        tokens: Some(&tokens),
        cache_salt: None,
        exclude: &[],
    };
    let small: [(&str, Held); 3] = [
        ("cold", |_| 0),
        ("partial", |i| (i * 8) % BLOCKS),
        ("worst_all_hold_whole_chain", |_| BLOCKS),
    ];
    // At fleet scale a popular prefix lives on a handful of pods (its homes), not on all.
    let large: [(&str, Held); 4] = [
        ("cold", |_| 0),
        ("eight_hold_whole_chain", |i| {
            if i % 125 == 0 { BLOCKS } else { 0 }
        }),
        ("partial", |i| (i * 8) % BLOCKS),
        ("worst_all_hold_whole_chain", |_| BLOCKS),
    ];
    let runs = small
        .iter()
        .map(|case| (&SMALL, case))
        .chain(large.iter().map(|case| (&LARGE, case)));
    let only = std::env::var("KVSIGHT_PICK_ONLY").unwrap_or_default();
    for (fleet, &(name, held)) in runs {
        let variants = variants(fleet, name, &sched, &no_home, &only);
        if variants.is_empty() {
            continue;
        }
        let (mut reg, conns) = registry(fleet, &chain, held);
        // As the router does before taking the lock; the pods' shapes never change here, so
        // the same hashes serve every pick.
        let mut hashes = PromptHashes::new(&Scheduler::hash_plan(&reg, &req), req.tokens);
        let mut pick = |reg: &mut Registry, sched: &Scheduler, hashing: bool| {
            if hashing {
                sched.pick(reg, &req, Instant::now())
            } else {
                sched.pick_prepared(reg, &req, &mut hashes, Instant::now())
            }
            .unwrap()
        };
        for (bench, sched, hashing) in variants {
            let mut samples = Vec::with_capacity(fleet.samples);
            for _ in 0..fleet.samples {
                report_all(&mut reg, &conns);
                let t = Instant::now();
                let d = black_box(pick(&mut reg, sched, hashing));
                samples.push(t.elapsed());
                assert!(
                    !d.all_saturated,
                    "the case must not degrade to the fallback"
                );
            }
            let (p50, p99) = percentiles(samples);
            eprintln!(
                "{bench}: p50 {p50:?}, p99 {p99:?} over {} picks",
                fleet.samples
            );
            c.bench_function(&bench, |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        report_all(&mut reg, &conns);
                        let t = Instant::now();
                        black_box(pick(&mut reg, sched, hashing));
                        total += t.elapsed();
                    }
                    total
                })
            });
        }
    }
}

/// The Phi-3-mini fixture (`../shared/fixtures`), absent on machines without the shared folder.
/// Phi-3-mini's tokenizer, under `../shared`.
const PHI3_JSON: &str = "fixtures/tokenizers/phi-3-mini/tokenizer.json";

fn tokenize_bench(c: &mut Criterion) {
    if let Some(dir) = kvsight_harness::or_skip(
        "tokenize_bench own",
        kvsight_sim::own_tokenizer::ensure_dir(),
    ) {
        tokenize_chat(c, "own", &dir);
    }
    if let Some(json) = kvsight_harness::fixture_or_skip("tokenize_bench phi3", PHI3_JSON) {
        tokenize_chat(c, "phi3", json.parent().expect("the fixture's folder"));
    }
}

/// Tokenize + hash of the same ~2k-token chat (120 guidelines as the system prompt).
fn tokenize_chat(c: &mut Criterion, name: &str, dir: &std::path::Path) {
    let tok = model_tokenizer(&read_dir(dir).unwrap()).unwrap();
    let system = kvsight_sim::own_tokenizer::guidelines_preamble(120, 7);
    let body = serde_json::json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Which of these guidelines matters most for a short answer?"}
        ]
    });
    let n = tok.encode_chat(&body).unwrap().len();
    eprintln!("chat prompt [{name}]: {n} tokens");
    let seed = ChainSeed {
        lora: None,
        cache_salt: None,
    };
    c.bench_function(&format!("tokenize_and_hash_chat_{name}_{n}_tokens"), |b| {
        b.iter(|| {
            let t = tok.encode_chat(black_box(&body)).unwrap();
            black_box(hash_chain(&seed, &t, BS as usize))
        })
    });
}

criterion_group!(benches, pick_bench, tokenize_bench);
criterion_main!(benches);
