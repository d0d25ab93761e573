//! Multi-thread stress: threads hammer allocate / free / incref / cache_block / touch on one
//! small pool for a fixed op count, each tracking the references it holds. Afterwards every
//! block's ref count equals the number of references held across all threads (every block
//! owned exactly as many times as counted, none lost, none handed out twice), and the
//! invariants of docs/design.md hold.
#![cfg(not(loom))]

use std::sync::Arc;
use std::thread;

use pagedkv_core::events::EventSink;
use pagedkv_core::hashing::BlockHash;
use pagedkv_core::pool::BlockPool;
use pagedkv_core::{BlockId, Error};

const THREADS: u64 = 4;
const OPS_PER_THREAD: u64 = 100_000;
const NUM_BLOCKS: u32 = 33; // 32 usable: small enough that allocations fail and evict often

/// xorshift64*: a tiny deterministic generator (per-thread seed), no dependency needed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn hash_of(thread: u64, k: u64) -> BlockHash {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&thread.to_le_bytes());
    b[8..16].copy_from_slice(&k.to_le_bytes());
    BlockHash(b)
}

/// Runs one thread's ops; returns the references it still holds (a multiset of ids).
fn worker(pool: &BlockPool, t: u64) -> Vec<BlockId> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (t + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
    let mut owned: Vec<BlockId> = Vec::new();
    let mut my_hashes: Vec<BlockHash> = Vec::new();
    let mut next_hash = 0u64;
    for _ in 0..OPS_PER_THREAD {
        match rng.below(10) {
            0..=2 => {
                let n = 1 + rng.below(4) as usize;
                match pool.allocate(n) {
                    Ok(ids) => {
                        assert_eq!(ids.len(), n);
                        for &id in &ids {
                            // Nobody else can reference a fresh block: no hash, so no hit.
                            assert_eq!(
                                pool.ref_count(id),
                                1,
                                "block {id} handed out while referenced"
                            );
                            assert_eq!(
                                pool.block_hash(id),
                                None,
                                "block {id} handed out with a stale hash"
                            );
                        }
                        owned.extend(ids);
                    }
                    Err(Error::OutOfBlocks { requested, .. }) => assert_eq!(requested, n),
                    Err(e) => panic!("allocate: {e}"),
                }
            }
            3..=5 => {
                // Release up to 4 references, tail-first like a finishing sequence.
                let k = (rng.below(4) as usize + 1).min(owned.len());
                let tail: Vec<_> = owned.drain(owned.len() - k..).rev().collect();
                pool.free(&tail).unwrap();
            }
            6 if !owned.is_empty() => {
                let id = owned[rng.below(owned.len() as u64) as usize];
                pool.incref(&[id]).unwrap();
                owned.push(id);
            }
            7 if !owned.is_empty() => {
                let id = owned[rng.below(owned.len() as u64) as usize];
                let hash = hash_of(t, next_hash);
                next_hash += 1;
                pool.cache_block(id, hash).unwrap();
                my_hashes.push(hash);
                if my_hashes.len() > 64 {
                    my_hashes.remove(0);
                }
            }
            8 | 9 if !my_hashes.is_empty() => {
                let hash = my_hashes[rng.below(my_hashes.len() as u64) as usize];
                if let Some(id) = pool.lookup(&hash) {
                    // Another thread may evict it between lookup and touch: then the verified
                    // touch refuses it (stale) or finds no capacity.
                    match pool.touch_verified(&[id], &[hash]) {
                        Ok(()) => owned.push(id),
                        Err(Error::InvalidArgument { .. } | Error::OutOfBlocks { .. }) => {}
                        Err(e) => panic!("touch: {e}"),
                    }
                }
            }
            _ => {}
        }
    }
    owned
}

#[test]
fn threads_hammering_the_pool_keep_every_block_owned_exactly_once() {
    let pool = Arc::new(BlockPool::new(NUM_BLOCKS, Arc::new(EventSink::new(false))).unwrap());
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let pool = pool.clone();
            thread::spawn(move || worker(&pool, t))
        })
        .collect();
    let held: Vec<Vec<BlockId>> = handles.into_iter().map(|h| h.join().unwrap()).collect();

    let mut expected = vec![0u32; NUM_BLOCKS as usize];
    for &id in held.iter().flatten() {
        expected[id as usize] += 1;
    }
    let actual: Vec<u32> = (0..NUM_BLOCKS).map(|id| pool.ref_count(id)).collect();
    assert_eq!(
        actual, expected,
        "ref counts != references held across threads"
    );
    pool.check_invariants().unwrap();
    let in_use = expected.iter().filter(|&&c| c > 0).count();
    assert_eq!(pool.num_used(), in_use);

    let c = pool.counters();
    assert!(
        c.allocations > 0 && c.frees > 0 && c.prefix_touches > 0 && c.evictions > 0,
        "{c:?}"
    );

    for ids in &held {
        pool.free(ids).unwrap();
    }
    pool.check_invariants().unwrap();
    assert_eq!(
        (pool.num_free(), pool.num_used()),
        (NUM_BLOCKS as usize - 1, 0)
    );
    pool.reset_prefix_cache().unwrap();
    assert_eq!(pool.num_cached_free(), 0);
    pool.check_invariants().unwrap();
}
