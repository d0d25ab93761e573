//! Rules of the block pool (docs/design.md, "Core semantics") and scenarios S2, S4 (raw block ids)
//! and S8 (docs/design.md, "Regression scenarios") at pool level, with exact values.
#![cfg(not(loom))]

use std::sync::Arc;

use pagedkv_core::events::{EventSink, KvEvent, Tier};
use pagedkv_core::hashing::BlockHash;
use pagedkv_core::pool::{BlockPool, PoolCounters, MAX_BLOCKS};
use pagedkv_core::{BlockId, Error, NULL_BLOCK};

fn h(b: u8) -> BlockHash {
    BlockHash([b; 32])
}

fn pool(num_blocks: u32) -> (BlockPool, Arc<EventSink>) {
    let events = Arc::new(EventSink::new(true));
    (BlockPool::new(num_blocks, events.clone()).unwrap(), events)
}

/// Everything observable about the pool: ref counts, hashes, free queue order, counters.
#[derive(Debug, PartialEq)]
struct Snapshot {
    refs: Vec<u32>,
    hashes: Vec<Option<BlockHash>>,
    queue: Vec<BlockId>,
    free: usize,
    cached_free: usize,
    used: usize,
    counters: PoolCounters,
}

fn snap(p: &BlockPool) -> Snapshot {
    let ids = 0..p.num_blocks();
    Snapshot {
        refs: ids.clone().map(|i| p.ref_count(i)).collect(),
        hashes: ids.map(|i| p.block_hash(i)).collect(),
        queue: p.free_queue(),
        free: p.num_free(),
        cached_free: p.num_cached_free(),
        used: p.num_used(),
        counters: p.counters(),
    }
}

fn ok(p: &BlockPool) {
    p.check_invariants().unwrap();
}

#[test]
fn new_validates_num_blocks() {
    for bad in [0, 1, MAX_BLOCKS + 1] {
        match BlockPool::new(bad, Arc::new(EventSink::new(false))) {
            Err(Error::InvalidConfig {
                field: "num_blocks",
                value,
                ..
            }) => assert_eq!(value, bad.to_string()),
            other => panic!("num_blocks {bad}: {other:?}"),
        }
    }
    let (p, _) = pool(2);
    assert_eq!(
        (p.num_blocks(), p.num_usable(), p.num_free(), p.num_used()),
        (2, 1, 1, 0)
    );
    assert_eq!(p.free_queue(), vec![1]);
    ok(&p);
}

#[test]
fn fresh_blocks_in_ascending_order_and_uncached_reuse_is_lifo() {
    let (p, _) = pool(6);
    assert_eq!(p.free_queue(), vec![1, 2, 3, 4, 5]);
    assert_eq!(p.allocate(3).unwrap(), vec![1, 2, 3]);
    assert_eq!((p.num_free(), p.num_used()), (2, 3));
    // Tail-first free: 3, then 2, then 1; the last freed is reused first.
    p.free(&[3, 2, 1]).unwrap();
    assert_eq!(p.free_queue(), vec![1, 2, 3, 4, 5]);
    p.free(&[]).unwrap();
    let a = p.allocate(2).unwrap();
    assert_eq!(a, vec![1, 2]);
    p.free(&[1]).unwrap();
    p.free(&[2]).unwrap();
    assert_eq!(p.free_queue(), vec![2, 1, 3, 4, 5]);
    assert_eq!(p.allocate(1).unwrap(), vec![2]);
    assert_eq!(p.ref_count(2), 1);
    assert_eq!(p.block_hash(2), None);
    assert_eq!(p.allocate(0).unwrap(), Vec::<BlockId>::new());
    ok(&p);
}

#[test]
fn cached_blocks_go_to_lru_back_and_are_evicted_from_the_front_only_when_no_uncached_block_is_free()
{
    let (p, events) = pool(6);
    assert_eq!(p.allocate(5).unwrap(), vec![1, 2, 3, 4, 5]);
    for (id, b) in [(1, 1), (2, 2), (3, 3)] {
        p.cache_block(id, h(b)).unwrap();
    }
    p.free(&[3, 2, 1]).unwrap(); // a request frees tail-first
    assert_eq!(p.free_queue(), vec![3, 2, 1]);
    assert_eq!((p.num_free(), p.num_cached_free()), (3, 3));
    p.free(&[4]).unwrap();
    p.free(&[5]).unwrap();
    // Uncached LIFO first, then LRU front -> back.
    assert_eq!(p.free_queue(), vec![5, 4, 3, 2, 1]);
    ok(&p);

    // Two uncached blocks are free: no eviction.
    assert_eq!(p.allocate(2).unwrap(), vec![5, 4]);
    assert_eq!(p.counters().evictions, 0);
    assert_eq!(p.lookup(&h(3)), Some(3));
    assert!(events.drain().is_empty());

    // Now only cached blocks are free: evict the LRU front (block 3, the deepest of the chain).
    assert_eq!(p.allocate(1).unwrap(), vec![3]);
    assert_eq!(p.block_hash(3), None);
    assert_eq!(p.lookup(&h(3)), None);
    assert_eq!(p.ref_count(3), 1);
    assert_eq!(p.counters().evictions, 1);
    assert_eq!(
        events.drain(),
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![h(3)],
            tier: Tier::Device
        }]
    );
    assert_eq!(p.free_queue(), vec![2, 1]);
    assert_eq!((p.num_free(), p.num_cached_free()), (2, 2));
    ok(&p);

    // A freed cached block goes to the back, behind older cached blocks.
    p.cache_block(5, h(5)).unwrap();
    p.free(&[5]).unwrap();
    assert_eq!(p.free_queue(), vec![2, 1, 5]);
    // One call evicting several blocks emits one event with their hashes, front first.
    assert_eq!(p.allocate(3).unwrap(), vec![2, 1, 5]);
    assert_eq!(
        events.drain(),
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![h(2), h(1), h(5)],
            tier: Tier::Device
        }]
    );
    assert_eq!(p.counters().evictions, 4);
    assert_eq!(p.counters().allocations, 5 + 2 + 1 + 3);
    assert_eq!((p.num_free(), p.num_cached_free(), p.num_used()), (0, 0, 5));
    ok(&p);
}

#[test]
fn touch_removes_a_free_cached_block_from_the_middle_and_consumes_capacity() {
    let (p, _) = pool(5);
    assert_eq!(p.allocate(4).unwrap(), vec![1, 2, 3, 4]);
    for id in 1..=3 {
        p.cache_block(id, h(id as u8)).unwrap();
    }
    p.free(&[3, 2, 1]).unwrap();
    assert_eq!(p.free_queue(), vec![3, 2, 1]);
    assert_eq!(p.lookup(&h(2)), Some(2));

    p.touch(&[2]).unwrap();
    assert_eq!(p.ref_count(2), 1);
    assert_eq!(p.free_queue(), vec![3, 1]);
    assert_eq!((p.num_free(), p.num_cached_free(), p.num_used()), (2, 2, 2));
    assert_eq!(p.block_hash(2), Some(h(2)), "a hit keeps its hash");
    ok(&p);

    // Touching an in-use block takes no capacity; a repeated id counts once for capacity.
    p.cache_block(4, h(4)).unwrap();
    p.touch(&[2, 4]).unwrap();
    assert_eq!((p.ref_count(2), p.ref_count(4)), (2, 2));
    assert_eq!(p.num_free(), 2);
    p.touch(&[1, 1]).unwrap();
    assert_eq!(p.ref_count(1), 2);
    assert_eq!(p.free_queue(), vec![3]);
    assert_eq!((p.num_free(), p.num_cached_free(), p.num_used()), (1, 1, 3));
    assert_eq!(p.counters().prefix_touches, 5);
    ok(&p);

    // Releasing a touched block brings it back to the LRU back.
    p.free(&[1, 1]).unwrap();
    assert_eq!(p.free_queue(), vec![3, 1]);
    ok(&p);
}

#[test]
fn touch_validates_everything_first() {
    let (p, _) = pool(5);
    let a = p.allocate(2).unwrap();
    p.cache_block(a[0], h(1)).unwrap();
    p.free(&[a[0]]).unwrap();
    let before = snap(&p);
    // The valid hit (block 1) comes first; the call still changes nothing.
    for (ids, want) in [
        (
            vec![1, 3],
            Error::InvalidArgument {
                arg: "ids",
                value: "3".into(),
                reason: String::new(),
            },
        ),
        (
            vec![1, 0],
            Error::InvalidBlockId {
                block_id: 0,
                num_blocks: 5,
            },
        ),
        (
            vec![1, 5],
            Error::InvalidBlockId {
                block_id: 5,
                num_blocks: 5,
            },
        ),
        // In use but unhashed: not a prefix hit (a stale id after eviction + reallocation).
        (
            vec![1, 2],
            Error::InvalidArgument {
                arg: "ids",
                value: "2".into(),
                reason: String::new(),
            },
        ),
    ] {
        let err = p.touch(&ids).unwrap_err();
        match (&err, &want) {
            (
                Error::InvalidArgument { arg, value, reason },
                Error::InvalidArgument {
                    arg: a2, value: v2, ..
                },
            ) => {
                assert_eq!((arg, value), (a2, v2));
                assert!(reason.contains("does not carry a hash"), "{reason}");
            }
            _ => assert_eq!(err, want),
        }
        assert_eq!(snap(&p), before, "touch({ids:?}) changed state");
    }
}

#[test]
fn touch_verified_checks_the_hash_each_block_carries() {
    let (p, _) = pool(4);
    let a = p.allocate(2).unwrap();
    p.cache_block(a[0], h(1)).unwrap();
    p.cache_block(a[1], h(2)).unwrap();
    p.free(&[a[1], a[0]]).unwrap();
    let before = snap(&p);
    match p.touch_verified(&[1, 2], &[h(1), h(9)]) {
        Err(Error::InvalidArgument {
            arg: "ids",
            value,
            reason,
        }) => {
            assert_eq!(value, "2");
            assert!(reason.contains("the expected hash"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    match p.touch_verified(&[1, 2], &[h(1)]) {
        Err(Error::InvalidArgument {
            arg: "hashes",
            value,
            ..
        }) => assert_eq!(value, "1"),
        other => panic!("{other:?}"),
    }
    assert_eq!(snap(&p), before);
    p.touch_verified(&[1, 2], &[h(1), h(2)]).unwrap();
    assert_eq!((p.ref_count(1), p.ref_count(2), p.num_free()), (1, 1, 1));
    ok(&p);
}

#[test]
fn failed_allocate_leaves_state_bit_identical() {
    let (p, events) = pool(6);
    let a = p.allocate(4).unwrap();
    for (k, &id) in a.iter().enumerate() {
        p.cache_block(id, h(k as u8)).unwrap();
    }
    p.free(&[a[3], a[2]]).unwrap();
    events.drain();
    let before = snap(&p);
    assert_eq!((before.free, before.cached_free), (3, 2));
    assert_eq!(
        p.allocate(4),
        Err(Error::OutOfBlocks {
            requested: 4,
            available: 3
        })
    );
    assert_eq!(
        p.allocate(usize::MAX),
        Err(Error::OutOfBlocks {
            requested: usize::MAX,
            available: 3
        })
    );
    assert_eq!(snap(&p), before);
    assert!(events.drain().is_empty());
    ok(&p);
    // The same request minus one succeeds, evicting both cached blocks.
    assert_eq!(p.allocate(3).unwrap(), vec![5, 4, 3]);
    assert_eq!(p.counters().evictions, 2);
}

#[test]
fn free_validates_everything_first() {
    let (p, _) = pool(5);
    let a = p.allocate(2).unwrap();
    assert_eq!(a, vec![1, 2]);
    let before = snap(&p);
    let cases: Vec<(Vec<BlockId>, Error)> = vec![
        (
            vec![1, 5],
            Error::InvalidBlockId {
                block_id: 5,
                num_blocks: 5,
            },
        ),
        (
            vec![1, u32::MAX],
            Error::InvalidBlockId {
                block_id: u32::MAX,
                num_blocks: 5,
            },
        ),
        (
            vec![2, NULL_BLOCK],
            Error::InvalidBlockId {
                block_id: 0,
                num_blocks: 5,
            },
        ),
        (vec![1, 3], Error::RefCountUnderflow { block_id: 3 }),
        (vec![2, 1, 2], Error::RefCountUnderflow { block_id: 2 }),
    ];
    for (ids, want) in cases {
        assert_eq!(p.free(&ids), Err(want), "free({ids:?})");
        assert_eq!(snap(&p), before, "free({ids:?}) changed state");
    }
    // Large batches take the sorting path of the duplicate check.
    let mut many = vec![1; 9];
    many.extend(vec![2; 9]);
    p.incref(&[1; 8]).unwrap();
    p.incref(&[2; 7]).unwrap();
    let before = snap(&p);
    assert_eq!(p.free(&many), Err(Error::RefCountUnderflow { block_id: 2 }));
    assert_eq!(snap(&p), before);
    p.incref(&[2]).unwrap();
    p.free(&many).unwrap();
    assert_eq!((p.ref_count(1), p.ref_count(2), p.num_free()), (0, 0, 4));
    assert_eq!(p.counters().frees, 18);
    ok(&p);
}

#[test]
fn incref_needs_a_referenced_block() {
    let (p, _) = pool(4);
    let a = p.allocate(1).unwrap();
    let before = snap(&p);
    assert_eq!(
        p.incref(&[a[0], 0]),
        Err(Error::InvalidBlockId {
            block_id: 0,
            num_blocks: 4
        })
    );
    match p.incref(&[a[0], 2]) {
        Err(Error::InvalidArgument {
            arg: "ids", value, ..
        }) => assert_eq!(value, "2"),
        other => panic!("{other:?}"),
    }
    assert_eq!(snap(&p), before);
    p.incref(&[a[0], a[0]]).unwrap();
    assert_eq!(p.ref_count(a[0]), 3);
    assert_eq!(p.num_free(), 2, "incref allocates nothing");
    p.free(&[a[0], a[0]]).unwrap();
    assert_eq!(p.free_queue(), vec![2, 3]);
    p.free(&[a[0]]).unwrap();
    assert_eq!(p.free_queue(), vec![1, 2, 3]);
    ok(&p);
}

#[test]
fn cache_block_rules_and_lookup_prefers_a_block_in_use() {
    let (p, _) = pool(5);
    let a = p.allocate(2).unwrap();
    match p.cache_block(3, h(1)) {
        Err(Error::InvalidArgument {
            arg: "id", value, ..
        }) => assert_eq!(value, "3"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        p.cache_block(0, h(1)),
        Err(Error::InvalidBlockId {
            block_id: 0,
            num_blocks: 5
        })
    );
    p.cache_block(a[0], h(7)).unwrap();
    p.cache_block(a[0], h(8)).unwrap(); // already hashed: ignored
    assert_eq!(p.block_hash(a[0]), Some(h(7)));
    assert_eq!(p.lookup(&h(8)), None);
    // Two blocks with the same content: the index is a multiset.
    p.cache_block(a[1], h(7)).unwrap();
    ok(&p);
    p.free(&[a[0]]).unwrap();
    assert_eq!(
        p.lookup(&h(7)),
        Some(a[1]),
        "prefer the block in use (no capacity taken)"
    );
    p.free(&[a[1]]).unwrap();
    assert_eq!(p.lookup(&h(7)), Some(a[0]));
    let before = snap(&p);
    let _ = p.lookup(&h(7));
    assert_eq!(snap(&p), before, "lookup has no side effects");
    ok(&p);
}

#[test]
fn reset_prefix_cache_is_refused_while_in_use() {
    let (p, events) = pool(6);
    let a = p.allocate(4).unwrap();
    for (k, &id) in a.iter().enumerate() {
        p.cache_block(id, h(k as u8)).unwrap();
    }
    p.free(&[a[3], a[2]]).unwrap();
    let before = snap(&p);
    assert_eq!(
        p.reset_prefix_cache(),
        Err(Error::CacheInUse { blocks_in_use: 2 })
    );
    assert_eq!(snap(&p), before);
    p.free(&[a[1], a[0]]).unwrap();
    assert_eq!(p.free_queue(), vec![5, 4, 3, 2, 1]);
    events.drain();
    p.reset_prefix_cache().unwrap();
    assert_eq!(events.drain(), vec![KvEvent::AllBlocksCleared]);
    assert_eq!(
        p.free_queue(),
        vec![5, 4, 3, 2, 1],
        "queue order kept, all uncached now"
    );
    assert_eq!((p.num_free(), p.num_cached_free()), (5, 0));
    assert!((0..6).all(|id| p.block_hash(id).is_none()));
    assert!((0..4).all(|k| p.lookup(&h(k)).is_none()));
    ok(&p);
    // Uncached now: allocation evicts nothing.
    assert_eq!(p.allocate(5).unwrap(), vec![5, 4, 3, 2, 1]);
    assert_eq!(p.counters().evictions, 0);
}

/// S2 — a reused block carries no stale hash (2 usable blocks).
#[test]
fn s2_reused_block_carries_no_stale_hash() {
    let (p, events) = pool(3);
    let a = p.allocate(1).unwrap();
    assert_eq!(a, vec![1]);
    p.cache_block(1, h(0xAB)).unwrap();
    p.free(&[1]).unwrap();
    assert_eq!(p.free_queue(), vec![2, 1]);
    // Another sequence's partial block: the uncached block 2 is taken first.
    assert_eq!(p.allocate(1).unwrap(), vec![2]);
    assert_eq!(p.block_hash(2), None);
    assert_eq!(p.lookup(&h(0xAB)), Some(1), "the cached block survives");
    // A third allocation must reuse block 1: it comes out without its old hash.
    assert_eq!(p.allocate(1).unwrap(), vec![1]);
    assert_eq!(p.block_hash(1), None);
    assert_eq!(p.lookup(&h(0xAB)), None);
    assert_eq!(
        events.drain(),
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![h(0xAB)],
            tier: Tier::Device
        }]
    );
    ok(&p);
    // Freed again without caching: goes back uncached.
    p.free(&[1, 2]).unwrap();
    assert_eq!(p.num_cached_free(), 0);
    assert_eq!(p.free_queue(), vec![2, 1]);
    ok(&p);
}

/// S4 (pool part) — freeing raw block ids whose ref count is already 0 is an error naming the
/// block, with no state change and no duplicate in the free queue.
#[test]
fn s4_raw_double_free_is_an_error_without_state_change() {
    let (p, _) = pool(4);
    let a = p.allocate(2).unwrap();
    p.cache_block(a[1], h(1)).unwrap();
    p.free(&a).unwrap();
    let before = snap(&p);
    for id in [a[0], a[1]] {
        let err = p.free(&[id]).unwrap_err();
        assert_eq!(err, Error::RefCountUnderflow { block_id: id });
        assert!(
            err.to_string().contains(&format!(
                "block {id} is freed more times than it is referenced"
            )),
            "{err}"
        );
        assert_eq!(snap(&p), before);
    }
    let q = p.free_queue();
    let mut dedup = q.clone();
    dedup.sort_unstable();
    dedup.dedup();
    assert_eq!(q.len(), dedup.len());
    assert_eq!(q, vec![1, 3, 2]);
    ok(&p);
}

/// S8 — the null block is never capacity, never allocated, touched, freed or hashed.
#[test]
fn s8_null_block_is_never_capacity() {
    let (p, _) = pool(4);
    assert_eq!((p.num_usable(), p.num_free()), (3, 3));
    assert!(!p.free_queue().contains(&NULL_BLOCK));
    let all = p.allocate(3).unwrap();
    assert_eq!(all, vec![1, 2, 3]);
    assert_eq!(
        p.allocate(1),
        Err(Error::OutOfBlocks {
            requested: 1,
            available: 0
        })
    );
    let null_err = Error::InvalidBlockId {
        block_id: 0,
        num_blocks: 4,
    };
    assert_eq!(p.free(&[0]), Err(null_err.clone()));
    assert_eq!(p.touch(&[0]), Err(null_err.clone()));
    assert_eq!(p.incref(&[0]), Err(null_err.clone()));
    assert_eq!(p.cache_block(0, h(1)), Err(null_err));
    assert_eq!((p.ref_count(0), p.block_hash(0)), (0, None));
    p.cache_block(1, h(1)).unwrap();
    p.free(&[3, 2, 1]).unwrap();
    assert_eq!((p.num_free(), p.num_cached_free(), p.num_used()), (3, 1, 0));
    assert!(!p.free_queue().contains(&NULL_BLOCK));
    assert_eq!(p.ref_count(0), 0);
    assert_eq!(p.ref_count(99), 0, "out of range reads as 0");
    ok(&p);
}

#[test]
fn counters_count_blocks() {
    let (p, _) = pool(4);
    let a = p.allocate(3).unwrap();
    p.cache_block(a[0], h(1)).unwrap();
    p.free(&a).unwrap();
    p.touch(&[a[0]]).unwrap();
    p.free(&[a[0]]).unwrap();
    p.allocate(3).unwrap();
    assert_eq!(
        p.counters(),
        PoolCounters {
            evictions: 1,
            allocations: 6,
            frees: 4,
            prefix_touches: 1
        }
    );
}

#[test]
fn cache_blocks_batches_cache_block_and_reports_newly_resolvable_hashes() {
    let (p, _events) = pool(8);
    assert_eq!(p.allocate(5).unwrap(), vec![1, 2, 3, 4, 5]);
    p.cache_block(1, h(1)).unwrap();
    let mut newly = vec![true; 9]; // stale content is cleared
                                   // 1 already carries a hash; 3 gets a second copy of h(2) (2 is first in the batch); 4 is
                                   // listed twice.
    p.cache_blocks(
        &[1, 2, 3, 4, 4],
        &[h(9), h(2), h(2), h(4), h(5)],
        &mut newly,
    )
    .unwrap();
    assert_eq!(newly, vec![false, true, false, true, false]);
    assert_eq!(p.block_hash(1), Some(h(1)));
    assert_eq!(p.block_hash(3), Some(h(2)));
    assert_eq!(p.block_hash(4), Some(h(4)));
    assert!(p.is_hashed(2) && p.is_hashed(3) && !p.is_hashed(5));
    ok(&p);

    // Bad input changes nothing: a free block (ref 0), an out-of-range id, a length mismatch.
    let before = snap(&p);
    p.free(&[5]).unwrap();
    let before_free = snap(&p);
    assert!(matches!(
        p.cache_blocks(&[4, 5], &[h(7), h(8)], &mut newly),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        p.cache_blocks(&[2, 8], &[h(7), h(8)], &mut newly),
        Err(Error::InvalidBlockId { block_id: 8, .. })
    ));
    assert!(matches!(
        p.cache_blocks(&[2], &[], &mut newly),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(snap(&p), before_free);
    assert_ne!(before, before_free);
    ok(&p);
}

#[test]
fn lookup_chain_resolves_the_longest_prefix_preferring_blocks_in_use() {
    let (p, _events) = pool(8);
    assert_eq!(p.allocate(4).unwrap(), vec![1, 2, 3, 4]);
    let mut newly = Vec::new();
    // h(1) -> {1, 4} (4 a second copy), h(2) -> 2, h(3) -> 3.
    p.cache_blocks(&[1, 2, 3, 4], &[h(1), h(2), h(3), h(1)], &mut newly)
        .unwrap();
    assert_eq!(p.lookup_chain(&[h(1), h(2), h(3)]), vec![1, 2, 3]);
    // The chain stops at the first miss even if later hashes resolve.
    assert_eq!(p.lookup_chain(&[h(1), h(6), h(3)]), vec![1]);
    assert_eq!(p.lookup_chain(&[h(6), h(1)]), Vec::<BlockId>::new());
    assert_eq!(p.lookup_chain(&[]), Vec::<BlockId>::new());
    // With block 1 free (cached, ref 0) the copy in use (4) is preferred, as lookup does.
    p.free(&[1]).unwrap();
    assert_eq!(p.lookup(&h(1)), Some(4));
    assert_eq!(p.lookup_chain(&[h(1), h(2)]), vec![4, 2]);
    ok(&p);
}

#[test]
fn long_free_with_a_repeated_id_is_checked_against_its_ref_count() {
    let (p, _events) = pool(200);
    let got = p.allocate(100).unwrap();
    // 40 ids, one of them twice while it holds one reference: refused, nothing changed.
    let mut ids: Vec<BlockId> = got[..39].to_vec();
    ids.push(got[7]);
    let before = snap(&p);
    assert_eq!(
        p.free(&ids),
        Err(Error::RefCountUnderflow { block_id: got[7] })
    );
    assert_eq!(snap(&p), before);
    // With a second reference the same list is a valid free of both.
    p.incref(&[got[7]]).unwrap();
    p.free(&ids).unwrap();
    assert_eq!(p.ref_count(got[7]), 0);
    assert_eq!(p.num_used(), 61);
    // A long list without repeats, one id already free: refused.
    let mut ids: Vec<BlockId> = got[40..80].to_vec();
    ids.push(got[0]);
    let before = snap(&p);
    assert_eq!(
        p.free(&ids),
        Err(Error::RefCountUnderflow { block_id: got[0] })
    );
    assert_eq!(snap(&p), before);
    p.free(&got[39..]).unwrap();
    assert_eq!(p.num_used(), 0);
    ok(&p);
}

#[test]
fn allocate_into_appends_what_allocate_returns_and_changes_nothing_on_error() {
    let (a, _ea) = pool(12);
    let (b, _eb) = pool(12);
    // Same history on both pools, so the same free queue.
    for p in [&a, &b] {
        let got = p.allocate(6).unwrap();
        p.free(&[got[4], got[1], got[2]]).unwrap();
    }
    let mut out = vec![99];
    a.allocate_into(5, &mut out).unwrap();
    let want = b.allocate(5).unwrap();
    assert_eq!(
        want,
        vec![3, 2, 5, 7, 8],
        "stack first (LIFO), then fresh blocks"
    );
    assert_eq!(out[0], 99, "what the buffer held stays");
    assert_eq!(&out[1..], want.as_slice());
    assert_eq!(snap(&a), snap(&b));
    // Too many: refused, buffer and pool unchanged.
    let before = snap(&a);
    assert_eq!(
        a.allocate_into(4, &mut out),
        Err(Error::OutOfBlocks {
            requested: 4,
            available: 3
        })
    );
    assert_eq!(out.len(), 6);
    assert_eq!(snap(&a), before);
    a.allocate_into(0, &mut out).unwrap();
    assert_eq!(out.len(), 6);
    ok(&a);
}

#[test]
fn long_free_reports_an_invalid_id_before_a_free_block() {
    let (p, _events) = pool(50);
    let got = p.allocate(30).unwrap();
    p.free(&got[20..]).unwrap();
    // 21 ids: a free block (got[25]) first, an id out of range last.
    let mut ids: Vec<BlockId> = vec![got[25]];
    ids.extend_from_slice(&got[..19]);
    ids.push(50);
    let before = snap(&p);
    assert_eq!(
        p.free(&ids),
        Err(Error::InvalidBlockId {
            block_id: 50,
            num_blocks: 50
        })
    );
    ids.pop();
    assert_eq!(
        p.free(&ids),
        Err(Error::RefCountUnderflow { block_id: got[25] })
    );
    assert_eq!(snap(&p), before);
    p.free(&got[..20]).unwrap();
    ok(&p);
}
