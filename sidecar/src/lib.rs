//! kvsight-sidecar: runs beside each vLLM pod, mirrors the engine's KV-cache events, scrapes its
//! metrics, warms the pod before it reports Ready and publishes limits, load and a Bloom filter of
//! resident blocks to every router replica over QUIC with mutual TLS.
//!
//! Status: not built yet (issue "kvsight-sidecar"). This crate holds no behaviour so far; it
//! exists so the workspace shows the architecture and the protocol crate has its consumer.
