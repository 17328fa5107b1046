//! The vLLM stand-in: pieces that make the simulator look like a real vLLM pod from outside.

pub mod kv_events;
