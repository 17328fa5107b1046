use crate::scheduler::{Candidate, Ctx, MatchUse, Scorer};

/// KV-cache headroom: `1 - projected use` (reported use plus the prompts sent since that
/// report). This prompt's own blocks are left out on purpose: they are fewer where its prefix is
/// cached, which would make this scorer a second prefix scorer and keep `prefix: 0` from
/// spreading. The saturation filter does count them.
pub struct KvCache;

impl Scorer for KvCache {
    fn match_use(&self) -> MatchUse {
        MatchUse::Ignores
    }

    fn scores(&self, _ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]) {
        for (o, c) in out.iter_mut().zip(cands) {
            *o = (1.0 - c.projection.kv_usage).clamp(0.0, 1.0);
        }
    }
}
