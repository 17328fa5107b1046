use crate::scheduler::{Candidate, Ctx, MatchUse, Scorer};

/// The prompt's *home* ([`crate::homes`]: the pod this router first placed its prefix on, kept
/// while it keeps going there) scores how much of the prompt it is home to (1 for a prompt sent
/// there whole before, little for a shared header only); other pods 0.
///
/// Why, when the router can see real caches: past saturation caches thrash, and a prefix is
/// often evicted from every pod between two of its requests. Then no pod's cache speaks for it,
/// and a router that only follows caches places it by load — somewhere new each time, until
/// every pod holds every tenant and none holds any for long. Sending it home instead keeps each
/// pod's working set small, so its prefixes stay resident and its neighbours' too. This is a
/// preference, never a prediction: the cached tokens the router predicts come from the real
/// cache only, and with the default weights a pod that really holds the prefix outscores a home
/// that lost it only together with lighter load.
///
/// A prompt without a home worth at least ½ (a new prefix, or one whose shared header only is
/// remembered) is placed where it adds least: the pod that is home to the fewest
/// prefix depths scores [`NEW_PREFIX_SHARE`], the others less in proportion (a shallow home
/// keeps its own value if that is more). Placing new
/// prefixes by load alone left one pod with 7–8 of 24 tenants and another with 4 in half the runs
/// of issue 16's load, and a sticky home then keeps that imbalance.
pub struct Affinity;

/// The most a new prefix's placement score is worth, as a share of the weight: a tie-breaker
/// the load terms can overrule, strong enough to spread tenants evenly when load is even.
pub(crate) const NEW_PREFIX_SHARE: f64 = 0.5;

impl Scorer for Affinity {
    fn match_use(&self) -> MatchUse {
        MatchUse::Ignores
    }

    fn scores(&self, _ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]) {
        if cands.iter().any(|c| c.home >= 0.5) {
            for (o, c) in out.iter_mut().zip(cands) {
                *o = c.home;
            }
        } else {
            super::lighter_share(cands, |c| c.homes_held as f64, out);
            for (o, c) in out.iter_mut().zip(cands) {
                *o = (*o * NEW_PREFIX_SHARE).max(c.home);
            }
        }
    }
}
