//! Every committed corpus input of this crate's fuzz targets, replayed; none may panic.

use std::path::Path;

#[test]
fn committed_corpora_replay_without_a_failure() {
    kvsight_harness::fuzz::replay_corpora(
        Path::new(env!("CARGO_MANIFEST_DIR")),
        &[
            ("frame_decode", kvsight_protocol_fuzz::frame_decode::run),
            ("chat_render", kvsight_protocol_fuzz::chat_render::run),
        ],
    );
}
