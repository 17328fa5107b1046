//! SplitMix64 (Steele, Lea and Flood, 2014): the project's one mixing function and seeded
//! generator. The Bloom filter derives its probe positions from [`splitmix64`], so the sidecar's
//! filter and every router's agree bit for bit — it can never change. Tests, benches and the
//! simulator use [`SplitMix64`] for seeded data that must be the same on every machine and
//! independent of any RNG crate's version.

/// The golden-ratio increment between two generator states.
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// One step: `x` advanced by the increment, then mixed to a well-spread 64-bit value.
#[inline]
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The generator: its `n`-th output (from 0) is `splitmix64(seed + n × GAMMA)`.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub const fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 pseudo-random bits.
    pub fn next_u64(&mut self) -> u64 {
        let out = splitmix64(self.0);
        self.0 = self.0.wrapping_add(GAMMA);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_outputs() {
        // The first outputs of the reference implementation seeded with 0.
        let mut g = SplitMix64::new(0);
        assert_eq!(g.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(g.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(g.next_u64(), 0x06c4_5d18_8009_454f);
        assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
    }
}
