//! Project automation, run as `cargo xtask <command>`.
//!
//! `ci` is the one test command of the README and of `.ci/run`: it installs what it needs on a
//! fresh machine, then runs exactly what a developer runs before committing. Keeping CI and
//! developers on the same recipe is the point (linkerd2-proxy does the same with its justfile).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  ci      fmt check, clippy -D warnings, every test, and build (not run) the benches and fuzz targets
  bench   run the criterion benchmarks (extra arguments go to `cargo bench`)
  demo    the end-to-end demo (not delivered yet: see the README)
";

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let cmd = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    let root = workspace_root();
    std::env::set_current_dir(&root).context("entering the workspace root")?;
    match cmd.as_str() {
        "ci" => ci(&root),
        "bench" => bench(&rest),
        "demo" => {
            eprintln!(
                "cargo xtask demo is not delivered yet: it needs the simulator, sidecar and router \
                 (issues 3-6). Run `cargo xtask ci` for the tests that exist today."
            );
            std::process::exit(2);
        }
        "" | "help" | "-h" | "--help" => {
            print!("{USAGE}");
            Ok(())
        }
        other => {
            eprint!("unknown command `{other}`\n\n{USAGE}");
            std::process::exit(64);
        }
    }
}

fn workspace_root() -> PathBuf {
    // CARGO_MANIFEST_DIR is xtask/; its parent is the workspace root.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

fn ci(root: &Path) -> Result<()> {
    let started = Instant::now();
    ensure_components()?;
    let fuzz_manifest = root.join("protocol/fuzz/Cargo.toml");
    let fuzz_manifest = fuzz_manifest.to_str().context("non-UTF-8 path")?;

    step("cargo fmt --check", &["fmt", "--all", "--", "--check"])?;
    step(
        "cargo fmt --check (fuzz)",
        &["fmt", "--manifest-path", fuzz_manifest, "--", "--check"],
    )?;
    step(
        "cargo clippy",
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--locked",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    step("cargo test", &["test", "--workspace", "--locked"])?;
    step(
        "cargo bench --no-run",
        &["bench", "--workspace", "--locked", "--no-run"],
    )?;
    build_and_replay_fuzz(root, fuzz_manifest)?;
    println!(
        "xtask ci: all steps passed in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Builds the fuzz crate with the toolchain at hand and replays its committed seed corpus once.
///
/// Coverage-guided fuzzing (`cargo fuzz run`) needs a nightly compiler for its sanitizer flags;
/// CI machines have only stable, so CI proves that the targets build and that no seed input
/// crashes the decoder. A plain build of a libfuzzer-sys target still links libFuzzer's driver,
/// which runs a corpus with `-runs=0`.
fn build_and_replay_fuzz(root: &Path, fuzz_manifest: &str) -> Result<()> {
    step(
        "fuzz targets build",
        &["build", "--manifest-path", fuzz_manifest, "--locked"],
    )?;
    let target_dir = root.join("protocol/fuzz/target/debug");
    let corpus_root = root.join("protocol/fuzz/corpus");
    for entry in std::fs::read_dir(&corpus_root).context("reading the fuzz corpus folder")? {
        let entry = entry?;
        let name = entry.file_name();
        let bin = target_dir.join(&name);
        if !bin.exists() {
            bail!(
                "corpus folder {:?} has no fuzz target of that name",
                entry.path()
            );
        }
        let label = format!("fuzz corpus replay ({})", name.to_string_lossy());
        run(&label, Command::new(&bin).arg("-runs=0").arg(entry.path()))?;
    }
    Ok(())
}

fn bench(extra: &[String]) -> Result<()> {
    let mut args = vec!["bench", "--workspace", "--locked"];
    args.extend(extra.iter().map(String::as_str));
    step("cargo bench", &args)
}

/// A fresh machine may have a minimal toolchain profile; add what the recipe uses.
fn ensure_components() -> Result<()> {
    let have = |sub: &str| {
        Command::new(cargo())
            .args([sub, "--version"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    let mut missing = Vec::new();
    if !have("fmt") {
        missing.push("rustfmt");
    }
    if !have("clippy") {
        missing.push("clippy");
    }
    if !missing.is_empty() {
        run(
            "rustup component add",
            Command::new("rustup").arg("component").arg("add").args(&missing),
        )?;
    }
    Ok(())
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn step(label: &str, args: &[&str]) -> Result<()> {
    run(label, Command::new(cargo()).args(args))
}

fn run(label: &str, cmd: &mut Command) -> Result<()> {
    println!("==> {label}");
    let t = Instant::now();
    let status = cmd
        .status()
        .with_context(|| format!("starting `{label}`"))?;
    if !status.success() {
        bail!("`{label}` failed ({status})");
    }
    println!("<== {label}: ok in {:.1} s", t.elapsed().as_secs_f64());
    Ok(())
}
