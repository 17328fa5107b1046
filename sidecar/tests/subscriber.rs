//! The ZMQ subscriber against the testbed's real vLLM KV-event publisher over loopback: the
//! mirror ends equal to the published resident set after a mixed stream, dropped ranges are
//! recovered by replay in both replay layouts, a restart resets, and history that cannot be
//! recovered is declared Lost without inventing blocks.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvsight_protocol::messages::CacheView;
use kvsight_sidecar::kv_events::subscriber::{
    KvSubscriber, SharedMirror, SubscriberConfig, SubscriberStatus, lock,
};
use kvsight_sidecar::metrics::Metrics;
use kvsight_sidecar::mirror::Mirror;
use kvsight_sim::kv_events::{
    BlockHash, BlockRemoved, BlockStored, EventBatch, KvEvent, KvEventPublisher, PublisherConfig,
    ReplayLayout,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const B: u32 = 4;
const WAIT: Duration = Duration::from_secs(10);

/// A deterministic workload that tracks the resident set vLLM would have.
struct Workload {
    rng: u64,
    next_hash: u64,
    resident: Vec<u64>,
}

impl Workload {
    fn new(seed: u64) -> Self {
        Workload {
            rng: seed | 1,
            // Hashes above 2^63 occur in vLLM (low 8 bytes of a digest).
            next_hash: (1 << 63) + seed * 1_000_000,
            resident: Vec::new(),
        }
    }

    fn rand(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    /// One batch: stores (new chains or extensions of resident blocks) and removals.
    fn batch(&mut self) -> EventBatch {
        let mut events = Vec::new();
        for _ in 0..(1 + self.rand() % 3) {
            let r = self.rand() % 10;
            if r < 6 || self.resident.is_empty() {
                let parent = if self.resident.is_empty() || r < 2 {
                    None
                } else {
                    let i = (self.rand() as usize) % self.resident.len();
                    Some(self.resident[i])
                };
                events.push(self.chain(parent));
            } else {
                let i = (self.rand() as usize) % self.resident.len();
                let h = self.resident.swap_remove(i);
                events.push(KvEvent::BlockRemoved(BlockRemoved::new(vec![
                    BlockHash::Int(h),
                ])));
            }
        }
        EventBatch::new(1.0, events)
    }

    /// Stores a chain of 1 to 3 new blocks under `parent` (a new root without one).
    fn chain(&mut self, parent: Option<u64>) -> KvEvent {
        let n = 1 + self.rand() % 3;
        let hashes: Vec<u64> = (0..n)
            .map(|_| {
                self.next_hash += 1;
                self.next_hash
            })
            .collect();
        let tokens: Vec<u32> = (0..n as u32 * B)
            .map(|_| (self.rand() % 50_000) as u32)
            .collect();
        self.resident.extend(&hashes);
        KvEvent::BlockStored(BlockStored::new(
            hashes.into_iter().map(BlockHash::Int).collect(),
            parent.map(BlockHash::Int),
            tokens,
            B,
        ))
    }

    fn clear(&mut self) -> EventBatch {
        self.resident.clear();
        EventBatch::new(1.0, vec![KvEvent::AllBlocksCleared])
    }

    fn set(&self) -> HashSet<u64> {
        self.resident.iter().copied().collect()
    }
}

struct Harness {
    publisher: KvEventPublisher,
    mirror: SharedMirror,
    status: watch::Receiver<SubscriberStatus>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl Harness {
    async fn start(configure: impl FnOnce(&mut PublisherConfig)) -> Harness {
        let mut cfg = PublisherConfig::loopback("kv@test");
        configure(&mut cfg);
        Harness::attach(KvEventPublisher::bind(cfg).await.expect("bind publisher")).await
    }

    /// Subscribes to a publisher that may already have published (a sidecar starting late).
    async fn attach(publisher: KvEventPublisher) -> Harness {
        let mirror = Arc::new(Mutex::new(Mirror::new(10_000).unwrap()));
        let metrics = Arc::new(Metrics::new());
        let sub = KvSubscriber::connect(
            SubscriberConfig {
                endpoint: publisher.endpoint().to_owned(),
                replay_endpoint: publisher.replay_endpoint().map(str::to_owned),
                topic: "kv@test".into(),
                replay_timeout: Duration::from_secs(5),
            },
            Arc::clone(&mirror),
            Arc::clone(&metrics),
        )
        .await
        .expect("subscribe");
        publisher
            .wait_for_subscriptions(1, WAIT)
            .await
            .expect("subscription reached the publisher");
        let status = sub.status();
        let cancel = CancellationToken::new();
        tokio::spawn(sub.run(cancel.clone()));
        Harness {
            publisher,
            mirror,
            status,
            metrics,
            cancel,
        }
    }

    fn publish(&self, batch: EventBatch) -> u64 {
        self.publisher.publish(batch).expect("publish")
    }

    /// Waits until the subscriber has applied `seq`.
    async fn applied(&mut self, seq: u64) -> SubscriberStatus {
        self.handled(seq, 0).await
    }

    /// Waits until `seq` is applied and at least `messages` live messages were handled (a
    /// replay can apply `seq` before the live copies of earlier batches are read).
    async fn handled(&mut self, seq: u64, messages: u64) -> SubscriberStatus {
        let mut rx = self.status.clone();
        let done = |s: &SubscriberStatus| s.last_seq == Some(seq) && s.messages >= messages;
        let waited = tokio::time::timeout(WAIT, rx.wait_for(done)).await;
        let got = waited
            .unwrap_or_else(|_| panic!("seq {seq} not applied: {:?}", self.status.borrow()))
            .expect("subscriber alive");
        got.clone()
    }

    fn mirror_set(&self) -> HashSet<u64> {
        lock(&self.mirror).blocks().map(|(k, _)| k).collect()
    }
}

#[tokio::test]
async fn mixed_stream_ends_with_the_published_resident_set() {
    let mut h = Harness::start(|_| {}).await;
    let mut w = Workload::new(7);
    let mut last = 0;
    for i in 0..300 {
        let batch = if i == 150 { w.clear() } else { w.batch() };
        last = h.publish(batch);
    }
    let status = h.applied(last).await;
    assert_eq!(status.view, CacheView::Exact);
    assert_eq!(status.gaps, 0);
    assert!(!w.resident.is_empty());
    assert_eq!(h.mirror_set(), w.set());
    assert_eq!(lock(&h.mirror).filter().len(), w.resident.len() as u64);
}

async fn dropped_range_is_replayed(layout: ReplayLayout) {
    let mut h = Harness::start(|c| c.replay_layout = layout).await;
    h.publisher.set_live_drop(Some(20..45));
    let mut w = Workload::new(11);
    let mut last = 0;
    for _ in 0..80 {
        last = h.publish(w.batch());
    }
    let status = h.applied(last).await;
    assert_eq!(status.gaps, 1, "{status:?}");
    assert_eq!(status.replays_recovered, 1, "{status:?}");
    assert_eq!(status.view, CacheView::Exact);
    assert_eq!(status.losses, 0);
    assert_eq!(h.mirror_set(), w.set());
    assert!(
        h.metrics
            .render()
            .contains("replays_total{outcome=\"recovered\"} 1")
    );
}

#[tokio::test]
async fn dropped_range_is_recovered_by_replay_new_layout() {
    dropped_range_is_replayed(ReplayLayout::New).await;
}

#[tokio::test]
async fn dropped_range_is_recovered_by_replay_old_layout() {
    dropped_range_is_replayed(ReplayLayout::Old).await;
}

#[tokio::test]
async fn restart_to_seq_zero_resets_and_resyncs() {
    let mut h = Harness::start(|_| {}).await;
    let mut before = Workload::new(3);
    let mut last = 0;
    for _ in 0..40 {
        last = h.publish(before.batch());
    }
    h.applied(last).await;
    assert_eq!(h.mirror_set(), before.set());

    // A new vLLM process: seq 0 again, an empty cache, new blocks.
    h.publisher.restart_sequence();
    let mut after = Workload::new(5);
    for _ in 0..10 {
        last = h.publish(after.batch());
    }
    assert_eq!(last, 9);
    let status = h.applied(last).await;
    assert_eq!(status.restarts, 1, "{status:?}");
    assert_eq!(status.view, CacheView::Exact);
    assert_eq!(h.mirror_set(), after.set(), "old blocks must be gone");
}

#[tokio::test]
async fn history_beyond_the_replay_buffer_is_lost_and_rebuilt() {
    let mut h = Harness::start(|c| c.buffer_steps = 3).await;
    let mut w = Workload::new(13);
    let mut last = 0;
    for _ in 0..5 {
        last = h.publish(w.batch());
    }
    h.applied(last).await;
    // Lose more batches than the engine keeps for replay.
    h.publisher.set_live_drop(Some(5..30));
    for _ in 0..25 {
        w.batch_into_void(&h);
    }
    h.publisher.set_live_drop(None);
    // After the loss: fresh chains only (their parents are known).
    let mut fresh = Workload::new(17);
    for _ in 0..10 {
        last = h.publish(fresh.batch_roots_only());
    }
    // 5 live before the loss, 10 after.
    let status = h.handled(last, 15).await;
    assert_eq!(
        status.restarts, 0,
        "stale live copies are not a restart: {status:?}"
    );
    assert_eq!(status.view, CacheView::Lost, "{status:?}");
    assert!(status.losses >= 1);
    let got = h.mirror_set();
    // Never invents blocks: everything the mirror holds is resident in the engine.
    let truth: HashSet<u64> = w.set().union(&fresh.set()).copied().collect();
    assert!(got.is_subset(&truth));
    // And it rebuilt from new events.
    assert!(fresh.set().is_subset(&got));
    assert!(
        h.metrics
            .render()
            .contains("replays_total{outcome=\"late_start\"} 1")
    );

    // A clear makes the view exact again.
    last = h.publish(fresh.clear());
    let status = h.handled(last, 16).await;
    assert_eq!(status.view, CacheView::Exact);
    assert!(h.mirror_set().is_empty());
}

#[tokio::test]
async fn gap_without_replay_socket_is_lost() {
    let mut h = Harness::start(|c| c.replay_endpoint = None).await;
    let mut w = Workload::new(19);
    h.publisher.set_live_drop(Some(2..4));
    let mut last = 0;
    for _ in 0..8 {
        last = h.publish(w.batch_roots_only());
    }
    let status = h.applied(last).await;
    assert_eq!(status.view, CacheView::Lost);
    assert_eq!(status.gaps, 1);
    assert!(h.mirror_set().is_subset(&w.set()));
    assert!(!h.mirror_set().is_empty());
}

impl Workload {
    fn batch_into_void(&mut self, h: &Harness) {
        let b = self.batch();
        h.publish(b);
    }

    /// A batch of new chains (no parents), so it can be placed even after lost history.
    fn batch_roots_only(&mut self) -> EventBatch {
        EventBatch::new(1.0, vec![self.chain(None)])
    }
}

/// Raw frames from a hand-driven XPUB: payloads that do not decode and messages that are not
/// `[topic, seq, payload]` are counted and skipped, and the stream goes on without a gap. A
/// payload that does not decode may have been a removal: the view is lost (reset, never exact
/// again until the cache is known empty), so no hit is predicted on a block that is gone.
#[tokio::test]
async fn malformed_messages_are_counted_and_skipped() {
    use bytes::Bytes;
    use kvsight_sim::kv_events::{Layout, encode_batch};
    use zeromq::{Socket, SocketRecv, SocketSend, XPubSocket, ZmqMessage};

    let mut xpub = XPubSocket::new();
    let endpoint = xpub.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mirror = Arc::new(Mutex::new(Mirror::new(1000).unwrap()));
    let metrics = Arc::new(Metrics::new());
    let sub = KvSubscriber::connect(
        SubscriberConfig {
            endpoint,
            replay_endpoint: None,
            topic: String::new(),
            replay_timeout: Duration::from_secs(1),
        },
        Arc::clone(&mirror),
        Arc::clone(&metrics),
    )
    .await
    .unwrap();
    // The subscription request reaching the XPUB is what makes delivery certain.
    let request = tokio::time::timeout(WAIT, xpub.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(request.get(0).and_then(|f| f.first()), Some(&1));
    let mut status = sub.status();
    let cancel = CancellationToken::new();
    tokio::spawn(sub.run(cancel.clone()));

    let send = |frames: Vec<Bytes>| ZmqMessage::try_from(frames).unwrap();
    let seq = |s: u64| Bytes::copy_from_slice(&s.to_be_bytes());
    // seq 0: not msgpack.
    xpub.send(send(vec![
        Bytes::new(),
        seq(0),
        Bytes::from_static(b"\xc1garbage"),
    ]))
    .await
    .unwrap();
    // Two frames only.
    xpub.send(send(vec![Bytes::new(), seq(1)])).await.unwrap();
    // seq 1: a real batch.
    let batch = EventBatch::new(
        1.0,
        vec![KvEvent::BlockStored(BlockStored::new(
            vec![BlockHash::Int(77)],
            None,
            vec![1, 2, 3, 4],
            B,
        ))],
    );
    let payload = Bytes::from(encode_batch(&batch, Layout::Map).unwrap());
    xpub.send(send(vec![Bytes::new(), seq(1), payload]))
        .await
        .unwrap();

    let got = tokio::time::timeout(WAIT, status.wait_for(|s| s.last_seq == Some(1)))
        .await
        .expect("valid batch applied")
        .unwrap()
        .clone();
    cancel.cancel();
    assert_eq!(got.malformed, 2, "{got:?}");
    assert_eq!(got.gaps, 0);
    assert_eq!(got.view, CacheView::Lost, "{got:?}");
    assert_eq!(got.losses, 1, "{got:?}");
    // What came after the loss is known again.
    assert_eq!(lock(&mirror).resident(), 1);
    assert!(
        metrics
            .render()
            .contains("kvsight_sidecar_kv_payloads_malformed_total 2")
    );
}

#[tokio::test]
async fn a_late_subscriber_catches_up_before_any_new_event() {
    // The engine served requests before the sidecar (re)started.
    let publisher = KvEventPublisher::bind(PublisherConfig::loopback("kv@test"))
        .await
        .expect("bind publisher");
    let mut w = Workload::new(23);
    let mut last = 0;
    for _ in 0..6 {
        last = publisher.publish(w.batch()).expect("publish");
    }
    let mut h = Harness::attach(publisher).await;
    // No new event was published: the history came from the catch-up alone.
    let status = h.status.borrow().clone();
    assert_eq!(status.last_seq, Some(last), "{status:?}");
    assert_eq!(status.view, CacheView::Exact);
    assert_eq!(status.messages, 0, "nothing live was read: {status:?}");
    assert_eq!(h.mirror_set(), w.set());

    // The live stream goes on without a gap or a false restart.
    let next = h.publish(w.batch());
    let status = h.applied(next).await;
    assert_eq!(
        (status.gaps, status.restarts, status.losses),
        (0, 0, 0),
        "{status:?}"
    );
    assert_eq!(h.mirror_set(), w.set());
}
