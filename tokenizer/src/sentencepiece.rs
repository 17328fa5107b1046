//! A faster road to the same ids for sentencepiece-style BPE tokenizers (tested on Phi-3 and a
//! Llama-2-shaped tokenizer; Llama 2 and Mistral have the same shape), in both of the ways
//! they put spaces into the model's alphabet:
//!
//! - tokenizer.json's own (transformers 4): a normalizer that prepends "▁" and replaces " "
//!   with "▁", no pre-tokenizer;
//! - transformers 5's rebuilt `LlamaTokenizer` (and newer tokenizer.json files): no normalizer,
//!   a `Metaspace` pre-tokenizer that replaces " " with "▁" and prepends "▁" by its scheme
//!   (`first`: only to the text at byte 0 of the input, and only if it does not already start
//!   with "▁"), without splitting.
//!
//! Why: either way `tokenizers` hands the whole text between two added tokens to the BPE model
//! as one word. That word is longer than the model's cache accepts (256 bytes), so every prompt
//! is merged from single characters: ~3–4 ms for a 2,500-token chat.
//!
//! Here that word is cut into pieces before every "▁" that follows another character, and
//! each piece goes through the model's own `tokenize` (which caches it). That is exact when no
//! merge can join the two sides of such a cut: a merge's result is a vocabulary token, and one
//! that joined a symbol ending in character `c` (not "▁") to a symbol starting with "▁" would
//! contain `c▁` — so [`SentencePieceFastPath::detect`] checks once that no vocabulary token
//! contains a "▁" right after another character. Without merges across a cut, each side's
//! merges happen in the same order as on its own (the model merges by rank, then position),
//! so the pieces' tokens concatenate to the word's tokens.
//!
//! Everything else is the crate's own code: added tokens are split off by its
//! `AddedVocabulary`, and its post-processor adds the special tokens. The space handling is
//! applied by hand, as the crate applies it to each text between added tokens: the normalizer
//! prepends "▁" to every non-empty one; `Metaspace` decides per text from where it starts in the
//! input. Tokenizers of any other shape keep the full pipeline.

use serde_json::json;
use tokenizers::pre_tokenizers::metaspace::PrependScheme;
use tokenizers::{ModelWrapper, PreTokenizerWrapper, Tokenizer};

use super::{TokenizerError, WordSink};

/// The sentencepiece word-boundary marker that stands for a space.
const SPACE: char = '▁';

/// Encodes text with a sentencepiece-style BPE tokenizer, one cacheable piece at a time.
#[derive(Debug)]
pub(super) struct SentencePieceFastPath {
    prepend: Prepend,
}

/// When a text between added tokens gets a "▁" in front.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Prepend {
    /// The `Prepend("▁")` normalizer: every non-empty text, even one starting with a space.
    EveryText,
    /// `Metaspace` `always`: every text that does not start with "▁" once spaces are "▁".
    UnlessSpace,
    /// `Metaspace` `first`: as [`Prepend::UnlessSpace`], only for the text at byte 0 of the
    /// input.
    FirstText,
    /// `Metaspace` `never`.
    Never,
}

impl SentencePieceFastPath {
    /// The fast path when `tokenizer` is exactly a shape it reproduces, else `None`.
    pub(super) fn detect(tokenizer: &Tokenizer) -> Option<Self> {
        let prepend = match (tokenizer.get_normalizer(), tokenizer.get_pre_tokenizer()) {
            (Some(normalizer), None) => {
                // The normalizer's fields are private; its serialized form is its exact
                // configuration.
                let normalizer = serde_json::to_value(normalizer).ok()?;
                let expected = json!({
                    "type": "Sequence",
                    "normalizers": [
                        {"type": "Prepend", "prepend": "▁"},
                        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
                    ],
                });
                (normalizer == expected).then_some(Prepend::EveryText)?
            }
            (None, Some(PreTokenizerWrapper::Metaspace(metaspace)))
                if metaspace.get_replacement() == SPACE && !metaspace.get_split() =>
            {
                match metaspace.get_prepend_scheme() {
                    PrependScheme::Always => Prepend::UnlessSpace,
                    PrependScheme::First => Prepend::FirstText,
                    PrependScheme::Never => Prepend::Never,
                }
            }
            _ => return None,
        };
        let ModelWrapper::BPE(bpe) = tokenizer.get_model() else {
            return None;
        };
        // Each piece must be merged the way it would be inside the whole word: no dropout, no
        // whole-word vocabulary shortcut, no prefix or suffix that depends on where a symbol
        // sits in its word.
        if bpe.dropout.is_some_and(|d| d > 0.0)
            || bpe.ignore_merges
            || bpe.continuing_subword_prefix.is_some()
            || bpe.end_of_word_suffix.is_some()
        {
            return None;
        }
        let vocab = bpe.get_vocab();
        // "▁" must be its own symbol: a byte-fallback or unknown "▁" could merge or fuse with
        // what precedes it.
        if !vocab.contains_key(SPACE.encode_utf8(&mut [0; 4]) as &str) {
            return None;
        }
        if vocab.keys().any(|token| crosses_a_cut(token)) {
            return None;
        }
        // Added tokens matched on normalized text would need the normalizer run before the
        // split, which the hand-made normalization here does after it. Without a normalizer
        // (the `Metaspace` shapes) the crate matches them on the raw text, as here.
        let normalized_added = tokenizer
            .get_added_vocabulary()
            .get_added_tokens_decoder()
            .values()
            .any(|token| token.normalized);
        if normalized_added && prepend == Prepend::EveryText {
            return None;
        }
        Some(Self { prepend })
    }

    /// Puts one text between added tokens into the model's alphabet as the crate does (" "
    /// becomes "▁", a "▁" in front by [`Prepend`]; `at_start`: the text starts at byte 0 of the
    /// input) and passes its pieces to `emit`, cut before every "▁" that follows another
    /// character — all in one pass (the rest is [`super::encode_by_words`]).
    pub(super) fn words(
        &self,
        split: &str,
        at_start: bool,
        emit: &mut WordSink<'_>,
    ) -> Result<(), TokenizerError> {
        // Neither `Prepend` nor `Metaspace` add anything to an empty text (the crate drops
        // empty splits anyway).
        let Some(first) = split.chars().next() else {
            return Ok(());
        };
        let starts_with_space = first == ' ' || first == SPACE;
        let prepend = match self.prepend {
            Prepend::EveryText => true,
            Prepend::UnlessSpace => !starts_with_space,
            Prepend::FirstText => at_start && !starts_with_space,
            Prepend::Never => false,
        };
        let mut piece = String::with_capacity(split.len() + SPACE.len_utf8());
        // The character before the next one, if any: a cut goes before a "▁" that follows
        // another character, never at the very start.
        let mut last = None;
        if prepend {
            piece.push(SPACE);
            last = Some(SPACE);
        }
        for c in split.chars() {
            let c = if c == ' ' { SPACE } else { c };
            if c == SPACE && last.is_some_and(|l| l != SPACE) {
                emit(&piece)?;
                piece.clear();
            }
            piece.push(c);
            last = Some(c);
        }
        emit(&piece)
    }
}

/// Whether `token` has a "▁" right after another character: the only kind of token a merge
/// across a cut could produce.
fn crosses_a_cut(token: &str) -> bool {
    let mut chars = token.chars();
    let Some(mut prev) = chars.next() else {
        return false;
    };
    chars.any(|c| {
        let crosses = c == SPACE && prev != SPACE;
        prev = c;
        crosses
    })
}

#[cfg(test)]
mod tests {
    use serde_json::Value as Json;

    use super::*;
    use crate::ModelTokenizer;

    /// The fast path gives the full pipeline's ids for `text`, with and without special tokens;
    /// `context` leads the failure message.
    fn assert_fast_equals_reference(tok: &ModelTokenizer, text: &str, context: &str) {
        for add_special_tokens in [false, true] {
            assert_eq!(
                tok.encode(text, add_special_tokens).expect("fast"),
                tok.encode_reference(text, add_special_tokens)
                    .expect("reference"),
                "{context} {text:?}"
            );
        }
    }

    /// A tiny sentencepiece-style tokenizer.json: byte fallback, `extra_vocab` and `merges`
    /// on top of "▁", a few letters and the 256 byte tokens, and a BOS post-processor.
    fn tokenizer_json(extra_vocab: &[&str], merges: &[&str], normalizer: Json) -> Vec<u8> {
        let mut vocab = serde_json::Map::new();
        let mut add = |token: String| {
            let id = vocab.len();
            vocab.entry(token).or_insert(Json::from(id));
        };
        for token in ["<unk>", "<s>", "</s>"] {
            add(token.to_owned());
        }
        for byte in 0..=255u8 {
            add(format!("<0x{byte:02X}>"));
        }
        for token in ["▁", "a", "b", "c", "\n"] {
            add(token.to_owned());
        }
        for token in extra_vocab {
            add((*token).to_owned());
        }
        serde_json::to_vec(&json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [
                {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": true, "normalized": false, "special": false}
            ],
            "normalizer": normalizer,
            "pre_tokenizer": null,
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
            },
            "decoder": null,
            "model": {
                "type": "BPE",
                "dropout": null,
                "unk_token": "<unk>",
                "continuing_subword_prefix": null,
                "end_of_word_suffix": null,
                "fuse_unk": true,
                "byte_fallback": true,
                "vocab": vocab,
                "merges": merges,
            }
        }))
        .expect("json")
    }

    fn sentencepiece_normalizer() -> Json {
        json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        ]})
    }

    fn load(json: &[u8]) -> ModelTokenizer {
        ModelTokenizer::from_bytes(json, None).expect("tokenizer")
    }

    const SAFE_VOCAB: &[&str] = &["▁a", "▁▁", "ab", "▁ab", "▁▁a"];
    const SAFE_MERGES: &[&str] = &["▁ a", "▁ ▁", "a b", "▁ ab", "▁▁ a"];

    #[test]
    fn the_sentencepiece_shape_takes_the_fast_path_and_gives_the_same_ids() {
        let tok = load(&tokenizer_json(
            SAFE_VOCAB,
            SAFE_MERGES,
            sentencepiece_normalizer(),
        ));
        assert!(tok.fast_path.is_some());
        let id = |token: &str| tok.token_to_id(token).expect("in the vocabulary");
        assert_eq!(tok.encode("a", true).expect("fast"), [id("<s>"), id("▁a")]);
        for text in [
            "",
            " ",
            "  ",
            "a",
            " ab  ab",
            "ab ab\nab",
            "a</s> \nab<s>",
            "é ab",
            "a▁b ▁▁a",
        ] {
            assert_fast_equals_reference(&tok, text, "");
        }
    }

    #[test]
    fn a_token_that_crosses_a_cut_keeps_the_full_pipeline() {
        // "a▁" merges across the cut in "a a": pieces "▁a", "▁a" would give two tokens where
        // the whole word gives "▁", "a▁", "a".
        let json = tokenizer_json(&["a▁", "▁a"], &["a ▁", "▁ a"], sentencepiece_normalizer());
        let tok = load(&json);
        assert!(tok.fast_path.is_none());
        let reference = tok.encode_reference("a a", false).expect("reference");
        let mut cut = Vec::new();
        for piece in ["▁a", "▁a"] {
            cut.extend(tok.encode_reference(piece, false).expect("piece"));
        }
        assert_ne!(reference, cut, "cutting would change the ids");
        assert!(crosses_a_cut("a▁"));
        assert!(crosses_a_cut("<0x41>▁"));
        assert!(!crosses_a_cut("▁▁ab"));
        assert!(!crosses_a_cut("▁"));
    }

    #[test]
    fn only_the_exact_shape_takes_the_fast_path() {
        let other_normalizers = [
            Json::Null,
            json!({"type": "Sequence", "normalizers": [
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
            ]}),
            json!({"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
                {"type": "Lowercase"}
            ]}),
            json!({"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"Regex": " "}, "content": "▁"}
            ]}),
        ];
        for normalizer in other_normalizers {
            let tok = load(&tokenizer_json(SAFE_VOCAB, SAFE_MERGES, normalizer.clone()));
            assert!(tok.fast_path.is_none(), "{normalizer}");
        }
        let json = tokenizer_json(SAFE_VOCAB, SAFE_MERGES, sentencepiece_normalizer());
        let mut value: Json = serde_json::from_slice(&json).expect("json");
        value["pre_tokenizer"] = json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false});
        let tok = load(&serde_json::to_vec(&value).expect("json"));
        assert!(tok.fast_path.is_none(), "a pre-tokenizer");
        let mut value: Json = serde_json::from_slice(&json).expect("json");
        value["added_tokens"][2]["normalized"] = json!(true);
        let tok = load(&serde_json::to_vec(&value).expect("json"));
        assert!(tok.fast_path.is_none(), "a normalized added token");
        let mut value: Json = serde_json::from_slice(&json).expect("json");
        value["model"]["ignore_merges"] = json!(true);
        let tok = load(&serde_json::to_vec(&value).expect("json"));
        assert!(tok.fast_path.is_none(), "ignore_merges");
    }

    #[test]
    fn the_metaspace_shape_takes_the_fast_path_with_its_prepend_scheme() {
        let json = tokenizer_json(SAFE_VOCAB, SAFE_MERGES, Json::Null);
        let with_pre_tokenizer = |pre_tokenizer: Json| {
            let mut value: Json = serde_json::from_slice(&json).expect("json");
            value["pre_tokenizer"] = pre_tokenizer;
            // Without a normalizer an added token matched on normalized text is no obstacle.
            value["added_tokens"][2]["normalized"] = json!(true);
            load(&serde_json::to_vec(&value).expect("json"))
        };
        for scheme in ["first", "always", "never"] {
            let tok = with_pre_tokenizer(json!({"type": "Metaspace", "replacement": "▁",
                                                "prepend_scheme": scheme, "split": false}));
            assert!(tok.fast_path.is_some(), "{scheme}");
            for text in [
                "",
                " ",
                "a",
                " ab  ab",
                "a</s> \nab<s>ab",
                "</s>a",
                "<s> a",
                "▁a",
                "é ab",
            ] {
                assert_fast_equals_reference(&tok, text, scheme);
            }
        }
        // Splitting on "▁" and other replacements are other shapes.
        for other in [
            json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true}),
            json!({"type": "Metaspace", "replacement": "_", "prepend_scheme": "first", "split": false}),
        ] {
            assert!(
                with_pre_tokenizer(other.clone()).fast_path.is_none(),
                "{other}"
            );
        }
    }
}
