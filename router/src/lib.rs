//! kvsight-router: the backend a gateway sends every OpenAI request to. It tokenizes the prompt,
//! matches the block-hash chain against every pod's Bloom filter, filters saturated pods, scores
//! the rest with configured weights and streams the answer back under one deadline.
//!
//! Status: not built yet (issue "kvsight-router"). This crate holds no behaviour so far; it
//! exists so the workspace shows the architecture and the protocol crate has its consumer.
