//! Scorers: each gives every candidate a value in 0 – 1 (higher is better); the scheduler sums
//! them with the configured weights. Relative signals (queue, running, latency) are min-max
//! normalised across the candidates, so equal pods score equally and the weights compare like
//! with like; absolute signals (prefix fraction, KV headroom) are used as they are.

mod affinity;
mod kv_cache;
mod lmetric;
mod lora_affinity;
mod lru;
mod predicted_latency;
mod prefix;
mod queue;
mod running_requests;

pub use affinity::Affinity;
pub use kv_cache::KvCache;
pub use lmetric::Lmetric;
pub use lora_affinity::LoraAffinity;
pub use lru::Lru;
pub use predicted_latency::PredictedLatency;
pub use prefix::Prefix;
pub use queue::Queue;
pub use running_requests::RunningRequests;

use crate::scheduler::Candidate;

/// Writes `1` for the candidate with the smallest `value`, `0` for the largest, linear between;
/// all `1` when all are equal. No allocation: this runs on every pick.
pub(crate) fn lower_is_better(
    cands: &[Candidate<'_>],
    value: impl Fn(&Candidate<'_>) -> f64,
    out: &mut [f64],
) {
    let (min, max) = cands
        .iter()
        .map(&value)
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    // Also covers an empty slice and NaN (no ordering): everyone scores equally.
    if max.partial_cmp(&min) != Some(std::cmp::Ordering::Greater) {
        out.fill(1.0);
        return;
    }
    for (o, c) in out.iter_mut().zip(cands) {
        *o = (max - value(c)) / (max - min);
    }
}
