//! The simulator's own block hash and its seeded pseudo-randomness. Like vLLM, a block's hash
//! chains its parent's hash, its tokens and its extra keys (LoRA name, `cache_salt` on the first
//! block), and the chain's root is a per-process random value: two engines hash the same prompt
//! differently, which is exactly why kvsight re-hashes canonically. The values are full-range
//! `u64`s (vLLM publishes the low 8 bytes of its digest), so values >= 2^63 are common.

use xxhash_rust::xxh3::Xxh3;

// SplitMix64 derives independent streams (root hash, generated tokens) from the one seed.
pub(crate) use kvsight_protocol::splitmix::splitmix64;

/// vLLM's `NONE_HASH`: the parent of every first block, random per process. Here it is derived
/// from the seed so runs are reproducible yet differ between engines with different seeds.
pub(crate) fn root_hash(seed: u64) -> u64 {
    // The constant separates this stream from the token stream fed by the same seed.
    splitmix64(seed ^ 0x6b76_7369_6768_7421)
}

/// Extra keys of one block: the LoRA name on every block, the salt on the first, as vLLM's
/// `generate_block_hash_extra_keys` does. `None` when there are none.
pub(crate) fn extra_keys(
    lora_name: Option<&str>,
    cache_salt: Option<&str>,
    first_block: bool,
) -> Option<Vec<String>> {
    let mut keys = Vec::new();
    if let Some(name) = lora_name {
        keys.push(name.to_owned());
    }
    if first_block && let Some(salt) = cache_salt {
        keys.push(salt.to_owned());
    }
    (!keys.is_empty()).then_some(keys)
}

/// Hash of one full block given its parent's hash (or the root for the first block).
pub(crate) fn block_hash(parent: u64, tokens: &[u32], extra: Option<&[String]>) -> u64 {
    let mut h = Xxh3::new();
    h.update(&parent.to_le_bytes());
    h.update(&(tokens.len() as u64).to_le_bytes());
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    // Length-prefixed so that ["ab"] and ["a", "b"] (or no keys) never collide by construction.
    match extra {
        None => h.update(&[0]),
        Some(keys) => {
            h.update(&[1]);
            h.update(&(keys.len() as u64).to_le_bytes());
            for k in keys {
                h.update(&(k.len() as u64).to_le_bytes());
                h.update(k.as_bytes());
            }
        }
    }
    h.digest()
}

/// A digest of what determines a request's output (prompt and adapter), so identical requests
/// generate identical tokens whatever their ids, as greedy decoding would.
pub(crate) fn output_key(seed: u64, prompt: &[u32], lora_name: Option<&str>) -> u64 {
    let mut h = Xxh3::with_seed(seed);
    for t in prompt {
        h.update(&t.to_le_bytes());
    }
    if let Some(name) = lora_name {
        h.update(&[1]);
        h.update(name.as_bytes());
    }
    h.digest()
}

/// The token generated at output position `position` for a request with `key`.
pub(crate) fn generated_token(key: u64, position: usize, vocab_size: u32) -> u32 {
    let r = splitmix64(key ^ splitmix64(position as u64));
    // Multiply-shift maps to 0..vocab_size without modulo bias worth caring about.
    ((u128::from(r) * u128::from(vocab_size)) >> 64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_keys_put_lora_everywhere_and_salt_first() {
        assert_eq!(extra_keys(None, None, true), None);
        assert_eq!(
            extra_keys(Some("a"), Some("s"), true),
            Some(vec!["a".to_owned(), "s".to_owned()])
        );
        assert_eq!(
            extra_keys(Some("a"), Some("s"), false),
            Some(vec!["a".to_owned()])
        );
        assert_eq!(extra_keys(None, Some("s"), false), None);
    }

    #[test]
    fn hash_depends_on_parent_tokens_and_keys() {
        let base = block_hash(1, &[1, 2, 3], None);
        assert_ne!(base, block_hash(2, &[1, 2, 3], None));
        assert_ne!(base, block_hash(1, &[1, 2, 4], None));
        assert_ne!(base, block_hash(1, &[1, 2, 3], Some(&["x".to_owned()])));
        assert_ne!(
            block_hash(1, &[1], Some(&["ab".to_owned()])),
            block_hash(1, &[1], Some(&["a".to_owned(), "b".to_owned()]))
        );
        assert_ne!(root_hash(0), root_hash(1));
    }

    #[test]
    fn hashes_cover_the_upper_half_of_u64() {
        let high = (0..64u32)
            .filter(|&i| block_hash(root_hash(7), &[i], None) >= 1 << 63)
            .count();
        assert!(high > 10 && high < 54, "{high} of 64 hashes >= 2^63");
    }

    #[test]
    fn generated_tokens_stay_in_vocab() {
        for p in 0..1000 {
            assert!(generated_token(42, p, 7) < 7);
        }
    }
}
