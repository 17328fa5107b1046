//! The publisher over real loopback ZMQ sockets, read back by the simulator's raw client: PUB
//! framing and topic filtering, replay in both layouts, and the fault knobs.

use std::time::Duration;

use kvsight_sim::kv_events::client::{self, Frames, Subscriber};
use kvsight_sim::kv_events::{
    BlockHash, BlockRemoved, BlockStored, EndpointMode, EventBatch, KvEvent, KvEventPublisher,
    Layout, PublisherConfig, ReplayLayout, encode_batch,
};
use rmpv::Value;

const TOPIC: &str = "kv-events";
const WAIT: Duration = Duration::from_secs(10);
const MAX_REPLAY: usize = 1000;

/// A distinct batch per `i`, so a payload identifies the batch it came from.
fn batch(i: u64) -> EventBatch {
    let events = match i % 3 {
        0 => vec![KvEvent::BlockStored(BlockStored {
            group_idx: Some(0),
            ..BlockStored::new(
                vec![BlockHash::Int(u64::MAX - i), BlockHash::Int(i)],
                (i > 0).then(|| BlockHash::Int(i - 1)),
                vec![1, 2, 3, u32::try_from(i).expect("small")],
                2,
            )
        })],
        1 => vec![KvEvent::BlockRemoved(BlockRemoved::new(vec![
            BlockHash::Int(i),
        ]))],
        _ => vec![KvEvent::AllBlocksCleared],
    };
    EventBatch::new(1_700_000_000.0 + i as f64, events)
}

/// The payload the publisher must send for `batch(i)`: rank filled in with the default 0.
fn expected_payload(i: u64, layout: Layout) -> Vec<u8> {
    let mut b = batch(i);
    b.data_parallel_rank = Some(0);
    encode_batch(&b, layout).expect("encode")
}

async fn publisher(config: PublisherConfig) -> KvEventPublisher {
    KvEventPublisher::bind(config)
        .await
        .expect("bind publisher")
}

async fn subscribed(publisher: &KvEventPublisher, topic: &str) -> Subscriber {
    let before = publisher.subscriptions_seen();
    let sub = Subscriber::connect(publisher.endpoint(), topic)
        .await
        .expect("connect SUB");
    publisher
        .wait_for_subscriptions(before + 1, WAIT)
        .await
        .expect("subscription reaches the publisher");
    sub
}

async fn publish(publisher: &KvEventPublisher, range: std::ops::Range<u64>) {
    for i in range {
        publisher.publish(batch(i)).expect("publish");
    }
    publisher.flush().await.expect("flush");
}

async fn replay(publisher: &KvEventPublisher, start: u64, layout: ReplayLayout) -> Vec<Frames> {
    let endpoint = publisher.replay_endpoint().expect("replay on");
    client::replay(endpoint, start, layout, WAIT, MAX_REPLAY)
        .await
        .expect("replay")
}

fn seqs(frames: &[Frames]) -> Vec<u64> {
    frames.iter().map(|f| f.seq).collect()
}

#[tokio::test]
async fn live_frames_carry_topic_and_consecutive_seqs_from_zero() {
    let publisher = publisher(PublisherConfig::loopback(TOPIC)).await;
    assert!(publisher.endpoint().starts_with("tcp://127.0.0.1:"));
    assert!(!publisher.endpoint().ends_with(":0"), "port not resolved");
    let mut sub = subscribed(&publisher, TOPIC).await;

    publish(&publisher, 0..5).await;
    for i in 0..5 {
        let frames = sub.recv(WAIT).await.expect("live message");
        assert_eq!(frames.topic.as_deref(), Some(TOPIC.as_bytes()));
        assert_eq!(frames.seq, i);
        assert_eq!(frames.payload, expected_payload(i, Layout::Map));
        // Decodable as msgpack, shaped [ts: f64, [events], rank].
        let value = rmpv::decode::read_value(&mut frames.payload.as_ref()).expect("msgpack");
        let Value::Array(items) = value else {
            panic!("batch is not an array: {value:?}")
        };
        assert_eq!(items.len(), 3);
        assert_eq!(items[0], Value::F64(1_700_000_000.0 + i as f64));
        assert!(matches!(&items[1], Value::Array(events) if events.len() == 1));
        assert_eq!(items[2], Value::from(0));
    }
    assert_eq!(publisher.next_seq(), 5);
    publisher.shutdown(WAIT).await;
}

#[tokio::test]
async fn array_layout_goes_on_the_wire_when_configured() {
    let publisher = publisher(PublisherConfig {
        layout: Layout::Array,
        ..PublisherConfig::loopback(TOPIC)
    })
    .await;
    let mut sub = subscribed(&publisher, "").await;
    publish(&publisher, 0..2).await;
    for i in 0..2 {
        let frames = sub.recv(WAIT).await.expect("live message");
        assert_eq!(frames.payload, expected_payload(i, Layout::Array));
    }
}

#[tokio::test]
async fn subscriber_with_a_non_matching_topic_gets_nothing() {
    let publisher = publisher(PublisherConfig::loopback(TOPIC)).await;
    // One SUB socket, first subscribed only to another topic: batch 0 must be filtered out.
    // Then it also subscribes to a prefix of ours and batch 1 goes through. Messages to one peer
    // keep their order, so if filtering were broken batch 0 would arrive first.
    let mut sub = subscribed(&publisher, "other-topic").await;
    publish(&publisher, 0..1).await;
    let seen = publisher.subscriptions_seen();
    sub.subscribe("kv-").await.expect("subscribe");
    publisher
        .wait_for_subscriptions(seen + 1, WAIT)
        .await
        .expect("second subscription");
    publish(&publisher, 1..2).await;
    let frames = sub.recv(WAIT).await.expect("the matching batch");
    assert_eq!(
        frames.seq, 1,
        "batch 0 leaked through a non-matching subscription"
    );
}

#[tokio::test]
async fn replay_returns_the_buffered_batches_from_start_in_both_layouts() {
    for layout in [ReplayLayout::New, ReplayLayout::Old] {
        let publisher = publisher(PublisherConfig {
            replay_layout: layout,
            ..PublisherConfig::loopback(TOPIC)
        })
        .await;
        publish(&publisher, 0..6).await;

        let frames = replay(&publisher, 2, layout).await;
        assert_eq!(seqs(&frames), vec![2, 3, 4, 5], "{layout:?}");
        for f in &frames {
            assert_eq!(
                f.payload,
                expected_payload(f.seq, Layout::Map),
                "{layout:?}"
            );
            let topic = f.topic.as_deref();
            match layout {
                ReplayLayout::New => assert_eq!(topic, Some(TOPIC.as_bytes())),
                ReplayLayout::Old => assert_eq!(topic, None),
            }
        }
        assert_eq!(
            seqs(&replay(&publisher, 0, layout).await),
            vec![0, 1, 2, 3, 4, 5]
        );
        // Past the newest batch: only the end marker.
        assert!(replay(&publisher, 6, layout).await.is_empty(), "{layout:?}");
        publisher.shutdown(WAIT).await;
    }
}

#[tokio::test]
async fn replay_from_before_the_buffer_starts_at_the_oldest_buffered_batch() {
    let publisher = publisher(PublisherConfig {
        buffer_steps: 3,
        ..PublisherConfig::loopback(TOPIC)
    })
    .await;
    publish(&publisher, 0..7).await;
    let frames = replay(&publisher, 1, ReplayLayout::New).await;
    assert_eq!(seqs(&frames), vec![4, 5, 6]);
    assert_eq!(frames[0].payload, expected_payload(4, Layout::Map));
}

#[tokio::test]
async fn dropped_seqs_are_missing_live_but_present_in_replay() {
    let publisher = publisher(PublisherConfig::loopback(TOPIC)).await;
    let mut sub = subscribed(&publisher, TOPIC).await;
    publisher.set_live_drop(Some(2..4));
    publish(&publisher, 0..6).await;
    let mut live = Vec::new();
    for _ in 0..4 {
        live.push(sub.recv(WAIT).await.expect("live").seq);
    }
    assert_eq!(live, vec![0, 1, 4, 5]);

    let frames = replay(&publisher, 2, ReplayLayout::New).await;
    assert_eq!(seqs(&frames), vec![2, 3, 4, 5]);
    assert_eq!(frames[0].payload, expected_payload(2, Layout::Map));

    // Dropping off again: the next batch is live.
    publisher.set_live_drop(None);
    publish(&publisher, 6..7).await;
    assert_eq!(sub.recv(WAIT).await.expect("live").seq, 6);
}

#[tokio::test]
async fn sequence_restart_goes_back_to_zero_and_forgets_the_buffer() {
    let publisher = publisher(PublisherConfig::loopback(TOPIC)).await;
    let mut sub = subscribed(&publisher, TOPIC).await;
    publish(&publisher, 0..3).await;
    publisher.restart_sequence();
    assert_eq!(publisher.next_seq(), 0);
    publish(&publisher, 10..12).await;

    let mut live = Vec::new();
    for _ in 0..5 {
        live.push(sub.recv(WAIT).await.expect("live"));
    }
    assert_eq!(seqs(&live), vec![0, 1, 2, 0, 1]);
    assert_eq!(live[3].payload, expected_payload(10, Layout::Map));

    let frames = replay(&publisher, 0, ReplayLayout::New).await;
    assert_eq!(seqs(&frames), vec![0, 1]);
    assert_eq!(frames[0].payload, expected_payload(10, Layout::Map));
    assert_eq!(frames[1].payload, expected_payload(11, Layout::Map));
}

#[tokio::test]
async fn connect_mode_publisher_reaches_a_bound_subscriber() {
    let (mut sub, endpoint) = Subscriber::bind("tcp://127.0.0.1:0", TOPIC)
        .await
        .expect("bind SUB");
    let publisher = publisher(PublisherConfig {
        endpoint,
        endpoint_mode: EndpointMode::Auto,
        replay_endpoint: None,
        ..PublisherConfig::loopback(TOPIC)
    })
    .await;
    assert!(publisher.replay_endpoint().is_none());
    publisher
        .wait_for_subscriptions(1, WAIT)
        .await
        .expect("bound SUB's subscription arrives over the publisher's connection");
    publish(&publisher, 0..1).await;
    let frames = sub.recv(WAIT).await.expect("live");
    assert_eq!(
        (frames.seq, frames.payload.as_ref()),
        (0, expected_payload(0, Layout::Map).as_slice())
    );
}

#[tokio::test]
async fn dropping_the_publisher_releases_its_port() {
    let publisher = publisher(PublisherConfig::loopback(TOPIC)).await;
    let endpoint = publisher.endpoint().to_owned();
    publisher.shutdown(WAIT).await;
    let again = KvEventPublisher::bind(PublisherConfig {
        endpoint: endpoint.clone(),
        replay_endpoint: None,
        ..PublisherConfig::loopback(TOPIC)
    })
    .await
    .expect("port free again after shutdown");
    assert_eq!(again.endpoint(), endpoint);
}

#[tokio::test]
async fn a_full_send_queue_drops_live_messages_without_blocking_publish() {
    let publisher = publisher(PublisherConfig {
        queue_capacity: 1,
        ..PublisherConfig::loopback(TOPIC)
    })
    .await;
    let mut sub = subscribed(&publisher, TOPIC).await;
    // The test runtime is single-threaded: the sending task cannot run during this loop, so
    // the first batch fills the queue and the other nine overflow it.
    for i in 0..10 {
        assert_eq!(publisher.publish(batch(i)).expect("publish"), i);
    }
    assert_eq!(publisher.live_messages_lost(), 9);
    publisher.flush().await.expect("flush");
    publish(&publisher, 10..11).await;
    assert_eq!(publisher.live_messages_lost(), 9);
    assert_eq!(sub.recv(WAIT).await.expect("live").seq, 0);
    assert_eq!(sub.recv(WAIT).await.expect("live").seq, 10);
    // Everything stays replayable.
    let frames = replay(&publisher, 0, ReplayLayout::New).await;
    assert_eq!(seqs(&frames), (0..11).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_subscriber_after_another_left_gets_the_stream_on_a_threaded_runtime() {
    let publisher = publisher(PublisherConfig::loopback(TOPIC)).await;
    let mut first = subscribed(&publisher, TOPIC).await;
    publish(&publisher, 0..2).await;
    assert_eq!(first.recv(WAIT).await.expect("live").seq, 0);
    drop(first);

    let mut second = subscribed(&publisher, TOPIC).await;
    publish(&publisher, 2..50).await;
    for i in 2..50 {
        assert_eq!(second.recv(WAIT).await.expect("live").seq, i);
    }
}

#[tokio::test]
async fn dropping_the_publisher_without_shutdown_also_frees_its_port() {
    let publisher = publisher(PublisherConfig::loopback(TOPIC)).await;
    let endpoint = publisher.endpoint().to_owned();
    drop(publisher);
    // Drop only aborts the socket tasks; the listener closes once they have been cancelled,
    // a few scheduler turns later.
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut last_error = None;
    for _ in 0..10_000 {
        match KvEventPublisher::bind(PublisherConfig {
            endpoint: endpoint.clone(),
            replay_endpoint: None,
            ..PublisherConfig::loopback(TOPIC)
        })
        .await
        {
            Ok(again) => {
                assert_eq!(again.endpoint(), endpoint);
                return;
            }
            Err(e) => last_error = Some(e),
        }
        if tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::task::yield_now().await;
    }
    panic!("port {endpoint} still taken after drop: {last_error:?}");
}
