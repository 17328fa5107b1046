//! The QUIC listener sidecars connect to (mutual TLS: a client certificate from the configured CA
//! is required by the endpoint, so a rogue pod never completes the handshake and never reaches
//! the registry). One connection per pod, one bidirectional stream: `Hello` → `Welcome` (or
//! `Refused` naming both versions), then load reports, filter snapshots and deltas flow in while
//! this router reports its in-flight count for the pod. A malformed frame closes that connection
//! only; the pod is unregistered whenever its connection ends.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, SystemTime};

use tokio::time::{Instant, MissedTickBehavior, timeout};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, info_span, warn};

use kvsight_protocol::frame::FrameError;
use kvsight_protocol::tokenizer_transfer::{TokenizerAssembler, TokenizerFiles};
use kvsight_protocol::{
    CacheDelta, CloseReason, Goodbye, Hello, Inflight, PROTOCOL_VERSION, Placement,
    RecentPlacement, Refused, RouterMessage, SidecarMessage, TokenizerRequest, Welcome,
};
use kvsight_transport::{FramedRecv, FramedSend, PeerCertificate, TransportError};
use tokio::sync::mpsc;

use crate::config::PodsConfig;
use crate::identity::check_name;
use crate::pods::{RegistryError, pod_key};
use crate::server::Slot;
use crate::state::State;

/// How long a new connection may take to open its stream and say `Hello`.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on waiting for a sidecar to read our `Goodbye` and close.
pub const GOODBYE_GRACE: Duration = Duration::from_millis(300);
/// Bound on waiting for sidecars to acknowledge the close at shutdown.
pub const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// Picks queued for one pod's sidecar before new ones are dropped (counted as unsent): a
/// second of a busy pod's requests.
pub const OUTBOX: usize = 1024;

/// Accepts sidecars until `stop` is cancelled, then closes every connection with
/// [`CloseReason::Shutdown`].
pub async fn serve(endpoint: quinn::Endpoint, state: Arc<State>, stop: CancellationToken) {
    // Connections have their own tracker: the HTTP drain waits for streams, not for pods.
    let conns = TaskTracker::new();
    let open = Arc::new(AtomicUsize::new(0));
    loop {
        let incoming = tokio::select! {
            _ = stop.cancelled() => break,
            i = endpoint.accept() => match i {
                Some(i) => i,
                None => break,
            },
        };
        let max = state.live().config.pods.max_connections;
        let Some(slot) = Slot::take(&open, max) else {
            // Refused before the handshake: a flood of connections costs no TLS work.
            state.metrics.sidecar_refused("connections");
            warn!(max, remote = %incoming.remote_address(), "sidecar connection over the limit refused");
            incoming.refuse();
            continue;
        };
        let (state, stop) = (state.clone(), stop.clone());
        let remote = incoming.remote_address();
        conns.spawn(
            async move {
                if let Err(e) = connection(incoming, state, stop).await {
                    debug!(error = %e, "sidecar connection ended");
                }
                drop(slot);
            }
            .instrument(info_span!("sidecar", %remote)),
        );
    }
    // Each connection says Goodbye and closes itself; then the endpoint closes what is left.
    conns.close();
    let _ = timeout(CLOSE_GRACE, conns.wait()).await;
    endpoint.close(CloseReason::Shutdown.code().into(), b"router shutting down");
    let _ = timeout(CLOSE_GRACE, endpoint.wait_idle()).await;
}

fn close(conn: &quinn::Connection, reason: CloseReason, msg: &str) {
    conn.close(reason.code().into(), msg.as_bytes());
}

async fn connection(
    incoming: quinn::Incoming,
    state: Arc<State>,
    stop: CancellationToken,
) -> Result<(), TransportError> {
    // A certificate not signed by the CA fails here, before any application byte.
    let conn = incoming
        .await
        .inspect_err(|_| state.metrics.sidecar_refused("handshake"))?;
    let Ok(accepted) = timeout(HELLO_TIMEOUT, conn.accept_bi()).await else {
        state.metrics.sidecar_refused("protocol");
        close(&conn, CloseReason::ProtocolViolation, "no stream");
        return Ok(());
    };
    let (send, recv) = accepted?;
    let (mut send, mut recv) = (FramedSend::new(send), FramedRecv::new(recv));
    let first = timeout(HELLO_TIMEOUT, recv.recv::<SidecarMessage>()).await;
    let hello = match first {
        Ok(Ok(Some(SidecarMessage::Hello(h)))) if h.protocol_version == PROTOCOL_VERSION => h,
        Ok(Ok(Some(SidecarMessage::Hello(h)))) => {
            state.metrics.sidecar_refused("version");
            return refuse_version(&conn, &mut send, h.protocol_version).await;
        }
        Ok(Err(TransportError::Frame(FrameError::VersionMismatch { theirs, .. }))) => {
            state.metrics.sidecar_refused("version");
            return refuse_version(&conn, &mut send, theirs).await;
        }
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => {
            state.metrics.sidecar_refused("protocol");
            close(&conn, CloseReason::ProtocolViolation, "malformed frame");
            return Err(e);
        }
        Ok(Ok(Some(_))) | Err(_) => {
            state.metrics.sidecar_refused("protocol");
            close(&conn, CloseReason::ProtocolViolation, "expected Hello");
            return Ok(());
        }
    };
    let peer = conn.remote_address().ip();
    let pods = state.live().config.pods.clone();
    if let Err(e) = check_advertised_url(&pods, &hello.pod.url, peer).await {
        state.metrics.sidecar_refused("advertised_url");
        let reason = format!("advertised pod URL refused: {e}");
        warn!(pod = %hello.pod.name, url = %hello.pod.url, %peer, %reason, "refusing sidecar");
        return refuse(&conn, &mut send, reason, CloseReason::ProtocolViolation).await;
    }
    // The pod name must be one the certificate grants, and not held by another certificate.
    let cert = PeerCertificate::of(&conn);
    let key = pod_key(&hello);
    let claim = check_name(
        pods.identity,
        cert.as_ref(),
        &hello.pod.namespace,
        &hello.pod.name,
    )
    .and_then(|()| {
        let fingerprint = cert.as_ref().map_or([0; 32], |c| c.fingerprint);
        state.owners.claim(&key, fingerprint)
    });
    let claim = match claim {
        Ok(c) => c,
        Err(e) => {
            state.metrics.sidecar_refused(e.reason());
            let reason = format!("pod name refused: {e}");
            warn!(pod = %key, %peer, %reason, "refusing sidecar");
            return refuse(&conn, &mut send, reason, CloseReason::ProtocolViolation).await;
        }
    };
    let full = {
        let reg = state.registry();
        reg.len() >= pods.max_pods && reg.get(&key).is_none()
    };
    if full {
        state.metrics.sidecar_refused("pods");
        let reason = format!(
            "this router has {} pods registered, its limit",
            pods.max_pods
        );
        warn!(pod = %key, %reason, "refusing sidecar");
        return refuse(&conn, &mut send, reason, CloseReason::Shutdown).await;
    }
    send.send(&RouterMessage::Welcome(Welcome {
        protocol_version: PROTOCOL_VERSION,
        router_id: state.router_id.clone(),
    }))
    .await?;
    let interval = Duration::from_millis(u64::from(hello.load_interval_ms.clamp(50, 60_000)));
    let (key, conn_id) = state
        .registry()
        .register(hello.clone(), Instant::now().into_std());
    let span = info_span!("pod", pod = %key);
    info!(parent: &span, url = %hello.pod.url, models = ?hello.models, "pod registered");
    let session = Session {
        state: &state,
        hello: &hello,
        key: &key,
        conn_id,
        conn: &conn,
        stop: &stop,
        interval,
        expires: cert.map(|c| c.not_after),
        messages_per_second: pods.messages_per_second,
    };
    let result = session
        .run(&mut send, &mut recv)
        .instrument(span.clone())
        .await;
    state.registry().unregister(&key, conn_id);
    drop(claim);
    info!(parent: &span, "pod unregistered");
    result
}

async fn refuse_version(
    conn: &quinn::Connection,
    send: &mut FramedSend,
    theirs: u16,
) -> Result<(), TransportError> {
    let reason = format!(
        "protocol version mismatch: this router speaks version {PROTOCOL_VERSION}, the sidecar speaks version {theirs}"
    );
    warn!(%reason, "refusing sidecar");
    refuse(conn, send, reason, CloseReason::VersionMismatch).await
}

/// Sends `Refused` naming why, lets it leave, and closes with `code`.
async fn refuse(
    conn: &quinn::Connection,
    send: &mut FramedSend,
    reason: String,
    code: CloseReason,
) -> Result<(), TransportError> {
    send.send(&RouterMessage::Refused(Refused {
        protocol_version: PROTOCOL_VERSION,
        reason: reason.clone(),
    }))
    .await?;
    let _ = send.finish();
    // Give the Refused frame a moment to leave before the close discards the stream.
    let _ = timeout(Duration::from_secs(1), conn.closed()).await;
    close(conn, code, &reason);
    Ok(())
}

/// Bound on resolving a host name a sidecar advertises.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why an advertised pod URL was refused.
#[derive(Debug, thiserror::Error)]
pub enum AdvertisedUrlError {
    #[error("{0:?} is not an http(s) URL with a host")]
    Unparsable(String),
    #[error("host {host} is not this connection's address {peer}")]
    OtherHost { host: String, peer: IpAddr },
    #[error("host {host} did not resolve: {message}")]
    Unresolved { host: String, message: String },
}

/// A sidecar's certificate proves it is a sidecar, not where its pod is: the URL it advertises
/// must name the address its connection comes from (an IP literal, or a name resolving to it),
/// unless `pods.trustAdvertisedUrl` is set or the host is in `pods.allowAdvertisedHosts`.
/// Otherwise one stolen certificate could point a pod entry at any host and have prompts sent
/// there.
pub async fn check_advertised_url(
    pods: &PodsConfig,
    url: &str,
    peer: IpAddr,
) -> Result<(), AdvertisedUrlError> {
    if pods.trust_advertised_url {
        return Ok(());
    }
    let unparsable = || AdvertisedUrlError::Unparsable(url.to_owned());
    let parsed = reqwest::Url::parse(url).map_err(|_| unparsable())?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(unparsable());
    }
    // IPv6 literals come bracketed; anything that is not an IP literal is a name.
    let name = parsed
        .host_str()
        .ok_or_else(unparsable)?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let allowed = |h: &String| {
        h.trim_start_matches('[')
            .trim_end_matches(']')
            .eq_ignore_ascii_case(&name)
    };
    if pods.allow_advertised_hosts.iter().any(allowed) {
        return Ok(());
    }
    // A dual-stack socket shows an IPv4 peer as ::ffff:a.b.c.d.
    let peer = peer.to_canonical();
    let resolved: Vec<IpAddr> = match name.parse::<IpAddr>() {
        Ok(ip) => vec![ip.to_canonical()],
        Err(_) => {
            let port = parsed.port_or_known_default().unwrap_or(80);
            let unresolved = |message: String| AdvertisedUrlError::Unresolved {
                host: name.clone(),
                message,
            };
            timeout(
                RESOLVE_TIMEOUT,
                tokio::net::lookup_host((name.as_str(), port)),
            )
            .await
            .map_err(|_| unresolved(format!("no answer within {RESOLVE_TIMEOUT:?}")))?
            .map_err(|e| unresolved(e.to_string()))?
            .map(|a| a.ip().to_canonical())
            .collect()
        }
    };
    if resolved.contains(&peer) {
        Ok(())
    } else {
        Err(AdvertisedUrlError::OtherHost { host: name, peer })
    }
}

/// Takes a tokenizer a sidecar sent, if it is the one this connection asked for, for a model
/// the sidecar serves, and the config names none for it; it is built in the heavy pool.
fn accept_tokenizer(
    state: &Arc<State>,
    hello: &Hello,
    requested: Option<&str>,
    model: String,
    files: TokenizerFiles,
) {
    let refused = if requested != Some(model.as_str()) {
        Some("unsolicited")
    } else if !hello.models.contains(&model) {
        Some("unserved")
    } else if state.tokenizers.is_configured(&model) {
        Some("configured")
    } else {
        None
    };
    if let Some(reason) = refused {
        state.metrics.tokenizer_refused(reason);
        warn!(%model, reason, "tokenizer from the sidecar refused");
        return;
    }
    let st = state.clone();
    tokio::spawn(
        async move {
            let build = {
                let st = st.clone();
                move || st.tokenizers.build(&files).map(|tok| (files.digest(), tok))
            };
            match st.heavy.run_waiting(build).await {
                Ok(Ok((digest, tok))) => {
                    if st.tokenizers.insert_received(&model, digest, tok) {
                        info!(%model, "tokenizer received");
                    } else {
                        st.metrics.tokenizer_refused("configured");
                    }
                }
                Ok(Err(e)) => {
                    st.metrics.tokenizer_refused("unusable");
                    warn!(%model, error = %e, "tokenizer unusable");
                }
                Err(e) => warn!(%model, error = %e, "building the tokenizer failed"),
            }
        }
        .instrument(tracing::Span::current()),
    );
}

/// A registered sidecar's connection: what its session loop reads and answers.
struct Session<'a> {
    state: &'a Arc<State>,
    hello: &'a Hello,
    /// The pod's registry key, and this connection's id under it (a newer connection of the
    /// same pod replaces this one).
    key: &'a str,
    conn_id: u64,
    conn: &'a quinn::Connection,
    /// The router's shutdown: say Goodbye and close.
    stop: &'a CancellationToken,
    /// How often the sidecar hears this router's in-flight count for its pod (its load
    /// interval, clamped).
    interval: Duration,
    /// When the sidecar's certificate expires: the connection is closed then (the handshake
    /// checked it once; a connection must not outlive it).
    expires: Option<SystemTime>,
    /// `pods.messagesPerSecond` when the connection was accepted.
    messages_per_second: u32,
}

/// What the sidecar's messages build up over a connection.
struct Inbound {
    assembler: TokenizerAssembler,
    bucket: Bucket,
    /// The model whose tokenizer this router asked the sidecar for.
    requested: Option<String>,
    /// A snapshot was asked for and has not arrived yet.
    resync_sent: bool,
}

/// Whether the connection goes on after a message.
enum Next {
    Continue,
    End,
}

/// A token bucket over a connection's messages: `rate` per second, a second's worth of burst.
struct Bucket {
    rate: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new(rate: u32) -> Self {
        let rate = f64::from(rate.max(1));
        Bucket {
            rate,
            tokens: rate,
            at: Instant::now(),
        }
    }

    /// Takes one message; returns how long to wait before reading the next.
    fn take(&mut self) -> Duration {
        let now = Instant::now();
        let refill = now.duration_since(self.at).as_secs_f64() * self.rate;
        self.tokens = (self.tokens + refill).min(self.rate) - 1.0;
        self.at = now;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate)
        }
    }
}

impl Session<'_> {
    /// Asks for the primary model's tokenizer when the sidecar has one and this router has not
    /// (and the config does not name one for it: a configured tokenizer is never replaced);
    /// returns the model asked for.
    async fn request_tokenizer(
        &self,
        send: &mut FramedSend,
    ) -> Result<Option<String>, TransportError> {
        let (state, hello) = (self.state, self.hello);
        if let (Some(model), Some(info)) = (hello.models.first(), &hello.tokenizer)
            && state.tokenizers.can_load()
            && !state.tokenizers.is_configured(model)
            && !state.tokenizers.has(model, Some(&info.digest))
        {
            send.send(&RouterMessage::TokenizerRequest(TokenizerRequest {
                model: model.clone(),
            }))
            .await?;
            return Ok(Some(model.clone()));
        }
        Ok(None)
    }

    /// Other replicas' placements on this pod, while sharing is on.
    fn placements(
        &self,
        entries: &[Placement],
        now: std::time::Instant,
    ) -> Result<(), RegistryError> {
        let Some(policy) = self.state.live().scheduler.peer_policy() else {
            return Ok(());
        };
        let transit = self.conn.rtt() / 2;
        let done = self.state.registry().apply_placements(
            self.key,
            self.conn_id,
            entries,
            now,
            transit,
            policy,
        )?;
        let metrics = &self.state.metrics;
        metrics.placements("received", done.placements as u64);
        metrics.home_handovers.inc_by(done.handovers as u64);
        Ok(())
    }

    /// The homes the sidecar remembered, while sharing and homes are on.
    fn recent(
        &self,
        entries: &[RecentPlacement],
        now: std::time::Instant,
    ) -> Result<(), RegistryError> {
        let Some(ttl) = self
            .state
            .live()
            .scheduler
            .peer_policy()
            .and_then(|p| p.homes_ttl)
        else {
            return Ok(());
        };
        let transit = self.conn.rtt() / 2;
        let handed = self.state.registry().apply_recent(
            self.key,
            self.conn_id,
            entries,
            now,
            transit,
            ttl,
        )?;
        self.state.metrics.home_handovers.inc_by(handed as u64);
        Ok(())
    }

    /// Serves the connection until either side ends it: in-flight counts out, loads, filter
    /// snapshots and deltas and tokenizer chunks in.
    async fn run(
        &self,
        send: &mut FramedSend,
        recv: &mut FramedRecv,
    ) -> Result<(), TransportError> {
        let Session {
            state,
            key,
            conn_id,
            conn,
            stop,
            interval,
            expires,
            messages_per_second,
            ..
        } = *self;
        // A connection lives no longer than its certificate.
        let expiry = expires.map(|t| {
            Instant::now()
                + t.duration_since(SystemTime::now())
                    .unwrap_or(Duration::ZERO)
        });
        let expired = async {
            match expiry {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let mut expired = std::pin::pin!(expired);
        let mut inbound = Inbound {
            assembler: TokenizerAssembler::new(),
            bucket: Bucket::new(messages_per_second),
            requested: self.request_tokenizer(send).await?,
            resync_sent: false,
        };
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut seq = 0u64;
        let (outbox, mut picks) = mpsc::channel(OUTBOX);
        state.registry().attach_outbox(key, conn_id, outbox);
        loop {
            tokio::select! {
                _ = stop.cancelled() => {
                    self.say_goodbye(send).await;
                    return Ok(());
                }
                Some(routed) = picks.recv() => {
                    send.send(&RouterMessage::Routed(routed)).await?;
                }
                _ = &mut expired => {
                    state.metrics.sidecar_refused("certificate_expired");
                    warn!("the sidecar's certificate expired: closing its connection");
                    close(conn, CloseReason::ProtocolViolation, "certificate expired");
                    return Ok(());
                }
                _ = tick.tick() => {
                    seq += 1;
                    let requests = state.registry().get(key).map_or(0, |p| p.inflight);
                    send.send(&RouterMessage::Inflight(Inflight { seq, requests })).await?;
                }
                msg = recv.recv::<SidecarMessage>() => {
                    let msg = match msg {
                        Ok(Some(m)) => m,
                        Ok(None) => return Ok(()),
                        Err(e) => {
                            close(conn, CloseReason::ProtocolViolation, "malformed frame");
                            return Err(e);
                        }
                    };
                    if let Next::End = self.receive(msg, &mut inbound, send).await? {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// The router is shutting down: `Goodbye`, then close.
    async fn say_goodbye(&self, send: &mut FramedSend) {
        let _ = send
            .send(&RouterMessage::Goodbye(Goodbye {
                reason: CloseReason::Shutdown,
                message: "router shutting down".into(),
            }))
            .await;
        let _ = send.finish();
        // A close discards unsent stream data: give the Goodbye a bounded moment (a sidecar
        // closes as soon as it reads it).
        let _ = timeout(GOODBYE_GRACE, self.conn.closed()).await;
        close(self.conn, CloseReason::Shutdown, "router shutting down");
    }

    /// One message from the sidecar, after the rate limit: applied to the registry, or the end
    /// of the connection.
    async fn receive(
        &self,
        msg: SidecarMessage,
        inbound: &mut Inbound,
        send: &mut FramedSend,
    ) -> Result<Next, TransportError> {
        let (state, key, conn_id, conn) = (self.state, self.key, self.conn_id, self.conn);
        let wait = inbound.bucket.take();
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        let now = Instant::now().into_std();
        let applied = match msg {
            SidecarMessage::Load(l) => state.registry().apply_load(key, conn_id, l, now),
            SidecarMessage::CacheSnapshot(s) => {
                inbound.resync_sent = false;
                state.registry().apply_snapshot(key, conn_id, &s)
            }
            SidecarMessage::CacheDelta(d) => self.delta(&d),
            SidecarMessage::TokenizerChunk(c) => {
                match inbound.assembler.push(c) {
                    Ok(Some((model, files))) => {
                        accept_tokenizer(
                            state,
                            self.hello,
                            inbound.requested.as_deref(),
                            model,
                            files,
                        );
                    }
                    Ok(None) => {}
                    Err(e) => warn!(error = %e, "tokenizer transfer failed"),
                }
                Ok(())
            }
            SidecarMessage::Placements(p) => self.placements(&p.entries, now),
            SidecarMessage::RecentPlacements(r) => self.recent(&r.entries, now),
            SidecarMessage::Goodbye(g) => {
                info!(reason = ?g.reason, message = %g.message, "sidecar said goodbye");
                return Ok(Next::End);
            }
            SidecarMessage::Hello(_) => {
                close(conn, CloseReason::ProtocolViolation, "second Hello");
                return Ok(Next::End);
            }
        };
        match applied {
            Ok(()) => {}
            Err(RegistryError::Filter(e)) => {
                // The filter was dropped: ask for a whole one, once until it arrives.
                if !inbound.resync_sent {
                    warn!(error = %e, "filter out of step, requesting a snapshot");
                    send.send(&RouterMessage::ResyncRequest).await?;
                    inbound.resync_sent = true;
                }
            }
            // A newer connection of the same pod replaced this one.
            Err(RegistryError::NotRegistered(_)) => {
                close(
                    conn,
                    CloseReason::Shutdown,
                    "replaced by a newer connection",
                );
                return Ok(Next::End);
            }
        }
        Ok(Next::Continue)
    }

    /// A filter delta, and the view's staleness it shows.
    fn delta(&self, d: &CacheDelta) -> Result<(), RegistryError> {
        let applied = self.state.registry().apply_delta(self.key, self.conn_id, d);
        // Engine publish → sidecar send (the sidecar's clock), plus half the round trip →
        // applied here.
        if let (Ok(()), Some(age)) = (&applied, d.age_ms) {
            let transit = self.conn.rtt().as_secs_f64() / 2.0;
            self.state
                .metrics
                .view_staleness_seconds
                .observe(f64::from(age) / 1000.0 + transit);
        }
        applied
    }
}
