//! The simulated pods' cost model: what a GPU running vLLM costs in time, so routing decisions
//! have the consequences they have in production.
//!
//! Calibrated to an 8B model (Llama-3.1-8B class, bf16) on one H100 80GB SXM:
//!
//! - **prefill** 15,928 tokens/s: llm-d's calibrated `peakPrefillThroughput` for that pairing;
//! - **decode step** = 6 ms + 30 µs per sequence + 40 ns per KV token the batch attends to. The
//!   fixed part is reading 16 GB of weights at ≈ 3.35 TB/s (4.8 ms) plus launch and sampling
//!   overhead; a token of KV is 128 KiB (32 layers × 8 KV heads × 128 dims × 2 (K, V) × 2 bytes),
//!   read once per step: 128 KiB / 3.35 TB/s ≈ 40 ns. A batch of 64 sequences of 2k tokens then
//!   steps in ≈ 13 ms, in line with published vLLM inter-token latencies for that pairing;
//! - **chunked prefill** shares `max_num_batched_tokens` = 8,192 per step with the decodes
//!   (vLLM V1's default for this class of GPU), `max_num_seqs` = 256;
//! - **KV blocks**: the real pairing has ≈ 26k blocks of 16 tokens. The bench shrinks prompts by
//!   [`CostModel::length_scale`] to fit a 2-core machine and shrinks the cache with them, then
//!   sizes it per workload so that a workload's shared prompts overflow one pod's cache but fit
//!   the cluster's (see `workload.rs`);
//! - **time** runs [`CostModel::time_scale`] times slower than real time, so that the routers,
//!   the pods and the clients, all on two cores, are not what limits the run.

use serde::Serialize;

/// Everything a pod is started with, besides its ports.
#[derive(Debug, Clone, Serialize)]
pub struct CostModel {
    /// The GPU and model this imitates.
    pub calibration: &'static str,
    pub prefill_tokens_per_s: f64,
    pub decode_base_ms: f64,
    pub decode_per_seq_us: f64,
    pub decode_per_kv_token_ns: f64,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    pub block_size: u32,
    pub max_model_len: u32,
    /// Wall-clock seconds per simulated second (2 = half speed).
    pub time_scale: f64,
    /// Prompt and output lengths relative to the published workloads they imitate.
    pub length_scale: f64,
    /// vLLM's `--stream-interval`: streamed chunks carry this many tokens after the first.
    pub stream_interval: u32,
    /// TTFT under which a request counts towards goodput, in simulated seconds (the published
    /// 2 s, scaled with the prompt lengths).
    pub ttft_slo_s: f64,
    /// KV blocks per pod when fixed on the command line (else sized per workload).
    pub kv_blocks: Option<u32>,
}

/// Engine parameters given on the command line, to reproduce another deployment's shape
/// instead of the H100 calibration (each optional).
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct EngineOverrides {
    #[arg(long)]
    pub prefill_tokens_per_s: Option<f64>,
    #[arg(long)]
    pub decode_base_ms: Option<f64>,
    #[arg(long)]
    pub decode_per_seq_us: Option<f64>,
    #[arg(long)]
    pub decode_per_kv_token_ns: Option<f64>,
    #[arg(long)]
    pub max_num_seqs: Option<u32>,
    #[arg(long)]
    pub max_num_batched_tokens: Option<u32>,
    /// KV blocks per pod (default: sized per workload).
    #[arg(long)]
    pub kv_blocks: Option<u32>,
    /// Prompt and output lengths relative to the published workloads (default 0.25).
    #[arg(long)]
    pub length_scale: Option<f64>,
}

impl CostModel {
    /// The H100 / 8B calibration at this machine's scale.
    pub fn h100_8b(time_scale: f64) -> CostModel {
        let length_scale = 0.25;
        CostModel {
            calibration: "Llama-3.1-8B bf16 on one H100 80GB SXM (llm-d's peakPrefillThroughput; decode from memory bandwidth)",
            prefill_tokens_per_s: 15_928.0,
            decode_base_ms: 6.0,
            decode_per_seq_us: 30.0,
            decode_per_kv_token_ns: 40.0,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            block_size: 16,
            max_model_len: 16_384,
            time_scale,
            length_scale,
            stream_interval: 8,
            ttft_slo_s: 2.0 * length_scale,
            kv_blocks: None,
        }
    }

    /// Applies the engine overrides given on the command line.
    pub fn with(mut self, o: &EngineOverrides) -> CostModel {
        let set = |v: &mut f64, o: Option<f64>| {
            if let Some(o) = o {
                *v = o;
            }
        };
        set(&mut self.prefill_tokens_per_s, o.prefill_tokens_per_s);
        set(&mut self.decode_base_ms, o.decode_base_ms);
        set(&mut self.decode_per_seq_us, o.decode_per_seq_us);
        set(&mut self.decode_per_kv_token_ns, o.decode_per_kv_token_ns);
        if let Some(l) = o.length_scale {
            self.length_scale = l;
            self.ttft_slo_s = 2.0 * l;
        }
        if let Some(n) = o.max_num_seqs {
            self.max_num_seqs = n;
        }
        if let Some(n) = o.max_num_batched_tokens {
            self.max_num_batched_tokens = n;
        }
        self.kv_blocks = o.kv_blocks;
        self
    }

    /// Scales a published length (tokens) to this bench's.
    pub fn tokens(&self, published: u32) -> u32 {
        ((f64::from(published) * self.length_scale).round() as u32).max(1)
    }

    /// The SLO in wall-clock seconds.
    pub fn ttft_slo_wall_s(&self) -> f64 {
        self.ttft_slo_s * self.time_scale
    }

    /// `vllm-sim`'s flags for a pod with `num_gpu_blocks` blocks (ports come separately).
    pub fn sim_flags(&self, num_gpu_blocks: u32) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        let mut flag = |k: &str, val: String| {
            v.push(format!("--{k}"));
            v.push(val);
        };
        flag(
            "prefill-tokens-per-s",
            self.prefill_tokens_per_s.to_string(),
        );
        flag("decode-base-ms", self.decode_base_ms.to_string());
        flag("decode-per-seq-us", self.decode_per_seq_us.to_string());
        flag(
            "decode-per-kv-token-ns",
            self.decode_per_kv_token_ns.to_string(),
        );
        flag("max-num-seqs", self.max_num_seqs.to_string());
        flag(
            "max-num-batched-tokens",
            self.max_num_batched_tokens.to_string(),
        );
        flag("block-size", self.block_size.to_string());
        // vLLM refuses a context window its cache cannot hold once.
        let fits = (num_gpu_blocks.saturating_sub(1)) * self.block_size;
        flag("max-model-len", self.max_model_len.min(fits).to_string());
        flag("num-gpu-blocks-override", num_gpu_blocks.to_string());
        flag("time-scale", self.time_scale.to_string());
        flag("stream-interval", self.stream_interval.to_string());
        v
    }
}
