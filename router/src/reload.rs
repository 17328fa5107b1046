//! Config hot reload. Kubernetes updates a mounted ConfigMap by swapping a `..data` symlink in
//! the file's directory, so the directory is watched, not the file. A change is applied only
//! when the file's bytes changed and the new config validates; an invalid file is rejected,
//! logged and counted, and the running config stays.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{ConfigError, RouterConfig};
use crate::state::State;

/// What a reload attempt did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The new config is live.
    Applied,
    /// The bytes did not change (a touch, or an event for another file in the directory).
    Unchanged,
    /// The file is invalid; the old config stays.
    Rejected(String),
}

/// Errors starting the watcher.
pub type ReloadError = kvsight_process::files::WatchError;

/// Reads `path` and applies it if it changed from `last` and validates.
pub fn reload_once(state: &State, path: &Path, last: &mut Option<Vec<u8>>) -> Outcome {
    let bytes = std::fs::read(path).ok();
    if bytes.is_some() && bytes == *last {
        return Outcome::Unchanged;
    }
    let outcome = match RouterConfig::load(path) {
        Ok(cfg) => {
            state.swap_config(cfg);
            state.metrics.reload("applied");
            info!(path = %path.display(), "config reloaded");
            Outcome::Applied
        }
        Err(e) => {
            state.metrics.reload("rejected");
            let msg = describe(&e);
            warn!(path = %path.display(), error = %msg, "config change rejected; keeping the running config");
            Outcome::Rejected(msg)
        }
    };
    *last = bytes;
    state.note_reload();
    outcome
}

fn describe(e: &ConfigError) -> String {
    e.to_string()
}

/// Watches the directory of `path` until `stop` is cancelled.
pub fn spawn_watcher(
    state: Arc<State>,
    path: PathBuf,
    stop: CancellationToken,
) -> Result<(), ReloadError> {
    let mut last = std::fs::read(&path).ok();
    let dir = kvsight_process::files::parent_dir(&path);
    let watch = kvsight_process::files::watch_dirs(&[dir], move || {
        let outcome = reload_once(&state, &path, &mut last);
        tracing::debug!(?outcome, "config file event handled");
    })?;
    // Not on the state's tracker: that one is drained for in-flight streams only.
    tokio::spawn(async move {
        stop.cancelled().await;
        drop(watch);
    });
    Ok(())
}
