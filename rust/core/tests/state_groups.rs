//! State groups (Mamba / linear attention recurrent states) and the commit fence
//! (docs/design.md, "KV cache groups", state groups): live-state moves, copies and zero
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
    // A fresh pool hands out 1, 2, ... in group order.
    let full = a.groups[FULL].new_block_ids.clone();
    assert_eq!(full, vec![1, 2]);
    let s1 = a.groups[STATE].new_block_ids.clone();
    assert_eq!(s1, vec![3]);
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
    assert_eq!(a.groups[FULL].new_block_ids, vec![4]);
    assert_eq!(s2, vec![5]);
    assert_eq!(a.groups[STATE].copies, vec![(3, 5)]);
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
    assert_eq!(a.groups[FULL].new_block_ids, vec![6]);
    assert_eq!(s3, vec![7]);
    assert_eq!(a.groups[STATE].copies, vec![(5, 7)]);
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
        m.block_tables(1).unwrap(),
        vec![
            vec![1, 2, 4, 6],
            vec![NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 7]
        ]
    );
    assert_eq!(m.pool().num_cached_free(), cached_before + 2);
    assert!(m.pool().is_hashed(3) && m.pool().is_hashed(5));
    assert_eq!((m.pool().ref_count(3), m.pool().ref_count(5)), (0, 0));
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
    assert!(
        a.groups[STATE].released.is_empty(),
        "the hit block was never taken"
    );
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
fn placeholder_slots_keep_the_state_and_publish_at_their_commit() {
    // An asynchronous scheduler's decodes: the slot of a token whose id is not known yet is a
    // draft (placeholder) slot. The live state moves with it into a new block; settling the
    // placeholder keeps that block (the state there is the step's), and the token, once
    // appended, is computed into it without a second move.
    let t = toks(9, 0);
    let m = mgr(32);
    m.add_sequence(1, t[..7].to_vec(), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 7).unwrap();
    // Position 7, token unknown: the state after 8 is written in block 1 (already live).
    let a = m.allocate_slots_with_drafts(1, 0, &[0]).unwrap();
    assert!(a.groups[STATE].new_block_ids.is_empty());
    ok(&m);
    // Token 7 known, position 8 unknown: the state moves to block 2; the state after 8 in
    // block 1 waits for its commit.
    m.accept_drafts_keeping_blocks(1, 0).unwrap();
    m.append_tokens(1, &t[7..8]).unwrap();
    ok(&m);
    let b = m.allocate_slots_with_drafts(1, 1, &[0]).unwrap();
    let col1 = m.block_tables(1).unwrap()[STATE][1];
    assert_eq!(b.groups[STATE].new_block_ids.len(), 1);
    assert_eq!(
        b.groups[STATE].copies,
        vec![(col1, b.groups[STATE].new_block_ids[0])]
    );
    assert!(
        b.groups[STATE].released.is_empty(),
        "the state after 8 waits for its commit"
    );
    ok(&m);
    m.add_sequence(2, t.clone(), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 0, "not before the commit");
    assert_eq!(m.commit_computed(1, 8).unwrap(), 1);
    assert_eq!(m.lookup_prefix(2).unwrap(), 8);
    assert!(m.pool().is_hashed(col1) && m.pool().ref_count(col1) == 0);
    assert_eq!(m.block_tables(1).unwrap()[STATE][1], NULL_BLOCK);
    ok(&m);
    // Token 8 known: computed into the placeholder's blocks, nothing taken or moved.
    m.accept_drafts_keeping_blocks(1, 0).unwrap();
    ok(&m);
    m.append_tokens(1, &t[8..9]).unwrap();
    let live = m.block_tables(1).unwrap()[STATE][2];
    let c = m.allocate_slots(1, 1).unwrap();
    assert!(c
        .groups
        .iter()
        .all(|g| g.new_block_ids.is_empty() && g.copies.is_empty()));
    assert_eq!(m.num_computed_tokens(1).unwrap(), 9);
    assert_eq!(m.block_tables(1).unwrap()[STATE][2], live);
    ok(&m);
    // A placeholder's state cannot be rolled back: rejecting it while giving its blocks back
    // is refused, nothing changed.
    m.allocate_slots_with_drafts(1, 0, &[0]).unwrap();
    match m.accept_drafts(1, 0) {
        Err(Error::InvalidArgument { arg, .. }) => assert_eq!(arg, "num_accepted"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert_eq!(m.num_draft_tokens(1).unwrap(), 1);
    m.accept_drafts_keeping_blocks(1, 0).unwrap();
    ok(&m);
    // Preempted with a settled placeholder: everything goes, the resume starts afresh.
    m.preempt_recompute(&[1]).unwrap();
    ok(&m);
    assert!(m.free(1));
    assert!(m.free(2));
    ok(&m);
    assert_eq!(m.pool().num_used(), 0);
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
    // A load of a recurrent state commits in full or not at all.
    m.add_sequence(3, toks(10, 1), SequenceSpec::default())
        .unwrap();
    m.allocate_external(3, 8, 0, true, 0).unwrap();
    let loading = m.block_tables(3).unwrap();
    let free3 = m.pool().num_free();
    for v in [0, 4, 7] {
        match m.commit_external(3, v) {
            Err(Error::InvalidArgument { arg, .. }) => assert_eq!(arg, "num_valid_tokens"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        assert_eq!(m.block_tables(3).unwrap(), loading);
        assert_eq!(m.status(3).unwrap(), SeqStatus::Loading);
        assert_eq!(m.pool().num_free(), free3);
        ok(&m);
    }
    assert!(m.free(3));
    same(&m);
}

// ---- external loads (KV connectors) with state groups -------------------------------------

#[test]
fn staged_load_state_is_never_matched_until_its_commit() {
    let m = mgr(32);
    m.add_sequence(1, toks(10, 0), SequenceSpec::default())
        .unwrap();
    let need = m.num_blocks_needed_external(1, 8, 0).unwrap();
    let free = m.pool().num_free();
    let a = m.allocate_external(1, 8, 0, true, 0).unwrap();
    assert_eq!(free - m.pool().num_free(), need.take);
    assert_eq!(need.per_group, vec![(2, 0), (1, 0)]);
    assert_eq!((a.num_cached_tokens, a.num_context_tokens), (0, 8));
    // The live state after 8 tokens at column 1, null before it; nothing to copy or zero (the
    // connector writes it).
    let t = m.block_tables(1).unwrap();
    assert_eq!(t[STATE].len(), 2);
    assert_eq!(t[STATE][0], NULL_BLOCK);
    assert_eq!(a.groups[STATE].new_block_ids, vec![t[STATE][1]]);
    assert!(a.groups[STATE].copies.is_empty());
    assert_eq!(m.status(1).unwrap(), SeqStatus::Loading);
    assert_eq!(m.num_staged_tokens(1).unwrap(), 8);
    // Loading: a commit of the steps publishes nothing, no sibling matches any of it.
    assert_eq!(m.commit_all_computed(&[1]).unwrap(), 0);
    assert_eq!(m.commit_computed(1, 8).unwrap(), 0);
    m.add_sequence(2, toks(10, 0), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix_group(2, FULL, 9).unwrap(), 0);
    assert_eq!(m.lookup_prefix_group(2, STATE, 9).unwrap(), 0);
    assert_eq!(m.lookup_prefix(2).unwrap(), 0);
    assert!(!m.pool().is_hashed(t[STATE][1]));
    assert_eq!(stored(&m, STATE as u32), 0);
    ok(&m);
    // The load completed: the full blocks and the aligned state after 8 are published.
    assert_eq!(m.commit_external(1, 8).unwrap(), 3);
    assert!(m.pool().is_hashed(t[STATE][1]));
    assert_eq!(stored(&m, STATE as u32), 1);
    assert_eq!(m.lookup_prefix(2).unwrap(), 8);
    assert_eq!(m.num_computed_tokens(1).unwrap(), 8);
    ok(&m);
    // It runs on from the loaded state: the move copies it into the next live block.
    let b = m.allocate_slots(1, 2).unwrap();
    assert_eq!(
        b.groups[STATE].copies,
        vec![(t[STATE][1], b.groups[STATE].new_block_ids[0])]
    );
    ok(&m);
}

#[test]
fn staged_load_after_a_hit_and_unaligned_ends() {
    let m = mgr(32);
    m.add_sequence(1, toks(14, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 8).unwrap();
    m.allocate_slots(1, 2).unwrap();
    let state8 = m.block_tables(1).unwrap()[STATE][1];
    assert_eq!(m.commit_computed(1, 10).unwrap(), 1);
    // Hit 8, 3 tokens loaded (an unaligned end): live column (11 - 1) / 4 = 2.
    m.add_sequence(2, toks(14, 0), SequenceSpec::default())
        .unwrap();
    let need = m.num_blocks_needed_external(2, 3, 0).unwrap();
    let free = m.pool().num_free();
    let a = m.allocate_external(2, 3, 0, true, 0).unwrap();
    assert_eq!(free + need.release - m.pool().num_free(), need.take);
    assert_eq!((a.num_cached_tokens, a.num_context_tokens), (8, 11));
    let t = m.block_tables(2).unwrap();
    assert_eq!(t[STATE][..2], [NULL_BLOCK, NULL_BLOCK]);
    assert_eq!(t[STATE].len(), 3);
    // The hit state is the copy source, as for an ordinary hit (released cached).
    assert_eq!(a.groups[STATE].copies, vec![(state8, t[STATE][2])]);
    assert!(m.pool().is_hashed(state8));
    ok(&m);
    // An unaligned load end publishes no state; its full blocks are registered.
    m.commit_external(2, 11).unwrap();
    assert!(!m.pool().is_hashed(t[STATE][2]));
    m.add_sequence(3, toks(14, 0), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(3).unwrap(), 8);
    ok(&m);
    // The step from 11 computes to 12: the commit publishes the state there.
    m.allocate_slots(2, 1).unwrap();
    assert_eq!(m.commit_computed(2, 12).unwrap(), 1);
    assert_eq!(m.lookup_prefix(3).unwrap(), 12);
    ok(&m);
}

#[test]
fn failed_or_aborted_loads_leave_no_matchable_state() {
    let m = mgr(32);
    for (seq, how) in [(1u64, "free"), (2, "preempt"), (3, "deferred")] {
        m.add_sequence(seq, toks(10, 0), SequenceSpec::default())
            .unwrap();
        m.allocate_external(seq, 8, 0, true, 0).unwrap();
        let live = m.block_tables(seq).unwrap()[STATE][1];
        match how {
            "free" => assert!(m.free(seq)),
            "preempt" => m.preempt_recompute(&[seq]).unwrap(),
            _ => {
                let h = m.free_deferred(seq).unwrap();
                assert!(!m.pool().is_hashed(live));
                m.release_deferred(h).unwrap();
            }
        }
        assert!(!m.pool().is_hashed(live), "{how}");
        assert_eq!(stored(&m, STATE as u32), 0, "{how}");
        m.add_sequence(9, toks(10, 0), SequenceSpec::default())
            .unwrap();
        assert_eq!(m.lookup_prefix(9).unwrap(), 0, "{how}");
        assert!(m.free(9));
        ok(&m);
    }
    // The preempted one recomputes from scratch: a fresh live block, a zero row.
    let a = m.allocate_slots(2, 4).unwrap();
    assert_eq!(a.num_cached_tokens, 0);
    assert_eq!(a.groups[STATE].zero_blocks.len(), 1);
    ok(&m);
    assert_eq!(m.pool().num_used(), 2);
}

#[test]
fn a_load_bringing_the_state_takes_the_attention_hit() {
    // The full group caches 12 tokens, the state group only the state after 4 (a divergent
    // hit): a connector that loads the state takes the attention hit, its state group none.
    let m = mgr(32);
    m.add_sequence(1, toks(14, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 4).unwrap();
    m.allocate_slots(1, 9).unwrap();
    assert_eq!(m.commit_computed(1, 13).unwrap(), 1); // the state after 4 only (13 unaligned)
    m.add_sequence(2, toks(20, 0), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix_group(2, FULL, 19).unwrap(), 12);
    assert_eq!(m.lookup_prefix_group(2, STATE, 19).unwrap(), 4);
    assert_eq!(m.lookup_prefix(2).unwrap(), 4);
    m.set_state_from_load(2, true).unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 12);
    // Without external tokens the allocation is refused and changes nothing.
    let free = m.pool().num_free();
    match m.allocate_slots(2, 4) {
        Err(Error::InvalidArgument { arg, .. }) => assert_eq!(arg, "num_external_tokens"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert!(m.block_tables(2).unwrap().iter().all(Vec::is_empty));
    assert_eq!(m.pool().num_free(), free);
    let need = m.num_blocks_needed_external(2, 7, 0).unwrap();
    let a = m.allocate_external(2, 7, 0, true, 0).unwrap();
    assert_eq!((a.num_cached_tokens, a.num_context_tokens), (12, 19));
    assert_eq!(free + need.release - m.pool().num_free(), need.take);
    // The state group: no hit block, no copy, no zero row; the live block at column 4.
    let t = m.block_tables(2).unwrap();
    assert_eq!(t[STATE][..4], [NULL_BLOCK; 4]);
    assert_eq!(t[STATE].len(), 5);
    assert!(a.groups[STATE].copies.is_empty() && a.groups[STATE].zero_blocks.is_empty());
    ok(&m);
    // Cleared by the allocation; a held sequence cannot set it again.
    assert!(matches!(
        m.set_state_from_load(2, true),
        Err(Error::InvalidSequenceState { .. })
    ));
    m.set_state_from_load(2, false).unwrap();
    assert!(matches!(
        m.set_state_from_load(99, true),
        Err(Error::UnknownSequence { .. })
    ));
    m.commit_external(2, 19).unwrap();
    ok(&m);
    // Reset by set_state_from_load(false): the hit every group serves again.
    m.add_sequence(3, toks(20, 0), SequenceSpec::default())
        .unwrap();
    m.set_state_from_load(3, true).unwrap();
    m.set_state_from_load(3, false).unwrap();
    assert_eq!(m.lookup_prefix(3).unwrap(), 4);
    ok(&m);
}

#[test]
fn sync_load_states_wait_for_the_step_commit() {
    let m = mgr(32);
    m.add_sequence(1, toks(14, 0), SequenceSpec::default())
        .unwrap();
    // 8 loaded, 4 computed in the same step: live state after 12 at column 2.
    let a = m.allocate_external(1, 8, 4, false, 0).unwrap();
    assert_eq!((a.num_context_tokens, a.num_scheduled_tokens), (8, 4));
    let t = m.block_tables(1).unwrap();
    assert_eq!(t[STATE][..2], [NULL_BLOCK, NULL_BLOCK]);
    m.add_sequence(2, toks(14, 0), SequenceSpec::default())
        .unwrap();
    // The full blocks are registered at allocation, the state is not published before its
    // step completed.
    assert_eq!(m.lookup_prefix_group(2, FULL, 13).unwrap(), 12);
    assert_eq!(m.lookup_prefix(2).unwrap(), 0);
    assert_eq!(m.commit_computed(1, 12).unwrap(), 1);
    assert_eq!(m.lookup_prefix(2).unwrap(), 12);
    ok(&m);
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

// ---- proptest: random operations over full + state (+ window) groups -----------------------

mod model {
    use super::*;
    use pagedkv_core::{manager::CPU_NULL, SeqId};
    use proptest::prelude::*;
    use proptest::test_runner::FileFailurePersistence;
    use std::collections::{HashMap, HashSet};

    #[derive(Debug, Clone)]
    pub enum Op {
        Add {
            family: u8,
            len: u8,
        },
        Append {
            seq: usize,
            n: u8,
        },
        Allocate {
            seq: usize,
            n: u8,
        },
        Step {
            seqs: Vec<usize>,
            n: u8,
        },
        Commit {
            seq: usize,
            back: u8,
        },
        Free {
            seq: usize,
        },
        Preempt {
            seq: usize,
        },
        SwapOut {
            seq: usize,
        },
        SwapIn {
            seq: usize,
        },
        Lookup {
            seq: usize,
        },
        /// `num_blocks_owed`, then every member's uncomputed tokens scheduled in order.
        Owed {
            seqs: Vec<usize>,
        },
        /// A KV connector's load into a sequence without blocks: staged (async) or sync with
        /// `n` tokens computed after it.
        External {
            seq: usize,
            ext: u8,
            n: u8,
            staged: bool,
        },
        /// The end of a staged load: a short (partial) commit first (refused, nothing
        /// changed), then the commit in full.
        CommitLoad {
            seq: usize,
            short: u8,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => (0u8..3, 1u8..24).prop_map(|(family, len)| Op::Add { family, len }),
            2 => (any::<usize>(), 1u8..4).prop_map(|(seq, n)| Op::Append { seq, n }),
            5 => (any::<usize>(), 1u8..10).prop_map(|(seq, n)| Op::Allocate { seq, n }),
            2 => (prop::collection::vec(any::<usize>(), 1..4), 1u8..8)
                .prop_map(|(seqs, n)| Op::Step { seqs, n }),
            4 => (any::<usize>(), 0u8..6).prop_map(|(seq, back)| Op::Commit { seq, back }),
            1 => any::<usize>().prop_map(|seq| Op::Free { seq }),
            1 => any::<usize>().prop_map(|seq| Op::Preempt { seq }),
            1 => any::<usize>().prop_map(|seq| Op::SwapOut { seq }),
            1 => any::<usize>().prop_map(|seq| Op::SwapIn { seq }),
            2 => any::<usize>().prop_map(|seq| Op::Lookup { seq }),
            1 => prop::collection::vec(any::<usize>(), 1..4).prop_map(|seqs| Op::Owed { seqs }),
            3 => (any::<usize>(), 1u8..20, 0u8..6, any::<bool>())
                .prop_map(|(seq, ext, n, staged)| Op::External { seq, ext, n, staged }),
            3 => (any::<usize>(), 0u8..3).prop_map(|(seq, short)| Op::CommitLoad { seq, short }),
        ]
    }

    fn layout(k: u8) -> (Vec<GroupSpec>, Vec<u32>) {
        match k {
            0 => (
                vec![GroupSpec::full(4, 8), GroupSpec::state(4, 8)],
                vec![0, 1],
            ),
            // Hit unit 4: the full group's blocks are half the state group's.
            1 => (
                vec![GroupSpec::full(2, 16), GroupSpec::state(4, 8)],
                vec![1, 0],
            ),
            2 => (
                vec![
                    GroupSpec::full(4, 8),
                    GroupSpec::sliding_window(4, 8, 6),
                    GroupSpec::state(4, 8),
                ],
                vec![0, 1, 2, 2],
            ),
            // The state group first, aligned on 8 tokens (hit unit 8).
            _ => (
                vec![GroupSpec::state(8, 4), GroupSpec::full(4, 8)],
                vec![0, 1],
            ),
        }
    }

    /// Everything observable about one sequence, to check that a failed call changes nothing.
    fn snapshot(m: &KvCacheManager, id: SeqId) -> (Vec<Vec<u32>>, usize, usize, usize) {
        (
            m.block_tables(id).unwrap(),
            m.num_computed_tokens(id).unwrap(),
            m.num_tokens(id).unwrap(),
            m.pool().num_free(),
        )
    }

    struct Model {
        m: KvCacheManager,
        ids: Vec<SeqId>,
        next: SeqId,
        /// Per sequence, the token prefixes of its aligned step ends not yet committed.
        pending: HashMap<SeqId, Vec<Vec<u32>>>,
        /// Token prefixes whose state a commit covered (the only ones a hit may return).
        committed: HashSet<Vec<u32>>,
        state_bs: Vec<usize>,
    }

    impl Model {
        fn pick(&self, k: usize) -> Option<SeqId> {
            (!self.ids.is_empty()).then(|| self.ids[k % self.ids.len()])
        }

        /// Records the aligned step end of an allocation of `id` that ended at `end`.
        fn note_end(&mut self, id: SeqId, end: usize) {
            if self.state_bs.iter().all(|&bs| end % bs == 0) {
                let toks = self.m.tokens(id).unwrap()[..end].to_vec();
                self.pending.entry(id).or_default().push(toks);
            }
        }

        fn allocate(&mut self, id: SeqId, n: usize) {
            let before = snapshot(&self.m, id);
            let need = self.m.num_blocks_needed(id, n);
            match self.m.allocate_slots(id, n) {
                Ok(a) => {
                    let need = need.unwrap();
                    assert_eq!(
                        self.m.pool().num_free() as isize,
                        before.3 as isize - need.net(),
                        "demand {need:?}"
                    );
                    // Every fresh state block without a hit is zeroed; a hit's is copied (unless
                    // this call evicted the hit block and took it again as the live block).
                    for (g, ga) in a.groups.iter().enumerate() {
                        if self.m.config().groups[g].is_state() && a.num_context_tokens == 0 {
                            assert_eq!(ga.zero_blocks.len(), 1);
                        }
                        if self.m.config().groups[g].is_state() && a.num_cached_tokens > 0 {
                            assert!(ga.copies.len() <= 1);
                            assert!(ga.zero_blocks.is_empty());
                        }
                    }
                    let end = a.num_context_tokens + a.num_scheduled_tokens;
                    self.note_end(id, end);
                }
                Err(_) => assert_eq!(snapshot(&self.m, id), before, "failed call changed state"),
            }
        }

        fn check_lookup(&self, id: SeqId) {
            let hit = self.m.lookup_prefix(id).unwrap();
            if hit > 0 {
                let toks = self.m.tokens(id).unwrap();
                assert!(
                    self.committed.contains(&toks[..hit]),
                    "a lookup of {hit} tokens returned a state never committed"
                );
            }
        }

        fn apply(&mut self, op: Op) {
            match op {
                Op::Add { family, len } => {
                    let id = self.next;
                    self.next += 1;
                    let mut p: Vec<u32> = (0..len as u32)
                        .map(|i| u32::from(family) * 100 + i)
                        .collect();
                    // A private tail after 12 shared tokens.
                    for (i, t) in p.iter_mut().enumerate().skip(12) {
                        *t = 10_000 + id as u32 * 50 + i as u32;
                    }
                    self.m.add_sequence(id, p, SequenceSpec::default()).unwrap();
                    self.check_lookup(id);
                    self.ids.push(id);
                }
                Op::Append { seq, n } => {
                    if let Some(id) = self.pick(seq) {
                        let extra: Vec<u32> = (0..n as u32).map(|i| 500 + i).collect();
                        let _ = self.m.append_tokens(id, &extra);
                    }
                }
                Op::Allocate { seq, n } => {
                    if let Some(id) = self.pick(seq) {
                        if self.m.status(id).unwrap() != SeqStatus::Swapped {
                            self.check_lookup(id);
                        }
                        self.allocate(id, n as usize);
                    }
                }
                Op::Step { seqs, n } => {
                    let mut ids: Vec<SeqId> = seqs.iter().filter_map(|&k| self.pick(k)).collect();
                    ids.sort_unstable();
                    ids.dedup();
                    let out = self.m.step(&StepRequest {
                        seq_ids: ids.clone(),
                        num_new_tokens: vec![u32::from(n); ids.len()],
                        ..Default::default()
                    });
                    for (k, &id) in ids.iter().enumerate().take(out.num_scheduled) {
                        self.note_end(id, out.seq_lens[k] as usize);
                    }
                    // Each state group's rows: -1; zero rows name state groups only.
                    let t = out.slot_mapping.len() / out.num_groups.max(1);
                    for (g, spec) in self.m.config().groups.iter().enumerate() {
                        if spec.is_state() {
                            assert!(out.slot_mapping[g * t..(g + 1) * t]
                                .iter()
                                .all(|&x| x == -1));
                        }
                    }
                    for z in out.zero_blocks.chunks(2) {
                        assert!(self.m.config().groups[z[0] as usize].is_state());
                    }
                }
                Op::Commit { seq, back } => {
                    if let Some(id) = self.pick(seq) {
                        let c = self.m.num_computed_tokens(id).unwrap();
                        let n = c.saturating_sub(back as usize);
                        self.m.commit_computed(id, n).unwrap();
                        let running = self.m.status(id).unwrap() == SeqStatus::Running;
                        let list = self.pending.entry(id).or_default();
                        if running {
                            let (done, rest): (Vec<_>, Vec<_>) =
                                list.drain(..).partition(|p| p.len() <= n);
                            *list = rest;
                            self.committed.extend(done);
                        }
                        let before = snapshot(&self.m, id);
                        assert!(self.m.commit_computed(id, c + 1).is_err());
                        assert_eq!(snapshot(&self.m, id), before);
                    }
                }
                Op::Free { seq } => {
                    if let Some(id) = self.pick(seq) {
                        assert!(self.m.free(id));
                        self.ids.retain(|&x| x != id);
                        self.pending.remove(&id);
                    }
                }
                Op::Preempt { seq } => {
                    if let Some(id) = self.pick(seq) {
                        if self.m.preempt_recompute(&[id]).is_ok() {
                            self.pending.remove(&id);
                        }
                    }
                }
                Op::SwapOut { seq } => {
                    if let Some(id) = self.pick(seq) {
                        if self.m.swap_out(&[id]).is_ok() {
                            self.pending.remove(&id);
                            let t = self.m.block_tables(id).unwrap();
                            for (g, spec) in self.m.config().groups.iter().enumerate() {
                                if spec.is_state() {
                                    let held = t[g].iter().filter(|&&b| b != CPU_NULL).count();
                                    assert!(held <= 1, "a swapped state table holds {held}");
                                }
                            }
                        }
                    }
                }
                Op::SwapIn { seq } => {
                    if let Some(id) = self.pick(seq) {
                        let _ = self.m.swap_in(&[id]);
                    }
                }
                Op::Owed { seqs } => {
                    let mut ids: Vec<SeqId> = seqs.iter().filter_map(|&k| self.pick(k)).collect();
                    ids.sort_unstable();
                    ids.dedup();
                    ids.retain(|&id| {
                        !matches!(
                            self.m.status(id).unwrap(),
                            SeqStatus::Swapped | SeqStatus::Loading
                        )
                    });
                    let owed = self.m.num_blocks_owed(&ids).unwrap();
                    let free0 = self.m.pool().num_free();
                    if owed > free0 {
                        return;
                    }
                    // Exactly the peak of the members' demand, scheduled in order.
                    let mut peak = 0isize;
                    for &id in &ids {
                        let left = self.m.num_tokens(id).unwrap()
                            - self.m.num_computed_tokens(id).unwrap();
                        if left == 0 {
                            continue;
                        }
                        let a = self.m.allocate_slots(id, left).unwrap();
                        self.note_end(id, a.num_context_tokens + a.num_scheduled_tokens);
                        peak = peak.max(free0 as isize - self.m.pool().num_free() as isize);
                    }
                    assert_eq!(peak as usize, owed, "owed {owed}, peak {peak}");
                }
                Op::External {
                    seq,
                    ext,
                    n,
                    staged,
                } => {
                    let Some(id) = self.pick(seq) else { return };
                    let n = if staged { 0 } else { n.max(1) as usize };
                    let before = snapshot(&self.m, id);
                    let need = self.m.num_blocks_needed_external(id, ext as usize, n);
                    match self.m.allocate_external(id, ext as usize, n, staged, 0) {
                        Ok(a) => {
                            let need = need.unwrap();
                            assert_eq!(
                                self.m.pool().num_free() as isize,
                                before.3 as isize - need.net(),
                                "demand {need:?}"
                            );
                            assert_eq!(a.num_context_tokens, a.num_cached_tokens + ext as usize);
                            if !staged {
                                self.note_end(id, a.num_context_tokens + a.num_scheduled_tokens);
                            }
                        }
                        Err(_) => {
                            assert_eq!(snapshot(&self.m, id), before, "failed call changed state")
                        }
                    }
                }
                Op::CommitLoad { seq, short } => {
                    let Some(id) = self.pick(seq) else { return };
                    if self.m.status(id).unwrap() != SeqStatus::Loading {
                        assert!(self.m.commit_external(id, 0).is_err());
                        return;
                    }
                    let hi = self.m.num_computed_tokens(id).unwrap();
                    let lo = hi - self.m.num_staged_tokens(id).unwrap();
                    if short > 0 && hi - lo >= short as usize {
                        let before = snapshot(&self.m, id);
                        assert!(self.m.commit_external(id, hi - short as usize).is_err());
                        assert_eq!(
                            snapshot(&self.m, id),
                            before,
                            "a partial commit changed state"
                        );
                    }
                    self.m.commit_external(id, hi).unwrap();
                    if self.state_bs.iter().all(|&bs| hi % bs == 0) {
                        self.committed
                            .insert(self.m.tokens(id).unwrap()[..hi].to_vec());
                    }
                }
                Op::Lookup { seq } => {
                    if let Some(id) = self.pick(seq) {
                        if self.m.status(id).unwrap() != SeqStatus::Swapped {
                            self.check_lookup(id);
                        }
                    }
                }
            }
        }
    }

    pub fn run(layout_k: u8, num_blocks: u32, retention: bool, ops: Vec<Op>) {
        let (groups, layers) = layout(layout_k);
        let mut c = CacheConfig::with_groups(num_blocks, groups, layers);
        c.num_cpu_blocks = 16;
        c.enable_events = true;
        let unit = c.hit_unit().unwrap();
        if retention {
            c.retention_interval = 2 * unit;
        }
        let state_bs = c
            .groups
            .iter()
            .filter(|g| g.is_state())
            .map(|g| g.block_size as usize)
            .collect();
        let mut md = Model {
            m: KvCacheManager::new(c).unwrap(),
            ids: Vec::new(),
            next: 1,
            pending: HashMap::new(),
            committed: HashSet::new(),
            state_bs,
        };
        for op in ops {
            md.apply(op);
            md.m.check_invariants().unwrap();
            // Every published state block in the events belongs to a committed prefix.
            for e in md.m.take_events() {
                let Some(g) = e.group else { continue };
                if !md.m.config().groups[g as usize].is_state() {
                    continue;
                }
                if let KvEvent::BlockStored { .. } = e.event {
                    assert!(!md.committed.is_empty(), "a state stored before any commit");
                }
            }
        }
        for id in md.ids.clone() {
            md.m.free(id);
        }
        md.m.check_invariants().unwrap();
        assert_eq!(md.m.pool().num_free(), num_blocks as usize - 1);
    }

    fn cases() -> u32 {
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(300)
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: cases(),
            failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
            ..ProptestConfig::default()
        })]

        #[test]
        fn state_groups_against_the_model(
            layout_k in 0u8..4,
            num_blocks in 6u32..40,
            retention in prop::bool::weighted(0.3),
            ops in prop::collection::vec(op(), 1..70),
        ) {
            run(layout_k, num_blocks, retention, ops);
        }
    }
}

#[test]
fn commit_all_computed_commits_each_whole_computed_range() {
    let m = mgr(32);
    for (seq, salt) in [(1, 0), (2, 1), (3, 2)] {
        m.add_sequence(seq, toks(10, salt), SequenceSpec::default())
            .unwrap();
    }
    m.allocate_slots(1, 8).unwrap();
    m.allocate_slots(2, 8).unwrap();
    m.allocate_slots(3, 6).unwrap(); // ends between alignment points: nothing to publish
    let _ = m.take_events();
    // An unknown id anywhere refuses the whole batch, nothing published.
    assert!(matches!(
        m.commit_all_computed(&[1, 9]),
        Err(Error::UnknownSequence { .. })
    ));
    assert_eq!(stored(&m, STATE as u32), 0);
    assert_eq!(m.commit_all_computed(&[1, 2, 3]).unwrap(), 2);
    assert_eq!(stored(&m, STATE as u32), 2);
    assert_eq!(m.commit_all_computed(&[1, 2, 3]).unwrap(), 0);
    m.add_sequence(4, toks(9, 1), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(4).unwrap(), 8);
    ok(&m);
}

#[test]
fn a_state_hit_moves_its_block_to_the_young_end_of_the_lru() {
    let m = mgr(32);
    for (seq, salt) in [(1, 0), (2, 1)] {
        m.add_sequence(seq, toks(10, salt), SequenceSpec::default())
            .unwrap();
        m.allocate_slots(seq, 8).unwrap();
        assert_eq!(m.commit_computed(seq, 8).unwrap(), 1);
    }
    let s1 = m.block_tables(1).unwrap()[STATE][1];
    let s2 = m.block_tables(2).unwrap()[STATE][1];
    m.free(1);
    m.free(2);
    let pos = |b| m.pool().free_queue().iter().position(|&x| x == b).unwrap();
    assert!(pos(s1) < pos(s2), "sequence 1's state was freed first");
    m.add_sequence(3, toks(10, 0), SequenceSpec::default())
        .unwrap();
    let a = m.allocate_slots(3, 2).unwrap();
    assert_eq!(a.num_cached_tokens, 8);
    assert_eq!(a.groups[STATE].copies[0].0, s1);
    assert_eq!(m.pool().ref_count(s1), 0);
    assert!(m.pool().is_hashed(s1));
    assert!(pos(s1) > pos(s2), "the hit refreshed sequence 1's state");
    ok(&m);
}
