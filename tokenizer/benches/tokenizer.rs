//! Tokenize + hash, the router's first step on every request: a ~2k-token chat with a
//! Llama-3-shaped tokenizer, fast path vs `tokenizers`' full pipeline, and a ~3.9k-token chat with
//! Phi-3-mini's sentencepiece-style tokenizer (both dialects; its fixture is in `../shared`).
//! Run with `cargo bench -p kvsight-tokenizer`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvsight_protocol::hash::{ChainSeed, hash_chain};

/// A seeded generator for the pseudo-text.
type SplitMix = kvsight_protocol::splitmix::SplitMix64;

/// The Phi-3-mini fixture, under `../shared`.
const PHI3_DIR: &str = "fixtures/tokenizers/phi-3-mini";

mod llama3 {
    //! A synthetic Llama-3-shaped tokenizer (byte-level BPE with a few thousand merges trained
    //! here, Llama 3's `Split` pattern and special tokens) and a chat rendered in its format.

    use kvsight_tokenizer::ModelTokenizer;
    use tokenizers::AddedToken;

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
        let mut rng = SplitMix::new(1);
        let corpus: Vec<String> = (0..4000).map(|_| sentence(&mut rng)).collect();
        let mut tokenizer = kvsight_tokenizer::testing::byte_level_bpe(
            kvsight_tokenizer::testing::split_byte_level(PATTERN),
            None,
            vocab_size,
            Some("<|begin_of_text|>"),
            corpus.into_iter(),
        );
        tokenizer
            .add_special_tokens(
                ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
                    .map(|t| AddedToken::from(t, true)),
            )
            .expect("special tokens");
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
fn tokenize_llama3(c: &mut Criterion) {
    use criterion::BatchSize;
    use kvsight_tokenizer::ModelTokenizer;

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

/// Tokenize + hash a ~3.9k-token chat rendered with Phi-3-mini's template (a system prompt of
/// pseudo-text sentences and one question), BPE word cache warm: the sentencepiece fast path
/// against `tokenizers`' full pipeline, in the transformers 4 and the transformers 5 (rebuilt)
/// dialects.
fn tokenize_phi3(c: &mut Criterion) {
    use kvsight_tokenizer::{ChatExtras, ChatMessage, Dialect, ModelTokenizer};

    let Some(dir) = kvsight_harness::fixture_or_skip("tokenize_phi3", PHI3_DIR) else {
        return;
    };
    let json = std::fs::read(dir.join("tokenizer.json")).expect("tokenizer.json");
    let config = std::fs::read(dir.join("tokenizer_config.json")).expect("tokenizer_config.json");
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

criterion_group!(benches, tokenize_llama3, tokenize_phi3);
criterion_main!(benches);
