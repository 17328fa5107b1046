use super::lighter_share;
use crate::scheduler::{Candidate, Ctx, MatchUse, Scorer};

/// Fewer waiting requests (projected: reported plus what this router sent since) is better.
pub struct Queue;

impl Scorer for Queue {
    fn match_use(&self) -> MatchUse {
        MatchUse::Ignores
    }

    fn scores(&self, _ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]) {
        lighter_share(cands, |c| f64::from(c.projection.waiting), out);
    }
}
