//! Watching files that Kubernetes mounts. A ConfigMap or Secret volume is updated by writing a
//! new `..<timestamp>` folder and swapping the `..data` symlink, so the file's own inode never
//! changes and a watch on the file would miss it: the directory is watched instead. Editors and
//! non-atomic writers (cert then key) write in several steps, so a burst of events is handled
//! once the directory has been quiet for [`SETTLE`]. The router's config reload and both sides'
//! certificate reload use this one watcher.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};

/// Quiet time after the last file event before the change is handled.
pub const SETTLE: Duration = Duration::from_millis(100);

/// A running watch; dropping it stops the watcher and then its thread.
#[derive(Debug)]
pub struct DirWatch {
    _watcher: notify::RecommendedWatcher,
}

/// Why a watch could not start.
#[derive(Debug, thiserror::Error)]
#[error("watching {path}: {source}")]
pub struct WatchError {
    pub path: PathBuf,
    #[source]
    pub source: notify::Error,
}

/// The folder a file lives in (`.` for a bare file name): what gets watched.
pub fn parent_dir(file: &Path) -> PathBuf {
    file.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_owned()
}

/// Calls `on_change` on a thread of its own after each settled burst of events in any of
/// `dirs`, until the returned [`DirWatch`] is dropped. `on_change` decides whether anything it
/// cares about really changed (events also come for sibling files and for mere touches).
pub fn watch_dirs(
    dirs: &[PathBuf],
    mut on_change: impl FnMut() + Send + 'static,
) -> Result<DirWatch, WatchError> {
    let (tx, rx) = mpsc::channel::<()>();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if ev.is_ok() {
            let _ = tx.send(());
        }
    })
    .map_err(|source| WatchError {
        path: dirs.first().cloned().unwrap_or_default(),
        source,
    })?;
    let mut unique = dirs.to_vec();
    unique.sort();
    unique.dedup();
    for dir in &unique {
        watcher
            .watch(dir, RecursiveMode::NonRecursive)
            .map_err(|source| WatchError {
                path: dir.clone(),
                source,
            })?;
    }
    // The sender lives in the watcher's callback: dropping the watcher ends `recv` with an
    // error, and so this thread. A thread, not a task: `on_change` reads files and may parse
    // them, and it must not need a runtime.
    std::thread::Builder::new()
        .name("kvsight-watch".into())
        .spawn(move || {
            while rx.recv().is_ok() {
                // Each quiet period is SETTLE long, so a steady writer delays but cannot starve
                // the handling for longer than it keeps writing.
                loop {
                    match rx.recv_timeout(SETTLE) {
                        Ok(()) => continue,
                        Err(mpsc::RecvTimeoutError::Timeout) => break,
                        Err(mpsc::RecvTimeoutError::Disconnected) => return,
                    }
                }
                on_change();
            }
        })
        .map_err(|e| WatchError {
            path: unique.first().cloned().unwrap_or_default(),
            source: notify::Error::io(e),
        })?;
    Ok(DirWatch { _watcher: watcher })
}
