//! The router compares its tokenizer with the engine's own `/tokenize` (a vllm-sim pod over
//! loopback HTTP): the same files agree and stay in exact mode; a skewed chat template is caught,
//! the model falls back to approximate mode and `/tokenize` is forwarded to the engine; a pod that
//! does not answer leaves the verdict open.

mod common;

use kvsight_router::config::RouterConfig;
use kvsight_router::state::State;
use kvsight_router::tokenize::{Verdict, model_tokenizer, read_dir};
use kvsight_router::tokenizer_check::check_pending;
use kvsight_testbed::sim::server::{
    SimConfig, SimPod, SimPodHandle, TokenizerFiles as SimTokenizerFiles,
};
use serde_json::{Value, json};

use common::*;

/// The project's own tokenizer files, or `None` (the test says "skipped") when they cannot be
/// built here.
fn own_files(test: &str) -> Option<kvsight_protocol::tokenizer_transfer::TokenizerFiles> {
    kvsight_testbed::cluster::own_tokenizer_or_skip(test).map(|dir| read_dir(&dir).unwrap())
}

async fn sim_with(files: &kvsight_protocol::tokenizer_transfer::TokenizerFiles) -> SimPodHandle {
    SimPod::start(SimConfig {
        served_model_names: vec![MODEL.into()],
        tokenizer: Some(SimTokenizerFiles {
            tokenizer_json: files.tokenizer_json.clone(),
            tokenizer_config: files.tokenizer_config.clone().unwrap_or_default(),
        }),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

/// Status, body as JSON, and the `x-kvsight-decision` header's `prefix_mode`.
async fn post(url: &str, body: &Value) -> (u16, Value, Option<String>) {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let a = kvsight_testbed::cluster::post_json(&http, url, body)
        .await
        .unwrap();
    let mode = a
        .decision
        .map(|d| d["prefix_mode"].as_str().unwrap().to_owned());
    (
        a.status,
        serde_json::from_str(&a.text).unwrap_or(Value::Null),
        mode,
    )
}

async fn metrics(router: &str) -> String {
    reqwest::get(format!("{router}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

fn with_tokenizer(
    files: &kvsight_protocol::tokenizer_transfer::TokenizerFiles,
) -> std::sync::Arc<State> {
    let st = state(RouterConfig::default());
    st.tokenizers
        .insert(MODEL, files.digest(), model_tokenizer(files).unwrap());
    st
}

#[tokio::test]
async fn the_engines_own_files_agree_and_keep_exact_mode() {
    let Some(files) = own_files("the_engines_own_files_agree_and_keep_exact_mode") else {
        return;
    };
    let sim = sim_with(&files).await;
    let st = with_tokenizer(&files);
    // No pod yet: nothing to compare with, the verdict stays open.
    assert_eq!(check_pending(&st).await, 0);
    assert_eq!(st.tokenizers.verdict(MODEL), Some(Verdict::Unchecked));

    add_pod(&st, "sim", &sim.base_url(), &[], 0);
    assert_eq!(check_pending(&st).await, 1);
    assert_eq!(st.tokenizers.verdict(MODEL), Some(Verdict::Agrees));
    assert_eq!(
        check_pending(&st).await,
        0,
        "a verdict is not asked for twice"
    );

    let router = format!("http://{}", serve(kvsight_router::app(st.clone())).await);
    let (s, _, mode) = post(
        &format!("{router}/v1/completions"),
        &json!({"model": MODEL, "prompt": "Tell me a story", "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(mode.unwrap(), "exact");
    let m = metrics(&router).await;
    assert!(
        m.contains(r#"kvsight_router_tokenizer_checks_total{model="m",outcome="agrees"} 1"#),
        "{m}"
    );
}

#[tokio::test]
async fn a_skewed_chat_template_is_caught_and_the_model_falls_back_to_approximate_mode() {
    let test = "a_skewed_chat_template_is_caught_and_the_model_falls_back_to_approximate_mode";
    let Some(files) = own_files(test) else {
        return;
    };
    let sim = sim_with(&files).await;
    // The router was given a template one character off the engine's: a space where the
    // engine's has a newline after each role header (as template revisions differ).
    let router_files = with_template(&files, |t| {
        let skewed = t.replace(r"'|>\n'", r"'|> '");
        assert_ne!(skewed, t, "the fixture's template changed shape");
        skewed
    });

    let st = with_tokenizer(&router_files);
    add_pod(&st, "sim", &sim.base_url(), &[], 0);
    let router = format!("http://{}", serve(kvsight_router::app(st.clone())).await);
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}]});

    // Before the check the router answers /tokenize itself, with its (wrong) ids.
    let (_, engine, _) = post(&format!("{}/tokenize", sim.base_url()), &chat).await;
    let (_, before, _) = post(&format!("{router}/tokenize"), &chat).await;
    assert_ne!(before["tokens"], engine["tokens"]);

    assert_eq!(check_pending(&st).await, 1);
    match st.tokenizers.verdict(MODEL) {
        Some(Verdict::Differs(why)) => assert!(why.starts_with("chat: ids part at token"), "{why}"),
        other => panic!("expected a difference, got {other:?}"),
    }
    assert!(st.tokenizers.get(MODEL).is_none());

    // Now /tokenize is the engine's, and requests are routed on the router's own memory.
    let (s, after, _) = post(&format!("{router}/tokenize"), &chat).await;
    assert_eq!(s, 200);
    assert_eq!(after["tokens"], engine["tokens"]);
    let (s, _, mode) = post(
        &format!("{router}/v1/chat/completions"),
        &json!({"model": MODEL, "messages": chat["messages"], "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(mode.unwrap(), "approximate");

    let (_, debug, _) = get_json(&format!("{router}/debug/pods")).await;
    assert_eq!(debug["tokenizers"][MODEL]["verdict"], "differs");
    assert_eq!(debug["tokenizers"][MODEL]["digest"], router_files.digest());
    let m = metrics(&router).await;
    assert!(
        m.contains(r#"kvsight_router_tokenizer_checks_total{model="m",outcome="differs"} 1"#),
        "{m}"
    );

    // The same files again (say, from a sidecar) are not fetched or judged again; new files are.
    assert!(st.tokenizers.has(MODEL, Some(&router_files.digest())));
    st.tokenizers
        .insert(MODEL, files.digest(), model_tokenizer(&files).unwrap());
    assert_eq!(check_pending(&st).await, 1);
    assert_eq!(st.tokenizers.verdict(MODEL), Some(Verdict::Agrees));
}

/// `files` with its chat template changed by `f`.
fn with_template(
    files: &kvsight_protocol::tokenizer_transfer::TokenizerFiles,
    f: impl Fn(&str) -> String,
) -> kvsight_protocol::tokenizer_transfer::TokenizerFiles {
    let mut cfg: Value = serde_json::from_slice(files.tokenizer_config.as_ref().unwrap()).unwrap();
    let template = f(cfg["chat_template"].as_str().unwrap());
    cfg["chat_template"] = Value::String(template);
    let mut out = files.clone();
    out.tokenizer_config = Some(serde_json::to_vec(&cfg).unwrap());
    out
}

/// Templates that refuse a system role (Gemma's, say) make the engine answer 400 to a chat probe
/// with one; the check retries without it instead of never reaching a verdict.
#[tokio::test]
async fn an_engine_whose_template_refuses_system_roles_is_still_checked() {
    let test = "an_engine_whose_template_refuses_system_roles_is_still_checked";
    let Some(own) = own_files(test) else {
        return;
    };
    let files = with_template(&own, |t| {
        format!(
            "{{% for m in messages %}}{{% if m['role'] == 'system' %}}\
             {{{{ raise_exception('System role not supported') }}}}{{% endif %}}{{% endfor %}}{t}"
        )
    });
    let sim = sim_with(&files).await;
    let system = json!({"model": MODEL, "messages": [{"role": "system", "content": "x"}]});
    let (s, body, _) = post(&format!("{}/tokenize", sim.base_url()), &system).await;
    assert_eq!(s, 400, "the engine refuses a system role: {body}");

    let st = with_tokenizer(&files);
    add_pod(&st, "sim", &sim.base_url(), &[], 0);
    assert_eq!(check_pending(&st).await, 1);
    assert_eq!(st.tokenizers.verdict(MODEL), Some(Verdict::Agrees));

    // And a skew in the rest of that template is still caught through the chat probe.
    let skewed = with_template(&files, |t| t.replace(r"'|>\n'", r"'|> '"));
    let st = with_tokenizer(&skewed);
    add_pod(&st, "sim", &sim.base_url(), &[], 0);
    assert_eq!(check_pending(&st).await, 1);
    match st.tokenizers.verdict(MODEL) {
        Some(Verdict::Differs(why)) => assert!(why.starts_with("chat: "), "{why}"),
        other => panic!("expected a difference, got {other:?}"),
    }
}

/// An engine upgraded in place keeps the files the router checked, but may tokenize them
/// differently: a Ready pod of an engine version not yet agreed with is asked again.
#[tokio::test]
async fn a_pod_of_a_new_engine_version_is_asked_again() {
    let test = "a_pod_of_a_new_engine_version_is_asked_again";
    let Some(files) = own_files(test) else {
        return;
    };
    let old = sim_with(&files).await;
    let st = with_tokenizer(&files);
    add_pod(&st, "old", &old.base_url(), &[], 0);
    assert_eq!(check_pending(&st).await, 1);
    assert_eq!(st.tokenizers.verdict(MODEL), Some(Verdict::Agrees));

    // The upgraded engine renders the same template differently (a stand-in for a new
    // transformers release): the same files, another version, other ids.
    let new = sim_with(&with_template(&files, |t| t.replace(r"'|>\n'", r"'|> '"))).await;
    let mut h = hello("new", &new.base_url(), &[]);
    h.engine.engine_version = "0.34.0".into();
    {
        let mut reg = st.registry();
        let (key, conn) = reg.register(h, std::time::Instant::now());
        reg.apply_load(
            &key,
            conn,
            load(kvsight_protocol::messages::Phase::Ready, 0, 0),
            std::time::Instant::now(),
        )
        .unwrap();
    }
    assert_eq!(check_pending(&st).await, 1);
    match st.tokenizers.verdict(MODEL) {
        Some(Verdict::Differs(why)) => assert!(why.starts_with("chat: "), "{why}"),
        other => panic!("expected a difference, got {other:?}"),
    }
    assert!(
        st.tokenizers.get(MODEL).is_none(),
        "approximate mode for the mixed fleet"
    );
}

#[tokio::test]
async fn a_pod_that_does_not_answer_leaves_the_verdict_open() {
    let Some(files) = own_files("a_pod_that_does_not_answer_leaves_the_verdict_open") else {
        return;
    };
    let st = with_tokenizer(&files);
    add_pod(&st, "gone", &refused_url(), &[], 0);
    assert_eq!(check_pending(&st).await, 0);
    assert_eq!(st.tokenizers.verdict(MODEL), Some(Verdict::Unchecked));
    // Asked again only after a wait: a second pass right away sends nothing (the error count
    // below stays 1).
    assert_eq!(check_pending(&st).await, 0);
    assert!(st.tokenizers.get(MODEL).is_some(), "still used meanwhile");
    let router = format!("http://{}", serve(kvsight_router::app(st.clone())).await);
    let m = metrics(&router).await;
    assert!(
        m.contains(r#"kvsight_router_tokenizer_checks_total{model="m",outcome="error"} 1"#),
        "{m}"
    );
}

async fn get_json(url: &str) -> (u16, Value, Option<String>) {
    let resp = reqwest::get(url).await.unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap(), None)
}
