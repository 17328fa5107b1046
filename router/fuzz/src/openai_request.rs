//! Feeds arbitrary bytes, as an OpenAI request body, through what the router does with a body
//! before it picks a pod: the nesting check on raw bytes, parsing and `model`, `stream` read as
//! vLLM reads it, and the prompt (approximate for an unknown model, the real tokenizer and chat
//! template for a known one; completion and chat). Nothing may panic, and:
//! - the byte scan's verdict on nesting agrees with the depth of the value the parser builds;
//! - `model` is the body's non-empty string field, and a body without one is refused;
//! - the chat prompt text holds every message's role and string content, in order; approximate
//!   tokens are one per 4 characters of it;
//! - the body written out again and read back means the same: model, stream, prompt.

use std::sync::{Arc, OnceLock};

use kvsight_router::proxy::{json_deeper_than, parse_body};
use kvsight_router::tokenize::{
    APPROX_CHARS_PER_TOKEN, Tokenizers, approximate_tokens, prompt_text, prompt_tokens,
};
use kvsight_tokenizer::ModelTokenizer;
use serde_json::Value;

/// The router's default `limits.jsonDepth`.
const DEPTH: usize = 64;
/// The model with a real tokenizer; every other model is tokenized approximately.
const EXACT_MODEL: &str = "exact";

fn tokenizers() -> &'static Tokenizers {
    static TOKENIZERS: OnceLock<Tokenizers> = OnceLock::new();
    TOKENIZERS.get_or_init(|| {
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "unk_token": "[UNK]",
                      "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "<|im_start|>": 3}}
        });
        let template = "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}\n\
                        {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}";
        let tok = ModelTokenizer::from_bytes(&serde_json::to_vec(&json).expect("json"), None)
            .expect("tokenizer")
            .with_chat_template(template);
        let t = Tokenizers::new(None);
        t.insert(EXACT_MODEL, tok.digest_hex(), Arc::new(tok));
        t
    })
}

fn depth(v: &Value) -> usize {
    match v {
        Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Value::Object(fields) => 1 + fields.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// What the router makes of a body it accepted, for comparison.
#[derive(Debug, PartialEq)]
struct Meaning {
    model: String,
    stream: Option<bool>,
    completion: String,
    chat: String,
}

fn meaning(json: &Value, model: String) -> Meaning {
    Meaning {
        stream: kvsight_protocol::openai::optional_bool(json, "stream", false).ok(),
        completion: prompt_text(json, false),
        chat: prompt_text(json, true),
        model,
    }
}

/// One input, as libFuzzer or the corpus replay hands it over.
pub fn run(data: &[u8]) {
    let deep = json_deeper_than(data, DEPTH);
    if let Ok(v) = serde_json::from_slice::<Value>(data) {
        assert_eq!(
            deep,
            depth(&v) > DEPTH,
            "nesting scan disagrees with the parser"
        );
    }
    if deep {
        return;
    }
    let Ok((json, model)) = parse_body(data) else {
        if let Ok(v) = serde_json::from_slice::<Value>(data) {
            assert!(
                !matches!(v.get("model"), Some(Value::String(m)) if !m.is_empty()),
                "a body with a model refused"
            );
        }
        return;
    };
    assert_eq!(
        json.get("model").and_then(Value::as_str),
        Some(model.as_str())
    );

    let chat_text = prompt_text(&json, true);
    let mut rest = chat_text.as_str();
    for m in json
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        for part in [m.get("role"), m.get("content")] {
            if let Some(Value::String(s)) = part {
                let at = rest
                    .find(s.as_str())
                    .expect("message text in the chat prompt");
                rest = &rest[at + s.len()..];
            }
        }
    }

    for chat in [false, true] {
        for m in [model.as_str(), EXACT_MODEL] {
            let Ok(prompt) = prompt_tokens(tokenizers(), m, chat, &json) else {
                assert_eq!(m, EXACT_MODEL, "approximate tokenizing cannot fail");
                continue;
            };
            if !prompt.exact {
                let text = prompt_text(&json, chat);
                assert_eq!(
                    prompt.tokens.len(),
                    text.chars().count().div_ceil(APPROX_CHARS_PER_TOKEN)
                );
                assert_eq!(prompt.tokens, approximate_tokens(&text));
            }
        }
    }

    let again = serde_json::to_vec(&json).expect("a value serializes");
    let (json2, model2) = parse_body(&again).expect("a written body parses");
    assert_eq!(meaning(&json, model), meaning(&json2, model2));
}
