//! Framing edge cases a broken decoder gets wrong.

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
