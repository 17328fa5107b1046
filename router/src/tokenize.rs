//! Turning a request body into the tokens the scheduler hashes. With a tokenizer for the model
//! the tokens are exactly vLLM's (chat template for chat, special tokens added for completions);
//! without one the router falls back to *approximate* prefix memory: pseudo-tokens from
//! fixed-size character chunks of the prompt. Their chain never matches a pod's Bloom filter, but
//! it matches the pending blocks this router recorded for what it sent, so requests sharing a
//! prefix still land together on the pod that saw it first (within the pending TTL).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64;

use kvsight_protocol::tokenizer_transfer::TokenizerFiles;
use kvsight_tokenizer::{ChatRequest, Dialect, ModelTokenizer, TokenizerError};

use crate::body::PromptInput;

/// Characters per pseudo-token in approximate mode: about one real token of English text.
pub const APPROX_CHARS_PER_TOKEN: usize = 4;

/// Why a prompt could not be tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("{0}")]
    Invalid(String),
    #[error("tokenizer failed: {0}")]
    Tokenizer(String),
}

/// One model's tokenizer, as vLLM applies it. Implemented by the real `tokenizers` +
/// `minijinja` adapter and by test doubles.
pub trait PromptTokenizer: Send + Sync {
    /// A completion prompt, special tokens added (`add_special_tokens=true`).
    fn encode_completion(&self, prompt: &str) -> Result<Vec<u32>, TokenizeError>;
    /// A chat request body (`messages`, `add_generation_prompt`, `chat_template_kwargs`, …),
    /// rendered with the model's template and tokenized without adding special tokens again.
    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError>;
    /// The dialect (transformers 4 or 5's reading of the files) these ids are in.
    fn dialect(&self) -> Dialect {
        Dialect::default()
    }
    /// The dialects that give ids of their own for the same files, in order of preference: the
    /// tokenizer check tries each against the engine. Only [`dialect`](Self::dialect) unless
    /// the tokenizer can be read in others.
    fn dialects(&self) -> Vec<Dialect> {
        vec![self.dialect()]
    }
    /// The same files read in `dialect` (one of [`dialects`](Self::dialects)).
    fn in_dialect(&self, dialect: Dialect) -> Result<Arc<dyn PromptTokenizer>, TokenizeError> {
        Err(TokenizeError::Tokenizer(format!(
            "this tokenizer has no {dialect} dialect"
        )))
    }
}

/// Builds a tokenizer from the files a sidecar sent or the config names.
pub type TokenizerLoader =
    Arc<dyn Fn(&TokenizerFiles) -> Result<Arc<dyn PromptTokenizer>, TokenizeError> + Send + Sync>;

/// A tokenizer with the digest of the files it was built from and what the engine said of it.
struct Entry {
    digest: String,
    /// In the dialect an engine agreed with (until a check: the files' transformers 4 reading).
    tok: Arc<dyn PromptTokenizer>,
    verdict: Verdict,
    /// Engine versions whose pods agreed: a pod of another version (an engine upgraded in
    /// place, with the same files) is asked again.
    agreed_versions: Vec<String>,
    /// Checks that got no answer in a row, and when the next one may run.
    failed_checks: u32,
    next_check: Option<Instant>,
    /// Loaded from the router's config: never replaced by files a sidecar sends.
    configured: bool,
}

/// What the router knows of one model's tokenizer (`/debug/pods`, metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerStatus {
    pub model: String,
    pub digest: String,
    pub verdict: Verdict,
    /// Engine versions whose pods agreed.
    pub agreed_versions: Vec<String>,
    /// The dialect the router tokenizes this model in (while [`Verdict::Differs`] it is not
    /// used at all).
    pub dialect: Dialect,
    /// The dialects the files can be read in with ids of their own (the check's candidates).
    pub dialects: Vec<Dialect>,
}

/// A tokenizer that may need a check: see [`Tokenizers::due`].
pub struct Due {
    pub model: String,
    pub digest: String,
    pub tok: Arc<dyn PromptTokenizer>,
    /// Engine versions already agreed with; a pod of any other version is to be asked.
    pub agreed_versions: Vec<String>,
}

/// Whether a tokenizer gives the engine's own ids (`crate::tokenizer_check` asks a pod).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Not yet compared: used meanwhile, in its transformers 4 dialect (a wrong one costs cache
    /// affinity, never correctness).
    Unchecked,
    /// A pod's `/tokenize` gave the same ids for the probe prompts as the tokenizer read in this
    /// dialect, which the router now uses.
    Agrees(Dialect),
    /// A pod's `/tokenize` gave other ids: the router's chains could never match the pods'
    /// blocks, so the model is routed in approximate mode and `/tokenize` is forwarded.
    Differs(String),
}

/// The tokenizers this router has, by model name.
#[derive(Default)]
pub struct Tokenizers {
    by_model: RwLock<HashMap<String, Entry>>,
    loader: Option<TokenizerLoader>,
}

impl std::fmt::Debug for Tokenizers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let models: Vec<String> = self
            .by_model
            .read()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        f.debug_struct("Tokenizers")
            .field("models", &models)
            .finish()
    }
}

impl Tokenizers {
    pub fn new(loader: Option<TokenizerLoader>) -> Self {
        Tokenizers {
            by_model: RwLock::default(),
            loader,
        }
    }

    /// The model's tokenizer, unless the engine disagrees with it.
    pub fn get(&self, model: &str) -> Option<Arc<dyn PromptTokenizer>> {
        let map = self.by_model.read().unwrap_or_else(|e| e.into_inner());
        map.get(model)
            .filter(|e| !matches!(e.verdict, Verdict::Differs(_)))
            .map(|e| e.tok.clone())
    }

    /// Whether the router has `digest` for `model` (or any tokenizer when `digest` is `None`),
    /// whatever its verdict: files already judged are not fetched again.
    pub fn has(&self, model: &str, digest: Option<&str>) -> bool {
        let map = self.by_model.read().unwrap_or_else(|e| e.into_inner());
        map.get(model)
            .is_some_and(|e| digest.is_none_or(|want| e.digest == want))
    }

    /// The verdict on the model's tokenizer, if it has one.
    pub fn verdict(&self, model: &str) -> Option<Verdict> {
        let map = self.by_model.read().unwrap_or_else(|e| e.into_inner());
        map.get(model).map(|e| e.verdict.clone())
    }

    /// Every tokenizer, by model.
    pub fn models(&self) -> Vec<TokenizerStatus> {
        let map = self.by_model.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<_> = map
            .iter()
            .map(|(m, e)| TokenizerStatus {
                model: m.clone(),
                digest: e.digest.clone(),
                verdict: e.verdict.clone(),
                agreed_versions: e.agreed_versions.clone(),
                dialect: e.tok.dialect(),
                dialects: e.tok.dialects(),
            })
            .collect();
        out.sort_by(|a, b| a.model.cmp(&b.model));
        out
    }

    /// Every tokenizer that may need a check at `now`: not judged different, and not waiting
    /// out a failed check. Whether a pod is to be asked depends on the pods' engine versions
    /// ([`Due::agreed_versions`]).
    pub fn due(&self, now: Instant) -> Vec<Due> {
        let map = self.by_model.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<Due> = map
            .iter()
            .filter(|(_, e)| {
                !matches!(e.verdict, Verdict::Differs(_)) && e.next_check.is_none_or(|t| t <= now)
            })
            .map(|(m, e)| Due {
                model: m.clone(),
                digest: e.digest.clone(),
                tok: e.tok.clone(),
                agreed_versions: e.agreed_versions.clone(),
            })
            .collect();
        out.sort_by(|a, b| a.model.cmp(&b.model));
        out
    }

    /// Notes a check that got no answer: the next waits `retry_after` doubled per failure in a
    /// row, at most `max_wait` (a pod without `/tokenize` is not asked twice a second forever).
    /// Returns the failures in a row so far (0 when the files were replaced meanwhile).
    pub fn check_failed(
        &self,
        model: &str,
        digest: &str,
        now: Instant,
        retry_after: Duration,
        max_wait: Duration,
    ) -> u32 {
        let mut map = self.by_model.write().unwrap_or_else(|e| e.into_inner());
        let Some(e) = map.get_mut(model).filter(|e| e.digest == digest) else {
            return 0;
        };
        let wait = retry_after
            .saturating_mul(1 << e.failed_checks.min(16))
            .min(max_wait);
        e.failed_checks += 1;
        e.next_check = Some(now + wait);
        e.failed_checks
    }

    /// Records a verdict obtained from a pod of `engine_version`, unless the model's tokenizer
    /// was replaced since it was checked. A difference is final for these files; an agreement
    /// adds the version to those agreed with and, when the engine agreed with another dialect
    /// than the one in use, puts `chosen` (the files read in that dialect) in its place.
    pub fn set_verdict(
        &self,
        model: &str,
        digest: &str,
        engine_version: &str,
        verdict: Verdict,
        chosen: Option<Arc<dyn PromptTokenizer>>,
    ) {
        let mut map = self.by_model.write().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = map.get_mut(model).filter(|e| e.digest == digest) {
            if let Verdict::Agrees(_) = verdict
                && !e.agreed_versions.iter().any(|v| v == engine_version)
            {
                e.agreed_versions.push(engine_version.to_owned());
            }
            if let Some(tok) = chosen {
                e.tok = tok;
            }
            e.failed_checks = 0;
            e.next_check = None;
            e.verdict = verdict;
        }
    }

    /// Whether files can be turned into a tokenizer at all (a loader is built in).
    pub fn can_load(&self) -> bool {
        self.loader.is_some()
    }

    /// Adds or replaces the model's tokenizer. The same files again (two sidecars sending them
    /// at once) keep the verdict they already have.
    pub fn insert(&self, model: &str, digest: String, tok: Arc<dyn PromptTokenizer>) {
        self.put(model, digest, tok, false);
    }

    /// Adds the tokenizer the router's config names for the model: files a sidecar sends never
    /// replace it.
    pub fn insert_configured(&self, model: &str, digest: String, tok: Arc<dyn PromptTokenizer>) {
        self.put(model, digest, tok, true);
    }

    /// Adds a tokenizer a sidecar sent, unless the config names one for the model. Returns
    /// whether it was taken.
    pub fn insert_received(
        &self,
        model: &str,
        digest: String,
        tok: Arc<dyn PromptTokenizer>,
    ) -> bool {
        self.put(model, digest, tok, false)
    }

    /// Whether the model's tokenizer comes from the router's config.
    pub fn is_configured(&self, model: &str) -> bool {
        let map = self.by_model.read().unwrap_or_else(|e| e.into_inner());
        map.get(model).is_some_and(|e| e.configured)
    }

    fn put(
        &self,
        model: &str,
        digest: String,
        tok: Arc<dyn PromptTokenizer>,
        configured: bool,
    ) -> bool {
        let mut map = self.by_model.write().unwrap_or_else(|e| e.into_inner());
        match map.get(model) {
            Some(e) if e.configured && !configured => return false,
            Some(e) if e.digest == digest && e.configured == configured => return true,
            _ => {}
        }
        map.insert(
            model.to_owned(),
            Entry {
                digest,
                tok,
                verdict: Verdict::Unchecked,
                agreed_versions: Vec::new(),
                failed_checks: 0,
                next_check: None,
                configured,
            },
        );
        true
    }

    /// Builds a tokenizer from files with the built-in loader (CPU-heavy: run it in the heavy
    /// pool).
    pub fn build(&self, files: &TokenizerFiles) -> Result<Arc<dyn PromptTokenizer>, TokenizeError> {
        let loader = self
            .loader
            .as_ref()
            .ok_or_else(|| TokenizeError::Tokenizer("no tokenizer loader built in".into()))?;
        loader(files)
    }

    /// Loads files received for `model` (from a sidecar) with the built-in loader, here and now.
    pub fn load_files(&self, model: &str, files: &TokenizerFiles) -> Result<(), TokenizeError> {
        let tok = self.build(files)?;
        if self.insert_received(model, files.digest(), tok) {
            Ok(())
        } else {
            Err(TokenizeError::Tokenizer(format!(
                "the config names the tokenizer of {model}"
            )))
        }
    }
}

/// The real tokenizer: `tokenizers` + the model's chat template, as vLLM applies them.
impl PromptTokenizer for ModelTokenizer {
    fn encode_completion(&self, prompt: &str) -> Result<Vec<u32>, TokenizeError> {
        ModelTokenizer::encode_completion(self, prompt).map_err(tok_err)
    }

    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError> {
        let chat = ChatRequest::from_body(body).map_err(tok_err)?;
        ModelTokenizer::encode_chat(
            self,
            &chat.messages,
            chat.add_generation_prompt,
            &chat.extras,
        )
        .map_err(tok_err)
    }

    fn dialect(&self) -> Dialect {
        ModelTokenizer::dialect(self)
    }

    fn dialects(&self) -> Vec<Dialect> {
        ModelTokenizer::dialects(self).to_vec()
    }

    fn in_dialect(&self, dialect: Dialect) -> Result<Arc<dyn PromptTokenizer>, TokenizeError> {
        let tok = ModelTokenizer::in_dialect(self, dialect).map_err(tok_err)?;
        Ok(Arc::new(tok))
    }
}

fn tok_err(e: TokenizerError) -> TokenizeError {
    match e {
        TokenizerError::InvalidRequest(m) => TokenizeError::Invalid(m),
        other => TokenizeError::Tokenizer(other.to_string()),
    }
}

/// Builds a [`ModelTokenizer`] from transferred files (a separate `chat_template.jinja`
/// overrides the config's template, as in vLLM).
pub fn model_tokenizer(files: &TokenizerFiles) -> Result<Arc<dyn PromptTokenizer>, TokenizeError> {
    let mut tok =
        ModelTokenizer::from_bytes(&files.tokenizer_json, files.tokenizer_config.as_deref())
            .map_err(tok_err)?;
    if let Some(t) = &files.chat_template {
        tok = tok.with_chat_template(String::from_utf8_lossy(t).into_owned());
    }
    Ok(Arc::new(tok))
}

/// The loader the binary uses.
pub fn default_loader() -> TokenizerLoader {
    Arc::new(model_tokenizer)
}

/// What the scheduler gets for a prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub tokens: Vec<u32>,
    /// Whether `tokens` are the model's real tokens (else pseudo-tokens of approximate mode).
    pub exact: bool,
}

/// Tokenizes a prompt for `model`: exactly when a tokenizer is known (token ids are exact
/// anyway), else approximately from the prompt text. A batch is routed on its first element:
/// each element becomes one engine request on the pod it is sent to, and a later element over
/// the window gets vLLM's 400, which a fallback pool still catches.
pub fn prompt_tokens(
    tokenizers: &Tokenizers,
    model: &str,
    input: PromptInput,
) -> Result<Prompt, TokenizeError> {
    let tok = tokenizers.get(model);
    let exact = |tokens: Vec<u32>| Prompt {
        tokens,
        exact: true,
    };
    let approximate = |text: &str| Prompt {
        tokens: approximate_tokens(text),
        exact: false,
    };
    Ok(match input {
        PromptInput::Chat(fields) => match tok {
            Some(t) => exact(t.encode_chat(&fields)?),
            None => approximate(&prompt_text(&fields, true)),
        },
        PromptInput::Text(s) | PromptInput::FirstText(s) => match tok {
            Some(t) => exact(t.encode_completion(&s)?),
            None => approximate(&s),
        },
        PromptInput::Ids(ids) => exact(ids),
        PromptInput::Empty => match tok {
            Some(_) => exact(Vec::new()),
            None => approximate(""),
        },
    })
}

/// The prompt's text as a stable string: the completion prompt, or each chat message's role and
/// content in order (multimodal parts by their text or URL).
pub fn prompt_text(body: &Value, chat: bool) -> String {
    let mut out = String::new();
    if chat {
        for m in body
            .get("messages")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            out.push_str(m.get("role").and_then(Value::as_str).unwrap_or(""));
            out.push('\u{1e}');
            match m.get("content") {
                Some(Value::String(s)) => out.push_str(s),
                Some(other) => out.push_str(&other.to_string()),
                None => {}
            }
            out.push('\u{1f}');
        }
    } else {
        match body.get("prompt") {
            Some(Value::String(s)) => out.push_str(s),
            Some(Value::Array(a)) => {
                if let Some(Value::String(s)) = a.first() {
                    out.push_str(s);
                }
            }
            _ => {}
        }
    }
    out
}

/// One pseudo-token per [`APPROX_CHARS_PER_TOKEN`] characters. Each is a hash of its chunk
/// only; the chain the scheduler computes over them makes the prefix property. Chunks are
/// slices of the text, so a long prompt costs only its tokens.
pub fn approximate_tokens(text: &str) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len() / APPROX_CHARS_PER_TOKEN + 1);
    let mut start = 0;
    let mut chars = 0;
    for (i, _) in text.char_indices() {
        if chars == APPROX_CHARS_PER_TOKEN {
            out.push(xxh3_64(&text.as_bytes()[start..i]) as u32);
            start = i;
            chars = 0;
        }
        chars += 1;
    }
    if chars > 0 {
        out.push(xxh3_64(&text.as_bytes()[start..]) as u32);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn approximate_tokens_share_a_prefix_exactly_as_long_as_the_text() {
        let a = approximate_tokens("You are a helpful assistant. Question one?");
        let b = approximate_tokens("You are a helpful assistant. Question two?");
        let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        // "You are a helpful assistant. Question " is 38 chars = 9 whole chunks.
        assert_eq!(common, 9);
        assert_eq!(a.len(), 42usize.div_ceil(4));
    }

    #[test]
    fn approximate_tokens_hash_the_same_chunks_as_collected_characters() {
        let text = "héllo wörld, ünïcode ☃ and more";
        let chars: Vec<char> = text.chars().collect();
        let want: Vec<u32> = chars
            .chunks(APPROX_CHARS_PER_TOKEN)
            .map(|c| xxh3_64(c.iter().collect::<String>().as_bytes()) as u32)
            .collect();
        assert_eq!(approximate_tokens(text), want);
        assert!(approximate_tokens("").is_empty());
    }

    #[test]
    fn token_id_prompts_are_exact_without_a_tokenizer() {
        let t = Tokenizers::default();
        let p = prompt_tokens(&t, "m", PromptInput::Ids(vec![1, 2, 3])).unwrap();
        assert_eq!(
            p,
            Prompt {
                tokens: vec![1, 2, 3],
                exact: true
            }
        );
        let p = prompt_tokens(&t, "m", PromptInput::Text("hello world".into())).unwrap();
        assert!(!p.exact);
    }

    /// One token per byte: enough to see which text was encoded.
    struct Bytes;

    impl PromptTokenizer for Bytes {
        fn encode_completion(&self, prompt: &str) -> Result<Vec<u32>, TokenizeError> {
            Ok(prompt.bytes().map(u32::from).collect())
        }
        fn encode_chat(&self, _: &Value) -> Result<Vec<u32>, TokenizeError> {
            Ok(Vec::new())
        }
    }

    #[test]
    fn a_batch_of_text_prompts_is_routed_on_its_first_element_exactly() {
        let t = Tokenizers::default();
        t.insert("m", "d".into(), Arc::new(Bytes));
        let p = prompt_tokens(&t, "m", PromptInput::FirstText("abc".into())).unwrap();
        assert_eq!(p.tokens, vec![97, 98, 99]);
        assert!(p.exact);
        let p = prompt_tokens(&t, "m", PromptInput::Ids(vec![7, 8])).unwrap();
        assert_eq!(p.tokens, vec![7, 8]);
    }

    #[test]
    fn chat_text_includes_roles_so_a_different_system_prompt_differs() {
        let a = prompt_text(&json!({"messages":[{"role":"system","content":"x"}]}), true);
        let b = prompt_text(&json!({"messages":[{"role":"user","content":"x"}]}), true);
        assert_ne!(a, b);
    }

    #[test]
    fn a_check_without_answer_waits_longer_each_time_and_new_files_start_afresh() {
        let t = Tokenizers::default();
        t.insert("m", "d1".into(), Arc::new(Bytes));
        let t0 = Instant::now();
        let (base, max) = (Duration::from_millis(500), Duration::from_secs(30));
        let due = |at: Duration| t.due(t0 + at).len();
        assert_eq!(due(Duration::ZERO), 1);
        t.check_failed("m", "d1", t0, base, max);
        assert_eq!(due(Duration::from_millis(499)), 0);
        assert_eq!(due(Duration::from_millis(500)), 1);
        t.check_failed("m", "d1", t0, base, max);
        assert_eq!(
            due(Duration::from_millis(999)),
            0,
            "the second wait doubles"
        );
        for _ in 0..20 {
            t.check_failed("m", "d1", t0, base, max);
        }
        assert_eq!(due(max), 1, "the wait never exceeds the cap");
        // A failure noted for files since replaced does not delay the new ones.
        t.insert("m", "d2".into(), Arc::new(Bytes));
        t.check_failed("m", "d1", t0, base, max);
        assert_eq!(due(Duration::ZERO), 1);
    }
}
