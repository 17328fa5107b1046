//! The mirror of the engine's KV cache: the exact set of resident GPU blocks, keyed by vLLM's
//! hash and translated to canonical hashes, with the counting Bloom filter routers receive.
//!
//! Rules, each one a decision an operator may need to know:
//! - **Only GPU blocks** count: events whose `medium` is set and not `"GPU"` (CPU or disk
//!   offload tiers) are ignored, because a router predicts GPU prefix hits. They are counted.
//! - **One KV-cache group**: hybrid models publish one event stream per group (`group_idx`); we
//!   mirror group 0 (or events without a group) and count the rest as skipped.
//! - **Idempotent stores**: vLLM 0.33 re-emits `BlockStored` for blocks reused from the cache; a
//!   hash already resident is left as is, and is removed by a single `BlockRemoved`.
//! - **Canonical hash**: from the event's token ids and the parent's canonical hash; the first
//!   block of a chain starts at the root for its LoRA name and `cache_salt` (the salt is the
//!   string among the first block's untagged `extra_keys`).
//! - **Opaque blocks**: blocks whose extra keys hold multimodal or prompt-embedding digests, and
//!   LoRA blocks from vLLM versions that publish only a numeric `lora_id`, get a canonical hash
//!   that no router chain can produce: the router cannot reproduce those keys, so it must never
//!   predict a hit on them.
//! - **Unknown parent**: a store whose parent we never saw (events were missed) cannot be placed
//!   in any chain; its blocks are skipped and counted as orphans. The caller treats orphans
//!   outside a known gap as lost history.
//! - **Lost history**: [`Mirror::reset`] empties the view. A router then under-predicts hits
//!   (blocks still resident but unknown) instead of predicting hits on evicted blocks.

use std::collections::HashMap;

use kvsight_protocol::bloom::{CountingFilter, DEFAULT_FP_RATE, FilterError, FilterParams};
use kvsight_protocol::hash::{ChainSeed, block_hash};
use kvsight_protocol::messages::CacheDelta;
use rmpv::Value;
use xxhash_rust::xxh3::Xxh3;

use crate::kv_events::decode::{Event, Removed, Stored};

/// Counters of what the mirror did with events (exported as metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MirrorStats {
    pub blocks_stored: u64,
    pub blocks_restored: u64,
    pub blocks_removed: u64,
    pub clears: u64,
    pub orphan_blocks: u64,
    pub unknown_removals: u64,
    pub skipped_medium: u64,
    pub skipped_group: u64,
    pub opaque_blocks: u64,
    pub unknown_events: u64,
    pub malformed_events: u64,
}

/// The exact resident set plus its filter.
#[derive(Debug)]
pub struct Mirror {
    filter: CountingFilter,
    /// vLLM hash key → canonical hash.
    blocks: HashMap<u64, u64>,
    stats: MirrorStats,
    /// When the engine published the oldest batch applied since the last delta was taken
    /// (vLLM's `ts`, seconds since the Unix epoch by the pod's clock).
    oldest_unsent: Option<f64>,
}

impl Mirror {
    /// An empty mirror whose filter holds `num_gpu_blocks` at the default false-positive rate.
    pub fn new(num_gpu_blocks: u64) -> Result<Self, FilterError> {
        let params = FilterParams::for_capacity(
            usize::try_from(num_gpu_blocks).unwrap_or(usize::MAX),
            DEFAULT_FP_RATE,
        );
        Ok(Mirror {
            filter: CountingFilter::new(params)?,
            blocks: HashMap::new(),
            stats: MirrorStats::default(),
            oldest_unsent: None,
        })
    }

    /// Applies one event.
    pub fn apply(&mut self, event: &Event) {
        match event {
            Event::Stored(s) => self.store(s),
            Event::Removed(r) => self.remove(r),
            Event::AllCleared => {
                self.stats.clears += 1;
                self.clear_view();
            }
            Event::Unknown(_) => self.stats.unknown_events += 1,
        }
    }

    /// Notes that a batch the engine published at `ts` (seconds since the Unix epoch) was
    /// applied; the next delta carries the age of the oldest such batch.
    pub fn note_batch(&mut self, ts: f64) {
        if ts.is_finite() && self.oldest_unsent.is_none_or(|t| ts < t) {
            self.oldest_unsent = Some(ts);
        }
    }

    /// Takes the filter's delta, stamped with its age at `now` (seconds since the Unix epoch):
    /// how long ago the engine published the oldest change it carries. An age that is negative
    /// or over an hour says the engine's timestamps are not this clock's: left out.
    pub fn take_delta(&mut self, now: f64) -> Option<CacheDelta> {
        let mut delta = self.filter.take_delta()?;
        if let Some(ts) = self.oldest_unsent.take() {
            let age = now - ts;
            delta.age_ms = (0.0..3600.0)
                .contains(&age)
                .then(|| (age * 1000.0).round() as u32);
        }
        Some(delta)
    }

    /// Forgets everything (history lost); counters are kept.
    pub fn reset(&mut self) {
        self.clear_view();
    }

    fn clear_view(&mut self) {
        self.blocks.clear();
        self.filter.clear();
    }

    fn tracked(&mut self, medium: Option<&str>, group: Option<i64>, n: usize) -> bool {
        if medium.is_some_and(|m| !m.eq_ignore_ascii_case("GPU")) {
            self.stats.skipped_medium += n as u64;
            return false;
        }
        if group.is_some_and(|g| g != 0) {
            self.stats.skipped_group += n as u64;
            return false;
        }
        true
    }

    fn store(&mut self, s: &Stored) {
        let n = s.block_hashes.len();
        if !self.tracked(s.medium.as_deref(), s.group_idx, n) {
            return;
        }
        let bs = s.block_size as usize;
        if s.token_ids.len() < n * bs {
            // Fewer tokens than blocks: nothing trustworthy to hash.
            self.stats.malformed_events += 1;
            return;
        }
        let mut parent = match &s.parent_block_hash {
            None => None,
            Some(p) => match self.blocks.get(&p.key()) {
                Some(&c) => Some(c),
                None => {
                    self.stats.orphan_blocks += n as u64;
                    return;
                }
            },
        };
        for (i, h) in s.block_hashes.iter().enumerate() {
            let tokens = &s.token_ids[i * bs..(i + 1) * bs];
            let keys = s
                .extra_keys
                .as_ref()
                .and_then(|k| k.get(i))
                .and_then(Option::as_deref)
                .unwrap_or(&[]);
            let canonical = self.canonical(parent, tokens, keys, s);
            parent = Some(canonical);
            let key = h.key();
            if self.blocks.contains_key(&key) {
                self.stats.blocks_restored += 1;
                continue;
            }
            self.blocks.insert(key, canonical);
            self.filter.insert(canonical);
            self.stats.blocks_stored += 1;
        }
    }

    fn canonical(
        &mut self,
        parent: Option<u64>,
        tokens: &[u32],
        keys: &[Value],
        s: &Stored,
    ) -> u64 {
        // The LoRA identity, when present, leads the untagged keys of every block: its name
        // since vLLM 0.14, its numeric id before.
        let leading_lora = match (keys.first(), &s.lora_name) {
            (Some(Value::String(k)), Some(name)) => k.as_str() == Some(name.as_str()),
            (Some(Value::Integer(_)), _) => s.lora_name.is_some() || s.lora_id.is_some(),
            _ => false,
        };
        let keys = if leading_lora { &keys[1..] } else { keys };
        let mut opaque = s.lora_name.is_none() && s.lora_id.is_some();
        let mut salt = None;
        for k in keys {
            match (k, parent) {
                (Value::String(v), None) if v.as_str().is_some() => salt = v.as_str(),
                _ => opaque = true,
            }
        }
        let parent = parent.unwrap_or_else(|| {
            ChainSeed {
                lora: s.lora_name.as_deref(),
                cache_salt: salt,
            }
            .root()
        });
        if opaque {
            self.stats.opaque_blocks += 1;
            let mut h = Xxh3::new();
            h.update(b"kvsight/opaque/v1");
            h.update(&parent.to_le_bytes());
            for t in tokens {
                h.update(&t.to_le_bytes());
            }
            for k in keys {
                h.update(k.to_string().as_bytes());
            }
            h.digest()
        } else {
            block_hash(parent, tokens)
        }
    }

    fn remove(&mut self, r: &Removed) {
        if !self.tracked(r.medium.as_deref(), r.group_idx, r.block_hashes.len()) {
            return;
        }
        for h in &r.block_hashes {
            match self.blocks.remove(&h.key()) {
                Some(canonical) => {
                    self.filter.remove(canonical);
                    self.stats.blocks_removed += 1;
                }
                None => self.stats.unknown_removals += 1,
            }
        }
    }

    /// Number of resident blocks.
    pub fn resident(&self) -> usize {
        self.blocks.len()
    }

    /// Whether vLLM's block `key` is resident, and its canonical hash.
    pub fn canonical_of(&self, vllm_key: u64) -> Option<u64> {
        self.blocks.get(&vllm_key).copied()
    }

    /// Every resident block as (vLLM hash key, canonical hash).
    pub fn blocks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.blocks.iter().map(|(&k, &c)| (k, c))
    }

    /// The filter, for snapshots and deltas.
    pub fn filter(&self) -> &CountingFilter {
        &self.filter
    }

    /// The filter, for taking deltas.
    pub fn filter_mut(&mut self) -> &mut CountingFilter {
        &mut self.filter
    }

    /// What happened so far.
    pub fn stats(&self) -> &MirrorStats {
        &self.stats
    }

    /// Counts an event payload that failed to decode.
    pub fn count_malformed(&mut self) {
        self.stats.malformed_events += 1;
    }
}
