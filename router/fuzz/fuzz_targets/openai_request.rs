//! The cargo-fuzz entry of [`kvsight_router_fuzz::openai_request`]:
//! the target and what it checks live there.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsight_router_fuzz::openai_request::run(data));
