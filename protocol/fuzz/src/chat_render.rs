//! Feeds arbitrary bytes, read as an OpenAI chat body the way the router reads one, to chat
//! rendering (vLLM's conversation + the Jinja template) and the encoder, with three templates:
//! ChatML, a Phi-3-style one that raises on unknown roles, and one that loops over content parts
//! (openai content format) and writes `tools` and `documents` with `tojson`. Nothing may panic,
//! and:
//! - ChatML renders exactly the text computed here by hand (so every message's content appears,
//!   unescaped and in order);
//! - `continue_final_message` leaves the text ending right after the last message's content;
//! - the byte-level fast path gives the ids of `tokenizers`' full pipeline for any rendered text,
//!   and `encode_chat` equals rendering then encoding.

use std::sync::OnceLock;

use kvsight_tokenizer::{ChatMessage, ChatRequest, MessageContent, ModelTokenizer};
use serde_json::Value;
use tokenizers::AddedToken;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + \
    message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}\
    {{ '<|im_start|>assistant\\n' }}{% endif %}";

const PHI3: &str = "{{ bos_token }}{% for message in messages %}
{% if message['role'] not in ['system', 'user', 'assistant'] %}
{{ raise_exception('Unsupported role: ' ~ message['role']) }}{% endif %}
{{ '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ '<|end|>\\n' }}{% endfor %}
{% if add_generation_prompt %}
{{ '<|assistant|>\\n' }}{% endif %}";

const PARTS: &str = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}\
{% if documents %}<docs>{{ documents | tojson(indent=2) }}</docs>{% endif %}\
{% for message in messages %}<|im_start|>{{ message.role }}{% if message.name %} ({{ message.name }}){% endif %}
{% for part in message.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}\
{% if message.tool_calls %}{% for call in message.tool_calls %}{{ call.function.name }}\
{{ call.function.arguments | tojson }}{% endfor %}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}";

/// A byte-level BPE (the GPT-2 shape, so `encode` takes its fast path) trained on a few lines,
/// with the chat tokens as special tokens.
fn tokenizer_json() -> String {
    let corpus = [
        "You are a helpful assistant. What is the capital of France?",
        "The capital of France is Paris. 12 + 30 = 42; héllo wörld — ünïcode 日本語 🙂",
        "def main():\n    print(\"hello, world\")\n\n\treturn 0",
    ];
    let mut tokenizer = kvsight_tokenizer::testing::byte_level_bpe(
        ByteLevel::default().add_prefix_space(false),
        None,
        400,
        None,
        corpus.iter().map(|s| s.to_string()),
    );
    tokenizer
        .add_special_tokens(
            [
                "<|im_start|>",
                "<|im_end|>",
                "<|end|>",
                "<|user|>",
                "<|assistant|>",
            ]
            .map(|t| AddedToken::from(t, true)),
        )
        .expect("special tokens");
    tokenizer.to_string(false).expect("serialize")
}

struct Setup {
    chatml: ModelTokenizer,
    phi3: ModelTokenizer,
    parts: ModelTokenizer,
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        let json = tokenizer_json();
        let config = br#"{"bos_token": "<s>", "eos_token": "<|im_end|>"}"#;
        let base = ModelTokenizer::from_bytes(json.as_bytes(), Some(config)).expect("tokenizer");
        assert_eq!(base.fast_path(), Some("byte_level"));
        Setup {
            chatml: base.clone().with_chat_template(CHATML),
            phi3: base.clone().with_chat_template(PHI3),
            parts: base.with_chat_template(PARTS),
        }
    })
}

/// What ChatML renders, when every message's content is plain text (or absent).
fn chatml_by_hand(messages: &[ChatMessage], add_generation_prompt: bool) -> Option<String> {
    let mut out = String::new();
    for m in messages {
        let content = match &m.content {
            None => "",
            Some(MessageContent::Text(t)) => t,
            Some(MessageContent::Parts(_)) => return None,
        };
        out.push_str(&format!("<|im_start|>{}\n{content}<|im_end|>\n", m.role));
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    Some(out)
}

fn check_encoding(tok: &ModelTokenizer, rendered: &str) {
    let fast = tok
        .encode(rendered, false)
        .expect("a rendered prompt encodes");
    let reference = tok
        .encode_reference(rendered, false)
        .expect("a rendered prompt encodes (full pipeline)");
    assert_eq!(fast, reference, "fast path and full pipeline differ");
}

/// One input, as libFuzzer or the corpus replay hands it over.
pub fn run(data: &[u8]) {
    let Ok(body) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let Ok(ChatRequest {
        messages,
        add_generation_prompt: gen_prompt,
        extras,
    }) = ChatRequest::from_body(&body)
    else {
        return;
    };
    let s = setup();
    for tok in [&s.chatml, &s.phi3, &s.parts] {
        let Ok(rendered) = tok.render_chat(&messages, gen_prompt, &extras) else {
            continue;
        };
        check_encoding(tok, &rendered);
        let ids = tok
            .encode_chat(&messages, gen_prompt, &extras)
            .expect("encode_chat of a prompt that renders");
        assert_eq!(ids, tok.encode(&rendered, false).expect("encodes"));
        if std::ptr::eq(tok, &s.chatml)
            && let Some(expected) = chatml_by_hand(&messages, gen_prompt)
        {
            if extras.continue_final_message {
                // Cut right after the final message's content.
                let content = match messages.last().and_then(|m| m.content.as_ref()) {
                    Some(MessageContent::Text(t)) => t.as_str(),
                    _ => "",
                };
                assert!(
                    expected.starts_with(&rendered) && rendered.ends_with(content),
                    "continued: {rendered:?} vs {expected:?}"
                );
            } else {
                assert_eq!(rendered, expected);
            }
        }
    }
}
