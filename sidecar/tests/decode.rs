//! The decoder against vLLM's own encoder output (golden bytes) and every layout variation.

use kvsight_sidecar::kv_events::decode::{DecodeError, Event, VllmHash, decode_batch};
use rmpv::Value;

/// vLLM's encoder output, under `../shared`.
const GOLDEN: &str = "fixtures/vllm/kv-events-golden.md";

/// `(section, name, payload)` for every golden line, or `None` after skipping `test` when the
/// fixture is absent.
fn golden(test: &str) -> Option<Vec<(String, String, Vec<u8>)>> {
    let path = kvsight_harness::fixture_or_skip(test, GOLDEN)?;
    let text = std::fs::read_to_string(path).expect("read the golden fixture");
    let mut section = String::new();
    let mut out = Vec::new();
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            section = h.to_owned();
        } else if let Some(rest) = line.strip_prefix("- `") {
            let (name, rest) = rest.split_once("`: `").expect("name");
            let hex = rest.trim_end_matches('`');
            let bytes = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
                .collect();
            out.push((section.clone(), name.to_owned(), bytes));
        }
    }
    Some(out)
}

#[test]
fn golden_payloads_from_vllms_encoder_decode_in_both_layouts() {
    let Some(cases) = golden("golden_payloads_from_vllms_encoder_decode_in_both_layouts") else {
        return;
    };
    assert_eq!(cases.len(), 8, "4 payloads per layout");
    for (section, name, bytes) in cases {
        let batch = decode_batch(&bytes).unwrap_or_else(|e| panic!("{section}/{name}: {e}"));
        match name.as_str() {
            "stored_int" => {
                assert_eq!(batch.ts, 1_700_000_000.5);
                assert_eq!(batch.data_parallel_rank, Some(0));
                let Event::Stored(s) = &batch.events[0] else {
                    panic!("{section}: {batch:?}")
                };
                assert_eq!(
                    s.block_hashes,
                    vec![
                        VllmHash::Int(0x1111_1111_1111_1111),
                        VllmHash::Int(0x2222_2222_2222_2222)
                    ]
                );
                assert_eq!(s.parent_block_hash, None);
                assert_eq!(s.token_ids, vec![1, 2, 3, 4]);
                assert_eq!(s.block_size, 2);
                assert_eq!(s.medium.as_deref(), Some("GPU"));
                assert_eq!(s.lora_name, None);
                assert_eq!(s.extra_keys, Some(vec![None, None]));
                assert_eq!(s.group_idx, Some(0));
                assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("full_attention"));
            }
            "removed" => {
                let Event::Removed(r) = &batch.events[0] else {
                    panic!("{section}: {batch:?}")
                };
                assert_eq!(r.block_hashes, vec![VllmHash::Int(0x2222_2222_2222_2222)]);
                assert_eq!(r.medium.as_deref(), Some("GPU"));
                assert_eq!(r.group_idx, Some(0));
            }
            "cleared" => {
                assert_eq!(batch.events, vec![Event::AllCleared]);
                assert_eq!(batch.data_parallel_rank, Some(1));
            }
            "no_dp_rank" => {
                assert_eq!(batch.events, vec![Event::AllCleared]);
                assert_eq!(batch.data_parallel_rank, None);
            }
            other => panic!("unexpected golden payload {other}"),
        }
    }
}

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn map(pairs: Vec<(&str, Value)>) -> Value {
    Value::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
}

#[test]
fn map_shaped_batches_bytes_hashes_and_unknown_fields() {
    let event = map(vec![
        ("type", s("BlockStored")),
        (
            "block_hashes",
            Value::Array(vec![Value::Binary(vec![0xab; 32])]),
        ),
        ("parent_block_hash", Value::Binary(vec![0xcd; 32])),
        ("token_ids", Value::Array((0..4).map(Value::from).collect())),
        ("block_size", Value::from(4)),
        ("lora_name", s("sql-lora")),
        ("a_field_from_the_future", Value::from(42)),
    ]);
    let batch = map(vec![
        ("ts", Value::F64(1.0)),
        (
            "events",
            Value::Array(vec![event, map(vec![("type", s("BlockMoved"))])]),
        ),
        ("data_parallel_rank", Value::Nil),
    ]);
    let b = decode_batch(&encode(&batch)).unwrap();
    let Event::Stored(st) = &b.events[0] else {
        panic!()
    };
    assert_eq!(st.block_hashes, vec![VllmHash::Bytes(vec![0xab; 32])]);
    assert_eq!(st.parent_block_hash, Some(VllmHash::Bytes(vec![0xcd; 32])));
    assert_eq!(st.lora_name.as_deref(), Some("sql-lora"));
    assert_eq!(st.medium, None, "absent before 0.10.2");
    assert_eq!(b.events[1], Event::Unknown("BlockMoved".into()));
}

#[test]
fn two_element_batches_of_vllm_0_9_and_short_arrays_of_0_10() {
    // 0.10.0: [tag, hashes, parent, tokens, block_size, lora_id] and nothing after.
    let event = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(u64::MAX)]),
        Value::Nil,
        Value::Array((0..16).map(Value::from).collect()),
        Value::from(16),
        Value::Nil,
    ]);
    let b = decode_batch(&encode(&Value::Array(vec![
        Value::F64(2.0),
        Value::Array(vec![event]),
    ])))
    .unwrap();
    assert_eq!(b.data_parallel_rank, None);
    let Event::Stored(st) = &b.events[0] else {
        panic!()
    };
    assert_eq!(
        st.block_hashes,
        vec![VllmHash::Int(u64::MAX)],
        "values >= 2^63 survive"
    );
    assert_eq!(st.group_idx, None);
}

#[test]
fn malformed_payloads_are_typed_errors() {
    // 0xc1 is msgpack's reserved byte; rmpv reads it as a nil value, which is no batch.
    assert_eq!(decode_batch(&[0xc1]), Err(DecodeError::BadBatch));
    assert!(matches!(
        decode_batch(&[0x92, 0xcb]),
        Err(DecodeError::NotMsgpack(_))
    ));
    assert!(matches!(decode_batch(&[]), Err(DecodeError::NotMsgpack(_))));
    assert_eq!(
        decode_batch(&encode(&Value::from(3))),
        Err(DecodeError::BadBatch)
    );
    let mut two = encode(&Value::Array(vec![Value::F64(1.0), Value::Array(vec![])]));
    two.push(0);
    assert_eq!(decode_batch(&two), Err(DecodeError::TrailingBytes(1)));
    // A stored event with a token id that is not a u32, and one without a block size.
    for bad in [
        Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![]),
            Value::Nil,
            Value::Array(vec![Value::from(-1)]),
            Value::from(16),
        ]),
        Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![]),
            Value::Nil,
            Value::Array(vec![]),
        ]),
        Value::Array(vec![Value::from(7)]),
    ] {
        let payload = encode(&Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![bad]),
        ]));
        assert!(matches!(
            decode_batch(&payload),
            Err(DecodeError::BadEvent { index: 0, .. })
        ));
    }
}

/// A payload of nested containers is refused at [`MAX_NESTING`] levels, on a thread with a
/// small stack, and the deepest layout vLLM writes (an extra key inside `extra_keys`) still
/// decodes there. With rmpv's default limit (1,024 levels) 524 bytes of nested maps overflowed a
/// 2 MiB test thread's stack in a debug build and aborted the process (found by replaying the
/// `kv_event_decode` fuzz corpus on test threads).
#[test]
fn deeply_nested_payloads_are_refused_before_they_exhaust_the_stack() {
    use kvsight_sidecar::kv_events::decode::MAX_NESTING;
    let handle = std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(|| {
            // Raw bytes, as a hostile publisher would send them: rmpv's own encoder (and drop)
            // would recurse just as deep while building the payload.
            let mut nested = vec![0x92, 0xcb];
            nested.extend(1.0f64.to_be_bytes());
            nested.extend(std::iter::repeat_n(0x91, 2_000));
            nested.push(0xc0);
            let refused = decode_batch(&nested);
            assert!(
                matches!(refused, Err(DecodeError::NotMsgpack(ref why)) if why.contains("depth")),
                "{refused:?}"
            );
            // The same shape at the limit (the batch and MAX_NESTING - 1 arrays in it) reaches
            // the event decoder; one level more does not.
            let mut shallow = vec![0x92, 0xcb];
            shallow.extend(1.0f64.to_be_bytes());
            shallow.extend(std::iter::repeat_n(0x91, MAX_NESTING - 1));
            shallow.push(0xc0);
            let mut over = shallow.clone();
            over.insert(10, 0x91);
            assert!(matches!(
                decode_batch(&over),
                Err(DecodeError::NotMsgpack(_))
            ));
            let shallow = decode_batch(&shallow);
            assert!(
                matches!(shallow, Err(DecodeError::BadEvent { index: 0, .. })),
                "{shallow:?}"
            );
            let extra = Value::Array(vec![Value::Array(vec![
                s("lora"),
                Value::Array(vec![Value::Binary(vec![7; 8])]),
            ])]);
            let event = map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", Value::Array(vec![Value::from(5)])),
                ("token_ids", Value::Array((0..4).map(Value::from).collect())),
                ("block_size", Value::from(4)),
                ("extra_keys", Value::Array(vec![extra])),
            ]);
            let batch = Value::Array(vec![Value::F64(1.0), Value::Array(vec![event])]);
            let b = decode_batch(&encode(&batch)).expect("vLLM's deepest layout decodes");
            assert!(matches!(&b.events[0], Event::Stored(st) if st.extra_keys.is_some()));
        })
        .expect("spawn");
    handle.join().expect("no panic, no overflow");
}
