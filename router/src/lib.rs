//! kvsight-router: the backend a gateway sends every OpenAI request to. It tokenizes the prompt,
//! matches the block-hash chain against every pod's Bloom filter, filters saturated pods, scores
//! the rest with configured weights and streams the answer back under one deadline.
//!
//! Status (issue "kvsight-router"): the configuration file and the sans-I/O pod registry and
//! scheduler exist; the HTTP proxy, QUIC listener and binary are not built yet.

pub mod config;
pub mod pods;
pub mod scheduler;
