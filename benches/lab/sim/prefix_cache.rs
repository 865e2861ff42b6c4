//! A replica's prefix cache: the blocks of tokens it has computed, keyed by their hash chain,
//! least recently used out first.
//!
//! A request's cached prefix is the run of its leading blocks found in the cache (the first miss
//! ends it, as in vLLM: a block is only usable after every block before it). Looking a chain up
//! or storing it marks its blocks used, the first block most recently, so that when a chain is
//! evicted its last blocks go first and no block outlives the blocks it follows.

use std::collections::{BTreeMap, HashMap};

/// Blocks by hash chain, with a capacity in tokens.
#[derive(Debug)]
pub struct PrefixCache {
    capacity_blocks: usize,
    /// Hash → the tick of its last use.
    blocks: HashMap<u64, u64>,
    /// Tick → hash, oldest first.
    by_age: BTreeMap<u64, u64>,
    clock: u64,
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

    /// Stores `chain` (marked used), evicting the least recently used blocks beyond capacity.
    pub fn insert(&mut self, chain: &[u64]) {
        if !self.is_enabled() {
            return;
        }
        self.touch(chain);
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
            if let Some(old) = self.blocks.insert(*hash, tick) {
                self.by_age.remove(&old);
            }
            self.by_age.insert(tick, *hash);
        }
        self.clock = newest;
    }
}
