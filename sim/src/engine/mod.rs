//! A deterministic, step-driven model of vLLM v1's engine core: the scheduler
//! (`core/sched/scheduler.py`), the KV cache manager (`core/kv_cache_manager.py`) and the block
//! pool with prefix caching (`core/block_pool.py`). It is sans-I/O: no threads, sockets or wall
//! clock. The caller submits tokenized requests, calls [`Engine::step`] and receives the step's
//! simulated duration, generated tokens and KV events; the HTTP server and the ZMQ publisher are
//! shells around it. Everything the sidecar and router observe from a real pod — hits counted the
//! way vLLM counts them, eviction order, preemption, queueing — is decided here, so the semantics
//! follow vLLM's source rather than intuition.

mod block_pool;
mod config;
mod error;
mod hash;
mod types;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use block_pool::{BlockId, BlockPool, StoreInfo};

pub use config::{CostModel, EngineConfig, EngineConfigBuilder};
pub use error::{ConfigError, EngineError, PromptLengthError, check_prompt_len};
pub use types::{EngineKvEvent, EngineStats, FinishReason, Request, RequestOutput, StepOutput};

/// A request inside the engine (vLLM's `Request`).
#[derive(Debug)]
struct ReqState {
    id: String,
    /// Prompt followed by the tokens generated so far.
    tokens: Vec<u32>,
    num_prompt_tokens: usize,
    /// Already clamped to the context window.
    max_tokens: usize,
    lora_id: Option<u64>,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    ignore_eos: bool,
    report_reused_blocks: bool,
    /// Extra keys of the first block and of every other block, computed once.
    extra_first: Option<Vec<String>>,
    extra_rest: Option<Vec<String>>,
    /// Hashes of every full block of `tokens`, extended as output fills blocks (vLLM computes
    /// them eagerly too, so a preempted request can hit its own blocks on resume).
    block_hashes: Vec<u64>,
    /// Blocks held, in position order.
    blocks: Vec<BlockId>,
    /// How many leading `blocks` are registered in the prefix cache.
    num_cached_blocks: usize,
    num_computed_tokens: usize,
    /// Prefix-cache hit at first scheduling; `None` until then.
    num_cached_tokens: Option<usize>,
    output_key: u64,
    num_preemptions: u32,
}

impl ReqState {
    fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }

    fn store_info(&self) -> StoreInfo<'_> {
        StoreInfo {
            tokens: &self.tokens,
            block_hashes: &self.block_hashes,
            lora_id: self.lora_id,
            lora_name: self.lora_name.as_deref(),
            cache_salt: self.cache_salt.as_deref(),
        }
    }

    /// Hashes the blocks of `tokens` that became full since the last call.
    fn extend_block_hashes(&mut self, block_size: usize, root: u64) {
        while (self.block_hashes.len() + 1) * block_size <= self.tokens.len() {
            let i = self.block_hashes.len();
            let parent = if i == 0 {
                root
            } else {
                self.block_hashes[i - 1]
            };
            let extra = if i == 0 {
                self.extra_first.as_deref()
            } else {
                self.extra_rest.as_deref()
            };
            let tokens = &self.tokens[i * block_size..(i + 1) * block_size];
            self.block_hashes
                .push(hash::block_hash(parent, tokens, extra));
        }
    }
}

/// The simulated engine. See the module docs.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    pool: BlockPool,
    root_hash: u64,
    slots: Vec<Option<ReqState>>,
    free_slots: Vec<usize>,
    ids: HashMap<String, usize>,
    /// FCFS; preempted requests go back to the front.
    waiting: VecDeque<usize>,
    /// In scheduling order: the last one is the first preempted.
    running: Vec<usize>,
    seen_buckets: HashSet<usize>,
    stats: EngineStats,
}

impl Engine {
    /// Builds an engine; fails only for a config that [`EngineConfig::validate`] rejects.
    pub fn new(config: EngineConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let pool = BlockPool::new(
            config.num_gpu_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.enable_kv_cache_events,
        );
        Ok(Self {
            root_hash: hash::root_hash(config.seed),
            pool,
            config,
            slots: Vec::new(),
            free_slots: Vec::new(),
            ids: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            seen_buckets: HashSet::new(),
            stats: EngineStats::default(),
        })
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Queues a request at the back of the waiting queue. Applies vLLM's prompt-length check and
    /// clamps `max_tokens` to what the context window leaves.
    pub fn submit(&mut self, request: Request) -> Result<(), EngineError> {
        let prompt_len = request.prompt_token_ids.len();
        check_prompt_len(prompt_len, self.config.max_model_len)?;
        if request.max_tokens == 0 {
            return Err(EngineError::InvalidMaxTokens(0));
        }
        if self.ids.contains_key(&request.id) {
            return Err(EngineError::DuplicateRequestId(request.id));
        }
        let max_tokens = request
            .max_tokens
            .min(self.config.max_model_len - prompt_len);
        let lora = request.lora_name.as_deref();
        let salt = request.cache_salt.as_deref();
        let mut state = ReqState {
            output_key: hash::output_key(self.config.seed, &request.prompt_token_ids, lora),
            extra_first: hash::extra_keys(lora, salt, true),
            extra_rest: hash::extra_keys(lora, salt, false),
            id: request.id,
            tokens: request.prompt_token_ids,
            num_prompt_tokens: prompt_len,
            max_tokens,
            lora_id: request.lora_id,
            lora_name: request.lora_name,
            cache_salt: request.cache_salt,
            ignore_eos: request.ignore_eos,
            report_reused_blocks: request
                .report_reused_blocks
                .unwrap_or(self.config.emit_reused_stores),
            block_hashes: Vec::new(),
            blocks: Vec::new(),
            num_cached_blocks: 0,
            num_computed_tokens: 0,
            num_cached_tokens: None,
            num_preemptions: 0,
        };
        if self.config.enable_prefix_caching {
            state.extend_block_hashes(self.config.block_size, self.root_hash);
        }
        let id = state.id.clone();
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot] = Some(state);
                slot
            }
            None => {
                self.slots.push(Some(state));
                self.slots.len() - 1
            }
        };
        self.ids.insert(id, slot);
        self.waiting.push_back(slot);
        Ok(())
    }

    /// Removes a waiting or running request and frees its blocks. False if the id is unknown
    /// (already finished or never submitted).
    pub fn abort(&mut self, id: &str) -> bool {
        let Some(&slot) = self.ids.get(id) else {
            return false;
        };
        if let Some(pos) = self.running.iter().position(|&s| s == slot) {
            self.running.remove(pos);
        } else if let Some(pos) = self.waiting.iter().position(|&s| s == slot) {
            self.waiting.remove(pos);
        }
        self.release(slot);
        self.stats.aborted += 1;
        true
    }

    /// Whether a step would do anything (requests waiting or running).
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Whether `id` is waiting or running.
    pub fn contains(&self, id: &str) -> bool {
        self.ids.contains_key(id)
    }

    /// KV events produced outside a step (a reset while idle). `step` returns them too; real vLLM
    /// publishes a reset's `AllBlocksCleared` with the next step's batch, so an idle vLLM sends it
    /// only when work arrives. Calling this publishes it at once instead.
    pub fn take_events(&mut self) -> Vec<EngineKvEvent> {
        self.pool.take_events()
    }

    /// vLLM's `reset_prefix_cache`: refused (false) while any request holds blocks; otherwise
    /// every cached hash is forgotten and `AllBlocksCleared` is queued for the next step.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.reset_prefix_cache_with(false)
    }

    /// vLLM's `reset_prefix_cache(reset_running_requests)`: with `true`, every running request
    /// is first preempted (popped from the back, so they return to the waiting queue in their
    /// running order) and the reset then always succeeds.
    pub fn reset_prefix_cache_with(&mut self, reset_running_requests: bool) -> bool {
        if reset_running_requests {
            while let Some(slot) = self.running.pop() {
                self.preempt(slot);
            }
        }
        self.pool.reset_prefix_cache()
    }

    /// Current gauges and counters.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_cache_usage: self.pool.usage(),
            ..self.stats.clone()
        }
    }

    /// Ground truth for the sidecar's mirror: every block hash resident in the prefix cache
    /// (referenced or free-but-not-evicted), sorted, each once.
    pub fn resident_block_hashes(&self) -> Vec<u64> {
        self.pool
            .cached_hash_counts()
            .into_iter()
            .map(|(h, _)| h)
            .collect()
    }

    /// Like [`Self::resident_block_hashes`] with the number of blocks holding each hash: vLLM
    /// does not de-duplicate blocks filled independently with the same content.
    pub fn resident_block_hash_counts(&self) -> Vec<(u64, usize)> {
        self.pool.cached_hash_counts()
    }

    /// Cached blocks in the pool (a duplicated hash counts once per block).
    pub fn num_cached_blocks(&self) -> usize {
        self.pool.num_cached_blocks()
    }

    /// Test support: verifies the pool's and the scheduler's invariants in O(pool + requests):
    /// every usable block is either free or referenced, each block's reference count equals the
    /// number of requests holding it, the cache index matches the blocks' hashes, and the
    /// running set respects `max_num_seqs`.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let mut refs: HashMap<BlockId, u32> = HashMap::new();
        for req in self.slots.iter().flatten() {
            for &b in &req.blocks {
                *refs.entry(b).or_default() += 1;
            }
        }
        let referenced = self.pool.num_usable() - self.pool.num_free();
        if refs.len() != referenced {
            return Err(format!(
                "{} blocks held by requests, {referenced} referenced in the pool",
                refs.len()
            ));
        }
        for (b, n) in refs {
            if self.pool.ref_cnt(b) != n {
                return Err(format!(
                    "block {b}: {n} holders, ref_cnt {}",
                    self.pool.ref_cnt(b)
                ));
            }
        }
        if self.running.len() > self.config.max_num_seqs {
            return Err(format!("{} running > max_num_seqs", self.running.len()));
        }
        for &slot in &self.waiting {
            if self.slots[slot]
                .as_ref()
                .is_some_and(|r| !r.blocks.is_empty())
            {
                return Err("a waiting request holds blocks".into());
            }
        }
        if self.waiting.len() + self.running.len() != self.ids.len() {
            return Err("request index out of sync with the queues".into());
        }
        Ok(())
    }

    /// Runs one scheduler step: schedules running requests first (decodes and unfinished
    /// prefill chunks), preempting the most recently scheduled ones when blocks run out; then,
    /// if nothing was preempted, admits waiting requests FCFS within `max_num_seqs` and the token
    /// budget; then "executes" the batch, generating one token for every request whose computed
    /// tokens caught up with its tokens.
    pub fn step(&mut self) -> StepOutput {
        let bs = self.config.block_size;
        let mut budget = self.config.max_num_batched_tokens;
        // (slot, tokens scheduled, is a decode)
        let mut scheduled: Vec<(usize, usize, bool)> = Vec::new();
        let mut preempted_any = false;

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let slot = self.running[i];
            let Some(req) = self.slots[slot].as_ref() else {
                i += 1;
                continue;
            };
            let remaining = req.tokens.len() - req.num_computed_tokens;
            let n = remaining.min(budget);
            let is_decode = remaining == 1 && req.num_output_tokens() > 0;
            if n == 0 {
                i += 1;
                continue;
            }
            loop {
                if self.allocate_slots(slot, n, &[]) {
                    scheduled.push((slot, n, is_decode));
                    budget -= n;
                    i += 1;
                    break;
                }
                // vLLM preempts the lowest-priority request: under FCFS the last one running.
                let Some(victim) = self.running.pop() else {
                    break;
                };
                self.preempt(victim);
                preempted_any = true;
                if victim == slot {
                    break;
                }
            }
        }

        // vLLM admits nobody in a step that had to preempt: memory is short.
        if !preempted_any {
            while budget > 0 && self.running.len() < self.config.max_num_seqs {
                let Some(&slot) = self.waiting.front() else {
                    break;
                };
                let hit = self.computed_blocks(slot);
                let Some(req) = self.slots[slot].as_ref() else {
                    self.waiting.pop_front();
                    continue;
                };
                let hit_tokens = hit.len() * bs;
                let n = (req.tokens.len() - hit_tokens).min(budget);
                // vLLM (`scheduler_reserve_full_isl`, on by default) admits a request only if
                // its whole sequence fits, not just the first chunk of a chunked prefill.
                if !self.full_sequence_fits(slot, &hit) || !self.allocate_slots(slot, n, &hit) {
                    break;
                }
                self.waiting.pop_front();
                self.running.push(slot);
                if let Some(req) = self.slots[slot].as_mut() {
                    req.num_computed_tokens = hit_tokens;
                    req.num_cached_tokens.get_or_insert(hit_tokens);
                    // vLLM records the prefix-cache query at admission, "so unscheduled lookups
                    // are not counted": a request retried at the head of a full queue counts
                    // once, and a resumed (preempted) one not at all.
                    if self.config.enable_prefix_caching && req.num_preemptions == 0 {
                        self.stats.prefix_cache_queries += req.tokens.len() as u64;
                        self.stats.prefix_cache_hits += hit_tokens as u64;
                    }
                }
                scheduled.push((slot, n, false));
                budget -= n;
            }
        }

        let mut out = StepOutput {
            num_scheduled_tokens: self.config.max_num_batched_tokens - budget,
            ..StepOutput::default()
        };
        if !scheduled.is_empty() {
            let decodes = scheduled.iter().filter(|s| s.2).count();
            // Every scheduled request attends to its whole context so far.
            let kv_tokens: usize = scheduled
                .iter()
                .filter_map(|&(slot, n, _)| {
                    self.slots[slot].as_ref().map(|r| r.num_computed_tokens + n)
                })
                .sum();
            let (duration, compiled) = self.step_cost(
                out.num_scheduled_tokens,
                decodes,
                scheduled.len(),
                kv_tokens,
            );
            out.duration = duration;
            out.compiled_new_bucket = compiled;
            self.stats.steps += 1;
            self.stats.busy_time = self.stats.busy_time.saturating_add(duration);
        }
        let mut finished = Vec::new();
        for &(slot, n, _) in &scheduled {
            if let Some(output) = self.execute(slot, n) {
                if output.finished.is_some() {
                    finished.push(slot);
                }
                out.outputs.push(output);
            }
        }
        if !finished.is_empty() {
            for slot in finished {
                self.release(slot);
            }
            // Released slots are empty: one pass, whatever the number finished.
            let slots = &self.slots;
            self.running.retain(|&s| slots[s].is_some());
        }
        out.events = self.pool.take_events();
        out
    }

    /// Simulated cost of a step scheduling `tokens` tokens for `batch` requests, `decodes` of
    /// them single-token decodes, attending to `kv_tokens` in all. Returns the scaled duration and
    /// whether a new shape bucket was compiled.
    fn step_cost(
        &mut self,
        tokens: usize,
        decodes: usize,
        batch: usize,
        kv_tokens: usize,
    ) -> (Duration, bool) {
        let cost = &self.config.cost;
        let prefill_tokens = tokens - decodes;
        let prefill =
            Duration::try_from_secs_f64(prefill_tokens as f64 / cost.prefill_tokens_per_s)
                .unwrap_or(Duration::MAX);
        let per_seq = cost
            .decode_per_seq
            .checked_mul(u32::try_from(batch).unwrap_or(u32::MAX))
            .unwrap_or(Duration::MAX);
        let attention =
            Duration::try_from_secs_f64(cost.decode_per_kv_token.as_secs_f64() * kv_tokens as f64)
                .unwrap_or(Duration::MAX);
        let mut total = cost
            .decode_base
            .saturating_add(per_seq)
            .saturating_add(attention)
            .saturating_add(prefill);
        // Engines pad the batch to a captured shape; the first time a shape is seen it compiles.
        let compiled = self.seen_buckets.insert(tokens.next_power_of_two());
        if compiled {
            total = total.saturating_add(cost.compile_stall);
        }
        let scaled = Duration::try_from_secs_f64(total.as_secs_f64() * self.config.time_scale)
            .unwrap_or(Duration::MAX);
        (scaled, compiled)
    }

    /// vLLM's `get_computed_blocks`: the cached prefix of a waiting request, capped so that at
    /// least the last prompt token is recomputed (the model must produce logits for it). The
    /// prefix-cache counters are not touched here but at admission (in `step`): a lookup
    /// whose allocation then fails is not a query in vLLM's stats, and a request resumed after
    /// preemption feeds vLLM's separate `preempted_*` stats, not the Prometheus counters.
    fn computed_blocks(&mut self, slot: usize) -> Vec<BlockId> {
        if !self.config.enable_prefix_caching {
            return Vec::new();
        }
        let Some(req) = self.slots[slot].as_ref() else {
            return Vec::new();
        };
        let max_blocks = (req.tokens.len() - 1) / self.config.block_size;
        let hit = self.pool.longest_hit(&req.block_hashes, max_blocks);
        // vLLM's "full" KV report mode announces the reused chain here, at lookup, so a request
        // that then fails to get blocks announces it again on its next attempt.
        if req.report_reused_blocks {
            self.pool.announce_reused(hit.len(), &req.store_info());
        }
        hit
    }

    /// vLLM's admission gate (`allocate_slots` with `full_sequence_must_fit`): the free queue
    /// holds blocks for all of the request's tokens (capped at the context window) beyond the
    /// `hit`, plus the hit blocks that are free and would leave the queue when touched.
    fn full_sequence_fits(&self, slot: usize, hit: &[BlockId]) -> bool {
        let Some(req) = self.slots[slot].as_ref() else {
            return false;
        };
        let full = req
            .tokens
            .len()
            .min(self.config.max_model_len)
            .div_ceil(self.config.block_size);
        let hit_free = hit.iter().filter(|&&b| self.pool.ref_cnt(b) == 0).count();
        full.saturating_sub(req.blocks.len() + hit.len()) + hit_free <= self.pool.num_free()
    }

    /// vLLM's `allocate_slots`: makes room for `num_new` more tokens after the already computed
    /// ones plus the `hit` blocks, or changes nothing and returns false. Newly full blocks are
    /// cached (and announced) at scheduling time, as vLLM does.
    fn allocate_slots(&mut self, slot: usize, num_new: usize, hit: &[BlockId]) -> bool {
        let bs = self.config.block_size;
        let Some(req) = self.slots[slot].as_mut() else {
            return false;
        };
        let pool = &mut self.pool;
        let computed = req.num_computed_tokens + hit.len() * bs;
        let required = (computed + num_new).div_ceil(bs);
        let to_allocate = required.saturating_sub(req.blocks.len() + hit.len());
        // Hit blocks sitting in the free queue stop being allocatable once touched.
        let hit_free = hit.iter().filter(|&&b| pool.ref_cnt(b) == 0).count();
        if to_allocate + hit_free > pool.num_free() {
            return false;
        }
        if !hit.is_empty() {
            pool.touch(hit);
            req.blocks.extend_from_slice(hit);
            req.num_cached_blocks = hit.len();
        }
        let Some(new_blocks) = pool.allocate(to_allocate) else {
            return false;
        };
        req.blocks.extend(new_blocks);
        let full = (computed + num_new).min(req.tokens.len()) / bs;
        if full > req.num_cached_blocks {
            pool.cache_full_blocks(&req.blocks, req.num_cached_blocks, full, &req.store_info());
            if self.config.enable_prefix_caching {
                req.num_cached_blocks = full;
            }
        }
        true
    }

    /// Preemption by recompute: blocks freed (tail first), progress dropped, back to the front
    /// of the waiting queue with its generated tokens kept.
    fn preempt(&mut self, slot: usize) {
        if let Some(req) = self.slots[slot].as_mut() {
            self.pool.free(req.blocks.drain(..).rev());
            req.num_cached_blocks = 0;
            req.num_computed_tokens = 0;
            req.num_preemptions += 1;
        }
        self.stats.num_preemptions += 1;
        self.waiting.push_front(slot);
    }

    /// Applies a scheduled chunk; when the request caught up, samples its next token and checks
    /// the stop conditions in vLLM's order (length before eos).
    fn execute(&mut self, slot: usize, n: usize) -> Option<RequestOutput> {
        let bs = self.config.block_size;
        let caching = self.config.enable_prefix_caching;
        let root = self.root_hash;
        let req = self.slots[slot].as_mut()?;
        req.num_computed_tokens += n;
        if req.num_computed_tokens < req.tokens.len() {
            return None;
        }
        let position = req.num_output_tokens();
        let token = hash::generated_token(req.output_key, position, self.config.vocab_size);
        let num_cached_tokens = req.num_cached_tokens.unwrap_or(0);
        let first_token = position == 0;
        if first_token {
            self.stats.prompt_tokens += req.num_prompt_tokens as u64;
            self.stats.prompt_tokens_cached += num_cached_tokens as u64;
        }
        req.tokens.push(token);
        if caching {
            req.extend_block_hashes(bs, root);
        }
        self.stats.generation_tokens += 1;
        let finished = if req.num_output_tokens() >= req.max_tokens
            || req.tokens.len() >= self.config.max_model_len
        {
            Some(FinishReason::Length)
        } else if !req.ignore_eos && Some(token) == self.config.eos_token_id {
            Some(FinishReason::Stop)
        } else {
            None
        };
        match finished {
            Some(FinishReason::Length) => self.stats.finished_length += 1,
            Some(FinishReason::Stop) => self.stats.finished_stop += 1,
            None => {}
        }
        Some(RequestOutput {
            id: req.id.clone(),
            new_token_ids: vec![token],
            finished,
            num_cached_tokens,
            first_token,
        })
    }

    /// Frees a finished or aborted request's blocks (tail first, so a shared prefix outlives
    /// its suffix in the LRU) and forgets it. The caller has removed it from the queues.
    fn release(&mut self, slot: usize) {
        if let Some(req) = self.slots[slot].take() {
            self.pool.free(req.blocks.iter().rev().copied());
            self.ids.remove(&req.id);
            self.free_slots.push(slot);
        }
    }
}
