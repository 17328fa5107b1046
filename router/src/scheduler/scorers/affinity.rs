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
/// that lost it only together with lighter load (docs/decisions/0006-homes.md).
///
/// A *new* prefix — no home anywhere, no pod caching a quarter of it — is placed where it will
/// have room to stay: each pod that would start it within a home's slack of the soonest
/// (`saturation::room_cutoff`) scores by how close its working set is to the lightest
/// (`1 - (share - lightest) / span`, the span from the lightest share to the heaviest or
/// [`room_floor`], whichever is more); the others 0. A working set
/// ([`crate::homes::Homes::working_set`]) is the blocks of the prefixes a pod is home to that
/// were asked for again (sent to any pod), or sent in the last ten seconds: what the new prefix
/// will compete with for the pod's cache (docs/decisions/0010-working-set-room.md). A difference,
/// not a ratio: one tenant more weighs as much when every pod homes five as when they home one
/// (docs/decisions/0011-room-floor.md).
pub struct Affinity;

/// The least span room gaps are scored against, as a share of what the lightest working set
/// leaves of its cache ([`room_floor`]): while the working sets lie closer together than that, a
/// pod `gap` above the lightest scores `1 - gap / floor`, so small gaps move the score a little
/// and leave the choice to the other scorers (load). A quarter: a pod running six requests
/// beside an idle one must not draw new short prompts because its sibling already homes a few
/// blocks, while one tenant's prefix must already weigh on the next tenant's placement
/// (docs/decisions/0011-room-floor.md).
pub(crate) const ROOM_FLOOR: f64 = 0.25;

/// [`ROOM_FLOOR`] of what the lightest share (`lightest`) leaves free, and never less than a
/// tenth of that quarter (shares can pass 1 where a pod homes more than its cache holds).
///
/// Why of what is left, not of the whole cache: a new prefix competes for the room its pod's
/// working set leaves, and the same gap is a larger part of less room. One tenant more then
/// weighs more as the caches fill, when a wrong placement costs most
/// (docs/decisions/0011-room-floor.md).
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
