//! The sidecar's own Prometheus metrics (`kvsight_sidecar_*`), registered once and shared by every
//! task through an `Arc`. Units are in the names; counters get `_total` from the encoder.

use std::sync::atomic::AtomicU64;

use kvsight_protocol::messages::Phase;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, String)>;

/// Every metric the sidecar exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub resident_blocks: Gauge,
    /// By event `type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, `Unknown`).
    pub kv_events: Family<Labels, Counter>,
    /// Payloads (or frames) that could not be decoded; skipped.
    pub kv_payloads_malformed: Counter,
    pub kv_event_gaps: Counter,
    /// Sequence restarts (vLLM restarted).
    pub kv_event_restarts: Counter,
    /// By `outcome`: `recovered`, `late_start` (history gone), `failed` (socket error/timeout).
    pub replays: Family<Labels, Counter>,
    /// Times the view was declared lost and rebuilt.
    pub cache_lost: Counter,
    pub routers_connected: Gauge,
    /// By `reason`: `refused` (router said no), `connect` (dial/TLS), `connection` (dropped).
    pub router_errors: Family<Labels, Counter>,
    /// Looks at changed TLS files, by outcome (applied, unchanged, rejected).
    pub tls_reloads: Family<Labels, Counter>,
    pub publish_bytes: Counter,
    /// Placements routers reported (`received`), sent on to the other routers (`relayed`), and
    /// lost by a connection that fell behind the relay (`dropped`).
    pub placements: Family<Labels, Counter>,
    /// 1 for the current phase, 0 for the others.
    pub phase: Family<Labels, Gauge>,
    pub unrouted_requests: Gauge,
    pub warmup_seconds: Gauge<f64, AtomicU64>,
    pub scrape_errors: Counter,
    /// 1 for each vLLM metric kvsight reads that the engine's exposition lacks.
    pub engine_metrics_missing: Family<Labels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric under the `kvsight_sidecar` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kvsight_sidecar");
        let m = Metrics {
            registry: Registry::default(),
            resident_blocks: Gauge::default(),
            kv_events: Family::default(),
            kv_payloads_malformed: Counter::default(),
            kv_event_gaps: Counter::default(),
            kv_event_restarts: Counter::default(),
            replays: Family::default(),
            cache_lost: Counter::default(),
            routers_connected: Gauge::default(),
            router_errors: Family::default(),
            tls_reloads: Family::default(),
            publish_bytes: Counter::default(),
            placements: Family::default(),
            phase: Family::default(),
            unrouted_requests: Gauge::default(),
            warmup_seconds: Gauge::default(),
            scrape_errors: Counter::default(),
            engine_metrics_missing: Family::default(),
        };
        let r = &mut registry;
        r.register(
            "resident_blocks",
            "GPU KV blocks resident in vLLM as the mirror sees them",
            m.resident_blocks.clone(),
        );
        r.register(
            "kv_events",
            "KV-cache events applied, by type",
            m.kv_events.clone(),
        );
        r.register(
            "kv_payloads_malformed",
            "KV-event messages that could not be decoded and were skipped",
            m.kv_payloads_malformed.clone(),
        );
        r.register(
            "kv_event_gaps",
            "Sequence gaps detected on the KV-event stream",
            m.kv_event_gaps.clone(),
        );
        r.register(
            "kv_event_restarts",
            "KV-event sequence restarts (vLLM restarted)",
            m.kv_event_restarts.clone(),
        );
        r.register("replays", "Replay attempts by outcome", m.replays.clone());
        r.register(
            "cache_lost",
            "Times KV history was lost and the mirror rebuilt",
            m.cache_lost.clone(),
        );
        r.register(
            "routers_connected",
            "Router replicas currently connected and welcomed",
            m.routers_connected.clone(),
        );
        r.register(
            "router_errors",
            "Router connection failures by reason",
            m.router_errors.clone(),
        );
        r.register(
            "tls_reloads",
            "Looks at changed TLS files by outcome (applied, unchanged, rejected); applied \
             material is used from the next router handshake",
            m.tls_reloads.clone(),
        );
        r.register(
            "publish_bytes",
            "Bytes sent to routers",
            m.publish_bytes.clone(),
        );
        r.register(
            "placements",
            "Requests routers reported sending here, by outcome: received, relayed to another \
             router replica, or dropped by a connection that fell behind",
            m.placements.clone(),
        );
        r.register("phase", "1 for the current phase", m.phase.clone());
        r.register(
            "unrouted_requests",
            "vLLM running+waiting requests that no router reports in flight",
            m.unrouted_requests.clone(),
        );
        r.register(
            "warmup_seconds",
            "Duration of the warm-up plan",
            m.warmup_seconds.clone(),
        );
        r.register(
            "scrape_errors",
            "Failed scrapes of vLLM /metrics",
            m.scrape_errors.clone(),
        );
        r.register(
            "engine_metrics_missing",
            "1 for each vLLM metric kvsight reads that the engine does not export (read as a default)",
            m.engine_metrics_missing.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Marks `phase` as the current one.
    pub fn set_phase(&self, phase: Phase) {
        for p in Phase::ALL {
            self.phase
                .get_or_create(&vec![("phase", p.as_str().to_owned())])
                .set(i64::from(p == phase));
        }
    }

    /// Counts one event of `kind`.
    pub fn count_event(&self, kind: &str) {
        self.kv_events
            .get_or_create(&vec![("type", kind.to_owned())])
            .inc();
    }

    /// Counts one replay with `outcome`.
    pub fn count_replay(&self, outcome: &str) {
        self.replays
            .get_or_create(&vec![("outcome", outcome.to_owned())])
            .inc();
    }

    /// Counts one router failure for `reason`.
    pub fn count_tls_reload(&self, outcome: &str) {
        self.tls_reloads
            .get_or_create(&vec![("outcome", outcome.to_owned())])
            .inc();
    }

    pub fn count_placements(&self, outcome: &'static str, n: u64) {
        self.placements
            .get_or_create(&vec![("outcome", outcome.to_owned())])
            .inc_by(n);
    }

    pub fn count_router_error(&self, reason: &str) {
        self.router_errors
            .get_or_create(&vec![("reason", reason.to_owned())])
            .inc();
    }

    /// Records which expected vLLM metrics the last scrape lacked; returns those newly missing.
    pub fn set_missing(&self, missing: &[&'static str]) -> Vec<&'static str> {
        let mut newly = Vec::new();
        for name in crate::scrape::EXPECTED {
            let g = self
                .engine_metrics_missing
                .get_or_create(&vec![("metric", name.to_owned())]);
            let is = missing.contains(&name);
            if is && g.get() == 0 {
                newly.push(name);
            }
            g.set(i64::from(is));
        }
        newly
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
