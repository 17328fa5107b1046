//! One deliberate breakage per assertion, applied to a baseline rendering
//! (`ci/<name>-values.yaml`): every assertion must catch its own.

use serde_json::Value;

use super::assertions::{component, kind, name_of};

pub(super) type Mutation = fn(&mut [Value]);

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

pub(super) const MUTATIONS: [(&str, &str, Mutation); 21] = [
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
