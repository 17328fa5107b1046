//! The paged KV block pool with vLLM v1's prefix-caching semantics (`core/block_pool.py` and
//! `FreeKVCacheBlockQueue`). Blocks carry a reference count; a block whose count drops to zero
//! goes to the tail of an intrusive doubly linked free queue but keeps its hash, so it can still
//! be hit until an allocation pops it from the head — only then is it evicted and a
//! `BlockRemoved` produced. Every operation is O(blocks touched), never O(pool size), because
//! many engines share one process in the end-to-end tests.

use std::collections::HashMap;

use super::types::EngineKvEvent;

/// Index of a block in the pool.
pub(crate) type BlockId = u32;

const NIL: u32 = u32::MAX;

/// vLLM's `FreeKVCacheBlockQueue`: an O(1) LRU of free blocks (head = evicted first), with
/// removal from the middle when a cached free block is hit again.
#[derive(Debug)]
struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    in_queue: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    fn with_all(n: usize) -> Self {
        let mut q = Self {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            in_queue: vec![false; n],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for id in 0..n {
            q.push_back(id as u32);
        }
        q
    }

    fn push_back(&mut self, id: BlockId) {
        let i = id as usize;
        debug_assert!(!self.in_queue[i], "block {id} freed twice");
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.in_queue[i] = true;
        self.len += 1;
    }

    fn push_front(&mut self, id: BlockId) {
        let i = id as usize;
        debug_assert!(!self.in_queue[i], "block {id} freed twice");
        self.prev[i] = NIL;
        self.next[i] = self.head;
        if self.head == NIL {
            self.tail = id;
        } else {
            self.prev[self.head as usize] = id;
        }
        self.head = id;
        self.in_queue[i] = true;
        self.len += 1;
    }

    fn pop_front(&mut self) -> Option<BlockId> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.remove(id);
        Some(id)
    }

    fn remove(&mut self, id: BlockId) {
        let i = id as usize;
        debug_assert!(self.in_queue[i], "block {id} is not free");
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.in_queue[i] = false;
        self.len -= 1;
    }
}

/// What a stored block's event needs from the request that filled it.
pub(crate) struct StoreInfo<'a> {
    /// All the request's tokens (prompt then output).
    pub(crate) tokens: &'a [u32],
    /// The request's full-block hashes, at least as many as blocks being cached.
    pub(crate) block_hashes: &'a [u64],
    pub(crate) lora_id: Option<u64>,
    pub(crate) lora_name: Option<&'a str>,
    pub(crate) cache_salt: Option<&'a str>,
}

/// The pool.
#[derive(Debug)]
pub(crate) struct BlockPool {
    block_size: usize,
    enable_caching: bool,
    enable_events: bool,
    ref_cnt: Vec<u32>,
    hash: Vec<Option<u64>>,
    free: FreeQueue,
    /// hash → blocks holding it. vLLM does not de-duplicate: two requests that independently
    /// fill a block with the same content both cache it; a lookup takes the first.
    cached: HashMap<u64, Vec<BlockId>>,
    num_cached_blocks: usize,
    events: Vec<EngineKvEvent>,
}

impl BlockPool {
    pub(crate) fn new(
        num_gpu_blocks: usize,
        block_size: usize,
        enable_caching: bool,
        enable_events: bool,
    ) -> Self {
        let mut free = FreeQueue::with_all(num_gpu_blocks);
        // Block 0 is vLLM's null block: a placeholder never handed out or freed.
        let null = free.pop_front();
        debug_assert_eq!(null, Some(0));
        Self {
            block_size,
            enable_caching,
            enable_events,
            ref_cnt: vec![0; num_gpu_blocks],
            hash: vec![None; num_gpu_blocks],
            free,
            cached: HashMap::new(),
            num_cached_blocks: 0,
            events: Vec::new(),
        }
    }

    /// Blocks that can be handed out (free, cached or not).
    pub(crate) fn num_free(&self) -> usize {
        self.free.len
    }

    /// Blocks usable by requests (all but the null block).
    pub(crate) fn num_usable(&self) -> usize {
        self.ref_cnt.len() - 1
    }

    /// vLLM's `get_usage`: the fraction of usable blocks referenced by requests.
    pub(crate) fn usage(&self) -> f64 {
        1.0 - self.num_free() as f64 / self.num_usable() as f64
    }

    pub(crate) fn ref_cnt(&self, id: BlockId) -> u32 {
        self.ref_cnt[id as usize]
    }

    /// The longest run of cached blocks matching `hashes` from the start, at most `max_blocks`.
    pub(crate) fn longest_hit(&self, hashes: &[u64], max_blocks: usize) -> Vec<BlockId> {
        if !self.enable_caching {
            return Vec::new();
        }
        hashes
            .iter()
            .take(max_blocks)
            .map_while(|h| {
                self.cached
                    .get(h)
                    .and_then(|blocks| blocks.first().copied())
            })
            .collect()
    }

    /// Takes a reference on blocks hit in the cache, pulling free ones out of the free queue.
    pub(crate) fn touch(&mut self, blocks: &[BlockId]) {
        for &id in blocks {
            if self.ref_cnt[id as usize] == 0 {
                self.free.remove(id);
            }
            self.ref_cnt[id as usize] += 1;
        }
    }

    /// Pops `n` blocks from the head of the free queue, evicting cached ones. `None` (and no
    /// change) when fewer than `n` are free.
    pub(crate) fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free.len {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.free.pop_front()?;
            self.evict(id);
            self.ref_cnt[id as usize] = 1;
            out.push(id);
        }
        Some(out)
    }

    fn evict(&mut self, id: BlockId) {
        let Some(h) = self.hash[id as usize].take() else {
            return;
        };
        if let Some(blocks) = self.cached.get_mut(&h) {
            blocks.retain(|&b| b != id);
            if blocks.is_empty() {
                self.cached.remove(&h);
            }
        }
        self.num_cached_blocks -= 1;
        if self.enable_events {
            self.events.push(EngineKvEvent::BlockRemoved {
                block_hashes: vec![h],
            });
        }
    }

    /// Drops one reference per block; `ordered` is in eviction order (first = evicted first),
    /// so callers pass a request's blocks tail first. As vLLM's `free_blocks`: a block that
    /// reaches zero references goes to the *front* of the free queue when it holds no hash (it
    /// can never be hit, so it is reused first) and to the back when it is cached (LRU); the
    /// front group keeps the given order, its first block at the head.
    pub(crate) fn free(&mut self, ordered: impl IntoIterator<Item = BlockId>) {
        let mut first = Vec::new();
        for id in ordered {
            let rc = &mut self.ref_cnt[id as usize];
            debug_assert!(*rc > 0, "block {id} freed with no reference");
            *rc = rc.saturating_sub(1);
            if *rc == 0 {
                if self.hash[id as usize].is_some() {
                    self.free.push_back(id);
                } else {
                    first.push(id);
                }
            }
        }
        for &id in first.iter().rev() {
            self.free.push_front(id);
        }
    }

    /// Registers `blocks[from..to]` (now full) under their hashes and reports them in one
    /// `BlockStored`, chained to `blocks[from - 1]`'s hash.
    pub(crate) fn cache_full_blocks(
        &mut self,
        blocks: &[BlockId],
        from: usize,
        to: usize,
        info: &StoreInfo<'_>,
    ) {
        if !self.enable_caching || from >= to {
            return;
        }
        for (i, &id) in blocks.iter().enumerate().take(to).skip(from) {
            let h = info.block_hashes[i];
            debug_assert!(self.hash[id as usize].is_none(), "block {id} cached twice");
            self.hash[id as usize] = Some(h);
            self.cached.entry(h).or_default().push(id);
            self.num_cached_blocks += 1;
        }
        self.emit_stored(from, to, info);
    }

    /// vLLM 0.33 re-announces blocks reused from the prefix cache (`emit_cached_block_events`):
    /// one `BlockStored` for the `count` hit blocks from the chain start, parent `None`.
    pub(crate) fn announce_reused(&mut self, count: usize, info: &StoreInfo<'_>) {
        if self.enable_caching && count > 0 {
            self.emit_stored(0, count, info);
        }
    }

    fn emit_stored(&mut self, from: usize, to: usize, info: &StoreInfo<'_>) {
        if !self.enable_events {
            return;
        }
        let bs = self.block_size;
        self.events.push(EngineKvEvent::BlockStored {
            block_hashes: info.block_hashes[from..to].to_vec(),
            parent_block_hash: from.checked_sub(1).map(|p| info.block_hashes[p]),
            token_ids: info.tokens[from * bs..to * bs].to_vec(),
            block_size: bs,
            lora_id: info.lora_id,
            lora_name: info.lora_name.map(str::to_owned),
            extra_keys: (from..to)
                .map(|i| super::hash::extra_keys(info.lora_name, info.cache_salt, i == 0))
                .collect(),
        });
    }

    /// vLLM's `reset_prefix_cache`: refused (false) while any block is referenced; otherwise
    /// forgets every hash and reports `AllBlocksCleared`.
    pub(crate) fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free() != self.num_usable() {
            return false;
        }
        if !self.enable_caching {
            return true;
        }
        // Only cached blocks carry a hash, so this walks the cache, not the pool.
        for blocks in self.cached.values() {
            for &id in blocks {
                self.hash[id as usize] = None;
            }
        }
        self.cached.clear();
        self.num_cached_blocks = 0;
        if self.enable_events {
            self.events.push(EngineKvEvent::AllBlocksCleared);
        }
        true
    }

    pub(crate) fn take_events(&mut self) -> Vec<EngineKvEvent> {
        std::mem::take(&mut self.events)
    }

    #[cfg(test)]
    pub(crate) fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// Number of cached blocks (a hash held twice counts twice).
    pub(crate) fn num_cached_blocks(&self) -> usize {
        self.num_cached_blocks
    }

    /// Every cached hash with the number of blocks holding it, sorted by hash.
    pub(crate) fn cached_hash_counts(&self) -> Vec<(u64, usize)> {
        let mut v: Vec<_> = self.cached.iter().map(|(&h, b)| (h, b.len())).collect();
        v.sort_unstable();
        v
    }

    /// Test support: checks the pool's internal invariants, O(pool size).
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let mut free_walk = 0;
        let mut cur = self.free.head;
        while cur != NIL {
            if self.ref_cnt[cur as usize] != 0 {
                return Err(format!("free block {cur} has references"));
            }
            free_walk += 1;
            if free_walk > self.ref_cnt.len() {
                return Err("free queue has a cycle".into());
            }
            cur = self.free.next[cur as usize];
        }
        if free_walk != self.free.len {
            return Err(format!(
                "free queue walk {free_walk} != len {}",
                self.free.len
            ));
        }
        for id in 1..self.ref_cnt.len() {
            let free = self.free.in_queue[id];
            let referenced = self.ref_cnt[id] > 0;
            if free == referenced {
                return Err(format!(
                    "block {id}: free={free} but ref_cnt={}",
                    self.ref_cnt[id]
                ));
            }
        }
        if self.free.in_queue[0] || self.ref_cnt[0] != 0 {
            return Err("the null block was handed out".into());
        }
        let mut cached = 0;
        for (h, blocks) in &self.cached {
            for &b in blocks {
                if self.hash[b as usize] != Some(*h) {
                    return Err(format!("block {b} in cache under {h:#x} but hash differs"));
                }
                cached += 1;
            }
        }
        let hashed = self.hash.iter().filter(|h| h.is_some()).count();
        if cached != hashed || cached != self.num_cached_blocks {
            return Err(format!(
                "cached map {cached}, hashed blocks {hashed}, counter {}",
                self.num_cached_blocks
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info<'a>(tokens: &'a [u32], hashes: &'a [u64]) -> StoreInfo<'a> {
        StoreInfo {
            tokens,
            block_hashes: hashes,
            lora_id: None,
            lora_name: None,
            cache_salt: None,
        }
    }

    #[test]
    fn null_block_is_reserved_and_usage_counts_usable_blocks() {
        let mut pool = BlockPool::new(5, 2, true, true);
        assert_eq!(pool.num_free(), 4);
        let got = pool.allocate(4).expect("4 free");
        assert!(!got.contains(&0));
        assert_eq!(pool.usage(), 1.0);
        assert!(pool.allocate(1).is_none());
        pool.check_invariants().expect("invariants");
    }

    #[test]
    fn freed_cached_blocks_are_evicted_tail_first_and_only_on_demand() {
        let mut pool = BlockPool::new(4, 2, true, true);
        let blocks = pool.allocate(3).expect("3 free");
        let tokens = [1, 2, 3, 4, 5, 6];
        let hashes = [10, 11, 12];
        pool.cache_full_blocks(&blocks, 0, 3, &info(&tokens, &hashes));
        assert_eq!(pool.take_events().len(), 1);
        pool.free(blocks.iter().rev().copied());
        // Still cached while free: no eviction yet.
        assert_eq!(pool.longest_hit(&hashes, 3), blocks);
        assert!(!pool.has_events());
        pool.allocate(1).expect("1 free");
        assert_eq!(
            pool.take_events(),
            vec![EngineKvEvent::BlockRemoved {
                block_hashes: vec![12]
            }]
        );
        assert_eq!(pool.longest_hit(&hashes, 3), blocks[..2].to_vec());
        pool.check_invariants().expect("invariants");
    }

    #[test]
    fn reset_is_refused_while_blocks_are_in_use() {
        let mut pool = BlockPool::new(4, 2, true, true);
        let blocks = pool.allocate(1).expect("free");
        assert!(!pool.reset_prefix_cache());
        pool.free(blocks);
        assert!(pool.reset_prefix_cache());
        assert_eq!(pool.take_events(), vec![EngineKvEvent::AllBlocksCleared]);
    }
}
