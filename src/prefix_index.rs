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
//! A map from block hash to slot and last use (a `HashMap<u64, (u32, u32)>` with a pass-through
//! hasher, the hashes being uniformly random already) and a `Vec` of slots
//! `{hash, prev, next, pins}` linked by index into the LRU list: no allocation per entry, and
//! both containers stop growing at the capacity (the map is rebuilt in place when evictions have
//! left it no free bucket, rather than doubled). A full index holds about 58 bytes per block:
//! 24 bytes per slot, and 16 bytes plus one control byte per map bucket with up to twice as
//! many buckets as blocks. At the default capacity, 16,384 blocks (1,048,576 tokens), that is
//! about 930 KiB per backend; an index starts empty and grows with use.
//! [`PrefixIndex::memory_bytes`] reports what the containers actually hold.
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
//! # Reach
//!
//! The index holds up to its configured capacity, but an engine's cache may keep much less. A
//! strategy that learns how much the engine keeps sets the index's *reach*
//! ([`PrefixIndex::set_reach_blocks`]): a block counts as held only while fewer than that many
//! new blocks were recorded since it was last used, its *age*. Blocks past the reach stay
//! recorded (up to the capacity) as *stale*: when the engine turns out to have held them, their
//! age says how far the reach should go. [`PrefixIndex::record`] returns what it held of the
//! prompt, with the ages, as a [`Recall`]. Ages grow with the depth in a chain (every use of a
//! block uses the blocks before it too), so the held blocks of a prompt are a prefix of it.
//! The engine may still hold some of the stale blocks: the strategy that learns how much sets
//! [`PrefixIndex::set_stale_kept`], and [`PrefixIndex::held_and_stale_blocks`] tells a prompt's
//! held blocks from its stale ones.
//!
//! The state is behind a `std::sync::Mutex`, held for one call and never across an await.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::prompt::{self, Prompt};

/// Marks the end of the LRU list.
const NIL: u32 = u32::MAX;

/// The recorded prompt blocks of one backend, least recently used evicted first.
pub struct PrefixIndex {
    /// The configured capacity: the most the index ever holds.
    capacity_blocks: usize,
    lru: Mutex<Lru>,
    /// [`PrefixIndex::stale_kept`], as `f64` bits.
    stale_kept: AtomicU64,
}

impl PrefixIndex {
    /// Tokens in one block.
    pub const TOKENS_PER_BLOCK: u64 = (prompt::BLOCK_BYTES / prompt::BYTES_PER_TOKEN) as u64;

    /// The default capacity: 1,048,576 tokens (16,384 blocks), the order of one replica's prefix
    /// cache, in about 930 KiB when full.
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
                reach: capacity_blocks as u64,
                ..Lru::default()
            }),
            stale_kept: AtomicU64::new(0.0f64.to_bits()),
        }
    }

    /// The configured capacity in blocks.
    pub fn capacity_blocks(&self) -> usize {
        self.capacity_blocks
    }

    /// The reach in blocks: a recorded block counts as held while fewer new blocks than this
    /// were recorded since its last use. The configured capacity until
    /// [`PrefixIndex::set_reach_blocks`] sizes it like the backend's cache.
    pub fn reach_blocks(&self) -> u64 {
        self.lock().reach
    }

    /// [`Self::reach_blocks`] in tokens: the prefix cache the index takes the backend to keep.
    pub fn reach_tokens(&self) -> u64 {
        self.reach_blocks().saturating_mul(Self::TOKENS_PER_BLOCK)
    }

    /// Counts a block as held only while fewer than `blocks` new blocks (at least one, at most
    /// the configured capacity) were recorded since its last use: a strategy that learned how
    /// much the backend's own cache keeps sizes the index like it. Nothing is evicted: a longer
    /// reach holds again what is still recorded.
    pub fn set_reach_blocks(&self, blocks: u64) {
        if self.capacity_blocks == 0 {
            return;
        }
        self.lock().reach = blocks.clamp(1, self.capacity_blocks as u64);
    }

    /// The share of stale blocks (recorded past the reach) the backend's cache is taken to keep
    /// still: 0 (stale blocks are gone) until a strategy that learned it from the engine's
    /// answers sets it ([`Self::set_stale_kept`]).
    pub fn stale_kept(&self) -> f64 {
        f64::from_bits(self.stale_kept.load(Ordering::Relaxed))
    }

    /// Sets [`Self::stale_kept`] to `share`, within 0 and 1.
    pub fn set_stale_kept(&self, share: f64) {
        let share = if share.is_nan() {
            0.0
        } else {
            share.clamp(0.0, 1.0)
        };
        self.stale_kept.store(share.to_bits(), Ordering::Relaxed);
    }

    /// How many leading blocks of `blocks` are held (recorded, within the reach): the longest
    /// prefix of the prompt this backend probably has cached.
    pub fn matched_blocks(&self, blocks: &[u64]) -> usize {
        if self.capacity_blocks == 0 {
            return 0;
        }
        let lru = self.lock();
        lru.prefix(blocks, |block| lru.holds(block)).0
    }

    /// How many leading blocks of `prompt` the backend holds: [`Self::matched_blocks`] of its
    /// blocks, with the chat's last answer where the index holds the prompt up to it
    /// ([`Prompt::held_blocks`]).
    pub fn held_blocks(&self, prompt: &Prompt) -> usize {
        prompt.held_blocks(self.matched_blocks(&prompt.blocks))
    }

    /// [`Self::held_blocks`] of `prompt`, and how many blocks after those are still recorded
    /// past the reach (stale, as [`Recall::stale`] counts them): what the backend probably
    /// holds of the prompt, and what it may hold beyond that.
    pub fn held_and_stale_blocks(&self, prompt: &Prompt) -> (usize, usize) {
        if self.capacity_blocks == 0 {
            return (0, 0);
        }
        let recall = self.lock().recall(&prompt.blocks);
        let recall = credited(prompt, recall);
        (recall.held, recall.stale)
    }

    /// Records `prompt`'s blocks ([`Self::record`]) and returns what the backend held of it
    /// before, the chat's last answer counted as [`Self::held_blocks`] counts it.
    pub fn record_prompt(&self, prompt: &Prompt) -> Recall {
        credited(prompt, self.record(&prompt.blocks))
    }

    /// Records that a prompt with these blocks was routed here: they become the most recently
    /// used, the first block most of all. Beyond the capacity, only the leading blocks stay.
    /// Returns what the index held of the prompt before.
    pub fn record(&self, blocks: &[u64]) -> Recall {
        if self.capacity_blocks == 0 {
            return Recall::default();
        }
        let mut lru = self.lock();
        let recall = lru.recall(blocks);
        for &hash in self.recorded_part(blocks).iter().rev() {
            let slot = lru.touch(hash);
            let pins = &mut lru.slots[slot as usize].pins;
            *pins = pins.saturating_add(1);
        }
        recall
    }

    /// Marks the recorded blocks of a prompt whose request has ended ([`Self::record`]ed when it
    /// was sent) as used now and no longer in flight, adding nothing: an engine keeps a running
    /// sequence's blocks and frees them when it ends, and its cache evicts freed blocks oldest
    /// first, so a block's age counts from the end of the last request that used it. The
    /// blocks' order of eviction is the one [`Self::record`] gives (the first block last).
    pub fn release(&self, blocks: &[u64]) {
        if self.capacity_blocks == 0 || blocks.is_empty() {
            return;
        }
        let mut lru = self.lock();
        for &hash in self.recorded_part(blocks).iter().rev() {
            if let Some(slot) = lru.refresh(hash) {
                let pins = &mut lru.slots[slot as usize].pins;
                *pins = pins.saturating_sub(1);
            }
        }
    }

    /// The leading blocks of a prompt that [`Self::record`] records (and pins) and
    /// [`Self::release`] releases: those within the capacity, as touching the blocks past it
    /// would only have them evicted by the ones before.
    fn recorded_part<'b>(&self, blocks: &'b [u64]) -> &'b [u64] {
        &blocks[..blocks.len().min(self.capacity_blocks)]
    }

    /// Forgets every block (the backend restarted or left) and frees the memory; the reach
    /// stays.
    pub fn forget(&self) {
        let mut lru = self.lock();
        let (limit, reach) = (lru.limit, lru.reach);
        *lru = Lru {
            limit,
            reach,
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
        buckets * std::mem::size_of::<(u64, Entry)>()
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

/// What an index held of a prompt when it was recorded ([`PrefixIndex::record`]). Ages are in
/// new blocks recorded since the block's last use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recall {
    /// Leading blocks held (recorded, within the reach): what the backend was expected to have
    /// cached.
    pub held: usize,
    /// The age of the deepest held block (0 when none was).
    pub held_age: u64,
    /// Blocks after those still recorded, but past the reach.
    pub stale: usize,
    /// The age of the deepest stale block (0 when none was).
    pub stale_age: u64,
}

/// `recall` of `prompt`'s blocks with the chat's last answer counted with the blocks before it
/// ([`Prompt::held_blocks`]): as held where the held part reaches it, as stale where only the
/// stale part does.
fn credited(prompt: &Prompt, recall: Recall) -> Recall {
    let held = prompt.held_blocks(recall.held);
    Recall {
        held,
        stale: prompt
            .held_blocks(recall.held + recall.stale)
            .saturating_sub(held),
        ..recall
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

/// One recorded block, its neighbours in the LRU list (`prev` toward the most recent), and the
/// requests in flight using it.
#[derive(Clone, Copy)]
struct Slot {
    hash: u64,
    prev: u32,
    next: u32,
    /// Requests recorded with this block and not yet released: the engine runs them and keeps
    /// the block whatever its age.
    pins: u32,
}

/// A recorded block's slot and the [`Lru::clock`] at its last use.
#[derive(Clone, Copy)]
struct Entry {
    slot: u32,
    touched: u32,
}

/// The LRU list: `head` is the most recently used slot, `tail` the next to be evicted.
struct Lru {
    map: HashMap<u64, Entry, BuildHasherDefault<PassThrough>>,
    slots: Vec<Slot>,
    head: u32,
    tail: u32,
    /// The blocks recorded at most.
    limit: usize,
    /// [`PrefixIndex::reach_blocks`].
    reach: u64,
    /// New blocks recorded so far, wrapping: a block's age is the clock now less its
    /// `touched`, which no recorded block's age reaches (a block is evicted by the time as many
    /// new blocks as the capacity, at most `u32::MAX`, were recorded after it).
    clock: u32,
}

impl Default for Lru {
    fn default() -> Self {
        Self {
            map: HashMap::default(),
            slots: Vec::new(),
            head: NIL,
            tail: NIL,
            limit: 0,
            reach: 0,
            clock: 0,
        }
    }
}

/// What the index knows of one recorded block.
#[derive(Clone, Copy)]
struct Recorded {
    /// New blocks recorded since its last use.
    age: u64,
    /// Whether a request in flight uses it.
    pinned: bool,
}

impl Lru {
    /// What is held of `blocks` and what is recorded past the reach after it, with the ages
    /// ([`Recall`], the blocks as they are, no answer counted).
    fn recall(&self, blocks: &[u64]) -> Recall {
        let (held, held_age) = self.prefix(blocks, |block| self.holds(block));
        let mut recall = Recall {
            held,
            held_age,
            ..Recall::default()
        };
        // What is recorded past the reach, when not every block is held.
        if held < blocks.len() {
            let (recorded, stale_age) = self.prefix(blocks, |_| true);
            if recorded > held {
                (recall.stale, recall.stale_age) = (recorded - held, stale_age);
            }
        }
        recall
    }

    /// What is known of `hash` if it is recorded.
    fn recorded(&self, hash: u64) -> Option<Recorded> {
        let entry = self.map.get(&hash)?;
        Some(Recorded {
            age: u64::from(self.clock.wrapping_sub(entry.touched)),
            pinned: self.slots[entry.slot as usize].pins > 0,
        })
    }

    /// Whether a recorded block counts as held: a request in flight uses it, or it is within
    /// the reach.
    fn holds(&self, block: Recorded) -> bool {
        block.pinned || block.age <= self.reach
    }

    /// The longest prefix of `blocks` recorded in a way that `keeps`, and the age of its
    /// deepest block (0 for none). Ages grow with the depth, and a request in flight using a
    /// block uses every block before it, so that is a binary search: one lookup when the first
    /// block fails, two when the last one passes, about log2(n) otherwise.
    fn prefix(&self, blocks: &[u64], keeps: impl Fn(Recorded) -> bool) -> (usize, u64) {
        let kept = |hash: u64| {
            self.recorded(hash)
                .filter(|&block| keeps(block))
                .map(|block| block.age)
        };
        let n = blocks.len();
        let Some(first) = blocks.first().and_then(|&hash| kept(hash)) else {
            return (0, 0);
        };
        if let Some(age) = kept(blocks[n - 1]) {
            return (n, age);
        }
        // Block 0 passes and block n - 1 does not: the first one failing is in 1..n.
        let (mut lo, mut hi, mut deepest) = (1, n - 1, first);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match kept(blocks[mid]) {
                Some(age) => (lo, deepest) = (mid + 1, age),
                None => hi = mid,
            }
        }
        // `lo` moved last past block lo - 1: `deepest` is its age (block 0's if it never moved).
        (lo, deepest)
    }

    /// Makes `hash` the most recently used block if it is recorded; returns its slot.
    fn refresh(&mut self, hash: u64) -> Option<u32> {
        let entry = self.map.get_mut(&hash)?;
        entry.touched = self.clock;
        let slot = entry.slot;
        if slot != self.head {
            self.unlink(slot);
            self.push_front(slot);
        }
        Some(slot)
    }

    /// Makes `hash` the most recently used block, evicting the least recently used one when
    /// the limit is reached; returns its slot.
    fn touch(&mut self, hash: u64) -> u32 {
        if let Some(slot) = self.refresh(hash) {
            return slot;
        }
        self.clock = self.clock.wrapping_add(1);
        let slot = if self.map.len() < self.limit {
            if self.slots.len() == self.slots.capacity() {
                // Grow by doubling, but never past the limit.
                let more = self.slots.len().max(16).min(self.limit - self.slots.len());
                self.slots.reserve_exact(more);
            }
            self.slots.push(Slot {
                hash,
                prev: NIL,
                next: NIL,
                pins: 0,
            });
            (self.slots.len() - 1) as u32
        } else {
            let slot = self.tail;
            self.unlink(slot);
            self.map.remove(&self.slots[slot as usize].hash);
            self.slots[slot as usize].hash = hash;
            self.slots[slot as usize].pins = 0;
            if self.map.len() == self.map.capacity() {
                self.rebuild_map();
            }
            slot
        };
        self.map.insert(
            hash,
            Entry {
                slot,
                touched: self.clock,
            },
        );
        self.push_front(slot);
        slot
    }

    /// Removals leave tombstones only a rehash clears, and at full load the map's own rehash
    /// would double it: it is rebuilt in place instead, at its size, from the list. Each
    /// block's last use is kept in its slot's `prev` meanwhile (the list is walked by `next`),
    /// and the links restored as the map is filled again.
    fn rebuild_map(&mut self) {
        let mut at = self.head;
        while at != NIL {
            let slot = self.slots[at as usize];
            self.slots[at as usize].prev = self.map[&slot.hash].touched;
            at = slot.next;
        }
        self.map.clear();
        let (mut at, mut prev) = (self.head, NIL);
        while at != NIL {
            let slot = self.slots[at as usize];
            let entry = Entry {
                slot: at,
                touched: slot.prev,
            };
            self.map.insert(slot.hash, entry);
            self.slots[at as usize].prev = prev;
            (prev, at) = (at, slot.next);
        }
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

    /// Records `blocks` as a request sent to the backend and ended: what the index held of
    /// them before.
    fn sent(index: &PrefixIndex, blocks: &[u64]) -> Recall {
        let recall = index.record(blocks);
        index.release(blocks);
        recall
    }

    #[test]
    fn a_prompt_in_flight_is_held_whatever_its_age_and_young_again_when_released() {
        let index = PrefixIndex::new(100 * TPB);
        index.set_reach_blocks(30);
        let (long, short) = (chain(21, 20), chain(22, 20));
        // A long answer's prompt is sent, then 40 new blocks while it runs: past the reach by
        // the age of its dispatch, but the engine runs it and holds its blocks.
        index.record(&long);
        sent(&index, &short);
        sent(&index, &chain(23, 20));
        assert_eq!(index.matched_blocks(&long), 20);
        // A second request on the same prefix, in flight too: it ends, the first still runs.
        let longer = [&long[..], &chain(26, 4)].concat();
        assert_eq!(sent(&index, &longer).held, 20);
        assert_eq!(index.matched_blocks(&long), 20);
        sent(&index, &chain(27, 40));
        assert_eq!(index.matched_blocks(&longer), 20);
        // The first ends: the engine frees its blocks now, the youngest of its cache.
        index.release(&long);
        assert_eq!(index.matched_blocks(&long), 20);
        sent(&index, &chain(28, 20));
        assert_eq!(index.matched_blocks(&long), 20);
        // Then it ages like any other block.
        sent(&index, &chain(29, 20));
        assert_eq!(index.matched_blocks(&long), 0);
        // Releasing adds no age to other blocks, and no block the index does not hold.
        let before = index.len_blocks();
        let held = index.matched_blocks(&chain(29, 20));
        let unknown = chain(24, 5);
        index.release(&unknown);
        assert_eq!(index.matched_blocks(&chain(29, 20)), held);
        assert_eq!(index.matched_blocks(&unknown), 0);
        assert_eq!(index.len_blocks(), before);
    }

    #[test]
    fn the_reach_holds_blocks_by_age_and_a_longer_reach_holds_them_again() {
        let index = PrefixIndex::new(100 * TPB);
        assert_eq!(index.reach_blocks(), 100);
        let (old, new) = (chain(11, 40), chain(12, 40));
        assert_eq!(sent(&index, &old), Recall::default());
        sent(&index, &new);
        // The older prompt ended 40 new blocks ago, the newer one just now.
        index.set_reach_blocks(30);
        assert_eq!(index.reach_blocks(), 30);
        assert_eq!(index.matched_blocks(&new), 40);
        assert_eq!(index.matched_blocks(&old), 0);
        // Sending it tells what was held, what was stale and how old; all of it is held after.
        assert_eq!(
            sent(&index, &old),
            Recall {
                held: 0,
                held_age: 0,
                stale: 40,
                stale_age: 40,
            }
        );
        assert_eq!(index.matched_blocks(&old), 40);
        // 30 new blocks: the newer prompt is 30 old, its last 10 blocks evicted at the capacity
        // (it ended before the older one was sent again).
        for seed in 100..103 {
            sent(&index, &chain(seed, 10));
        }
        assert_eq!(index.matched_blocks(&new), 30);
        // A shorter reach counts it stale; a longer one holds it again: nothing was evicted.
        index.set_reach_blocks(20);
        assert_eq!(index.matched_blocks(&new), 0);
        index.set_reach_blocks(1_000);
        assert_eq!(index.reach_blocks(), 100);
        assert_eq!(index.matched_blocks(&new), 30);
        let recall = sent(&index, &new);
        assert_eq!((recall.held, recall.held_age, recall.stale), (30, 30, 0));
        assert_eq!(index.matched_blocks(&new), 40);
        // A prompt held in part: its first blocks sent again since (young), the rest past the
        // reach. Recording it tells both, with their ages.
        let index = PrefixIndex::new(100 * TPB);
        index.set_reach_blocks(30);
        sent(&index, &old);
        sent(&index, &chain(17, 35));
        sent(&index, &old[..10]);
        assert_eq!(
            sent(&index, &old),
            Recall {
                held: 10,
                held_age: 0,
                stale: 30,
                stale_age: 35,
            }
        );
        // Sending again what was just sent adds no age: only new blocks count.
        let index = PrefixIndex::new(100 * TPB);
        sent(&index, &old);
        sent(&index, &chain(13, 5));
        assert_eq!(sent(&index, &old).held_age, 5);
        assert_eq!(sent(&index, &old).held_age, 0);
        assert_eq!(sent(&index, &chain(14, 7)).held_age, 0);
        assert_eq!(sent(&index, &old).held_age, 7);
        index.set_reach_blocks(0);
        assert_eq!(index.reach_blocks(), 1);
        index.forget();
        assert_eq!((index.len_blocks(), index.reach_blocks()), (0, 1));
        assert_eq!(index.capacity_blocks(), 100);
        // In flight, a prompt is held whatever the reach; it ages from its release.
        index.record(&old);
        sent(&index, &chain(15, 2));
        assert_eq!(index.matched_blocks(&old), 40);
        index.release(&old);
        assert_eq!(index.matched_blocks(&old), 40);
        sent(&index, &chain(16, 2));
        assert_eq!(index.matched_blocks(&old), 0);
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

    /// A chat of a 506-byte question (two blocks), then `answer` and "next" when given.
    fn turn(answer: Option<&str>) -> Prompt {
        let question = "q".repeat(506);
        let mut messages = vec![serde_json::json!({"role": "user", "content": question})];
        if let Some(answer) = answer {
            messages.push(serde_json::json!({"role": "assistant", "content": answer}));
            messages.push(serde_json::json!({"role": "user", "content": "next"}));
        }
        let body = serde_json::json!({"messages": messages}).to_string();
        Prompt::of_body(body.as_bytes()).unwrap()
    }

    #[test]
    fn the_lookup_tells_the_held_blocks_from_the_stale_ones_as_recording_does() {
        let index = PrefixIndex::new(100 * TPB);
        index.set_reach_blocks(30);
        let (turn1, turn2) = (turn(None), turn(Some(&"a".repeat(501))));
        let prompt = |blocks: &[u64]| Prompt {
            blocks: blocks.into(),
            ..turn1.clone()
        };
        let a = chain(44, 10);
        assert_eq!(index.held_and_stale_blocks(&prompt(&a)), (0, 0));
        // Ten blocks recorded, then 35 newer ones: the first five are within the reach again
        // (a second prompt used them), the last five past it.
        sent(&index, &a);
        sent(&index, &chain(45, 35));
        sent(&index, &a[..5]);
        assert_eq!(index.held_and_stale_blocks(&prompt(&a)), (5, 5));
        assert_eq!(index.held_and_stale_blocks(&prompt(&a[..5])), (5, 0));
        let recall = index.record(&a);
        assert_eq!((recall.held, recall.stale), (5, 5));
        assert_eq!(index.held_and_stale_blocks(&prompt(&a)), (10, 0));
        // A chat's last answer counts as held with the question before it, as recording counts.
        sent(&index, &turn2.blocks);
        sent(&index, &chain(46, 35));
        sent(&index, &turn1.blocks);
        let looked = index.held_and_stale_blocks(&turn2);
        let recall = index.record_prompt(&turn2);
        assert_eq!(looked, (recall.held, recall.stale));
        assert_eq!(looked, (4, 0));
        // The question alone recorded, now past the reach: the answer is stale with it.
        let index = PrefixIndex::new(100 * TPB);
        index.set_reach_blocks(30);
        sent(&index, &turn1.blocks);
        sent(&index, &chain(47, 35));
        let looked = index.held_and_stale_blocks(&turn2);
        let recall = index.record_prompt(&turn2);
        assert_eq!(looked, (recall.held, recall.stale));
        assert_eq!(looked, (0, 4));
    }

    #[test]
    fn a_chats_last_answer_is_held_where_the_turn_that_wrote_it_ran() {
        let (turn1, turn2) = (turn(None), turn(Some(&"a".repeat(501))));
        assert_eq!((turn1.blocks.len(), turn2.answer), (2, Some((2, 4))));
        let ran_it = PrefixIndex::new(100 * TPB);
        sent(&ran_it, &turn1.blocks);
        sent(&ran_it, &chain(40, 3));
        // The index recorded the question only; the engine cached the answer with it.
        assert_eq!(ran_it.matched_blocks(&turn2.blocks), 2);
        assert_eq!(ran_it.held_blocks(&turn2), 4);
        let recall = ran_it.record_prompt(&turn2);
        assert_eq!((recall.held, recall.held_age, recall.stale), (4, 3, 0));
        // Another backend saw none of the chat.
        let other = PrefixIndex::new(100 * TPB);
        sent(&other, &chain(41, 3));
        assert_eq!(other.held_blocks(&turn2), 0);
        assert_eq!(other.record_prompt(&turn2), Recall::default());
        // The whole turn recorded, then its answer's blocks past the reach while the question's
        // are young again: the stale answer blocks count as held.
        let index = PrefixIndex::new(100 * TPB);
        index.set_reach_blocks(30);
        sent(&index, &turn2.blocks);
        sent(&index, &chain(42, 35));
        sent(&index, &turn1.blocks);
        let before = index.record(&turn2.blocks);
        index.release(&turn2.blocks);
        assert_eq!((before.held, before.stale), (2, 2));
        sent(&index, &chain(43, 35));
        sent(&index, &turn1.blocks);
        let recall = index.record_prompt(&turn2);
        assert_eq!((recall.held, recall.stale), (4, 0));
    }
}
