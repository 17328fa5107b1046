use super::lower_is_better;
use crate::scheduler::{Candidate, Ctx, Scorer};

/// Prefill rate assumed for a pod that has not reported one yet (tokens/s).
const DEFAULT_PREFILL_TOKENS_PER_S: f64 = 5_000.0;

/// Predicted time to first token: the queue ahead (waiting requests, each assumed the size of
/// this prompt) plus this prompt's uncached tokens, over the pod's measured prefill rate. Lower is
/// better. It trades cache hits against queueing the way the prefix and queue weights cannot on
/// their own: a long cached prompt is worth a short queue, a short one is not.
pub struct PredictedLatency;

impl PredictedLatency {
    pub(crate) fn seconds(c: &Candidate<'_>, prompt_tokens: u32) -> f64 {
        let rate = c
            .pod
            .load
            .as_ref()
            .and_then(|l| l.load.prefill_tokens_per_s)
            .map(f64::from)
            .filter(|r| *r > 0.0)
            .unwrap_or(DEFAULT_PREFILL_TOKENS_PER_S);
        let queued = f64::from(c.projection.waiting) * f64::from(prompt_tokens);
        (queued + f64::from(c.uncached_tokens)) / rate
    }
}

impl Scorer for PredictedLatency {
    fn name(&self) -> &'static str {
        "predictedLatency"
    }

    // Normalised across the candidates' uncached tokens: `MatchUse::Relative` (the default).
    fn scores(&self, ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]) {
        lower_is_better(cands, |c| Self::seconds(c, ctx.req.prompt_tokens), out);
    }
}
