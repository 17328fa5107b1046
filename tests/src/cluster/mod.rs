//! A loopback cluster: N vllm-sim pods, one kvsight sidecar beside each and R router replicas.
//!
//! Everything runs in this process, but the parts talk only over real sockets, as they would in a
//! Kubernetes namespace: vLLM's HTTP API and its ZMQ KV-event sockets between a pod and its
//! sidecar, QUIC with mutual TLS (certificates from a throw-away [`DevCa`]) between sidecars and
//! routers, HTTP between the routers and the pods. Each sidecar is configured from its command
//! line exactly as in a pod (URLs, endpoints, certificate files), so nothing here reaches into a
//! component to make it work. `cargo xtask demo` and the scenario tests build on this module.
//!
//! Ports are ephemeral loopback ports chosen by the kernel; a restarted component binds the
//! ports it had before, as a restarted container keeps its pod's IP and ports.

mod baseline;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvsight_harness::TempDir;
use kvsight_protocol::messages::Phase;
use kvsight_router::config::RouterConfig;
use kvsight_sidecar::config::Args as SidecarArgs;
use kvsight_sidecar::state::Shared as SidecarShared;
use kvsight_transport::dev_certs::DevCa;
use serde_json::Value;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use kvsight_sim::engine::EngineConfig;
use kvsight_sim::kv_events::PublisherConfig;
use kvsight_sim::server::{SimConfig, SimPod, SimPodHandle, TokenizerFiles};

pub use baseline::{BlindMode, BlindRouter, L4Balancer};
pub use kvsight_harness::http::{Routed, decision_of, post_json, send_json};
pub use kvsight_sidecar::counters::{PodCounters, parse_counters};

/// How long [`eventually`] and the cluster's waits give a condition by default.
pub const WAIT: Duration = Duration::from_secs(20);

/// The namespace every pod of the cluster is in (`--pod-namespace`).
pub const NAMESPACE: &str = "kvsight";

/// Why a cluster (or one of its parts) could not start.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("I/O in {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("certificates: {0}")]
    Certs(#[from] kvsight_transport::TransportError),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] kvsight_sim::own_tokenizer::OwnTokenizerError),
    #[error("pod {pod}: {message}")]
    Pod { pod: String, message: String },
    #[error("router {index}: {message}")]
    Router { index: usize, message: String },
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
    #[error("HTTP: {0}")]
    Http(#[from] reqwest::Error),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ClusterError {
    let what = what.into();
    move |source| ClusterError::Io { what, source }
}

/// The project's own tokenizer directory that every [`PodSpec`] serves, built on first use; or,
/// when it cannot be built or loaded, `None` after [`kvsight_harness::skip`] (which fails the
/// test under `CI=true`).
///
/// Scenario tests begin with it so a machine where the tokenizer cannot be trained (an
/// unwritable target directory, say) reports a visible skip instead of failing inside a
/// half-started cluster.
pub fn own_tokenizer_or_skip(test: &str) -> Option<PathBuf> {
    kvsight_harness::or_skip(test, kvsight_sim::own_tokenizer::ensure_dir())
}

/// Polls `cond` every 10 ms until it holds or `within` passes; for state that has no change
/// notification (another process's metrics, a registry behind a lock).
pub async fn eventually<F, Fut>(
    what: &str,
    within: Duration,
    mut cond: F,
) -> Result<(), ClusterError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if cond().await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(ClusterError::Timeout {
                what: what.to_owned(),
                after: within,
            });
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The sidecar's `--warmup`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Warmup {
    /// `none`: Ready as soon as the engine is up and subscribed.
    Skip,
    /// The sidecar's built-in plan, sized from the engine's `max_model_len`.
    Default,
    /// A plan file's JSON.
    Plan(String),
}

/// Binds the port a stopped component had. Its sockets close when its last task has been
/// dropped, which in one process can trail the stop by a few scheduler turns (a real restarted
/// container binds after the old process exited), so an address in use is retried, bounded.
async fn rebind<T>(
    what: &str,
    mut bind: impl FnMut() -> std::io::Result<T>,
) -> Result<T, ClusterError> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match bind() {
            Ok(s) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(io(format!("rebinding {what}"))(e)),
        }
    }
}

/// [`rebind`] for a TCP listener, handed over to tokio.
async fn rebind_tcp(what: &str, addr: SocketAddr) -> Result<tokio::net::TcpListener, ClusterError> {
    let listener = rebind(&format!("{what} {addr}"), || {
        std::net::TcpListener::bind(addr)
    })
    .await?;
    listener
        .set_nonblocking(true)
        .and_then(|()| tokio::net::TcpListener::from_std(listener))
        .map_err(io(format!("{what} listener")))
}

/// One pod to run: the simulator's configuration and what its sidecar is told.
#[derive(Debug, Clone)]
pub struct PodSpec {
    /// The pod's name (the sidecar's `--pod-name`); routers key it as `kvsight/<name>`.
    pub name: String,
    /// The simulator. Its tokenizer is set from `tokenizer_dir` by the cluster.
    pub sim: SimConfig,
    /// The folder with `tokenizer.json` and `tokenizer_config.json` the pod and its sidecar use
    /// (as vLLM's `--tokenizer` and the sidecar's `--tokenizer-dir`); `None`: the simulator's
    /// byte-level codec and no tokenizer offered to routers.
    pub tokenizer_dir: Option<PathBuf>,
    /// Pod labels routers select pools by.
    pub labels: Vec<(String, String)>,
    /// What the sidecar warms the pod with before it reports Ready.
    pub warmup: Warmup,
    /// Extra sidecar flags, appended last.
    pub sidecar_args: Vec<String>,
    /// The sidecar's certificate comes from another CA than the routers trust (an impostor).
    pub foreign_certificate: bool,
}

/// A simulated engine without compile stalls (the pods skip warm-up) on a scaled clock:
/// `blocks` KV blocks of `block_size` tokens, a `max_model_len` window, `seed` for its RNG.
pub fn fast_engine(
    block_size: usize,
    blocks: usize,
    max_model_len: usize,
    time_scale: f64,
    seed: u64,
) -> EngineConfig {
    EngineConfig::builder()
        .block_size(block_size)
        .num_gpu_blocks(blocks)
        .max_model_len(max_model_len)
        .compile_stall(Duration::ZERO)
        .time_scale(time_scale)
        .seed(seed)
        .build()
        .expect("a valid engine shape")
}

impl PodSpec {
    /// A pod serving `model` with KV events (and replay) on, the project's own tokenizer and
    /// `engine`.
    pub fn new(name: &str, model: &str, engine: EngineConfig) -> Result<PodSpec, ClusterError> {
        Ok(PodSpec {
            name: name.to_owned(),
            sim: SimConfig {
                engine,
                served_model_names: vec![model.to_owned()],
                kv_events: Some(PublisherConfig::loopback("")),
                enable_prompt_tokens_details: true,
                ..SimConfig::default()
            },
            tokenizer_dir: Some(kvsight_sim::own_tokenizer::ensure_dir()?),
            labels: Vec::new(),
            warmup: Warmup::Skip,
            sidecar_args: Vec::new(),
            foreign_certificate: false,
        })
    }

    /// Adds a pod label.
    pub fn label(mut self, key: &str, value: &str) -> PodSpec {
        self.labels.push((key.to_owned(), value.to_owned()));
        self
    }
}

/// What a cluster runs.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub pods: Vec<PodSpec>,
    /// Router replicas; every sidecar reports to all of them.
    pub routers: usize,
    /// The routers' config file (YAML), written to disk and watched, so tests and the demo can
    /// rewrite it while the cluster runs.
    pub router_yaml: String,
    /// Routers build tokenizers from the files sidecars send (exact prefix mode). `false` leaves
    /// them in approximate prefix mode: router-side memory of what it sent, not the real cache.
    pub router_tokenizers: bool,
    /// Sidecars' `--scrape-interval` (load reports) and `--publish-interval` (cache deltas).
    pub scrape_interval: Duration,
    pub publish_interval: Duration,
    /// Router drain grace on shutdown.
    pub router_grace: Duration,
}

impl ClusterConfig {
    /// `pods` with one router, the default scheduler, exact prefix mode and fast reports.
    pub fn new(pods: Vec<PodSpec>) -> ClusterConfig {
        ClusterConfig {
            pods,
            routers: 1,
            router_yaml: String::from("{}\n"),
            router_tokenizers: true,
            scrape_interval: Duration::from_millis(50),
            publish_interval: Duration::from_millis(10),
            router_grace: Duration::from_secs(5),
        }
    }
}

/// A running sidecar, on a thread and runtime of its own: a sidecar is a process of its own in a
/// pod, and a killed process's sockets all close at once and say nothing more — which, inside one
/// shared runtime, tasks the sidecar spawned (its publisher, the QUIC endpoint's driver) would
/// not do when the sidecar's own task ends.
pub struct SidecarHandle {
    /// Its health/metrics server.
    pub addr: SocketAddr,
    /// Phase, metrics and mirror, as the sidecar's own tests watch them.
    pub shared: Arc<SidecarShared>,
    stop: CancellationToken,
    /// Sending (or dropping) it drops the sidecar's runtime: every task and socket at once.
    kill: tokio::sync::oneshot::Sender<()>,
    /// Resolves when the runtime is gone: `Some` with `run`'s result after a stop, `None` after
    /// a kill.
    exited: tokio::sync::oneshot::Receiver<Option<Result<(), kvsight_sidecar::RunError>>>,
}

impl SidecarHandle {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn phase(&self) -> Phase {
        self.shared.phase()
    }

    /// SIGTERM: drain, say Goodbye, stop; bounded by `within`.
    pub async fn stop(self, within: Duration) -> Result<(), ClusterError> {
        let SidecarHandle {
            stop, kill, exited, ..
        } = self;
        stop.cancel();
        let stopped = tokio::time::timeout(within, exited).await;
        drop(kill);
        match stopped {
            Ok(_) => Ok(()),
            Err(_) => Err(ClusterError::Timeout {
                what: "the sidecar to stop".into(),
                after: within,
            }),
        }
    }

    /// The process vanishes (crash, OOM kill): no drain, no Goodbye, no QUIC close — its
    /// sockets are simply gone. Returns once they are.
    pub async fn kill(self) {
        let _ = self.kill.send(());
        let _ = self.exited.await;
    }
}

/// One pod: the simulator and its sidecar.
pub struct Pod {
    pub spec: PodSpec,
    /// `None` while the simulator is down (between a stop and a start).
    pub sim: Option<SimPodHandle>,
    pub sidecar: Option<SidecarHandle>,
    /// The simulator's configuration while it is down after [`Cluster::kill_sim`].
    killed_sim: Option<SimConfig>,
    /// The simulator's addresses, kept across restarts.
    http_addr: SocketAddr,
    kv_endpoint: Option<String>,
    replay_endpoint: Option<String>,
}

impl Pod {
    /// The key routers know this pod by.
    pub fn key(&self) -> String {
        format!("{NAMESPACE}/{}", self.spec.name)
    }

    /// vLLM's HTTP address.
    pub fn vllm_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// vLLM's base URL.
    pub fn vllm_url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    pub fn sim(&self) -> &SimPodHandle {
        self.sim.as_ref().expect("the simulator is running")
    }

    pub fn sidecar(&self) -> &SidecarHandle {
        self.sidecar.as_ref().expect("the sidecar is running")
    }
}

/// A running router replica.
pub struct RouterHandle {
    pub index: usize,
    pub http_addr: SocketAddr,
    /// The admin listener: `/metrics`, `/debug/pods` (never on the API's address).
    pub admin_addr: SocketAddr,
    pub quic_addr: SocketAddr,
    /// Its state, to look inside (registry, metrics).
    pub state: Arc<kvsight_router::State>,
    stop: CancellationToken,
    task: JoinHandle<Result<(), kvsight_router::RunError>>,
}

impl RouterHandle {
    pub fn url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    /// The admin listener's base URL (`/metrics`, `/debug/pods`).
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.admin_addr)
    }

    /// The phase this router holds for `pod_key`, or `None` when the pod is not registered.
    pub fn pod_phase(&self, pod_key: &str) -> Option<Phase> {
        self.state.registry().get(pod_key).map(|p| p.phase())
    }

    /// The pod is Ready, fresh and has sent its cache snapshot: it can be picked on real state.
    pub fn routable(&self, pod_key: &str) -> bool {
        let now = Instant::now();
        self.state
            .registry()
            .get(pod_key)
            .is_some_and(|p| p.phase() == Phase::Ready && !p.is_stale(now) && p.filter.is_some())
    }
}

/// The whole cluster. Dropping it stops every part (without draining).
pub struct Cluster {
    pub pods: Vec<Pod>,
    pub routers: Vec<RouterHandle>,
    /// An HTTP client without proxies, pooled (one keep-alive connection is reused).
    pub http: reqwest::Client,
    config: ClusterConfig,
    ca: DevCa,
    dir: TempDir,
}

impl Cluster {
    /// Starts the routers first (so sidecars find them at once), then each pod and its sidecar.
    /// Returns without waiting for Ready; see [`Cluster::wait_routable`].
    pub async fn start(config: ClusterConfig) -> Result<Cluster, ClusterError> {
        let dir = TempDir::new("cluster").map_err(io("creating the cluster's folder"))?;
        let ca = DevCa::new("kvsight-cluster-ca")?;
        std::fs::write(dir.path().join("ca.pem"), ca.ca_pem()).map_err(io("writing ca.pem"))?;
        let config_path = dir.path().join("router.yaml");
        std::fs::write(&config_path, &config.router_yaml).map_err(io("writing router.yaml"))?;
        let mut cluster = Cluster {
            pods: Vec::new(),
            routers: Vec::new(),
            http: reqwest::Client::builder().no_proxy().build()?,
            config: config.clone(),
            ca,
            dir,
        };
        for index in 0..config.routers {
            let http = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(io("binding a router's HTTP port"))?;
            let quic = std::net::UdpSocket::bind("127.0.0.1:0")
                .map_err(io("binding a router's QUIC port"))?;
            let router = cluster.start_router(index, http, quic)?;
            cluster.routers.push(router);
        }
        for spec in config.pods {
            cluster.add_pod(spec).await?;
        }
        Ok(cluster)
    }

    /// The routers' config file.
    pub fn router_config_path(&self) -> PathBuf {
        self.dir.path().join("router.yaml")
    }

    /// Rewrites the routers' config file (atomically, by rename, as a ConfigMap update does) and
    /// waits until every router applied it.
    pub async fn reload_router_config(&mut self, yaml: &str) -> Result<(), ClusterError> {
        let want = RouterConfig::from_yaml(yaml).map_err(|e| ClusterError::Router {
            index: 0,
            message: format!("the new config is invalid: {e}"),
        })?;
        let tmp = self.dir.path().join(".router.yaml.tmp");
        std::fs::write(&tmp, yaml).map_err(io("writing router.yaml"))?;
        std::fs::rename(&tmp, self.router_config_path()).map_err(io("renaming router.yaml"))?;
        self.config.router_yaml = yaml.to_owned();
        for r in &self.routers {
            let state = Arc::clone(&r.state);
            eventually(
                &format!("router {} to apply the new config", r.index),
                WAIT,
                || {
                    let applied = state.live().config == want;
                    async move { applied }
                },
            )
            .await?;
        }
        Ok(())
    }

    fn start_router(
        &self,
        index: usize,
        http: tokio::net::TcpListener,
        quic: std::net::UdpSocket,
    ) -> Result<RouterHandle, ClusterError> {
        let err = |message: String| ClusterError::Router { index, message };
        let http_addr = http.local_addr().map_err(io("router HTTP address"))?;
        let quic_addr = quic.local_addr().map_err(io("router QUIC address"))?;
        let admin = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .and_then(tokio::net::TcpListener::from_std)
            .map_err(io("binding a router's admin port"))?;
        let admin_addr = admin.local_addr().map_err(io("router admin address"))?;
        let path = self.router_config_path();
        let config = RouterConfig::load(&path).map_err(|e| err(e.to_string()))?;
        let run = kvsight_router::RunConfig {
            config,
            config_path: Some(path),
            tls: self
                .ca
                .material(&format!("router-{index}"), &["127.0.0.1", "localhost"])?,
            tls_files: None,
            router_id: format!("router-{index}"),
            ready_delay: Duration::ZERO,
            grace: self.config.router_grace,
            tokenizer_loader: self
                .config
                .router_tokenizers
                .then(kvsight_router::tokenize::default_loader),
            // The scenarios read each decision from the response.
            decision_header: true,
        };
        let stop = CancellationToken::new();
        let state = kvsight_router::build_state(&run, &stop).map_err(|e| err(e.to_string()))?;
        let listeners = kvsight_router::Listeners {
            http,
            quic,
            admin: Some(admin),
        };
        let task = tokio::spawn(kvsight_router::serve(
            listeners,
            run,
            Arc::clone(&state),
            stop.clone(),
        ));
        Ok(RouterHandle {
            index,
            http_addr,
            admin_addr,
            quic_addr,
            state,
            stop,
            task,
        })
    }

    /// Stops router `index` (graceful) and starts a fresh one on the same ports: its view must be
    /// rebuilt from what the sidecars send on reconnecting.
    pub async fn restart_router(&mut self, index: usize) -> Result<(), ClusterError> {
        let old = self.routers.remove(index);
        let (http_addr, quic_addr) = (old.http_addr, old.quic_addr);
        old.stop.cancel();
        let within = self.config.router_grace + Duration::from_secs(5);
        if tokio::time::timeout(within, old.task).await.is_err() {
            return Err(ClusterError::Timeout {
                what: format!("router {index} to stop"),
                after: within,
            });
        }
        let http = rebind_tcp("router HTTP", http_addr).await?;
        let quic = rebind(&format!("router QUIC {quic_addr}"), || {
            std::net::UdpSocket::bind(quic_addr)
        })
        .await?;
        let router = self.start_router(index, http, quic)?;
        self.routers.insert(index, router);
        Ok(())
    }

    /// Starts one more pod and its sidecar (reporting to every router); returns its index.
    pub async fn add_pod(&mut self, spec: PodSpec) -> Result<usize, ClusterError> {
        let mut sim_config = spec.sim.clone();
        if let Some(dir) = &spec.tokenizer_dir {
            sim_config.tokenizer = Some(
                TokenizerFiles::from_dir(dir)
                    .map_err(io(format!("reading the tokenizer in {}", dir.display())))?,
            );
        }
        let sim = SimPod::start(sim_config)
            .await
            .map_err(|e| ClusterError::Pod {
                pod: spec.name.clone(),
                message: e.to_string(),
            })?;
        let mut pod = Pod {
            http_addr: sim.http_addr(),
            kv_endpoint: sim.kv_endpoint().map(str::to_owned),
            replay_endpoint: sim.replay_endpoint().map(str::to_owned),
            sim: Some(sim),
            sidecar: None,
            killed_sim: None,
            spec,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(io("binding a sidecar's port"))?;
        pod.sidecar = Some(self.start_sidecar(&pod, listener)?);
        self.pods.push(pod);
        Ok(self.pods.len() - 1)
    }

    fn sidecar_args(&self, pod: &Pod) -> Result<Vec<String>, ClusterError> {
        let name = &pod.spec.name;
        let certs = self.dir.path().join("pods");
        if !certs.join(format!("{name}.pem")).exists() {
            if pod.spec.foreign_certificate {
                // A valid certificate, from a CA the routers do not trust; the impostor does
                // trust the real CA (so it can verify the routers), which is all it could do.
                let foreign = DevCa::new("not-the-cluster-ca")?;
                let leaf = foreign.issue(name, &[name.as_str()])?;
                std::fs::create_dir_all(&certs).map_err(io("creating the pod cert folder"))?;
                std::fs::write(certs.join(format!("{name}.pem")), leaf.cert)
                    .map_err(io("writing a certificate"))?;
                std::fs::write(certs.join(format!("{name}-key.pem")), leaf.key)
                    .map_err(io("writing a key"))?;
            } else {
                // The URI SAN grants the pod its name (routers check it).
                let grant = kvsight_transport::pod_uri(NAMESPACE, name);
                self.ca
                    .write_leaves(&certs, &[(name, &[name.as_str(), grant.as_str()])])?;
            }
        }
        let file = |f: String| certs.join(f).display().to_string();
        let mut args: Vec<String> = vec![
            "kvsight-sidecar".into(),
            "--pod-name".into(),
            name.clone(),
            "--pod-namespace".into(),
            NAMESPACE.into(),
            "--vllm-url".into(),
            pod.vllm_url(),
            "--advertise-url".into(),
            pod.vllm_url(),
            "--scrape-interval".into(),
            format!("{}ms", self.config.scrape_interval.as_millis()),
            "--publish-interval".into(),
            format!("{}ms", self.config.publish_interval.as_millis()),
            "--max-num-seqs".into(),
            pod.spec.sim.engine.max_num_seqs.to_string(),
            "--max-num-batched-tokens".into(),
            pod.spec.sim.engine.max_num_batched_tokens.to_string(),
            "--drain-grace".into(),
            "5s".into(),
            "--tls-cert".into(),
            file(format!("{name}.pem")),
            "--tls-key".into(),
            file(format!("{name}-key.pem")),
            "--tls-ca".into(),
            self.dir.path().join("ca.pem").display().to_string(),
        ];
        if let Some(kv) = &pod.kv_endpoint {
            args.extend(["--kv-events-endpoint".into(), kv.clone()]);
        }
        if let Some(replay) = &pod.replay_endpoint {
            args.extend(["--kv-events-replay-endpoint".into(), replay.clone()]);
        }
        for r in &self.routers {
            args.extend(["--router".into(), r.quic_addr.to_string()]);
        }
        for (k, v) in &pod.spec.labels {
            args.extend(["--pod-label".into(), format!("{k}={v}")]);
        }
        if let Some(dir) = &pod.spec.tokenizer_dir {
            args.extend(["--tokenizer-dir".into(), dir.display().to_string()]);
        }
        match &pod.spec.warmup {
            Warmup::Skip => args.extend(["--warmup".into(), "none".into()]),
            Warmup::Default => {}
            Warmup::Plan(plan) => {
                let path = self.dir.path().join(format!("warmup-{name}.json"));
                std::fs::write(&path, plan).map_err(io("writing a warm-up plan"))?;
                args.extend(["--warmup".into(), path.display().to_string()]);
            }
        }
        args.extend(pod.spec.sidecar_args.iter().cloned());
        Ok(args)
    }

    fn start_sidecar(
        &self,
        pod: &Pod,
        listener: tokio::net::TcpListener,
    ) -> Result<SidecarHandle, ClusterError> {
        let args = self.sidecar_args(pod)?;
        let err = |message: String| ClusterError::Pod {
            pod: pod.spec.name.clone(),
            message,
        };
        let parsed = <SidecarArgs as clap::Parser>::try_parse_from(&args)
            .map_err(|e| err(format!("sidecar flags: {e}")))?;
        // No environment: the cluster must not depend on the caller's `KVSIGHT_*` or `POD_IP`.
        let config = parsed
            .validate(|_| None)
            .map_err(|e| err(format!("sidecar config: {e}")))?;
        let addr = listener.local_addr().map_err(io("sidecar address"))?;
        // Registered again inside the sidecar's own runtime.
        let listener = listener.into_std().map_err(io("sidecar listener"))?;
        let shared = Arc::new(SidecarShared::default());
        let stop = CancellationToken::new();
        let (kill, killed) = tokio::sync::oneshot::channel::<()>();
        let (exited_tx, exited) = tokio::sync::oneshot::channel();
        let (run_shared, run_stop) = (Arc::clone(&shared), stop.clone());
        std::thread::Builder::new()
            .name(format!("sidecar-{}", pod.spec.name))
            .spawn(move || {
                let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                let result = runtime.block_on(async move {
                    let http = tokio::net::TcpListener::from_std(listener).ok()?;
                    tokio::select! {
                        r = kvsight_sidecar::run_with(
                            kvsight_sidecar::Listeners { http, debug: None },
                            config,
                            run_stop,
                            run_shared,
                        ) => Some(r),
                        // Killed, or the handle dropped with the cluster.
                        _ = killed => None,
                    }
                });
                // Every task still in the runtime — publisher, QUIC driver, scrapers — goes here,
                // and with it every socket, before `exited` says so.
                runtime.shutdown_background();
                let _ = exited_tx.send(result);
            })
            .map_err(io("starting a sidecar thread"))?;
        Ok(SidecarHandle {
            addr,
            shared,
            stop,
            kill,
            exited,
        })
    }

    /// Stops pod `i`'s sidecar (drain + Goodbye) and starts a new one on the same port.
    pub async fn restart_sidecar(&mut self, i: usize) -> Result<(), ClusterError> {
        let old = self.pods[i].sidecar.take().expect("the sidecar is running");
        let addr = old.addr;
        old.stop(Duration::from_secs(15)).await?;
        self.start_killed_sidecar(i, addr).await
    }

    /// Restarts pod `i`'s simulator as a vLLM container restart looks: the process is gone (its
    /// sockets close, its cache is lost), then a new one with a new KV-event sequence starts on
    /// the same ports. The sidecar keeps running and must notice.
    pub async fn restart_sim(&mut self, i: usize) -> Result<(), ClusterError> {
        let pod = &mut self.pods[i];
        let old = pod.sim.take().expect("the simulator is running");
        let sim = old
            .restart(Duration::from_secs(5))
            .await
            .map_err(|e| ClusterError::Pod {
                pod: pod.spec.name.clone(),
                message: format!("restarting the simulator: {e}"),
            })?;
        pod.sim = Some(sim);
        Ok(())
    }

    /// Pod `i`'s engine process dies: every socket it had closes at once (its streams are cut,
    /// new connections refused) and it stays down until [`Cluster::start_killed_sim`]. The
    /// sidecar keeps running and must notice.
    pub async fn kill_sim(&mut self, i: usize) {
        let pod = &mut self.pods[i];
        let sim = pod.sim.take().expect("the simulator is running");
        pod.killed_sim = Some(sim.restart_config().clone());
        sim.shutdown(Duration::ZERO).await;
    }

    /// Starts pod `i`'s killed engine again as its container restart would: the same ports, an
    /// empty cache, cold (its compile stalls ahead of it), KV-event seqs from 0.
    pub async fn start_killed_sim(&mut self, i: usize) -> Result<(), ClusterError> {
        let pod = &mut self.pods[i];
        let config = pod.killed_sim.take().expect("the simulator was killed");
        let deadline = Instant::now() + Duration::from_secs(5);
        // As in `rebind`: a port can trail the old runtime's end by a few scheduler turns.
        let sim = loop {
            match SimPod::start(config.clone()).await {
                Ok(sim) => break sim,
                Err(kvsight_sim::server::StartError::Bind { .. }) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => {
                    return Err(ClusterError::Pod {
                        pod: pod.spec.name.clone(),
                        message: format!("starting the killed simulator: {e}"),
                    });
                }
            }
        };
        pod.sim = Some(sim);
        Ok(())
    }

    /// Pod `i`'s sidecar process is killed (no drain, no Goodbye) and stays down.
    pub async fn kill_sidecar(&mut self, i: usize) {
        let sidecar = self.pods[i].sidecar.take().expect("the sidecar is running");
        sidecar.kill().await;
    }

    /// Starts pod `i`'s sidecar again on the port it had, `addr` (after
    /// [`Cluster::kill_sidecar`] or a stop).
    pub async fn start_killed_sidecar(
        &mut self,
        i: usize,
        addr: SocketAddr,
    ) -> Result<(), ClusterError> {
        let listener = rebind_tcp("sidecar", addr).await?;
        let sidecar = self.start_sidecar(&self.pods[i], listener)?;
        self.pods[i].sidecar = Some(sidecar);
        Ok(())
    }

    /// Waits until every router holds every listed pod Ready, fresh and with its cache snapshot.
    pub async fn wait_routable(
        &self,
        pods: &[usize],
        within: Duration,
    ) -> Result<(), ClusterError> {
        for r in &self.routers {
            for &i in pods {
                let key = self.pods[i].key();
                eventually(
                    &format!("router {} to see {key} Ready", r.index),
                    within,
                    || {
                        let ok = r.routable(&key);
                        async move { ok }
                    },
                )
                .await?;
            }
        }
        Ok(())
    }

    /// [`Cluster::wait_routable`] for every pod.
    pub async fn wait_all_routable(&self, within: Duration) -> Result<(), ClusterError> {
        let all: Vec<usize> = (0..self.pods.len()).collect();
        self.wait_routable(&all, within).await
    }

    /// Waits until every router built `model`'s tokenizer from a sidecar's files and an engine's
    /// `/tokenize` agreed with it, so text prompts are routed in exact prefix mode, as in
    /// production (until then a router is approximate).
    pub async fn wait_tokenizer(&self, model: &str, within: Duration) -> Result<(), ClusterError> {
        for r in &self.routers {
            let state = Arc::clone(&r.state);
            eventually(
                &format!(
                    "router {} to load and check the tokenizer of {model}",
                    r.index
                ),
                within,
                || {
                    let agrees = matches!(
                        state.tokenizers.verdict(model),
                        Some(kvsight_router::tokenize::Verdict::Agrees(_))
                    );
                    async move { agrees }
                },
            )
            .await?;
        }
        Ok(())
    }

    /// Waits until the engines together finished `n` more requests than in `before` (read with
    /// [`Cluster::all_counters`]), then returns each pod's delta. An engine counts a request as
    /// its answer ends, so a client that has its answer may read the counter a moment early.
    pub async fn counters_after(
        &self,
        before: &[PodCounters],
        n: f64,
        within: Duration,
    ) -> Result<Vec<PodCounters>, ClusterError> {
        let out = std::sync::Mutex::new(Vec::new());
        eventually("the engines to count every request", within, || async {
            let Ok(after) = self.all_counters().await else {
                return false;
            };
            let d: Vec<PodCounters> = after.iter().zip(before).map(|(a, b)| a.since(b)).collect();
            let done = d.iter().map(|d| d.requests).sum::<f64>() >= n;
            *out.lock().unwrap_or_else(|e| e.into_inner()) = d;
            done
        })
        .await?;
        Ok(out.into_inner().unwrap_or_else(|e| e.into_inner()))
    }

    /// Reads pod `i`'s engine counters from its own `/metrics`.
    pub async fn pod_counters(&self, i: usize) -> Result<PodCounters, ClusterError> {
        let text = self
            .http
            .get(format!("{}/metrics", self.pods[i].vllm_url()))
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?;
        parse_counters(&text).map_err(|message| ClusterError::Pod {
            pod: self.pods[i].spec.name.clone(),
            message,
        })
    }

    /// Counters of every pod, in pod order.
    pub async fn all_counters(&self) -> Result<Vec<PodCounters>, ClusterError> {
        let mut out = Vec::with_capacity(self.pods.len());
        for i in 0..self.pods.len() {
            out.push(self.pod_counters(i).await?);
        }
        Ok(out)
    }

    /// POSTs `body` to `path` on router `r` with the decision header requested; returns the
    /// status, the chosen pod's key (from `x-kvsight-decision`), timings and the body text.
    pub async fn post(&self, r: usize, path: &str, body: &Value) -> Result<Routed, ClusterError> {
        post_json(
            &self.http,
            &format!("{}{path}", self.routers[r].url()),
            body,
        )
        .await
        .map_err(ClusterError::from)
    }

    /// POSTs `body` to `path` on router `r` and returns the key and index of the pod that
    /// answered it with a 200 (an error otherwise).
    pub async fn routed_to(
        &self,
        r: usize,
        path: &str,
        body: &Value,
    ) -> Result<(String, usize), ClusterError> {
        let routed = self.post(r, path, body).await?;
        let err = |message: String| ClusterError::Router { index: r, message };
        if routed.status != 200 {
            return Err(err(format!("{}: {}", routed.status, routed.text)));
        }
        let key = routed.pod.ok_or_else(|| err("no decision header".into()))?;
        let i = self
            .pod_index(&key)
            .ok_or_else(|| err(format!("{key} is not a pod of the cluster")))?;
        Ok((key, i))
    }

    /// The canonical chain of a completion `prompt` for `model` at `block_size`, from the token
    /// ids the first router's `/tokenize` returns (the engine's own tokens).
    pub async fn chain_of(
        &self,
        model: &str,
        prompt: &str,
        block_size: usize,
    ) -> Result<Vec<u64>, ClusterError> {
        let r = self
            .post(
                0,
                "/tokenize",
                &serde_json::json!({"model": model, "prompt": prompt}),
            )
            .await?;
        let err = |message: String| ClusterError::Router { index: 0, message };
        if r.status != 200 {
            return Err(err(format!("/tokenize: {}: {}", r.status, r.text)));
        }
        let body: Value = serde_json::from_str(&r.text).map_err(|e| err(e.to_string()))?;
        let ids: Vec<u32> =
            serde_json::from_value(body["tokens"].clone()).map_err(|e| err(e.to_string()))?;
        Ok(kvsight_protocol::hash::hash_chain(
            &kvsight_protocol::hash::ChainSeed::BASE,
            &ids,
            block_size,
        ))
    }

    /// The index of the pod whose key is `key`.
    pub fn pod_index(&self, key: &str) -> Option<usize> {
        self.pods.iter().position(|p| p.key() == key)
    }

    /// Stops everything: sidecars drain first (routers see Goodbye), then routers, then pods.
    pub async fn shutdown(mut self) {
        for pod in &mut self.pods {
            if let Some(s) = pod.sidecar.take() {
                let _ = s.stop(Duration::from_secs(10)).await;
            }
        }
        for r in self.routers.drain(..) {
            r.stop.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(10), r.task).await;
        }
        for pod in &mut self.pods {
            if let Some(sim) = pod.sim.take() {
                sim.shutdown(Duration::from_secs(2)).await;
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Sidecars stop as their handles drop with `pods`.
        for r in &self.routers {
            r.stop.cancel();
            r.task.abort();
        }
    }
}
