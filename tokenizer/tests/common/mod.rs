//! What the tokenizer tests share: adversarial strings and the check that a fast path gives
//! the full `tokenizers` pipeline's ids.

use kvsight_tokenizer::ModelTokenizer;

/// Text where a fast path (sentencepiece's, the rebuilt dialect's rules) must split exactly as
/// `tokenizers` merges: runs of spaces at either end and after added tokens, tabs and newlines,
/// "▁" written literally, letters of several scripts, combining marks, emoji (byte fallback),
/// control and private-use characters, and Phi-3's added tokens (some strip the whitespace
/// after them).
pub(crate) const NASTY: &[&str] = &[
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n ",
    "▁",
    "▁▁",
    " ▁",
    "a",
    "Hello",
    "world",
    "don't",
    "3.14",
    "12345",
    "...",
    "?!",
    "é",
    "e\u{301}",
    "Straße",
    "中文",
    "日本語のテキスト",
    "한국어",
    "🙂",
    "👍🏽",
    "👨‍👩‍👧",
    "\u{0}",
    "\u{7f}",
    "\u{a0}",
    "\u{200b}",
    "\u{feff}",
    "\u{e000}",
    "\u{10fffd}",
    "𝔘𝔫𝔦",
    "<0x41>",
    "<",
    "|",
    ">",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|system|>",
    "<|endoftext|>",
    "<s>",
    "</s>",
    "<unk>",
];

/// The fast path and the full pipeline agree on `text`, with and without special tokens.
pub(crate) fn assert_fast_equals_reference(tok: &ModelTokenizer, text: &str) {
    for add_special_tokens in [false, true] {
        assert_eq!(
            tok.encode(text, add_special_tokens).expect("fast"),
            tok.encode_reference(text, add_special_tokens)
                .expect("reference"),
            "{} text {text:?}, add_special_tokens {add_special_tokens}",
            tok.dialect()
        );
    }
}
