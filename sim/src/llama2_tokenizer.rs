//! A Llama-2-shaped ("sentencepiece-style") tokenizer trained here, so tests can run an engine
//! on transformers 5 — which rebuilds exactly this shape — without third-party model files.
//!
//! The shape is Llama 2's `tokenizer.json` (and Mistral's, Phi-3's): a BPE model with byte
//! fallback whose vocabulary is `<unk>`, `<s>`, `</s>`, the 256 byte tokens `<0x00>`..`<0xFF>`
//! and then the learned pieces; the normalizer `Prepend("▁")` + `Replace(" ", "▁")`; no
//! pre-tokenizer; `<s> $A` as post-processor; a `LlamaTokenizer` config with `add_bos_token`
//! and `legacy: false`. Chat tokens `<|system|>`, `<|user|>`, `<|assistant|>`, `<|end|>` strip the
//! whitespace after them, as Phi-3's do, so every message body starts right after an added
//! token — where transformers 4 and 5 part ways. Trained deterministically on the own
//! tokenizer's corpus with a `Metaspace` splitter (as sentencepiece trains: no piece has a "▁"
//! after another character), cached under the target directory like the own tokenizer.

use std::path::PathBuf;
use std::sync::Mutex;

use serde_json::{Value as Json, json};
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::BpeTrainerBuilder;
use tokenizers::{AddedToken, Tokenizer};

use crate::own_tokenizer::{OwnTokenizerError, OwnTokenizerFiles, corpus, ensure_cached};

/// Bump when anything that changes the produced files changes: it names the cache directory.
pub const VERSION: &str = "v1";

/// Vocabulary size the trainer aims at (the byte tokens come on top).
const VOCAB_SIZE: usize = 3000;

/// Chat tokens, after the vocabulary, in id order; all special and `rstrip`.
pub const CHAT_TOKENS: [&str; 4] = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"];

/// BOS once, then each message as `<|role|>\n{content}<|end|>\n`, then `<|assistant|>\n` when a
/// generation prompt is asked for; roles other than system, user and assistant are refused.
pub const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}\
{% if message['role'] not in ['system', 'user', 'assistant'] %}\
{{ raise_exception('Unsupported role: ' ~ message['role']) }}{% endif %}\
{{ '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ '<|end|>\\n' }}{% endfor %}\
{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}";

fn train_err(e: impl std::fmt::Display) -> OwnTokenizerError {
    OwnTokenizerError::Train(e.to_string())
}

/// The sentencepiece-style normalizer Llama 2's tokenizer.json carries.
fn normalizer() -> Json {
    json!({"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    ]})
}

/// The special tokens, first in the vocabulary.
const SPECIALS: [&str; 3] = ["<unk>", "<s>", "</s>"];

/// Trains the tokenizer in memory and returns its two files. Deterministic: the same bytes on
/// every call and machine (for a given `tokenizers` version, pinned by Cargo.lock).
pub fn build() -> Result<OwnTokenizerFiles, OwnTokenizerError> {
    let (learned, merges) = train()?;
    let tokenizer_json = tokenizer_json(llama_vocab(&learned), merges);
    // The files must load as they will be read.
    let tokenizer_json = serde_json::to_string_pretty(&tokenizer_json).map_err(train_err)?;
    tokenizer_json
        .parse::<Tokenizer>()
        .map_err(|e| train_err(format!("the built tokenizer.json does not load: {e}")))?;
    let tokenizer_config_json =
        serde_json::to_string_pretty(&tokenizer_config()).map_err(train_err)?;
    Ok(OwnTokenizerFiles {
        tokenizer_json,
        tokenizer_config_json,
    })
}

/// Trains BPE on the corpus: the learned pieces in id order, and the merges.
fn train() -> Result<(Vec<String>, Json), OwnTokenizerError> {
    // Training pipeline: the runtime normalizer, then pieces cut before every "▁" so merges
    // never join two words (sentencepiece's own training does not either).
    let trainer_json = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": normalizer(),
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never",
                          "split": true},
        "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": true, "vocab": {}, "merges": []}
    });
    let mut tokenizer: Tokenizer = trainer_json.to_string().parse().map_err(train_err)?;
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(VOCAB_SIZE)
        .min_frequency(2)
        .limit_alphabet(120)
        .max_token_length(Some(16))
        .show_progress(false)
        .special_tokens(SPECIALS.map(|t| AddedToken::from(t, true)).to_vec())
        .build()
        .into();
    let text = corpus();
    tokenizer
        .train(&mut trainer, text.lines().map(|l| format!("{l}\n")))
        .map_err(train_err)?;
    let mut trained: Json =
        serde_json::from_str(&tokenizer.to_string(false).map_err(train_err)?).map_err(train_err)?;
    let learned = trained["model"]["vocab"]
        .as_object()
        .ok_or_else(|| train_err("trained vocabulary missing"))?;
    let mut learned: Vec<(&String, u64)> = learned
        .iter()
        .filter_map(|(token, id)| Some((token, id.as_u64()?)))
        .collect();
    learned.sort_by_key(|&(_, id)| id);
    let learned = learned.into_iter().map(|(t, _)| t.clone()).collect();
    Ok((learned, trained["model"]["merges"].take()))
}

/// Llama 2's layout: specials, the 256 byte tokens, then the learned pieces in their order.
fn llama_vocab(learned: &[String]) -> serde_json::Map<String, Json> {
    let mut vocab = serde_json::Map::new();
    let mut add = |token: String| {
        let id = vocab.len();
        vocab.entry(token).or_insert_with(|| Json::from(id));
    };
    for token in SPECIALS {
        add(token.to_owned());
    }
    for byte in 0..=255u8 {
        add(format!("<0x{byte:02X}>"));
    }
    for token in learned {
        add(token.clone());
    }
    vocab
}

/// The runtime `tokenizer.json`: the specials and chat tokens added, Llama 2's normalizer,
/// post-processor and decoder around the trained model.
fn tokenizer_json(vocab: serde_json::Map<String, Json>, merges: Json) -> Json {
    let added = |id: usize, content: &str, rstrip: bool| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": rstrip, "normalized": false, "special": true})
    };
    let mut added_tokens: Vec<Json> = SPECIALS
        .iter()
        .enumerate()
        .map(|(id, t)| added(id, t, false))
        .collect();
    let first_chat_id = vocab.len();
    added_tokens.extend(
        CHAT_TOKENS
            .iter()
            .enumerate()
            .map(|(i, t)| added(first_chat_id + i, t, true)),
    );
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": normalizer(),
        "pre_tokenizer": null,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        }
    })
}

/// A `LlamaTokenizer` config: BOS added, `legacy: false`, the chat template.
fn tokenizer_config() -> Json {
    json!({
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": true,
        "add_eos_token": false,
        "legacy": false,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": null,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": false,
        "chat_template": CHAT_TEMPLATE,
    })
}

/// Builds the tokenizer once and caches it in `<target>/kvsight-llama2-tokenizer/<VERSION>/`,
/// returning that directory (safe when tests race, as [`crate::own_tokenizer::ensure_dir`]).
pub fn ensure_dir() -> Result<PathBuf, OwnTokenizerError> {
    static TRAINING: Mutex<()> = Mutex::new(());
    ensure_cached("kvsight-llama2-tokenizer", VERSION, &TRAINING, build)
}

/// The tokenizer as a [`kvsight_tokenizer::ModelTokenizer`] (transformers 4's
/// reading), from the cache.
pub fn load() -> Result<kvsight_tokenizer::ModelTokenizer, OwnTokenizerError> {
    crate::own_tokenizer::load_dir(&ensure_dir()?)
}
