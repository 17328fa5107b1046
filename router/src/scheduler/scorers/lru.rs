use crate::scheduler::{Candidate, Ctx, MatchUse, Scorer};

/// The pod picked longest ago (or never) scores 1, the most recent 0: among otherwise equal pods
/// traffic rotates instead of piling onto whichever sorts first.
pub struct Lru;

impl Scorer for Lru {
    fn match_use(&self) -> MatchUse {
        MatchUse::Ignores
    }

    fn scores(&self, _ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]) {
        let n = cands.len();
        if n <= 1 {
            out.fill(1.0);
            return;
        }
        let mut order: Vec<usize> = (0..n).collect();
        // None (never picked) sorts first; ties by key keep the order deterministic.
        order.sort_by(|&a, &b| {
            (cands[a].pod.last_picked, &cands[a].pod.key)
                .cmp(&(cands[b].pod.last_picked, &cands[b].pod.key))
        });
        for (rank, i) in order.into_iter().enumerate() {
            out[i] = 1.0 - rank as f64 / (n - 1) as f64;
        }
    }
}
