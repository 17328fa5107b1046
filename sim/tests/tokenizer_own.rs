//! The project's own tokenizer: deterministic training, round trips, chat template, and that
//! realistic prompts tokenize to realistic lengths.

mod tokenizer_pin;

use std::time::Instant;

use kvsight_sim::own_tokenizer::{self, SPECIAL_TOKENS};
use kvsight_tokenizer::{ChatExtras, ChatMessage, MessageContent, TokenizerError};

/// sha256 of the produced tokenizer.json. A change means every token id (and so every block hash
/// in recorded expectations) may have moved: bump `own_tokenizer::VERSION` and update this.
const TOKENIZER_JSON_SHA256: &str =
    "e5864f855ded2e50129ac021ff049347d3c14263b3a1db26f1a0653fef399d52";

#[test]
fn training_is_deterministic_and_pinned() {
    let start = Instant::now();
    let first = own_tokenizer::build().expect("train");
    // Printed, not asserted: the time on a shared 2-core CI machine says little.
    let elapsed = start.elapsed();
    eprintln!("own tokenizer trained in {elapsed:?}");
    let second = own_tokenizer::build().expect("train again");
    assert!(
        first == second,
        "two trainings must give byte-identical files"
    );
    tokenizer_pin::assert_pinned(
        first.tokenizer_json.as_bytes(),
        TOKENIZER_JSON_SHA256,
        "bump own_tokenizer::VERSION and re-pin",
    );
}

#[test]
fn corpus_and_vocabulary_have_the_intended_size() {
    let corpus = own_tokenizer::corpus();
    assert!(
        (150_000..600_000).contains(&corpus.len()),
        "corpus is {} bytes",
        corpus.len()
    );
    let tok = own_tokenizer::load().expect("load");
    let vocab = tok.vocab_size();
    eprintln!("corpus {} bytes, vocabulary {vocab}", corpus.len());
    assert!((4_000..=8_000).contains(&vocab), "vocab size {vocab}");
    for (id, token) in SPECIAL_TOKENS.iter().enumerate() {
        assert_eq!(tok.token_to_id(token), Some(id as u32), "{token}");
    }
}

#[test]
fn ensure_dir_caches_the_trained_files() {
    let dir = own_tokenizer::ensure_dir().expect("ensure_dir");
    assert!(dir.ends_with(format!("kvsight-own-tokenizer/{}", own_tokenizer::VERSION)));
    let again = own_tokenizer::ensure_dir().expect("ensure_dir again");
    assert_eq!(dir, again);
    // The cache holds what training produces (pinned), not a stale or partial copy.
    let on_disk = std::fs::read(dir.join("tokenizer.json")).expect("read");
    tokenizer_pin::assert_pinned(
        &on_disk,
        TOKENIZER_JSON_SHA256,
        "bump own_tokenizer::VERSION and re-pin",
    );
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer_config.json")).expect("read"))
            .expect("config json");
    assert_eq!(config["chat_template"], own_tokenizer::CHAT_TEMPLATE);
    assert_eq!(config["bos_token"], "<|bos|>");
    assert_eq!(config["eos_token"], "<|eos|>");
}

#[test]
fn ensure_dir_survives_concurrent_callers() {
    let handles: Vec<_> = (0..3)
        .map(|_| std::thread::spawn(own_tokenizer::ensure_dir))
        .collect();
    let dirs: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("thread").expect("ensure_dir"))
        .collect();
    assert!(dirs.windows(2).all(|w| w[0] == w[1]));
    let parent = dirs[0].parent().expect("parent");
    let leftovers: Vec<_> = std::fs::read_dir(parent)
        .expect("read_dir")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
        .map(|e| e.file_name())
        .collect();
    // Other test processes may be mid-write; ours must have cleaned up, which we can only
    // check as "no temp dir of this process remains".
    let pid = format!("-{}-", std::process::id());
    assert!(
        leftovers
            .iter()
            .all(|name| !name.to_string_lossy().contains(&pid)),
        "{leftovers:?}"
    );
}

#[test]
fn decode_of_encode_round_trips() {
    let tok = own_tokenizer::load().expect("load");
    let bos = tok.token_to_id("<|bos|>").expect("bos");
    for text in [
        "What is the capital of France?",
        "  leading spaces, trailing spaces  ",
        "line one\nline two\n\n\tindented\r\n",
        "Unicode: café, naïve, 東京, emoji 🦀 and math ∑x².",
        "1. Always check the request before you answer any long question.",
        "",
    ] {
        let ids = tok.encode_completion(text).expect("encode");
        assert_eq!(ids.first(), Some(&bos), "completion gets a BOS: {text:?}");
        assert_eq!(tok.decode(&ids, true).expect("decode"), text);
        let plain = tok.encode(text, false).expect("encode");
        assert_eq!(&ids[1..], &plain[..], "BOS is the only difference");
    }
}

#[test]
fn chat_template_renders_role_tokens() {
    let tok = own_tokenizer::load().expect("load");
    let messages = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "What is the capital of France?"),
        ChatMessage::new("assistant", "Paris."),
        ChatMessage::new("user", "And of Spain?"),
    ];
    let rendered = tok
        .render_chat(&messages, true, &ChatExtras::default())
        .expect("render");
    assert_eq!(
        rendered,
        "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nWhat is the capital of France?<|end|>\n\
         <|assistant|>\nParis.<|end|>\n<|user|>\nAnd of Spain?<|end|>\n<|assistant|>\n"
    );
    let without = tok
        .render_chat(&messages, false, &ChatExtras::default())
        .expect("render");
    assert_eq!(without, rendered.trim_end_matches("<|assistant|>\n"));

    let ids = tok
        .encode_chat(&messages, true, &ChatExtras::default())
        .expect("encode");
    let id = |t: &str| tok.token_to_id(t).expect(t);
    assert_eq!(ids[0], id("<|bos|>"));
    assert_eq!(
        ids.iter().filter(|&&i| i == id("<|bos|>")).count(),
        1,
        "chat is encoded without adding a second BOS"
    );
    assert_eq!(ids[1], id("<|system|>"));
    assert_eq!(ids.iter().filter(|&&i| i == id("<|user|>")).count(), 2);
    assert_eq!(ids.iter().filter(|&&i| i == id("<|end|>")).count(), 4);
    assert_eq!(ids.iter().filter(|&&i| i == id("<|assistant|>")).count(), 2);
    assert_eq!(ids[ids.len() - 2], id("<|assistant|>"));
    assert_eq!(tok.decode(&ids, false).expect("decode"), rendered);
}

#[test]
fn forty_guidelines_tokenize_to_a_realistic_length() {
    let tok = own_tokenizer::load().expect("load");
    let preamble = own_tokenizer::guidelines_preamble(40, 7);
    assert_eq!(preamble.lines().count(), 41);
    let ids = tok.encode(&preamble, false).expect("encode");
    eprintln!(
        "40 guidelines: {} bytes, {} words, {} tokens",
        preamble.len(),
        preamble.split_whitespace().count(),
        ids.len()
    );
    assert!((500..=900).contains(&ids.len()), "{} tokens", ids.len());
    let chat = tok
        .encode_chat(
            &[
                ChatMessage::new("system", preamble.clone()),
                ChatMessage::new("user", "How should I answer?"),
            ],
            true,
            &ChatExtras::default(),
        )
        .expect("encode chat");
    assert!(chat.len() > ids.len() + 8);
}

#[test]
fn list_of_parts_content_is_joined_like_vllm() {
    let tok = own_tokenizer::load().expect("load");
    let parts: ChatMessage = serde_json::from_value(serde_json::json!({
        "role": "user",
        "content": [
            {"type": "text", "text": "First part."},
            {"type": "text", "text": "Second part."}
        ]
    }))
    .expect("parse");
    assert!(matches!(parts.content, Some(MessageContent::Parts(_))));
    let joined = ChatMessage::new("user", "First part.\nSecond part.");
    let extras = ChatExtras::default();
    assert_eq!(
        tok.encode_chat(std::slice::from_ref(&parts), true, &extras)
            .expect("parts"),
        tok.encode_chat(&[joined], true, &extras).expect("string")
    );

    let image: ChatMessage = serde_json::from_value(serde_json::json!({
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    }))
    .expect("parse");
    let err = tok.render_chat(&[parts, image], true, &extras).unwrap_err();
    assert!(
        matches!(err, TokenizerError::InvalidMessage { index: 1, .. }),
        "{err:?}"
    );
}

#[test]
fn template_refusals_are_typed() {
    let tok = own_tokenizer::load().expect("load");
    let err = tok
        .render_chat(
            &[ChatMessage::new("tool", "42")],
            true,
            &ChatExtras::default(),
        )
        .unwrap_err();
    assert_eq!(
        err,
        TokenizerError::TemplateRaised("Unsupported role: tool".to_owned())
    );
}
