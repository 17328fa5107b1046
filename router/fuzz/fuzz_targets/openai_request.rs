//! The cargo-fuzz entry of [`kvsight_router_fuzz::openai_request`], where the target and what it checks live.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsight_router_fuzz::openai_request::run(data));
