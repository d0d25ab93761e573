//! The prefix index: block hash → the physical blocks that currently carry it (a multiset).
//!
//! Several physical blocks may hold the same content (two sequences prefilled the same prefix
//! before either was cached, or a swapped-in copy of a still-cached block), so one hash can map
//! to several blocks; the index never keeps an empty entry. Peer: vLLM V1
//! `BlockHashToBlockMap` in `block_pool.py` (hash → {block_id: block}).
//!
//! Not synchronised: the pool keeps it behind its mutex.

use crate::hashing::BlockHash;
use crate::BlockId;
use foldhash::HashMap;

/// The blocks carrying one hash. One block is by far the common case, so it is stored inline
/// without a heap allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Holders {
    One(BlockId),
    Many(Vec<BlockId>),
}

impl Holders {
    fn as_slice(&self) -> &[BlockId] {
        match self {
            Holders::One(id) => std::slice::from_ref(id),
            Holders::Many(ids) => ids,
        }
    }
}

/// Multiset map from [`BlockHash`] to [`BlockId`]s.
///
/// Invariants: no hash maps to an empty set; a (hash, block) pair appears at most once.
/// Lookups and updates are O(1) expected plus O(k) in the number k of blocks sharing one hash
/// (almost always 1). The map hashes keys with foldhash, seeded randomly per process: keys can be
/// steered by clients through their token ids, so a keyed hasher keeps bucket flooding out, and
/// foldhash is several times cheaper than std's SipHash on these 32-byte keys.
#[derive(Debug, Clone, Default)]
pub struct PrefixIndex {
    map: HashMap<BlockHash, Holders>,
    entries: usize,
}

impl PrefixIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty index with room for `hashes` distinct hashes before it reallocates. The pool
    /// sizes it to its block count (each block carries at most one hash), so inserting never
    /// rehashes the whole table in the middle of a scheduler step.
    pub fn with_capacity(hashes: usize) -> Self {
        Self {
            map: HashMap::with_capacity_and_hasher(hashes, Default::default()),
            entries: 0,
        }
    }

    /// Adds `block` under `hash`. Returns `false` (and changes nothing) if the pair is already
    /// present. O(1) expected.
    pub fn insert(&mut self, hash: BlockHash, block: BlockId) -> bool {
        self.insert_reporting(hash, block).is_some()
    }

    /// Adds `block` under `hash` with one probe of the table. Returns `None` (and changes
    /// nothing) if the pair is already present, else `Some(first)` where `first` tells whether
    /// `hash` had no block before (it just became resolvable). O(1) expected.
    pub fn insert_reporting(&mut self, hash: BlockHash, block: BlockId) -> Option<bool> {
        use std::collections::hash_map::Entry;
        let first = match self.map.entry(hash) {
            Entry::Vacant(v) => {
                v.insert(Holders::One(block));
                true
            }
            Entry::Occupied(mut o) => {
                let h = o.get_mut();
                if h.as_slice().contains(&block) {
                    return None;
                }
                match h {
                    Holders::One(first) => *h = Holders::Many(vec![*first, block]),
                    Holders::Many(ids) => ids.push(block),
                }
                false
            }
        };
        self.entries += 1;
        Some(first)
    }

    /// Removes the pair (`hash`, `block`); drops the entry when it becomes empty. Returns whether
    /// the pair was present. O(1) expected.
    pub fn remove(&mut self, hash: &BlockHash, block: BlockId) -> bool {
        self.remove_reporting(hash, block).is_some()
    }

    /// Removes the pair (`hash`, `block`) with one probe of the table. Returns `None` if the
    /// pair was absent (nothing changed), else `Some(last)` where `last` tells whether `hash`
    /// has no block left (it no longer resolves). O(1) expected.
    pub fn remove_reporting(&mut self, hash: &BlockHash, block: BlockId) -> Option<bool> {
        use std::collections::hash_map::Entry;
        let Entry::Occupied(mut o) = self.map.entry(*hash) else {
            return None;
        };
        let last = match o.get_mut() {
            Holders::One(id) if *id == block => {
                o.remove();
                true
            }
            Holders::One(_) => return None,
            Holders::Many(ids) => {
                let pos = ids.iter().position(|&b| b == block)?;
                ids.swap_remove(pos);
                if ids.len() == 1 {
                    let only = ids[0];
                    *o.get_mut() = Holders::One(only);
                }
                false
            }
        };
        self.entries -= 1;
        Some(last)
    }

    /// Some block carrying `hash` (the first inserted that is still present), if any. O(1).
    pub fn get_one(&self, hash: &BlockHash) -> Option<BlockId> {
        self.map.get(hash).map(|h| h.as_slice()[0])
    }

    /// Every block carrying `hash` (empty slice if none). O(1).
    pub fn get_all(&self, hash: &BlockHash) -> &[BlockId] {
        self.map.get(hash).map_or(&[], Holders::as_slice)
    }

    /// Whether the pair (`hash`, `block`) is present. O(k).
    pub fn contains(&self, hash: &BlockHash, block: BlockId) -> bool {
        self.get_all(hash).contains(&block)
    }

    /// Number of (hash, block) pairs.
    pub fn len(&self) -> usize {
        self.entries
    }

    /// Whether the index holds no pair.
    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Number of distinct hashes.
    pub fn num_hashes(&self) -> usize {
        self.map.len()
    }

    /// Removes every pair.
    pub fn clear(&mut self) {
        self.map.clear();
        self.entries = 0;
    }

    /// Iterates over all (hash, block) pairs in unspecified order (for invariant checks).
    pub fn iter(&self) -> impl Iterator<Item = (&BlockHash, BlockId)> + '_ {
        self.map
            .iter()
            .flat_map(|(h, holders)| holders.as_slice().iter().map(move |&b| (h, b)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(b: u8) -> BlockHash {
        BlockHash([b; 32])
    }

    #[test]
    fn multiset_insert_remove_no_empty_entries() {
        let mut idx = PrefixIndex::new();
        assert!(idx.insert(h(1), 5));
        assert!(!idx.insert(h(1), 5));
        assert_eq!(idx.insert_reporting(h(1), 5), None);
        assert_eq!(idx.insert_reporting(h(1), 7), Some(false));
        assert_eq!(idx.insert_reporting(h(4), 8), Some(true));
        assert_eq!(idx.remove_reporting(&h(4), 9), None);
        assert_eq!(idx.remove_reporting(&h(4), 8), Some(true));
        assert_eq!(idx.remove_reporting(&h(4), 8), None);
        assert!(idx.insert(h(2), 9));
        assert_eq!(idx.len(), 3);
        assert_eq!(idx.num_hashes(), 2);
        assert_eq!(idx.get_all(&h(1)), &[5, 7]);
        assert_eq!(idx.get_one(&h(1)), Some(5));
        assert!(idx.remove(&h(1), 5));
        assert!(!idx.remove(&h(1), 5));
        assert_eq!(idx.get_one(&h(1)), Some(7));
        assert!(idx.remove(&h(1), 7));
        assert_eq!(idx.get_one(&h(1)), None);
        assert_eq!(idx.num_hashes(), 1);
        assert_eq!(idx.len(), 1);
        assert!(!idx.remove(&h(3), 1));
        idx.clear();
        assert!(idx.is_empty());
        assert_eq!(idx.iter().count(), 0);
    }
}
