//! The prefix cache's host tier through the manager (docs/design.md, "Host tier"): stores of
//! evicted blocks, loads of host hits, admission, pins, reset, events and exact capacity; on the KV cache
//! manager with one full-attention group ([`common::OneGroup`]).

mod common;

use common::OneGroup;
use pagedkv_core::events::{KvEvent, Tier};
use pagedkv_core::host_tier::{HostEviction, HostTransfers};
use pagedkv_core::{CacheConfig, Error, KvCacheManager, SequenceSpec, StepRequest};

fn manager<M: OneGroup>(num_blocks: u32, host: u32, min_seen: u32) -> M {
    let mut cfg = CacheConfig::new(num_blocks, 4);
    cfg.num_host_blocks = host;
    cfg.host_admission_min_seen = min_seen;
    cfg.enable_events = true;
    M::build(cfg).unwrap()
}

/// An empty step: the executor has run the previous plans (blocks registered before hold
/// their KV); returns its host `(stores, loads)`, row-major `(group, src, dst)` triples
/// (group 0 throughout).
fn step<M: OneGroup>(m: &M) -> (Vec<i32>, Vec<i32>) {
    let out = m.step(&StepRequest::default());
    assert!(out.error.is_none());
    (out.host_stores, out.host_loads)
}

fn add<M: OneGroup>(m: &M, id: u64, prompt: &[u32]) {
    m.add_sequence(id, prompt, SequenceSpec::default()).unwrap();
}

const A: [u32; 9] = [1, 2, 3, 4, 5, 6, 7, 8, 9];
const B: [u32; 9] = [11, 12, 13, 14, 15, 16, 17, 18, 19];

/// Seq 1 computes A (blocks 1, 2 cached, 3 partial), is freed; seq 2 computes B, evicting
/// A's two blocks from the device (stored to host blocks 0, 1), and is freed.
fn a_evicted_to_host<M: OneGroup>(m: &M) {
    add(m, 1, &A);
    m.allocate_slots(1, 9).unwrap();
    assert_eq!(m.block_table(1).unwrap(), vec![1, 2, 3]);
    step(m);
    m.free(1);
    add(m, 2, &B);
    m.allocate_slots(2, 9).unwrap();
    // Block 3 (uncached) first, then the LRU front: A's deepest block 2, then block 1.
    assert_eq!(m.block_table(2).unwrap(), vec![3, 2, 1]);
    m.free(2);
    m.check_invariants().unwrap();
}

fn an_evicted_prefix_comes_back_as_host_loads<M: OneGroup>() {
    let m: M = manager(4, 8, 1);
    a_evicted_to_host(&m);
    let h = m.hasher();
    let a0 = h.hash_block(None, &A[..4], &[]);
    let a1 = h.hash_block(Some(&a0), &A[4..8], &[]);
    let events = m.take_events();
    assert!(events.contains(&KvEvent::BlockRemoved {
        block_hashes: vec![a1, a0],
        tier: Tier::Device
    }));
    let host_stored: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                tier: Tier::Host,
                ..
            } => Some((block_hashes.clone(), *parent_block_hash, token_ids.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        host_stored,
        vec![
            (vec![a1], Some(a0), A[4..8].to_vec()),
            (vec![a0], None, A[..4].to_vec())
        ]
    );
    // The stores come out with the next step: (group, device block, host block).
    assert_eq!(step(&m), (vec![0, 2, 0, 0, 1, 1], vec![]));

    add(&m, 3, &A);
    assert_eq!(m.lookup_prefix(3).unwrap(), 8);
    // Two loads and one fresh block; B's cached blocks are evicted (and stored) for them.
    assert_eq!(m.num_blocks_needed(3, 9).unwrap(), 3);
    assert_eq!(m.num_blocks_owed(&[3]).unwrap(), 3);
    let a = m.allocate_slots(3, 9).unwrap();
    assert_eq!(a.num_cached_tokens, 8);
    assert_eq!(a.num_scheduled_tokens, 1);
    assert_eq!(a.groups[0].new_block_ids, vec![1, 2, 3]);
    assert_eq!(m.block_table(3).unwrap(), vec![1, 2, 3]);
    m.check_invariants().unwrap();
    let (stores, loads) = step(&m);
    // B's blocks 2 (its block 1) and 3 (its block 0) went to host blocks 2, 3; A's host
    // blocks 1 (a0) and 0 (a1) are loaded into device blocks 1 and 2.
    assert_eq!(stores, vec![0, 2, 2, 0, 3, 3]);
    assert_eq!(loads, vec![0, 1, 1, 0, 0, 2]);
    let st = m.stats();
    assert_eq!(
        (
            st.host_hits_tokens,
            st.prefix_hits_tokens,
            st.host_loads_blocks,
            st.host_stores_blocks,
            st.host_used
        ),
        (8, 8, 2, 4, 4)
    );
    // The loaded blocks are resolvable on the device again.
    assert_eq!(m.pool().block_hash(1), Some(a0));
    assert_eq!(m.pool().block_hash(2), Some(a1));
    let device_stored: Vec<_> = m
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                tier: Tier::Device,
                ..
            } => Some(block_hashes),
            _ => None,
        })
        .collect();
    assert_eq!(device_stored, vec![vec![a0, a1]]);
    m.free(3);
    m.check_invariants().unwrap();
}

fn stores_only_hashes_seen_the_admission_count<M: OneGroup>() {
    // Seen twice: A computed once is not stored; computed again (a miss), it is.
    let m: M = manager(4, 8, 2);
    a_evicted_to_host(&m);
    assert_eq!(step(&m), (vec![], vec![]));
    add(&m, 3, &A);
    assert_eq!(m.lookup_prefix(3).unwrap(), 0);
    m.allocate_slots(3, 9).unwrap();
    step(&m);
    m.free(3);
    add(&m, 4, &B);
    m.allocate_slots(4, 9).unwrap();
    // A's blocks (seen twice now) are stored; B's were evicted once, seen once: not stored.
    let (stores, _) = step(&m);
    assert_eq!(stores.len(), 2 * 3);
    add(&m, 5, &A);
    assert_eq!(m.lookup_prefix(5).unwrap(), 8);
    m.check_invariants().unwrap();
}

fn a_pool_that_fits_one_request_with_its_loads_runs_it<M: OneGroup>() {
    // 3 usable blocks: A's two host loads plus one fresh block use all of them.
    let m: M = manager(4, 8, 1);
    a_evicted_to_host(&m);
    step(&m);
    add(&m, 3, &A);
    add(&m, 4, &[50, 51]);
    m.allocate_slots(4, 2).unwrap();
    // One block held by seq 4: three needed, two free. Refused, and nothing moved.
    let before = (m.stats(), m.pool().free_queue(), m.block_table(3).unwrap());
    assert_eq!(m.num_blocks_needed(3, 9).unwrap(), 3);
    assert_eq!(
        m.allocate_slots(3, 9).unwrap_err(),
        Error::OutOfBlocks {
            requested: 3,
            available: 2
        }
    );
    assert_eq!(
        (m.stats(), m.pool().free_queue(), m.block_table(3).unwrap()),
        before
    );
    assert_eq!(step(&m), (vec![], vec![]));
    m.check_invariants().unwrap();
    // Once seq 4 finishes the whole pool is free: it runs, nothing else waits.
    m.free(4);
    assert_eq!(m.num_blocks_needed(3, 9).unwrap(), m.stats().free);
    let a = m.allocate_slots(3, 9).unwrap();
    assert_eq!((a.num_cached_tokens, a.num_scheduled_tokens), (8, 1));
    m.check_invariants().unwrap();
}

fn a_host_block_being_loaded_is_pinned_until_the_next_step_returns<M: OneGroup>() {
    // 5 usable device blocks, one host block: it holds A's first block (a0).
    let m: M = manager(6, 1, 1);
    let c: Vec<u32> = (100..120).collect();
    add(&m, 1, &A[..5]);
    m.allocate_slots(1, 5).unwrap(); // blocks 1 (a0, cached), 2 (partial)
    step(&m);
    m.free(1);
    add(&m, 2, &c);
    m.allocate_slots(2, 20).unwrap(); // blocks 2, 3, 4, 5, then evicts 1: a0 -> host 0
    assert_eq!(m.block_table(2).unwrap(), vec![2, 3, 4, 5, 1]);
    assert_eq!(step(&m), (vec![0, 1, 0], vec![]));
    m.free(2); // device LRU, front first: 1, 5, 4, 3, 2 (C's blocks, deepest first)
    add(&m, 3, &A[..5]);
    let a = m.allocate_slots(3, 5).unwrap();
    assert_eq!(
        (a.num_cached_tokens, a.groups[0].new_block_ids.clone()),
        (4, vec![1, 5])
    );
    // Its evictions (C's blocks 4 and 3) find the only host block pinned: no store. So do
    // those of another sequence in the same step.
    add(&m, 4, &[60, 61, 62, 63, 64]);
    m.allocate_slots(4, 5).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(step(&m), (vec![], vec![0, 0, 1]));
    // Still pinned after that step returned (it handed the load out).
    m.free(4);
    add(&m, 5, &[70, 71, 72, 73, 74]);
    m.allocate_slots(5, 5).unwrap();
    assert_eq!(step(&m), (vec![], vec![]));
    m.check_invariants().unwrap();
    // That step released it: the next eviction replaces it (seq 4's block 4 -> host 0).
    m.free(5);
    add(&m, 6, &[80, 81, 82, 83, 84]);
    m.allocate_slots(6, 5).unwrap();
    assert_eq!(step(&m), (vec![0, 4, 0], vec![]));
    m.check_invariants().unwrap();
}

fn a_block_registered_in_the_current_step_is_not_stored<M: OneGroup>() {
    // Its KV is written by the forward pass that has not run yet.
    let m: M = manager(4, 8, 1);
    add(&m, 1, &A);
    m.allocate_slots(1, 9).unwrap();
    m.free(1);
    add(&m, 2, &B);
    m.allocate_slots(2, 9).unwrap();
    assert_eq!(step(&m), (vec![], vec![]));
    m.check_invariants().unwrap();
}

fn reset_clears_the_host_tier<M: OneGroup>() {
    let m: M = manager(4, 8, 1);
    a_evicted_to_host(&m);
    m.take_events();
    m.reset_prefix_cache().unwrap();
    assert_eq!(m.take_events(), vec![KvEvent::AllBlocksCleared]);
    add(&m, 3, &A);
    assert_eq!(m.lookup_prefix(3).unwrap(), 0);
    assert_eq!(m.stats().host_used, 0);
    m.check_invariants().unwrap();
}

fn reset_waits_for_planned_loads<M: OneGroup>() {
    let m: M = manager(4, 8, 1);
    a_evicted_to_host(&m);
    step(&m);
    add(&m, 3, &A);
    m.allocate_slots(3, 9).unwrap();
    m.free(3);
    // The two load destinations are held until the loads are handed out.
    assert_eq!(
        m.reset_prefix_cache().unwrap_err(),
        Error::CacheInUse { blocks_in_use: 2 }
    );
    assert_eq!(m.take_host_transfers().loads, vec![(1, 1), (0, 2)]);
    m.reset_prefix_cache().unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn bad_host_configs_are_refused() {
    let mut cfg = CacheConfig::new(8, 4);
    cfg.host_admission_min_seen = 0;
    assert!(matches!(
        <KvCacheManager as OneGroup>::build(cfg).unwrap_err(),
        Error::InvalidConfig {
            field: "host_admission_min_seen",
            ..
        }
    ));
    let mut cfg = CacheConfig::new(8, 4);
    cfg.num_host_blocks = 4;
    cfg.enable_prefix_caching = false;
    assert!(matches!(
        <KvCacheManager as OneGroup>::build(cfg).unwrap_err(),
        Error::InvalidConfig {
            field: "num_host_blocks",
            ..
        }
    ));
    assert_eq!(HostEviction::from_name("random"), None);
}

fn without_a_host_tier_steps_carry_no_host_plans<M: OneGroup>() {
    let m = M::build(CacheConfig::new(4, 4)).unwrap();
    add(&m, 1, &A);
    m.allocate_slots(1, 9).unwrap();
    step(&m);
    m.free(1);
    add(&m, 2, &B);
    m.allocate_slots(2, 9).unwrap();
    assert_eq!(step(&m), (vec![], vec![]));
    assert_eq!(m.take_host_transfers(), HostTransfers::default());
    assert_eq!(m.stats().num_host_blocks, 0);
}

/// A block swapped in between two step calls gets its KV from the swap-in copy, which the
/// executor runs after the next step call's host stores: that call must not store it (the
/// store would copy the block's old bytes to the host, and a later hit would load them).
fn a_block_swapped_in_since_the_last_step_is_not_stored_before_its_copy_runs<M: OneGroup>() {
    let mut cfg = CacheConfig::new(6, 4);
    cfg.num_cpu_blocks = 4;
    cfg.num_host_blocks = 4;
    cfg.host_admission_min_seen = 1;
    let m = M::build(cfg).unwrap();
    add(&m, 1, &[1, 2, 3, 4, 5]);
    m.allocate_slots(1, 5).unwrap();
    step(&m);
    step(&m);
    m.swap_out(&[1]).unwrap();
    let swapped_in = m.swap_in(&[1]).unwrap();
    // Its first block, cached again on device block `d` (KV arriving by the swap-in).
    let d = swapped_in[0].1;
    m.preempt_recompute(&[1]).unwrap();
    add(&m, 2, &(20..40).collect::<Vec<u32>>());
    // Seq 2 scheduled by the next step call evicts `d`: in this step the executor runs the
    // swap-in copy after the stores.
    let out = m.step(&StepRequest {
        seq_ids: vec![2],
        num_new_tokens: vec![20],
        ..StepRequest::default()
    });
    assert_eq!(out.num_scheduled, 1);
    let stores = out.host_stores;
    assert!(
        !stores.chunks(3).any(|p| p[1] as u32 == d),
        "stored block {d} before its swap-in copy ran: {stores:?}"
    );
    m.check_invariants().unwrap();
}

one_group_tests!(
    an_evicted_prefix_comes_back_as_host_loads,
    stores_only_hashes_seen_the_admission_count,
    a_pool_that_fits_one_request_with_its_loads_runs_it,
    a_host_block_being_loaded_is_pinned_until_the_next_step_returns,
    a_block_registered_in_the_current_step_is_not_stored,
    reset_clears_the_host_tier,
    reset_waits_for_planned_loads,
    without_a_host_tier_steps_carry_no_host_plans,
    a_block_swapped_in_since_the_last_step_is_not_stored_before_its_copy_runs,
);
