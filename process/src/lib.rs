//! kvsight-process: what every kvsight binary shares as a process, apart from the network.
//!
//! The router, the sidecar and the simulator end alike ([`exit`]), drain on the same signals
//! ([`signal`]), watch Kubernetes-mounted files the same way ([`files`]: config and certificate
//! reload) and read a model's tokenizer folder with one reader ([`tokenizer_dir`]). Kept apart
//! from `kvsight-transport` so that a binary without QUIC (the simulator) links no TLS stack.

pub mod exit;
pub mod files;
pub mod signal;
pub mod tokenizer_dir;
