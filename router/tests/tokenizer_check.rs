//! The router compares its tokenizer with the engine's own `/tokenize` (a vllm-sim pod over
//! loopback HTTP) and chooses the dialect the engine agrees with: the same files agree and stay
//! in exact mode; an engine on transformers 5 that rebuilds a Llama-2-shaped tokenizer is matched
//! in that dialect (and routed exactly, cached tokens predicted right, end to end); one on
//! transformers 4 keeps that dialect; a skewed chat template agrees with no dialect and the model
//! falls back to approximate mode, `/tokenize` forwarded to the engine; a pod that does not
//! answer leaves the verdict open.

mod common;

use kvsight_router::config::RouterConfig;
use kvsight_router::state::State;
use kvsight_router::tokenize::{Verdict, model_tokenizer};
use kvsight_router::tokenizer_check::check_pending;
use kvsight_sim::server::{SimConfig, SimPod, SimPodHandle};
use kvsight_tokenizer::Dialect;
use serde_json::{Value, json};

use common::*;

async fn sim_with(files: &kvsight_protocol::tokenizer_transfer::TokenizerFiles) -> SimPodHandle {
    sim_in(files, Dialect::Transformers4).await
}

/// An engine serving `files` read in `dialect` (as vLLM on transformers 4, or on 5).
async fn sim_in(
    files: &kvsight_protocol::tokenizer_transfer::TokenizerFiles,
    dialect: Dialect,
) -> SimPodHandle {
    SimPod::start(SimConfig {
        served_model_names: vec![MODEL.into()],
        tokenizer: Some(sim_tokenizer(files)),
        tokenizer_dialect: dialect,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

/// Status, body as JSON, and the `x-kvsight-decision` header's `prefix_mode`.
async fn post(url: &str, body: &Value) -> (u16, Value, Option<String>) {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let a = kvsight_harness::http::post_json(&http, url, body)
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

/// Runs the pending check, which must ask one pod, and asserts it agreed in `dialect`.
async fn assert_checked_agrees(st: &State, dialect: Dialect) {
    assert_eq!(check_pending(st).await, 1);
    assert_eq!(st.tokenizers.verdict(MODEL), Some(Verdict::Agrees(dialect)));
}

/// Runs the pending check, which must ask one pod and find a difference: why it differs.
async fn checked_differs(st: &State) -> String {
    assert_eq!(check_pending(st).await, 1);
    match st.tokenizers.verdict(MODEL) {
        Some(Verdict::Differs(why)) => why,
        other => panic!("expected a difference, got {other:?}"),
    }
}

/// A chat completion of `messages` through `router`: the prefix mode it was routed in.
async fn chat_mode(router: &str, messages: &Value) -> String {
    let (s, _, mode) = post(
        &format!("{router}/v1/chat/completions"),
        &json!({"model": MODEL, "messages": messages, "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200);
    mode.unwrap()
}

/// The router's metrics show `line`.
async fn assert_metric(router: &str, line: &str) {
    let m = metrics(router).await;
    assert!(m.contains(line), "{m}");
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
    assert_checked_agrees(&st, Dialect::Transformers4).await;
    assert_eq!(
        check_pending(&st).await,
        0,
        "a verdict is not asked for twice"
    );

    let router = format!("http://{}", serve(app_and_admin(st.clone())).await);
    let (s, _, mode) = post(
        &format!("{router}/v1/completions"),
        &json!({"model": MODEL, "prompt": "Tell me a story", "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(mode.unwrap(), "exact");
    assert_metric(
        &router,
        r#"kvsight_router_tokenizer_checks_total{model="m",outcome="agrees"} 1"#,
    )
    .await;
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
    let router = format!("http://{}", serve(app_and_admin(st.clone())).await);
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}]});

    // Before the check the router answers /tokenize itself, with its (wrong) ids.
    let (_, engine, _) = post(&format!("{}/tokenize", sim.base_url()), &chat).await;
    let (_, before, _) = post(&format!("{router}/tokenize"), &chat).await;
    assert_ne!(before["tokens"], engine["tokens"]);

    let why = checked_differs(&st).await;
    assert!(why.starts_with("chat: ids part at token"), "{why}");
    assert!(st.tokenizers.get(MODEL).is_none());

    // Now /tokenize is the engine's, and requests are routed on the router's own memory.
    let (s, after, _) = post(&format!("{router}/tokenize"), &chat).await;
    assert_eq!(s, 200);
    assert_eq!(after["tokens"], engine["tokens"]);
    assert_eq!(chat_mode(&router, &chat["messages"]).await, "approximate");

    let (_, debug, _) = get_json(&format!("{router}/debug/pods")).await;
    assert_eq!(debug["tokenizers"][MODEL]["verdict"], "differs");
    assert_eq!(debug["tokenizers"][MODEL]["digest"], router_files.digest());
    assert_metric(
        &router,
        r#"kvsight_router_tokenizer_checks_total{model="m",outcome="differs"} 1"#,
    )
    .await;

    // The same files again (say, from a sidecar) are not fetched or judged again; new files are.
    assert!(st.tokenizers.has(MODEL, Some(&router_files.digest())));
    st.tokenizers
        .insert(MODEL, files.digest(), model_tokenizer(&files).unwrap());
    assert_checked_agrees(&st, Dialect::Transformers4).await;
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
    assert_checked_agrees(&st, Dialect::Transformers4).await;

    // And a skew in the rest of that template is still caught through the chat probe.
    let skewed = with_template(&files, |t| t.replace(r"'|>\n'", r"'|> '"));
    let st = with_tokenizer(&skewed);
    add_pod(&st, "sim", &sim.base_url(), &[], 0);
    let why = checked_differs(&st).await;
    assert!(why.starts_with("chat: "), "{why}");
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
    assert_checked_agrees(&st, Dialect::Transformers4).await;

    // The upgraded engine renders the same template differently (a stand-in for a new
    // transformers release): the same files, another version, other ids.
    let new = sim_with(&with_template(&files, |t| t.replace(r"'|>\n'", r"'|> '"))).await;
    let mut h = hello("new", &new.base_url(), &[]);
    h.engine.engine_version = "0.34.0".into();
    add_hello(&st, h, kvsight_protocol::messages::Phase::Ready, 0);
    let why = checked_differs(&st).await;
    assert!(why.starts_with("chat: "), "{why}");
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
    let router = format!("http://{}", serve(app_and_admin(st.clone())).await);
    assert_metric(
        &router,
        r#"kvsight_router_tokenizer_checks_total{model="m",outcome="error"} 1"#,
    )
    .await;
}

async fn get_json(url: &str) -> (u16, Value, Option<String>) {
    let resp = reqwest::get(url).await.unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap(), None)
}

/// A chat with a system prompt, where every message body follows an added token: transformers 4
/// and 5 part ways at the first body.
fn dialect_chat() -> Value {
    json!({"model": MODEL, "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour, then two more."}]})
}

/// The engine's ids for `body`, and the router's (answered locally when it has a tokenizer in
/// use, else forwarded).
async fn ids_of(sim: &SimPodHandle, router: &str, body: &Value) -> (Value, Value) {
    let (s, engine, _) = post(&format!("{}/tokenize", sim.base_url()), body).await;
    assert_eq!(s, 200, "{engine}");
    let (s, ours, _) = post(&format!("{router}/tokenize"), body).await;
    assert_eq!(s, 200, "{ours}");
    (engine["tokens"].clone(), ours["tokens"].clone())
}

#[tokio::test]
async fn an_engine_on_transformers5_is_matched_in_the_rebuilt_dialect() {
    let test = "an_engine_on_transformers5_is_matched_in_the_rebuilt_dialect";
    let Some(files) = llama2_files(test) else {
        return;
    };
    let sim = sim_in(&files, Dialect::Transformers5Rebuilt).await;
    let st = with_tokenizer(&files);
    add_pod(&st, "sim", &sim.base_url(), &[], 0);
    let router = format!("http://{}", serve(app_and_admin(st.clone())).await);
    let completion = json!({"model": MODEL, "prompt": " Tell me a story."});

    // Until the check the router reads the files as transformers 4 does: not the engine's ids.
    for body in [dialect_chat(), completion.clone()] {
        let (engine, ours) = ids_of(&sim, &router, &body).await;
        assert_ne!(ours, engine, "{body}");
    }
    let (_, debug, _) = get_json(&format!("{router}/debug/pods")).await;
    assert_eq!(debug["tokenizers"][MODEL]["dialect"], "transformers4");
    assert_eq!(
        debug["tokenizers"][MODEL]["dialects"],
        json!(["transformers4", "transformers5_rebuilt"])
    );

    assert_checked_agrees(&st, Dialect::Transformers5Rebuilt).await;
    let tok = st.tokenizers.get(MODEL).expect("in use");
    assert_eq!(tok.dialect(), Dialect::Transformers5Rebuilt);
    for body in [dialect_chat(), completion.clone()] {
        let (engine, ours) = ids_of(&sim, &router, &body).await;
        assert_eq!(ours, engine, "{body}");
    }
    assert_eq!(
        chat_mode(&router, &dialect_chat()["messages"]).await,
        "exact"
    );

    let (_, debug, _) = get_json(&format!("{router}/debug/pods")).await;
    assert_eq!(debug["tokenizers"][MODEL]["verdict"], "agrees");
    assert_eq!(
        debug["tokenizers"][MODEL]["dialect"],
        "transformers5_rebuilt"
    );
    let m = metrics(&router).await;
    for line in [
        r#"kvsight_router_tokenizer_checks_total{model="m",outcome="agrees"} 1"#,
        r#"kvsight_router_tokenizer_dialect_info{model="m",dialect="transformers5_rebuilt"} 1"#,
    ] {
        assert!(m.contains(line), "{line} in {m}");
    }
    assert!(!m.contains(r#"dialect="transformers4""#), "{m}");
}

#[tokio::test]
async fn an_engine_on_transformers4_keeps_the_transformers4_dialect() {
    let test = "an_engine_on_transformers4_keeps_the_transformers4_dialect";
    let Some(files) = llama2_files(test) else {
        return;
    };
    let sim = sim_in(&files, Dialect::Transformers4).await;
    let st = with_tokenizer(&files);
    add_pod(&st, "sim", &sim.base_url(), &[], 0);
    let router = format!("http://{}", serve(app_and_admin(st.clone())).await);
    assert_checked_agrees(&st, Dialect::Transformers4).await;
    for body in [
        dialect_chat(),
        json!({"model": MODEL, "prompt": " Tell me a story."}),
    ] {
        let (engine, ours) = ids_of(&sim, &router, &body).await;
        assert_eq!(ours, engine, "{body}");
    }
    assert_metric(
        &router,
        r#"kvsight_router_tokenizer_dialect_info{model="m",dialect="transformers4"} 1"#,
    )
    .await;
}

#[tokio::test]
async fn an_engine_that_agrees_with_no_dialect_leaves_the_model_approximate() {
    let test = "an_engine_that_agrees_with_no_dialect_leaves_the_model_approximate";
    let Some(files) = llama2_files(test) else {
        return;
    };
    // The engine runs transformers 5 on files whose template revision does not write BOS.
    // (Whitespace after the role tokens would not do: they strip it, in either dialect.)
    let engine_files = with_template(&files, |t| {
        let skewed = t.replace("{{ bos_token }}", "");
        assert_ne!(skewed, t, "the template changed shape");
        skewed
    });
    let sim = sim_in(&engine_files, Dialect::Transformers5Rebuilt).await;
    let st = with_tokenizer(&files);
    add_pod(&st, "sim", &sim.base_url(), &[], 0);
    let router = format!("http://{}", serve(app_and_admin(st.clone())).await);
    let why = checked_differs(&st).await;
    assert!(why.starts_with("chat: ids part at token"), "{why}");
    assert!(
        why.contains("; transformers5_rebuilt: chat: ids part at token"),
        "each dialect's difference is told: {why}"
    );
    assert!(st.tokenizers.get(MODEL).is_none());
    let (engine, forwarded) = ids_of(&sim, &router, &dialect_chat()).await;
    assert_eq!(forwarded, engine, "/tokenize is the engine's");
    assert_eq!(
        chat_mode(&router, &dialect_chat()["messages"]).await,
        "approximate"
    );
    let m = metrics(&router).await;
    assert!(
        m.contains(r#"kvsight_router_tokenizer_checks_total{model="m",outcome="differs"} 1"#),
        "{m}"
    );
    assert!(!m.contains("kvsight_router_tokenizer_dialect_info{"), "{m}");
}

/// One dialect serves every pod of a model: a fleet half upgraded to transformers 5 (old pods
/// agree with transformers 4, new ones only with the rebuilt dialect) is routed approximately.
#[tokio::test]
async fn a_fleet_half_on_transformers5_makes_the_model_approximate() {
    let test = "a_fleet_half_on_transformers5_makes_the_model_approximate";
    let Some(files) = llama2_files(test) else {
        return;
    };
    let old = sim_in(&files, Dialect::Transformers4).await;
    let st = with_tokenizer(&files);
    add_pod(&st, "old", &old.base_url(), &[], 0);
    assert_checked_agrees(&st, Dialect::Transformers4).await;

    let new = sim_in(&files, Dialect::Transformers5Rebuilt).await;
    let mut h = hello("new", &new.base_url(), &[]);
    h.engine.engine_version = "0.32.0".into();
    add_hello(&st, h, kvsight_protocol::messages::Phase::Ready, 0);
    let why = checked_differs(&st).await;
    assert!(
        why.contains("this engine agrees with transformers5_rebuilt")
            && why.contains("one dialect cannot serve both"),
        "{why}"
    );
    assert!(st.tokenizers.get(MODEL).is_none());
}
