//! The protocol's hot paths: hashing a prompt, matching a chain against every pod's filter, and
//! producing + applying a delta. Run with `cargo xtask bench -- --bench protocol` or
//! `cargo bench -p kvsight-protocol`. Tokenizing before the hash is benchmarked in
//! `kvsight-tokenizer` (`tokenizer/benches/tokenizer.rs`).

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvsight_protocol::bloom::{BloomFilter, CountingFilter, FilterParams};
use kvsight_protocol::frame::{self, MAX_FRAME_LEN};
use kvsight_protocol::hash::{ChainSeed, hash_chain};
use kvsight_protocol::messages::SidecarMessage;

/// A seeded stand-in for uniform 64-bit canonical hashes.
type SplitMix = kvsight_protocol::splitmix::SplitMix64;

const GPU_BLOCKS: usize = 50_000;

fn hash_prompt(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..8192u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 32_000)
        .collect();
    let mut g = c.benchmark_group("hash_chain");
    g.throughput(Throughput::Elements(tokens.len() as u64));
    g.bench_function("8k_tokens_block16", |b| {
        b.iter(|| hash_chain(black_box(&ChainSeed::BASE), black_box(&tokens), 16))
    });
    g.finish();
}

/// 64 pods, each filter sized for 50k GPU blocks and filled to 80 % with unrelated blocks.
fn pods(rng: &mut SplitMix, chain: &[u64], held: impl Fn(usize) -> usize) -> Vec<BloomFilter> {
    let params = FilterParams::for_capacity(GPU_BLOCKS, 0.01);
    (0..64)
        .map(|pod| {
            let mut keys: Vec<u64> = (0..GPU_BLOCKS * 8 / 10).map(|_| rng.next_u64()).collect();
            keys.extend_from_slice(&chain[..held(pod)]);
            BloomFilter::from_keys(params, keys).expect("valid params")
        })
        .collect()
}

/// How many leading blocks of the chain pod `i` holds.
type HeldBlocks = Box<dyn Fn(usize) -> usize>;

fn longest_prefix(c: &mut Criterion) {
    let mut rng = SplitMix::new(42);
    let chain: Vec<u64> = (0..512).map(|_| rng.next_u64()).collect();
    let mut g = c.benchmark_group("longest_prefix_512_blocks_64_pods");
    let cases: [(&str, HeldBlocks); 3] = [
        // The common case: one pod holds the conversation, a few hold the system prompt.
        (
            "one_warm_pod",
            Box::new(|pod| match pod {
                0 => 512,
                1..=7 => 40,
                _ => 0,
            }),
        ),
        // Every pod holds a different share of the chain.
        ("mixed", Box::new(|pod| pod * 8)),
        // The worst case: every pod holds the whole chain.
        ("all_pods_hold_all", Box::new(|_| 512)),
    ];
    for (name, held) in cases {
        let filters = pods(&mut rng, &chain, held);
        g.bench_with_input(BenchmarkId::new("scan", name), &filters, |b, filters| {
            b.iter(|| {
                filters
                    .iter()
                    .map(|f| f.longest_prefix(black_box(&chain)))
                    .max()
            })
        });
        // What a router does per request: prepare once per filter shape, then probe every pod.
        g.bench_with_input(
            BenchmarkId::new("prepared", name),
            &filters,
            |b, filters| {
                b.iter(|| {
                    let prepared = filters[0].params().prepare(black_box(&chain));
                    filters
                        .iter()
                        .map(|f| f.longest_prefix_prepared(&prepared))
                        .max()
                })
            },
        );
    }
    g.finish();
}

fn delta_roundtrip(c: &mut Criterion) {
    let params = FilterParams::for_capacity(GPU_BLOCKS, 0.01);
    let mut rng = SplitMix::new(7);
    let mut side = CountingFilter::new(params).expect("valid params");
    for _ in 0..GPU_BLOCKS / 2 {
        side.insert(rng.next_u64());
    }
    let _ = side.take_delta();
    let mut router = BloomFilter::from_snapshot(&side.snapshot()).expect("snapshot");
    let mut g = c.benchmark_group("delta");
    g.throughput(Throughput::Elements(1000));
    g.bench_function("encode_apply_1000_changed_blocks", |b| {
        b.iter(|| {
            // 1000 blocks stored, then the same 1000 evicted: two deltas per iteration, so the
            // filter returns to its starting state and every iteration does the same work.
            let keys: Vec<u64> = (0..1000).map(|_| rng.next_u64()).collect();
            for &k in &keys {
                side.insert(k);
            }
            apply(&mut side, &mut router);
            for &k in &keys {
                side.remove(k);
            }
            apply(&mut side, &mut router);
        })
    });
    g.finish();
}

fn apply(side: &mut CountingFilter, router: &mut BloomFilter) {
    let delta = side.take_delta().expect("changes");
    let bytes = frame::encode(&SidecarMessage::CacheDelta(delta)).expect("encode");
    let (msg, _) = frame::decode::<SidecarMessage>(&bytes, MAX_FRAME_LEN)
        .expect("decode")
        .expect("whole");
    let SidecarMessage::CacheDelta(d) = msg else {
        unreachable!()
    };
    router.apply_delta(&d).expect("in order");
}

criterion_group!(benches, hash_prompt, longest_prefix, delta_roundtrip);
criterion_main!(benches);
