//! The cargo-fuzz entry of [`kvsight_sidecar_fuzz::kv_event_decode`], where the target and what it checks live.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsight_sidecar_fuzz::kv_event_decode::run(data));
