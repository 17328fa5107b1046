//! Where each prefix lives: the pod this router first placed it on, remembered so that a prefix
//! evicted from every cache returns there, and so that a loaded home is not given up lightly.
//!
//! Why a router that sees real caches still needs a memory: past saturation the engines' LRU
//! evicts a tenant's prefix between two of its requests, and a loaded pod is skipped for an idle
//! sibling. Each such move places the prefix on a pod that did not hold it, where it evicts some
//! other tenant's, whose next request then moves too: every pod ends up holding every tenant and
//! none for long (measured on issue 16's KV-starved load: 10–14 of the 24 tenants went to each
//! pod where 6 fit, and about 40 % of the lost hits were requests whose prefix no pod held any
//! more).
//! A home is *exclusive* and *sticky*: the first pod a prefix is routed to owns it while this
//! router keeps sending it there (within `affinityTtlSeconds`); sending it elsewhere for load does
//! not move it. A home is a preference (the `affinity` scorer and the saturation rule's slack),
//! never a prediction: the cached tokens the router predicts come from the real caches only.
//!
//! A prefix is named by blocks of its chain at depths 1, 2, 4, 8, … (the hashes at indices
//! 0, 1, 3, 7, …): a chain hash commits to every token before it, so the deepest remembered one
//! says how much of the prompt this router has already sent to one pod. A prompt matched only
//! at a shallow depth (a chat template's header that every tenant shares) gets a home worth
//! little — twice the fraction of the prompt it covers, at most 1 — so one pod does not become
//! the home of everything that starts alike. A shared prefix that is most of a prompt (a system
//! prompt every chat session starts with) is told apart from a tenant's own by where else it
//! lives: a home counts only beyond the *commons*, what most other pods hold too ([`value`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most remembered prefix depths (about eight per distinct prompt); beyond it the expired and
/// then the stalest go first. ~48 bytes each.
pub const MAX_HOMES: usize = 262_144;

/// One remembered depth: the pod that owns it and when this router last sent it there.
#[derive(Debug, Clone)]
struct Home {
    pod: Arc<str>,
    at: Instant,
}

/// The prompt's home: its pod and how many leading blocks of the prompt it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found<'a> {
    pub pod: &'a str,
    pub blocks: usize,
}

/// Every remembered home (see the module docs).
#[derive(Debug, Default)]
pub struct Homes {
    map: HashMap<u64, Home>,
    /// Interned pod keys, so an entry costs a pointer rather than a string; with each pod's
    /// number of entries (expired ones included until the next prune).
    pods: HashMap<String, (Arc<str>, usize)>,
    /// When expired entries were last dropped.
    pruned_at: Option<Instant>,
}

/// What a home at `depth` blocks is worth to a prompt of `chain_len` blocks when `commons`
/// leading blocks are held by most other pods anyway: the share of the rest of the prompt it
/// covers, doubled (depths are powers of two, so a prompt sent whole before is remembered to at
/// least half its length: that counts as all of it), at most 1; 0 when the home covers no more
/// than the commons.
///
/// The commons are what tells a tenant's prefix from a system prompt every session shares: the
/// latter ends up resident on every pod, so its home is worth nothing and new sessions spread;
/// a tenant's prefix lives on its home (and at most on a pod or two it was moved to for load),
/// so its home keeps its worth.
pub fn value(depth: usize, commons: usize, chain_len: usize) -> f64 {
    let rest = chain_len.saturating_sub(commons);
    if depth <= commons || rest == 0 {
        return 0.0;
    }
    (2.0 * (depth - commons) as f64 / rest as f64).min(1.0)
}

/// A home is overloaded, and claims nothing, while its pod carries more than this many times
/// the mean load (running + waiting requests, projected) of the model's eligible pods, plus one.
/// One prefix whose traffic is more than a pod's worth (a system prompt every chat session
/// starts with) must spread before the commons can see it on the other pods: measured on the
/// bench's `multi_turn` (8 pods, 96 req/s, `affinity: 3`), without it 129 of 240 requests went
/// to one pod (TTFT p90 0.83 s); with it 22–38 per pod and TTFT p90 0.06 s, as with homes off.
/// Three, not two (both fix `multi_turn`): on issue 16's load two gave hit rates 0.663 / 0.675,
/// three 0.680 / 0.683 (two runs each; without the rule 0.692–0.699 in three). Among four pods,
/// three means one pod carrying three times the other three together, plus four.
pub const OVERLOAD: f64 = 3.0;

/// Whether a home whose pod carries `load` is [`OVERLOAD`]ed against the pods' `mean` load.
pub fn overloaded(load: f64, mean: f64) -> bool {
    load > OVERLOAD * mean + 1.0
}

/// The commons of [`value`]: the longest match more than half of `others` hold (their matched
/// blocks, in any order; reordered here). 0 without others. More than half, so that a tenant's
/// prefix moved once for load (its home and one sibling hold it) keeps its home among three or
/// more pods.
pub fn commons(others: &mut [usize]) -> usize {
    if others.is_empty() {
        return 0;
    }
    others.sort_unstable_by(|a, b| b.cmp(a));
    // The (⌊k/2⌋+1)-th longest: more than half of the k others hold this much.
    others[others.len() / 2]
}

/// What moving a prompt to a sibling would evict there: the share of the sibling's free KV pool
/// (the blocks its running requests do not hold, `1 - kv_usage` of its cache) that the
/// prompt's `new_blocks` there take, at most 1. A home's claim ([`value`]) is scaled by the
/// largest share among its siblings.
///
/// Why: a home is worth keeping because a move copies the prefix onto a pod whose LRU then
/// evicts another prefix, which costs its owner a prefill too. That holds where the caches are
/// starved — issue 16's load, every pod's KV about 0.9 in use, a tenant's 181 blocks more than a
/// pod's free pool — and not where every sibling's free pool holds many such copies: the copy
/// then evicts only the oldest of many cached blocks, and keeping the prompt on a loaded home
/// costs its time to first token for nothing. Measured on the bench's `multi_turn` (8 pods of
/// 2,644 blocks, 96 req/s, the winner's KV about 0.14 in use): TTFT p90 0.068–0.075 s with full
/// claims, 0.049–0.053 s scaled (homes off: 0.050 s); issue 16's load level (hit rate 0.66 /
/// 0.71 / 0.67 / 0.72 against 0.70 / 0.72 / 0.67 / 0.68 unscaled, interleaved runs). The largest
/// share, not the smallest: one roomy sibling is not a fleet with room (scaling by the smallest
/// gave issue 16's load 0.68 / 0.64).
pub fn eviction_share(new_blocks: u32, kv_usage: f64, num_gpu_blocks: u64) -> f64 {
    let free = (1.0 - kv_usage).clamp(0.0, 1.0) * num_gpu_blocks as f64;
    if free < 1.0 {
        return 1.0;
    }
    (f64::from(new_blocks) / free).min(1.0)
}

/// Chain indices that name a prefix: 0, 1, 3, 7, … below `len`.
fn depths(len: usize) -> impl DoubleEndedIterator<Item = usize> {
    // 2^k - 1 < len for k in 0..=floor(log2(len)).
    (0..usize::BITS - len.leading_zeros()).map(|k| (1usize << k) - 1)
}

impl Homes {
    /// Records that `chain` was routed to `pod` at `now`: every depth without a live home
    /// becomes `pod`'s, and `pod`'s own are refreshed. Depths another pod owns stay its own.
    pub fn record(&mut self, pod: &str, chain: &[u64], now: Instant, ttl: Duration) {
        if chain.is_empty() {
            return;
        }
        // Expired entries are dropped a few times per TTL, so the per-pod counts stay close to
        // the live homes.
        if self.map.len() >= MAX_HOMES
            || self
                .pruned_at
                .is_none_or(|at| now.saturating_duration_since(at) > ttl / 4)
        {
            self.prune(now, ttl);
        }
        let pod = match self.pods.get(pod) {
            Some((k, _)) => k.clone(),
            None => {
                let k: Arc<str> = Arc::from(pod);
                self.pods.insert(pod.to_owned(), (k.clone(), 0));
                k
            }
        };
        let mut gained = 0;
        for d in depths(chain.len()) {
            let previous = match self.map.get_mut(&chain[d]) {
                Some(home) if home.pod == pod => {
                    home.at = now;
                    continue;
                }
                Some(home) if now.saturating_duration_since(home.at) <= ttl => continue,
                Some(home) => {
                    home.at = now;
                    Some(std::mem::replace(&mut home.pod, pod.clone()))
                }
                None => {
                    self.map.insert(
                        chain[d],
                        Home {
                            pod: pod.clone(),
                            at: now,
                        },
                    );
                    None
                }
            };
            if let Some(p) = previous
                && let Some(e) = self.pods.get_mut(&*p)
            {
                e.1 = e.1.saturating_sub(1);
            }
            gained += 1;
        }
        if let Some(e) = self.pods.get_mut(&*pod) {
            e.1 += gained;
        }
    }

    /// How many prefix depths `pod` is the home of (expired ones until the next prune, at
    /// most a quarter of the TTL later).
    pub fn count(&self, pod: &str) -> usize {
        self.pods.get(pod).map_or(0, |(_, n)| *n)
    }

    /// The home of the deepest remembered depth of `chain` that is still live.
    pub fn find(&self, chain: &[u64], now: Instant, ttl: Duration) -> Option<Found<'_>> {
        depths(chain.len()).rev().find_map(|d| {
            self.map
                .get(&chain[d])
                .filter(|h| now.saturating_duration_since(h.at) <= ttl)
                .map(|h| Found {
                    pod: &h.pod,
                    blocks: d + 1,
                })
        })
    }

    /// Forgets every home of a pod that left: its prefixes find new homes at once.
    pub fn forget_pod(&mut self, pod: &str) {
        if let Some((k, _)) = self.pods.remove(pod) {
            self.map.retain(|_, h| h.pod != k);
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Drops the expired homes, and when that is not enough the stalest tenth (so the scan is
    /// paid rarely: a few times per TTL, a few milliseconds at the cap, under the registry
    /// lock).
    fn prune(&mut self, now: Instant, ttl: Duration) {
        self.pruned_at = Some(now);
        self.map
            .retain(|_, h| now.saturating_duration_since(h.at) <= ttl);
        if self.map.len() >= MAX_HOMES * 9 / 10 {
            let mut ages: Vec<Instant> = self.map.values().map(|h| h.at).collect();
            let cut = ages.len() / 10;
            let (_, &mut oldest_kept, _) = ages.select_nth_unstable(cut);
            self.map.retain(|_, h| h.at > oldest_kept);
        }
        for (_, n) in self.pods.values_mut() {
            *n = 0;
        }
        for h in self.map.values() {
            if let Some(e) = self.pods.get_mut(&*h.pod) {
                e.1 += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(120);

    fn chain(tenant: u64, len: usize) -> Vec<u64> {
        (0..len as u64).map(|i| tenant << 32 | i).collect()
    }

    #[test]
    fn depths_are_one_less_than_powers_of_two() {
        assert_eq!(depths(0).collect::<Vec<_>>(), Vec::<usize>::new());
        assert_eq!(depths(1).collect::<Vec<_>>(), vec![0]);
        assert_eq!(depths(8).collect::<Vec<_>>(), vec![0, 1, 3, 7]);
        assert_eq!(depths(200).count(), 8);
    }

    #[test]
    fn the_first_pod_keeps_a_prefix_sent_elsewhere_for_load() {
        let (mut h, t0) = (Homes::default(), Instant::now());
        let c = chain(1, 100);
        h.record("a", &c, t0, TTL);
        h.record("b", &c, t0 + Duration::from_secs(1), TTL);
        let found = h.find(&c, t0 + Duration::from_secs(2), TTL).unwrap();
        assert_eq!((found.pod, found.blocks), ("a", 64));
    }

    #[test]
    fn a_home_not_used_for_the_ttl_passes_to_the_pod_that_serves_the_prefix() {
        let (mut h, t0) = (Homes::default(), Instant::now());
        let c = chain(1, 10);
        h.record("a", &c, t0, TTL);
        // Refreshed by its own pod, so it outlives the first TTL.
        h.record("a", &c, t0 + Duration::from_secs(100), TTL);
        h.record("b", &c, t0 + Duration::from_secs(150), TTL);
        assert_eq!(
            h.find(&c, t0 + Duration::from_secs(150), TTL).unwrap().pod,
            "a"
        );
        h.record("b", &c, t0 + Duration::from_secs(221), TTL);
        assert_eq!(
            h.find(&c, t0 + Duration::from_secs(221), TTL).unwrap().pod,
            "b"
        );
        assert!(h.find(&c, t0 + Duration::from_secs(400), TTL).is_none());
    }

    #[test]
    fn a_shared_header_gives_a_new_prompt_only_a_shallow_home() {
        let (mut h, t0) = (Homes::default(), Instant::now());
        // Two tenants whose prompts share their first two blocks (a template header).
        let a: Vec<u64> = (0..100)
            .map(|i| if i < 2 { i } else { 1 << 32 | i })
            .collect();
        let b: Vec<u64> = (0..100)
            .map(|i| if i < 2 { i } else { 2 << 32 | i })
            .collect();
        h.record("pod-a", &a, t0, TTL);
        assert_eq!(h.find(&a, t0, TTL).unwrap().blocks, 64);
        let found = h.find(&b, t0, TTL).unwrap();
        assert_eq!(
            (found.pod, found.blocks),
            ("pod-a", 2),
            "only the header is pod-a's"
        );
        h.record("pod-b", &b, t0, TTL);
        assert_eq!(h.find(&b, t0, TTL).unwrap().pod, "pod-b");
        assert_eq!(h.find(&a, t0, TTL).unwrap().pod, "pod-a");
    }

    #[test]
    fn a_home_counts_beyond_what_most_other_pods_hold() {
        // A prompt of 100 blocks whose home holds 64.
        assert_eq!(value(64, 0, 100), 1.0);
        assert_eq!(value(16, 0, 100), 0.32);
        // A shared 40-block system prompt on every pod: a home that ends inside it is worth
        // nothing; a session's own turns beyond it count against the rest of the prompt.
        assert_eq!(value(32, 40, 100), 0.0);
        assert_eq!(value(64, 40, 100), 0.8);
        assert_eq!(value(5, 5, 5), 0.0);
        // Commons: more than half of the others.
        assert_eq!(commons(&mut []), 0);
        assert_eq!(commons(&mut [40]), 40);
        assert_eq!(
            commons(&mut [62, 0]),
            0,
            "moved once: one sibling of two holds it"
        );
        assert_eq!(commons(&mut [0, 62, 0]), 0);
        assert_eq!(commons(&mut [40, 0, 40]), 40);
        assert_eq!(commons(&mut [40, 40, 40, 0, 0, 0, 40]), 40, "4 of 7");
        assert_eq!(commons(&mut [40, 40, 40, 0, 0, 0, 0]), 0, "3 of 7");
    }

    #[test]
    fn a_move_evicts_what_the_siblings_free_pool_cannot_spare() {
        // Issue 16's shape: 1,200 blocks, 0.9 in use, a tenant's 181 blocks: more than the pool.
        assert_eq!(eviction_share(181, 0.9, 1200), 1.0);
        // Half the pool.
        assert!((eviction_share(60, 0.9, 1200) - 0.5).abs() < 1e-9);
        // multi_turn's shape: 2,644 blocks, 0.14 in use, a 150-block history: a small share.
        assert!(eviction_share(150, 0.14, 2644) < 0.07);
        // Nothing to copy: nothing evicted; no free pool at all (or a report over 1): all of it.
        assert_eq!(eviction_share(0, 0.5, 1000), 0.0);
        assert_eq!(eviction_share(1, 1.0, 1000), 1.0);
        assert_eq!(eviction_share(1, 1.2, 1000), 1.0);
        assert_eq!(eviction_share(5, 0.0, 0), 1.0);
    }

    #[test]
    fn a_home_far_above_the_mean_load_is_overloaded() {
        // Loads [30, 2, 2, 2]: mean 9, 30 > 28.
        assert!(overloaded(30.0, 9.0));
        // [24, 3, 3, 3]: mean 8.25, 24 < 25.75.
        assert!(!overloaded(24.0, 8.25));
        // Nothing running anywhere but one request at home: not overloaded.
        assert!(!overloaded(1.0, 0.25));
    }

    #[test]
    fn a_pod_that_leaves_takes_its_homes_with_it() {
        let (mut h, t0) = (Homes::default(), Instant::now());
        h.record("a", &chain(1, 10), t0, TTL);
        h.record("b", &chain(2, 10), t0, TTL);
        h.forget_pod("a");
        assert!(h.find(&chain(1, 10), t0, TTL).is_none());
        assert_eq!(h.find(&chain(2, 10), t0, TTL).unwrap().pod, "b");
        h.record("c", &chain(1, 10), t0, TTL);
        assert_eq!(h.find(&chain(1, 10), t0, TTL).unwrap().pod, "c");
    }

    #[test]
    fn memory_is_bounded_and_the_freshest_homes_survive() {
        let (mut h, t0) = (Homes::default(), Instant::now());
        // One-block prompts: one entry each.
        let n = MAX_HOMES + 1000;
        for i in 0..n as u64 {
            h.record("a", &[i], t0 + Duration::from_millis(i / 100), TTL);
        }
        assert!(h.len() <= MAX_HOMES, "{}", h.len());
        let now = t0 + Duration::from_millis(n as u64 / 100);
        assert!(h.find(&[n as u64 - 1], now, TTL).is_some());
        assert!(h.find(&[0], now, TTL).is_none());
    }
}
