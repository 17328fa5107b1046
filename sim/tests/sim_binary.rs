//! The `vllm-sim` binary: vLLM-named flags, a free port, a bad flag refused with exit code 64.

mod sim_support;

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

#[tokio::test]
async fn binary_serves_on_a_free_port() -> anyhow::Result<()> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
        .args([
            "--port",
            "0",
            "--served-model-name",
            "tiny",
            "--max-model-len",
            "256",
            "--no-enable-prefix-caching",
            "--compile-stall-ms",
            "0",
            "--time-scale",
            "0.001",
        ])
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let stderr = child.stderr.take().expect("stderr piped");
    let mut lines = BufReader::new(stderr).lines();
    let line = tokio::time::timeout(sim_support::WAIT, lines.next_line())
        .await??
        .expect("a startup line");
    let url = line
        .strip_prefix("vllm-sim: HTTP on http://")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    let addr = url.parse()?;
    let models = sim_support::get(addr, "/v1/models").await?.json()?;
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(models["data"][0]["max_model_len"], 256);
    let m = sim_support::get(addr, "/metrics").await?.text();
    assert!(m.contains("enable_prefix_caching=\"False\""));
    child.start_kill()?;
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    Ok(())
}

#[tokio::test]
async fn bad_flag_exits_64() -> anyhow::Result<()> {
    let out = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
        .args(["--port", "0", "--lora-modules", "no-equals-sign"])
        .output()
        .await?;
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--lora-modules"));
    Ok(())
}

#[tokio::test]
async fn export_tokenizer_writes_the_files_it_reads() -> anyhow::Result<()> {
    let Some(src) = kvsight_harness::or_skip(
        "export_tokenizer_writes_the_files_it_reads",
        kvsight_sim::own_tokenizer::ensure_dir(),
    ) else {
        return Ok(());
    };
    let out = std::env::temp_dir().join(format!("kvsight-export-tokenizer-{}", std::process::id()));
    let run = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
        .arg("--tokenizer")
        .arg(&src)
        .arg("--export-tokenizer")
        .arg(out.join("tok"))
        .output()
        .await?;
    let read = |dir: &std::path::Path, f: &str| std::fs::read(dir.join(f));
    let same = ["tokenizer.json", "tokenizer_config.json"]
        .iter()
        .map(|f| Ok(read(&src, f)? == read(&out.join("tok"), f)?))
        .collect::<std::io::Result<Vec<bool>>>();
    let _ = std::fs::remove_dir_all(&out);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(same?, [true, true]);
    // No files to write: refused as a bad flag.
    let builtin = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
        .args([
            "--tokenizer",
            "builtin",
            "--export-tokenizer",
            "/nonexistent/x",
        ])
        .output()
        .await?;
    assert_eq!(builtin.status.code(), Some(64));
    Ok(())
}
