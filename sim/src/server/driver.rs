//! The engine driver: one tokio task owns the [`Engine`] and is the only thing that touches it.
//! HTTP handlers talk to it over a channel (submit, abort, reset, faults); it runs
//! [`Engine::step`], lets each step's simulated `duration` pass with `tokio::time::sleep` (so
//! tests can pause time), routes every [`RequestOutput`] to its request's channel, feeds the
//! metrics and publishes one KV-event batch per step that produced events. With no work (or
//! hung) it waits on the channel, so an idle pod costs nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::SimConfig;
use super::metrics::Metrics;
use crate::engine::{Engine, EngineKvEvent, EngineStats, Request, RequestOutput, StepOutput};
use crate::kv_events::{
    BlockHash, BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent, KvEventPublisher,
};

/// What a request's handler receives.
#[derive(Debug)]
pub(crate) enum Event {
    /// One step's output for this request.
    Output(RequestOutput),
    /// The engine failed the request (dead engine); no more events follow.
    Error(String),
}

/// Requests from handlers and the pod handle.
#[derive(Debug)]
pub(crate) enum Command {
    Submit {
        request: Request,
        sink: mpsc::UnboundedSender<Event>,
    },
    Abort(String),
    ResetPrefixCache(oneshot::Sender<bool>),
    SetDead(bool),
    SetHung(bool),
    SetSlowdown(f64),
    /// Test-only ground truth: the engine's resident block hashes, read between steps.
    ResidentBlocks(oneshot::Sender<Vec<u64>>),
}

/// What vLLM 0.33 tells clients when the engine core died (`EngineDeadError.CLIENT_MESSAGE`,
/// sent as a 500 `InternalServerError`).
pub(crate) const ENGINE_DEAD_MESSAGE: &str =
    "The server had an error while processing your request.";

/// State read by HTTP handlers without going through the driver.
#[derive(Debug)]
pub(crate) struct Shared {
    dead: AtomicBool,
    metrics: Mutex<Metrics>,
}

impl Shared {
    pub(crate) fn new(config: &SimConfig) -> Self {
        Self {
            dead: AtomicBool::new(false),
            metrics: Mutex::new(Metrics::new(config, wall_clock())),
        }
    }

    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Relaxed)
    }

    pub(crate) fn metrics(&self) -> MutexGuard<'_, Metrics> {
        // A panic while holding the lock cannot leave the counters inconsistent enough to matter.
        self.metrics.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Seconds since the Unix epoch, as Python's `time.time()`.
pub(crate) fn wall_clock() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

struct InFlight {
    sink: mpsc::UnboundedSender<Event>,
    arrived: Instant,
    prompt_len: usize,
    lora: Option<String>,
    started: bool,
    /// Tokens generated but not yet delivered (`--stream-interval` above 1).
    held: Option<RequestOutput>,
}

/// The task state. See the module docs.
pub(crate) struct Driver {
    engine: Engine,
    commands: mpsc::UnboundedReceiver<Command>,
    shared: Arc<Shared>,
    publisher: Option<Arc<KvEventPublisher>>,
    in_flight: HashMap<String, InFlight>,
    hung: bool,
    slowdown: f64,
    /// vLLM's `--stream-interval`: after the first token, outputs are delivered once this many
    /// tokens accumulated, or when the request finishes.
    stream_interval: usize,
}

impl Driver {
    pub(crate) fn new(
        engine: Engine,
        commands: mpsc::UnboundedReceiver<Command>,
        shared: Arc<Shared>,
        publisher: Option<Arc<KvEventPublisher>>,
        stream_interval: usize,
    ) -> Self {
        Self {
            engine,
            commands,
            shared,
            publisher,
            in_flight: HashMap::new(),
            hung: false,
            slowdown: 1.0,
            stream_interval: stream_interval.max(1),
        }
    }

    pub(crate) async fn run(mut self) {
        loop {
            while let Ok(cmd) = self.commands.try_recv() {
                self.handle(cmd);
            }
            if self.hung || !self.engine.has_work() {
                match self.commands.recv().await {
                    Some(cmd) => self.handle(cmd),
                    None => return,
                }
                continue;
            }
            // The step's results exist only once its simulated time has passed.
            let out = self.engine.step();
            self.refresh_gauges();
            let duration = out.duration.mul_f64(self.slowdown.min(1e6));
            if duration.is_zero() {
                // Never monopolise the runtime, even when time is scaled to zero.
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(duration).await;
            }
            self.deliver(out);
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { request, sink } => {
                if self.shared.is_dead() {
                    let _ = sink.send(Event::Error(ENGINE_DEAD_MESSAGE.to_owned()));
                    return;
                }
                let id = request.id.clone();
                let prompt_len = request.prompt_token_ids.len();
                let lora = request.lora_name.clone();
                match self.engine.submit(request) {
                    Ok(()) => {
                        self.in_flight.insert(
                            id,
                            InFlight {
                                sink,
                                arrived: Instant::now(),
                                prompt_len,
                                lora,
                                started: false,
                                held: None,
                            },
                        );
                    }
                    Err(e) => {
                        let _ = sink.send(Event::Error(e.to_string()));
                    }
                }
                self.refresh_gauges();
            }
            Command::Abort(id) => {
                if self.in_flight.remove(&id).is_some() {
                    self.engine.abort(&id);
                    self.shared.metrics().finished("abort");
                    self.refresh_gauges();
                }
            }
            Command::ResetPrefixCache(reply) => {
                let ok = self.engine.reset_prefix_cache();
                // The reset's AllBlocksCleared goes out at once, not with the next step.
                let events = self.engine.take_events();
                self.publish(events);
                self.refresh_gauges();
                let _ = reply.send(ok);
            }
            Command::SetDead(dead) => {
                self.shared.dead.store(dead, Ordering::Relaxed);
                if dead {
                    for (id, req) in self.in_flight.drain() {
                        self.engine.abort(&id);
                        let _ = req.sink.send(Event::Error(ENGINE_DEAD_MESSAGE.to_owned()));
                    }
                    self.refresh_gauges();
                }
            }
            Command::SetHung(hung) => self.hung = hung,
            Command::ResidentBlocks(reply) => {
                let _ = reply.send(self.engine.resident_block_hashes());
            }
            Command::SetSlowdown(factor) => self.slowdown = factor,
        }
    }

    /// Publishes a finished step's events and routes its outputs.
    fn deliver(&mut self, out: StepOutput) {
        self.publish(out.events);
        let now = Instant::now();
        let mut finished_reasons = Vec::new();
        {
            let mut metrics = self.shared.metrics();
            for output in &out.outputs {
                let Some(req) = self.in_flight.get_mut(&output.id) else {
                    continue;
                };
                if output.first_token && !req.started {
                    req.started = true;
                    metrics.first_token(
                        now.duration_since(req.arrived),
                        req.prompt_len.saturating_sub(output.num_cached_tokens),
                    );
                }
                if let Some(reason) = output.finished {
                    metrics.e2e(now.duration_since(req.arrived));
                    finished_reasons.push(reason.as_str());
                }
            }
        }
        for output in out.outputs {
            let id = output.id.clone();
            let finished = output.finished.is_some();
            let Some(req) = self.in_flight.get_mut(&id) else {
                continue;
            };
            // vLLM's output processor with `stream_interval > 1`: the first token at once, then
            // every `stream_interval` tokens, and whatever is left when the request finishes.
            let output = match req.held.take() {
                Some(mut held) => {
                    held.new_token_ids.extend_from_slice(&output.new_token_ids);
                    held.finished = output.finished;
                    held.num_cached_tokens = output.num_cached_tokens;
                    held
                }
                None => output,
            };
            if !finished && !output.first_token && output.new_token_ids.len() < self.stream_interval
            {
                req.held = Some(output);
                continue;
            }
            let delivered = req.sink.send(Event::Output(output)).is_ok();
            if finished {
                self.in_flight.remove(&id);
            } else if !delivered {
                // The client went away: free its slot and blocks, as vLLM aborts on disconnect.
                self.in_flight.remove(&id);
                self.engine.abort(&id);
                self.shared.metrics().finished("abort");
            }
        }
        {
            let mut metrics = self.shared.metrics();
            for reason in finished_reasons {
                metrics.finished(reason);
            }
        }
        self.refresh_gauges();
    }

    fn refresh_gauges(&self) {
        let stats: EngineStats = self.engine.stats();
        let (mut running, mut waiting) = (Vec::new(), Vec::new());
        for req in self.in_flight.values() {
            if let Some(name) = &req.lora {
                let list = if req.started {
                    &mut running
                } else {
                    &mut waiting
                };
                if !list.contains(name) {
                    list.push(name.clone());
                }
            }
        }
        running.sort();
        waiting.sort();
        self.shared.metrics().update(stats, running, waiting);
    }

    fn publish(&self, events: Vec<EngineKvEvent>) {
        let Some(publisher) = &self.publisher else {
            return;
        };
        if events.is_empty() {
            return;
        }
        let events = events.into_iter().map(to_wire).collect();
        // A closed publisher only loses events, which is what a subscriber must cope with anyway.
        let _ = publisher.publish(EventBatch::new(wall_clock(), events));
    }
}

/// The engine's event in vLLM's wire struct (integer hashes, GPU medium).
pub(crate) fn to_wire(event: EngineKvEvent) -> KvEvent {
    match event {
        EngineKvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            lora_name,
            extra_keys,
        } => {
            let mut stored = BlockStored::new(
                block_hashes.into_iter().map(BlockHash::Int).collect(),
                parent_block_hash.map(BlockHash::Int),
                token_ids,
                u32::try_from(block_size).unwrap_or(u32::MAX),
            );
            stored.lora_id = lora_id;
            stored.lora_name = lora_name;
            stored.extra_keys = Some(
                extra_keys
                    .into_iter()
                    .map(|keys| keys.map(|k| k.into_iter().map(ExtraKey::Str).collect()))
                    .collect(),
            );
            stored.group_idx = Some(0);
            KvEvent::BlockStored(stored)
        }
        EngineKvEvent::BlockRemoved { block_hashes } => {
            let mut removed =
                BlockRemoved::new(block_hashes.into_iter().map(BlockHash::Int).collect());
            removed.group_idx = Some(0);
            KvEvent::BlockRemoved(removed)
        }
        EngineKvEvent::AllBlocksCleared => KvEvent::AllBlocksCleared,
    }
}
