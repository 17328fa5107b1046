//! The branch-and-bound search over the open candidates (see the module docs of `scheduler`):
//! every score that ignores the cache match first, an upper bound per pod (its whole chain
//! cached), then matches computed in the order of those bounds until no unmatched pod can reach
//! the top two. Each match it does compute is the plain linear scan, so the result equals
//! matching every pod (`scheduler/tests.rs` compares the two on random clusters).

use super::{Candidate, Ctx, MatchUse, Scheduler, Weighted};
use crate::scheduler::prompt_hashes::PromptHashes;

/// Blocks between the probes that bound a pod's match before the search: shorter tightens the
/// bounds (fewer pods matched in full) at more probes per pod where the chain is cached.
const BOUND_STRIDE: usize = 32;

impl Scheduler {
    /// Scores the open candidates and finds the best two totals (highest first, ties broken by
    /// pod key so decisions are reproducible), computing real matches only where needed.
    pub(super) fn rank<'p>(
        &self,
        ctx: &Ctx<'_>,
        used: &[&Weighted],
        open: &mut [Candidate<'p>],
        m: &mut PromptHashes<'_>,
    ) -> Ranked {
        let n = open.len();
        let req = ctx.req;
        if used
            .iter()
            .any(|w| w.scorer.match_use() == MatchUse::Relative)
        {
            for c in open.iter_mut() {
                m.resolve(c, req, ctx.now);
            }
        }
        // One probe each settles every pod lacking the chain's next block; the others are
        // scored with the whole chain cached, an upper bound.
        for c in open.iter_mut() {
            m.bound(c, req, ctx.now, usize::MAX);
        }
        let mut values = vec![0.0; used.len() * n];
        for (k, w) in used.iter().enumerate() {
            w.scorer.scores(ctx, open, &mut values[k * n..(k + 1) * n]);
        }
        let total_of = |values: &[f64], i: usize| -> f64 {
            used.iter()
                .enumerate()
                .map(|(k, w)| w.weight * values[k * n + i])
                .sum()
        };
        let mut totals: Vec<f64> = (0..n).map(|i| total_of(&values, i)).collect();
        // The pods outlive `open`, so their keys can be read while candidates are resolved.
        let keys: Vec<&'p str> = open.iter().map(|c| c.pod.key.as_str()).collect();
        let key = |i: usize| keys[i];
        // The best two exact candidates so far, best first.
        let mut top: [Option<usize>; 2] = [None, None];
        let enter = |top: &mut [Option<usize>; 2], totals: &[f64], i: usize| {
            let before = |j: usize| by_rank(totals[i], key(i), totals[j], key(j)).is_lt();
            *top = match *top {
                [Some(a), b] if !before(a) => match b {
                    Some(b) if !before(b) => *top,
                    _ => [Some(a), Some(i)],
                },
                [a, _] => [Some(i), a],
            };
        };
        // Best bound first; a bound is tightened in two steps, each only when it could still
        // reach the top two: sampled probes, then the full linear scan.
        let mut heap = std::collections::BinaryHeap::with_capacity(n);
        let mut sampled = vec![false; n];
        // An exact candidate competes for the top two; any other waits on the heap by its bound.
        let place = |top: &mut [Option<usize>; 2],
                     heap: &mut std::collections::BinaryHeap<Bound<'p>>,
                     totals: &[f64],
                     exact: bool,
                     i: usize| {
            if exact {
                enter(top, totals, i);
            } else {
                heap.push(Bound {
                    total: totals[i],
                    key: key(i),
                    index: i,
                });
            }
        };
        for (i, c) in open.iter().enumerate() {
            place(&mut top, &mut heap, &totals, c.exact, i);
        }
        while let Some(Bound {
            total, index: i, ..
        }) = heap.pop()
        {
            if let Some(j) = top[1]
                && by_rank(total, key(i), totals[j], key(j)).is_gt()
            {
                break; // neither this bound nor any after it reaches the runner-up
            }
            if sampled[i] {
                m.resolve(&mut open[i], req, ctx.now);
            } else {
                m.bound(&mut open[i], req, ctx.now, BOUND_STRIDE);
                sampled[i] = true;
            }
            for (k, w) in used.iter().enumerate() {
                if w.scorer.match_use() == MatchUse::OwnGrowing {
                    let at = k * n + i;
                    w.scorer
                        .scores(ctx, std::slice::from_ref(&open[i]), &mut values[at..=at]);
                }
            }
            totals[i] = total_of(&values, i);
            place(&mut top, &mut heap, &totals, open[i].exact, i);
        }
        let best = top[0].expect("non-empty");
        Ranked {
            best: (best, totals[best]),
            runner_up: top[1].map(|j| (j, totals[j])),
            values,
        }
    }
}

/// Ranks the open candidates: see [`Scheduler::rank`].
pub(super) type RankFn =
    fn(&Scheduler, &Ctx<'_>, &[&Weighted], &mut [Candidate<'_>], &mut PromptHashes<'_>) -> Ranked;

/// A candidate's upper-bound total in [`Scheduler::rank`]'s search; the heap's greatest is the
/// one ranking first.
struct Bound<'k> {
    total: f64,
    key: &'k str,
    index: usize,
}

impl Ord for Bound<'_> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        by_rank(self.total, self.key, other.total, other.key).reverse()
    }
}

impl PartialOrd for Bound<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bound<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for Bound<'_> {}

/// `Less` when a total and pod key rank ahead of another: higher total first, then the key.
fn by_rank(total_a: f64, key_a: &str, total_b: f64, key_b: &str) -> std::cmp::Ordering {
    total_b.total_cmp(&total_a).then_with(|| key_a.cmp(key_b))
}

/// The best two candidates of [`Scheduler::rank`] with their totals, and every scorer's values
/// (scorer `k`, candidate `i` at `k * n + i`; exact for the two).
pub(super) struct Ranked {
    pub(super) best: (usize, f64),
    pub(super) runner_up: Option<(usize, f64)>,
    pub(super) values: Vec<f64>,
}
