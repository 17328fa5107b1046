//! The QUIC publisher: one connection per router replica address, each running
//! `Hello` → `Welcome`/`Refused` → `CacheSnapshot` → `CacheDelta`s and `Load`s, answering the
//! router's `Inflight`, `TokenizerRequest` and `ResyncRequest`.
//!
//! Deltas: a single ticker takes at most one delta from the mirror's filter per publish
//! interval and broadcasts it to every connection, under the mirror lock, so a snapshot taken
//! under the same lock is always consistent with the deltas that follow it. A connection that
//! falls behind the broadcast (or sees a version it cannot chain) sends a fresh snapshot.
//!
//! Placements: each router reports every request it sends here ([`RouterMessage::Routed`]);
//! the publisher relays it at once to every *other* router connection ([`Placements`]), so
//! router replicas learn where each other placed a prefix within a round trip, long before the
//! engine's events or the next load report could show it. A connection that falls behind the
//! relay loses the oldest placements (counted): they are hints, the filter stays the truth.
//!
//! The publisher also remembers the homes-relevant part of recent placements (their prefix
//! depths, [`RecentPlacement`]) and sends them after the snapshot on every connect, so a router
//! that restarts — a rolling update — learns where the running replicas placed each prefix
//! instead of placing prefixes anew where its memory is empty. An `AllBlocksCleared` (a cache
//! reset) forgets them.
//!
//! Addresses: a router name resolves to every replica; names are re-resolved periodically, new
//! addresses get a connection and vanished ones are closed. Each connection reconnects on its own
//! with exponential backoff and jitter, so a refused or unreachable router (a certificate not from
//! our CA, a version mismatch) never holds up the others.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvsight_protocol::messages::{
    CacheDelta, CloseReason, Goodbye, Hello, Inflight, Load, MAX_PLACEMENTS, Placement, Placements,
    RecentPlacement, RecentPlacements, Routed, RouterMessage, SidecarMessage, TokenizerInfo,
};
use kvsight_protocol::tokenizer_transfer::TokenizerFiles;
use kvsight_transport::{FramedRecv, FramedSend, TlsMaterial, TransportError};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::RouterTarget;
use crate::kv_events::subscriber::{SharedMirror, lock};
use crate::state::Shared;

/// Deltas buffered per connection before it counts as fallen behind (≈3 s at 50 ms).
const DELTA_BACKLOG: usize = 64;
/// Placements buffered for relay per connection before the oldest are dropped: seconds of
/// traffic at thousands of requests per second.
const PLACEMENT_BACKLOG: usize = 8192;
/// Placements remembered for routers that connect later: at most this many (about 100 bytes
/// each), and none older than [`RECENT_FOR`], longer than routers keep a home unused by default.
const RECENT_PLACEMENTS: usize = 65_536;
const RECENT_FOR: Duration = Duration::from_secs(600);
/// First reconnect delay; doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// Longest wait for a handshake, a `Welcome`, or the peer to acknowledge our close.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of one router connection.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("connecting: {0}")]
    Connect(#[from] quinn::ConnectError),
    #[error("connection: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("router refused: {0}")]
    Refused(String),
    #[error("router sent {0} unexpectedly")]
    Unexpected(&'static str),
    #[error("router closed the stream")]
    Closed,
    #[error("timed out waiting for {0}")]
    Timeout(&'static str),
}

/// What every connection shares.
#[derive(Debug)]
pub struct Publisher {
    shared: Arc<Shared>,
    mirror: SharedMirror,
    hello: Hello,
    tokenizer: Option<Arc<TokenizerFiles>>,
    deltas: broadcast::Sender<Arc<CacheDelta>>,
    placements: broadcast::Sender<Arc<Relayed>>,
    recent: std::sync::Mutex<VecDeque<Remembered>>,
    next_connection: AtomicU64,
}

/// A placement kept for routers that connect later.
#[derive(Debug)]
struct Remembered {
    at: Instant,
    /// The mirror's clear count when it was made: a cache reset forgets it.
    clears: u64,
    placement: RecentPlacement,
}

/// Which connection a router message came in on.
struct Answering<'a> {
    conn: &'a quinn::Connection,
    addr: SocketAddr,
    label: &'a str,
    id: u64,
}

/// A placement one router connection reported, on its way to the others.
#[derive(Debug)]
struct Relayed {
    /// The connection it came from (not sent back there).
    from: u64,
    at: Instant,
    routed: Routed,
}

impl Publisher {
    /// A publisher announcing `hello` (its tokenizer field is filled from `tokenizer`).
    pub fn new(
        shared: Arc<Shared>,
        mirror: SharedMirror,
        mut hello: Hello,
        tokenizer: Option<TokenizerFiles>,
    ) -> Arc<Self> {
        hello.tokenizer = tokenizer.as_ref().map(|t| TokenizerInfo {
            digest: t.digest(),
            total_bytes: t.total_bytes(),
        });
        Arc::new(Publisher {
            shared,
            mirror,
            hello,
            tokenizer: tokenizer.map(Arc::new),
            deltas: broadcast::channel(DELTA_BACKLOG).0,
            placements: broadcast::channel(PLACEMENT_BACKLOG).0,
            recent: std::sync::Mutex::new(VecDeque::new()),
            next_connection: AtomicU64::new(0),
        })
    }

    /// Takes one delta per `interval` and broadcasts it, until `cancel`.
    pub async fn run_ticker(self: Arc<Self>, interval: Duration, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let mut mirror = lock(&self.mirror);
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            if let Some(delta) = mirror.take_delta(now) {
                tracing::trace!(
                    version = delta.version,
                    receivers = self.deltas.receiver_count(),
                    "delta taken"
                );
                // No receiver is fine: connections start from a snapshot anyway.
                let _ = self.deltas.send(Arc::new(delta));
            }
        }
    }

    /// Resolves `targets` every `every` and keeps one connection per address until `close`;
    /// connections then say Goodbye with the shared close reason.
    pub async fn run_routers(
        self: Arc<Self>,
        tls: tokio::sync::watch::Receiver<TlsMaterial>,
        targets: Vec<RouterTarget>,
        every: Duration,
        close: CancellationToken,
        tracker: TaskTracker,
    ) {
        let mut endpoints: HashMap<bool, quinn::Endpoint> = HashMap::new();
        let mut live: HashMap<SocketAddr, CancellationToken> = HashMap::new();
        loop {
            let mut seen = HashMap::new();
            for t in &targets {
                match tokio::net::lookup_host((t.host.as_str(), t.port)).await {
                    Ok(addrs) => {
                        for a in addrs {
                            seen.insert(a, t.host.clone());
                        }
                    }
                    Err(e) => tracing::warn!(router = %t.host, error = %e, "cannot resolve"),
                }
            }
            for (addr, host) in &seen {
                if live.contains_key(addr) {
                    continue;
                }
                let v6 = addr.is_ipv6();
                let endpoint = match endpoints.get(&v6) {
                    Some(e) => e.clone(),
                    None => {
                        let bind: SocketAddr = if v6 {
                            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
                        } else {
                            (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
                        };
                        match kvsight_transport::client(bind, &tls.borrow()) {
                            Ok(e) => {
                                endpoints.insert(v6, e.clone());
                                e
                            }
                            Err(e) => {
                                tracing::error!(error = %e, "cannot open QUIC endpoint");
                                continue;
                            }
                        }
                    }
                };
                let token = close.child_token();
                live.insert(*addr, token.clone());
                tracing::info!(router = %addr, name = %host, "new router address");
                tracker.spawn(Arc::clone(&self).run_connection(
                    endpoint,
                    tls.clone(),
                    *addr,
                    host.clone(),
                    token,
                ));
            }
            // Addresses that no longer resolve: that replica is gone.
            live.retain(|addr, token| {
                let keep = seen.contains_key(addr);
                if !keep {
                    tracing::info!(router = %addr, "router address gone");
                    token.cancel();
                    self.shared.remove_router(&addr.to_string());
                }
                keep
            });
            tokio::select! {
                () = close.cancelled() => break,
                () = tokio::time::sleep(every) => {}
            }
        }
        // Let the connections send their Goodbye, then release the sockets.
        for e in endpoints.values() {
            let _ = tokio::time::timeout(HANDSHAKE_TIMEOUT, e.wait_idle()).await;
        }
    }

    /// One router address, reconnecting with backoff until `close`.
    async fn run_connection(
        self: Arc<Self>,
        endpoint: quinn::Endpoint,
        tls: tokio::sync::watch::Receiver<TlsMaterial>,
        addr: SocketAddr,
        server_name: String,
        close: CancellationToken,
    ) {
        let label = addr.to_string();
        let mut backoff = MIN_BACKOFF;
        let mut attempt: u64 = 0;
        while !close.is_cancelled() {
            attempt += 1;
            let id = self.next_connection.fetch_add(1, Ordering::Relaxed);
            let started = Instant::now();
            let result = self
                .connect_once(&endpoint, &tls, addr, &server_name, id, &close)
                .await;
            self.shared.clear_inflight(id);
            self.shared.update_router(&label, |r| {
                r.connected = false;
                r.inflight = 0;
            });
            match result {
                Ok(()) => {
                    tracing::info!(router = %addr, "router connection ended");
                }
                Err(e) => {
                    let reason = match &e {
                        PublishError::Refused(_) => "refused",
                        PublishError::Connect(_) | PublishError::Timeout("handshake") => "connect",
                        PublishError::Connection(_) if started.elapsed() < HANDSHAKE_TIMEOUT => {
                            "connect"
                        }
                        _ => "connection",
                    };
                    self.shared.metrics.count_router_error(reason);
                    tracing::warn!(router = %addr, error = %e, attempt, "router connection failed");
                    self.shared
                        .update_router(&label, |r| r.last_error = Some(e.to_string()));
                }
            }
            // A connection that lasted a while was healthy: start the backoff over.
            if started.elapsed() > MAX_BACKOFF {
                backoff = MIN_BACKOFF;
            }
            let delay = jitter(backoff, id);
            backoff = (backoff * 2).min(MAX_BACKOFF);
            tokio::select! {
                () = close.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    async fn connect_once(
        &self,
        endpoint: &quinn::Endpoint,
        tls: &tokio::sync::watch::Receiver<TlsMaterial>,
        addr: SocketAddr,
        server_name: &str,
        id: u64,
        close: &CancellationToken,
    ) -> Result<(), PublishError> {
        let metrics = &self.shared.metrics;
        let mut sent = |n: usize| {
            metrics.publish_bytes.inc_by(n as u64);
        };
        let (conn, mut tx, mut rx) = self
            .handshake(endpoint, tls, addr, server_name, &mut sent)
            .await?;
        let label = addr.to_string();
        metrics.routers_connected.inc();
        let _connected = GaugeGuard(&metrics.routers_connected);

        // Subscribe before the snapshot so that no delta after it is missed.
        let mut deltas = self.deltas.subscribe();
        let mut placements = self.placements.subscribe();
        let mut version = self.send_snapshot(&mut tx, &mut sent).await?;
        self.send_recent(&mut tx, &mut sent).await?;
        let mut load_rx = self.shared.load.subscribe();
        let mut load_seq = 0u64;
        let first = load_rx.borrow_and_update().clone();
        if let Some(sample) = first {
            load_seq += 1;
            sent(
                tx.send(&stamp(sample.load, load_seq, sample.sampled_at))
                    .await?,
            );
        }
        loop {
            tokio::select! {
                biased;
                () = close.cancelled() => {
                    let reason = self.shared.close_reason();
                    let bye = SidecarMessage::Goodbye(Goodbye {
                        reason,
                        message: format!("sidecar closing ({reason:?})"),
                    });
                    // Best effort: the router may already be gone.
                    if let Ok(n) = tx.send(&bye).await {
                        sent(n);
                    }
                    let _ = tx.finish();
                    // Give the router a moment to read the Goodbye before the close.
                    let _ = tokio::time::timeout(Duration::from_millis(500), rx.recv::<RouterMessage>()).await;
                    conn.close(reason.code().into(), b"goodbye");
                    return Ok(());
                }
                msg = rx.recv::<RouterMessage>() => {
                    let Some(msg) = msg? else { return Err(PublishError::Closed) };
                    let at = Answering { conn: &conn, addr, label: &label, id };
                    if let Some(end) = self.answer(msg, &at, &mut tx, &mut version, &mut sent).await? {
                        return end;
                    }
                }
                d = deltas.recv() => match d {
                    Ok(d) if d.base_version == version => {
                        tracing::trace!(router = %addr, version = d.version, "delta");
                        sent(tx.send(&SidecarMessage::CacheDelta((*d).clone())).await?);
                        version = d.version;
                    }
                    // Already contained in the snapshot we sent.
                    Ok(d) if d.version <= version => {}
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {
                        tracing::debug!(router = %addr, "fell behind the deltas: fresh snapshot");
                        version = self.send_snapshot(&mut tx, &mut sent).await?;
                    }
                    Err(broadcast::error::RecvError::Closed) => return Ok(()),
                },
                changed = load_rx.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                    let sample = load_rx.borrow_and_update().clone();
                    if let Some(sample) = sample {
                        load_seq += 1;
                        sent(tx.send(&stamp(sample.load, load_seq, sample.sampled_at)).await?);
                    }
                }
                p = placements.recv() => match p {
                    Ok(first) => {
                        let batch = relay_batch(first, &mut placements, id, metrics);
                        if !batch.is_empty() {
                            metrics.count_placements("relayed", batch.len() as u64);
                            sent(tx.send(&SidecarMessage::Placements(Placements { entries: batch })).await?);
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        metrics.count_placements("dropped", n);
                    }
                    Err(broadcast::error::RecvError::Closed) => return Ok(()),
                },
            }
        }
    }

    /// Connects, opens the stream, says `Hello` and waits for `Welcome` (bounded); records the
    /// router as connected.
    async fn handshake(
        &self,
        endpoint: &quinn::Endpoint,
        tls: &tokio::sync::watch::Receiver<TlsMaterial>,
        addr: SocketAddr,
        server_name: &str,
        sent: &mut impl FnMut(usize),
    ) -> Result<(quinn::Connection, FramedSend, FramedRecv), PublishError> {
        // The newest material on every attempt: a renewed certificate is used from the next
        // reconnect on (the connection in progress keeps the one it was set up with).
        let config = kvsight_transport::client_config(&tls.borrow())?;
        let connecting = endpoint.connect_with(config, addr, server_name)?;
        let conn = tokio::time::timeout(HANDSHAKE_TIMEOUT, connecting)
            .await
            .map_err(|_| PublishError::Timeout("handshake"))??;
        let (send, recv) = conn.open_bi().await?;
        let mut tx = FramedSend::new(send);
        let mut rx = FramedRecv::new(recv);
        sent(tx.send(&SidecarMessage::Hello(self.hello.clone())).await?);
        let answer = tokio::time::timeout(HANDSHAKE_TIMEOUT, rx.recv::<RouterMessage>())
            .await
            .map_err(|_| PublishError::Timeout("Welcome"))??;
        let router_id = match answer {
            Some(RouterMessage::Welcome(w)) => w.router_id,
            Some(RouterMessage::Refused(r)) => {
                conn.close(CloseReason::Shutdown.code().into(), b"refused");
                return Err(PublishError::Refused(r.reason));
            }
            Some(_) => return Err(PublishError::Unexpected("a message before Welcome")),
            None => return Err(PublishError::Closed),
        };
        tracing::info!(router = %addr, %router_id, "router welcomed us");
        self.shared.update_router(&addr.to_string(), |r| {
            r.router_id = Some(router_id.clone());
            r.connected = true;
            r.last_error = None;
        });
        Ok((conn, tx, rx))
    }

    /// Answers one router message; `Some` ends the connection with that outcome.
    async fn answer(
        &self,
        msg: RouterMessage,
        at: &Answering<'_>,
        tx: &mut FramedSend,
        version: &mut u64,
        sent: &mut impl FnMut(usize),
    ) -> Result<Option<Result<(), PublishError>>, PublishError> {
        match msg {
            RouterMessage::Inflight(Inflight { requests, .. }) => {
                self.shared.set_inflight(at.id, requests);
                self.shared
                    .update_router(at.label, |r| r.inflight = requests);
            }
            RouterMessage::TokenizerRequest(req) => match &self.tokenizer {
                Some(files) => {
                    for chunk in files.chunks(&req.model) {
                        sent(tx.send(&SidecarMessage::TokenizerChunk(chunk)).await?);
                    }
                }
                None => tracing::warn!(router = %at.addr, model = %req.model,
                    "router asked for a tokenizer and we have none"),
            },
            RouterMessage::ResyncRequest => {
                *version = self.send_snapshot(tx, sent).await?;
            }
            RouterMessage::Routed(routed) => {
                self.shared.metrics.count_placements("received", 1);
                self.remember(&routed);
                // No other router connected is fine: nobody to tell.
                let _ = self.placements.send(Arc::new(Relayed {
                    from: at.id,
                    at: Instant::now(),
                    routed,
                }));
            }
            RouterMessage::Goodbye(g) => {
                tracing::info!(router = %at.addr, reason = ?g.reason, "router said goodbye");
                return Ok(Some(Ok(())));
            }
            RouterMessage::Welcome(_) | RouterMessage::Refused(_) => {
                at.conn
                    .close(CloseReason::ProtocolViolation.code().into(), b"unexpected");
                return Ok(Some(Err(PublishError::Unexpected(
                    "a second Welcome/Refused",
                ))));
            }
        }
        Ok(None)
    }

    /// Keeps `routed`'s prefix depths for routers that connect later (see the module docs).
    fn remember(&self, routed: &Routed) {
        if routed.chain.is_empty() {
            return;
        }
        let clears = lock(&self.mirror).stats().clears;
        let now = Instant::now();
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        while recent
            .front()
            .is_some_and(|r| r.clears != clears || now.duration_since(r.at) > RECENT_FOR)
        {
            recent.pop_front();
        }
        if recent.len() >= RECENT_PLACEMENTS {
            recent.pop_front();
        }
        recent.push_back(Remembered {
            at: now,
            clears,
            placement: RecentPlacement::of(routed, 0),
        });
    }

    /// Sends what [`Self::remember`] kept and the cache has not been reset since, oldest first.
    async fn send_recent(
        &self,
        tx: &mut FramedSend,
        sent: &mut impl FnMut(usize),
    ) -> Result<(), PublishError> {
        let clears = lock(&self.mirror).stats().clears;
        let entries: Vec<RecentPlacement> = {
            let recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
            recent
                .iter()
                .filter(|r| r.clears == clears && r.at.elapsed() <= RECENT_FOR)
                .map(|r| RecentPlacement {
                    age_ms: u32::try_from(r.at.elapsed().as_millis()).unwrap_or(u32::MAX),
                    ..r.placement.clone()
                })
                .collect()
        };
        for chunk in entries.chunks(MAX_PLACEMENTS) {
            let msg = SidecarMessage::RecentPlacements(RecentPlacements {
                entries: chunk.to_vec(),
            });
            sent(tx.send(&msg).await?);
        }
        Ok(())
    }

    async fn send_snapshot(
        &self,
        tx: &mut FramedSend,
        sent: &mut impl FnMut(usize),
    ) -> Result<u64, PublishError> {
        let snapshot = lock(&self.mirror).filter().snapshot();
        let version = snapshot.version;
        sent(tx.send(&SidecarMessage::CacheSnapshot(snapshot)).await?);
        Ok(version)
    }
}

/// `first` and whatever else is already queued for this connection (at most
/// [`MAX_PLACEMENTS`]), minus its own, each stamped with its age now.
fn relay_batch(
    first: Arc<Relayed>,
    rx: &mut broadcast::Receiver<Arc<Relayed>>,
    id: u64,
    metrics: &crate::metrics::Metrics,
) -> Vec<Placement> {
    let mut batch = Vec::new();
    let mut next = Some(first);
    while let Some(r) = next.take() {
        if r.from != id {
            batch.push(Placement {
                age_ms: u32::try_from(r.at.elapsed().as_millis()).unwrap_or(u32::MAX),
                routed: r.routed.clone(),
            });
        }
        if batch.len() >= MAX_PLACEMENTS {
            break;
        }
        next = match rx.try_recv() {
            Ok(r) => Some(r),
            Err(broadcast::error::TryRecvError::Lagged(n)) => {
                metrics.count_placements("dropped", n);
                rx.try_recv().ok()
            }
            Err(_) => None,
        };
    }
    batch
}

fn stamp(mut load: Load, seq: u64, sampled_at: Instant) -> SidecarMessage {
    load.seq = seq;
    load.sample_age_ms = u32::try_from(sampled_at.elapsed().as_millis()).unwrap_or(u32::MAX);
    SidecarMessage::Load(load)
}

/// `base` scaled by a factor in [0.5, 1.5), different per attempt and process, so that sidecars
/// that lost the same router do not reconnect in lockstep.
fn jitter(base: Duration, salt: u64) -> Duration {
    use std::hash::{BuildHasher, RandomState};
    let r = RandomState::new().hash_one((salt, Instant::now()));
    let f = 0.5 + (r % 1000) as f64 / 1000.0;
    base.mul_f64(f)
}

struct GaugeGuard<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}
