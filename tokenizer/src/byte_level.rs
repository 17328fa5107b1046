//! A faster road to the same ids for GPT-2-style byte-level BPE tokenizers (no normalizer, a
//! `ByteLevel` pre-tokenizer with its built-in regex).
//!
//! Why: `tokenizers` runs the pre-tokenizer through `NormalizedString`s — every word gets its
//! own string plus a per-byte alignment table, and the GPT-2 pattern's `\s+(?!\S)` lookahead
//! forces the backtracking `fancy-regex` VM. For a 2,300-token chat that is ~2 ms of the ~2.5 ms
//! encode, while the BPE merges themselves (cached) take ~0.2 ms. The built-in pattern has the
//! shape `split.rs` runs exactly (plain alternatives around the one lookahead), so the words are
//! found by that module's matcher; this module adds only `ByteLevel`'s own prefix space.
//! Everything else is the crate's own code: added tokens are split off by its
//! `AddedVocabulary`, each word is merged by its model, and its post-processor adds the special
//! tokens. `tests` below compare both roads on adversarial text.

use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{PreTokenizerWrapper, Tokenizer};

use super::split::SplitFastPath;
use super::{TokenizerError, WordSink, Words};

/// `ByteLevel`'s built-in pattern (GPT-2's).
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Encodes text with a byte-level BPE tokenizer without the `NormalizedString` machinery.
#[derive(Debug)]
pub(super) struct ByteLevelFastPath {
    words: SplitFastPath,
    add_prefix_space: bool,
}

impl ByteLevelFastPath {
    /// The fast path when `tokenizer` is exactly the shape it reproduces, else `None`.
    pub(super) fn detect(tokenizer: &Tokenizer) -> Option<Self> {
        if tokenizer.get_normalizer().is_some() {
            return None;
        }
        let Some(PreTokenizerWrapper::ByteLevel(ByteLevel {
            add_prefix_space,
            use_regex: true,
            ..
        })) = tokenizer.get_pre_tokenizer()
        else {
            return None;
        };
        Some(Self {
            // The pattern is a constant of the accepted shape; `None` (no fast path) would only
            // cost speed, and a test asserts the fast path is taken.
            words: SplitFastPath::for_pattern(GPT2_PATTERN)?,
            add_prefix_space: *add_prefix_space,
        })
    }

    /// Passes each word of one text between added tokens to `emit`, written in GPT-2's byte
    /// alphabet as the model expects (the rest is [`super::encode_by_words`]), or says the text
    /// needs the full pipeline.
    pub(super) fn words(
        &self,
        split: &str,
        emit: &mut WordSink<'_>,
    ) -> Result<Words, TokenizerError> {
        let prefixed;
        let split = if self.add_prefix_space && !split.starts_with(' ') {
            prefixed = format!(" {split}");
            prefixed.as_str()
        } else {
            split
        };
        self.words.words(split, emit)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use tokenizers::models::bpe::BPE;
    use tokenizers::normalizers::Lowercase;
    use tokenizers::pre_tokenizers::metaspace::Metaspace;
    use tokenizers::{
        AddedToken, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer as _,
    };

    use super::*;
    use crate::LONG_WHITESPACE_RUN;
    use crate::ModelTokenizer;

    /// Text that exercises every alternative of the pattern: contractions, letters and digits of
    /// several scripts, symbols, every kind of whitespace run, and the added tokens below.
    const FRAGMENTS: &[&str] = &[
        " ",
        "  ",
        "   ",
        "\n",
        "\n\n",
        "\t",
        " \n ",
        "\r\n",
        "\u{a0}",
        "\u{3000}",
        "\u{200b}",
        "hello",
        "Hello",
        "world",
        "the",
        "'s",
        "'t",
        "'re",
        "'ve",
        "'m",
        "'ll",
        "'d",
        "'",
        "'S",
        "don't",
        "123",
        "4567",
        "٣٤",
        "Ⅻ",
        "3.14",
        "é",
        "naïve",
        "Straße",
        "中文",
        "日本語",
        "🙂",
        "👍🏽",
        "!!",
        "?",
        ".",
        ",",
        "--",
        "...",
        "$",
        "<|end|>",
        "<|user|>",
        "<s>",
        "[DAY]",
        "day",
        "x",
    ];

    fn corpus() -> Vec<String> {
        let mut lines = Vec::new();
        for i in 0..200 {
            let line: String = (0..12)
                .map(|j| FRAGMENTS[(i * 7 + j * 13 + i * j) % FRAGMENTS.len()])
                .collect();
            lines.push(format!("{line}\n"));
        }
        lines
    }

    /// A small byte-level BPE with added tokens of every flavour (special or not, stripping,
    /// single-word, matched on normalized text) and a BOS post-processor.
    fn tokenizer_json(add_prefix_space: bool) -> String {
        let mut tokenizer = crate::testing::byte_level_bpe(
            ByteLevel::default().add_prefix_space(add_prefix_space),
            None,
            600,
            Some("<|bos|>"),
            corpus().into_iter(),
        );
        tokenizer
            .add_special_tokens([
                AddedToken::from("<|end|>", true).rstrip(true),
                AddedToken::from("<|user|>", true).lstrip(true),
            ])
            .expect("special tokens");
        tokenizer
            .add_tokens([
                AddedToken::from("[DAY]", false).single_word(true),
                AddedToken::from("day", false).normalized(true),
            ])
            .expect("added tokens");
        tokenizer.to_string(false).expect("serialize")
    }

    fn model_tokenizer(add_prefix_space: bool) -> ModelTokenizer {
        let tok = ModelTokenizer::from_bytes(tokenizer_json(add_prefix_space).as_bytes(), None)
            .expect("load");
        assert!(
            tok.fast_path.is_some(),
            "byte-level BPE takes the fast path"
        );
        tok
    }

    fn words(text: &str) -> Vec<String> {
        words_or_handed_over(text).expect("the fast path splits this text itself")
    }

    /// The fast path's words, or `None` when it hands the text to the full pipeline.
    fn words_or_handed_over(text: &str) -> Option<Vec<String>> {
        let fast = ByteLevelFastPath::detect(&byte_level_tokenizer()).expect("fast path");
        let mut out = Vec::new();
        let words = fast
            .words(text, &mut |w: &str| {
                out.push(w.to_owned());
                Ok(())
            })
            .expect("split");
        (words == Words::Emitted).then_some(out)
    }

    fn reference_words(text: &str) -> Vec<String> {
        let mut pre = PreTokenizedString::from(text);
        ByteLevel::default()
            .add_prefix_space(false)
            .pre_tokenize(&mut pre)
            .expect("pre-tokenize");
        pre.get_splits(OffsetReferential::Original, OffsetType::None)
            .into_iter()
            .map(|(w, _, _)| w.to_owned())
            .collect()
    }

    /// An (untrained) tokenizer with `ByteLevel`'s usual pre-tokenizer.
    fn byte_level_tokenizer() -> Tokenizer {
        let mut tokenizer = Tokenizer::new(BPE::default());
        tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
        tokenizer
    }

    #[test]
    fn a_whitespace_run_before_a_word_gives_its_last_character_to_the_word() {
        let expected: Vec<String> = ["a", " ", " b", "\n\n", " c", "   "]
            .iter()
            .map(|w| w.replace(' ', "Ġ").replace('\n', "Ċ"))
            .collect();
        assert_eq!(words("a  b\n\n c   "), expected);
        assert_eq!(reference_words("a  b\n\n c   "), expected);
    }

    #[test]
    fn only_the_byte_level_shape_takes_the_fast_path() {
        let plain = || Tokenizer::new(BPE::default());
        assert!(ByteLevelFastPath::detect(&byte_level_tokenizer()).is_some());
        let mut normalized = byte_level_tokenizer();
        normalized
            .with_normalizer(Some(Lowercase))
            .expect("normalizer");
        assert!(ByteLevelFastPath::detect(&normalized).is_none());
        let mut no_regex = plain();
        no_regex.with_pre_tokenizer(Some(ByteLevel::default().use_regex(false)));
        assert!(ByteLevelFastPath::detect(&no_regex).is_none());
        let mut metaspace = plain();
        metaspace.with_pre_tokenizer(Some(Metaspace::default()));
        assert!(ByteLevelFastPath::detect(&metaspace).is_none());
        assert!(ByteLevelFastPath::detect(&plain()).is_none());
    }

    #[test]
    fn a_whitespace_run_the_reference_cannot_split_goes_to_the_full_pipeline() {
        let long = format!("a{}b", " ".repeat(LONG_WHITESPACE_RUN));
        assert_eq!(words_or_handed_over(&long), None);
        let short = format!("a{}b", " ".repeat(LONG_WHITESPACE_RUN - 1));
        assert_eq!(words(&short), reference_words(&short));
        // Through `encode`: the handed-over text gets the pipeline's own ids.
        let tok = model_tokenizer(false);
        let text = format!("x{}y z", "\n".repeat(LONG_WHITESPACE_RUN));
        assert_eq!(
            tok.encode(&text, true).unwrap(),
            tok.encode_reference(&text, true).unwrap()
        );
    }

    fn fragment_text() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(FRAGMENTS), 0..40).prop_map(|f| f.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn words_equal_byte_levels_on_tricky_text(text in fragment_text()) {
            prop_assert_eq!(words(&text), reference_words(&text));
        }

        #[test]
        fn words_equal_byte_levels_on_any_text(text in any::<String>()) {
            prop_assert_eq!(words(&text), reference_words(&text));
        }

        #[test]
        fn ids_equal_the_full_pipeline(
            text in prop_oneof![fragment_text(), any::<String>()],
            add_special_tokens in any::<bool>(),
            add_prefix_space in any::<bool>(),
        ) {
            thread_local! {
                static TOKENIZERS: [ModelTokenizer; 2] = [model_tokenizer(false), model_tokenizer(true)];
            }
            TOKENIZERS.with(|toks| {
                let tok = &toks[usize::from(add_prefix_space)];
                prop_assert_eq!(
                    tok.encode(&text, add_special_tokens).expect("fast"),
                    tok.encode_reference(&text, add_special_tokens).expect("reference")
                );
                Ok(())
            })?;
        }
    }
}
