//! Measures the simulated engine's CPU cost: 8 engines, each draining 500 requests of 512 prompt
//! tokens (half shared) and 64 output tokens. Run with
//! `cargo run --release -p kvsight-sim --example engine_throughput`.

use std::time::{Duration, Instant};

use kvsight_sim::engine::{Engine, EngineConfig, Request};

fn main() -> anyhow::Result<()> {
    let engines = 8u64;
    let per_engine = 500u32;
    let start = Instant::now();
    let mut steps = 0u64;
    let mut simulated = Duration::ZERO;
    for seed in 0..engines {
        let config = EngineConfig::builder()
            .seed(seed)
            .num_gpu_blocks(8192)
            .build()?;
        let mut engine = Engine::new(config)?;
        for i in 0..per_engine {
            let mut prompt: Vec<u32> = (0..256).collect();
            prompt.extend((0..256).map(|t| t + i * 1000));
            engine.submit(Request::new(format!("r{i}"), prompt, 64))?;
        }
        while engine.has_work() {
            simulated += engine.step().duration;
            steps += 1;
        }
    }
    let elapsed = start.elapsed();
    let requests = engines * u64::from(per_engine);
    println!(
        "{requests} requests, {steps} steps in {elapsed:?}: {:.0} requests/s, {:.1} µs/step \
         (simulated {simulated:?})",
        requests as f64 / elapsed.as_secs_f64(),
        elapsed.as_micros() as f64 / steps as f64
    );
    Ok(())
}
