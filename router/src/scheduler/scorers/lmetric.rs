use super::lower_is_better;
use crate::scheduler::{Candidate, Ctx, Scorer};

/// LMetric (Zhang et al., OSDI '26, arXiv 2603.15202): the prompt tokens the pod must compute
/// times its batch (running + waiting, projected; plus one so that an idle pod still compares by
/// its cache). Lower is better. A product rather than a weighted sum: whatever scale either
/// factor has cancels when two pods are compared, so the trade between cache and load needs no
/// tuning — a pod that must compute six times more wins only with a sixth of the batch.
pub struct Lmetric;

impl Lmetric {
    pub(crate) fn value(c: &Candidate<'_>) -> f64 {
        let p = &c.projection;
        f64::from(c.uncached_tokens.max(1)) * (f64::from(p.running) + f64::from(p.waiting) + 1.0)
    }
}

impl Scorer for Lmetric {
    // Normalised across the candidates: `MatchUse::Relative` (the default).
    fn scores(&self, _ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]) {
        lower_is_better(cands, Self::value, out);
    }
}
