//! Measurements behind docs/bench/security.md, run by hand (ignored in the test run: they time
//! things on a shared machine):
//!
//! `cargo test -p kvsight-router --test security_bench -- --ignored --nocapture`
//!
//! `health_latency_under_four_8_mib_tokenize`: the router binary with a local tokenizer, four
//! concurrent `/tokenize` requests of an 8 MiB prompt, and `/health` asked every 10 ms
//! meanwhile; prints `/health`'s latency quantiles. `KVSIGHT_ROUTER_BIN` runs another build of
//! the binary (one without `--admin-listen`, for a before/after figure).

mod router_process;

use std::time::{Duration, Instant};

use router_process::RouterProcess;

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

#[test]
#[ignore = "a measurement: run by hand with --ignored --nocapture"]
fn health_latency_under_four_8_mib_tokenize() {
    let Some(tok_dir) = kvsight_harness::or_skip(
        "health_latency_under_four_8_mib_tokenize",
        kvsight_sim::own_tokenizer::ensure_dir(),
    ) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvsight-router-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("router.yaml");
    std::fs::write(
        &config,
        format!(
            "pools: [{{name: p, models: [m]}}]\ntokenizers: {{m: {:?}}}\n",
            tok_dir.display().to_string()
        ),
    )
    .unwrap();
    let router = RouterProcess::start(&dir, &["--config", &config.display().to_string()]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let base = router.base.clone();
    rt.block_on(async {
        router.wait_started(&client, Duration::from_secs(60)).await;
        // 8 MiB of prompt text, just within the default promptBytes.
        let words = "the quick brown fox jumps over the lazy dog ";
        let prompt = words.repeat(((8 << 20) - 4096) / words.len());
        let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
        let started = Instant::now();
        let tokenizes: Vec<_> = (0..4)
            .map(|_| {
                let (client, url, body) =
                    (client.clone(), format!("{base}/tokenize"), body.clone());
                tokio::spawn(async move {
                    let t = Instant::now();
                    let r = client.post(url).body(body).send().await.unwrap();
                    let status = r.status();
                    let _ = r.bytes().await;
                    (status, t.elapsed())
                })
            })
            .collect();
        let mut latencies = Vec::new();
        while !tokenizes.iter().all(|t| t.is_finished()) {
            assert!(started.elapsed() < Duration::from_secs(600), "bounded");
            let t = Instant::now();
            let ok = client
                .get(format!("{base}/health"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200);
            assert!(ok);
            latencies.push(t.elapsed().as_secs_f64() * 1000.0);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for t in tokenizes {
            let (status, took) = t.await.unwrap();
            println!(
                "/tokenize of 8 MiB: {status} in {:.1} s",
                took.as_secs_f64()
            );
        }
        latencies.sort_by(f64::total_cmp);
        println!(
            "/health while they ran: {} probes, p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            latencies.len(),
            quantile(&latencies, 0.5),
            quantile(&latencies, 0.99),
            latencies.last().copied().unwrap_or_default()
        );
    });
    let _ = std::fs::remove_dir_all(&dir);
}
