//! Picking one pod per request: filters, then a weighted sum of scorers, every decision
//! explainable (each scorer's value, the margin over the runner-up, the predicted cached tokens).
//!
//! One trait per extension point ([`Filter`], [`Scorer`]) and one file per implementation;
//! [`scorers::ScorerKind`] names every scorer once (its config key, default weight and
//! implementation) and [`Scheduler::new`] turns the config's weights into the scorer set.
//!
//! The files: this one holds the types and [`Scheduler::pick`] (filters, saturation, the
//! winner recorded); `saturation.rs` the saturation rule; `search.rs` the ranking of the open
//! candidates; `prompt_hashes.rs` the prompt's block-hash chains, computed before the registry
//! lock is taken.
//!
//! Only the winner's and the runner-up's cache matches are needed exactly (the decision reports
//! the winner's values and the margin over the runner-up), so the ranking searches
//! branch-and-bound: every score that ignores the match is computed first, each pod gets an upper
//! bound (its whole chain cached), and pods are matched against their Bloom filters in order of
//! that bound until no unmatched pod can reach the top two. Each match it does compute is the
//! plain linear scan, so every reported value is exactly what matching every pod would give
//! (`scheduler/tests.rs` compares the two on random clusters).
//!
//! Prefix caching off: when no candidate pod caches prefixes, the prefix, KV and latency scorers
//! carry no signal worth following, so the scheduler uses least-request scoring (queue and
//! running requests, LRU to break ties). A router that remembers its own decisions would pile
//! shared-prompt traffic onto one pod here; this one spreads it.

pub mod filters;
mod prompt_hashes;
pub mod saturation;
pub mod scorers;
mod search;
#[cfg(test)]
mod tests;

use std::time::Instant;

use crate::config::{PoolConfig, SchedulerConfig};
use crate::pods::{PeerPolicy, Picked, Pod, Projection, Registry};
use filters::Rejection;
pub use prompt_hashes::{HashPlan, PromptHashes};
use saturation::{Fleet, Pressure};
use scorers::ScorerKind;
use search::RankFn;

/// What the scheduler needs to know about a request.
#[derive(Debug, Clone, Copy)]
pub struct PickRequest<'a> {
    /// The body's `model`: a served name or a LoRA adapter name.
    pub model: &'a str,
    /// The pool chosen for the model, if one is configured.
    pub pool: Option<&'a PoolConfig>,
    /// Prompt length in tokens (exact when `tokens` is set, else an estimate).
    pub prompt_tokens: u32,
    /// The prompt's token ids, when a tokenizer for the model is known.
    pub tokens: Option<&'a [u32]>,
    pub cache_salt: Option<&'a str>,
    /// Pods not to pick (a retry after a refused connection).
    pub exclude: &'a [String],
}

/// Per-request context given to filters and scorers.
#[derive(Debug)]
pub struct Ctx<'a> {
    pub req: &'a PickRequest<'a>,
    pub cfg: &'a SchedulerConfig,
    pub now: Instant,
    /// `Some(model)` when the model is a LoRA adapter.
    pub lora: Option<&'a str>,
    /// The model's pods as a whole (for pods that have not measured something yet).
    pub fleet: Fleet,
}

/// One pod as seen by this request.
///
/// The three match fields hold the pod's real match only once the scheduler has computed it;
/// until then they hold a bound: nothing cached when filters see them (the most uncached blocks:
/// a pod kept that way is kept whatever it caches), the whole chain cached when scorers see them
/// for an upper bound (see [`MatchUse`]).
#[derive(Debug)]
pub struct Candidate<'a> {
    pub pod: &'a Pod,
    pub projection: Projection,
    /// Full blocks in the prompt at this pod's block size.
    pub chain_len: usize,
    /// Leading blocks resident or pending on the pod.
    pub matched_blocks: usize,
    /// Prompt tokens vLLM would have to compute (after its last-token rule).
    pub uncached_tokens: u32,
    /// KV blocks the prompt would newly occupy.
    pub new_blocks: u32,
    /// How much of the prompt has this pod as its home ([`crate::homes`]), 0 – 1, when the
    /// deepest depth this router remembers sending to one pod was sent to this one; else 0.
    /// Counted beyond what most other pods hold ([`crate::homes::value`]).
    pub home: f64,
    /// The remembered depth behind `home`, in blocks (0: not this pod's home).
    home_depth: usize,
    /// For a new prefix (no home anywhere, no pod caching a quarter of it), the share of this
    /// pod's KV cache that the prefixes it is home to and likely to be asked for again take
    /// ([`crate::homes::Homes::working_set`] over `num_gpu_blocks`), when the pod would start
    /// the prompt within a home's slack of the soonest ([`saturation::room_cutoff`]); else
    /// `None`. Read by the `affinity` scorer.
    pub room: Option<f64>,
    chain_index: usize,
    /// Index of the chain prepared for this pod's filter shape, when it has a filter to probe.
    prepared_index: Option<usize>,
    /// Whether the match fields are the pod's real match rather than a bound.
    exact: bool,
}

impl Candidate<'_> {
    /// Sets the match fields for `matched` leading blocks.
    fn set_match(&mut self, matched: usize, prompt_tokens: u32) {
        let bs = self.pod.hello.engine.block_size.max(1);
        let cached = cached_tokens(matched, bs, prompt_tokens);
        self.matched_blocks = matched;
        self.uncached_tokens = prompt_tokens - cached;
        self.new_blocks = prompt_tokens.div_ceil(bs) - cached / bs;
    }
}

/// A filter: may this pod take the request? `Err` says why not.
pub trait Filter: Send + Sync {
    fn check(&self, ctx: &Ctx<'_>, c: &Candidate<'_>) -> Result<(), Rejection>;
}

/// A scorer: one value in 0 – 1 per candidate, higher is better. Its name and weight belong
/// to its [`ScorerKind`].
pub trait Scorer: Send + Sync {
    /// How the values depend on the candidates' cache matches; decides how much of the match
    /// the scheduler must compute. The default is the safe one: every match, exactly.
    fn match_use(&self) -> MatchUse {
        MatchUse::Relative
    }
    /// Writes one value per candidate into `out` (`out.len() == cands.len()`).
    fn scores(&self, ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]);
}

/// How a scorer reads `matched_blocks`, `uncached_tokens` and `new_blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatchUse {
    /// Not at all: values computed before any match are final.
    Ignores,
    /// A candidate's value depends on its own match only (scored alone it gets the same value),
    /// and never decreases as the match grows: scored with the whole chain cached it is an
    /// upper bound.
    OwnGrowing,
    /// Any other way (e.g. normalised across the candidates' matches): every match is computed.
    Relative,
}

/// Flow control's admission gate for [`Scheduler::pick_within`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gate {
    /// Seconds a pod may be predicted to make the request wait before its prefill starts; an
    /// infinite budget is no gate at all.
    pub wait_budget_s: f64,
    /// The request may use the KV headroom `kvThreshold` keeps (flow control grants it to
    /// tenants within their fair share, so a burst of one tenant cannot fill it).
    pub kv_headroom: bool,
    /// The most of a pod's KV cache the request may fill, with its prompt (1: no ceiling of
    /// its own); flow control keeps a lower class under it so higher ones find room.
    pub kv_ceiling: f64,
}

impl Gate {
    /// No gate: what flow control turned off or an unclassified request gets.
    pub const OPEN: Gate = Gate {
        wait_budget_s: f64::INFINITY,
        kv_headroom: true,
        kv_ceiling: 1.0,
    };
}

/// Why no pod was picked.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PickError {
    #[error("no ready pod serves model {0:?}")]
    NoReadyPod(String),
    #[error("the prompt ({prompt_tokens} tokens) does not fit the context window of any ready pod")]
    TooLong { prompt_tokens: u32 },
    /// [`Scheduler::pick_within`]: no pod can take the request within the budget (`wait_s` is
    /// the shortest predicted wait among the pods that compete). Nothing was recorded.
    #[error("every pod is predicted to make the request wait {wait_s:.3} s, over its budget")]
    OverBudget { wait_s: f64 },
}

/// The explanation of a pick.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub pod: String,
    pub url: String,
    pub total: f64,
    /// Total of the winner minus the runner-up's (0 when alone).
    pub margin: f64,
    /// Each weighted scorer's raw value for the winner, by its config key
    /// ([`ScorerKind::key`]).
    pub scores: Vec<(&'static str, f64)>,
    /// Prompt tokens the pod is predicted to find in its cache.
    pub predicted_cached_tokens: u32,
    pub matched_blocks: usize,
    pub chain_len: usize,
    /// Predicted seconds to the first token on the chosen pod (see [`saturation`]).
    pub predicted_ttft_s: f64,
    /// Every eligible pod was busy or full: the smallest predicted time to first token won.
    pub all_saturated: bool,
    /// Least-request scoring was used (no candidate caches prefixes).
    pub least_request: bool,
    pub candidates: usize,
    /// Eligible pods the saturation rule left out of the ranking.
    pub saturation_skipped: usize,
    /// Whether the pick was handed to the pod's sidecar for the other router replicas (`None`:
    /// not shared, or the pod has no connection; `Some(false)`: its outbox was full).
    pub placement_shared: Option<bool>,
}

/// Filters and weighted scorers built from the config.
pub struct Scheduler {
    cfg: SchedulerConfig,
    hard: Vec<Box<dyn Filter>>,
    scorers: Vec<Weighted>,
}

/// A scorer the config gave a weight.
struct Weighted {
    kind: ScorerKind,
    scorer: Box<dyn Scorer>,
    weight: f64,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Scheduler {
    /// The factory: every scorer with a non-zero weight, in config order.
    pub fn new(cfg: &SchedulerConfig) -> Self {
        let scorers = ScorerKind::ALL
            .into_iter()
            .filter_map(|kind| {
                let weight = cfg.weights.effective(kind);
                (weight > 0.0).then(|| Weighted {
                    kind,
                    scorer: kind.scorer(),
                    weight,
                })
            })
            .collect();
        Scheduler {
            cfg: cfg.clone(),
            hard: vec![
                Box::new(filters::ServesModel),
                Box::new(filters::Ready),
                Box::new(filters::FitsWindow),
            ],
            scorers,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// How other replicas' placements count here; `None` while `sharePlacements` is off (they
    /// are ignored, as this router's own are not sent).
    pub fn peer_policy(&self) -> Option<PeerPolicy> {
        self.cfg.share_placements.then(|| PeerPolicy {
            pending_ttl: self.cfg.pending_ttl(),
            homes_ttl: (self.cfg.weights.effective(ScorerKind::Affinity) > 0.0)
                .then(|| self.cfg.affinity_ttl()),
        })
    }

    /// Picks a pod and records the pick in the registry (in flight, pending blocks, LRU), under
    /// the caller's one lock so concurrent picks see each other.
    ///
    /// Hashes the prompt under the lock; [`Self::pick_prepared`] takes hashes computed before.
    pub fn pick(
        &self,
        reg: &mut Registry,
        req: &PickRequest<'_>,
        now: Instant,
    ) -> Result<Decision, PickError> {
        self.pick_prepared(reg, req, &mut PromptHashes::default(), now)
    }

    /// [`Self::pick`] with the prompt's hashes computed beforehand ([`Self::hash_plan`], then
    /// [`PromptHashes::new`], outside the registry lock). Whatever they lack — a pod with a new
    /// block size or filter shape joined in between — is computed here; hashes made for another
    /// seed or another token list than `req.tokens` are discarded.
    pub fn pick_prepared<'r>(
        &self,
        reg: &mut Registry,
        req: &PickRequest<'r>,
        hashes: &mut PromptHashes<'r>,
        now: Instant,
    ) -> Result<Decision, PickError> {
        self.pick_ranked_by(reg, req, hashes, now, Self::rank)
    }

    /// [`Self::pick_prepared`] as flow control's admission ([`crate::flow`]): only the pods
    /// that can take the request now compete — free by the saturation rule (nothing waiting, a
    /// sequence slot, KV use with the prompt within `kvThreshold`: the headroom running
    /// requests need to grow without preemption) and predicted to start its prefill within
    /// the gate's `wait_budget_s` seconds (the predicted time to first token less the
    /// request's own prefill, which no choice of pod shortens); with `kv_headroom`, a pod whose
    /// KV use the prompt takes past `kvThreshold` (but not past the whole cache) counts too. Among them the scorers decide as in
    /// [`Self::pick_prepared`]; with none, [`PickError::OverBudget`] and nothing is recorded.
    pub fn pick_within<'r>(
        &self,
        reg: &mut Registry,
        req: &PickRequest<'r>,
        hashes: &mut PromptHashes<'r>,
        now: Instant,
        gate: Gate,
    ) -> Result<Decision, PickError> {
        self.pick_gated(reg, req, hashes, now, Self::rank, Some(gate))
    }

    /// [`Self::pick_prepared`] with the ranking of the open candidates given: the unit tests swap
    /// in the plain one (every match computed, then sorted) as the reference.
    ///
    /// The phases: the eligible candidates with their homes ([`Self::eligible`]), the homes'
    /// claims ([`claim_homes`]), the saturation rule's open set ([`open_set`]), the room of a
    /// new prefix ([`mark_room`]), the ranking, and the winner recorded ([`Self::record`]).
    fn pick_ranked_by<'r>(
        &self,
        reg: &mut Registry,
        req: &PickRequest<'r>,
        m: &mut PromptHashes<'r>,
        now: Instant,
        rank: RankFn,
    ) -> Result<Decision, PickError> {
        self.pick_gated(reg, req, m, now, rank, None)
    }

    /// The pick itself; `gate` is [`Self::pick_within`]'s.
    fn pick_gated<'r>(
        &self,
        reg: &mut Registry,
        req: &PickRequest<'r>,
        m: &mut PromptHashes<'r>,
        now: Instant,
        rank: RankFn,
        gate: Option<Gate>,
    ) -> Result<Decision, PickError> {
        let seed = Self::seed(reg, req);
        m.keep_only_for(seed, req.tokens);
        let ctx = Ctx {
            req,
            cfg: &self.cfg,
            now,
            lora: seed.lora,
            fleet: Fleet::of(reg.pods().filter(|p| p.serves(req.model))),
        };
        // Homes are remembered and read only while a weight uses them.
        let homes_on = self.cfg.weights.effective(ScorerKind::Affinity) > 0.0;
        let Eligible {
            mut cands,
            homed,
            too_long,
        } = self.eligible(reg, &ctx, m, homes_on);
        if cands.is_empty() {
            return Err(if too_long {
                PickError::TooLong {
                    prompt_tokens: req.prompt_tokens,
                }
            } else {
                PickError::NoReadyPod(req.model.to_owned())
            });
        }
        if cands.iter().any(|c| c.home_depth > 0) {
            claim_homes(&mut cands, m, req, now);
        }
        let n_eligible = cands.len();
        let Open {
            cands: mut open,
            all_saturated,
            least_request,
        } = open_set(&ctx, cands, m);
        // An infinite budget is no gate (flow control turned off with requests still queued).
        if let Some(Gate {
            wait_budget_s: budget,
            kv_headroom,
            kv_ceiling,
        }) = gate.filter(|g| g.wait_budget_s.is_finite())
        {
            // Flow control's gate: only pods that can start the request within the budget
            // compete; with none, nothing is recorded and the request waits.
            let mut soonest = f64::INFINITY;
            for c in open.iter_mut() {
                m.resolve(c, req, now);
            }
            open.retain(|c| {
                let wait = (saturation::predicted_ttft(&ctx, c)
                    - saturation::own_prefill_s(&ctx, c))
                .max(0.0);
                soonest = soonest.min(wait);
                wait <= budget && saturation::gate_room(&ctx, c, kv_headroom, kv_ceiling)
            });
            if open.is_empty() {
                return Err(PickError::OverBudget { wait_s: soonest });
            }
        }
        // A new prefix is placed where it will have room to stay: see `scorers::affinity`.
        if homes_on && !homed && open.len() > 1 && open.iter().all(|c| c.chain_len > 0) {
            mark_room(&ctx, reg, &mut open, m);
        }
        let (winner, total, margin, scores) = {
            let used: Vec<&Weighted> = self
                .scorers
                .iter()
                .filter(|w| !least_request || w.kind.least_request())
                .collect();
            let ranked = rank(self, &ctx, &used, &mut open, m);
            let (best, total) = ranked.best;
            let margin = ranked.runner_up.map_or(0.0, |(_, t)| total - t);
            let scores = used
                .iter()
                .enumerate()
                .map(|(k, w)| (w.kind.key(), ranked.values[k * open.len() + best]))
                .collect();
            (&open[best], total, margin, scores)
        };
        let bs = winner.pod.hello.engine.block_size.max(1);
        debug_assert!(winner.exact, "the winner's match is computed");
        let decision = Decision {
            pod: winner.pod.key.clone(),
            url: winner.pod.hello.pod.url.clone(),
            total,
            margin,
            scores,
            predicted_cached_tokens: cached_tokens(winner.matched_blocks, bs, req.prompt_tokens),
            predicted_ttft_s: saturation::predicted_ttft(&ctx, winner),
            matched_blocks: winner.matched_blocks,
            chain_len: winner.chain_len,
            all_saturated,
            least_request,
            candidates: n_eligible,
            saturation_skipped: n_eligible - open.len(),
            placement_shared: None,
        };
        let (caching, chain_index) = (winner.pod.hello.engine.prefix_caching, winner.chain_index);
        let picked = (winner.new_blocks, winner.uncached_tokens);
        drop(open);
        let chain: &[u64] = if caching {
            &m.chains[chain_index].1
        } else {
            &[]
        };
        Ok(self.record(reg, decision, picked, chain, now, homes_on))
    }

    /// Every pod of the model that passes the hard filters, as a candidate assuming nothing
    /// cached, with the depth of the prompt's home when it is this pod; whether the prompt has
    /// a home anywhere; whether a ready pod refused it only as too long.
    fn eligible<'p>(
        &self,
        reg: &'p Registry,
        ctx: &Ctx<'_>,
        m: &mut PromptHashes<'_>,
        homes_on: bool,
    ) -> Eligible<'p> {
        let homes_ttl = self.cfg.affinity_ttl();
        let mut out = Eligible {
            cands: Vec::with_capacity(reg.len()),
            homed: false,
            too_long: false,
        };
        // One home lookup per chain shape (pods of one model usually share one).
        let mut home_of: Vec<(usize, Option<crate::homes::Found<'_>>)> = Vec::new();
        // Pods of other models never become candidates: building one would hash the prompt at
        // their block size and prepare it for their filter shape, under the lock, for nothing.
        for pod in reg.pods().filter(|p| p.serves(ctx.req.model)) {
            let mut cand = m.candidate(pod, ctx.req);
            if homes_on {
                let found = match home_of.iter().find(|(i, _)| *i == cand.chain_index) {
                    Some((_, f)) => *f,
                    None => {
                        let f = reg
                            .homes()
                            .find(&m.chains[cand.chain_index].1, ctx.now, homes_ttl);
                        home_of.push((cand.chain_index, f));
                        f
                    }
                };
                if let Some(f) = found.filter(|f| f.pod == pod.key) {
                    cand.home_depth = f.blocks;
                }
            }
            // Filters run in order (serves, ready, window): a pod refused as too long serves
            // the model and is ready.
            match self.hard.iter().try_for_each(|f| f.check(ctx, &cand)) {
                Ok(()) => out.cands.push(cand),
                Err(Rejection::TooLong) => out.too_long = true,
                Err(Rejection::OtherModel | Rejection::NotReady | Rejection::Excluded) => {}
            }
        }
        out.homed = home_of.iter().any(|(_, f)| f.is_some());
        out
    }

    /// Records the pick in the registry (in flight, pending chain, the outbox to the other
    /// replicas, the prefix's home) and returns the decision with what was shared.
    fn record(
        &self,
        reg: &mut Registry,
        decision: Decision,
        (new_blocks, uncached_tokens): (u32, u32),
        chain: &[u64],
        now: Instant,
        homes_on: bool,
    ) -> Decision {
        let picked = Picked {
            new_blocks,
            uncached_tokens,
            chain,
            share: self.cfg.share_placements,
        };
        let shared = reg.record_pick(&decision.pod, &picked, now, self.cfg.pending_ttl());
        if homes_on {
            reg.record_home(&decision.pod, chain, now, self.cfg.affinity_ttl());
        }
        Decision {
            placement_shared: shared,
            ..decision
        }
    }
}

/// What [`Scheduler::eligible`] found.
struct Eligible<'p> {
    cands: Vec<Candidate<'p>>,
    /// The prompt has a home on some pod (eligible or not).
    homed: bool,
    too_long: bool,
}

/// Pods whose matches the commons are read from when a model has more: the median of a sample
/// this size estimates it well, and matching every pod of a large fleet exactly would cost a
/// full filter scan per pod on every pick with a home.
pub const COMMONS_SAMPLE: usize = 32;

/// A home is worth what it holds beyond the commons (what most other pods hold too); nothing
/// while it carries far more than its share of the load. Up to [`COMMONS_SAMPLE`] other pods'
/// matches are computed exactly (all of them in a fleet that small, an even spread otherwise),
/// and the commons and the eviction share are read from them.
fn claim_homes(
    eligible: &mut [Candidate<'_>],
    m: &PromptHashes<'_>,
    req: &PickRequest<'_>,
    now: Instant,
) {
    let n = eligible.len();
    let sampled: Vec<usize> = if n <= COMMONS_SAMPLE + 1 {
        (0..n).collect()
    } else {
        (0..COMMONS_SAMPLE)
            .map(|k| k * n / COMMONS_SAMPLE)
            .collect()
    };
    for &j in &sampled {
        m.resolve(&mut eligible[j], req, now);
    }
    for c in eligible.iter_mut().filter(|c| c.home_depth > 0) {
        m.resolve(c, req, now);
    }
    let mut others: Vec<usize> = Vec::with_capacity(sampled.len());
    let load = |c: &Candidate<'_>| f64::from(c.projection.running + c.projection.waiting);
    let mean_load = eligible.iter().map(load).sum::<f64>() / n as f64;
    for i in 0..n {
        if eligible[i].home_depth == 0 {
            continue;
        }
        others.clear();
        // Pods hashing the prompt another way (block size) count blocks another way.
        let chain = eligible[i].chain_index;
        others.extend(
            sampled
                .iter()
                .filter(|&&j| j != i && eligible[j].chain_index == chain)
                .map(|&j| eligible[j].matched_blocks),
        );
        let overloaded = crate::homes::overloaded(load(&eligible[i]), mean_load);
        let commons = crate::homes::commons(&mut others);
        // What a move would evict: see `homes::eviction_share`.
        let evicts = sampled
            .iter()
            .filter(|&&j| j != i)
            .map(|&j| {
                let o = &eligible[j];
                crate::homes::eviction_share(
                    o.new_blocks,
                    o.projection.kv_usage,
                    o.pod.hello.engine.num_gpu_blocks,
                )
            })
            .reduce(f64::max)
            .unwrap_or(1.0);
        let c = &mut eligible[i];
        c.home = if overloaded {
            0.0
        } else {
            crate::homes::claim(c.home_depth, commons, c.chain_len, evicts)
        };
    }
}

/// The candidates the ranking sees ([`open_set`]), whether they are all saturated, and whether
/// least-request scoring applies (no candidate caches prefixes).
struct Open<'p> {
    cands: Vec<Candidate<'p>>,
    all_saturated: bool,
    least_request: bool,
}

/// The saturation rule (see `saturation`): free pods, then busy ones that would start the
/// request no later than the best free pod (a home with its slack); when none is free, every
/// pod but an outlier whose queue stands still.
fn open_set<'p>(ctx: &Ctx<'_>, eligible: Vec<Candidate<'p>>, m: &PromptHashes<'_>) -> Open<'p> {
    let (req, now) = (ctx.req, ctx.now);
    // Candidates come assuming nothing cached, the most blocks a prompt can add: a pod whose
    // cache has room for that has room for its real match, which is computed only when the
    // bound says "full". Busy pods are compared by predicted time to first token, which needs
    // their real match.
    let (mut free, mut busy, mut full) =
        (Vec::with_capacity(eligible.len()), Vec::new(), Vec::new());
    for mut c in eligible {
        match saturation::pressure(ctx, &c) {
            Pressure::Free => {
                free.push(c);
                continue;
            }
            // The bound assumed nothing cached: decide on the real match.
            Pressure::Tight | Pressure::Full => m.resolve(&mut c, req, now),
            Pressure::Busy => {
                m.resolve(&mut c, req, now);
                busy.push(c);
                continue;
            }
        }
        match saturation::pressure(ctx, &c) {
            Pressure::Free => free.push(c),
            Pressure::Busy | Pressure::Tight => busy.push(c),
            Pressure::Full if saturation::full_home_competes(&c) => busy.push(c),
            Pressure::Full => full.push(c),
        }
    }
    let least_request = !free
        .iter()
        .chain(&busy)
        .chain(&full)
        .any(|c| c.pod.hello.engine.prefix_caching);
    let mut open = free;
    if !open.is_empty() && !busy.is_empty() {
        // A busy pod competes only if it would start the request no later than the best free
        // one, counting what each must compute.
        for c in open.iter_mut() {
            m.resolve(c, req, now);
        }
        let (best_free, best_free_prefill) = saturation::soonest(ctx, &open);
        // The prompt's home may be a little later: see `saturation` on homes.
        open.extend(busy.drain(..).filter(|c| {
            saturation::predicted_ttft(ctx, c)
                <= best_free + saturation::home_slack(ctx, c, best_free_prefill)
        }));
    }
    let all_saturated = open.is_empty();
    if all_saturated {
        // Every pod busy or full: they all compete, ranked like free pods (the queue, KV and
        // running scorers still prefer the lighter ones).
        open.append(&mut busy);
        open.append(&mut full);
        // The rare pod whose queue stands still is left out (see `saturation`).
        if open.len() > 1 {
            for c in open.iter_mut() {
                m.resolve(c, req, now);
            }
            let cutoff = saturation::saturated_cutoff(ctx, &open);
            open.retain(|c| saturation::predicted_ttft(ctx, c) <= cutoff);
        }
    }
    Open {
        cands: open,
        all_saturated,
        least_request,
    }
}

/// For a new prefix (no home anywhere, no pod caching a quarter of it): each open pod's
/// working-set share of its cache, when it would start the prompt within a home's slack of the
/// soonest (see `scorers::affinity`).
fn mark_room(ctx: &Ctx<'_>, reg: &Registry, open: &mut [Candidate<'_>], m: &PromptHashes<'_>) {
    for c in open.iter_mut() {
        m.resolve(c, ctx.req, ctx.now);
    }
    if open.iter().all(|c| c.matched_blocks * 4 < c.chain_len) {
        let cut = saturation::room_cutoff(ctx, open);
        for c in open.iter_mut() {
            let blocks = c.pod.hello.engine.num_gpu_blocks.max(1) as f64;
            c.room = (saturation::predicted_ttft(ctx, c) <= cut)
                .then(|| reg.homes().working_set(&c.pod.key) as f64 / blocks);
        }
    }
}

/// Tokens vLLM finds cached for `matched` resident blocks: full blocks only, and never the
/// prompt's last token (vLLM recomputes it to produce the first output).
pub fn cached_tokens(matched: usize, block_size: u32, prompt_tokens: u32) -> u32 {
    let bs = block_size.max(1);
    let cap = prompt_tokens.saturating_sub(1) / bs * bs;
    (u32::try_from(matched)
        .unwrap_or(u32::MAX)
        .saturating_mul(bs))
    .min(cap)
}
