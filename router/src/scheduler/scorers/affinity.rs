use crate::scheduler::{Candidate, Ctx, MatchUse, Scorer};

/// The pod this router last sent the prompt's prefix to (its first block), within
/// `scheduler.affinityTtlSeconds`, scores 1; others 0.
///
/// Why, when the router can see real caches: past saturation caches thrash, and a prefix is
/// often evicted from every pod between two of its requests. Then no pod's cache speaks for it,
/// and a router that only follows caches places it by load — somewhere new each time, until
/// every pod holds every tenant and none holds any for long. Sending it home instead keeps each
/// pod's working set small, so its prefixes stay resident and its neighbours' too. This is a
/// preference, never a prediction: the cached tokens the router predicts come from the real
/// cache only, and a pod that really holds the prefix outscores a home that lost it.
pub struct Affinity;

impl Scorer for Affinity {
    fn match_use(&self) -> MatchUse {
        MatchUse::Ignores
    }

    fn scores(&self, ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]) {
        let ttl = ctx.cfg.affinity_ttl();
        for (o, c) in out.iter_mut().zip(cands) {
            let home = c.first_block.and_then(|f| c.pod.last_routed(f));
            *o = f64::from(home.is_some_and(|at| ctx.now.saturating_duration_since(at) <= ttl));
        }
    }
}
