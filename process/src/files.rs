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

/// How often files are compared when the kernel refuses another watch (inotify's per-user
/// instance limit is shared by every container running as the same uid on a node).
pub const POLL: Duration = Duration::from_secs(30);

/// A running watch; dropping it stops the watcher and then its thread.
#[derive(Debug)]
pub struct DirWatch {
    _watcher: Option<notify::RecommendedWatcher>,
    /// Held so that the thread's channel disconnects exactly when this is dropped, whether or
    /// not the kernel watch started.
    _wake: mpsc::Sender<()>,
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

fn start_watcher(
    dirs: &[PathBuf],
    tx: mpsc::Sender<()>,
) -> Result<notify::RecommendedWatcher, WatchError> {
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if ev.is_ok() {
            let _ = tx.send(());
        }
    })
    .map_err(|source| WatchError {
        path: dirs.first().cloned().unwrap_or_default(),
        source,
    })?;
    for dir in dirs {
        watcher
            .watch(dir, RecursiveMode::NonRecursive)
            .map_err(|source| WatchError {
                path: dir.clone(),
                source,
            })?;
    }
    Ok(watcher)
}

/// Calls `on_change` on a thread of its own once at start (a change between the caller's own
/// read and this watch is not missed) and then after each settled burst of events in any of
/// `dirs`, until the returned [`DirWatch`] is dropped. `on_change` decides whether anything it
/// cares about really changed (events also come for sibling files and for mere touches).
///
/// When the kernel refuses a watch (out of inotify instances or watches), the files are polled
/// every [`POLL`] instead: slower to notice, never a reason to stop the process.
pub fn watch_dirs(
    dirs: &[PathBuf],
    on_change: impl FnMut() + Send + 'static,
) -> Result<DirWatch, WatchError> {
    watch_dirs_polling_every(dirs, POLL, on_change)
}

fn watch_dirs_polling_every(
    dirs: &[PathBuf],
    poll: Duration,
    mut on_change: impl FnMut() + Send + 'static,
) -> Result<DirWatch, WatchError> {
    let mut unique = dirs.to_vec();
    unique.sort();
    unique.dedup();
    let (tx, rx) = mpsc::channel::<()>();
    let watcher = match start_watcher(&unique, tx.clone()) {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(error = %e, every = ?poll, "cannot watch; polling the files instead");
            None
        }
    };
    let polling = watcher.is_none();
    let mut handle = move || {
        // A panicking handler is a bug, but it must not end the watching silently.
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut on_change)).is_err() {
            tracing::error!("a file-change handler panicked; watching goes on");
        }
    };
    // A thread, not a task: `on_change` reads files and may parse them, and it must not need a
    // runtime. It ends when the `DirWatch` (holding the last senders) is dropped.
    std::thread::Builder::new()
        .name("kvsight-watch".into())
        .spawn(move || {
            handle();
            loop {
                let next = if polling {
                    rx.recv_timeout(poll)
                } else {
                    rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected)
                };
                match next {
                    Ok(()) => {}
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        handle();
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
                // Each quiet period is SETTLE long, so a steady writer delays but cannot starve
                // the handling for longer than it keeps writing.
                loop {
                    match rx.recv_timeout(SETTLE) {
                        Ok(()) => continue,
                        Err(mpsc::RecvTimeoutError::Timeout) => break,
                        Err(mpsc::RecvTimeoutError::Disconnected) => return,
                    }
                }
                handle();
            }
        })
        .map_err(|e| WatchError {
            path: unique.first().cloned().unwrap_or_default(),
            source: notify::Error::io(e),
        })?;
    Ok(DirWatch {
        _watcher: watcher,
        _wake: tx,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_secs(10);

    fn scratch(tag: &str) -> PathBuf {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        std::env::temp_dir().join(format!(
            "kvsight-watch-{tag}-{}-{nanos}",
            std::process::id()
        ))
    }

    #[test]
    fn handles_once_at_start_then_on_each_change_and_stops_when_dropped() {
        let dir = scratch("events");
        std::fs::create_dir_all(&dir).unwrap();
        let (tx, rx) = mpsc::channel();
        let watch = watch_dirs(std::slice::from_ref(&dir), move || tx.send(()).unwrap()).unwrap();
        rx.recv_timeout(LIMIT).expect("a call at start");
        std::fs::write(dir.join("f"), "1").unwrap();
        rx.recv_timeout(LIMIT)
            .expect("a call after the write settled");
        drop(watch);
        // The handler (holding the sender) goes with the thread: the channel disconnects.
        loop {
            match rx.recv_timeout(LIMIT) {
                Ok(()) => continue, // a late event from the write
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => panic!("the thread outlived its watch"),
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_directory_the_kernel_cannot_watch_is_polled_and_a_panicking_handler_is_survived() {
        // Watching a folder that does not exist fails, as running out of inotify instances does.
        let dir = scratch("missing");
        let (tx, rx) = mpsc::channel();
        let mut calls = 0;
        let watch = watch_dirs_polling_every(
            std::slice::from_ref(&dir),
            Duration::from_millis(20),
            move || {
                calls += 1;
                if calls == 1 {
                    panic!("the first look fails");
                }
                tx.send(calls).unwrap();
            },
        )
        .unwrap();
        assert!(watch._watcher.is_none(), "the watch was expected to fail");
        let second = rx
            .recv_timeout(LIMIT)
            .expect("polling goes on after a panic");
        assert_eq!(second, 2);
        assert_eq!(rx.recv_timeout(LIMIT), Ok(3), "and keeps polling");
    }
}
