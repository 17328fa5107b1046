//! The router binary's memory under hostile 32 MiB bodies (`0,0,0,…` in the fields a body
//! parser would build values for): its peak resident set (`VmHWM`) may grow by less than four
//! times the body. A bound on memory, not a timing: it holds on a loaded machine. The figures
//! are printed (`--nocapture`) and recorded in docs/bench/security.md; `KVSIGHT_ROUTER_BIN`
//! measures another build of the binary (one without `--admin-listen`, for a before figure).

mod router_process;

use std::io::{BufRead, BufReader};
use std::time::Duration;

use router_process::RouterProcess;

/// The router's default `limits.bodyBytes`.
const BODY: usize = 32 << 20;

/// A `/proc/<pid>/status` field in KiB.
fn status_kib(pid: u32, field: &str) -> u64 {
    let f = std::fs::File::open(format!("/proc/{pid}/status")).unwrap();
    BufReader::new(f)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| {
            l.strip_prefix(field)?
                .trim_start_matches(':')
                .trim()
                .strip_suffix(" kB")?
                .parse()
                .ok()
        })
        .unwrap()
}

/// A JSON body of exactly `BODY` bytes whose `field` is a list of zeros.
fn hostile(field: &str) -> Vec<u8> {
    let head = format!("{{\"model\":\"m\",\"{field}\":[");
    let tail = "0]}";
    let mut body = head.into_bytes();
    while body.len() + 2 + tail.len() <= BODY {
        body.extend_from_slice(b"0,");
    }
    body.extend_from_slice(tail.as_bytes());
    while body.len() < BODY {
        body.insert(body.len() - tail.len(), b' ');
    }
    body
}

#[test]
fn a_32_mib_body_of_zeros_costs_the_router_under_four_times_its_size() {
    if !std::path::Path::new("/proc/self/status").exists() {
        eprintln!("skipped: no /proc here");
        return;
    }
    let dir = std::env::temp_dir().join(format!("kvsight-router-mem-{}", std::process::id()));
    let router = RouterProcess::start(&dir, &[]);
    let pid = router.pid();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let base = router.base.clone();
    rt.block_on(router.wait_started(&client, Duration::from_secs(30)));
    let baseline = status_kib(pid, "VmRSS");
    let mut worst = 0;
    println!("baseline VmRSS {} MiB", baseline / 1024);
    for (field, path) in [
        ("prompt", "/v1/completions"),
        ("messages", "/v1/chat/completions"),
        ("tools", "/v1/chat/completions"),
        ("ignored", "/v1/completions"),
        ("prompt", "/tokenize"),
    ] {
        let body = hostile(field);
        let status = rt.block_on(async {
            client
                .post(format!("{base}{path}"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap()
                .status()
        });
        assert!(status.is_client_error(), "{field} on {path}: {status}");
        let peak = status_kib(pid, "VmHWM");
        let grew = peak.saturating_sub(baseline);
        worst = worst.max(grew);
        println!(
            "{field:>8} on {path:<21} -> {status}; peak VmHWM {} MiB, +{} MiB over the baseline",
            peak / 1024,
            grew / 1024
        );
    }
    // Two at once, as a hostile client would send them.
    let two = rt.block_on(async {
        let send = |path: &'static str| {
            let (client, base) = (client.clone(), base.clone());
            tokio::spawn(async move {
                client
                    .post(format!("{base}{path}"))
                    .body(hostile("prompt"))
                    .send()
                    .await
                    .map(|r| r.status())
            })
        };
        let (a, b) = (send("/v1/completions"), send("/tokenize"));
        (a.await.unwrap().unwrap(), b.await.unwrap().unwrap())
    });
    let peak = status_kib(pid, "VmHWM");
    println!(
        "two at once -> {two:?}; peak VmHWM {} MiB, +{} MiB over the baseline",
        peak / 1024,
        peak.saturating_sub(baseline) / 1024
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        worst < 4 * (BODY as u64 / 1024),
        "one 32 MiB body grew the router by {} MiB",
        worst / 1024
    );
}
