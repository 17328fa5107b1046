//! A request's block-hash chains, computed before the registry lock is taken and matched
//! against each pod's filter under it.

use std::time::Instant;

use kvsight_protocol::bloom::{FilterParams, PreparedChain};
use kvsight_protocol::hash::{ChainSeed, hash_chain};

use super::{Candidate, PickRequest, Scheduler};
use crate::pods::{Pod, Registry};

impl Scheduler {
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

    pub(super) fn seed<'r>(reg: &Registry, req: &PickRequest<'r>) -> ChainSeed<'r> {
        ChainSeed {
            lora: reg
                .pods()
                .any(|p| p.is_lora(req.model))
                .then_some(req.model),
            cache_salt: req.cache_salt,
        }
    }
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
    pub(super) chains: Vec<(u32, Vec<u64>)>,
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

    /// Keeps the hashes if they were made for `seed` and this very token list (the same slice);
    /// otherwise starts over empty, and the pick hashes what it needs.
    pub(super) fn keep_only_for(&mut self, seed: ChainSeed<'s>, tokens: Option<&'s [u32]>) {
        let same_tokens = match (self.tokens, tokens) {
            (Some(a), Some(b)) => std::ptr::eq(a, b),
            (a, b) => a.is_none() && b.is_none(),
        };
        if self.seed != seed || !same_tokens {
            *self = PromptHashes {
                seed,
                tokens,
                ..PromptHashes::default()
            };
        }
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
    pub(super) fn candidate<'p>(&mut self, pod: &'p Pod, req: &PickRequest<'_>) -> Candidate<'p> {
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
            home: 0.0,
            home_depth: 0,
            room: None,
            chain_index,
            prepared_index,
            exact: !caching,
        };
        c.set_match(0, req.prompt_tokens);
        c
    }

    /// Sets the candidate's match to an upper bound of its real match, from probes every
    /// `stride` blocks; the real match when the bound proves it.
    pub(super) fn bound(
        &self,
        c: &mut Candidate<'_>,
        req: &PickRequest<'_>,
        now: Instant,
        stride: usize,
    ) {
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
    pub(super) fn resolve(&self, c: &mut Candidate<'_>, req: &PickRequest<'_>, now: Instant) {
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
