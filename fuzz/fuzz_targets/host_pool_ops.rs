//! Fuzz target `host_pool_ops`: arbitrary bytes -> a [`HostPool`] (1-8 host blocks, LRU or
//! ARC, admission after 0-3 offers: 0 must be refused) and up to 128 operations of an
//! offloading connector on it: lookup, prepare_load, complete_load, touch, prepare_store,
//! complete_store (success or failure), reset (loads and completes also of keys picked from
//! the readable, pinned or storing ones, so they are mostly accepted), over 12 keys (exact 36-byte keys in two
//! groups, a 36-byte key of the reserved group and keys of other lengths, both hashed), lists
//! with repeats on purpose.
//!
//! A model of the connector keeps the keys with a store in flight (and their host blocks), the
//! load pins per key, and the KV each host block holds (written when a store completes with
//! success). After every operation:
//! - `check()` holds (the tier's invariants with the pool's pins, the held count, the hashed
//!   keys' bytes);
//! - every key the model has storing is `Storing` in its block, every key with load pins is
//!   `Readable` in its block (a held block is never evicted, never a store destination), and
//!   the held blocks are distinct;
//! - a load pins the block holding that key's KV (a load never reads another key's bytes);
//! - a refused call (an error or `prepare_store`'s `None`) changes no key's state, no pin and
//!   no block, and is refused exactly when the model says so (loads of keys not readable,
//!   completes without a pin or store in flight); `prepare_store` returns `None` exactly when
//!   its admitted candidates exceed the free and evictable blocks;
//! - a store plan gives distinct blocks to distinct offered keys not on host, evicts only keys
//!   that were readable and unpinned and not offered, and reports them as their bytes.
//!
//! At the end every pin is released and every store completed: nothing is held.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv_core::host_pool::{HostPool, KeyState};
use pagedkv_core::host_tier::HostEviction;
use pagedkv_core::{BlockId, Error};
use std::collections::{HashMap, HashSet};

const MAX_OPS: usize = 128;
const NUM_KEYS: u8 = 12;

#[derive(Arbitrary, Debug)]
struct Cfg {
    num_blocks: u8,
    min_seen: u8,
    arc: bool,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Lookup(Vec<u8>),
    PrepareLoad(Vec<u8>),
    CompleteLoad(Vec<u8>),
    Touch(Vec<u8>),
    PrepareStore(Vec<u8>),
    CompleteStore(Vec<u8>, bool),
    Reset,
    /// `PrepareLoad` of the readable keys a bit mask picks (so loads find keys).
    LoadReadable(u16),
    /// `CompleteLoad` of the load-pinned keys a bit mask picks.
    CompleteLoads(u16),
    /// `CompleteStore` of the storing keys a bit mask picks.
    CompleteStores(u16, bool),
}

/// The ids of `keys` (ascending) whose position's bit is set in `mask`.
fn pick(mask: u16, keys: impl IntoIterator<Item = u8>) -> Vec<u8> {
    let mut keys: Vec<u8> = keys.into_iter().collect();
    keys.sort_unstable();
    keys.into_iter()
        .enumerate()
        .filter(|&(j, _)| mask >> (j % 16) & 1 == 1)
        .map(|(_, i)| i)
        .collect()
}

#[derive(Arbitrary, Debug)]
struct Input {
    cfg: Cfg,
    ops: Vec<Op>,
}

/// The bytes of key `i`: exact 36-byte keys in groups 0 and 1, a 36-byte key of the reserved
/// group (hashed), and keys of other lengths (hashed).
fn key_bytes(i: u8) -> Vec<u8> {
    let i = i % NUM_KEYS;
    match i % 4 {
        0 | 1 => {
            let mut k = vec![i; 32];
            k.extend_from_slice(&u32::from(i % 4).to_be_bytes());
            k
        }
        2 => {
            let mut k = vec![i; 32];
            k.extend_from_slice(&u32::MAX.to_be_bytes());
            k
        }
        _ => vec![i; usize::from(i) + 1],
    }
}

/// What the connector knows.
#[derive(Default)]
struct Model {
    /// Keys with a store in flight -> host block.
    storing: HashMap<u8, BlockId>,
    /// Keys with load pins -> (host block, pins).
    pinned: HashMap<u8, (BlockId, u32)>,
    /// Per host block, the key whose KV it holds (written when a store completed).
    kv: HashMap<BlockId, u8>,
}

/// Every key's state.
fn states(p: &HostPool) -> Vec<KeyState> {
    (0..NUM_KEYS).map(|i| p.state(&key_bytes(i))).collect()
}

/// The key ids of an op's list (each mod [`NUM_KEYS`], at most 10).
fn ids(v: &[u8]) -> Vec<u8> {
    v.iter().take(10).map(|i| i % NUM_KEYS).collect()
}

fuzz_target!(|input: Input| {
    let c = &input.cfg;
    let n = u32::from(c.num_blocks % 8) + 1;
    let min_seen = u32::from(c.min_seen % 4);
    let eviction = if c.arc {
        HostEviction::Arc
    } else {
        HostEviction::Lru
    };
    let mut p = match HostPool::new(n, min_seen, eviction) {
        Ok(p) => p,
        Err(e) => {
            assert_eq!(min_seen, 0, "refused a valid config: {e}");
            assert!(matches!(
                e,
                Error::InvalidConfig {
                    field: "host_admission_min_seen",
                    ..
                }
            ));
            return;
        }
    };
    assert_ne!(min_seen, 0, "accepted admission_min_seen = 0");
    // Offers of each key since the last reset, for the admission model: a key not on host is
    // a candidate once offered `min_seen` times (counts age only past 64,000 keys: never here).
    let mut offers: HashMap<u8, u32> = HashMap::new();
    let mut m = Model::default();
    for op in input.ops.into_iter().take(MAX_OPS) {
        let before = states(&p);
        let (used, held, counters) = (p.num_used(), p.num_held(), p.counters());
        let mut refused = false;
        let op = match op {
            Op::LoadReadable(mask) => Op::PrepareLoad(pick(
                mask,
                (0..NUM_KEYS).filter(|&i| before[usize::from(i)] == KeyState::Readable),
            )),
            Op::CompleteLoads(mask) => Op::CompleteLoad(pick(mask, m.pinned.keys().copied())),
            Op::CompleteStores(mask, ok) => {
                Op::CompleteStore(pick(mask, m.storing.keys().copied()), ok)
            }
            op => op,
        };
        match op {
            Op::Lookup(v) => {
                let ks: Vec<Vec<u8>> = ids(&v).iter().map(|&i| key_bytes(i)).collect();
                let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
                let want = ids(&v)
                    .iter()
                    .take_while(|&&i| before[usize::from(i)] == KeyState::Readable)
                    .count();
                assert_eq!(p.lookup(&refs), want);
                refused = true; // no side effects
            }
            Op::PrepareLoad(v) => {
                let idv = ids(&v);
                let ks: Vec<Vec<u8>> = idv.iter().map(|&i| key_bytes(i)).collect();
                let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
                let bad = idv
                    .iter()
                    .position(|&i| before[usize::from(i)] != KeyState::Readable);
                match p.prepare_load(&refs) {
                    Ok(blocks) => {
                        assert!(bad.is_none(), "loaded a key that is not readable");
                        assert_eq!(blocks.len(), idv.len());
                        for (&i, &h) in idv.iter().zip(&blocks) {
                            assert_eq!(m.kv.get(&h), Some(&i), "load of key {i} reads block {h}");
                            let e = m.pinned.entry(i).or_insert((h, 0));
                            assert_eq!(e.0, h);
                            e.1 += 1;
                        }
                    }
                    Err(e) => {
                        assert_eq!(Some(e.index), bad);
                        refused = true;
                    }
                }
            }
            Op::CompleteLoad(v) => {
                let idv = ids(&v);
                let ks: Vec<Vec<u8>> = idv.iter().map(|&i| key_bytes(i)).collect();
                let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
                let mut left: HashMap<u8, u32> =
                    m.pinned.iter().map(|(&k, &(_, c))| (k, c)).collect();
                let bad = idv.iter().position(|i| match left.get_mut(i) {
                    Some(c) if *c > 0 => {
                        *c -= 1;
                        false
                    }
                    _ => true,
                });
                match p.complete_load(&refs) {
                    Ok(()) => {
                        assert!(bad.is_none(), "released a pin that was not there");
                        for i in idv {
                            let e = m.pinned.get_mut(&i).unwrap();
                            e.1 -= 1;
                            if e.1 == 0 {
                                m.pinned.remove(&i);
                            }
                        }
                    }
                    Err(e) => {
                        assert_eq!(Some(e.index), bad);
                        refused = true;
                    }
                }
            }
            Op::Touch(v) => {
                let ks: Vec<Vec<u8>> = ids(&v).iter().map(|&i| key_bytes(i)).collect();
                let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
                p.touch(&refs);
                assert_eq!(states(&p), before, "touch changed a state");
            }
            Op::PrepareStore(v) => {
                let idv = ids(&v);
                let ks: Vec<Vec<u8>> = idv.iter().map(|&i| key_bytes(i)).collect();
                let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
                let mut distinct = Vec::new();
                for &i in &idv {
                    if !distinct.contains(&i) {
                        distinct.push(i);
                    }
                }
                for &i in &distinct {
                    *offers.entry(i).or_insert(0) += 1;
                }
                let candidates: Vec<u8> = distinct
                    .iter()
                    .copied()
                    .filter(|&i| {
                        before[usize::from(i)] == KeyState::Absent && offers[&i] >= min_seen
                    })
                    .collect();
                let offered_readable = distinct
                    .iter()
                    .filter(|&&i| {
                        before[usize::from(i)] == KeyState::Readable && !m.pinned.contains_key(&i)
                    })
                    .count();
                let room = n as usize - held - offered_readable;
                match p.prepare_store(&refs) {
                    None => {
                        assert!(candidates.len() > room, "refused with room");
                        refused = true;
                    }
                    Some(plan) => {
                        assert!(candidates.len() <= room, "accepted without room");
                        let got: Vec<u8> = plan.indices.iter().map(|&j| idv[j]).collect();
                        assert_eq!(got, candidates, "stored keys");
                        let blocks: HashSet<BlockId> = plan.blocks.iter().copied().collect();
                        assert_eq!(blocks.len(), plan.blocks.len(), "a block given twice");
                        for b in &plan.evicted {
                            let i = (0..NUM_KEYS).find(|&i| key_bytes(i) == *b).expect("a key");
                            assert_eq!(before[usize::from(i)], KeyState::Readable);
                            assert!(!m.pinned.contains_key(&i) && !distinct.contains(&i));
                            assert_eq!(p.state(b), KeyState::Absent);
                        }
                        for (&i, &h) in got.iter().zip(&plan.blocks) {
                            assert!(h < n);
                            m.storing.insert(i, h);
                            m.kv.remove(&h);
                        }
                        let c = p.counters();
                        assert_eq!(c.evictions - counters.evictions, plan.evicted.len() as u64);
                    }
                }
            }
            Op::CompleteStore(v, success) => {
                let idv = ids(&v);
                let ks: Vec<Vec<u8>> = idv.iter().map(|&i| key_bytes(i)).collect();
                let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
                let mut seen = HashSet::new();
                let bad = idv
                    .iter()
                    .position(|i| !m.storing.contains_key(i) || !seen.insert(*i));
                match p.complete_store(&refs, success) {
                    Ok(()) => {
                        assert!(bad.is_none(), "completed a store not in flight");
                        for i in idv {
                            let h = m.storing.remove(&i).unwrap();
                            if success {
                                m.kv.insert(h, i);
                            }
                        }
                    }
                    Err(e) => {
                        assert_eq!(Some(e.index), bad);
                        refused = true;
                    }
                }
            }
            Op::LoadReadable(_) | Op::CompleteLoads(_) | Op::CompleteStores(..) => {
                unreachable!("mapped above")
            }
            Op::Reset => {
                p.reset();
                m = Model::default();
                offers.clear();
                assert_eq!((p.num_used(), p.num_held()), (0, 0));
                assert_eq!(p.counters(), counters);
            }
        }
        p.check().unwrap_or_else(|e| panic!("invariant: {e}"));
        if refused {
            assert_eq!(states(&p), before, "a refused call changed a state");
            assert_eq!((p.num_used(), p.num_held()), (used, held));
        }
        // Held keys stay where they are; held blocks are distinct.
        let mut held_blocks = HashSet::new();
        for (&i, &h) in &m.storing {
            assert_eq!(p.state(&key_bytes(i)), KeyState::Storing, "storing key {i}");
            assert!(held_blocks.insert(h));
        }
        for (&i, &(h, _)) in &m.pinned {
            assert_eq!(p.state(&key_bytes(i)), KeyState::Readable, "pinned key {i}");
            assert!(held_blocks.insert(h));
            assert_eq!(m.kv.get(&h), Some(&i));
        }
        assert_eq!(p.num_held(), held_blocks.len());
    }
    // Release everything: nothing stays held.
    let pins: Vec<Vec<u8>> = m
        .pinned
        .iter()
        .flat_map(|(&i, &(_, c))| std::iter::repeat(key_bytes(i)).take(c as usize))
        .collect();
    p.complete_load(&pins.iter().map(Vec::as_slice).collect::<Vec<_>>())
        .unwrap();
    let stores: Vec<Vec<u8>> = m.storing.keys().map(|&i| key_bytes(i)).collect();
    p.complete_store(&stores.iter().map(Vec::as_slice).collect::<Vec<_>>(), true)
        .unwrap();
    assert_eq!(p.num_held(), 0);
    p.check().unwrap();
});
