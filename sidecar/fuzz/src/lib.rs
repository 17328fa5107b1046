//! The fuzz targets of kvsight-sidecar, as library functions: `fuzz_targets/` hands libFuzzer's
//! inputs to them (`cargo xtask fuzz`, with the `libfuzzer` feature), and `tests/corpus.rs`
//! replays the committed corpora through them in the ordinary test build.

pub mod kv_event_decode;
pub mod prometheus_parse;
