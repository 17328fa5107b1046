//! The arbiter: the simulator's stream read by pyzmq (libzmq) and decoded by msgspec into structs
//! declared as vLLM declares them (`tests/python/check_kv_events.py`), in both event layouts and
//! both replay layouts. Needs `$KVSIGHT_PYTHON`, a python with msgspec and pyzmq.

use std::process::Stdio;
use std::time::Duration;

use kvsight_sim::kv_events::{
    BlockHash, BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent, KvEventPublisher, Layout,
    PublisherConfig, ReplayLayout,
};
use serde_json::{Map, Value, json};
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/python/check_kv_events.py"
);
const TOPIC: &str = "kv-events";
const WAIT: Duration = Duration::from_secs(30);

fn batches() -> Vec<EventBatch> {
    let stored = BlockStored {
        lora_id: Some(7),
        lora_name: Some("sql-adapter".into()),
        extra_keys: Some(vec![
            Some(vec![
                ExtraKey::Str("sql-adapter".into()),
                ExtraKey::Tuple(vec![ExtraKey::Str("mm-abc".into()), ExtraKey::Int(16)]),
                ExtraKey::Str("salt".into()),
            ]),
            None,
        ]),
        group_idx: Some(1),
        kv_cache_spec_kind: Some("sliding_window".into()),
        kv_cache_spec_sliding_window: Some(4096),
        locality: Some("LOCAL".into()),
        session_id: Some("sess-1".into()),
        lookahead_token_ids: Some(vec![vec![5], vec![6]]),
        ..BlockStored::new(
            vec![BlockHash::Int(u64::MAX), BlockHash::Int(1 << 40)],
            Some(BlockHash::Int(3)),
            vec![1, 2, 70_000, 4],
            2,
        )
    };
    let bytes_stored = BlockStored::new(
        vec![BlockHash::Bytes(vec![0xde, 0xad, 0xbe, 0xef])],
        Some(BlockHash::Bytes(vec![0; 32])),
        vec![9, 9],
        2,
    );
    let removed = BlockRemoved {
        group_idx: Some(0),
        ownership: Some("tier-2".into()),
        ..BlockRemoved::new(vec![BlockHash::Int(u64::MAX)])
    };
    let mut with_rank = EventBatch::new(1_700_000_004.25, vec![KvEvent::AllBlocksCleared]);
    with_rank.data_parallel_rank = Some(3);
    vec![
        EventBatch::new(1_700_000_000.5, vec![KvEvent::AllBlocksCleared]),
        EventBatch::new(1_700_000_001.0, vec![KvEvent::BlockStored(stored)]),
        EventBatch::new(
            1_700_000_002.0,
            vec![
                KvEvent::BlockStored(bytes_stored),
                KvEvent::BlockRemoved(removed),
            ],
        ),
        EventBatch::new(1_700_000_003.0, vec![]),
        with_rank,
    ]
}

/// `v` as JSON, `None` when absent.
fn some_json<T: serde::Serialize>(v: &Option<T>) -> Option<Value> {
    v.as_ref().map(|v| json!(v))
}

fn hash_json(h: &BlockHash) -> Value {
    match h {
        BlockHash::Int(v) => json!(v),
        BlockHash::Bytes(b) => bytes_json(b),
    }
}

fn bytes_json(b: &[u8]) -> Value {
    json!({ "hex": b.iter().map(|x| format!("{x:02x}")).collect::<String>() })
}

fn extra_json(k: &ExtraKey) -> Value {
    match k {
        ExtraKey::Nil => Value::Null,
        ExtraKey::Bool(b) => json!(b),
        ExtraKey::Int(v) => json!(v),
        ExtraKey::Float(v) => json!(v),
        ExtraKey::Str(s) => json!(s),
        ExtraKey::Bytes(b) => bytes_json(b),
        ExtraKey::Tuple(items) => Value::Array(items.iter().map(extra_json).collect()),
    }
}

/// The event as the check script must see it: for maps exactly the keys on the wire in wire
/// order, for arrays every 0.23 field.
fn event_json(event: &KvEvent, layout: Layout) -> Value {
    let all = layout == Layout::Array;
    let mut m = Map::new();
    m.insert("type".into(), json!(event.tag()));
    let opt = |m: &mut Map<String, Value>, key: &str, v: Option<Value>, always: bool| {
        if always || all || v.is_some() {
            m.insert(key.into(), v.unwrap_or(Value::Null));
        }
    };
    match event {
        KvEvent::BlockStored(e) => {
            let hashes = e.block_hashes.iter().map(hash_json).collect();
            opt(&mut m, "block_hashes", Some(Value::Array(hashes)), true);
            opt(
                &mut m,
                "parent_block_hash",
                e.parent_block_hash.as_ref().map(hash_json),
                true,
            );
            opt(&mut m, "token_ids", Some(json!(e.token_ids)), true);
            opt(&mut m, "block_size", Some(json!(e.block_size)), true);
            opt(&mut m, "lora_id", e.lora_id.map(|v| json!(v)), true);
            opt(&mut m, "medium", some_json(&e.medium), true);
            opt(&mut m, "lora_name", some_json(&e.lora_name), true);
            let extra = e.extra_keys.as_ref().map(|keys| {
                keys.iter()
                    .map(|k| match k {
                        Some(items) => Value::Array(items.iter().map(extra_json).collect()),
                        None => Value::Null,
                    })
                    .collect()
            });
            opt(&mut m, "extra_keys", extra.map(Value::Array), false);
            opt(&mut m, "group_idx", e.group_idx.map(|v| json!(v)), false);
            opt(
                &mut m,
                "kv_cache_spec_kind",
                some_json(&e.kv_cache_spec_kind),
                false,
            );
            let window = e.kv_cache_spec_sliding_window.map(|v| json!(v));
            opt(&mut m, "kv_cache_spec_sliding_window", window, false);
            if layout == Layout::Map {
                opt(&mut m, "locality", some_json(&e.locality), false);
                opt(&mut m, "ownership", some_json(&e.ownership), false);
                opt(&mut m, "session_id", some_json(&e.session_id), false);
                let lookahead = some_json(&e.lookahead_token_ids);
                opt(&mut m, "lookahead_token_ids", lookahead, false);
            }
        }
        KvEvent::BlockRemoved(e) => {
            let hashes = e.block_hashes.iter().map(hash_json).collect();
            opt(&mut m, "block_hashes", Some(Value::Array(hashes)), true);
            opt(&mut m, "medium", some_json(&e.medium), true);
            opt(&mut m, "group_idx", e.group_idx.map(|v| json!(v)), false);
            if layout == Layout::Map {
                opt(&mut m, "locality", some_json(&e.locality), false);
                opt(&mut m, "ownership", some_json(&e.ownership), false);
            }
        }
        KvEvent::AllBlocksCleared => {}
    }
    Value::Object(m)
}

async fn check_with_python(python: &str, layout: Layout, replay_layout: ReplayLayout) {
    let publisher = KvEventPublisher::bind(PublisherConfig {
        layout,
        replay_layout,
        ..PublisherConfig::loopback(TOPIC)
    })
    .await
    .expect("bind publisher");
    let batches = batches();
    let expected: Vec<Value> = batches
        .iter()
        .enumerate()
        .map(|(seq, b)| {
            json!({
                "seq": seq,
                "ts": b.ts,
                // The publisher fills an unset rank with its own (0).
                "data_parallel_rank": b.data_parallel_rank.unwrap_or(0),
                "events": b.events.iter().map(|e| event_json(e, layout)).collect::<Vec<_>>(),
            })
        })
        .collect();
    let spec = json!({
        "endpoint": publisher.endpoint(),
        "replay_endpoint": publisher.replay_endpoint(),
        "topic": TOPIC,
        "layout": if layout == Layout::Map { "map" } else { "array" },
        "replay_layout": if replay_layout == ReplayLayout::New { "new" } else { "old" },
        "replay_start": 2,
        "batches": expected,
    });

    let mut child = Command::new(python)
        .arg(SCRIPT)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start $KVSIGHT_PYTHON");
    let mut stdin = child.stdin.take().expect("piped stdin");
    stdin
        .write_all(format!("{spec}\n").as_bytes())
        .await
        .expect("write spec");

    // Phase 1: the script is subscribed to a non-matching topic only; batch 0 must not reach it.
    let step = async {
        publisher.wait_for_subscriptions(1, WAIT).await?;
        publisher.publish(batches[0].clone())?;
        publisher.flush().await?;
        let seen = publisher.subscriptions_seen();
        stdin
            .write_all(b"go\n")
            .await
            .map_err(|_| kvsight_sim::kv_events::PublishError::Closed)?;
        // Phase 2: subscribed to our topic; the rest must arrive live.
        publisher.wait_for_subscriptions(seen + 1, WAIT).await?;
        for b in &batches[1..] {
            publisher.publish(b.clone())?;
        }
        publisher.flush().await?;
        Ok::<_, kvsight_sim::kv_events::PublishError>(())
    }
    .await;
    drop(stdin);
    let output = tokio::time::timeout(WAIT, child.wait_with_output())
        .await
        .expect("check script finishes in time")
        .expect("check script output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        step.is_ok() && output.status.success() && stdout.lines().last() == Some("ok"),
        "{layout:?}/{replay_layout:?}: publisher {step:?}, script {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    publisher.shutdown(WAIT).await;
}

#[tokio::test]
async fn pyzmq_and_msgspec_accept_the_stream_in_every_layout() {
    let Some(python) = std::env::var_os("KVSIGHT_PYTHON") else {
        kvsight_harness::skip(
            "pyzmq_and_msgspec_accept_the_stream_in_every_layout",
            "KVSIGHT_PYTHON unset",
        );
        return;
    };
    let python = python.to_string_lossy().into_owned();
    for (layout, replay_layout) in [
        (Layout::Map, ReplayLayout::New),
        (Layout::Array, ReplayLayout::Old),
        (Layout::Map, ReplayLayout::Old),
    ] {
        check_with_python(&python, layout, replay_layout).await;
    }
}
