//! Regression scenarios S1, S2, S3, S4, S7, S8 (docs/design.md, "Regression scenarios"), each
//! asserting exact values, on the KV cache manager with one full-attention group ([`common::OneGroup`]).

mod common;

use common::OneGroup;
use pagedkv_core::events::{KvEvent, Tier};
use pagedkv_core::{BlockHash, BlockId, CacheConfig, Error, SequenceSpec};

fn manager<M: OneGroup>(num_blocks: u32, block_size: u32, caching: bool) -> M {
    let mut cfg = CacheConfig::new(num_blocks, block_size);
    cfg.enable_prefix_caching = caching;
    cfg.enable_events = true;
    M::build(cfg).unwrap()
}

fn toks(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

/// Every observable bit of pool state: ref counts, hashes, free-queue order.
fn snapshot<M: OneGroup>(m: &M) -> (Vec<u32>, Vec<Option<BlockHash>>, Vec<BlockId>) {
    let p = m.pool();
    let n = p.num_blocks();
    (
        (0..n).map(|b| p.ref_count(b)).collect(),
        (0..n).map(|b| p.block_hash(b)).collect(),
        p.free_queue(),
    )
}

fn s1_failed_allocation_does_not_leak_prefix_hits<M: OneGroup>() {
    let m: M = manager(11, 16, true);
    // A: 96 tokens = 6 full blocks, all cached, then freed tail-first.
    m.add_sequence(1, &toks(0, 96), SequenceSpec::default())
        .unwrap();
    let a = m.allocate_slots(1, 96).unwrap();
    assert_eq!(a.groups[0].new_block_ids, vec![1, 2, 3, 4, 5, 6]);
    assert!(m.free(1));
    assert_eq!(m.pool().free_queue(), vec![7, 8, 9, 10, 6, 5, 4, 3, 2, 1]);
    assert_eq!(m.pool().num_cached_free(), 6);
    // B: 2 fresh blocks.
    m.add_sequence(2, &toks(1000, 32), SequenceSpec::default())
        .unwrap();
    assert_eq!(
        m.allocate_slots(2, 32).unwrap().groups[0].new_block_ids,
        vec![7, 8]
    );
    // C: A's 96 tokens + 48 more -> 6 hits on free cached blocks + 3 fresh = 9 > 8 free.
    let mut c_prompt = toks(0, 96);
    c_prompt.extend(toks(5000, 48));
    m.add_sequence(3, &c_prompt, SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(3).unwrap(), 96);
    assert_eq!(m.num_blocks_needed(3, 144).unwrap(), 9);
    m.take_events();
    let before = snapshot(&m);
    let stats_before = m.stats();
    assert_eq!(before.2, vec![9, 10, 6, 5, 4, 3, 2, 1]);
    let err = m.allocate_slots(3, 144).unwrap_err();
    assert_eq!(
        err,
        Error::OutOfBlocks {
            requested: 9,
            available: 8
        }
    );
    assert_eq!(
        snapshot(&m),
        before,
        "ref counts / hashes / free queue changed by a failed call"
    );
    assert_eq!(m.stats(), stats_before);
    assert!(m.take_events().is_empty());
    assert_eq!(m.block_table(3).unwrap(), Vec::<BlockId>::new());
    assert_eq!(m.num_computed_tokens(3).unwrap(), 0);
    m.check_invariants().unwrap();
    // The same through the batched step.
    let out = m.step(&pagedkv_core::StepRequest {
        seq_ids: vec![3],
        num_new_tokens: vec![144],
        ..Default::default()
    });
    assert_eq!(out.num_scheduled, 0);
    assert_eq!(
        out.error,
        Some(Error::OutOfBlocks {
            requested: 9,
            available: 8
        })
    );
    assert_eq!(snapshot(&m), before);
    // B still allocates (one decode token) and frees cleanly.
    m.append_tokens(2, &[77]).unwrap();
    assert_eq!(
        m.allocate_slots(2, 1).unwrap().groups[0].new_block_ids,
        vec![9]
    );
    assert!(m.free(2));
    // Block 9 (partial, no hash) -> LIFO front; 8 then 7 (cached) -> LRU back.
    assert_eq!(m.pool().free_queue(), vec![9, 10, 6, 5, 4, 3, 2, 1, 8, 7]);
    // Retry of C succeeds: hits 1..=6, fresh 9, 10, then evicts B's deepest block 8.
    let c = m.allocate_slots(3, 144).unwrap();
    assert_eq!(c.num_cached_tokens, 96);
    assert_eq!(c.num_scheduled_tokens, 48);
    assert_eq!(c.groups[0].new_block_ids, vec![9, 10, 8]);
    assert_eq!(m.block_table(3).unwrap(), vec![1, 2, 3, 4, 5, 6, 9, 10, 8]);
    assert_eq!(m.stats().evictions, 1);
    assert_eq!(m.pool().free_queue(), vec![7]);
    m.check_invariants().unwrap();
}

fn s2_reused_block_carries_no_stale_hash<M: OneGroup>() {
    // Two usable blocks: the second allocation must evict the cached one.
    let m: M = manager(3, 4, true);
    m.add_sequence(1, &[1, 2, 3, 4, 5], SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 5).unwrap();
    let old = m.pool().block_hash(1).expect("full block cached");
    assert_eq!(
        m.pool().block_hash(2),
        None,
        "partial block is never hashed"
    );
    assert!(m.free(1));
    m.take_events();
    // Another sequence takes both blocks; block 1 comes out of the LRU (same id, reused).
    m.add_sequence(2, &[9, 9, 9, 9, 9, 9], SequenceSpec::default())
        .unwrap();
    let a = m.allocate_slots(2, 5).unwrap();
    assert_eq!(a.groups[0].new_block_ids, vec![2, 1]);
    assert_eq!(m.pool().lookup(&old), None);
    assert_eq!(
        m.pool().block_hash(1),
        None,
        "reused block handed out with a stale hash"
    );
    let events = m.take_events();
    assert_eq!(
        events[0],
        KvEvent::BlockRemoved {
            block_hashes: vec![old],
            tier: Tier::Device
        }
    );
    m.check_invariants().unwrap();

    // With caching off no block is ever hashed.
    let m: M = manager(3, 4, false);
    m.add_sequence(1, &[1, 2, 3, 4, 5, 6, 7, 8], SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 8).unwrap();
    assert_eq!(
        (m.pool().block_hash(1), m.pool().block_hash(2)),
        (None, None)
    );
    m.free(1);
    m.add_sequence(2, &[1, 2, 3, 4, 5, 6, 7, 8], SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 0);
    assert_eq!(m.allocate_slots(2, 8).unwrap().num_cached_tokens, 0);
    assert!(m.take_events().is_empty());
    m.check_invariants().unwrap();
}

/// S3 with a fixed pseudo-random workload (the proptest in model_proptest.rs covers random
/// ones): predicted blocks == blocks removed from the free pool, every time.
fn s3_capacity_check_predicts_exactly_what_is_taken<M: OneGroup>() {
    let m: M = manager(24, 4, true);
    let mut rng = 0x2545_f491_u64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut live: Vec<u64> = Vec::new();
    let mut next_id = 0u64;
    let (mut checked, mut with_hits) = (0, 0);
    for _ in 0..3000 {
        match next(6) {
            0 | 1 if live.len() < 6 => {
                // Prompts share prefixes (two families) so free cached blocks get hit.
                let fam = next(2) as u32 * 100;
                let len = 1 + next(14) as u32;
                let id = next_id;
                next_id += 1;
                m.add_sequence(id, &toks(fam, len), SequenceSpec::default())
                    .unwrap();
                live.push(id);
            }
            2 if !live.is_empty() => {
                let id = live.swap_remove(next(live.len() as u64) as usize);
                assert!(m.free(id));
            }
            3 if !live.is_empty() => {
                let parent = live[next(live.len() as u64) as usize];
                if m.status(parent).unwrap() == pagedkv_core::SeqStatus::Running && live.len() < 8 {
                    m.fork(parent, next_id).unwrap();
                    live.push(next_id);
                    next_id += 1;
                }
            }
            _ if !live.is_empty() => {
                let id = live[next(live.len() as u64) as usize];
                let left = m.num_tokens(id).unwrap() - m.num_computed_tokens(id).unwrap();
                if left == 0 {
                    m.append_tokens(id, &[next(50) as u32]).unwrap();
                }
                let chunk = [1usize, 4, 8, 12, 16][next(5) as usize];
                let predicted = m.num_blocks_needed(id, chunk).unwrap();
                let free_before = m.pool().num_free();
                let hits_before = m.stats().prefix_hits_tokens;
                match m.allocate_slots(id, chunk) {
                    Ok(_) => {
                        assert_eq!(free_before - m.pool().num_free(), predicted);
                        checked += 1;
                        with_hits += usize::from(m.stats().prefix_hits_tokens > hits_before);
                    }
                    Err(Error::OutOfBlocks {
                        requested,
                        available,
                    }) => {
                        assert_eq!((requested, available), (predicted, free_before));
                        assert_eq!(m.pool().num_free(), free_before);
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            _ => {}
        }
        m.check_invariants().unwrap();
    }
    assert!(checked > 500, "{checked}");
    assert!(with_hits > 20, "{with_hits}");
}

fn s4_double_free_is_idempotent_and_raw_underflow_is_an_error<M: OneGroup>() {
    let m: M = manager(8, 4, true);
    m.add_sequence(1, &toks(0, 10), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 10).unwrap();
    assert!(m.free(1));
    let after_first = snapshot(&m);
    assert_eq!(after_first.2, vec![3, 4, 5, 6, 7, 2, 1]);
    assert!(!m.free(1));
    assert!(!m.free(42));
    assert_eq!(snapshot(&m), after_first);
    let q = m.pool().free_queue();
    let mut dedup = q.clone();
    dedup.sort_unstable();
    dedup.dedup();
    assert_eq!(dedup.len(), q.len());
    // Raw ids with ref count 0.
    let err = m.pool().free(&[2]).unwrap_err();
    assert_eq!(err, Error::RefCountUnderflow { block_id: 2 });
    assert!(err.to_string().contains("block 2"), "{err}");
    assert_eq!(snapshot(&m), after_first);
    m.check_invariants().unwrap();
}

fn s7_copy_on_write_after_fork<M: OneGroup>() {
    for plen in [1u32, 16, 129] {
        for alen in [1u32, 16, 129] {
            for write_child in [false, true] {
                let m: M = manager(64, 8, true);
                m.add_sequence(1, &toks(0, plen), SequenceSpec::default())
                    .unwrap();
                m.allocate_slots(1, plen as usize).unwrap();
                let free0 = m.pool().num_free();
                m.fork(1, 2).unwrap();
                assert_eq!(m.pool().num_free(), free0, "fork allocated");
                let table0 = m.block_table(1).unwrap();
                let (writer, other) = if write_child { (2, 1) } else { (1, 2) };
                m.append_tokens(writer, &toks(500, alen)).unwrap();
                let predicted = m.num_blocks_needed(writer, alen as usize).unwrap();
                let a = m.allocate_slots(writer, alen as usize).unwrap();
                let cow = plen % 8 != 0;
                let fresh = (plen + alen).div_ceil(8) - plen.div_ceil(8);
                assert_eq!(predicted, fresh as usize + usize::from(cow));
                assert_eq!(
                    m.pool().num_free(),
                    free0 - predicted,
                    "plen {plen} alen {alen}"
                );
                assert_eq!(
                    m.block_table(other).unwrap(),
                    table0,
                    "the other side's table changed"
                );
                let wt = m.block_table(writer).unwrap();
                let k = (plen / 8) as usize;
                if cow {
                    assert_eq!(a.groups[0].copies, vec![(table0[k], wt[k])]);
                    assert_ne!(table0[k], wt[k]);
                    assert_eq!(
                        &wt[..k],
                        &table0[..k],
                        "full shared blocks are never copied"
                    );
                    assert_eq!(m.pool().ref_count(table0[k]), 1);
                } else {
                    assert!(a.groups[0].copies.is_empty());
                    assert_eq!(&wt[..table0.len()], &table0[..]);
                }
                for &b in &table0[..k] {
                    assert_eq!(m.pool().ref_count(b), 2);
                }
                assert_eq!(m.stats().copies, u64::from(cow));
                m.check_invariants().unwrap();
                assert!(m.free(1) && m.free(2));
                assert_eq!(m.pool().num_free(), 63);
                assert!((0..64).all(|b| m.pool().ref_count(b) == 0));
                assert_eq!(m.num_sequences(), 0);
                m.check_invariants().unwrap();
            }
        }
    }
}

fn s8_null_block_is_never_capacity<M: OneGroup>() {
    let m: M = manager(11, 16, true);
    assert_eq!(m.stats().free, 10);
    assert_eq!(m.pool().num_usable(), 10);
    m.add_sequence(1, &toks(0, 160), SequenceSpec::default())
        .unwrap();
    m.add_sequence(2, &toks(0, 16), SequenceSpec::default())
        .unwrap();
    assert_eq!(
        m.allocate_slots(1, 160).unwrap().groups[0].new_block_ids,
        (1..=10).collect::<Vec<_>>()
    );
    // Nothing left: the null block is not capacity (a prefix hit is capped below 16 tokens).
    assert_eq!(
        m.allocate_slots(2, 16).unwrap_err(),
        Error::OutOfBlocks {
            requested: 1,
            available: 0
        }
    );
    assert!(!m.block_table(1).unwrap().contains(&0));
    assert_eq!(m.pool().ref_count(0), 0);
    assert_eq!(m.pool().block_hash(0), None);
    let nb = m.pool().num_blocks();
    for call in [
        m.pool().free(&[0]),
        m.pool().touch(&[0]),
        m.pool().incref(&[0]),
    ] {
        assert_eq!(
            call.unwrap_err(),
            Error::InvalidBlockId {
                block_id: 0,
                num_blocks: nb
            }
        );
    }
    m.free(1);
    assert!(!m.pool().free_queue().contains(&0));
    assert_eq!(m.stats().cached_free, 10);
    assert_eq!(m.pool().free_queue().len(), 10);
    let out = m.step(&pagedkv_core::StepRequest {
        seq_ids: vec![2],
        num_new_tokens: vec![16],
        ..Default::default()
    });
    assert!(out.block_table.iter().all(|&b| b != 0));
    m.check_invariants().unwrap();
}

one_group_tests!(
    s1_failed_allocation_does_not_leak_prefix_hits,
    s2_reused_block_carries_no_stale_hash,
    s3_capacity_check_predicts_exactly_what_is_taken,
    s4_double_free_is_idempotent_and_raw_underflow_is_an_error,
    s7_copy_on_write_after_fork,
    s8_null_block_is_never_capacity,
);
