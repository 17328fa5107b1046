//! Random events through the encoder, read back with a generic msgpack decoder (rmpv): every
//! payload is well-formed (patched map counts included), maps hold exactly the fields that must
//! be on the wire in vLLM's order, arrays hold every 0.23 field, and values survive.

use kvsight_sim::kv_events::{
    BlockHash, BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent, Layout, encode_batch,
};
use proptest::prelude::*;
use rmpv::Value;

fn hash() -> impl Strategy<Value = BlockHash> {
    prop_oneof![
        any::<u64>().prop_map(BlockHash::Int),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(BlockHash::Bytes),
    ]
}

fn extra_key() -> impl Strategy<Value = ExtraKey> {
    let leaf = prop_oneof![
        Just(ExtraKey::Nil),
        any::<bool>().prop_map(ExtraKey::Bool),
        any::<i64>().prop_map(ExtraKey::Int),
        "[a-z]{0,40}".prop_map(ExtraKey::Str),
        proptest::collection::vec(any::<u8>(), 0..8).prop_map(ExtraKey::Bytes),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        proptest::collection::vec(inner, 0..3).prop_map(ExtraKey::Tuple)
    })
}

fn opt_str() -> impl Strategy<Value = Option<String>> {
    proptest::option::of("[A-Za-z_-]{0,35}")
}

fn stored() -> impl Strategy<Value = BlockStored> {
    (
        (
            proptest::collection::vec(hash(), 0..4),
            proptest::option::of(hash()),
            proptest::collection::vec(any::<u32>(), 0..20),
            any::<u32>(),
            proptest::option::of(any::<u64>()),
            opt_str(),
            opt_str(),
        ),
        (
            proptest::option::of(proptest::collection::vec(
                proptest::option::of(proptest::collection::vec(extra_key(), 0..3)),
                0..3,
            )),
            proptest::option::of(any::<u32>()),
            opt_str(),
            proptest::option::of(any::<u32>()),
            opt_str(),
            opt_str(),
            opt_str(),
            proptest::option::of(proptest::collection::vec(
                proptest::collection::vec(any::<u32>(), 0..3),
                0..3,
            )),
        ),
    )
        .prop_map(
            |(
                (
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                ),
                (
                    extra_keys,
                    group_idx,
                    kv_cache_spec_kind,
                    kv_cache_spec_sliding_window,
                    locality,
                    ownership,
                    session_id,
                    lookahead_token_ids,
                ),
            )| BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
                group_idx,
                kv_cache_spec_kind,
                kv_cache_spec_sliding_window,
                locality,
                ownership,
                session_id,
                lookahead_token_ids,
            },
        )
}

fn removed() -> impl Strategy<Value = BlockRemoved> {
    (
        proptest::collection::vec(hash(), 0..3),
        opt_str(),
        proptest::option::of(any::<u32>()),
        opt_str(),
        opt_str(),
    )
        .prop_map(
            |(block_hashes, medium, group_idx, locality, ownership)| BlockRemoved {
                block_hashes,
                medium,
                group_idx,
                locality,
                ownership,
            },
        )
}

fn event() -> impl Strategy<Value = KvEvent> {
    prop_oneof![
        stored().prop_map(KvEvent::BlockStored),
        removed().prop_map(KvEvent::BlockRemoved),
        Just(KvEvent::AllBlocksCleared),
    ]
}

fn hash_value(h: &BlockHash) -> Value {
    match h {
        BlockHash::Int(v) => Value::from(*v),
        BlockHash::Bytes(b) => Value::Binary(b.clone()),
    }
}

fn extra_value(k: &ExtraKey) -> Value {
    match k {
        ExtraKey::Nil => Value::Nil,
        ExtraKey::Bool(b) => Value::Boolean(*b),
        ExtraKey::Int(v) => Value::from(*v),
        ExtraKey::Float(v) => Value::F64(*v),
        ExtraKey::Str(s) => Value::from(s.as_str()),
        ExtraKey::Bytes(b) => Value::Binary(b.clone()),
        ExtraKey::Tuple(items) => Value::Array(items.iter().map(extra_value).collect()),
    }
}

fn opt<T>(v: Option<T>, f: impl FnOnce(T) -> Value) -> Value {
    v.map_or(Value::Nil, f)
}

fn tokens(t: &[u32]) -> Value {
    Value::Array(t.iter().map(|x| Value::from(*x)).collect())
}

/// `(key, value, always_present)` in vLLM 0.33's declaration order; `post_023` marks fields the
/// array layout does not have.
fn fields(event: &KvEvent) -> Vec<(&'static str, Value, bool, bool)> {
    let s = |v: &Option<String>| opt(v.as_deref(), Value::from);
    match event {
        KvEvent::BlockStored(e) => vec![
            (
                "block_hashes",
                Value::Array(e.block_hashes.iter().map(hash_value).collect()),
                true,
                false,
            ),
            (
                "parent_block_hash",
                opt(e.parent_block_hash.as_ref(), hash_value),
                true,
                false,
            ),
            ("token_ids", tokens(&e.token_ids), true, false),
            ("block_size", Value::from(e.block_size), true, false),
            ("lora_id", opt(e.lora_id, Value::from), true, false),
            ("medium", s(&e.medium), true, false),
            ("lora_name", s(&e.lora_name), true, false),
            (
                "extra_keys",
                opt(e.extra_keys.as_ref(), |keys| {
                    Value::Array(
                        keys.iter()
                            .map(|k| {
                                opt(k.as_ref(), |t| {
                                    Value::Array(t.iter().map(extra_value).collect())
                                })
                            })
                            .collect(),
                    )
                }),
                false,
                false,
            ),
            ("group_idx", opt(e.group_idx, Value::from), false, false),
            ("kv_cache_spec_kind", s(&e.kv_cache_spec_kind), false, false),
            (
                "kv_cache_spec_sliding_window",
                opt(e.kv_cache_spec_sliding_window, Value::from),
                false,
                false,
            ),
            ("locality", s(&e.locality), false, true),
            ("ownership", s(&e.ownership), false, true),
            ("session_id", s(&e.session_id), false, true),
            (
                "lookahead_token_ids",
                opt(e.lookahead_token_ids.as_ref(), |l| {
                    Value::Array(l.iter().map(|t| tokens(t)).collect())
                }),
                false,
                true,
            ),
        ],
        KvEvent::BlockRemoved(e) => vec![
            (
                "block_hashes",
                Value::Array(e.block_hashes.iter().map(hash_value).collect()),
                true,
                false,
            ),
            ("medium", s(&e.medium), true, false),
            ("group_idx", opt(e.group_idx, Value::from), false, false),
            ("locality", s(&e.locality), false, true),
            ("ownership", s(&e.ownership), false, true),
        ],
        KvEvent::AllBlocksCleared => vec![],
    }
}

fn expected_event(event: &KvEvent, layout: Layout) -> Value {
    let tag = Value::from(event.tag());
    let all = fields(event);
    match layout {
        Layout::Map => {
            let mut entries = vec![(Value::from("type"), tag)];
            entries.extend(
                all.into_iter()
                    .filter(|(_, v, always, _)| *always || !v.is_nil())
                    .map(|(k, v, ..)| (Value::from(k), v)),
            );
            Value::Map(entries)
        }
        Layout::Array => {
            let mut items = vec![tag];
            items.extend(
                all.into_iter()
                    .filter(|(.., post)| !post)
                    .map(|(_, v, ..)| v),
            );
            Value::Array(items)
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn encoded_batches_decode_to_exactly_the_wire_fields(
        ts in any::<f64>().prop_filter("NaN never equals itself", |t| !t.is_nan()),
        events in proptest::collection::vec(event(), 0..4),
        rank in proptest::option::of(any::<u32>()),
        array in any::<bool>(),
    ) {
        let layout = if array { Layout::Array } else { Layout::Map };
        let batch = EventBatch { ts, events, data_parallel_rank: rank };
        let payload = encode_batch(&batch, layout).expect("encode");
        let mut rest = payload.as_slice();
        let decoded = rmpv::decode::read_value(&mut rest).expect("well-formed msgpack");
        prop_assert!(rest.is_empty(), "{} trailing bytes", rest.len());
        let expected = Value::Array(vec![
            Value::F64(ts),
            Value::Array(batch.events.iter().map(|e| expected_event(e, layout)).collect()),
            opt(rank, Value::from),
        ]);
        prop_assert_eq!(decoded, expected);
    }
}
