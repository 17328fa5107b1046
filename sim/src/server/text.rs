//! Text in and out of the simulated model: tokenizing prompts, rendering chats and turning
//! generated token ids into text. With tokenizer files (`--tokenizer DIR`, or the project's own
//! tokenizer that `vllm-sim` uses by default) this is vLLM's path exactly, through
//! [`ModelTokenizer`]: completion prompts with special tokens, chats rendered with the model's
//! template and encoded without adding them again. Without files the built-in codec is
//! byte-level (one token per UTF-8 byte, so shared text prefixes share token prefixes, which
//! prefix caching needs) and generated ids become words from a fixed list.

use kvsight_tokenizer::{ChatExtras, ChatMessage, Dialect, ModelTokenizer};
use serde_json::Value;

use super::TokenizerFiles;

/// Token ids of the built-in byte codec start here so that 0..3 stay free for specials.
const BYTE_OFFSET: u32 = 3;
/// The built-in codec's beginning-of-sequence token, added to completion prompts as
/// `add_special_tokens=true` would.
const BOS: u32 = 1;

const WORDS: &[&str] = &[
    "the", "of", "cache", "block", "token", "model", "prefix", "router", "pod", "engine", "and",
    "request", "stream", "batch", "to", "a", "in", "is", "that", "with",
];

/// The pod's tokenizer. See the module docs.
#[derive(Debug)]
pub(crate) struct Codec {
    tokenizer: Option<ModelTokenizer>,
}

impl Codec {
    /// The files' tokenizer read in `dialect` (as an engine on that transformers version reads
    /// them); without files the built-in codec, whatever the dialect.
    pub(crate) fn new(files: Option<&TokenizerFiles>, dialect: Dialect) -> Result<Self, String> {
        let tokenizer = match files {
            Some(f) => {
                let tok = ModelTokenizer::from_bytes(&f.tokenizer_json, Some(&f.tokenizer_config))
                    .map_err(|e| e.to_string())?;
                Some(match dialect {
                    Dialect::Transformers4 => tok,
                    other => tok.in_dialect(other).map_err(|e| e.to_string())?,
                })
            }
            None => None,
        };
        Ok(Self { tokenizer })
    }

    /// Token ids the model can generate (the tokenizer's vocabulary), if a tokenizer is loaded.
    pub(crate) fn vocab_size(&self) -> Option<usize> {
        self.tokenizer.as_ref().map(ModelTokenizer::vocab_size)
    }

    /// A completion prompt, with special tokens added as vLLM does.
    pub(crate) fn encode_completion(&self, text: &str) -> Result<Vec<u32>, String> {
        if let Some(t) = &self.tokenizer {
            return t.encode_completion(text).map_err(|e| e.to_string());
        }
        let mut ids = Vec::with_capacity(text.len() + 1);
        ids.push(BOS);
        ids.extend(text.bytes().map(|b| u32::from(b) + BYTE_OFFSET));
        Ok(ids)
    }

    /// Text tokenized without special tokens (`/tokenize` with `add_special_tokens: false`).
    pub(crate) fn encode_plain(&self, text: &str) -> Result<Vec<u32>, String> {
        if let Some(t) = &self.tokenizer {
            return t.encode(text, false).map_err(|e| e.to_string());
        }
        Ok(text.bytes().map(|b| u32::from(b) + BYTE_OFFSET).collect())
    }

    /// A chat request's prompt ids: rendered with the chat template, then encoded without
    /// special tokens (the template wrote them).
    pub(crate) fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, String> {
        let messages: Vec<ChatMessage> =
            serde_json::from_value(body.get("messages").cloned().unwrap_or(Value::Null))
                .map_err(|e| format!("invalid `messages`: {e}"))?;
        let add_generation_prompt = body
            .get("add_generation_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let Some(t) = &self.tokenizer else {
            return Ok(builtin_chat(&messages, add_generation_prompt)
                .bytes()
                .map(|b| u32::from(b) + BYTE_OFFSET)
                .collect());
        };
        let extras = ChatExtras {
            tools: body.get("tools").and_then(Value::as_array).cloned(),
            documents: body.get("documents").and_then(Value::as_array).cloned(),
            template_kwargs: body
                .get("chat_template_kwargs")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default(),
            continue_final_message: body
                .get("continue_final_message")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        };
        t.encode_chat(&messages, add_generation_prompt, &extras)
            .map_err(|e| e.to_string())
    }

    /// The text of a request's generated ids so far (callers stream the growth of this string).
    pub(crate) fn decode(&self, ids: &[u32]) -> String {
        if let Some(t) = &self.tokenizer
            && let Ok(text) = t.decode(ids, true)
        {
            return text;
        }
        let mut out = String::new();
        for (i, id) in ids.iter().enumerate() {
            if i > 0 {
                out.push(' ');
            }
            out.push_str(WORDS[*id as usize % WORDS.len()]);
        }
        out
    }
}

/// The built-in chat template: `<|role|>\ncontent<|end|>\n` per message.
fn builtin_chat(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    use kvsight_tokenizer::MessageContent;
    let mut out = String::new();
    for m in messages {
        let content = match &m.content {
            Some(MessageContent::Text(s)) => s.clone(),
            Some(MessageContent::Parts(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str).or(p.as_str()))
                .collect::<Vec<_>>()
                .join("\n"),
            None => String::new(),
        };
        out.push_str(&format!("<|{}|>\n{content}<|end|>\n", m.role));
    }
    if add_generation_prompt {
        out.push_str("<|assistant|>\n");
    }
    out
}
