use super::lighter_share;
use crate::scheduler::{Candidate, Ctx, MatchUse, Scorer};

/// Fewer running requests (projected) is better: vLLM's own count, so load that bypassed every
/// router counts too.
pub struct RunningRequests;

impl Scorer for RunningRequests {
    fn match_use(&self) -> MatchUse {
        MatchUse::Ignores
    }

    fn scores(&self, _ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]) {
        lighter_share(cands, |c| f64::from(c.projection.running), out);
    }
}
