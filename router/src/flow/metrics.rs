//! Flow control's Prometheus metrics, registered with the router's own
//! ([`crate::metrics::Metrics`]). Tenants are labels only up to [`MAX_TENANT_LABELS`] distinct
//! names per replica (first come); the rest are counted as `other`, so API-key tenants cannot
//! grow the exposition without bound.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry as PromRegistry;

type Labels = Vec<(&'static str, String)>;

/// Distinct tenant label values kept per replica.
pub const MAX_TENANT_LABELS: usize = 64;

/// Flow control's metrics.
#[derive(Debug)]
pub struct FlowMetrics {
    depth: Family<Labels, Gauge>,
    wait: Family<Labels, Histogram, fn() -> Histogram>,
    shed: Family<Labels, Counter>,
    admitted: Family<Labels, Counter>,
    abandoned: Family<Labels, Counter>,
    tenants: Mutex<HashSet<String>>,
}

fn wait_histogram() -> Histogram {
    // 1 ms .. ~65 s
    Histogram::new(exponential_buckets(1e-3, 2.0, 17))
}

impl Default for FlowMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl FlowMetrics {
    pub fn new() -> Self {
        FlowMetrics {
            depth: Family::default(),
            wait: Family::new_with_constructor(wait_histogram),
            shed: Family::default(),
            admitted: Family::default(),
            abandoned: Family::default(),
            tenants: Mutex::new(HashSet::new()),
        }
    }

    pub fn register(&self, prom: &mut PromRegistry) {
        prom.register(
            "kvsight_router_flow_queue_depth",
            "Requests waiting in this replica's flow-control queue, by class and tenant",
            self.depth.clone(),
        );
        prom.register(
            "kvsight_router_flow_wait_seconds",
            "Time requests waited in the flow-control queue before a pod took them, by class \
             and tenant (requests admitted at once are not observed)",
            self.wait.clone(),
        );
        prom.register(
            "kvsight_router_flow_shed",
            "Requests answered 429 by flow control, by class and reason (predicted_wait: over \
             the class's maxWaitSeconds, deadline: past the request deadline, queue_full, \
             displaced: by a higher priority while the queue was full, wait_expired: still \
             queued at maxWaitSeconds)",
            self.shed.clone(),
        );
        prom.register(
            "kvsight_router_flow_admitted",
            "Requests flow control let through, by class and path (direct: a pod took it on \
             arrival, queued: after waiting)",
            self.admitted.clone(),
        );
        prom.register(
            "kvsight_router_flow_abandoned",
            "Queued requests whose client went away before a pod took them, by class",
            self.abandoned.clone(),
        );
    }

    fn tenant_label(&self, tenant: &str) -> String {
        let mut seen = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains(tenant) {
            return tenant.to_owned();
        }
        if seen.len() < MAX_TENANT_LABELS {
            seen.insert(tenant.to_owned());
            return tenant.to_owned();
        }
        "other".to_owned()
    }

    fn by_tenant(&self, class: &str, tenant: &str) -> Labels {
        vec![
            ("class", class.to_owned()),
            ("tenant", self.tenant_label(tenant)),
        ]
    }

    pub fn joined_queue(&self, class: &str, tenant: &str) {
        self.depth
            .get_or_create(&self.by_tenant(class, tenant))
            .inc();
    }

    pub fn left_queue(&self, class: &str, tenant: &str) {
        self.depth
            .get_or_create(&self.by_tenant(class, tenant))
            .dec();
    }

    pub fn waited(&self, class: &str, tenant: &str, d: Duration) {
        self.wait
            .get_or_create(&self.by_tenant(class, tenant))
            .observe(d.as_secs_f64());
    }

    pub fn shed(&self, class: &str, reason: &'static str) {
        self.shed
            .get_or_create(&vec![
                ("class", class.to_owned()),
                ("reason", reason.to_owned()),
            ])
            .inc();
    }

    pub fn admitted(&self, class: &str, path: &'static str) {
        self.admitted
            .get_or_create(&vec![
                ("class", class.to_owned()),
                ("path", path.to_owned()),
            ])
            .inc();
    }

    pub fn abandoned(&self, class: &str) {
        self.abandoned
            .get_or_create(&vec![("class", class.to_owned())])
            .inc();
    }
}
