//! A faster road to the same ids for byte-level BPE tokenizers whose words come from their own
//! `Split` pattern: `pre_tokenizer: Sequence[Split{Regex(P), Isolated, invert: false},
//! ByteLevel{add_prefix_space: false, use_regex: false}]` — Llama 3, Qwen2, GPT-4
//! style. Any normalizer (Qwen2's NFC) is run by the crate itself, where its pipeline runs it.
//!
//! Why: `tokenizers` runs `P` in the backtracking `fancy-regex` VM, because P's
//! `\s+(?!\S)` alternative is a lookahead, and gives every word its own `NormalizedString`.
//!
//! What makes the linear-time `regex` engine exact here: P's top-level alternation is
//! `A | \s+(?!\S) | B` where A and B are plain regexes (checked by [`around_lookahead`]), and
//! the alternation ends the pattern, so the backtracking engine's first match at a position
//! is the first alternative that matches there, with that alternative's own preferred match —
//! which for A and B is what `regex`'s leftmost-first anchored search returns (it simulates
//! backtracking priority). The lookahead alternative is done by hand: greedy `\s+` takes the
//! maximal whitespace run from the position; `(?!\S)` holds at the end of the text and never
//! right after a maximal run, so the engine gives back one character (after which the next
//! character is whitespace), and the alternative fails if nothing is left. `\s` is taken from
//! the `regex` engine in both places (fancy-regex delegates `\s+`/`\S` to it too).
//!
//! Two things go back to the full pipeline for that one call (same ids, just slower): text
//! where P leaves a gap (no alternative matches at some position: fancy-regex's unanchored
//! search would then keep the gap as its own piece, and a long gap can exhaust its backtrack
//! limit), and a whitespace run long enough that fancy-regex's greedy `\s+` could overflow its
//! backtracking stack (it then stops splitting and keeps the rest of the text as one piece).

use regex_automata::meta::Regex;
use regex_automata::{Anchored, Input};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use super::{FullPipeline, LONG_WHITESPACE_RUN, TokenizerError, WordSink, Words};

/// The one alternative the `regex` engine cannot run; [`SplitFastPath::lookahead_at`] runs it.
const LOOKAHEAD: &str = r"\s+(?!\S)";

/// Encodes text with a `Split`-pattern byte-level BPE tokenizer without `fancy-regex`.
#[derive(Debug)]
pub(super) struct SplitFastPath {
    /// The alternatives before `\s+(?!\S)`, if any.
    before: Option<Regex>,
    /// The alternatives after it, if any.
    after: Option<Regex>,
    /// `\s+`, from the same Unicode tables as the pattern's own `\s`.
    whitespace: Regex,
    /// GPT-2's `bytes_to_unicode`, applied by the `ByteLevel` step.
    alphabet: ByteAlphabet,
}

impl SplitFastPath {
    /// The fast path when `tokenizer` is exactly the shape it reproduces, else `None`.
    pub(super) fn detect(tokenizer: &Tokenizer) -> Option<Self> {
        let Some(PreTokenizerWrapper::Sequence(sequence)) = tokenizer.get_pre_tokenizer() else {
            return None;
        };
        let [
            PreTokenizerWrapper::Split(Split {
                pattern: SplitPattern::Regex(pattern),
                behavior: SplitDelimiterBehavior::Isolated,
                invert: false,
                ..
            }),
            PreTokenizerWrapper::ByteLevel(ByteLevel {
                add_prefix_space: false,
                use_regex: false,
                ..
            }),
        ] = sequence.as_ref()
        else {
            return None;
        };
        Self::for_pattern(pattern)
    }

    /// The fast path for a `Split` pattern, if it has the shape this module can run exactly.
    pub(super) fn for_pattern(pattern: &str) -> Option<Self> {
        let (before, after) = around_lookahead(pattern)?;
        Some(Self {
            before: plain_regex(&before)?,
            after: plain_regex(&after)?,
            whitespace: Regex::new(r"\s+").ok()?,
            alphabet: ByteAlphabet::new(),
        })
    }

    /// Passes each word of one (normalized) text between added tokens to `emit`, written in
    /// GPT-2's byte alphabet, or says the text needs the full pipeline.
    pub(super) fn words(
        &self,
        split: &str,
        emit: &mut WordSink<'_>,
    ) -> Result<Words, TokenizerError> {
        let mut word = String::new();
        self.for_each_piece(split, |piece| {
            self.alphabet.write(piece, &mut word);
            emit(&word)
        })
    }

    /// Calls `f` with each piece of `text` as the `Split` pre-tokenizer cuts it (matches tile
    /// the text, so each search is anchored where the previous piece ended).
    fn for_each_piece(
        &self,
        text: &str,
        mut f: impl FnMut(&str) -> Result<(), TokenizerError>,
    ) -> Result<Words, TokenizerError> {
        let mut start = 0;
        while start < text.len() {
            let end = match self.match_at(text, start) {
                Ok(Some(end)) => end,
                Ok(None) | Err(FullPipeline) => return Ok(Words::HandedOver),
            };
            f(&text[start..end])?;
            start = end;
        }
        Ok(Words::Emitted)
    }

    /// Where the pattern's match at `start` ends: the first alternative that matches wins.
    fn match_at(&self, text: &str, start: usize) -> Result<Option<usize>, FullPipeline> {
        if let Some(end) = anchored_end(self.before.as_ref(), text, start) {
            return Ok(Some(end));
        }
        if let Some(end) = self.lookahead_at(text, start)? {
            return Ok(Some(end));
        }
        Ok(anchored_end(self.after.as_ref(), text, start))
    }

    /// `\s+(?!\S)` at `start`: the maximal whitespace run, whole at the end of the text, else
    /// without its last character if that leaves any.
    fn lookahead_at(&self, text: &str, start: usize) -> Result<Option<usize>, FullPipeline> {
        let Some(run_end) = anchored_end(Some(&self.whitespace), text, start) else {
            return Ok(None);
        };
        if run_end - start >= LONG_WHITESPACE_RUN {
            return Err(FullPipeline);
        }
        if run_end == text.len() {
            return Ok(Some(run_end));
        }
        let last = text[start..run_end]
            .chars()
            .next_back()
            .map_or(0, char::len_utf8);
        let end = run_end - last;
        Ok((end > start).then_some(end))
    }
}

/// End of `regex`'s leftmost-first match anchored at `start`.
fn anchored_end(regex: Option<&Regex>, text: &str, start: usize) -> Option<usize> {
    let input = Input::new(text).range(start..).anchored(Anchored::Yes);
    regex?.find(input).map(|found| found.end())
}

/// Compiles alternatives for the `regex` engine: `Some(None)` when there are none, `None` (no
/// fast path) when they could match the empty string (fancy-regex then steps over empty
/// matches its own way) or use look-around assertions (`^`, `$`, `\b`: not checked to agree).
fn plain_regex(alternatives: &[&str]) -> Option<Option<Regex>> {
    if alternatives.is_empty() {
        return Some(None);
    }
    let pattern = alternatives.join("|");
    let hir = regex_automata::util::syntax::parse(&pattern).ok()?;
    let props = hir.properties();
    if !props.look_set().is_empty() || props.minimum_len().is_none_or(|len| len == 0) {
        return None;
    }
    Regex::new(&pattern).ok().map(Some)
}

/// Splits `pattern`'s top-level alternation around its one `\s+(?!\S)` alternative: the
/// alternatives before and after it. `None` unless every other alternative is made only of
/// constructs both engines read the same way: literals, `.`, escapes of classes (`\s \S \d \D
/// \w \W \p{..} \P{..}`), control characters (`\r \n \t \f \v`) and punctuation, classes
/// `[...]` (nested, POSIX `[:alpha:]`, no set operations), groups `(...)`, `(?:...)` and
/// scoped flags `(?i:...)` (only `i`, `m`, `s`), and the quantifiers `? * + {n} {n,} {n,m}`
/// (greedy or lazy).
fn around_lookahead(pattern: &str) -> Option<(Vec<&str>, Vec<&str>)> {
    let mut alternatives = Vec::new();
    let mut lookahead = None;
    let mut rest = pattern;
    loop {
        let len = if let Some(after) = rest.strip_prefix(LOOKAHEAD)
            && (after.is_empty() || after.starts_with('|'))
        {
            if lookahead.replace(alternatives.len()).is_some() {
                return None;
            }
            LOOKAHEAD.len()
        } else {
            let len = plain_alternative_len(rest)?;
            alternatives.push(&rest[..len]);
            len
        };
        match rest[len..].strip_prefix('|') {
            Some(next) => rest = next,
            None if len == rest.len() => break,
            None => return None,
        }
    }
    let at = lookahead?;
    let after = alternatives.split_off(at);
    Some((alternatives, after))
}

/// Length in bytes of the plain alternative that starts `pattern` (up to a top-level `|` or
/// the end), `None` if it is empty or uses anything outside the accepted constructs.
fn plain_alternative_len(pattern: &str) -> Option<usize> {
    let mut chars = pattern.char_indices().peekable();
    let mut depth = 0usize;
    // Whether a quantifier may follow (something to repeat precedes it).
    let mut atom = false;
    while let Some(&(at, c)) = chars.peek() {
        if c == '|' && depth == 0 {
            return (at > 0).then_some(at);
        }
        chars.next();
        atom = match c {
            '\\' => escape_ok(&mut chars)?,
            '[' => class_ok(&mut chars)?,
            '(' => {
                if chars.next_if(|&(_, c)| c == '?').is_some() {
                    // Only `(?:` and scoped flags `(?ims-ims:`.
                    while chars
                        .next_if(|&(_, c)| matches!(c, 'i' | 'm' | 's' | '-'))
                        .is_some()
                    {}
                    chars.next_if(|&(_, c)| c == ':')?;
                }
                depth += 1;
                false
            }
            ')' => {
                depth = depth.checked_sub(1)?;
                true
            }
            '?' | '*' | '+' if atom => {
                chars.next_if(|&(_, c)| c == '?');
                false
            }
            '{' if atom => {
                repetition_ok(&mut chars)?;
                chars.next_if(|&(_, c)| c == '?');
                false
            }
            '?' | '*' | '+' | '{' | '}' | ']' | '^' | '$' | '#' => return None,
            _ => true,
        };
    }
    (depth == 0 && !pattern.is_empty()).then_some(pattern.len())
}

type Chars<'a> = std::iter::Peekable<std::str::CharIndices<'a>>;

/// After a `\`: an accepted escape (see [`around_lookahead`]).
fn escape_ok(chars: &mut Chars<'_>) -> Option<bool> {
    let (_, c) = chars.next()?;
    match c {
        's' | 'S' | 'd' | 'D' | 'w' | 'W' | 'r' | 'n' | 't' | 'f' | 'v' => Some(true),
        'p' | 'P' => {
            chars.next_if(|&(_, c)| c == '{')?;
            let mut name = 0;
            while chars
                .next_if(|&(_, c)| c.is_ascii_alphanumeric() || c == '_')
                .is_some()
            {
                name += 1;
            }
            chars.next_if(|&(_, c)| c == '}')?;
            (name > 0).then_some(true)
        }
        c if c.is_ascii_punctuation() => Some(true),
        _ => None,
    }
}

/// After a `[`: the rest of an accepted class, nested classes included.
fn class_ok(chars: &mut Chars<'_>) -> Option<bool> {
    let mut depth = 1usize;
    let mut first = true;
    while depth > 0 {
        let (_, c) = chars.next()?;
        match c {
            '^' if first => continue,
            // `[]...]` and `[^]...]` read `]` as a literal in some engines only.
            ']' if first => return None,
            ']' => depth -= 1,
            '\\' => {
                escape_ok(chars)?;
            }
            '[' if chars.next_if(|&(_, c)| c == ':').is_some() => {
                // A POSIX class `[:name:]`.
                while chars.next_if(|&(_, c)| c.is_ascii_alphabetic()).is_some() {}
                chars.next_if(|&(_, c)| c == ':')?;
                chars.next_if(|&(_, c)| c == ']')?;
            }
            '[' => {
                depth += 1;
                first = true;
                continue;
            }
            // Set operations (`&&`, `--`, `~~`) are not read the same everywhere.
            '&' | '-' | '~' if chars.peek().is_some_and(|&(_, next)| next == c) => return None,
            _ => {}
        }
        first = false;
    }
    Some(true)
}

/// After a `{` that follows an atom: `n}`, `n,}` or `n,m}`.
fn repetition_ok(chars: &mut Chars<'_>) -> Option<()> {
    let digits = |chars: &mut Chars<'_>| {
        let mut n = 0;
        while chars.next_if(|&(_, c)| c.is_ascii_digit()).is_some() {
            n += 1;
        }
        n
    };
    if digits(chars) == 0 {
        return None;
    }
    if chars.next_if(|&(_, c)| c == ',').is_some() {
        digits(chars);
    }
    chars.next_if(|&(_, c)| c == '}').map(|_| ())
}

/// GPT-2's `bytes_to_unicode`: the character each byte is written as before byte-level BPE.
/// Printable bytes stand for themselves, the other 68 are mapped in order to U+0100 onwards.
#[derive(Debug)]
pub(super) struct ByteAlphabet([char; 256]);

impl ByteAlphabet {
    pub(super) fn new() -> Self {
        let mut table = ['\0'; 256];
        let mut next = 256u32;
        for (byte, slot) in (0u8..=255).zip(table.iter_mut()) {
            let printable = matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            let code = if printable {
                u32::from(byte)
            } else {
                next += 1;
                next - 1
            };
            // All codes are below U+0200, valid scalar values.
            *slot = char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER);
        }
        ByteAlphabet(table)
    }

    /// `piece` written in the alphabet, into `word` (cleared first, so one buffer serves a
    /// whole text).
    pub(super) fn write(&self, piece: &str, word: &mut String) {
        word.clear();
        word.extend(piece.bytes().map(|b| self.0[usize::from(b)]));
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use tokenizers::models::bpe::BPE;
    use tokenizers::normalizers::unicode::NFC;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::{
        AddedToken, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer as _,
    };

    use super::*;
    use crate::ModelTokenizer;

    #[test]
    fn byte_table_is_byte_levels_alphabet() {
        let table = ByteAlphabet::new().0;
        let mut chars: Vec<char> = table.to_vec();
        chars.sort_unstable();
        chars.dedup();
        assert_eq!(chars.len(), 256, "the table is a bijection");
        let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        alphabet.sort_unstable();
        assert_eq!(chars, alphabet);
        assert_eq!(table[usize::from(b' ')], 'Ġ');
        assert_eq!(table[usize::from(b'\n')], 'Ċ');
    }

    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    /// GPT-4o's (o200k) pattern: the same shape with case-aware letter runs.
    const O200K: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    /// Text that exercises every alternative: every kind of whitespace run before letters,
    /// digits, symbols and the end, contractions in any case (`ſ` folds to `s`), digit runs
    /// of 1 to 7, symbols before newlines, several scripts, combining marks (NFC composes
    /// them), emoji, and the added tokens below.
    const FRAGMENTS: &[&str] = &[
        " ",
        "  ",
        "   ",
        "\n",
        "\n\n",
        "\r\n",
        "\r",
        "\t",
        " \n ",
        " \t\n",
        "\u{a0}",
        "\u{3000}",
        "\u{2028}",
        "\u{85}",
        "\u{200b}",
        "\u{2003}",
        "hello",
        "Hello",
        "WORLD",
        "the",
        "'s",
        "'S",
        "'t",
        "'RE",
        "'ve",
        "'M",
        "'Ll",
        "'d",
        "'ſ",
        "'",
        "don't",
        "1",
        "12",
        "123",
        "1234",
        "12345",
        "123456",
        "1234567",
        "٣٤",
        "Ⅻ",
        "3.14",
        "é",
        "e\u{301}",
        "\u{212b}",
        "naïve",
        "Straße",
        "中文",
        "日本語",
        "한국어",
        "🙂",
        "👍🏽",
        "!!",
        "?",
        ".\n",
        "!\r\n",
        ",",
        "--",
        "...",
        "$",
        "/",
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "x",
    ];

    fn corpus() -> Vec<String> {
        (0..300)
            .map(|i| {
                let line: String = (0..12)
                    .map(|j| FRAGMENTS[(i * 7 + j * 13 + i * j) % FRAGMENTS.len()])
                    .collect();
                format!("{line} the quick brown fox's 2026 jumps over 42 lazy dogs.\n")
            })
            .collect()
    }

    /// A small Llama-3-shaped tokenizer: byte-level BPE trained here, `Sequence[Split(pattern),
    /// ByteLevel]`, Llama 3's special tokens and a BOS post-processor, and `nfc` for Qwen2.
    fn tokenizer(pattern: &str, nfc: bool) -> Tokenizer {
        let mut tokenizer = crate::testing::byte_level_bpe(
            crate::testing::split_byte_level(pattern),
            nfc.then(|| NFC.into()),
            800,
            Some("<|begin_of_text|>"),
            corpus().into_iter(),
        );
        tokenizer
            .add_special_tokens([
                AddedToken::from("<|eot_id|>", true),
                AddedToken::from("<|start_header_id|>", true),
                AddedToken::from("<|end_header_id|>", true),
            ])
            .expect("special tokens");
        tokenizer
    }

    fn model_tokenizer(pattern: &str, nfc: bool) -> ModelTokenizer {
        let json = tokenizer(pattern, nfc).to_string(false).expect("serialize");
        ModelTokenizer::from_bytes(json.as_bytes(), None).expect("load")
    }

    /// The fast path's pieces for `text`, or `None` where it defers to the full pipeline.
    fn pieces(fast: &SplitFastPath, text: &str) -> Option<Vec<String>> {
        let mut out = Vec::new();
        let done = fast
            .for_each_piece(text, |p| {
                out.push(p.to_owned());
                Ok(())
            })
            .expect("split");
        (done == Words::Emitted).then_some(out)
    }

    /// The pieces the crate's own `Split` cuts `text` into.
    fn reference_pieces(pattern: &str, text: &str) -> Vec<String> {
        let split = Split::new(
            SplitPattern::Regex(pattern.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .expect("pattern");
        split_pieces(&split, text)
    }

    fn split_pieces(split: &Split, text: &str) -> Vec<String> {
        let mut pre = PreTokenizedString::from(text);
        split.pre_tokenize(&mut pre).expect("pre-tokenize");
        pre.get_splits(OffsetReferential::Original, OffsetType::None)
            .into_iter()
            .map(|(w, _, _)| w.to_owned())
            .collect()
    }

    fn fast(pattern: &str) -> SplitFastPath {
        SplitFastPath::for_pattern(pattern).expect("fast path")
    }

    #[test]
    fn llama3_qwen2_and_gpt4o_shapes_take_the_fast_path() {
        for (pattern, nfc) in [(LLAMA3, false), (QWEN2, true)] {
            let tok = model_tokenizer(pattern, nfc);
            assert_eq!(tok.fast_path(), Some("byte_level_split"), "{pattern}");
        }
        assert!(SplitFastPath::for_pattern(O200K).is_some());
    }

    #[test]
    fn whitespace_before_a_word_gives_its_last_character_to_the_word() {
        let text = "a  b\n\n c   1\t\t.\u{3000}\u{3000}x  ";
        let expected = [
            "a",
            " ",
            " b",
            "\n\n",
            " c",
            "  ",
            " ",
            "1",
            "\t",
            "\t",
            ".",
            "\u{3000}",
            "\u{3000}x",
            "  ",
        ];
        assert_eq!(pieces(&fast(LLAMA3), text).expect("tiles"), expected);
        assert_eq!(reference_pieces(LLAMA3, text), expected);
    }

    #[test]
    fn only_the_exact_shape_takes_the_fast_path() {
        for pattern in [
            r"\p{L}+|\s+",                     // no lookahead
            r"\p{L}+|\s+(?!\S)|\s+(?!\S)|\s+", // two
            r"\p{L}+|\s+(?!\S)x|\s+",          // lookahead inside an alternative
            r"^\p{L}+|\s+(?!\S)|\s+",          // assertion
            r"\b\p{L}+|\s+(?!\S)|\s+",         // assertion
            r"(?i)'s|\p{L}+|\s+(?!\S)|\s+",    // flags without a scope
            r"(?x: a )|\s+(?!\S)|\s+",         // verbose mode
            r"(?=a)\p{L}+|\s+(?!\S)|\s+",      // other look-around
            r"(\p{L})\1|\s+(?!\S)|\s+",        // backreference
            r"(?>\p{L}+)|\s+(?!\S)|\s+",       // atomic group
            r"\p{L}++|\s+(?!\S)|\s+",          // possessive
            r"[]a]|\s+(?!\S)|\s+",             // leading `]`
            r"[\p{L}&&\p{Lu}]|\s+(?!\S)|\s+",  // set operation
            r"\p{N}{,3}|\s+(?!\S)|\s+",        // `{,n}`
            r"\p{L}*|\s+(?!\S)|\s+",           // matches empty
            r"\p{L}+||\s+(?!\S)|\s+",          // empty alternative
            r"\p{L}+|\s+(?!\S)|\s+|",          // empty last alternative
            r"(\p{L}+|\s+(?!\S)|\s+",          // unbalanced
            r"\p{L}+)|\s+(?!\S)|\s+",          // unbalanced
            r"\K\p{L}+|\s+(?!\S)|\s+",         // unknown escape
        ] {
            assert!(SplitFastPath::for_pattern(pattern).is_none(), "{pattern}");
        }
        let with = |pre: PreTokenizerWrapper| {
            let mut t = Tokenizer::new(BPE::default());
            t.with_pre_tokenizer(Some(pre));
            SplitFastPath::detect(&t).is_some()
        };
        let split = |behavior, invert| {
            Split::new(SplitPattern::Regex(LLAMA3.to_owned()), behavior, invert).expect("split")
        };
        let byte_level = |prefix, regex| {
            ByteLevel::default()
                .add_prefix_space(prefix)
                .use_regex(regex)
        };
        let seq = |a: Split, b: ByteLevel| Sequence::new(vec![a.into(), b.into()]).into();
        assert!(with(seq(
            split(SplitDelimiterBehavior::Isolated, false),
            byte_level(false, false)
        )));
        assert!(!with(seq(
            split(SplitDelimiterBehavior::Isolated, true),
            byte_level(false, false)
        )));
        assert!(!with(seq(
            split(SplitDelimiterBehavior::Removed, false),
            byte_level(false, false)
        )));
        assert!(!with(seq(
            split(SplitDelimiterBehavior::Isolated, false),
            byte_level(true, false)
        )));
        assert!(!with(seq(
            split(SplitDelimiterBehavior::Isolated, false),
            byte_level(false, true)
        )));
        assert!(!with(split(SplitDelimiterBehavior::Isolated, false).into()));
        let literal = Split::new(
            SplitPattern::String(r"\s+(?!\S)|\s+".to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .expect("split");
        assert!(!with(seq(literal, byte_level(false, false))));
    }

    #[test]
    fn a_whitespace_run_that_could_overflow_fancy_regex_takes_the_full_pipeline() {
        let text = format!("a{}b", " ".repeat(LONG_WHITESPACE_RUN));
        assert_eq!(pieces(&fast(LLAMA3), &text), None);
        let short = format!("a{}b", " ".repeat(LONG_WHITESPACE_RUN - 1));
        assert_eq!(
            pieces(&fast(LLAMA3), &short),
            Some(reference_pieces(LLAMA3, &short))
        );
    }

    fn fragment_text() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(FRAGMENTS), 0..40).prop_map(|f| f.concat())
    }

    /// Alternatives for random patterns: the building blocks of the real ones and some that
    /// leave gaps or overlap them.
    const ATOMS: &[&str] = &[
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
        r"[^\r\n\p{L}\p{N}]?\p{L}+",
        r" ?\p{L}+",
        r"\p{N}{1,3}",
        r"\p{N}",
        r" ?\p{N}+",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"[^\s\p{L}\p{N}]",
        r"\s*[\r\n]+",
        r"\s+",
        r"[\t ]",
        r"\s\s",
        r"\p{L}+?",
        r"(?s:.)",
    ];

    fn random_pattern() -> impl Strategy<Value = String> {
        (
            prop::sample::subsequence(ATOMS, 1..ATOMS.len()).prop_shuffle(),
            any::<prop::sample::Index>(),
        )
            .prop_map(|(mut atoms, at)| {
                atoms.insert(at.index(atoms.len() + 1), LOOKAHEAD);
                atoms.join("|")
            })
    }

    /// Both roads' pieces of `text` for Llama 3's, Qwen2's and GPT-4o's patterns (compiled once).
    fn both_pieces(text: &str) -> Vec<(Option<Vec<String>>, Vec<String>)> {
        thread_local! {
            static COMPILED: Vec<(SplitFastPath, Split)> = [LLAMA3, QWEN2, O200K]
                .into_iter()
                .map(|p| {
                    let split = Split::new(SplitPattern::Regex(p.to_owned()), SplitDelimiterBehavior::Isolated, false);
                    (fast(p), split.expect("pattern"))
                })
                .collect();
        }
        COMPILED.with(|compiled| {
            compiled
                .iter()
                .map(|(fast, split)| (pieces(fast, text), split_pieces(split, text)))
                .collect()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn pieces_equal_splits_on_tricky_text(text in fragment_text()) {
            for (fast, reference) in both_pieces(&text) {
                prop_assert_eq!(fast, Some(reference));
            }
        }

        #[test]
        fn pieces_equal_splits_on_any_text(text in any::<String>()) {
            for (fast, reference) in both_pieces(&text) {
                prop_assert_eq!(fast, Some(reference));
            }
        }

        /// Random patterns of the accepted shape; one that leaves a gap in a text defers to the
        /// full pipeline (and one ending in `(?s:.)` never leaves one).
        #[test]
        fn pieces_equal_splits_for_random_patterns(
            pattern in random_pattern(),
            text in prop_oneof![fragment_text(), any::<String>()],
        ) {
            let fast = fast(&pattern);
            match pieces(&fast, &text) {
                Some(pieces) => prop_assert_eq!(pieces, reference_pieces(&pattern, &text)),
                None => prop_assert!(!pattern.ends_with("(?s:.)"), "{pattern}"),
            }
        }

        #[test]
        fn ids_equal_the_full_pipeline(
            text in prop_oneof![fragment_text(), any::<String>()],
            add_special_tokens in any::<bool>(),
            qwen2 in any::<bool>(),
        ) {
            thread_local! {
                static TOKENIZERS: [ModelTokenizer; 2] =
                    [model_tokenizer(LLAMA3, false), model_tokenizer(QWEN2, true)];
            }
            TOKENIZERS.with(|toks| {
                let tok = &toks[usize::from(qwen2)];
                prop_assert_eq!(
                    tok.encode(&text, add_special_tokens).expect("fast"),
                    tok.encode_reference(&text, add_special_tokens).expect("reference")
                );
                Ok(())
            })?;
        }
    }
}
