//! The router's configuration file: pools, scheduler weights and thresholds, timeouts, limits,
//! tokenizers. YAML or TOML (by extension), camelCase keys like a gateway's config, parsed and
//! validated in one place so that a bad file is rejected whole with a message naming the field —
//! at start (exit 64) and on every hot reload (the old config stays).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::scheduler::scorers::ScorerKind;

/// Why a configuration was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct RouterConfig {
    /// Pools, in order: a request goes to the first pool that lists its model. A model in no
    /// pool is served by every Ready pod that serves it (an implicit pool without a window).
    pub pools: Vec<PoolConfig>,
    pub scheduler: SchedulerConfig,
    pub timeouts: Timeouts,
    pub limits: Limits,
    /// Which pod URLs sidecars may advertise.
    pub pods: PodsConfig,
    /// Local tokenizer folders per model name (a `tokenizer.json`, usually with a
    /// `tokenizer_config.json`); models not listed get their tokenizer from a sidecar.
    pub tokenizers: BTreeMap<String, PathBuf>,
    /// Priorities, fair shares between tenants and admission by predicted wait
    /// ([`crate::flow`]); off by default.
    pub flow_control: crate::flow::FlowControlConfig,
}

/// A set of pods serving some models, with an optional context window and fallback.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolConfig {
    pub name: String,
    /// Served model names (or LoRA adapter names) this pool answers.
    pub models: Vec<String>,
    /// Pods must carry all these labels (Kubernetes `matchLabels`); empty selects every pod that
    /// serves one of the models.
    #[serde(default)]
    pub pod_selector: BTreeMap<String, String>,
    /// Largest prompt (tokens) this pool accepts; default: each pod's `max_model_len`.
    #[serde(default)]
    pub context_window: Option<u32>,
    /// A pool to resend a request to, once, when this pool rejects its prompt as too long.
    #[serde(default)]
    pub fallback: Option<String>,
}

/// Weights of the scorers: a pod's score is Σ weight × scorer value (each value in 0 – 1).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Weights {
    /// Fraction of the prompt's blocks resident on the pod (real cache, via its Bloom filter).
    pub prefix: f64,
    /// Fewer waiting requests (projected) scores higher.
    pub queue: f64,
    /// Lower projected KV-cache use scores higher.
    pub kv_cache: f64,
    /// Fewer running requests (projected) scores higher.
    pub running_requests: f64,
    /// The request's LoRA adapter already loaded on the pod.
    pub lora_affinity: f64,
    /// Lower predicted time to first token (queue + uncached prefill) scores higher. Off by
    /// default: it rewards cached prefixes too, so `prefix: 0` alone would not spread traffic.
    pub predicted_latency: f64,
    /// LMetric's product of the prompt tokens the pod must compute and its batch size (running +
    /// waiting): lower scores higher. Off by default.
    pub lmetric: f64,
    /// The prompt's home (the pod this router first sent its prefix to, kept while it keeps
    /// going there within `affinityTtlSeconds`; `crate::homes`) scores higher, and a busy home
    /// may start the prompt a little later than a free pod and still compete (a full one too):
    /// where a prefix evicted everywhere returns, and what keeps tenants from spreading over
    /// every pod past saturation. Default 3 (see docs/decisions/0006-homes.md);
    /// 0 turns homes off. A companion of `prefix`, so it counts only while `prefix` is above 0
    /// (`prefix: 0` spreads a shared prefix, as operators expect).
    pub affinity: f64,
    /// The pod picked longest ago scores higher: the tie-breaker.
    pub lru: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            prefix: ScorerKind::Prefix.default_weight(),
            queue: ScorerKind::Queue.default_weight(),
            kv_cache: ScorerKind::KvCache.default_weight(),
            running_requests: ScorerKind::RunningRequests.default_weight(),
            lora_affinity: ScorerKind::LoraAffinity.default_weight(),
            predicted_latency: ScorerKind::PredictedLatency.default_weight(),
            lmetric: ScorerKind::Lmetric.default_weight(),
            affinity: ScorerKind::Affinity.default_weight(),
            lru: ScorerKind::Lru.default_weight(),
        }
    }
}

impl Weights {
    /// The configured weight of `kind`. The fields stay plain so the file format is serde's;
    /// this match is what joins each field to its scorer.
    pub fn get(&self, kind: ScorerKind) -> f64 {
        match kind {
            ScorerKind::Prefix => self.prefix,
            ScorerKind::Queue => self.queue,
            ScorerKind::KvCache => self.kv_cache,
            ScorerKind::RunningRequests => self.running_requests,
            ScorerKind::LoraAffinity => self.lora_affinity,
            ScorerKind::PredictedLatency => self.predicted_latency,
            ScorerKind::Lmetric => self.lmetric,
            ScorerKind::Affinity => self.affinity,
            ScorerKind::Lru => self.lru,
        }
    }

    /// The weight the scheduler applies to `kind`: as configured, except `affinity`, which
    /// counts only alongside `prefix` (`prefix: 0` must spread a shared prefix, and a home is
    /// a prefix preference too).
    pub fn effective(&self, kind: ScorerKind) -> f64 {
        match kind {
            ScorerKind::Affinity if self.prefix == 0.0 => 0.0,
            _ => self.get(kind),
        }
    }
}

/// When a pod counts as saturated and is skipped.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Saturation {
    /// Saturated at this many waiting requests (projected). Default 1.
    pub max_waiting: u32,
    /// Saturated when projected KV-cache use would exceed this fraction. Default 0.9.
    pub kv_threshold: f64,
}

impl Default for Saturation {
    fn default() -> Self {
        Saturation {
            max_waiting: 1,
            kv_threshold: 0.9,
        }
    }
}

/// Scheduler settings.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct SchedulerConfig {
    pub weights: Weights,
    pub saturation: Saturation,
    /// Seconds a routed prompt's blocks count as *pending* on its pod until the pod's own events
    /// confirm them. Default 2.
    pub pending_ttl_seconds: f64,
    /// Seconds a pod stays the home of a prefix after this router last sent it there (the
    /// `affinity` weight); another pod can become its home only after that. Default 120.
    pub affinity_ttl_seconds: f64,
    /// Tell the other router replicas, through each pod's sidecar, of every request sent to
    /// the pod, and count theirs as this router's own picks count (pending chains, projected
    /// load, homes). Off, each replica decides on its own sends and the pods' reports only.
    /// Default true.
    pub share_placements: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            weights: Weights::default(),
            saturation: Saturation::default(),
            pending_ttl_seconds: 2.0,
            affinity_ttl_seconds: 120.0,
            share_placements: true,
        }
    }
}

impl SchedulerConfig {
    /// [`Self::affinity_ttl_seconds`] as a duration.
    pub fn affinity_ttl(&self) -> Duration {
        Duration::from_secs_f64(self.affinity_ttl_seconds)
    }

    /// [`Self::pending_ttl_seconds`] as a duration.
    pub fn pending_ttl(&self) -> Duration {
        Duration::from_secs_f64(self.pending_ttl_seconds)
    }
}

/// Deadlines.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Timeouts {
    /// The one deadline for a whole request, first byte to last. Default 3600 s.
    pub request_seconds: f64,
    /// Connecting to a pod. Default 2 s.
    pub connect_seconds: f64,
    /// A client's request line and headers must arrive within this many seconds, or the
    /// connection is closed (slow-header clients hold a connection each). The same clock closes a
    /// keep-alive connection idle this long between requests. Default 30 s.
    pub header_read_seconds: f64,
    /// A request's whole body must arrive within this many seconds, or the answer is 408 and the
    /// connection closes (a trickling body holds a connection and a buffer). Default 60 s: a
    /// 32 MiB body at 1 MB/s with room to spare. The same bound applies to the bodies the router
    /// reads whole from a pod (a forwarded `/tokenize` answer, an error it inspects).
    pub body_read_seconds: f64,
    /// A client that takes no chunk of its answer for this many seconds is cut off: the pod's
    /// request is aborted and the connection closed, instead of both waiting for
    /// `requestSeconds`. A client that reads slowly but steadily is not affected. Default 30 s.
    pub client_write_seconds: f64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            request_seconds: 3600.0,
            connect_seconds: 2.0,
            header_read_seconds: 30.0,
            body_read_seconds: 60.0,
            client_write_seconds: 30.0,
        }
    }
}

impl Timeouts {
    pub fn request(&self) -> Duration {
        Duration::from_secs_f64(self.request_seconds)
    }
    pub fn connect(&self) -> Duration {
        Duration::from_secs_f64(self.connect_seconds)
    }
    pub fn header_read(&self) -> Duration {
        Duration::from_secs_f64(self.header_read_seconds)
    }
    pub fn body_read(&self) -> Duration {
        Duration::from_secs_f64(self.body_read_seconds)
    }
    pub fn client_write(&self) -> Duration {
        Duration::from_secs_f64(self.client_write_seconds)
    }
}

/// Bounds on everything a client controls; each refusal is counted in
/// `kvsight_router_refused_total{reason}` (docs/operations.md, limits).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Limits {
    /// Largest request body in bytes; a larger declared `Content-Length` is refused (413) before
    /// any of the body is read. Default 32 MiB (room for base64 images).
    pub body_bytes: usize,
    /// Largest request head (request line and headers) in bytes; over it the answer is 431.
    /// Default 64 KiB; at least 8192 (hyper's smallest read buffer).
    pub header_bytes: usize,
    /// Most headers in one request; over it the answer is 431. Default 100.
    pub headers: usize,
    /// Deepest nesting of JSON arrays and objects in a body, checked before parsing. Default 64;
    /// at most 100 (serde_json refuses past 128 on its own).
    pub json_depth: usize,
    /// Most `messages` in a chat request. Default 4096.
    pub chat_messages: usize,
    /// Most bytes of prompt before tokenizing: every string and number in the fields the chat
    /// template renders or the engine tokenizes (`prompt`, token ids included; `messages`,
    /// `tools`, `documents`, `chat_template_kwargs`, `chat_template`), as written in the JSON
    /// text; media payloads (images, audio, video, files) do not count. Default 8 MiB (above any
    /// context window of text).
    pub prompt_bytes: usize,
    /// Most JSON values (each string, number, literal, array and object) in the fields the chat
    /// template renders, counted before they are parsed: a parsed value costs the router about
    /// a hundred bytes whatever its size in the body, so this bounds the memory a chat body
    /// takes (token-id prompts are read as plain integers and not counted here). Default 262144.
    pub json_values: usize,
    /// Bytes of request bodies the whole replica holds at once (read, being read, or parsed, as
    /// estimated), across every request; a body that would exceed it is refused with 503 and
    /// `Retry-After`. Default 512 MiB: sixteen bodies of `bodyBytes`, or thousands of usual ones,
    /// within the chart's 2 GiB memory limit (docs/decisions/0100-request-memory-bounds.md).
    pub inflight_body_bytes: usize,
    /// Threads that run CPU-heavy work (tokenizing and parsing large bodies, building tokenizers
    /// sidecars send) away from the threads that answer probes and stream answers. 0 (default):
    /// one fewer than the CPUs, at least one. Read at start; a reload does not resize the pool.
    pub heavy_workers: usize,
    /// Heavy jobs that may wait for a thread; one more is refused with 503 and `Retry-After`.
    /// Default 64. Read at start, like `heavyWorkers`.
    pub heavy_queue: usize,
    /// Most client connections open at once on this replica; a connection over it is answered
    /// 503 with `Retry-After` and closed. Default 4096.
    pub connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            body_bytes: 32 << 20,
            header_bytes: 64 << 10,
            headers: 100,
            json_depth: 64,
            chat_messages: 4096,
            prompt_bytes: 8 << 20,
            json_values: 1 << 18,
            inflight_body_bytes: 512 << 20,
            heavy_workers: 0,
            heavy_queue: 64,
            connections: 4096,
        }
    }
}

/// What a sidecar may claim, and how many may connect. A sidecar's certificate proves it is a
/// sidecar; which pod names it may register comes from the certificate too, and its advertised
/// URL must be its own address: without these checks, one stolen certificate could replace any
/// pod in every router, or point a pod entry at any host and receive the prompts routed to it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct PodsConfig {
    /// Which pod names a sidecar may register. `certificate` (default): only names a URI SAN
    /// `kvsight://pod/<namespace>/<name>` of its certificate grants (a name ending in `*` grants
    /// a prefix), as the Helm chart issues them. `any`: any name, for certificates issued
    /// without such SANs (a certificate shared by every pod); either way a
    /// name held by a live connection with another certificate is refused.
    pub identity: PodIdentityMode,
    /// Most sidecar connections open at once (QUIC); one more is refused at the handshake.
    /// Default 4096 (one per pod of a large fleet).
    pub max_connections: usize,
    /// Most pods registered at once; a `Hello` for one more is refused. Default 4096.
    pub max_pods: usize,
    /// Messages a sidecar connection may send per second, averaged over a second: past it the
    /// router reads the connection more slowly (QUIC flow control then slows the sidecar).
    /// Default 1000 (a sidecar sends a few dozen: load, deltas, tokenizer chunks).
    pub messages_per_second: u32,
    /// Accept any advertised URL (the behaviour before this check existed). Default false: the URL's host
    /// must be (or resolve to) the IP address the sidecar's QUIC connection comes from.
    pub trust_advertised_url: bool,
    /// Hosts accepted in advertised URLs whatever the connection's address (exact names or IP
    /// literals), for setups where a sidecar reaches routers through NAT. Default empty.
    pub allow_advertised_hosts: Vec<String>,
}

impl Default for PodsConfig {
    fn default() -> Self {
        PodsConfig {
            identity: PodIdentityMode::Certificate,
            max_connections: 4096,
            max_pods: 4096,
            messages_per_second: 1000,
            trust_advertised_url: false,
            allow_advertised_hosts: Vec::new(),
        }
    }
}

/// How a sidecar's pod name is checked ([`PodsConfig::identity`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum PodIdentityMode {
    /// The certificate's URI SANs must grant the name.
    #[default]
    Certificate,
    /// Any name (certificates without pod URI SANs).
    Any,
}

impl RouterConfig {
    /// Reads and validates a file; YAML for `.yaml`/`.yml`, TOML for `.toml`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let parse_err = |message: String| ConfigError::Parse {
            path: path.to_owned(),
            message,
        };
        let cfg: RouterConfig = match path.extension().and_then(|e| e.to_str()) {
            Some("toml") => toml::from_str(&text).map_err(|e| parse_err(e.to_string()))?,
            Some("yaml" | "yml") => Self::parse_yaml(&text).map_err(parse_err)?,
            _ => {
                return Err(parse_err(
                    "unknown extension: use .yaml, .yml or .toml".into(),
                ));
            }
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses and validates YAML text (what [`Self::load`] does for a `.yaml` file).
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let cfg = Self::parse_yaml(text).map_err(|message| ConfigError::Parse {
            path: PathBuf::from("<yaml>"),
            message,
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn parse_yaml(text: &str) -> Result<Self, String> {
        serde_saphyr::from_str(text).map_err(|e| e.to_string())
    }

    /// Every rule a config must satisfy, checked in one place.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_pools()?;
        self.validate_scheduler()?;
        self.validate_timeouts()?;
        self.validate_limits()?;
        self.validate_pods()?;
        let l = &self.limits;
        if l.inflight_body_bytes < l.body_bytes {
            return Err(invalid(
                "limits.inflightBodyBytes",
                format!(
                    "must be at least limits.bodyBytes ({}), or a body of the largest size is never read, got {}",
                    l.body_bytes, l.inflight_body_bytes
                ),
            ));
        }
        self.flow_control.validate()?;
        Ok(())
    }

    /// Pool names are unique and non-empty, each pool serves a model, fallbacks name another pool.
    fn validate_pools(&self) -> Result<(), ConfigError> {
        let mut names = BTreeSet::new();
        for (i, pool) in self.pools.iter().enumerate() {
            let field = format!("pools[{i}]");
            if pool.name.trim().is_empty() {
                return Err(invalid(format!("{field}.name"), "must not be empty"));
            }
            if !names.insert(pool.name.as_str()) {
                return Err(invalid(
                    format!("{field}.name"),
                    format!("pool {:?} is defined twice", pool.name),
                ));
            }
            if pool.models.is_empty() {
                return Err(invalid(
                    format!("{field}.models"),
                    "must list at least one model",
                ));
            }
            if pool.context_window == Some(0) {
                return Err(invalid(
                    format!("{field}.contextWindow"),
                    "must be positive",
                ));
            }
        }
        for (i, pool) in self.pools.iter().enumerate() {
            if let Some(fb) = &pool.fallback {
                if fb == &pool.name {
                    return Err(invalid(
                        format!("pools[{i}].fallback"),
                        "a pool cannot fall back to itself",
                    ));
                }
                if !names.contains(fb.as_str()) {
                    return Err(invalid(
                        format!("pools[{i}].fallback"),
                        format!("no pool named {fb:?}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Scorer weights, saturation thresholds and the pending and affinity times.
    fn validate_scheduler(&self) -> Result<(), ConfigError> {
        for kind in ScorerKind::ALL {
            let w = self.scheduler.weights.get(kind);
            if !w.is_finite() || w < 0.0 {
                return Err(invalid(
                    format!("scheduler.weights.{}", kind.key()),
                    format!("must be a finite number >= 0, got {w}"),
                ));
            }
        }
        let sat = &self.scheduler.saturation;
        if !(sat.kv_threshold > 0.0 && sat.kv_threshold <= 1.0) {
            return Err(invalid(
                "scheduler.saturation.kvThreshold",
                "must be in (0, 1]",
            ));
        }
        if sat.max_waiting == 0 {
            return Err(invalid(
                "scheduler.saturation.maxWaiting",
                "must be at least 1",
            ));
        }
        positive_secs(
            "scheduler.pendingTtlSeconds",
            self.scheduler.pending_ttl_seconds,
        )?;
        positive_secs(
            "scheduler.affinityTtlSeconds",
            self.scheduler.affinity_ttl_seconds,
        )?;
        Ok(())
    }

    /// Every timeout is a positive number of seconds.
    fn validate_timeouts(&self) -> Result<(), ConfigError> {
        positive_secs("timeouts.requestSeconds", self.timeouts.request_seconds)?;
        positive_secs("timeouts.connectSeconds", self.timeouts.connect_seconds)?;
        positive_secs(
            "timeouts.headerReadSeconds",
            self.timeouts.header_read_seconds,
        )?;
        positive_secs("timeouts.bodyReadSeconds", self.timeouts.body_read_seconds)?;
        positive_secs(
            "timeouts.clientWriteSeconds",
            self.timeouts.client_write_seconds,
        )?;
        Ok(())
    }

    /// Every size and count limit is in its range.
    fn validate_limits(&self) -> Result<(), ConfigError> {
        let l = &self.limits;
        for (field, v, min, max) in [
            ("limits.bodyBytes", l.body_bytes, 1, usize::MAX),
            ("limits.headerBytes", l.header_bytes, 8192, usize::MAX),
            ("limits.headers", l.headers, 1, usize::MAX),
            ("limits.jsonDepth", l.json_depth, 1, 100),
            ("limits.chatMessages", l.chat_messages, 1, usize::MAX),
            ("limits.promptBytes", l.prompt_bytes, 1, usize::MAX),
            ("limits.jsonValues", l.json_values, 1, usize::MAX),
            (
                "limits.inflightBodyBytes",
                l.inflight_body_bytes,
                1,
                usize::MAX,
            ),
            ("limits.heavyWorkers", l.heavy_workers, 0, 1024),
            ("limits.heavyQueue", l.heavy_queue, 0, 1 << 20),
            ("limits.connections", l.connections, 1, usize::MAX),
        ] {
            if !(min..=max).contains(&v) {
                let range = if max == usize::MAX {
                    format!("at least {min}")
                } else {
                    format!("in {min} ..= {max}")
                };
                return Err(invalid(field, format!("must be {range}, got {v}")));
            }
        }
        Ok(())
    }

    /// The per-pod bounds are at least 1.
    fn validate_pods(&self) -> Result<(), ConfigError> {
        let p = &self.pods;
        for (field, v) in [
            ("pods.maxConnections", p.max_connections),
            ("pods.maxPods", p.max_pods),
            ("pods.messagesPerSecond", p.messages_per_second as usize),
        ] {
            if v == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        Ok(())
    }

    /// The pool configured for `model`, if any.
    pub fn pool_for(&self, model: &str) -> Option<&PoolConfig> {
        self.pools
            .iter()
            .find(|p| p.models.iter().any(|m| m == model))
    }

    /// A pool by name.
    pub fn pool(&self, name: &str) -> Option<&PoolConfig> {
        self.pools.iter().find(|p| p.name == name)
    }
}

fn positive_secs(field: &str, v: f64) -> Result<(), ConfigError> {
    // Duration::from_secs_f64 panics on negative, NaN or huge values: refuse them here.
    if v.is_finite() && v > 0.0 && v < 1e9 {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("must be a positive number of seconds, got {v}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> (tempdir::Dir, PathBuf) {
        let dir = tempdir::Dir::new();
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    /// A tiny self-deleting temporary folder (no extra dependency for two tests).
    mod tempdir {
        use std::path::{Path, PathBuf};
        use std::sync::atomic::{AtomicU32, Ordering};

        pub(super) struct Dir(PathBuf);
        impl Dir {
            pub(super) fn new() -> Self {
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "kvsight-router-config-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
            pub(super) fn path(&self) -> &Path {
                &self.0
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    const YAML: &str = r#"
pools:
  - name: short
    models: [kvsight-demo]
    contextWindow: 4096
    fallback: long
  - name: long
    models: [kvsight-demo]
    podSelector: {kvsight.io/pool: long}
scheduler:
  weights: {prefix: 0, lru: 0.5}
  saturation: {maxWaiting: 2}
timeouts: {requestSeconds: 30}
"#;

    #[test]
    fn yaml_and_toml_give_the_same_config() {
        let (_d1, y) = write("c.yaml", YAML);
        let (_d2, t) = write(
            "c.toml",
            r#"
[[pools]]
name = "short"
models = ["kvsight-demo"]
contextWindow = 4096
fallback = "long"
[[pools]]
name = "long"
models = ["kvsight-demo"]
podSelector = { "kvsight.io/pool" = "long" }
[scheduler.weights]
prefix = 0
lru = 0.5
[scheduler.saturation]
maxWaiting = 2
[timeouts]
requestSeconds = 30
"#,
        );
        let a = RouterConfig::load(&y).unwrap();
        let b = RouterConfig::load(&t).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.scheduler.weights.prefix, 0.0);
        assert_eq!(
            a.scheduler.weights.queue, 1.0,
            "unset weights keep their defaults"
        );
        assert_eq!(a.scheduler.saturation.kv_threshold, 0.9);
        assert_eq!(a.timeouts.request(), Duration::from_secs(30));
        assert_eq!(a.pool_for("kvsight-demo").unwrap().name, "short");
    }

    /// Each kind's key is the file's key for its weight: set alone, it reaches `get(kind)` and
    /// no other kind's weight; refused, the error names it.
    #[test]
    fn every_scorer_key_is_its_weight_in_the_file() {
        for kind in ScorerKind::ALL {
            let key = kind.key();
            let c = RouterConfig::from_yaml(&format!("scheduler: {{weights: {{{key}: 7.25}}}}"))
                .unwrap_or_else(|e| panic!("{key}: {e}"));
            for other in ScorerKind::ALL {
                let want = if other == kind {
                    7.25
                } else {
                    other.default_weight()
                };
                assert_eq!(
                    c.scheduler.weights.get(other),
                    want,
                    "{key} set, {other:?} read"
                );
            }
            let err = RouterConfig::from_yaml(&format!("scheduler: {{weights: {{{key}: -1}}}}"))
                .unwrap_err()
                .to_string();
            assert!(
                err.starts_with(&format!("scheduler.weights.{key}")),
                "{err}"
            );
        }
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (
                "pools: [{name: a, models: [m], fallback: b}]",
                "pools[0].fallback",
            ),
            ("pools: [{name: a, models: []}]", "pools[0].models"),
            (
                "pools: [{name: a, models: [m]}, {name: a, models: [n]}]",
                "pools[1].name",
            ),
            (
                "scheduler: {weights: {prefix: -1}}",
                "scheduler.weights.prefix",
            ),
            (
                "scheduler: {saturation: {kvThreshold: 1.5}}",
                "scheduler.saturation.kvThreshold",
            ),
            (
                "scheduler: {affinityTtlSeconds: 0}",
                "scheduler.affinityTtlSeconds",
            ),
            ("timeouts: {requestSeconds: 0}", "timeouts.requestSeconds"),
        ];
        for (text, field) in cases {
            let (_d, p) = write("c.yaml", text);
            let err = RouterConfig::load(&p).unwrap_err().to_string();
            assert!(err.starts_with(field), "{text}: {err}");
        }
        let (_d, p) = write("c.yaml", "scheduler: {weights: {prefx: 1}}");
        let err = RouterConfig::load(&p).unwrap_err().to_string();
        assert!(err.contains("prefx"), "unknown keys are refused: {err}");
    }
}
