//! What this router replica knows about each pod: the sidecar's `Hello`, its latest `Load`, its
//! Bloom filter, what this router sent it since that load was sampled, and what the other
//! router replicas sent it, as its sidecar relays their placements.
//!
//! Replicas: every pick is handed to the pod's connection ([`Outbox`]) and relayed by the
//! sidecar to every other replica, which applies it as its own pick would count — pending chain,
//! projected load, the prefix's home ([`Registry::apply_placements`]). What decides where a
//! prefix goes thus reaches every replica within a round trip, not a report later.
//!
//! The registry is sans-I/O: the QUIC listener feeds it messages, the scheduler reads it and
//! records its picks. Time is passed in, so every rule here is testable without a clock.
//!
//! A pod is keyed by `namespace/name`. A new connection for the same key (a sidecar restart or a
//! reconnect) replaces the old state; messages from a replaced connection are ignored. A pod whose
//! reports stop for three of its announced load intervals is *stale*: it stays listed (so
//! `/debug/pods` shows it and its age) but receives no traffic until a report arrives or its
//! connection closes (QUIC's idle timeout closes dead connections within seconds).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::homes::Homes;
use kvsight_protocol::bloom::{BloomFilter, FilterError, PreparedChain};
use kvsight_protocol::messages::{
    CacheDelta, CacheSnapshot, Hello, Load, PackedChain, Phase, Placement, RecentPlacement, Routed,
};

/// Where this router's picks for a pod go to be relayed to the other replicas: the pod's QUIC
/// session drains it. Bounded: a pick never waits for it.
pub type Outbox = tokio::sync::mpsc::Sender<Routed>;

/// Identifies one accepted connection; stale messages carry an old id.
pub type ConnId = u64;

/// A report as received.
#[derive(Debug, Clone)]
pub struct LoadSample {
    pub load: Load,
    pub received_at: Instant,
    /// When vLLM's metrics were sampled, by this router's clock.
    pub sampled_at: Instant,
}

/// What a pick adds to its pod, for [`Registry::record_pick`].
#[derive(Debug, Clone, Copy)]
pub struct Picked<'a> {
    /// KV blocks the prompt newly occupies.
    pub new_blocks: u32,
    /// Prompt tokens the pod is predicted to compute.
    pub uncached_tokens: u32,
    /// The prompt's chain, remembered as pending (empty when the pod caches nothing).
    pub chain: &'a [u64],
    /// Relay the pick to the other router replicas (`scheduler.sharePlacements`).
    pub share: bool,
}

/// What a relayed placement tells this router (see [`Registry::apply_placements`]).
#[derive(Debug, Clone, Copy)]
pub struct PeerPolicy {
    /// `scheduler.pendingTtlSeconds`.
    pub pending_ttl: Duration,
    /// `scheduler.affinityTtlSeconds` while homes are used; `None`: they are not.
    pub homes_ttl: Option<Duration>,
}

/// What [`Registry::apply_placements`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlacementsApplied {
    pub placements: usize,
    /// Prefix depths whose home this router had given one pod and now gives to another
    /// replica's pod (placed about together, see [`crate::homes`]).
    pub handovers: usize,
}

/// A request another router replica sent to the pod, as its sidecar relayed it.
#[derive(Debug, Clone, Copy)]
struct PeerSent {
    at: Instant,
    new_blocks: u32,
    uncached_tokens: u32,
}

/// A request this router sent to the pod, remembered until a load sample includes it.
#[derive(Debug, Clone, Copy)]
struct Sent {
    at: Instant,
    new_blocks: u32,
    /// Prompt tokens the pod was predicted to compute (not found in its cache).
    uncached_tokens: u32,
    /// Blocks and uncached tokens of every send up to and including this one (running totals),
    /// so the sum over the sends after a cutoff is one subtraction: a pick reads every pod's
    /// projection, and a busy pod can have thousands of sends inside the admission lag.
    cum_blocks: u64,
    cum_uncached: u64,
}

/// One pod's state.
#[derive(Debug)]
pub struct Pod {
    pub key: String,
    pub conn: ConnId,
    pub hello: Hello,
    pub joined_at: Instant,
    pub load: Option<LoadSample>,
    pub filter: Option<BloomFilter>,
    /// This router's requests currently in flight on the pod.
    pub inflight: u32,
    /// This router's requests here that finished after the last report's sample: when each was
    /// sent and when it finished. The report may still count them (see [`Pod::projection`]).
    finished: VecDeque<(Instant, Instant)>,
    pub last_picked: Option<Instant>,
    sent: VecDeque<Sent>,
    /// Chains of prompts routed here, until their TTL, indexed by their first block: a burst
    /// sharing a new prefix lands together instead of scattering before the first prefill is
    /// reported. Whole chains (one shared allocation per pick) rather than one entry per block,
    /// because a chain hash commits to everything before it: the pending match of a request is
    /// its longest common prefix with one of these chains.
    pending: HashMap<u64, Vec<PendingChain>>,
    pending_chains: usize,
    /// Uncached prompt tokens of the requests routed here, smoothed: the size this router
    /// assumes for each request the pod reports waiting.
    mean_uncached_tokens: Option<f64>,
    /// When each of this router's streamed requests here that has not had its first event yet
    /// was sent, oldest first (see [`Pod::oldest_awaiting`]).
    awaiting: VecDeque<Instant>,
    /// Other replicas' sends, in time order, until a load sample includes them. Their finishes
    /// are not known here, so they count until that sample (a short request a moment too long).
    peer_sent: VecDeque<PeerSent>,
    /// Where this router's picks go to reach the other replicas, while the pod is connected.
    outbox: Option<Outbox>,
}

/// A routed prompt's chain and when it stops counting.
type PendingChain = (Arc<[u64]>, Instant);

/// The shortest silence that makes a pod stale. vLLM's `/metrics` can take hundreds of
/// milliseconds to answer on a busy engine, and the sidecar reports only after a scrape; with
/// the default 100 ms interval three missed reports alone would drop a busy, healthy pod.
pub const MIN_STALE_AFTER: Duration = Duration::from_secs(1);

/// How long a request may take from this router to vLLM's own counters (transit, the API
/// server's tokenization, the engine's next scheduler step). A request sent less than this
/// before a sample may be missing from it, so it still counts on top of the report: counting it
/// twice for a moment only makes the pod look busier, forgetting it lets a burst overfill a pod.
pub const ADMISSION_LAG: Duration = Duration::from_millis(100);

/// Most pending chains remembered per pod; beyond it the oldest are dropped first.
const MAX_PENDING_CHAINS: usize = 4096;

/// Most pending chains per first block (prompts sharing a system prompt): enough for a burst to
/// land together, small enough that matching a request against them stays cheap.
pub const MAX_PENDING_PER_FIRST_BLOCK: usize = 16;

/// The load the scheduler should assume: the last report plus what was sent since its sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Projection {
    pub running: u32,
    pub waiting: u32,
    pub kv_usage: f64,
    /// Requests sent since the sample (included above).
    pub sent_since_sample: u32,
    /// Prompt tokens the pod must compute before it reaches a request sent now: the requests it
    /// reported waiting (each of [`Pod::mean_uncached_tokens`], or of `None` here when that is
    /// unknown: see [`Projection::queued_prefill_tokens`]) and what this router sent since.
    pub queued_requests: u32,
    pub sent_prefill_tokens: u64,
}

impl Projection {
    /// The prefill backlog in tokens, assuming `per_request` tokens for each request the pod
    /// reported waiting whose size this router does not know.
    pub fn queued_prefill_tokens(&self, per_request: f64) -> f64 {
        f64::from(self.queued_requests) * per_request + self.sent_prefill_tokens as f64
    }
}

impl Pod {
    /// The pod's phase, or `Starting` before its first report.
    pub fn phase(&self) -> Phase {
        self.load.as_ref().map_or(Phase::Starting, |l| l.load.phase)
    }

    /// Time since the last report (since joining if none).
    pub fn report_age(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.load.as_ref().map_or(self.joined_at, |l| l.received_at))
    }

    /// Whether reports stopped for three load intervals, and for at least [`MIN_STALE_AFTER`].
    /// A stale pod keeps its registration (its QUIC connection is still open) but receives no
    /// new request until a report arrives again.
    pub fn is_stale(&self, now: Instant) -> bool {
        let interval = Duration::from_millis(u64::from(self.hello.load_interval_ms.max(10)));
        self.report_age(now) > (interval * 3).max(MIN_STALE_AFTER)
    }

    /// Whether `model` is a served name or a LoRA adapter of this pod.
    pub fn serves(&self, model: &str) -> bool {
        self.hello.models.iter().any(|m| m == model) || self.is_lora(model)
    }

    /// Whether `model` names one of this pod's LoRA adapters.
    pub fn is_lora(&self, model: &str) -> bool {
        self.hello.lora_adapters.iter().any(|m| m == model)
    }

    /// Projected load at `now` (see [`Projection`]).
    pub fn projection(&self) -> Projection {
        let Some(sample) = &self.load else {
            return Projection {
                running: 0,
                waiting: 0,
                kv_usage: 0.0,
                sent_since_sample: 0,
                queued_requests: 0,
                sent_prefill_tokens: 0,
            };
        };
        let counted = sample
            .sampled_at
            .checked_sub(ADMISSION_LAG)
            .unwrap_or(sample.sampled_at);
        // Sends are in time order: the ones after the cutoff are a suffix.
        let first = self.sent.partition_point(|s| s.at <= counted);
        let sent = u32::try_from(self.sent.len() - first).unwrap_or(u32::MAX);
        let (sent_blocks, sent_uncached) = match (self.sent.get(first), self.sent.back()) {
            (Some(f), Some(l)) => (
                l.cum_blocks - (f.cum_blocks - u64::from(f.new_blocks)),
                l.cum_uncached - (f.cum_uncached - u64::from(f.uncached_tokens)),
            ),
            _ => (0, 0),
        };
        // Of those, only requests still in flight are running (and holding blocks) now: short
        // requests that already finished must not make an idle pod look busy until the next
        // report. Which of them finished is known by send time; their blocks are scaled alike.
        let finished_newer = self.finished.iter().filter(|(at, _)| *at > counted).count();
        let n = sent
            .saturating_sub(u32::try_from(finished_newer).unwrap_or(u32::MAX))
            .min(self.inflight);
        let (blocks, uncached) = if sent == 0 {
            (0, 0)
        } else {
            (
                sent_blocks * u64::from(n) / u64::from(sent),
                sent_uncached * u64::from(n) / u64::from(sent),
            )
        };
        // This router's requests sent before the sample that have finished since: the report
        // counted them (unless one was still in transit when it was taken, an error of one
        // request for one interval, in the direction that cannot overfill a pod) and shows them
        // running until the next report, up to an interval later. A sequence of short requests
        // would otherwise find the pod that served the last one busy and pile onto its sibling.
        let finished = self
            .finished
            .iter()
            .filter(|(at, _)| *at <= sample.sampled_at)
            .count();
        let finished = u32::try_from(finished).unwrap_or(u32::MAX);
        // Other replicas' sends the sample cannot include yet.
        let first_peer = self.peer_sent.partition_point(|s| s.at <= counted);
        let (mut peers, mut blocks, mut uncached) = (0u32, blocks, uncached);
        for s in self.peer_sent.range(first_peer..) {
            peers += 1;
            blocks += u64::from(s.new_blocks);
            uncached += u64::from(s.uncached_tokens);
        }
        let n = n.saturating_add(peers);
        let slots = self.hello.engine.max_num_seqs.max(1);
        let l = &sample.load;
        let total = l.running.saturating_sub(finished).saturating_add(n);
        let running = total.min(slots);
        let waiting = l.waiting.saturating_add(total - running);
        let gpu_blocks = self.hello.engine.num_gpu_blocks.max(1) as f64;
        Projection {
            running,
            waiting,
            kv_usage: f64::from(l.kv_usage) + blocks as f64 / gpu_blocks,
            sent_since_sample: n,
            queued_requests: l.waiting,
            sent_prefill_tokens: uncached,
        }
    }

    /// The smoothed uncached prompt tokens of requests this router sent here, if it sent any.
    pub fn mean_uncached_tokens(&self) -> Option<f64> {
        self.mean_uncached_tokens
    }

    /// How long the oldest of this router's streamed requests here has been waiting for its
    /// first event at `now` (zero when none waits): what the pod's queue is really taking. The
    /// load report's counts say how many wait, not why; a queue held up by something the counts
    /// cannot show — running requests that hold every KV block for minutes (load that bypassed
    /// the router), a stalled engine — shows here, whatever the reason, and ends the moment the
    /// request gets its first token. Streamed requests only: an unstreamed answer's first byte
    /// is its last.
    pub fn oldest_awaiting(&self, now: Instant) -> Duration {
        self.awaiting
            .front()
            .map_or(Duration::ZERO, |&at| now.saturating_duration_since(at))
    }

    /// Folds a routed request's uncached prompt tokens into [`Self::mean_uncached_tokens`].
    fn note_uncached(&mut self, tokens: u32) {
        let u = f64::from(tokens);
        self.mean_uncached_tokens =
            Some(self.mean_uncached_tokens.map_or(u, |m| 0.9 * m + 0.1 * u));
    }

    /// Remembers `chain` as pending here until `expires`, unless the filter already holds it
    /// (its last block resident: the filter speaks for it and will also show its eviction).
    fn add_pending(&mut self, chain: &[u64], now: Instant, expires: Instant) {
        let Some(&first) = chain.first() else { return };
        if let (Some(f), Some(&last)) = (&self.filter, chain.last())
            && f.contains(last)
        {
            return;
        }
        if self.pending_chains >= MAX_PENDING_CHAINS {
            self.pending.retain(|_, chains| {
                chains.retain(|(_, exp)| *exp > now);
                !chains.is_empty()
            });
            self.pending_chains = self.pending.values().map(Vec::len).sum();
            if self.pending_chains >= MAX_PENDING_CHAINS {
                // Still full of live entries: forget the soonest to expire.
                if let Some(chains) = self.pending.values_mut().max_by_key(|c| c.len()) {
                    chains.remove(0);
                    self.pending_chains -= 1;
                }
            }
        }
        let chains = self.pending.entry(first).or_default();
        let before = chains.len();
        chains.retain(|(_, exp)| *exp > now);
        // The same prompt again (a burst of one prefix): refresh it rather than keep copies, and
        // keep only the newest few per first block, because every pick compares its chain with
        // each of them.
        if let Some(same) = chains.iter_mut().find(|(c, _)| c[..] == chain[..]) {
            same.1 = same.1.max(expires);
        } else {
            chains.push((Arc::from(chain), expires));
            if chains.len() > MAX_PENDING_PER_FIRST_BLOCK {
                chains.remove(0);
            }
        }
        let after = chains.len();
        self.pending_chains = self.pending_chains + after - before;
    }

    /// Forgets one awaiting request sent at `sent_at`, if it is there.
    fn stop_awaiting(&mut self, sent_at: Instant) {
        if let Some(i) = self.awaiting.iter().position(|&at| at == sent_at) {
            self.awaiting.remove(i);
        }
    }

    /// Forgets pending chains the pod's own events now confirm, so from then on only the real
    /// cache speaks for them: a prefix evicted (or an engine restarted) right after it was stored
    /// is not credited for the rest of the TTL. A chain is stored in order, so its last block
    /// being present stands for all of it (one probe per chain; a false positive only ends the
    /// pending credit early, never extends a claim).
    fn drop_confirmed_pending(&mut self) {
        let Some(filter) = &self.filter else { return };
        let mut dropped = 0;
        self.pending.retain(|_, chains| {
            let before = chains.len();
            chains.retain(|(c, _)| !c.last().is_some_and(|&h| filter.contains(h)));
            dropped += before - chains.len();
            !chains.is_empty()
        });
        self.pending_chains -= dropped;
    }

    /// Leading blocks of `chain` that a prompt routed here within the TTL shares.
    pub fn pending_blocks(&self, chain: &[u64], now: Instant) -> usize {
        let Some(first) = chain.first() else { return 0 };
        self.pending.get(first).map_or(0, |chains| {
            chains
                .iter()
                .filter(|(_, exp)| *exp > now)
                .map(|(c, _)| c.iter().zip(chain).take_while(|(a, b)| a == b).count())
                .max()
                .unwrap_or(0)
        })
    }

    /// Bounds on [`Self::matched_blocks`] for a few probes: at least the pending prefix, at most
    /// that plus the filter's run bound sampled every `stride` blocks (equal when no filter is
    /// probed).
    pub fn matched_bounds(
        &self,
        chain: &[u64],
        prepared: Option<&PreparedChain>,
        now: Instant,
        stride: usize,
    ) -> (usize, usize) {
        let pending = self.pending_blocks(chain, now);
        let Some(filter) = &self.filter else {
            return (pending, pending);
        };
        let run = match prepared.filter(|p| p.params() == filter.params()) {
            Some(p) => filter.present_run_bound(p, pending, stride),
            None => chain.len() - pending,
        };
        (pending, pending + run)
    }

    /// Number of leading blocks of `chain` pending or resident: the pending prefix, then the
    /// run of blocks the filter holds after it. `prepared` must be `chain` prepared for this
    /// pod's filter shape when given (the scheduler shares one per shape across pods).
    pub fn matched_blocks(
        &self,
        chain: &[u64],
        prepared: Option<&PreparedChain>,
        now: Instant,
    ) -> usize {
        let pending = self.pending_blocks(chain, now);
        let Some(filter) = &self.filter else {
            return pending;
        };
        let run = match prepared.filter(|p| p.params() == filter.params()) {
            Some(p) => filter.present_run_prepared(p, pending),
            None => filter.longest_prefix(&chain[pending..]),
        };
        pending + run
    }
}

/// Why a message was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("pod {0} is not registered on this connection")]
    NotRegistered(String),
    #[error("filter: {0}")]
    Filter(#[from] FilterError),
}

/// Every pod this router knows.
#[derive(Debug, Default)]
pub struct Registry {
    pods: HashMap<String, Pod>,
    next_conn: ConnId,
    homes: Homes,
    /// Notified whenever a pod may have room it did not have: a load report, a request that
    /// got its first token or finished, a pod that joined or left. Flow control's queue waits
    /// on it ([`crate::flow`]); nothing else does, and a notification nobody waits for is one
    /// stored permit.
    changed: Arc<tokio::sync::Notify>,
}

/// `namespace/name`.
pub fn pod_key(hello: &Hello) -> String {
    format!("{}/{}", hello.pod.namespace, hello.pod.name)
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// The signal notified when a pod may have freed room (see the field).
    pub fn changes(&self) -> Arc<tokio::sync::Notify> {
        self.changed.clone()
    }

    /// Registers a pod from its `Hello`, replacing any earlier connection for the same key.
    pub fn register(&mut self, hello: Hello, now: Instant) -> (String, ConnId) {
        self.next_conn += 1;
        let key = pod_key(&hello);
        let pod = Pod {
            key: key.clone(),
            conn: self.next_conn,
            hello,
            joined_at: now,
            load: None,
            filter: None,
            inflight: 0,
            finished: VecDeque::new(),
            last_picked: None,
            sent: VecDeque::new(),
            pending: HashMap::new(),
            pending_chains: 0,
            mean_uncached_tokens: None,
            awaiting: VecDeque::new(),
            peer_sent: VecDeque::new(),
            outbox: None,
        };
        // A replaced pod keeps this router's in-flight count: those requests are still running.
        let inflight = self.pods.get(&key).map_or(0, |p| p.inflight);
        let pod = Pod { inflight, ..pod };
        self.pods.insert(key.clone(), pod);
        self.changed.notify_one();
        (key, self.next_conn)
    }

    /// Removes the pod if `conn` still owns it. Returns whether it was removed.
    pub fn unregister(&mut self, key: &str, conn: ConnId) -> bool {
        if self.pods.get(key).is_some_and(|p| p.conn == conn) {
            self.pods.remove(key);
            self.homes.forget_pod(key);
            self.changed.notify_one();
            true
        } else {
            false
        }
    }

    fn owned(&mut self, key: &str, conn: ConnId) -> Result<&mut Pod, RegistryError> {
        self.pods
            .get_mut(key)
            .filter(|p| p.conn == conn)
            .ok_or_else(|| RegistryError::NotRegistered(key.to_owned()))
    }

    /// Applies a load report received at `now`.
    pub fn apply_load(
        &mut self,
        key: &str,
        conn: ConnId,
        load: Load,
        now: Instant,
    ) -> Result<(), RegistryError> {
        let pod = self.owned(key, conn)?;
        let age = Duration::from_millis(u64::from(load.sample_age_ms));
        let sampled_at = now.checked_sub(age).unwrap_or(now);
        // What was sent well before the sample is now part of vLLM's own numbers.
        let counted = sampled_at.checked_sub(ADMISSION_LAG).unwrap_or(sampled_at);
        while pod.sent.front().is_some_and(|s| s.at <= counted) {
            pod.sent.pop_front();
        }
        while pod.peer_sent.front().is_some_and(|s| s.at <= counted) {
            pod.peer_sent.pop_front();
        }
        // Requests finished before the sample are not in it; those finished since may be.
        pod.finished.retain(|(_, done)| *done > sampled_at);
        pod.load = Some(LoadSample {
            load,
            received_at: now,
            sampled_at,
        });
        self.changed.notify_one();
        Ok(())
    }

    /// Replaces the pod's filter with a snapshot.
    pub fn apply_snapshot(
        &mut self,
        key: &str,
        conn: ConnId,
        snap: &CacheSnapshot,
    ) -> Result<(), RegistryError> {
        let pod = self.owned(key, conn)?;
        pod.filter = Some(BloomFilter::from_snapshot(snap)?);
        pod.drop_confirmed_pending();
        Ok(())
    }

    /// Applies a delta; on a version gap the filter is dropped (no prefix predictions) until the
    /// snapshot the caller requests arrives.
    pub fn apply_delta(
        &mut self,
        key: &str,
        conn: ConnId,
        delta: &CacheDelta,
    ) -> Result<(), RegistryError> {
        let pod = self.owned(key, conn)?;
        let Some(filter) = pod.filter.as_mut() else {
            return Err(RegistryError::Filter(FilterError::VersionGap {
                have: 0,
                delta_base: delta.base_version,
            }));
        };
        if let Err(e) = filter.apply_delta(delta) {
            pod.filter = None;
            return Err(e.into());
        }
        pod.drop_confirmed_pending();
        Ok(())
    }

    /// Records that a request was routed to `key`: in flight, sent since the last sample (with
    /// the blocks it adds and the prompt tokens it makes the pod compute), its chain pending
    /// until `now + ttl`, picked at `now`; and hands it to the pod's [`Outbox`] when
    /// `pick.share`. Returns whether it was handed over (`None`: not shared or no connection;
    /// `Some(false)`: the outbox was full and the other replicas will not hear of it).
    pub fn record_pick(
        &mut self,
        key: &str,
        pick: &Picked<'_>,
        now: Instant,
        ttl: Duration,
    ) -> Option<bool> {
        let pod = self.pods.get_mut(key)?;
        let (new_blocks, chain) = (pick.new_blocks, pick.chain);
        pod.inflight += 1;
        pod.last_picked = Some(now);
        pod.note_uncached(pick.uncached_tokens);
        let back = pod.sent.back();
        let cum_blocks = back.map_or(0, |s| s.cum_blocks) + u64::from(new_blocks);
        let cum_uncached = back.map_or(0, |s| s.cum_uncached) + u64::from(pick.uncached_tokens);
        pod.sent.push_back(Sent {
            at: now,
            new_blocks,
            uncached_tokens: pick.uncached_tokens,
            cum_blocks,
            cum_uncached,
        });
        // Bound the memory of a pod that stopped reporting: its oldest sends matter least.
        while pod.sent.len() > 4096 {
            pod.sent.pop_front();
        }
        pod.add_pending(chain, now, now + ttl);
        let outbox = pod.outbox.as_ref().filter(|_| pick.share)?;
        Some(
            outbox
                .try_send(Routed {
                    chain: PackedChain::new(chain),
                    new_blocks,
                    uncached_tokens: pick.uncached_tokens,
                })
                .is_ok(),
        )
    }

    /// Hands this router's picks for `key` to `outbox` while `conn` owns the pod.
    pub fn attach_outbox(&mut self, key: &str, conn: ConnId, outbox: Outbox) {
        if let Ok(pod) = self.owned(key, conn) {
            pod.outbox = Some(outbox);
        }
    }

    /// Applies placements other replicas made on `key`, relayed by its sidecar and received at
    /// `now`, `transit` after the sidecar sent them (half the round trip): each counts in the
    /// pod's projected load until a sample includes it, its chain is pending for
    /// `pending_ttl` from when it was made, and it is recorded for the prefix's home as this
    /// router's own pick would be (a near-simultaneous placement of a new prefix elsewhere is
    /// settled the same way on every replica: [`crate::homes`]).
    pub fn apply_placements(
        &mut self,
        key: &str,
        conn: ConnId,
        entries: &[Placement],
        now: Instant,
        transit: Duration,
        policy: PeerPolicy,
    ) -> Result<PlacementsApplied, RegistryError> {
        let pod = self.owned(key, conn)?;
        let mut done = PlacementsApplied::default();
        let mut chains: Vec<(Vec<u64>, Instant)> = Vec::with_capacity(entries.len());
        for e in entries {
            let age = Duration::from_millis(u64::from(e.age_ms)) + transit;
            let at = now.checked_sub(age).unwrap_or(now);
            let r = &e.routed;
            let sent = PeerSent {
                at,
                new_blocks: r.new_blocks,
                uncached_tokens: r.uncached_tokens,
            };
            let i = pod.peer_sent.partition_point(|s| s.at <= at);
            pod.peer_sent.insert(i, sent);
            while pod.peer_sent.len() > 4096 {
                pod.peer_sent.pop_front();
            }
            pod.last_picked = pod.last_picked.max(Some(at));
            pod.note_uncached(r.uncached_tokens);
            let chain: Vec<u64> = r.chain.hashes().collect();
            let expires = at + policy.pending_ttl;
            if expires > now {
                pod.add_pending(&chain, now, expires);
            }
            chains.push((chain, at));
            done.placements += 1;
        }
        if let Some(ttl) = policy.homes_ttl {
            for (chain, at) in &chains {
                done.handovers += self.homes.record_peer(key, chain, *at, ttl);
            }
        }
        Ok(done)
    }

    /// Restores the homes of placements `key`'s sidecar remembered (sent after its snapshot on
    /// every connect), received at `now`, `transit` after they were sent: a router that
    /// (re)started learns where the running replicas placed each prefix, settled as a relayed
    /// placement would be. Returns the depths handed over.
    pub fn apply_recent(
        &mut self,
        key: &str,
        conn: ConnId,
        entries: &[RecentPlacement],
        now: Instant,
        transit: Duration,
        homes_ttl: Duration,
    ) -> Result<usize, RegistryError> {
        self.owned(key, conn)?;
        let mut handovers = 0;
        for e in entries {
            let age = Duration::from_millis(u64::from(e.age_ms)) + transit;
            let at = now.checked_sub(age).unwrap_or(now);
            let marks: Vec<(usize, u64)> = e.marks().collect();
            handovers += self.homes.restore(key, &marks, at, homes_ttl);
        }
        Ok(handovers)
    }

    /// Records that a prompt's chain was routed to `key` for the `affinity` scorer and the
    /// saturation rule (see [`crate::homes`]); `ttl` is `scheduler.affinityTtlSeconds`.
    pub fn record_home(&mut self, key: &str, chain: &[u64], now: Instant, ttl: Duration) {
        if self.pods.contains_key(key) {
            self.homes.record(key, chain, now, ttl);
        }
    }

    /// What this router remembers of where prompts live.
    pub fn homes(&self) -> &Homes {
        &self.homes
    }

    /// A streamed request sent to `key` at `sent_at` waits for its first event (see
    /// [`Pod::oldest_awaiting`]) until [`Self::record_started`] or [`Self::record_done`].
    pub fn record_awaiting(&mut self, key: &str, sent_at: Instant) {
        if let Some(p) = self.pods.get_mut(key) {
            // Sends are recorded in about time order: keep the deque sorted so the oldest is
            // at the front.
            let i = p.awaiting.partition_point(|&at| at <= sent_at);
            p.awaiting.insert(i, sent_at);
            // Bounded like `sent` for a pod that stopped answering.
            while p.awaiting.len() > 4096 {
                p.awaiting.pop_back();
            }
        }
    }

    /// The streamed request sent to `key` at `sent_at` got its first event.
    pub fn record_started(&mut self, key: &str, sent_at: Instant) {
        if let Some(p) = self.pods.get_mut(key) {
            p.stop_awaiting(sent_at);
        }
        self.changed.notify_one();
    }

    /// A request sent to `key` at `sent_at` finished at `now` (whatever the outcome; one still
    /// awaiting its first event stops awaiting).
    pub fn record_done(&mut self, key: &str, sent_at: Instant, now: Instant) {
        if let Some(p) = self.pods.get_mut(key) {
            p.stop_awaiting(sent_at);
            p.inflight = p.inflight.saturating_sub(1);
            p.finished.push_back((sent_at, now));
            // Bounded like `sent` for a pod that stopped reporting.
            while p.finished.len() > 4096 {
                p.finished.pop_front();
            }
        }
        self.changed.notify_one();
    }

    pub fn get(&self, key: &str) -> Option<&Pod> {
        self.pods.get(key)
    }

    pub fn pods(&self) -> impl Iterator<Item = &Pod> {
        self.pods.values()
    }

    pub fn len(&self) -> usize {
        self.pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }
}
