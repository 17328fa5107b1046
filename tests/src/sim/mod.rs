//! The vLLM simulator (`vllm-sim`): a deterministic model of vLLM v1's engine core plus the
//! interfaces real vLLM exposes (KV events, metrics, OpenAI HTTP). The engine is sans-I/O so that
//! every behaviour the sidecar and router depend on can be tested step by step without a GPU.

pub mod engine;
pub mod kv_events;
pub mod server;
