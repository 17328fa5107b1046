//! kvsight-testbed: kvsight end to end. A loopback cluster harness (`vllm-sim` pods from
//! `kvsight-sim`, real sidecars and routers, mutual TLS), the demo and the scenario tests. It is
//! the only crate that depends on both the router and the sidecar; nothing here ships.

pub mod cluster;
pub mod demo;
