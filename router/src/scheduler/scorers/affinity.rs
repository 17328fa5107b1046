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
/// A *new* prefix — no home anywhere, no pod caching a quarter of it — is placed where it will
/// have room to stay: each pod that would start it within a home's slack of the soonest
/// (`saturation::room_cutoff`) scores by how close its working set is to the lightest
/// (`1 - (share - lightest) / span`, the span from the lightest share to the heaviest or
/// [`room_floor`] — a quarter of what the lightest leaves free — whichever is more); the
/// others 0. A working set
/// ([`crate::homes::Homes::working_set`]) is the blocks of the prefixes a pod is home to that
/// were asked for again (sent to any pod), or sent in the last ten seconds: what the new prefix
/// will compete with for the pod's cache. Placed by load, issue 16's 24 equal tenants landed
/// 5 / 5 / 7 / 7 on four pods nearly every run, and the pods holding seven found 0.66–0.70 of
/// their prompts cached against 0.74–0.81; with the working set they land 6 / 6 / 6 / 6 or
/// 5 / 6 / 6 / 7, moves off a first pod fell from 20–32 to 8–25 per run, and the hit rate rose
/// from 0.69 / 0.74 / 0.73 to 0.74 / 0.75 / 0.76 (interleaved runs; more in the README).
///
/// A difference, not a ratio: one tenant more weighs as much when every pod homes five as when
/// they home one. Scored as `1 - share / heaviest` (the tenth session's form), a one-tenant gap
/// between pods homing five and six tenants was worth 0.17 of the weight, less than a few
/// running requests: issue 16's last tenants went by load, and a run that placed them 7 / 5 /
/// 6 / 6 fell to 0.68, its seven-tenant pod two seconds behind its siblings. As a difference
/// against a quarter of a cache the gap is worth 0.43 at every depth (measured interleaved
/// there, eleventh session: 0.745 / 0.730 / 0.743 against 0.728 / 0.727 / 0.724 for the
/// ratio); against a quarter of what the lightest leaves free it weighs more as the caches
/// fill, which is when a wrong placement costs most ([`room_floor`]).
///
/// Earlier rules, measured and dropped: the fewest prefixes homed (a half-weight tie-breaker)
/// counted the bench's `agentic` tool prompts of 3k and 30k tokens alike and stacked the long
/// ones (TTFT p90 0.55–0.57 s against 0.48 s); the fewest blocks homed counted every request's
/// own deepest depths — served traffic, not prefixes — and the saturation scenario
/// (`scenarios_saturation`) then lost to the shortest queue. The working set counts a prompt
/// sent once only for ten seconds, and blocks, not prompts: `agentic` at 96 req/s went from
/// TTFT p90 0.63 s to 0.42–0.49 s (four runs). Without the slack cut (the ninth session's try
/// of a rule like this one), `mixed_faults`' stuck pod (its queue held by load that bypassed
/// the router, so it serves few of its homes) looked roomiest and took new tenants: TTFT p99
/// about 10 s in three of three runs; with the cut 1.5–2.3 s in four runs of six and 9.5 /
/// 9.9 s in two — the rules off give 1.9–9.6 s too, so the cut is shown to avoid the worst,
/// not to steady that tail.
pub struct Affinity;

/// The least span room gaps are measured against, as a share of what the lightest working set
/// leaves of its cache ([`room_floor`]): while the working sets lie closer together than that, a
/// pod `gap` above the lightest scores `1 - gap / floor`, so small gaps move the score a little
/// and leave the choice to the other scorers (load). A quarter: a pod running six requests
/// beside an idle one (`load_that_bypassed_the_router_is_seen`) must not draw new short prompts
/// because its sibling already homes a few blocks, while on issue 16's load one tenant (128 of
/// 1,200 blocks) must already weigh on the next tenant's placement — the first 24 arrive within
/// a few seconds. Measured there with the ratio form (a floor under the heaviest share): 0.70 /
/// 0.74 / 0.74 with it, 0.71 / 0.75 / 0.73 with none.
pub(crate) const ROOM_FLOOR: f64 = 0.25;

/// [`ROOM_FLOOR`] of what the lightest share (`lightest`) leaves free, and never less than a
/// tenth of that quarter (shares can pass 1 where a pod homes more than its cache holds).
///
/// Why of what is left, not of the whole cache: a new prefix competes for the room its pod's
/// working set leaves, and the same gap is a larger part of less room. With a quarter of the
/// whole cache, a one-tenant gap (0.107 of a cache on issue 16's load) stayed worth 0.43 of
/// the weight when every pod already homed five tenants and had 0.47 of its cache left: less
/// than two waiting and four running requests more on the lighter pod, so the last tenant went
/// to the pod with the lightest moment's load, and the fleet ended 7 / 5 / 6 / 6 in 2 runs of
/// 11 (hit rates 0.706 and 0.715; the pod with seven ran seconds behind its siblings). Of what
/// is left, the gap is worth 0.91 there and the same 0.43 for the first tenants. Measured
/// interleaved (twelfth session, five runs each): 6 / 6 / 6 / 6 in five of five, hit rates
/// 0.727 / 0.745 / 0.751 / 0.746 / 0.728, against 7 / 5 / 6 / 6 in two of five and 0.745 /
/// 0.746 / 0.734 / 0.679 / 0.722.
pub(crate) fn room_floor(lightest: f64) -> f64 {
    ROOM_FLOOR * (1.0 - lightest).clamp(0.1, 1.0)
}

impl Scorer for Affinity {
    fn match_use(&self) -> MatchUse {
        MatchUse::Ignores
    }

    fn scores(&self, _ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]) {
        if cands.iter().any(|c| c.room.is_some()) {
            // A new prefix: the lighter working sets among the pods that compete for it, by
            // how far each is above the lightest, against the spread or a quarter of what the
            // lightest leaves free, whichever is more.
            let (min, max) = cands
                .iter()
                .filter_map(|c| c.room)
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), s| {
                    (lo.min(s), hi.max(s))
                });
            let span = (max - min).max(room_floor(min));
            for (o, c) in out.iter_mut().zip(cands) {
                *o = c
                    .room
                    .map_or(0.0, |share| (1.0 - (share - min) / span).clamp(0.0, 1.0));
            }
            return;
        }
        for (o, c) in out.iter_mut().zip(cands) {
            *o = c.home;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{ROOM_FLOOR, room_floor};

    /// A quarter of the whole cache while nothing is homed, of what is left as it fills, and
    /// never zero or negative: a pod can home more than its cache holds (shares past 1), and a
    /// span of 0 would score every equal pod `0 / 0`.
    #[test]
    fn the_room_floor_shrinks_with_the_room_left_and_stays_positive() {
        assert_eq!(room_floor(0.0), ROOM_FLOOR);
        assert!((room_floor(0.6) - 0.1).abs() < 1e-12, "{}", room_floor(0.6));
        for lightest in [0.9, 1.0, 1.5, 40.0] {
            let f = room_floor(lightest);
            assert!((f - ROOM_FLOOR * 0.1).abs() < 1e-12, "{lightest}: {f}");
        }
    }
}
