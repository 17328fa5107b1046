//! The cargo-fuzz entry of [`kvsight_sidecar_fuzz::kv_event_decode`]:
//! the target and what it checks live there.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsight_sidecar_fuzz::kv_event_decode::run(data));
