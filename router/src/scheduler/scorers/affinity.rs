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
/// A prompt without a home is placed by the other scorers alone. Placing it where the fewest
/// prefixes live, as a half-weight tie-breaker, evened out issue 16's 24 equal tenants but
/// counted the bench's `agentic` tool prompts of 3k and 30k tokens alike and stacked the long
/// ones (TTFT p90 0.55–0.57 s against 0.48 s without it); issue 16's load measured 0.740 / 0.763
/// without it against 0.734–0.746 with it. Weighing by the blocks homed instead fixed `agentic`
/// (0.37–0.45 s) and kept `multi_turn`'s new sessions apart (TTFT p90 0.053–0.065 s against
/// 0.071–0.073 s without any rule, 0.050–0.054 s with homes off), but a pod's homed blocks grow
/// with every request's own deepest depths — served traffic, not prefixes — and the
/// saturation scenario (`scenarios_saturation`) then lost to the shortest queue (TTFT p90
/// 0.92–1.15 s against 0.75–0.98 s; 0.62–0.64 s without the rule), even at a share of 0.15.
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
