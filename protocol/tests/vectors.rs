//! Pinned vectors: any change to the canonical hash, the filter layout or the wire encoding makes
//! these fail, because routers and sidecars of different builds must still agree.
//!
//! The hash vectors were computed independently of this crate, from the definition in
//! `protocol/src/hash.rs`, with Python's `xxhash` package (`xxh3_64_intdigest(..., seed=HASH_SEED)`).

mod common;

use kvsight_protocol::bloom::{BloomFilter, FilterParams};
use kvsight_protocol::frame;
use kvsight_protocol::hash::{ChainSeed, block_hash, hash_chain};
use kvsight_protocol::messages::*;

#[test]
fn root_of_the_base_model() {
    assert_eq!(ChainSeed::BASE.root(), 0xaa20_5af5_a544_5185);
}

#[test]
fn chain_of_forty_tokens_has_two_full_blocks() {
    let tokens: Vec<u32> = (1..=40).collect();
    assert_eq!(
        hash_chain(&ChainSeed::BASE, &tokens, 16),
        vec![0x2c88_145d_6b86_b89a, 0xf196_9e7f_f25a_70b6]
    );
}

#[test]
fn lora_and_salt_start_different_chains() {
    let tokens: Vec<u32> = (1..=32).collect();
    let lora = ChainSeed {
        lora: Some("sql-lora"),
        cache_salt: None,
    };
    let salt = ChainSeed {
        lora: None,
        cache_salt: Some("tenant-a"),
    };
    assert_eq!(
        hash_chain(&lora, &tokens, 16),
        vec![0x092e_9ed6_8efd_f3a4, 0xa956_54a6_3bbe_d8ac]
    );
    assert_eq!(
        hash_chain(&salt, &tokens, 16),
        vec![0x400c_817f_2b90_e2e1, 0xc8e7_e92f_2306_c2ee]
    );
    // A LoRA name equal to a salt value must not collide with it.
    let swapped = ChainSeed {
        lora: Some("tenant-a"),
        cache_salt: None,
    };
    assert_ne!(swapped.root(), salt.root());
}

#[test]
fn token_ids_are_hashed_as_full_u32() {
    assert_eq!(
        hash_chain(&ChainSeed::BASE, &[u32::MAX, 0, 7, 123_456], 2),
        vec![0x1ebc_153b_931d_9dd0, 0x3df5_7b27_a05d_92b5]
    );
    assert_eq!(
        block_hash(ChainSeed::BASE.root(), &[u32::MAX, 0]),
        0x1ebc_153b_931d_9dd0
    );
}

#[test]
fn filter_sizing_for_a_typical_gpu() {
    // 1 % at 50,000 blocks: about 10.5 bits per block in this blocked layout.
    let p = FilterParams::for_capacity(50_000, 0.01);
    assert_eq!(p.num_blocks, PINNED_BLOCKS_50K);
    assert!(p.expected_fp_rate(50_000) <= 0.01);
    let smaller = FilterParams {
        num_blocks: p.num_blocks - 1,
    };
    assert!(smaller.expected_fp_rate(50_000) > 0.01, "not the smallest");
}
const PINNED_BLOCKS_50K: u32 = 987;

#[test]
fn filter_layout_is_pinned() {
    let params = FilterParams { num_blocks: 4 };
    let f = BloomFilter::from_keys(params, [1u64, 2, 3, 0xdead_beef_0000_0001]).unwrap();
    let digest = fnv_words(&f.words().collect::<Vec<_>>());
    assert_eq!(digest, PINNED_LAYOUT);
}
const PINNED_LAYOUT: u64 = 1_790_279_156_973_306_283;

fn fnv_words(words: &[u64]) -> u64 {
    // FNV-1a over the words: enough to pin the layout without another dependency.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words {
        for b in w.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

#[test]
fn hello_frame_bytes_are_pinned() {
    let hello = SidecarMessage::Hello(Hello {
        protocol_version: PROTOCOL_VERSION,
        instance_id: 7,
        pod: PodIdentity {
            name: "p".into(),
            namespace: "ns".into(),
            url: "http://x".into(),
            labels: [("kvsight.io/pool".to_string(), "short".to_string())].into(),
        },
        engine: common::engine(),
        models: vec!["m".into()],
        lora_adapters: vec![],
        tokenizer: None,
        sidecar_version: "0.1.0".into(),
        load_interval_ms: 100,
    });
    let bytes = frame::encode(&hello).unwrap();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, PINNED_HELLO);
}
const PINNED_HELLO: &str = "000000460003070170026e7308687474703a2f2f78010f6b7673696768742e696f2f706f6f6c0573686f727410e807018002802001801006302e33332e3001016d000005302e312e3064";

/// A snapshot and a delta on the wire: the filter owns these types (`bloom.rs`) and the messages
/// carry them, and the bytes were pinned when they moved there from `messages.rs`.
#[test]
fn snapshot_and_delta_frame_bytes_are_pinned() {
    let snapshot = SidecarMessage::CacheSnapshot(CacheSnapshot {
        version: 3,
        params: FilterParams { num_blocks: 1 },
        resident_blocks: 2,
        bits: (0..64).collect(),
    });
    let delta = SidecarMessage::CacheDelta(CacheDelta {
        base_version: 3,
        version: 4,
        resident_blocks: 1,
        toggles: vec![5, 6, 300, 511],
        age_ms: Some(12),
    });
    let hex = |m: &SidecarMessage| -> String {
        let bytes = frame::encode(m).unwrap();
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    };
    assert_eq!(hex(&snapshot), PINNED_SNAPSHOT);
    assert_eq!(hex(&delta), PINNED_DELTA);
}
const PINNED_SNAPSHOT: &str = "000000450203010240000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f";
const PINNED_DELTA: &str = "0000000d03030401040501a602d301010c";

/// A placement on the wire, both directions: the chain is little-endian words, not varints.
#[test]
fn placement_frame_bytes_are_pinned() {
    let routed = Routed {
        chain: PackedChain::new(&[1, u64::MAX]),
        new_blocks: 2,
        uncached_tokens: 300,
    };
    let hex = |bytes: Vec<u8>| -> String { bytes.iter().map(|b| format!("{b:02x}")).collect() };
    assert_eq!(
        hex(frame::encode(&RouterMessage::Routed(routed.clone())).unwrap()),
        "0000001506100100000000000000ffffffffffffffff02ac02"
    );
    let placements = SidecarMessage::Placements(Placements {
        entries: vec![Placement { age_ms: 5, routed }],
    });
    assert_eq!(
        hex(frame::encode(&placements).unwrap()),
        "00000017060105100100000000000000ffffffffffffffff02ac02"
    );
}
