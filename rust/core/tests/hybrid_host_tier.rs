//! The prefix cache's host tier under KV cache groups (`KvCacheManager`, docs/design.md, "Host
//! tier"): host entries keyed by (hash, group), the window rule for host hits, exact demand,
//! pins, admission and events.

use pagedkv_core::events::{KvEvent, Tier};
use pagedkv_core::manager::GroupEvent;
use pagedkv_core::{
    CacheConfig, Error, GroupSpec, KvCacheManager, SequenceSpec, StepRequest, NULL_BLOCK,
};
use std::collections::HashMap;

const BS: u32 = 4;
/// Window 5: a hit at `p` needs the one block before `p` (ceil((5 - 1) / 4) = 1).
const W: u32 = 5;

/// Full attention (group 0) and a sliding window of 5 (group 1), block size 4.
fn manager(num_blocks: u32, host: u32, min_seen: u32) -> KvCacheManager {
    let mut c = CacheConfig::with_groups(
        num_blocks,
        vec![GroupSpec::full(BS, 8), GroupSpec::sliding_window(BS, 8, W)],
        vec![1, 1, 0],
    );
    c.num_host_blocks = host;
    c.host_admission_min_seen = min_seen;
    c.enable_events = true;
    KvCacheManager::new(c).unwrap()
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt * 1000 + 1).collect()
}

/// `(group, block, block)` copies.
type Copies = Vec<(u32, u32, u32)>;

/// Triples of a flat row-major array.
fn triples(v: &[i32]) -> Copies {
    v.chunks(3)
        .map(|c| (c[0] as u32, c[1] as u32, c[2] as u32))
        .collect()
}

/// An empty step (the executor ran the previous plans); its host `(stores, loads)` triples.
fn step(m: &KvCacheManager) -> (Copies, Copies) {
    let out = m.step(&StepRequest::default());
    assert!(out.error.is_none());
    (triples(&out.host_stores), triples(&out.host_loads))
}

/// Seq 1 computes A (13 tokens: 3 full blocks and a partial one per group), is freed; seq 2
/// computes B (13 other tokens) in the 8 usable blocks, evicting A's six cached blocks, and
/// is freed. Returns A's tables and the stores handed out: `(group, logical block) -> host`.
/// `(group, logical block) -> host block`.
type HostOf = HashMap<(u32, usize), u32>;

fn a_evicted_to_host(m: &KvCacheManager) -> (Vec<Vec<u32>>, HostOf) {
    m.add_sequence(1, toks(13, 1), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 13).unwrap();
    let a = m.block_tables(1).unwrap();
    step(m);
    m.free(1);
    m.add_sequence(2, toks(13, 2), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(2, 13).unwrap();
    m.free(2);
    m.check_invariants().unwrap();
    let (stores, loads) = step(m);
    assert!(loads.is_empty());
    let mut host_of = HashMap::new();
    for (g, d, h) in stores {
        let j = a[g as usize]
            .iter()
            .position(|&b| b == d)
            .expect("A's block");
        assert!(host_of.insert((g, j), h).is_none());
    }
    (a, host_of)
}

#[test]
fn full_attention_loads_every_block_a_window_group_only_its_window() {
    let m = manager(9, 16, 1);
    let (_, host_of) = a_evicted_to_host(&m);
    // Both groups' three full blocks are on host, as six different entries.
    let mut keys: Vec<_> = host_of.keys().copied().collect();
    keys.sort_unstable();
    assert_eq!(keys, vec![(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]);
    let mut hosts: Vec<u32> = host_of.values().copied().collect();
    hosts.sort_unstable();
    hosts.dedup();
    assert_eq!(hosts.len(), 6);
    assert_eq!(m.stats().host_stores_blocks, 6);

    m.add_sequence(3, toks(13, 1), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(3).unwrap(), 12);
    // Full: 3 loads + 1 fresh; window: 1 load (block 2) + 1 fresh; nothing released.
    let demand = m.num_blocks_needed(3, 13).unwrap();
    assert_eq!(demand.per_group, vec![(4, 0), (2, 0)]);
    assert_eq!(m.num_blocks_owed(&[3]).unwrap(), 6);
    let free = m.pool().num_free();
    let a = m.allocate_slots(3, 13).unwrap();
    assert_eq!(
        free - m.pool().num_free(),
        6,
        "exactly the predicted blocks"
    );
    assert_eq!(a.num_cached_tokens, 12);
    let t = m.block_tables(3).unwrap();
    assert!(t[0].iter().all(|&b| b != NULL_BLOCK));
    assert_eq!(&t[1][..2], &[NULL_BLOCK, NULL_BLOCK]);
    assert_eq!(a.groups[0].new_block_ids, t[0]);
    assert_eq!(a.groups[1].new_block_ids, t[1][2..].to_vec());
    m.check_invariants().unwrap();
    let (stores, loads) = step(&m);
    // B's two uncached partial blocks, then four of its cached ones made room (stored too),
    // never into a host block being loaded.
    assert_eq!(stores.len(), 4);
    for (_, _, h) in &stores {
        assert!(!loads.iter().any(|l| l.1 == *h));
    }
    let want: Copies = vec![
        (0, host_of[&(0, 0)], t[0][0]),
        (0, host_of[&(0, 1)], t[0][1]),
        (0, host_of[&(0, 2)], t[0][2]),
        (1, host_of[&(1, 2)], t[1][2]),
    ];
    assert_eq!(loads, want);
    let st = m.stats();
    assert_eq!((st.host_loads_blocks, st.host_hits_tokens), (4, 12));
    assert_eq!(st.prefix_hits_tokens, 12);
    m.check_invariants().unwrap();
    // The loaded blocks are on the device now: a second copy of A hits them there.
    m.add_sequence(4, toks(13, 1), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.num_blocks_needed(4, 13).unwrap().take, 2);
}

#[test]
fn a_window_hit_needs_only_its_in_window_blocks_on_either_tier() {
    // Host of 4 blocks: of A's six, the four stored last survive (LRU): B evicts A's blocks
    // deepest first per table, so what is left decides the hit. Only those four stores are
    // handed out (the first two would be overwritten in the same output).
    let m = manager(9, 4, 1);
    let (_, host_of) = a_evicted_to_host(&m);
    assert_eq!(host_of.len(), 4);
    let st = m.stats();
    assert_eq!((st.host_used, st.host_stores_blocks), (4, 4));
    m.add_sequence(3, toks(13, 1), SequenceSpec::default())
        .unwrap();
    let hit = m.lookup_prefix(3).unwrap();
    // Whatever survived, the hit is the longest prefix where full attention has blocks
    // 0..p/4 and the window its block p/4 - 1, each from one of the tiers.
    let alloc = m.allocate_slots(3, 13).unwrap();
    assert_eq!(alloc.num_cached_tokens, hit);
    let (_, loads) = step(&m);
    let p = hit / 4;
    let full: Vec<u32> = loads.iter().filter(|l| l.0 == 0).map(|l| l.1).collect();
    let win: Vec<u32> = loads.iter().filter(|l| l.0 == 1).map(|l| l.1).collect();
    assert_eq!(full.len(), p);
    assert_eq!(win.len(), usize::from(p > 0));
    if p > 0 {
        assert_eq!(win, vec![host_of[&(1, p - 1)]]);
    }
    m.check_invariants().unwrap();
}

#[test]
fn pinned_host_blocks_are_never_evicted_by_stores() {
    // Host of exactly A's six blocks.
    let m = manager(9, 6, 1);
    let (_, host_of) = a_evicted_to_host(&m);
    // Seq 3 re-reads A: 4 loads planned (pinned); its allocation evicts B's cached blocks,
    // whose stores may take only the two unpinned host blocks (window blocks 0 and 1).
    m.add_sequence(3, toks(13, 1), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(3, 13).unwrap();
    m.check_invariants().unwrap();
    let (stores, loads) = step(&m);
    let loaded: Vec<u32> = loads.iter().map(|l| l.1).collect();
    assert_eq!(loaded.len(), 4);
    assert!(!stores.is_empty());
    for (_, _, h) in &stores {
        assert!(!loaded.contains(h), "store into pinned host block {h}");
        assert!(
            [host_of[&(1, 0)], host_of[&(1, 1)]].contains(h),
            "store into {h}"
        );
    }
    // Handed out: still pinned until the next step returns.
    m.add_sequence(4, toks(21, 3), SequenceSpec::default())
        .unwrap();
    m.free(3);
    m.allocate_slots(4, 8).unwrap();
    let (stores, _) = step(&m);
    for (_, _, h) in &stores {
        assert!(!loaded.contains(h), "store into in-flight host block {h}");
    }
    m.check_invariants().unwrap();
}

#[test]
fn admission_needs_the_minimum_seen_count() {
    let m = manager(9, 16, 2);
    let (_, host_of) = a_evicted_to_host(&m);
    assert!(host_of.is_empty(), "A computed once: not admitted");
    assert_eq!(m.stats().host_stores_blocks, 0);
    // A computed again (a miss), then evicted by C: every block seen twice, stored.
    m.add_sequence(3, toks(13, 1), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(3).unwrap(), 0);
    m.allocate_slots(3, 13).unwrap();
    step(&m);
    m.free(3);
    m.add_sequence(4, toks(13, 4), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(4, 13).unwrap();
    m.free(4);
    let (stores, _) = step(&m);
    assert_eq!(stores.len(), 6);
    m.check_invariants().unwrap();
}

#[test]
fn host_events_name_tier_and_group() {
    let m = manager(9, 16, 1);
    a_evicted_to_host(&m);
    let host_stored: Vec<(Option<u32>, usize)> = m
        .take_events()
        .into_iter()
        .filter_map(|GroupEvent { group, event }| match event {
            KvEvent::BlockStored {
                tier: Tier::Host,
                token_ids,
                ..
            } => Some((group, token_ids.len())),
            _ => None,
        })
        .collect();
    let mut groups: Vec<_> = host_stored.iter().map(|e| e.0).collect();
    groups.sort_unstable();
    assert_eq!(
        groups,
        vec![Some(0), Some(0), Some(0), Some(1), Some(1), Some(1)]
    );
    assert!(host_stored.iter().all(|e| e.1 == BS as usize));
}

#[test]
fn reset_clears_both_tiers_and_waits_for_planned_loads() {
    let m = manager(9, 16, 1);
    a_evicted_to_host(&m);
    m.add_sequence(3, toks(13, 1), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(3, 13).unwrap();
    m.free(3);
    // The planned loads hold their device blocks until handed out.
    assert!(matches!(
        m.reset_prefix_cache(),
        Err(Error::CacheInUse { .. })
    ));
    step(&m);
    m.reset_prefix_cache().unwrap();
    // The four host blocks being loaded stay pinned until the next step returns.
    assert_eq!(m.stats().host_used, 4);
    m.check_invariants().unwrap();
    step(&m);
    assert_eq!(m.stats().host_used, 0);
    m.add_sequence(5, toks(13, 1), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(5).unwrap(), 0);
    m.check_invariants().unwrap();
}

#[test]
fn host_config_is_checked_as_for_one_group() {
    let mut c = CacheConfig::with_groups(9, vec![GroupSpec::full(BS, 8)], vec![0]);
    c.num_host_blocks = 4;
    c.enable_prefix_caching = false;
    assert!(matches!(
        KvCacheManager::new(c.clone()),
        Err(Error::InvalidConfig {
            field: "num_host_blocks",
            ..
        })
    ));
    c.enable_prefix_caching = true;
    c.host_admission_min_seen = 0;
    assert!(matches!(
        KvCacheManager::new(c),
        Err(Error::InvalidConfig {
            field: "host_admission_min_seen",
            ..
        })
    ));
}

/// As for one group: a block swapped in since the last step call gets its KV from the swap-in
/// copy, which runs after the next step call's stores, so that call does not store it (found
/// by tests/core/test_hybrid_host_tier.py: a later host hit loaded the block's old bytes).
#[test]
fn a_block_swapped_in_since_the_last_step_is_not_stored_before_its_copy_runs() {
    let mut c = CacheConfig::with_groups(
        9,
        vec![GroupSpec::full(BS, 8), GroupSpec::sliding_window(BS, 8, W)],
        vec![1, 0],
    );
    c.num_host_blocks = 4;
    c.host_admission_min_seen = 1;
    c.num_cpu_blocks = 6;
    let m = KvCacheManager::new(c).unwrap();
    m.add_sequence(1, toks(5, 1), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 5).unwrap();
    step(&m);
    step(&m);
    m.swap_out(&[1]).unwrap();
    let swapped_in: Vec<u32> = m.swap_in(&[1]).unwrap().iter().map(|p| p.1).collect();
    m.preempt_recompute(&[1]).unwrap();
    m.add_sequence(2, toks(16, 2), SequenceSpec::default())
        .unwrap();
    // Seq 2 scheduled by the next step call: its allocation evicts the swapped-in blocks, and
    // in this step the executor runs the swap-in copy after the stores.
    let out = m.step(&StepRequest {
        seq_ids: vec![2],
        num_new_tokens: vec![16],
        ..StepRequest::default()
    });
    assert_eq!(out.num_scheduled, 1);
    let stores = triples(&out.host_stores);
    for (_, d, _) in &stores {
        assert!(
            !swapped_in.contains(d),
            "stored block {d} before its swap-in copy ran: {stores:?}"
        );
    }
    m.check_invariants().unwrap();
}
