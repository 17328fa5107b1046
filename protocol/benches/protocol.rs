//! The protocol's hot paths: hashing a prompt, matching a chain against every pod's filter, and
//! producing + applying a delta. Run with `cargo xtask bench -- --bench protocol` or
//! `cargo bench -p kvsight-protocol`; with `--features tokenizer` also tokenize + hash of a ~2k-token
//! chat with a Llama-3-shaped tokenizer, fast path vs `tokenizers`' full pipeline, and of a
//! ~3.9k-token chat with Phi-3-mini's sentencepiece-style tokenizer (both dialects) when its
//! fixture is beside the checkout (`../shared/fixtures`).

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

#[cfg(feature = "tokenizer")]
mod llama3 {
    //! A synthetic Llama-3-shaped tokenizer (byte-level BPE with a few thousand merges trained
    //! here, Llama 3's `Split` pattern and special tokens) and a chat rendered in its format.

    use kvsight_protocol::tokenizer::ModelTokenizer;
    use tokenizers::models::TrainerWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

    use super::SplitMix;

    const PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const SYLLABLES: &[&str] = &[
        "ka", "ro", "mi", "te", "su", "na", "lo", "be", "di", "fu", "ga", "he", "ji", "pe", "qu",
        "ra", "si", "to", "vi", "we", "xa", "yo", "ze", "an", "el", "in", "on", "ur", "st", "th",
    ];
    const PUNCT: &[&str] = &[", ", ". ", "; ", ": ", " (", ") ", "'s ", " - ", "? ", "! "];

    /// One sentence of pseudo-words, numbers and punctuation.
    pub(super) fn sentence(rng: &mut SplitMix) -> String {
        let mut s = String::new();
        for _ in 0..8 + rng.next_u64() % 10 {
            let syllables = 1 + rng.next_u64() % 3;
            let mut word: String = (0..syllables)
                .map(|_| SYLLABLES[(rng.next_u64() % SYLLABLES.len() as u64) as usize])
                .collect();
            if rng.next_u64().is_multiple_of(9) {
                word = word.to_uppercase();
            }
            s.push_str(&word);
            match rng.next_u64() % 8 {
                0 => s.push_str(PUNCT[(rng.next_u64() % PUNCT.len() as u64) as usize]),
                1 => s.push_str(&format!(" {} ", rng.next_u64() % 5000)),
                _ => s.push(' '),
            }
        }
        s.push_str(".\n");
        s
    }

    /// The tokenizer, trained to `vocab_size` on pseudo-text.
    pub(super) fn tokenizer_json(vocab_size: usize) -> String {
        let mut tokenizer = Tokenizer::new(BPE::default());
        let split = Split::new(
            SplitPattern::Regex(PATTERN.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .expect("pattern");
        let byte_level = ByteLevel::default()
            .add_prefix_space(false)
            .use_regex(false);
        tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![split.into(), byte_level.into()])));
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(vocab_size)
            .show_progress(false)
            .special_tokens(vec![AddedToken::from("<|begin_of_text|>", true)])
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build()
            .into();
        let mut rng = SplitMix::new(1);
        let corpus: Vec<String> = (0..4000).map(|_| sentence(&mut rng)).collect();
        tokenizer
            .train(&mut trainer, corpus.into_iter())
            .expect("train");
        tokenizer
            .add_special_tokens(
                ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
                    .map(|t| AddedToken::from(t, true)),
            )
            .expect("special tokens");
        let post = TemplateProcessing::builder()
            .try_single("<|begin_of_text|> $A")
            .expect("single")
            .special_tokens(vec![("<|begin_of_text|>".to_owned(), 0)])
            .build()
            .expect("post-processor");
        tokenizer.with_post_processor(Some(post));
        tokenizer.to_string(false).expect("serialize")
    }

    /// A chat as Llama 3's template renders it: a system prompt of `guidelines` numbered
    /// guidelines and one question.
    pub(super) fn chat(guidelines: usize) -> String {
        let mut rng = SplitMix::new(2);
        let mut s = String::from(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant. Follow these guidelines:\n",
        );
        for i in 1..=guidelines {
            s.push_str(&format!("{i}. {}", sentence(&mut rng)));
        }
        s.push_str("<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n");
        s.push_str(&sentence(&mut rng));
        s.push_str("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
        s
    }

    pub(super) fn load(json: &str) -> ModelTokenizer {
        ModelTokenizer::from_bytes(json.as_bytes(), None).expect("tokenizer")
    }
}

/// Tokenize + hash a ~2k-token Llama-3 chat: the fast path against `tokenizers`' full pipeline,
/// with the BPE word cache warm (one chat repeated) and cold (a fresh tokenizer per iteration).
#[cfg(feature = "tokenizer")]
fn tokenize_llama3(c: &mut Criterion) {
    use criterion::BatchSize;
    use kvsight_protocol::tokenizer::ModelTokenizer;

    let json = llama3::tokenizer_json(4000);
    let tok = llama3::load(&json);
    assert_eq!(tok.fast_path(), Some("byte_level_split"));
    let chat = llama3::chat(72);
    let ids = tok.encode(&chat, false).expect("fast");
    assert_eq!(ids, tok.encode_reference(&chat, false).expect("full"));
    eprintln!(
        "llama3-shaped chat: {} tokens, {} bytes, vocab {}",
        ids.len(),
        chat.len(),
        tok.vocab_size()
    );
    let seed = ChainSeed::BASE;
    type Road = fn(&ModelTokenizer, &str) -> Vec<u32>;
    let roads: [(&str, Road); 2] = [
        ("fast_path", |t, s| t.encode(s, false).expect("fast")),
        ("full_pipeline", |t, s| {
            t.encode_reference(s, false).expect("full")
        }),
    ];
    let mut g = c.benchmark_group(format!(
        "tokenize_and_hash_llama3_chat_{}_tokens",
        ids.len()
    ));
    for (name, road) in roads {
        g.bench_function(BenchmarkId::new(name, "warm"), |b| {
            b.iter(|| hash_chain(&seed, &road(&tok, black_box(&chat)), 16))
        });
        g.bench_function(BenchmarkId::new(name, "cold"), |b| {
            b.iter_batched(
                || llama3::load(&json),
                |fresh| hash_chain(&seed, &road(&fresh, black_box(&chat)), 16),
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

/// The Phi-3-mini fixture (`../shared/fixtures`), absent on machines without the shared folder.
#[cfg(feature = "tokenizer")]
const PHI3_DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/fixtures/tokenizers/phi-3-mini"
);

/// Tokenize + hash a ~3.9k-token chat rendered with Phi-3-mini's template (a system prompt of
/// pseudo-text sentences and one question), BPE word cache warm: the sentencepiece fast path
/// against `tokenizers`' full pipeline, in the transformers 4 and the transformers 5 (rebuilt)
/// dialects.
#[cfg(feature = "tokenizer")]
fn tokenize_phi3(c: &mut Criterion) {
    use kvsight_protocol::tokenizer::{ChatExtras, ChatMessage, Dialect, ModelTokenizer};

    let dir = std::path::Path::new(PHI3_DIR);
    let (Ok(json), Ok(config)) = (
        std::fs::read(dir.join("tokenizer.json")),
        std::fs::read(dir.join("tokenizer_config.json")),
    ) else {
        eprintln!("skipped: tokenize_phi3: fixture {PHI3_DIR} absent");
        return;
    };
    let tok = ModelTokenizer::from_bytes(&json, Some(&config)).expect("phi-3 tokenizer");
    let mut rng = SplitMix::new(3);
    let system: String = (1..=100)
        .map(|i| format!("{i}. {}", llama3::sentence(&mut rng)))
        .collect();
    let messages = [
        ChatMessage::new("system", system),
        ChatMessage::new("user", llama3::sentence(&mut rng)),
    ];
    let chat = tok
        .render_chat(&messages, true, &ChatExtras::default())
        .expect("render");
    let seed = ChainSeed::BASE;
    let ids = tok.encode(&chat, false).expect("fast");
    eprintln!("phi-3 chat: {} tokens, {} bytes", ids.len(), chat.len());
    let mut g = c.benchmark_group(format!("tokenize_and_hash_phi3_chat_{}_tokens", ids.len()));
    // transformers 4's reading of the files, and transformers 5's rebuilt one.
    for dialect in [Dialect::Transformers4, Dialect::Transformers5Rebuilt] {
        let tok = tok.in_dialect(dialect).expect("dialect");
        assert_eq!(
            tok.encode(&chat, false).expect("fast"),
            tok.encode_reference(&chat, false).expect("full")
        );
        g.bench_function(BenchmarkId::new("fast_path", dialect), |b| {
            b.iter(|| {
                hash_chain(
                    &seed,
                    &tok.encode(black_box(&chat), false).expect("fast"),
                    16,
                )
            })
        });
        g.bench_function(BenchmarkId::new("full_pipeline", dialect), |b| {
            b.iter(|| {
                let ids = tok.encode_reference(black_box(&chat), false).expect("full");
                hash_chain(&seed, &ids, 16)
            })
        });
    }
    g.finish();
}

#[cfg(feature = "tokenizer")]
criterion_group!(
    benches,
    hash_prompt,
    longest_prefix,
    delta_roundtrip,
    tokenize_llama3,
    tokenize_phi3
);
#[cfg(not(feature = "tokenizer"))]
criterion_group!(benches, hash_prompt, longest_prefix, delta_roundtrip);
criterion_main!(benches);
