//! Text prompts through a real tokenizer over HTTP: the project's own tokenizer (always
//! available), the project's Llama-2-shaped tokenizer read as transformers 5 reads it
//! (`--tokenizer-dialect transformers5-rebuilt`: a vLLM >= 0.32 engine), and, when `../shared` is
//! present, Phi-3-mini, whose chat ids must equal the vector from Python `tokenizers` + jinja2
//! recorded in its SOURCE.md.

mod sim_support;

use kvsight_sim::server::{SimConfig, SimPod, TokenizerFiles};
use kvsight_sim::{llama2_tokenizer, own_tokenizer};
use kvsight_tokenizer::{ChatExtras, ChatMessage, Dialect};
use serde_json::json;
use sim_support::post_json;

/// Phi-3-mini's tokenizer folder, under `../shared`.
const PHI3_DIR: &str = "fixtures/tokenizers/phi-3-mini";

fn files(dir: &std::path::Path) -> TokenizerFiles {
    TokenizerFiles::from_dir(dir).expect("tokenizer files")
}

#[tokio::test]
async fn own_tokenizer_over_http() -> anyhow::Result<()> {
    let direct = own_tokenizer::load()?;
    let pod = SimPod::start(SimConfig {
        tokenizer: Some(TokenizerFiles::own()?),
        enable_prompt_tokens_details: true,
        ..SimConfig::default()
    })
    .await?;
    let text = "Please summarise the cache policy of the router in two sentences.";
    let tok = post_json(pod.http_addr(), "/tokenize", &json!({"prompt": text}))
        .await?
        .json()?;
    let expected = direct.encode_completion(text)?;
    assert_eq!(tok["tokens"], json!(expected));
    // Fewer tokens than bytes: a real BPE, not the byte codec.
    assert!(expected.len() < text.len() / 2);

    let messages = json!([{"role": "user", "content": text}]);
    let rendered = post_json(
        pod.http_addr(),
        "/v1/chat/completions/render",
        &json!({"messages": messages}),
    )
    .await?
    .json()?;
    let chat = direct.encode_chat(
        &[kvsight_tokenizer::ChatMessage::new("user", text)],
        true,
        &Default::default(),
    )?;
    assert_eq!(rendered["token_ids"], json!(chat));

    let r = post_json(
        pod.http_addr(),
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 8}),
    )
    .await?
    .json()?;
    assert_eq!(r["usage"]["prompt_tokens"], chat.len());
    assert!(
        !r["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty()
    );
    Ok(())
}

/// An engine on transformers 5 serving a Llama-2-shaped model: `/tokenize` gives the rebuilt
/// dialect's ids (transformers 5.19's, pinned in `tokenizer_llama2.rs`), for completions and
/// chats; a tokenizer the dialect does not apply to is refused at start.
#[tokio::test]
async fn llama2_tokenizer_in_the_rebuilt_dialect_over_http() -> anyhow::Result<()> {
    let files = files(&llama2_tokenizer::ensure_dir()?);
    let pod = SimPod::start(SimConfig {
        tokenizer: Some(files.clone()),
        tokenizer_dialect: Dialect::Transformers5Rebuilt,
        ..SimConfig::default()
    })
    .await?;
    let tok = post_json(pod.http_addr(), "/tokenize", &json!({"prompt": " leading"}))
        .await?
        .json()?;
    // transformers 4 gives [1, 327, 675, 1043]: "▁" twice.
    assert_eq!(tok["tokens"], json!([1, 675, 1043]));

    let direct = llama2_tokenizer::load()?.in_dialect(Dialect::Transformers5Rebuilt)?;
    let messages = [
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", "Be brief."),
    ];
    let chat = post_json(
        pod.http_addr(),
        "/tokenize",
        &json!({"messages": messages, "add_generation_prompt": true}),
    )
    .await?
    .json()?;
    let expected = direct.encode_chat(&messages, true, &ChatExtras::default())?;
    assert_eq!(chat["tokens"], json!(expected));
    let as_tf4 = llama2_tokenizer::load()?.encode_chat(&messages, true, &ChatExtras::default())?;
    assert_ne!(expected, as_tf4, "the chat tells the dialects apart");

    let byte_level = SimPod::start(SimConfig {
        tokenizer: Some(TokenizerFiles::own()?),
        tokenizer_dialect: Dialect::Transformers5Rebuilt,
        ..SimConfig::default()
    })
    .await;
    let err = byte_level.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("does not apply"), "{err}");
    Ok(())
}

#[tokio::test]
async fn phi3_chat_ids_match_python() -> anyhow::Result<()> {
    let Some(dir) = kvsight_harness::fixture_or_skip("phi3_chat_ids_match_python", PHI3_DIR) else {
        return Ok(());
    };
    let pod = SimPod::start(SimConfig {
        tokenizer: Some(files(&dir)),
        ..SimConfig::default()
    })
    .await?;
    let tok = post_json(
        pod.http_addr(),
        "/tokenize",
        &json!({"messages": [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."}
        ], "add_generation_prompt": true}),
    )
    .await?
    .json()?;
    assert_eq!(
        tok["tokens"],
        json!([
            32010, 1724, 338, 278, 7483, 310, 3444, 29973, 32007, 32001, 450, 7483, 310, 3444, 338,
            3681, 29889, 32007, 32001
        ])
    );
    Ok(())
}
