//! Property tests: messages round-trip, deltas are lossless, the router's view always equals a
//! filter rebuilt from the exact set, the false-positive rate holds at capacity, and the decoder
//! survives any input.

use std::collections::HashMap;

use kvsight_protocol::bloom::{BloomFilter, CountingFilter, FilterParams};
use kvsight_protocol::frame::{self, FrameError, FrameReader, MAX_FRAME_LEN};
use kvsight_protocol::messages::*;
use kvsight_protocol::tokenizer_transfer::MAX_TOKENIZER_BYTES;
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9_./:-]{0,24}"
}

fn phase() -> impl Strategy<Value = Phase> {
    prop::sample::select(Phase::ALL.to_vec())
}

/// Mostly our version (so the full round trip is exercised), sometimes any other.
fn version() -> impl Strategy<Value = u16> {
    prop_oneof![9 => Just(PROTOCOL_VERSION), 1 => any::<u16>()]
}

fn hello() -> impl Strategy<Value = Hello> {
    (
        version(),
        any::<u64>(),
        (text(), text(), text()),
        // In the ranges `Hello::validate` accepts: the decoder refuses the rest (tested in
        // frames.rs).
        (
            1..=MAX_BLOCK_SIZE,
            any::<u64>(),
            any::<bool>(),
            1..=u32::MAX,
            1..=u32::MAX,
            option::of(1..=u32::MAX),
            text(),
        ),
        vec(text(), 0..4),
        vec(text(), 0..4),
        option::of((text(), any::<u64>())),
        (text(), 1..=MAX_LOAD_INTERVAL_MS),
    )
        .prop_map(
            |(v, id, (name, ns, url), e, models, loras, tok, (sv, interval))| Hello {
                protocol_version: v,
                instance_id: id,
                pod: PodIdentity {
                    labels: [(name.clone(), url.clone())].into(),
                    name,
                    namespace: ns,
                    url,
                },
                engine: EngineFacts {
                    block_size: e.0,
                    num_gpu_blocks: e.1,
                    prefix_caching: e.2,
                    max_num_seqs: e.3,
                    max_model_len: e.4,
                    max_num_batched_tokens: e.5,
                    engine_version: e.6,
                },
                models,
                lora_adapters: loras,
                tokenizer: tok.map(|(digest, total_bytes)| TokenizerInfo {
                    digest,
                    total_bytes,
                }),
                sidecar_version: sv,
                load_interval_ms: interval,
            },
        )
}

fn load() -> impl Strategy<Value = Load> {
    (
        (any::<u64>(), any::<u32>(), phase()),
        prop::sample::select(vec![
            CacheView::Exact,
            CacheView::Recovering,
            CacheView::Lost,
        ]),
        (any::<u32>(), any::<u32>(), 0f32..=1.0, any::<u32>()),
        (any::<u64>(), any::<u64>(), any::<u64>()),
        option::of(1e-3f32..1e6),
        vec(text(), 0..3),
        vec(text(), 0..3),
    )
        .prop_map(
            |((seq, age, phase), view, (r, w, kv, un), (q, h, p), rate, lr, lw)| Load {
                seq,
                sample_age_ms: age,
                phase,
                cache_view: view,
                running: r,
                waiting: w,
                kv_usage: kv,
                unrouted: un,
                prefix_cache_queries: q,
                prefix_cache_hits: h,
                preemptions: p,
                prefill_tokens_per_s: rate,
                lora_running: lr,
                lora_waiting: lw,
            },
        )
}

fn sorted_unique(max: u32) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::btree_set(0..max, 0..200).prop_map(|s| s.into_iter().collect())
}

fn sidecar_message() -> impl Strategy<Value = SidecarMessage> {
    prop_oneof![
        hello().prop_map(SidecarMessage::Hello),
        load().prop_map(SidecarMessage::Load),
        (
            any::<u64>(),
            (1u32..4).prop_flat_map(|n| (Just(n), vec(any::<u8>(), n as usize * 64))),
            any::<u64>(),
        )
            .prop_map(|(version, (n, bits), resident_blocks)| {
                SidecarMessage::CacheSnapshot(CacheSnapshot {
                    version,
                    params: FilterParams { num_blocks: n },
                    resident_blocks,
                    bits,
                })
            }),
        (
            0..u64::MAX,
            any::<u64>(),
            sorted_unique(u32::MAX),
            any::<Option<u32>>()
        )
            .prop_map(|(b, r, toggles, age_ms)| {
                SidecarMessage::CacheDelta(CacheDelta {
                    base_version: b,
                    version: b + 1,
                    resident_blocks: r,
                    toggles,
                    age_ms,
                })
            }),
        (
            text(),
            text(),
            0..MAX_TOKENIZER_BYTES - 64,
            any::<bool>(),
            vec(any::<u8>(), 0..64)
        )
            .prop_map(
                |(model, digest, offset, last, data)| SidecarMessage::TokenizerChunk(
                    TokenizerChunk {
                        model,
                        digest,
                        file: TokenizerFile::TokenizerJson,
                        offset,
                        file_len: offset.saturating_add(data.len() as u64),
                        last,
                        data,
                    }
                )
            ),
        text().prop_map(|m| SidecarMessage::Goodbye(Goodbye {
            reason: CloseReason::Drained,
            message: m
        })),
        vec((any::<u32>(), routed()), 0..4).prop_map(|e| SidecarMessage::Placements(Placements {
            entries: e
                .into_iter()
                .map(|(age_ms, routed)| Placement { age_ms, routed })
                .collect()
        })),
        recent(),
    ]
}

fn recent() -> impl Strategy<Value = SidecarMessage> {
    vec((any::<u32>(), routed()), 0..4).prop_map(|e| {
        SidecarMessage::RecentPlacements(RecentPlacements {
            entries: e
                .iter()
                .map(|(age, r)| RecentPlacement::of(r, *age))
                .collect(),
        })
    })
}

fn routed() -> impl Strategy<Value = Routed> {
    (vec(any::<u64>(), 0..40), any::<u32>(), any::<u32>()).prop_map(|(c, new_blocks, u)| Routed {
        chain: PackedChain::new(&c),
        new_blocks,
        uncached_tokens: u,
    })
}

fn router_message() -> impl Strategy<Value = RouterMessage> {
    prop_oneof![
        (version(), text()).prop_map(|(v, id)| RouterMessage::Welcome(Welcome {
            protocol_version: v,
            router_id: id
        })),
        (version(), text()).prop_map(|(v, r)| RouterMessage::Refused(Refused {
            protocol_version: v,
            reason: r
        })),
        (any::<u64>(), any::<u32>())
            .prop_map(|(seq, requests)| RouterMessage::Inflight(Inflight { seq, requests })),
        text().prop_map(|model| RouterMessage::TokenizerRequest(TokenizerRequest { model })),
        Just(RouterMessage::ResyncRequest),
        text().prop_map(|m| RouterMessage::Goodbye(Goodbye {
            reason: CloseReason::Shutdown,
            message: m
        })),
        routed().prop_map(RouterMessage::Routed),
    ]
}

/// Encodes ignoring the version: the round trip is about the codec, not the version check.
fn roundtrip<M: frame::WireMessage + PartialEq + std::fmt::Debug>(
    msg: &M,
) -> Result<M, FrameError> {
    let bytes = frame::encode(msg)?;
    let mut reader = FrameReader::default();
    // Feed in two pieces to exercise reassembly.
    let cut = bytes.len() / 2;
    reader.push(&bytes[..cut]);
    let early: Option<M> = reader.next_message()?;
    assert!(
        early.is_none() || cut >= bytes.len(),
        "decoded half a frame"
    );
    reader.push(&bytes[cut..]);
    let got = reader.next_message()?.expect("a whole frame");
    reader.finish()?;
    Ok(got)
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u64),
    Remove(usize),
    Publish,
    Clear,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    vec(
        prop_oneof![
            8 => (0u64..400).prop_map(|k| Op::Insert(k.wrapping_mul(0x9e37_79b9_7f4a_7c15))),
            5 => any::<usize>().prop_map(Op::Remove),
            2 => Just(Op::Publish),
            1 => Just(Op::Clear),
        ],
        0..300,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn sidecar_messages_roundtrip(msg in sidecar_message()) {
        match roundtrip(&msg) {
            Ok(got) => prop_assert_eq!(got, msg),
            // A Hello of another version must be refused by name, never silently accepted.
            Err(FrameError::VersionMismatch { ours, theirs }) => {
                prop_assert_eq!(ours, PROTOCOL_VERSION);
                let SidecarMessage::Hello(h) = &msg else { panic!("mismatch on {msg:?}") };
                prop_assert_eq!(theirs, h.protocol_version);
                prop_assert_ne!(theirs, PROTOCOL_VERSION);
            }
            Err(e) => panic!("{e} for {msg:?}"),
        }
    }

    #[test]
    fn router_messages_roundtrip(msg in router_message()) {
        match roundtrip(&msg) {
            Ok(got) => prop_assert_eq!(got, msg),
            Err(FrameError::VersionMismatch { theirs, .. }) => {
                let v = match &msg {
                    RouterMessage::Welcome(w) => w.protocol_version,
                    RouterMessage::Refused(r) => r.protocol_version,
                    other => panic!("mismatch on {other:?}"),
                };
                prop_assert_eq!(theirs, v);
                prop_assert_ne!(theirs, PROTOCOL_VERSION);
            }
            Err(e) => panic!("{e} for {msg:?}"),
        }
    }

    /// The router's filter, fed one snapshot and then deltas, always equals a filter built from
    /// the exact set the sidecar holds; and `delta(a → b)` applied to `a` is exactly `b`.
    #[test]
    fn router_view_equals_rebuilt_filter(ops in ops(), joins_at in 0usize..300) {
        let params = FilterParams { num_blocks: 3 };
        let mut sidecar = CountingFilter::new(params).unwrap();
        let mut exact: HashMap<u64, u32> = HashMap::new();
        // One router connects at the start, another in the middle (gets the published snapshot).
        let mut early = BloomFilter::from_snapshot(&sidecar.snapshot()).unwrap();
        let mut late: Option<BloomFilter> = None;
        for (i, op) in ops.iter().enumerate() {
            if i == joins_at {
                late = Some(BloomFilter::from_snapshot(&sidecar.snapshot()).unwrap());
            }
            match op {
                Op::Insert(k) => {
                    sidecar.insert(*k);
                    *exact.entry(*k).or_default() += 1;
                }
                Op::Remove(i) => {
                    if exact.is_empty() { continue; }
                    let mut keys: Vec<u64> = exact.keys().copied().collect();
                    keys.sort_unstable();
                    let k = keys[i % keys.len()];
                    prop_assert!(sidecar.remove(k));
                    let n = exact.get_mut(&k).unwrap();
                    *n -= 1;
                    if *n == 0 { exact.remove(&k); }
                }
                Op::Clear => {
                    sidecar.clear();
                    exact.clear();
                }
                Op::Publish => {
                    let before = early.clone();
                    if let Some(d) = sidecar.take_delta() {
                        early.apply_delta(&d).unwrap();
                        if let Some(l) = late.as_mut() { l.apply_delta(&d).unwrap(); }
                        // Applying the delta to a is b: b is the published snapshot.
                        let b = BloomFilter::from_snapshot(&sidecar.snapshot()).unwrap();
                        let mut a = before;
                        a.apply_delta(&d).unwrap();
                        prop_assert_eq!(&a, &b);
                    }
                }
            }
        }
        if let Some(d) = sidecar.take_delta() {
            early.apply_delta(&d).unwrap();
            if let Some(l) = late.as_mut() { l.apply_delta(&d).unwrap(); }
        }
        let rebuilt = BloomFilter::from_keys(params, exact.keys().copied()).unwrap();
        prop_assert!(early.words().eq(rebuilt.words()));
        if let Some(l) = &late { prop_assert!(l.words().eq(rebuilt.words())); }
        prop_assert_eq!(early.resident_blocks(), exact.values().map(|&n| u64::from(n)).sum::<u64>());
        for k in exact.keys() { prop_assert!(early.contains(*k)); }
    }

    /// Whatever the bytes, decoding returns a value or a typed error: never a panic, and never a
    /// buffered frame over the limit.
    /// The prepared scan is the plain per-key linear scan, and the sampled bound never falls
    /// below it (equal at stride 1), on filters from one line (nearly every probe a false
    /// positive) to roomy ones, with chains that mix held and unheld blocks.
    #[test]
    fn prepared_scan_equals_linear_scan_and_bound_stays_above(
        capacity in prop_oneof![Just(1usize), Just(8), Just(64), Just(4_096)],
        others in 0u64..600,
        chain in vec((any::<u64>(), any::<bool>()), 0..200),
        start in 0usize..220,
        stride in prop_oneof![Just(1usize), 2usize..40, Just(usize::MAX)],
    ) {
        let held = chain.iter().filter(|(_, h)| *h).map(|(k, _)| *k);
        let keys = held.chain((0..others).map(|k| k.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
        let f = BloomFilter::from_keys(FilterParams::for_capacity(capacity, 0.01), keys).unwrap();
        let chain: Vec<u64> = chain.into_iter().map(|(k, _)| k).collect();
        let prepared = f.params().prepare(&chain);
        let linear = f.longest_prefix(chain.get(start..).unwrap_or(&[]));
        prop_assert_eq!(f.present_run_prepared(&prepared, start), linear);
        prop_assert_eq!(f.present_run_bound(&prepared, start, 1), linear);
        prop_assert!(f.present_run_bound(&prepared, start, stride) >= linear);
    }

    /// Garbage never panics the decoder, and whatever it does accept is a whole frame within
    /// the bytes that re-encodes to the same message; "need more bytes" only when the bytes end
    /// before the declared frame does. The reader says what `decode` says.
    #[test]
    fn decoder_survives_garbage(
        bytes in prop_oneof![
            vec(any::<u8>(), 0..512),
            // A valid frame with one byte changed and garbage after it: often still a message.
            (sidecar_message(), any::<prop::sample::Index>(), any::<u8>(), vec(any::<u8>(), 0..16))
                .prop_map(|(msg, at, byte, tail)| {
                    let mut b = frame::encode(&msg).unwrap();
                    let i = frame::HEADER_LEN + at.index(b.len() - frame::HEADER_LEN);
                    if i < b.len() {
                        b[i] = byte;
                    }
                    b.extend(tail);
                    b
                }),
        ],
    ) {
        let declared = bytes
            .get(..frame::HEADER_LEN)
            .map(|h| u32::from_be_bytes(h.try_into().unwrap()) as usize);
        let decoded = frame::decode::<SidecarMessage>(&bytes, MAX_FRAME_LEN);
        match &decoded {
            Ok(Some((msg, used))) => {
                prop_assert_eq!(Some(*used), declared.map(|d| d + frame::HEADER_LEN));
                prop_assert!(*used <= bytes.len());
                let again = frame::encode(msg).unwrap();
                let (back, _) = frame::decode::<SidecarMessage>(&again, MAX_FRAME_LEN)
                    .unwrap()
                    .unwrap();
                prop_assert_eq!(&back, msg);
            }
            Ok(None) => prop_assert!(
                declared.is_none_or(|d| bytes.len() < d + frame::HEADER_LEN),
                "asked for more with a whole frame present"
            ),
            Err(_) => {}
        }
        if let Ok(Some((msg, used))) = frame::decode::<RouterMessage>(&bytes, MAX_FRAME_LEN) {
            prop_assert!(used <= bytes.len());
            let again = frame::encode(&msg).unwrap();
            let (back, _) = frame::decode::<RouterMessage>(&again, MAX_FRAME_LEN)
                .unwrap()
                .unwrap();
            prop_assert_eq!(back, msg);
        }
        let mut r = FrameReader::new(MAX_FRAME_LEN);
        r.push(&bytes);
        let first = r.next_message::<SidecarMessage>();
        match (&first, &decoded) {
            (Ok(Some(a)), Ok(Some((b, _)))) => prop_assert_eq!(a, b),
            (Ok(None), Ok(None)) | (Err(_), Err(_)) => {}
            _ => prop_assert!(false, "reader {:?} vs decode {:?}", first, decoded),
        }
    }

    /// Every proper prefix of a valid frame asks for more bytes instead of failing or panicking.
    #[test]
    fn truncated_frames_wait_for_more(msg in sidecar_message(), cut in any::<prop::sample::Index>()) {
        let bytes = frame::encode(&msg).unwrap();
        let cut = cut.index(bytes.len());
        prop_assert_eq!(frame::decode::<SidecarMessage>(&bytes[..cut], MAX_FRAME_LEN).unwrap().map(|(m, _)| m), None);
    }
}

/// The false-positive rate at full capacity stays at or under 1 % within statistical margin.
#[test]
fn false_positive_rate_at_capacity() {
    let capacity = 50_000usize;
    let params = FilterParams::for_capacity(capacity, 0.01);
    let mut f = CountingFilter::new(params).unwrap();
    // Keys are canonical hashes, i.e. uniform 64-bit values; a seeded generator stands in.
    let mut rng = kvsight_protocol::splitmix::SplitMix64::new(0x1234_5678_9abc_def0);
    let mut next = || rng.next_u64();
    let members: Vec<u64> = (0..capacity).map(|_| next()).collect();
    for &k in &members {
        f.insert(k);
    }
    let _ = f.take_delta();
    let router = BloomFilter::from_snapshot(&f.snapshot()).unwrap();
    assert!(
        members.iter().all(|&k| router.contains(k)),
        "no false negatives"
    );
    let trials = 400_000u32;
    let fps = (0..trials).filter(|_| router.contains(next())).count() as f64;
    let rate = fps / f64::from(trials);
    // 1 % plus four standard deviations of a binomial estimate at p = 1 %.
    let margin = 4.0 * (0.01f64 * 0.99 / f64::from(trials)).sqrt();
    assert!(rate <= 0.01 + margin, "false-positive rate {rate:.4}");
    // And the estimate that sized the filter is honest (within 25 % of the measurement).
    let expected = params.expected_fp_rate(capacity);
    assert!(
        (rate - expected).abs() <= 0.25 * expected,
        "measured {rate:.4}, expected {expected:.4}"
    );
}

/// A change of N blocks costs O(N) bytes on the wire, whatever the filter's size.
#[test]
fn delta_size_grows_with_changes_not_with_filter_size() {
    let size_for = |capacity: usize, changed: u64| {
        let mut f = CountingFilter::new(FilterParams::for_capacity(capacity, 0.01)).unwrap();
        for k in 0..capacity as u64 / 2 {
            f.insert(k.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        }
        let _ = f.take_delta();
        for k in 0..changed {
            f.insert(((k + 1) << 40).wrapping_mul(0xbf58_476d_1ce4_e5b9));
        }
        let d = f.take_delta().unwrap();
        frame::encode(&SidecarMessage::CacheDelta(d)).unwrap().len()
    };
    let small = size_for(10_000, 1_000);
    let large = size_for(1_000_000, 1_000);
    let tiny = size_for(1_000_000, 10);
    assert!(
        large < 2 * small + 4096,
        "1k changes: {small} B vs {large} B"
    );
    assert!(large < 1_000 * 8 * 3, "1k changes cost {large} B");
    assert!(tiny < 300, "10 changes cost {tiny} B");
    let snapshot = frame::encode(&SidecarMessage::CacheSnapshot(
        CountingFilter::new(FilterParams::for_capacity(1_000_000, 0.01))
            .unwrap()
            .snapshot(),
    ))
    .unwrap()
    .len();
    assert!(
        large * 20 < snapshot,
        "delta {large} B vs snapshot {snapshot} B"
    );
}

#[test]
fn a_router_filter_turned_into_a_snapshot_comes_back_equal() {
    let params = FilterParams::for_capacity(1_000, 0.01);
    let f =
        BloomFilter::from_keys(params, (0..700u64).map(|k| k.wrapping_mul(0x9e37_79b9))).unwrap();
    let snap = f.snapshot();
    assert_eq!(snap.resident_blocks, 700);
    assert_eq!(snap.bits.len() as u64 * 8, params.num_bits());
    assert_eq!(BloomFilter::from_snapshot(&snap).unwrap(), f);
}
