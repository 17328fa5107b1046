//! What operators watch: the Grafana dashboard's queries name only metrics the parts export, and
//! Sight (predicted vs engine cached tokens) records what the client saw.
//!
//! The dashboard lives once, in the chart (`helm/kvsight/dashboards/kvsight.json`, which the
//! chart's ConfigMap embeds: Helm reads only files inside the chart); `docs/grafana/kvsight.json`
//! is a symbolic link to it. Every metric name in its PromQL is checked against the expositions
//! of a running router, sidecar and vllm-sim (whose exposition follows vLLM 0.33's), so renaming
//! a metric fails this test instead of silently emptying a panel.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use kvsight_sim::engine::EngineConfig;
use kvsight_testbed::cluster::{Cluster, ClusterConfig, PodSpec, WAIT, eventually};
use serde_json::{Value, json};

const MODEL: &str = "obs-model";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

async fn one_pod_cluster(test: &str) -> Option<Cluster> {
    kvsight_testbed::cluster::own_tokenizer_or_skip(test)?;
    let engine = EngineConfig::builder()
        .max_model_len(2048)
        .compile_stall(std::time::Duration::ZERO)
        .time_scale(0.01)
        .build()
        .unwrap();
    let pod = PodSpec::new("p0", MODEL, engine).unwrap();
    let cluster = Cluster::start(ClusterConfig::new(vec![pod])).await.unwrap();
    cluster.wait_all_routable(WAIT).await.unwrap();
    Some(cluster)
}

async fn get(cluster: &Cluster, url: String) -> String {
    let resp = cluster.http.get(url).send().await.unwrap();
    assert!(resp.status().is_success());
    resp.text().await.unwrap()
}

/// Every sample name an exposition can have: the samples it shows, and the ones its `# TYPE`
/// lines promise (a family with no series yet shows only its HELP and TYPE).
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            let suffixes: &[&str] = match kind {
                "counter" => &["", "_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                "summary" => &["", "_sum", "_count"],
                "info" => &["_info"],
                _ => &[""],
            };
            names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_owned());
        }
    }
    names
}

/// The metric names a PromQL expression reads, as Prometheus's lexer tells them from functions,
/// keywords, label lists, durations, strings and Grafana's `$variables`.
fn promql_metrics(expr: &str) -> BTreeSet<String> {
    const KEYWORDS: [&str; 25] = [
        // Aggregation operators: keywords to Prometheus's lexer, never metric names.
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
    ];
    const LABEL_LISTS: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let b = expr.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    // From an opening quote to just past its closing one.
    let skip_string = |mut i: usize| {
        let q = b[i];
        i += 1;
        while i < b.len() && b[i] != q {
            i += if b[i] == b'\\' { 2 } else { 1 };
        }
        i + 1
    };
    // From an opening bracket to just past its match, stepping over quoted strings.
    let skip_group = |mut i: usize, open: u8, close: u8| {
        let mut depth = 0;
        while i < b.len() {
            match b[i] {
                b'"' | b'\'' | b'`' => {
                    i = skip_string(i);
                    continue;
                }
                c if c == open => depth += 1,
                c if c == close => {
                    depth -= 1;
                    if depth == 0 {
                        return i + 1;
                    }
                }
                _ => {}
            }
            i += 1;
        }
        i
    };
    let mut out = BTreeSet::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'{' {
            i = skip_group(i, b'{', b'}');
        } else if c == b'[' {
            i = skip_group(i, b'[', b']');
        } else if c == b'"' || c == b'\'' || c == b'`' {
            i = skip_string(i);
        } else if c == b'$' || c.is_ascii_digit() || c == b'.' {
            // A Grafana variable, a number or a duration.
            i += 1;
            while i < b.len() && (ident(b[i]) || b[i] == b'.') {
                i += 1;
            }
        } else if ident(c) {
            let start = i;
            while i < b.len() && ident(b[i]) {
                i += 1;
            }
            let word = &expr[start..i];
            let mut j = i;
            while j < b.len() && b[j].is_ascii_whitespace() {
                j += 1;
            }
            let call = b.get(j) == Some(&b'(');
            if LABEL_LISTS.contains(&word) && call {
                i = skip_group(j, b'(', b')');
            } else if !call
                && !KEYWORDS.contains(&word)
                && !["inf", "nan"].contains(&word.to_ascii_lowercase().as_str())
            {
                out.insert(word.to_owned());
            }
        } else {
            i += 1;
        }
    }
    out
}

/// Every PromQL query of the dashboard: panel targets and the query variables'
/// `label_values(<selector>, <label>)`.
fn dashboard_queries(dash: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        if p["type"] == "row" {
            continue;
        }
        let exprs: Vec<&str> = p["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t["expr"].as_str())
            .collect();
        assert!(!exprs.is_empty(), "panel {} has no query", p["title"]);
        out.extend(exprs.into_iter().map(str::to_owned));
    }
    for v in dash["templating"]["list"].as_array().expect("templating") {
        if v["type"] != "query" {
            continue;
        }
        let q = v["query"]["query"]
            .as_str()
            .expect("a query variable's query");
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|r| r.rsplit_once(','))
            .map(|(sel, _)| sel)
            .unwrap_or_else(|| panic!("variable {} is not label_values(...): {q}", v["name"]));
        out.push(inner.to_owned());
    }
    out
}

#[test]
fn promql_names_are_read_as_prometheus_does() {
    let expr = r#"histogram_quantile(0.9, sum by (le, pod) (rate(a_bucket{namespace="$ns", le=~"0|0\\.0"}[$__rate_interval]))) / on (pod) group_left max by (pod) (vllm:b{x="y}"} offset 5m) > bool 1e3 and c"#;
    let got: Vec<String> = promql_metrics(expr).into_iter().collect();
    assert_eq!(got, ["a_bucket", "c", "vllm:b"]);
}

#[test]
fn the_docs_dashboard_is_the_charts_file() {
    let docs = repo().join("docs/grafana/kvsight.json");
    let chart = repo().join("helm/kvsight/dashboards/kvsight.json");
    assert_eq!(
        std::fs::canonicalize(&docs).unwrap(),
        std::fs::canonicalize(&chart).unwrap(),
        "docs/grafana/kvsight.json must stay a link to the chart's file (one source)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_metric_is_exported() {
    let text = std::fs::read_to_string(repo().join("helm/kvsight/dashboards/kvsight.json"))
        .expect("the dashboard");
    let dash: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let wanted: BTreeSet<String> = dashboard_queries(&dash)
        .iter()
        .flat_map(|q| promql_metrics(q))
        .collect();
    assert!(wanted.len() >= 20, "too few metrics read: {wanted:?}");

    let Some(cluster) = one_pod_cluster("every_dashboard_metric_is_exported").await else {
        return;
    };
    let pod = &cluster.pods[0];
    // prometheus-client renders a labelled family only once it has a series (not even its
    // `# TYPE` line before), and a fresh cluster has seen no retry, reload or refusal: one
    // sample through each recording method, so every registered family is in the exposition.
    let r = &cluster.routers[0].state.metrics;
    r.request("pool", "pod", 200);
    r.retry("connect_refused");
    r.cut("deadline");
    r.reload("applied");
    r.tls_reload("applied");
    r.mode(MODEL, "exact");
    r.tokenizer_check(MODEL, "agrees");
    r.sight("pod", 16, 16);
    r.sidecar_refused("version");
    r.refused("body_bytes");
    r.flow.joined_queue("batch", "t");
    r.flow
        .waited("batch", "t", std::time::Duration::from_millis(5));
    r.flow.shed("batch", "queue_full");
    r.flow.admitted("batch", "queued");
    r.flow.abandoned("batch");
    let s = &pod.sidecar().shared.metrics;
    s.count_event("BlockStored");
    s.count_replay("recovered");
    s.count_router_error("connect");
    s.count_tls_reload("applied");
    let mut have = BTreeSet::new();
    for url in [
        format!("{}/metrics", cluster.routers[0].admin_url()),
        format!("{}/metrics", pod.sidecar().url()),
        format!("{}/metrics", pod.vllm_url()),
    ] {
        have.extend(exported(&get(&cluster, url).await));
    }
    let missing: Vec<&String> = wanted.difference(&have).collect();
    assert!(
        missing.is_empty(),
        "the dashboard reads metrics nothing exports: {missing:?}"
    );
    cluster.shutdown().await;
}

/// One value of a router exposition line (`name{labels} value` or `name value`).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sight_records_predicted_minus_engine_cached_tokens() {
    let Some(cluster) = one_pod_cluster("sight_records_predicted_minus_engine_cached_tokens").await
    else {
        return;
    };
    // Some 40 blocks of a prompt, sent twice (the second finds it cached), then streamed with
    // usage asked for; and once streamed without usage, which Sight cannot measure.
    let prompt = "the quick brown fox jumps over the lazy dog; ".repeat(60);
    let plain = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    let with_usage = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": true,
                            "stream_options": {"include_usage": true}});
    let no_usage = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": true});
    let (mut predicted, mut engine) = (0u64, 0u64);
    let mut errors = Vec::new();
    for body in [&plain, &plain, &with_usage, &no_usage] {
        let r = cluster.post(0, "/v1/completions", body).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text);
        let p = r.decision.as_ref().expect("a decision")["predicted_cached_tokens"]
            .as_u64()
            .unwrap();
        // The usage object the client got: the body, or the stream's usage chunk.
        let usage = r
            .text
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").or(Some(l)))
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find_map(|v| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64());
        if body["stream"] == true && body.get("stream_options").is_none() {
            assert_eq!(usage, None);
            continue;
        }
        let e = usage.expect("cached_tokens in the usage");
        predicted += p;
        engine += e;
        errors.push(p as f64 - e as f64);
    }
    assert!(engine > 0, "the repeated prompt was cached");
    let router = format!("{}/metrics", cluster.routers[0].admin_url());
    // The router records when it has copied the answer's last byte, a moment after the client
    // may have read it.
    let last = std::sync::Mutex::new(String::new());
    // View staleness, the dashboard's other view-quality signal, is recorded as the KV events of
    // these requests reach the router in the sidecar's deltas.
    eventually(
        "Sight to count three answers, and a delta's staleness",
        WAIT,
        || async {
            let text = get(&cluster, router.clone()).await;
            let done = sample(&text, "kvsight_router_sight_error_tokens_count") == Some(3.0)
                && sample(&text, "kvsight_router_view_staleness_seconds_count") > Some(0.0);
            *last.lock().unwrap() = text;
            done
        },
    )
    .await
    .unwrap();
    let text = last.into_inner().unwrap();
    let sum = sample(&text, "kvsight_router_sight_error_tokens_sum").unwrap();
    assert_eq!(sum, errors.iter().sum::<f64>(), "errors {errors:?}");
    let pod = r#"{pod="kvsight/p0"}"#;
    let series = |name: &str| sample(&text, &format!("{name}{pod}"));
    assert_eq!(
        series("kvsight_router_sight_predicted_cached_tokens_total"),
        Some(predicted as f64)
    );
    assert_eq!(
        series("kvsight_router_sight_engine_cached_tokens_total"),
        Some(engine as f64)
    );
    cluster.shutdown().await;
}
