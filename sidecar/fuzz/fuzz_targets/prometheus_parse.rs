//! The cargo-fuzz entry of [`kvsight_sidecar_fuzz::prometheus_parse`], where the target and what it checks live.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsight_sidecar_fuzz::prometheus_parse::run(data));
