//! kvsight-sidecar: runs beside each vLLM pod, mirrors the engine's KV-cache events, scrapes its
//! metrics, warms the pod before it reports Ready and publishes limits, load and a Bloom filter of
//! resident blocks to every router replica over QUIC with mutual TLS.
//!
//! Status (issue "kvsight-sidecar"): the sans-I/O core exists — [`kv_events::decode`] reads every
//! vLLM KV-event layout and [`mirror`] keeps the exact resident set and its filter. The ZMQ
//! subscriber, metrics scrape, warm-up, QUIC publisher and the binary are not built yet.

pub mod kv_events;
pub mod mirror;
pub mod scrape;
