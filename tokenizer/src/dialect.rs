//! Which transformers generation's tokenization a [`super::ModelTokenizer`] reproduces.
//!
//! The same `tokenizer.json` + `tokenizer_config.json` give different ids in transformers 4 and
//! 5, and vLLM moved from one to the other (vLLM >= 0.32 requires transformers >= 5.16). Which
//! one an engine follows, and which of transformers 5's two behaviours, depends on the model's
//! `config.json` (`model_type`), which the router never sees: so the router builds each
//! tokenizer in every dialect that gives other ids ([`distinct`]) and keeps the one an engine's
//! own `/tokenize` agrees with.
//!
//! - [`Dialect::Transformers4`]: tokenizer.json's pipeline as it is; Llama-family classes rebuild
//!   the post-processor from `add_bos_token`/`add_eos_token` (`config.rs`).
//! - [`Dialect::Transformers5`]: tokenizer.json as it is, post-processor included. transformers 5
//!   ignores the config's BOS/EOS flags whenever tokenizer.json exists; its `TokenizersBackend`
//!   (e.g. for `model_type` phi3, mistral, llava, or a `PreTrainedTokenizerFast` class) loads
//!   the file unchanged.
//! - [`Dialect::Transformers5Rebuilt`]: what transformers 5's `LlamaTokenizer` builds from the
//!   files (tokenizer_class `LlamaTokenizer[Fast]` with `model_type` llama, or no config.json):
//!   only vocab, merges, added tokens and post-processor are taken from tokenizer.json; the
//!   normalizer is dropped, the pre-tokenizer is `Metaspace("▁", prepend_scheme, split=false)`
//!   and the BPE model has no unknown token. The difference that matters: "▁" is prepended only
//!   to the text at byte 0 of the input, not to every text after an added token, and not to text
//!   that already starts with a space (` leading` is `▁leading`, not `▁ ▁leading`).
//!
//! Checked against transformers 4.57 and 5.19: the rebuilt construction gives transformers 5's
//! ids on the pinned Phi-3 and Llama-2-shaped vectors (`tests/dialects.rs`,
//! `sim/tests/tokenizer_llama2.rs`).

use serde_json::{Value as Json, json};
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{ModelWrapper, NormalizerWrapper, PostProcessor, Tokenizer};

use super::TokenizerError;

/// The sentencepiece word-boundary marker that stands for a space.
const METASPACE: char = '▁';

/// A way of turning the same tokenizer files into token ids (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dialect {
    /// transformers 4: tokenizer.json's pipeline, the config's BOS/EOS flags for Llama-family
    /// classes. vLLM before 0.32; what the router uses until an engine says otherwise.
    #[default]
    Transformers4,
    /// transformers 5 loading tokenizer.json as it is (its post-processor decides BOS/EOS).
    Transformers5,
    /// transformers 5's rebuilt `LlamaTokenizer`: no normalizer, a `Metaspace` pre-tokenizer
    /// that prepends "▁" once, no unknown token.
    Transformers5Rebuilt,
}

impl Dialect {
    /// Every dialect, in the order of preference when several give the same ids.
    pub const ALL: [Dialect; 3] = [
        Dialect::Transformers4,
        Dialect::Transformers5,
        Dialect::Transformers5Rebuilt,
    ];

    /// `transformers4`, `transformers5` or `transformers5_rebuilt` (metric labels, JSON, flags).
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Transformers4 => "transformers4",
            Dialect::Transformers5 => "transformers5",
            Dialect::Transformers5Rebuilt => "transformers5_rebuilt",
        }
    }
}

impl std::fmt::Display for Dialect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A dialect name that is none of [`Dialect::as_str`]'s.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown tokenizer dialect {0:?}: expected transformers4, transformers5 or transformers5_rebuilt"
)]
pub struct UnknownDialect(pub String);

impl std::str::FromStr for Dialect {
    type Err = UnknownDialect;

    /// [`Dialect::as_str`]'s names; `-` may stand for `_` (command-line style).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let name = s.replace('-', "_");
        Dialect::ALL
            .into_iter()
            .find(|d| d.as_str() == name)
            .ok_or_else(|| UnknownDialect(s.to_owned()))
    }
}

/// The prepend scheme transformers 5's `LlamaTokenizer` derives from the config:
/// `add_prefix_space: false` → never; else `legacy: true` → always; else (the default,
/// `legacy` false) → first.
pub(super) fn rebuilt_prepend_scheme(config: &serde_json::Map<String, Json>) -> PrependScheme {
    let flag =
        |key: &str, default: bool| config.get(key).and_then(Json::as_bool).unwrap_or(default);
    if !flag("add_prefix_space", true) {
        PrependScheme::Never
    } else if flag("legacy", false) {
        PrependScheme::Always
    } else {
        PrependScheme::First
    }
}

/// Whether transformers 5's Llama rebuild applies to this tokenizer's shape: a sentencepiece-
/// style BPE (a normalizer or pre-tokenizer that turns spaces into "▁"; Llama 2, Mistral,
/// Phi-3). Byte-level BPE tokenizers are left to the other dialects.
pub(super) fn rebuild_applies(tokenizer: &Tokenizer) -> bool {
    let ModelWrapper::BPE(bpe) = tokenizer.get_model() else {
        return false;
    };
    if bpe.continuing_subword_prefix.is_some() || bpe.end_of_word_suffix.is_some() {
        return false;
    }
    let as_json = |v: Option<Json>| v.unwrap_or(Json::Null);
    let normalizer = as_json(
        tokenizer
            .get_normalizer()
            .and_then(|n| serde_json::to_value(n).ok()),
    );
    let pre_tokenizer = as_json(
        tokenizer
            .get_pre_tokenizer()
            .and_then(|p| serde_json::to_value(p).ok()),
    );
    uses_metaspace(&normalizer) || uses_metaspace(&pre_tokenizer)
}

/// Whether a serialized normalizer or pre-tokenizer (sequences included) has a `Metaspace` step
/// or replaces " " with "▁".
fn uses_metaspace(step: &Json) -> bool {
    match step {
        Json::Object(map) => {
            let kind = map.get("type").and_then(Json::as_str);
            let space_to_metaspace = kind == Some("Replace")
                && map.get("pattern") == Some(&json!({"String": " "}))
                && map.get("content").and_then(Json::as_str) == Some("▁");
            kind == Some("Metaspace")
                || space_to_metaspace
                || map
                    .values()
                    .any(|v| matches!(v, Json::Array(_)) && uses_metaspace(v))
        }
        Json::Array(items) => items.iter().any(uses_metaspace),
        _ => false,
    }
}

/// Turns a tokenizer loaded from the files into transformers 5's rebuilt `LlamaTokenizer`
/// (`LlamaTokenizer.__init__`: `BPE(vocab, merges, fuse_unk=True, byte_fallback=True,
/// dropout=None)`, no normalizer, `Metaspace(prepend_scheme, split=False)`). Added tokens and
/// the post-processor stay as loaded. The decoder is left alone: it does not change ids.
pub(super) fn rebuild_llama(
    tokenizer: &mut Tokenizer,
    scheme: PrependScheme,
) -> Result<(), TokenizerError> {
    let not_applicable = || TokenizerError::DialectDoesNotApply(Dialect::Transformers5Rebuilt);
    if !rebuild_applies(tokenizer) {
        return Err(not_applicable());
    }
    let ModelWrapper::BPE(bpe) = tokenizer.get_model() else {
        return Err(not_applicable());
    };
    let mut bpe = bpe.clone();
    bpe.unk_token = None;
    bpe.fuse_unk = true;
    bpe.byte_fallback = true;
    bpe.dropout = None;
    bpe.ignore_merges = false;
    tokenizer.with_model(bpe);
    // Also re-matches added tokens flagged `normalized` on the raw text, as transformers 5 does.
    tokenizer
        .with_normalizer(None::<NormalizerWrapper>)
        .map_err(|e| TokenizerError::InvalidTokenizer(e.to_string()))?;
    tokenizer.with_pre_tokenizer(Some(Metaspace::new(METASPACE, scheme, false)));
    Ok(())
}

/// Everything a dialect can change that decides ids: two dialects with equal signatures give
/// the same ids for every text.
#[derive(Clone, Debug, PartialEq)]
struct Signature {
    normalizer: Json,
    pre_tokenizer: Json,
    model: Json,
    /// The ids around one token after `add_special_tokens=true`.
    specials: Vec<u32>,
}

/// The dialects that give different ids for this tokenizer, in [`Dialect::ALL`]'s order
/// (so [`Dialect::Transformers4`] first). `flags` is the post-processor transformers 4 builds
/// from the config's BOS/EOS flags, if the class has one; `tokenizer` is as loaded from the
/// files (its own post-processor, its own pipeline).
pub(super) fn distinct(
    tokenizer: &Tokenizer,
    flags: Option<&TemplateProcessing>,
    scheme: PrependScheme,
) -> Vec<Dialect> {
    let to_json = |v: Option<Result<Json, serde_json::Error>>| match v {
        Some(Ok(v)) => v,
        _ => Json::Null,
    };
    let normalizer = to_json(tokenizer.get_normalizer().map(serde_json::to_value));
    let pre_tokenizer = to_json(tokenizer.get_pre_tokenizer().map(serde_json::to_value));
    let file_processor = tokenizer
        .get_post_processor()
        .map(|p| p as &dyn PostProcessor);
    let file = Signature {
        normalizer,
        pre_tokenizer,
        model: model_params(tokenizer.get_model(), false),
        specials: specials(file_processor),
    };
    let transformers4 = Signature {
        specials: match flags {
            Some(flags) => specials(Some(flags)),
            None => file.specials.clone(),
        },
        ..file.clone()
    };
    let mut candidates = vec![
        (Dialect::Transformers4, transformers4),
        (Dialect::Transformers5, file),
    ];
    if rebuild_applies(tokenizer) {
        candidates.push((
            Dialect::Transformers5Rebuilt,
            Signature {
                normalizer: Json::Null,
                pre_tokenizer: serde_json::to_value(Metaspace::new(METASPACE, scheme, false))
                    .unwrap_or(Json::Null),
                model: model_params(tokenizer.get_model(), true),
                specials: specials(file_processor),
            },
        ));
    }
    let mut kept: Vec<(Dialect, Signature)> = Vec::new();
    for (dialect, signature) in candidates {
        if kept.iter().all(|(_, other)| *other != signature) {
            kept.push((dialect, signature));
        }
    }
    kept.into_iter().map(|(dialect, _)| dialect).collect()
}

/// The BPE settings that change ids (not the vocabulary, which no dialect changes), as loaded
/// or (`rebuilt`) as [`rebuild_llama`] sets them.
fn model_params(model: &ModelWrapper, rebuilt: bool) -> Json {
    let ModelWrapper::BPE(bpe) = model else {
        return Json::Null;
    };
    if !rebuilt {
        json!({
            "unk_token": bpe.unk_token,
            "fuse_unk": bpe.fuse_unk,
            "byte_fallback": bpe.byte_fallback,
            "dropout": bpe.dropout,
            "ignore_merges": bpe.ignore_merges,
            "continuing_subword_prefix": bpe.continuing_subword_prefix,
            "end_of_word_suffix": bpe.end_of_word_suffix,
        })
    } else {
        json!({
            "unk_token": null,
            "fuse_unk": true,
            "byte_fallback": true,
            "dropout": null,
            "ignore_merges": false,
            "continuing_subword_prefix": bpe.continuing_subword_prefix,
            "end_of_word_suffix": bpe.end_of_word_suffix,
        })
    }
}

/// What a post-processor puts around one token with `add_special_tokens=true` (the token is an
/// id no vocabulary has; processors insert ids, they never look them up).
fn specials(processor: Option<&dyn PostProcessor>) -> Vec<u32> {
    let one = tokenizers::Encoding::from_tokens(
        vec![tokenizers::Token::new(u32::MAX, String::new(), (0, 0))],
        0,
    );
    match processor {
        Some(p) => match p.process(one, None, true) {
            Ok(encoding) => encoding.get_ids().to_vec(),
            // A processor that fails here fails on every text: any signature will do.
            Err(_) => Vec::new(),
        },
        None => vec![u32::MAX],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for dialect in Dialect::ALL {
            assert_eq!(dialect.as_str().parse::<Dialect>(), Ok(dialect));
            assert_eq!(dialect.to_string(), dialect.as_str());
        }
        assert_eq!(
            "transformers5-rebuilt".parse::<Dialect>(),
            Ok(Dialect::Transformers5Rebuilt)
        );
        assert_eq!(
            "transformers6".parse::<Dialect>(),
            Err(UnknownDialect("transformers6".to_owned()))
        );
        assert_eq!(Dialect::default(), Dialect::Transformers4);
    }

    #[test]
    fn the_prepend_scheme_follows_legacy_and_add_prefix_space() {
        let scheme = |config: Json| {
            let Json::Object(map) = config else {
                panic!("an object")
            };
            rebuilt_prepend_scheme(&map)
        };
        assert_eq!(scheme(json!({})), PrependScheme::First);
        assert_eq!(scheme(json!({"legacy": false})), PrependScheme::First);
        assert_eq!(scheme(json!({"legacy": true})), PrependScheme::Always);
        assert_eq!(
            scheme(json!({"legacy": true, "add_prefix_space": false})),
            PrependScheme::Never
        );
        assert_eq!(
            scheme(json!({"add_prefix_space": true})),
            PrependScheme::First
        );
    }

    #[test]
    fn metaspace_steps_are_found_inside_sequences() {
        assert!(uses_metaspace(&json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        ]})));
        assert!(uses_metaspace(
            &json!({"type": "Sequence", "pretokenizers": [
                {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false}
            ]})
        ));
        assert!(!uses_metaspace(
            &json!({"type": "ByteLevel", "add_prefix_space": false})
        ));
        assert!(!uses_metaspace(
            &json!({"type": "Replace", "pattern": {"String": " "}, "content": "Ġ"})
        ));
        assert!(!uses_metaspace(&Json::Null));
    }
}
