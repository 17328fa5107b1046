//! Feeds arbitrary bytes, as an OpenAI request body, through what the router does with a body
//! before it picks a pod: the nesting check on raw bytes, the typed read of the fields the router
//! needs (`kvsight_router::body::parse_request`, as each endpoint reads it), `stream` read as
//! vLLM reads it, and the prompt (approximate for an unknown model, the real tokenizer and chat
//! template for a known one). Nothing may panic, and:
//! - the byte scan's verdict on nesting agrees with the depth of the value a parser builds;
//! - a body the router accepts is a JSON object whose `model` is the non-empty string read, and
//!   whose `stream` means what pydantic's lax boolean makes of it;
//! - the chat fields handed to the template are the body's own; a completion's text or token
//!   ids are the body's `prompt` (or its first element);
//! - `promptBytes` counts at least every byte of text in `prompt` and `messages`;
//! - approximate tokens are one per 4 characters of the prompt text;
//! - the body written out again and read back means the same.

use std::sync::{Arc, OnceLock};

use kvsight_router::body::{BodyKind, ParsedBody, PromptInput, json_deeper_than, parse_request};
use kvsight_router::config::Limits;
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

/// Bytes of every string in a value, media payloads too (a lower bound of `promptBytes`'s count
/// once media is left out: the scan counts strings as written, escapes included).
fn string_bytes(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len(),
        Value::Array(items) => items.iter().map(string_bytes).sum(),
        Value::Object(fields) => fields.values().map(string_bytes).sum(),
        _ => 0,
    }
}

/// Whether a value holds a media key anywhere (its strings are then left out of the count).
fn has_media(v: &Value) -> bool {
    match v {
        Value::Array(items) => items.iter().any(has_media),
        Value::Object(fields) => fields
            .iter()
            .any(|(k, v)| kvsight_router::body::MEDIA_KEYS.contains(&k.as_str()) || has_media(v)),
        _ => false,
    }
}

/// A token id list as vLLM takes it (every element a `u32`).
fn ids(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?
        .iter()
        .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

/// What a completion body's `prompt` routes on, read from the whole value.
fn expected_completion(v: &Value) -> PromptInput {
    match v.get("prompt") {
        Some(Value::String(s)) => PromptInput::Text(s.clone()),
        Some(Value::Array(a)) => match a.first() {
            Some(Value::String(s)) => PromptInput::FirstText(s.clone()),
            Some(Value::Array(_)) => match a.first().and_then(ids) {
                Some(i) if !i.is_empty() => PromptInput::Ids(i),
                _ => PromptInput::Empty,
            },
            Some(_) => ids(&Value::Array(a.clone())).map_or(PromptInput::Empty, PromptInput::Ids),
            None => PromptInput::Empty,
        },
        _ => PromptInput::Empty,
    }
}

fn check_accepted(v: &Value, p: &ParsedBody, kind: BodyKind) {
    assert!(v.is_object(), "a body that is not an object accepted");
    assert_eq!(
        v.get("model").and_then(Value::as_str),
        Some(p.model.as_str())
    );
    assert_eq!(
        p.stream.ok(),
        kvsight_protocol::openai::optional_bool(v, "stream", false).ok()
    );
    let chat = match kind {
        BodyKind::Chat => true,
        BodyKind::Completion => false,
        // `messages: null` is no chat body (the field is absent to the engine's model too).
        BodyKind::Tokenize => v.get("messages").is_some_and(|m| !m.is_null()),
    };
    match &p.input {
        PromptInput::Chat(fields) => {
            assert!(chat);
            for (k, f) in fields.as_object().expect("the chat fields are an object") {
                assert_eq!(v.get(k), Some(f), "{k} is the body's own");
            }
        }
        other => {
            assert!(!chat);
            assert_eq!(other, &expected_completion(v));
        }
    }
    for f in ["prompt", "messages"] {
        if let Some(x) = v.get(f)
            && !has_media(x)
        {
            assert!(p.prompt_bytes >= string_bytes(x), "{f} not counted whole");
        }
    }
}

/// One input, as libFuzzer or the corpus replay hands it over.
pub fn run(data: &[u8]) {
    let deep = json_deeper_than(data, DEPTH);
    let value = serde_json::from_slice::<Value>(data).ok();
    if let Some(v) = &value {
        assert_eq!(
            deep,
            depth(v) > DEPTH,
            "nesting scan disagrees with the parser"
        );
    }
    if deep {
        return;
    }
    let limits = Limits {
        json_depth: DEPTH,
        ..Limits::default()
    };
    for kind in [BodyKind::Completion, BodyKind::Chat, BodyKind::Tokenize] {
        let Ok(parsed) = parse_request(data, &limits, kind) else {
            continue;
        };
        let Some(v) = value.as_ref() else {
            // A number past f64's range is JSON (Python's parser, vLLM's, reads it as inf) that
            // serde_json's values cannot hold; the router reads no such field as a number.
            let e = serde_json::from_slice::<Value>(data).expect_err("no value");
            assert!(
                e.to_string().contains("number out of range"),
                "an accepted body is not JSON: {e}"
            );
            continue;
        };
        check_accepted(v, &parsed, kind);

        for m in [parsed.model.as_str(), EXACT_MODEL] {
            let Ok(prompt) = prompt_tokens(tokenizers(), m, parsed.input.clone()) else {
                assert_eq!(m, EXACT_MODEL, "approximate tokenizing cannot fail");
                continue;
            };
            if !prompt.exact {
                let text = match &parsed.input {
                    PromptInput::Chat(fields) => prompt_text(fields, true),
                    PromptInput::Text(s) | PromptInput::FirstText(s) => s.clone(),
                    _ => String::new(),
                };
                assert_eq!(
                    prompt.tokens.len(),
                    text.chars().count().div_ceil(APPROX_CHARS_PER_TOKEN)
                );
                assert_eq!(prompt.tokens, approximate_tokens(&text));
            }
        }

        let again = serde_json::to_vec(v).expect("a value serializes");
        let reread = parse_request(&again, &limits, kind).expect("a written body parses");
        // Compared by what routing reads: the chat's text (floats in template fields need not
        // survive serde_json's writing and reading bit for bit), the completion's prompt.
        let meaning = |p: &ParsedBody| {
            let prompt = match &p.input {
                PromptInput::Chat(fields) => PromptInput::Text(prompt_text(fields, true)),
                other => other.clone(),
            };
            (p.model.clone(), p.stream, prompt, p.cache_salt.clone())
        };
        assert_eq!(meaning(&parsed), meaning(&reread));
    }
}
