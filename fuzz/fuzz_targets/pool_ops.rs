//! Fuzz target `pool_ops`: arbitrary bytes -> direct [`BlockPool`] operations (allocate, free,
//! incref, touch, cache_block, lookup, reset) including bad ids (the null block, ids out of
//! range, blocks with ref count 0, double frees), checked against an exact model of the pool:
//! ref counts, hashes, the free queue order of docs/design.md (uncached LIFO at the front, cached
//! LRU at the back, allocation from the front, eviction from the LRU front), the exact error
//! of every failed call, the events and the counters. After every operation the pool's own
//! `check_invariants()` must hold and a failed call must have changed nothing.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv_core::events::{EventSink, KvEvent, Tier};
use pagedkv_core::pool::{BlockPool, PoolCounters};
use pagedkv_core::{BlockHash, BlockId, Error};
use std::collections::VecDeque;
use std::sync::Arc;

const MAX_OPS: usize = 128;

/// How an operation names a block.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum IdRef {
    /// Any id in `0..num_blocks + 2` (the null block and out-of-range ids included).
    Any(u8),
    /// One of the blocks currently in use (ref > 0), if any.
    Used(u8),
    /// One of the blocks currently carrying a hash, if any.
    Cached(u8),
}

#[derive(Arbitrary, Debug)]
enum Op {
    Allocate(u8),
    Free(Vec<IdRef>),
    Incref(Vec<IdRef>),
    Touch(Vec<IdRef>),
    Cache(IdRef, u8),
    Lookup(u8),
    Reset,
}

#[derive(Arbitrary, Debug)]
struct Input {
    num_blocks: u8,
    ops: Vec<Op>,
}

/// The model: what the pool must look like.
#[derive(Debug, Clone, PartialEq)]
struct Model {
    n: u32,
    refs: Vec<u32>,
    hashes: Vec<Option<BlockHash>>,
    /// Uncached free blocks; the last element is the front of the free queue (LIFO top).
    stack: Vec<BlockId>,
    /// Cached free blocks, front (next to evict) first.
    lru: VecDeque<BlockId>,
    counters: PoolCounters,
}

impl Model {
    fn new(n: u32) -> Self {
        Self {
            n,
            refs: vec![0; n as usize],
            hashes: vec![None; n as usize],
            stack: (1..n).rev().collect(),
            lru: VecDeque::new(),
            counters: PoolCounters::default(),
        }
    }
    fn free_count(&self) -> usize {
        self.stack.len() + self.lru.len()
    }
    fn free_queue(&self) -> Vec<BlockId> {
        self.stack
            .iter()
            .rev()
            .copied()
            .chain(self.lru.iter().copied())
            .collect()
    }
    fn valid(&self, id: BlockId) -> bool {
        id != 0 && id < self.n
    }
    fn bad_id(&self, id: BlockId) -> Error {
        Error::InvalidBlockId {
            block_id: id,
            num_blocks: self.n,
        }
    }
    fn resolve(&self, r: IdRef) -> BlockId {
        match r {
            IdRef::Any(x) => BlockId::from(x) % (self.n + 2),
            IdRef::Used(x) => pick(
                &(1..self.n)
                    .filter(|&b| self.refs[b as usize] > 0)
                    .collect::<Vec<_>>(),
                x,
            ),
            IdRef::Cached(x) => pick(
                &(1..self.n)
                    .filter(|&b| self.hashes[b as usize].is_some())
                    .collect::<Vec<_>>(),
                x,
            ),
        }
    }
}

fn pick(v: &[BlockId], x: u8) -> BlockId {
    if v.is_empty() {
        BlockId::from(x) // usually an invalid or free id: exercises the error paths
    } else {
        v[x as usize % v.len()]
    }
}

fn hash(x: u8) -> BlockHash {
    // Four distinct hashes: several blocks often carry the same one (the index is a multiset).
    BlockHash([x % 4; 32])
}

/// Observable pool state.
fn observe(
    p: &BlockPool,
    n: u32,
) -> (Vec<u32>, Vec<Option<BlockHash>>, Vec<BlockId>, usize, usize) {
    (
        (0..n + 2).map(|b| p.ref_count(b)).collect(),
        (0..n + 2).map(|b| p.block_hash(b)).collect(),
        p.free_queue(),
        p.num_free(),
        p.num_cached_free(),
    )
}

fn model_view(m: &Model) -> (Vec<u32>, Vec<Option<BlockHash>>, Vec<BlockId>, usize, usize) {
    let mut refs = m.refs.clone();
    refs.extend([0, 0]);
    let mut hashes = m.hashes.clone();
    hashes.extend([None, None]);
    (refs, hashes, m.free_queue(), m.free_count(), m.lru.len())
}

fn run(input: Input) {
    let raw = u32::from(input.num_blocks % 16);
    let sink = Arc::new(EventSink::new(true));
    let pool = match BlockPool::new(raw, sink.clone()) {
        Ok(p) => {
            assert!(raw >= 2, "pool of {raw} blocks accepted");
            p
        }
        Err(e) => {
            assert!(raw < 2, "pool of {raw} blocks rejected: {e}");
            assert!(matches!(
                e,
                Error::InvalidConfig {
                    field: "num_blocks",
                    ..
                }
            ));
            return;
        }
    };
    let mut m = Model::new(raw);
    for op in input.ops.into_iter().take(MAX_OPS) {
        let before = observe(&pool, raw);
        let mut want_events: Vec<KvEvent> = Vec::new();
        let result: Result<(), Error> = match op {
            Op::Allocate(k) => {
                let k = usize::from(k % 8);
                let want = if k > m.free_count() {
                    Err(Error::OutOfBlocks {
                        requested: k,
                        available: m.free_count(),
                    })
                } else {
                    let mut out = Vec::new();
                    let mut evictions = 0u64;
                    // Set semantics: a hash is announced as removed when its last copy goes.
                    let mut unresolvable = Vec::new();
                    for _ in 0..k {
                        let b = match m.stack.pop() {
                            Some(b) => b,
                            None => {
                                let b = m.lru.pop_front().expect("counted");
                                let h = m.hashes[b as usize].take().expect("cached");
                                evictions += 1;
                                if !m.hashes.iter().any(|&c| c == Some(h)) {
                                    unresolvable.push(h);
                                }
                                b
                            }
                        };
                        m.refs[b as usize] = 1;
                        out.push(b);
                    }
                    m.counters.evictions += evictions;
                    if !unresolvable.is_empty() {
                        want_events.push(KvEvent::BlockRemoved {
                            block_hashes: unresolvable,
                            tier: Tier::Device,
                        });
                    }
                    if k > 0 {
                        m.counters.allocations += k as u64;
                    }
                    Ok(out)
                };
                let got = pool.allocate(k);
                assert_eq!(got, want, "allocate({k})");
                got.map(|_| ())
            }
            Op::Free(refs) => {
                let ids: Vec<BlockId> = refs.iter().take(24).map(|&r| m.resolve(r)).collect();
                let got = pool.free(&ids);
                let first_bad = ids.iter().find(|&&b| !m.valid(b));
                let underflow: Vec<BlockId> = ids
                    .iter()
                    .copied()
                    .filter(|&b| m.valid(b))
                    .filter(|&b| {
                        ids.iter().filter(|&&x| x == b).count() > m.refs[b as usize] as usize
                    })
                    .collect();
                if let Some(&b) = first_bad {
                    assert_eq!(got, Err(m.bad_id(b)));
                } else if !underflow.is_empty() {
                    match got {
                        Err(Error::RefCountUnderflow { block_id }) => {
                            assert!(
                                underflow.contains(&block_id),
                                "named {block_id}, not underflowing"
                            )
                        }
                        other => panic!("free({ids:?}) double free -> {other:?}"),
                    }
                } else {
                    assert_eq!(got, Ok(()), "free({ids:?})");
                    for &b in &ids {
                        let r = &mut m.refs[b as usize];
                        *r -= 1;
                        if *r == 0 {
                            if m.hashes[b as usize].is_some() {
                                m.lru.push_back(b);
                            } else {
                                m.stack.push(b);
                            }
                        }
                    }
                    m.counters.frees += ids.len() as u64;
                }
                got
            }
            Op::Incref(refs) => {
                let ids: Vec<BlockId> = refs.iter().take(8).map(|&r| m.resolve(r)).collect();
                let got = pool.incref(&ids);
                let first_bad = ids
                    .iter()
                    .find(|&&b| !m.valid(b) || m.refs[b as usize] == 0);
                match first_bad {
                    Some(&b) if !m.valid(b) => assert_eq!(got, Err(m.bad_id(b))),
                    Some(&b) => assert!(
                        matches!(&got, Err(Error::InvalidArgument { value, .. }) if *value == b.to_string()),
                        "incref of free block {b} -> {got:?}"
                    ),
                    None => {
                        assert_eq!(got, Ok(()));
                        for &b in &ids {
                            m.refs[b as usize] += 1;
                        }
                    }
                }
                got
            }
            Op::Touch(refs) => {
                let ids: Vec<BlockId> = refs.iter().take(8).map(|&r| m.resolve(r)).collect();
                let got = pool.touch(&ids);
                // A prefix hit must name a block carrying a hash (in use or cached-free).
                let first_bad = ids
                    .iter()
                    .find(|&&b| !m.valid(b) || m.hashes[b as usize].is_none());
                let mut revive: Vec<BlockId> = ids
                    .iter()
                    .copied()
                    .filter(|&b| m.valid(b) && m.refs[b as usize] == 0)
                    .collect();
                revive.sort_unstable();
                revive.dedup();
                match first_bad {
                    Some(&b) if !m.valid(b) => assert_eq!(got, Err(m.bad_id(b))),
                    Some(&b) => assert!(
                        matches!(&got, Err(Error::InvalidArgument { value, .. }) if *value == b.to_string()),
                        "touch of unhashed block {b} -> {got:?}"
                    ),
                    None if revive.len() > m.free_count() => assert_eq!(
                        got,
                        Err(Error::OutOfBlocks {
                            requested: revive.len(),
                            available: m.free_count()
                        })
                    ),
                    None => {
                        assert_eq!(got, Ok(()), "touch({ids:?})");
                        for b in &revive {
                            let at = m
                                .lru
                                .iter()
                                .position(|x| x == b)
                                .expect("cached free block in LRU");
                            m.lru.remove(at);
                        }
                        for &b in &ids {
                            m.refs[b as usize] += 1;
                        }
                        m.counters.prefix_touches += ids.len() as u64;
                    }
                }
                got
            }
            Op::Cache(r, h) => {
                let b = m.resolve(r);
                let got = pool.cache_block(b, hash(h));
                if !m.valid(b) {
                    assert_eq!(got, Err(m.bad_id(b)));
                } else if m.refs[b as usize] == 0 {
                    assert!(
                        matches!(got, Err(Error::InvalidArgument { .. })),
                        "cache free block -> {got:?}"
                    );
                } else {
                    // True exactly when the hash becomes resolvable (no block carried it).
                    let fresh = m.hashes[b as usize].is_none()
                        && !(1..m.n).any(|c| m.hashes[c as usize] == Some(hash(h)));
                    assert_eq!(got, Ok(fresh));
                    m.hashes[b as usize].get_or_insert(hash(h));
                }
                got.map(|_| ())
            }
            Op::Lookup(h) => {
                let carriers: Vec<BlockId> = (1..m.n)
                    .filter(|&b| m.hashes[b as usize] == Some(hash(h)))
                    .collect();
                match pool.lookup(&hash(h)) {
                    None => assert!(carriers.is_empty()),
                    Some(b) => {
                        assert!(carriers.contains(&b), "lookup -> {b} not carrying the hash");
                        if carriers.iter().any(|&c| m.refs[c as usize] > 0) {
                            assert!(m.refs[b as usize] > 0, "lookup must prefer a block in use");
                        }
                    }
                }
                Ok(())
            }
            Op::Reset => {
                let used = (1..m.n).filter(|&b| m.refs[b as usize] > 0).count();
                let got = pool.reset_prefix_cache();
                if used > 0 {
                    assert_eq!(
                        got,
                        Err(Error::CacheInUse {
                            blocks_in_use: used
                        })
                    );
                } else {
                    assert_eq!(got, Ok(()));
                    let order = m.free_queue();
                    m.stack = order.into_iter().rev().collect();
                    m.lru.clear();
                    m.hashes.iter_mut().for_each(|h| *h = None);
                    want_events.push(KvEvent::AllBlocksCleared);
                }
                got
            }
        };
        if result.is_err() {
            assert_eq!(
                observe(&pool, raw),
                before,
                "failed call {result:?} changed the pool"
            );
        }
        assert_eq!(
            observe(&pool, raw),
            model_view(&m),
            "pool and model disagree"
        );
        assert_eq!(sink.drain(), want_events);
        assert_eq!(pool.counters(), m.counters);
        assert_eq!(pool.num_used() + pool.num_free(), pool.num_usable());
        if let Err(e) = pool.check_invariants() {
            panic!("invariant violated: {e}");
        }
    }
}

fuzz_target!(|input: Input| run(input));
