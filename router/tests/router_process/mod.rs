//! The router binary as a process of its own, for the measurements that watch it from outside
//! (its memory, its `/health` latency): started with dev certificates on a free port, killed
//! on drop. `KVSIGHT_ROUTER_BIN` runs another build of the binary instead (one without
//! `--admin-listen`, for a before figure).
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) struct RouterProcess {
    child: Child,
    /// `http://127.0.0.1:<port>` of its OpenAI listener.
    pub(crate) base: String,
}

impl RouterProcess {
    /// Writes dev certificates into `dir` and starts the router with them and `extra` flags.
    pub(crate) fn start(dir: &Path, extra: &[&str]) -> RouterProcess {
        let ca = kvsight_transport::dev_certs::DevCa::new("ca").unwrap();
        ca.write_leaves(dir, &[("router", &["kvsight-router"])])
            .unwrap();
        let p = |f: &str| dir.join(f).display().to_string();
        let http = free_port();
        let other = std::env::var("KVSIGHT_ROUTER_BIN").ok();
        let mut cmd = Command::new(
            other
                .as_deref()
                .unwrap_or(env!("CARGO_BIN_EXE_kvsight-router")),
        );
        cmd.args([
            "--tls-cert",
            &p("router.pem"),
            "--tls-key",
            &p("router-key.pem"),
        ])
        .args(["--tls-ca", &p("ca.pem")])
        .args(extra)
        .args(["--listen", &format!("127.0.0.1:{http}")])
        .args(["--quic-listen", "127.0.0.1:0"])
        .env("RUST_LOG", "error")
        .stdout(Stdio::null());
        if other.is_none() {
            cmd.args(["--admin-listen", &format!("127.0.0.1:{}", free_port())]);
        }
        RouterProcess {
            child: cmd.spawn().unwrap(),
            base: format!("http://127.0.0.1:{http}"),
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until `/health` answers, failing the test after `within`.
    pub(crate) async fn wait_started(&self, client: &reqwest::Client, within: Duration) {
        let end = Instant::now() + within;
        while client
            .get(format!("{}/health", self.base))
            .send()
            .await
            .is_err()
        {
            assert!(Instant::now() < end, "the router did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
