//! Picking one pod per request: filters, then a weighted sum of scorers, every decision
//! explainable (each scorer's value, the margin over the runner-up, the predicted cached tokens).
//!
//! One trait per extension point ([`Filter`], [`Scorer`]) and one file per implementation;
//! [`Scheduler::new`] is the factory that turns the config's weights into the scorer set.
//!
//! Only the winner's and the runner-up's cache matches are needed exactly (the decision reports
//! the winner's values and the margin over the runner-up), so the scheduler searches
//! branch-and-bound: every score that ignores the match is computed first, each pod gets an upper
//! bound (its whole chain cached), and pods are matched against their Bloom filters in order of
//! that bound until no unmatched pod can reach the top two. Each match it does compute is the
//! plain linear scan, so every reported value is exactly what matching every pod would give
//! (`tests/scheduler.rs` compares the two on random clusters).
//!
//! Prefix caching off: when no candidate pod caches prefixes, the prefix, KV and latency scorers
//! carry no signal worth following, so the scheduler uses least-request scoring (queue and
//! running requests, LRU to break ties). A router that remembers its own decisions would pile
//! shared-prompt traffic onto one pod here; this one spreads it.

pub mod filters;
pub mod saturation;
pub mod scorers;
#[cfg(test)]
mod tests;

use std::time::Instant;

use kvsight_protocol::bloom::{FilterParams, PreparedChain};
use kvsight_protocol::hash::{ChainSeed, hash_chain};

use crate::config::{PoolConfig, SchedulerConfig};
use crate::pods::{Picked, Pod, Projection, Registry};
use saturation::{Fleet, Pressure};

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
    /// The prompt's first block at this pod's block size (what identifies a shared prefix).
    pub first_block: Option<u64>,
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

/// A filter: may this pod take the request?
pub trait Filter: Send + Sync {
    fn name(&self) -> &'static str;
    fn keep(&self, ctx: &Ctx<'_>, c: &Candidate<'_>) -> bool;
}

/// A scorer: one value in 0 – 1 per candidate, higher is better.
pub trait Scorer: Send + Sync {
    /// The weight's name in the config.
    fn name(&self) -> &'static str;
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

/// Why no pod was picked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickError {
    #[error("no ready pod serves model {0:?}")]
    NoReadyPod(String),
    #[error("the prompt ({prompt_tokens} tokens) does not fit the context window of any ready pod")]
    TooLong { prompt_tokens: u32 },
}

/// The explanation of a pick.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub pod: String,
    pub url: String,
    pub total: f64,
    /// Total of the winner minus the runner-up's (0 when alone).
    pub margin: f64,
    /// Each weighted scorer's raw value for the winner.
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
}

/// Filters and weighted scorers built from the config.
pub struct Scheduler {
    cfg: SchedulerConfig,
    hard: Vec<Box<dyn Filter>>,
    scorers: Vec<(Box<dyn Scorer>, f64)>,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// Blocks between the probes that bound a pod's match before the search: shorter tightens the
/// bounds (fewer pods matched in full) at more probes per pod where the chain is cached.
const BOUND_STRIDE: usize = 32;

/// Scorers that least-request scoring keeps.
const LEAST_REQUEST: [&str; 3] = ["queue", "runningRequests", "lru"];

impl Scheduler {
    /// The factory: every scorer with a non-zero weight, in config order.
    pub fn new(cfg: &SchedulerConfig) -> Self {
        let all: Vec<Box<dyn Scorer>> = vec![
            Box::new(scorers::Prefix),
            Box::new(scorers::Queue),
            Box::new(scorers::KvCache),
            Box::new(scorers::RunningRequests),
            Box::new(scorers::LoraAffinity),
            Box::new(scorers::PredictedLatency),
            Box::new(scorers::Lmetric),
            Box::new(scorers::Affinity),
            Box::new(scorers::Lru),
        ];
        let weights = cfg.weights.effective();
        let scorers = all
            .into_iter()
            .filter_map(|s| {
                let w = weights
                    .iter()
                    .find(|(n, _)| *n == s.name())
                    .map_or(0.0, |(_, w)| *w);
                (w > 0.0).then_some((s, w))
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

    /// What hashing `req` needs from the registry: the chain's seed (a model that some pod serves
    /// as a LoRA adapter hashes under the adapter's name) and the block sizes and filter shapes of
    /// the pods serving it. Cheap: one pass over the pods, no hashing.
    pub fn hash_plan<'r>(reg: &Registry, req: &PickRequest<'r>) -> HashPlan<'r> {
        let mut shapes: Vec<(u32, Option<FilterParams>)> = Vec::new();
        for pod in reg.pods().filter(|p| p.serves(req.model)) {
            let bs = pod.hello.engine.block_size.max(1);
            let params = pod
                .filter
                .as_ref()
                .filter(|_| pod.hello.engine.prefix_caching)
                .map(|f| f.params());
            if !shapes.contains(&(bs, params)) {
                shapes.push((bs, params));
            }
        }
        HashPlan {
            seed: Self::seed(reg, req),
            shapes,
        }
    }

    fn seed<'r>(reg: &Registry, req: &PickRequest<'r>) -> ChainSeed<'r> {
        ChainSeed {
            lora: reg
                .pods()
                .any(|p| p.is_lora(req.model))
                .then_some(req.model),
            cache_salt: req.cache_salt,
        }
    }

    /// [`Self::pick_prepared`] with the ranking of the open candidates given: the unit tests swap
    /// in the plain one (every match computed, then sorted) as the reference.
    fn pick_ranked_by<'r>(
        &self,
        reg: &mut Registry,
        req: &PickRequest<'r>,
        m: &mut PromptHashes<'r>,
        now: Instant,
        rank: RankFn,
    ) -> Result<Decision, PickError> {
        let seed = Self::seed(reg, req);
        let same_tokens = match (m.tokens, req.tokens) {
            (Some(a), Some(b)) => std::ptr::eq(a, b),
            (a, b) => a.is_none() && b.is_none(),
        };
        if m.seed != seed || !same_tokens {
            *m = PromptHashes {
                seed,
                tokens: req.tokens,
                ..PromptHashes::default()
            };
        }
        let ctx = Ctx {
            req,
            cfg: &self.cfg,
            now,
            lora: seed.lora,
            fleet: Fleet::of(reg.pods().filter(|p| p.serves(req.model))),
        };
        let m = &mut *m;
        // Set when a pod that serves the model and is ready cannot hold the prompt.
        let mut too_long = false;
        let mut eligible: Vec<Candidate<'_>> = Vec::with_capacity(reg.len());
        // Pods of other models never become candidates: building one would hash the prompt at
        // their block size and prepare it for their filter shape, under the lock, for nothing.
        for pod in reg.pods().filter(|p| p.serves(req.model)) {
            let cand = m.candidate(pod, req);
            // Filters run in order (serves, ready, window): failing the window means the pod
            // serves the model and is ready.
            match self.hard.iter().find(|f| !f.keep(&ctx, &cand)) {
                None => eligible.push(cand),
                Some(f) if f.name() == "fits_window" => too_long = true,
                Some(_) => {}
            }
        }
        if eligible.is_empty() {
            return Err(if too_long {
                PickError::TooLong {
                    prompt_tokens: req.prompt_tokens,
                }
            } else {
                PickError::NoReadyPod(req.model.to_owned())
            });
        }
        let n_eligible = eligible.len();
        // See `saturation`. Candidates come assuming nothing cached, the most blocks a prompt
        // can add: a pod whose cache has room for that has room for its real match, which is
        // computed only when the bound says "full". Busy pods are compared by predicted time to
        // first token, which needs their real match.
        let (mut free, mut busy, mut full) =
            (Vec::with_capacity(n_eligible), Vec::new(), Vec::new());
        for mut c in eligible {
            match saturation::pressure(&ctx, &c) {
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
            match saturation::pressure(&ctx, &c) {
                Pressure::Free => free.push(c),
                Pressure::Busy | Pressure::Tight => busy.push(c),
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
            // A busy pod competes only if it would start the request no later than the best
            // free one, counting what each must compute.
            for c in open.iter_mut() {
                m.resolve(c, req, now);
            }
            let best_free = open
                .iter()
                .map(|c| saturation::predicted_ttft(&ctx, c))
                .fold(f64::INFINITY, f64::min);
            open.extend(
                busy.drain(..)
                    .filter(|c| saturation::predicted_ttft(&ctx, c) <= best_free),
            );
        }
        let all_saturated = open.is_empty();
        if all_saturated {
            // Every pod busy or full: they all compete, ranked like free pods (the queue, KV
            // and running scorers still prefer the lighter ones).
            open.append(&mut busy);
            open.append(&mut full);
        }
        let (winner, total, margin, scores) = {
            let used: Vec<&(Box<dyn Scorer>, f64)> = self
                .scorers
                .iter()
                .filter(|(s, _)| !least_request || LEAST_REQUEST.contains(&s.name()))
                .collect();
            let ranked = rank(self, &ctx, &used, &mut open, m);
            let (best, total) = ranked.best;
            let margin = ranked.runner_up.map_or(0.0, |(_, t)| total - t);
            let scores = used
                .iter()
                .enumerate()
                .map(|(k, (s, _))| (s.name(), ranked.values[k * open.len() + best]))
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
        };
        let new_blocks = winner.new_blocks;
        let record_chain: &[u64] = if winner.pod.hello.engine.prefix_caching {
            &m.chains[winner.chain_index].1
        } else {
            &[]
        };
        let picked = Picked {
            new_blocks,
            uncached_tokens: winner.uncached_tokens,
            chain: record_chain,
        };
        reg.record_pick(&decision.pod, &picked, now, self.cfg.pending_ttl());
        Ok(decision)
    }

    /// Scores the open candidates and finds the best two totals (highest first, ties broken by
    /// pod key so decisions are reproducible), computing real matches only where needed.
    fn rank<'p>(
        &self,
        ctx: &Ctx<'_>,
        used: &[&(Box<dyn Scorer>, f64)],
        open: &mut [Candidate<'p>],
        m: &mut PromptHashes<'_>,
    ) -> Ranked {
        let n = open.len();
        let req = ctx.req;
        if used
            .iter()
            .any(|(s, _)| s.match_use() == MatchUse::Relative)
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
        for (k, (s, _)) in used.iter().enumerate() {
            s.scores(ctx, open, &mut values[k * n..(k + 1) * n]);
        }
        let total_of = |values: &[f64], i: usize| -> f64 {
            used.iter()
                .enumerate()
                .map(|(k, (_, w))| w * values[k * n + i])
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
            for (k, (s, _)) in used.iter().enumerate() {
                if s.match_use() == MatchUse::OwnGrowing {
                    let at = k * n + i;
                    s.scores(ctx, std::slice::from_ref(&open[i]), &mut values[at..=at]);
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
type RankFn = fn(
    &Scheduler,
    &Ctx<'_>,
    &[&(Box<dyn Scorer>, f64)],
    &mut [Candidate<'_>],
    &mut PromptHashes<'_>,
) -> Ranked;

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
struct Ranked {
    best: (usize, f64),
    runner_up: Option<(usize, f64)>,
    values: Vec<f64>,
}

/// What [`PromptHashes::new`] computes for a request: see [`Scheduler::hash_plan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashPlan<'s> {
    seed: ChainSeed<'s>,
    /// Distinct (block size, filter shape of a pod that caches prefixes) among the model's pods.
    shapes: Vec<(u32, Option<FilterParams>)>,
}

/// A request's chains, one per block size among the pods (usually one), and their probe
/// positions once per filter shape (pods of one model share both), so matching a pod is only
/// memory loads.
///
/// Made before the registry lock is taken: hashing an 8k-token prompt costs about as much as
/// the rest of a pick over 64 pods, and every other request waits on that lock.
#[derive(Debug, Default)]
pub struct PromptHashes<'s> {
    seed: ChainSeed<'s>,
    /// The token list the chains were hashed from (compared by address: a pick given hashes of
    /// another list, even an equal one, recomputes them).
    tokens: Option<&'s [u32]>,
    chains: Vec<(u32, Vec<u64>)>,
    prepared: Vec<(u32, FilterParams, PreparedChain)>,
}

impl<'s> PromptHashes<'s> {
    /// Hashes `tokens` for every shape in `plan`; a pick uses them for a request with this very
    /// token list (the same slice) only.
    pub fn new(plan: &HashPlan<'s>, tokens: Option<&'s [u32]>) -> Self {
        let mut h = PromptHashes {
            seed: plan.seed,
            tokens,
            ..PromptHashes::default()
        };
        for &(bs, params) in &plan.shapes {
            let i = h.chain_index(bs, tokens);
            if let Some(params) = params {
                h.prepared_index(i, params);
            }
        }
        h
    }

    /// The chain at block size `bs`, hashed when first asked for.
    fn chain_index(&mut self, bs: u32, tokens: Option<&[u32]>) -> usize {
        match self.chains.iter().position(|(b, _)| *b == bs) {
            Some(i) => i,
            None => {
                let chain = tokens
                    .map(|t| hash_chain(&self.seed, t, bs as usize))
                    .unwrap_or_default();
                self.chains.push((bs, chain));
                self.chains.len() - 1
            }
        }
    }

    /// Chain `chain_index`'s probe positions for filter shape `params`, computed when first
    /// asked for.
    fn prepared_index(&mut self, chain_index: usize, params: FilterParams) -> usize {
        let (bs, chain) = &self.chains[chain_index];
        match self
            .prepared
            .iter()
            .position(|(b, p, _)| b == bs && *p == params)
        {
            Some(i) => i,
            None => {
                self.prepared.push((*bs, params, params.prepare(chain)));
                self.prepared.len() - 1
            }
        }
    }

    /// `pod` as a candidate assuming nothing cached; exact already when it caches nothing.
    fn candidate<'p>(&mut self, pod: &'p Pod, req: &PickRequest<'_>) -> Candidate<'p> {
        let bs = pod.hello.engine.block_size.max(1);
        let chain_index = self.chain_index(bs, req.tokens);
        let chain_len = self.chains[chain_index].1.len();
        let caching = pod.hello.engine.prefix_caching;
        let prepared_index = match &pod.filter {
            Some(f) if caching && chain_len > 0 => {
                Some(self.prepared_index(chain_index, f.params()))
            }
            _ => None,
        };
        let mut c = Candidate {
            pod,
            projection: pod.projection(),
            chain_len,
            matched_blocks: 0,
            uncached_tokens: 0,
            new_blocks: 0,
            first_block: self.chains[chain_index].1.first().copied(),
            chain_index,
            prepared_index,
            exact: !caching,
        };
        c.set_match(0, req.prompt_tokens);
        c
    }

    /// Sets the candidate's match to an upper bound of its real match, from probes every
    /// `stride` blocks; the real match when the bound proves it.
    fn bound(&self, c: &mut Candidate<'_>, req: &PickRequest<'_>, now: Instant, stride: usize) {
        if c.exact {
            return;
        }
        let chain = &self.chains[c.chain_index].1;
        let prepared = c.prepared_index.map(|i| &self.prepared[i].2);
        let (lo, hi) = c.pod.matched_bounds(chain, prepared, now, stride);
        c.set_match(hi, req.prompt_tokens);
        c.exact = lo == hi;
    }

    /// Computes the candidate's real match (pending chains, then the filter's linear scan).
    fn resolve(&self, c: &mut Candidate<'_>, req: &PickRequest<'_>, now: Instant) {
        if c.exact {
            return;
        }
        let chain = &self.chains[c.chain_index].1;
        let prepared = c.prepared_index.map(|i| &self.prepared[i].2);
        let matched = c.pod.matched_blocks(chain, prepared, now);
        c.set_match(matched, req.prompt_tokens);
        c.exact = true;
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
