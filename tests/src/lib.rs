//! kvsight-testbed: a faithful vLLM stand-in (`vllm-sim`), a loopback cluster harness and the
//! end-to-end tests. Nothing here ships; it is how everything kvsight claims is proven without a
//! GPU.

pub mod cluster;
pub mod demo;
pub mod llama2_tokenizer;
pub mod messages;
pub mod own_tokenizer;
pub mod sim;
