//! The ZMQ side of vLLM's `ZmqEventPublisher`: a PUB stream of `[topic, seq, payload]` messages
//! and a ROUTER replay socket serving the last `buffer_steps` batches, plus fault knobs that let
//! reliability tests lose live messages or restart the sequence the way a real pod would.
//!
//! The PUB socket is a ZMQ XPUB. On the wire a SUB cannot tell the two apart (libzmq's SUB accepts
//! either), and XPUB hands us every subscription message, which is what lets
//! [`KvEventPublisher::wait_for_subscriptions`] replace the usual "sleep and hope the slow joiner
//! is in" with an exact condition. One task owns that socket, because sending and receiving on it
//! both need exclusive access; a second task owns the ROUTER and, as vLLM does, serves one replay
//! request at a time.
//!
//! [`KvEventPublisher::publish`] only queues, like vLLM's `publish` (a queue drained by a
//! thread): a subscriber that stops reading can make the socket wait, and that must never stall
//! the simulated engine. A full queue drops live messages (they stay replayable), as a PUB
//! socket past its high-water mark does.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use zeromq::{RouterSocket, Socket, SocketRecv, SocketSend, XPubSocket, ZmqError, ZmqMessage};

use super::{EncodeError, EventBatch, Layout, encode_batch};

/// The sequence number of the replay end marker (`-1` as a signed 64-bit int in vLLM).
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// Whether the PUB socket binds or connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EndpointMode {
    /// vLLM's rule: bind when the endpoint contains `*` or `::` or is `ipc://`/`inproc://`,
    /// connect otherwise.
    #[default]
    Auto,
    /// Always bind. Tests use this with `tcp://127.0.0.1:0`, which vLLM's rule would connect to.
    Bind,
    /// Always connect.
    Connect,
}

/// The frames a DEALER sees for each replayed batch (the ROUTER identity already stripped).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplayLayout {
    /// vLLM >= 0.26: `["", topic, seq, payload]`, end marker `["", "", END_SEQ, ""]`.
    #[default]
    New,
    /// vLLM <= 0.25: `["", seq, payload]`, end marker `["", END_SEQ, ""]`.
    Old,
}

/// What vLLM's `--kv-events-config` says, plus the simulator's choices of wire generation.
#[derive(Debug, Clone, PartialEq)]
pub struct PublisherConfig {
    /// PUB endpoint. Default `tcp://*:5557` (vLLM's default).
    pub endpoint: String,
    /// Bind or connect the PUB socket. Default [`EndpointMode::Auto`].
    pub endpoint_mode: EndpointMode,
    /// ROUTER endpoint for replay; always bound. Default `None` (replay off, as in vLLM).
    pub replay_endpoint: Option<String>,
    /// First frame of every PUB message. Default `""`.
    pub topic: String,
    /// How many of the latest batches replay can serve. Default 10 000.
    pub buffer_steps: usize,
    /// Event layout inside the payload. Default [`Layout::Map`].
    pub layout: Layout,
    /// Replay reply framing. Default [`ReplayLayout::New`].
    pub replay_layout: ReplayLayout,
    /// Live messages queued for the PUB socket before new ones are dropped (vLLM's `hwm` and
    /// `max_queue_size` play this part). Default 100 000.
    pub queue_capacity: usize,
    /// Written into batches whose `data_parallel_rank` is `None` (vLLM always does this; `None`
    /// here leaves them nil). Ranks > 0 also shift both ports by the rank, as vLLM does.
    /// Default `Some(0)`.
    pub data_parallel_rank: Option<u32>,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            endpoint: "tcp://*:5557".to_owned(),
            endpoint_mode: EndpointMode::Auto,
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 10_000,
            layout: Layout::Map,
            replay_layout: ReplayLayout::New,
            queue_capacity: 100_000,
            data_parallel_rank: Some(0),
        }
    }
}

impl PublisherConfig {
    /// PUB and ROUTER both bound to ephemeral loopback ports; read them back with
    /// [`KvEventPublisher::endpoint`] and [`KvEventPublisher::replay_endpoint`].
    pub fn loopback(topic: &str) -> Self {
        Self {
            endpoint: "tcp://127.0.0.1:0".to_owned(),
            endpoint_mode: EndpointMode::Bind,
            replay_endpoint: Some("tcp://127.0.0.1:0".to_owned()),
            topic: topic.to_owned(),
            ..Self::default()
        }
    }

    /// This configuration with every ephemeral port (`:0`) replaced by the port `bound` got, so
    /// that binding it again takes the same ports, as a restarted process configured with fixed
    /// ports would. Fixed ports and connect endpoints are kept as they are.
    pub fn with_bound_ports(&self, bound: &KvEventPublisher) -> Self {
        let rank = self.data_parallel_rank.unwrap_or(0);
        Self {
            endpoint: pin_port(&self.endpoint, bound.endpoint(), rank),
            replay_endpoint: match (&self.replay_endpoint, bound.replay_endpoint()) {
                (Some(configured), Some(resolved)) => Some(pin_port(configured, resolved, rank)),
                (configured, _) => configured.clone(),
            },
            ..self.clone()
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("cannot bind {endpoint}: {source}")]
    Bind { endpoint: String, source: ZmqError },
    #[error("cannot connect to {endpoint}: {source}")]
    Connect { endpoint: String, source: ZmqError },
    #[error("cannot encode batch: {0}")]
    Encode(#[from] EncodeError),
    #[error("the publisher task has stopped")]
    Closed,
    #[error("saw {seen} subscriptions within {waited:?}, wanted {wanted}")]
    SubscriptionTimeout {
        seen: u64,
        wanted: u64,
        waited: Duration,
    },
}

/// vLLM's port offset for data-parallel rank `rank`: `tcp` ports grow by the rank (a port of 0 is
/// left for the OS to pick), `inproc` names get a `_dp{rank}` suffix; rank 0 changes nothing.
pub fn offset_endpoint_port(endpoint: &str, rank: u32) -> Result<String, PublishError> {
    if rank == 0 {
        return Ok(endpoint.to_owned());
    }
    if endpoint.contains("inproc") {
        return Ok(format!("{endpoint}_dp{rank}"));
    }
    if !endpoint.contains("tcp") {
        return Err(endpoint_error(endpoint, "must contain 'inproc' or 'tcp'"));
    }
    let Some((base, port)) = endpoint.rsplit_once(':') else {
        return Ok(endpoint.to_owned());
    };
    let port: u32 = port
        .parse()
        .map_err(|_| endpoint_error(endpoint, "port is not a number"))?;
    if port == 0 {
        return Ok(endpoint.to_owned());
    }
    let shifted = port
        .checked_add(rank)
        .filter(|p| *p <= u32::from(u16::MAX))
        .ok_or_else(|| endpoint_error(endpoint, "port + data-parallel rank exceeds 65535"))?;
    Ok(format!("{base}:{shifted}"))
}

/// `configured` with its port 0 replaced by `resolved`'s port, less the data-parallel offset that
/// [`KvEventPublisher::bind`] adds again to a non-zero port; `configured` when its port is not 0.
fn pin_port(configured: &str, resolved: &str, rank: u32) -> String {
    let Some((base, "0")) = configured.rsplit_once(':') else {
        return configured.to_owned();
    };
    let port = resolved
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse::<u32>().ok())
        .and_then(|port| port.checked_sub(rank))
        .filter(|port| *port > 0);
    match port {
        Some(port) => format!("{base}:{port}"),
        // A resolved port below the offset cannot come from bind(); keep asking the OS.
        None => configured.to_owned(),
    }
}

fn endpoint_error(endpoint: &str, reason: &str) -> PublishError {
    PublishError::Endpoint {
        endpoint: endpoint.to_owned(),
        reason: reason.to_owned(),
    }
}

fn is_bind_endpoint(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// Rewrites a libzmq endpoint into one the pure-Rust stack accepts: libzmq's `*` wildcard host
/// is `0.0.0.0` there. Transports it lacks are refused up front rather than failing obscurely.
fn native_endpoint(endpoint: &str) -> Result<String, PublishError> {
    if endpoint.starts_with("inproc://") {
        return Err(endpoint_error(
            endpoint,
            "inproc:// needs a shared libzmq context; the simulator speaks tcp:// only",
        ));
    }
    if endpoint.starts_with("ipc://") {
        return Err(endpoint_error(
            endpoint,
            "ipc:// is not enabled in the simulator; use tcp://",
        ));
    }
    Ok(match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => endpoint.to_owned(),
    })
}

/// State shared by `publish`, the fault knobs and the replay task.
struct Shared {
    next_seq: u64,
    /// `(seq, payload)` of the latest `buffer_steps` batches, oldest first.
    ring: VecDeque<(u64, Bytes)>,
    live_drop: Option<Range<u64>>,
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    // The lock is never held across code that can panic halfway through an update, so a
    // poisoned state is still consistent.
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

enum PubCommand {
    Send(ZmqMessage),
    /// Answered once every message queued before it has been handed to the socket.
    Flush(oneshot::Sender<()>),
}

/// Counters of live messages that never reached the socket or failed in it.
#[derive(Default)]
struct Losses {
    queue_full: AtomicU64,
    send_failed: AtomicU64,
}

/// A vLLM KV-event publisher on real ZMQ sockets. Dropping it stops both sockets.
pub struct KvEventPublisher {
    endpoint: String,
    replay_endpoint: Option<String>,
    topic: Bytes,
    layout: Layout,
    buffer_steps: usize,
    data_parallel_rank: Option<u32>,
    shared: Arc<Mutex<Shared>>,
    commands: mpsc::Sender<PubCommand>,
    losses: Arc<Losses>,
    subscriptions: watch::Receiver<u64>,
    tasks: Vec<JoinHandle<()>>,
}

impl KvEventPublisher {
    /// Binds (or connects) the PUB socket and binds the replay socket, then starts serving.
    /// Must be called inside a tokio runtime. Unlike libzmq's lazy connect, connect mode waits
    /// until the peer accepts (the `zeromq` crate's connect timeout, 30 s, bounds it).
    pub async fn bind(config: PublisherConfig) -> Result<Self, PublishError> {
        let rank = config.data_parallel_rank.unwrap_or(0);
        let endpoint = offset_endpoint_port(&config.endpoint, rank)?;
        let replay_endpoint = config
            .replay_endpoint
            .as_deref()
            .map(|e| offset_endpoint_port(e, rank))
            .transpose()?;

        let mut pub_socket = XPubSocket::new();
        let bind = match config.endpoint_mode {
            EndpointMode::Auto => is_bind_endpoint(&endpoint),
            EndpointMode::Bind => true,
            EndpointMode::Connect => false,
        };
        let native = native_endpoint(&endpoint)?;
        let endpoint = if bind {
            pub_socket
                .bind(&native)
                .await
                .map_err(|source| PublishError::Bind {
                    endpoint: endpoint.clone(),
                    source,
                })?
                .to_string()
        } else {
            pub_socket
                .connect(&native)
                .await
                .map_err(|source| PublishError::Connect {
                    endpoint: endpoint.clone(),
                    source,
                })?;
            endpoint
        };

        let mut replay_socket = None;
        let replay_endpoint = match replay_endpoint {
            Some(requested) => {
                let mut socket = RouterSocket::new();
                let bound = socket
                    .bind(&native_endpoint(&requested)?)
                    .await
                    .map_err(|source| PublishError::Bind {
                        endpoint: requested.clone(),
                        source,
                    })?;
                replay_socket = Some(socket);
                Some(bound.to_string())
            }
            None => None,
        };

        let topic = Bytes::from(config.topic.into_bytes());
        let shared = Arc::new(Mutex::new(Shared {
            next_seq: 0,
            ring: VecDeque::with_capacity(config.buffer_steps.min(1024)),
            live_drop: None,
        }));
        let (commands, command_rx) = mpsc::channel(config.queue_capacity.max(1));
        let (subscriptions_tx, subscriptions) = watch::channel(0);
        let losses = Arc::new(Losses::default());
        let mut tasks = vec![tokio::spawn(run_pub(
            pub_socket,
            command_rx,
            subscriptions_tx,
            Arc::clone(&losses),
        ))];
        if let Some(socket) = replay_socket {
            tasks.push(tokio::spawn(run_replay(
                socket,
                Arc::clone(&shared),
                topic.clone(),
                config.replay_layout,
            )));
        }

        Ok(Self {
            endpoint,
            replay_endpoint,
            topic,
            layout: config.layout,
            buffer_steps: config.buffer_steps,
            data_parallel_rank: config.data_parallel_rank,
            shared,
            commands,
            losses,
            subscriptions,
            tasks,
        })
    }

    /// The PUB endpoint, resolved (`tcp://127.0.0.1:<port>`) when bound.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay endpoint, resolved, when replay is on.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The topic frame of every PUB message.
    pub fn topic(&self) -> &[u8] {
        &self.topic
    }

    /// Assigns the next sequence number to `batch`, keeps it for replay and queues it for the PUB
    /// socket (unless that seq is in the live-drop range); returns the seq. Never waits: use
    /// [`flush`](Self::flush) to know it left. Like a real PUB, the message is silently not
    /// delivered to peers that have not subscribed yet.
    pub fn publish(&self, mut batch: EventBatch) -> Result<u64, PublishError> {
        if batch.data_parallel_rank.is_none() {
            batch.data_parallel_rank = self.data_parallel_rank;
        }
        let payload = Bytes::from(encode_batch(&batch, self.layout)?);
        let mut shared = lock(&self.shared);
        let seq = shared.next_seq;
        shared.next_seq += 1;
        if self.buffer_steps > 0 {
            if shared.ring.len() >= self.buffer_steps {
                shared.ring.pop_front();
            }
            shared.ring.push_back((seq, payload.clone()));
        }
        let live = !shared
            .live_drop
            .as_ref()
            .is_some_and(|range| range.contains(&seq));
        if live {
            let frames = vec![
                self.topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            let message = ZmqMessage::try_from(frames).map_err(|_| PublishError::Closed)?;
            // Queued while the lock is held so that concurrent publishers hit the wire in seq
            // order.
            match self.commands.try_send(PubCommand::Send(message)) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(_)) => {
                    self.losses.queue_full.fetch_add(1, Ordering::Relaxed);
                }
                Err(mpsc::error::TrySendError::Closed(_)) => return Err(PublishError::Closed),
            }
        }
        Ok(seq)
    }

    /// Waits until every batch published so far has been handed to the PUB socket (or lost, see
    /// [`live_messages_lost`](Self::live_messages_lost)).
    pub async fn flush(&self) -> Result<(), PublishError> {
        let (done, done_rx) = oneshot::channel();
        self.commands
            .send(PubCommand::Flush(done))
            .await
            .map_err(|_| PublishError::Closed)?;
        done_rx.await.map_err(|_| PublishError::Closed)
    }

    /// Live messages lost so far because the send queue was full or the socket refused them;
    /// they remain available through replay while buffered.
    pub fn live_messages_lost(&self) -> u64 {
        self.losses.queue_full.load(Ordering::Relaxed)
            + self.losses.send_failed.load(Ordering::Relaxed)
    }

    /// The seq the next [`publish`](Self::publish) will use.
    pub fn next_seq(&self) -> u64 {
        lock(&self.shared).next_seq
    }

    /// Fault knob: batches whose seq falls in `range` are buffered for replay but never sent on
    /// the PUB socket, as if the network lost them. `None` turns dropping off.
    pub fn set_live_drop(&self, range: Option<Range<u64>>) {
        lock(&self.shared).live_drop = range;
    }

    /// Fault knob: the sequence part of a vLLM restart — the next batch is seq 0 again and the
    /// replay buffer is empty, but the sockets stay up. A whole restart, connections dropped and
    /// ports bound anew, is `SimPodHandle::restart`.
    pub fn restart_sequence(&self) {
        let mut shared = lock(&self.shared);
        shared.next_seq = 0;
        shared.ring.clear();
    }

    /// How many subscribe requests (any topic) the PUB socket has received so far.
    pub fn subscriptions_seen(&self) -> u64 {
        *self.subscriptions.borrow()
    }

    /// Waits until at least `at_least` subscribe requests have reached the PUB socket, i.e. until
    /// a message published now reaches those subscribers.
    pub async fn wait_for_subscriptions(
        &self,
        at_least: u64,
        timeout: Duration,
    ) -> Result<(), PublishError> {
        let mut rx = self.subscriptions.clone();
        match tokio::time::timeout(timeout, rx.wait_for(|seen| *seen >= at_least)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err(PublishError::Closed),
            Err(_) => Err(PublishError::SubscriptionTimeout {
                seen: self.subscriptions_seen(),
                wanted: at_least,
                waited: timeout,
            }),
        }
    }

    /// Sends what is queued (bounded by `grace`), then stops both sockets and waits until their
    /// tasks are gone, so their ports are released.
    pub async fn shutdown(mut self, grace: Duration) {
        // A flush that fails or times out only means less was delivered; stopping goes on.
        let _ = tokio::time::timeout(grace, self.flush()).await;
        for task in std::mem::take(&mut self.tasks) {
            task.abort();
            // A cancelled task's JoinError is the expected outcome here.
            let _ = task.await;
        }
    }
}

impl Drop for KvEventPublisher {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Owns the XPUB socket: sends what `publish` queued and counts subscription messages.
async fn run_pub(
    mut socket: XPubSocket,
    mut commands: mpsc::Receiver<PubCommand>,
    subscriptions: watch::Sender<u64>,
    losses: Arc<Losses>,
) {
    loop {
        tokio::select! {
            // Queued batches go before newly arrived subscriptions, so that a batch published
            // before a subscriber joined is never delivered to it.
            biased;
            command = commands.recv() => match command {
                Some(PubCommand::Send(message)) => {
                    if socket.send(message).await.is_err() {
                        losses.send_failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                // The flusher may have given up waiting; nothing to undo.
                Some(PubCommand::Flush(done)) => drop(done.send(())),
                None => break,
            },
            received = socket.recv() => {
                // A subscribe request is one frame `\x01<prefix>`; `\x00` unsubscribes. Errors
                // here are peers going away, which the socket already handles.
                if let Ok(message) = received
                    && message.get(0).is_some_and(|frame| frame.first() == Some(&1))
                {
                    subscriptions.send_modify(|seen| *seen += 1);
                }
            }
        }
    }
    let _ = socket.close().await;
}

/// Parses a replay request's start seq as Python's `int.from_bytes(b, "big")` would; a value
/// beyond u64 (more than 8 significant bytes) is after every seq.
fn parse_start_seq(frame: &[u8]) -> Option<u64> {
    let significant = match frame.iter().position(|b| *b != 0) {
        Some(first) => &frame[first..],
        None => return Some(0),
    };
    if significant.len() > 8 {
        return None;
    }
    Some(
        significant
            .iter()
            .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)),
    )
}

/// Owns the ROUTER socket and answers `["", start_seq]` requests with every buffered batch whose
/// seq >= start_seq, then the end marker.
async fn run_replay(
    mut socket: RouterSocket,
    shared: Arc<Mutex<Shared>>,
    topic: Bytes,
    layout: ReplayLayout,
) {
    loop {
        let Ok(request) = socket.recv().await else {
            continue;
        };
        let frames = request.into_vec();
        // vLLM drops anything but [identity, delimiter, start] without answering.
        let [identity, _delimiter, start] = frames.as_slice() else {
            continue;
        };
        let batches: Vec<(u64, Bytes)> = match parse_start_seq(start) {
            Some(start) => lock(&shared)
                .ring
                .iter()
                .filter(|(seq, _)| *seq >= start)
                .cloned()
                .collect(),
            None => Vec::new(),
        };
        // `None` marks the end marker, which closes every reply.
        let replies = batches.into_iter().map(Some).chain(std::iter::once(None));
        for reply in replies {
            let mut out = vec![identity.clone(), Bytes::new()];
            match (reply, layout) {
                (Some((seq, payload)), ReplayLayout::New) => out.extend([
                    topic.clone(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ]),
                (Some((seq, payload)), ReplayLayout::Old) => {
                    out.extend([Bytes::copy_from_slice(&seq.to_be_bytes()), payload]);
                }
                // 0.26+ sends an empty topic frame in the end marker.
                (None, ReplayLayout::New) => {
                    out.extend([Bytes::new(), Bytes::from_static(&END_SEQ), Bytes::new()]);
                }
                (None, ReplayLayout::Old) => {
                    out.extend([Bytes::from_static(&END_SEQ), Bytes::new()]);
                }
            }
            let Ok(reply) = ZmqMessage::try_from(out) else {
                break;
            };
            // A requester that left mid-replay gets nothing more; the next request starts over.
            if socket.send(reply).await.is_err() {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_offset_follows_vllm() {
        assert_eq!(
            offset_endpoint_port("tcp://*:5557", 0).unwrap(),
            "tcp://*:5557"
        );
        assert_eq!(
            offset_endpoint_port("tcp://*:5557", 2).unwrap(),
            "tcp://*:5559"
        );
        assert_eq!(
            offset_endpoint_port("tcp://127.0.0.1:0", 3).unwrap(),
            "tcp://127.0.0.1:0"
        );
        assert_eq!(
            offset_endpoint_port("inproc://cache", 1).unwrap(),
            "inproc://cache_dp1"
        );
        assert!(offset_endpoint_port("ipc:///tmp/x", 1).is_err());
        assert!(offset_endpoint_port("tcp://*:65535", 1).is_err());
    }

    #[test]
    fn pinned_ports_bind_the_same_ports_again() {
        assert_eq!(
            pin_port("tcp://127.0.0.1:0", "tcp://127.0.0.1:41234", 0),
            "tcp://127.0.0.1:41234"
        );
        assert_eq!(
            pin_port("tcp://*:0", "tcp://0.0.0.0:41234", 0),
            "tcp://*:41234"
        );
        // bind() shifts a non-zero port by the rank again.
        let pinned = pin_port("tcp://127.0.0.1:0", "tcp://127.0.0.1:41234", 2);
        assert_eq!(
            offset_endpoint_port(&pinned, 2).unwrap(),
            "tcp://127.0.0.1:41234"
        );
        assert_eq!(
            pin_port("tcp://*:5557", "tcp://0.0.0.0:5559", 2),
            "tcp://*:5557"
        );
        assert_eq!(
            pin_port("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5557", 0),
            "tcp://10.0.0.1:5557"
        );
    }

    #[test]
    fn bind_rule_follows_vllm() {
        assert!(is_bind_endpoint("tcp://*:5557"));
        assert!(is_bind_endpoint("tcp://[::]:5557"));
        assert!(is_bind_endpoint("ipc:///tmp/kv"));
        assert!(!is_bind_endpoint("tcp://10.0.0.1:5557"));
        assert!(!is_bind_endpoint("tcp://127.0.0.1:0"));
        assert_eq!(
            native_endpoint("tcp://*:5557").unwrap(),
            "tcp://0.0.0.0:5557"
        );
    }

    #[test]
    fn start_seq_parses_like_python_int_from_bytes() {
        assert_eq!(parse_start_seq(&[]), Some(0));
        assert_eq!(parse_start_seq(&7u64.to_be_bytes()), Some(7));
        assert_eq!(parse_start_seq(&[1, 0]), Some(256));
        assert_eq!(parse_start_seq(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 5]), Some(5));
        assert_eq!(parse_start_seq(&[1, 0, 0, 0, 0, 0, 0, 0, 0]), None);
    }
}
