//! Flow control: priorities, fair shares between tenants, and admission that keeps each pod's
//! predicted wait within a budget instead of letting the pods' queues absorb a burst.
//!
//! Off (`flowControl.enabled: false`, the default) the proxy never calls in here. On, the first
//! attempt of every request goes through [`admit`]:
//!
//! 1. [`classify`] gives it a class (priority, budgets) and a tenant.
//! 2. While nothing waits for its model, it is picked at once through the scheduler's gate
//!    ([`crate::scheduler::Scheduler::pick_within`]): only pods that are free and predicted to
//!    start its prefill within the class's budget compete, scored as usual. A tenant within its
//!    fair share of the model's recent traffic may also use the KV headroom that
//!    `kvThreshold` keeps, so one tenant's burst, held at the threshold, does not hold back
//!    the others.
//! 3. Otherwise it joins this replica's [`queue`] — unless the queue is full (a lower-priority
//!    entry is displaced if there is one), or its predicted wait there (the tokens ahead of it at
//!    the rate the queue has been draining) is over its class's `maxWaitSeconds` or past its
//!    request deadline: then the answer is 429 with `Retry-After` at once.
//! 4. The queue is worked off by [`FlowControl::pass`] whenever capacity may have freed: a
//!    request of this router finished or got its first token, a pod reported its load, a pod
//!    joined or left, the config was reloaded (the registry's change signal; no timer polls).
//!    Each entry is picked when it leaves, with the pods' cache view of that moment.
//! 5. A waiting request leaves the queue when its client goes away (its future is dropped) and
//!    is answered 429 if it is still there at its class's `maxWaitSeconds`.
//!
//! Replicas: each replica queues its own arrivals; see `docs/flow-control.md`.

pub mod classify;
pub mod config;
pub mod metrics;
pub mod queue;

use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant as TokioInstant;
use tokio_util::sync::CancellationToken;

pub use classify::{Classified, PRIORITY_HEADER, TENANT_HEADER, classify};
pub use config::{ClassConfig, FlowControlConfig, RuleConfig};
pub use metrics::FlowMetrics;

use crate::error::ApiError;
use crate::scheduler::{Decision, Gate};
use crate::state::{Live, State};
use queue::{Join, Queue};

/// Output tokens assumed for a request that does not bound them (`max_tokens` absent): what it
/// is charged in its tenant's share until it is measured otherwise.
pub const DEFAULT_OUTPUT_TOKENS: u64 = 256;

/// Longest `Retry-After` given, in seconds.
const MAX_RETRY_AFTER_S: u64 = 60;

/// A pick that flow control let through.
#[derive(Debug, Clone)]
pub struct Admitted {
    pub decision: Decision,
    /// The pool it was made in, by name (a reload may have replaced the config it came from).
    pub pool: Option<String>,
    /// When the pick was recorded (what `record_done` is given when nobody takes the pick).
    pub picked_at: Instant,
}

/// Picks for a request through the scheduler's [`Gate`]: `Err(ApiError::OverBudget)` when no
/// pod can take it within the gate (nothing recorded), any other error when it can never be
/// picked. Owned, since the queue may run it from another task.
pub type TryPick = Box<dyn Fn(&State, &Live, Gate) -> Result<Admitted, ApiError> + Send + Sync>;

/// What flow control needs to know of a request.
#[derive(Debug, Clone, Copy)]
pub struct Ticket<'a> {
    pub model: &'a str,
    pub headers: &'a HeaderMap,
    pub prompt_tokens: u32,
    /// The body as sent (its `max_tokens` is read; its length counts towards the queue's bytes).
    pub body: &'a [u8],
    pub deadline: TokioInstant,
}

/// A queued request's side of the queue.
struct Waiter {
    class: String,
    try_pick: TryPick,
    tx: oneshot::Sender<Result<Admitted, ApiError>>,
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("class", &self.class)
            .finish_non_exhaustive()
    }
}

/// One replica's flow control: the queue and its dispatcher.
#[derive(Debug)]
pub struct FlowControl {
    queue: Mutex<Queue<Waiter>>,
    /// Signalled when capacity may have freed (the registry's, and config reloads).
    signal: Arc<Notify>,
    dispatcher: std::sync::Once,
    stop: CancellationToken,
    /// The queue's length after every change, watchable (tests and operators wait on it).
    len: tokio::sync::watch::Sender<usize>,
}

impl Drop for FlowControl {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl FlowControl {
    /// Flow control woken by `signal` (the registry's change signal).
    pub fn new(signal: Arc<Notify>) -> Self {
        FlowControl {
            queue: Mutex::new(Queue::default()),
            signal,
            dispatcher: std::sync::Once::new(),
            stop: CancellationToken::new(),
            len: tokio::sync::watch::Sender::new(0),
        }
    }

    /// The queue, locked. Its guard publishes the length when it is released; the lock is
    /// always taken before the registry's.
    fn queue(&self) -> QueueGuard<'_> {
        QueueGuard {
            q: self.queue.lock().unwrap_or_else(|e| e.into_inner()),
            len: &self.len,
        }
    }

    /// The number of queued requests, watchable: changes as requests join and leave.
    pub fn watch_queued(&self) -> tokio::sync::watch::Receiver<usize> {
        self.len.subscribe()
    }

    /// Wakes the dispatcher: capacity may have freed, or the config changed.
    pub fn kick(&self) {
        self.signal.notify_one();
    }

    /// Requests queued on this replica.
    pub fn queued(&self) -> usize {
        self.queue().len()
    }

    /// Requests queued for `model`.
    pub fn queued_for(&self, model: &str) -> usize {
        self.queue().lane_len(model)
    }

    /// Starts the task that runs [`Self::pass`] on every signal, once.
    fn ensure_dispatcher(&self, state: &Arc<State>) {
        self.dispatcher.call_once(|| {
            let weak: Weak<State> = Arc::downgrade(state);
            let (signal, stop) = (self.signal.clone(), self.stop.clone());
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = signal.notified() => {}
                        _ = stop.cancelled() => return,
                    }
                    let Some(state) = weak.upgrade() else { return };
                    let mut q = state.flow.queue();
                    state.flow.pass(&state, &mut q);
                }
            });
        });
    }

    /// Works off what can leave the queue now, per model: the entry next in order is picked
    /// under its class's budget; when no pod can take it, a tenant of the same band that is
    /// within its fair share may still go into the KV headroom the next one may not use (so a
    /// burst of one tenant cannot hold the others back), and then the lane waits — nothing of
    /// a lower priority goes before it. With flow control turned off by a reload, everything
    /// leaves.
    fn pass(&self, state: &State, q: &mut Queue<Waiter>) {
        if q.is_empty() {
            return;
        }
        let live = state.live();
        let cfg = &live.config.flow_control;
        for lane in q.lanes() {
            // Each turn removes an entry or stops: bounded by the lane's length.
            for _ in 0..q.lane_len(&lane) {
                let Some(head) = q.peek(&lane) else { break };
                let mut tries = vec![(head.id, head.tenant.clone())];
                tries.extend(q.band_heads(&lane));
                let now = TokioInstant::now();
                let mut left = false;
                for (i, (id, tenant)) in tries.into_iter().enumerate() {
                    let headroom = q.within_share(&lane, &tenant, now);
                    if i > 0 && !headroom {
                        continue;
                    }
                    if self.try_leave(state, &live, cfg, q, id, headroom) {
                        left = true;
                        break;
                    }
                }
                if !left {
                    break;
                }
            }
        }
    }

    /// Tries to let entry `id` go; whether it left the queue (picked, or failed for good).
    fn try_leave(
        &self,
        state: &State,
        live: &Live,
        cfg: &FlowControlConfig,
        q: &mut Queue<Waiter>,
        id: u64,
        kv_headroom: bool,
    ) -> bool {
        let Some(entry) = q.get(id) else { return false };
        // The default class's gate when a reload removed the request's class.
        let class = cfg
            .class(&entry.payload.class)
            .or_else(|| cfg.class(&cfg.default_class));
        let gate = match class {
            Some(c) if cfg.enabled => gate_of(cfg, c, kv_headroom),
            _ => Gate::OPEN,
        };
        let result = (entry.payload.try_pick)(state, live, gate);
        if matches!(result, Err(ApiError::OverBudget { .. })) {
            return false;
        }
        let now = TokioInstant::now();
        let entry = if result.is_ok() {
            q.dispatch(id, now)
        } else {
            q.remove(id, now)
        };
        let Some(entry) = entry else { return false };
        let m = &state.metrics.flow;
        m.left_queue(&entry.payload.class, &entry.tenant);
        if result.is_ok() {
            m.admitted(&entry.payload.class, "queued");
            m.waited(
                &entry.payload.class,
                &entry.tenant,
                now.saturating_duration_since(entry.enqueued),
            );
        }
        if let Err(Ok(a)) = entry.payload.tx.send(result) {
            // The client left between the pick and now: the pod never gets it.
            undo(state, &a);
        }
        true
    }
}

/// The locked queue; publishes its length when released.
struct QueueGuard<'a> {
    q: MutexGuard<'a, Queue<Waiter>>,
    len: &'a tokio::sync::watch::Sender<usize>,
}

impl std::ops::Deref for QueueGuard<'_> {
    type Target = Queue<Waiter>;
    fn deref(&self) -> &Self::Target {
        &self.q
    }
}

impl std::ops::DerefMut for QueueGuard<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.q
    }
}

impl Drop for QueueGuard<'_> {
    fn drop(&mut self) {
        let n = self.q.len();
        self.len.send_if_modified(|v| std::mem::replace(v, n) != n);
    }
}

/// The gate a request of `class` passes: its effective budget and KV ceiling.
fn gate_of(cfg: &FlowControlConfig, class: &ClassConfig, kv_headroom: bool) -> Gate {
    Gate {
        wait_budget_s: cfg.effective_budget(class),
        kv_headroom,
        kv_ceiling: cfg.effective_kv_ceiling(class),
    }
}

/// A pick that nobody will send: counted as finished at once.
fn undo(state: &State, a: &Admitted) {
    state
        .registry()
        .record_done(&a.decision.pod, a.picked_at, Instant::now());
}

/// `max_tokens` (or `max_completion_tokens`) of a request body, if it has one.
fn max_output_tokens(body: &[u8]) -> Option<u64> {
    #[derive(serde::Deserialize)]
    struct Bounds {
        max_tokens: Option<u64>,
        max_completion_tokens: Option<u64>,
    }
    let b: Bounds = serde_json::from_slice(body).ok()?;
    b.max_completion_tokens.or(b.max_tokens)
}

/// Seconds to tell a shed client to wait: the predicted wait, at least one second.
fn retry_after(wait: Duration) -> u64 {
    (wait.as_secs_f64().ceil() as u64).clamp(1, MAX_RETRY_AFTER_S)
}

fn shed(state: &State, class: &str, reason: &'static str, wait: Duration) -> ApiError {
    state.metrics.flow.shed(class, reason);
    let message = match reason {
        "queue_full" => "the router's queue is full; retry later".to_owned(),
        "displaced" => {
            "the router's queue is full and a request of a higher priority took this one's place; retry later"
                .to_owned()
        }
        "deadline" => format!(
            "the request is predicted to wait {:.1} s for a pod, past its deadline; retry later",
            wait.as_secs_f64()
        ),
        "wait_expired" => format!(
            "no pod could take the request within its class's wait of {:.1} s; retry later",
            wait.as_secs_f64()
        ),
        _ => format!(
            "the request is predicted to wait {:.1} s for a pod, over its class's budget; retry later",
            wait.as_secs_f64()
        ),
    };
    ApiError::Shed {
        reason,
        retry_after_s: retry_after(wait),
        message,
    }
}

/// The waiting side of a queued request. Dropped before an answer (the client went away), it
/// takes the entry out of the queue, or gives back a pick the dispatcher made meanwhile.
struct Queued {
    state: Arc<State>,
    id: u64,
    class: String,
    tenant: String,
    rx: oneshot::Receiver<Result<Admitted, ApiError>>,
    answered: bool,
}

impl Drop for Queued {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let removed = self.state.flow.queue().remove(self.id, TokioInstant::now());
        if removed.is_some() {
            let m = &self.state.metrics.flow;
            m.left_queue(&self.class, &self.tenant);
            m.abandoned(&self.class);
            return;
        }
        self.rx.close();
        if let Ok(Ok(a)) = self.rx.try_recv() {
            undo(&self.state, &a);
        }
    }
}

/// Lets the first attempt of a request through flow control (see the module docs): its pick,
/// or the error to answer (429 when shed).
pub async fn admit(
    state: &Arc<State>,
    live: &Live,
    t: Ticket<'_>,
    try_pick: TryPick,
) -> Result<Admitted, ApiError> {
    let cfg = &live.config.flow_control;
    let Classified { class, tenant } = classify(cfg, t.model, t.headers);
    let Some(class_cfg) = cfg.class(&class) else {
        // `classify` only returns configured classes.
        return try_pick(state, live, Gate::OPEN);
    };
    let cost =
        u64::from(t.prompt_tokens) + max_output_tokens(t.body).unwrap_or(DEFAULT_OUTPUT_TOKENS);
    let bytes = t.body.len() + 4 * t.prompt_tokens as usize;
    let m = &state.metrics.flow;
    let (id, rx, expiry, wait_for) = {
        let mut q = state.flow.queue();
        let now = TokioInstant::now();
        if q.lane_len(t.model) == 0 {
            let gate = gate_of(cfg, class_cfg, q.within_share(t.model, &tenant, now));
            match try_pick(state, live, gate) {
                Err(ApiError::OverBudget { .. }) => {}
                other => {
                    if other.is_ok() {
                        m.admitted(&class, "direct");
                        q.note_served(t.model, &tenant, cost, now);
                    }
                    return other;
                }
            }
        }
        let max_wait = class_cfg.max_wait();
        let until_deadline = t.deadline.saturating_duration_since(now);
        let wait_for = max_wait.min(until_deadline);
        let join = Join {
            lane: t.model.to_owned(),
            priority: class_cfg.priority,
            tenant: tenant.clone(),
            cost,
            bytes,
            deadline: now + wait_for,
            payload: (),
        };
        let predicted = q.drain_rate(t.model).map_or(Duration::ZERO, |rate| {
            Duration::from_secs_f64(q.tokens_ahead(&join) as f64 / rate)
        });
        if predicted > max_wait {
            return Err(shed(state, &class, "predicted_wait", predicted));
        }
        if predicted > until_deadline {
            return Err(shed(state, &class, "deadline", predicted));
        }
        make_room(
            state,
            cfg,
            &mut q,
            class_cfg.priority,
            bytes,
            &class,
            predicted,
        )?;
        let (tx, rx) = oneshot::channel();
        let id = q.push(
            Join {
                lane: join.lane,
                priority: join.priority,
                tenant: join.tenant,
                cost,
                bytes,
                deadline: join.deadline,
                payload: Waiter {
                    class: class.clone(),
                    try_pick,
                    tx,
                },
            },
            now,
        );
        m.joined_queue(&class, &tenant);
        // It may go at once: capacity freed between the failed pick and now, or it outranks
        // what was waiting.
        state.flow.pass(state, &mut q);
        (id, rx, now + wait_for, wait_for)
    };
    state.flow.ensure_dispatcher(state);
    let queued = Queued {
        state: state.clone(),
        id,
        class,
        tenant,
        rx,
        answered: false,
    };
    wait(queued, expiry, wait_for).await
}

/// Makes room for an entry of `priority` holding `bytes`: displaces lower priorities while the
/// queue is full (each answered 429), or sheds the arrival when nothing lower is there.
fn make_room(
    state: &State,
    cfg: &FlowControlConfig,
    q: &mut Queue<Waiter>,
    priority: i32,
    bytes: usize,
    class: &str,
    predicted: Duration,
) -> Result<(), ApiError> {
    let full = |q: &Queue<Waiter>| {
        q.len() >= cfg.max_queued_requests || q.bytes() + bytes > cfg.max_queued_bytes
    };
    // Bounded: each turn displaces one entry.
    for _ in 0..cfg.max_queued_requests.max(1) {
        if !full(q) {
            return Ok(());
        }
        let Some(victim) = q.displaceable(priority) else {
            break;
        };
        if let Some(v) = q.remove(victim, TokioInstant::now()) {
            state.metrics.flow.left_queue(&v.payload.class, &v.tenant);
            let err = shed(state, &v.payload.class, "displaced", predicted);
            let _ = v.payload.tx.send(Err(err));
        }
    }
    if full(q) {
        return Err(shed(state, class, "queue_full", predicted));
    }
    Ok(())
}

/// Waits for a queued request's pick, or answers 429 when it is still queued at `expiry`.
async fn wait(
    mut queued: Queued,
    expiry: TokioInstant,
    wait_for: Duration,
) -> Result<Admitted, ApiError> {
    let result = tokio::select! {
        r = &mut queued.rx => r,
        _ = tokio::time::sleep_until(expiry) => {
            let state = queued.state.clone();
            let removed = state.flow.queue().remove(queued.id, TokioInstant::now());
            match removed {
                Some(_) => {
                    state.metrics.flow.left_queue(&queued.class, &queued.tenant);
                    queued.answered = true;
                    return Err(shed(&state, &queued.class, "wait_expired", wait_for));
                }
                // Dispatched meanwhile: the answer is in the channel.
                None => (&mut queued.rx).await,
            }
        }
    };
    queued.answered = true;
    result.unwrap_or(Err(ApiError::ShuttingDown))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::http::HeaderValue;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::config::RouterConfig;

    const CFG: &str = "
flowControl:
  enabled: true
  defaultClass: lo
  classes:
    - {name: hi, priority: 5, ttftBudgetSeconds: 0.1, maxWaitSeconds: 2}
    - {name: lo, priority: 0, ttftBudgetSeconds: 0.1, maxWaitSeconds: 10}
";

    fn state() -> Arc<State> {
        let cfg = RouterConfig::from_yaml(CFG).unwrap();
        State::new(cfg, "t".into(), None, CancellationToken::new()).unwrap()
    }

    fn decision() -> Decision {
        Decision {
            pod: "nowhere/pod".into(),
            url: "http://127.0.0.1:9".into(),
            total: 0.0,
            margin: 0.0,
            scores: Vec::new(),
            predicted_cached_tokens: 0,
            matched_blocks: 0,
            chain_len: 0,
            predicted_ttft_s: 0.0,
            all_saturated: false,
            least_request: false,
            candidates: 1,
            saturation_skipped: 0,
            placement_shared: None,
        }
    }

    /// A pick that succeeds while `permits` lasts, each success taking one.
    fn try_pick(permits: &Arc<AtomicUsize>) -> TryPick {
        let permits = permits.clone();
        Box::new(move |_, _, _: Gate| {
            permits
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |p| p.checked_sub(1))
                .map(|_| Admitted {
                    decision: decision(),
                    pool: None,
                    picked_at: Instant::now(),
                })
                .map_err(|_| ApiError::OverBudget { wait_s: 1.0 })
        })
    }

    /// Runs `admit` for a request of `class` with `tokens` (prompt and output alike) in a task.
    fn spawn(
        st: &Arc<State>,
        permits: &Arc<AtomicUsize>,
        class: &str,
        tokens: u32,
    ) -> tokio::task::JoinHandle<Result<Admitted, ApiError>> {
        let (st, pick) = (st.clone(), try_pick(permits));
        let mut headers = HeaderMap::new();
        headers.insert(PRIORITY_HEADER, HeaderValue::from_str(class).unwrap());
        let body = format!(r#"{{"max_tokens": {tokens}}}"#).into_bytes();
        tokio::spawn(async move {
            let live = st.live();
            let t = Ticket {
                model: "m",
                headers: &headers,
                prompt_tokens: tokens,
                body: &body,
                deadline: TokioInstant::now() + Duration::from_secs(3600),
            };
            admit(&st, &live, t, pick).await
        })
    }

    async fn queued(st: &State, n: usize) {
        let mut w = st.flow.watch_queued();
        tokio::time::timeout(Duration::from_secs(60), w.wait_for(|q| *q == n))
            .await
            .unwrap_or_else(|_| panic!("{n} queued: {}", st.flow.queued()))
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_still_queued_at_its_class_wait_is_answered_429_then() {
        let st = state();
        let none = Arc::new(AtomicUsize::new(0));
        let t0 = TokioInstant::now();
        let r = spawn(&st, &none, "hi", 10).await.unwrap();
        // Paused time: the only timer is the class's two seconds.
        assert_eq!(t0.elapsed(), Duration::from_secs(2));
        match r {
            Err(ApiError::Shed {
                reason: "wait_expired",
                retry_after_s,
                ..
            }) => assert_eq!(retry_after_s, 2),
            other => panic!("{other:?}"),
        }
        assert_eq!(st.flow.queued(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn capacity_freeing_releases_the_queue_without_a_timer() {
        let st = state();
        let permits = Arc::new(AtomicUsize::new(0));
        let a = spawn(&st, &permits, "lo", 10);
        queued(&st, 1).await;
        // Nothing happens while nothing frees: the queue holds.
        tokio::task::yield_now().await;
        assert_eq!(st.flow.queued(), 1);
        permits.store(1, Ordering::SeqCst);
        st.registry().changes().notify_one();
        let t0 = TokioInstant::now();
        assert!(a.await.unwrap().is_ok());
        assert_eq!(
            t0.elapsed(),
            Duration::ZERO,
            "released by the signal, not a timer"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_predicted_wait_over_the_class_budget_is_answered_at_once() {
        let st = state();
        let permits = Arc::new(AtomicUsize::new(0));
        // Measure the drain rate: 500-token requests (250 prompt, 250 output) leaving one a
        // second while the queue is backlogged: 500 tokens/s.
        let mut first = Vec::new();
        for i in 0..4 {
            first.push(spawn(&st, &permits, "lo", 250));
            queued(&st, i + 1).await;
        }
        for i in 0..3 {
            tokio::time::advance(Duration::from_secs(1)).await;
            permits.store(1, Ordering::SeqCst);
            st.flow.kick();
            queued(&st, 3 - i).await;
        }
        // Ten more of 500 tokens: 5,500 tokens (11 s at that rate) wait ahead of the next.
        let mut rest = Vec::new();
        for i in 0..10 {
            rest.push(spawn(&st, &permits, "lo", 250));
            queued(&st, 2 + i).await;
        }
        let t0 = TokioInstant::now();
        let r = spawn(&st, &permits, "lo", 250).await.unwrap();
        assert_eq!(t0.elapsed(), Duration::ZERO, "answered at once");
        match r {
            Err(ApiError::Shed {
                reason: "predicted_wait",
                retry_after_s,
                ..
            }) => assert!((10..=12).contains(&retry_after_s), "{retry_after_s}"),
            other => panic!("{other:?}"),
        }
        // A higher class waits for nothing below it: it joins, and goes first.
        let hi = spawn(&st, &permits, "hi", 250);
        queued(&st, 12).await;
        permits.store(1, Ordering::SeqCst);
        st.flow.kick();
        assert!(hi.await.unwrap().is_ok());
        assert_eq!(st.flow.queued(), 11);
        for t in first.into_iter().chain(rest) {
            t.abort();
        }
    }
}
