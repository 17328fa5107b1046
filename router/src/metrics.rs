//! Prometheus metrics of one router replica. Counters and histograms are updated on the request
//! path; the per-pod gauges (phase counts, in-flight, unrouted, report age, hit rate) are
//! recomputed from the registry at scrape time, so a pod that left disappears from them.

use std::sync::atomic::AtomicU64;
use std::time::Instant;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry as PromRegistry;

use kvsight_protocol::Phase;

use crate::pods::Registry;
use crate::tokenize::{TokenizerStatus, Verdict};

type Labels = Vec<(&'static str, String)>;

/// Bucket bounds of the Sight histogram (tokens): symmetric, so the count at 0 minus the count at
/// -1 is the answers predicted exactly.
const SIGHT_BUCKETS: [f64; 13] = [
    -4096.0, -1024.0, -256.0, -64.0, -16.0, -1.0, 0.0, 15.0, 63.0, 255.0, 1023.0, 4095.0, 16383.0,
];

/// Every metric the router exports.
pub struct Metrics {
    prom: PromRegistry,
    pub requests: Family<Labels, Counter>,
    pub pick_seconds: Histogram,
    pub prefix_match_ratio: Histogram,
    pub tokenize_seconds: Histogram,
    /// A KV event published by an engine → visible in this router's filter of that pod.
    pub view_staleness_seconds: Histogram,
    /// Sight: predicted minus engine-reported cached prompt tokens, per answer that carried
    /// them ([`crate::sight`]).
    sight_error_tokens: Histogram,
    /// The two sides of Sight per pod, summed.
    sight_predicted_tokens: Family<Labels, Counter>,
    sight_engine_tokens: Family<Labels, Counter>,
    /// The request's arrival (its body read) until it is sent to the pod that answers:
    /// tokenizing, picking, and any retried pick.
    pub added_latency_seconds: Histogram,
    /// Pods left out of picks by the saturation rule.
    pub saturation_skips: Counter,
    /// Placements shared with the other replicas through the pods' sidecars, by outcome.
    placements: Family<Labels, Counter>,
    /// Prefix depths whose home passed to another replica's earlier placement.
    pub home_handovers: Counter,
    /// Sidecar connections refused, by reason (handshake, version, protocol).
    sidecars_refused: Family<Labels, Counter>,
    pub retries: Family<Labels, Counter>,
    pub stream_cuts: Family<Labels, Counter>,
    /// Requests and connections refused by a client bound (`limits.*`, `timeouts.*Read*`), and
    /// sidecars refused for their advertised URL, by reason.
    pub refused: Family<Labels, Counter>,
    pub config_reloads: Family<Labels, Counter>,
    /// Looks at changed TLS files, by outcome (applied, unchanged, rejected).
    pub tls_reloads: Family<Labels, Counter>,
    /// Requests by how their prefix chain was computed: `exact` (the model's tokenizer) or
    /// `approximate` (character chunks, no tokenizer for the model yet).
    pub prefix_mode: Family<Labels, Counter>,
    /// Comparisons of a tokenizer with an engine's `/tokenize`, by model and outcome.
    pub tokenizer_checks: Family<Labels, Counter>,
    /// 1 per model for the dialect its prompts are tokenized in (absent in approximate mode).
    tokenizer_dialect: Family<Labels, Gauge>,
    /// Bytes of request bodies held now (read, being read, or parsed as estimated).
    pub inflight_body_bytes: Gauge,
    /// Heavy jobs admitted (waiting for a thread or running), and those running.
    pub heavy_jobs: Gauge,
    pub heavy_jobs_running: Gauge,
    /// Tokenizers a sidecar sent that were not taken, by reason.
    tokenizers_refused: Family<Labels, Counter>,
    pods: Family<Labels, Gauge>,
    inflight: Family<Labels, Gauge>,
    unrouted: Family<Labels, Gauge>,
    report_age: Family<Labels, Gauge<f64, AtomicU64>>,
    hit_rate: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Flow control's queue, admissions and sheds ([`crate::flow`]).
    pub flow: crate::flow::FlowMetrics,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut prom = PromRegistry::default();
        let m = Metrics {
            requests: Family::default(),
            // 1 µs .. ~1 s
            pick_seconds: Histogram::new(exponential_buckets(1e-6, 2.0, 20)),
            prefix_match_ratio: Histogram::new([0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]),
            tokenize_seconds: Histogram::new(exponential_buckets(1e-5, 2.0, 18)),
            view_staleness_seconds: Histogram::new(exponential_buckets(1e-3, 2.0, 16)),
            sight_error_tokens: Histogram::new(SIGHT_BUCKETS),
            sight_predicted_tokens: Family::default(),
            sight_engine_tokens: Family::default(),
            // 10 µs .. ~1.3 s
            added_latency_seconds: Histogram::new(exponential_buckets(1e-5, 2.0, 18)),
            saturation_skips: Counter::default(),
            placements: Family::default(),
            home_handovers: Counter::default(),
            sidecars_refused: Family::default(),
            retries: Family::default(),
            stream_cuts: Family::default(),
            refused: Family::default(),
            config_reloads: Family::default(),
            tls_reloads: Family::default(),
            prefix_mode: Family::default(),
            tokenizer_checks: Family::default(),
            tokenizer_dialect: Family::default(),
            inflight_body_bytes: Gauge::default(),
            heavy_jobs: Gauge::default(),
            heavy_jobs_running: Gauge::default(),
            tokenizers_refused: Family::default(),
            pods: Family::default(),
            inflight: Family::default(),
            unrouted: Family::default(),
            report_age: Family::default(),
            hit_rate: Family::default(),
            flow: crate::flow::FlowMetrics::new(),
            prom: PromRegistry::default(),
        };
        m.flow.register(&mut prom);
        // prometheus-client appends `_total` to counters itself.
        m.register_picks(&mut prom);
        m.register_sight(&mut prom);
        m.register_replicas(&mut prom);
        m.register_outcomes(&mut prom);
        m.register_tokenizers(&mut prom);
        m.register_admission(&mut prom);
        m.register_pod_gauges(&mut prom);
        Metrics { prom, ..m }
    }

    /// What a pick costs and finds: requests, pick and tokenize times, match ratio, staleness.
    fn register_picks(&self, prom: &mut PromRegistry) {
        prom.register(
            "kvsight_router_requests",
            "Requests by pool, pod and HTTP status",
            self.requests.clone(),
        );
        prom.register(
            "kvsight_router_pick_seconds",
            "Time to pick a pod: hashing the prompt's blocks, waiting for the registry lock, filters and scorers",
            self.pick_seconds.clone(),
        );
        prom.register(
            "kvsight_router_prefix_match_ratio",
            "Matched blocks over chain length on the chosen pod",
            self.prefix_match_ratio.clone(),
        );
        prom.register(
            "kvsight_router_tokenize_seconds",
            "Time to tokenize and hash a prompt",
            self.tokenize_seconds.clone(),
        );
        prom.register(
            "kvsight_router_view_staleness_seconds",
            "A KV event published by an engine until this router's filter of that pod shows it (the sidecar's age of the delta plus half the QUIC round trip)",
            self.view_staleness_seconds.clone(),
        );
    }

    /// Sight (predicted against engine-reported cached tokens) and the latency the router adds.
    fn register_sight(&self, prom: &mut PromRegistry) {
        prom.register(
            "kvsight_router_sight_error_tokens",
            "Predicted minus engine-reported cached prompt tokens (usage.prompt_tokens_details.\
             cached_tokens), per answer that carried them: 0 is an exact view, below 0 the \
             engine had more cached than this router knew, above 0 less",
            self.sight_error_tokens.clone(),
        );
        prom.register(
            "kvsight_router_sight_predicted_cached_tokens",
            "Cached prompt tokens this router predicted, per pod, over the answers Sight measured",
            self.sight_predicted_tokens.clone(),
        );
        prom.register(
            "kvsight_router_sight_engine_cached_tokens",
            "Cached prompt tokens the engine reported, per pod, over the answers Sight measured",
            self.sight_engine_tokens.clone(),
        );
        prom.register(
            "kvsight_router_added_latency_seconds",
            "Time the router adds before a request reaches its pod: from the body read to the \
             send to the pod that answers (tokenizing, picking, retried picks)",
            self.added_latency_seconds.clone(),
        );
    }

    /// The saturation rule and what is shared with other replicas and sidecars.
    fn register_replicas(&self, prom: &mut PromRegistry) {
        prom.register(
            "kvsight_router_saturation_skips",
            "Pods left out of picks by the saturation rule (busy or tight pods that would start \
             the request later than the best free pod; full pods while one is not full)",
            self.saturation_skips.clone(),
        );
        prom.register(
            "kvsight_router_placements",
            "Requests sent to pods as told to the other router replicas through the pods' \
             sidecars, by outcome: shared (this replica's, handed to the sidecar), unsent (the \
             connection's queue was full: the other replicas never hear of it), received (the \
             other replicas' own)",
            self.placements.clone(),
        );
        prom.register(
            "kvsight_router_home_handovers",
            "Prefix depths whose home this replica gave one pod and then handed to another \
             replica's placement of the same prefix made about together (each replica settles \
             such a race the same way)",
            self.home_handovers.clone(),
        );
        prom.register(
            "kvsight_router_sidecars_refused",
            "Sidecar connections refused, by reason (handshake: TLS or certificate name, \
             version: protocol version mismatch, protocol: no Hello or a malformed frame, \
             advertised_url: a pod URL that is not the peer's own address)",
            self.sidecars_refused.clone(),
        );
    }

    /// Retries, cut streams, refusals and reloads.
    fn register_outcomes(&self, prom: &mut PromRegistry) {
        prom.register(
            "kvsight_router_retries",
            "Retries by reason (connect_refused, context_fallback)",
            self.retries.clone(),
        );
        prom.register(
            "kvsight_router_stream_cuts",
            "Streams ended with an SSE error event, by reason (deadline, upstream)",
            self.stream_cuts.clone(),
        );
        prom.register(
            "kvsight_router_refused",
            "Refusals by reason: body_bytes, body_read_time, header_read_time, header_bytes \
             (size or count of the request head), json_depth, chat_messages, prompt_bytes, \
             connections. Sidecars refused are in kvsight_router_sidecars_refused",
            self.refused.clone(),
        );
        prom.register(
            "kvsight_router_config_reloads",
            "Config file reloads by outcome (applied, rejected)",
            self.config_reloads.clone(),
        );
        prom.register(
            "kvsight_router_tls_reloads",
            "Looks at changed TLS files by outcome (applied, unchanged, rejected); applied \
             material is used by new sidecar handshakes",
            self.tls_reloads.clone(),
        );
    }

    /// Prefix mode, tokenizer checks and dialects, and tokenizers refused.
    fn register_tokenizers(&self, prom: &mut PromRegistry) {
        prom.register(
            "kvsight_router_prefix_mode",
            "Requests by prefix mode: exact (tokenizer) or approximate (router-side memory)",
            self.prefix_mode.clone(),
        );
        prom.register(
            "kvsight_router_tokenizer_checks",
            "Tokenizers compared with an engine's /tokenize, by model and outcome (agrees, \
             differs: the model is routed in approximate mode, error: no answer, tried again)",
            self.tokenizer_checks.clone(),
        );
        prom.register(
            "kvsight_router_tokenizer_dialect_info",
            "1 for the dialect each model's prompts are tokenized in: transformers4 (also until \
             the check), transformers5 (tokenizer.json as is) or transformers5_rebuilt \
             (transformers 5's LlamaTokenizer); no series while the model is in approximate mode",
            self.tokenizer_dialect.clone(),
        );
        prom.register(
            "kvsight_router_tokenizers_refused",
            "Tokenizers a sidecar sent that were not taken, by reason (unserved: a model the \
             sender does not serve, configured: the model's tokenizer comes from the config, \
             unusable: the files do not build a tokenizer)",
            self.tokenizers_refused.clone(),
        );
    }

    /// Bodies held and heavy jobs admitted.
    fn register_admission(&self, prom: &mut PromRegistry) {
        prom.register(
            "kvsight_router_inflight_body_bytes",
            "Bytes of request bodies this replica holds now: read, being read, or parsed (as \
             estimated); bounded by limits.inflightBodyBytes",
            self.inflight_body_bytes.clone(),
        );
        prom.register(
            "kvsight_router_heavy_jobs",
            "Heavy jobs (tokenizing and parsing large bodies, building sidecars' tokenizers) \
             admitted: waiting for a pool thread or running",
            self.heavy_jobs.clone(),
        );
        prom.register(
            "kvsight_router_heavy_jobs_running",
            "Heavy jobs running on a pool thread",
            self.heavy_jobs_running.clone(),
        );
    }

    /// The per-pod gauges recomputed from the registry at scrape time.
    fn register_pod_gauges(&self, prom: &mut PromRegistry) {
        prom.register(
            "kvsight_router_pods",
            "Registered pods by phase",
            self.pods.clone(),
        );
        prom.register(
            "kvsight_router_inflight",
            "This replica's in-flight requests per pod",
            self.inflight.clone(),
        );
        prom.register(
            "kvsight_router_unrouted",
            "Load on the pod that no router sent, as its sidecar reports it",
            self.unrouted.clone(),
        );
        prom.register(
            "kvsight_router_report_age_seconds",
            "Seconds since the pod's last load report",
            self.report_age.clone(),
        );
        prom.register(
            "kvsight_router_pod_prefix_cache_hit_ratio",
            "The pod's own prefix-cache hits over queries (tokens), from its reported counters",
            self.hit_rate.clone(),
        );
    }

    pub fn request(&self, pool: &str, pod: &str, code: u16) {
        self.requests
            .get_or_create(&vec![
                ("pool", pool.to_owned()),
                ("pod", pod.to_owned()),
                ("code", code.to_string()),
            ])
            .inc();
    }

    pub fn retry(&self, reason: &'static str) {
        self.retries
            .get_or_create(&vec![("reason", reason.to_owned())])
            .inc();
    }

    /// Sight for one answer: `predicted` cached prompt tokens at the pick, `engine` reported.
    pub fn sight(&self, pod: &str, predicted: u32, engine: u64) {
        let l = vec![("pod", pod.to_owned())];
        self.sight_predicted_tokens
            .get_or_create(&l)
            .inc_by(u64::from(predicted));
        self.sight_engine_tokens.get_or_create(&l).inc_by(engine);
        self.sight_error_tokens
            .observe(f64::from(predicted) - engine as f64);
    }

    pub fn placements(&self, outcome: &'static str, n: u64) {
        self.placements
            .get_or_create(&vec![("outcome", outcome.to_owned())])
            .inc_by(n);
    }

    pub fn sidecar_refused(&self, reason: &'static str) {
        self.sidecars_refused
            .get_or_create(&vec![("reason", reason.to_owned())])
            .inc();
    }

    pub fn tokenizer_refused(&self, reason: &'static str) {
        self.tokenizers_refused
            .get_or_create(&vec![("reason", reason.to_owned())])
            .inc();
    }

    pub fn cut(&self, reason: &'static str) {
        self.stream_cuts
            .get_or_create(&vec![("reason", reason.to_owned())])
            .inc();
    }

    pub fn refused(&self, reason: &'static str) {
        self.refused
            .get_or_create(&vec![("reason", reason.to_owned())])
            .inc();
    }

    pub fn reload(&self, outcome: &'static str) {
        self.config_reloads
            .get_or_create(&vec![("outcome", outcome.to_owned())])
            .inc();
    }

    pub fn tls_reload(&self, outcome: &'static str) {
        self.tls_reloads
            .get_or_create(&vec![("outcome", outcome.to_owned())])
            .inc();
    }

    pub fn mode(&self, model: &str, mode: &'static str) {
        self.prefix_mode
            .get_or_create(&vec![
                ("model", model.to_owned()),
                ("mode", mode.to_owned()),
            ])
            .inc();
    }

    pub fn tokenizer_check(&self, model: &str, outcome: &'static str) {
        self.tokenizer_checks
            .get_or_create(&vec![
                ("model", model.to_owned()),
                ("outcome", outcome.to_owned()),
            ])
            .inc();
    }

    /// Refreshes the per-pod gauges from the registry and the dialect gauge from the
    /// tokenizers, and renders the text exposition.
    pub fn render(&self, reg: &Registry, tokenizers: &[TokenizerStatus], now: Instant) -> String {
        self.tokenizer_dialect.clear();
        for t in tokenizers {
            if !matches!(t.verdict, Verdict::Differs(_)) {
                self.tokenizer_dialect
                    .get_or_create(&vec![
                        ("model", t.model.clone()),
                        ("dialect", t.dialect.as_str().to_owned()),
                    ])
                    .set(1);
            }
        }
        self.pods.clear();
        self.inflight.clear();
        self.unrouted.clear();
        self.report_age.clear();
        self.hit_rate.clear();
        for phase in Phase::ALL {
            self.pods
                .get_or_create(&vec![("phase", phase.as_str().to_owned())])
                .set(0);
        }
        for pod in reg.pods() {
            let l = vec![("pod", pod.key.clone())];
            self.pods
                .get_or_create(&vec![("phase", pod.phase().as_str().to_owned())])
                .inc();
            self.inflight.get_or_create(&l).set(i64::from(pod.inflight));
            if let Some(s) = &pod.load {
                self.unrouted
                    .get_or_create(&l)
                    .set(i64::from(s.load.unrouted));
                if s.load.prefix_cache_queries > 0 {
                    self.hit_rate
                        .get_or_create(&l)
                        .set(s.load.prefix_cache_hits as f64 / s.load.prefix_cache_queries as f64);
                }
            }
            self.report_age
                .get_or_create(&l)
                .set(pod.report_age(now).as_secs_f64());
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.prom);
        out
    }
}
