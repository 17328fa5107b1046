//! kvsight-protocol: the one definition of what crosses the wire between sidecars and routers.
#[cfg(feature = "tokenizer")]
pub mod tokenizer;
