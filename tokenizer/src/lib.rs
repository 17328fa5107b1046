//! kvsight-tokenizer: tokenization exactly as vLLM does it, so the router's block-hash chain is
//! computed over the very token ids the engine caches. Its own crate (beside `kvsight-protocol`,
//! whose hash it feeds) because only the router and the simulator tokenize: the sidecar ships
//! tokenizer files without compiling `tokenizers`. A [`ModelTokenizer`] is built from the bytes of a model's
//! `tokenizer.json` (HF `tokenizers` format) and `tokenizer_config.json` — they arrive over the
//! wire or from the router's config, this crate does no I/O. Completions are encoded with
//! `add_special_tokens=true` (the post-processor's BOS, if any); chat requests are first turned
//! into vLLM's "conversation" (content parts joined or wrapped the way vLLM does, tool-call
//! arguments parsed), rendered with the model's Jinja chat template configured the way
//! transformers configures jinja2 (`trim_blocks`, `lstrip_blocks`, `raise_exception`, a
//! Python-style `tojson`, Python string methods, loop controls, special tokens in the context),
//! and then encoded with `add_special_tokens=false`, because the template already wrote them.
//!
//! The same files give other ids under transformers 5 than under transformers 4 (vLLM moved to
//! 5 in 0.32): a tokenizer is built in one [`Dialect`], and [`ModelTokenizer::dialects`] says
//! which dialects give ids of their own for these files, so a caller can ask an engine which
//! one it follows (the router's tokenizer check does).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use sha2::{Digest as _, Sha256};

mod byte_level;
mod config;
mod conversation;
mod dialect;
mod sentencepiece;
mod split;
mod template;
#[doc(hidden)]
pub mod testing;

use byte_level::ByteLevelFastPath;
use config::{
    SPECIAL_TOKEN_KEYS, bos_eos_processor, config_chat_template, parse_config,
    register_config_tokens, token_content,
};
use conversation::{conversation, cut_after_final_message};
pub use dialect::{Dialect, UnknownDialect};
use sentencepiece::SentencePieceFastPath;
use split::SplitFastPath;
use template::ChatTemplate;

/// Everything that can go wrong building a tokenizer or rendering and encoding a prompt.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenizerError {
    /// `tokenizer.json` could not be parsed by the `tokenizers` crate.
    #[error("tokenizer.json is invalid: {0}")]
    InvalidTokenizer(String),
    /// `tokenizer_config.json` is not a JSON object of the expected shape.
    #[error("tokenizer_config.json is invalid: {0}")]
    InvalidConfig(String),
    /// Chat requires a template and neither the config nor an override provided one.
    #[error("the tokenizer has no chat template")]
    NoChatTemplate,
    /// The chat template does not compile.
    #[error("chat template does not compile: {0}")]
    TemplateSyntax(String),
    /// The chat template failed while rendering (undefined attribute, bad operation, ...).
    #[error("chat template failed to render: {0}")]
    TemplateRender(String),
    /// The chat template called `raise_exception(message)`.
    #[error("chat template raised an exception: {0}")]
    TemplateRaised(String),
    /// A message cannot be turned into vLLM's conversation form.
    #[error("invalid chat message {index}: {reason}")]
    InvalidMessage {
        /// Position of the message in the request.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The request's options contradict each other or the template (vLLM answers 400).
    #[error("invalid chat request: {0}")]
    InvalidRequest(String),
    /// The `tokenizers` crate refused to encode or decode.
    #[error("tokenization failed: {0}")]
    Encode(String),
    /// The dialect is not one these files can be read in (transformers 5 rebuilds only
    /// sentencepiece-style BPE tokenizers as a `LlamaTokenizer`).
    #[error("the {0} dialect does not apply to this tokenizer (not a sentencepiece-style BPE)")]
    DialectDoesNotApply(Dialect),
}

/// How message content is handed to the template, as vLLM's `--chat-template-content-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ContentFormat {
    /// Decide from the template: `openai` when it loops over a message's `content`.
    #[default]
    Auto,
    /// Content is one string; text parts are joined with `"\n"`.
    String,
    /// Content is a list of `{"type": "text", "text": ..}` parts.
    OpenAi,
}

/// Content of a chat message: a string or a list of OpenAI content parts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts such as `{"type": "text", "text": "..."}` (or bare strings).
    Parts(Vec<Json>),
}

/// One OpenAI chat message, with the fields vLLM passes on to the template.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, `developer`, or a custom role.
    pub role: String,
    /// Absent or `null` renders as an empty string (string format) or no parts (openai format).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    /// Participant name (passed to the template when present).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Assistant tool calls; string `function.arguments` are parsed into objects as vLLM does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Json>,
    /// For `tool` messages: the call this result answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Assistant reasoning for interleaved thinking (also exposed as `reasoning_content`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
}

impl ChatMessage {
    /// A message with plain-text content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Some(MessageContent::Text(content.into())),
            name: None,
            tool_calls: None,
            tool_call_id: None,
            reasoning: None,
        }
    }
}

/// Request-level template inputs besides the messages (vLLM's `tools`, `documents` and
/// `chat_template_kwargs`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatExtras {
    /// Tool schemas, rendered as `tools` (None when the request has none, as transformers does).
    pub tools: Option<Vec<Json>>,
    /// RAG documents, rendered as `documents`.
    pub documents: Option<Vec<Json>>,
    /// Extra template variables (`chat_template_kwargs`, e.g. `enable_thinking`); they override
    /// the special tokens but not `messages`, `tools`, `documents` or `add_generation_prompt`.
    pub template_kwargs: serde_json::Map<String, Json>,
    /// vLLM's `continue_final_message`: the last message is left open so generation continues
    /// it — the rendered text is cut right after that message's content, as transformers does.
    pub continue_final_message: bool,
}

/// A chat completion body as the template reads it: the messages, `add_generation_prompt`
/// (vLLM's default: true) and the [`ChatExtras`]. Read here, once, for every reader of bodies
/// (the router, the fuzz target), so they cannot disagree on a default.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    pub add_generation_prompt: bool,
    pub extras: ChatExtras,
}

impl ChatRequest {
    /// Reads a request body; fields of the wrong type count as absent, as vLLM's defaults do,
    /// except `messages`, which must be a list of messages.
    pub fn from_body(body: &Json) -> Result<Self, TokenizerError> {
        let messages = body
            .get("messages")
            .ok_or_else(|| TokenizerError::InvalidRequest("`messages` is required".into()))?;
        let messages = Vec::<ChatMessage>::deserialize(messages)
            .map_err(|e| TokenizerError::InvalidRequest(format!("`messages`: {e}")))?;
        let flag = |k: &str, default: bool| body.get(k).and_then(Json::as_bool).unwrap_or(default);
        let list = |k: &str| body.get(k).and_then(Json::as_array).cloned();
        Ok(ChatRequest {
            messages,
            add_generation_prompt: flag("add_generation_prompt", true),
            extras: ChatExtras {
                tools: list("tools"),
                documents: list("documents"),
                template_kwargs: body
                    .get("chat_template_kwargs")
                    .and_then(Json::as_object)
                    .cloned()
                    .unwrap_or_default(),
                continue_final_message: flag("continue_final_message", false),
            },
        })
    }
}

/// A model's tokenizer and chat template, producing vLLM's token ids.
#[derive(Clone, Debug)]
pub struct ModelTokenizer {
    tokenizer: Arc<tokenizers::Tokenizer>,
    /// Same ids as `tokenizer.encode`, faster, for the tokenizer shapes that have one.
    fast_path: Option<Arc<FastPath>>,
    /// Lazily reported: a template minijinja cannot compile must not stop completions working.
    template: Result<Arc<ChatTemplate>, TokenizerError>,
    template_source: Option<String>,
    special_tokens: BTreeMap<String, String>,
    additional_special_tokens: Vec<String>,
    content_format: ContentFormat,
    inputs: Arc<Inputs>,
    digest: [u8; 32],
    dialect: Dialect,
    /// The dialects that give ids of their own for these files, [`Dialect::Transformers4`] first.
    dialects: Arc<[Dialect]>,
}

/// A faster road to `tokenizers`' ids for one tokenizer shape (each module says why it is exact).
#[derive(Debug)]
enum FastPath {
    /// GPT-2-style byte-level BPE.
    ByteLevel(ByteLevelFastPath),
    /// Sentencepiece-style BPE (Phi-3; Llama 2 and Mistral share the shape, untested).
    SentencePiece(SentencePieceFastPath),
    /// Byte-level BPE with its own `Split` pattern (Llama 3, Qwen2, GPT-4 style).
    Split(SplitFastPath),
}

impl FastPath {
    fn detect(tokenizer: &tokenizers::Tokenizer) -> Option<Self> {
        ByteLevelFastPath::detect(tokenizer)
            .map(Self::ByteLevel)
            .or_else(|| SentencePieceFastPath::detect(tokenizer).map(Self::SentencePiece))
            .or_else(|| SplitFastPath::detect(tokenizer).map(Self::Split))
    }
}

/// The bytes the tokenizer was built from, kept so the digest can be recomputed on override.
#[derive(Debug)]
struct Inputs {
    tokenizer_json: Vec<u8>,
    tokenizer_config_json: Option<Vec<u8>>,
    template_override: Option<String>,
}

impl ModelTokenizer {
    /// Builds a tokenizer from the bytes of `tokenizer.json` and, optionally,
    /// `tokenizer_config.json` (special tokens and `chat_template`), in the
    /// [`Transformers4`](Dialect::Transformers4) dialect ([`in_dialect`](Self::in_dialect) for
    /// another).
    ///
    /// Truncation and padding stored in `tokenizer.json` are switched off: transformers turns
    /// them off for every call that does not ask for them, and vLLM never does.
    pub fn from_bytes(
        tokenizer_json: &[u8],
        tokenizer_config_json: Option<&[u8]>,
    ) -> Result<Self, TokenizerError> {
        let inputs = Inputs {
            tokenizer_json: tokenizer_json.to_vec(),
            tokenizer_config_json: tokenizer_config_json.map(<[u8]>::to_vec),
            template_override: None,
        };
        Self::build(Arc::new(inputs), Dialect::default(), ContentFormat::Auto)
    }

    /// The same files (and template override, and content format) read in `dialect`. Fails with
    /// [`TokenizerError::DialectDoesNotApply`] for [`Dialect::Transformers5Rebuilt`] when the
    /// tokenizer is not sentencepiece-style.
    pub fn in_dialect(&self, dialect: Dialect) -> Result<Self, TokenizerError> {
        Self::build(self.inputs.clone(), dialect, self.content_format)
    }

    /// The dialect these ids are in.
    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// The dialects that give ids of their own for these files, in [`Dialect::ALL`]'s order: a
    /// dialect left out gives the same ids as one listed before it for every text (a byte-level
    /// BPE tokenizer has no rebuilt dialect; transformers 5 reads it as transformers 4 does
    /// unless the config's BOS/EOS flags change transformers 4's post-processor).
    pub fn dialects(&self) -> &[Dialect] {
        &self.dialects
    }

    fn build(
        inputs: Arc<Inputs>,
        dialect: Dialect,
        content_format: ContentFormat,
    ) -> Result<Self, TokenizerError> {
        let mut tokenizer = tokenizers::Tokenizer::from_bytes(&inputs.tokenizer_json)
            .map_err(|e| TokenizerError::InvalidTokenizer(e.to_string()))?;
        tokenizer
            .with_truncation(None)
            .map_err(|e| TokenizerError::InvalidTokenizer(e.to_string()))?;
        tokenizer.with_padding(None);

        let config = match &inputs.tokenizer_config_json {
            Some(bytes) => parse_config(bytes)?,
            None => serde_json::Map::new(),
        };
        let mut special_tokens = BTreeMap::new();
        for key in SPECIAL_TOKEN_KEYS {
            if let Some(token) = config.get(key).and_then(token_content) {
                special_tokens.insert(key.to_owned(), token);
            }
        }
        let additional_special_tokens = match config.get("additional_special_tokens") {
            Some(Json::Array(items)) => items.iter().filter_map(token_content).collect(),
            _ => Vec::new(),
        };
        register_config_tokens(
            &mut tokenizer,
            &config,
            &special_tokens,
            &additional_special_tokens,
        )?;
        let flags_processor = bos_eos_processor(&tokenizer, &config, &special_tokens)?;
        let scheme = dialect::rebuilt_prepend_scheme(&config);
        let dialects = dialect::distinct(&tokenizer, flags_processor.as_ref(), scheme);
        match dialect {
            Dialect::Transformers4 => {
                if let Some(processor) = flags_processor {
                    tokenizer.with_post_processor(Some(processor));
                }
            }
            Dialect::Transformers5 => {}
            Dialect::Transformers5Rebuilt => dialect::rebuild_llama(&mut tokenizer, scheme)?,
        }
        let template_source = match &inputs.template_override {
            Some(source) => Some(source.clone()),
            None => config_chat_template(&config)?,
        };
        let digest = inputs.digest();
        let mut this = Self {
            fast_path: FastPath::detect(&tokenizer).map(Arc::new),
            tokenizer: Arc::new(tokenizer),
            template: Err(TokenizerError::NoChatTemplate),
            template_source: None,
            special_tokens,
            additional_special_tokens,
            content_format,
            inputs,
            digest,
            dialect,
            dialects: dialects.into(),
        };
        if let Some(source) = template_source {
            this.template = ChatTemplate::new(source.clone()).map(Arc::new);
            this.template_source = Some(source);
        }
        Ok(this)
    }

    /// Replaces the chat template (a `chat_template.jinja` file, or vLLM's `--chat-template`).
    /// The override is part of the [`digest`](Self::digest).
    pub fn with_chat_template(mut self, source: impl Into<String>) -> Self {
        let source = source.into();
        let inputs = Inputs {
            tokenizer_json: self.inputs.tokenizer_json.clone(),
            tokenizer_config_json: self.inputs.tokenizer_config_json.clone(),
            template_override: Some(source.clone()),
        };
        self.digest = inputs.digest();
        self.inputs = Arc::new(inputs);
        self.template = ChatTemplate::new(source.clone()).map(Arc::new);
        self.template_source = Some(source);
        self
    }

    /// Forces how message content is passed to the template (vLLM's
    /// `--chat-template-content-format`); the default detects it from the template.
    pub fn with_content_format(mut self, format: ContentFormat) -> Self {
        self.content_format = format;
        self
    }

    /// sha256 over the inputs (tokenizer.json, tokenizer_config.json, template override):
    /// equal digests and equal [`dialect`](Self::dialect)s mean equal token ids for every
    /// prompt.
    pub fn digest(&self) -> [u8; 32] {
        self.digest
    }

    /// The [`digest`](Self::digest) as lowercase hex.
    pub fn digest_hex(&self) -> String {
        let mut out = String::with_capacity(64);
        for byte in self.digest {
            // Writing to a String cannot fail.
            let _ = write!(out, "{byte:02x}");
        }
        out
    }

    /// The chat template source in use, if there is one (even if it does not compile).
    pub fn chat_template_source(&self) -> Option<&str> {
        self.template_source.as_deref()
    }

    /// A special token from the config (`bos_token`, `eos_token`, ...), as its text.
    pub fn special_token(&self, key: &str) -> Option<&str> {
        self.special_tokens.get(key).map(String::as_str)
    }

    /// The id of a token of the vocabulary (including added tokens).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Encodes a completion prompt as vLLM does: `add_special_tokens=true`.
    pub fn encode_completion(&self, prompt: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode(prompt, true)
    }

    /// Encodes text with or without the post-processor's special tokens.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        match self.fast_path.as_deref() {
            Some(FastPath::ByteLevel(fast)) => {
                self.encode_or_fall_back(None, text, add_special_tokens, |split, emit| {
                    fast.words(split, emit)
                })
            }
            Some(FastPath::SentencePiece(fast)) => encode_by_words(
                &self.tokenizer,
                None,
                text,
                add_special_tokens,
                |split, at_start, emit| fast.words(split, at_start, emit),
            ),
            Some(FastPath::Split(fast)) => self.encode_or_fall_back(
                self.tokenizer.get_normalizer(),
                text,
                add_special_tokens,
                |split, emit| fast.words(split, emit),
            ),
            None => self.encode_reference(text, add_special_tokens),
        }
    }

    /// [`encode_by_words`] with a fast path that may hand a text over: then the whole text goes
    /// to the full pipeline.
    fn encode_or_fall_back(
        &self,
        normalizer: Option<&tokenizers::NormalizerWrapper>,
        text: &str,
        add_special_tokens: bool,
        mut words: impl FnMut(&str, &mut WordSink<'_>) -> Result<Words, TokenizerError>,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut full_pipeline = false;
        let ids = encode_by_words(
            &self.tokenizer,
            normalizer,
            text,
            add_special_tokens,
            |split, _, emit| {
                if !full_pipeline {
                    full_pipeline = words(split, emit)? == Words::HandedOver;
                }
                Ok(())
            },
        )?;
        if full_pipeline {
            self.encode_reference(text, add_special_tokens)
        } else {
            Ok(ids)
        }
    }

    /// Which faster road [`encode`](Self::encode) takes to the same ids (`"byte_level"`,
    /// `"sentencepiece"`, `"byte_level_split"`), or `None` when it runs `tokenizers`' full
    /// pipeline.
    pub fn fast_path(&self) -> Option<&'static str> {
        self.fast_path.as_deref().map(|fast| match fast {
            FastPath::ByteLevel(_) => "byte_level",
            FastPath::SentencePiece(_) => "sentencepiece",
            FastPath::Split(_) => "byte_level_split",
        })
    }

    /// `tokenizers`' own full pipeline, never a fast path: what [`encode`](Self::encode) must
    /// equal (public so tests outside the crate can compare them).
    pub fn encode_reference(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Decodes ids back to text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// Renders a chat request to the prompt text vLLM would feed the tokenizer.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extras: &ChatExtras,
    ) -> Result<String, TokenizerError> {
        if add_generation_prompt && extras.continue_final_message {
            return Err(TokenizerError::InvalidRequest(
                "cannot set both `continue_final_message` and `add_generation_prompt`".to_owned(),
            ));
        }
        let template = self.template.as_ref().map_err(Clone::clone)?;
        let format = match self.content_format {
            ContentFormat::Auto => template.content_format,
            forced => forced,
        };
        let conversation = conversation(messages, format)?;

        let mut ctx = serde_json::Map::new();
        for (key, token) in &self.special_tokens {
            ctx.insert(key.clone(), Json::String(token.clone()));
        }
        if !self.additional_special_tokens.is_empty() {
            ctx.insert(
                "additional_special_tokens".to_owned(),
                Json::from(self.additional_special_tokens.clone()),
            );
        }
        for (key, value) in &extras.template_kwargs {
            ctx.insert(key.clone(), value.clone());
        }
        ctx.insert("messages".to_owned(), Json::Array(conversation.clone()));
        ctx.insert(
            "tools".to_owned(),
            extras.tools.clone().map_or(Json::Null, Json::Array),
        );
        ctx.insert(
            "documents".to_owned(),
            extras.documents.clone().map_or(Json::Null, Json::Array),
        );
        ctx.insert(
            "add_generation_prompt".to_owned(),
            Json::Bool(add_generation_prompt),
        );

        let rendered = template.render(Json::Object(ctx))?;
        if extras.continue_final_message {
            cut_after_final_message(rendered, messages.len(), &conversation)
        } else {
            Ok(rendered)
        }
    }

    /// Renders a chat request and encodes it with `add_special_tokens=false`, as vLLM does:
    /// the template already wrote BOS and the role tokens.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extras: &ChatExtras,
    ) -> Result<Vec<u32>, TokenizerError> {
        let prompt = self.render_chat(messages, add_generation_prompt, extras)?;
        self.encode(&prompt, false)
    }
}

/// Why a fast path hands a text to the full pipeline instead: its ids would not be exact there.
#[derive(Debug, PartialEq, Eq)]
struct FullPipeline;

/// How a fast path that may hand a text over dealt with it.
#[must_use]
#[derive(Debug, PartialEq, Eq)]
enum Words {
    /// Every word went to the sink.
    Emitted,
    /// The text needs the full pipeline ([`FullPipeline`]); the words emitted so far are void.
    HandedOver,
}

/// Whitespace runs of this many bytes or more go to the full pipeline. The lookahead
/// alternative `\s+(?!\S)` of the byte-level patterns runs in fancy-regex's backtracking VM,
/// which pushes one entry per character of `\s+` and gives up at 1,000,000 entries: past that,
/// `tokenizers` stops splitting the text (measured: 1,200,000 spaces between two letters give
/// 2 words there, 3 on a fast path; 600,000 give 3 on both). A run this long has at most this
/// many characters, so every shorter run is safe with a wide margin.
const LONG_WHITESPACE_RUN: usize = 100_000;

/// Where a fast path's words go: each is merged by the BPE model.
type WordSink<'a> = dyn FnMut(&str) -> Result<(), TokenizerError> + 'a;

/// What the fast paths share; only how a text becomes words differs. Added tokens are split
/// off by the crate's own `AddedVocabulary`, which also runs `normalizer` on the text between
/// them exactly as the full pipeline does (a fast path that normalizes by hand passes `None`);
/// `words` cuts each text between them into words the
/// BPE model can merge on their own, in the model's alphabet, and passes each to its sink (it is
/// told whether the text starts at byte 0 of the input, which transformers 5's `Metaspace`
/// looks at); the model merges each word (through its cache); the post-processor adds the
/// special tokens by id (token strings and offsets, which only `Encoding`'s other fields carry,
/// are left empty).
fn encode_by_words(
    tokenizer: &tokenizers::Tokenizer,
    normalizer: Option<&tokenizers::NormalizerWrapper>,
    text: &str,
    add_special_tokens: bool,
    mut words: impl FnMut(&str, bool, &mut WordSink<'_>) -> Result<(), TokenizerError>,
) -> Result<Vec<u32>, TokenizerError> {
    let encode_err = |e: tokenizers::Error| TokenizerError::Encode(e.to_string());
    let splits = tokenizer
        .get_added_vocabulary()
        .extract_and_normalize(normalizer, text);
    let model = tokenizer.get_model();
    let mut ids: Vec<u32> = Vec::with_capacity(text.len() / 3);
    // Offsets in the original text, as the crate's own pre-tokenizers see them.
    for (split, (start, _), added) in splits.get_splits(
        tokenizers::OffsetReferential::Original,
        tokenizers::OffsetType::Byte,
    ) {
        match added {
            Some(added) => ids.extend(added.iter().map(|t| t.id)),
            None => words(split, start == 0, &mut |word| {
                let merged = tokenizers::Model::tokenize(model, word).map_err(encode_err)?;
                ids.extend(merged.iter().map(|t| t.id));
                Ok(())
            })?,
        }
    }
    let tokens = ids
        .into_iter()
        .map(|id| tokenizers::Token::new(id, String::new(), (0, 0)))
        .collect();
    let encoding = tokenizer
        .post_process(
            tokenizers::Encoding::from_tokens(tokens, 0),
            None,
            add_special_tokens,
        )
        .map_err(encode_err)?;
    Ok(encoding.get_ids().to_vec())
}

impl Inputs {
    fn digest(&self) -> [u8; 32] {
        tokenizer_digest(
            &self.tokenizer_json,
            self.tokenizer_config_json.as_deref(),
            self.template_override.as_deref(),
        )
    }
}

/// The digest [`ModelTokenizer::digest`] reports, computable from the files alone (a sidecar can
/// announce it without building the tokenizer).
///
/// Layout hashed with sha256: the 21 bytes `kvsight-tokenizer-v1\0`, then for each of
/// tokenizer.json, tokenizer_config.json and the template override either `0x00` (absent) or
/// `0x01`, the length as u64 little-endian and the bytes. Length prefixes and presence flags make
/// the encoding injective: different inputs never hash the same stream.
pub fn tokenizer_digest(
    tokenizer_json: &[u8],
    tokenizer_config_json: Option<&[u8]>,
    chat_template_override: Option<&str>,
) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(b"kvsight-tokenizer-v1\0");
    let mut field = |bytes: Option<&[u8]>| match bytes {
        Some(bytes) => {
            hasher.update([1u8]);
            hasher.update((bytes.len() as u64).to_le_bytes());
            hasher.update(bytes);
        }
        None => hasher.update([0u8]),
    };
    field(Some(tokenizer_json));
    field(tokenizer_config_json);
    field(chat_template_override.map(str::as_bytes));
    hasher.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_tokenizer_can_be_shared_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ModelTokenizer>();
    }

    #[test]
    fn digest_layout_is_injective_on_field_boundaries() {
        // Moving bytes between fields must change the digest.
        assert_ne!(
            tokenizer_digest(b"ab", Some(b"c"), None),
            tokenizer_digest(b"a", Some(b"bc"), None)
        );
        assert_ne!(
            tokenizer_digest(b"a", None, None),
            tokenizer_digest(b"a", Some(b""), None)
        );
        assert_ne!(
            tokenizer_digest(b"a", None, Some("")),
            tokenizer_digest(b"a", None, None)
        );
    }
}
