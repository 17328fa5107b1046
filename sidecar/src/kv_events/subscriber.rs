//! The ZMQ side of the mirror: a SUB socket on vLLM's KV-event stream, sequence tracking, and
//! recovery through vLLM's replay socket.
//!
//! Every PUB message carries a sequence number that starts at 0 in each vLLM process. The rules:
//! - `seq == expected`: apply.
//! - `seq > expected`: events were lost (PUB drops past its high-water mark, a slow reader, a
//!   sidecar that started late). Ask the replay socket for everything from `expected`. If the
//!   first replayed seq is later than asked, the engine's buffer no longer holds that history
//!   (vLLM replays silently from later on): the view is reset and declared [`CacheView::Lost`].
//!   Only the missing range `[expected, seq)` is taken from the replay; the live stream goes on
//!   in order from `seq`, so nothing is read twice and a stale copy is never taken for a restart.
//! - `seq < expected`: vLLM restarted (there is no
//!   epoch on the wire). A new process starts with an empty cache, so the mirror is reset; if
//!   the first message is not seq 0 the missing start is replayed like any gap.
//!
//! A sidecar that starts (or restarts) beside an engine that already served requests catches up
//! right after subscribing, before it publishes anything: it replays from 0 and learns the whole
//! history when the buffer still holds it (else the view is `Lost`). Live messages that the
//! catch-up already covered arrive as seqs below `expected`; until the first live message at or
//! past `expected` those are duplicates, not a restart. Without a catch-up (no replay socket, or
//! it did not answer) the start counts as `expected = 0` and the first live message is a gap.
//!
//! `Lost` is sticky until the cache is known to be empty again (an `AllBlocksCleared` or a vLLM
//! restart): blocks stored before the loss may still be resident and we cannot name them, so the
//! view under-reports hits until they are stored again, and never invents one.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use kvsight_protocol::messages::CacheView;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqError, ZmqMessage};

use crate::kv_events::decode::{Event, decode_batch};
use crate::metrics::Metrics;
use crate::mirror::Mirror;

/// vLLM's replay end marker (`-1` as a signed 64-bit int).
const END_SEQ: [u8; 8] = [0xff; 8];
/// Upper bound on batches one replay may deliver (vLLM's default buffer is 10 000 steps).
const MAX_REPLAY_BATCHES: usize = 1_000_000;

/// The mirror, shared by the subscriber (writer) and the publisher (deltas and snapshots).
pub type SharedMirror = Arc<Mutex<Mirror>>;

/// Locks the mirror. Nothing panics while holding it halfway through an update, so a poisoned
/// lock still guards a consistent mirror.
pub fn lock(mirror: &SharedMirror) -> MutexGuard<'_, Mirror> {
    mirror.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where and how to subscribe.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// vLLM's PUB endpoint, e.g. `tcp://127.0.0.1:5557`.
    pub endpoint: String,
    /// vLLM's replay (ROUTER) endpoint; without it every gap is lost history.
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (`""`: everything).
    pub topic: String,
    /// Longest wait for one replay reply.
    pub replay_timeout: Duration,
}

/// What the subscriber knows, published after every message (tests and `/debug/state` read it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriberStatus {
    /// The last sequence number applied (live or replayed).
    pub last_seq: Option<u64>,
    pub view: CacheView,
    /// Messages handled (applied, skipped as duplicates or malformed).
    pub messages: u64,
    pub gaps: u64,
    pub restarts: u64,
    pub replays_recovered: u64,
    pub losses: u64,
    pub malformed: u64,
}

impl Default for SubscriberStatus {
    fn default() -> Self {
        SubscriberStatus {
            last_seq: None,
            view: CacheView::Exact,
            messages: 0,
            gaps: 0,
            restarts: 0,
            replays_recovered: 0,
            losses: 0,
            malformed: 0,
        }
    }
}

/// Errors of the ZMQ boundary.
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    #[error("connecting to {endpoint}: {source}")]
    Connect { endpoint: String, source: ZmqError },
    #[error("zmq: {0}")]
    Zmq(#[from] ZmqError),
    #[error("no replay reply within {0:?}")]
    Timeout(Duration),
    #[error("malformed replay reply of {0} frames")]
    Malformed(usize),
    #[error("replay sent more than {0} batches")]
    TooLong(usize),
}

/// A connected, subscribed SUB socket and the state of the stream.
pub struct KvSubscriber {
    config: SubscriberConfig,
    socket: SubSocket,
    mirror: SharedMirror,
    metrics: Arc<Metrics>,
    status: watch::Sender<SubscriberStatus>,
    expected: u64,
    /// After a catch-up: live messages below this seq were already applied from the replay.
    duplicates_below: Option<u64>,
    /// Signalled when the engine is known to have restarted by other means than the stream.
    restarted: Arc<Notify>,
}

impl std::fmt::Debug for KvSubscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvSubscriber")
            .field("config", &self.config)
            .field("expected", &self.expected)
            .finish_non_exhaustive()
    }
}

impl KvSubscriber {
    /// Connects and subscribes. Call before anything makes vLLM produce events (warm-up), so
    /// that nothing is missed that replay would have to fetch.
    pub async fn connect(
        config: SubscriberConfig,
        mirror: SharedMirror,
        metrics: Arc<Metrics>,
    ) -> Result<Self, SubscribeError> {
        let mut socket = SubSocket::new();
        socket
            .connect(&config.endpoint)
            .await
            .map_err(|source| SubscribeError::Connect {
                endpoint: config.endpoint.clone(),
                source,
            })?;
        socket.subscribe(&config.topic).await?;
        let (status, _) = watch::channel(SubscriberStatus::default());
        let mut subscriber = KvSubscriber {
            config,
            socket,
            mirror,
            metrics,
            status,
            expected: 0,
            duplicates_below: None,
            restarted: Arc::new(Notify::new()),
        };
        subscriber.catch_up().await;
        Ok(subscriber)
    }

    /// Learns what the engine already cached, so a restarted sidecar's first snapshot is the
    /// engine's cache rather than an empty one that would under-report until the next event.
    /// The SUB socket is subscribed first, so every batch is either in the replay or arrives live.
    async fn catch_up(&mut self) {
        let Some(endpoint) = self.config.replay_endpoint.clone() else {
            return;
        };
        let batches = match replay(&endpoint, 0, self.config.replay_timeout).await {
            Ok(b) => b,
            Err(e) => {
                // Not fatal: the first live message is then a gap and is recovered as one.
                tracing::warn!(error = %e, "start-up catch-up replay failed");
                return;
            }
        };
        let Some(&(first, _)) = batches.first() else {
            return; // The engine has published nothing yet.
        };
        if first != 0 {
            self.metrics.count_replay("late_start");
            self.lose("the engine's replay buffer no longer holds its first events");
        } else {
            self.metrics.count_replay("recovered");
        }
        for (seq, payload) in &batches {
            self.apply(*seq, payload);
        }
        self.duplicates_below = Some(self.expected);
        tracing::info!(
            batches = batches.len(),
            next = self.expected,
            "caught up with the engine's KV-event history"
        );
    }

    /// Rebuild the mirror whenever `restarted` is notified. The KV stream alone shows a restart
    /// only with the new process's first event; an idle engine that came back would otherwise
    /// keep its old, now empty, cache in our view. The sidecar's scraper notifies it when
    /// vLLM's counters go back.
    pub fn resync_on(mut self, restarted: Arc<Notify>) -> Self {
        self.restarted = restarted;
        self
    }

    /// Follows the subscriber's progress.
    pub fn status(&self) -> watch::Receiver<SubscriberStatus> {
        self.status.subscribe()
    }

    /// Reads the stream until `cancel`. Socket errors are logged and reading goes on: the SUB
    /// socket reconnects by itself, and a restarted vLLM shows up as a sequence restart.
    pub async fn run(mut self, cancel: CancellationToken) {
        loop {
            let restarted = Arc::clone(&self.restarted);
            let message = tokio::select! {
                () = cancel.cancelled() => return,
                () = restarted.notified() => {
                    self.on_engine_restart().await;
                    continue;
                }
                m = self.socket.recv() => m,
            };
            match message {
                Ok(m) => self.on_message(m).await,
                Err(e) => {
                    tracing::warn!(error = %e, "KV-event socket error");
                    // A broken socket would spin; give the reconnect a moment.
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(100)) => {}
                    }
                }
            }
        }
    }

    async fn on_message(&mut self, message: ZmqMessage) {
        let frames = message.into_vec();
        let parsed = match frames.as_slice() {
            [_topic, seq, payload] => seq_of(seq).map(|s| (s, payload.clone())),
            _ => None,
        };
        self.status.send_modify(|s| s.messages += 1);
        let Some((seq, payload)) = parsed else {
            self.metrics.kv_payloads_malformed.inc();
            self.status.send_modify(|s| s.malformed += 1);
            tracing::debug!(frames = frames.len(), "malformed KV-event message skipped");
            return;
        };
        self.on_live(seq, payload).await;
    }

    async fn on_live(&mut self, seq: u64, payload: Bytes) {
        if let Some(below) = self.duplicates_below {
            if seq < below {
                return; // Already applied by the catch-up.
            }
            self.duplicates_below = None;
        }
        if seq == self.expected {
            self.apply(seq, &payload);
        } else if seq > self.expected {
            self.metrics.kv_event_gaps.inc();
            self.status.send_modify(|s| s.gaps += 1);
            tracing::warn!(expected = self.expected, got = seq, "KV-event sequence gap");
            self.recover(self.expected, seq, payload).await;
        } else {
            self.metrics.kv_event_restarts.inc();
            self.status.send_modify(|s| s.restarts += 1);
            tracing::warn!(
                expected = self.expected,
                got = seq,
                "KV-event sequence went back: vLLM restarted, resetting the mirror"
            );
            // A new engine process starts with an empty cache: nothing we knew is resident.
            lock(&self.mirror).reset();
            self.expected = 0;
            self.set_view(CacheView::Exact);
            if seq == 0 {
                self.apply(seq, &payload);
            } else {
                self.recover(0, seq, payload).await;
            }
        }
    }

    /// The engine restarted: its cache is empty and its history restarts at 0. Start over from
    /// an empty view and learn whatever the new process already published.
    async fn on_engine_restart(&mut self) {
        self.metrics.kv_event_restarts.inc();
        self.status.send_modify(|s| s.restarts += 1);
        tracing::warn!("the engine restarted: resetting the mirror and catching up");
        lock(&self.mirror).reset();
        self.metrics.resident_blocks.set(0);
        self.expected = 0;
        self.duplicates_below = None;
        self.set_view(CacheView::Exact);
        self.catch_up().await;
    }

    /// Fills `[from, live_seq)` from the replay socket, then applies the live message.
    async fn recover(&mut self, from: u64, live_seq: u64, live: Bytes) {
        let Some(endpoint) = self.config.replay_endpoint.clone() else {
            self.lose("no replay endpoint configured");
            self.apply(live_seq, &live);
            return;
        };
        let was_lost = self.status.borrow().view == CacheView::Lost;
        self.set_view(CacheView::Recovering);
        // Only the missing range matters: the live stream carries on from `live_seq` in order,
        // so batches the replay adds after it would only be read twice.
        let replay = replay(&endpoint, from, self.config.replay_timeout)
            .await
            .map(|batches| {
                batches
                    .into_iter()
                    .filter(|(s, _)| (from..live_seq).contains(s))
                    .collect::<Vec<_>>()
            });
        match replay {
            Ok(batches) if is_run(&batches, from, live_seq) => {
                for (seq, payload) in &batches {
                    self.apply(*seq, payload);
                }
                self.metrics.count_replay("recovered");
                self.status.send_modify(|s| s.replays_recovered += 1);
                tracing::info!(from, to = live_seq, "KV-event gap recovered by replay");
                if self.status.borrow().view == CacheView::Recovering {
                    self.set_view(if was_lost {
                        CacheView::Lost
                    } else {
                        CacheView::Exact
                    });
                }
            }
            Ok(batches) => {
                self.metrics.count_replay("late_start");
                let first = batches.first().map(|(s, _)| *s);
                tracing::warn!(asked = from, first = ?first, "replay started later than asked");
                self.lose("replay buffer no longer holds the missed events");
                // Rebuild from what the engine still has: later stores land on top of the reset
                // view; removals of blocks we never knew are counted and ignored.
                for (seq, payload) in &batches {
                    self.apply(*seq, payload);
                }
            }
            Err(e) => {
                self.metrics.count_replay("failed");
                tracing::warn!(error = %e, asked = from, "replay failed");
                self.lose("replay failed");
            }
        }
        self.apply(live_seq, &live);
    }

    /// History is gone for good: start over from an empty view and say so.
    fn lose(&mut self, why: &str) {
        self.metrics.cache_lost.inc();
        tracing::error!(
            reason = why,
            "KV-cache history lost: mirror reset, view rebuilt from new events"
        );
        let mut mirror = lock(&self.mirror);
        mirror.reset();
        self.metrics.resident_blocks.set(0);
        drop(mirror);
        self.status.send_modify(|s| s.losses += 1);
        self.set_view(CacheView::Lost);
    }

    fn set_view(&self, view: CacheView) {
        self.status.send_if_modified(|s| {
            let changed = s.view != view;
            s.view = view;
            changed
        });
    }

    fn apply(&mut self, seq: u64, payload: &[u8]) {
        self.expected = seq.wrapping_add(1);
        let mut cleared = false;
        // Whether this batch held something the mirror could not apply: a payload that does not
        // decode, an event of an unknown type, a store that cannot be hashed. Any of them may be
        // a removal the view then misses, and a missed removal is a hit predicted on a block
        // that is gone: the view is lost, as with missed events.
        let mut unreadable: Option<&'static str> = None;
        let mut resident = {
            let mut mirror = lock(&self.mirror);
            let skipped = |m: &Mirror| m.stats().malformed_events + m.stats().unknown_events;
            let before = skipped(&mirror);
            match decode_batch(payload) {
                Ok(batch) => {
                    for event in &batch.events {
                        self.metrics.count_event(match event {
                            Event::Stored(_) => "BlockStored",
                            Event::Removed(_) => "BlockRemoved",
                            Event::AllCleared => "AllBlocksCleared",
                            Event::Unknown(_) => "Unknown",
                        });
                        cleared |= matches!(event, Event::AllCleared);
                        mirror.apply(event);
                    }
                    if !batch.events.is_empty() {
                        mirror.note_batch(batch.ts);
                    }
                }
                Err(e) => {
                    mirror.count_malformed();
                    self.metrics.kv_payloads_malformed.inc();
                    self.status.send_modify(|s| s.malformed += 1);
                    tracing::warn!(seq, error = %e, "malformed KV-event payload");
                    unreadable = Some("a KV-event payload did not decode");
                }
            }
            if unreadable.is_none() && skipped(&mirror) > before {
                unreadable =
                    Some("a KV event could not be applied (malformed or of an unknown type)");
            }
            mirror.resident()
        };
        if let Some(why) = unreadable {
            self.lose(why);
            resident = 0;
            cleared = false;
        }
        self.metrics
            .resident_blocks
            .set(i64::try_from(resident).unwrap_or(i64::MAX));
        // After a clear the engine's cache is empty and so is ours: exact again.
        let view = if cleared {
            CacheView::Exact
        } else {
            self.status.borrow().view
        };
        self.status.send_modify(|s| {
            s.last_seq = Some(seq);
            s.view = view;
        });
    }
}

/// Whether `batches` are exactly the seqs `from..to`, in order.
fn is_run(batches: &[(u64, Bytes)], from: u64, to: u64) -> bool {
    batches.len() as u64 == to - from && batches.iter().zip(from..).all(|((s, _), want)| *s == want)
}

fn seq_of(frame: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes)
}

/// Asks vLLM's replay socket for every buffered batch from `start_seq` on and returns them in
/// order. Understands both reply layouts as a DEALER sees them: `["", topic, seq, payload]`
/// (vLLM 0.26+) and `["", seq, payload]` (0.25 and older), each ending with an `END_SEQ` marker.
pub async fn replay(
    endpoint: &str,
    start_seq: u64,
    timeout: Duration,
) -> Result<Vec<(u64, Bytes)>, SubscribeError> {
    let mut socket = DealerSocket::new();
    socket
        .connect(endpoint)
        .await
        .map_err(|source| SubscribeError::Connect {
            endpoint: endpoint.to_owned(),
            source,
        })?;
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start_seq.to_be_bytes()),
    ])
    .map_err(|_| SubscribeError::Malformed(0))?;
    socket.send(request).await?;
    let mut out = Vec::new();
    loop {
        let reply = tokio::time::timeout(timeout, socket.recv())
            .await
            .map_err(|_| SubscribeError::Timeout(timeout))??;
        let frames = reply.into_vec();
        let (seq, payload) = match frames.as_slice() {
            [delim, _topic, seq, payload] if delim.is_empty() => (seq, payload),
            [delim, seq, payload] if delim.is_empty() => (seq, payload),
            _ => return Err(SubscribeError::Malformed(frames.len())),
        };
        if seq.as_ref() == END_SEQ {
            return Ok(out);
        }
        let seq = seq_of(seq).ok_or(SubscribeError::Malformed(frames.len()))?;
        if out.len() >= MAX_REPLAY_BATCHES {
            return Err(SubscribeError::TooLong(MAX_REPLAY_BATCHES));
        }
        out.push((seq, payload.clone()));
    }
}
