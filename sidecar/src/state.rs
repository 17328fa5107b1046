//! State shared by the sidecar's tasks: the phase, vLLM's health, the engine facts, the mirror,
//! the latest load sample and what each router reported. Each piece has one writer.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Instant;

use kvsight_protocol::messages::{CloseReason, Load, Phase};
use tokio::sync::watch;

use crate::engine::Facts;
use crate::kv_events::subscriber::{SharedMirror, SubscriberStatus};
use crate::metrics::Metrics;

/// One load report as sampled, before a connection stamps its `seq` and `sample_age_ms`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadSample {
    pub sampled_at: Instant,
    pub load: Load,
}

/// A router connection as `/debug/state` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RouterInfo {
    pub address: String,
    pub router_id: Option<String>,
    pub connected: bool,
    pub inflight: u32,
    pub last_error: Option<String>,
}

fn guard<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section is a plain assignment; a poisoned lock holds consistent data.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Everything the tasks share.
#[derive(Debug)]
pub struct Shared {
    pub metrics: Arc<Metrics>,
    phase: watch::Sender<Phase>,
    healthy: AtomicBool,
    pub facts: OnceLock<Facts>,
    pub mirror: OnceLock<SharedMirror>,
    pub subscriber: OnceLock<watch::Receiver<SubscriberStatus>>,
    pub load: watch::Sender<Option<LoadSample>>,
    /// Signalled by the scraper when vLLM's counters went back (the engine restarted): the KV
    /// subscriber then rebuilds the mirror from the new process's history.
    pub engine_restarted: Arc<tokio::sync::Notify>,
    /// Router connection id → its last reported in-flight count.
    inflight: Mutex<HashMap<u64, u32>>,
    routers: Mutex<BTreeMap<String, RouterInfo>>,
    close_reason: Mutex<CloseReason>,
}

impl Default for Shared {
    fn default() -> Self {
        Self::new(Arc::new(Metrics::new()))
    }
}

impl Shared {
    /// Fresh state in phase Starting.
    pub fn new(metrics: Arc<Metrics>) -> Self {
        metrics.set_phase(Phase::Starting);
        Shared {
            metrics,
            phase: watch::channel(Phase::Starting).0,
            healthy: AtomicBool::new(false),
            facts: OnceLock::new(),
            mirror: OnceLock::new(),
            subscriber: OnceLock::new(),
            load: watch::channel(None).0,
            engine_restarted: Arc::new(tokio::sync::Notify::new()),
            inflight: Mutex::new(HashMap::new()),
            routers: Mutex::new(BTreeMap::new()),
            close_reason: Mutex::new(CloseReason::Shutdown),
        }
    }

    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    /// Follows phase changes.
    pub fn watch_phase(&self) -> watch::Receiver<Phase> {
        self.phase.subscribe()
    }

    /// Moves to `phase`. Draining is final: nothing but Draining follows it.
    pub fn set_phase(&self, phase: Phase) {
        self.phase.send_if_modified(|p| {
            if *p == phase || *p == Phase::Draining {
                return false;
            }
            tracing::info!(from = p.as_str(), to = phase.as_str(), "phase change");
            // The gauge changes before watchers wake, so whoever sees the new phase also reads
            // it in `/metrics`.
            self.metrics.set_phase(phase);
            *p = phase;
            true
        });
    }

    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    pub fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::Relaxed);
    }

    /// `/ready`: the pod takes traffic only when warmed up and vLLM answers.
    pub fn ready(&self) -> bool {
        self.phase() == Phase::Ready && self.healthy()
    }

    /// Records a router's in-flight count.
    pub fn set_inflight(&self, connection: u64, requests: u32) {
        guard(&self.inflight).insert(connection, requests);
    }

    /// Forgets a closed connection's in-flight count.
    pub fn clear_inflight(&self, connection: u64) {
        guard(&self.inflight).remove(&connection);
    }

    /// Sum of every router's in-flight count for this pod.
    pub fn inflight_total(&self) -> u64 {
        guard(&self.inflight).values().map(|&v| u64::from(v)).sum()
    }

    /// Updates the `/debug/state` row of `address`.
    pub fn update_router(&self, address: &str, f: impl FnOnce(&mut RouterInfo)) {
        let mut routers = guard(&self.routers);
        let info = routers
            .entry(address.to_owned())
            .or_insert_with(|| RouterInfo {
                address: address.to_owned(),
                router_id: None,
                connected: false,
                inflight: 0,
                last_error: None,
            });
        f(info);
    }

    /// Drops the row of a router address that no longer resolves.
    pub fn remove_router(&self, address: &str) {
        guard(&self.routers).remove(address);
    }

    pub fn routers(&self) -> Vec<RouterInfo> {
        guard(&self.routers).values().cloned().collect()
    }

    /// Why connections close when they do.
    pub fn close_reason(&self) -> CloseReason {
        *guard(&self.close_reason)
    }

    pub fn set_close_reason(&self, reason: CloseReason) {
        *guard(&self.close_reason) = reason;
    }
}
