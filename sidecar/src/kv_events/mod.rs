//! vLLM's KV-cache event stream: decoding its payloads (every published layout) and subscribing
//! over ZMQ with gap detection and replay.

pub mod decode;
pub mod subscriber;
