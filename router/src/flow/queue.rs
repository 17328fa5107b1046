//! The router's queue, as data: no clock, no I/O, no knowledge of what a queued entry is
//! (`T`), so its order is tested alone.
//!
//! One lane per model (the pods a request can go to); in a lane, strict priority between bands;
//! in a band, fair shares by tokens between tenants with virtual token counters (Sheng et al.,
//! "Fairness in Serving Large Language Models", OSDI '24): the tenant whose counter is lowest
//! goes next and is charged the entry's tokens (prompt plus the most it may generate); a tenant
//! that starts waiting is lifted to the lowest counter of those already waiting, so time spent
//! idle is not saved up as credit. Within a tenant, the earliest deadline goes first.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

// The runtime's clock, so tests with paused time drive the drain rate.
use tokio::time::Instant;

/// A queued request and what orders it.
#[derive(Debug)]
pub struct Entry<T> {
    pub id: u64,
    pub lane: String,
    pub priority: i32,
    pub tenant: String,
    /// Tokens charged to the tenant when it leaves: prompt plus the most it may generate.
    pub cost: u64,
    /// Bytes it holds while queued.
    pub bytes: usize,
    /// Leaves the queue (dispatched or shed) by then.
    pub deadline: Instant,
    pub enqueued: Instant,
    pub payload: T,
}

/// Where an entry sits, by id.
#[derive(Debug, Clone)]
struct Slot {
    lane: String,
    priority: i32,
    tenant: String,
    key: (Instant, u64),
}

#[derive(Debug)]
struct TenantQueue<T> {
    /// Tokens charged so far in this band, relative to the other waiting tenants.
    counter: u64,
    entries: BTreeMap<(Instant, u64), Entry<T>>,
    tokens: u64,
}

#[derive(Debug)]
struct Band<T> {
    tenants: HashMap<String, TenantQueue<T>>,
}

impl<T> Band<T> {
    /// The tenant that goes next: the lowest counter, then the earliest head.
    fn next_tenant(&self) -> Option<&str> {
        self.tenants
            .iter()
            .filter_map(|(name, t)| Some((t.counter, *t.entries.keys().next()?, name)))
            .min()
            .map(|(_, _, name)| name.as_str())
    }
}

/// How fast a lane's queue drains while it is not empty, decayed over [`RATE_DECAY`].
#[derive(Debug, Clone, Copy, Default)]
struct DrainRate {
    tokens: f64,
    backlogged_s: f64,
    /// Backlogged seconds ever measured, not decayed: whether the rate means anything yet.
    span_s: f64,
    at: Option<Instant>,
}

/// The time constant of [`DrainRate`]: long enough to span a few dispatches under any load,
/// short enough to follow a fleet that grows or shrinks.
const RATE_DECAY: Duration = Duration::from_secs(10);

/// Backlogged time measured before a drain rate is trusted.
const MIN_RATE_SPAN: Duration = Duration::from_millis(200);

impl DrainRate {
    /// Moves the clock to `now`; the lane was backlogged since the last call when `backlogged`.
    fn advance(&mut self, now: Instant, backlogged: bool) {
        if let Some(at) = self.at {
            let dt = now.saturating_duration_since(at).as_secs_f64();
            let tau = RATE_DECAY.as_secs_f64();
            let decay = (-dt / tau).exp();
            self.tokens *= decay;
            self.backlogged_s *= decay;
            if backlogged {
                // ∫ e^{-(t'-t)/τ} over the interval.
                self.backlogged_s += tau * (1.0 - decay);
                self.span_s += dt;
            }
        }
        self.at = Some(now);
    }

    fn tokens_per_s(&self) -> Option<f64> {
        // Both sides decay alike, so an idle lane keeps the rate it last measured (until the
        // decay reaches the floating point floor).
        (self.span_s >= MIN_RATE_SPAN.as_secs_f64()
            && self.tokens > 0.0
            && self.backlogged_s > 1e-12)
            .then(|| self.tokens / self.backlogged_s)
    }
}

#[derive(Debug)]
struct Lane<T> {
    bands: BTreeMap<Reverse<i32>, Band<T>>,
    len: usize,
    rate: DrainRate,
    /// Tokens each tenant was let through recently (queued or not), decayed over
    /// [`USAGE_DECAY`]: who is within a fair share of the lane.
    usage: HashMap<String, Usage>,
}

impl<T> Lane<T> {
    fn new() -> Self {
        Lane {
            bands: BTreeMap::new(),
            len: 0,
            rate: DrainRate::default(),
            usage: HashMap::new(),
        }
    }
}

/// Decayed tokens of one tenant.
#[derive(Debug, Clone, Copy)]
struct Usage {
    tokens: f64,
    at: Instant,
}

impl Usage {
    fn at(&self, now: Instant) -> f64 {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens * (-dt / USAGE_DECAY.as_secs_f64()).exp()
    }
}

/// The memory of who was served how much: a burst shows within a second or two, a tenant
/// that stopped is forgotten within a few of these.
const USAGE_DECAY: Duration = Duration::from_secs(5);

/// Tenants remembered per lane; beyond it the least served are forgotten.
const MAX_USAGE_TENANTS: usize = 4096;

/// The queue of one router replica.
#[derive(Debug)]
pub struct Queue<T> {
    lanes: HashMap<String, Lane<T>>,
    slots: HashMap<u64, Slot>,
    bytes: usize,
    next_id: u64,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Queue {
            lanes: HashMap::new(),
            slots: HashMap::new(),
            bytes: 0,
            next_id: 0,
        }
    }
}

/// What an entry is asked to join with.
#[derive(Debug)]
pub struct Join<T> {
    pub lane: String,
    pub priority: i32,
    pub tenant: String,
    pub cost: u64,
    pub bytes: usize,
    pub deadline: Instant,
    pub payload: T,
}

impl<T> Queue<T> {
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Entries waiting for `lane`.
    pub fn lane_len(&self, lane: &str) -> usize {
        self.lanes.get(lane).map_or(0, |l| l.len)
    }

    /// The lanes with entries.
    pub fn lanes(&self) -> Vec<String> {
        self.lanes
            .iter()
            .filter(|(_, l)| l.len > 0)
            .map(|(k, _)| k.clone())
            .collect()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.slots.contains_key(&id)
    }

    /// Tokens that leave the queue before an entry joining with `j` would, by the order above:
    /// everything in higher bands, and in its band each tenant's tokens up to what its own
    /// tenant has ahead of it plus its own (what fair shares serve of every tenant meanwhile).
    pub fn tokens_ahead<U>(&self, j: &Join<U>) -> u64 {
        let Some(lane) = self.lanes.get(&j.lane) else {
            return 0;
        };
        let mut ahead = 0;
        for (Reverse(p), band) in &lane.bands {
            if *p > j.priority {
                ahead += band.tenants.values().map(|t| t.tokens).sum::<u64>();
            } else if *p == j.priority {
                let own = band.tenants.get(&j.tenant).map_or(0, |t| {
                    t.entries
                        .range(..(j.deadline, u64::MAX))
                        .map(|(_, e)| e.cost)
                        .sum::<u64>()
                });
                let share = own + j.cost;
                ahead += own;
                ahead += band
                    .tenants
                    .iter()
                    .filter(|(name, _)| **name != j.tenant)
                    .map(|(_, t)| t.tokens.min(share))
                    .sum::<u64>();
            }
        }
        ahead
    }

    /// The lane's drain rate, tokens per second, once measured.
    pub fn drain_rate(&self, lane: &str) -> Option<f64> {
        self.lanes.get(lane)?.rate.tokens_per_s()
    }

    /// Adds an entry at `now`; returns its id.
    pub fn push(&mut self, j: Join<T>, now: Instant) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let lane = self.lanes.entry(j.lane.clone()).or_insert_with(Lane::new);
        lane.rate.advance(now, lane.len > 0);
        let band = lane
            .bands
            .entry(Reverse(j.priority))
            .or_insert_with(|| Band {
                tenants: HashMap::new(),
            });
        if !band.tenants.contains_key(&j.tenant) {
            // Lifted to the lowest counter of those waiting: idle time is no credit.
            let floor = band.tenants.values().map(|t| t.counter).min().unwrap_or(0);
            band.tenants.insert(
                j.tenant.clone(),
                TenantQueue {
                    counter: floor,
                    entries: BTreeMap::new(),
                    tokens: 0,
                },
            );
        }
        let t = band.tenants.get_mut(&j.tenant).expect("inserted above");
        let key = (j.deadline, id);
        t.tokens += j.cost;
        self.bytes += j.bytes;
        self.slots.insert(
            id,
            Slot {
                lane: j.lane.clone(),
                priority: j.priority,
                tenant: j.tenant.clone(),
                key,
            },
        );
        t.entries.insert(
            key,
            Entry {
                id,
                lane: j.lane,
                priority: j.priority,
                tenant: j.tenant,
                cost: j.cost,
                bytes: j.bytes,
                deadline: j.deadline,
                enqueued: now,
                payload: j.payload,
            },
        );
        lane.len += 1;
        id
    }

    /// The entry `id`, while queued.
    pub fn get(&self, id: u64) -> Option<&Entry<T>> {
        let slot = self.slots.get(&id)?;
        self.lanes
            .get(&slot.lane)?
            .bands
            .get(&Reverse(slot.priority))?
            .tenants
            .get(&slot.tenant)?
            .entries
            .get(&slot.key)
    }

    /// The entry of `lane` that goes next, if any.
    pub fn peek(&self, lane: &str) -> Option<&Entry<T>> {
        let band = self
            .lanes
            .get(lane)?
            .bands
            .values()
            .find(|b| !b.tenants.is_empty())?;
        let t = band.tenants.get(band.next_tenant()?)?;
        t.entries.values().next()
    }

    /// Takes the entry `id` out because it leaves for a pod: its tenant is charged its tokens
    /// and the lane's drain rate counts them.
    pub fn dispatch(&mut self, id: u64, now: Instant) -> Option<Entry<T>> {
        let e = self.take(id, now, true)?;
        Some(e)
    }

    /// Takes the entry `id` out without charging anyone (shed, or its client left).
    pub fn remove(&mut self, id: u64, now: Instant) -> Option<Entry<T>> {
        self.take(id, now, false)
    }

    fn take(&mut self, id: u64, now: Instant, charge: bool) -> Option<Entry<T>> {
        let slot = self.slots.remove(&id)?;
        let lane = self.lanes.get_mut(&slot.lane)?;
        lane.rate.advance(now, lane.len > 0);
        let band = lane.bands.get_mut(&Reverse(slot.priority))?;
        let t = band.tenants.get_mut(&slot.tenant)?;
        let e = t.entries.remove(&slot.key)?;
        t.tokens -= e.cost;
        if charge {
            t.counter += e.cost;
            lane.rate.tokens += e.cost as f64;
        }
        let served = charge.then(|| (e.tenant.clone(), e.cost));
        if t.entries.is_empty() {
            band.tenants.remove(&slot.tenant);
        }
        if band.tenants.is_empty() {
            lane.bands.remove(&Reverse(slot.priority));
        }
        lane.len -= 1;
        self.bytes -= e.bytes;
        if let Some((tenant, cost)) = served {
            self.note_served(&slot.lane, &tenant, cost, now);
        }
        Some(e)
    }

    /// Counts `cost` tokens let through for `tenant` on `lane` (a queued entry leaving does
    /// this itself; a request let through at once is told here).
    pub fn note_served(&mut self, lane: &str, tenant: &str, cost: u64, now: Instant) {
        let lane = self.lanes.entry(lane.to_owned()).or_insert_with(Lane::new);
        let u = lane.usage.entry(tenant.to_owned()).or_insert(Usage {
            tokens: 0.0,
            at: now,
        });
        *u = Usage {
            tokens: u.at(now) + cost as f64,
            at: now,
        };
        if lane.usage.len() > MAX_USAGE_TENANTS {
            let total: f64 = lane.usage.values().map(|u| u.at(now)).sum();
            lane.usage.retain(|_, u| u.at(now) > total * 1e-4);
        }
    }

    /// Whether `tenant` has been let through no more than an even share of what `lane` let
    /// through recently, among the tenants it served (counting `tenant` itself).
    pub fn within_share(&self, lane: &str, tenant: &str, now: Instant) -> bool {
        let Some(l) = self.lanes.get(lane) else {
            return true;
        };
        let values: Vec<(&String, f64)> = l.usage.iter().map(|(k, u)| (k, u.at(now))).collect();
        let total: f64 = values.iter().map(|(_, v)| v).sum();
        if total <= 0.0 {
            return true;
        }
        let own = values
            .iter()
            .find(|(k, _)| k.as_str() == tenant)
            .map_or(0.0, |(_, v)| *v);
        let mut tenants = values.iter().filter(|(_, v)| *v > 0.01 * total).count();
        if own <= 0.01 * total {
            tenants += 1;
        }
        own <= total / tenants as f64
    }

    /// Besides the lane's next entry, the first entry of every other tenant waiting in the
    /// same band, lowest counter first: who may go ahead when the next entry cannot.
    pub fn band_heads(&self, lane: &str) -> Vec<(u64, String)> {
        let Some(band) = self
            .lanes
            .get(lane)
            .and_then(|l| l.bands.values().find(|b| !b.tenants.is_empty()))
        else {
            return Vec::new();
        };
        let next = band.next_tenant();
        let mut heads: Vec<(u64, (Instant, u64), u64, String)> = band
            .tenants
            .iter()
            .filter(|(name, _)| Some(name.as_str()) != next)
            .filter_map(|(name, t)| {
                let (k, e) = t.entries.iter().next()?;
                Some((t.counter, *k, e.id, name.clone()))
            })
            .collect();
        heads.sort();
        heads
            .into_iter()
            .map(|(_, _, id, name)| (id, name))
            .collect()
    }

    /// The entry to displace for an arrival of `priority` when the queue is full: in the lowest
    /// band below it (any lane), the tenant that has been served most, its latest deadline.
    pub fn displaceable(&self, priority: i32) -> Option<u64> {
        let (_, band) = self
            .lanes
            .values()
            .flat_map(|l| l.bands.iter())
            .filter(|(Reverse(p), b)| *p < priority && !b.tenants.is_empty())
            .min_by_key(|(Reverse(p), _)| *p)?;
        let t = band
            .tenants
            .values()
            .max_by_key(|t| (t.counter + t.tokens, t.entries.len()))?;
        t.entries.values().next_back().map(|e| e.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join(lane: &str, priority: i32, tenant: &str, cost: u64, deadline: Instant) -> Join<u32> {
        Join {
            lane: lane.into(),
            priority,
            tenant: tenant.into(),
            cost,
            bytes: 10,
            deadline,
            payload: 0,
        }
    }

    /// Pops the whole lane in order: (tenant, cost) per entry.
    fn drain(q: &mut Queue<u32>, lane: &str, now: Instant) -> Vec<(String, i32)> {
        let mut out = Vec::new();
        while let Some(e) = q.peek(lane) {
            let id = e.id;
            let e = q.dispatch(id, now).unwrap();
            out.push((e.tenant, e.priority));
        }
        out
    }

    #[test]
    fn strict_priority_between_bands() {
        let now = Instant::now();
        let d = now + Duration::from_secs(10);
        let mut q = Queue::default();
        q.push(join("m", 0, "a", 10, d), now);
        q.push(join("m", 5, "b", 1000, d), now);
        q.push(join("m", 0, "a", 10, d), now);
        q.push(join("m", 5, "c", 1000, d), now);
        let order: Vec<i32> = drain(&mut q, "m", now).into_iter().map(|x| x.1).collect();
        assert_eq!(order, [5, 5, 0, 0]);
        assert!(q.is_empty() && q.bytes() == 0);
    }

    #[test]
    fn tenants_share_by_tokens_not_by_requests() {
        let now = Instant::now();
        let d = now + Duration::from_secs(10);
        let mut q = Queue::default();
        // `big` sends 10 requests of 1000 tokens, `small` 40 of 100: equal tokens per turn.
        for _ in 0..10 {
            q.push(join("m", 0, "big", 1000, d), now);
        }
        for _ in 0..40 {
            q.push(join("m", 0, "small", 100, d), now);
        }
        let order = drain(&mut q, "m", now);
        // Over every prefix of the order, the tokens served differ by at most one big request.
        let (mut big, mut small) = (0i64, 0i64);
        for (i, (t, _)) in order.iter().enumerate() {
            if t == "big" {
                big += 1000
            } else {
                small += 100
            }
            if big < 10_000 && small < 4_000 {
                assert!(
                    (big - small).abs() <= 1000,
                    "after {i}: big {big}, small {small}"
                );
            }
        }
    }

    #[test]
    fn a_tenant_that_starts_waiting_gets_no_credit_for_idle_time() {
        let now = Instant::now();
        let d = now + Duration::from_secs(10);
        let mut q = Queue::default();
        for _ in 0..5 {
            q.push(join("m", 0, "a", 100, d), now);
        }
        for _ in 0..3 {
            let id = q.peek("m").unwrap().id;
            q.dispatch(id, now);
        }
        // `a` has been charged 300; `b` joins at `a`'s counter, not at 0 …
        for _ in 0..5 {
            q.push(join("m", 0, "b", 100, d), now);
        }
        let order: Vec<String> = drain(&mut q, "m", now).into_iter().map(|x| x.0).collect();
        // … so they alternate instead of `b` taking three turns first.
        assert_eq!(
            order[..4].iter().filter(|t| *t == "b").count(),
            2,
            "{order:?}"
        );
    }

    #[test]
    fn earliest_deadline_first_within_a_tenant_and_lanes_apart() {
        let now = Instant::now();
        let mut q = Queue::default();
        let late = q.push(join("m", 0, "a", 1, now + Duration::from_secs(9)), now);
        let soon = q.push(join("m", 0, "a", 1, now + Duration::from_secs(1)), now);
        q.push(join("other", 9, "z", 1, now), now);
        assert_eq!(q.peek("m").unwrap().id, soon);
        q.remove(soon, now);
        assert_eq!(q.peek("m").unwrap().id, late);
        assert_eq!(q.lane_len("m"), 1);
        assert_eq!(q.lane_len("other"), 1);
    }

    #[test]
    fn tokens_ahead_follow_the_order() {
        let now = Instant::now();
        let d = now + Duration::from_secs(10);
        let mut q = Queue::default();
        q.push(join("m", 9, "hi", 500, d), now);
        for _ in 0..10 {
            q.push(join("m", 0, "noisy", 1000, d), now);
        }
        // A quiet tenant's 1000 tokens wait for the higher band and one noisy turn, not ten.
        assert_eq!(q.tokens_ahead(&join("m", 0, "quiet", 1000, d)), 500 + 1000);
        // The noisy tenant's next waits for all of it.
        assert_eq!(
            q.tokens_ahead(&join("m", 0, "noisy", 1000, d)),
            500 + 10_000
        );
        // A higher band waits for nothing below it.
        assert_eq!(q.tokens_ahead(&join("m", 10, "x", 1, d)), 0);
    }

    #[test]
    fn the_displaced_entry_is_the_lowest_band_most_served_tenants_latest() {
        let now = Instant::now();
        let mut q = Queue::default();
        q.push(join("m", 0, "a", 10, now + Duration::from_secs(1)), now);
        let last = q.push(join("m", 0, "b", 10, now + Duration::from_secs(9)), now);
        q.push(join("m", 0, "b", 10, now + Duration::from_secs(2)), now);
        q.push(join("m", 3, "c", 10, now), now);
        assert_eq!(q.displaceable(5), Some(last));
        assert_eq!(q.displaceable(0), None, "nothing below the lowest band");
    }

    #[test]
    fn a_burst_puts_its_tenant_over_its_share_and_the_others_within() {
        let t0 = Instant::now();
        let mut q: Queue<u32> = Queue::default();
        for k in 0..20u64 {
            let now = t0 + Duration::from_millis(100 * k);
            q.note_served("m", "noisy", 1000, now);
            if k % 4 == 0 {
                for t in ["a", "b", "c"] {
                    q.note_served("m", t, 1000, now);
                }
            }
        }
        let now = t0 + Duration::from_secs(2);
        assert!(!q.within_share("m", "noisy", now));
        for t in ["a", "b", "c", "newcomer"] {
            assert!(q.within_share("m", t, now), "{t}");
        }
        assert!(q.within_share("other-lane", "noisy", now));
        // A minute later the burst is forgotten as its tenant's share.
        q.note_served("m", "a", 10, now + Duration::from_secs(60));
        q.note_served("m", "noisy", 5, now + Duration::from_secs(60));
        assert!(q.within_share("m", "noisy", now + Duration::from_secs(60)));
    }

    #[test]
    fn the_drain_rate_counts_backlogged_time_only() {
        let t0 = Instant::now();
        let d = t0 + Duration::from_secs(100);
        let mut q = Queue::default();
        assert_eq!(q.drain_rate("m"), None);
        let a = q.push(join("m", 0, "a", 1000, d), t0);
        let b = q.push(join("m", 0, "a", 1000, d), t0);
        q.dispatch(a, t0 + Duration::from_millis(500));
        q.dispatch(b, t0 + Duration::from_secs(1));
        // Idle for a minute: the rate is what was measured while backlogged, decayed alike.
        let r = q.drain_rate("m").unwrap();
        assert!((r - 2000.0).abs() < 100.0, "{r}");
        let c = q.push(join("m", 0, "a", 1000, d), t0 + Duration::from_secs(60));
        q.remove(c, t0 + Duration::from_secs(60));
        let r = q.drain_rate("m").unwrap();
        assert!((r - 2000.0).abs() < 100.0, "{r}");
    }
}
