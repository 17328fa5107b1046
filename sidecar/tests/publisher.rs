//! The QUIC publisher against test routers built from `kvsight-transport` and a dev CA, over
//! loopback: the message sequence a router sees, a fresh snapshot after a router restart, a
//! rogue-CA router refused while a good one is served, tokenizer transfer, in-flight reports and
//! the drained Goodbye.

use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvsight_harness::messages;
use kvsight_protocol::bloom::BloomFilter;
use kvsight_protocol::messages::*;
use kvsight_protocol::tokenizer_transfer::{TokenizerAssembler, TokenizerFiles};
use kvsight_sidecar::config::RouterTarget;
use kvsight_sidecar::kv_events::decode::{Event, Stored, VllmHash};
use kvsight_sidecar::kv_events::subscriber::{SharedMirror, lock};
use kvsight_sidecar::mirror::Mirror;
use kvsight_sidecar::publisher::Publisher;
use kvsight_sidecar::state::{LoadSample, Shared};
use kvsight_transport::dev_certs::DevCa;
use kvsight_transport::{FramedRecv, FramedSend, TlsMaterial, server};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

const WAIT: Duration = Duration::from_secs(10);

/// What a test router saw, per accepted connection.
#[derive(Debug)]
enum Seen {
    /// A connection that said Hello and got Welcome, with the pod's leaf certificate.
    Connected(
        u64,
        mpsc::UnboundedSender<RouterMessage>,
        CertificateDer<'static>,
    ),
    Message(u64, SidecarMessage),
    Closed,
}

struct TestRouter {
    addr: SocketAddr,
    endpoint: quinn::Endpoint,
    seen: mpsc::UnboundedReceiver<Seen>,
}

impl TestRouter {
    fn start(tls: &TlsMaterial, bind: &str, refuse: Option<&str>) -> TestRouter {
        Self::on(tls, UdpSocket::bind(bind).unwrap(), refuse)
    }

    /// A router on the port a stopped one used: the old endpoint releases its socket once its
    /// last connection task is gone, so binding is retried (bounded).
    async fn restart_at(tls: &TlsMaterial, addr: SocketAddr) -> TestRouter {
        let deadline = Instant::now() + WAIT;
        loop {
            match UdpSocket::bind(addr) {
                Ok(s) => return Self::on(tls, s, None),
                Err(e) => assert!(Instant::now() < deadline, "rebinding {addr}: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn on(tls: &TlsMaterial, socket: UdpSocket, refuse: Option<&str>) -> TestRouter {
        let addr = socket.local_addr().unwrap();
        let endpoint = server(socket, tls).unwrap();
        let (tx, seen) = mpsc::unbounded_channel();
        let ep = endpoint.clone();
        let refuse = refuse.map(str::to_owned);
        tokio::spawn(async move {
            let mut n = 0;
            while let Some(incoming) = ep.accept().await {
                n += 1;
                let id = n;
                let tx = tx.clone();
                let refuse = refuse.clone();
                tokio::spawn(async move {
                    let Ok(conn) = incoming.await else { return };
                    let Ok((send, recv)) = conn.accept_bi().await else {
                        return;
                    };
                    let (mut send, mut recv) = (FramedSend::new(send), FramedRecv::new(recv));
                    let Ok(Some(hello)) = recv.recv::<SidecarMessage>().await else {
                        return;
                    };
                    let _ = tx.send(Seen::Message(id, hello));
                    if let Some(reason) = refuse {
                        let _ = send
                            .send(&RouterMessage::Refused(Refused {
                                protocol_version: PROTOCOL_VERSION,
                                reason,
                            }))
                            .await;
                        let _ = send.finish();
                        let _ = conn.closed().await;
                        return;
                    }
                    send.send(&RouterMessage::Welcome(Welcome {
                        protocol_version: PROTOCOL_VERSION,
                        router_id: format!("router-{id}"),
                    }))
                    .await
                    .unwrap();
                    let (out_tx, mut out_rx) = mpsc::unbounded_channel();
                    let peer = conn
                        .peer_identity()
                        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
                        .and_then(|chain| chain.first().cloned())
                        .expect("mutual TLS: the pod presented a certificate");
                    let _ = tx.send(Seen::Connected(id, out_tx, peer));
                    // The test may drop its sender: then the router only listens.
                    let mut out_open = true;
                    loop {
                        tokio::select! {
                            m = recv.recv::<SidecarMessage>() => match m {
                                Ok(Some(m)) => { let _ = tx.send(Seen::Message(id, m)); }
                                _ => break,
                            },
                            out = out_rx.recv(), if out_open => match out {
                                Some(m) => { if send.send(&m).await.is_err() { break; } }
                                None => out_open = false,
                            },
                        }
                    }
                    let _ = tx.send(Seen::Closed);
                });
            }
        });
        TestRouter {
            addr,
            endpoint,
            seen,
        }
    }

    async fn next(&mut self) -> Seen {
        tokio::time::timeout(WAIT, self.seen.recv())
            .await
            .expect("router saw nothing in time")
            .expect("router task alive")
    }

    /// The next sidecar message, skipping `Load`s unless `loads`.
    async fn message(&mut self, loads: bool) -> (u64, SidecarMessage) {
        loop {
            match self.next().await {
                Seen::Message(_, SidecarMessage::Load(_)) if !loads => {}
                Seen::Message(id, m) => return (id, m),
                _ => {}
            }
        }
    }

    /// Waits until the router's view holds `n` blocks, by a delta or (when the change was
    /// published before this connection subscribed) by its snapshot.
    async fn resident(&mut self, n: u64) {
        loop {
            match self.message(false).await {
                (_, SidecarMessage::CacheDelta(d)) if d.resident_blocks == n => return,
                (_, SidecarMessage::CacheSnapshot(s)) if s.resident_blocks == n => return,
                _ => {}
            }
        }
    }

    async fn connected(&mut self) -> (u64, mpsc::UnboundedSender<RouterMessage>) {
        let (id, tx, _) = self.connected_as().await;
        (id, tx)
    }

    /// [`connected`](Self::connected), with the certificate the pod presented.
    async fn connected_as(
        &mut self,
    ) -> (
        u64,
        mpsc::UnboundedSender<RouterMessage>,
        CertificateDer<'static>,
    ) {
        loop {
            if let Seen::Connected(id, tx, peer) = self.next().await {
                return (id, tx, peer);
            }
        }
    }

    async fn stop(self) {
        self.endpoint
            .close(CloseReason::Shutdown.code().into(), b"restart");
        self.endpoint.wait_idle().await;
    }
}

fn hello() -> Hello {
    Hello {
        instance_id: 42,
        engine: EngineFacts {
            block_size: 4,
            ..messages::engine()
        },
        load_interval_ms: 100,
        ..messages::hello("pod-0", "http://127.0.0.1:8000")
    }
}

fn store(mirror: &SharedMirror, first_hash: u64, blocks: u64) {
    let tokens: Vec<u32> = (0..blocks as u32 * 4)
        .map(|t| t + first_hash as u32)
        .collect();
    lock(mirror).apply(&Event::Stored(Stored {
        block_hashes: (0..blocks).map(|i| VllmHash::Int(first_hash + i)).collect(),
        parent_block_hash: None,
        token_ids: tokens,
        block_size: 4,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: None,
        group_idx: None,
        kv_cache_spec_kind: None,
    }));
}

struct Sidecar {
    shared: Arc<Shared>,
    /// What the sidecar's TLS reload would publish: the material for its next handshakes.
    tls: tokio::sync::watch::Sender<TlsMaterial>,
    mirror: SharedMirror,
    close: CancellationToken,
    stop: CancellationToken,
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn start_sidecar(
    tls: TlsMaterial,
    routers: &[SocketAddr],
    tokenizer: Option<TokenizerFiles>,
) -> Sidecar {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("debug,quinn=info,quinn_proto=info,rustls=info")
        .try_init();
    let shared = Arc::new(Shared::default());
    let mirror = Arc::new(Mutex::new(Mirror::new(1000).unwrap()));
    let publisher = Publisher::new(Arc::clone(&shared), Arc::clone(&mirror), hello(), tokenizer);
    let stop = CancellationToken::new();
    let close = stop.child_token();
    let tracker = TaskTracker::new();
    let (tls, current) = tokio::sync::watch::channel(tls);
    tokio::spawn(Arc::clone(&publisher).run_ticker(Duration::from_millis(10), stop.clone()));
    tokio::spawn(
        publisher.run_routers(
            current,
            routers
                .iter()
                .map(|a| RouterTarget {
                    host: a.ip().to_string(),
                    port: a.port(),
                })
                .collect(),
            Duration::from_secs(60),
            close.clone(),
            tracker,
        ),
    );
    Sidecar {
        shared,
        tls,
        mirror,
        close,
        stop,
    }
}

/// Polls `cond` until true; bounded by [`WAIT`]. For state that has no change notification.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn hello_snapshot_then_deltas_and_loads() {
    let ca = DevCa::new("test-ca").unwrap();
    let mut router = TestRouter::start(
        &ca.material("router", &["127.0.0.1"]).unwrap(),
        "127.0.0.1:0",
        None,
    );
    let side = start_sidecar(
        ca.material("pod-0", &["pod-0"]).unwrap(),
        &[router.addr],
        None,
    );

    let (_, m) = router.message(false).await;
    let SidecarMessage::Hello(h) = m else {
        panic!("first message must be Hello, got {m:?}")
    };
    assert_eq!(h.pod.name, "pod-0");
    let (_, m) = router.message(false).await;
    let SidecarMessage::CacheSnapshot(snap) = m else {
        panic!("second message must be CacheSnapshot, got {m:?}")
    };
    assert_eq!(snap.resident_blocks, 0);
    let mut view = BloomFilter::from_snapshot(&snap).unwrap();

    store(&side.mirror, 1000, 5);
    let (_, m) = router.message(false).await;
    let SidecarMessage::CacheDelta(delta) = m else {
        panic!("expected a CacheDelta, got {m:?}")
    };
    assert_eq!(delta.base_version, snap.version);
    assert_eq!(delta.resident_blocks, 5);
    // A change of 5 blocks costs O(5) toggles, not the filter's size.
    assert!(
        delta.toggles.len() <= 5 * 8,
        "{} toggles",
        delta.toggles.len()
    );
    view.apply_delta(&delta).unwrap();
    for (_, canonical) in lock(&side.mirror).blocks() {
        assert!(view.contains(canonical));
    }

    // Load reaches the router with its own sequence.
    let mut load = kvsight_sidecar::load::build_load(
        &Default::default(),
        Phase::Ready,
        CacheView::Exact,
        0,
        None,
    );
    load.running = 3;
    side.shared.load.send_replace(Some(LoadSample {
        sampled_at: Instant::now(),
        load,
    }));
    let l = loop {
        if let (_, SidecarMessage::Load(l)) = router.message(true).await {
            break l;
        }
    };
    assert_eq!(l.running, 3);
    assert_eq!(l.seq, 1);
    assert_eq!(side.shared.metrics.routers_connected.get(), 1);
}

#[tokio::test]
async fn restarted_router_gets_a_fresh_snapshot() {
    let ca = DevCa::new("test-ca").unwrap();
    let tls = ca.material("router", &["127.0.0.1"]).unwrap();
    let mut router = TestRouter::start(&tls, "127.0.0.1:0", None);
    let addr = router.addr;
    let side = start_sidecar(ca.material("pod-0", &["pod-0"]).unwrap(), &[addr], None);
    router.connected().await;
    store(&side.mirror, 1, 7);
    router.resident(7).await;
    router.stop().await;

    // Same address, new process.
    let mut router = TestRouter::restart_at(&tls, addr).await;
    let (_, m) = router.message(false).await;
    assert!(matches!(m, SidecarMessage::Hello(_)), "{m:?}");
    let (_, m) = router.message(false).await;
    let SidecarMessage::CacheSnapshot(snap) = m else {
        panic!("expected a snapshot after reconnect, got {m:?}")
    };
    assert_eq!(snap.resident_blocks, 7);
    let view = BloomFilter::from_snapshot(&snap).unwrap();
    for (_, canonical) in lock(&side.mirror).blocks() {
        assert!(view.contains(canonical));
    }
}

#[tokio::test]
async fn a_renewed_pod_certificate_is_presented_from_the_next_connection_on() {
    let ca = DevCa::new("test-ca").unwrap();
    let tls = ca.material("router", &["127.0.0.1"]).unwrap();
    let mut router = TestRouter::start(&tls, "127.0.0.1:0", None);
    let addr = router.addr;
    let leaf = |name: &str| {
        let l = ca.issue(name, &[name]).unwrap();
        let m = TlsMaterial::from_pem(l.cert.as_bytes(), l.key.as_bytes(), ca.ca_pem().as_bytes())
            .unwrap();
        (
            CertificateDer::from_pem_slice(l.cert.as_bytes()).unwrap(),
            m,
        )
    };
    let (first_der, first) = leaf("pod-0");
    let (renewed_der, renewed) = leaf("pod-0");
    let side = start_sidecar(first, &[addr], None);
    assert_eq!(router.connected_as().await.2, first_der);

    // A renewal reaches the publisher; the connection in progress keeps its keys, the next one
    // (here: after the router restarted) presents the renewed certificate.
    side.tls.send_replace(renewed);
    router.stop().await;
    let mut router = TestRouter::restart_at(&tls, addr).await;
    assert_eq!(router.connected_as().await.2, renewed_der);
}

#[tokio::test]
async fn rogue_ca_router_is_refused_while_the_good_one_is_served() {
    let ca = DevCa::new("test-ca").unwrap();
    let rogue_ca = DevCa::new("rogue-ca").unwrap();
    let mut rogue = TestRouter::start(
        &rogue_ca.material("router", &["127.0.0.1"]).unwrap(),
        "127.0.0.1:0",
        None,
    );
    let mut good = TestRouter::start(
        &ca.material("router", &["127.0.0.1"]).unwrap(),
        "127.0.0.1:0",
        None,
    );
    let side = start_sidecar(
        ca.material("pod-0", &["pod-0"]).unwrap(),
        &[rogue.addr, good.addr],
        None,
    );
    let (_, m) = good.message(false).await;
    assert!(matches!(m, SidecarMessage::Hello(_)));
    let metrics = Arc::clone(&side.shared.metrics);
    eventually("a failed connection to the rogue router", || {
        metrics
            .render()
            .contains("router_errors_total{reason=\"connect\"}")
    })
    .await;
    assert!(rogue.seen.try_recv().is_err(), "rogue router got a message");
    // The good one keeps being served.
    store(&side.mirror, 50, 2);
    good.resident(2).await;
    assert_eq!(metrics.routers_connected.get(), 1);
}

#[tokio::test]
async fn refused_hello_is_counted_and_retried() {
    let ca = DevCa::new("test-ca").unwrap();
    let mut router = TestRouter::start(
        &ca.material("router", &["127.0.0.1"]).unwrap(),
        "127.0.0.1:0",
        Some("protocol version 0 expected"),
    );
    let side = start_sidecar(
        ca.material("pod-0", &["pod-0"]).unwrap(),
        &[router.addr],
        None,
    );
    // Two Hellos: refused once, tried again after a backoff.
    for _ in 0..2 {
        let (_, m) = router.message(false).await;
        assert!(matches!(m, SidecarMessage::Hello(_)));
    }
    let metrics = Arc::clone(&side.shared.metrics);
    eventually("refusal counted", || {
        metrics
            .render()
            .contains("router_errors_total{reason=\"refused\"}")
    })
    .await;
    assert_eq!(metrics.routers_connected.get(), 0);
}

#[tokio::test]
async fn tokenizer_chunks_inflight_resync_and_goodbye() {
    let ca = DevCa::new("test-ca").unwrap();
    let mut router = TestRouter::start(
        &ca.material("router", &["127.0.0.1"]).unwrap(),
        "127.0.0.1:0",
        None,
    );
    // Bigger than one chunk, so reassembly is exercised.
    let files = TokenizerFiles {
        tokenizer_json: (0..2_500_000u32).map(|i| (i % 251) as u8).collect(),
        tokenizer_config: Some(b"{\"chat_template\": \"{{ messages }}\"}".to_vec()),
        chat_template: None,
    };
    let side = start_sidecar(
        ca.material("pod-0", &["pod-0"]).unwrap(),
        &[router.addr],
        Some(files.clone()),
    );
    let (_, m) = router.message(false).await;
    let SidecarMessage::Hello(h) = m else {
        panic!("{m:?}")
    };
    assert_eq!(h.tokenizer.as_ref().unwrap().digest, files.digest());
    let (_, to_sidecar) = router.connected().await;
    to_sidecar
        .send(RouterMessage::TokenizerRequest(TokenizerRequest {
            model: "m".into(),
        }))
        .unwrap();
    let mut asm = TokenizerAssembler::new();
    let got = loop {
        if let (_, SidecarMessage::TokenizerChunk(c)) = router.message(false).await
            && let Some(done) = asm.push(c).unwrap()
        {
            break done;
        }
    };
    assert_eq!(got.0, "m");
    assert_eq!(got.1, files);

    to_sidecar
        .send(RouterMessage::Inflight(Inflight {
            seq: 1,
            requests: 3,
        }))
        .unwrap();
    let shared = Arc::clone(&side.shared);
    eventually("in-flight recorded", || shared.inflight_total() == 3).await;

    // A router whose filter went wrong asks for a resync and gets a snapshot of what it has.
    store(&side.mirror, 900, 3);
    router.resident(3).await;
    to_sidecar.send(RouterMessage::ResyncRequest).unwrap();
    let snap = loop {
        if let (_, SidecarMessage::CacheSnapshot(s)) = router.message(false).await {
            break s;
        }
    };
    assert_eq!(snap.resident_blocks, 3);

    side.shared.set_close_reason(CloseReason::Drained);
    side.close.cancel();
    let bye = loop {
        if let (_, SidecarMessage::Goodbye(g)) = router.message(false).await {
            break g;
        }
    };
    assert_eq!(bye.reason, CloseReason::Drained);
}

/// The next `Placements` router `r` is sent, skipping everything else.
async fn placements(r: &mut TestRouter) -> Vec<Placement> {
    loop {
        if let (_, SidecarMessage::Placements(p)) = r.message(false).await {
            return p.entries;
        }
    }
}

#[tokio::test]
async fn a_routers_placement_is_relayed_to_every_other_router_and_not_back() {
    let ca = DevCa::new("test-ca").unwrap();
    let tls = ca.material("router", &["127.0.0.1"]).unwrap();
    let mut a = TestRouter::start(&tls, "127.0.0.1:0", None);
    let mut b = TestRouter::start(&tls, "127.0.0.1:0", None);
    let mut c = TestRouter::start(&tls, "127.0.0.1:0", None);
    let side = start_sidecar(
        ca.material("pod-0", &["pod-0"]).unwrap(),
        &[a.addr, b.addr, c.addr],
        None,
    );
    let (_, to_a) = a.connected().await;
    let (_, to_b) = b.connected().await;
    let _ = c.connected().await;
    let routed = |first: u64, n: u64| Routed {
        chain: PackedChain::new(&(first..first + n).collect::<Vec<_>>()),
        new_blocks: n as u32,
        uncached_tokens: 4 * n as u32,
    };
    to_a.send(RouterMessage::Routed(routed(100, 7))).unwrap();
    for r in [&mut b, &mut c] {
        let got = placements(r).await;
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].routed, routed(100, 7));
        assert!(got[0].age_ms < WAIT.as_millis() as u32);
    }
    // B's placement reaches A (and C); had A been sent its own, it would come first here.
    to_b.send(RouterMessage::Routed(routed(200, 3))).unwrap();
    let got = placements(&mut a).await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].routed, routed(200, 3));
    assert_eq!(placements(&mut c).await[0].routed, routed(200, 3));
    let text = side.shared.metrics.render();
    for (outcome, n) in [("received", 2), ("relayed", 4)] {
        let line = format!("kvsight_sidecar_placements_total{{outcome=\"{outcome}\"}} {n}");
        assert!(text.contains(&line), "no {line:?} in\n{text}");
    }
}

#[tokio::test]
async fn a_router_that_connects_later_is_told_the_recent_placements_until_a_cache_reset() {
    let ca = DevCa::new("test-ca").unwrap();
    let tls = ca.material("router", &["127.0.0.1"]).unwrap();
    let mut a = TestRouter::start(&tls, "127.0.0.1:0", None);
    let late = UdpSocket::bind("127.0.0.1:0").unwrap();
    let late_addr = late.local_addr().unwrap();
    drop(late);
    let side = start_sidecar(
        ca.material("pod-0", &["pod-0"]).unwrap(),
        &[a.addr, late_addr],
        None,
    );
    let (_, to_a) = a.connected().await;
    let chain: Vec<u64> = (500..540).collect();
    to_a.send(RouterMessage::Routed(Routed {
        chain: PackedChain::new(&chain),
        new_blocks: 40,
        uncached_tokens: 160,
    }))
    .unwrap();
    eventually("the sidecar to receive the placement", || {
        side.shared
            .metrics
            .render()
            .contains("outcome=\"received\"} 1")
    })
    .await;
    // A router that starts now hears it right after its snapshot.
    let mut b = TestRouter::restart_at(&tls, late_addr).await;
    let recent = loop {
        match b.message(false).await {
            (_, SidecarMessage::RecentPlacements(r)) => break r.entries,
            (_, SidecarMessage::CacheDelta(_) | SidecarMessage::Placements(_)) => {
                panic!("recent placements come right after the snapshot")
            }
            _ => {}
        }
    };
    assert_eq!(recent.len(), 1);
    assert_eq!(recent[0].chain_len, 40);
    let marks: Vec<(usize, u64)> = recent[0].marks().collect();
    assert_eq!(marks.last(), Some(&(31, chain[31])));
    // After a cache reset they are forgotten: the next connection gets none.
    lock(&side.mirror).apply(&Event::AllCleared);
    b.stop().await;
    let mut b = TestRouter::restart_at(&tls, late_addr).await;
    loop {
        if let (_, SidecarMessage::CacheSnapshot(_)) = b.message(false).await {
            break;
        }
    }
    // The connection subscribed to deltas before its snapshot: this one comes after anything
    // the sidecar sends right after the snapshot.
    store(&side.mirror, 9000, 2);
    loop {
        match b.message(false).await {
            (_, SidecarMessage::RecentPlacements(r)) => panic!("forgotten, yet sent: {r:?}"),
            (_, SidecarMessage::CacheDelta(_)) => break,
            _ => {}
        }
    }
}
