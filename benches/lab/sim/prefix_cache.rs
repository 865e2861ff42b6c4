//! A replica's prefix cache: the blocks of tokens it has computed, keyed by their hash chain,
//! least recently used out first.
//!
//! A request's cached prefix is the run of its leading blocks found in the cache (the first miss
//! ends it, as in vLLM: a block is only usable after every block before it). Looking a chain up
//! or storing it marks its blocks used, the first block most recently, so that when a chain is
//! evicted its last blocks go first and no block outlives the blocks it follows.
//!
//! The blocks of a running request are pinned ([`PrefixCache::pin`] to
//! [`PrefixCache::unpin`]): as in vLLM, whose blocks in use have a reference count, they are
//! never evicted while it runs, and another request can find them. Only unpinned blocks count
//! towards eviction order; pinned ones may hold the cache above its capacity for a while.

use std::collections::{BTreeMap, HashMap};

/// Blocks by hash chain, with a capacity in tokens.
#[derive(Debug)]
pub struct PrefixCache {
    capacity_blocks: usize,
    /// Hash → its block.
    blocks: HashMap<u64, Block>,
    /// Tick → hash of the blocks no running request holds, oldest first: the eviction order.
    by_age: BTreeMap<u64, u64>,
    clock: u64,
}

#[derive(Debug, Clone, Copy)]
struct Block {
    /// The tick of its last use.
    tick: u64,
    /// Running requests holding it.
    pins: u32,
}

impl PrefixCache {
    /// A cache holding up to `capacity_tokens` tokens in blocks of `block_tokens` (0: holds
    /// nothing).
    pub fn new(capacity_tokens: u64, block_tokens: u32) -> Self {
        Self {
            capacity_blocks: (capacity_tokens / u64::from(block_tokens.max(1))) as usize,
            blocks: HashMap::new(),
            by_age: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Whether it can hold anything.
    pub fn is_enabled(&self) -> bool {
        self.capacity_blocks > 0
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether it holds no block.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// How many leading blocks of `chain` are held; those are marked used.
    pub fn lookup(&mut self, chain: &[u64]) -> usize {
        let held = chain
            .iter()
            .take_while(|hash| self.blocks.contains_key(hash))
            .count();
        self.touch(&chain[..held]);
        held
    }

    /// Stores `chain` (marked used), evicting the least recently used unpinned blocks beyond
    /// capacity.
    pub fn insert(&mut self, chain: &[u64]) {
        if !self.is_enabled() {
            return;
        }
        self.touch(chain);
        self.evict();
    }

    /// Stores `chain` as [`PrefixCache::insert`] does, pinning its blocks from `from` on before
    /// anything is evicted (a running request's prompt, stored by its prefill).
    pub fn insert_pinned(&mut self, chain: &[u64], from: usize) {
        if !self.is_enabled() {
            return;
        }
        self.touch(chain);
        self.pin(&chain[from.min(chain.len())..]);
        self.evict();
    }

    /// A running request holds the blocks of `chain` (all in the cache: found by
    /// [`PrefixCache::lookup`] or stored by [`PrefixCache::insert_pinned`]): they are not
    /// evicted until as many [`PrefixCache::unpin`] calls.
    pub fn pin(&mut self, chain: &[u64]) {
        for hash in chain {
            if let Some(block) = self.blocks.get_mut(hash) {
                if block.pins == 0 {
                    self.by_age.remove(&block.tick);
                }
                block.pins += 1;
            }
        }
    }

    /// Lets go of blocks [`PrefixCache::pin`] held; a block no request holds any more may be
    /// evicted again.
    pub fn unpin(&mut self, chain: &[u64]) {
        for hash in chain {
            if let Some(block) = self.blocks.get_mut(hash) {
                block.pins = block.pins.saturating_sub(1);
                if block.pins == 0 {
                    self.by_age.insert(block.tick, *hash);
                }
            }
        }
        self.evict();
    }

    fn evict(&mut self) {
        while self.blocks.len() > self.capacity_blocks {
            let Some((_, hash)) = self.by_age.pop_first() else {
                break;
            };
            self.blocks.remove(&hash);
        }
    }

    /// Marks `chain` used now, its first block the most recent.
    fn touch(&mut self, chain: &[u64]) {
        let newest = self.clock + chain.len() as u64;
        for (depth, hash) in chain.iter().enumerate() {
            let tick = newest - depth as u64;
            let block = self.blocks.entry(*hash).or_insert(Block { tick, pins: 0 });
            if block.pins == 0 {
                self.by_age.remove(&block.tick);
                self.by_age.insert(tick, *hash);
            }
            block.tick = tick;
        }
        self.clock = newest;
    }
}
