use crate::scheduler::{Candidate, Ctx, Scorer};

/// Fraction of the prompt's full blocks that are resident on the pod now (its Bloom filter, plus
/// blocks of prompts this router just sent there).
pub struct Prefix;

impl Scorer for Prefix {
    fn name(&self) -> &'static str {
        "prefix"
    }

    fn scores(&self, _ctx: &Ctx<'_>, cands: &[Candidate<'_>]) -> Vec<f64> {
        cands
            .iter()
            .map(|c| match c.chain_len {
                0 => 0.0,
                n => c.matched_blocks as f64 / n as f64,
            })
            .collect()
    }
}
