//! Every committed corpus input of this crate's fuzz targets, replayed; none may panic.

use std::path::Path;

#[test]
fn committed_corpora_replay_without_a_failure() {
    kvsight_harness::fuzz::replay_corpora(
        Path::new(env!("CARGO_MANIFEST_DIR")),
        &[
            (
                "kv_event_decode",
                kvsight_sidecar_fuzz::kv_event_decode::run,
            ),
            (
                "prometheus_parse",
                kvsight_sidecar_fuzz::prometheus_parse::run,
            ),
        ],
    );
}
