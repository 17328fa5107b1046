//! Tokenization exactly as vLLM does it, so the router's block-hash chain is computed over the
//! very token ids the engine caches. A [`ModelTokenizer`] is built from the bytes of a model's
//! `tokenizer.json` (HF `tokenizers` format) and `tokenizer_config.json` — they arrive over the
//! wire or from the router's config, this crate does no I/O. Completions are encoded with
//! `add_special_tokens=true` (the post-processor's BOS, if any); chat requests are first turned
//! into vLLM's "conversation" (content parts joined or wrapped the way vLLM does, tool-call
//! arguments parsed), rendered with the model's Jinja chat template configured the way
//! transformers configures jinja2 (`trim_blocks`, `lstrip_blocks`, `raise_exception`, a
//! Python-style `tojson`, Python string methods, loop controls, special tokens in the context),
//! and then encoded with `add_special_tokens=false`, because the template already wrote them.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

use minijinja::value::{Kwargs, Serde, Value, ValueKind};
use minijinja::{Environment, ErrorKind, State};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use sha2::{Digest as _, Sha256};

/// Name under which the chat template is registered in its own minijinja environment.
const TEMPLATE_NAME: &str = "chat_template";

/// Marker put in front of `raise_exception` messages so a template's deliberate refusal (e.g.
/// "Conversation roles must alternate") is reported as [`TokenizerError::TemplateRaised`] rather
/// than as a rendering bug.
const RAISE_MARKER: &str = "\u{1}kvsight-raise\u{1}";

/// Special-token attributes transformers puts in a template's context (`special_tokens_map`).
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

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
    /// The `tokenizers` crate refused to encode or decode.
    #[error("tokenization failed: {0}")]
    Encode(String),
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
}

/// A compiled chat template (its own minijinja environment, configured like transformers).
#[derive(Debug)]
struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    content_format: ContentFormat,
}

/// A model's tokenizer and chat template, producing vLLM's token ids.
#[derive(Clone, Debug)]
pub struct ModelTokenizer {
    tokenizer: Arc<tokenizers::Tokenizer>,
    /// Lazily reported: a template minijinja cannot compile must not stop completions working.
    template: Result<Arc<ChatTemplate>, TokenizerError>,
    special_tokens: BTreeMap<String, String>,
    additional_special_tokens: Vec<String>,
    content_format: ContentFormat,
    inputs: Arc<Inputs>,
    digest: [u8; 32],
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
    /// `tokenizer_config.json` (special tokens and `chat_template`).
    ///
    /// Truncation and padding stored in `tokenizer.json` are switched off: transformers turns
    /// them off for every call that does not ask for them, and vLLM never does.
    pub fn from_bytes(
        tokenizer_json: &[u8],
        tokenizer_config_json: Option<&[u8]>,
    ) -> Result<Self, TokenizerError> {
        let mut tokenizer = tokenizers::Tokenizer::from_bytes(tokenizer_json)
            .map_err(|e| TokenizerError::InvalidTokenizer(e.to_string()))?;
        tokenizer
            .with_truncation(None)
            .map_err(|e| TokenizerError::InvalidTokenizer(e.to_string()))?;
        tokenizer.with_padding(None);

        let config = match tokenizer_config_json {
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
        apply_bos_eos_flags(&mut tokenizer, &config, &special_tokens)?;
        let template_source = config_chat_template(&config)?;
        let inputs = Inputs {
            tokenizer_json: tokenizer_json.to_vec(),
            tokenizer_config_json: tokenizer_config_json.map(<[u8]>::to_vec),
            template_override: None,
        };
        let digest = inputs.digest();
        let mut this = Self {
            tokenizer: Arc::new(tokenizer),
            template: Err(TokenizerError::NoChatTemplate),
            special_tokens,
            additional_special_tokens,
            content_format: ContentFormat::Auto,
            inputs: Arc::new(inputs),
            digest,
        };
        if let Some(source) = template_source {
            this.template = this.compile(source);
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
        self.template = self.compile(source);
        self
    }

    /// Forces how message content is passed to the template (vLLM's
    /// `--chat-template-content-format`); the default detects it from the template.
    pub fn with_content_format(mut self, format: ContentFormat) -> Self {
        self.content_format = format;
        self
    }

    /// sha256 over the inputs (tokenizer.json, tokenizer_config.json, template override):
    /// equal digests mean equal token ids for every prompt.
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
        match &self.template {
            Ok(template) => Some(template.source.as_str()),
            Err(_) => self.inputs.template_override.as_deref(),
        }
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
        ctx.insert("messages".to_owned(), Json::Array(conversation));
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

        let compiled = template
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TokenizerError::TemplateSyntax(describe(&e)))?;
        compiled
            .render(Value::from(Serde(Json::Object(ctx))))
            .map_err(|e| render_error(&e))
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

    fn compile(&self, source: String) -> Result<Arc<ChatTemplate>, TokenizerError> {
        ChatTemplate::new(source).map(Arc::new)
    }
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

impl ChatTemplate {
    fn new(source: String) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TokenizerError::TemplateSyntax(describe(&e)))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| TokenizerError::TemplateSyntax(describe(&e)))?;
        let content_format = detect_content_format(&source);
        Ok(Self {
            env,
            source,
            content_format,
        })
    }
}

fn parse_config(bytes: &[u8]) -> Result<serde_json::Map<String, Json>, TokenizerError> {
    match serde_json::from_slice::<Json>(bytes) {
        Ok(Json::Object(map)) => Ok(map),
        Ok(_) => Err(TokenizerError::InvalidConfig(
            "expected a JSON object".to_owned(),
        )),
        Err(e) => Err(TokenizerError::InvalidConfig(e.to_string())),
    }
}

/// transformers adds the config's `added_tokens_decoder` entries and its special tokens to the
/// tokenizer when tokenizer.json lacks them, which makes them atomic in text (and appends a new
/// id for a token the vocabulary does not have). Doing the same keeps such configs' ids equal.
fn register_config_tokens(
    tokenizer: &mut tokenizers::Tokenizer,
    config: &serde_json::Map<String, Json>,
    special_tokens: &BTreeMap<String, String>,
    additional_special_tokens: &[String],
) -> Result<(), TokenizerError> {
    let mut known: std::collections::HashSet<String> = tokenizer
        .get_added_tokens_decoder()
        .into_values()
        .map(|t| t.content)
        .collect();
    let mut to_add = Vec::new();
    if let Some(Json::Object(decoder)) = config.get("added_tokens_decoder") {
        let mut entries: Vec<(u64, &serde_json::Map<String, Json>)> = decoder
            .iter()
            .filter_map(|(id, entry)| Some((id.parse().ok()?, entry.as_object()?)))
            .collect();
        entries.sort_by_key(|(id, _)| *id);
        for (_, entry) in entries {
            let Some(content) = entry.get("content").and_then(Json::as_str) else {
                continue;
            };
            if !known.insert(content.to_owned()) {
                continue;
            }
            let flag = |key: &str| entry.get(key).and_then(Json::as_bool);
            let special = flag("special").unwrap_or(false);
            to_add.push(
                tokenizers::AddedToken::from(content, special)
                    .single_word(flag("single_word").unwrap_or(false))
                    .lstrip(flag("lstrip").unwrap_or(false))
                    .rstrip(flag("rstrip").unwrap_or(false))
                    .normalized(flag("normalized").unwrap_or(!special)),
            );
        }
    }
    for content in special_tokens.values().chain(additional_special_tokens) {
        if known.insert(content.clone()) {
            to_add.push(tokenizers::AddedToken::from(content.as_str(), true));
        }
    }
    if !to_add.is_empty() {
        tokenizer
            .add_tokens(to_add)
            .map_err(|e| TokenizerError::InvalidConfig(format!("adding config tokens: {e}")))?;
    }
    Ok(())
}

/// transformers (v5 for every tokenizer, v4 for the Llama/Gemma family) rebuilds the
/// post-processor from `add_bos_token` / `add_eos_token` when the config sets either, so those
/// flags — not tokenizer.json's post-processor — decide whether a completion gets BOS/EOS.
/// A missing flag counts as false, as in transformers v5; without either flag tokenizer.json's
/// post-processor is kept.
fn apply_bos_eos_flags(
    tokenizer: &mut tokenizers::Tokenizer,
    config: &serde_json::Map<String, Json>,
    special_tokens: &BTreeMap<String, String>,
) -> Result<(), TokenizerError> {
    let flag = |key: &str| config.get(key).and_then(Json::as_bool);
    let (add_bos, add_eos) = (flag("add_bos_token"), flag("add_eos_token"));
    if add_bos.is_none() && add_eos.is_none() {
        return Ok(());
    }
    // A flag without its token is dropped, as transformers v5 does.
    let token =
        |wanted: Option<bool>, key: &str| -> Result<Option<(String, u32)>, TokenizerError> {
            let Some(content) = special_tokens.get(key).filter(|_| wanted == Some(true)) else {
                return Ok(None);
            };
            match tokenizer.token_to_id(content) {
                Some(id) => Ok(Some((content.clone(), id))),
                None => Err(TokenizerError::InvalidConfig(format!(
                    "{key} {content:?} is not in the vocabulary"
                ))),
            }
        };
    let bos = token(add_bos, "bos_token")?;
    let eos = token(add_eos, "eos_token")?;
    let piece = |t: &Option<(String, u32)>, type_id: u8| {
        t.as_ref()
            .map(|(content, _)| format!("{content}:{type_id}"))
    };
    let join =
        |parts: Vec<Option<String>>| parts.into_iter().flatten().collect::<Vec<_>>().join(" ");
    let single = join(vec![
        piece(&bos, 0),
        Some("$A:0".to_owned()),
        piece(&eos, 0),
    ]);
    let pair = join(vec![
        Some(single.clone()),
        piece(&bos, 1),
        Some("$B:1".to_owned()),
        piece(&eos, 1),
    ]);
    let invalid = |e: String| TokenizerError::InvalidConfig(format!("bos/eos post-processor: {e}"));
    let processor = tokenizers::processors::template::TemplateProcessing::builder()
        .try_single(single)
        .map_err(invalid)?
        .try_pair(pair)
        .map_err(invalid)?
        .special_tokens(bos.into_iter().chain(eos).collect::<Vec<_>>())
        .build()
        .map_err(|e| invalid(e.to_string()))?;
    tokenizer.with_post_processor(Some(processor));
    Ok(())
}

/// A special token in tokenizer_config.json is a string or an `AddedToken` object.
fn token_content(value: &Json) -> Option<String> {
    match value {
        Json::String(s) => Some(s.clone()),
        Json::Object(map) => map.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` is a string, or a list of named templates of which transformers uses
/// `default` unless told otherwise.
fn config_chat_template(
    config: &serde_json::Map<String, Json>,
) -> Result<Option<String>, TokenizerError> {
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(named)) => {
            for entry in named {
                if entry.get("name").and_then(Json::as_str) == Some("default") {
                    return match entry.get("template").and_then(Json::as_str) {
                        Some(s) => Ok(Some(s.to_owned())),
                        None => Err(TokenizerError::InvalidConfig(
                            "named chat template `default` has no `template` string".to_owned(),
                        )),
                    };
                }
            }
            Ok(None)
        }
        Some(_) => Err(TokenizerError::InvalidConfig(
            "`chat_template` must be a string or a list of named templates".to_owned(),
        )),
    }
}

/// vLLM's "auto" content format: `openai` when the template iterates over a message's
/// `content` (`{% for part in message['content'] %}`), `string` otherwise. vLLM inspects the
/// Jinja AST; scanning the source for that loop shape covers the templates seen in practice.
fn detect_content_format(source: &str) -> ContentFormat {
    let mut rest = source;
    while let Some(pos) = rest.find(" in ") {
        let before = &rest[..pos];
        let after = rest[pos + 4..].trim_start();
        rest = &rest[pos + 4..];
        let in_for = before
            .rfind("{%")
            .is_some_and(|open| before[open..].contains("for ") && !before[open..].contains("%}"));
        if !in_for {
            continue;
        }
        let ident_len = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(after.len());
        if ident_len == 0 {
            continue;
        }
        let tail = &after[ident_len..];
        let accesses_content = tail.starts_with("['content']")
            || tail.starts_with("[\"content\"]")
            || (tail.starts_with(".content")
                && !tail[".content".len()..]
                    .starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_'));
        if accesses_content {
            return ContentFormat::OpenAi;
        }
    }
    ContentFormat::String
}

/// Turns request messages into vLLM's conversation (`ConversationMessage` dicts).
fn conversation(
    messages: &[ChatMessage],
    format: ContentFormat,
) -> Result<Vec<Json>, TokenizerError> {
    let wrap = format == ContentFormat::OpenAi;
    let mut out = Vec::with_capacity(messages.len());
    for (index, message) in messages.iter().enumerate() {
        let invalid = |reason: String| TokenizerError::InvalidMessage { index, reason };
        let texts: Vec<String> = match &message.content {
            None => Vec::new(),
            Some(MessageContent::Text(text)) => vec![text.clone()],
            Some(MessageContent::Parts(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for part in parts {
                    if let Some(text) = part_text(part).map_err(invalid)? {
                        texts.push(text);
                    }
                }
                texts
            }
        };
        let content = if wrap && message.role != "tool" {
            Json::Array(
                texts
                    .into_iter()
                    .map(|text| serde_json::json!({"type": "text", "text": text}))
                    .collect(),
            )
        } else {
            // String format joins text parts with "\n"; vLLM also flattens all-text `tool`
            // content to a string in openai format, because most templates expect one.
            Json::String(texts.join("\n"))
        };

        let mut msg = serde_json::Map::new();
        msg.insert("role".to_owned(), Json::String(message.role.clone()));
        msg.insert("content".to_owned(), content);
        if message.role == "assistant" {
            if let Some(calls) = &message.tool_calls
                && !calls.is_null()
            {
                let calls = normalize_tool_calls(calls.clone());
                if !matches!(&calls, Json::Array(items) if items.is_empty()) {
                    msg.insert("tool_calls".to_owned(), calls);
                }
            }
            if let Some(reasoning) = &message.reasoning {
                msg.insert("reasoning".to_owned(), Json::String(reasoning.clone()));
                msg.insert(
                    "reasoning_content".to_owned(),
                    Json::String(reasoning.clone()),
                );
            }
        } else if message.role == "tool"
            && let Some(id) = &message.tool_call_id
        {
            msg.insert("tool_call_id".to_owned(), Json::String(id.clone()));
        }
        if let Some(name) = &message.name {
            msg.insert("name".to_owned(), Json::String(name.clone()));
        }
        out.push(Json::Object(msg));
    }
    Ok(out)
}

/// The text of one content part, `None` for a text part whose text is null (vLLM skips those).
fn part_text(part: &Json) -> Result<Option<String>, String> {
    let obj = match part {
        Json::String(s) => return Ok(Some(s.clone())),
        Json::Object(obj) => obj,
        _ => return Err("content part is neither a string nor an object".to_owned()),
    };
    let kind = obj
        .get("type")
        .and_then(Json::as_str)
        .ok_or_else(|| "content part has no string `type`".to_owned())?;
    let key = match kind {
        "text" | "input_text" | "output_text" => "text",
        "refusal" => "refusal",
        "thinking" => "thinking",
        other => {
            // Media parts need the model's multimodal processor; the router has none and
            // cannot reproduce vLLM's placeholders, so it says so instead of guessing.
            return Err(format!("content part type `{other}` is not supported"));
        }
    };
    match obj.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("content part `{key}` is not a string")),
    }
}

/// vLLM parses string `function.arguments` into objects (invalid JSON becomes `{}`), because
/// tool-use templates expect dicts.
fn normalize_tool_calls(mut calls: Json) -> Json {
    if let Json::Array(items) = &mut calls {
        for item in items {
            if let Some(function) = item.get_mut("function").and_then(Json::as_object_mut) {
                let parsed = match function.get("arguments") {
                    Some(Json::String(s)) => serde_json::from_str::<Json>(s)
                        .unwrap_or_else(|_| Json::Object(serde_json::Map::new())),
                    Some(v @ (Json::Object(_) | Json::Array(_))) => v.clone(),
                    _ => Json::Object(serde_json::Map::new()),
                };
                function.insert("arguments".to_owned(), parsed);
            }
        }
    }
    calls
}

/// jinja2 prints Python values: `True`, `False`, `None`, and lists and dicts as Python's
/// `repr` (`['a', 'b']`, `{'k': 1}`); strings and numbers as minijinja does.
fn python_formatter(
    out: &mut minijinja::Output<'_>,
    state: &mut State<'_, '_>,
    value: &Value,
) -> Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::Bool | ValueKind::None | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            python_repr(&mut text, value, 0)?;
            out.write_str(&text)
                .map_err(|e| minijinja::Error::new(ErrorKind::WriteFailure, e.to_string()))
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Nesting deeper than this is printed as `...` (Python prints recursive containers that way).
const MAX_REPR_DEPTH: usize = 64;

fn python_repr(out: &mut String, value: &Value, depth: usize) -> Result<(), minijinja::Error> {
    if depth > MAX_REPR_DEPTH {
        out.push_str("...");
        return Ok(());
    }
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::String => python_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &item, depth + 1)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &key, depth + 1)?;
                out.push_str(": ");
                python_repr(out, &value.get_item(&key)?, depth + 1)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`.
fn python_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISE_MARKER}{message}"),
    ))
}

/// transformers' `strftime_now(format)`: the current UTC time, for templates that print today's
/// date. Supports the common `%` directives.
fn strftime_now(format: String) -> Result<Value, minijinja::Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(Value::from(strftime(&format, secs)))
}

fn strftime(format: &str, unix_secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = unix_secs / 86_400;
    let secs_of_day = unix_secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    let weekday = DAYS[(days % 7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year % 100),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('-') if chars.clone().next() == Some('d') => {
                chars.next();
                write!(out, "{day}")
            }
            Some('B') => write!(out, "{month_name}"),
            Some('b') => write!(out, "{}", &month_name[..3]),
            Some('A') => write!(out, "{weekday}"),
            Some('a') => write!(out, "{}", &weekday[..3]),
            Some('H') => write!(out, "{:02}", secs_of_day / 3600),
            Some('M') => write!(out, "{:02}", secs_of_day / 60 % 60),
            Some('S') => write!(out, "{:02}", secs_of_day % 60),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    // Howard Hinnant's algorithm, shifted so the era starts on 0000-03-01.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// transformers' `tojson`: Python `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)` — not minijinja's HTML-safe compact form, whose
/// bytes (and so token ids) differ.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            None => Some(v.as_str().unwrap_or_default().to_owned()),
        },
    };
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson separators must be a pair",
            ));
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let json = serde_json::to_value(value)
        .map_err(|e| minijinja::Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    let opts = PyJson {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    opts.write(&mut out, &json, 0);
    Ok(Value::from(out))
}

/// Python `json.dumps` formatting options.
struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn write(&self, out: &mut String, value: &Json, depth: usize) {
        match value {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => self.write_number(out, n),
            Json::String(s) => self.write_str(out, s),
            Json::Array(items) => {
                if items.is_empty() {
                    out.push_str("[]");
                    return;
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, depth + 1);
                    self.write(out, item, depth + 1);
                }
                self.newline(out, depth);
                out.push(']');
            }
            Json::Object(map) => {
                if map.is_empty() {
                    out.push_str("{}");
                    return;
                }
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (key, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, depth + 1);
                    self.write_str(out, key);
                    out.push_str(&self.key_sep);
                    self.write(out, item, depth + 1);
                }
                self.newline(out, depth);
                out.push('}');
            }
        }
    }

    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    fn write_number(&self, out: &mut String, n: &serde_json::Number) {
        if let Some(f) = n.as_f64().filter(|_| n.is_f64()) {
            // Python's float repr: integral floats keep a ".0"; exponents look like 1e+20.
            if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
                let _ = write!(out, "{f:.1}");
            } else {
                let _ = write!(out, "{}", serde_json::Value::from(f));
            }
        } else {
            let _ = write!(out, "{n}");
        }
    }

    fn write_str(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A minijinja error with its source chain, so the line and cause both reach the caller.
fn describe(err: &minijinja::Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        let _ = write!(text, ": {cause}");
        source = cause.source();
    }
    text
}

fn render_error(err: &minijinja::Error) -> TokenizerError {
    // The raise may be wrapped by the include/call machinery: look through the chain.
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = current {
        if let Some(mj) = e.downcast_ref::<minijinja::Error>()
            && let Some(detail) = mj.detail()
            && let Some(message) = detail.strip_prefix(RAISE_MARKER)
        {
            return TokenizerError::TemplateRaised(message.to_owned());
        }
        current = e.source();
    }
    match err.kind() {
        ErrorKind::SyntaxError => TokenizerError::TemplateSyntax(describe(err)),
        _ => TokenizerError::TemplateRender(describe(err)),
    }
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

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(
            strftime("%d %b %Y %A", 1_709_164_800),
            "29 Feb 2024 Thursday"
        );
    }

    #[test]
    fn detects_openai_content_format() {
        assert_eq!(
            detect_content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}"),
            ContentFormat::String
        );
        assert_eq!(
            detect_content_format(
                "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}"
            ),
            ContentFormat::OpenAi
        );
        assert_eq!(
            detect_content_format("{%- for part in message.content -%}{%- endfor -%}"),
            ContentFormat::OpenAi
        );
        assert_eq!(
            detect_content_format("{% for x in message.contents %}{% endfor %}"),
            ContentFormat::String
        );
    }
}
