//! The cargo-fuzz entry of [`kvsight_sidecar_fuzz::prometheus_parse`]:
//! the target and what it checks live there.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsight_sidecar_fuzz::prometheus_parse::run(data));
