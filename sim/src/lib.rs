//! kvsight-sim: the vLLM simulator (`vllm-sim`), a deterministic model of vLLM v1's engine core
//! plus the interfaces real vLLM exposes (KV events, metrics, OpenAI HTTP), and the tokenizers it
//! serves (the project's own and a Llama-2-shaped one, trained here from a fixed seed). The engine
//! is sans-I/O so that every behaviour the sidecar and router depend on can be tested step by step
//! without a GPU. Like Dynamo's mocker, it depends on the wire protocol and the tokenizer only,
//! never on the router or the sidecar it stands in front of.

pub mod engine;
pub mod kv_events;
pub mod llama2_tokenizer;
pub mod own_tokenizer;
pub mod server;
