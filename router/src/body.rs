//! Request bodies in bounded memory. A body is read under `limits.bodyBytes` and a replica-wide
//! budget of bytes held by bodies in flight ([`BodyBudget`]), then read as the few typed fields
//! the router needs, borrowed from the bytes: it is never parsed whole into a
//! `serde_json::Value` (a body of `0,0,0,…` would cost about forty times its size). Fields the
//! router does not read are skipped without allocating. Only the fields the chat template
//! renders become values, and only after one pass over their text ([`scan`]) has counted them
//! against `limits.promptBytes` and `limits.jsonValues`.

use std::borrow::Cow;
use std::fmt;
use std::sync::atomic::Ordering;

use axum::body::{Body, Bytes};
use http_body_util::BodyExt;
use prometheus_client::metrics::gauge::Gauge;
use serde::Deserialize;
use serde::de::{self, IgnoredAny, SeqAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

use kvsight_protocol::openai::{LaxBoolError, lax_bool};

use crate::config::Limits;
use crate::error::ApiError;

/// What one parsed value costs the router, in bytes, as charged to the body budget: a
/// `serde_json::Value` with its share of the map or vector that holds it.
pub const VALUE_COST: usize = 96;

/// Keys of chat content parts whose strings are media (base64 images, audio, video, files), not
/// text the tokenizer reads.
pub const MEDIA_KEYS: [&str; 5] = ["image_url", "input_audio", "audio_url", "video_url", "file"];

/// Bytes of request bodies held by the whole replica: read, being read, or parsed. Kept in the
/// gauge the metrics export (`kvsight_router_inflight_body_bytes`).
#[derive(Debug, Default, Clone)]
pub struct BodyBudget {
    held: Gauge,
}

/// A share of the [`BodyBudget`], given back when dropped.
#[derive(Debug)]
pub struct Hold {
    held: Gauge,
    bytes: usize,
}

impl BodyBudget {
    /// A budget counted in `gauge`.
    pub fn new(gauge: Gauge) -> Self {
        BodyBudget { held: gauge }
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        usize::try_from(self.held.get()).unwrap_or(0)
    }

    /// A hold of `bytes` when the total stays within `limit`.
    pub fn try_hold(&self, bytes: usize, limit: usize) -> Option<Hold> {
        let mut hold = Hold {
            held: self.held.clone(),
            bytes: 0,
        };
        hold.grow(bytes, limit).then_some(hold)
    }
}

impl Hold {
    /// Adds `bytes` to this hold when the budget's total stays within `limit`.
    pub fn grow(&mut self, bytes: usize, limit: usize) -> bool {
        let (Ok(add), Ok(limit)) = (i64::try_from(bytes), i64::try_from(limit)) else {
            return false;
        };
        let ok = self
            .held
            .inner()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                n.checked_add(add).filter(|t| *t <= limit)
            })
            .is_ok();
        if ok {
            self.bytes += bytes;
        }
        ok
    }

    /// Bytes this hold has.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.held.dec_by(self.bytes as i64);
    }
}

/// Reads the whole body, at most `limit` bytes, holding its buffer's size in `budget` (at most
/// `budget_limit` for the replica). A declared length is held, and allocated, before the first
/// byte is read, so a body never grows its buffer by doubling.
pub async fn read_body(
    mut body: Body,
    limit: usize,
    declared: Option<u64>,
    budget: &BodyBudget,
    budget_limit: usize,
) -> Result<(Bytes, Hold), ApiError> {
    let over_budget = || ApiError::BodyBudget {
        limit: budget_limit,
    };
    let first = declared.map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX).min(limit));
    let mut hold = budget
        .try_hold(first, budget_limit)
        .ok_or_else(over_budget)?;
    let mut buf: Vec<u8> = Vec::with_capacity(first);
    while let Some(frame) = body.frame().await {
        let frame = frame
            .map_err(|e| ApiError::BadRequest(format!("could not read the request body: {e}")))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let need = buf.len() + data.len();
        if need > limit {
            return Err(ApiError::BodyTooLarge { limit });
        }
        if need > buf.capacity() {
            let cap = need.max(buf.capacity().saturating_mul(2)).min(limit);
            if !hold.grow(cap.saturating_sub(hold.bytes()), budget_limit) {
                return Err(over_budget());
            }
            buf.reserve_exact(cap - buf.len());
        }
        buf.extend_from_slice(&data);
    }
    Ok((Bytes::from(buf), hold))
}

/// Whether JSON text nests arrays and objects deeper than `limit`, by one pass over the bytes
/// (brackets inside strings do not count), so a hostile body never reaches a recursive parser.
pub fn json_deeper_than(bytes: &[u8], limit: usize) -> bool {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for &b in bytes {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

/// What one pass over a JSON value's text finds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Scan {
    /// Every value: strings, numbers, literals, arrays and objects (keys are not values).
    pub values: usize,
    /// Bytes of every string (as written, escapes included) and number, except strings under a
    /// media key ([`MEDIA_KEYS`]).
    pub text_bytes: usize,
    /// Elements of the value when it is an array.
    pub items: usize,
}

impl std::ops::Add for Scan {
    type Output = Scan;
    fn add(self, o: Scan) -> Scan {
        Scan {
            values: self.values + o.values,
            text_bytes: self.text_bytes + o.text_bytes,
            items: self.items + o.items,
        }
    }
}

/// One open container while scanning: an object (and whether a key comes next) or an array.
#[derive(Clone, Copy)]
enum Open {
    Object { key_next: bool },
    Array,
}

/// Scans the text of one JSON value that a parser has already checked is valid JSON.
pub fn scan(text: &[u8]) -> Scan {
    let mut stack: Vec<Open> = Vec::new();
    // The depth at which a media value began, while inside one.
    let mut media_from: Option<usize> = None;
    // The last key read names media: the value after it is media.
    let mut media_key = false;
    let mut out = Scan::default();
    let mut i = 0;
    while i < text.len() {
        let b = text[i];
        let key_next = matches!(stack.last(), Some(Open::Object { key_next: true }));
        match b {
            b'"' => {
                let start = i + 1;
                let mut j = start;
                while j < text.len() && text[j] != b'"' {
                    j += if text[j] == b'\\' { 2 } else { 1 };
                }
                let s = &text[start..j.min(text.len())];
                if key_next {
                    media_key = MEDIA_KEYS.iter().any(|k| k.as_bytes() == s);
                    if let Some(top) = stack.last_mut() {
                        *top = Open::Object { key_next: false };
                    }
                } else {
                    value(&mut out, stack.len());
                    if media_from.is_none() && !media_key {
                        out.text_bytes += s.len();
                    }
                    media_key = false;
                }
                i = j + 1;
                continue;
            }
            b'{' | b'[' => {
                value(&mut out, stack.len());
                stack.push(if b == b'{' {
                    Open::Object { key_next: true }
                } else {
                    Open::Array
                });
                if media_key && media_from.is_none() {
                    media_from = Some(stack.len());
                }
                media_key = false;
            }
            b'}' | b']' => {
                if media_from == Some(stack.len()) {
                    media_from = None;
                }
                stack.pop();
            }
            b',' => {
                if let Some(top @ Open::Object { .. }) = stack.last_mut() {
                    *top = Open::Object { key_next: true };
                }
            }
            b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => {
                let start = i;
                while i < text.len()
                    && !matches!(text[i], b',' | b']' | b'}' | b' ' | b'\n' | b'\r' | b'\t')
                {
                    i += 1;
                }
                value(&mut out, stack.len());
                if !matches!(b, b't' | b'f' | b'n') && media_from.is_none() && !media_key {
                    out.text_bytes += i - start;
                }
                media_key = false;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Counts a value starting at `depth` (and as an item of the root array).
fn value(out: &mut Scan, depth: usize) {
    out.values += 1;
    if depth == 1 {
        out.items += 1;
    }
}

/// The body fields the router reads, borrowed from the body's bytes; every other field is
/// skipped without being parsed into anything.
#[derive(Debug, Default, Deserialize)]
struct Envelope<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    cache_salt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    documents: Option<&'a RawValue>,
    #[serde(borrow, default)]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(borrow, default)]
    chat_template: Option<&'a RawValue>,
    #[serde(borrow, default)]
    add_generation_prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    continue_final_message: Option<&'a RawValue>,
}

/// Which endpoint a body was sent to: it decides how the prompt is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    Completion,
    Chat,
    /// `/tokenize`: a chat body when it has `messages`, else a completion.
    Tokenize,
}

/// The prompt as the router tokenizes it.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// A chat body: the fields the chat template reads (`messages`, `tools`, `documents`,
    /// `chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`), as one object.
    Chat(Value),
    /// A completion prompt given as text.
    Text(String),
    /// The first of a list of text prompts (a batch is routed on its first element).
    FirstText(String),
    /// Token ids: the prompt, or the first of a list of them.
    Ids(Vec<u32>),
    /// No prompt the router can route on (absent, empty, or of a type the engine will refuse).
    Empty,
}

/// A body read as the router needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedBody {
    pub model: String,
    /// `stream` as vLLM reads it (pydantic's lax boolean).
    pub stream: Result<bool, LaxBoolError>,
    pub cache_salt: Option<String>,
    pub input: PromptInput,
    /// What [`Scan::text_bytes`] found in the prompt fields (compared with `limits.promptBytes`).
    pub prompt_bytes: usize,
    /// Values parsed for the chat template (compared with `limits.jsonValues`).
    pub values: usize,
}

impl ParsedBody {
    /// Memory the parsed fields take beyond the body, as charged to the body budget.
    pub fn parsed_bytes(&self) -> usize {
        let input = match &self.input {
            PromptInput::Chat(_) => self.values.saturating_mul(VALUE_COST),
            PromptInput::Text(s) | PromptInput::FirstText(s) => s.len(),
            PromptInput::Ids(ids) => ids.len() * 4,
            PromptInput::Empty => 0,
        };
        input + self.model.len() + self.cache_salt.as_ref().map_or(0, String::len)
    }
}

fn bad_json(e: serde_json::Error) -> ApiError {
    ApiError::BadRequest(format!("the request body is not valid JSON: {e}"))
}

/// Reads a generation or `/tokenize` body: the nesting bound on the raw bytes, the fields the
/// router needs, `messages`, `promptBytes` and `jsonValues` counted on the text before any of it
/// becomes a value.
pub fn parse_request(
    bytes: &[u8],
    limits: &Limits,
    kind: BodyKind,
) -> Result<ParsedBody, ApiError> {
    if json_deeper_than(bytes, limits.json_depth) {
        return Err(ApiError::TooDeep {
            limit: limits.json_depth,
        });
    }
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        // Also keeps an array from being read as the struct's fields in order.
        serde_json::from_slice::<IgnoredAny>(bytes).map_err(bad_json)?;
        return Err(ApiError::BadRequest(
            "the request body must be a JSON object".into(),
        ));
    }
    // Fields the router skips are not parsed into anything, so their strings are never checked:
    // check the whole text once, as the engine's parser will.
    let text = std::str::from_utf8(bytes)
        .map_err(|e| ApiError::BadRequest(format!("the request body is not valid JSON: {e}")))?;
    let env: Envelope<'_> = serde_json::from_str(text).map_err(bad_json)?;
    let model = match env
        .model
        .map(|m| serde_json::from_str::<Cow<'_, str>>(m.get()))
    {
        Some(Ok(m)) if !m.is_empty() => m.into_owned(),
        _ => {
            return Err(ApiError::BadParam {
                message: "`model` is required and must be a non-empty string".into(),
                param: "model",
            });
        }
    };
    let scan_of = |f: Option<&RawValue>| f.map(|v| scan(v.get().as_bytes())).unwrap_or_default();
    let messages = scan_of(env.messages);
    let is_list = |f: Option<&RawValue>| f.is_some_and(|v| v.get().starts_with('['));
    if is_list(env.messages) && messages.items > limits.chat_messages {
        return Err(ApiError::TooManyMessages {
            count: messages.items,
            limit: limits.chat_messages,
        });
    }
    let prompt = scan_of(env.prompt);
    let template = messages
        + scan_of(env.tools)
        + scan_of(env.documents)
        + scan_of(env.chat_template_kwargs)
        + scan_of(env.chat_template);
    let text = prompt.text_bytes + template.text_bytes;
    if text > limits.prompt_bytes {
        return Err(ApiError::PromptTooLarge {
            bytes: text,
            limit: limits.prompt_bytes,
        });
    }
    let chat = match kind {
        BodyKind::Chat => true,
        BodyKind::Completion => false,
        BodyKind::Tokenize => env.messages.is_some(),
    };
    let (input, values) = if chat {
        let flags = scan_of(env.add_generation_prompt) + scan_of(env.continue_final_message);
        let values = template.values - scan_of(env.chat_template).values + flags.values;
        if values > limits.json_values {
            return Err(ApiError::TooManyValues {
                count: values,
                limit: limits.json_values,
            });
        }
        (
            PromptInput::Chat(chat_fields(&env).map_err(bad_json)?),
            values,
        )
    } else {
        let input = match env.prompt {
            Some(p) => {
                serde_json::from_str::<CompletionPrompt>(p.get())
                    .map_err(bad_json)?
                    .0
            }
            None => PromptInput::Empty,
        };
        (input, 0)
    };
    Ok(ParsedBody {
        model,
        stream: env.stream.map_or(Ok(false), stream_flag),
        cache_salt: env
            .cache_salt
            .and_then(|s| serde_json::from_str::<Cow<'_, str>>(s.get()).ok())
            .map(Cow::into_owned),
        input,
        prompt_bytes: text,
        values,
    })
}

/// The chat template's fields as one object, each parsed from its own text.
fn chat_fields(env: &Envelope<'_>) -> Result<Value, serde_json::Error> {
    let mut out = serde_json::Map::new();
    for (key, raw) in [
        ("messages", env.messages),
        ("tools", env.tools),
        ("documents", env.documents),
        ("chat_template_kwargs", env.chat_template_kwargs),
        ("add_generation_prompt", env.add_generation_prompt),
        ("continue_final_message", env.continue_final_message),
    ] {
        if let Some(raw) = raw {
            out.insert(key.to_owned(), serde_json::from_str(raw.get())?);
        }
    }
    Ok(Value::Object(out))
}

/// `stream` read as vLLM reads it, without parsing a hostile value: a list or an object is not a
/// boolean, and no string that long is one either (a number parses without allocating).
fn stream_flag(raw: &RawValue) -> Result<bool, LaxBoolError> {
    let text = raw.get();
    match text.as_bytes().first() {
        Some(b'[' | b'{') => Err(LaxBoolError::BoolType),
        _ if text == "null" => Ok(false),
        Some(b'"') if text.len() > 64 => Err(LaxBoolError::BoolParsing),
        _ => serde_json::from_str::<Value>(text)
            .map_err(|_| LaxBoolError::BoolParsing)
            .and_then(|v| lax_bool(&v)),
    }
}

/// A completion's `prompt` read into what routing needs: a string, the first of a list of
/// strings, token ids, or the first of a list of token-id lists. The rest of a batch is skipped
/// unparsed; ids are read straight into integers.
struct CompletionPrompt(PromptInput);

impl<'de> Deserialize<'de> for CompletionPrompt {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor).map(CompletionPrompt)
    }
}

struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = PromptInput;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a prompt")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<PromptInput, E> {
        Ok(PromptInput::Text(s.to_owned()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptInput, A::Error> {
        let first = match seq.next_element::<First>()? {
            None => return Ok(PromptInput::Empty),
            Some(f) => f,
        };
        let input = match first {
            First::Text(s) => PromptInput::FirstText(s),
            First::Ids(ids) if ids.is_empty() => PromptInput::Empty,
            First::Ids(ids) => PromptInput::Ids(ids),
            First::Id(id) => {
                let mut ids = vec![id];
                loop {
                    match seq.next_element::<Id>()? {
                        Some(Id(Some(id))) => ids.push(id),
                        Some(Id(None)) => {
                            while seq.next_element::<IgnoredAny>()?.is_some() {}
                            return Ok(PromptInput::Empty);
                        }
                        None => break,
                    }
                }
                PromptInput::Ids(ids)
            }
            First::Other => PromptInput::Empty,
        };
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(input)
    }

    // Any other type is the engine's to refuse; the router routes it on nothing.
    fn visit_bool<E>(self, _: bool) -> Result<PromptInput, E> {
        Ok(PromptInput::Empty)
    }
    fn visit_i64<E>(self, _: i64) -> Result<PromptInput, E> {
        Ok(PromptInput::Empty)
    }
    fn visit_u64<E>(self, _: u64) -> Result<PromptInput, E> {
        Ok(PromptInput::Empty)
    }
    fn visit_f64<E>(self, _: f64) -> Result<PromptInput, E> {
        Ok(PromptInput::Empty)
    }
    fn visit_unit<E>(self) -> Result<PromptInput, E> {
        Ok(PromptInput::Empty)
    }
    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<PromptInput, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(PromptInput::Empty)
    }
}

/// The first element of a list prompt.
enum First {
    Text(String),
    Id(u32),
    Ids(Vec<u32>),
    Other,
}

impl<'de> Deserialize<'de> for First {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = First;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a prompt element")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<First, E> {
                Ok(First::Text(s.to_owned()))
            }
            fn visit_u64<E>(self, n: u64) -> Result<First, E> {
                Ok(u32::try_from(n).map_or(First::Other, First::Id))
            }
            fn visit_i64<E>(self, _: i64) -> Result<First, E> {
                Ok(First::Other)
            }
            fn visit_f64<E>(self, _: f64) -> Result<First, E> {
                Ok(First::Other)
            }
            fn visit_bool<E>(self, _: bool) -> Result<First, E> {
                Ok(First::Other)
            }
            fn visit_unit<E>(self) -> Result<First, E> {
                Ok(First::Other)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<First, A::Error> {
                let mut ids = Vec::new();
                let mut whole = true;
                while let Some(Id(id)) = seq.next_element::<Id>()? {
                    match id {
                        Some(id) if whole => ids.push(id),
                        _ => whole = false,
                    }
                }
                Ok(if whole { First::Ids(ids) } else { First::Other })
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<First, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(First::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// A token id, or `None` for any value that is not one (read without allocating).
struct Id(Option<u32>);

impl<'de> Deserialize<'de> for Id {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Id;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id")
            }
            fn visit_u64<E>(self, n: u64) -> Result<Id, E> {
                Ok(Id(u32::try_from(n).ok()))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Id, E> {
                Ok(Id(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Id, E> {
                Ok(Id(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Id, E> {
                Ok(Id(None))
            }
            fn visit_unit<E>(self) -> Result<Id, E> {
                Ok(Id(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<Id, E> {
                Ok(Id(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Id, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Id(None))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Id, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Id(None))
            }
        }
        d.deserialize_any(V)
    }
}
