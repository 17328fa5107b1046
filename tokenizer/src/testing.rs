//! Small tokenizers trained here, for this crate's tests and benchmarks and the fuzz targets:
//! real byte-level BPE models of the shapes the fast paths serve, without model files.

use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// Llama 3's pre-tokenizer shape: `Split(pattern)` isolating each match, then `ByteLevel`
/// without its own regex.
pub fn split_byte_level(pattern: &str) -> PreTokenizerWrapper {
    let split = Split::new(
        SplitPattern::Regex(pattern.to_owned()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .expect("pattern");
    let byte_level = ByteLevel::default()
        .add_prefix_space(false)
        .use_regex(false);
    Sequence::new(vec![split.into(), byte_level.into()]).into()
}

/// A byte-level BPE trained on `corpus` to `vocab_size`: `pre_tokenizer` (and `normalizer`)
/// in front, every byte in its alphabet, and `bos`, if any, its first token (id 0), put before
/// every encoding by the post-processor. Callers add their other tokens after.
pub fn byte_level_bpe(
    pre_tokenizer: impl Into<PreTokenizerWrapper>,
    normalizer: Option<NormalizerWrapper>,
    vocab_size: usize,
    bos: Option<&str>,
    corpus: impl Iterator<Item = String> + Send,
) -> Tokenizer {
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer.into()));
    if let Some(normalizer) = normalizer {
        tokenizer
            .with_normalizer(Some(normalizer))
            .expect("normalizer");
    }
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .show_progress(false)
        .special_tokens(bos.map(|b| AddedToken::from(b, true)).into_iter().collect())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tokenizer.train(&mut trainer, corpus).expect("train");
    let Some(bos) = bos else {
        return tokenizer;
    };
    let post = TemplateProcessing::builder()
        .try_single(format!("{bos} $A"))
        .expect("single")
        .special_tokens(vec![(bos.to_owned(), 0)])
        .build()
        .expect("post-processor");
    tokenizer.with_post_processor(Some(post));
    tokenizer
}
