//! `kvsight-demo --json` as `cargo xtask demo` runs it: 2 vllm-sim pods, 2 sidecars, a router,
//! real sockets and certificates. Every experiment's verdict comes from the engines' own
//! counters, so a router that scattered the shared prefix, piled the unique prompts onto one pod
//! or ignored the hot-reloaded `prefix: 0` fails here.

use std::process::Command;

use serde_json::Value;

#[test]
fn demo_json_passes_all_three_experiments_on_two_pods() {
    if let Err(e) = kvsight_testbed::own_tokenizer::ensure_dir() {
        eprintln!("skipped: demo_json_passes_all_three_experiments_on_two_pods: {e}");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_kvsight-demo"))
        .args(["--json", "--pods", "2"])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("not one JSON object ({e}): {stdout}\n{stderr}"));
    assert!(
        out.status.success(),
        "exit {:?}: {report:#}\n{stderr}",
        out.status
    );
    assert_eq!(report["ok"], true, "{report:#}");
    let exps = report["experiments"].as_array().unwrap();
    let names: Vec<&str> = exps.iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["shared_prefix", "unique_prefix", "prefix_weight_zero"]
    );
    let counts = |i: usize| -> Vec<u64> {
        let mut v: Vec<u64> = exps[i]["requests_per_pod"]
            .as_object()
            .unwrap()
            .values()
            .map(|n| n.as_u64().unwrap())
            .collect();
        v.sort_unstable();
        v
    };
    assert_eq!(counts(0), [0, 12], "{report:#}");
    assert!(exps[0]["hit_rate"].as_f64().unwrap() >= 0.85, "{report:#}");
    for i in [1, 2] {
        let c = counts(i);
        assert_eq!(c.iter().sum::<u64>(), 12, "{report:#}");
        assert!(c[0] >= 3, "{report:#}");
    }
    let preamble = report["preamble_tokens"].as_u64().unwrap();
    assert!(
        (600..=900).contains(&preamble),
        "preamble of {preamble} tokens"
    );
}

#[test]
fn demo_rejects_a_bad_flag_with_usage_status() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvsight-demo"))
        .args(["--pods", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--pods"));
}
