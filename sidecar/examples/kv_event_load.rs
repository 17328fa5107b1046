//! Benchmark: the sidecar's KV-event path at a given event rate.
//!
//! A testbed `KvEventPublisher` (vLLM's wire format over real ZMQ on loopback) publishes a
//! store/remove mix that keeps ~20 000 blocks resident; the sidecar's subscriber and its delta
//! ticker (one delta per 50 ms, as `--publish-interval`) run on a dedicated OS thread with their
//! own single-threaded runtime, so that thread's CPU time (`/proc/thread-self/schedstat`) is the
//! sidecar's cost, apart from the publisher's. RSS is the whole process's peak (`VmHWM`), which
//! includes the publisher and its replay buffer: an upper bound for the sidecar.
//!
//! `cargo run --release -p kvsight-sidecar --example kv_event_load -- [events_per_s] [seconds]`

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvsight_sidecar::kv_events::subscriber::{KvSubscriber, SubscriberConfig, lock};
use kvsight_sidecar::metrics::Metrics;
use kvsight_sidecar::mirror::Mirror;
use kvsight_sim::kv_events::{
    BlockHash, BlockRemoved, BlockStored, EventBatch, KvEvent, KvEventPublisher, PublisherConfig,
};
use tokio_util::sync::CancellationToken;

const BLOCK: u32 = 16;
const RESIDENT: usize = 20_000;
const STEPS_PER_S: u64 = 100;

fn thread_cpu() -> Duration {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let ns = text
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Duration::from_nanos(ns)
}

fn vm_hwm_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// What the sidecar thread measured: its CPU time, the blocks its mirror holds at the end, and
/// the bytes of the deltas it would have sent.
type SidecarCost = (Duration, usize, u64);

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let rate: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(2000);
    let seconds: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(10);
    let pub_rt = tokio::runtime::Runtime::new()?;
    let publisher = pub_rt.block_on(KvEventPublisher::bind(PublisherConfig::loopback("")))?;
    let endpoint = publisher.endpoint().to_owned();
    let replay = publisher.replay_endpoint().map(str::to_owned);

    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let cancel = CancellationToken::new();
    let sidecar_cancel = cancel.clone();
    let sidecar =
        std::thread::spawn(move || sidecar_thread(endpoint, replay, ready_tx, sidecar_cancel));
    ready_rx.recv()?;
    pub_rt.block_on(publisher.wait_for_subscriptions(1, Duration::from_secs(10)))?;

    // Publish `rate` events per second in STEPS_PER_S batches per second.
    let per_step = (rate / STEPS_PER_S).max(1) as usize;
    let mut workload = Workload::new();
    let start = Instant::now();
    let total_steps = seconds * STEPS_PER_S;
    let mut events = 0u64;
    for step in 0..total_steps {
        let batch = workload.batch(per_step);
        events += batch.len() as u64;
        publisher.publish(EventBatch::new(0.0, batch))?;
        let due = start + Duration::from_millis((step + 1) * 1000 / STEPS_PER_S);
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
    }
    pub_rt.block_on(publisher.flush())?;
    // Let the subscriber drain what is in flight.
    std::thread::sleep(Duration::from_millis(500));
    let wall = start.elapsed();
    cancel.cancel();
    let (cpu, mirror_resident, delta_bytes) = sidecar
        .join()
        .map_err(|_| anyhow::anyhow!("sidecar thread panicked"))??;
    println!(
        "events: {events} in {:.1} s ({:.0}/s); mirror resident {mirror_resident} (publisher {})",
        wall.as_secs_f64(),
        events as f64 / wall.as_secs_f64(),
        workload.resident.len()
    );
    println!(
        "sidecar CPU: {:.3} s = {:.2} % of one core; delta bytes {:.1} KiB/s; peak RSS (whole process) {:.1} MiB",
        cpu.as_secs_f64(),
        100.0 * cpu.as_secs_f64() / wall.as_secs_f64(),
        delta_bytes as f64 / 1024.0 / wall.as_secs_f64(),
        vm_hwm_kib() as f64 / 1024.0
    );
    Ok(())
}

/// The sidecar's subscriber and delta ticker on this thread's own runtime, until `cancel`;
/// `ready` is told when the CPU clock starts.
fn sidecar_thread(
    endpoint: String,
    replay: Option<String>,
    ready: std::sync::mpsc::Sender<()>,
    cancel: CancellationToken,
) -> anyhow::Result<SidecarCost> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mirror = Arc::new(Mutex::new(Mirror::new(27_000)?));
        let metrics = Arc::new(Metrics::new());
        let sub = KvSubscriber::connect(
            SubscriberConfig {
                endpoint,
                replay_endpoint: replay,
                topic: String::new(),
                replay_timeout: Duration::from_secs(5),
            },
            Arc::clone(&mirror),
            metrics,
        )
        .await?;
        let status = sub.status();
        tokio::spawn(sub.run(cancel.clone()));
        let delta_bytes = tokio::spawn(delta_ticker(Arc::clone(&mirror), cancel.clone()));
        let cpu0 = thread_cpu();
        let _ = ready.send(());
        cancel.cancelled().await;
        let cpu = thread_cpu().saturating_sub(cpu0);
        let bytes = delta_bytes.await.unwrap_or(0);
        let resident = lock(&mirror).resident();
        let seen = status.borrow().messages;
        println!("sidecar thread: handled {seen} batches");
        Ok((cpu, resident, bytes))
    })
}

/// Takes the filter's delta every 50 ms (as `--publish-interval`) until `cancel`; returns the
/// bytes of the frames they make.
async fn delta_ticker(mirror: Arc<Mutex<Mirror>>, cancel: CancellationToken) -> u64 {
    let mut bytes = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            () = cancel.cancelled() => return bytes,
            _ = tick.tick() => {}
        }
        if let Some(d) = lock(&mirror).filter_mut().take_delta() {
            let msg = kvsight_protocol::messages::SidecarMessage::CacheDelta(d);
            bytes += kvsight_protocol::frame::encode(&msg).map_or(0, |f| f.len() as u64);
        }
    }
}

/// A seeded store/remove mix that keeps about [`RESIDENT`] blocks resident.
struct Workload {
    resident: std::collections::VecDeque<u64>,
    next: u64,
    x: u64,
}

impl Workload {
    fn new() -> Self {
        Self {
            resident: Default::default(),
            next: 1 << 63,
            x: 0x1234_5678,
        }
    }

    /// The next `n` events: once full, a coin flip between removing the oldest block and
    /// storing a new one.
    fn batch(&mut self, n: usize) -> Vec<KvEvent> {
        let mut batch = Vec::with_capacity(n);
        for _ in 0..n {
            let x = &mut self.x;
            *x ^= *x << 13;
            *x ^= *x >> 7;
            *x ^= *x << 17;
            let x = *x;
            if self.resident.len() >= RESIDENT && x.is_multiple_of(2) {
                let h = self.resident.pop_front().unwrap_or(0);
                batch.push(KvEvent::BlockRemoved(BlockRemoved::new(vec![
                    BlockHash::Int(h),
                ])));
            } else {
                self.next += 1;
                let tokens = (0..BLOCK)
                    .map(|i| ((x >> (i % 32)) % 32_000) as u32)
                    .collect();
                batch.push(KvEvent::BlockStored(BlockStored::new(
                    vec![BlockHash::Int(self.next)],
                    None,
                    tokens,
                    BLOCK,
                )));
                self.resident.push_back(self.next);
            }
        }
        batch
    }
}
