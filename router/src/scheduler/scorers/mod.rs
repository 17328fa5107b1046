//! Scorers: each gives every candidate a value in 0 – 1 (higher is better); the scheduler sums
//! them with the configured weights. Counts of requests (queue, running) are taken as a share of
//! the busiest candidate's (`lighter_share`); latency-like signals are min-max normalised
//! across the candidates (`lower_is_better`); absolute signals (prefix fraction, KV headroom)
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

use crate::scheduler::{Candidate, Scorer};

/// Every scorer the scheduler knows. A kind owns its weight's key in the config file
/// (`scheduler.weights.<key>`), its default weight and its implementation, so the config, the
/// factory and the decision header cannot disagree on a name: adding a kind without a weight,
/// a default or an implementation does not compile (`Weights::get` matches on the kind too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScorerKind {
    Prefix,
    Queue,
    KvCache,
    RunningRequests,
    LoraAffinity,
    PredictedLatency,
    Lmetric,
    Affinity,
    Lru,
}

impl ScorerKind {
    /// Every kind, in the order the scheduler sums them and the decision lists them.
    pub const ALL: [ScorerKind; 9] = [
        ScorerKind::Prefix,
        ScorerKind::Queue,
        ScorerKind::KvCache,
        ScorerKind::RunningRequests,
        ScorerKind::LoraAffinity,
        ScorerKind::PredictedLatency,
        ScorerKind::Lmetric,
        ScorerKind::Affinity,
        ScorerKind::Lru,
    ];

    /// The weight's key under `scheduler.weights` (the serde name of its `Weights` field; a
    /// config test holds the two together).
    pub const fn key(self) -> &'static str {
        match self {
            ScorerKind::Prefix => "prefix",
            ScorerKind::Queue => "queue",
            ScorerKind::KvCache => "kvCache",
            ScorerKind::RunningRequests => "runningRequests",
            ScorerKind::LoraAffinity => "loraAffinity",
            ScorerKind::PredictedLatency => "predictedLatency",
            ScorerKind::Lmetric => "lmetric",
            ScorerKind::Affinity => "affinity",
            ScorerKind::Lru => "lru",
        }
    }

    /// The weight when the config does not set one (why: docs/decisions/0006-homes.md,
    /// 0012-load-scores-as-shares.md and 0013-prefix-weight.md).
    pub const fn default_weight(self) -> f64 {
        match self {
            ScorerKind::Prefix => 3.0,
            ScorerKind::Queue => 1.0,
            ScorerKind::KvCache => 1.0,
            ScorerKind::RunningRequests => 2.0,
            ScorerKind::LoraAffinity => 1.0,
            ScorerKind::PredictedLatency => 0.0,
            ScorerKind::Lmetric => 0.0,
            ScorerKind::Affinity => 3.0,
            ScorerKind::Lru => 0.1,
        }
    }

    /// Whether least-request scoring (no candidate caches prefixes) keeps this scorer: only
    /// the ones that count requests, and the tie-breaker.
    pub const fn least_request(self) -> bool {
        matches!(
            self,
            ScorerKind::Queue | ScorerKind::RunningRequests | ScorerKind::Lru
        )
    }

    /// The implementation.
    pub fn scorer(self) -> Box<dyn Scorer> {
        match self {
            ScorerKind::Prefix => Box::new(Prefix),
            ScorerKind::Queue => Box::new(Queue),
            ScorerKind::KvCache => Box::new(KvCache),
            ScorerKind::RunningRequests => Box::new(RunningRequests),
            ScorerKind::LoraAffinity => Box::new(LoraAffinity),
            ScorerKind::PredictedLatency => Box::new(PredictedLatency),
            ScorerKind::Lmetric => Box::new(Lmetric),
            ScorerKind::Affinity => Box::new(Affinity),
            ScorerKind::Lru => Box::new(Lru),
        }
    }
}

/// Writes `1 - value / max`: the busiest candidate scores `0`, an idle one `1`, and 28 against
/// 34 requests differ by 0.18, not by the whole weight. Min-max normalisation would turn any
/// spread, however small, into the full weight, so a balanced fleet's noise would outweigh a
/// prefix cache (docs/decisions/0012-load-scores-as-shares.md). Values are counts, never
/// negative; all `1` when every candidate is idle.
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
