//! State groups (Mamba / linear attention recurrent states) and the commit fence
//! (docs/design.md, "State groups and the commit fence"): live-state moves, copies and zero
//! rows, prefix hits on committed states only, releases on free / preempt / swap, refusals.

use pagedkv_core::events::KvEvent;
use pagedkv_core::{
    CacheConfig, Error, GroupSpec, KvCacheManager, SeqStatus, SequenceSpec, StepRequest, NULL_BLOCK,
};

const BS: u32 = 4;
const FULL: usize = 0;
const STATE: usize = 1;

/// One full-attention group and one state group, both of 4-token blocks (32-byte pages).
fn cfg(num_blocks: u32) -> CacheConfig {
    let mut c = CacheConfig::with_groups(
        num_blocks,
        vec![GroupSpec::full(BS, 8), GroupSpec::state(BS, 8)],
        vec![0, 1, 1],
    );
    c.enable_events = true;
    c
}

fn mgr(num_blocks: u32) -> KvCacheManager {
    KvCacheManager::new(cfg(num_blocks)).unwrap()
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt * 1000 + 1).collect()
}

fn ok(m: &KvCacheManager) {
    m.check_invariants().unwrap();
}

fn stored(m: &KvCacheManager, group: u32) -> usize {
    m.take_events()
        .iter()
        .filter(|e| e.group == Some(group))
        .map(|e| match &e.event {
            KvEvent::BlockStored { block_hashes, .. } => block_hashes.len(),
            _ => 0,
        })
        .sum()
}

#[test]
fn state_kind_and_config_checks() {
    let g = GroupSpec::state(BS, 8);
    assert_eq!(g.kind.name(), "state");
    assert!(g.is_state());
    assert_eq!(g.hit_blocks(8), (1, 2));
    assert_eq!(g.hit_blocks(0), (0, 0));
    let mut c = cfg(8);
    c.groups[1] = GroupSpec::state(BS, 16); // page 64 vs 32 bytes
    match KvCacheManager::new(c) {
        Err(Error::InvalidConfig { field, reason, .. }) => {
            assert_eq!(field, "groups");
            assert!(reason.contains("same size"), "{reason}");
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

/// The worked example: prompt of 10 tokens chunked 8 + 2, then decode across a boundary.
#[test]
fn worked_example_tables_copies_and_zero_rows() {
    let m = mgr(16);
    m.add_sequence(1, toks(10, 0), SequenceSpec::default())
        .unwrap();
    // Chunk 1: [0, 8). Full: blocks 0, 1; state: the live block at (8 - 1) / 4 = 1, fresh.
    let a = m.allocate_slots(1, 8).unwrap();
    let full = a.groups[FULL].new_block_ids.clone();
    assert_eq!(full.len(), 2);
    let s1 = a.groups[STATE].new_block_ids.clone();
    assert_eq!(s1.len(), 1);
    assert_eq!(a.groups[STATE].zero_blocks, s1);
    assert!(a.groups[STATE].copies.is_empty());
    assert!(a.groups[FULL].zero_blocks.is_empty());
    let t = m.block_tables(1).unwrap();
    assert_eq!(t[FULL], full);
    assert_eq!(t[STATE], vec![NULL_BLOCK, s1[0]]);
    assert_eq!(m.num_blocks_held(1).unwrap(), vec![2, 1]);
    ok(&m);
    // Chunk 2: [8, 10). The live index moves 1 -> 2: a copy row, the aligned state after 8
    // tokens stays held for its commit.
    let need = m.num_blocks_needed(1, 2).unwrap();
    assert_eq!((need.take, need.release), (2, 0));
    assert_eq!(need.per_group, vec![(1, 0), (1, 0)]);
    let a = m.allocate_slots(1, 2).unwrap();
    let s2 = a.groups[STATE].new_block_ids.clone();
    assert_eq!(s2.len(), 1);
    assert_eq!(a.groups[STATE].copies, vec![(s1[0], s2[0])]);
    assert!(a.groups[STATE].zero_blocks.is_empty());
    assert!(a.groups[STATE].released.is_empty());
    assert_eq!(
        m.block_tables(1).unwrap()[STATE],
        vec![NULL_BLOCK, s1[0], s2[0]]
    );
    assert_eq!(
        stored(&m, STATE as u32),
        0,
        "nothing of the state group published yet"
    );
    ok(&m);
    // Decode 10 -> 11 -> 12: same block, in place (no copy, nothing taken).
    for n in [11usize, 12] {
        m.append_tokens(1, &[900 + n as u32]).unwrap();
        let need = m.num_blocks_needed(1, 1).unwrap();
        assert_eq!(need.per_group[STATE], (0, 0));
        let a = m.allocate_slots(1, 1).unwrap();
        assert!(a.groups[STATE].new_block_ids.is_empty());
        assert!(a.groups[STATE].copies.is_empty());
        assert_eq!(
            m.block_tables(1).unwrap()[STATE],
            vec![NULL_BLOCK, s1[0], s2[0]]
        );
        ok(&m);
    }
    // 12 -> 13 crosses a boundary: the aligned state after 12 (in s2) is kept for its commit.
    m.append_tokens(1, &[913]).unwrap();
    let a = m.allocate_slots(1, 1).unwrap();
    let s3 = a.groups[STATE].new_block_ids.clone();
    assert_eq!(a.groups[STATE].copies, vec![(s2[0], s3[0])]);
    assert_eq!(
        m.block_tables(1).unwrap()[STATE],
        vec![NULL_BLOCK, s1[0], s2[0], s3[0]]
    );
    ok(&m);
    // The commit of 13 publishes the states after 8 and 12 and releases them (cached).
    let cached_before = m.pool().num_cached_free();
    assert_eq!(m.commit_computed(1, 13).unwrap(), 2);
    assert_eq!(stored(&m, STATE as u32), 2);
    assert_eq!(
        m.block_tables(1).unwrap()[STATE],
        vec![NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, s3[0]]
    );
    assert_eq!(m.pool().num_cached_free(), cached_before + 2);
    assert_eq!(m.commit_computed(1, 13).unwrap(), 0, "nothing new");
    assert_eq!(
        m.commit_computed(1, 4).unwrap(),
        0,
        "below an earlier commit"
    );
    ok(&m);
}

#[test]
fn step_output_rows_for_state_groups() {
    let m = mgr(16);
    m.add_sequence(1, toks(10, 0), SequenceSpec::default())
        .unwrap();
    let out = m.step(&StepRequest {
        seq_ids: vec![1],
        num_new_tokens: vec![8],
        ..Default::default()
    });
    assert!(out.error.is_none(), "{:?}", out.error);
    let t = m.block_tables(1).unwrap();
    assert_eq!(out.zero_blocks, vec![STATE as i32, t[STATE][1] as i32]);
    // Row 1 (the state group) is -1 for every token; row 0 the full group's slots.
    assert_eq!(&out.slot_mapping[8..], &[-1i64; 8]);
    assert_eq!(out.slot_mapping[0], i64::from(t[FULL][0]) * 4);
    assert_eq!(out.block_table_row(STATE, 0), &[0, t[STATE][1] as i32]);
    let out = m.step(&StepRequest {
        seq_ids: vec![1],
        num_new_tokens: vec![2],
        ..Default::default()
    });
    let t2 = m.block_tables(1).unwrap();
    assert!(out.zero_blocks.is_empty());
    assert_eq!(
        out.copies,
        vec![STATE as i32, t[STATE][1] as i32, t2[STATE][2] as i32]
    );
    assert_eq!(&out.slot_mapping[2..], &[-1i64; 2]);
    ok(&m);
}

#[test]
fn hit_after_commit_and_no_hit_before_the_fence() {
    let m = mgr(32);
    m.add_sequence(1, toks(10, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 8).unwrap();
    m.allocate_slots(1, 2).unwrap();
    let state8 = m.block_tables(1).unwrap()[STATE][1];
    // Same first 9 tokens: the full group alone would serve 8, the state is not committed.
    m.add_sequence(2, toks(10, 0), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix_group(2, FULL, 10).unwrap(), 8);
    assert_eq!(m.lookup_prefix_group(2, STATE, 10).unwrap(), 0);
    assert_eq!(m.lookup_prefix(2).unwrap(), 0);
    assert_eq!(
        m.commit_computed(1, 7).unwrap(),
        0,
        "the state after 8 is not covered"
    );
    assert_eq!(m.lookup_prefix(2).unwrap(), 0);
    assert_eq!(m.commit_computed(1, 10).unwrap(), 1);
    assert_eq!(m.lookup_prefix(2).unwrap(), 8);
    // The hit copies the committed state into a fresh live block and lets it go again.
    let a = m.allocate_slots(2, 2).unwrap();
    assert_eq!(a.num_cached_tokens, 8);
    let live = a.groups[STATE].new_block_ids.clone();
    assert_eq!(live.len(), 1);
    assert_eq!(a.groups[STATE].copies, vec![(state8, live[0])]);
    assert_eq!(a.groups[STATE].released, vec![state8]);
    assert!(a.groups[STATE].zero_blocks.is_empty());
    assert_eq!(
        m.block_tables(2).unwrap()[STATE],
        vec![NULL_BLOCK, NULL_BLOCK, live[0]]
    );
    assert_eq!(m.pool().ref_count(state8), 0);
    assert!(m.pool().is_hashed(state8));
    ok(&m);
}

#[test]
fn abort_before_commit_leaves_nothing_matchable() {
    let m = mgr(32);
    m.add_sequence(1, toks(10, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 8).unwrap();
    m.allocate_slots(1, 2).unwrap();
    let state8 = m.block_tables(1).unwrap()[STATE][1];
    assert!(m.free(1));
    assert!(!m.pool().is_hashed(state8));
    assert_eq!(m.pool().ref_count(state8), 0);
    assert_eq!(stored(&m, STATE as u32), 0);
    m.add_sequence(2, toks(10, 0), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 0);
    assert_eq!(m.commit_computed(2, 0).unwrap(), 0);
    ok(&m);
}

#[test]
fn preempt_then_resume_gives_a_zero_row() {
    let m = mgr(32);
    m.add_sequence(1, toks(10, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 8).unwrap();
    m.preempt_recompute(&[1]).unwrap();
    ok(&m);
    assert_eq!(m.status(1).unwrap(), SeqStatus::Preempted);
    let a = m.allocate_slots(1, 10).unwrap();
    assert_eq!(a.num_cached_tokens, 0, "the uncommitted state is gone");
    let live = a.groups[STATE].new_block_ids.clone();
    assert_eq!(a.groups[STATE].zero_blocks, live);
    assert!(a.groups[STATE].copies.is_empty());
    // Committed, then preempted: the resume hits the committed state and copies it.
    assert_eq!(m.commit_computed(1, 10).unwrap(), 0, "10 is not aligned");
    m.append_tokens(1, &[5, 6]).unwrap();
    m.allocate_slots(1, 2).unwrap(); // 12, aligned, live in place
    assert_eq!(m.commit_computed(1, 12).unwrap(), 1);
    let state12 = m.block_tables(1).unwrap()[STATE][2];
    m.append_tokens(1, &[7]).unwrap();
    m.preempt_recompute(&[1]).unwrap();
    let a = m.allocate_slots(1, 13).unwrap();
    assert_eq!(a.num_cached_tokens, 12);
    assert_eq!(a.groups[STATE].copies.len(), 1);
    assert_eq!(a.groups[STATE].copies[0].0, state12);
    assert!(a.groups[STATE].zero_blocks.is_empty());
    ok(&m);
}

#[test]
fn unaligned_step_ends_are_never_published() {
    let m = mgr(32);
    m.add_sequence(1, toks(12, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 5).unwrap();
    let a = m.allocate_slots(1, 6).unwrap(); // 5 -> 11: the state after 5 is released
    let released = a.groups[STATE].released.clone();
    assert_eq!(released.len(), 1);
    assert!(!m.pool().is_hashed(released[0]));
    assert_eq!(m.commit_computed(1, 11).unwrap(), 0);
    assert_eq!(stored(&m, STATE as u32), 0);
    m.add_sequence(2, toks(12, 0), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 0);
    ok(&m);
}

#[test]
fn hit_is_the_newest_committed_state_at_or_below_the_attention_hit() {
    let m = mgr(64);
    m.add_sequence(1, toks(17, 0), SequenceSpec::default())
        .unwrap();
    for _ in 0..4 {
        m.allocate_slots(1, 4).unwrap(); // 4, 8, 12, 16
    }
    // Commit only up to 8: the states after 4 and 8 are published, 12 waits.
    assert_eq!(m.commit_computed(1, 11).unwrap(), 2);
    m.add_sequence(2, toks(17, 0), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix_group(2, FULL, 16).unwrap(), 16);
    assert_eq!(m.lookup_prefix(2).unwrap(), 8);
    // A prompt that shares 6 tokens: the full group serves 4, the state after 4 is there.
    let mut p = toks(6, 0);
    p.extend([77, 78, 79]);
    m.add_sequence(3, p, SequenceSpec::default()).unwrap();
    assert_eq!(m.lookup_prefix(3).unwrap(), 4);
    assert_eq!(m.commit_computed(1, 16).unwrap(), 2);
    assert_eq!(m.lookup_prefix(2).unwrap(), 16);
    ok(&m);
}

#[test]
fn retention_interval_publishes_only_its_multiples() {
    let mut c = cfg(64);
    c.retention_interval = 8;
    let m = KvCacheManager::new(c).unwrap();
    m.add_sequence(1, toks(17, 0), SequenceSpec::default())
        .unwrap();
    for _ in 0..4 {
        m.allocate_slots(1, 4).unwrap();
        ok(&m);
    }
    // The states after 4 and 12 were released at their moves (never publishable).
    let t = m.block_tables(1).unwrap()[STATE].clone();
    assert_eq!(t[0], NULL_BLOCK);
    assert_ne!(t[1], NULL_BLOCK);
    assert_eq!(t[2], NULL_BLOCK);
    assert_eq!(m.commit_computed(1, 16).unwrap(), 2); // after 8 and 16
    m.add_sequence(2, toks(17, 0), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 16);
    let mut p = toks(14, 0);
    p.push(99);
    m.add_sequence(3, p, SequenceSpec::default()).unwrap();
    assert_eq!(m.lookup_prefix(3).unwrap(), 8, "no state after 12");
    ok(&m);
}

#[test]
fn swap_out_releases_pending_states_unpublished() {
    let mut c = cfg(32);
    c.num_cpu_blocks = 16;
    let m = KvCacheManager::new(c).unwrap();
    m.add_sequence(1, toks(10, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 8).unwrap();
    m.allocate_slots(1, 2).unwrap();
    let state8 = m.block_tables(1).unwrap()[STATE][1];
    m.swap_out(&[1]).unwrap();
    ok(&m);
    assert_eq!(m.pool().ref_count(state8), 0);
    m.swap_in(&[1]).unwrap();
    ok(&m);
    assert_eq!(m.commit_computed(1, 10).unwrap(), 0);
    m.add_sequence(2, toks(10, 0), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 0);
}

#[test]
fn refusals_are_typed_and_change_nothing() {
    let m = mgr(32);
    m.add_sequence(1, toks(10, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 8).unwrap();
    let tables = m.block_tables(1).unwrap();
    let free = m.pool().num_free();
    let same = |m: &KvCacheManager| {
        assert_eq!(m.block_tables(1).unwrap(), tables);
        assert_eq!(m.num_computed_tokens(1).unwrap(), 8);
        assert_eq!(m.pool().num_free(), free);
        ok(m);
    };
    match m.commit_computed(1, 9) {
        Err(Error::InvalidArgument { arg, .. }) => assert_eq!(arg, "num_tokens"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    same(&m);
    assert!(matches!(
        m.commit_computed(7, 0),
        Err(Error::UnknownSequence { seq_id: 7 })
    ));
    m.append_tokens(1, &[]).unwrap();
    match m.allocate_slots_with_drafts(1, 2, &[5, 6]) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("speculative decoding"), "{reason}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    same(&m);
    match m.allocate_slots_with_lookahead(1, 2, &[], 3) {
        Err(Error::InvalidArgument { arg, reason, .. }) => {
            assert_eq!(arg, "num_lookahead");
            assert!(reason.contains("speculative decoding"), "{reason}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    same(&m);
    match m.fork(1, 2) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("state groups"), "{reason}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    same(&m);
    assert!(m.status(2).is_err());
    match m.rollback(1, 4, false) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("state group"), "{reason}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    same(&m);
    m.add_sequence(3, toks(10, 1), SequenceSpec::default())
        .unwrap();
    match m.allocate_external(3, 4, 0, true, 0) {
        Err(Error::InvalidArgument { arg, .. }) => assert_eq!(arg, "num_external_tokens"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert!(m.block_tables(3).unwrap().iter().all(Vec::is_empty));
    same(&m);
}

#[test]
fn demand_is_exact_for_moves_and_hits() {
    // 1 + 1 blocks at the first chunk, a tight pool: the move's release makes room.
    let m = mgr(64);
    m.add_sequence(1, toks(13, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 5).unwrap();
    let need = m.num_blocks_needed(1, 4).unwrap();
    // 5 -> 9: full takes 1 (block 2), state moves 1 -> 2 releasing the unaligned state.
    assert_eq!(need.per_group, vec![(1, 0), (1, 1)]);
    let free = m.pool().num_free();
    m.allocate_slots(1, 4).unwrap();
    assert_eq!(m.pool().num_free() as isize, free as isize - need.net());
    ok(&m);
    let owed = m.num_blocks_owed(&[1]).unwrap();
    let free = m.pool().num_free();
    m.allocate_slots(1, 4).unwrap();
    assert_eq!(free - m.pool().num_free(), owed);
    ok(&m);
}
