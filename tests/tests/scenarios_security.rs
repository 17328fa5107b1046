//! Nothing joins the router's pool without a certificate from the configured CA: a
//! pod whose sidecar presents a certificate from another CA — a valid certificate, a working
//! engine, a sidecar that reports Ready — is never registered and never receives a request,
//! while its legitimate neighbour serves everything.

use std::time::Duration;

use kvsight_sim::engine::EngineConfig;
use kvsight_testbed::cluster::{
    Cluster, ClusterConfig, PodSpec, WAIT, eventually, own_tokenizer_or_skip,
};
use serde_json::json;

const MODEL: &str = "kvsight-demo";

fn engine() -> EngineConfig {
    EngineConfig::builder()
        .compile_stall(Duration::ZERO)
        .time_scale(0.01)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_without_a_ca_signed_certificate_never_receives_a_request() {
    if own_tokenizer_or_skip("a_pod_without_a_ca_signed_certificate_never_receives_a_request")
        .is_none()
    {
        return;
    }
    let legit = PodSpec::new("pod-0", MODEL, engine()).unwrap();
    let mut rogue = PodSpec::new("impostor", MODEL, engine()).unwrap();
    rogue.foreign_certificate = true;
    let cluster = Cluster::start(ClusterConfig::new(vec![legit, rogue]))
        .await
        .unwrap();
    cluster.wait_routable(&[0], WAIT).await.unwrap();
    // The impostor's sidecar is up and believes its pod is Ready; its handshakes fail.
    let impostor = &cluster.pods[1];
    let mut phase = impostor.sidecar().shared.watch_phase();
    tokio::time::timeout(
        WAIT,
        phase.wait_for(|p| *p == kvsight_protocol::messages::Phase::Ready),
    )
    .await
    .unwrap()
    .unwrap();
    let shared = impostor.sidecar().shared.clone();
    eventually(
        "the impostor's sidecar to record a refused handshake",
        WAIT,
        || {
            let failed = shared
                .routers()
                .iter()
                .any(|r| !r.connected && r.last_error.is_some());
            async move { failed }
        },
    )
    .await
    .unwrap();

    for n in 0..12 {
        let r = cluster
            .post(
                0,
                "/v1/completions",
                &json!({"model": MODEL, "prompt": format!("Request {n}: say hi."), "max_tokens": 2}),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.pod.as_deref(), Some("kvsight/pod-0"));
    }
    assert!(cluster.routers[0].pod_phase(&impostor.key()).is_none());
    let counters = cluster.all_counters().await.unwrap();
    assert_eq!(counters[0].requests, 12.0);
    assert_eq!(
        counters[1].requests, 0.0,
        "the impostor's engine saw no request"
    );
    let pods: serde_json::Value = serde_json::from_str(
        &kvsight_harness::http::get_text(
            &cluster.http,
            &format!("{}/debug/pods", cluster.routers[0].admin_url()),
        )
        .await,
    )
    .unwrap();
    assert_eq!(pods["pods"].as_array().unwrap().len(), 1, "{pods:#}");
    cluster.shutdown().await;
}
