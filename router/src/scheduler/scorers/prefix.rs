use crate::scheduler::{Candidate, Ctx, MatchUse, Scorer};

/// Fraction of the prompt's full blocks that are resident on the pod now (its Bloom filter, plus
/// blocks of prompts this router just sent there).
pub struct Prefix;

impl Scorer for Prefix {
    fn match_use(&self) -> MatchUse {
        MatchUse::OwnGrowing
    }

    fn scores(&self, _ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]) {
        for (o, c) in out.iter_mut().zip(cands) {
            *o = match c.chain_len {
                0 => 0.0,
                n => c.matched_blocks as f64 / n as f64,
            };
        }
    }
}
