//! End to end with the vLLM simulator (`kvsight_sim::server::SimPod`) over real loopback
//! sockets. The pod is registered by hand (the sidecar runtime is not in this branch yet): the
//! router's `/tokenize` ids equal the simulator's, and a streamed completion passes through whole.

mod common;

use std::time::Duration;

use kvsight_router::config::RouterConfig;
use kvsight_router::tokenize::model_tokenizer;
use kvsight_sim::server::{SimConfig, SimPod};
use serde_json::{Value, json};

use common::*;

async fn post(url: &str, body: &Value) -> (u16, String) {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let a = kvsight_harness::http::post_json(&http, url, body)
        .await
        .unwrap();
    (a.status, a.text)
}

#[tokio::test]
async fn router_tokenize_ids_equal_the_simulators_and_streams_pass_through() {
    let Some(files) = own_files("router_tokenize_ids_equal_the_simulators") else {
        return;
    };
    let sim = SimPod::start(SimConfig {
        served_model_names: vec![MODEL.into()],
        tokenizer: Some(sim_tokenizer(&files)),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let st = state(RouterConfig::default());
    add_pod(&st, "sim", &sim.base_url(), &[], 0);
    let router = format!("http://{}", serve(app_and_admin(st.clone())).await);

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

#[tokio::test]
async fn three_sim_pods_concentrate_a_shared_prefix_then_spread_after_a_reload_to_prefix_zero() {
    let dir = std::env::temp_dir().join(format!("kvsight-e2e-reload-{}", rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("router.yaml");
    std::fs::write(&path, "scheduler:\n  weights:\n    prefix: 3\n").unwrap();
    let st = state(RouterConfig::load(&path).unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    kvsight_router::reload::spawn_watcher(st.clone(), path.clone(), stop.clone()).unwrap();
    let mut sims = Vec::new();
    for i in 0..3 {
        let sim = SimPod::start(SimConfig {
            served_model_names: vec![MODEL.into()],
            ..SimConfig::default()
        })
        .await
        .unwrap();
        add_pod(&st, &format!("sim{i}"), &sim.base_url(), &[], 0);
        sims.push(sim);
    }
    let router = format!("http://{}", serve(app_and_admin(st.clone())).await);
    let system = "You are a careful assistant who answers in complete sentences. ".repeat(10);
    let batch = |tag: &'static str| {
        let (router, system) = (router.clone(), system.clone());
        async move {
            let mut pods = Vec::new();
            for i in 0..6 {
                let resp = reqwest::Client::builder()
                    .no_proxy()
                    .build()
                    .unwrap()
                    .post(format!("{router}/v1/completions"))
                    .header("x-kvsight-debug", "1")
                    .body(json!({"model": MODEL, "prompt": format!("{system} {tag} {i}"), "max_tokens": 2}).to_string())
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                let d: Value =
                    serde_json::from_str(resp.headers()["x-kvsight-decision"].to_str().unwrap())
                        .unwrap();
                pods.push(d["pod"].as_str().unwrap().to_owned());
                let _ = resp.text().await;
            }
            pods
        }
    };
    let first = batch("a").await;
    assert!(first.iter().all(|p| *p == first[0]), "{first:?}");

    let mut events = st.reload_events();
    std::fs::write(&path, "scheduler:\n  weights:\n    prefix: 0\n").unwrap();
    tokio::time::timeout(Duration::from_secs(10), events.wait_for(|n| *n >= 1))
        .await
        .unwrap()
        .unwrap();
    let second = batch("b").await;
    let distinct: std::collections::BTreeSet<_> = second.iter().collect();
    assert!(distinct.len() >= 2, "spread after prefix: 0: {second:?}");
    stop.cancel();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn an_adapter_request_is_tokenized_with_its_base_models_tokenizer() {
    let Some(files) = own_files("an_adapter_request_is_tokenized_with_its_base_models_tokenizer")
    else {
        return;
    };
    let sim = SimPod::start(SimConfig {
        served_model_names: vec![MODEL.into()],
        lora_modules: vec![("sql-lora".into(), "/adapters/sql".into())],
        tokenizer: Some(sim_tokenizer(&files)),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let st = state(RouterConfig::default());
    // The pod serves MODEL with the adapter `sql-lora` (see `hello`); only MODEL has files.
    add_pod(&st, "sim", &sim.base_url(), &[], 0);
    st.tokenizers
        .insert(MODEL, files.digest(), model_tokenizer(&files).unwrap());
    let router = format!("http://{}", serve(kvsight_router::app(st.clone())).await);
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let r = http
        .post(format!("{router}/v1/completions"))
        .header("x-kvsight-debug", "1")
        .header("content-type", "application/json")
        .body(
            json!({"model": "sql-lora", "prompt": "Which tables hold the orders?", "max_tokens": 1})
                .to_string(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let decision: Value =
        serde_json::from_str(r.headers()["x-kvsight-decision"].to_str().unwrap()).unwrap();
    // Without the base's tokenizer the router would fall back to approximate pseudo-tokens.
    assert_eq!(decision["prefix_mode"], "exact", "{decision}");
    sim.shutdown(Duration::from_secs(1)).await;
}
