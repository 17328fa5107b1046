//! Replaying a fuzz crate's committed corpora as an ordinary test.
//!
//! Every fuzz target's body is a library function (`<crate>/fuzz/src/<target>.rs`); the
//! cargo-fuzz binary only hands libFuzzer's inputs to it. `cargo test` replays each target's
//! committed corpus (seeds, kept crashing inputs `regression-*`, minimized campaign corpora)
//! through the same function, so the corpora are checked in the test build — no second build
//! with libFuzzer linked, and a crash names its file.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

/// One fuzz target: its name (its corpus is `corpus/<name>/`) and its body.
pub type Target = (&'static str, fn(&[u8]));

/// Replays every file of `<fuzz_dir>/corpus/<target>/` through its target, for all `targets`.
///
/// Fails when a corpus folder has no target of its name (a renamed target would silently stop
/// being replayed), when a target has no corpus or an empty one, and when any input panics — all
/// inputs still run, and the failure lists every one that panicked.
pub fn replay_corpora(fuzz_dir: &Path, targets: &[Target]) {
    let corpus_root = fuzz_dir.join("corpus");
    let mut folders: Vec<String> = std::fs::read_dir(&corpus_root)
        .unwrap_or_else(|e| panic!("reading {}: {e}", corpus_root.display()))
        .map(|entry| entry.expect("a corpus folder entry").file_name())
        .map(|name| name.to_string_lossy().into_owned())
        .collect();
    folders.sort();
    let mut names: Vec<String> = targets.iter().map(|(n, _)| (*n).to_owned()).collect();
    names.sort();
    assert_eq!(
        folders,
        names,
        "{}: one corpus folder per fuzz target, named after it",
        corpus_root.display()
    );

    let mut failed = Vec::new();
    for (name, run) in targets {
        let dir = corpus_root.join(name);
        let mut inputs: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .map(|entry| entry.expect("a corpus entry").path())
            .collect();
        inputs.sort();
        assert!(!inputs.is_empty(), "{}: empty corpus", dir.display());
        for input in &inputs {
            let data =
                std::fs::read(input).unwrap_or_else(|e| panic!("reading {}: {e}", input.display()));
            if catch_unwind(AssertUnwindSafe(|| run(&data))).is_err() {
                failed.push(input.display().to_string());
            }
        }
        println!("fuzz corpus {name}: {} inputs replayed", inputs.len());
    }
    assert!(
        failed.is_empty(),
        "fuzz inputs that panic (replay one with `cargo xtask fuzz` or this test): {failed:#?}"
    );
}
