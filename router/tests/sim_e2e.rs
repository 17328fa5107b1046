//! End to end with the vLLM simulator (`kvsight_testbed::sim::server::SimPod`) over real loopback
//! sockets. The pod is registered by hand (the sidecar runtime is not in this branch yet): the
//! router's `/tokenize` ids equal the simulator's, and a streamed completion passes through whole.

mod common;

use std::time::{Duration, Instant};

use kvsight_router::config::RouterConfig;
use kvsight_router::tokenize::{model_tokenizer, read_dir};
use kvsight_testbed::sim::server::{SimConfig, SimPod, TokenizerFiles};
use serde_json::{Value, json};

use common::*;

async fn post(url: &str, body: &Value) -> (u16, String) {
    let resp = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let text = tokio::time::timeout(Duration::from_secs(20), resp.text())
        .await
        .unwrap()
        .unwrap();
    (status, text)
}

#[tokio::test]
async fn router_tokenize_ids_equal_the_simulators_and_streams_pass_through() {
    let dir = match kvsight_testbed::own_tokenizer::ensure_dir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: router_tokenize_ids_equal_the_simulators: {e}");
            return;
        }
    };
    let files = read_dir(&dir).unwrap();
    let sim = SimPod::start(SimConfig {
        served_model_names: vec![MODEL.into()],
        tokenizer: Some(TokenizerFiles {
            tokenizer_json: files.tokenizer_json.clone(),
            tokenizer_config: files.tokenizer_config.clone().unwrap_or_default(),
        }),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let st = state(RouterConfig::default());
    {
        let mut reg = st.registry();
        let (key, conn) = reg.register(hello("sim", &sim.base_url(), &[]), Instant::now());
        reg.apply_load(
            &key,
            conn,
            load(kvsight_protocol::messages::Phase::Ready, 0, 0),
            Instant::now(),
        )
        .unwrap();
    }
    let router = format!("http://{}", serve(kvsight_router::app(st.clone())).await);

    let prompt =
        json!({"model": MODEL, "prompt": "Which of the seven bridges should we repair first?"});
    let chat = json!({"model": MODEL, "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."}]});
    for body in [&prompt, &chat] {
        let (s, sim_text) = post(&format!("{}/tokenize", sim.base_url()), body).await;
        assert_eq!(s, 200, "{sim_text}");
        let sim_ids: Value = serde_json::from_str::<Value>(&sim_text).unwrap()["tokens"].clone();
        // Forwarded (no tokenizer in the router yet) …
        let (s, fwd) = post(&format!("{router}/tokenize"), body).await;
        assert_eq!(s, 200, "{fwd}");
        assert_eq!(
            serde_json::from_str::<Value>(&fwd).unwrap()["tokens"],
            sim_ids
        );
        // … and answered locally with the same tokenizer: the same ids.
        st.tokenizers
            .insert(MODEL, files.digest(), model_tokenizer(&files).unwrap());
        let (s, local) = post(&format!("{router}/tokenize"), body).await;
        assert_eq!(s, 200, "{local}");
        assert_eq!(
            serde_json::from_str::<Value>(&local).unwrap()["tokens"],
            sim_ids,
            "{body}"
        );
    }

    let (s, text) = post(
        &format!("{router}/v1/completions"),
        &json!({"model": MODEL, "prompt": "Tell me a story", "max_tokens": 8, "stream": true}),
    )
    .await;
    assert_eq!(s, 200, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(text.contains("finish_reason\":\"length\""), "{text}");
    assert!(!text.contains("\"error\""), "{text}");
}
