//! Where each prefix lives: the pod this router first placed it on, remembered so that a prefix
//! evicted from every cache returns there, and so that a loaded home is not given up lightly.
//!
//! Why a router that sees real caches still needs a memory: past saturation the engines' LRU
//! evicts a tenant's prefix between two of its requests, and a loaded pod is skipped for an idle
//! sibling. Each such move places the prefix on a pod that did not hold it, where it evicts some
//! other tenant's, whose next request then moves too: every pod ends up holding every tenant and
//! none for long (docs/decisions/0006-homes.md).
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

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvsight_protocol::hash::prefix_depths as depths;

/// Most remembered prefix depths (about eight per distinct prompt); beyond it the expired and
/// then the stalest go first. ~80 bytes each.
pub const MAX_HOMES: usize = 262_144;

/// How long a prefix sent once counts towards its pod's working set ([`Homes::working_set`])
/// before a second request for it makes it count for as long as it stays homed. Ten seconds:
/// a tenant's first requests arrive about together and must see each other's placements before
/// any of them is reused, while a prompt nobody asks for again (a one-off question, a session's
/// last turn) must not weigh on its pod for the TTL.
pub const FRESH: Duration = Duration::from_secs(10);

/// One remembered depth: the pod that owns it, when this router last sent it there, when it
/// became that pod's, the blocks it adds beyond the depth below it, and whether it was sent
/// again (to any pod) since.
#[derive(Debug, Clone)]
struct Home {
    pod: Arc<str>,
    at: Instant,
    since: Instant,
    span: u32,
    reused: bool,
}

impl Home {
    /// Whether its span counts in its pod's working set at `now` (fresh ones already aged out
    /// by [`Homes::age`]).
    fn counted(&self, now: Instant) -> bool {
        self.reused || now.saturating_duration_since(self.since) <= FRESH
    }
}

/// The blocks depth index `d` (a depth of `d + 1` blocks) adds beyond the depth below it:
/// depths 1, 2, 4, 8, … cover 1, 1, 2, 4, … new blocks, so a prefix's spans add up to its
/// deepest remembered depth.
fn span(d: usize) -> u32 {
    u32::try_from((d + 1).div_ceil(2)).unwrap_or(u32::MAX)
}

/// One pod's side of the map.
#[derive(Debug)]
struct PodHomes {
    key: Arc<str>,
    /// Entries owned (expired ones included until the next prune).
    count: usize,
    /// Blocks of the counted homes ([`Homes::working_set`]).
    working_set: u64,
    /// Homes gained in the last [`FRESH`], oldest first: (when, chain hash).
    fresh: VecDeque<(Instant, u64)>,
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
    /// counts.
    pods: HashMap<String, PodHomes>,
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
/// starts with) must spread before the commons can see it on the other pods. Among four pods,
/// three means one pod carrying three times the other three together, plus four
/// (docs/decisions/0007-commons-and-overload.md).
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
/// starved, not where every sibling's free pool holds many such copies: there the copy evicts
/// only old blocks, and keeping the prompt on a loaded home costs its time to first token for
/// nothing. The largest share, not the smallest: one roomy sibling is not a fleet with room
/// (docs/decisions/0008-eviction-share.md).
pub fn eviction_share(new_blocks: u32, kv_usage: f64, num_gpu_blocks: u64) -> f64 {
    let free = (1.0 - kv_usage).clamp(0.0, 1.0) * num_gpu_blocks as f64;
    if free < 1.0 {
        return 1.0;
    }
    (f64::from(new_blocks) / free).min(1.0)
}

/// A home's claim on a prompt ([`Candidate::home`](crate::scheduler::Candidate)): its
/// [`value`] scaled by what a move would evict ([`eviction_share`], `evicts`), the commons
/// counted only as far as the siblings' caches can keep their copies — by `1 - evicts`.
///
/// Why the commons fade where caches are starved: there a copy a sibling holds is transient
/// (its LRU evicts it unless the prefix keeps being sent there), so "most other pods hold it
/// too" describes only what earlier moves for load left behind, and honouring it spreads the
/// prefix further. Where every sibling's free pool holds the prompt many times over (`evicts`
/// near 0) the commons count in full: there a copy stays (docs/decisions/0009-commons-fade.md).
pub fn claim(depth: usize, commons: usize, chain_len: usize, evicts: f64) -> f64 {
    let evicts = evicts.clamp(0.0, 1.0);
    let kept = value(depth, commons, chain_len);
    let own = value(depth, 0, chain_len);
    evicts * (evicts * own + (1.0 - evicts) * kept)
}

/// Two placements of one new prefix this close together were made by router replicas that
/// had not yet heard of each other's (the relay takes a round trip): every replica gives the
/// home to the lower pod key, whatever order it heard them in. Placements further apart are
/// settled by time: the earlier one keeps the home.
pub const CLAIM_TIE: Duration = Duration::from_millis(50);

/// `chain`'s hashes at its prefix depths, as `(chain index, hash)`.
fn marks(chain: &[u64]) -> Vec<(usize, u64)> {
    depths(chain.len()).map(|d| (d, chain[d])).collect()
}

/// Whether another replica's placement on `pod` at `at` takes over `home`, a live home on
/// another pod (see [`CLAIM_TIE`]).
fn claimed_first(at: Instant, pod: &str, home: &Home) -> bool {
    match home.since.checked_duration_since(at) {
        Some(earlier) if earlier > CLAIM_TIE => true,
        _ => {
            let gap = at
                .checked_duration_since(home.since)
                .unwrap_or(Duration::ZERO);
            gap <= CLAIM_TIE && pod < &*home.pod
        }
    }
}

impl Homes {
    /// Records that `chain` was routed to `pod` at `now`: every depth without a live home
    /// becomes `pod`'s, and `pod`'s own are refreshed. Depths another pod owns stay its own.
    pub fn record(&mut self, pod: &str, chain: &[u64], now: Instant, ttl: Duration) {
        self.record_marks(pod, &marks(chain), now, ttl, false);
    }

    /// Records a placement another router replica made (relayed by the pod's sidecar) as
    /// [`Self::record`] does, except that a live home this replica gave another pod passes to
    /// `pod` when the other replica placed it first (see [`CLAIM_TIE`]): replicas that placed
    /// a new prefix about together end up agreeing on one home. Returns the depths handed over.
    pub fn record_peer(&mut self, pod: &str, chain: &[u64], at: Instant, ttl: Duration) -> usize {
        self.record_marks(pod, &marks(chain), at, ttl, true)
    }

    /// [`Self::record_peer`] for a placement a pod's sidecar remembered: only its prefix depths,
    /// as `(chain index, hash)` pairs in depth order.
    pub fn restore(
        &mut self,
        pod: &str,
        marks: &[(usize, u64)],
        at: Instant,
        ttl: Duration,
    ) -> usize {
        self.record_marks(pod, marks, at, ttl, true)
    }

    fn record_marks(
        &mut self,
        pod: &str,
        marks: &[(usize, u64)],
        now: Instant,
        ttl: Duration,
        peer: bool,
    ) -> usize {
        if marks.is_empty() {
            return 0;
        }
        // Aged first: the prune's recount uses the same `now`.
        self.age(now);
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
            Some(e) => e.key.clone(),
            None => {
                let k: Arc<str> = Arc::from(pod);
                self.pods.insert(
                    pod.to_owned(),
                    PodHomes {
                        key: k.clone(),
                        count: 0,
                        working_set: 0,
                        fresh: VecDeque::new(),
                    },
                );
                k
            }
        };
        let (mut gained, mut grown, mut handovers) = (0, 0u64, 0);
        let mut fresh = Vec::new();
        for &(d, hash) in marks {
            let new = Home {
                pod: pod.clone(),
                at: now,
                since: now,
                span: span(d),
                reused: false,
            };
            let previous = match self.map.get_mut(&hash) {
                // Sent again, home or elsewhere for load (it is still asked for: a home whose
                // tenants moved for load must not look roomy and draw more). Counted from now
                // on, if it was not while fresh.
                Some(home)
                    if home.pod == pod
                        || (now.saturating_duration_since(home.at) <= ttl
                            && !(peer && claimed_first(now, &pod, home))) =>
                {
                    if home.pod == pod {
                        // A relayed placement may be older than this router's last send.
                        home.at = home.at.max(now);
                    }
                    if !home.reused {
                        if !home.counted(now)
                            && let Some(e) = self.pods.get_mut(&*home.pod)
                        {
                            e.working_set += u64::from(home.span);
                        }
                        home.reused = true;
                    }
                    continue;
                }
                Some(home) => {
                    if now.saturating_duration_since(home.at) <= ttl {
                        handovers += 1;
                    }
                    Some(std::mem::replace(home, new))
                }
                None => {
                    self.map.insert(hash, new);
                    None
                }
            };
            if let Some(p) = previous
                && let Some(e) = self.pods.get_mut(&*p.pod)
            {
                e.count = e.count.saturating_sub(1);
                if p.counted(now) {
                    e.working_set = e.working_set.saturating_sub(u64::from(p.span));
                }
            }
            gained += 1;
            grown += u64::from(span(d));
            fresh.push((now, hash));
        }
        if let Some(e) = self.pods.get_mut(&*pod) {
            e.count += gained;
            e.working_set += grown;
            e.fresh.extend(fresh);
        }
        handovers
    }

    /// How many prefix depths `pod` is the home of (expired ones until the next prune, at
    /// most a quarter of the TTL later).
    pub fn count(&self, pod: &str) -> usize {
        self.pods.get(pod).map_or(0, |e| e.count)
    }

    /// The blocks of the prefixes `pod` is home to that it will likely be asked for again:
    /// those this router was sent again while homed there (to any pod: one sent elsewhere for
    /// load is still asked for), and those it sent there in the last [`FRESH`] (as of the last
    /// [`Self::record`]). What a new prefix placed there
    /// competes with for the pod's cache (see `scorers::affinity`).
    pub fn working_set(&self, pod: &str) -> u64 {
        self.pods.get(pod).map_or(0, |e| e.working_set)
    }

    /// Ages the fresh homes: a home gained more than [`FRESH`] ago and never sent again stops
    /// counting in its pod's working set.
    fn age(&mut self, now: Instant) {
        let map = &self.map;
        for e in self.pods.values_mut() {
            while let Some(&(t, key)) = e.fresh.front() {
                if now.saturating_duration_since(t) <= FRESH {
                    break;
                }
                e.fresh.pop_front();
                // Only the same incarnation: the entry may have passed to another pod since.
                if let Some(h) = map.get(&key)
                    && h.pod == e.key
                    && h.since == t
                    && !h.reused
                {
                    e.working_set = e.working_set.saturating_sub(u64::from(h.span));
                }
            }
        }
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
        if let Some(e) = self.pods.remove(pod) {
            self.map.retain(|_, h| h.pod != e.key);
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
        for e in self.pods.values_mut() {
            e.count = 0;
            e.working_set = 0;
        }
        for h in self.map.values() {
            if let Some(e) = self.pods.get_mut(&*h.pod) {
                e.count += 1;
                if h.counted(now) {
                    e.working_set += u64::from(h.span);
                }
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

    /// Two replicas placed one new prefix on different pods before hearing of each other: once
    /// each has heard the other's placement, both name the same home — the lower pod key when
    /// the two were about simultaneous, else the earlier placement — whatever order the relays
    /// arrived in. Their working sets agree too.
    #[test]
    fn replicas_that_placed_a_prefix_about_together_agree_on_one_home() {
        let t0 = Instant::now();
        let c = chain(9, 40);
        let ms = Duration::from_millis;
        for (a_at, b_at, winner) in [
            (ms(0), ms(3), "pod-a"),   // a tie: the lower key
            (ms(3), ms(0), "pod-a"),   // a tie either way round
            (ms(200), ms(0), "pod-b"), // b clearly first
            (ms(0), ms(200), "pod-a"), // a clearly first
        ] {
            let (mut a, mut b) = (Homes::default(), Homes::default());
            a.record("pod-a", &c, t0 + a_at, TTL);
            b.record("pod-b", &c, t0 + b_at, TTL);
            let handed = a.record_peer("pod-b", &c, t0 + b_at, TTL)
                + b.record_peer("pod-a", &c, t0 + a_at, TTL);
            assert_eq!(handed, 6, "one side hands over all six depths");
            let now = t0 + ms(300);
            for h in [&a, &b] {
                assert_eq!(h.find(&c, now, TTL).unwrap().pod, winner);
                assert_eq!(h.working_set(winner), 32);
                let loser = if winner == "pod-a" { "pod-b" } else { "pod-a" };
                assert_eq!(h.working_set(loser), 0);
            }
        }
    }

    /// A standing home is not moved by another replica's later send elsewhere (for load), nor by
    /// this replica's own; a peer's send to the home refreshes it.
    #[test]
    fn a_standing_home_stays_when_another_replica_sends_the_prefix_elsewhere() {
        let (mut h, t0) = (Homes::default(), Instant::now());
        let c = chain(3, 16);
        h.record("pod-b", &c, t0, TTL);
        assert_eq!(
            h.record_peer("pod-a", &c, t0 + Duration::from_secs(5), TTL),
            0
        );
        h.record("pod-a", &c, t0 + Duration::from_secs(6), TTL);
        assert_eq!(
            h.find(&c, t0 + Duration::from_secs(7), TTL).unwrap().pod,
            "pod-b"
        );
        // Kept alive by the other replica's sends home, past this one's TTL.
        h.record_peer("pod-b", &c, t0 + Duration::from_secs(100), TTL);
        let later = t0 + Duration::from_secs(200);
        assert_eq!(h.find(&c, later, TTL).unwrap().pod, "pod-b");
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
        // The KV-starved load's shape: 1,200 blocks, 0.9 in use, a tenant's 181 blocks: more
        // than the pool.
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
    fn the_commons_count_where_copies_stay_and_fade_where_caches_are_starved() {
        // A tenant's 128-block home in a 196-block prompt, its prefix (181 blocks) on most
        // siblings: starved siblings (a move evicts all it copies) leave the home its worth.
        assert_eq!(claim(128, 181, 196, 1.0), 1.0);
        // Roomy siblings: the copies stay, the home is worth nothing beyond the commons (and
        // a move evicts little anyway).
        assert!(claim(128, 181, 196, 0.01) < 1e-3);
        // Half-starved: half the claim, of which half counts the commons.
        assert!((claim(128, 181, 196, 0.5) - 0.25).abs() < 1e-9);
        // No commons: the value scaled by what a move evicts, as before.
        assert!((claim(16, 0, 100, 0.5) - 0.16).abs() < 1e-9);
        assert_eq!(claim(64, 0, 100, 2.0), 1.0, "clamped");
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

    /// The working sets as [`Homes::working_set`] defines them, recounted from the entries.
    fn recount(h: &Homes, now: Instant) -> HashMap<String, u64> {
        let mut ws: HashMap<String, u64> = h.pods.keys().map(|k| (k.clone(), 0)).collect();
        for e in h.map.values() {
            if e.counted(now) {
                *ws.get_mut(&*e.pod).unwrap() += u64::from(e.span);
            }
        }
        ws
    }

    #[test]
    fn a_working_set_counts_what_was_sent_again_and_what_was_sent_lately() {
        let (mut h, t0) = (Homes::default(), Instant::now());
        let s = Duration::from_secs;
        // 100 blocks: depths 1 – 64, spans adding up to 64.
        h.record("a", &chain(1, 100), t0, TTL);
        h.record("a", &chain(2, 100), t0, TTL);
        assert_eq!(h.working_set("a"), 128, "both sent lately");
        h.record("a", &chain(1, 100), t0 + s(5), TTL);
        // Past the fresh window: tenant 2 was sent once and stops counting, tenant 1 stays.
        h.record("b", &chain(3, 10), t0 + s(11), TTL);
        assert_eq!(h.working_set("a"), 64);
        assert_eq!(h.working_set("b"), 8);
        // Sent again after it aged out: it counts again, for good.
        h.record("a", &chain(2, 100), t0 + s(20), TTL);
        assert_eq!(h.working_set("a"), 128);
        h.record("b", &chain(3, 10), t0 + s(60), TTL);
        assert_eq!(h.working_set("a"), 128);
        // Expired at `a` and taken by `b`: the blocks move with the home.
        h.record("b", &chain(1, 100), t0 + s(20) + TTL + s(1), TTL);
        assert_eq!(h.working_set("a"), 0, "tenant 2 expired too");
        assert_eq!(h.working_set("b"), 64 + 8);
        assert_eq!(h.working_set("nobody"), 0);
    }

    #[test]
    fn a_prefix_sent_elsewhere_for_load_stays_in_its_homes_working_set() {
        let (mut h, t0) = (Homes::default(), Instant::now());
        let s = Duration::from_secs;
        h.record("a", &chain(4, 100), t0, TTL);
        h.record("a", &chain(5, 100), t0, TTL);
        // Tenant 4's next request went to `b` for load: `a` is still its home, and it is
        // asked for again; tenant 5 is not.
        h.record("b", &chain(4, 100), t0 + s(5), TTL);
        assert_eq!(h.working_set("b"), 0, "no home gained");
        h.record("b", &chain(6, 10), t0 + s(11), TTL);
        assert_eq!(h.working_set("a"), 64, "tenant 4 only");
        assert_eq!(h.working_set("b"), 8);
    }

    #[test]
    fn working_sets_kept_incrementally_match_a_recount() {
        // A random walk of tenants over three pods and a minute and a half, with a TTL short
        // enough that homes expire and change pods: after every record the running sums are
        // what the entries say.
        let (mut h, t0) = (Homes::default(), Instant::now());
        let ttl = Duration::from_secs(30);
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let pods = ["a", "b", "c"];
        let mut now = t0;
        for _ in 0..3000 {
            now += Duration::from_millis(next() % 60);
            let tenant = next() % 40;
            let len = 1 + (next() % 300) as usize;
            let pod = pods[(next() % 3) as usize];
            h.record(pod, &chain(tenant, len), now, ttl);
            let ws = recount(&h, now);
            for p in pods {
                assert_eq!(
                    h.working_set(p),
                    ws.get(p).copied().unwrap_or(0),
                    "pod {p} at {:?}",
                    now - t0
                );
            }
        }
        assert!(now - t0 > ttl * 2, "homes expired during the walk");
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
