//! Throughput of simulated pods over real HTTP: one process runs 8 pods, 64 concurrent clients
//! send completion requests (token-id prompts of 320 tokens, 256 of them a shared prefix,
//! 16 output tokens) round-robin over loopback TCP, one connection per request. Simulated time
//! is scaled down 1000×, so the figure is the simulator's own CPU cost.
//!
//! Run: `cargo bench -p kvsight-sim --bench sim_pods` (`SIM_PODS_REQUESTS` sets the total).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvsight_sim::engine::EngineConfig;
use kvsight_sim::server::{SimConfig, SimPod};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PODS: usize = 8;
const CLIENTS: usize = 64;

fn main() -> anyhow::Result<()> {
    let total: usize = std::env::var("SIM_PODS_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run(total))
}

async fn run(total: usize) -> anyhow::Result<()> {
    let mut pods = Vec::new();
    for seed in 0..PODS as u64 {
        let engine = EngineConfig::builder()
            .seed(seed)
            .compile_stall(Duration::ZERO)
            .time_scale(0.001)
            .max_num_seqs(256)
            .build()?;
        pods.push(
            SimPod::start(SimConfig {
                engine,
                ..SimConfig::default()
            })
            .await?,
        );
    }
    let addrs: Arc<Vec<SocketAddr>> = Arc::new(pods.iter().map(|p| p.http_addr()).collect());
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let addrs = addrs.clone();
        let next = next.clone();
        clients.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return Ok::<_, anyhow::Error>(());
                }
                let mut prompt: Vec<u32> = (0..256).collect();
                prompt.extend((0..64).map(|t| 1000 + t + (i as u32 % 10_000) * 64));
                let body = serde_json::json!({"prompt": prompt, "max_tokens": 16}).to_string();
                post(addrs[i % addrs.len()], &body).await?;
            }
        }));
    }
    for c in clients {
        c.await??;
    }
    let elapsed = start.elapsed();
    println!(
        "sim_pods: {PODS} pods, {CLIENTS} clients, {total} requests in {:.2} s = {:.0} requests/s",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64()
    );
    Ok(())
}

async fn post(addr: SocketAddr, body: &str) -> anyhow::Result<()> {
    let mut s = TcpStream::connect(addr).await?;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out))
        .await
        .context("response timed out")??;
    if !out.starts_with(b"HTTP/1.1 200") {
        bail!("bad response: {}", String::from_utf8_lossy(&out));
    }
    Ok(())
}
