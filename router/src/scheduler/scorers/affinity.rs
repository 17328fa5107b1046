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
/// A prompt without a home is placed by the other scorers alone. (Placing it where the fewest
/// prefixes live, as a half-weight tie-breaker, evened out issue 16's 24 equal tenants but
/// counted the bench's `agentic` tool prompts of 3k and 30k tokens alike and stacked the long
/// ones: TTFT p90 0.55–0.57 s against 0.48 s without it, while issue 16's load measured 0.740 /
/// 0.763 without it against 0.734–0.746 with it.)
pub struct Affinity;

impl Scorer for Affinity {
    fn match_use(&self) -> MatchUse {
        MatchUse::Ignores
    }

    fn scores(&self, _ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]) {
        for (o, c) in out.iter_mut().zip(cands) {
            *o = c.home;
        }
    }
}
