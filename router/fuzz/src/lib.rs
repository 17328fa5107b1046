//! The fuzz targets of kvsight-router, as library functions: `fuzz_targets/` hands libFuzzer's
//! inputs to them (`cargo xtask fuzz`, with the `libfuzzer` feature), and `tests/corpus.rs`
//! replays the committed corpora through them in the ordinary test build.

pub mod openai_request;
