//! Framing edge cases a broken decoder gets wrong.

mod common;

use kvsight_protocol::bloom::{BloomFilter, CountingFilter, FilterError, FilterParams};
use kvsight_protocol::frame::{self, FrameError, FrameReader, MAX_FRAME_LEN};
use kvsight_protocol::messages::*;

fn welcome(v: u16) -> RouterMessage {
    RouterMessage::Welcome(Welcome {
        protocol_version: v,
        router_id: "r".into(),
    })
}

#[test]
fn oversized_length_is_refused_from_the_header_alone() {
    let header = ((MAX_FRAME_LEN + 1) as u32).to_be_bytes();
    assert_eq!(
        frame::decode::<SidecarMessage>(&header, MAX_FRAME_LEN).unwrap_err(),
        FrameError::Oversized {
            len: MAX_FRAME_LEN + 1,
            max: MAX_FRAME_LEN
        }
    );
}

#[test]
fn garbage_payload_is_malformed() {
    let mut bytes = 3u32.to_be_bytes().to_vec();
    bytes.extend_from_slice(&[0xff, 0xff, 0xff]);
    assert!(matches!(
        frame::decode::<SidecarMessage>(&bytes, MAX_FRAME_LEN),
        Err(FrameError::Malformed(_))
    ));
}

#[test]
fn trailing_bytes_inside_a_frame_are_an_error() {
    let mut bytes = frame::encode(&RouterMessage::ResyncRequest).unwrap();
    bytes.push(0);
    let len = (bytes.len() - 4) as u32;
    bytes[..4].copy_from_slice(&len.to_be_bytes());
    assert_eq!(
        frame::decode::<RouterMessage>(&bytes, MAX_FRAME_LEN).unwrap_err(),
        FrameError::TrailingBytes(1)
    );
}

#[test]
fn version_mismatch_names_both_versions_even_when_the_rest_is_unreadable() {
    // A future Welcome with extra fields we cannot parse: the version is still readable.
    let mut payload = vec![0u8]; // variant 0 = Welcome
    payload.push(9); // protocol_version 9 as a varint
    payload.extend_from_slice(&[0xff; 12]);
    let err = frame::decode_payload::<RouterMessage>(&payload).unwrap_err();
    assert_eq!(
        err,
        FrameError::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs: 9
        }
    );
    assert!(
        err.to_string()
            .contains(&format!("version {PROTOCOL_VERSION}"))
            && err.to_string().contains("version 9"),
        "{err}"
    );
    // And a well-formed message of another version is refused too.
    let bytes = frame::encode(&welcome(PROTOCOL_VERSION + 1)).unwrap();
    assert!(matches!(
        frame::decode::<RouterMessage>(&bytes, MAX_FRAME_LEN),
        Err(FrameError::VersionMismatch { .. })
    ));
    let ok = frame::encode(&welcome(PROTOCOL_VERSION)).unwrap();
    assert_eq!(
        frame::decode::<RouterMessage>(&ok, MAX_FRAME_LEN)
            .unwrap()
            .unwrap()
            .0,
        welcome(PROTOCOL_VERSION)
    );
}

#[test]
fn reader_yields_back_to_back_frames_and_reports_truncation() {
    let mut bytes = Vec::new();
    for i in 0..3 {
        frame::encode_into(
            &RouterMessage::Inflight(Inflight {
                seq: i,
                requests: 5,
            }),
            &mut bytes,
        )
        .unwrap();
    }
    let mut r = FrameReader::default();
    // One byte at a time: the worst fragmentation a stream can produce.
    let mut got = Vec::new();
    for b in &bytes[..bytes.len() - 1] {
        r.push(std::slice::from_ref(b));
        while let Some(m) = r.next_message::<RouterMessage>().unwrap() {
            got.push(m);
        }
    }
    assert_eq!(got.len(), 2);
    assert_eq!(r.finish(), Err(FrameError::Truncated(bytes.len() / 3 - 1)));
    r.push(&bytes[bytes.len() - 1..]);
    assert!(r.next_message::<RouterMessage>().unwrap().is_some());
    assert_eq!(r.finish(), Ok(()));
}

#[test]
fn unsorted_delta_positions_are_refused_on_decode() {
    let d = SidecarMessage::CacheDelta(CacheDelta {
        base_version: 0,
        version: 1,
        resident_blocks: 0,
        toggles: vec![10, 3],
        age_ms: None,
    });
    let bytes = frame::encode(&d).unwrap();
    assert!(matches!(
        frame::decode::<SidecarMessage>(&bytes, MAX_FRAME_LEN),
        Err(FrameError::Malformed(_))
    ));
}

#[test]
fn filters_refuse_bad_snapshots_and_out_of_order_deltas() {
    let params = FilterParams { num_blocks: 2 };
    let mut side = CountingFilter::new(params).unwrap();
    let mut snap = side.snapshot();
    snap.bits.pop();
    assert!(matches!(
        BloomFilter::from_snapshot(&snap),
        Err(FilterError::SnapshotLength { .. })
    ));
    let huge = CacheSnapshot {
        version: 0,
        params: FilterParams {
            num_blocks: u32::MAX,
        },
        resident_blocks: 0,
        bits: vec![],
    };
    assert_eq!(
        BloomFilter::from_snapshot(&huge),
        Err(FilterError::BadSize(u32::MAX))
    );

    let mut router = BloomFilter::from_snapshot(&side.snapshot()).unwrap();
    side.insert(1);
    let d1 = side.take_delta().unwrap();
    side.insert(2);
    let d2 = side.take_delta().unwrap();
    let before = router.clone();
    assert_eq!(
        router.apply_delta(&d2),
        Err(FilterError::VersionGap {
            have: 0,
            delta_base: 1
        })
    );
    assert_eq!(router, before, "a refused delta changes nothing");
    router.apply_delta(&d1).unwrap();
    router.apply_delta(&d2).unwrap();
    assert!(router.contains(1) && router.contains(2));
    let bad = CacheDelta {
        base_version: 2,
        version: 3,
        resident_blocks: 0,
        toggles: vec![0, 2 * 512],
        age_ms: None,
    };
    assert!(matches!(
        router.apply_delta(&bad),
        Err(FilterError::BitOutOfRange { bit: 1024, .. })
    ));
    assert_eq!(router.version(), 2);
}

#[test]
fn longest_prefix_stops_at_the_first_missing_block() {
    let params = FilterParams::for_capacity(1000, 0.01);
    let f = BloomFilter::from_keys(params, [11, 22, 33, 55]).unwrap();
    assert_eq!(f.longest_prefix(&[11, 22, 33, 44, 55]), 3);
    assert_eq!(f.longest_prefix(&[44, 11]), 0);
    assert_eq!(f.longest_prefix(&[]), 0);
    assert_eq!(f.longest_prefix(&[11, 22]), 2);
}

#[test]
fn removal_is_exact_and_unknown_removal_changes_nothing() {
    let params = FilterParams::for_capacity(1000, 0.01);
    let mut f = CountingFilter::new(params).unwrap();
    f.insert(7);
    f.insert(7); // vLLM 0.33 stores reused blocks again; callers dedupe, but counting is safe
    f.insert(8);
    assert!(f.remove(7));
    assert!(f.contains(7));
    assert!(f.remove(7));
    assert!(!f.contains(7));
    assert!(f.contains(8));
    assert!(!f.remove(9_999_999), "never inserted");
    assert_eq!(f.len(), 1);
    f.clear();
    assert!(f.is_empty() && !f.contains(8));
    assert_eq!(
        f.take_delta(),
        None,
        "8 was never published, so after clearing nothing differs from what routers hold"
    );
    f.insert(8);
    let d = f.take_delta().unwrap();
    assert_eq!(
        d.toggles.len(),
        8,
        "one bit in each word of the key's block"
    );
    assert_eq!(f.take_delta(), None, "nothing changed since");
}

/// A `Load` as an idle Ready pod reports it.
fn load() -> Load {
    Load {
        kv_usage: 0.5,
        prefill_tokens_per_s: Some(5_000.0),
        ..Load::idle()
    }
}

/// Encodes `msg` (the encoder does not judge values) and decodes it as a router would.
fn decode_sidecar(msg: &SidecarMessage) -> Result<SidecarMessage, FrameError> {
    let bytes = frame::encode(msg).unwrap();
    frame::decode::<SidecarMessage>(&bytes, MAX_FRAME_LEN).map(|m| m.expect("whole frame").0)
}

fn invalid_field(msg: SidecarMessage) -> &'static str {
    match decode_sidecar(&msg) {
        Err(FrameError::Invalid(e)) => e.field,
        other => panic!("{msg:?} decoded as {other:?}"),
    }
}

#[test]
fn a_load_with_kv_usage_outside_0_to_1_is_refused_at_decode() {
    for kv in [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.01,
        1.01,
        f32::MAX,
    ] {
        let msg = SidecarMessage::Load(Load {
            kv_usage: kv,
            ..load()
        });
        assert_eq!(invalid_field(msg), "Load.kv_usage", "kv_usage {kv}");
    }
    for kv in [0.0, 1.0, 0.25] {
        let msg = SidecarMessage::Load(Load {
            kv_usage: kv,
            ..load()
        });
        assert_eq!(decode_sidecar(&msg).unwrap(), msg);
    }
}

#[test]
fn a_prefill_rate_that_is_not_finite_and_positive_is_refused_at_decode() {
    for r in [f32::NAN, f32::INFINITY, 0.0, -1.0] {
        let msg = SidecarMessage::Load(Load {
            prefill_tokens_per_s: Some(r),
            ..load()
        });
        assert_eq!(invalid_field(msg), "Load.prefill_tokens_per_s", "rate {r}");
    }
}

/// An input `cargo fuzz run frame_decode` found: a `Load` whose `kv_usage` is NaN, which must
/// not decode (a NaN never compares equal, not even to its own re-encoding).
#[test]
fn regression_fuzz_nan_kv_usage_frame() {
    let mut payload = vec![1u8]; // variant 1 = Load
    payload.extend_from_slice(&[1, 0, 2, 0, 0, 0]); // seq, age, Ready, Exact, running, waiting
    payload.extend_from_slice(&f32::NAN.to_le_bytes()); // kv_usage
    // unrouted, three counters, no rate, two empty LoRA lists
    payload.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0]);
    let mut bytes = (payload.len() as u32).to_be_bytes().to_vec();
    bytes.extend_from_slice(&payload);
    assert!(matches!(
        frame::decode::<SidecarMessage>(&bytes, MAX_FRAME_LEN),
        Err(FrameError::Invalid(InvalidField {
            field: "Load.kv_usage",
            ..
        }))
    ));
    // The same bytes with a real number decode: only the value was wrong.
    bytes[4 + 7..4 + 11].copy_from_slice(&0.5f32.to_le_bytes());
    assert!(matches!(
        frame::decode::<SidecarMessage>(&bytes, MAX_FRAME_LEN),
        Ok(Some((SidecarMessage::Load(_), _)))
    ));
}

#[test]
fn a_hello_with_impossible_engine_facts_is_refused_at_decode() {
    let hello = || Hello {
        protocol_version: PROTOCOL_VERSION,
        instance_id: 1,
        pod: PodIdentity {
            name: "p".into(),
            namespace: "ns".into(),
            url: "http://127.0.0.1:8000".into(),
            labels: Default::default(),
        },
        engine: common::engine(),
        models: vec!["m".into()],
        lora_adapters: vec![],
        tokenizer: None,
        sidecar_version: "t".into(),
        load_interval_ms: 1000,
    };
    assert!(decode_sidecar(&SidecarMessage::Hello(hello())).is_ok());
    let engine = |f: fn(&mut EngineFacts)| {
        let mut h = hello();
        f(&mut h.engine);
        SidecarMessage::Hello(h)
    };
    assert_eq!(
        invalid_field(engine(|e| e.block_size = 0)),
        "Hello.engine.block_size"
    );
    assert_eq!(
        invalid_field(engine(|e| e.block_size = MAX_BLOCK_SIZE + 1)),
        "Hello.engine.block_size"
    );
    assert_eq!(
        invalid_field(engine(|e| e.max_num_seqs = 0)),
        "Hello.engine.max_num_seqs"
    );
    assert_eq!(
        invalid_field(engine(|e| e.max_model_len = 0)),
        "Hello.engine.max_model_len"
    );
    assert_eq!(
        invalid_field(engine(|e| e.max_num_batched_tokens = Some(0))),
        "Hello.engine.max_num_batched_tokens"
    );
    for ms in [0, MAX_LOAD_INTERVAL_MS + 1] {
        let msg = SidecarMessage::Hello(Hello {
            load_interval_ms: ms,
            ..hello()
        });
        assert_eq!(invalid_field(msg), "Hello.load_interval_ms");
    }
}

#[test]
fn filter_messages_with_impossible_numbers_are_refused_at_decode() {
    let snapshot = |num_blocks, len| {
        SidecarMessage::CacheSnapshot(CacheSnapshot {
            version: 1,
            params: FilterParams { num_blocks },
            resident_blocks: 0,
            bits: vec![0; len],
        })
    };
    assert!(decode_sidecar(&snapshot(2, 128)).is_ok());
    assert_eq!(invalid_field(snapshot(0, 0)), "CacheSnapshot.params");
    assert_eq!(invalid_field(snapshot(2, 127)), "CacheSnapshot.params");
    let delta = |base_version, version| {
        SidecarMessage::CacheDelta(CacheDelta {
            base_version,
            version,
            resident_blocks: 0,
            toggles: vec![1, 5],
            age_ms: None,
        })
    };
    assert!(decode_sidecar(&delta(4, 5)).is_ok());
    assert_eq!(invalid_field(delta(4, 7)), "CacheDelta.version");
    assert_eq!(invalid_field(delta(u64::MAX, 0)), "CacheDelta.version");
    let chunk = |offset, file_len| {
        SidecarMessage::TokenizerChunk(TokenizerChunk {
            model: "m".into(),
            digest: "d".into(),
            file: TokenizerFile::TokenizerJson,
            offset,
            file_len,
            last: false,
            data: vec![0; 10],
        })
    };
    assert!(decode_sidecar(&chunk(0, 10)).is_ok());
    assert_eq!(invalid_field(chunk(1, 10)), "TokenizerChunk.offset");
    assert_eq!(invalid_field(chunk(u64::MAX, 10)), "TokenizerChunk.offset");
    assert_eq!(invalid_field(chunk(0, u64::MAX)), "TokenizerChunk.file_len");
}

#[test]
fn placements_carry_whole_chains_and_refuse_broken_or_endless_ones() {
    let chain: Vec<u64> = (0..300u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    let routed = |chain: PackedChain| Routed {
        chain,
        new_blocks: 3,
        uncached_tokens: 40,
    };
    let placements = |chains: Vec<PackedChain>| {
        SidecarMessage::Placements(Placements {
            entries: chains
                .into_iter()
                .map(|c| Placement {
                    age_ms: 2,
                    routed: routed(c),
                })
                .collect(),
        })
    };
    let ok = placements(vec![PackedChain::new(&chain)]);
    let SidecarMessage::Placements(back) = decode_sidecar(&ok).unwrap() else {
        panic!("not placements")
    };
    let hashes: Vec<u64> = back.entries[0].routed.chain.hashes().collect();
    assert_eq!(hashes, chain);
    // 8 bytes a hash: a varint would spend 10 on most of these.
    assert!(frame::encode(&ok).unwrap().len() < 300 * 8 + 64);
    // A long prompt travels as its leading blocks.
    let long: Vec<u64> = (0..MAX_PLACEMENT_BLOCKS as u64 + 5).collect();
    assert_eq!(PackedChain::new(&long).len(), MAX_PLACEMENT_BLOCKS);

    let torn = PackedChain::from_le_bytes(vec![1; 12]);
    assert_eq!(
        invalid_field(placements(vec![torn.clone()])),
        "Placements.entries.routed.chain"
    );
    let endless = PackedChain::from_le_bytes(vec![0; (MAX_PLACEMENT_BLOCKS + 1) * 8]);
    assert_eq!(
        invalid_field(placements(vec![endless])),
        "Placements.entries.routed.chain"
    );
    assert_eq!(
        invalid_field(placements(vec![PackedChain::default(); MAX_PLACEMENTS + 1])),
        "Placements.entries"
    );
    // The router's side is checked the same way.
    let bytes = frame::encode(&RouterMessage::Routed(routed(torn))).unwrap();
    match frame::decode::<RouterMessage>(&bytes, MAX_FRAME_LEN) {
        Err(FrameError::Invalid(e)) => assert_eq!(e.field, "Routed.chain"),
        other => panic!("a torn chain decoded as {other:?}"),
    }
}

#[test]
fn recent_placements_keep_a_prompts_prefix_depths_and_refuse_a_mismatched_count() {
    let chain: Vec<u64> = (1..=40).collect();
    let routed = Routed {
        chain: PackedChain::new(&chain),
        new_blocks: 40,
        uncached_tokens: 640,
    };
    let r = RecentPlacement::of(&routed, 7);
    assert_eq!(r.chain_len, 40);
    // Depths 1, 2, 4, 8, 16, 32 blocks: chain indices 0, 1, 3, 7, 15, 31.
    assert_eq!(
        r.marks().collect::<Vec<_>>(),
        vec![(0, 1), (1, 2), (3, 4), (7, 8), (15, 16), (31, 32)]
    );
    let msg = |e: RecentPlacement| {
        SidecarMessage::RecentPlacements(RecentPlacements { entries: vec![e] })
    };
    assert!(decode_sidecar(&msg(r.clone())).is_ok());
    let short = RecentPlacement {
        chain_len: 64,
        ..r.clone()
    };
    assert_eq!(invalid_field(msg(short)), "RecentPlacements.entries.depths");
    let endless = RecentPlacement {
        chain_len: u32::MAX,
        ..r
    };
    assert_eq!(
        invalid_field(msg(endless)),
        "RecentPlacements.entries.chain_len"
    );
}
