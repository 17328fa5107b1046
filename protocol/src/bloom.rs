//! The Bloom filter of resident block hashes: an exact, counting view on the sidecar and a plain
//! bit set on the router, kept equal by full snapshots and compact deltas.
//!
//! Layout: a *blocked* Bloom filter. The bit array is cut into 512-bit blocks (one 64-byte cache
//! line, eight `u64` words); a key selects one block and sets one bit in each of its eight words.
//! A probe therefore touches one cache line instead of eight random ones, which is what makes a
//! longest-prefix query of a 512-block chain against 64 pods affordable on every request. The
//! price is a slightly higher false-positive rate per bit, which [`FilterParams::for_capacity`]
//! pays for with more bits (it sizes the filter with the exact formula for this layout).
//!
//! Deltas are lists of bit positions whose value changed since the last published version
//! (an XOR), so applying `delta(a → b)` to `a` yields exactly `b`, and the bytes on the wire grow
//! with the number of blocks that changed, not with the size of the cache.
//!
//! The filter owns its wire forms, [`CacheSnapshot`] and [`CacheDelta`] (with the delta's gap
//! coding): `messages` carries and validates them but the filter never imports a message, so the
//! dependency runs one way.

use serde::{Deserialize, Serialize};

use crate::splitmix::splitmix64;

/// The whole Bloom filter at a version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheSnapshot {
    pub version: u64,
    pub params: FilterParams,
    /// Blocks the sidecar knows resident (for display; the bits are what matter).
    pub resident_blocks: u64,
    /// The filter's words, little-endian, `params.num_blocks * 64` bytes.
    #[serde(with = "serde_bytes")]
    pub bits: Vec<u8>,
}

/// The bits that changed from `base_version` to `version` (= `base_version + 1`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheDelta {
    pub base_version: u64,
    pub version: u64,
    pub resident_blocks: u64,
    /// Strictly increasing bit positions to flip; on the wire as varint gaps, so a change of N
    /// blocks costs about N × 8 bytes whatever the filter's size.
    #[serde(with = "gaps")]
    pub toggles: Vec<u32>,
    /// Milliseconds from the engine publishing the oldest KV event this delta carries to the
    /// delta leaving the sidecar (both clocks are the pod's), when known. The router adds half
    /// the round trip for the view's staleness, without comparing clocks across machines.
    pub age_ms: Option<u32>,
}

/// Words of 64 bits in one filter block (one cache line).
pub const WORDS_PER_BLOCK: usize = 8;
/// Bits in one filter block.
pub const BITS_PER_BLOCK: usize = WORDS_PER_BLOCK * 64;
/// Bits set per key: one in each word of its block.
pub const HASHES_PER_KEY: usize = WORDS_PER_BLOCK;
/// Default target false-positive rate at full capacity.
pub const DEFAULT_FP_RATE: f64 = 0.01;
/// Upper bound on the number of filter blocks (2^22 blocks = 256 MiB of bits); a capacity that
/// would need more is clamped, and a snapshot claiming more is refused before allocating.
pub const MAX_FILTER_BLOCKS: u32 = 1 << 22;

/// Errors applying a snapshot or delta to a router-side filter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    #[error("filter has {0} blocks; allowed are 1 ..= {MAX_FILTER_BLOCKS}")]
    BadSize(u32),
    #[error("snapshot carries {got} bytes of bits, its parameters need {want}")]
    SnapshotLength { got: usize, want: usize },
    #[error("delta from version {delta_base} does not apply to version {have}")]
    VersionGap { have: u64, delta_base: u64 },
    #[error("delta toggles bit {bit}, the filter has {num_bits} bits")]
    BitOutOfRange { bit: u32, num_bits: u64 },
}

/// The shape of a filter; both sides derive every probe position from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FilterParams {
    /// Number of 512-bit blocks.
    pub num_blocks: u32,
}

impl FilterParams {
    /// The smallest filter whose expected false-positive rate with `capacity` keys is at most
    /// `fp_rate` (clamped to `[1e-6, 0.5]`). The sidecar passes the engine's `num_gpu_blocks`, so
    /// the rate holds even when the whole KV cache is full.
    pub fn for_capacity(capacity: usize, fp_rate: f64) -> Self {
        let fp_rate = fp_rate.clamp(1e-6, 0.5);
        let capacity = capacity.max(1) as f64;
        // The answer lies between 4 and 64 bits per key for every clamped rate; search the
        // number of blocks in that range (the estimate falls monotonically with more blocks).
        let to_blocks = |bits_per_key: f64| {
            ((capacity * bits_per_key / BITS_PER_BLOCK as f64).ceil() as u64)
                .clamp(1, u64::from(MAX_FILTER_BLOCKS)) as u32
        };
        let (mut lo, mut hi) = (to_blocks(4.0), to_blocks(64.0));
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if Self::estimate_fp(mid, capacity) <= fp_rate {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        FilterParams { num_blocks: lo }
    }

    /// Expected false-positive rate of this filter holding `keys` keys.
    pub fn expected_fp_rate(&self, keys: usize) -> f64 {
        Self::estimate_fp(self.num_blocks, keys as f64)
    }

    /// Exact expectation for the blocked layout: the number of keys in a block is Poisson with
    /// mean `λ = keys / blocks`; with `j` keys a word has a given bit set with probability
    /// `1 - (1 - 1/64)^j`, and a false positive needs all eight probed bits set.
    fn estimate_fp(num_blocks: u32, keys: f64) -> f64 {
        let lambda = keys / f64::from(num_blocks.max(1));
        if lambda <= 0.0 {
            return 0.0;
        }
        let spread = lambda.sqrt() * 12.0 + 30.0;
        let j_max = (lambda + spread).ceil() as u64;
        // Poisson pmf in log space so large means neither underflow nor overflow.
        let mut ln_fact = 0.0f64;
        let mut total = 0.0;
        for j in 0..=j_max {
            if j > 0 {
                ln_fact += (j as f64).ln();
            }
            let ln_p = -lambda + j as f64 * lambda.ln() - ln_fact;
            let p = ln_p.exp();
            let set = 1.0 - (1.0 - 1.0 / 64.0f64).powf(j as f64);
            total += p * set.powi(HASHES_PER_KEY as i32);
        }
        total.min(1.0)
    }

    /// Total number of bits.
    pub fn num_bits(&self) -> u64 {
        u64::from(self.num_blocks) * BITS_PER_BLOCK as u64
    }

    fn num_words(&self) -> usize {
        self.num_blocks as usize * WORDS_PER_BLOCK
    }

    fn check(&self) -> Result<(), FilterError> {
        if self.num_blocks == 0 || self.num_blocks > MAX_FILTER_BLOCKS {
            return Err(FilterError::BadSize(self.num_blocks));
        }
        Ok(())
    }

    /// A snapshot of this shape carrying `bits_len` bytes of bits: the size is in range and the
    /// bytes are exactly the filter's.
    pub fn check_snapshot(&self, bits_len: usize) -> Result<(), FilterError> {
        self.check()?;
        let want = self.num_words() * 8;
        if bits_len != want {
            return Err(FilterError::SnapshotLength {
                got: bits_len,
                want,
            });
        }
        Ok(())
    }

    /// Word indices and in-word bit positions of a key: block chosen from the key's high bits
    /// (multiply-shift range reduction), positions from a remix so they are independent of it.
    #[inline]
    fn probe(&self, key: u64) -> Probe {
        let block = ((u128::from(key) * u128::from(self.num_blocks)) >> 64) as usize;
        Probe {
            base: block * WORDS_PER_BLOCK,
            positions: splitmix64(key),
        }
    }
}

#[derive(Clone, Copy)]
struct Probe {
    base: usize,
    /// Six bits per word, word `w` uses bits `6w .. 6w+6`.
    positions: u64,
}

impl Probe {
    #[inline]
    fn bit(&self, w: usize) -> (usize, u64) {
        (self.base + w, 1u64 << ((self.positions >> (6 * w)) & 63))
    }
}

#[inline]
fn words_contain(words: &[u64], probe: Probe) -> bool {
    let mut all = true;
    for w in 0..WORDS_PER_BLOCK {
        let (i, mask) = probe.bit(w);
        all &= words[i] & mask != 0;
    }
    all
}

/// One filter block, aligned so that a probe touches exactly one cache line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C, align(64))]
struct Line([u64; WORDS_PER_BLOCK]);

impl Line {
    #[inline]
    fn contains(&self, positions: u64) -> bool {
        let mut all = true;
        for (w, word) in self.0.iter().enumerate() {
            all &= word & (1u64 << ((positions >> (6 * w)) & 63)) != 0;
        }
        all
    }
}

/// A chain's probe positions computed once for a filter shape, to match against many pods that
/// share it (pods of one model usually have the same `num_gpu_blocks`, hence the same shape).
#[derive(Debug, Clone)]
pub struct PreparedChain {
    params: FilterParams,
    probes: Vec<(u32, u64)>,
}

impl PreparedChain {
    /// Number of blocks in the chain.
    pub fn len(&self) -> usize {
        self.probes.len()
    }

    /// Whether the chain is empty.
    pub fn is_empty(&self) -> bool {
        self.probes.is_empty()
    }

    /// The shape the probes were computed for.
    pub fn params(&self) -> FilterParams {
        self.params
    }
}

impl FilterParams {
    /// Computes the probes of `chain` for filters of this shape.
    pub fn prepare(&self, chain: &[u64]) -> PreparedChain {
        PreparedChain {
            params: *self,
            probes: chain
                .iter()
                .map(|&k| {
                    let p = self.probe(k);
                    ((p.base / WORDS_PER_BLOCK) as u32, p.positions)
                })
                .collect(),
        }
    }
}

/// The router's view of one pod's cache: a plain bit set at a known version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BloomFilter {
    params: FilterParams,
    lines: Vec<Line>,
    version: u64,
    resident_blocks: u64,
}

impl BloomFilter {
    /// An empty filter (version 0).
    pub fn new(params: FilterParams) -> Result<Self, FilterError> {
        params.check()?;
        Ok(BloomFilter {
            params,
            lines: vec![Line::default(); params.num_blocks as usize],
            version: 0,
            resident_blocks: 0,
        })
    }

    /// A filter holding exactly `keys`: what the sidecar's view must equal after any history.
    pub fn from_keys(
        params: FilterParams,
        keys: impl IntoIterator<Item = u64>,
    ) -> Result<Self, FilterError> {
        let mut f = Self::new(params)?;
        for k in keys {
            let probe = params.probe(k);
            for w in 0..WORDS_PER_BLOCK {
                let (i, mask) = probe.bit(w);
                f.lines[i / WORDS_PER_BLOCK].0[i % WORDS_PER_BLOCK] |= mask;
            }
            f.resident_blocks += 1;
        }
        Ok(f)
    }

    /// This filter as a snapshot message, the inverse of [`Self::from_snapshot`] (what a test or
    /// bench hands a registry for a filter it built with [`Self::from_keys`]).
    pub fn snapshot(&self) -> CacheSnapshot {
        CacheSnapshot {
            version: self.version,
            params: self.params,
            resident_blocks: self.resident_blocks,
            bits: self.words().flat_map(u64::to_le_bytes).collect(),
        }
    }

    /// Replaces everything with a sidecar's snapshot.
    pub fn from_snapshot(snap: &CacheSnapshot) -> Result<Self, FilterError> {
        snap.params.check_snapshot(snap.bits.len())?;
        let lines = snap
            .bits
            .chunks_exact(8 * WORDS_PER_BLOCK)
            .map(|line| {
                let mut l = Line::default();
                for (w, c) in l.0.iter_mut().zip(line.chunks_exact(8)) {
                    *w = u64::from_le_bytes(c.try_into().expect("chunks_exact(8)"));
                }
                l
            })
            .collect();
        Ok(BloomFilter {
            params: snap.params,
            lines,
            version: snap.version,
            resident_blocks: snap.resident_blocks,
        })
    }

    /// Applies the next delta. A delta that does not start at this filter's version is refused
    /// (the caller asks for a fresh snapshot); so is one naming a bit outside the filter, and in
    /// both cases the filter is left unchanged.
    pub fn apply_delta(&mut self, delta: &CacheDelta) -> Result<(), FilterError> {
        if delta.base_version != self.version {
            return Err(FilterError::VersionGap {
                have: self.version,
                delta_base: delta.base_version,
            });
        }
        let num_bits = self.params.num_bits();
        if let Some(&bit) = delta.toggles.iter().find(|&&b| u64::from(b) >= num_bits) {
            return Err(FilterError::BitOutOfRange { bit, num_bits });
        }
        for &bit in &delta.toggles {
            let word = bit as usize / 64;
            self.lines[word / WORDS_PER_BLOCK].0[word % WORDS_PER_BLOCK] ^= 1u64 << (bit % 64);
        }
        self.version = delta.version;
        self.resident_blocks = delta.resident_blocks;
        Ok(())
    }

    /// Whether `key` may be resident (false positives at the configured rate, no false negatives).
    pub fn contains(&self, key: u64) -> bool {
        let p = self.params.probe(key);
        self.lines[p.base / WORDS_PER_BLOCK].contains(p.positions)
    }

    /// How many leading blocks of `chain` are present: the predicted prefix-cache hit in blocks.
    /// Stops at the first miss, so a false positive can only lengthen a match when every block
    /// before it matched too.
    pub fn longest_prefix(&self, chain: &[u64]) -> usize {
        chain
            .iter()
            .position(|&k| !self.contains(k))
            .unwrap_or(chain.len())
    }

    /// [`Self::longest_prefix`] with the probes computed once for many filters of one shape.
    /// A chain prepared for another shape is a caller bug: it matches nothing (0), and debug
    /// builds assert.
    pub fn longest_prefix_prepared(&self, chain: &PreparedChain) -> usize {
        self.present_run_prepared(chain, 0)
    }

    /// How many consecutive blocks of a prepared chain are present starting at block `start`
    /// (0 when `start` is past the end or the chain was prepared for another shape).
    pub fn present_run_prepared(&self, chain: &PreparedChain, start: usize) -> usize {
        debug_assert_eq!(
            chain.params, self.params,
            "chain prepared for another shape"
        );
        if chain.params != self.params {
            return 0;
        }
        let probes = chain.probes.get(start..).unwrap_or(&[]);
        probes
            .iter()
            .position(|&(line, positions)| !self.lines[line as usize].contains(positions))
            .unwrap_or(probes.len())
    }

    /// An upper bound on [`Self::present_run_prepared`] from every `stride`-th block only: the
    /// filter has no false negatives, so a sampled block it lacks ends every run that reaches
    /// it, and the run is at most the distance to the first such block. Costs one probe where
    /// the run is short and `len / stride` where it is long; never below the real run.
    pub fn present_run_bound(&self, chain: &PreparedChain, start: usize, stride: usize) -> usize {
        debug_assert_eq!(
            chain.params, self.params,
            "chain prepared for another shape"
        );
        if chain.params != self.params {
            return 0;
        }
        let stride = stride.max(1);
        let probes = chain.probes.get(start..).unwrap_or(&[]);
        probes
            .iter()
            .step_by(stride)
            .position(|&(line, positions)| !self.lines[line as usize].contains(positions))
            .map_or(probes.len(), |k| k * stride)
    }

    /// The filter's shape.
    pub fn params(&self) -> FilterParams {
        self.params
    }

    /// Version of the last snapshot or delta applied.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Number of resident blocks the sidecar reported with the last snapshot or delta.
    pub fn resident_blocks(&self) -> u64 {
        self.resident_blocks
    }

    /// Fraction of bits set (0 – 1); about 0.5 means the filter is at its design capacity.
    pub fn fill_ratio(&self) -> f64 {
        let ones: u64 = self.words().map(|w| u64::from(w.count_ones())).sum();
        ones as f64 / self.params.num_bits() as f64
    }

    /// The raw words in order, for equality checks.
    pub fn words(&self) -> impl Iterator<Item = u64> + '_ {
        self.lines.iter().flat_map(|l| l.0)
    }
}

/// The sidecar's side: a counting filter (so removals are exact) plus the last published bits,
/// from which deltas and snapshots are produced.
///
/// Counters are `u8`; one saturates only if 255 resident keys set the same bit, which at design
/// load (about 0.7 keys per bit) does not happen. A saturated counter sticks, so the worst case
/// is a bit that stays set (a false positive), never a lost key.
#[derive(Debug, Clone)]
pub struct CountingFilter {
    params: FilterParams,
    counts: Vec<u8>,
    current: Vec<u64>,
    published: Vec<u64>,
    /// Words whose bits may differ from `published`, each listed once (tracked by `dirty_mark`).
    dirty: Vec<u32>,
    dirty_mark: Vec<u64>,
    version: u64,
    keys: u64,
    /// `keys` as of the last publication (what routers were told).
    published_keys: u64,
}

impl CountingFilter {
    /// An empty filter at version 0.
    pub fn new(params: FilterParams) -> Result<Self, FilterError> {
        params.check()?;
        let words = params.num_words();
        Ok(CountingFilter {
            params,
            counts: vec![0; words * 64],
            current: vec![0; words],
            published: vec![0; words],
            dirty: Vec::new(),
            dirty_mark: vec![0; words.div_ceil(64)],
            version: 0,
            keys: 0,
            published_keys: 0,
        })
    }

    /// Adds one occurrence of `key`. Callers hold the exact set and insert each resident block
    /// once; inserting twice counts twice.
    pub fn insert(&mut self, key: u64) {
        let probe = self.params.probe(key);
        for w in 0..WORDS_PER_BLOCK {
            let (i, mask) = probe.bit(w);
            let c = &mut self.counts[i * 64 + mask.trailing_zeros() as usize];
            if *c == 0 {
                self.current[i] |= mask;
                Self::mark(&mut self.dirty, &mut self.dirty_mark, i);
            }
            *c = c.saturating_add(1);
        }
        self.keys += 1;
    }

    /// Removes one occurrence of `key`. Returns false, changing nothing, when `key` cannot have
    /// been inserted (one of its counters is zero).
    pub fn remove(&mut self, key: u64) -> bool {
        let probe = self.params.probe(key);
        let present = (0..WORDS_PER_BLOCK).all(|w| {
            let (i, mask) = probe.bit(w);
            self.counts[i * 64 + mask.trailing_zeros() as usize] > 0
        });
        if !present {
            return false;
        }
        for w in 0..WORDS_PER_BLOCK {
            let (i, mask) = probe.bit(w);
            let c = &mut self.counts[i * 64 + mask.trailing_zeros() as usize];
            if *c == u8::MAX {
                continue; // saturated: sticky, see the type's comment
            }
            *c -= 1;
            if *c == 0 {
                self.current[i] &= !mask;
                Self::mark(&mut self.dirty, &mut self.dirty_mark, i);
            }
        }
        self.keys = self.keys.saturating_sub(1);
        true
    }

    /// Removes every key (vLLM's `AllBlocksCleared`). The next delta carries the cleared bits.
    pub fn clear(&mut self) {
        self.counts.fill(0);
        for i in 0..self.current.len() {
            if self.current[i] != 0 {
                self.current[i] = 0;
                Self::mark(&mut self.dirty, &mut self.dirty_mark, i);
            }
        }
        self.keys = 0;
    }

    fn mark(dirty: &mut Vec<u32>, dirty_mark: &mut [u64], word: usize) {
        let (slot, bit) = (word / 64, 1u64 << (word % 64));
        if dirty_mark[slot] & bit == 0 {
            dirty_mark[slot] |= bit;
            dirty.push(word as u32);
        }
    }

    /// Whether `key` may be present in the current (not yet published) state.
    pub fn contains(&self, key: u64) -> bool {
        words_contain(&self.current, self.params.probe(key))
    }

    /// Number of keys inserted and not removed.
    pub fn len(&self) -> u64 {
        self.keys
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.keys == 0
    }

    /// The filter's shape.
    pub fn params(&self) -> FilterParams {
        self.params
    }

    /// Version of the last published state.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The last *published* state. Every router receives this on connect; the deltas that follow
    /// start from its version, so a router joining between two deltas stays consistent.
    pub fn snapshot(&self) -> CacheSnapshot {
        let mut bits = Vec::with_capacity(self.published.len() * 8);
        for w in &self.published {
            bits.extend_from_slice(&w.to_le_bytes());
        }
        CacheSnapshot {
            version: self.version,
            params: self.params,
            resident_blocks: self.published_keys,
            bits,
        }
    }

    /// Publishes what changed since the last publication as one delta, or `None` when the bits
    /// are unchanged (inserts and removals that cancel out produce no delta). Cost and size are
    /// proportional to the words touched since the last call.
    pub fn take_delta(&mut self) -> Option<CacheDelta> {
        let mut toggles = Vec::new();
        self.dirty.sort_unstable();
        for &word in &self.dirty {
            let i = word as usize;
            let mut diff = self.current[i] ^ self.published[i];
            self.published[i] = self.current[i];
            self.dirty_mark[i / 64] &= !(1u64 << (i % 64));
            while diff != 0 {
                let b = diff.trailing_zeros();
                toggles.push(word * 64 + b);
                diff &= diff - 1;
            }
        }
        self.dirty.clear();
        let keys_changed = self.published_keys != self.keys;
        if toggles.is_empty() && !keys_changed {
            return None;
        }
        self.published_keys = self.keys;
        let base_version = self.version;
        self.version += 1;
        Some(CacheDelta {
            base_version,
            version: self.version,
            resident_blocks: self.keys,
            toggles,
            age_ms: None,
        })
    }
}

/// Strictly increasing `u32`s as the first value and then the gaps between neighbours. Postcard
/// writes `u32` as a varint, so dense or clustered positions take one or two bytes each.
mod gaps {
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &[u32], s: S) -> Result<S::Ok, S::Error> {
        let mut prev = None;
        let mut out = Vec::with_capacity(v.len());
        for &x in v {
            out.push(match prev {
                None => x,
                // Unsorted input would encode garbage silently; saturate and let the decoder's
                // strictness check reject it instead of panicking in a serializer.
                Some(p) => x.saturating_sub(p),
            });
            prev = Some(x);
        }
        out.serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
        let raw = Vec::<u32>::deserialize(d)?;
        let mut out = Vec::with_capacity(raw.len());
        let mut prev: Option<u32> = None;
        for gap in raw {
            let x = match prev {
                None => gap,
                Some(_) if gap == 0 => return Err(D::Error::custom("repeated delta position")),
                Some(p) => p
                    .checked_add(gap)
                    .ok_or_else(|| D::Error::custom("delta position overflows u32"))?,
            };
            out.push(x);
            prev = Some(x);
        }
        Ok(out)
    }
}
