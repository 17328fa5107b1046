//! A folder under the system temp dir, removed on drop.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// `<tmp>/kvsight-<prefix>-<pid>-<n>`, removed on drop. A killed test process never drops it,
/// so creating one first removes the folders of processes that no longer run.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> std::io::Result<TempDir> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        sweep_stale(&std::env::temp_dir(), prefix);
        let dir = std::env::temp_dir().join(format!(
            "kvsight-{prefix}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(TempDir(dir))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Removes `<tmp>/kvsight-<prefix>-<pid>-<n>` folders whose process is gone (Linux: `/proc`
/// says so; elsewhere nothing is removed).
fn sweep_stale(tmp: &Path, prefix: &str) {
    let proc_fs = Path::new("/proc/self");
    if !proc_fs.exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    let lead = format!("kvsight-{prefix}-");
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&lead))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, n)| n.parse::<u64>().is_ok().then_some(pid))
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_of_dead_processes_are_swept_and_live_ones_kept() {
        let tmp = std::env::temp_dir().join(format!("kvsight-sweep-test-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        // No process has pid 4_000_000_000 (Linux pids stop at 2^22).
        let dead = tmp.join("kvsight-cluster-4000000000-0");
        let live = tmp.join(format!("kvsight-cluster-{}-7", std::process::id()));
        let other = tmp.join("kvsight-cluster-notes");
        for d in [&dead, &live, &other] {
            std::fs::create_dir_all(d.join("sub")).unwrap();
        }
        sweep_stale(&tmp, "cluster");
        let linux = Path::new("/proc/self").exists();
        assert_eq!(dead.exists(), !linux);
        assert!(live.exists() && other.exists());
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn a_temp_dir_is_removed_on_drop() {
        let dir = TempDir::new("harness-test").unwrap();
        let path = dir.path().to_path_buf();
        assert!(path.is_dir());
        drop(dir);
        assert!(!path.exists());
    }
}
