//! True load: scrapes vLLM's `/metrics` at the scrape interval and turns it into `Load` reports,
//! republished at once when the phase or the cache view changes. Also keeps vLLM's health and
//! the Ready/Unhealthy phase in step.
//!
//! `unrouted` = vLLM's running + waiting − Σ routers' in-flight for this pod, never negative:
//! load no router sent (benchmarks run with `kubectl exec`, warm-up, other gateways). The
//! prefill rate is the rate at which the engine works off its queue: prefilled tokens (vLLM's
//! `request_prefill_kv_computed_tokens` sum, else prompt tokens) per second of wall time,
//! smoothed, over intervals during which requests were waiting throughout. Routers turn a queue
//! into a time with it; an interval with an empty queue says how much work arrived, not how fast
//! the engine can do it, so it is left out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvsight_protocol::messages::{CacheView, Load, Phase};
use tokio_util::sync::CancellationToken;

use crate::engine::VllmClient;
use crate::scrape::EngineMetrics;
use crate::state::{LoadSample, Shared};

/// Smoothed prefill throughput of a busy engine, from successive counter samples.
#[derive(Debug, Default, Clone)]
pub struct PrefillRate {
    /// The previous sample: when, the prefilled-token counter, whether requests were waiting.
    last: Option<(Instant, f64, bool)>,
    rate: Option<f64>,
}

impl PrefillRate {
    /// Feeds one sample of the cumulative prefilled-token counter taken at `at`, and whether
    /// requests were waiting then. Only intervals with a queue at both ends count.
    pub fn update(&mut self, at: Instant, tokens: f64, queued: bool) -> Option<f32> {
        if let Some((t0, n0, was_queued)) = self.last {
            let dt = at.saturating_duration_since(t0).as_secs_f64();
            let dn = tokens - n0;
            // A counter that went back is a restarted engine: start over.
            if dn < 0.0 {
                self.rate = None;
            } else if was_queued && queued && dn > 0.0 && dt > 0.0 {
                let now = dn / dt;
                self.rate = Some(self.rate.map_or(now, |r| 0.7 * r + 0.3 * now));
            }
        }
        self.last = Some((at, tokens, queued));
        // Routers refuse a report with a rate that is not finite and positive (`Load::validate`).
        self.rate
            .map(|r| r as f32)
            .filter(|r| r.is_finite() && *r > 0.0)
    }
}

/// `running + waiting − inflight`, clamped at zero.
pub fn unrouted(running: f64, waiting: f64, inflight: u64) -> u32 {
    let engine = (running.max(0.0) + waiting.max(0.0)).round() as u64;
    u32::try_from(engine.saturating_sub(inflight)).unwrap_or(u32::MAX)
}

/// Builds the report for one scrape.
pub fn build_load(
    m: &EngineMetrics,
    phase: Phase,
    view: CacheView,
    inflight: u64,
    prefill: Option<f32>,
) -> Load {
    let lora = m.lora.clone().unwrap_or_default();
    Load {
        seq: 0,
        sample_age_ms: 0,
        phase,
        cache_view: view,
        running: m.running.max(0.0).round() as u32,
        waiting: m.waiting.max(0.0).round() as u32,
        // `clamp` keeps a NaN, which routers refuse (`Load::validate`): NaN counts as 0 like
        // the counts above.
        kv_usage: if m.kv_usage.is_nan() {
            0.0
        } else {
            m.kv_usage.clamp(0.0, 1.0) as f32
        },
        unrouted: unrouted(m.running, m.waiting, inflight),
        prefix_cache_queries: m.prefix_cache_queries.max(0.0) as u64,
        prefix_cache_hits: m.prefix_cache_hits.max(0.0) as u64,
        preemptions: m.preemptions.max(0.0) as u64,
        prefill_tokens_per_s: prefill,
        lora_running: lora.running,
        lora_waiting: lora.waiting,
    }
}

fn view(shared: &Shared) -> CacheView {
    shared
        .subscriber
        .get()
        .map_or(CacheView::Exact, |s| s.borrow().view)
}

/// Scrapes every `interval` until `cancel`; republishes the last sample at once on a phase
/// change so routers hear about Draining without waiting for the next scrape.
pub async fn run_load(
    client: VllmClient,
    shared: Arc<Shared>,
    interval: Duration,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut phase_rx = shared.watch_phase();
    let mut rate = PrefillRate::default();
    let mut last: Option<(Instant, EngineMetrics)> = None;
    // A change of the cache view (Lost, Recovering) also reaches routers at once.
    let mut sub_rx = shared.subscriber.get().cloned();
    let mut last_view = view(&shared);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {
                let timeout = interval.max(Duration::from_secs(1));
                match client.metrics(timeout).await {
                    Ok(m) => {
                        if last.as_ref().is_some_and(|(_, prev)| m.restarted_since(prev)) {
                            tracing::warn!("vLLM's counters went back: the engine restarted");
                            shared.engine_restarted.notify_one();
                        }
                        for name in shared.metrics.set_missing(&m.missing) {
                            tracing::warn!(metric = name, "vLLM does not export a metric kvsight reads; it is read as a default");
                        }
                        let at = Instant::now();
                        let tokens = m.prefill_computed_tokens_sum.unwrap_or(m.prompt_tokens);
                        rate.update(at, tokens, m.waiting > 0.0);
                        last = Some((at, m));
                    }
                    Err(e) => {
                        shared.metrics.scrape_errors.inc();
                        tracing::debug!(error = %e, "scrape failed");
                        continue;
                    }
                }
            }
            changed = phase_rx.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            changed = async {
                match &mut sub_rx {
                    Some(rx) => rx.changed().await,
                    None => std::future::pending().await,
                }
            } => {
                let Some(rx) = sub_rx.as_mut().filter(|_| changed.is_ok()) else {
                    sub_rx = None;
                    continue;
                };
                let v = rx.borrow_and_update().view;
                if v == last_view {
                    continue;
                }
                last_view = v;
            }
        }
        let Some((at, m)) = &last else { continue };
        let inflight = shared.inflight_total();
        let load = build_load(
            m,
            shared.phase(),
            view(&shared),
            inflight,
            rate.rate.map(|r| r as f32),
        );
        shared
            .metrics
            .unrouted_requests
            .set(i64::from(load.unrouted));
        shared.load.send_replace(Some(LoadSample {
            sampled_at: *at,
            load,
        }));
    }
}

/// Polls `/health` every `interval`: a Ready pod whose engine stops answering is Unhealthy; an
/// Unhealthy pod whose engine answers again goes back to Warming, not Ready — an engine that was
/// gone is most likely a new process, cold like at start, and `run` warms it again before it
/// reports Ready (other phases keep theirs).
pub async fn run_health(
    client: VllmClient,
    shared: Arc<Shared>,
    interval: Duration,
    cancel: CancellationToken,
) {
    loop {
        let ok = client.health().await.is_ok();
        let was = shared.healthy();
        shared.set_healthy(ok);
        match (ok, shared.phase()) {
            (false, Phase::Ready) => shared.set_phase(Phase::Unhealthy),
            (true, Phase::Unhealthy) => shared.set_phase(Phase::Warming),
            _ => {}
        }
        if was != ok {
            tracing::info!(healthy = ok, "vLLM health changed");
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unrouted_never_negative() {
        assert_eq!(unrouted(3.0, 2.0, 1), 4);
        assert_eq!(unrouted(3.0, 2.0, 9), 0);
        assert_eq!(unrouted(0.0, 0.0, 0), 0);
    }

    #[test]
    fn prefill_rate_from_deltas_while_queued() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut r = PrefillRate::default();
        assert_eq!(r.update(at(0), 0.0, true), None);
        let got = r.update(at(1), 1000.0, true).unwrap();
        assert!((got - 1000.0).abs() < 1e-3);
        // Idle interval keeps the estimate.
        let got = r.update(at(2), 1000.0, true).unwrap();
        assert!((got - 1000.0).abs() < 1e-3);
        // Work done without a queue at both ends says how much arrived, not how fast the engine
        // is: ignored.
        let got = r.update(at(3), 1100.0, false).unwrap();
        assert!((got - 1000.0).abs() < 1e-3);
        let got = r.update(at(4), 1150.0, true).unwrap();
        assert!((got - 1000.0).abs() < 1e-3);
        // Counter reset forgets it.
        assert_eq!(r.update(at(5), 10.0, true), None);
    }
}
