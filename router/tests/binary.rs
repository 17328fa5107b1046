//! The binary's contract with its operator: a wrong config file exits 64 and names the field.

use std::process::{Command, Output};

/// Runs the binary on loopback with `extra` flags and TLS files that do not exist; returns
/// once it has exited.
fn run_without_tls_files(extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvsight-router"))
        .args(extra)
        .args([
            "--tls-cert",
            "/nonexistent/c.pem",
            "--tls-key",
            "/nonexistent/k.pem",
        ])
        .args(["--tls-ca", "/nonexistent/ca.pem"])
        .args(["--listen", "127.0.0.1:0", "--quic-listen", "127.0.0.1:0"])
        .output()
        .unwrap()
}

#[test]
fn an_invalid_config_exits_64_naming_the_field() {
    let dir = std::env::temp_dir().join(format!("kvsight-router-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("router.yaml");
    std::fs::write(&cfg, "timeouts:\n  requestSeconds: -5\n").unwrap();
    let out = run_without_tls_files(&["--config", cfg.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("timeouts.requestSeconds"), "{stderr}");
}

#[test]
fn unreadable_tls_files_exit_64_before_binding() {
    let out = run_without_tls_files(&[]);
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tls-cert"));
}

/// `--check-config` is `nginx -t`: no TLS files, no ports; OK and 0, or the field and 64.
#[test]
fn check_config_validates_the_file_only() {
    let dir = std::env::temp_dir().join(format!("kvsight-router-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let check = |text: &str| {
        let cfg = dir.join("router.yaml");
        std::fs::write(&cfg, text).unwrap();
        Command::new(env!("CARGO_BIN_EXE_kvsight-router"))
            .args(["--check-config", "--config", cfg.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let good =
        check("pools:\n  - {name: a, models: [m], fallback: b}\n  - {name: b, models: [m]}\n");
    let bad_field = check("pools:\n  - {name: a, models: [m], fallback: c}\n");
    let unknown = check("scheduler: {weights: {prefx: 1}}\n");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(good.status.code(), Some(0), "{good:?}");
    assert!(String::from_utf8_lossy(&good.stdout).contains("OK"));
    assert_eq!(bad_field.status.code(), Some(64), "{bad_field:?}");
    assert!(String::from_utf8_lossy(&bad_field.stderr).contains("pools[0].fallback"));
    assert_eq!(unknown.status.code(), Some(64), "{unknown:?}");
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("prefx"));
}

#[test]
fn a_sidecar_name_that_is_not_a_dns_name_exits_64_naming_the_flag() {
    let dir = std::env::temp_dir().join(format!("kvsight-router-name-{}", std::process::id()));
    let ca = kvsight_transport::dev_certs::DevCa::new("ca").unwrap();
    ca.write_leaves(&dir, &[("router", &["kvsight-router"])])
        .unwrap();
    let p = |f: &str| dir.join(f).display().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_kvsight-router"))
        .args([
            "--tls-cert",
            &p("router.pem"),
            "--tls-key",
            &p("router-key.pem"),
        ])
        .args(["--tls-ca", &p("ca.pem"), "--sidecar-name", "not a name!"])
        .args(["--listen", "127.0.0.1:0", "--quic-listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--sidecar-name"));
}
