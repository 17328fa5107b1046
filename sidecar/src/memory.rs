//! Handing freed heap pages back to the system.
//!
//! The sidecar's work is steady churn: every publish interval it builds a Bloom filter and a
//! frame, every scrape parses a metrics page, every KV event batch allocates and frees. glibc's
//! allocator returns freed memory to the system only from the top of each arena; pages freed
//! below a live allocation stay resident, so resident memory steps up at every burst while the
//! live heap stays flat (docs/decisions/0018-sidecar-memory-trim.md). A sidecar is a guest in
//! the model pod's memory limit: it gives pages back rather than hold its peak forever.
//!
//! The one `unsafe` in the workspace lives here (the workspace denies `unsafe_code`; this is its
//! only exception, checked by `cargo xtask ci`).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Asks glibc to return the free pages of every arena to the system (`malloc_trim(0)`); returns
/// whether anything was released. Elsewhere (musl, macOS) a no-op returning false: those
/// allocators give large free spans back themselves and have no such call.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[expect(
    unsafe_code,
    reason = "malloc_trim is a C function; the only FFI call of the workspace"
)]
pub fn release_free_pages() -> bool {
    // SAFETY: malloc_trim takes no pointer and touches only glibc's own free lists, which it
    // locks arena by arena like any malloc call; it is thread-safe and has no precondition.
    unsafe { libc::malloc_trim(0) == 1 }
}

/// See the glibc version: nothing to do on other allocators.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free_pages() -> bool {
    false
}

/// Calls [`release_free_pages`] every `interval` until `shutdown`; `Duration::ZERO` disables it.
/// A trim walks every arena, each under its lock, and issues `madvise` calls: blocking work,
/// so it runs on the blocking pool, never on a runtime worker.
pub async fn trim_every(interval: Duration, shutdown: CancellationToken) {
    every(interval, shutdown, release_free_pages).await;
}

/// Runs `work` on the blocking pool every `interval` (the first after one interval) until
/// `shutdown`; returns at once for `Duration::ZERO`.
async fn every(interval: Duration, shutdown: CancellationToken, work: fn() -> bool) {
    if interval.is_zero() {
        return;
    }
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // the first tick is immediate: nothing to give back at start-up
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {
                let released = tokio::task::spawn_blocking(work).await;
                tracing::trace!(?released, "malloc_trim");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    // Each test counts its own calls (tests run in parallel threads).
    static CALLS_PERIODIC: AtomicUsize = AtomicUsize::new(0);
    static CALLS_OFF: AtomicUsize = AtomicUsize::new(0);

    #[tokio::test(start_paused = true)]
    async fn runs_once_per_interval_not_at_start_and_ends_on_cancel() {
        fn work() -> bool {
            CALLS_PERIODIC.fetch_add(1, Ordering::SeqCst);
            true
        }
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(every(Duration::from_secs(5), shutdown.clone(), work));
        // Paused time advances only while every task waits, so the blocking calls complete
        // before the clock moves on: the count is exact at each whole second.
        let mut seen = Vec::new();
        for _ in 0..12 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            seen.push(CALLS_PERIODIC.load(Ordering::SeqCst));
        }
        assert_eq!(seen.first(), Some(&0), "no trim at start-up: {seen:?}");
        assert_eq!(seen.last(), Some(&2), "one per 5 s over 12 s: {seen:?}");
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .expect("ends on cancel")
            .unwrap();
        let after = CALLS_PERIODIC.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert_eq!(
            CALLS_PERIODIC.load(Ordering::SeqCst),
            after,
            "none after cancel"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn zero_interval_is_off() {
        fn work() -> bool {
            CALLS_OFF.fetch_add(1, Ordering::SeqCst);
            true
        }
        // Never cancelled: only returning at once ends it.
        tokio::time::timeout(
            Duration::from_secs(3600),
            every(Duration::ZERO, CancellationToken::new(), work),
        )
        .await
        .expect("returns at once");
        assert_eq!(CALLS_OFF.load(Ordering::SeqCst), 0);
    }
}
