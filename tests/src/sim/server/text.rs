//! Text in and out of the simulated model: tokenizing prompts, rendering chats and turning
//! generated token ids into text. Without a tokenizer the built-in codec is byte-level (one
//! token per UTF-8 byte, so shared text prefixes share token prefixes, which prefix caching
//! needs) and generated ids become words from a fixed list — deterministic, like everything else.

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
    _files: Option<TokenizerFiles>,
}

impl Codec {
    pub(crate) fn new(files: Option<&TokenizerFiles>) -> Result<Self, String> {
        if files.is_some() {
            return Err("loading tokenizer.json is not supported by this build".to_owned());
        }
        Ok(Self { _files: None })
    }

    /// A completion prompt, with special tokens added as vLLM does.
    pub(crate) fn encode_completion(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() + 1);
        ids.push(BOS);
        ids.extend(text.bytes().map(|b| u32::from(b) + BYTE_OFFSET));
        ids
    }

    /// The chat rendered as a prompt string (the built-in template).
    pub(crate) fn render_chat(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let mut out = String::new();
        for m in messages {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or("each message needs a string `role`")?;
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("\n"),
                None | Some(Value::Null) => String::new(),
                Some(_) => return Err("message `content` must be a string or a list".into()),
            };
            out.push_str(&format!("<|{role}|>\n{content}<|end|>\n"));
        }
        if add_generation_prompt {
            out.push_str("<|assistant|>\n");
        }
        Ok(out)
    }

    /// A rendered chat, tokenized without adding special tokens again.
    pub(crate) fn encode_chat(&self, rendered: &str) -> Vec<u32> {
        rendered
            .bytes()
            .map(|b| u32::from(b) + BYTE_OFFSET)
            .collect()
    }

    /// Text of generated ids; `first` says whether these are the request's first tokens.
    pub(crate) fn decode(&self, ids: &[u32], first: bool) -> String {
        let mut out = String::new();
        for (i, id) in ids.iter().enumerate() {
            if !(first && i == 0) {
                out.push(' ');
            }
            out.push_str(WORDS[*id as usize % WORDS.len()]);
        }
        out
    }
}
