//! The pool CPU-heavy work runs in: tokenizing and parsing large bodies, building the
//! tokenizers sidecars send. It runs on blocking threads, at most `limits.heavyWorkers` at once,
//! with at most `limits.heavyQueue` more waiting (one past that is refused with 503 and
//! `Retry-After`), so probes, metrics and streaming answers stay on the async workers and never
//! wait behind it (docs/decisions/0101-heavy-work-pool.md).

use std::sync::Arc;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::Semaphore;

use crate::error::ApiError;

/// Bodies up to this many bytes are parsed and tokenized on the async worker that read them:
/// under a millisecond of work, less than the hand-off to a pool thread costs in latency
/// (docs/decisions/0101-heavy-work-pool.md).
pub const INLINE_BYTES: usize = 64 << 10;

/// The bounded pool and its queue.
#[derive(Debug)]
pub struct Heavy {
    threads: Arc<Semaphore>,
    workers: usize,
    queue: usize,
    /// Jobs admitted and not finished (waiting or running).
    admitted: Gauge,
    running: Gauge,
}

/// The thread count `limits.heavyWorkers: 0` stands for: one fewer than the CPUs, at least one,
/// so one CPU stays for the async workers.
pub fn auto_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1))
}

/// Counts a job from admission to its end (also when the waiting request is dropped).
struct Admitted(Gauge);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Heavy {
    /// A pool of `workers` threads (0: [`auto_workers`]) with `queue` waiting slots, reporting
    /// into the two gauges (jobs admitted, jobs running).
    pub fn new(workers: usize, queue: usize, admitted: Gauge, running: Gauge) -> Self {
        let workers = if workers == 0 {
            auto_workers()
        } else {
            workers
        };
        Heavy {
            threads: Arc::new(Semaphore::new(workers)),
            workers,
            queue,
            admitted,
            running,
        }
    }

    /// Threads in the pool.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// Jobs waiting for a thread now.
    pub fn queued(&self) -> usize {
        usize::try_from(self.admitted.get() - self.running.get()).unwrap_or(0)
    }

    /// Runs `f` on a pool thread, or refuses it at once when the queue is full.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        let limit = (self.workers + self.queue) as i64;
        self.admitted
            .inner()
            .fetch_update(
                std::sync::atomic::Ordering::AcqRel,
                std::sync::atomic::Ordering::Acquire,
                |n| (n < limit).then_some(n + 1),
            )
            .map_err(|_| ApiError::Busy { limit: self.queue })?;
        self.execute(Admitted(self.admitted.clone()), f).await
    }

    /// Runs `f` on a pool thread, waiting for one however long the queue: for work that must
    /// happen whatever the load (a tokenizer a sidecar sent).
    pub async fn run_waiting<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        self.admitted.inc();
        self.execute(Admitted(self.admitted.clone()), f).await
    }

    async fn execute<T: Send + 'static>(
        &self,
        admitted: Admitted,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        let permit = self
            .threads
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::ShuttingDown)?;
        self.running.inc();
        let running = Admitted(self.running.clone());
        // The job owns its slot, thread permit and counts: a request that goes away while it
        // runs does not free them before the thread does.
        tokio::task::spawn_blocking(move || {
            let _held = (admitted, running, permit);
            f()
        })
        .await
        .map_err(|e| ApiError::Internal(format!("a heavy job failed: {e}")))
    }
}
