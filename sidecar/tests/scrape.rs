//! vLLM's real exposition (0.33) and the pre-0.12 names.

use kvsight_sidecar::scrape::{ScrapeError, parse, samples};

/// vLLM 0.33's `/metrics`, under `../shared`.
const FIXTURE: &str = "fixtures/vllm/metrics-0.33.txt";

#[test]
fn reads_vllm_0_33_exposition() {
    let Some(path) = kvsight_harness::fixture_or_skip("reads_vllm_0_33_exposition", FIXTURE) else {
        return;
    };
    let text = std::fs::read_to_string(path).expect("read the fixture");
    let m = parse(&text).unwrap();
    assert_eq!((m.running, m.waiting), (3.0, 1.0));
    assert_eq!(m.kv_usage, 0.0421);
    assert_eq!(
        (m.prefix_cache_queries, m.prefix_cache_hits),
        (4096.0, 2048.0)
    );
    assert_eq!(m.requests_finished, 8.0);
    assert_eq!(m.prefill_computed_tokens_sum, Some(48.0));
    let cc = m.cache_config.expect("cache_config_info");
    assert_eq!(
        (cc.block_size, cc.num_gpu_blocks, cc.enable_prefix_caching),
        (16, 27_000, true)
    );
    assert_eq!(cc.prefix_caching_hash_algo.as_deref(), Some("sha256"));
    let lora = m.lora.expect("lora_requests_info");
    assert_eq!(lora.running, vec!["sql-lora", "chat-lora"]);
    assert!(lora.waiting.is_empty());
    assert_eq!(lora.max_lora, Some(4));
    assert_eq!(m.engines, 1);
    assert!(
        m.missing.is_empty(),
        "vLLM 0.33 exports all: {:?}",
        m.missing
    );
}

#[test]
fn pre_0_12_names_and_data_parallel_engines() {
    let text = r#"
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 2.0
vllm:num_requests_running{model_name="m",engine="1"} 5.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.6
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 40.0
vllm:cache_config_info{block_size="32",enable_prefix_caching="False",num_gpu_blocks="100",prefix_caching_hash_algo="None"} 1.0
"#;
    let m = parse(text).unwrap();
    assert_eq!((m.running, m.waiting), (7.0, 1.0));
    assert!((m.kv_usage - 0.4).abs() < 1e-9, "mean over engines");
    assert_eq!((m.prefix_cache_queries, m.prefix_cache_hits), (100.0, 40.0));
    let cc = m.cache_config.unwrap();
    assert!(!cc.enable_prefix_caching);
    assert_eq!(cc.prefix_caching_hash_algo, None);
    assert_eq!(m.engines, 2);
    assert_eq!(m.lora, None);
    // Renamed metrics count under their new names; the ones this old exposition lacks are named.
    assert_eq!(
        m.missing,
        [
            "vllm:num_preemptions_total",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:request_success_total",
            "vllm:request_prefill_kv_computed_tokens_sum",
        ]
    );
}

#[test]
fn new_names_win_over_old_ones() {
    let text = "vllm:kv_cache_usage_perc 0.5\nvllm:gpu_cache_usage_perc 0.9\nvllm:prefix_cache_hits_total 3\nvllm:gpu_prefix_cache_hits_total 99\n";
    let m = parse(text).unwrap();
    assert_eq!((m.kv_usage, m.prefix_cache_hits), (0.5, 3.0));
}

#[test]
fn something_that_is_not_vllm_is_refused() {
    assert_eq!(
        parse("process_cpu_seconds_total 3\n").unwrap_err(),
        ScrapeError::NotVllm
    );
}

/// Found by `cargo fuzz run prometheus_parse`: a form feed between two labels was read as part of
/// the next label's name (`"\x0c,waiting_lora_adapters"` → `",waiting_lora_adapters"`), so the
/// LoRA queue was silently missing. Whitespace between labels is skipped now, names are checked
/// against the format, and labels must be separated by commas.
#[test]
fn regression_fuzz_stray_character_between_labels() {
    let line = "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a, b\"\x0c,\
                waiting_lora_adapters=\"c\"} 1\n";
    let lora = parse(line).unwrap().lora.unwrap();
    assert_eq!(
        (lora.running.len(), lora.waiting),
        (2, vec!["c".to_owned()])
    );
    for bad in [
        "m{a=\"1\"x,b=\"2\"} 1",
        "m{a=\"1\" b=\"2\"} 1",
        "m{,a=\"1\"} 1",
        "m{a-b=\"1\"} 1",
        "m{1a=\"1\"} 1",
        "{} 1",
        "1m 1",
        "m\"x 1",
    ] {
        assert!(
            matches!(samples(bad), Err(ScrapeError::Syntax { line: 1, .. })),
            "{bad:?} accepted"
        );
    }
    // What the format allows still reads: spaces around names, `=` and commas, a trailing comma.
    let m =
        parse("vllm:lora_requests_info{ max_lora = \"2\" , running_lora_adapters=\"a, b\", } 1\n")
            .unwrap();
    let lora = m.lora.unwrap();
    assert_eq!((lora.max_lora, lora.running.len()), (Some(2), 2));
}

#[test]
fn the_newest_lora_series_is_the_current_one_wherever_it_stands() {
    // vLLM keeps every label set it ever set, valued with the time it was set: an adapter that
    // runs again updates its old series in place, ahead of the empty one set when it stopped.
    let text = "# TYPE vllm:lora_requests_info gauge\n\
        vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"tiny-lora\",waiting_lora_adapters=\"\"} 1.7964588270e+09\n\
        vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1.7964588250e+09\n";
    let lora = parse(text)
        .expect("parses")
        .lora
        .expect("lora_requests_info");
    assert_eq!(lora.running, vec!["tiny-lora"]);
}
