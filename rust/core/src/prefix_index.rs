//! The prefix index: the hash each physical block carries, and the blocks that carry each hash
//! (a multiset: hash → blocks).
//!
//! Several physical blocks may hold the same content (two sequences prefilled the same prefix
//! before either was cached, or a swapped-in copy of a still-cached block), so one hash can map
//! to several blocks; a block carries at most one hash. Peer: vLLM V1 `BlockHashToBlockMap` in
//! `block_pool.py` (hash → {block_id: block}) plus the per-block `block_hash` field.
//!
//! Layout, chosen for the scheduler's hot path (one insert per filled block, one removal per
//! eviction, one lookup per prompt block):
//! - `hash_of[block]`: the 32-byte hash per block id (the keys live here, once).
//! - `fp_of[block]`: its fingerprint (4 bytes), so a removal starts probing without waiting
//!   for the 32-byte hash to load.
//! - `slots`: an open-addressed table with linear probing whose 8-byte slots pack a 32-bit
//!   fingerprint of the hash and `block + 1` (0 = empty). It has a power-of-two number of slots,
//!   at least twice the number of blocks, and a block carries at most one hash, so the load
//!   factor never exceeds 1/2: the table never grows or rehashes (no pause inside a step), and
//!   at 16 bytes per block it costs about a third of a general hash map holding the 32-byte keys.
//!   Removal is backward-shift deletion (Knuth, TAOCP vol. 3, §6.4, Algorithm R), so there are
//!   no tombstones and probe runs stay as short as a fresh table's.
//! - A probe compares fingerprints first and reads `hash_of` only on a fingerprint match, which
//!   for two different hashes happens with probability 2^-32 per compared slot.
//!
//! Fingerprint and home slot come from one keyed hash (foldhash, seeded randomly per process) of
//! the first 16 bytes of the block hash. Keys can be steered by clients through their token ids,
//! so a client must not be able to pile its blocks into one probe run (hash flooding): with the
//! seed unknown, it cannot aim at a slot. Two block hashes always share a home slot if their
//! first 16 bytes agree; for SHA-256 finding many such inputs is as hard as a 128-bit
//! multi-collision, and for xxh3-128 those 16 bytes are the whole digest, so such inputs would
//! already collide in the prefix cache itself (the documented risk of opting into xxh3).
//!
//! Not synchronised: the pool keeps it behind its mutex.

use crate::hashing::BlockHash;
use crate::BlockId;
use std::hash::BuildHasher;

/// An empty slot. Occupied slots store `block + 1` in their low half, so they are never 0.
const EMPTY: u64 = 0;

/// Map from block id to the [`BlockHash`] it carries, and multiset map from hash to block ids.
///
/// Invariants: a block carries at most one hash; a (hash, block) pair appears at most once;
/// every block that carries a hash has exactly one slot, reachable from its hash's home slot
/// without crossing an empty slot. Lookups and updates are O(1) expected plus O(k) in the
/// number k of blocks sharing one hash (almost always 1). Block ids must be below the
/// `num_blocks` given to [`PrefixIndex::new`] (the pool validates ids before calling; an id out
/// of range panics).
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    /// Per block id: the hash it carries (meaningful where `carries[id]`).
    hash_of: Vec<[u8; 32]>,
    /// Per block id: whether it carries a hash.
    carries: Vec<bool>,
    /// Per block id: the fingerprint of the hash it carries (meaningful where `carries[id]`).
    /// A removal reads it from this small array to start its probe at once, while the
    /// 32-byte hash (a likely cache miss in a pool-sized array) is still being loaded.
    fp_of: Vec<u32>,
    /// `fingerprint << 32 | (block + 1)`, or [`EMPTY`]. The home slot of a hash is
    /// `fingerprint & mask`.
    slots: Vec<u64>,
    mask: usize,
    /// (hash, block) pairs.
    entries: usize,
    /// Distinct hashes.
    distinct: usize,
    keyed: foldhash::fast::RandomState,
}

impl Default for PrefixIndex {
    /// An index for block ids `0..1`; see [`PrefixIndex::new`].
    fn default() -> Self {
        Self::new(1)
    }
}

impl PrefixIndex {
    /// An empty index for block ids `0..num_blocks`. Memory: 37 bytes per block plus 16 per
    /// block of slots (rounded up to a power of two). Every page is touched here, once: zeroed
    /// memory from the OS is mapped lazily, and a fresh page faulted in by the first hash stored
    /// on it would otherwise cost a page fault inside a scheduler step. O(num_blocks).
    pub fn new(num_blocks: u32) -> Self {
        let n = num_blocks as usize;
        let slots = (2 * n).next_power_of_two().max(8);
        let mut index = Self {
            hash_of: vec![[0u8; 32]; n],
            carries: vec![false; n],
            fp_of: vec![0; n],
            slots: vec![EMPTY; slots],
            mask: slots - 1,
            entries: 0,
            distinct: 0,
            keyed: foldhash::fast::RandomState::default(),
        };
        prefault(&mut index.hash_of);
        prefault(&mut index.carries);
        prefault(&mut index.fp_of);
        prefault(&mut index.slots);
        index
    }

    /// The 32-bit fingerprint of `hash` (its home slot is `fingerprint & mask`).
    #[inline]
    fn fingerprint(&self, hash: &BlockHash) -> u32 {
        let mut lo = [0u8; 16];
        lo.copy_from_slice(&hash.0[..16]);
        (self.keyed.hash_one(u128::from_le_bytes(lo)) >> 32) as u32
    }

    #[inline]
    fn slot_fingerprint(slot: u64) -> u32 {
        (slot >> 32) as u32
    }

    #[inline]
    fn slot_block(slot: u64) -> BlockId {
        (slot as u32).wrapping_sub(1)
    }

    /// The hash `block` carries, if any. O(1).
    #[inline]
    pub fn hash_of(&self, block: BlockId) -> Option<BlockHash> {
        self.carries(block)
            .then(|| BlockHash(self.hash_of[block as usize]))
    }

    /// Whether `block` carries a hash. O(1).
    #[inline]
    pub fn carries(&self, block: BlockId) -> bool {
        self.carries.get(block as usize).copied().unwrap_or(false)
    }

    /// Whether the block held in `slot` carries `hash`, given the hash's fingerprint.
    #[inline]
    fn slot_holds(&self, slot: u64, fp: u32, hash: &BlockHash) -> bool {
        Self::slot_fingerprint(slot) == fp
            && self.hash_of[Self::slot_block(slot) as usize] == hash.0
    }

    /// Starts loading the home slot of the hash `block` carries, if any: a hint with no effect
    /// on results. The pool's eviction loop calls it for the next LRU block, so that block's
    /// [`PrefixIndex::remove`] finds its probe's first slot (a random line of a pool-sized
    /// table) in cache. O(1).
    #[inline]
    pub fn prefetch_remove(&self, block: BlockId) {
        let b = block as usize;
        if self.carries(block) {
            prefetch(&self.slots[self.fp_of[b] as usize & self.mask]);
        }
    }

    /// Starts loading the home slot of `hash`: a hint with no effect on results, for the next
    /// [`PrefixIndex::insert`] of a batch. O(1).
    #[inline]
    pub fn prefetch_insert(&self, hash: &BlockHash) {
        prefetch(&self.slots[self.fingerprint(hash) as usize & self.mask]);
    }

    /// Gives `block` the hash `hash`. Returns `None` (and changes nothing) if the block already
    /// carries a hash (its first hash stays), else `Some(first)` where `first` tells whether no
    /// other block carried `hash` before (it just became resolvable). O(1) expected.
    pub fn insert(&mut self, block: BlockId, hash: BlockHash) -> Option<bool> {
        let b = block as usize;
        if self.carries[b] {
            return None;
        }
        let fp = self.fingerprint(&hash);
        let mut i = fp as usize & self.mask;
        let mut first = true;
        loop {
            let slot = self.slots[i];
            if slot == EMPTY {
                break;
            }
            if first && self.slot_holds(slot, fp, &hash) {
                first = false;
            }
            i = (i + 1) & self.mask;
        }
        // Appending at the end of the run keeps the holders of one hash in insertion order.
        self.slots[i] = (u64::from(fp) << 32) | u64::from(block + 1);
        self.hash_of[b] = hash.0;
        self.fp_of[b] = fp;
        self.carries[b] = true;
        self.entries += 1;
        self.distinct += usize::from(first);
        Some(first)
    }

    /// Drops the hash `block` carries. Returns `None` if it carried none, else `Some((hash,
    /// last))` where `last` tells whether no other block carries `hash` now (it no longer
    /// resolves). O(1) expected.
    pub fn remove(&mut self, block: BlockId) -> Option<(BlockHash, bool)> {
        let b = block as usize;
        if !self.carries(block) {
            return None;
        }
        let fp = self.fp_of[b];
        let hash = BlockHash(self.hash_of[b]);
        let own = (u64::from(fp) << 32) | u64::from(block + 1);
        // Walk the whole run from the home slot: find our slot and any other holder of `hash`.
        let mut i = fp as usize & self.mask;
        let mut at = None;
        let mut others = false;
        loop {
            let slot = self.slots[i];
            if slot == EMPTY {
                break;
            }
            if slot == own {
                at = Some(i);
            } else if !others && self.slot_holds(slot, fp, &hash) {
                others = true;
            }
            i = (i + 1) & self.mask;
        }
        let hole = at.expect("a block carrying a hash has a slot in its probe run");
        self.delete_slot(hole);
        self.carries[b] = false;
        self.entries -= 1;
        self.distinct -= usize::from(!others);
        Some((hash, !others))
    }

    /// Backward-shift deletion of slot `hole`: each later slot of the run whose home is not
    /// between the hole and itself moves into the hole, which moves on to its place.
    fn delete_slot(&mut self, mut hole: usize) {
        let mask = self.mask;
        let mut j = (hole + 1) & mask;
        loop {
            let slot = self.slots[j];
            if slot == EMPTY {
                break;
            }
            let home = Self::slot_fingerprint(slot) as usize & mask;
            // The entry may move back iff the hole lies in [home, j) (cyclically).
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = slot;
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.slots[hole] = EMPTY;
    }

    /// The blocks carrying `hash`, in the order they got it (the oldest first). O(1) expected.
    pub fn holders<'a>(&'a self, hash: &'a BlockHash) -> impl Iterator<Item = BlockId> + 'a {
        let fp = self.fingerprint(hash);
        let mut i = fp as usize & self.mask;
        std::iter::from_fn(move || loop {
            let slot = self.slots[i];
            if slot == EMPTY {
                return None;
            }
            i = (i + 1) & self.mask;
            if self.slot_holds(slot, fp, hash) {
                return Some(Self::slot_block(slot));
            }
        })
    }

    /// The first block carrying `hash` for which `prefer` holds, else the first (oldest) block
    /// carrying it; `None` if no block carries it. O(1) expected.
    pub fn find(&self, hash: &BlockHash, prefer: impl Fn(BlockId) -> bool) -> Option<BlockId> {
        let mut first = None;
        for b in self.holders(hash) {
            if prefer(b) {
                return Some(b);
            }
            first = first.or(Some(b));
        }
        first
    }

    /// Whether `block` carries `hash`. O(1).
    pub fn contains(&self, hash: &BlockHash, block: BlockId) -> bool {
        self.hash_of(block) == Some(*hash)
    }

    /// Number of (hash, block) pairs: blocks carrying a hash.
    pub fn len(&self) -> usize {
        self.entries
    }

    /// Whether no block carries a hash.
    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Number of distinct hashes.
    pub fn num_hashes(&self) -> usize {
        self.distinct
    }

    /// Drops every hash. O(num_blocks).
    pub fn clear(&mut self) {
        self.slots.fill(EMPTY);
        self.carries.fill(false);
        self.entries = 0;
        self.distinct = 0;
    }

    /// Iterates over all (hash, block) pairs in block-id order (for invariant checks).
    /// O(num_blocks).
    pub fn iter(&self) -> impl Iterator<Item = (BlockHash, BlockId)> + '_ {
        self.carries
            .iter()
            .enumerate()
            .filter(|(_, &c)| c)
            .map(|(b, _)| (BlockHash(self.hash_of[b]), b as BlockId))
    }

    /// Checks the table against the per-block hashes: every occupied slot holds a block that
    /// carries a hash with that fingerprint and is reachable from its home slot; every such
    /// block has exactly one slot; the pair and distinct-hash counts are right. Returns a
    /// message naming the first violation. O(slots).
    pub fn check(&self) -> std::result::Result<(), String> {
        let mask = self.mask;
        let mut seen = vec![false; self.carries.len()];
        let mut distinct = 0;
        for (i, &slot) in self.slots.iter().enumerate() {
            if slot == EMPTY {
                continue;
            }
            let b = Self::slot_block(slot) as usize;
            if b >= self.carries.len() || !self.carries[b] {
                return Err(format!(
                    "index slot {i} holds block {b}, which carries no hash"
                ));
            }
            if std::mem::replace(&mut seen[b], true) {
                return Err(format!("block {b} has two index slots"));
            }
            let hash = BlockHash(self.hash_of[b]);
            let fp = self.fingerprint(&hash);
            if Self::slot_fingerprint(slot) != fp {
                return Err(format!(
                    "index slot {i}: fingerprint does not match block {b}'s hash"
                ));
            }
            if self.fp_of[b] != fp {
                return Err(format!(
                    "block {b}'s kept fingerprint does not match its hash"
                ));
            }
            // Reachable: no empty slot between the home slot and this one; the first holder of
            // a hash along that path counts it as distinct.
            let mut j = fp as usize & mask;
            let mut earlier_holder = false;
            while j != i {
                let s = self.slots[j];
                if s == EMPTY {
                    return Err(format!("block {b} is not reachable from its home slot"));
                }
                earlier_holder |= self.slot_holds(s, fp, &hash);
                j = (j + 1) & mask;
            }
            distinct += usize::from(!earlier_holder);
        }
        let carried = self.carries.iter().filter(|&&c| c).count();
        let slotted = seen.iter().filter(|&&s| s).count();
        if carried != slotted || carried != self.entries {
            return Err(format!(
                "{carried} blocks carry a hash, {slotted} have a slot, the count says {}",
                self.entries
            ));
        }
        if distinct != self.distinct {
            return Err(format!(
                "{distinct} distinct hashes in the table, the count says {}",
                self.distinct
            ));
        }
        Ok(())
    }
}

/// Asks the CPU to start loading the cache line of `r` (x86-64 `prefetcht0`; nothing elsewhere).
#[inline(always)]
fn prefetch<T>(r: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults; `r` is a valid reference anyway.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((r as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = r;
}

/// Writes one zero byte per 4 KiB page of `v` (already all zero), so the OS maps every page
/// now. Volatile: the compiler knows the allocation is zeroed and would drop plain writes.
fn prefault<T: Copy>(v: &mut [T]) {
    let bytes = std::mem::size_of_val(v);
    let base = v.as_mut_ptr().cast::<u8>();
    for off in (0..bytes).step_by(4096) {
        // SAFETY: `off < bytes`, so the byte is inside `v`'s allocation; `T: Copy` has no
        // drop glue, and the byte already is 0 (every element is zero-initialised), so
        // rewriting 0 leaves every element's value unchanged.
        unsafe { base.add(off).write_volatile(0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(b: u8) -> BlockHash {
        BlockHash([b; 32])
    }

    #[test]
    fn multiset_insert_remove_counts() {
        let mut idx = PrefixIndex::new(16);
        assert_eq!(idx.insert(5, h(1)), Some(true));
        assert_eq!(idx.insert(5, h(1)), None, "a block carries one hash");
        assert_eq!(idx.insert(5, h(2)), None, "the first hash stays");
        assert_eq!(idx.insert(7, h(1)), Some(false));
        assert_eq!(idx.insert(8, h(4)), Some(true));
        assert_eq!(idx.remove(9), None);
        assert_eq!(idx.remove(8), Some((h(4), true)));
        assert_eq!(idx.remove(8), None);
        assert_eq!(idx.insert(9, h(2)), Some(true));
        assert_eq!(idx.len(), 3);
        assert_eq!(idx.num_hashes(), 2);
        assert_eq!(idx.holders(&h(1)).collect::<Vec<_>>(), vec![5, 7]);
        assert_eq!(idx.find(&h(1), |_| false), Some(5));
        assert_eq!(idx.find(&h(1), |b| b == 7), Some(7));
        assert_eq!(idx.hash_of(5), Some(h(1)));
        assert!(idx.contains(&h(1), 7));
        assert!(!idx.contains(&h(2), 7));
        idx.check().unwrap();
        assert_eq!(idx.remove(5), Some((h(1), false)));
        assert_eq!(idx.find(&h(1), |_| false), Some(7));
        assert_eq!(idx.remove(7), Some((h(1), true)));
        assert_eq!(idx.find(&h(1), |_| true), None);
        assert_eq!(idx.num_hashes(), 1);
        assert_eq!(idx.len(), 1);
        assert_eq!(idx.iter().collect::<Vec<_>>(), vec![(h(2), 9)]);
        idx.check().unwrap();
        idx.clear();
        assert!(idx.is_empty());
        assert_eq!(idx.num_hashes(), 0);
        assert_eq!(idx.iter().count(), 0);
        assert_eq!(idx.hash_of(9), None);
        idx.check().unwrap();
    }

    /// Against a model (a map of insertion-ordered holder lists) under a full table's worth of
    /// random inserts and removals with many repeated hashes: probe runs get long and wrap
    /// around, which exercises backward-shift deletion.
    #[test]
    fn matches_a_model_under_churn() {
        const N: u32 = 64;
        let mut idx = PrefixIndex::new(N);
        let mut model: std::collections::HashMap<u8, Vec<BlockId>> = Default::default();
        let mut carried: Vec<Option<u8>> = vec![None; N as usize];
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for step in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let block = (x % u64::from(N)) as BlockId;
            let key = ((x >> 16) % 9) as u8;
            if (x >> 40) % 3 == 0 {
                let got = idx.remove(block);
                let want = carried[block as usize].take().map(|k| {
                    let v = model.get_mut(&k).unwrap();
                    v.retain(|&b| b != block);
                    let last = v.is_empty();
                    if last {
                        model.remove(&k);
                    }
                    (h(k), last)
                });
                assert_eq!(got, want, "step {step}");
            } else {
                let got = idx.insert(block, h(key));
                let want = if carried[block as usize].is_some() {
                    None
                } else {
                    carried[block as usize] = Some(key);
                    let v = model.entry(key).or_default();
                    v.push(block);
                    Some(v.len() == 1)
                };
                assert_eq!(got, want, "step {step}");
            }
            if step % 97 == 0 {
                idx.check().unwrap();
            }
            for k in 0..9u8 {
                let want = model.get(&k).cloned().unwrap_or_default();
                assert_eq!(idx.holders(&h(k)).collect::<Vec<_>>(), want, "step {step}");
            }
            assert_eq!(idx.num_hashes(), model.len());
        }
        idx.check().unwrap();
    }
}
