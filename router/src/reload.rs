//! Config hot reload. Kubernetes updates a mounted ConfigMap by swapping a `..data` symlink in
//! the file's directory, so the directory is watched, not the file. A change is applied only
//! when the file's bytes changed and the new config validates; an invalid file is rejected,
//! logged and counted, and the running config stays.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{ConfigError, RouterConfig};
use crate::state::State;

/// Quiet time after the last file event before reading: editors and ConfigMap swaps write in
/// several steps, and reading mid-way would reject a half-written file.
pub const SETTLE: Duration = Duration::from_millis(100);

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
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("watching {path}: {source}")]
    Watch {
        path: PathBuf,
        #[source]
        source: notify::Error,
    },
}

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
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_owned();
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if ev.is_ok() {
            let _ = tx.send(());
        }
    })
    .map_err(|source| ReloadError::Watch {
        path: dir.clone(),
        source,
    })?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .map_err(|source| ReloadError::Watch {
            path: dir.clone(),
            source,
        })?;
    let mut last = std::fs::read(&path).ok();
    // Not on the state's tracker: that one is drained for in-flight streams only.
    tokio::spawn(async move {
        // The watcher lives as long as this task.
        let _watcher = watcher;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                ev = rx.recv() => if ev.is_none() { return },
            }
            // Wait for the writes to settle (bounded: each quiet period is SETTLE long).
            loop {
                match tokio::time::timeout(SETTLE, rx.recv()).await {
                    Ok(Some(())) => continue,
                    Ok(None) => return,
                    Err(_) => break,
                }
            }
            let state = state.clone();
            let path = path.clone();
            let mut l = last.take();
            let (outcome, l) = tokio::task::spawn_blocking(move || {
                let o = reload_once(&state, &path, &mut l);
                (o, l)
            })
            .await
            .unwrap_or((Outcome::Unchanged, None));
            last = l;
            tracing::debug!(?outcome, "config file event handled");
        }
    });
    Ok(())
}
