//! Unit tests for each manager rule: prefix hits, chunked prefill, errors, fork, preemption,
//! swap, reset, events, the batched step and stats. Exact values throughout, on the manager with
//! one full-attention group ([`common::OneGroup`]).

mod common;

use common::{OneGroup, Step};
use pagedkv_core::events::{KvEvent, Tier};
use pagedkv_core::{
    BlockHash, BlockId, CacheConfig, Error, ExtraKey, KvCacheManager, MmItem, PrefixHasher,
    SeqStatus, SequenceSpec, StepOptions, StepRequest,
};

fn manager_with<M: OneGroup>(num_blocks: u32, block_size: u32, cpu: u32) -> M {
    let mut cfg = CacheConfig::new(num_blocks, block_size);
    cfg.enable_events = true;
    cfg.num_cpu_blocks = cpu;
    M::build(cfg).unwrap()
}

fn manager<M: OneGroup>(num_blocks: u32, block_size: u32) -> M {
    manager_with(num_blocks, block_size, 0)
}

fn toks(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

fn spec() -> SequenceSpec {
    SequenceSpec::default()
}

fn snapshot<M: OneGroup>(m: &M) -> (Vec<u32>, Vec<Option<BlockHash>>, Vec<BlockId>) {
    let p = m.pool();
    let n = p.num_blocks();
    (
        (0..n).map(|b| p.ref_count(b)).collect(),
        (0..n).map(|b| p.block_hash(b)).collect(),
        p.free_queue(),
    )
}

#[test]
fn config_validation_names_the_field() {
    for (nb, bs, field) in [
        (1, 16, "num_blocks"),
        (0, 16, "num_blocks"),
        (8, 0, "block_size"),
        (8, 4097, "block_size"),
    ] {
        match <KvCacheManager as OneGroup>::build(CacheConfig::new(nb, bs)) {
            Err(Error::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{other:?}"),
        }
    }
    let c = CacheConfig::new(2, 4096);
    assert!(
        c.enable_prefix_caching
            && !c.enable_events
            && c.num_cpu_blocks == 0
            && c.hash_seed.is_empty()
    );
    <KvCacheManager as OneGroup>::build(c).unwrap();
}

fn argument_errors_change_nothing<M: OneGroup>() {
    let m: M = manager(8, 4);
    assert_eq!(
        m.add_sequence(1, &[], spec()).unwrap_err().to_string(),
        "invalid argument prompt = []: a sequence needs at least one token"
    );
    let bad_mm = SequenceSpec {
        mm_items: vec![MmItem {
            item_hash: vec![1],
            start: 0,
            len: 0,
        }],
        ..spec()
    };
    assert!(matches!(
        m.add_sequence(1, &[1], bad_mm),
        Err(Error::InvalidArgument {
            arg: "mm_items",
            ..
        })
    ));
    m.add_sequence(1, &[1, 2, 3], spec()).unwrap();
    assert_eq!(
        m.add_sequence(1, &[1], spec()),
        Err(Error::SequenceExists { seq_id: 1 })
    );
    assert_eq!(
        m.allocate_slots(9, 1),
        Err(Error::UnknownSequence { seq_id: 9 })
    );
    assert_eq!(
        m.append_tokens(9, &[1]),
        Err(Error::UnknownSequence { seq_id: 9 })
    );
    assert!(matches!(
        m.allocate_slots(1, 0),
        Err(Error::InvalidArgument {
            arg: "num_new_tokens",
            ..
        })
    ));
    m.allocate_slots(1, 3).unwrap();
    // Everything computed: nothing to schedule.
    assert!(matches!(
        m.allocate_slots(1, 1),
        Err(Error::InvalidArgument {
            arg: "num_new_tokens",
            ..
        })
    ));
    assert!(matches!(
        m.num_blocks_needed(1, 1),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(m.fork(9, 2), Err(Error::UnknownSequence { seq_id: 9 }));
    assert_eq!(m.fork(1, 1), Err(Error::SequenceExists { seq_id: 1 }));
    assert_eq!(
        m.preempt_recompute(&[1, 9]),
        Err(Error::UnknownSequence { seq_id: 9 })
    );
    assert!(matches!(
        m.preempt_recompute(&[1, 1]),
        Err(Error::InvalidArgument { arg: "seq_ids", .. })
    ));
    assert_eq!(m.block_table(1).unwrap(), vec![1]);
    assert_eq!(m.status(1).unwrap(), SeqStatus::Running);
    m.check_invariants().unwrap();
}

fn prefix_hit_is_capped_so_the_last_token_is_recomputed<M: OneGroup>() {
    let m: M = manager(16, 4);
    m.add_sequence(1, &toks(0, 8), spec()).unwrap();
    assert_eq!(
        m.allocate_slots(1, 8).unwrap().groups[0].new_block_ids,
        vec![1, 2]
    );
    // Same 8 tokens: only the first block may be served (8 - 1 = 7 tokens -> 1 full block).
    m.add_sequence(2, &toks(0, 8), spec()).unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 4);
    // Hit on block 1 (ref 1, in use) takes no free capacity: only one fresh block.
    assert_eq!(m.num_blocks_needed(2, 100).unwrap(), 1);
    let a = m.allocate_slots(2, 100).unwrap();
    assert_eq!(
        (
            a.num_cached_tokens,
            a.num_context_tokens,
            a.num_scheduled_tokens
        ),
        (4, 4, 4)
    );
    assert_eq!(a.groups[0].new_block_ids, vec![3]);
    assert_eq!(m.block_table(2).unwrap(), vec![1, 3]);
    assert_eq!(m.pool().ref_count(1), 2);
    // Block 3 holds the same content as block 2: the index is a multiset.
    assert_eq!(m.pool().block_hash(3), m.pool().block_hash(2));
    // 9 tokens: two full blocks are served.
    m.add_sequence(3, &[toks(0, 8), vec![99]].concat(), spec())
        .unwrap();
    assert_eq!(m.lookup_prefix(3).unwrap(), 8);
    let s = m.stats();
    assert_eq!((s.prefix_queries_tokens, s.prefix_hits_tokens), (16, 4));
    m.check_invariants().unwrap();
}

fn prefix_lookup_happens_only_on_first_allocation<M: OneGroup>() {
    let m: M = manager(16, 4);
    m.add_sequence(1, &toks(0, 8), spec()).unwrap();
    m.allocate_slots(1, 2).unwrap(); // first allocation: nothing cached yet
    m.add_sequence(2, &toks(0, 8), spec()).unwrap();
    m.allocate_slots(2, 8).unwrap(); // caches blocks 0..1 of the prefix
    let a = m.allocate_slots(1, 6).unwrap();
    assert_eq!(
        (
            a.num_cached_tokens,
            a.num_context_tokens,
            a.num_scheduled_tokens
        ),
        (0, 2, 6)
    );
    assert_eq!(m.block_table(1).unwrap(), vec![1, 4]);
    m.check_invariants().unwrap();
}

fn hits_on_free_cached_blocks_consume_capacity<M: OneGroup>() {
    let m: M = manager(16, 4);
    m.add_sequence(1, &toks(0, 12), spec()).unwrap();
    m.allocate_slots(1, 12).unwrap();
    m.free(1);
    assert_eq!(m.pool().num_free(), 15);
    m.add_sequence(2, &toks(0, 13), spec()).unwrap();
    // 3 hits on ref-0 cached blocks + 1 fresh.
    assert_eq!(m.num_blocks_needed(2, 13).unwrap(), 4);
    let a = m.allocate_slots(2, 13).unwrap();
    assert_eq!(a.num_cached_tokens, 12);
    assert_eq!(m.pool().num_free(), 11);
    assert_eq!(m.block_table(2).unwrap(), vec![1, 2, 3, 4]);
    m.check_invariants().unwrap();
}

fn chunked_prefill_then_decode<M: OneGroup>() {
    let m: M = manager(16, 4);
    m.add_sequence(1, &toks(0, 10), spec()).unwrap();
    assert_eq!(m.allocate_slots(1, 4).unwrap().num_scheduled_tokens, 4);
    assert_eq!(m.block_table(1).unwrap(), vec![1]);
    assert_eq!(
        m.allocate_slots(1, 4).unwrap().groups[0].new_block_ids,
        vec![2]
    );
    let a = m.allocate_slots(1, 4).unwrap();
    assert_eq!(
        (
            a.num_context_tokens,
            a.num_scheduled_tokens,
            a.groups[0].new_block_ids.clone()
        ),
        (8, 2, vec![3])
    );
    assert_eq!(m.num_computed_tokens(1).unwrap(), 10);
    m.append_tokens(1, &[77]).unwrap();
    assert_eq!(m.num_blocks_needed(1, 5).unwrap(), 0);
    let a = m.allocate_slots(1, 5).unwrap();
    assert_eq!((a.num_context_tokens, a.num_scheduled_tokens), (10, 1));
    assert!(a.groups[0].new_block_ids.is_empty());
    assert_eq!(m.num_tokens(1).unwrap(), 11);
    m.check_invariants().unwrap();
}

fn fork_allocates_nothing_and_increments_refs<M: OneGroup>() {
    let m: M = manager(16, 4);
    m.add_sequence(1, &toks(0, 6), spec()).unwrap();
    m.allocate_slots(1, 6).unwrap();
    let free = m.pool().num_free();
    m.fork(1, 2).unwrap();
    assert_eq!(m.pool().num_free(), free);
    assert_eq!(m.block_table(2).unwrap(), vec![1, 2]);
    assert_eq!((m.pool().ref_count(1), m.pool().ref_count(2)), (2, 2));
    assert_eq!(m.tokens(2).unwrap(), toks(0, 6));
    assert_eq!(m.num_computed_tokens(2).unwrap(), 6);
    // Free is tail-first and only drops references.
    assert!(m.free(1));
    assert_eq!((m.pool().ref_count(1), m.pool().ref_count(2)), (1, 1));
    m.check_invariants().unwrap();
}

fn preempt_recompute_keeps_hashes_and_resume_hits_own_prefix<M: OneGroup>() {
    let m: M = manager(16, 4);
    m.add_sequence(1, &toks(0, 10), spec()).unwrap();
    m.allocate_slots(1, 10).unwrap();
    m.append_tokens(1, &[50, 51]).unwrap(); // generated tokens
    m.preempt_recompute(&[1]).unwrap();
    assert_eq!(m.status(1).unwrap(), SeqStatus::Preempted);
    assert_eq!(
        (m.num_computed_tokens(1).unwrap(), m.num_tokens(1).unwrap()),
        (0, 12)
    );
    assert_eq!(m.block_table(1).unwrap(), Vec::<BlockId>::new());
    // Tail-first: partial block 3 to the LIFO front, cached 2 then 1 to the LRU back.
    assert_eq!(m.pool().free_queue()[0], 3);
    assert_eq!(&m.pool().free_queue()[13..], &[2, 1]);
    m.preempt_recompute(&[1]).unwrap(); // already preempted: no-op
    assert_eq!(m.stats().preemptions, 1);
    // Resume: the prefill covers prompt + generated tokens, the first 8 come from the cache.
    let a = m.allocate_slots(1, 100).unwrap();
    assert_eq!((a.num_cached_tokens, a.num_scheduled_tokens), (8, 4));
    assert_eq!(m.block_table(1).unwrap(), vec![1, 2, 3]);
    assert_eq!(m.status(1).unwrap(), SeqStatus::Running);
    m.check_invariants().unwrap();
}

/// vLLM #25780: a recompute resume looks its own blocks up again; counting that as a new
/// lookup made a lone request with no sharing report hits. The resume still reuses them.
fn a_request_preempted_before_its_first_allocation_still_counts_its_lookup<M: OneGroup>() {
    // Its first allocation after the preemption is its first lookup, not a resume: the
    // status alone (preempted) cannot tell the two apart.
    let m: M = manager(64, 4);
    m.add_sequence(1, &toks(0, 10), spec()).unwrap();
    m.allocate_slots(1, 10).unwrap();
    m.free(1);
    m.add_sequence(2, &toks(0, 10), spec()).unwrap();
    m.preempt_recompute(&[2]).unwrap();
    m.fork(2, 3).unwrap(); // a child of a parent that has not looked up yet
    m.allocate_slots(2, 10).unwrap();
    m.allocate_slots(3, 10).unwrap();
    let s = m.stats();
    // Three lookups of 10 tokens; 2 and 3 each hit the 2 full blocks 1 left cached.
    assert_eq!((s.prefix_queries_tokens, s.prefix_hits_tokens), (30, 16));
    // A resume of 2 after all this is still no new lookup.
    m.preempt_recompute(&[2]).unwrap();
    m.allocate_slots(2, 10).unwrap();
    assert_eq!(m.stats().prefix_queries_tokens, 30);
    m.check_invariants().unwrap();
}

fn a_resume_after_preemption_is_not_a_new_prefix_lookup<M: OneGroup>() {
    let m: M = manager(32, 4);
    m.add_sequence(1, &toks(0, 10), spec()).unwrap();
    m.allocate_slots(1, 10).unwrap();
    for t in 50..60 {
        m.append_tokens(1, &[t]).unwrap();
        m.allocate_slots(1, 1).unwrap();
    }
    m.append_tokens(1, &[60]).unwrap();
    m.preempt_recompute(&[1]).unwrap();
    let a = m.allocate_slots(1, 100).unwrap();
    assert_eq!((a.num_cached_tokens, a.num_scheduled_tokens), (20, 1));
    let s = m.stats();
    assert_eq!((s.prefix_queries_tokens, s.prefix_hits_tokens), (10, 0));
    assert_eq!(s.prefix_hit_rate(), 0.0);
    // A fork child of a preempted request resumes with it: no new lookup either.
    m.preempt_recompute(&[1]).unwrap();
    m.fork(1, 2).unwrap();
    m.allocate_slots(2, 100).unwrap();
    assert_eq!(m.stats().prefix_queries_tokens, 10);
    // A new request with the same prompt is a lookup, and its hits count.
    m.add_sequence(3, &toks(0, 10), spec()).unwrap();
    m.allocate_slots(3, 10).unwrap();
    let s = m.stats();
    assert_eq!((s.prefix_queries_tokens, s.prefix_hits_tokens), (20, 8));
    m.check_invariants().unwrap();
}

/// A reset drops every prefix hash, those of blocks swapped out to the CPU pool included: the
/// swapped-in KV was computed before the reset (maybe under other weights), so it is neither
/// registered nor announced again, nor are the blocks its decode fills later (their parents
/// are not cached). A recompute preemption computes the KV afresh and caches it again.
fn reset_drops_the_hashes_of_swapped_out_blocks<M: OneGroup>() {
    let m: M = manager_with(16, 4, 8);
    m.add_sequence(1, &toks(0, 10), spec()).unwrap();
    m.allocate_slots(1, 10).unwrap();
    m.swap_out(&[1]).unwrap();
    m.reset_prefix_cache().unwrap();
    assert_eq!(m.take_events().last(), Some(&KvEvent::AllBlocksCleared));
    m.swap_in(&[1]).unwrap();
    assert_eq!(m.take_events(), vec![]);
    assert!((0..16).all(|b| m.pool().block_hash(b).is_none()));
    m.add_sequence(2, &toks(0, 10), spec()).unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 0);
    m.check_invariants().unwrap();
    m.append_tokens(1, &[90, 91, 92]).unwrap();
    m.allocate_slots(1, 3).unwrap(); // fills block 2, starts block 3
    assert!((0..16).all(|b| m.pool().block_hash(b).is_none()));
    assert_eq!(m.num_blocks_owed(&[2]).unwrap(), 3);
    m.check_invariants().unwrap();
    // Swapped out again and back: still nothing to register.
    m.swap_out(&[1]).unwrap();
    m.swap_in(&[1]).unwrap();
    assert_eq!(m.take_events(), vec![]);
    m.preempt_recompute(&[1]).unwrap();
    m.allocate_slots(1, 100).unwrap();
    let table = m.block_table(1).unwrap();
    assert!(table[..3].iter().all(|&b| m.pool().block_hash(b).is_some()));
    assert_eq!(m.lookup_prefix(2).unwrap(), 8);
    m.check_invariants().unwrap();
    // A sequence swapped out after the reset is cached again on swap-in as usual.
    m.swap_out(&[1]).unwrap();
    m.swap_in(&[1]).unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 8);
    m.check_invariants().unwrap();
}

fn swap_out_and_in_keep_group_sharing<M: OneGroup>() {
    let m: M = manager_with(16, 4, 4);
    m.add_sequence(1, &toks(0, 6), spec()).unwrap();
    m.allocate_slots(1, 6).unwrap();
    m.fork(1, 2).unwrap();
    m.append_tokens(2, &[9]).unwrap();
    let a = m.allocate_slots(2, 1).unwrap();
    assert_eq!(a.groups[0].copies, vec![(2, 3)]);
    assert_eq!(m.block_table(2).unwrap(), vec![1, 3]);

    let out = m.swap_out(&[1, 2]).unwrap();
    assert_eq!(out, vec![(1, 0), (2, 1), (3, 2)]);
    assert_eq!(m.block_table(1).unwrap(), vec![0, 1]);
    assert_eq!(m.block_table(2).unwrap(), vec![0, 2]);
    assert_eq!(m.status(2).unwrap(), SeqStatus::Swapped);
    assert_eq!(m.pool().num_used(), 0);
    let s = m.stats();
    assert_eq!((s.cpu_used, s.swaps_out_blocks, s.preemptions), (3, 3, 2));
    assert!(matches!(
        m.allocate_slots(1, 1),
        Err(Error::InvalidSequenceState {
            seq_id: 1,
            state: "swapped",
            ..
        })
    ));
    assert!(matches!(
        m.fork(1, 5),
        Err(Error::InvalidSequenceState { .. })
    ));
    m.check_invariants().unwrap();

    let back = m.swap_in(&[1, 2]).unwrap();
    assert_eq!(back, vec![(0, 3), (1, 2), (2, 4)]);
    assert_eq!(m.block_table(1).unwrap(), vec![3, 2]);
    assert_eq!(m.block_table(2).unwrap(), vec![3, 4]);
    assert_eq!(m.pool().ref_count(3), 2);
    assert_eq!(
        (
            m.num_computed_tokens(1).unwrap(),
            m.num_computed_tokens(2).unwrap()
        ),
        (6, 7)
    );
    // The full computed block is registered again.
    assert_eq!(m.pool().block_hash(3), m.pool().block_hash(1));
    let s = m.stats();
    assert_eq!((s.cpu_used, s.swaps_in_blocks), (0, 3));
    m.check_invariants().unwrap();
    assert!(m.free(1) && m.free(2));
    assert_eq!(m.pool().num_free(), 15);
}

fn swap_failures_are_all_or_nothing<M: OneGroup>() {
    let m: M = manager_with(8, 4, 2);
    m.add_sequence(1, &toks(0, 12), spec()).unwrap();
    m.allocate_slots(1, 12).unwrap();
    let before = snapshot(&m);
    assert_eq!(
        m.swap_out(&[1]),
        Err(Error::OutOfSwapSpace {
            requested: 3,
            available: 2
        })
    );
    assert_eq!(snapshot(&m), before);
    assert_eq!(m.status(1).unwrap(), SeqStatus::Running);
    assert!(matches!(
        m.swap_in(&[1]),
        Err(Error::InvalidSequenceState { .. })
    ));

    m.add_sequence(2, &toks(100, 6), spec()).unwrap();
    m.allocate_slots(2, 6).unwrap();
    assert_eq!(m.swap_out(&[2]).unwrap(), vec![(4, 0), (5, 1)]);
    // Fill the GPU so swap-in cannot fit: 7 usable, seq 1 holds 3, seq 3 takes 3 more.
    m.add_sequence(3, &toks(200, 12), spec()).unwrap();
    m.allocate_slots(3, 12).unwrap();
    assert_eq!(m.pool().num_free(), 1);
    let before = snapshot(&m);
    assert_eq!(
        m.swap_in(&[2]),
        Err(Error::OutOfBlocks {
            requested: 2,
            available: 1
        })
    );
    assert_eq!(snapshot(&m), before);
    assert_eq!(m.stats().cpu_used, 2);
    assert_eq!(m.block_table(2).unwrap(), vec![0, 1]);
    m.check_invariants().unwrap();
    // Freeing a swapped sequence returns its CPU blocks.
    assert!(m.free(2));
    assert_eq!(m.stats().cpu_used, 0);
    m.check_invariants().unwrap();
}

fn reset_prefix_cache_refused_while_in_use<M: OneGroup>() {
    let m: M = manager(8, 4);
    m.add_sequence(1, &toks(0, 8), spec()).unwrap();
    m.allocate_slots(1, 8).unwrap();
    m.take_events();
    assert_eq!(
        m.reset_prefix_cache(),
        Err(Error::CacheInUse { blocks_in_use: 2 })
    );
    assert!(m.pool().block_hash(1).is_some());
    m.free(1);
    m.reset_prefix_cache().unwrap();
    assert!((0..8).all(|b| m.pool().block_hash(b).is_none()));
    assert_eq!(m.take_events(), vec![KvEvent::AllBlocksCleared]);
    m.add_sequence(2, &toks(0, 8), spec()).unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 0);
    m.check_invariants().unwrap();
}

fn block_stored_events_carry_the_hash_chain<M: OneGroup>() {
    let m: M = manager(16, 4);
    let salt = vec![ExtraKey::CacheSalt("s".into())];
    m.add_sequence(
        1,
        &toks(0, 9),
        SequenceSpec {
            extra_keys: salt.clone(),
            ..spec()
        },
    )
    .unwrap();
    m.allocate_slots(1, 9).unwrap();
    let h = PrefixHasher::default();
    let h0 = h.hash_block(None, &toks(0, 4), &salt);
    let h1 = h.hash_block(Some(&h0), &toks(4, 4), &salt);
    assert_eq!(
        m.take_events(),
        vec![KvEvent::BlockStored {
            block_hashes: vec![h0, h1],
            parent_block_hash: None,
            token_ids: toks(0, 8),
            block_size: 4,
            extra_keys: salt.clone(),
            hash_root: Some(h.root()),
            tier: Tier::Device,
        }]
    );
    m.append_tokens(1, &[20, 21, 22]).unwrap();
    m.allocate_slots(1, 3).unwrap();
    let h2 = h.hash_block(Some(&h1), &[8, 20, 21, 22], &salt);
    assert_eq!(
        m.take_events(),
        vec![KvEvent::BlockStored {
            block_hashes: vec![h2],
            parent_block_hash: Some(h1),
            token_ids: vec![8, 20, 21, 22],
            block_size: 4,
            extra_keys: salt,
            hash_root: Some(h.root()),
            tier: Tier::Device,
        }]
    );
    assert_eq!(m.pool().block_hash(3), Some(h2));
    // Events off: nothing buffered.
    let quiet = M::build(CacheConfig::new(8, 4)).unwrap();
    quiet.add_sequence(1, &toks(0, 8), spec()).unwrap();
    quiet.allocate_slots(1, 8).unwrap();
    assert!(quiet.take_events().is_empty());
}

fn extra_keys_isolate_prefixes<M: OneGroup>() {
    let m: M = manager(32, 4);
    let with = |k: ExtraKey| SequenceSpec {
        extra_keys: vec![k],
        ..spec()
    };
    m.add_sequence(1, &toks(0, 9), with(ExtraKey::Adapter("a".into())))
        .unwrap();
    m.allocate_slots(1, 9).unwrap();
    m.add_sequence(2, &toks(0, 9), with(ExtraKey::Adapter("b".into())))
        .unwrap();
    m.add_sequence(3, &toks(0, 9), with(ExtraKey::CacheSalt("a".into())))
        .unwrap();
    m.add_sequence(4, &toks(0, 9), spec()).unwrap();
    m.add_sequence(5, &toks(0, 9), with(ExtraKey::Adapter("a".into())))
        .unwrap();
    assert_eq!(
        [2, 3, 4, 5].map(|s| m.lookup_prefix(s).unwrap()),
        [0, 0, 0, 8]
    );
}

fn multimodal_items_key_the_blocks_they_overlap<M: OneGroup>() {
    let m: M = manager(32, 4);
    let img = |h: u8| SequenceSpec {
        mm_items: vec![MmItem {
            item_hash: vec![h],
            start: 2,
            len: 4,
        }],
        ..spec()
    };
    m.add_sequence(1, &toks(0, 13), img(1)).unwrap();
    m.allocate_slots(1, 13).unwrap();
    let h = PrefixHasher::default();
    let k0 = vec![ExtraKey::Multimodal {
        item_hash: vec![1],
        offset: 2,
    }];
    let k1 = vec![ExtraKey::Multimodal {
        item_hash: vec![1],
        offset: -2,
    }];
    let h0 = h.hash_block(None, &toks(0, 4), &k0);
    let h1 = h.hash_block(Some(&h0), &toks(4, 4), &k1);
    let h2 = h.hash_block(Some(&h1), &toks(8, 4), &[]);
    assert_eq!(
        [1, 2, 3].map(|b| m.pool().block_hash(b)),
        [Some(h0), Some(h1), Some(h2)]
    );
    // Per-block keys differ, so three events.
    let ev = m.take_events();
    assert_eq!(ev.len(), 3);
    assert!(
        matches!(&ev[1], KvEvent::BlockStored { extra_keys, parent_block_hash: Some(p), .. } if *extra_keys == k1 && *p == h0)
    );
    m.add_sequence(2, &toks(0, 13), img(2)).unwrap();
    m.add_sequence(3, &toks(0, 13), img(1)).unwrap();
    assert_eq!(
        (m.lookup_prefix(2).unwrap(), m.lookup_prefix(3).unwrap()),
        (0, 12)
    );
}

fn step_without_block_table_takes_the_same_blocks<M: OneGroup>() {
    let skip = StepOptions {
        skip_block_table: true,
        ..Default::default()
    };
    let full: M = manager(16, 4);
    let lean = manager(16, 4);
    for m in [&full, &lean] {
        m.add_sequence(1, &toks(0, 6), spec()).unwrap();
        m.add_sequence(2, &toks(100, 3), spec()).unwrap();
    }
    let first = StepRequest {
        seq_ids: vec![1, 2],
        num_new_tokens: vec![6, 3],
        ..Default::default()
    };
    let decode = StepRequest {
        seq_ids: vec![1, 2],
        num_new_tokens: vec![1, 1],
        append_indptr: vec![0, 1, 2],
        append_tokens: vec![7, 8],
    };
    for req in [&first, &decode] {
        let a = full.step(req);
        let b = lean.step_with(req, skip);
        assert!(b.block_table.is_empty());
        assert_eq!(b.block_table_width, 0);
        assert_eq!(
            Step {
                block_table: Vec::new(),
                block_table_width: 0,
                ..a
            },
            b
        );
    }
    assert_eq!(lean.block_table(1).unwrap(), vec![1, 2]);
    assert_eq!(lean.block_table(2).unwrap(), vec![3]);
}

/// Without the per-token arrays a step takes the same blocks, reports the same tables and
/// lengths, and leaves the same state (a prefix hit and decodes that start blocks included).
fn step_without_token_arrays_takes_the_same_blocks<M: OneGroup>() {
    let skip = StepOptions {
        skip_token_arrays: true,
        ..Default::default()
    };
    let full: M = manager(16, 4);
    let lean = manager(16, 4);
    for m in [&full, &lean] {
        m.add_sequence(1, &toks(0, 6), spec()).unwrap();
        m.add_sequence(2, &toks(0, 7), spec()).unwrap();
    }
    let first = StepRequest {
        seq_ids: vec![1],
        num_new_tokens: vec![6],
        ..Default::default()
    };
    let second = StepRequest {
        seq_ids: vec![2],
        num_new_tokens: vec![7],
        ..Default::default()
    };
    let decode = StepRequest {
        seq_ids: vec![1, 2],
        num_new_tokens: vec![1, 1],
        append_indptr: vec![0, 1, 2],
        append_tokens: vec![7, 8],
    };
    for req in [&first, &second, &decode, &decode] {
        let a = full.step(req);
        let b = lean.step_with(req, skip);
        assert!(!a.slot_mapping.is_empty() && a.error.is_none());
        assert_eq!(
            Step {
                slot_mapping: Vec::new(),
                input_ids: Vec::new(),
                ..a
            },
            b
        );
    }
    for seq in [1, 2] {
        assert_eq!(
            full.block_table(seq).unwrap(),
            lean.block_table(seq).unwrap()
        );
    }
    assert_eq!(full.stats(), lean.stats());
    lean.check_invariants().unwrap();
}

/// The table delta of each step: a decode that starts a block reports only it, a fork child
/// and a swapped-in table come whole, a copy-on-write reports from the rewritten block on, and
/// the version goes up by one per output that reports the table.
fn step_reports_block_table_deltas<M: OneGroup>() {
    let m: M = manager_with(16, 4, 8);
    m.add_sequence(1, &toks(0, 6), spec()).unwrap();
    let one = |seq: u64, tok: u32| StepRequest {
        seq_ids: vec![seq],
        num_new_tokens: vec![1],
        append_indptr: vec![0, 1],
        append_tokens: vec![tok],
    };
    let out = m.step(&StepRequest {
        seq_ids: vec![1],
        num_new_tokens: vec![6],
        ..Default::default()
    });
    assert_eq!(
        (
            out.table_start,
            out.table_version,
            out.table_delta_indptr,
            out.table_delta
        ),
        (vec![0], vec![1], vec![0, 2], vec![1, 2])
    );
    // Token 7 fills block 2: nothing changes in the table.
    let out = m.step(&one(1, 7));
    assert_eq!((out.table_start, out.table_delta), (vec![2], vec![]));
    m.fork(1, 2).unwrap();
    // Token 8 goes into the shared partial block 2: seq 1 copies it on write, so its delta
    // restarts at logical block 1; the child's whole table comes the first time.
    let out = m.step(&StepRequest {
        seq_ids: vec![1, 2],
        num_new_tokens: vec![1, 1],
        append_indptr: vec![0, 1, 2],
        append_tokens: vec![8, 9],
    });
    // One (group, src, dst) row: group 0, the shared block 2.
    assert_eq!(out.copies.len(), 3);
    assert_eq!(out.copies[..2], [0, 2]);
    let dst = out.copies[2];
    assert_eq!(out.table_start, vec![1, 0]);
    // The child's versions continue above every version reported before (2, its parent's).
    assert_eq!(out.table_version, vec![3, 3]);
    assert_eq!(out.table_delta, vec![dst, 1, 2]);
    // Block 2 of seq 2 is now full: its next token starts a block, reported alone.
    m.fork(2, 3).unwrap();
    let out = m.step(&one(2, 10));
    assert_eq!(out.table_start, vec![2]);
    assert_eq!(out.table_delta, out.new_block_ids);
    // Swap out and in: the table is rewritten with new GPU blocks, reported whole.
    m.swap_out(&[1]).unwrap();
    m.swap_in(&[1]).unwrap();
    let out = m.step(&one(1, 11));
    assert_eq!(out.table_start, vec![0]);
    assert_eq!(
        out.table_delta,
        m.block_table(1)
            .unwrap()
            .iter()
            .map(|&b| b as i32)
            .collect::<Vec<_>>()
    );
    assert_eq!(out.table_version, vec![4]);
    // Preemption clears it: the resumed prefill reports from 0 again.
    m.preempt_recompute(&[3]).unwrap();
    let out = m.step(&StepRequest {
        seq_ids: vec![3],
        num_new_tokens: vec![100],
        ..Default::default()
    });
    assert_eq!(out.table_start, vec![0]);
    assert_eq!(out.table_delta.len(), m.block_table(3).unwrap().len());
}

/// A freed sequence's id reused by a new sequence: the new one's table versions continue
/// above every version reported before, so a consumer still holding the old table under that
/// id can never take the new sequence's delta for the next version of the old one.
fn a_reused_id_never_repeats_a_table_version<M: OneGroup>() {
    let m: M = manager(32, 4);
    let one = |seq: u64, n: u32| StepRequest {
        seq_ids: vec![seq],
        num_new_tokens: vec![n],
        ..Default::default()
    };
    m.add_sequence(1, &toks(0, 6), spec()).unwrap();
    m.add_sequence(2, &toks(50, 6), spec()).unwrap();
    assert_eq!(m.step(&one(1, 3)).table_version, vec![1]);
    assert_eq!(m.step(&one(1, 3)).table_version, vec![2]);
    assert_eq!(m.step(&one(2, 6)).table_version, vec![1]);
    m.free(1);
    m.add_sequence(1, &toks(100, 6), spec()).unwrap();
    let out = m.step(&one(1, 3));
    assert_eq!((out.table_start, out.table_version), (vec![0], vec![3]));
    assert_eq!(m.step(&one(1, 3)).table_version, vec![4]);
    m.fork(2, 3).unwrap();
    m.append_tokens(3, &[7]).unwrap();
    assert_eq!(m.step(&one(3, 1)).table_version, vec![5]);
}

fn step_returns_exact_flat_arrays<M: OneGroup>() {
    let m: M = manager(16, 4);
    m.add_sequence(1, &toks(0, 6), spec()).unwrap();
    m.add_sequence(2, &toks(100, 3), spec()).unwrap();
    let out = m.step(&StepRequest {
        seq_ids: vec![1, 2],
        num_new_tokens: vec![6, 3],
        ..Default::default()
    });
    assert_eq!(out.error, None);
    assert_eq!(out.num_scheduled, 2);
    assert_eq!(out.num_cached_tokens, vec![0, 0]);
    assert_eq!(out.query_start_loc, vec![0, 6, 9]);
    assert_eq!(out.seq_lens, vec![6, 3]);
    assert_eq!(out.context_lens, vec![0, 0]);
    assert_eq!(out.slot_mapping, vec![4, 5, 6, 7, 8, 9, 12, 13, 14]);
    assert_eq!(out.block_table_row(0, 0), &[1, 2]);
    assert_eq!(out.block_table_row(0, 1), &[3, 0]);
    assert_eq!(out.new_block_indptr, vec![0, 2, 3]);
    assert_eq!(out.new_block_ids, vec![1, 2, 3]);
    assert!(out.copies.is_empty());
    assert_eq!(out.input_ids, vec![0, 1, 2, 3, 4, 5, 100, 101, 102]);
    assert_eq!(out.block_table_width, 2);
    assert_eq!(out.block_table, vec![1, 2, 3, 0]);

    let out = m.step(&StepRequest {
        seq_ids: vec![1, 2],
        num_new_tokens: vec![1, 1],
        append_indptr: vec![0, 1, 2],
        append_tokens: vec![100, 200],
    });
    assert_eq!(out.slot_mapping, vec![10, 15]);
    assert_eq!(out.input_ids, vec![100, 200]);
    assert_eq!(out.context_lens, vec![6, 3]);
    assert_eq!(out.seq_lens, vec![7, 4]);
    assert_eq!(out.new_block_indptr, vec![0, 0, 0]);
    assert_eq!(m.tokens(2).unwrap(), vec![100, 101, 102, 200]);

    // A failing sequence stops the batch and is left unchanged, appended tokens included.
    m.add_sequence(3, &toks(1000, 100), spec()).unwrap();
    let out = m.step(&StepRequest {
        seq_ids: vec![1, 3, 2],
        num_new_tokens: vec![1, 100, 1],
        append_indptr: vec![0, 1, 2, 3],
        append_tokens: vec![101, 300, 201],
    });
    assert_eq!(out.num_scheduled, 1);
    assert_eq!(
        out.error,
        Some(Error::OutOfBlocks {
            requested: 25,
            available: 12
        })
    );
    assert_eq!(out.slot_mapping, vec![11]);
    assert_eq!(out.query_start_loc, vec![0, 1]);
    assert_eq!(m.num_tokens(3).unwrap(), 100);
    assert_eq!(m.num_tokens(2).unwrap(), 4);
    assert_eq!(m.block_table(3).unwrap(), Vec::<BlockId>::new());

    // COW shows up in the copy arrays.
    m.fork(2, 4).unwrap();
    let out = m.step(&StepRequest {
        seq_ids: vec![4],
        num_new_tokens: vec![1],
        append_indptr: vec![0, 1],
        append_tokens: vec![7],
    });
    assert!(out.error.is_none(), "{:?}", out.error);
    // Seq 2 is [3] with 4 tokens (full block); appending to the child opens a new block.
    assert!(out.copies.is_empty());
    assert_eq!(out.new_block_ids, vec![4]);

    // Malformed requests schedule nothing.
    for bad in [
        StepRequest {
            seq_ids: vec![1],
            num_new_tokens: vec![],
            ..Default::default()
        },
        StepRequest {
            seq_ids: vec![1],
            num_new_tokens: vec![1],
            append_indptr: vec![0, 2],
            append_tokens: vec![1],
        },
        StepRequest {
            seq_ids: vec![1],
            num_new_tokens: vec![1],
            append_indptr: vec![],
            append_tokens: vec![1],
        },
    ] {
        let out = m.step(&bad);
        assert_eq!(out.num_scheduled, 0);
        assert!(
            matches!(out.error, Some(Error::InvalidArgument { .. })),
            "{:?}",
            out.error
        );
        assert_eq!(out.query_start_loc, vec![0]);
    }
    // A sequence scheduled twice in one step is rejected before anything changes.
    let before = (
        snapshot(&m),
        m.block_table(1).unwrap(),
        m.num_computed_tokens(1).unwrap(),
    );
    let out = m.step(&StepRequest {
        seq_ids: vec![1, 1],
        num_new_tokens: vec![4, 4],
        append_indptr: vec![0, 1, 2],
        append_tokens: vec![7, 8],
    });
    assert_eq!(out.num_scheduled, 0);
    assert_eq!(
        out.error.map(|e| e.to_string()).as_deref(),
        Some("invalid argument seq_ids = 1: sequence 1 appears more than once in one step")
    );
    assert_eq!(
        (
            snapshot(&m),
            m.block_table(1).unwrap(),
            m.num_computed_tokens(1).unwrap()
        ),
        before
    );
    let out = m.step(&StepRequest {
        seq_ids: vec![77],
        num_new_tokens: vec![1],
        ..Default::default()
    });
    assert_eq!(out.error, Some(Error::UnknownSequence { seq_id: 77 }));
    m.check_invariants().unwrap();
}

fn stats_usage_and_kv_utilization<M: OneGroup>() {
    let m: M = manager(16, 4);
    m.add_sequence(1, &toks(0, 6), spec()).unwrap();
    m.allocate_slots(1, 6).unwrap();
    let s = m.stats();
    assert_eq!(
        (s.used, s.free, s.cached_free, s.num_blocks, s.block_size),
        (2, 13, 0, 16, 4)
    );
    assert_eq!(s.usage, 2.0 / 15.0);
    assert_eq!(s.kv_utilization, 0.75);
    m.fork(1, 2).unwrap(); // shared blocks count once
    assert_eq!(m.stats().kv_utilization, 0.75);
    m.append_tokens(2, &[1]).unwrap();
    m.allocate_slots(2, 1).unwrap(); // COW: 3 blocks, 4 + 2 + 3 = 9 of 12 slots
    assert_eq!(m.stats().kv_utilization, 0.75);
    assert_eq!(m.stats().copies, 1);
    m.free(1);
    m.free(2);
    let s = m.stats();
    assert_eq!(
        (s.used, s.free, s.cached_free, s.kv_utilization),
        (0, 15, 1, 0.0)
    );
}

fn step_refused_as_a_whole_has_an_empty_dense_table<M: OneGroup>() {
    let m: M = manager(8, 4);
    m.add_sequence(1, &toks(0, 3), spec()).unwrap();
    let out = m.step(&StepRequest {
        seq_ids: vec![1, 1],
        num_new_tokens: vec![1, 1],
        ..Default::default()
    });
    assert_eq!(out.num_scheduled, 0);
    assert!(out.block_table.is_empty() && out.input_ids.is_empty());
    assert_eq!(out.block_table_width, 1);
}

fn num_uncomputed_tokens_per_sequence_in_every_state<M: OneGroup>() {
    let m: M = manager_with(16, 4, 8);
    m.add_sequence(1, &toks(0, 10), spec()).unwrap();
    m.add_sequence(2, &toks(100, 5), spec()).unwrap();
    m.allocate_slots(1, 6).unwrap();
    assert_eq!(m.num_uncomputed_tokens(&[1, 2]).unwrap(), vec![4, 5]);
    m.append_tokens(2, &[7, 8]).unwrap();
    m.allocate_slots(2, 7).unwrap();
    assert_eq!(m.num_uncomputed_tokens(&[2, 1]).unwrap(), vec![0, 4]);
    m.swap_out(&[1]).unwrap();
    assert_eq!(m.num_uncomputed_tokens(&[1]).unwrap(), vec![4]);
    m.preempt_recompute(&[2]).unwrap();
    assert_eq!(m.num_uncomputed_tokens(&[2]).unwrap(), vec![7]);
    assert_eq!(m.num_uncomputed_tokens(&[]).unwrap(), Vec::<i32>::new());
    assert_eq!(
        m.num_uncomputed_tokens(&[2, 9]),
        Err(Error::UnknownSequence { seq_id: 9 })
    );
}

/// `num_blocks_owed` equals what scheduling every uncomputed token of the group takes, for a
/// fresh group, a mid-prefill sequence, a forked pair sharing a partial block (one copy), a
/// preempted group re-admitted (siblings share the prompt blocks the first one registers) and a
/// swapped group (distinct CPU blocks).
fn num_blocks_owed_matches_what_scheduling_takes<M: OneGroup>() {
    let m: M = manager_with(32, 4, 16);
    // fresh sequence, 10 tokens: 3 blocks
    m.add_sequence(1, &toks(0, 10), spec()).unwrap();
    assert_eq!(m.num_blocks_owed(&[1]).unwrap(), 3);
    // mid-prefill: 5 of 10 computed (2 blocks held) -> 1 more
    m.allocate_slots(1, 5).unwrap();
    assert_eq!(m.num_blocks_owed(&[1]).unwrap(), 1);
    let free = m.pool().num_free();
    m.allocate_slots(1, 5).unwrap();
    assert_eq!(free - m.pool().num_free(), 1);
    assert_eq!(m.num_blocks_owed(&[1]).unwrap(), 0);

    // fork: both share a partial last block (10 tokens, 2 in block 3); one new token each.
    m.fork(1, 2).unwrap();
    m.append_tokens(1, &[50]).unwrap();
    m.append_tokens(2, &[51]).unwrap();
    // the first copies the shared block, the second then holds it alone
    assert_eq!(m.num_blocks_owed(&[1, 2]).unwrap(), 1);
    let free = m.pool().num_free();
    let out = m.step(&StepRequest {
        seq_ids: vec![1, 2],
        num_new_tokens: vec![1, 1],
        ..Default::default()
    });
    assert_eq!(out.error, None);
    assert_eq!(free - m.pool().num_free(), 1);

    // preempted group with the same 11-token prefix... the second reuses the 2 full blocks
    // the first registers (in use, so free to it) and needs its own third block.
    m.preempt_recompute(&[1, 2]).unwrap();
    let owed = m.num_blocks_owed(&[1, 2]).unwrap();
    let free = m.pool().num_free();
    let out = m.step(&StepRequest {
        seq_ids: vec![1, 2],
        num_new_tokens: vec![100, 100],
        ..Default::default()
    });
    assert_eq!(out.error, None);
    assert_eq!(owed, free - m.pool().num_free());
    assert_eq!(owed, 4);

    // swapped group: distinct CPU blocks (2 shared + 1 + 1)
    m.swap_out(&[1, 2]).unwrap();
    assert_eq!(m.num_blocks_owed(&[1, 2]).unwrap(), 4);
    let free = m.pool().num_free();
    m.swap_in(&[1, 2]).unwrap();
    assert_eq!(free - m.pool().num_free(), 4);

    // errors change nothing
    assert_eq!(
        m.num_blocks_owed(&[1, 3]),
        Err(Error::UnknownSequence { seq_id: 3 })
    );
    assert!(matches!(
        m.num_blocks_owed(&[1, 1]),
        Err(Error::InvalidArgument { arg: "seq_ids", .. })
    ));
    m.check_invariants().unwrap();
}

one_group_tests!(
    argument_errors_change_nothing,
    prefix_hit_is_capped_so_the_last_token_is_recomputed,
    prefix_lookup_happens_only_on_first_allocation,
    hits_on_free_cached_blocks_consume_capacity,
    chunked_prefill_then_decode,
    fork_allocates_nothing_and_increments_refs,
    preempt_recompute_keeps_hashes_and_resume_hits_own_prefix,
    a_request_preempted_before_its_first_allocation_still_counts_its_lookup,
    a_resume_after_preemption_is_not_a_new_prefix_lookup,
    reset_drops_the_hashes_of_swapped_out_blocks,
    swap_out_and_in_keep_group_sharing,
    swap_failures_are_all_or_nothing,
    reset_prefix_cache_refused_while_in_use,
    block_stored_events_carry_the_hash_chain,
    extra_keys_isolate_prefixes,
    multimodal_items_key_the_blocks_they_overlap,
    step_without_block_table_takes_the_same_blocks,
    step_without_token_arrays_takes_the_same_blocks,
    step_reports_block_table_deltas,
    a_reused_id_never_repeats_a_table_version,
    step_returns_exact_flat_arrays,
    stats_usage_and_kv_utilization,
    step_refused_as_a_whole_has_an_empty_dense_table,
    num_uncomputed_tokens_per_sequence_in_every_state,
    num_blocks_owed_matches_what_scheduling_takes,
);
