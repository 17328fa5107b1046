//! `kvsight-demo --json` as `cargo xtask demo` runs it: 2 vllm-sim pods, 2 sidecars, a router,
//! real sockets and certificates. Every experiment's verdict comes from the engines' own
//! counters, so a router that scattered the shared prefix, piled the unique prompts onto one pod
//! or ignored the hot-reloaded `prefix: 0` fails here.

use std::process::Command;

use serde_json::Value;

#[test]
fn demo_json_passes_all_three_experiments_on_two_pods() {
    if kvsight_harness::or_skip(
        "demo_json_passes_all_three_experiments_on_two_pods",
        kvsight_sim::own_tokenizer::ensure_dir(),
    )
    .is_none()
    {
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

#[test]
fn demo_serve_leaves_a_working_cluster_up_until_interrupted() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::time::{Duration, Instant};

    if kvsight_harness::or_skip(
        "demo_serve_leaves_a_working_cluster_up_until_interrupted",
        kvsight_sim::own_tokenizer::ensure_dir(),
    )
    .is_none()
    {
        return;
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvsight-demo"))
        .args(["--json", "--serve"])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill the cluster whatever happens below.
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stdout = child.stdout.take().unwrap();
    let mut child = Reap(child);
    let mut lines = BufReader::new(stdout).lines();
    let report: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    assert_eq!(report["ok"], true, "{report:#}");
    let router = lines.next().unwrap().unwrap();
    let addr = router
        .strip_prefix("router: http://")
        .unwrap_or_else(|| panic!("not the router line: {router:?}"))
        .to_owned();
    let admin = lines.next().unwrap().unwrap();
    assert!(
        admin.starts_with("router admin (/metrics, /debug/pods): http://127.0.0.1:"),
        "{admin}"
    );
    let pod_lines: Vec<String> = (0..2).map(|_| lines.next().unwrap().unwrap()).collect();
    for (i, l) in pod_lines.iter().enumerate() {
        assert!(
            l.starts_with(&format!("pod-{i}: vllm http://127.0.0.1:"))
                && l.contains(" sidecar http://127.0.0.1:"),
            "{l}"
        );
    }

    // The cluster still answers: plain HTTP/1.1 to the router, as curl would.
    let mut tcp = std::net::TcpStream::connect(&addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        tcp,
        "GET /v1/models HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    tcp.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"kvsight-demo\""), "{answer}");

    // Ctrl-C stops it, with the experiments' status.
    let pid = child.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap()
            .success()
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "still running 30 s after SIGINT");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
}
