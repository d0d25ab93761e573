//! KV cache groups: `KvCacheManager` over full-attention, sliding-window and chunked-local
//! groups in one pool (docs/design.md, "KV cache groups").

use pagedkv_core::events::KvEvent;
use pagedkv_core::kv_groups::MAX_HIT_UNIT;
use pagedkv_core::manager::GroupEvent;
use pagedkv_core::{
    BlockHash, CacheConfig, Error, GroupSpec, HashAlgo, KvCacheManager, PrefixHasher, SequenceSpec,
    StepRequest, NULL_BLOCK,
};

const BS: u32 = 4;

/// Gemma-like: two sliding-window layers per full-attention layer.
fn cfg(num_blocks: u32, window: u32) -> CacheConfig {
    CacheConfig::with_groups(
        num_blocks,
        vec![
            GroupSpec::full(BS, 8),
            GroupSpec::sliding_window(BS, 8, window),
        ],
        vec![1, 1, 0, 1, 1, 0],
    )
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt * 1000 + 1).collect()
}

fn config_err(c: CacheConfig) -> (&'static str, String) {
    match KvCacheManager::new(c) {
        Err(Error::InvalidConfig { field, reason, .. }) => (field, reason),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[test]
fn bad_group_specs_are_refused_at_construction() {
    let mut c = cfg(16, 8);
    c.groups[1] = GroupSpec::sliding_window(BS, 16, 8); // page 64 bytes vs 32
    let (field, reason) = config_err(c);
    assert_eq!(field, "groups");
    assert!(reason.contains("same size"), "{reason}");
    // Different block sizes with equal pages share one pool.
    let mut c = cfg(16, 8);
    c.groups[1] = GroupSpec::sliding_window(8, 4, 8);
    assert_eq!(KvCacheManager::new(c).unwrap().hit_unit(), 8);

    let mut c = cfg(16, 8);
    c.groups[1] = GroupSpec::sliding_window(BS, 8, 0);
    assert!(config_err(c).1.contains("at least 1 token"));
    let mut c = cfg(16, 8);
    c.groups[1] = GroupSpec::chunked_local(BS, 8, 0);
    assert!(config_err(c).1.contains("chunk holds at least 1"));
    let mut c = cfg(16, 8);
    c.layer_groups.push(2);
    let (field, reason) = config_err(c);
    assert_eq!(field, "layer_groups");
    assert!(reason.contains("mapped to no group"), "{reason}");
    let mut c = cfg(16, 8);
    c.layer_groups = vec![0, 0];
    assert!(config_err(c).1.contains("without layers"));
    let mut c = cfg(16, 8);
    c.groups.clear();
    assert_eq!(config_err(c).0, "groups");
    let mut c = cfg(16, 8);
    c.retention_interval = 6;
    assert_eq!(config_err(c).0, "retention_interval");
    let mut c = cfg(1, 8);
    c.num_blocks = 1;
    assert_eq!(config_err(c).0, "num_blocks");
    // Block sizes whose LCM is absurd.
    let c = CacheConfig::with_groups(
        16,
        vec![
            GroupSpec::full(4093, 4091 * 4),
            GroupSpec::sliding_window(4091, 4093 * 4, 8),
        ],
        vec![0, 1],
    );
    const _: () = assert!(4091 * 4093 > MAX_HIT_UNIT);
    assert!(config_err(c).1.contains("least common multiple"));
}

#[test]
fn sliding_window_releases_blocks_no_query_can_read() {
    let mut c = cfg(64, 6);
    c.enable_prefix_caching = false;
    let m = KvCacheManager::new(c).unwrap();
    m.add_sequence(1, toks(3, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 3).unwrap();
    for step in 0..40 {
        m.append_tokens(1, &[5]).unwrap();
        let ctx = m.num_computed_tokens(1).unwrap();
        let a = m.allocate_slots(1, 1).unwrap();
        assert_eq!(a.num_context_tokens, ctx);
        let tables = m.block_tables(1).unwrap();
        // Full attention keeps everything.
        assert!(tables[0].iter().all(|&b| b != NULL_BLOCK));
        assert_eq!(tables[0].len(), (ctx + 1).div_ceil(4));
        // The window of the query at ctx is (ctx - 6, ctx]: blocks before (ctx - 5) / 4 are null.
        let first = (ctx + 1).saturating_sub(6) / 4;
        for (j, &b) in tables[1].iter().enumerate() {
            assert_eq!(
                b == NULL_BLOCK,
                j < first,
                "step {step} ctx {ctx} entry {j}"
            );
        }
        m.check_invariants().unwrap();
    }
    // Bounded by the window: at most ceil(6 / 4) + 1 blocks.
    assert!(m.num_blocks_held(1).unwrap()[1] <= 3);
    m.free(1);
    assert_eq!(m.pool().num_free(), 63);
    m.check_invariants().unwrap();
}

#[test]
fn chunked_local_releases_at_chunk_boundaries() {
    let mut c = CacheConfig::with_groups(
        64,
        vec![GroupSpec::full(BS, 8), GroupSpec::chunked_local(BS, 8, 8)],
        vec![0, 1],
    );
    c.enable_prefix_caching = false;
    let m = KvCacheManager::new(c).unwrap();
    m.add_sequence(1, toks(30, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 10).unwrap(); // tokens 0..10
    m.allocate_slots(1, 6).unwrap(); // ctx 10: chunk [8, 16): blocks 0, 1 released
    assert_eq!(m.block_tables(1).unwrap()[1][..2], [NULL_BLOCK, NULL_BLOCK]);
    assert_eq!(m.num_blocks_held(1).unwrap(), vec![4, 2]);
    m.allocate_slots(1, 1).unwrap(); // ctx 16: chunk [16, 24): blocks 2, 3 released
    assert_eq!(m.num_blocks_held(1).unwrap(), vec![5, 1]);
    m.check_invariants().unwrap();
}

#[test]
fn prefix_hit_is_what_every_group_serves() {
    let m = KvCacheManager::new(cfg(64, 8)).unwrap();
    let p = toks(33, 0);
    m.add_sequence(1, p.clone(), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 33).unwrap();
    m.free(1);
    m.add_sequence(2, p.clone(), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 32);
    let a = m.allocate_slots(2, 33).unwrap();
    assert_eq!(a.num_cached_tokens, 32);
    // The sliding group takes only the blocks the window of position 32 needs:
    // (32 - 8, 32] -> tokens 25..32 -> blocks 6, 7; entries before are null.
    let t = m.block_tables(2).unwrap();
    assert_eq!(t[1].iter().filter(|&&b| b != NULL_BLOCK).count(), 3);
    assert!(t[1][..6].iter().all(|&b| b == NULL_BLOCK));
    assert!(t[0].iter().all(|&b| b != NULL_BLOCK));
    m.check_invariants().unwrap();
}

#[test]
fn sparse_retention_serves_the_interval_points_and_shrinks_to_them() {
    let mut c = cfg(64, 8);
    c.retention_interval = 16;
    let m = KvCacheManager::new(c).unwrap();
    let p = toks(40, 0);
    m.add_sequence(1, p.clone(), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 24).unwrap();
    m.allocate_slots(1, 16).unwrap(); // ctx 24: window blocks before the keep point released
                                      // A request sharing 30 tokens while 1 still runs: full attention serves 28, the sliding
                                      // group lacks block 5 (not a retention block, released) -> 16 (blocks 2, 3 retained).
    let mut q = p[..30].to_vec();
    q.extend([9999, 9998]);
    m.add_sequence(2, q, SequenceSpec::default()).unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 16);
    m.check_invariants().unwrap();
}

/// vLLM #57610: a request that extends the same turn and diverges inside the last block of a
/// cached prompt must still hit (the latest replayable point is kept), also under sparse
/// retention.
#[test]
fn same_turn_extension_hits_under_sparse_retention() {
    for interval in [0, 64] {
        let mut c = cfg(64, 8);
        c.retention_interval = interval;
        let m = KvCacheManager::new(c).unwrap();
        let p = toks(38, 0);
        m.add_sequence(1, p.clone(), SequenceSpec::default())
            .unwrap();
        m.allocate_slots(1, 20).unwrap();
        m.allocate_slots(1, 18).unwrap();
        m.free(1);
        // Diverges at token 34, inside the last full block (32..36).
        let mut q = p[..34].to_vec();
        q.extend([4242, 4243, 4244]);
        m.add_sequence(2, q, SequenceSpec::default()).unwrap();
        assert_eq!(m.lookup_prefix(2).unwrap(), 32, "interval {interval}");
        // The whole prompt again: the last boundary.
        m.add_sequence(3, [p.clone(), vec![1]].concat(), SequenceSpec::default())
            .unwrap();
        assert_eq!(m.lookup_prefix(3).unwrap(), 36, "interval {interval}");
        m.check_invariants().unwrap();
    }
}

/// vLLM #48435: a long request's transient sliding-window blocks must not flush another
/// request's cached prefix. Dense retention caches every window block, so they push the first
/// request's blocks out of the LRU; a retention interval releases them uncached.
#[test]
fn transient_window_blocks_do_not_flush_cached_prefixes() {
    let hit_after_pressure = |interval: u32| {
        let mut c = cfg(70, 8);
        c.retention_interval = interval;
        let m = KvCacheManager::new(c).unwrap();
        let a = toks(49, 1);
        m.add_sequence(1, a.clone(), SequenceSpec::default())
            .unwrap();
        m.allocate_slots(1, 49).unwrap();
        m.free(1);
        // A long decode of another request: its window slides over 100 tokens.
        m.add_sequence(2, toks(9, 2), SequenceSpec::default())
            .unwrap();
        m.allocate_slots(2, 9).unwrap();
        for _ in 0..100 {
            m.append_tokens(2, &[3]).unwrap();
            m.allocate_slots(2, 1).unwrap();
        }
        m.check_invariants().unwrap();
        m.add_sequence(3, a, SequenceSpec::default()).unwrap();
        m.lookup_prefix(3).unwrap()
    };
    let (dense, sparse) = (hit_after_pressure(0), hit_after_pressure(16));
    eprintln!("hit after pressure: dense {dense}, sparse {sparse}");
    assert_eq!(sparse, 48);
    assert!(dense < 48, "{dense}");
}

#[test]
fn demand_is_exactly_what_the_call_takes_and_gives_back() {
    let m = KvCacheManager::new(cfg(24, 6)).unwrap();
    m.add_sequence(1, toks(21, 0), SequenceSpec::default())
        .unwrap();
    let d = m.num_blocks_needed(1, 21).unwrap();
    assert_eq!((d.take, d.release), (12, 0));
    let free0 = m.pool().num_free();
    m.allocate_slots(1, 21).unwrap();
    assert_eq!(free0 - m.pool().num_free(), 12);
    // The next chunk at ctx 21 reads from (21 - 6, 21]: blocks 0..4 of the window group go
    // back.
    m.append_tokens(1, &[1, 2, 3, 4]).unwrap();
    let d = m.num_blocks_needed(1, 4).unwrap();
    assert_eq!((d.take, d.release), (2, 4));
    assert_eq!(d.per_group, vec![(1, 0), (1, 4)]);
    let free0 = m.pool().num_free() as isize;
    m.allocate_slots(1, 4).unwrap();
    assert_eq!(free0 - m.pool().num_free() as isize, d.net());
    // Admission is exact: with take > free + release the call fails and changes nothing.
    m.add_sequence(2, toks(40, 3), SequenceSpec::default())
        .unwrap();
    let d = m.num_blocks_needed(2, 40).unwrap();
    assert!(d.take > m.pool().num_free());
    let before = (m.pool().free_queue(), m.block_tables(1).unwrap());
    match m.allocate_slots(2, 40) {
        Err(Error::OutOfBlocks {
            requested,
            available,
        }) => assert_eq!((requested, available), (d.take, m.pool().num_free())),
        other => panic!("{other:?}"),
    }
    assert_eq!(before, (m.pool().free_queue(), m.block_tables(1).unwrap()));
    m.check_invariants().unwrap();
}

#[test]
fn fork_and_copy_on_write_per_group() {
    let m = KvCacheManager::new(cfg(64, 6)).unwrap();
    m.add_sequence(1, toks(10, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 10).unwrap();
    m.fork(1, 2).unwrap();
    let t = m.block_tables(1).unwrap();
    assert_eq!(t, m.block_tables(2).unwrap());
    for &b in t.iter().flatten().filter(|&&b| b != NULL_BLOCK) {
        assert_eq!(m.pool().ref_count(b), 2);
    }
    m.append_tokens(2, &[77]).unwrap();
    let d = m.num_blocks_needed(2, 1).unwrap();
    // Both groups copy their shared partial last block (tokens 8..10).
    assert_eq!(d.take, 2);
    let a = m.allocate_slots(2, 1).unwrap();
    assert_eq!(
        a.groups[0].copies,
        vec![(t[0][2], a.groups[0].new_block_ids[0])]
    );
    assert_eq!(
        a.groups[1].copies,
        vec![(t[1][2], a.groups[1].new_block_ids[0])]
    );
    m.check_invariants().unwrap();
}

#[test]
fn swap_and_preemption_keep_every_group() {
    let mut c = cfg(64, 6);
    c.num_cpu_blocks = 32;
    let m = KvCacheManager::new(c).unwrap();
    m.add_sequence(1, toks(22, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 14).unwrap();
    m.allocate_slots(1, 8).unwrap();
    let before = m.block_tables(1).unwrap();
    let held: usize = m.num_blocks_held(1).unwrap().iter().sum();
    let out = m.swap_out(&[1]).unwrap();
    assert_eq!(out.len(), held);
    assert_eq!(m.pool().num_free(), 63);
    let back = m.swap_in(&[1]).unwrap();
    assert_eq!(back.len(), held);
    let after = m.block_tables(1).unwrap();
    for (b, a) in before.iter().zip(&after) {
        assert_eq!(b.len(), a.len());
        for (x, y) in b.iter().zip(a) {
            assert_eq!(*x == NULL_BLOCK, *y == NULL_BLOCK);
        }
    }
    m.check_invariants().unwrap();
    m.preempt_recompute(&[1]).unwrap();
    assert_eq!(m.num_blocks_held(1).unwrap(), vec![0, 0]);
    m.append_tokens(1, &[1]).unwrap();
    let a = m.allocate_slots(1, 100).unwrap();
    assert_eq!(a.num_cached_tokens, 20);
    m.check_invariants().unwrap();
}

#[test]
fn events_name_their_group_and_full_attention_hashes_are_the_plain_chain() {
    let mut c = cfg(65, 8);
    c.enable_events = true;
    let m = KvCacheManager::new(c).unwrap();
    let p = toks(13, 0);
    m.add_sequence(1, p.clone(), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 13).unwrap();
    let ev = m.take_events();
    let stored = |g: u32| -> Vec<_> {
        ev.iter()
            .filter(|e| e.group == Some(g))
            .flat_map(|e| match &e.event {
                KvEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
                _ => vec![],
            })
            .collect()
    };
    // What a router computes from the tokens alone (default seed, no extra keys).
    let hasher = PrefixHasher::new(HashAlgo::Sha256, &[]);
    let bs = BS as usize;
    let mut want: Vec<BlockHash> = Vec::new();
    for k in 0..13 / bs {
        let h = hasher.hash_block(want.last(), &p[k * bs..(k + 1) * bs], &[]);
        want.push(h);
    }
    assert_eq!(want.len(), 3);
    assert_eq!(stored(0), want);
    assert_eq!(stored(1), want); // same plain hashes, other group
                                 // Keys differ per group: the pool holds 6 distinct hashes, none shared between groups.
    let t = m.block_tables(1).unwrap();
    let keys: std::collections::HashSet<_> = t
        .iter()
        .flat_map(|r| r[..3].iter().map(|&b| m.pool().block_hash(b).unwrap()))
        .collect();
    assert_eq!(keys.len(), 6);
    // Eviction names the group too.
    m.free(1);
    m.add_sequence(2, toks(128, 5), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(2, 128).unwrap();
    let removed: Vec<GroupEvent> = m
        .take_events()
        .into_iter()
        .filter(|e| matches!(e.event, KvEvent::BlockRemoved { .. }))
        .collect();
    let mut gone: Vec<(u32, usize)> = removed
        .iter()
        .map(|e| match &e.event {
            KvEvent::BlockRemoved { block_hashes, .. } => (e.group.unwrap(), block_hashes.len()),
            _ => unreachable!(),
        })
        .collect();
    gone.sort();
    // Every cached block of both groups was evicted: 3 plain hashes per group.
    let per_group = |g: u32| gone.iter().filter(|x| x.0 == g).map(|x| x.1).sum::<usize>();
    assert_eq!((per_group(0), per_group(1)), (3, 3), "{removed:?}");
    let removed_hashes: Vec<_> = removed
        .iter()
        .filter(|e| e.group == Some(0))
        .flat_map(|e| match &e.event {
            KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.clone(),
            _ => vec![],
        })
        .collect();
    let mut sorted_want = want.clone();
    sorted_want.sort();
    let mut sorted_got = removed_hashes;
    sorted_got.sort();
    assert_eq!(sorted_got, sorted_want);
}

#[test]
fn step_returns_every_groups_slots_and_tables() {
    let m = KvCacheManager::new(cfg(64, 6)).unwrap();
    m.add_sequence(1, toks(10, 0), SequenceSpec::default())
        .unwrap();
    m.add_sequence(2, toks(5, 1), SequenceSpec::default())
        .unwrap();
    let out = m.step(&StepRequest {
        seq_ids: vec![1, 2],
        num_new_tokens: vec![10, 5],
        ..Default::default()
    });
    assert!(out.error.is_none());
    assert_eq!(out.num_groups, 2);
    assert_eq!(out.slot_mapping.len(), 2 * 15);
    let w = out.block_table_width;
    assert_eq!(w, 3);
    assert_eq!(out.block_table.len(), 2 * 2 * w);
    let tables = m.block_tables(1).unwrap();
    for (g, table) in tables.iter().enumerate() {
        let row = &out.block_table[(g * 2) * w..(g * 2 + 1) * w];
        assert_eq!(row, table.iter().map(|&b| b as i32).collect::<Vec<_>>());
        // Slot of token 9 of seq 1 in group g.
        assert_eq!(out.slot_mapping[g * 15 + 9], i64::from(table[2]) * 4 + 1);
    }
    // A duplicate id schedules nothing.
    let bad = m.step(&StepRequest {
        seq_ids: vec![1, 1],
        num_new_tokens: vec![1, 1],
        ..Default::default()
    });
    assert_eq!(bad.num_scheduled, 0);
    assert!(matches!(bad.error, Some(Error::InvalidArgument { .. })));
}

/// `num_blocks_owed` sees what the earlier members do to the pool: here the first member's
/// fresh blocks evict a cached block of the second member's prefix, which shortens the second
/// member's hit and makes its sliding-window group allocate one more block.
#[test]
fn owed_follows_evictions_by_earlier_members() {
    let m = KvCacheManager::new(cfg(22, 8)).unwrap();
    let a = toks(33, 0);
    m.add_sequence(1, a.clone(), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 33).unwrap();
    m.free(1);
    m.add_sequence(2, toks(12, 1), SequenceSpec::default())
        .unwrap();
    m.add_sequence(3, a, SequenceSpec::default()).unwrap();
    assert_eq!(m.lookup_prefix(3).unwrap(), 32);
    let owed = m.num_blocks_owed(&[2, 3]).unwrap();
    let free0 = m.pool().num_free();
    m.allocate_slots(2, 12).unwrap();
    assert_eq!(m.lookup_prefix(3).unwrap(), 28);
    let a3 = m.allocate_slots(3, 33).unwrap();
    assert_eq!(a3.num_cached_tokens, 28);
    assert_eq!(free0 - m.pool().num_free(), owed);
    assert_eq!(owed, 19);
    m.check_invariants().unwrap();
}

/// A reset drops every prefix hash of every group, those of blocks swapped out to the CPU
/// pool included: the swapped-in KV predates the reset, so swap-in neither registers nor
/// announces it again, nor the blocks its decode fills later; a new request with the same
/// prompt misses. A recompute preemption computes the KV afresh and caches it again.
#[test]
fn reset_drops_the_hashes_of_swapped_out_blocks_in_every_group() {
    let mut c = cfg(64, 8);
    c.num_cpu_blocks = 32;
    c.enable_events = true;
    let m = KvCacheManager::new(c).unwrap();
    let p = toks(18, 0);
    m.add_sequence(1, p.clone(), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 18).unwrap();
    m.swap_out(&[1]).unwrap();
    m.reset_prefix_cache().unwrap();
    let ev = m.take_events();
    assert_eq!(
        ev.last().map(|e| &e.event),
        Some(&KvEvent::AllBlocksCleared)
    );
    m.swap_in(&[1]).unwrap();
    assert_eq!(m.take_events(), vec![]);
    assert!((0..64).all(|b| m.pool().block_hash(b).is_none()));
    m.add_sequence(2, p.clone(), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 0);
    m.check_invariants().unwrap();
    // Its decode fills block 4 of each group: what request 2 owes after it counts no hit on
    // request 1's blocks (5 fresh blocks per group), and nothing is cached or announced.
    m.append_tokens(1, &[90, 91, 92]).unwrap();
    assert_eq!(m.num_blocks_owed(&[1, 2]).unwrap(), 10);
    m.allocate_slots(1, 3).unwrap();
    assert_eq!(m.take_events(), vec![]);
    assert!((0..64).all(|b| m.pool().block_hash(b).is_none()));
    m.check_invariants().unwrap();
    // Out and back again: nothing; freeing it caches nothing either.
    m.swap_out(&[1]).unwrap();
    m.swap_in(&[1]).unwrap();
    assert_eq!(m.take_events(), vec![]);
    m.fork(1, 3).unwrap();
    m.free(3);
    assert_eq!(m.take_events(), vec![]);
    m.check_invariants().unwrap();
    // A recompute preemption computes the KV again: cached and announced as usual.
    m.preempt_recompute(&[1]).unwrap();
    m.allocate_slots(1, 100).unwrap();
    assert!(!m.take_events().is_empty());
    assert_eq!(m.lookup_prefix(2).unwrap(), 16);
    m.check_invariants().unwrap();
    // A sequence swapped out after the reset is cached again on swap-in as usual.
    m.swap_out(&[1]).unwrap();
    m.swap_in(&[1]).unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 16);
    m.check_invariants().unwrap();
}

/// `num_blocks_owed` resolves a key that an earlier member registers again as the pool's
/// lookup does: the oldest in-use holder wins. Here request 1 (decoding, not first) fills and
/// registers blocks whose keys request 2's window blocks already carry; request 3's hit on
/// key 13 takes request 2's block (ref 2), so request 2's out-of-window release of it at its
/// next allocation frees nothing. Counting the hit on request 1's new block instead predicted
/// that release and owed one block too few (proptest hybrid_model, layout 2).
#[test]
fn owed_hits_the_oldest_in_use_holder_of_a_key_registered_again() {
    let mut c = CacheConfig::with_groups(64, vec![GroupSpec::sliding_window(2, 8, 5)], vec![0]);
    c.retention_interval = 4;
    let m = KvCacheManager::new(c).unwrap();
    let p = toks(32, 0);
    let with = |tail: &[u32]| [&p[..], tail].concat();
    m.add_sequence(1, with(&[1]), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 1).unwrap();
    m.add_sequence(2, with(&[2, 3]), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(2, 32).unwrap();
    m.allocate_slots(2, 2).unwrap();
    m.append_tokens(2, &[4]).unwrap();
    m.add_sequence(3, [&p[..28], &[5]].concat(), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(3).unwrap(), 28);
    let b13 = m.block_tables(2).unwrap()[0][13];
    assert_ne!(b13, NULL_BLOCK);
    // 16 fresh blocks for request 1, 1 for request 3 (a 28-token hit), 1 for request 2.
    let owed = m.num_blocks_owed(&[1, 3, 2]).unwrap();
    let free0 = m.pool().num_free();
    m.allocate_slots(1, 32).unwrap();
    let a3 = m.allocate_slots(3, 29).unwrap();
    assert_eq!(a3.num_cached_tokens, 28);
    assert_eq!(m.block_tables(3).unwrap()[0][13], b13);
    let a2 = m.allocate_slots(2, 1).unwrap();
    assert_eq!(a2.groups[0].released, vec![b13]);
    assert_eq!(m.pool().ref_count(b13), 1);
    assert_eq!(free0 - m.pool().num_free(), 18);
    assert_eq!(owed, 18);
    m.check_invariants().unwrap();
}

/// `num_blocks_owed` releases an earlier member's out-of-window blocks tail first, as the call
/// does: the LRU order decides which cached block that member's fresh blocks evict. Request
/// 1 releases logical blocks 0..6 and takes 11 fresh blocks, one more than the uncached ones,
/// so it evicts its own block 5 (released first); request 2's hit shrinks from 14 to 10
/// tokens. Releasing them head first evicted block 0 in the simulation, kept the 14-token
/// hit and owed 7 where scheduling took 10 (proptest hybrid_model, layout 2).
#[test]
fn owed_releases_out_of_window_blocks_tail_first() {
    let mut c = CacheConfig::with_groups(19, vec![GroupSpec::sliding_window(2, 8, 5)], vec![0]);
    c.retention_interval = 0;
    let m = KvCacheManager::new(c).unwrap();
    let p = toks(37, 0);
    m.add_sequence(1, p.clone(), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 16).unwrap();
    m.add_sequence(2, [&p[..14], &[9]].concat(), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 14);
    let owed = m.num_blocks_owed(&[1, 2]).unwrap();
    let free0 = m.pool().num_free();
    assert_eq!(free0, 10);
    let a1 = m.allocate_slots(1, 21).unwrap();
    assert_eq!(a1.groups[0].released.len(), 6);
    assert_eq!(a1.groups[0].new_block_ids.len(), 11);
    assert_eq!(m.lookup_prefix(2).unwrap(), 10);
    let a2 = m.allocate_slots(2, 15).unwrap();
    assert_eq!(a2.num_cached_tokens, 10);
    assert_eq!(free0 - m.pool().num_free(), 10);
    assert_eq!(owed, 10);
    m.check_invariants().unwrap();
}

/// `num_blocks_owed` finds a key that two blocks carry in its other holder when an earlier
/// member evicts the oldest one, as the pool's lookup does. Requests 1 and 2 computed the same
/// prompt (2 not as a prefix hit), so each key has two free cached holders, request 1's
/// older; request 3's fresh blocks evict request 1's blocks 7 and 6, and request 4's 16-token
/// hit takes request 2's (2 hits + 1 fresh). Taking the oldest holder as the only one saw a
/// miss and shrank the hit to 12 tokens (2 hits + 3 fresh): owed 17 where scheduling took 15
/// (proptest hybrid_model, layout 1).
#[test]
fn owed_finds_a_key_in_its_other_holder_after_an_eviction() {
    let mut c = CacheConfig::with_groups(27, vec![GroupSpec::sliding_window(2, 8, 5)], vec![0]);
    c.retention_interval = 0;
    let m = KvCacheManager::new(c).unwrap();
    let p = toks(17, 0);
    for id in [1, 2, 4] {
        m.add_sequence(id, p.clone(), SequenceSpec::default())
            .unwrap();
    }
    m.allocate_slots(2, 1).unwrap();
    m.allocate_slots(1, 17).unwrap();
    m.allocate_slots(2, 16).unwrap();
    let theirs = m.block_tables(2).unwrap()[0].clone();
    m.free(1);
    m.free(2);
    m.add_sequence(3, toks(24, 5), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.pool().num_cached_free(), 16);
    let owed = m.num_blocks_owed(&[3, 4]).unwrap();
    let free0 = m.pool().num_free();
    m.allocate_slots(3, 24).unwrap();
    let a4 = m.allocate_slots(4, 17).unwrap();
    assert_eq!(a4.num_cached_tokens, 16);
    assert_eq!(m.block_tables(4).unwrap()[0][6..8], theirs[6..8]);
    assert_eq!(free0 - m.pool().num_free(), 15);
    assert_eq!(owed, 15);
    m.check_invariants().unwrap();
}

#[test]
fn stats_count_lookups_copies_swaps_and_preemptions_as_the_one_group_manager() {
    let mut c = cfg(64, 6);
    c.num_cpu_blocks = 32;
    let m = KvCacheManager::new(c).unwrap();
    m.add_sequence(1, toks(10, 0), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.num_uncomputed_tokens(&[1]).unwrap(), vec![10]);
    m.allocate_slots(1, 10).unwrap();
    assert_eq!(m.num_uncomputed_tokens(&[1]).unwrap(), vec![0]);
    assert!(m.num_uncomputed_tokens(&[1, 9]).is_err());
    // A second request with the same 10 tokens hits the two full blocks of every group.
    m.add_sequence(2, toks(10, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(2, 10).unwrap();
    let s = m.stats();
    assert_eq!((s.prefix_queries_tokens, s.prefix_hits_tokens), (20, 8));
    assert_eq!(s.used, m.pool().num_used());
    assert_eq!(s.used + s.free, 63);
    // Fork + divergent write: one copy per group with a shared partial last block.
    m.fork(1, 3).unwrap();
    m.append_tokens(3, &[77]).unwrap();
    m.allocate_slots(3, 1).unwrap();
    assert_eq!(m.stats().copies, 2);
    // The child's first lookup was its parent's: not counted again.
    assert_eq!(m.stats().prefix_queries_tokens, 20);
    // Swap-out counts distinct blocks and one preemption per member; swap-in the blocks back.
    let held: usize = m.num_blocks_held(2).unwrap().iter().sum();
    let out = m.swap_out(&[2]).unwrap();
    let s = m.stats();
    assert_eq!((s.swaps_out_blocks, s.preemptions), (out.len() as u64, 1));
    assert_eq!(s.cpu_used, held);
    assert_eq!(m.num_blocks_held(2).unwrap().iter().sum::<usize>(), held); // CPU blocks
    m.swap_in(&[2]).unwrap();
    assert_eq!(m.stats().swaps_in_blocks, out.len() as u64);
    // Recompute preemption: one per running member; the resume's lookup is not counted.
    m.preempt_recompute(&[1, 3]).unwrap();
    assert_eq!(m.stats().preemptions, 3);
    m.preempt_recompute(&[1]).unwrap(); // already preempted: nothing more
    assert_eq!(m.stats().preemptions, 3);
    m.allocate_slots(1, 100).unwrap();
    let s = m.stats();
    assert_eq!((s.prefix_queries_tokens, s.prefix_hits_tokens), (20, 8));
    assert!(s.kv_utilization > 0.0 && s.kv_utilization <= 1.0);
    m.check_invariants().unwrap();
}

/// A window group out of the prefix cache (`GroupSpec::uncached`): the hit is the full
/// group's, the window gets fresh blocks for the hit's window (null below), never registers a
/// block, and a first allocation of 0 tokens adopts the hit alone.
#[test]
fn uncached_window_group_takes_fresh_blocks_for_the_hit() {
    let c = CacheConfig::with_groups(
        64,
        vec![
            GroupSpec::full(BS, 8),
            GroupSpec::sliding_window(BS, 8, 8).uncached(),
        ],
        vec![0, 1],
    );
    let m = KvCacheManager::new(c).unwrap();
    let p = toks(26, 0); // 6 full blocks: hit 24
    m.add_sequence(0, p.clone(), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(0, 26).unwrap();
    let a = m.block_tables(0).unwrap();
    assert!(a[1]
        .iter()
        .all(|&b| b == NULL_BLOCK || !m.pool().is_hashed(b)));
    assert!(a[0][..6].iter().all(|&b| m.pool().is_hashed(b)));
    m.add_sequence(1, p, SequenceSpec::default()).unwrap();
    assert_eq!(m.lookup_prefix(1).unwrap(), 24);
    assert_eq!(m.lookup_prefix_group(1, 1, 26).unwrap(), 0);
    let out = m.allocate_slots(1, 0).unwrap();
    assert_eq!((out.num_cached_tokens, out.num_context_tokens), (24, 24));
    let b = m.block_tables(1).unwrap();
    assert_eq!(b[0], a[0][..6].to_vec());
    // The window of position 24 reads 17..=24: blocks 4 and 5 fresh, 0..4 null.
    assert_eq!(b[1][..4], [NULL_BLOCK; 4]);
    assert_eq!(b[1].len(), 6);
    assert!(b[1][4..]
        .iter()
        .all(|&x| x != NULL_BLOCK && !a[1].contains(&x)));
    m.allocate_slots(1, 2).unwrap();
    let b = m.block_tables(1).unwrap();
    assert!(b[1]
        .iter()
        .all(|&x| x == NULL_BLOCK || !m.pool().is_hashed(x)));
    m.check_invariants().unwrap();
    // A full group cannot be left out; nor can every group.
    let mut c = cfg(16, 8);
    c.groups[0] = GroupSpec::full(BS, 8).uncached();
    assert_eq!(config_err(c).0, "prefix_cacheable");
    let c = CacheConfig::with_groups(
        16,
        vec![GroupSpec::sliding_window(BS, 8, 8).uncached()],
        vec![0],
    );
    assert_eq!(config_err(c).0, "prefix_cacheable");
}
