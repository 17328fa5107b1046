//! vllm-sim over real loopback sockets: the OpenAI endpoints' bodies and SSE framing as vLLM 0.33
//! writes them, prefix-cache hits seen through `usage.prompt_tokens_details.cached_tokens` and
//! `/metrics`, scheduling limits and timings visible in the metrics.

mod sim_support;

use std::time::Duration;

use kvsight_sim::engine::EngineConfig;
use kvsight_sim::server::{SimConfig, SimPod, SimPodHandle};
use serde_json::{Value, json};
use sim_support::{get, metric, post_json};

async fn pod(config: SimConfig) -> SimPodHandle {
    SimPod::start(config).await.expect("pod starts")
}

fn details_config() -> SimConfig {
    SimConfig {
        engine: EngineConfig::fast(),
        enable_prompt_tokens_details: true,
        ..SimConfig::default()
    }
}

#[tokio::test]
async fn repeated_prompt_hits_exactly_its_full_blocks() -> anyhow::Result<()> {
    let p = pod(details_config()).await;
    // 100 tokens with block size 16: 6 full blocks; the last token is always recomputed, so a
    // repeat hits (100 - 1) / 16 * 16 = 96 tokens.
    let prompt: Vec<u32> = (1000..1100).collect();
    let body = json!({"model": "vllm-sim", "prompt": prompt, "max_tokens": 2});
    let first = post_json(p.http_addr(), "/v1/completions", &body).await?;
    assert_eq!(first.status, 200, "{}", first.text());
    let first = first.json()?;
    assert_eq!(first["usage"]["prompt_tokens"], 100);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let second = post_json(p.http_addr(), "/v1/completions", &body)
        .await?
        .json()?;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        96
    );
    assert_eq!(second["usage"]["completion_tokens"], 2);
    assert_eq!(second["usage"]["total_tokens"], 102);

    let m = get(p.http_addr(), "/metrics").await?.text();
    assert_eq!(metric(&m, "vllm:prefix_cache_queries_total"), Some(200.0));
    assert_eq!(metric(&m, "vllm:prefix_cache_hits_total"), Some(96.0));
    assert_eq!(metric(&m, "vllm:prompt_tokens_total"), Some(200.0));
    assert_eq!(
        metric(&m, "vllm:request_prefill_kv_computed_tokens_sum"),
        Some(104.0)
    );

    // With prefix caching off nothing is ever a hit.
    let off = pod(SimConfig {
        engine: EngineConfig {
            enable_prefix_caching: false,
            ..EngineConfig::fast()
        },
        enable_prompt_tokens_details: true,
        ..SimConfig::default()
    })
    .await;
    for _ in 0..2 {
        let r = post_json(off.http_addr(), "/v1/completions", &body)
            .await?
            .json()?;
        assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    }
    let m = get(off.http_addr(), "/metrics").await?.text();
    assert_eq!(metric(&m, "vllm:prefix_cache_hits_total"), Some(0.0));
    assert!(m.contains("enable_prefix_caching=\"False\""));
    Ok(())
}

#[tokio::test]
async fn completion_body_has_vllm_fields_in_order() -> anyhow::Result<()> {
    let p = pod(details_config()).await;
    let r = post_json(
        p.http_addr(),
        "/v1/completions",
        &json!({"prompt": "hello world", "max_tokens": 3}),
    )
    .await?;
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .unwrap_or("")
            .starts_with("application/json")
    );
    let v = r.json()?;
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "id",
            "object",
            "created",
            "model",
            "choices",
            "service_tier",
            "system_fingerprint",
            "usage",
            "kv_transfer_params",
            "ec_transfer_params",
            "metrics"
        ]
    );
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "vllm-sim");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["index"], 0);
    // Deterministic text: the same request gives the same words.
    let again = post_json(
        p.http_addr(),
        "/v1/completions",
        &json!({"prompt": "hello world", "max_tokens": 3}),
    )
    .await?
    .json()?;
    assert_eq!(v["choices"][0]["text"], again["choices"][0]["text"]);
    assert_eq!(
        v["choices"][0]["text"].as_str().unwrap().split(' ').count(),
        3
    );

    // Default max_tokens is 16; a list of prompts gives one choice per prompt.
    let multi = post_json(
        p.http_addr(),
        "/v1/completions",
        &json!({"prompt": ["a", "b"]}),
    )
    .await?
    .json()?;
    assert_eq!(multi["choices"].as_array().unwrap().len(), 2);
    assert_eq!(multi["usage"]["completion_tokens"], 32);
    let lists = post_json(
        p.http_addr(),
        "/v1/completions",
        &json!({"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 1}),
    )
    .await?
    .json()?;
    assert_eq!(lists["usage"]["prompt_tokens"], 5);
    Ok(())
}

#[tokio::test]
async fn errors_match_vllm_bodies() -> anyhow::Result<()> {
    let p = pod(SimConfig {
        engine: EngineConfig {
            max_model_len: 64,
            ..EngineConfig::fast()
        },
        ..SimConfig::default()
    })
    .await;
    let long: Vec<u32> = (0..70).collect();
    for stream in [false, true] {
        let r = post_json(
            p.http_addr(),
            "/v1/completions",
            &json!({"model": "vllm-sim", "prompt": long, "stream": stream}),
        )
        .await?;
        assert_eq!(r.status, 400);
        assert_eq!(
            r.text(),
            "{\"error\":{\"message\":\"This model's maximum context length is 64 tokens. However, \
             your prompt contains 70 input tokens, which exceeds this limit even without any \
             output tokens. Please reduce the length of the input prompt. \
             (parameter=input_tokens, value=70)\",\"type\":\"BadRequestError\",\"param\":\
             \"input_tokens\",\"code\":400}}"
        );
    }
    let r = post_json(
        p.http_addr(),
        "/v1/completions",
        &json!({"model": "nope", "prompt": "x"}),
    )
    .await?;
    assert_eq!(r.status, 404);
    assert_eq!(
        r.text(),
        "{\"error\":{\"message\":\"The model `nope` does not exist. Valid aliases: vllm-sim.\",\
         \"type\":\"NotFoundError\",\"param\":\"model\",\"code\":404}}"
    );
    let r = sim_support::request(
        p.http_addr(),
        "POST",
        "/v1/chat/completions",
        Some(b"{\"model\": "),
    )
    .await?;
    assert_eq!(r.status, 400);
    let e = r.json()?;
    assert_eq!(e["error"]["code"], 400);
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("json_invalid")
    );
    // cache_salt is validated as vLLM 0.33 does.
    let r = post_json(
        p.http_addr(),
        "/v1/completions",
        &json!({"prompt": "x", "cache_salt": "a/b"}),
    )
    .await?;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()?["error"]["param"], "cache_salt");
    let ok = post_json(
        p.http_addr(),
        "/v1/completions",
        &json!({"prompt": "x", "cache_salt": "tenant-1", "max_tokens": 1}),
    )
    .await?;
    assert_eq!(ok.status, 200);
    Ok(())
}

/// `"stream": [1]`, `"maybe"` and `1` must not be answered 200 unstreamed. vLLM reads
/// `stream` as pydantic's lax bool: `"yes"` and `1` stream, a list or `"maybe"` is a 400.
#[tokio::test]
async fn stream_is_read_as_pydantics_lax_bool() -> anyhow::Result<()> {
    let p = pod(SimConfig {
        engine: EngineConfig::fast(),
        ..SimConfig::default()
    })
    .await;
    for (stream, streams) in [
        (json!("yes"), true),
        (json!(1), true),
        (json!("On"), true),
        (json!("0"), false),
        (json!(null), false),
        (json!("no"), false),
    ] {
        let r = post_json(
            p.http_addr(),
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": 1, "stream": stream}),
        )
        .await?;
        assert_eq!(r.status, 200, "stream {stream}");
        assert_eq!(
            r.text().starts_with("data: "),
            streams,
            "stream {stream}: {}",
            r.text()
        );
    }
    for (stream, kind) in [
        (json!([1]), "bool_type"),
        (json!("maybe"), "bool_parsing"),
        (json!(2), "bool_parsing"),
        (json!(1.5), "bool_parsing"),
    ] {
        let r = post_json(
            p.http_addr(),
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": 1, "stream": stream}),
        )
        .await?;
        assert_eq!(r.status, 400, "stream {stream}");
        let e = r.json()?;
        assert_eq!(e["error"]["code"], 400);
        assert_eq!(e["error"]["param"], "body.stream");
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.contains(kind) && msg.contains("body.stream"), "{msg}");
    }
    Ok(())
}

#[tokio::test]
async fn sse_framing_matches_vllm() -> anyhow::Result<()> {
    let p = pod(details_config()).await;
    let r = post_json(
        p.http_addr(),
        "/v1/completions",
        &json!({"prompt": [5, 6, 7], "max_tokens": 3, "stream": true,
                "stream_options": {"include_usage": true}}),
    )
    .await?;
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .unwrap_or("")
            .starts_with("text/event-stream")
    );
    let events = r.sse_events()?;
    assert_eq!(events.len(), 5, "{events:?}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..4]
        .iter()
        .map(|e| serde_json::from_str(e))
        .collect::<Result<_, _>>()?;
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("cmpl-"));
    for c in &chunks[..3] {
        assert_eq!(c["id"], id);
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["choices"].as_array().unwrap().len(), 1);
        assert!(c.get("usage").is_none());
    }
    assert_eq!(chunks[0]["choices"][0]["finish_reason"], Value::Null);
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[3]["choices"], json!([]));
    assert_eq!(
        chunks[3]["usage"],
        json!({"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    // The byte framing of the whole stream: data events only, [DONE] last.
    assert!(r.text().ends_with("}\n\ndata: [DONE]\n\n"));

    // Chat: the first chunk announces the role with empty content.
    let r = post_json(
        p.http_addr(),
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "stream": true}),
    )
    .await?;
    let events = r.sse_events()?;
    assert_eq!(events.len(), 4, "{events:?}");
    let first: Value = serde_json::from_str(&events[0])?;
    assert!(first["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(
        first["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let last: Value = serde_json::from_str(&events[2])?;
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(events[3], "[DONE]");
    Ok(())
}

/// `--stream-interval 4` as vLLM's output processor: the first token alone, then chunks of four,
/// the rest with the finish; the usage still counts every token.
#[tokio::test]
async fn stream_interval_batches_tokens_after_the_first() -> anyhow::Result<()> {
    let p = pod(SimConfig {
        stream_interval: 4,
        ..details_config()
    })
    .await;
    let r = post_json(
        p.http_addr(),
        "/v1/completions",
        &json!({"prompt": [5, 6, 7], "max_tokens": 10, "stream": true, "ignore_eos": true,
                "stream_options": {"include_usage": true}}),
    )
    .await?;
    assert_eq!(r.status, 200);
    let events = r.sse_events()?;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e))
        .collect::<Result<_, _>>()?;
    // 1 + 4 + 4 + 1 tokens, then the usage chunk.
    assert_eq!(chunks.len(), 5, "{events:?}");
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], Value::Null);
    assert_eq!(chunks[4]["usage"]["completion_tokens"], 10);
    Ok(())
}

#[tokio::test]
async fn chat_tokenize_models_health_version() -> anyhow::Result<()> {
    let p = pod(SimConfig {
        lora_modules: vec![("sql-lora".into(), "/adapters/sql".into())],
        ..details_config()
    })
    .await;
    let chat = post_json(
        p.http_addr(),
        "/v1/chat/completions",
        &json!({"model": "sql-lora", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4}),
    )
    .await?;
    assert_eq!(chat.status, 200, "{}", chat.text());
    let chat = chat.json()?;
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["model"], "sql-lora");
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    assert_eq!(chat["usage"]["completion_tokens"], 4);

    let tok = post_json(
        p.http_addr(),
        "/tokenize",
        &json!({"model": "vllm-sim", "messages": [{"role": "user", "content": "hi"}],
                "add_generation_prompt": true}),
    )
    .await?
    .json()?;
    // /tokenize and the chat request count the same prompt.
    assert_eq!(tok["count"], chat["usage"]["prompt_tokens"]);
    assert_eq!(tok["max_model_len"], 4096);
    let rendered = post_json(
        p.http_addr(),
        "/v1/chat/completions/render",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .await?
    .json()?;
    assert_eq!(rendered["token_ids"], tok["tokens"]);
    let rc = post_json(
        p.http_addr(),
        "/v1/completions/render",
        &json!({"prompt": ["ab", "c"]}),
    )
    .await?
    .json()?;
    assert_eq!(rc.as_array().map(Vec::len), Some(2));

    let models = get(p.http_addr(), "/v1/models").await?.json()?;
    assert_eq!(models["object"], "list");
    let data = models["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data[0]["id"], "vllm-sim");
    assert_eq!(data[0]["owned_by"], "vllm");
    assert_eq!(data[1]["id"], "sql-lora");
    assert_eq!(data[1]["parent"], "vllm-sim");
    assert_eq!(data[1]["root"], "/adapters/sql");

    let h = get(p.http_addr(), "/health").await?;
    assert_eq!((h.status, h.body.len()), (200, 0));
    assert_eq!(get(p.http_addr(), "/ping").await?.status, 200);
    assert_eq!(
        get(p.http_addr(), "/version").await?.text(),
        "{\"version\":\"0.33.0\"}"
    );
    let m = get(p.http_addr(), "/metrics").await?.text();
    assert!(m.contains("vllm:lora_requests_info{max_lora=\"1\""), "{m}");
    Ok(())
}

#[tokio::test]
async fn ttft_grows_with_uncached_tokens() -> anyhow::Result<()> {
    // 1 000 prefill tokens/s scaled by 0.05: 1 900 uncached tokens take ~95 ms, a cached repeat
    // recomputes 12 tokens (~0.6 ms).
    let p = pod(SimConfig {
        engine: EngineConfig {
            time_scale: 0.05,
            cost: kvsight_sim::engine::CostModel {
                prefill_tokens_per_s: 1000.0,
                compile_stall: Duration::ZERO,
                ..Default::default()
            },
            ..EngineConfig::default()
        },
        ..SimConfig::default()
    })
    .await;
    let prompt: Vec<u32> = (0..1900).collect();
    let body = json!({"prompt": prompt, "max_tokens": 1});
    let ttft_sum = |text: &str| metric(text, "vllm:time_to_first_token_seconds_sum").unwrap();
    post_json(p.http_addr(), "/v1/completions", &body).await?;
    let after_cold = ttft_sum(&get(p.http_addr(), "/metrics").await?.text());
    post_json(p.http_addr(), "/v1/completions", &body).await?;
    let after_warm = ttft_sum(&get(p.http_addr(), "/metrics").await?.text());
    let cold = after_cold;
    let warm = after_warm - after_cold;
    assert!(cold >= 0.09, "cold TTFT {cold}");
    assert!(warm < cold / 4.0, "warm TTFT {warm} vs cold {cold}");
    Ok(())
}

#[tokio::test]
async fn compile_stall_once_per_bucket() -> anyhow::Result<()> {
    // A 4 s stall scaled by 0.05 = 200 ms, paid by the first step of each new token bucket.
    let p = pod(SimConfig {
        engine: EngineConfig {
            time_scale: 0.05,
            cost: kvsight_sim::engine::CostModel {
                compile_stall: Duration::from_secs(4),
                ..Default::default()
            },
            ..EngineConfig::default()
        },
        ..SimConfig::default()
    })
    .await;
    let mut last = 0.0;
    let mut ttfts = Vec::new();
    // 100-token prompts (bucket 128) twice, then a 1 000-token prompt (bucket 1 024).
    for (start, len) in [(0u32, 100u32), (10_000, 100), (20_000, 1000)] {
        let prompt: Vec<u32> = (start..start + len).collect();
        let r = post_json(
            p.http_addr(),
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await?;
        assert_eq!(r.status, 200);
        let sum = metric(
            &get(p.http_addr(), "/metrics").await?.text(),
            "vllm:time_to_first_token_seconds_sum",
        )
        .unwrap();
        ttfts.push(sum - last);
        last = sum;
    }
    assert!(ttfts[0] >= 0.2, "{ttfts:?}");
    assert!(ttfts[1] < 0.1, "{ttfts:?}");
    assert!(ttfts[2] >= 0.2, "{ttfts:?}");
    Ok(())
}

#[tokio::test]
async fn long_prompts_exhaust_blocks_preempt_and_still_complete() -> anyhow::Result<()> {
    // 64 blocks of 16 tokens; four 400-token prompts generating 100 tokens each need about
    // 4 × 32 blocks at the end: the engine must preempt (recompute) and still finish them all.
    let p = pod(SimConfig {
        // Slow enough (about 100 ms per request) that the four requests overlap in the engine.
        engine: EngineConfig {
            num_gpu_blocks: 64,
            max_model_len: 512,
            time_scale: 0.05,
            ..EngineConfig::fast()
        },
        ..SimConfig::default()
    })
    .await;
    let addr = p.http_addr();
    let clients: Vec<_> = (0..4u32)
        .map(|i| {
            tokio::spawn(async move {
                let prompt: Vec<u32> = (0..400).map(|t| 1 + i * 1000 + t).collect();
                post_json(
                    addr,
                    "/v1/completions",
                    &json!({"prompt": prompt, "max_tokens": 100, "ignore_eos": true}),
                )
                .await
            })
        })
        .collect();
    for c in clients {
        let r = tokio::time::timeout(Duration::from_secs(30), c).await???;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()?["usage"]["completion_tokens"], 100);
    }
    let m = get(addr, "/metrics").await?.text();
    let preemptions = metric(&m, "vllm:num_preemptions_total").unwrap_or(0.0);
    assert!(preemptions > 0.0, "no preemption:\n{m}");
    Ok(())
}
