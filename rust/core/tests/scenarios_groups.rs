//! Regression scenarios S1 to S5, S7 and S8 (docs/design.md, "Regression scenarios") on
//! the KV cache manager (`KvCacheManager`): with the prefix cache's host tier, the step's
//! admission watermark (`reserve_blocks`) and per-group block-table deltas. Exact values.

use pagedkv_core::host_tier::HostEviction;
use pagedkv_core::manager::StepOptions;
use pagedkv_core::{
    BlockHash, BlockId, CacheConfig, Error, GroupSpec, KvCacheManager, SeqStatus, SequenceSpec,
    StepDrafts, StepRequest, NULL_BLOCK,
};
use std::collections::HashMap;

const BS: u32 = 4;
/// Window 5: a hit at `p` needs the one block before `p`.
const W: u32 = 5;

/// Full attention (group 0) and a sliding window of 5 (group 1), block size 4, events on.
fn manager(num_blocks: u32, host: u32) -> KvCacheManager {
    manager_evicting(num_blocks, host, HostEviction::Lru)
}

/// [`manager`] with the host tier's eviction policy.
fn manager_evicting(num_blocks: u32, host: u32, eviction: HostEviction) -> KvCacheManager {
    let mut c = CacheConfig::with_groups(
        num_blocks,
        vec![GroupSpec::full(BS, 8), GroupSpec::sliding_window(BS, 8, W)],
        vec![1, 1, 0],
    );
    c.num_host_blocks = host;
    c.host_admission_min_seen = 1;
    c.num_cpu_blocks = 32;
    c.enable_events = true;
    c.host_eviction = eviction;
    KvCacheManager::new(c).unwrap()
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt * 1000 + 1).collect()
}

type Snapshot = (Vec<u32>, Vec<Option<BlockHash>>, Vec<BlockId>);

/// Every observable bit of pool state: ref counts, hashes, free-queue order.
fn snapshot(m: &KvCacheManager) -> Snapshot {
    let p = m.pool();
    let n = p.num_blocks();
    (
        (0..n).map(|b| p.ref_count(b)).collect(),
        (0..n).map(|b| p.block_hash(b)).collect(),
        p.free_queue(),
    )
}

/// An empty step (the executor ran the previous plans): its host `(stores, loads)` row counts.
fn host_step(m: &KvCacheManager) -> (usize, usize) {
    let out = m.step(&StepRequest::default());
    assert!(out.error.is_none());
    // S8: a store never reads, a load never writes, the null block.
    assert!(out.host_stores.chunks(3).all(|r| r[1] != NULL_BLOCK as i32));
    assert!(out.host_loads.chunks(3).all(|r| r[2] != NULL_BLOCK as i32));
    (out.host_stores.len() / 3, out.host_loads.len() / 3)
}

/// Seq 1 computes A = `toks(13, 1)` (three full blocks per group), is freed; seq 2 computes 13
/// other tokens in the 8 usable blocks, evicting A's six cached blocks to the host, and is
/// freed. The stores are handed out.
fn a_on_host(m: &KvCacheManager) {
    m.add_sequence(1, toks(13, 1), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 13).unwrap();
    host_step(m);
    m.free(1);
    m.add_sequence(2, toks(13, 2), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(2, 13).unwrap();
    m.free(2);
    assert_eq!(host_step(m), (6, 0));
    assert_eq!(m.stats().host_used, 6);
}

/// S1 with the host tier: an allocation that would load A's blocks from the host and fails
/// for want of device blocks leaves the pool, the host tier, the stats and the events as they
/// were, plans no store or load, and the retry after the blocker is freed loads them.
#[test]
fn s1_failed_allocation_with_host_hits_leaks_nothing() {
    let m = manager(9, 16);
    a_on_host(&m);
    // Blocker D: 8 tokens = 2 blocks per group (its window group keeps both: 4 taken).
    m.add_sequence(4, toks(8, 4), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(4, 8).unwrap();
    assert_eq!(m.pool().num_free(), 4);
    // D's blocks evicted two of seq 2's cached ones: stored to the host too.
    assert_eq!(host_step(&m), (2, 0));
    // C = A's 13 tokens + 4: hit 12 on the host; full attention 3 loads + 2 fresh, the window
    // (queries 12..17 read from 8) 1 load + 2 fresh: 8 > 4 free.
    m.add_sequence(3, toks(17, 1), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(3).unwrap(), 12);
    let d = m.num_blocks_needed(3, 17).unwrap();
    assert_eq!((d.take, d.release), (8, 0));
    assert_eq!(d.per_group, vec![(5, 0), (3, 0)]);
    m.take_events();
    let before = snapshot(&m);
    let stats = m.stats();
    let err = m.allocate_slots(3, 17).unwrap_err();
    assert_eq!(
        err,
        Error::OutOfBlocks {
            requested: 8,
            available: 4
        }
    );
    assert_eq!(snapshot(&m), before, "pool changed by a failed call");
    assert_eq!(m.stats(), stats, "stats changed by a failed call");
    assert!(m.take_events().is_empty());
    assert_eq!(m.block_tables(3).unwrap(), vec![Vec::<BlockId>::new(); 2]);
    assert_eq!(m.num_computed_tokens(3).unwrap(), 0);
    m.check_invariants().unwrap();
    assert_eq!(host_step(&m), (0, 0), "a failed call planned host copies");
    // The same through the step, and with a watermark that the take alone would pass.
    let req = StepRequest {
        seq_ids: vec![3],
        num_new_tokens: vec![17],
        ..Default::default()
    };
    let out = m.step(&req);
    assert_eq!(
        (out.num_scheduled, out.error.clone()),
        (
            0,
            Some(Error::OutOfBlocks {
                requested: 8,
                available: 4
            })
        )
    );
    assert!(out.host_loads.is_empty() && out.host_stores.is_empty());
    assert_eq!(snapshot(&m), before);
    assert_eq!(m.stats(), stats);
    // D still decodes (a new block per group; the window group releases its block 0).
    m.append_tokens(4, &[99]).unwrap();
    let a = m.allocate_slots(4, 1).unwrap();
    assert_eq!(
        a.groups
            .iter()
            .map(|g| g.new_block_ids.len())
            .sum::<usize>(),
        2
    );
    assert_eq!(a.groups[1].released.len(), 1);
    assert!(m.free(4));
    m.check_invariants().unwrap();
    host_step(&m);
    // Retry of C with a watermark: 8 fit the 8 free blocks, 8 + 1 do not.
    let opts = StepOptions {
        reserve_blocks: 1,
        ..Default::default()
    };
    let before = snapshot(&m);
    let stats = m.stats();
    let out = m.step_with(&req, &StepDrafts::default(), opts);
    assert_eq!(
        out.error,
        Some(Error::OutOfBlocks {
            requested: 9,
            available: 8
        })
    );
    assert_eq!(snapshot(&m), before, "a refused watermark changed the pool");
    assert_eq!(m.stats(), stats);
    assert!(out.host_loads.is_empty());
    // Without the watermark C is served: 12 tokens from the host, 4 loads.
    let out = m.step_with(&req, &StepDrafts::default(), StepOptions::default());
    assert_eq!((out.num_scheduled, out.error), (1, None));
    assert_eq!(out.num_cached_tokens, vec![12]);
    assert_eq!(m.pool().num_free(), 0);
    // The step hands out its own loads.
    assert_eq!(out.host_loads.len() / 3, 4);
    assert!(out.host_loads.chunks(3).all(|r| r[2] != NULL_BLOCK as i32));
    assert_eq!(m.stats().host_loads_blocks, 4);
    m.check_invariants().unwrap();
}

/// A tiny xorshift so the workloads are fixed.
fn rng(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut s = seed;
    move |n| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s % n
    }
}

/// Applies one step output's deltas to `kept` (per sequence, per group) and checks them
/// against the manager's tables (S8 in the deltas: the null block only where a window released
/// an entry, never a full-attention entry or a new block).
fn apply_deltas(
    m: &KvCacheManager,
    ids: &[u64],
    out: &pagedkv_core::StepOutput,
    kept: &mut HashMap<u64, (u64, Vec<Vec<i32>>)>,
) {
    let g = out.num_groups;
    assert!(out.new_block_ids.iter().all(|&b| b != NULL_BLOCK as i32));
    assert!(out.copies.chunks(3).all(|r| r[1] != 0 && r[2] != 0));
    assert!(out.host_stores.chunks(3).all(|r| r[1] != 0));
    assert!(out.host_loads.chunks(3).all(|r| r[2] != 0));
    for (k, id) in ids.iter().take(out.num_scheduled).enumerate() {
        let version = out.table_version[k];
        let (v, tables) = kept
            .entry(*id)
            .or_insert_with(|| (version - 1, vec![Vec::new(); g]));
        assert_eq!(*v + 1, version, "seq {id}: versions skip");
        *v = version;
        for (gi, table) in tables.iter_mut().enumerate() {
            let e = k * g + gi;
            let start = out.table_start[e] as usize;
            let (lo, hi) = (
                out.table_delta_indptr[e] as usize,
                out.table_delta_indptr[e + 1] as usize,
            );
            assert!(
                start <= table.len(),
                "seq {id} group {gi}: start {start} past the kept table"
            );
            table.truncate(start);
            table.extend_from_slice(&out.table_delta[lo..hi]);
        }
        let want = m.block_tables(*id).unwrap();
        for (gi, table) in tables.iter().enumerate() {
            let w: Vec<i32> = want[gi].iter().map(|&b| b as i32).collect();
            assert_eq!(table, &w, "seq {id} group {gi} delta");
            if gi == 0 {
                assert!(!table.contains(&0), "null block in a full-attention table");
            } else {
                // Null entries only as a released prefix.
                let live = table.iter().position(|&b| b != 0).unwrap_or(table.len());
                assert!(table[live..].iter().all(|&b| b != 0), "{table:?}");
            }
        }
    }
}

/// S3 (and S8 in the deltas) with the host tier: random prefills, decodes, chunks of
/// 4/8/12/16, prefix hits on free cached device blocks and on host blocks, forks, frees and
/// swap preemptions; predicted `take - release` == the change of the free pool, every time,
/// through `allocate_slots` and through `step_with` (watermark, no dense tables or token
/// arrays), whose kept tables from the deltas equal the manager's.
#[test]
fn s3_capacity_check_predicts_exactly_what_is_taken_with_host_loads_and_deltas() {
    for eviction in HostEviction::ALL {
        s3_workload(eviction);
    }
}

fn s3_workload(eviction: HostEviction) {
    let m = manager_evicting(20, 12, eviction);
    let mut next = rng(0x2545_f491);
    let mut live: Vec<u64> = Vec::new();
    let mut kept: HashMap<u64, (u64, Vec<Vec<i32>>)> = HashMap::new();
    let mut next_id = 10u64;
    let (mut checked, mut via_step, mut host_hits, mut refused) = (0, 0, 0, 0);
    for _ in 0..2500 {
        match next(8) {
            0 | 1 if live.len() < 5 => {
                let len = 1 + next(24) as usize;
                m.add_sequence(next_id, toks(len, next(3) as u32), SequenceSpec::default())
                    .unwrap();
                live.push(next_id);
                next_id += 1;
            }
            2 if !live.is_empty() => {
                let id = live.swap_remove(next(live.len() as u64) as usize);
                assert!(m.free(id));
                kept.remove(&id);
            }
            3 if !live.is_empty() && live.len() < 7 => {
                let parent = live[next(live.len() as u64) as usize];
                if m.status(parent).unwrap() == SeqStatus::Running {
                    m.fork(parent, next_id).unwrap();
                    live.push(next_id);
                    next_id += 1;
                }
            }
            4 if !live.is_empty() => {
                let id = live[next(live.len() as u64) as usize];
                let running = m.status(id).unwrap() == SeqStatus::Running;
                if running && m.num_blocks_held(id).unwrap().iter().sum::<usize>() > 0 {
                    let before = snapshot(&m);
                    match m.swap_out(&[id]) {
                        Ok(_) => {
                            kept.remove(&id);
                        }
                        Err(Error::OutOfSwapSpace { .. }) => assert_eq!(snapshot(&m), before),
                        Err(e) => panic!("{e}"),
                    }
                } else if m.status(id).unwrap() == SeqStatus::Swapped {
                    let _ = m.swap_in(&[id]);
                }
            }
            _ if !live.is_empty() => {
                let id = live[next(live.len() as u64) as usize];
                if m.status(id).unwrap() == SeqStatus::Swapped {
                    continue;
                }
                let left = m.num_tokens(id).unwrap() - m.num_computed_tokens(id).unwrap();
                if left == 0 {
                    m.append_tokens(id, &[next(50) as u32]).unwrap();
                }
                let chunk = [1usize, 4, 8, 12, 16][next(5) as usize];
                let use_step = next(2) == 0;
                if use_step {
                    // A step first hands out (and unpins) the plans of earlier calls; run
                    // those first so the step's own change is what is measured.
                    host_step(&m);
                }
                let d = m.num_blocks_needed(id, chunk).unwrap();
                let free_before = m.pool().num_free();
                let hits_before = m.stats().host_hits_tokens;
                let before = snapshot(&m);
                let reserve = if use_step { next(3) as usize } else { 0 };
                let result = if use_step {
                    let out = m.step_with(
                        &StepRequest {
                            seq_ids: vec![id],
                            num_new_tokens: vec![chunk as u32],
                            ..Default::default()
                        },
                        &StepDrafts::default(),
                        StepOptions {
                            skip_block_table: true,
                            skip_token_arrays: true,
                            reserve_blocks: reserve,
                        },
                    );
                    assert!(out.block_table.is_empty() && out.slot_mapping.is_empty());
                    apply_deltas(&m, &[id], &out, &mut kept);
                    match out.error {
                        None => Ok(()),
                        Some(e) => Err(e),
                    }
                } else {
                    // The next step's delta still covers what this call changed.
                    m.allocate_slots(id, chunk).map(|_| ())
                };
                match result {
                    Ok(()) => {
                        assert_eq!(
                            free_before as isize - m.pool().num_free() as isize,
                            d.net(),
                            "seq {id} chunk {chunk} demand {d:?}"
                        );
                        checked += 1;
                        via_step += usize::from(use_step);
                        host_hits += usize::from(m.stats().host_hits_tokens > hits_before);
                    }
                    Err(Error::OutOfBlocks {
                        requested,
                        available,
                    }) => {
                        assert_eq!(
                            (requested, available),
                            (d.take + reserve, free_before + d.release)
                        );
                        assert!(d.take + reserve > free_before + d.release);
                        assert_eq!(
                            snapshot(&m),
                            before,
                            "a refused allocation changed the pool"
                        );
                        refused += 1;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            _ => {}
        }
        if next(4) == 0 {
            host_step(&m);
        }
        m.check_invariants().unwrap();
    }
    assert!(checked > 400, "{eviction:?} {checked}");
    assert!(via_step > 150, "{via_step}");
    assert!(host_hits > 5, "{host_hits}");
    assert!(refused > 20, "{refused}");
}

/// S4 with the host tier: freeing a sequence twice or an unknown one changes nothing (no
/// second store planned, no block twice in the free queue); a sequence freed before its host
/// loads are handed out keeps their destination blocks out of other sequences' hands until
/// the hand-out, and a swapped-out sequence's free returns its CPU blocks.
#[test]
fn s4_double_free_with_host_tier_changes_nothing() {
    let m = manager(9, 16);
    a_on_host(&m);
    m.add_sequence(3, toks(13, 1), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(3, 13).unwrap();
    let loaded: Vec<BlockId> = {
        let t = m.block_tables(3).unwrap();
        // Full attention loads blocks 0..3, the window its block 2.
        vec![t[0][0], t[0][1], t[0][2], t[1][2]]
    };
    assert!(m.free(3));
    let after_first = snapshot(&m);
    let stats = m.stats();
    assert!(!m.free(3));
    assert!(!m.free(42));
    assert_eq!(snapshot(&m), after_first);
    assert_eq!(m.stats(), stats);
    let mut q = m.pool().free_queue();
    let n = q.len();
    q.sort_unstable();
    q.dedup();
    assert_eq!(q.len(), n, "a block twice in the free queue");
    // The loads are still to be handed out: their destinations stay referenced.
    for &b in &loaded {
        assert_eq!(m.pool().ref_count(b), 1, "load destination {b}");
    }
    m.add_sequence(4, toks(16, 5), SequenceSpec::default())
        .unwrap();
    let before = m.pool().num_free();
    match m.allocate_slots(4, 16) {
        Ok(a) => {
            for g in &a.groups {
                assert!(g.new_block_ids.iter().all(|b| !loaded.contains(b)));
            }
        }
        Err(Error::OutOfBlocks { available, .. }) => assert_eq!(available, before),
        Err(e) => panic!("{e}"),
    }
    let (_, loads) = host_step(&m);
    assert_eq!(loads, 4);
    m.check_invariants().unwrap();
    // A swapped-out sequence: free gives its CPU blocks back, once.
    m.free(4);
    m.add_sequence(5, toks(9, 6), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(5, 9).unwrap();
    let plan = m.swap_out(&[5]).unwrap();
    assert_eq!(m.stats().cpu_used, plan.len());
    assert!(m.free(5));
    assert_eq!(m.stats().cpu_used, 0);
    assert!(!m.free(5));
    assert_eq!(m.stats().cpu_used, 0);
    host_step(&m);
    assert_eq!(m.pool().num_free(), 8);
    assert!((0..9).all(|b| m.pool().ref_count(b) == 0));
    m.check_invariants().unwrap();
}

/// S7 per group: bs 8, prompt lengths {1, 16, 129}, fork, append {1, 16, 129} to the parent
/// or the child. In each group exactly one copy, at logical block len / 8, iff len % 8 != 0;
/// no full block is copied; the other side's tables are unchanged; the free pool moves by the
/// predicted `take - release`; after freeing both, the pool is whole.
#[test]
fn s7_copy_on_write_per_group_after_fork() {
    for plen in [1u32, 16, 129] {
        for alen in [1u32, 16, 129] {
            for write_child in [false, true] {
                let mut c = CacheConfig::with_groups(
                    97,
                    vec![GroupSpec::full(8, 8), GroupSpec::sliding_window(8, 8, 32)],
                    vec![0, 1],
                );
                c.num_host_blocks = 8;
                let m = KvCacheManager::new(c).unwrap();
                m.add_sequence(1, toks(plen as usize, 0), SequenceSpec::default())
                    .unwrap();
                m.allocate_slots(1, plen as usize).unwrap();
                let free0 = m.pool().num_free();
                m.fork(1, 2).unwrap();
                assert_eq!(m.pool().num_free(), free0, "fork allocated");
                let t0 = m.block_tables(1).unwrap();
                let (writer, other) = if write_child { (2, 1) } else { (1, 2) };
                m.append_tokens(writer, &toks(alen as usize, 9)).unwrap();
                let d = m.num_blocks_needed(writer, alen as usize).unwrap();
                let a = m.allocate_slots(writer, alen as usize).unwrap();
                let case = format!("plen {plen} alen {alen} child {write_child}");
                assert_eq!(
                    free0 as isize - m.pool().num_free() as isize,
                    d.net(),
                    "{case}"
                );
                let cow = plen % 8 != 0;
                let fresh = ((plen + alen).div_ceil(8) - plen.div_ceil(8)) as usize;
                // Full attention takes every new block and the copy.
                assert_eq!(d.per_group[0], (fresh + usize::from(cow), 0), "{case}");
                assert_eq!(
                    m.block_tables(other).unwrap(),
                    t0,
                    "{case}: other side changed"
                );
                let wt = m.block_tables(writer).unwrap();
                let k = (plen / 8) as usize;
                for g in 0..2 {
                    let copies = &a.groups[g].copies;
                    if cow {
                        assert_eq!(copies, &vec![(t0[g][k], wt[g][k])], "{case} group {g}");
                        assert_ne!(t0[g][k], wt[g][k]);
                        assert_eq!(m.pool().ref_count(t0[g][k]), 1);
                    } else {
                        assert!(copies.is_empty(), "{case} group {g}: {copies:?}");
                    }
                    // Full blocks stay shared (or were released out of the window).
                    for j in 0..k {
                        assert!(wt[g][j] == t0[g][j] || wt[g][j] == NULL_BLOCK, "{case}");
                    }
                }
                assert_eq!(m.stats().copies, 2 * u64::from(cow), "{case}");
                m.check_invariants().unwrap();
                assert!(m.free(1) && m.free(2));
                assert_eq!(m.pool().num_free(), 96, "{case}");
                assert!((0..97).all(|b| m.pool().ref_count(b) == 0), "{case}");
                m.check_invariants().unwrap();
            }
        }
    }
}

/// S8 on KV cache groups: 11 blocks = 10 usable; window releases set table entries to the
/// null block and give the block back; block 0 is never handed out, counted free, cached or
/// freed, and a full pool refuses the next block with `available: 0`.
#[test]
fn s8_null_block_is_never_capacity_in_any_group() {
    let m = manager(11, 0);
    assert_eq!((m.stats().free, m.pool().num_usable()), (10, 10));
    m.add_sequence(1, toks(20, 0), SequenceSpec::default())
        .unwrap();
    let opts = StepOptions {
        skip_block_table: true,
        ..Default::default()
    };
    let prefill = StepRequest {
        seq_ids: vec![1],
        num_new_tokens: vec![20],
        ..Default::default()
    };
    let out = m.step_with(&prefill, &StepDrafts::default(), opts);
    // Every query of the prefill reads its window: 5 blocks per group, the pool is full.
    assert_eq!((out.num_scheduled, m.pool().num_free()), (1, 0));
    assert!(out.new_block_ids.iter().all(|&b| b != 0));
    // A decode at 20 reads 16..=20: the window gives its blocks 0..4 back (null entries) and
    // each group opens block 5.
    let decode = StepRequest {
        seq_ids: vec![1],
        num_new_tokens: vec![1],
        append_indptr: vec![0, 1],
        append_tokens: vec![5],
    };
    let out = m.step_with(&decode, &StepDrafts::default(), opts);
    assert_eq!(out.num_scheduled, 1);
    let t = m.block_tables(1).unwrap();
    assert!(!t[0].contains(&NULL_BLOCK));
    assert_eq!(t[1][..4], [NULL_BLOCK; 4]);
    assert!(t[1][4] != NULL_BLOCK && t[1][5] != NULL_BLOCK);
    assert_eq!(m.pool().num_free(), 2);
    assert!(!m.pool().free_queue().contains(&NULL_BLOCK));
    assert!(out.new_block_ids.iter().all(|&b| b != 0));
    assert_eq!(m.pool().ref_count(NULL_BLOCK), 0);
    assert_eq!(m.pool().block_hash(NULL_BLOCK), None);
    // The window group's delta re-reports from its first released entry, as null entries.
    assert_eq!(out.table_start, vec![5, 0]);
    let (lo, hi) = (
        out.table_delta_indptr[1] as usize,
        out.table_delta_indptr[2] as usize,
    );
    assert_eq!(
        out.table_delta[lo..hi],
        [0, 0, 0, 0, t[1][4] as i32, t[1][5] as i32]
    );
    m.add_sequence(2, toks(8, 3), SequenceSpec::default())
        .unwrap();
    let d = m.num_blocks_needed(2, 8).unwrap();
    let free = m.pool().num_free();
    assert_eq!(
        m.allocate_slots(2, 8).unwrap_err(),
        Error::OutOfBlocks {
            requested: d.take,
            available: free
        }
    );
    assert_eq!((d.take, free), (4, 2));
    assert!(m.free(1));
    assert_eq!(m.pool().num_free(), 10);
    assert!(!m.pool().free_queue().contains(&NULL_BLOCK));
    assert_eq!(m.pool().ref_count(NULL_BLOCK), 0);
    m.check_invariants().unwrap();
}

/// Rolling hash of a token prefix: what the KV of position `pos` depends on.
fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325_u64;
    tokens
        .iter()
        .map(|&t| {
            h = (h ^ u64::from(t))
                .wrapping_mul(0x0100_0000_01b3)
                .rotate_left(7);
            h
        })
        .collect()
}

/// The executor's caches: per device / CPU / host block, per slot, the prefix hash whose KV
/// it holds (a block id belongs to one group at a time, so no group dimension).
#[derive(Default)]
struct Executor {
    dev: HashMap<BlockId, Vec<u64>>,
    cpu: HashMap<BlockId, Vec<u64>>,
    host: HashMap<u32, Vec<u64>>,
    /// Swap plans returned between steps, `(to_cpu, src, dst)`, run in the next step.
    swaps: Vec<(bool, BlockId, BlockId)>,
}

impl Executor {
    /// Runs one step output in the documented order: host stores, swaps, host loads,
    /// copy-on-write, then the forward pass writing each scheduled token's KV.
    fn run(&mut self, out: &pagedkv_core::StepOutput, ids: &[u64], seqs: &HashMap<u64, Vec<u64>>) {
        let empty = vec![0u64; BS as usize];
        for r in out.host_stores.chunks(3) {
            let v = self
                .dev
                .get(&(r[1] as u32))
                .cloned()
                .unwrap_or_else(|| empty.clone());
            self.host.insert(r[2] as u32, v);
        }
        for (to_cpu, src, dst) in self.swaps.drain(..) {
            let (from, to) = if to_cpu {
                (&self.dev, &mut self.cpu)
            } else {
                (&self.cpu, &mut self.dev)
            };
            let v = from.get(&src).cloned().unwrap_or_else(|| empty.clone());
            to.insert(dst, v);
        }
        for r in out.host_loads.chunks(3) {
            let v = self.host[&(r[1] as u32)].clone();
            self.dev.insert(r[2] as u32, v);
        }
        for r in out.copies.chunks(3) {
            let v = self
                .dev
                .get(&(r[1] as u32))
                .cloned()
                .unwrap_or_else(|| empty.clone());
            self.dev.insert(r[2] as u32, v);
        }
        let g = out.num_groups;
        let t_total = *out.query_start_loc.last().unwrap_or(&0) as usize;
        for (k, id) in ids.iter().take(out.num_scheduled).enumerate() {
            let h = &seqs[id];
            let q0 = out.query_start_loc[k] as usize;
            let ctx = out.context_lens[k] as usize;
            for t in q0..out.query_start_loc[k + 1] as usize {
                let pos = ctx + t - q0;
                for gi in 0..g {
                    let slot = out.slot_mapping[gi * t_total + t] as u32;
                    let e = self.dev.entry(slot / BS).or_insert_with(|| empty.clone());
                    e[(slot % BS) as usize] = h[pos];
                }
            }
        }
    }

    /// Every computed position of every table entry holds its sequence's own prefix: the
    /// device blocks of running sequences, the CPU blocks of swapped ones.
    fn check(&self, m: &KvCacheManager, seqs: &HashMap<u64, Vec<u64>>) {
        for (&id, h) in seqs {
            let cache = match m.status(id).unwrap() {
                SeqStatus::Running => &self.dev,
                SeqStatus::Swapped => &self.cpu,
                _ => continue,
            };
            let computed = m.num_computed_tokens(id).unwrap();
            let null = if m.status(id).unwrap() == SeqStatus::Swapped {
                None
            } else {
                Some(NULL_BLOCK)
            };
            for (gi, table) in m.block_tables(id).unwrap().iter().enumerate() {
                for (j, &b) in table.iter().enumerate() {
                    if Some(b) == null || cache.get(&b).is_none() && null.is_none() {
                        continue;
                    }
                    for off in 0..BS as usize {
                        let pos = j * BS as usize + off;
                        if pos < computed {
                            assert_eq!(
                                cache.get(&b).map(|v| v[off]),
                                Some(h[pos]),
                                "seq {id} group {gi} block {j} (id {b}) position {pos}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// S5 with the host tier: swap and recompute preemption among sequences that share prefixes
/// on a small device pool with a host tier, through an executor model that runs each step's
/// plans in order. After every step every block a sequence's tables hold carries that
/// sequence's own KV: a swapped-in sequence gets back the KV it swapped out, block for block,
/// and a host hit loads the KV its prefix computed.
#[test]
fn s5_swap_preemption_with_host_tier_restores_the_same_kv() {
    for eviction in HostEviction::ALL {
        s5_workload(eviction);
    }
}

fn s5_workload(eviction: HostEviction) {
    let m = manager_evicting(14, 10, eviction);
    let mut next = rng(0x9e37_79b9);
    let mut ex = Executor::default();
    let mut tokens: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut hashes: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut next_id = 1u64;
    let (mut swapped_in, mut host_loads, mut steps) = (0, 0, 0);
    for _ in 0..1500 {
        let live: Vec<u64> = {
            let mut v: Vec<u64> = tokens.keys().copied().collect();
            v.sort_unstable();
            v
        };
        match next(10) {
            0 if live.len() < 4 => {
                let t = toks(4 + next(14) as usize, next(2) as u32);
                m.add_sequence(next_id, t.clone(), SequenceSpec::default())
                    .unwrap();
                hashes.insert(next_id, prefix_hashes(&t));
                tokens.insert(next_id, t);
                next_id += 1;
            }
            1 if !live.is_empty() => {
                let id = live[next(live.len() as u64) as usize];
                assert!(m.free(id));
                tokens.remove(&id);
                hashes.remove(&id);
            }
            2 | 3 if !live.is_empty() => {
                let id = live[next(live.len() as u64) as usize];
                match m.status(id).unwrap() {
                    SeqStatus::Running if m.num_computed_tokens(id).unwrap() > 0 => {
                        if next(3) == 0 {
                            m.preempt_recompute(&[id]).unwrap();
                        } else if let Ok(plan) = m.swap_out(&[id]) {
                            ex.swaps.extend(plan.into_iter().map(|(g, c)| (true, g, c)));
                        }
                    }
                    SeqStatus::Swapped => {
                        if let Ok(plan) = m.swap_in(&[id]) {
                            swapped_in += 1;
                            ex.swaps
                                .extend(plan.into_iter().map(|(c, g)| (false, c, g)));
                        }
                    }
                    _ => {}
                }
            }
            _ => {
                let mut ids = Vec::new();
                let mut n_new = Vec::new();
                for &id in &live {
                    if m.status(id).unwrap() == SeqStatus::Swapped || next(3) == 0 {
                        continue;
                    }
                    if m.num_tokens(id).unwrap() == m.num_computed_tokens(id).unwrap() {
                        if tokens[&id].len() >= 40 {
                            continue;
                        }
                        let t = next(30) as u32;
                        m.append_tokens(id, &[t]).unwrap();
                        let v = tokens.get_mut(&id).unwrap();
                        v.push(t);
                        hashes.insert(id, prefix_hashes(v));
                    }
                    ids.push(id);
                    n_new.push(1 + next(8) as u32);
                }
                let out = m.step(&StepRequest {
                    seq_ids: ids.clone(),
                    num_new_tokens: n_new,
                    ..Default::default()
                });
                host_loads += out.host_loads.len() / 3;
                ex.run(&out, &ids, &hashes);
                steps += 1;
                ex.check(&m, &hashes);
            }
        }
        m.check_invariants().unwrap();
    }
    assert!(steps > 500, "{steps}");
    assert!(swapped_in > 20, "{swapped_in}");
    assert!(host_loads > 10, "{eviction:?} {host_loads}");
}

/// S2 on KV cache groups with the host tier: 4 usable blocks, caching on. A full block cached
/// in each group, freed, then another sequence's blocks take every id, the two cached ones
/// included: those carry no stale hash (none, or the new holder's own), the index no longer
/// finds the old keys, and the evicted blocks went to the host under their old keys (a later
/// copy of the prompt hits there, not on the reused ids). With caching off no block is ever
/// hashed.
#[test]
fn s2_reused_block_carries_no_stale_hash_in_any_group() {
    let m = manager(5, 4);
    m.add_sequence(1, toks(4, 1), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 4).unwrap();
    let t = m.block_tables(1).unwrap();
    let (b0, b1) = (t[0][0], t[1][0]);
    let keys = [
        m.pool().block_hash(b0).unwrap(),
        m.pool().block_hash(b1).unwrap(),
    ];
    assert_ne!(keys[0], keys[1], "the groups' keys differ");
    host_step(&m);
    assert!(m.free(1));
    assert_eq!(m.pool().num_cached_free(), 2);
    // 7 tokens: two blocks per group, the second partial: all four ids.
    m.add_sequence(2, toks(7, 2), SequenceSpec::default())
        .unwrap();
    let a = m.allocate_slots(2, 7).unwrap();
    let got: Vec<BlockId> = a
        .groups
        .iter()
        .flat_map(|g| g.new_block_ids.clone())
        .collect();
    assert!(got.contains(&b0) && got.contains(&b1), "{got:?}");
    let t2 = m.block_tables(2).unwrap();
    for table in &t2 {
        assert_eq!(
            m.pool().block_hash(table[1]),
            None,
            "a partial block is hashed"
        );
    }
    for b in [b0, b1] {
        let h = m.pool().block_hash(b);
        assert!(
            h.is_none() || !keys.contains(&h.unwrap()),
            "block {b} kept its old hash"
        );
    }
    for k in &keys {
        assert_eq!(m.pool().lookup(k), None);
    }
    assert_eq!(host_step(&m), (2, 0));
    m.check_invariants().unwrap();
    // A copy of seq 1's prompt + 1 token hits 4 tokens from the host, not the reused ids.
    assert!(m.free(2));
    m.add_sequence(3, toks(5, 1), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(3).unwrap(), 4);
    let a = m.allocate_slots(3, 5).unwrap();
    assert_eq!(a.num_cached_tokens, 4);
    let out = m.step(&StepRequest::default());
    assert_eq!(out.host_loads.len() / 3, 2);
    let t = m.block_tables(3).unwrap();
    assert_eq!(m.pool().block_hash(t[0][0]), Some(keys[0]));
    assert_eq!(m.pool().block_hash(t[1][0]), Some(keys[1]));
    m.check_invariants().unwrap();

    // Caching off: nothing hashed, nothing stored.
    let mut c = CacheConfig::with_groups(
        5,
        vec![GroupSpec::full(BS, 8), GroupSpec::sliding_window(BS, 8, W)],
        vec![0, 1],
    );
    c.enable_prefix_caching = false;
    let m = KvCacheManager::new(c).unwrap();
    m.add_sequence(1, toks(8, 1), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 8).unwrap();
    assert!((0..5).all(|b| m.pool().block_hash(b).is_none()));
    m.free(1);
    m.add_sequence(2, toks(8, 1), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 0);
    assert_eq!(m.allocate_slots(2, 8).unwrap().num_cached_tokens, 0);
    assert!((0..5).all(|b| m.pool().block_hash(b).is_none()));
    m.check_invariants().unwrap();
}

/// S1, the host tier's own state: a failed allocation whose lookup hit host blocks must not
/// change their recency (LRU) or list (ARC: a hit moves T1 -> T2). Two managers run the same
/// calls, one of them also the failed allocation; every later step's host stores and loads,
/// and the later hits, are the same on both.
#[test]
fn s1_failed_allocation_leaves_host_eviction_order_unchanged() {
    for eviction in HostEviction::ALL {
        let run = |with_failure: bool| {
            // Host of 10: A's six blocks, seq 2's two evicted by D, then two more.
            let m = manager_evicting(9, 10, eviction);
            a_on_host(&m);
            m.add_sequence(4, toks(8, 4), SequenceSpec::default())
                .unwrap();
            m.allocate_slots(4, 8).unwrap();
            let mut log = vec![m.step(&StepRequest::default())];
            if with_failure {
                m.add_sequence(3, toks(17, 1), SequenceSpec::default())
                    .unwrap();
                assert!(matches!(
                    m.allocate_slots(3, 17),
                    Err(Error::OutOfBlocks { .. })
                ));
                assert!(m.free(3));
            }
            assert!(m.free(4));
            // A new prompt pushes stores through the full host tier: which entries it evicts
            // (here A's deeper blocks, the oldest) depends on the recency and lists the
            // failed call must not have changed.
            m.add_sequence(5, toks(5, 5), SequenceSpec::default())
                .unwrap();
            m.allocate_slots(5, 5).unwrap();
            log.push(m.step(&StepRequest::default()));
            assert!(m.free(5));
            // Then A again and seq 2's prompt: their hits show what survived.
            let mut hits = Vec::new();
            for (id, salt) in [(8u64, 1u32), (9, 2)] {
                m.add_sequence(id, toks(13, salt), SequenceSpec::default())
                    .unwrap();
                hits.push(m.lookup_prefix(id).unwrap());
                m.allocate_slots(id, 13).unwrap();
                log.push(m.step(&StepRequest::default()));
                assert!(m.free(id));
            }
            m.check_invariants().unwrap();
            let copies: Vec<(Vec<i32>, Vec<i32>)> = log
                .into_iter()
                .map(|o| (o.host_stores, o.host_loads))
                .collect();
            (copies, hits, m.stats().host_hits_tokens)
        };
        let (with, without) = (run(true), run(false));
        assert_eq!(
            with, without,
            "{eviction:?}: the failed call changed the host tier"
        );
    }
}
