//! Picking one pod per request: filters, then a weighted sum of scorers, every decision
//! explainable (each scorer's value, the margin over the runner-up, the predicted cached tokens).
//!
//! One trait per extension point ([`Filter`], [`Scorer`]) and one file per implementation;
//! [`Scheduler::new`] is the factory that turns the config's weights into the scorer set.
//!
//! Prefix caching off: when no candidate pod caches prefixes, the prefix, KV and latency scorers
//! carry no signal worth following, so the scheduler uses least-request scoring (queue and
//! running requests, LRU to break ties). A router that remembers its own decisions would pile
//! shared-prompt traffic onto one pod here; this one spreads it.

pub mod filters;
pub mod scorers;

use std::time::Instant;

use kvsight_protocol::bloom::{FilterParams, PreparedChain};
use kvsight_protocol::hash::{ChainSeed, hash_chain};

use crate::config::{PoolConfig, SchedulerConfig};
use crate::pods::{Pod, Projection, Registry};

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
}

/// One pod as seen by this request.
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
    chain_index: usize,
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
    fn scores(&self, ctx: &Ctx<'_>, cands: &[Candidate<'_>]) -> Vec<f64>;
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
    /// Every eligible pod was saturated: the shortest queue was taken.
    pub all_saturated: bool,
    /// Least-request scoring was used (no candidate caches prefixes).
    pub least_request: bool,
    pub candidates: usize,
}

/// Filters and weighted scorers built from the config.
pub struct Scheduler {
    cfg: SchedulerConfig,
    hard: Vec<Box<dyn Filter>>,
    saturation: Box<dyn Filter>,
    scorers: Vec<(Box<dyn Scorer>, f64)>,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

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
            Box::new(scorers::Lru),
        ];
        let weights = cfg.weights.named();
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
            saturation: Box::new(filters::NotSaturated),
            scorers,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Picks a pod and records the pick in the registry (in flight, pending blocks, LRU), under
    /// the caller's one lock so concurrent picks see each other.
    pub fn pick(
        &self,
        reg: &mut Registry,
        req: &PickRequest<'_>,
        now: Instant,
    ) -> Result<Decision, PickError> {
        let lora = reg
            .pods()
            .any(|p| p.is_lora(req.model))
            .then_some(req.model);
        let ctx = Ctx {
            req,
            cfg: &self.cfg,
            now,
            lora,
        };
        let seed = ChainSeed {
            lora,
            cache_salt: req.cache_salt,
        };
        // One chain per block size among the pods (usually one), and its probe positions once per
        // filter shape (pods of one model share both), so probing a pod is only memory loads.
        let mut chains: Vec<(u32, Vec<u64>)> = Vec::new();
        let mut prepared: Vec<(u32, FilterParams, PreparedChain)> = Vec::new();
        // Set when a pod that serves the model and is ready cannot hold the prompt.
        let mut too_long = false;
        let mut eligible: Vec<Candidate<'_>> = Vec::new();
        for pod in reg.pods() {
            let bs = pod.hello.engine.block_size.max(1);
            let chain_index = match chains.iter().position(|(b, _)| *b == bs) {
                Some(i) => i,
                None => {
                    let chain = req
                        .tokens
                        .map(|t| hash_chain(&seed, t, bs as usize))
                        .unwrap_or_default();
                    chains.push((bs, chain));
                    chains.len() - 1
                }
            };
            let chain = &chains[chain_index].1;
            let caching = pod.hello.engine.prefix_caching;
            let probe = match &pod.filter {
                Some(f) if caching && !chain.is_empty() => {
                    let params = f.params();
                    let found = prepared
                        .iter()
                        .position(|(b, p, _)| *b == bs && *p == params);
                    Some(found.unwrap_or_else(|| {
                        prepared.push((bs, params, params.prepare(chain)));
                        prepared.len() - 1
                    }))
                }
                _ => None,
            };
            let matched = if caching {
                pod.matched_blocks(chain, probe.map(|i| &prepared[i].2), now)
            } else {
                0
            };
            let cached = cached_tokens(matched, bs, req.prompt_tokens);
            let cand = Candidate {
                pod,
                projection: pod.projection(),
                chain_len: chain.len(),
                matched_blocks: matched,
                uncached_tokens: req.prompt_tokens - cached,
                new_blocks: req.prompt_tokens.div_ceil(bs) - cached / bs,
                chain_index,
            };
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
        let (open, saturated): (Vec<_>, Vec<_>) = eligible
            .into_iter()
            .partition(|c| self.saturation.keep(&ctx, c));
        let all_saturated = open.is_empty();
        let least_request = !saturated
            .iter()
            .chain(&open)
            .any(|c| c.pod.hello.engine.prefix_caching);

        let (winner, total, margin, scores) = if all_saturated {
            // Every pod is full: the shortest projected queue, then fewest running.
            let best = saturated
                .iter()
                .enumerate()
                .min_by_key(|(_, c)| {
                    (
                        c.projection.waiting,
                        c.projection.running,
                        c.pod.last_picked,
                    )
                })
                .map(|(i, _)| i)
                .expect("non-empty");
            (&saturated[best], 0.0, 0.0, Vec::new())
        } else {
            let used: Vec<&(Box<dyn Scorer>, f64)> = self
                .scorers
                .iter()
                .filter(|(s, _)| !least_request || LEAST_REQUEST.contains(&s.name()))
                .collect();
            let per_scorer: Vec<Vec<f64>> =
                used.iter().map(|(s, _)| s.scores(&ctx, &open)).collect();
            let totals: Vec<f64> = (0..open.len())
                .map(|i| {
                    used.iter()
                        .zip(&per_scorer)
                        .map(|((_, w), v)| w * v[i])
                        .sum()
                })
                .collect();
            let mut order: Vec<usize> = (0..open.len()).collect();
            // Highest total first; ties broken by pod key so decisions are reproducible.
            order.sort_by(|&a, &b| {
                totals[b]
                    .total_cmp(&totals[a])
                    .then_with(|| open[a].pod.key.cmp(&open[b].pod.key))
            });
            let best = order[0];
            let margin = order.get(1).map_or(0.0, |&j| totals[best] - totals[j]);
            let scores = used
                .iter()
                .zip(&per_scorer)
                .map(|((s, _), v)| (s.name(), v[best]))
                .collect();
            (&open[best], totals[best], margin, scores)
        };

        let bs = winner.pod.hello.engine.block_size.max(1);
        let decision = Decision {
            pod: winner.pod.key.clone(),
            url: winner.pod.hello.pod.url.clone(),
            total,
            margin,
            scores,
            predicted_cached_tokens: cached_tokens(winner.matched_blocks, bs, req.prompt_tokens),
            matched_blocks: winner.matched_blocks,
            chain_len: winner.chain_len,
            all_saturated,
            least_request,
            candidates: n_eligible,
        };
        let new_blocks = winner.new_blocks;
        let chain_index = winner.chain_index;
        let record_chain = if winner.pod.hello.engine.prefix_caching {
            chains[chain_index].1.clone()
        } else {
            Vec::new()
        };
        reg.record_pick(
            &decision.pod,
            new_blocks,
            &record_chain,
            now,
            self.cfg.pending_ttl(),
        );
        Ok(decision)
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
