//! kvsight-harness: the helpers every kvsight test crate shares — a temporary folder removed on
//! drop ([`TempDir`]), the one way a test skips itself ([`skip`], [`or_skip`],
//! [`fixture_or_skip`]), where the `../shared` fixtures are ([`shared_fixture`]), protocol
//! messages with ordinary values ([`messages`]), a JSON POST that reads the router's decision
//! ([`http::post_json`]), the replay of the fuzz corpora ([`fuzz::replay_corpora`]) and the
//! check of the configuration reference against the programs ([`reference`]).
//!
//! Of kvsight it depends on the protocol only, on purpose: the tokenizer, the simulator, the
//! sidecar and the router all dev-depend on it, and a helper that pulled one of them in would
//! make a dev-dependency cycle (a router edit rebuilding the sidecar's tests, and so on).

pub mod fuzz;
pub mod http;
pub mod messages;
pub mod reference;
mod skip;
mod temp_dir;

pub use skip::{or_skip, skip};
pub use temp_dir::TempDir;

use std::path::{Path, PathBuf};

/// The workspace root (this crate is `tests/harness/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `../shared/<relative>` beside the workspace: the fixtures recorded from real vLLM,
/// transformers and Phi-3 that the conformance tests compare with. The repository does not hold
/// them; CI checks out `../shared` beside it.
pub fn shared_fixture(relative: &str) -> PathBuf {
    workspace_root().join("../shared").join(relative)
}

/// [`shared_fixture`]`(relative)` when it exists, else `None` after [`skip`]ping `test` (which
/// fails the test under `CI=true`).
#[track_caller]
pub fn fixture_or_skip(test: &str, relative: &str) -> Option<PathBuf> {
    let path = shared_fixture(relative);
    if path.exists() {
        Some(path)
    } else {
        skip(test, format_args!("fixture {} absent", path.display()));
        None
    }
}
