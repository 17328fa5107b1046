use crate::scheduler::{Candidate, Ctx, MatchUse, Scorer};

/// A pod never picked scores 1, the most recent 0, the others by when they were picked in
/// between (the one picked longest ago just under a never-picked one): among otherwise equal pods traffic rotates instead of piling onto
/// whichever sorts first. Linear in the pods (a rank would sort them: a third of a pick over
/// 1,000 pods); equal times score alike and the ranking's tie-break by pod key decides.
pub struct Lru;

impl Scorer for Lru {
    fn match_use(&self) -> MatchUse {
        MatchUse::Ignores
    }

    fn scores(&self, _ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]) {
        if cands.len() <= 1 {
            out.fill(1.0);
            return;
        }
        let picked = cands.iter().filter_map(|c| c.pod.last_picked);
        let (Some(oldest), Some(newest)) = (picked.clone().min(), picked.max()) else {
            out.fill(1.0);
            return;
        };
        let span = newest.duration_since(oldest).as_secs_f64();
        // A pod never picked ranks above the one picked longest ago.
        let top = if cands.iter().any(|c| c.pod.last_picked.is_none()) {
            1.0 - 1.0 / cands.len() as f64
        } else {
            1.0
        };
        for (c, o) in cands.iter().zip(out.iter_mut()) {
            *o = match c.pod.last_picked {
                None => 1.0,
                Some(_) if span <= 0.0 => 0.0,
                Some(t) => top * newest.duration_since(t).as_secs_f64() / span,
            };
        }
    }
}
