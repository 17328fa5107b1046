//! Assertions on the rendered objects: each returns the first violation it finds, and each is
//! proven able to fail by a mutation of its own ([`super::mutations`]).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::{CHART, NAMESPACE};

pub(super) type Check = fn(&[Value]) -> std::result::Result<(), String>;

pub(super) const ASSERTIONS: [(&str, Check); 18] = [
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

pub(super) fn run_assertions(docs: &[Value]) -> Vec<String> {
    ASSERTIONS
        .iter()
        .filter_map(|(name, check)| check(docs).err().map(|e| format!("{name}: {e}")))
        .collect()
}

pub(super) fn kind(d: &Value) -> &str {
    d["kind"].as_str().unwrap_or_default()
}

pub(super) fn name_of(d: &Value) -> &str {
    d["metadata"]["name"].as_str().unwrap_or_default()
}

fn of_kind<'a>(docs: &'a [Value], k: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    docs.iter().filter(move |d| kind(d) == k)
}

pub(super) fn component(d: &Value) -> &str {
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
