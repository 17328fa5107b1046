//! The pin of a tokenizer the simulator trains: the sha256 of its `tokenizer.json`.

use sha2::{Digest, Sha256};

/// `tokenizer_json` hashes to `sha256` (lowercase hex); `bump` says what to do when it does not.
pub(crate) fn assert_pinned(tokenizer_json: &[u8], sha256: &str, bump: &str) {
    let got: String = Sha256::digest(tokenizer_json)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(got, sha256, "tokenizer.json changed: {bump}");
}
