//! Engine configuration: the subset of vLLM's engine flags that shape scheduling and the KV cache,
//! plus the simulator's cost model. Field names follow vLLM's CLI flags (`--block-size`,
//! `--max-num-seqs`, ...) so that a test reads like a vLLM command line. Validated once, in
//! [`EngineConfigBuilder::build`], so the engine itself never has to re-check them.

use std::time::Duration;

use super::error::ConfigError;

/// How long simulated work takes. All durations are *unscaled*; the engine multiplies each step's
/// total by [`EngineConfig::time_scale`].
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    /// Prefill throughput in tokens per second of uncached prompt tokens. Default 10 000.
    pub prefill_tokens_per_s: f64,
    /// Fixed cost of any forward pass (one step). Default 10 ms.
    pub decode_base: Duration,
    /// Extra cost per request scheduled in the step (batch size). Default 100 µs.
    pub decode_per_seq: Duration,
    /// Extra cost per KV token the step's requests attend to (each scheduled request's context:
    /// computed tokens plus the tokens scheduled): reading the KV cache makes a decode step of
    /// long contexts slower than one of short ones. Default zero.
    pub decode_per_kv_token: Duration,
    /// Paid once per new shape bucket (scheduled tokens padded to a power of two), like a
    /// first-time torch.compile / CUDA-graph capture. Default 500 ms; zero disables it.
    pub compile_stall: Duration,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            prefill_tokens_per_s: 10_000.0,
            decode_base: Duration::from_millis(10),
            decode_per_seq: Duration::from_micros(100),
            decode_per_kv_token: Duration::ZERO,
            compile_stall: Duration::from_millis(500),
        }
    }
}

/// The validated engine configuration. Build it with [`EngineConfig::builder`].
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block (`--block-size`). Default 16.
    pub block_size: usize,
    /// KV blocks in the GPU pool, including vLLM's reserved null block, so `num_gpu_blocks - 1`
    /// are usable. Default 4096.
    pub num_gpu_blocks: usize,
    /// Maximum running requests (`--max-num-seqs`). Default 256.
    pub max_num_seqs: usize,
    /// Token budget of one step, shared by decodes and prefill chunks
    /// (`--max-num-batched-tokens`). Default 2048.
    pub max_num_batched_tokens: usize,
    /// Context window in tokens, prompt plus output (`--max-model-len`). Default 4096.
    pub max_model_len: usize,
    /// Automatic prefix caching (`--enable-prefix-caching`). Default true.
    pub enable_prefix_caching: bool,
    /// Produce KV-cache events (`--kv-events-config` with `enable_kv_cache_events`). Default true.
    pub enable_kv_cache_events: bool,
    /// vLLM 0.33 emits `BlockStored` again for blocks reused from the prefix cache. Default true.
    pub emit_reused_stores: bool,
    /// Seeds everything random: the per-process root block hash and the generated tokens.
    /// Default 0.
    pub seed: u64,
    /// Generated token ids are drawn from `0..vocab_size`. Default 32 000.
    pub vocab_size: u32,
    /// A generated token equal to this finishes the request with `stop` (unless `ignore_eos`).
    /// Default `None`.
    pub eos_token_id: Option<u32>,
    /// The cost model.
    pub cost: CostModel,
    /// Multiplier applied to every step duration (0.01 makes a test run 100× faster). Default 1.
    pub time_scale: f64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_gpu_blocks: 4096,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 4096,
            enable_prefix_caching: true,
            enable_kv_cache_events: true,
            emit_reused_stores: true,
            seed: 0,
            vocab_size: 32_000,
            eos_token_id: None,
            cost: CostModel::default(),
            time_scale: 1.0,
        }
    }
}

impl EngineConfig {
    /// A builder starting from the defaults documented on each field.
    pub fn builder() -> EngineConfigBuilder {
        EngineConfigBuilder {
            config: Self::default(),
        }
    }

    /// The defaults without the compile stall and with steps 1000× shorter than the cost model
    /// says: an engine for tests that care about what it computes, not how long it takes.
    pub fn fast() -> EngineConfig {
        Self::builder()
            .compile_stall(Duration::ZERO)
            .time_scale(0.001)
            .build()
            .expect("the defaults are valid")
    }

    /// Checks every field; the builder calls this, and so does [`super::Engine::new`] for configs
    /// assembled by hand.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("block_size", self.block_size),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(ConfigError::Invalid {
                    field,
                    reason: "must be at least 1".into(),
                });
            }
        }
        // One block is vLLM's null block; at least one more must be usable.
        if self.num_gpu_blocks < 2 {
            return Err(ConfigError::Invalid {
                field: "num_gpu_blocks",
                reason: "must be at least 2 (one is reserved as the null block)".into(),
            });
        }
        if u32::try_from(self.num_gpu_blocks).is_err() {
            return Err(ConfigError::Invalid {
                field: "num_gpu_blocks",
                reason: "must fit in 32 bits".into(),
            });
        }
        // vLLM refuses to start when one max-length request cannot fit in the KV cache; without
        // this a lone request could preempt itself forever.
        if (self.num_gpu_blocks - 1).saturating_mul(self.block_size) < self.max_model_len {
            return Err(ConfigError::Invalid {
                field: "num_gpu_blocks",
                reason: format!(
                    "{} usable blocks of {} tokens cannot hold one max_model_len={} request",
                    self.num_gpu_blocks - 1,
                    self.block_size,
                    self.max_model_len
                ),
            });
        }
        if self.vocab_size == 0 {
            return Err(ConfigError::Invalid {
                field: "vocab_size",
                reason: "must be at least 1".into(),
            });
        }
        if let Some(eos) = self.eos_token_id
            && eos >= self.vocab_size
        {
            return Err(ConfigError::Invalid {
                field: "eos_token_id",
                reason: format!("{eos} is outside the vocabulary 0..{}", self.vocab_size),
            });
        }
        let rate = self.cost.prefill_tokens_per_s;
        if !(rate.is_finite() && rate > 0.0) {
            return Err(ConfigError::Invalid {
                field: "prefill_tokens_per_s",
                reason: format!("{rate} is not a positive finite number"),
            });
        }
        // Bounded so that `Duration::mul_f64` can never overflow or panic on a step.
        if !(self.time_scale.is_finite() && (0.0..=1e6).contains(&self.time_scale)) {
            return Err(ConfigError::Invalid {
                field: "time_scale",
                reason: format!("{} is not in 0..=1e6", self.time_scale),
            });
        }
        Ok(())
    }
}

/// Builder for [`EngineConfig`]; every setter is named after the field it sets.
#[derive(Debug, Clone)]
pub struct EngineConfigBuilder {
    config: EngineConfig,
}

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty => $($path:ident).+;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, value: $ty) -> Self {
                self.config.$($path).+ = value;
                self
            }
        )*
    };
}

impl EngineConfigBuilder {
    setters! {
        /// Sets [`EngineConfig::block_size`].
        block_size: usize => block_size;
        /// Sets [`EngineConfig::num_gpu_blocks`].
        num_gpu_blocks: usize => num_gpu_blocks;
        /// Sets [`EngineConfig::max_num_seqs`].
        max_num_seqs: usize => max_num_seqs;
        /// Sets [`EngineConfig::max_num_batched_tokens`].
        max_num_batched_tokens: usize => max_num_batched_tokens;
        /// Sets [`EngineConfig::max_model_len`].
        max_model_len: usize => max_model_len;
        /// Sets [`EngineConfig::enable_prefix_caching`].
        enable_prefix_caching: bool => enable_prefix_caching;
        /// Sets [`EngineConfig::enable_kv_cache_events`].
        enable_kv_cache_events: bool => enable_kv_cache_events;
        /// Sets [`EngineConfig::emit_reused_stores`].
        emit_reused_stores: bool => emit_reused_stores;
        /// Sets [`EngineConfig::seed`].
        seed: u64 => seed;
        /// Sets [`EngineConfig::vocab_size`].
        vocab_size: u32 => vocab_size;
        /// Sets [`EngineConfig::eos_token_id`].
        eos_token_id: Option<u32> => eos_token_id;
        /// Sets [`EngineConfig::cost`] as a whole.
        cost: CostModel => cost;
        /// Sets [`CostModel::prefill_tokens_per_s`].
        prefill_tokens_per_s: f64 => cost.prefill_tokens_per_s;
        /// Sets [`CostModel::decode_base`].
        decode_base: Duration => cost.decode_base;
        /// Sets [`CostModel::decode_per_seq`].
        decode_per_seq: Duration => cost.decode_per_seq;
        /// Sets [`CostModel::decode_per_kv_token`].
        decode_per_kv_token: Duration => cost.decode_per_kv_token;
        /// Sets [`CostModel::compile_stall`].
        compile_stall: Duration => cost.compile_stall;
        /// Sets [`EngineConfig::time_scale`].
        time_scale: f64 => time_scale;
    }

    /// Validates and returns the configuration.
    pub fn build(self) -> Result<EngineConfig, ConfigError> {
        self.config.validate()?;
        Ok(self.config)
    }
}
