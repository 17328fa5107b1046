use super::lower_is_better;
use crate::scheduler::{Candidate, Ctx, Scorer};

/// Fewer waiting requests (projected: reported plus what this router sent since) is better.
pub struct Queue;

impl Scorer for Queue {
    fn name(&self) -> &'static str {
        "queue"
    }

    fn scores(&self, _ctx: &Ctx<'_>, cands: &[Candidate<'_>]) -> Vec<f64> {
        lower_is_better(
            &cands
                .iter()
                .map(|c| f64::from(c.projection.waiting))
                .collect::<Vec<_>>(),
        )
    }
}
