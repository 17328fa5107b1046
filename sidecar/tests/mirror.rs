//! The mirror's rules: canonical hashes equal the router's, stores are idempotent, removals and
//! clears are exact, and what cannot be placed in a chain is never matched.

use kvsight_protocol::bloom::BloomFilter;
use kvsight_protocol::hash::{ChainSeed, hash_chain};
use kvsight_sidecar::kv_events::decode::{Event, Removed, Stored, VllmHash};
use kvsight_sidecar::mirror::Mirror;
use rmpv::Value;

const B: usize = 4;

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Stored {
    Stored {
        block_hashes: hashes.iter().map(|&h| VllmHash::Int(h)).collect(),
        parent_block_hash: parent.map(VllmHash::Int),
        token_ids: tokens.to_vec(),
        block_size: B as u32,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: None,
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
    }
}

fn removed(hashes: &[u64]) -> Event {
    Event::Removed(Removed {
        block_hashes: hashes.iter().map(|&h| VllmHash::Int(h)).collect(),
        medium: Some("GPU".into()),
        group_idx: None,
    })
}

/// What a router sees: the published filter after taking the pending delta.
fn router_view(m: &mut Mirror) -> BloomFilter {
    let _ = m.filter_mut().take_delta();
    BloomFilter::from_snapshot(&m.filter().snapshot()).unwrap()
}

fn prompt() -> Vec<u32> {
    (100..100 + 4 * B as u32).collect()
}

#[test]
fn chain_split_over_two_events_matches_the_routers_hash() {
    let mut m = Mirror::new(1000).unwrap();
    let p = prompt();
    m.apply(&Event::Stored(stored(&[11, 12], None, &p[..2 * B])));
    m.apply(&Event::Stored(stored(&[13, 14], Some(12), &p[2 * B..])));
    assert_eq!(m.resident(), 4);
    let chain = hash_chain(&ChainSeed::BASE, &p, B);
    let view = router_view(&mut m);
    assert_eq!(view.longest_prefix(&chain), 4);
    assert_eq!(m.canonical_of(14), Some(chain[3]));
    // A different continuation after block 2 matches only the shared part.
    let mut other = p.clone();
    other[2 * B] += 1;
    assert_eq!(
        view.longest_prefix(&hash_chain(&ChainSeed::BASE, &other, B)),
        2
    );
}

#[test]
fn repeated_stores_are_idempotent_and_one_removal_removes() {
    let mut m = Mirror::new(1000).unwrap();
    let p = prompt();
    let ev = Event::Stored(stored(&[11, 12], None, &p[..2 * B]));
    m.apply(&ev);
    m.apply(&ev); // vLLM 0.33 re-emits stores for reused blocks
    assert_eq!(m.resident(), 2);
    assert_eq!(m.stats().blocks_restored, 2);
    m.apply(&removed(&[12]));
    let chain = hash_chain(&ChainSeed::BASE, &p, B);
    assert_eq!(router_view(&mut m).longest_prefix(&chain), 1);
    m.apply(&removed(&[12]));
    assert_eq!(m.stats().unknown_removals, 1);
    m.apply(&Event::AllCleared);
    assert_eq!(m.resident(), 0);
    assert_eq!(router_view(&mut m).longest_prefix(&chain), 0);
}

#[test]
fn unknown_parent_other_media_and_groups_are_skipped_and_counted() {
    let mut m = Mirror::new(1000).unwrap();
    let p = prompt();
    m.apply(&Event::Stored(stored(&[13], Some(999), &p[..B])));
    assert_eq!(m.stats().orphan_blocks, 1);
    let mut cpu = stored(&[21], None, &p[..B]);
    cpu.medium = Some("CPU".into());
    m.apply(&Event::Stored(cpu));
    let mut g1 = stored(&[22], None, &p[..B]);
    g1.group_idx = Some(1);
    m.apply(&Event::Stored(g1));
    assert_eq!(m.resident(), 0);
    assert_eq!((m.stats().skipped_medium, m.stats().skipped_group), (1, 1));
    // Too few tokens for the blocks claimed.
    m.apply(&Event::Stored(stored(&[31, 32], None, &p[..B])));
    assert_eq!(m.stats().malformed_events, 1);
    assert_eq!(m.resident(), 0);
}

#[test]
fn lora_and_cache_salt_from_extra_keys_start_the_routers_chain() {
    let p = prompt();
    for (lora, salt) in [
        (None, Some("tenant-a")),
        (Some("sql-lora"), None),
        (Some("sql-lora"), Some("tenant-a")),
    ] {
        let mut m = Mirror::new(1000).unwrap();
        let mut st = stored(&[1, 2, 3, 4], None, &p);
        st.lora_name = lora.map(Into::into);
        st.extra_keys = Some(
            (0..4)
                .map(|i| {
                    let mut keys: Vec<Value> = lora.iter().map(|&l| Value::from(l)).collect();
                    if i == 0 {
                        keys.extend(salt.map(Value::from));
                    }
                    (!keys.is_empty()).then_some(keys)
                })
                .collect(),
        );
        m.apply(&Event::Stored(st));
        let view = router_view(&mut m);
        let seed = ChainSeed {
            lora,
            cache_salt: salt,
        };
        assert_eq!(
            view.longest_prefix(&hash_chain(&seed, &p, B)),
            4,
            "{lora:?} {salt:?}"
        );
        assert_eq!(
            view.longest_prefix(&hash_chain(&ChainSeed::BASE, &p, B)),
            0,
            "{lora:?} {salt:?}"
        );
    }
}

#[test]
fn multimodal_and_id_only_lora_blocks_are_never_matched() {
    let p = prompt();
    let mut m = Mirror::new(1000).unwrap();
    let mut mm = stored(&[1, 2], None, &p[..2 * B]);
    mm.extra_keys = Some(vec![
        Some(vec![Value::Array(vec![
            Value::from("img-hash"),
            Value::from(0),
        ])]),
        None,
    ]);
    m.apply(&Event::Stored(mm));
    let mut old_lora = stored(&[3], None, &p[..B]);
    old_lora.lora_id = Some(1);
    m.apply(&Event::Stored(old_lora));
    assert_eq!(m.resident(), 3);
    assert_eq!(
        m.stats().opaque_blocks,
        2,
        "the mm block and the id-only LoRA block"
    );
    let view = router_view(&mut m);
    assert_eq!(view.longest_prefix(&hash_chain(&ChainSeed::BASE, &p, B)), 0);
}

/// A delta carries how long ago the engine published the oldest change in it: the router turns
/// that into the view's staleness without comparing clocks across machines.
#[test]
fn a_delta_carries_the_age_of_its_oldest_change() {
    let mut m = Mirror::new(1000).unwrap();
    let p = prompt();
    m.apply(&Event::Stored(stored(&[1, 2], None, &p[..2 * B])));
    m.note_batch(100.25);
    m.apply(&Event::Stored(stored(&[3], Some(2), &p[2 * B..3 * B])));
    m.note_batch(100.5);
    let d = m.take_delta(100.75).expect("blocks stored");
    assert_eq!(d.age_ms, Some(500), "from the older batch");
    // Nothing changed since: no delta. A change stamped by a clock that is not ours: no age.
    assert!(m.take_delta(101.0).is_none());
    m.apply(&Event::Stored(stored(&[4], Some(3), &p[3 * B..])));
    m.note_batch(5000.0);
    assert_eq!(m.take_delta(101.0).unwrap().age_ms, None);
}
