//! Handler tests through `app().oneshot()`, no socket: every error the router itself produces
//! is vLLM's OpenAI shape with the right status, and the read-only endpoints report what the
//! registry holds.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tower::ServiceExt;

use common::*;
use kvsight_protocol::messages::Phase;
use kvsight_router::app;
use kvsight_router::config::RouterConfig;

async fn call(
    state: std::sync::Arc<kvsight_router::State>,
    req: Request<Body>,
) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    call_on(app(state), req).await
}

/// The admin listener's app (`/metrics`, `/debug/pods`).
async fn call_admin(
    state: std::sync::Arc<kvsight_router::State>,
    req: Request<Body>,
) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    call_on(kvsight_router::http::admin_app(state), req).await
}

async fn call_on(
    app: axum::Router,
    req: Request<Body>,
) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    let resp = app.oneshot(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = resp
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec();
    (status, headers, body)
}

fn post(path: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.into())
        .unwrap()
}

/// vLLM's error object: every field present, `code` equal to the status.
fn assert_openai_error(status: StatusCode, body: &[u8], want: StatusCode, param: Value) -> Value {
    assert_eq!(status, want, "body: {}", String::from_utf8_lossy(body));
    let v: Value = serde_json::from_slice(body).expect("error body is JSON");
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert_eq!(e["code"], json!(want.as_u16()), "{v}");
    assert_eq!(e["param"], param, "{v}");
    v
}

#[tokio::test]
async fn body_over_the_limit_is_413_naming_the_limit() {
    let cfg = config_yaml("limits:\n  bodyBytes: 64\n");
    let (s, _, b) = call(state(cfg), post("/v1/completions", vec![b' '; 65])).await;
    let v = assert_openai_error(s, &b, StatusCode::PAYLOAD_TOO_LARGE, Value::Null);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("64 bytes"),
        "{v}"
    );
}

#[tokio::test]
async fn bad_json_is_400() {
    let (s, _, b) = call(
        state(RouterConfig::default()),
        post("/v1/completions", "{nope"),
    )
    .await;
    assert_openai_error(s, &b, StatusCode::BAD_REQUEST, Value::Null);
}

#[tokio::test]
async fn missing_model_is_400_with_param_model() {
    let (s, _, b) = call(
        state(RouterConfig::default()),
        post("/v1/chat/completions", r#"{"messages":[]}"#),
    )
    .await;
    assert_openai_error(s, &b, StatusCode::BAD_REQUEST, json!("model"));
}

#[tokio::test]
async fn unknown_model_is_404_with_param_model() {
    let st = state(RouterConfig::default());
    add_pod(&st, "a", "http://127.0.0.1:9", &[], 0);
    let (s, _, b) = call(
        st,
        post("/v1/completions", r#"{"model":"nope","prompt":"x"}"#),
    )
    .await;
    let v = assert_openai_error(s, &b, StatusCode::NOT_FOUND, json!("model"));
    assert_eq!(v["error"]["type"], "NotFoundError");
}

#[tokio::test]
async fn no_ready_pod_is_503_with_retry_after() {
    let st = state(RouterConfig::default());
    let (key, conn) = add_pod(&st, "a", "http://127.0.0.1:9", &[], 0);
    // The pod serves the model but is warming up: known model, nobody ready.
    st.registry()
        .apply_load(
            &key,
            conn,
            load(Phase::Warming, 0, 0),
            std::time::Instant::now(),
        )
        .unwrap();
    let (s, h, b) = call(st, post("/v1/completions", r#"{"model":"m","prompt":"x"}"#)).await;
    assert_openai_error(s, &b, StatusCode::SERVICE_UNAVAILABLE, Value::Null);
    assert!(h.get(header::RETRY_AFTER).is_some());
    // The request id is created when the client sent none.
    assert!(h.get("x-request-id").is_some());
}

#[tokio::test]
async fn an_unlisted_path_is_an_openai_404_and_never_forwarded() {
    let st = state(RouterConfig::default());
    add_pod(&st, "a", "http://127.0.0.1:9", &[], 0);
    let (s, _, b) = call(st, post("/v1/embeddings", r#"{"model":"m"}"#)).await;
    assert_openai_error(s, &b, StatusCode::NOT_FOUND, Value::Null);
}

#[tokio::test]
async fn ready_turns_503_when_draining_while_health_stays_200() {
    let st = state(RouterConfig::default());
    let get = |p: &str| Request::get(p).body(Body::empty()).unwrap();
    assert_eq!(call(st.clone(), get("/ready")).await.0, StatusCode::OK);
    st.begin_drain();
    let (s, h, _) = call(st.clone(), get("/ready")).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert!(h.get(header::RETRY_AFTER).is_some());
    assert_eq!(call(st.clone(), get("/health")).await.0, StatusCode::OK);
    // New generation requests are refused too.
    let (s, _, b) = call(st, post("/v1/completions", r#"{"model":"m","prompt":"x"}"#)).await;
    assert_openai_error(s, &b, StatusCode::SERVICE_UNAVAILABLE, Value::Null);
}

#[tokio::test]
async fn models_lists_ready_pods_models_and_lora_cards_only() {
    let st = state(RouterConfig::default());
    add_pod(&st, "a", "http://127.0.0.1:9", &[], 0);
    let (key, conn) = {
        let mut reg = st.registry();
        let mut h = hello("b", "http://127.0.0.1:9", &[]);
        h.models = vec!["draining-only".into()];
        h.lora_adapters.clear();
        reg.register(h, std::time::Instant::now())
    };
    st.registry()
        .apply_load(
            &key,
            conn,
            load(Phase::Draining, 0, 0),
            std::time::Instant::now(),
        )
        .unwrap();
    let (s, _, b) = call(st, Request::get("/v1/models").body(Body::empty()).unwrap()).await;
    assert_eq!(s, StatusCode::OK);
    let v: Value = serde_json::from_slice(&b).unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["m", "sql-lora"]);
    assert_eq!(v["data"][1]["parent"], "m");
}

#[tokio::test]
async fn debug_pods_and_metrics_report_the_registry() {
    let st = state(RouterConfig::default());
    add_pod(&st, "a", "http://127.0.0.1:9", &[], 3);
    let (s, _, b) = call_admin(
        st.clone(),
        Request::get("/debug/pods").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let v: Value = serde_json::from_slice(&b).unwrap();
    let p = &v["pods"][0];
    assert_eq!(p["pod"], "ns/a");
    assert_eq!(p["phase"], "ready");
    assert_eq!(p["load"]["running"], 3);
    assert_eq!(p["inflight"], 0);
    let (s, _, b) = call_admin(st, Request::get("/metrics").body(Body::empty()).unwrap()).await;
    assert_eq!(s, StatusCode::OK);
    let text = String::from_utf8(b).unwrap();
    assert!(
        text.contains(r#"kvsight_router_pods{phase="ready"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"kvsight_router_pod_prefix_cache_hit_ratio{pod="ns/a"} 0.5"#),
        "{text}"
    );
}

#[tokio::test]
async fn tokenize_without_tokenizer_or_pod_is_an_openai_error() {
    let (s, _, b) = call(
        state(RouterConfig::default()),
        post("/tokenize", r#"{"model":"m","prompt":"hi"}"#),
    )
    .await;
    assert_openai_error(s, &b, StatusCode::NOT_FOUND, json!("model"));
}

#[tokio::test]
async fn tokenize_answers_locally_with_the_models_tokenizer() {
    let Some(dir) = kvsight_harness::or_skip(
        "tokenize_answers_locally_with_the_models_tokenizer",
        kvsight_sim::own_tokenizer::ensure_dir(),
    ) else {
        return;
    };
    let files = kvsight_process::tokenizer_dir::read(&dir).unwrap();
    let direct = kvsight_tokenizer::ModelTokenizer::from_bytes(
        &files.tokenizer_json,
        files.tokenizer_config.as_deref(),
    )
    .unwrap();
    let st = state(RouterConfig::default());
    add_pod(&st, "a", "http://127.0.0.1:9", &[], 0);
    st.tokenizers.insert(
        MODEL,
        files.digest(),
        kvsight_router::tokenize::model_tokenizer(&files).unwrap(),
    );
    let prompt = "The quick brown fox jumps over the lazy dog.";
    let (s, _, b) = call(
        st.clone(),
        post(
            "/tokenize",
            json!({"model": MODEL, "prompt": prompt}).to_string(),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let v: Value = serde_json::from_slice(&b).unwrap();
    let want = direct.encode_completion(prompt).unwrap();
    assert_eq!(v["tokens"], json!(want));
    assert_eq!(v["count"], json!(want.len()));
    assert_eq!(v["max_model_len"], 4096);

    // Chat: rendered with the template, no special tokens added again.
    let msgs = json!([{"role": "user", "content": "Hello there"}]);
    let (s, _, b) = call(
        st,
        post(
            "/tokenize",
            json!({"model": MODEL, "messages": msgs}).to_string(),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let v: Value = serde_json::from_slice(&b).unwrap();
    let want = direct
        .encode_chat(
            &[kvsight_tokenizer::ChatMessage::new("user", "Hello there")],
            true,
            &Default::default(),
        )
        .unwrap();
    assert_eq!(v["tokens"], json!(want));
}
