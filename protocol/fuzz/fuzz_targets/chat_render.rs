//! The cargo-fuzz entry of [`kvsight_protocol_fuzz::chat_render`]:
//! the target and what it checks live there.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsight_protocol_fuzz::chat_render::run(data));
