//! The project's own default tokenizer, so a fresh clone can tokenize realistic prompts without
//! any third-party model files. It is a byte-level BPE (GPT-2 style pre-tokenizer, about 4,250
//! tokens, special tokens `<|bos|>`, `<|eos|>`, `<|system|>`, `<|user|>`, `<|assistant|>`,
//! `<|end|>`) trained deterministically with the `tokenizers` crate's trainer on English-like
//! text generated here from a fixed seed (numbered guidelines, questions and prose, so prompts
//! made of the same material tokenize to realistic lengths). It is written as a real
//! `tokenizer.json` plus a `tokenizer_config.json` carrying an HF-style Jinja chat template, and
//! cached under the workspace target directory so training happens once per checkout and
//! version.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use kvsight_protocol::splitmix::SplitMix64;
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer};

/// Bump when anything that changes the produced files changes (corpus, trainer settings,
/// template): it names the cache directory, so stale caches are never reused.
pub const VERSION: &str = "v1";

/// Upper bound on the vocabulary (special tokens and the 256 byte symbols included); training
/// stops earlier, at about 4,250, when no pair occurs twice more.
pub const VOCAB_SIZE: usize = 6000;

/// Special tokens, in id order (ids 0..=5).
pub const SPECIAL_TOKENS: [&str; 6] = [
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
];

/// Seed of the training corpus.
const CORPUS_SEED: u64 = 0x6b76_7369_6768_7401;

/// Made-up terms in the corpus lexicon.
const LEXICON_SIZE: usize = 4000;

/// Number of corpus sections (each: guidelines, questions and answers, prose); ~420 KB total,
/// which trains in under 2 s in a debug build.
const CORPUS_SECTIONS: usize = 30;

/// HF-style chat template: BOS once, each message as `<|role|>\n{content}<|end|>\n`, then
/// `<|assistant|>\n` when a generation prompt is asked for; other roles are refused.
pub const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}
{% if message['role'] not in ['system', 'user', 'assistant'] %}
{{ raise_exception('Unsupported role: ' ~ message['role']) }}{% endif %}
{{ '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ '<|end|>\\n' }}{% endfor %}
{% if add_generation_prompt %}
{{ '<|assistant|>\\n' }}{% endif %}";

/// Why the own tokenizer could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum OwnTokenizerError {
    /// Reading or writing the cache directory failed.
    #[error("own tokenizer cache at {path}: {source}")]
    Io {
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The `tokenizers` crate failed to build, train or serialize.
    #[error("training the own tokenizer failed: {0}")]
    Train(String),
    /// The cached files do not load as a [`kvsight_tokenizer::ModelTokenizer`].
    #[error("loading the own tokenizer failed: {0}")]
    Load(#[from] kvsight_tokenizer::TokenizerError),
}

/// The two files that make up the own tokenizer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnTokenizerFiles {
    /// `tokenizer.json` (HF tokenizers format, pretty-printed).
    pub tokenizer_json: String,
    /// `tokenizer_config.json` with special tokens and the chat template.
    pub tokenizer_config_json: String,
}

/// A tiny seeded generator (SplitMix64): the corpus must be identical on every machine and
/// every run, independent of any RNG crate's version.
#[derive(Clone, Debug)]
pub struct SeededRng(SplitMix64);

impl SeededRng {
    /// A generator starting at `seed`.
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `0..n` (n > 0; the tiny modulo bias is irrelevant here).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

const NOUNS: &[&str] = &[
    "request",
    "response",
    "answer",
    "question",
    "customer",
    "user",
    "assistant",
    "system",
    "document",
    "report",
    "summary",
    "table",
    "record",
    "account",
    "order",
    "invoice",
    "payment",
    "policy",
    "rule",
    "guideline",
    "example",
    "detail",
    "section",
    "paragraph",
    "sentence",
    "word",
    "number",
    "date",
    "time",
    "price",
    "product",
    "service",
    "team",
    "manager",
    "engineer",
    "doctor",
    "teacher",
    "student",
    "city",
    "country",
    "river",
    "mountain",
    "market",
    "company",
    "project",
    "deadline",
    "meeting",
    "message",
    "email",
    "letter",
    "phone",
    "server",
    "database",
    "file",
    "folder",
    "network",
    "cache",
    "memory",
    "model",
    "token",
    "prompt",
    "context",
    "source",
    "reference",
    "citation",
    "claim",
    "fact",
    "opinion",
    "risk",
    "benefit",
    "cost",
    "budget",
    "plan",
    "goal",
    "step",
    "task",
    "issue",
    "problem",
    "solution",
    "result",
    "error",
    "warning",
    "limit",
    "range",
    "value",
    "unit",
    "measure",
    "language",
    "tone",
    "style",
    "format",
    "list",
    "title",
    "heading",
    "chapter",
    "book",
    "article",
    "story",
    "history",
    "science",
    "energy",
    "water",
    "food",
    "health",
    "safety",
    "privacy",
    "law",
    "contract",
    "weather",
    "travel",
    "ticket",
    "hotel",
    "flight",
    "train",
    "car",
    "road",
    "map",
    "address",
    "name",
    "family",
    "friend",
    "child",
    "parent",
    "animal",
    "garden",
    "house",
    "kitchen",
    "recipe",
    "music",
    "song",
    "film",
    "game",
    "sport",
    "season",
    "morning",
    "evening",
    "week",
    "month",
    "year",
    "world",
    "idea",
    "reason",
    "change",
    "decision",
    "feedback",
    "review",
];

const VERBS: &[&str] = &[
    "answer",
    "explain",
    "describe",
    "check",
    "verify",
    "confirm",
    "summarize",
    "list",
    "compare",
    "review",
    "write",
    "read",
    "cite",
    "quote",
    "translate",
    "format",
    "respect",
    "protect",
    "avoid",
    "include",
    "mention",
    "state",
    "ask",
    "clarify",
    "refuse",
    "decline",
    "help",
    "support",
    "suggest",
    "recommend",
    "consider",
    "keep",
    "use",
    "prefer",
    "follow",
    "report",
    "flag",
    "escalate",
    "handle",
    "update",
    "correct",
    "measure",
    "estimate",
    "calculate",
    "plan",
    "schedule",
    "organize",
    "group",
    "sort",
    "shorten",
    "expand",
    "simplify",
    "repeat",
    "remember",
    "forget",
    "share",
    "store",
    "delete",
    "open",
    "close",
    "start",
    "finish",
    "begin",
    "end",
    "build",
    "test",
    "reduce",
    "increase",
    "improve",
    "find",
];

const ADJECTIVES: &[&str] = &[
    "clear",
    "short",
    "long",
    "simple",
    "complex",
    "accurate",
    "precise",
    "polite",
    "friendly",
    "formal",
    "casual",
    "honest",
    "careful",
    "helpful",
    "useful",
    "relevant",
    "recent",
    "old",
    "new",
    "local",
    "global",
    "public",
    "private",
    "personal",
    "sensitive",
    "safe",
    "unsafe",
    "legal",
    "medical",
    "financial",
    "technical",
    "general",
    "specific",
    "important",
    "minor",
    "major",
    "small",
    "large",
    "early",
    "late",
    "correct",
    "wrong",
    "missing",
    "complete",
    "partial",
    "known",
    "unknown",
    "common",
    "rare",
    "official",
    "previous",
    "next",
    "final",
];

const ADVERBS: &[&str] = &[
    "always",
    "never",
    "usually",
    "often",
    "rarely",
    "carefully",
    "briefly",
    "clearly",
    "politely",
    "directly",
    "only",
    "first",
    "then",
    "finally",
    "quickly",
    "calmly",
    "openly",
];

const CONNECTORS: &[&str] = &[
    "before", "after", "when", "unless", "because", "while", "if", "even if", "so that",
];

const QUESTION_OPENERS: &[&str] = &[
    "What",
    "How",
    "Why",
    "When",
    "Where",
    "Which",
    "Who",
    "Can you",
    "Could you",
    "Should I",
];

const NAMES: &[&str] = &[
    "Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Paris",
    "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Seoul",
];

const SYLLABLES: &[&str] = &[
    "ka", "lo", "ren", "ti", "mar", "vel", "sor", "dan", "qui", "pe", "ra", "no", "shi", "tri",
    "ble", "on", "ex", "ist", "al", "um", "cor", "bi", "zen", "tho", "gra", "mi", "lux", "fen",
    "da", "or", "ves", "pra", "nel", "ato", "ic", "ium", "ber", "gan", "wy", "ste",
];

/// A seeded lexicon of made-up terms (product names, jargon): they give the trainer subword
/// structure to learn beyond the closed list of real words, as real text has.
fn lexicon(rng: &mut SeededRng, count: usize) -> Vec<String> {
    (0..count)
        .map(|_| {
            let syllables = 2 + rng.below(3);
            (0..syllables)
                .map(|_| rng.pick(SYLLABLES))
                .collect::<String>()
        })
        .collect()
}

/// Picks from `items` with a skewed (roughly Zipf-like) distribution, so a few terms are common
/// and most are rare.
fn pick_skewed<'a>(rng: &mut SeededRng, items: &'a [String]) -> &'a str {
    let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    let index = ((u * u) * items.len() as f64) as usize;
    &items[index.min(items.len().saturating_sub(1))]
}

fn plural(noun: &str) -> String {
    if noun.ends_with('s') || noun.ends_with('x') || noun.ends_with("ch") || noun.ends_with("sh") {
        format!("{noun}es")
    } else if let Some(stem) = noun
        .strip_suffix('y')
        .filter(|s| !s.ends_with(['a', 'e', 'o']))
    {
        format!("{stem}ies")
    } else {
        format!("{noun}s")
    }
}

fn past(verb: &str) -> String {
    if verb.ends_with('e') {
        format!("{verb}d")
    } else if let Some(stem) = verb
        .strip_suffix('y')
        .filter(|s| !s.ends_with(['a', 'e', 'o']))
    {
        format!("{stem}ied")
    } else {
        format!("{verb}ed")
    }
}

fn gerund(verb: &str) -> String {
    match verb.strip_suffix('e').filter(|s| !s.ends_with('e')) {
        Some(stem) => format!("{stem}ing"),
        None => format!("{verb}ing"),
    }
}

/// A longer sentence mixing inflected real words and made-up terms.
fn varied_sentence(rng: &mut SeededRng, terms: &[String]) -> String {
    let subject = plural(rng.pick(NOUNS));
    let mut first = subject.clone();
    if let Some(c) = first.get(..1) {
        let upper = c.to_uppercase();
        first.replace_range(..1, &upper);
    }
    match rng.below(3) {
        0 => format!(
            "{first} {} by the {} team were {} {} the {} {} {}.",
            past(rng.pick(VERBS)),
            pick_skewed(rng, terms),
            rng.pick(ADVERBS),
            gerund(rng.pick(VERBS)),
            rng.pick(ADJECTIVES),
            pick_skewed(rng, terms),
            plural(rng.pick(NOUNS)),
        ),
        1 => format!(
            "After {} the {}, {} {} {} {} of {} and {}.",
            gerund(rng.pick(VERBS)),
            pick_skewed(rng, terms),
            rng.pick(NAMES),
            past(rng.pick(VERBS)),
            1 + rng.below(99),
            plural(rng.pick(NOUNS)),
            pick_skewed(rng, terms),
            pick_skewed(rng, terms),
        ),
        _ => format!(
            "{first} of the {} {} are {} {} than the {} ones, reported {} in {}.",
            pick_skewed(rng, terms),
            rng.pick(NOUNS),
            rng.pick(&["more", "less", "far more", "slightly less"]),
            rng.pick(ADJECTIVES),
            rng.pick(ADJECTIVES),
            pick_skewed(rng, terms),
            1990 + rng.below(40),
        ),
    }
}

/// One guideline sentence, e.g. "Always check the request before you answer any long question."
pub fn guideline(rng: &mut SeededRng) -> String {
    let adverb = rng.pick(ADVERBS);
    let mut s = String::new();
    let mut first = adverb.to_owned();
    if let Some(c) = first.get(..1) {
        let upper = c.to_uppercase();
        first.replace_range(..1, &upper);
    }
    let _ = write!(
        s,
        "{first} {} the {} {} {} you {} any {} {}",
        rng.pick(VERBS),
        rng.pick(ADJECTIVES),
        rng.pick(NOUNS),
        rng.pick(CONNECTORS),
        rng.pick(VERBS),
        rng.pick(ADJECTIVES),
        rng.pick(NOUNS),
    );
    match rng.below(4) {
        0 => {
            let _ = write!(
                s,
                ", and {} the {} of the {}",
                rng.pick(VERBS),
                rng.pick(NOUNS),
                rng.pick(NOUNS)
            );
        }
        1 => {
            let _ = write!(
                s,
                " (for example, a {} about {})",
                rng.pick(NOUNS),
                rng.pick(NAMES)
            );
        }
        _ => {}
    }
    s.push('.');
    s
}

/// A numbered list of `count` guidelines, one per line, as a system prompt preamble would be.
pub fn guidelines_preamble(count: usize, seed: u64) -> String {
    let mut rng = SeededRng::new(seed);
    let mut s = String::from("You are a helpful assistant. Follow these guidelines:\n");
    for i in 1..=count {
        let _ = writeln!(s, "{i}. {}", guideline(&mut rng));
    }
    s
}

/// One user-style question.
pub fn question(rng: &mut SeededRng) -> String {
    format!(
        "{} {} the {} {} for the {} {} in {}?",
        rng.pick(QUESTION_OPENERS),
        rng.pick(VERBS),
        rng.pick(ADJECTIVES),
        rng.pick(NOUNS),
        rng.pick(NOUNS),
        1 + rng.below(2030),
        rng.pick(NAMES),
    )
}

/// A prose paragraph of a few sentences.
pub fn paragraph(rng: &mut SeededRng) -> String {
    let mut s = String::new();
    for _ in 0..3 + rng.below(4) {
        let _ = write!(
            s,
            "The {} {} {} {} the {} {} {}, {} costs {}.{:02} and takes {} minutes. ",
            rng.pick(ADJECTIVES),
            rng.pick(NOUNS),
            rng.pick(ADVERBS),
            rng.pick(VERBS),
            rng.pick(NOUNS),
            rng.pick(CONNECTORS),
            rng.pick(NAMES),
            rng.pick(&["which", "it", "this", "that"]),
            rng.below(100),
            rng.below(100),
            1 + rng.below(120),
        );
    }
    s.pop();
    s
}

/// The training text: seeded, a few hundred KB, same material as the prompt generators.
pub fn corpus() -> String {
    let mut rng = SeededRng::new(CORPUS_SEED);
    let terms = lexicon(&mut rng, LEXICON_SIZE);
    let mut s = String::with_capacity(400_000);
    for section in 1..=CORPUS_SECTIONS {
        let _ = writeln!(
            s,
            "## Section {section}: {} {}\n",
            rng.pick(ADJECTIVES),
            rng.pick(NOUNS)
        );
        for i in 1..=20 {
            let _ = writeln!(s, "{i}. {}", guideline(&mut rng));
        }
        s.push('\n');
        for i in 1..=10 {
            let _ = writeln!(s, "Q{i}: {}", question(&mut rng));
            let _ = writeln!(s, "A{i}: {}\n", paragraph(&mut rng));
        }
        for _ in 0..4 {
            let _ = writeln!(s, "{}\n", paragraph(&mut rng));
        }
        for _ in 0..10 {
            let mut para = String::new();
            for _ in 0..6 {
                para.push_str(&varied_sentence(&mut rng, &terms));
                para.push(' ');
            }
            para.pop();
            let _ = writeln!(s, "{para}\n");
        }
    }
    s
}

fn train_err(e: impl std::fmt::Display) -> OwnTokenizerError {
    OwnTokenizerError::Train(e.to_string())
}

/// Trains the tokenizer in memory and returns its two files. Deterministic: the same bytes on
/// every call and machine (for a given `tokenizers` version, pinned by Cargo.lock).
pub fn build() -> Result<OwnTokenizerFiles, OwnTokenizerError> {
    let text = corpus();
    let mut tokenizer = Tokenizer::new(BPE::default());
    // No prefix space: the chat template writes "\n" before content, and decode must give back
    // exactly what was encoded.
    let byte_level = ByteLevel::default().add_prefix_space(false);
    tokenizer.with_pre_tokenizer(Some(byte_level));
    tokenizer.with_decoder(Some(byte_level));

    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|t| AddedToken::from(*t, true))
        .collect();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(VOCAB_SIZE)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    // Lines keep the corpus's sentence structure while letting the trainer count words in
    // parallel; counts are summed, so the result does not depend on the split.
    tokenizer
        .train(&mut trainer, text.lines().map(|l| format!("{l}\n")))
        .map_err(train_err)?;

    let bos_id = tokenizer
        .token_to_id(SPECIAL_TOKENS[0])
        .ok_or_else(|| train_err("trainer dropped <|bos|>"))?;
    // Completion prompts get a BOS, as Llama-3-style tokenizers add one.
    let post = TemplateProcessing::builder()
        .try_single(format!("{} $A", SPECIAL_TOKENS[0]))
        .map_err(train_err)?
        .try_pair(format!("{} $A $B", SPECIAL_TOKENS[0]))
        .map_err(train_err)?
        .special_tokens(vec![(SPECIAL_TOKENS[0].to_owned(), bos_id)])
        .build()
        .map_err(train_err)?;
    tokenizer.with_post_processor(Some(post));

    let tokenizer_json = tokenizer.to_string(true).map_err(train_err)?;
    let config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[1],
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": false,
        "chat_template": CHAT_TEMPLATE,
    });
    let tokenizer_config_json = serde_json::to_string_pretty(&config).map_err(train_err)?;
    Ok(OwnTokenizerFiles {
        tokenizer_json,
        tokenizer_config_json,
    })
}

/// The workspace target directory: `$CARGO_TARGET_DIR` (relative to the workspace root when
/// relative) or `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    // CARGO_MANIFEST_DIR is sim/; the workspace root is its parent.
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => workspace.join(dir),
        _ => workspace.join("target"),
    }
}

/// Builds the tokenizer once and caches it in `<target>/kvsight-own-tokenizer/<VERSION>/`,
/// returning that directory (with `tokenizer.json` and `tokenizer_config.json`).
///
/// Safe when several test processes race: each writes a private temporary directory and renames
/// it into place; the loser of the rename discards its copy and uses the winner's.
pub fn ensure_dir() -> Result<PathBuf, OwnTokenizerError> {
    static TRAINING: Mutex<()> = Mutex::new(());
    ensure_cached("kvsight-own-tokenizer", VERSION, &TRAINING, build)
}

/// [`ensure_dir`] for any tokenizer trained here: `build`'s files cached once in
/// `<target>/<name>/<version>/`. `training` serializes the callers of one process.
pub(crate) fn ensure_cached(
    name: &str,
    version: &str,
    training: &Mutex<()>,
    build: fn() -> Result<OwnTokenizerFiles, OwnTokenizerError>,
) -> Result<PathBuf, OwnTokenizerError> {
    let parent = target_dir().join(name);
    let dir = parent.join(version);
    if is_complete(&dir) {
        return Ok(dir);
    }
    // Tests of one binary run on parallel threads and would all train at once on a cold cache;
    // one trains, the others wait and then find the files. (Processes still race; see below.)
    let _guard = training
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if is_complete(&dir) {
        return Ok(dir);
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| OwnTokenizerError::Io { path, source }
    };
    std::fs::create_dir_all(&parent).map_err(io(&parent))?;
    let files = build()?;

    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let tmp = parent.join(format!(
        ".tmp-{version}-{}-{nanos}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let write = |name: &str, contents: &str| {
        let path = tmp.join(name);
        std::fs::write(&path, contents).map_err(io(&path))
    };
    write("tokenizer.json", &files.tokenizer_json)?;
    write("tokenizer_config.json", &files.tokenizer_config_json)?;

    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        Err(_) if is_complete(&dir) => {
            // Another process won the race with identical contents.
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(source) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(OwnTokenizerError::Io { path: dir, source })
        }
    }
}

fn is_complete(dir: &Path) -> bool {
    dir.join("tokenizer.json").is_file() && dir.join("tokenizer_config.json").is_file()
}

/// The own tokenizer as a [`kvsight_tokenizer::ModelTokenizer`], from the cache.
pub fn load() -> Result<kvsight_tokenizer::ModelTokenizer, OwnTokenizerError> {
    load_dir(&ensure_dir()?)
}

/// A cached tokenizer folder as a [`kvsight_tokenizer::ModelTokenizer`], read as `vllm-sim` reads
/// a folder ([`crate::server::TokenizerFiles::from_dir`]).
pub(crate) fn load_dir(dir: &Path) -> Result<kvsight_tokenizer::ModelTokenizer, OwnTokenizerError> {
    let files =
        crate::server::TokenizerFiles::from_dir(dir).map_err(|source| OwnTokenizerError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    Ok(kvsight_tokenizer::ModelTokenizer::from_bytes(
        &files.tokenizer_json,
        Some(&files.tokenizer_config),
    )?)
}
