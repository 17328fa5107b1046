//! Child processes: every pod, sidecar and router runs as its own process, in its own process
//! group, with its output in a log file, and is killed with its group when dropped.
//!
//! A router's CPU time and memory are read from `/proc` over its whole process group (the Python
//! launchers of some peers start helper processes).

use std::net::{TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// A running child process (and its process group).
pub struct Proc {
    pub name: String,
    pub pid: u32,
    pub log: PathBuf,
    child: tokio::process::Child,
}

impl Proc {
    /// Starts `program args…` in a new process group, output appended to `logs/<name>.log`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, String)],
        logs: &Path,
    ) -> Result<Proc> {
        std::fs::create_dir_all(logs).context("creating the log folder")?;
        let log = logs.join(format!("{name}.log"));
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("opening {}", log.display()))?;
        let err = out.try_clone()?;
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .kill_on_drop(true)
            // Everything is on loopback: never through a proxy.
            .env("NO_PROXY", "*")
            .env("no_proxy", "*")
            .env_remove("http_proxy")
            .env_remove("https_proxy")
            .env_remove("HTTP_PROXY")
            .env_remove("HTTPS_PROXY");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.display()))?;
        let pid = child.id().context("the child has no pid")?;
        Ok(Proc {
            name: name.to_owned(),
            pid,
            log,
            child,
        })
    }

    /// Whether the process has exited (then the reason, with the log's tail).
    pub fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(format!(
                "{} exited ({status}); last log lines:\n{}",
                self.name,
                tail(&self.log, 15)
            )),
            _ => None,
        }
    }

    /// SIGTERM to the group, then SIGKILL after `grace`.
    pub async fn stop(mut self, grace: Duration) {
        self.terminate(grace).await;
    }

    /// SIGTERM to the group, SIGKILL after `grace`, and waits; the handle stays (for a restart).
    pub async fn terminate(&mut self, grace: Duration) {
        signal_group(self.pid, "TERM");
        if tokio::time::timeout(grace, self.child.wait())
            .await
            .is_err()
        {
            signal_group(self.pid, "KILL");
            let _ = self.child.wait().await;
        }
        // Helpers of the group that outlived the leader.
        signal_group(self.pid, "KILL");
    }

    /// SIGKILL to the group, as a crash or an OOM kill: no drain, no goodbye. Waits for the exit.
    pub async fn kill(&mut self) {
        signal_group(self.pid, "KILL");
        let _ = self.child.wait().await;
    }

    /// The leader's resident memory now (`VmRSS`), in bytes; `None` once it has exited.
    pub fn rss_bytes(&self) -> Option<u64> {
        status_kib(self.pid, "VmRSS:").map(|k| k * 1024)
    }

    /// The leader's open file descriptors now (entries of `/proc/PID/fd`).
    pub fn open_fds(&self) -> Option<usize> {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid))
            .ok()
            .map(|d| d.count())
    }

    /// CPU seconds (user + system) used by the whole process group so far.
    pub fn cpu_seconds(&self) -> f64 {
        group_pids(self.pid)
            .iter()
            .filter_map(|&p| proc_stat(p))
            .map(|s| s.cpu_ticks as f64 / TICKS_PER_S)
            .sum()
    }

    /// Resets the peak RSS of every process of the group (`/proc/PID/clear_refs` = 5).
    pub fn reset_peak_rss(&self) {
        for p in group_pids(self.pid) {
            let _ = std::fs::write(format!("/proc/{p}/clear_refs"), "5");
        }
    }

    /// Sum of the group's peak RSS since the last reset, in bytes.
    pub fn peak_rss_bytes(&self) -> u64 {
        group_pids(self.pid)
            .iter()
            .filter_map(|&p| status_kib(p, "VmHWM:"))
            .sum::<u64>()
            * 1024
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // kill_on_drop kills the leader only; helpers of the group must not outlive the bench.
        signal_group(self.pid, "KILL");
    }
}

/// `sysconf(_SC_CLK_TCK)` is 100 on every Linux this runs on.
const TICKS_PER_S: f64 = 100.0;

fn signal_group(pgid: u32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(format!("-{pgid}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

struct Stat {
    pgrp: u32,
    cpu_ticks: u64,
}

fn proc_stat(pid: u32) -> Option<Stat> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is parenthesised and may hold spaces: fields start after the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state(0) ppid(1) pgrp(2) … utime(11) stime(12).
    Some(Stat {
        pgrp: f.get(2)?.parse().ok()?,
        cpu_ticks: f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?,
    })
}

fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Every live process of the group led by `pgid`.
fn group_pids(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return vec![pgid];
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| proc_stat(p).is_some_and(|s| s.pgrp == pgid))
        .collect()
}

/// The last `n` lines of a log.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A loopback TCP port free now, for a child that binds it later — for vLLM up to a minute
/// later. Taken below the kernel's ephemeral range: a port the kernel hands to `bind(0)` is
/// free only until the next `bind(0)` anywhere on the machine, and a starting vLLM makes many
/// (ZMQ, torch), so a KV-event port from `bind(0)` can be taken by the other engine before its
/// own engine binds it ("Address already in use"). Ports are tried in turn from a
/// per-process offset, so two calls never return the same port.
pub fn free_tcp_port() -> Result<u16> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const BASE: u32 = 10_000;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let span = ephemeral_low.saturating_sub(BASE);
    if span >= 1_000 {
        let offset = std::process::id().wrapping_mul(7_919) % span;
        for _ in 0..span.min(5_000) {
            let port = BASE + (offset + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
            let port = u16::try_from(port).expect("below the ephemeral range");
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A loopback UDP port free now.
pub fn free_udp_port() -> Result<u16> {
    Ok(UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Polls `GET url` every 50 ms until it answers 2xx, the process exits, or `within` passes.
pub async fn wait_ok(
    http: &reqwest::Client,
    url: &str,
    procs: &mut [&mut Proc],
    within: Duration,
) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(r) = http.get(url).timeout(Duration::from_secs(2)).send().await
            && r.status().is_success()
        {
            return Ok(());
        }
        for p in procs.iter_mut() {
            if let Some(why) = p.exited() {
                bail!("waiting for {url}: {why}");
            }
        }
        if Instant::now() >= deadline {
            bail!("{url} did not answer 2xx within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
