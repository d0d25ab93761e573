//! proptest state machine: random pool operations against a plain sequential model of
//! docs/design.md's free queue (uncached LIFO at the front, cached LRU at the back). After every
//! operation the pool's ref counts, hashes, free-queue order and results equal the model's,
//! and `check_invariants` passes.
#![cfg(not(loom))]

use std::collections::VecDeque;
use std::sync::Arc;

use pagedkv_core::events::EventSink;
use pagedkv_core::hashing::BlockHash;
use pagedkv_core::pool::BlockPool;
use pagedkv_core::{BlockId, Error};
use proptest::prelude::*;

const NUM_BLOCKS: u32 = 7;

#[derive(Debug, Clone)]
enum Op {
    Allocate(usize),
    /// Free the held references at these positions (mod len), in this order.
    Free(Vec<usize>),
    /// Free a raw id (may be invalid or already free).
    FreeRaw(BlockId),
    Incref(usize),
    Cache(usize, u8),
    Touch(u8),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..5).prop_map(Op::Allocate),
        3 => prop::collection::vec(0usize..16, 1..4).prop_map(Op::Free),
        1 => (0u32..NUM_BLOCKS + 1).prop_map(Op::FreeRaw),
        1 => (0usize..16).prop_map(Op::Incref),
        2 => ((0usize..16), (0u8..4)).prop_map(|(i, h)| Op::Cache(i, h)),
        2 => (0u8..4).prop_map(Op::Touch),
        1 => Just(Op::Reset),
    ]
}

fn h(b: u8) -> BlockHash {
    BlockHash([b; 32])
}

/// The sequential model.
struct Model {
    refs: Vec<u32>,
    hashes: Vec<Option<BlockHash>>,
    stack: Vec<BlockId>, // top = last
    lru: VecDeque<BlockId>,
}

impl Model {
    fn new() -> Self {
        Self {
            refs: vec![0; NUM_BLOCKS as usize],
            hashes: vec![None; NUM_BLOCKS as usize],
            stack: (1..NUM_BLOCKS).rev().collect(),
            lru: VecDeque::new(),
        }
    }
    fn free_count(&self) -> usize {
        self.stack.len() + self.lru.len()
    }
    fn queue(&self) -> Vec<BlockId> {
        self.stack
            .iter()
            .rev()
            .chain(self.lru.iter())
            .copied()
            .collect()
    }
    fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, Error> {
        if n > self.free_count() {
            return Err(Error::OutOfBlocks {
                requested: n,
                available: self.free_count(),
            });
        }
        let mut out = Vec::new();
        for _ in 0..n {
            let id = match self.stack.pop() {
                Some(id) => id,
                None => {
                    let id = self.lru.pop_front().unwrap();
                    self.hashes[id as usize] = None;
                    id
                }
            };
            self.refs[id as usize] = 1;
            out.push(id);
        }
        Ok(out)
    }
    fn release(&mut self, ids: &[BlockId]) -> Result<(), Error> {
        for &id in ids {
            if id == 0 || id >= NUM_BLOCKS {
                return Err(Error::InvalidBlockId {
                    block_id: id,
                    num_blocks: NUM_BLOCKS,
                });
            }
        }
        for (k, &id) in ids.iter().enumerate() {
            let times = ids[..=k].iter().filter(|&&x| x == id).count() as u32;
            if self.refs[id as usize] < times {
                return Err(Error::RefCountUnderflow { block_id: id });
            }
        }
        for &id in ids {
            self.refs[id as usize] -= 1;
            if self.refs[id as usize] == 0 {
                if self.hashes[id as usize].is_some() {
                    self.lru.push_back(id);
                } else {
                    self.stack.push(id);
                }
            }
        }
        Ok(())
    }
    /// The blocks `lookup` may answer: those carrying `hash`, restricted to blocks in use
    /// when any is (the pool prefers them; which one among equals is unspecified).
    fn lookup_candidates(&self, hash: BlockHash) -> Vec<BlockId> {
        let ids: Vec<BlockId> = (1..NUM_BLOCKS)
            .filter(|&i| self.hashes[i as usize] == Some(hash))
            .collect();
        let used: Vec<BlockId> = ids
            .iter()
            .copied()
            .filter(|&i| self.refs[i as usize] > 0)
            .collect();
        if used.is_empty() {
            ids
        } else {
            used
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn pool_matches_sequential_model(ops in prop::collection::vec(op(), 1..60)) {
        let pool = BlockPool::new(NUM_BLOCKS, Arc::new(EventSink::new(false))).unwrap();
        let mut m = Model::new();
        let mut held: Vec<BlockId> = Vec::new();
        for op in ops {
            match op {
                Op::Allocate(n) => {
                    let got = pool.allocate(n);
                    prop_assert_eq!(&got, &m.allocate(n));
                    held.extend(got.unwrap_or_default());
                }
                Op::Free(pos) if !held.is_empty() => {
                    let mut idx: Vec<usize> = pos.iter().map(|p| p % held.len()).collect();
                    idx.sort_unstable();
                    idx.dedup();
                    let ids: Vec<BlockId> = idx.iter().rev().map(|&i| held[i]).collect();
                    prop_assert_eq!(pool.free(&ids), m.release(&ids));
                    for &i in idx.iter().rev() {
                        held.remove(i);
                    }
                }
                Op::FreeRaw(id) => {
                    let expect = m.release(&[id]);
                    prop_assert_eq!(pool.free(&[id]), expect.clone());
                    if expect.is_ok() {
                        let at = held.iter().position(|&x| x == id).unwrap();
                        held.remove(at);
                    }
                }
                Op::Incref(i) if !held.is_empty() => {
                    let id = held[i % held.len()];
                    pool.incref(&[id]).unwrap();
                    m.refs[id as usize] += 1;
                    held.push(id);
                }
                Op::Cache(i, hb) if !held.is_empty() => {
                    let id = held[i % held.len()];
                    pool.cache_block(id, h(hb)).unwrap();
                    if m.hashes[id as usize].is_none() {
                        m.hashes[id as usize] = Some(h(hb));
                    }
                }
                Op::Touch(hb) => {
                    let found = pool.lookup(&h(hb));
                    let candidates = m.lookup_candidates(h(hb));
                    match found {
                        None => prop_assert!(candidates.is_empty()),
                        Some(id) => prop_assert!(candidates.contains(&id), "{} not in {:?}", id, candidates),
                    }
                    if let Some(id) = found {
                        pool.touch(&[id]).unwrap();
                        if m.refs[id as usize] == 0 {
                            m.lru.retain(|&x| x != id);
                        }
                        m.refs[id as usize] += 1;
                        held.push(id);
                    }
                }
                Op::Reset => {
                    let in_use = m.refs.iter().filter(|&&r| r > 0).count();
                    let got = pool.reset_prefix_cache();
                    if in_use > 0 {
                        prop_assert_eq!(got, Err(Error::CacheInUse { blocks_in_use: in_use }));
                    } else {
                        prop_assert_eq!(got, Ok(()));
                        m.hashes.iter_mut().for_each(|x| *x = None);
                        let order = m.queue();
                        m.lru.clear();
                        m.stack = order.into_iter().rev().collect();
                    }
                }
                _ => {}
            }
            let refs: Vec<u32> = (0..NUM_BLOCKS).map(|i| pool.ref_count(i)).collect();
            prop_assert_eq!(&refs, &m.refs);
            let hashes: Vec<Option<BlockHash>> = (0..NUM_BLOCKS).map(|i| pool.block_hash(i)).collect();
            prop_assert_eq!(&hashes, &m.hashes);
            prop_assert_eq!(pool.free_queue(), m.queue());
            prop_assert_eq!((pool.num_free(), pool.num_cached_free()), (m.free_count(), m.lru.len()));
            if let Err(e) = pool.check_invariants() {
                prop_assert!(false, "{}", e);
            }
        }
    }
}
