//! Scorers: each gives every candidate a value in 0 – 1 (higher is better); the scheduler sums
//! them with the configured weights. Counts of requests (queue, running) are taken as a share of
//! the busiest candidate's ([`lighter_share`]); latency-like signals are min-max normalised
//! across the candidates ([`lower_is_better`]); absolute signals (prefix fraction, KV headroom)
//! are used as they are. Equal pods score equally either way.

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

/// Writes `1 - value / max`: the busiest candidate scores `0`, an idle one `1`, and 28 against
/// 34 requests differ by 0.18, not by the whole weight. Min-max normalisation would turn any
/// spread, however small, into the full weight: then a balanced fleet's noise outweighs a
/// prefix cache (moving tenants, measured: hit rate 0.74 → 0.59 on the bench's multi_tenant
/// with the running weight raised), or a large spread counts no more than a small one. Values
/// are counts, never negative; all `1` when every candidate is idle.
pub(crate) fn lighter_share(
    cands: &[Candidate<'_>],
    value: impl Fn(&Candidate<'_>) -> f64,
    out: &mut [f64],
) {
    let max = cands.iter().map(&value).fold(0.0_f64, f64::max);
    if !(max > 0.0 && max.is_finite()) {
        out.fill(1.0);
        return;
    }
    for (o, c) in out.iter_mut().zip(cands) {
        *o = (1.0 - value(c) / max).clamp(0.0, 1.0);
    }
}

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
