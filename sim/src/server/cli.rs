//! `vllm-sim`'s command line: vLLM's own flag names where vLLM has them (so a test harness or a
//! Helm chart can swap the simulator for vLLM without rewriting arguments), plus the simulator's
//! cost model, time scale and wire-generation choices. Parsed and validated into a [`SimConfig`]
//! before anything binds; `--kv-events-config` takes the same JSON vLLM takes.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use kvsight_tokenizer::Dialect;
use serde::Deserialize;

use super::{SimConfig, TokenizerFiles};
use crate::engine::{ConfigError, EngineConfig};
use crate::kv_events::{EndpointMode, PublisherConfig};

/// The flags of `vllm-sim`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "vllm-sim",
    about = "A vLLM 0.33 stand-in: OpenAI API, /metrics, KV events"
)]
pub struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// HTTP port (0 = any free port).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Model names served; the first names the metrics.
    #[arg(long, num_args = 1.., default_value = "vllm-sim")]
    pub served_model_name: Vec<String>,
    /// LoRA adapters as NAME=PATH, served as extra model cards.
    #[arg(long, num_args = 1..)]
    pub lora_modules: Vec<String>,
    /// Largest number of LoRA adapters in one batch (reported in `vllm:lora_requests_info`).
    #[arg(long, default_value_t = 1)]
    pub max_loras: usize,
    /// Context window in tokens.
    #[arg(long, default_value_t = 4096)]
    pub max_model_len: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks in the simulated GPU (one is vLLM's null block).
    #[arg(long)]
    pub num_gpu_blocks_override: Option<usize>,
    /// Most requests running at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one scheduler step (chunked prefill).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Prefix caching on (vLLM's default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Prefix caching off.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// vLLM's KV-events JSON, e.g. `{"enable_kv_cache_events":true,"publisher":"zmq"}`.
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// Streamed outputs carry this many tokens each (the first token alone), as vLLM's
    /// `--stream-interval`.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub stream_interval: u32,
    /// Report `usage.prompt_tokens_details.cached_tokens`.
    #[arg(long)]
    pub enable_prompt_tokens_details: bool,
    /// Simulator: a folder with `tokenizer.json` and `tokenizer_config.json`; `builtin` for the
    /// byte-level codec. Default: the project's own tokenizer (built once under target/).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Simulator: how the engine reads the tokenizer files — `transformers4` (vLLM < 0.32),
    /// `transformers5` (vLLM >= 0.32, files as they are: model_type phi3, mistral, …) or
    /// `transformers5-rebuilt` (vLLM >= 0.32 rebuilding a sentencepiece-style Llama tokenizer:
    /// model_type llama, or no config.json). Refused at start for tokenizers it does not apply to.
    #[arg(long, default_value = "transformers4")]
    pub tokenizer_dialect: Dialect,
    /// Simulator: write the tokenizer files this engine reads (`tokenizer.json`,
    /// `tokenizer_config.json`) into this folder and exit. The image build bakes the project's
    /// own tokenizer in this way, and the chart's init container hands it to the pod's sidecar.
    #[arg(long)]
    pub export_tokenizer: Option<PathBuf>,
    /// Simulator: prefill throughput, uncached prompt tokens per second.
    #[arg(long, default_value_t = 10_000.0)]
    pub prefill_tokens_per_s: f64,
    /// Simulator: fixed cost of one step, milliseconds.
    #[arg(long, default_value_t = 10.0)]
    pub decode_base_ms: f64,
    /// Simulator: extra step cost per scheduled request, microseconds.
    #[arg(long, default_value_t = 100.0)]
    pub decode_per_seq_us: f64,
    /// Simulator: extra step cost per KV token the step's requests attend to, nanoseconds.
    #[arg(long, default_value_t = 0.0)]
    pub decode_per_kv_token_ns: f64,
    /// Simulator: stall the first time a shape bucket is seen, milliseconds (0 = off).
    #[arg(long, default_value_t = 500.0)]
    pub compile_stall_ms: f64,
    /// Simulator: multiplier on every step's duration (0.01 = 100× faster).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Simulator: seed of the block-hash root and of generated tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Simulator: KV-event layout, `map` (vLLM ≥ 0.24) or `array` (≤ 0.23).
    #[arg(long, default_value = "map")]
    pub kv_events_format: String,
    /// Simulator: replay framing, `new` (vLLM ≥ 0.26) or `old`.
    #[arg(long, default_value = "new")]
    pub replay_layout: String,
}

/// vLLM's `KVEventsConfig` JSON.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct KvEventsConfig {
    /// Default false.
    pub enable_kv_cache_events: bool,
    /// `"zmq"` or `"null"`; default: `"zmq"` when events are enabled.
    pub publisher: Option<String>,
    /// Default `tcp://*:5557`.
    pub endpoint: String,
    /// Default none.
    pub replay_endpoint: Option<String>,
    /// Default 10 000.
    pub buffer_steps: usize,
    /// Default 100 000.
    pub hwm: usize,
    /// Default 100 000.
    pub max_queue_size: usize,
    /// Default `""`.
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: "tcp://*:5557".to_owned(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

/// A flag that cannot work, named.
#[derive(Debug, thiserror::Error)]
pub enum KvEventsConfigError {
    /// A flag's value is malformed.
    #[error("--{flag}: {reason}")]
    Flag {
        /// The flag, without dashes.
        flag: &'static str,
        /// Why.
        reason: String,
    },
    /// The engine refuses the combination.
    #[error(transparent)]
    Engine(#[from] ConfigError),
}

impl KvEventsConfig {
    /// Parses vLLM's JSON; `None` when events end up off (disabled or `"null"` publisher).
    pub fn parse(json: &str) -> Result<Option<PublisherConfig>, KvEventsConfigError> {
        let c: Self = serde_json::from_str(json).map_err(|e| KvEventsConfigError::Flag {
            flag: "kv-events-config",
            reason: e.to_string(),
        })?;
        let publisher = c.publisher.clone().unwrap_or_else(|| {
            if c.enable_kv_cache_events {
                "zmq".into()
            } else {
                "null".into()
            }
        });
        match publisher.as_str() {
            "null" => return Ok(None),
            "zmq" => {}
            other => {
                return Err(KvEventsConfigError::Flag {
                    flag: "kv-events-config",
                    reason: format!("publisher {other:?} is not \"zmq\" or \"null\""),
                });
            }
        }
        if !c.enable_kv_cache_events {
            return Ok(None);
        }
        Ok(Some(PublisherConfig {
            endpoint: c.endpoint,
            endpoint_mode: EndpointMode::Auto,
            replay_endpoint: c.replay_endpoint,
            topic: c.topic,
            buffer_steps: c.buffer_steps,
            queue_capacity: c.max_queue_size.max(1),
            ..PublisherConfig::default()
        }))
    }
}

fn ms(flag: &'static str, v: f64, scale: f64) -> Result<Duration, KvEventsConfigError> {
    Duration::try_from_secs_f64(v / scale).map_err(|e| KvEventsConfigError::Flag {
        flag,
        reason: e.to_string(),
    })
}

impl Args {
    /// Validates the flags into a pod configuration (reads `--tokenizer` files).
    pub fn into_config(self) -> Result<SimConfig, KvEventsConfigError> {
        let flag = |flag: &'static str, reason: String| KvEventsConfigError::Flag { flag, reason };
        let mut loras = Vec::new();
        for m in &self.lora_modules {
            let (name, path) = m
                .split_once('=')
                .ok_or_else(|| flag("lora-modules", format!("{m:?} is not NAME=PATH")))?;
            loras.push((name.to_owned(), path.to_owned()));
        }
        let num_gpu_blocks = self.num_gpu_blocks_override.unwrap_or_else(|| {
            // Enough for max_num_seqs full-length requests would be unrealistic; vLLM's profile
            // typically leaves room for a few dozen: take 64 full contexts (at least 4096 blocks).
            (64 * self.max_model_len.div_ceil(self.block_size.max(1))).max(4096) + 1
        });
        let engine = EngineConfig::builder()
            .block_size(self.block_size)
            .num_gpu_blocks(num_gpu_blocks)
            .max_num_seqs(self.max_num_seqs)
            .max_num_batched_tokens(self.max_num_batched_tokens)
            .max_model_len(self.max_model_len)
            .enable_prefix_caching(!self.no_enable_prefix_caching)
            .prefill_tokens_per_s(self.prefill_tokens_per_s)
            .decode_base(ms("decode-base-ms", self.decode_base_ms, 1e3)?)
            .decode_per_seq(ms("decode-per-seq-us", self.decode_per_seq_us, 1e6)?)
            .decode_per_kv_token(ms(
                "decode-per-kv-token-ns",
                self.decode_per_kv_token_ns,
                1e9,
            )?)
            .compile_stall(ms("compile-stall-ms", self.compile_stall_ms, 1e3)?)
            .time_scale(self.time_scale)
            .seed(self.seed)
            .build()?;
        let (layout, replay_layout) =
            super::parse_layouts(&self.kv_events_format, &self.replay_layout).ok_or_else(|| {
                flag(
                    "kv-events-format",
                    format!(
                        "{:?}/{:?}: use map|array and new|old",
                        self.kv_events_format, self.replay_layout
                    ),
                )
            })?;
        let kv_events = match &self.kv_events_config {
            Some(json) => KvEventsConfig::parse(json)?.map(|p| PublisherConfig {
                layout,
                replay_layout,
                ..p
            }),
            None => None,
        };
        let own;
        let dir = match &self.tokenizer {
            Some(dir) if dir.as_os_str() == "builtin" => None,
            Some(dir) => Some(dir),
            None => {
                own = crate::own_tokenizer::ensure_dir()
                    .map_err(|e| flag("tokenizer", format!("own tokenizer: {e}")))?;
                Some(&own)
            }
        };
        let tokenizer = match dir {
            Some(dir) => Some(
                TokenizerFiles::from_dir(dir)
                    .map_err(|e| flag("tokenizer", format!("{}: {e}", dir.display())))?,
            ),
            None => None,
        };
        if self.served_model_name.is_empty() {
            return Err(flag("served-model-name", "needs at least one name".into()));
        }
        Ok(SimConfig {
            engine,
            served_model_names: self.served_model_name,
            lora_modules: loras,
            max_loras: self.max_loras,
            http_addr: SocketAddr::new(self.host, self.port),
            kv_events,
            enable_prompt_tokens_details: self.enable_prompt_tokens_details,
            tokenizer,
            tokenizer_dialect: self.tokenizer_dialect,
            stream_interval: self.stream_interval as usize,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_events_json_like_vllm() {
        let p = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000",
                "replay_endpoint": "tcp://*:6001", "topic": "kv", "buffer_steps": 5, "hwm": 9}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(p.endpoint, "tcp://*:6000");
        assert_eq!(p.replay_endpoint.as_deref(), Some("tcp://*:6001"));
        assert_eq!(p.topic, "kv");
        assert_eq!(p.buffer_steps, 5);
        // Publisher defaults to zmq when enabled, and events stay off when not enabled.
        assert!(
            KvEventsConfig::parse(r#"{"enable_kv_cache_events": true}"#)
                .unwrap()
                .is_some()
        );
        assert!(
            KvEventsConfig::parse(r#"{"publisher": "zmq"}"#)
                .unwrap()
                .is_none()
        );
        assert!(
            KvEventsConfig::parse(r#"{"publisher": "kafka", "enable_kv_cache_events": true}"#)
                .is_err()
        );
    }

    #[test]
    fn flags_named_like_vllm() {
        let args = Args::try_parse_from([
            "vllm-sim",
            "--port",
            "0",
            "--served-model-name",
            "m1",
            "m2",
            "--lora-modules",
            "sql=/a",
            "chat=/b",
            "--no-enable-prefix-caching",
            "--max-num-seqs",
            "4",
            "--kv-events-config",
            r#"{"enable_kv_cache_events":true}"#,
            "--kv-events-format",
            "array",
        ])
        .unwrap();
        let c = args.into_config().unwrap();
        assert_eq!(c.served_model_names, ["m1", "m2"]);
        assert_eq!(c.lora_modules.len(), 2);
        assert!(!c.engine.enable_prefix_caching);
        assert_eq!(c.engine.max_num_seqs, 4);
        assert_eq!(c.kv_events.unwrap().layout, crate::kv_events::Layout::Array);
    }

    #[test]
    fn tokenizer_dialect_flag() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["vllm-sim", "--tokenizer", "builtin"];
            argv.extend_from_slice(extra);
            Args::try_parse_from(argv)
        };
        let c = parse(&[]).unwrap().into_config().unwrap();
        assert_eq!(c.tokenizer_dialect, Dialect::Transformers4);
        for (name, dialect) in [
            ("transformers5", Dialect::Transformers5),
            ("transformers5-rebuilt", Dialect::Transformers5Rebuilt),
            ("transformers5_rebuilt", Dialect::Transformers5Rebuilt),
        ] {
            let c = parse(&["--tokenizer-dialect", name])
                .unwrap()
                .into_config()
                .unwrap();
            assert_eq!(c.tokenizer_dialect, dialect, "{name}");
        }
        let err = parse(&["--tokenizer-dialect", "transformers6"]).unwrap_err();
        assert!(err.to_string().contains("transformers6"), "{err}");
    }
}
