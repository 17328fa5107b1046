//! The encoder against payloads produced by vLLM's own msgspec encoder (the shared fixture
//! `vllm/kv-events-golden.md`), byte for byte, in both event layouts.

use kvsight_sim::kv_events::{
    BlockHash, BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent, Layout, encode_batch,
    encode_event,
};

/// vLLM's encoder output, under `../shared`.
const GOLDEN: &str = "fixtures/vllm/kv-events-golden.md";

const H1: u64 = 0x1111_1111_1111_1111;
const H2: u64 = 0x2222_2222_2222_2222;

/// The batch each golden line was made from, per the fixture's "decodes to" column.
fn input(name: &str) -> Option<EventBatch> {
    let batch = |ts, events, rank| EventBatch {
        ts,
        events,
        data_parallel_rank: rank,
    };
    Some(match name {
        "stored_int" => batch(
            1_700_000_000.5,
            vec![KvEvent::BlockStored(BlockStored {
                extra_keys: Some(vec![None, None]),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                ..BlockStored::new(
                    vec![BlockHash::Int(H1), BlockHash::Int(H2)],
                    None,
                    vec![1, 2, 3, 4],
                    2,
                )
            })],
            Some(0),
        ),
        "removed" => batch(
            1_700_000_001.0,
            vec![KvEvent::BlockRemoved(BlockRemoved {
                group_idx: Some(0),
                ..BlockRemoved::new(vec![BlockHash::Int(H2)])
            })],
            Some(0),
        ),
        "cleared" => batch(1_700_000_002.0, vec![KvEvent::AllBlocksCleared], Some(1)),
        "no_dp_rank" => batch(1_700_000_002.0, vec![KvEvent::AllBlocksCleared], None),
        _ => return None,
    })
}

fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit"))
        .collect()
}

/// `(layout, case name, payload)` for every golden line: sections name the vLLM version, lines
/// read ``- `name`: `hex` ``.
fn golden_cases(text: &str) -> Vec<(Layout, String, Vec<u8>)> {
    let mut layout = None;
    let mut cases = Vec::new();
    for line in text.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            layout = if heading.contains("maps") {
                Some(Layout::Map)
            } else if heading.contains("arrays") {
                Some(Layout::Array)
            } else {
                None
            };
            continue;
        }
        let (Some(layout), Some(rest)) = (layout, line.strip_prefix("- `")) else {
            continue;
        };
        let mut parts = rest.split('`');
        let name = parts.next().unwrap_or_default().to_owned();
        let payload = parts.nth(1).expect("a `hex` payload after the name");
        cases.push((layout, name, unhex(payload)));
    }
    cases
}

#[test]
fn golden_payloads_match_vllm_byte_for_byte() {
    let Some(path) =
        kvsight_harness::fixture_or_skip("golden_payloads_match_vllm_byte_for_byte", GOLDEN)
    else {
        return;
    };
    let text = std::fs::read_to_string(path).expect("read the golden fixture");
    let cases = golden_cases(&text);
    for layout in [Layout::Map, Layout::Array] {
        assert!(
            cases.iter().filter(|(l, ..)| *l == layout).count() >= 4,
            "fixture has too few {layout:?} cases: the parser no longer understands it"
        );
    }
    for (layout, name, expected) in &cases {
        let batch = input(name).unwrap_or_else(|| panic!("no input for golden case {name:?}"));
        let actual = encode_batch(&batch, *layout).expect("encode");
        assert_eq!(
            hex(&actual),
            hex(expected),
            "{layout:?} {name}: our bytes (left) differ from vLLM's (right)"
        );
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Beyond the fixture: the fields the golden cases leave at None, checked against what msgspec
/// writes for vLLM 0.33's structs (bytes obtained with msgspec 0.22 and the 0.33 struct
/// definitions; see tests/python/check_kv_events.py for the same structs).
#[test]
fn optional_fields_and_byte_hashes_encode_like_msgspec() {
    let event = KvEvent::BlockStored(BlockStored {
        lora_id: Some(1 << 40),
        lora_name: Some("adapter".into()),
        extra_keys: Some(vec![Some(vec![
            ExtraKey::Str("salt".into()),
            ExtraKey::Tuple(vec![ExtraKey::Str("mm".into()), ExtraKey::Int(3)]),
        ])]),
        kv_cache_spec_sliding_window: Some(4096),
        locality: Some("LOCAL".into()),
        session_id: Some("s".into()),
        lookahead_token_ids: Some(vec![vec![9]]),
        ..BlockStored::new(
            vec![BlockHash::Bytes(vec![0xab; 3])],
            Some(BlockHash::Int(5)),
            vec![300],
            1,
        )
    });
    let map = encode_event(&event, Layout::Map).expect("encode");
    assert_eq!(
        hex(&map),
        concat!(
            "de000d",
            "a474797065ab426c6f636b53746f726564",
            "ac626c6f636b5f68617368657391c403ababab",
            "b1706172656e745f626c6f636b5f6861736805",
            "a9746f6b656e5f69647391cd012c",
            "aa626c6f636b5f73697a6501",
            "a76c6f72615f6964cf0000010000000000",
            "a66d656469756da3475055",
            "a96c6f72615f6e616d65a761646170746572",
            "aa65787472615f6b6579739192a473616c7492a26d6d03",
            "bc6b765f63616368655f737065635f736c6964696e675f77696e646f77cd1000",
            "a86c6f63616c697479a54c4f43414c",
            "aa73657373696f6e5f6964a173",
            "b36c6f6f6b61686561645f746f6b656e5f6964739191 09"
        )
        .replace(' ', "")
    );
}
