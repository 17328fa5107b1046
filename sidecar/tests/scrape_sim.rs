//! The sidecar's Prometheus reader on vllm-sim's `/metrics` over real sockets: the simulator's
//! exposition carries what the sidecar reads (queues, KV use, `cache_config_info`), and it has
//! every name, type and label of vLLM 0.33's own (the `../shared` fixture), as the sidecar's
//! parser splits them. Here rather than in kvsight-sim so the simulator never depends on the
//! sidecar.

use std::net::SocketAddr;
use std::time::Duration;

use kvsight_sim::engine::EngineConfig;
use kvsight_sim::server::{SimConfig, SimPod, SimPodHandle};
use serde_json::{Value, json};

async fn pod(config: SimConfig) -> SimPodHandle {
    SimPod::start(config).await.expect("pod starts")
}

/// POSTs a completion request and reads the whole answer.
async fn post(addr: SocketAddr, body: &Value) -> anyhow::Result<String> {
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await?;
    Ok(resp.error_for_status()?.text().await?)
}

/// The pod's `/metrics` exposition.
async fn metrics(addr: SocketAddr) -> anyhow::Result<String> {
    let resp = reqwest::get(format!("http://{addr}/metrics")).await?;
    Ok(resp.error_for_status()?.text().await?)
}

#[tokio::test]
async fn metrics_parse_with_the_sidecar_and_show_max_num_seqs() -> anyhow::Result<()> {
    // Real-time steps of 10 ms: five long requests stay in the engine while we look.
    let p = pod(SimConfig {
        engine: EngineConfig {
            max_num_seqs: 2,
            time_scale: 1.0,
            ..EngineConfig::fast()
        },
        ..SimConfig::default()
    })
    .await;
    let addr = p.http_addr();
    let mut clients = Vec::new();
    for i in 0..5u32 {
        clients.push(tokio::spawn(async move {
            post(addr, &json!({"prompt": [i + 1, 2, 3], "max_tokens": 2000})).await
        }));
    }
    let mut seen = None;
    for _ in 0..200 {
        let text = metrics(addr).await?;
        let m = kvsight_sidecar::scrape::parse(&text)?;
        if m.running > 0.0 && m.running + m.waiting >= 5.0 {
            seen = Some(m);
            break;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let m = seen.expect("five requests reach the engine");
    assert_eq!(m.running, 2.0);
    assert_eq!(m.waiting, 3.0);
    assert!(m.kv_usage > 0.0);
    let cc = m.cache_config.expect("cache_config_info");
    assert_eq!(cc.block_size, 16);
    assert_eq!(cc.num_gpu_blocks, 4096);
    assert!(cc.enable_prefix_caching);
    assert_eq!(m.engines, 1);
    drop(p);
    for c in clients {
        c.abort();
    }
    Ok(())
}

#[tokio::test]
async fn metrics_have_the_fixture_names_types_and_labels() -> anyhow::Result<()> {
    let Some(path) = kvsight_harness::fixture_or_skip(
        "metrics_have_the_fixture_names_types_and_labels",
        "fixtures/vllm/metrics-0.33.txt",
    ) else {
        return Ok(());
    };
    let fixture = std::fs::read_to_string(path)?;
    let p = pod(SimConfig {
        engine: EngineConfig::fast(),
        lora_modules: vec![("sql-lora".into(), "/a".into())],
        enable_prompt_tokens_details: true,
        ..SimConfig::default()
    })
    .await;
    post(
        p.http_addr(),
        &json!({"prompt": [1, 2, 3], "max_tokens": 2}),
    )
    .await?;
    let ours = metrics(p.http_addr()).await?;
    // Every HELP and TYPE line of vLLM 0.33's exposition, verbatim.
    for line in fixture.lines().filter(|l| l.starts_with("# ")) {
        assert!(ours.lines().any(|l| l == line), "missing {line:?}");
    }
    // Every sample name with the same label keys (and `le` bounds) as vLLM's.
    use std::collections::BTreeSet;
    /// (sample name, label keys, `le` value)
    type Shape = (String, Vec<String>, Option<String>);
    let keys = |text: &str| -> anyhow::Result<BTreeSet<Shape>> {
        Ok(kvsight_sidecar::scrape::samples(text)?
            .into_iter()
            .map(|s| {
                let le = s.labels.get("le").cloned();
                let names = s.labels.keys().map(|k| (*k).to_owned()).collect();
                (s.name.to_owned(), names, le)
            })
            .collect())
    };
    let (want, have) = (keys(&fixture)?, keys(&ours)?);
    let missing: Vec<_> = want.difference(&have).collect();
    // The fixture's prefill-token buckets stop at its max_model_len; ours at 4096.
    let missing: Vec<_> = missing
        .into_iter()
        .filter(|(n, _, le)| {
            !(n == "vllm:request_prefill_kv_computed_tokens_bucket"
                && le.as_deref().and_then(|v| v.parse::<f64>().ok()) > Some(4096.0))
        })
        .collect();
    assert!(missing.is_empty(), "samples missing: {missing:?}");
    Ok(())
}
