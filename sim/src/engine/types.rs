//! The engine's public data: what goes in (a tokenized [`Request`]), what comes out of a step
//! ([`StepOutput`] with per-request [`RequestOutput`]s and [`EngineKvEvent`]s) and the counters
//! behind vLLM's metrics ([`EngineStats`]). Plain data, no behaviour, so the HTTP layer and the
//! KV-event publisher can be written against it independently.

use std::time::Duration;

/// One tokenized generation request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Request {
    /// Unique among requests currently in the engine.
    pub id: String,
    /// The prompt, already tokenized.
    pub prompt_token_ids: Vec<u32>,
    /// Output tokens wanted; clamped to `max_model_len - prompt_len`, as vLLM does.
    pub max_tokens: usize,
    /// LoRA adapter name; part of every block's hash.
    pub lora_name: Option<String>,
    /// vLLM's `lora_int_id`, reported as `lora_id` in `BlockStored`.
    pub lora_id: Option<u64>,
    /// Per-tenant cache isolation; part of the first block's hash.
    pub cache_salt: Option<String>,
    /// Keep generating past the eos token.
    pub ignore_eos: bool,
    /// vLLM's per-request `kv_cache_report_mode` (`vllm_xargs`): `Some(true)` = "full"
    /// (announce prefix-cache hits as `BlockStored`), `Some(false)` = "incremental", `None` =
    /// the engine's [`super::EngineConfig::emit_reused_stores`].
    pub report_reused_blocks: Option<bool>,
}

impl Request {
    /// A plain request: no LoRA, no salt.
    pub fn new(id: impl Into<String>, prompt_token_ids: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            id: id.into(),
            prompt_token_ids,
            max_tokens,
            ..Self::default()
        }
    }
}

/// Why a request finished, named like vLLM's `finish_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// Reached `max_tokens` or the context window.
    Length,
    /// Generated the eos token.
    Stop,
}

impl FinishReason {
    /// The OpenAI / Prometheus label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Length => "length",
            Self::Stop => "stop",
        }
    }
}

/// What one request produced in one step. Requests that only advanced a prefill chunk produce
/// nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestOutput {
    /// The request id.
    pub id: String,
    /// Tokens generated in this step (one, without speculative decoding).
    pub new_token_ids: Vec<u32>,
    /// Set on the step the request finished; its blocks are already freed.
    pub finished: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache at first scheduling (vLLM's
    /// `num_cached_tokens`, reported as `prompt_tokens_details.cached_tokens`).
    pub num_cached_tokens: usize,
    /// True for the request's first generated token (TTFT ends here).
    pub first_token: bool,
}

/// A KV-cache event, in the order the block pool produced it. The wire layer maps this to vLLM's
/// msgpack structs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineKvEvent {
    /// Blocks became full and cached (or, with `emit_reused_stores`, were reused from the cache).
    BlockStored {
        /// One hash per block, in chain order.
        block_hashes: Vec<u64>,
        /// Hash of the block before the first one, `None` when the first is the chain's start.
        parent_block_hash: Option<u64>,
        /// The tokens of all these blocks, concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: usize,
        /// vLLM's `lora_int_id`.
        lora_id: Option<u64>,
        /// The LoRA adapter name.
        lora_name: Option<String>,
        /// One entry per block: that block's hash extra keys (LoRA name; the first block of a
        /// chain also carries the `cache_salt`), `None` when it has none.
        extra_keys: Vec<Option<Vec<String>>>,
    },
    /// A cached block was evicted to make room for a new allocation.
    BlockRemoved {
        /// The evicted block's hash (vLLM sends one per event).
        block_hashes: Vec<u64>,
    },
    /// The prefix cache was reset.
    AllBlocksCleared,
}

/// Everything one scheduler step did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepOutput {
    /// Simulated time the step took, already multiplied by `time_scale`. Zero when idle.
    pub duration: Duration,
    /// KV events produced since the previous step (including a reset in between), in order.
    pub events: Vec<EngineKvEvent>,
    /// Per-request results, in scheduling order.
    pub outputs: Vec<RequestOutput>,
    /// Tokens computed in this step (decodes plus prefill chunks).
    pub num_scheduled_tokens: usize,
    /// Whether this step paid the compile stall for a new shape bucket.
    pub compiled_new_bucket: bool,
}

/// Engine counters and gauges, named after the vLLM metrics they feed.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineStats {
    /// `vllm:num_requests_running`.
    pub running: usize,
    /// `vllm:num_requests_waiting`.
    pub waiting: usize,
    /// `vllm:kv_cache_usage_perc`, 0..=1 (the null block is not counted).
    pub kv_cache_usage: f64,
    /// `vllm:prefix_cache_queries_total`, in tokens (requests not previously preempted).
    pub prefix_cache_queries: u64,
    /// `vllm:prefix_cache_hits_total`, in tokens.
    pub prefix_cache_hits: u64,
    /// `vllm:num_preemptions_total`.
    pub num_preemptions: u64,
    /// `vllm:prompt_tokens_total`, counted when a request's prefill first completes.
    pub prompt_tokens: u64,
    /// `vllm:prompt_tokens_cached_total`.
    pub prompt_tokens_cached: u64,
    /// `vllm:generation_tokens_total`.
    pub generation_tokens: u64,
    /// `vllm:request_success_total{finished_reason="length"}`.
    pub finished_length: u64,
    /// `vllm:request_success_total{finished_reason="stop"}`.
    pub finished_stop: u64,
    /// Requests removed by `abort`.
    pub aborted: u64,
    /// Steps that scheduled work.
    pub steps: u64,
    /// Sum of all step durations: the engine's simulated clock.
    pub busy_time: Duration,
}
