//! The cargo-fuzz entry of [`kvsight_protocol_fuzz::frame_decode`]:
//! the target and what it checks live there.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsight_protocol_fuzz::frame_decode::run(data));
