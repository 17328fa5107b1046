use crate::scheduler::{Candidate, Ctx, Scorer};

/// KV-cache headroom: `1 - projected use` (reported use plus the prompts sent since that
/// report). This prompt's own blocks are left out on purpose: they are fewer where its prefix is
/// cached, which would make this scorer a second prefix scorer and keep `prefix: 0` from
/// spreading. The saturation filter does count them.
pub struct KvCache;

impl Scorer for KvCache {
    fn name(&self) -> &'static str {
        "kvCache"
    }

    fn scores(&self, _ctx: &Ctx<'_>, cands: &[Candidate<'_>]) -> Vec<f64> {
        cands
            .iter()
            .map(|c| (1.0 - c.projection.kv_usage).clamp(0.0, 1.0))
            .collect()
    }
}
