//! Configuration: the command line (every flag also an environment variable `KVSIGHT_…`),
//! validated once into [`Config`] before anything binds a port. A bad value is a [`ConfigError`]
//! naming the field; the binary exits with status 64 on it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// The sidecar's flags, as typed by an operator.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvsight-sidecar",
    version,
    about = "kvsight sidecar for a vLLM pod"
)]
pub struct Args {
    /// vLLM's base URL on localhost.
    #[arg(
        long,
        env = "KVSIGHT_VLLM_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    pub vllm_url: String,
    /// vLLM's KV-event PUB endpoint.
    #[arg(
        long,
        env = "KVSIGHT_KV_EVENTS_ENDPOINT",
        default_value = "tcp://127.0.0.1:5557"
    )]
    pub kv_events_endpoint: String,
    /// vLLM's KV-event replay endpoint (optional; without it a gap means lost history).
    #[arg(long, env = "KVSIGHT_KV_EVENTS_REPLAY_ENDPOINT")]
    pub kv_events_replay_endpoint: Option<String>,
    /// Topic prefix of vLLM's KV events (vLLM's default is empty).
    #[arg(long, env = "KVSIGHT_KV_EVENTS_TOPIC", default_value = "")]
    pub kv_events_topic: String,
    /// A router as HOST:PORT (repeatable; comma-separated in the env var). A DNS name resolves to
    /// every router replica, one connection each, and is re-resolved periodically.
    #[arg(long = "router", env = "KVSIGHT_ROUTERS", value_delimiter = ',')]
    pub routers: Vec<String>,
    /// How often router names are re-resolved. Default 10s.
    #[arg(long, env = "KVSIGHT_ROUTER_RESOLVE_INTERVAL", default_value = "10s")]
    pub router_resolve_interval: String,
    /// The pod's vLLM URL as routers should call it. Default `http://$POD_IP:<vllm port>`.
    #[arg(long, env = "KVSIGHT_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
    /// The pod's name (downward API). Default `$HOSTNAME`.
    #[arg(long, env = "KVSIGHT_POD_NAME")]
    pub pod_name: Option<String>,
    /// The pod's namespace (downward API).
    #[arg(long, env = "KVSIGHT_POD_NAMESPACE", default_value = "default")]
    pub pod_namespace: String,
    /// A pod label KEY=VALUE that routers select pools by (repeatable; comma-separated in env).
    #[arg(long = "pod-label", env = "KVSIGHT_POD_LABELS", value_delimiter = ',')]
    pub pod_labels: Vec<String>,
    /// This sidecar's certificate chain (PEM). Required with --router.
    #[arg(long, env = "KVSIGHT_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM). Required with --router.
    #[arg(long, env = "KVSIGHT_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The CA bundle routers' certificates must chain to (PEM). Required with --router.
    #[arg(long, env = "KVSIGHT_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Address of the health/metrics HTTP server.
    #[arg(long, env = "KVSIGHT_LISTEN", default_value = "0.0.0.0:9090")]
    pub listen: String,
    /// Address of `/debug/state` (the pod's routers, engine facts, KV view). Not served unless
    /// set; keep it on loopback (`127.0.0.1:9091`, reached with `kubectl port-forward`).
    #[arg(long, env = "KVSIGHT_DEBUG_LISTEN")]
    pub debug_listen: Option<String>,
    /// How often vLLM's /metrics is scraped and Load sent. Default 100ms.
    #[arg(long, env = "KVSIGHT_SCRAPE_INTERVAL", default_value = "100ms")]
    pub scrape_interval: String,
    /// Shortest interval between two cache deltas. Default 50ms.
    #[arg(long, env = "KVSIGHT_PUBLISH_INTERVAL", default_value = "50ms")]
    pub publish_interval: String,
    /// Warm-up plan (JSON list of {prompt_tokens, max_tokens, concurrency}). Default: a built-in
    /// plan of short and long prompts up to max_model_len. `none` skips warm-up.
    #[arg(long, env = "KVSIGHT_WARMUP")]
    pub warmup: Option<String>,
    /// Directory holding tokenizer.json (and tokenizer_config.json / chat_template.jinja).
    /// Default: vLLM's model `root` from /v1/models when it is a local directory.
    #[arg(long, env = "KVSIGHT_TOKENIZER_DIR")]
    pub tokenizer_dir: Option<PathBuf>,
    /// Longest wait for vLLM to finish running requests after SIGTERM. Default 30s.
    #[arg(long, env = "KVSIGHT_DRAIN_GRACE", default_value = "30s")]
    pub drain_grace: String,
    /// vLLM's --max-num-seqs (vLLM does not expose it). Default 256.
    #[arg(long, env = "KVSIGHT_MAX_NUM_SEQS", default_value_t = 256)]
    pub max_num_seqs: u32,
    /// vLLM's --max-num-batched-tokens, when known.
    #[arg(long, env = "KVSIGHT_MAX_NUM_BATCHED_TOKENS")]
    pub max_num_batched_tokens: Option<u32>,
    /// How often freed heap pages are handed back to the system (glibc's malloc_trim); 0 turns
    /// it off. The sidecar lives inside the model pod's memory limit (see `memory`).
    #[arg(long, env = "KVSIGHT_MEMORY_TRIM_INTERVAL", default_value = "5s")]
    pub memory_trim_interval: String,
}

/// A configuration value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid --{field}: {why}")]
pub struct ConfigError {
    /// The flag's name, without dashes.
    pub field: &'static str,
    pub why: String,
}

fn bad(field: &'static str, why: impl Into<String>) -> ConfigError {
    ConfigError {
        field,
        why: why.into(),
    }
}

/// TLS file paths (all three are needed together), watched for renewals.
pub use kvsight_transport::TlsFiles as TlsPaths;

/// A router target as configured: a host (name or address) and port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterTarget {
    pub host: String,
    pub port: u16,
}

/// The warm-up to run.
#[derive(Debug, Clone, PartialEq)]
pub enum WarmupSource {
    /// The built-in plan, sized from the engine's max_model_len.
    Default,
    /// No warm-up.
    Skip,
    /// A plan file.
    File(PathBuf),
}

/// Validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// vLLM's base URL without a trailing slash.
    pub vllm_url: String,
    pub kv_events_endpoint: String,
    pub kv_events_replay_endpoint: Option<String>,
    pub kv_events_topic: String,
    pub routers: Vec<RouterTarget>,
    pub router_resolve_interval: Duration,
    pub advertise_url: String,
    pub pod_name: String,
    pub pod_namespace: String,
    pub pod_labels: BTreeMap<String, String>,
    pub tls: Option<TlsPaths>,
    pub listen: SocketAddr,
    /// Where `/debug/state` is served; `None`: nowhere.
    pub debug_listen: Option<SocketAddr>,
    pub scrape_interval: Duration,
    pub publish_interval: Duration,
    pub warmup: WarmupSource,
    pub tokenizer_dir: Option<PathBuf>,
    pub drain_grace: Duration,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: Option<u32>,
    /// `Duration::ZERO`: never.
    pub memory_trim_interval: Duration,
}

/// Parses `100ms`, `5s`, `2m`, `1h` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().ok()?;
    let secs = match unit.trim() {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return None,
    };
    Duration::try_from_secs_f64(secs).ok()
}

fn duration(field: &'static str, s: &str, min: Duration) -> Result<Duration, ConfigError> {
    let d = parse_duration(s)
        .ok_or_else(|| bad(field, format!("{s:?} is not a duration like 100ms or 5s")))?;
    if d < min {
        return Err(bad(field, format!("{s} is shorter than {min:?}")));
    }
    Ok(d)
}

fn zmq_endpoint(field: &'static str, s: &str) -> Result<String, ConfigError> {
    if !s.starts_with("tcp://") {
        return Err(bad(field, format!("{s:?} is not a tcp:// endpoint")));
    }
    // A libzmq-style wildcard is where vLLM binds; we connect to it on loopback.
    Ok(s.replacen("tcp://*:", "tcp://127.0.0.1:", 1))
}

impl Args {
    /// Validates everything; `env` looks up `POD_IP` and `HOSTNAME` (injected for tests).
    pub fn validate(&self, env: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let url = reqwest::Url::parse(&self.vllm_url)
            .map_err(|e| bad("vllm-url", format!("{:?}: {e}", self.vllm_url)))?;
        if url.scheme() != "http" && url.scheme() != "https" {
            return Err(bad("vllm-url", "scheme must be http or https"));
        }
        let vllm_port = url.port_or_known_default().unwrap_or(8000);
        let routers = self
            .routers
            .iter()
            .filter(|r| !r.trim().is_empty())
            .map(|r| {
                let (host, port) = r
                    .trim()
                    .rsplit_once(':')
                    .ok_or_else(|| bad("router", format!("{r:?} is not HOST:PORT")))?;
                let port = port
                    .parse()
                    .map_err(|_| bad("router", format!("{r:?}: bad port")))?;
                let host = host.trim_start_matches('[').trim_end_matches(']');
                if host.is_empty() {
                    return Err(bad("router", format!("{r:?}: empty host")));
                }
                Ok(RouterTarget {
                    host: host.to_owned(),
                    port,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let tls = match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (Some(cert), Some(key), Some(ca)) => Some(TlsPaths {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            }),
            (None, None, None) => None,
            (None, _, _) => return Err(bad("tls-cert", "needed with --tls-key/--tls-ca")),
            (_, None, _) => return Err(bad("tls-key", "needed with --tls-cert/--tls-ca")),
            (_, _, None) => return Err(bad("tls-ca", "needed with --tls-cert/--tls-key")),
        };
        if !routers.is_empty() && tls.is_none() {
            return Err(bad(
                "tls-cert",
                "routers need --tls-cert, --tls-key, --tls-ca",
            ));
        }
        let advertise_url = match (&self.advertise_url, env("POD_IP")) {
            (Some(u), _) => {
                reqwest::Url::parse(u).map_err(|e| bad("advertise-url", format!("{u:?}: {e}")))?;
                u.trim_end_matches('/').to_owned()
            }
            (None, Some(ip)) if ip.contains(':') => format!("http://[{ip}]:{vllm_port}"),
            (None, Some(ip)) => format!("http://{ip}:{vllm_port}"),
            (None, None) => self.vllm_url.trim_end_matches('/').to_owned(),
        };
        let pod_name = self
            .pod_name
            .clone()
            .or_else(|| env("HOSTNAME"))
            .filter(|n| !n.is_empty())
            .ok_or_else(|| bad("pod-name", "not set and $HOSTNAME is empty"))?;
        let pod_labels = self
            .pod_labels
            .iter()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                l.split_once('=')
                    .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                    .filter(|(k, _)| !k.is_empty())
                    .ok_or_else(|| bad("pod-label", format!("{l:?} is not KEY=VALUE")))
            })
            .collect::<Result<_, _>>()?;
        let listen = self
            .listen
            .parse()
            .map_err(|e| bad("listen", format!("{:?}: {e}", self.listen)))?;
        let debug_listen = self
            .debug_listen
            .as_deref()
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse()
                    .map_err(|e| bad("debug-listen", format!("{s:?}: {e}")))
            })
            .transpose()?;
        let warmup = match self.warmup.as_deref() {
            None | Some("") => WarmupSource::Default,
            Some("none") => WarmupSource::Skip,
            Some(path) => WarmupSource::File(PathBuf::from(path)),
        };
        if self.max_num_seqs == 0 {
            return Err(bad("max-num-seqs", "must be at least 1"));
        }
        Ok(Config {
            vllm_url: self.vllm_url.trim_end_matches('/').to_owned(),
            kv_events_endpoint: zmq_endpoint("kv-events-endpoint", &self.kv_events_endpoint)?,
            kv_events_replay_endpoint: self
                .kv_events_replay_endpoint
                .as_deref()
                .filter(|e| !e.is_empty())
                .map(|e| zmq_endpoint("kv-events-replay-endpoint", e))
                .transpose()?,
            kv_events_topic: self.kv_events_topic.clone(),
            routers,
            router_resolve_interval: duration(
                "router-resolve-interval",
                &self.router_resolve_interval,
                Duration::from_millis(100),
            )?,
            advertise_url,
            pod_name,
            pod_namespace: self.pod_namespace.clone(),
            pod_labels,
            tls,
            listen,
            debug_listen,
            scrape_interval: duration(
                "scrape-interval",
                &self.scrape_interval,
                Duration::from_millis(5),
            )?,
            publish_interval: duration(
                "publish-interval",
                &self.publish_interval,
                Duration::from_millis(1),
            )?,
            warmup,
            tokenizer_dir: self.tokenizer_dir.clone(),
            drain_grace: duration("drain-grace", &self.drain_grace, Duration::ZERO)?,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            memory_trim_interval: trim_interval(&self.memory_trim_interval)?,
        })
    }
}

/// 0 (off) or at least 100 ms: a trim walks every arena under its lock, so not in a hot loop.
fn trim_interval(s: &str) -> Result<Duration, ConfigError> {
    let d = duration("memory-trim-interval", s, Duration::ZERO)?;
    if !d.is_zero() && d < Duration::from_millis(100) {
        return Err(bad(
            "memory-trim-interval",
            format!("{s} is shorter than 100ms (0 turns trimming off)"),
        ));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut v = vec!["kvsight-sidecar", "--pod-name", "p"];
        v.extend_from_slice(extra);
        Args::parse_from(v)
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("100ms"), Some(Duration::from_millis(100)));
        assert_eq!(parse_duration("5s"), Some(Duration::from_secs(5)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("3"), Some(Duration::from_secs(3)));
        assert_eq!(parse_duration("5 parsecs"), None);
    }

    #[test]
    fn defaults_validate() {
        let c = args(&[]).validate(|_| None).unwrap();
        assert_eq!(c.scrape_interval, Duration::from_millis(100));
        assert_eq!(c.publish_interval, Duration::from_millis(50));
        assert_eq!(c.advertise_url, "http://127.0.0.1:8000");
        assert!(c.routers.is_empty());
        assert_eq!(c.memory_trim_interval, Duration::from_secs(5));
    }

    #[test]
    fn memory_trimming_is_off_at_zero_and_never_in_a_hot_loop() {
        let trim = |v: &str| {
            args(&["--memory-trim-interval", v])
                .validate(|_| None)
                .map(|c| c.memory_trim_interval)
        };
        assert_eq!(trim("0"), Ok(Duration::ZERO));
        assert_eq!(trim("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(trim("10ms").unwrap_err().field, "memory-trim-interval");
    }

    #[test]
    fn errors_name_the_field() {
        let e = args(&["--scrape-interval", "soon"])
            .validate(|_| None)
            .unwrap_err();
        assert_eq!(e.field, "scrape-interval");
        let e = args(&["--router", "r:1"]).validate(|_| None).unwrap_err();
        assert_eq!(e.field, "tls-cert");
        let e = args(&[
            "--router",
            "nope",
            "--tls-cert",
            "a",
            "--tls-key",
            "b",
            "--tls-ca",
            "c",
        ])
        .validate(|_| None)
        .unwrap_err();
        assert_eq!(e.field, "router");
    }

    #[test]
    fn advertise_from_pod_ip() {
        let c = args(&["--vllm-url", "http://127.0.0.1:8080"])
            .validate(|k| (k == "POD_IP").then(|| "10.0.0.7".to_owned()))
            .unwrap();
        assert_eq!(c.advertise_url, "http://10.0.0.7:8080");
    }
}
