//! An approximate prefix index, one per backend: the prompt blocks (see [`crate::prompt`]) last
//! routed to a backend, kept least-recently-used within a capacity sized like one replica's
//! prefix cache, so a router can tell how much of a new prompt a backend probably has cached.
//!
//! It is approximate on purpose: it records what was sent, not what the engine kept, and it
//! evicts by its own LRU, not the engine's. A block is a [`prompt::BLOCK_BYTES`] piece of prompt
//! text, [`PrefixIndex::TOKENS_PER_BLOCK`] tokens.
//!
//! # Layout and memory
//!
//! A map from block hash to slot (a `HashMap<u64, u32>` with a pass-through hasher, the hashes
//! being uniformly random already) and a `Vec` of slots `{hash, prev, next}` linked by index into
//! the LRU list: no allocation per entry, and both containers stop growing at the capacity (the
//! map is rebuilt in place when evictions have left it no free bucket, rather than doubled). A
//! full index holds about 50 bytes per block: 16 bytes per slot, and 16 bytes plus one control
//! byte per map bucket with up to twice as many buckets as blocks. At the default capacity,
//! 16,384 blocks (1,048,576 tokens), that is about 800 KiB per backend; an index starts empty and
//! grows with use. [`PrefixIndex::memory_bytes`] reports what the containers actually hold.
//!
//! # Matching
//!
//! [`PrefixIndex::record`] touches a prompt's blocks last to first, so its first blocks are the
//! most recently used and evicted last, as an engine frees a sequence's blocks tail first. Since
//! a block's hash names its whole prefix, every touch of block `i` also touches blocks `0..i`
//! after it: the recorded blocks of any chain are always a prefix of it (barring hash
//! collisions). [`PrefixIndex::matched_blocks`] therefore finds the longest cached prefix with a
//! binary search: one lookup when the first block is missing (a backend that never saw the
//! prompt), two when the whole chain is there, about log2(n) otherwise.
//!
//! The state is behind a `std::sync::Mutex`, held for one call and never across an await.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Mutex, MutexGuard};

use crate::prompt;

/// Marks the end of the LRU list.
const NIL: u32 = u32::MAX;

/// The recorded prompt blocks of one backend, least recently used evicted first.
pub struct PrefixIndex {
    /// The configured capacity: the most the index ever holds.
    capacity_blocks: usize,
    lru: Mutex<Lru>,
}

impl PrefixIndex {
    /// Tokens in one block.
    pub const TOKENS_PER_BLOCK: u64 = (prompt::BLOCK_BYTES / prompt::BYTES_PER_TOKEN) as u64;

    /// The default capacity: 1,048,576 tokens (16,384 blocks), the order of one replica's prefix
    /// cache, in about 800 KiB when full.
    pub const DEFAULT_CAPACITY_TOKENS: u64 = 1 << 20;

    /// An index of `capacity_tokens` tokens, rounded up to whole blocks; 0 disables it (it
    /// records nothing and matches nothing).
    pub fn new(capacity_tokens: u64) -> Self {
        let blocks = capacity_tokens.div_ceil(Self::TOKENS_PER_BLOCK);
        let capacity_blocks = usize::try_from(blocks)
            .unwrap_or(usize::MAX)
            .min(NIL as usize);
        Self {
            capacity_blocks,
            lru: Mutex::new(Lru {
                limit: capacity_blocks,
                ..Lru::default()
            }),
        }
    }

    /// The configured capacity in blocks.
    pub fn capacity_blocks(&self) -> usize {
        self.capacity_blocks
    }

    /// The blocks it holds at most now: the configured capacity, or less once
    /// [`PrefixIndex::set_limit_blocks`] sized it like the backend's cache.
    pub fn limit_blocks(&self) -> usize {
        self.lock().limit
    }

    /// Holds at most `blocks` from now on (at least one, at most the configured capacity),
    /// evicting the least recently used at once when it holds more: a strategy that learned how
    /// much the backend's own cache keeps sizes the index like it. A larger limit keeps more from
    /// now on (what was evicted is not recovered).
    pub fn set_limit_blocks(&self, blocks: usize) {
        if self.capacity_blocks == 0 {
            return;
        }
        let limit = blocks.clamp(1, self.capacity_blocks);
        let mut lru = self.lock();
        lru.limit = limit;
        while lru.map.len() > limit {
            lru.evict_tail();
        }
    }

    /// How many leading blocks of `blocks` are recorded and not evicted: the longest prefix of
    /// the prompt this backend probably has cached.
    pub fn matched_blocks(&self, blocks: &[u64]) -> usize {
        let n = blocks.len();
        if n == 0 || self.capacity_blocks == 0 {
            return 0;
        }
        let lru = self.lock();
        if !lru.map.contains_key(&blocks[0]) {
            return 0;
        }
        if lru.map.contains_key(&blocks[n - 1]) {
            return n;
        }
        // Block 0 is present and block n - 1 is not: the first missing block is in 1..n.
        let (mut lo, mut hi) = (1, n - 1);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if lru.map.contains_key(&blocks[mid]) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Records that a prompt with these blocks was routed here: they become the most recently
    /// used, the first block most of all. Beyond the capacity, only the leading blocks stay.
    pub fn record(&self, blocks: &[u64]) {
        if self.capacity_blocks == 0 {
            return;
        }
        let mut lru = self.lock();
        // Touching the blocks past the limit would only have them evicted by the ones before.
        let blocks = &blocks[..blocks.len().min(lru.limit)];
        for &hash in blocks.iter().rev() {
            lru.touch(hash);
        }
    }

    /// Forgets every block (the backend restarted or left) and frees the memory; the limit
    /// stays.
    pub fn forget(&self) {
        let mut lru = self.lock();
        let limit = lru.limit;
        *lru = Lru {
            limit,
            ..Lru::default()
        };
    }

    /// Blocks recorded now.
    pub fn len_blocks(&self) -> usize {
        self.lock().map.len()
    }

    /// The heap the index holds, from the capacities of its containers.
    pub fn memory_bytes(&self) -> usize {
        let lru = self.lock();
        // The map's buckets: a power of two, 7/8 of them usable from 8 buckets on. Its reported
        // capacity leaves out buckets that removals left unusable, hence the rounding up.
        let buckets = match lru.map.capacity() {
            0 => 0,
            1..4 => 4,
            4..8 => 8,
            capacity => (capacity * 8).div_ceil(7).next_power_of_two(),
        };
        let control = if buckets == 0 { 0 } else { buckets + 16 };
        buckets * std::mem::size_of::<(u64, u32)>()
            + control
            + lru.slots.capacity() * std::mem::size_of::<Slot>()
    }

    fn lock(&self) -> MutexGuard<'_, Lru> {
        self.lru
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new(Self::DEFAULT_CAPACITY_TOKENS)
    }
}

impl std::fmt::Debug for PrefixIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixIndex")
            .field("capacity_blocks", &self.capacity_blocks)
            .field("len_blocks", &self.len_blocks())
            .finish()
    }
}

/// Hashes a `u64` to itself: block hashes are uniformly random already.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

/// One recorded block and its neighbours in the LRU list (`prev` toward the most recent).
#[derive(Clone, Copy)]
struct Slot {
    hash: u64,
    prev: u32,
    next: u32,
}

/// The LRU list: `head` is the most recently used slot, `tail` the next to be evicted.
struct Lru {
    map: HashMap<u64, u32, BuildHasherDefault<PassThrough>>,
    slots: Vec<Slot>,
    /// Slots a lowered limit emptied, used again before the list grows.
    free: Vec<u32>,
    head: u32,
    tail: u32,
    /// The blocks held at most.
    limit: usize,
}

impl Default for Lru {
    fn default() -> Self {
        Self {
            map: HashMap::default(),
            slots: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            limit: 0,
        }
    }
}

impl Lru {
    /// Removes the least recently used block; its slot becomes free.
    fn evict_tail(&mut self) {
        let slot = self.tail;
        if slot == NIL {
            return;
        }
        self.unlink(slot);
        self.map.remove(&self.slots[slot as usize].hash);
        self.free.push(slot);
    }

    /// Makes `hash` the most recently used block, evicting the least recently used one when
    /// the limit is reached.
    fn touch(&mut self, hash: u64) {
        if let Some(&slot) = self.map.get(&hash) {
            if slot != self.head {
                self.unlink(slot);
                self.push_front(slot);
            }
            return;
        }
        let slot = if self.map.len() < self.limit {
            if let Some(slot) = self.free.pop() {
                self.slots[slot as usize].hash = hash;
                slot
            } else {
                if self.slots.len() == self.slots.capacity() {
                    // Grow by doubling, but never past the limit.
                    let more = self.slots.len().max(16).min(self.limit - self.slots.len());
                    self.slots.reserve_exact(more);
                }
                self.slots.push(Slot {
                    hash,
                    prev: NIL,
                    next: NIL,
                });
                (self.slots.len() - 1) as u32
            }
        } else {
            let slot = self.tail;
            self.unlink(slot);
            self.map.remove(&self.slots[slot as usize].hash);
            self.slots[slot as usize].hash = hash;
            if self.map.len() == self.map.capacity() {
                // Removals leave tombstones only a rehash clears, and at this load the map's
                // own rehash would double it: it is rebuilt in place instead, at its size.
                // The blocks are those on the list (a lowered limit leaves free slots behind).
                self.map.clear();
                let mut at = self.head;
                while at != NIL {
                    let slot = self.slots[at as usize];
                    self.map.insert(slot.hash, at);
                    at = slot.next;
                }
            }
            slot
        };
        self.map.insert(hash, slot);
        self.push_front(slot);
    }

    fn unlink(&mut self, slot: u32) {
        let Slot { prev, next, .. } = self.slots[slot as usize];
        match prev {
            NIL => self.head = next,
            p => self.slots[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.slots[n as usize].prev = prev,
        }
    }

    fn push_front(&mut self, slot: u32) {
        let old = self.head;
        self.slots[slot as usize].prev = NIL;
        self.slots[slot as usize].next = old;
        match old {
            NIL => self.tail = slot,
            o => self.slots[o as usize].prev = slot,
        }
        self.head = slot;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TPB: u64 = PrefixIndex::TOKENS_PER_BLOCK;

    /// A chain of `n` distinct hashes starting from `seed`.
    fn chain(seed: u64, n: usize) -> Vec<u64> {
        let mut rng = fastrand::Rng::with_seed(seed);
        (0..n).map(|_| rng.u64(..)).collect()
    }

    #[test]
    fn prefix_index_matches_the_recorded_prefix() {
        let index = PrefixIndex::new(1000 * TPB);
        let a = chain(1, 10);
        assert_eq!(index.matched_blocks(&a), 0);
        index.record(&a[..6]);
        assert_eq!(index.matched_blocks(&a), 6);
        assert_eq!(index.matched_blocks(&a[..6]), 6);
        assert_eq!(index.matched_blocks(&a[..3]), 3);
        assert_eq!(index.matched_blocks(&[]), 0);
        assert_eq!(index.matched_blocks(&chain(2, 10)), 0);
        // A prompt that shares the first 4 blocks and then differs.
        let mut b = a[..4].to_vec();
        b.extend(chain(3, 5));
        assert_eq!(index.matched_blocks(&b), 4);
        assert_eq!(index.len_blocks(), 6);
        // Recording again adds nothing.
        index.record(&a[..6]);
        assert_eq!(index.len_blocks(), 6);
        for n in 1..=10 {
            let index = PrefixIndex::new(1000 * TPB);
            index.record(&a[..n]);
            assert_eq!(index.matched_blocks(&a), n);
        }
    }

    #[test]
    fn prefix_index_evicts_least_recently_used_first() {
        let index = PrefixIndex::new(3 * TPB);
        assert_eq!(index.capacity_blocks(), 3);
        let [a, b, c, d] = [[1], [2], [3], [4]];
        index.record(&a);
        index.record(&b);
        index.record(&c);
        index.record(&a); // a is now the most recent: b is next out
        index.record(&d);
        assert_eq!(index.matched_blocks(&b), 0);
        assert_eq!(index.matched_blocks(&a), 1);
        assert_eq!(index.matched_blocks(&c), 1);
        assert_eq!(index.matched_blocks(&d), 1);
        assert_eq!(index.len_blocks(), 3);
    }

    #[test]
    fn prefix_index_evicts_a_prompt_tail_first() {
        let index = PrefixIndex::new(4 * TPB);
        let p = chain(4, 4);
        index.record(&p);
        assert_eq!(index.matched_blocks(&p), 4);
        index.record(&chain(5, 1));
        assert_eq!(index.matched_blocks(&p), 3);
        index.record(&chain(6, 2));
        assert_eq!(index.matched_blocks(&p), 1);
        index.record(&chain(7, 1));
        assert_eq!(index.matched_blocks(&p), 0);
    }

    #[test]
    fn prefix_index_keeps_the_leading_blocks_of_an_oversized_prompt() {
        let index = PrefixIndex::new(5 * TPB);
        let other = chain(8, 2);
        index.record(&other);
        let p = chain(9, 12);
        index.record(&p);
        assert_eq!(index.len_blocks(), 5);
        assert_eq!(index.matched_blocks(&p), 5);
        assert_eq!(index.matched_blocks(&other), 0);
    }

    #[test]
    fn prefix_index_never_holds_more_than_its_capacity() {
        // 1000 tokens round up to 16 blocks.
        let index = PrefixIndex::new(1000);
        assert_eq!(index.capacity_blocks(), 16);
        let mut rng = fastrand::Rng::with_seed(10);
        let mut recent = Vec::new();
        for round in 0..500 {
            let p = chain(round, rng.usize(1..12));
            index.record(&p);
            assert!(index.len_blocks() <= 16);
            assert_eq!(index.matched_blocks(&p), p.len());
            recent = p;
        }
        assert_eq!(index.len_blocks(), 16);
        assert_eq!(index.matched_blocks(&recent), recent.len());
    }

    #[test]
    fn prefix_index_after_partial_eviction_matches_what_is_left() {
        let index = PrefixIndex::new(20 * TPB);
        let system = chain(11, 8);
        let with = |tail_seed| {
            let mut p = system.clone();
            p.extend(chain(tail_seed, 6));
            p
        };
        let alice = with(12);
        let bob = with(13);
        index.record(&alice); // 14 blocks
        index.record(&bob); // 6 more: 20, full
        assert_eq!(index.matched_blocks(&alice), 14);
        // 3 new blocks evict alice's last 3 (bob's refreshed the shared 8 after alice's tail).
        index.record(&chain(14, 3));
        assert_eq!(index.matched_blocks(&alice), 11);
        assert_eq!(index.matched_blocks(&bob), 14);
        index.record(&chain(15, 6));
        assert_eq!(index.matched_blocks(&alice), 8);
        assert_eq!(index.matched_blocks(&bob), 11);
    }

    #[test]
    fn a_lowered_limit_evicts_the_least_recently_used_and_a_raised_one_keeps_more() {
        let index = PrefixIndex::new(100 * TPB);
        let (old, new) = (chain(11, 40), chain(12, 40));
        index.record(&old);
        index.record(&new);
        assert_eq!(index.len_blocks(), 80);
        index.set_limit_blocks(50);
        assert_eq!((index.limit_blocks(), index.len_blocks()), (50, 50));
        // The older prompt's tail went first; the newer prompt is whole.
        assert_eq!(index.matched_blocks(&new), 40);
        assert_eq!(index.matched_blocks(&old), 10);
        // Recording past the limit evicts, and the freed slots are used again.
        let third = chain(13, 30);
        index.record(&third);
        assert_eq!(index.len_blocks(), 50);
        assert_eq!(index.matched_blocks(&third), 30);
        assert_eq!(index.matched_blocks(&new), 20);
        // Many more prompts through the lowered index: it never holds more than its limit and
        // still matches what it holds.
        for seed in 100..160 {
            index.record(&chain(seed, 17));
            assert!(index.len_blocks() <= 50);
        }
        assert_eq!(index.matched_blocks(&chain(159, 17)), 17);
        // A raised limit is bounded by the configured capacity, and keeps more from now on.
        index.set_limit_blocks(1_000);
        assert_eq!(index.limit_blocks(), 100);
        for seed in 200..205 {
            index.record(&chain(seed, 20));
        }
        assert_eq!(index.len_blocks(), 100);
        assert_eq!(index.matched_blocks(&chain(200, 20)), 20);
        index.forget();
        assert_eq!((index.len_blocks(), index.limit_blocks()), (0, 100));
    }

    #[test]
    fn prefix_index_disabled_records_and_matches_nothing() {
        let index = PrefixIndex::new(0);
        let p = chain(16, 5);
        index.record(&p);
        assert_eq!(index.matched_blocks(&p), 0);
        assert_eq!(index.len_blocks(), 0);
        assert_eq!(index.memory_bytes(), 0);
    }

    #[test]
    fn prefix_index_forget_clears_and_frees() {
        let index = PrefixIndex::new(100 * TPB);
        let p = chain(17, 50);
        index.record(&p);
        assert!(index.memory_bytes() > 50 * 16);
        index.forget();
        assert_eq!(index.len_blocks(), 0);
        assert_eq!(index.matched_blocks(&p), 0);
        assert_eq!(index.memory_bytes(), 0);
        index.record(&p);
        assert_eq!(index.matched_blocks(&p), 50);
    }

    #[test]
    fn prefix_index_full_at_default_capacity_stays_under_1_mib() {
        let index = PrefixIndex::default();
        let capacity = index.capacity_blocks();
        assert_eq!(capacity as u64, PrefixIndex::DEFAULT_CAPACITY_TOKENS / TPB);
        for round in 0..(capacity / 400 + 10) as u64 {
            index.record(&chain(round, 400));
        }
        assert_eq!(index.len_blocks(), capacity);
        let bytes = index.memory_bytes();
        assert!(bytes <= 1 << 20, "{bytes} bytes");
        assert!(bytes >= capacity * 32, "{bytes} bytes");
        eprintln!("{bytes} bytes for {capacity} blocks");
    }
}
