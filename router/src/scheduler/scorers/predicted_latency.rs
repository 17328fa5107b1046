use super::lower_is_better;
use crate::scheduler::{Candidate, Ctx, Scorer, saturation};

/// Predicted time to first token: the prefill backlog ahead (see `scheduler::saturation`) plus
/// this prompt's uncached tokens, over the pod's measured prefill rate. Lower is better. It
/// trades cache hits against queueing the way the prefix and queue weights cannot on their own:
/// a long cached prompt is worth a short queue, a short one is not.
pub struct PredictedLatency;

impl Scorer for PredictedLatency {
    // Normalised across the candidates' uncached tokens: `MatchUse::Relative` (the default).
    fn scores(&self, ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]) {
        lower_is_better(cands, |c| saturation::predicted_ttft(ctx, c), out);
    }
}
