//! The cargo-fuzz entry of [`kvsight_protocol_fuzz::frame_decode`], where the target and what it checks live.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsight_protocol_fuzz::frame_decode::run(data));
