//! kvsight-bench: the programs that measure kvsight as a whole, each a module of its own.
//!
//! - [`compare`]: kvsight against the routers people run today on simulated GPU pods, through
//!   and past saturation, with one or several router replicas (`cargo xtask bench`);
//! - [`soak`]: a long run with crashes, joins, leaves and reloads (`cargo xtask soak`);
//! - [`real_vllm`]: kvsight in front of real vLLM engines on CPU (`cargo xtask real-vllm`);
//! - [`blind`]: the blind baseline routers (round robin, least request) the comparison starts.
//!
//! What they share: the pods and certificates ([`cluster`]), the cost model ([`cost`]), the
//! workloads ([`workload`]), the load generator ([`client`]), processes ([`procs`]), the
//! routers under test ([`routers`]), faults ([`faults`]), results ([`report`], [`charts`]).

pub mod blind;
pub mod charts;
pub mod client;
pub mod cluster;
pub mod compare;
pub mod cost;
pub mod faults;
pub mod fleet;
pub mod procs;
pub mod real_vllm;
pub mod report;
pub mod routers;
pub mod soak;
pub mod workload;

pub use compare::{Options, Outcome, run};
