//! Speculative decoding in the manager: lookahead slots for draft tokens, acceptance of a
//! prefix of them, rejected slots and blocks given back, nothing hashed or announced for
//! drafts, prefix reuse equal to decoding without speculation, and bad input refused with the
//! state unchanged. Exact values throughout, on the KV cache manager with one full-attention
//! group ([`common::OneGroup`]).

mod common;

use common::OneGroup;
use pagedkv_core::events::KvEvent;
use pagedkv_core::{
    BlockHash, BlockId, CacheConfig, Error, SequenceSpec, StepDrafts, StepOptions, StepRequest,
};
use std::collections::BTreeSet;

fn manager<M: OneGroup>(num_blocks: u32, block_size: u32) -> M {
    let mut cfg = CacheConfig::new(num_blocks, block_size);
    cfg.enable_events = true;
    cfg.num_cpu_blocks = 8;
    M::build(cfg).unwrap()
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

/// Per-sequence observable state.
fn seq_state<M: OneGroup>(m: &M, seq: u64) -> (Vec<u32>, usize, Vec<BlockId>, usize) {
    (
        m.tokens(seq).unwrap(),
        m.num_computed_tokens(seq).unwrap(),
        m.block_table(seq).unwrap(),
        m.num_draft_tokens(seq).unwrap(),
    )
}

fn stored_tokens(events: &[KvEvent]) -> Vec<Vec<u32>> {
    events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored { token_ids, .. } => Some(token_ids.clone()),
            _ => None,
        })
        .collect()
}

fn cached_hashes<M: OneGroup>(m: &M) -> BTreeSet<BlockHash> {
    (0..m.pool().num_blocks())
        .filter_map(|b| m.pool().block_hash(b))
        .collect()
}

/// One sequence of 6 prompt tokens prefilled with block size 4 (blocks [0..4), [4..6)).
fn prefilled<M: OneGroup>() -> M {
    let m: M = manager(16, 4);
    m.add_sequence(1, &[0, 1, 2, 3, 4, 5], SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 6).unwrap();
    m.take_events();
    m
}

fn verify_step<M: OneGroup>(m: &M, sampled: u32, drafts: &[u32]) -> common::Step {
    let req = StepRequest {
        seq_ids: vec![1],
        num_new_tokens: vec![1],
        append_indptr: vec![0, 1],
        append_tokens: vec![sampled],
    };
    let d = StepDrafts {
        indptr: vec![0, drafts.len() as u32],
        tokens: drafts.to_vec(),
    };
    m.step_with_drafts(&req, &d, StepOptions::default())
}

fn verify_step_gives_lookahead_slots_in_the_same_call<M: OneGroup>() {
    let m: M = prefilled();
    let table = m.block_table(1).unwrap();
    let out = verify_step(&m, 100, &[101, 102, 103, 104, 105, 106]);
    assert_eq!(out.error, None);
    assert_eq!(out.num_scheduled, 1);
    // Query: the sampled token at position 6, then 6 drafts at positions 7..13.
    assert_eq!(out.query_start_loc, vec![0, 7]);
    assert_eq!(out.context_lens, vec![6]);
    assert_eq!(out.seq_lens, vec![13]);
    assert_eq!(out.num_draft_tokens, vec![6]);
    assert_eq!(out.input_ids, vec![100, 101, 102, 103, 104, 105, 106]);
    let t = m.block_table(1).unwrap();
    assert_eq!(t.len(), 4, "ceil(13 / 4) blocks");
    assert_eq!(&t[..2], &table[..]);
    let bs = 4i64;
    let want: Vec<i64> = (6..13)
        .map(|p: i64| i64::from(t[(p / bs) as usize]) * bs + p % bs)
        .collect();
    assert_eq!(out.slot_mapping, want);
    assert_eq!(out.new_block_ids, vec![t[2] as i32, t[3] as i32]);
    // Nothing computed for the drafts; block 1 holds a draft, so it is not hashed.
    assert_eq!(m.num_computed_tokens(1).unwrap(), 7);
    assert_eq!(m.num_tokens(1).unwrap(), 7);
    assert_eq!(m.num_draft_tokens(1).unwrap(), 6);
    assert!(m.take_events().is_empty());
    for &b in &t[1..] {
        assert_eq!(m.pool().block_hash(b), None);
    }
    m.check_invariants().unwrap();
}

fn partial_acceptance_frees_the_rejected_tail_and_hashes_filled_blocks<M: OneGroup>() {
    let m: M = prefilled();
    verify_step(&m, 100, &[101, 102, 103, 104, 105, 106]);
    let t = m.block_table(1).unwrap();
    let free_before = m.pool().num_free();
    // 2 of 6 accepted: tokens 0..9, ceil(9 / 4) = 3 blocks stay, the 4th (only drafts) goes.
    let released = m.accept_drafts(1, 2).unwrap();
    assert_eq!(released, vec![t[3]]);
    assert_eq!(m.pool().num_free(), free_before + 1);
    assert_eq!(m.pool().ref_count(t[3]), 0);
    assert_eq!(m.pool().block_hash(t[3]), None);
    assert_eq!(m.tokens(1).unwrap(), vec![0, 1, 2, 3, 4, 5, 100, 101, 102]);
    assert_eq!(m.num_computed_tokens(1).unwrap(), 9);
    assert_eq!(m.num_draft_tokens(1).unwrap(), 0);
    assert_eq!(m.block_table(1).unwrap(), t[..3].to_vec());
    // Block 1 is now full of accepted tokens: hashed and announced, exactly those tokens.
    assert_eq!(stored_tokens(&m.take_events()), vec![vec![4, 5, 100, 101]]);
    assert!(m.pool().block_hash(t[1]).is_some());
    assert_eq!(m.pool().block_hash(t[2]), None);
    m.check_invariants().unwrap();
    // The next step writes the bonus token into the first rejected slot (position 9).
    let out = verify_step(&m, 7, &[]);
    assert_eq!(out.error, None);
    assert_eq!(out.context_lens, vec![9]);
    assert_eq!(out.slot_mapping, vec![i64::from(t[2]) * 4 + 1]);
    assert!(out.new_block_ids.is_empty());
    assert_eq!(out.table_start, vec![3]);
    m.check_invariants().unwrap();
}

fn rejecting_every_draft_releases_every_lookahead_block<M: OneGroup>() {
    let m: M = prefilled();
    let free0 = m.pool().num_free();
    verify_step(&m, 100, &[101, 102, 103, 104, 105, 106]);
    assert_eq!(m.pool().num_free(), free0 - 2);
    let t = m.block_table(1).unwrap();
    assert_eq!(
        m.accept_drafts(1, 0).unwrap(),
        vec![t[3], t[2]],
        "tail first"
    );
    assert_eq!(m.pool().num_free(), free0);
    assert_eq!(m.block_table(1).unwrap(), t[..2].to_vec());
    assert_eq!(m.num_computed_tokens(1).unwrap(), 7);
    assert!(
        m.take_events().is_empty(),
        "nothing filled, nothing announced"
    );
    m.check_invariants().unwrap();
    // Accepting all of them keeps every block, and the full ones are cached.
    verify_step(&m, 7, &[8, 9, 10]);
    assert!(m.accept_drafts(1, 3).unwrap().is_empty());
    assert_eq!(m.num_computed_tokens(1).unwrap(), 11);
    assert_eq!(stored_tokens(&m.take_events()), vec![vec![4, 5, 100, 7]]);
    m.check_invariants().unwrap();
}

/// Decodes `generated` after `prompt` in one manager, `k` drafts per verify step of which the
/// first `accept` are right (the draft is the true continuation for them, wrong after).
fn run<M: OneGroup>(prompt: &[u32], generated: &[u32], k: usize, accept: usize) -> M {
    let m: M = manager(64, 4);
    m.add_sequence(1, prompt, SequenceSpec::default()).unwrap();
    m.allocate_slots(1, prompt.len()).unwrap();
    let mut done = 0; // generated tokens that are tokens of the sequence
    while done < generated.len() {
        // The token sampled by the last step, then drafts: `accept` true ones, then wrong ones.
        let sampled = generated[done];
        let rest = &generated[done + 1..];
        let m_true = accept.min(rest.len()).min(k);
        let mut drafts: Vec<u32> = rest[..m_true].to_vec();
        drafts.resize(k, 9999);
        let out = verify_step(&m, sampled, &drafts);
        assert_eq!(out.error, None);
        if !drafts.is_empty() {
            m.accept_drafts(1, m_true).unwrap();
        }
        m.check_invariants().unwrap();
        done += 1 + m_true;
    }
    m
}

fn prefix_reuse_with_speculation_equals_reuse_without<M: OneGroup>() {
    let prompt: Vec<u32> = (0..10).collect();
    let generated: Vec<u32> = (50..77).collect();
    let all_tokens: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
    for (k, accept) in [(3, 0), (3, 1), (3, 3), (5, 2), (8, 8), (1, 1)] {
        let plain: M = run(&prompt, &generated, 0, 0);
        let spec: M = run(&prompt, &generated, k, accept);
        assert_eq!(spec.tokens(1).unwrap(), all_tokens, "k={k} accept={accept}");
        assert_eq!(
            cached_hashes(&spec),
            cached_hashes(&plain),
            "k={k} accept={accept}"
        );
        // The same blocks announced (one event may carry several consecutive blocks).
        assert_eq!(
            stored_tokens(&spec.take_events()).concat(),
            stored_tokens(&plain.take_events()).concat()
        );
        // The same request again, after the first is freed: the same hit as without drafts.
        for m in [&plain, &spec] {
            m.free(1);
            m.add_sequence(2, &all_tokens, SequenceSpec::default())
                .unwrap();
        }
        let hit = plain.lookup_prefix(2).unwrap();
        assert_eq!(hit, 36, "every full block but the last token's");
        assert_eq!(spec.lookup_prefix(2).unwrap(), hit);
    }
}

fn bad_draft_input_is_refused_with_the_state_unchanged<M: OneGroup>() {
    let m: M = prefilled();
    m.append_tokens(1, &[100]).unwrap();
    let before = (snapshot(&m), seq_state(&m, 1));
    // Acceptance with no drafts pending.
    assert!(matches!(
        m.accept_drafts(1, 0),
        Err(Error::InvalidSequenceState {
            seq_id: 1,
            operation: "accept_drafts",
            ..
        })
    ));
    assert!(matches!(
        m.accept_drafts(7, 0),
        Err(Error::UnknownSequence { seq_id: 7 })
    ));
    // Drafts that do not follow the last token (only part of the uncomputed tokens scheduled).
    m.append_tokens(1, &[101]).unwrap();
    let before2 = (snapshot(&m), seq_state(&m, 1));
    assert!(matches!(
        m.allocate_slots_with_drafts(1, 1, &[5, 6]),
        Err(Error::InvalidArgument {
            arg: "draft_tokens",
            ..
        })
    ));
    assert_eq!((snapshot(&m), seq_state(&m, 1)), before2);
    // Lookahead blocks count towards capacity: all or nothing.
    let tiny: M = manager(3, 4);
    tiny.add_sequence(1, &[1, 2, 3], SequenceSpec::default())
        .unwrap();
    let tb = (snapshot(&tiny), seq_state(&tiny, 1));
    assert!(matches!(
        tiny.allocate_slots_with_drafts(1, 3, &[4, 5, 6, 7, 8, 9]),
        Err(Error::OutOfBlocks {
            requested: 3,
            available: 2
        })
    ));
    assert_eq!((snapshot(&tiny), seq_state(&tiny, 1)), tb);
    drop(before);

    let a = m.allocate_slots_with_drafts(1, 2, &[5, 6, 7]).unwrap();
    assert_eq!((a.num_scheduled_tokens, a.num_draft_tokens), (2, 3));
    let pending = (snapshot(&m), seq_state(&m, 1));
    // More accepted than proposed.
    assert!(matches!(
        m.accept_drafts(1, 4),
        Err(Error::InvalidArgument {
            arg: "num_accepted",
            ..
        })
    ));
    // Everything that would put tokens after, or copy, pending drafts.
    assert!(matches!(
        m.append_tokens(1, &[9]),
        Err(Error::InvalidSequenceState {
            operation: "append_tokens",
            ..
        })
    ));
    assert!(matches!(
        m.allocate_slots(1, 1),
        Err(Error::InvalidSequenceState {
            operation: "allocate_slots",
            ..
        })
    ));
    assert!(matches!(
        m.fork(1, 2),
        Err(Error::InvalidSequenceState {
            operation: "fork",
            ..
        })
    ));
    assert!(matches!(
        m.swap_out(&[1]),
        Err(Error::InvalidSequenceState {
            operation: "swap_out",
            ..
        })
    ));
    // A step with malformed draft offsets schedules nothing.
    let req = StepRequest {
        seq_ids: vec![1],
        num_new_tokens: vec![1],
        ..Default::default()
    };
    for d in [
        StepDrafts {
            indptr: vec![0, 2],
            tokens: vec![1],
        },
        StepDrafts {
            indptr: vec![],
            tokens: vec![1],
        },
        StepDrafts {
            indptr: vec![1, 1],
            tokens: vec![1],
        },
        StepDrafts {
            indptr: vec![0],
            tokens: vec![],
        },
    ] {
        let out = m.step_with_drafts(&req, &d, StepOptions::default());
        assert_eq!(out.num_scheduled, 0);
        assert!(matches!(
            out.error,
            Some(Error::InvalidArgument {
                arg: "draft_indptr",
                ..
            })
        ));
    }
    // A step that schedules a sequence with pending drafts fails on it, appends undone.
    let out = m.step(&StepRequest {
        seq_ids: vec![1],
        num_new_tokens: vec![1],
        append_indptr: vec![0, 1],
        append_tokens: vec![3],
    });
    assert!(matches!(
        out.error,
        Some(Error::InvalidSequenceState { .. })
    ));
    assert_eq!((snapshot(&m), seq_state(&m, 1)), pending);
    m.check_invariants().unwrap();
}

fn preemption_and_free_drop_pending_drafts<M: OneGroup>() {
    let m: M = prefilled();
    let free0 = m.pool().num_free();
    verify_step(&m, 100, &[101, 102, 103]);
    m.preempt_recompute(&[1]).unwrap();
    assert_eq!(m.num_draft_tokens(1).unwrap(), 0);
    assert_eq!(m.tokens(1).unwrap(), vec![0, 1, 2, 3, 4, 5, 100]);
    m.check_invariants().unwrap();
    // The resume hits block 0 only: the draft slots were never cached.
    let a = m.allocate_slots(1, 7).unwrap();
    assert_eq!(a.num_cached_tokens, 4);
    verify_step(&m, 5, &[6, 7]);
    assert!(m.free(1));
    assert_eq!(m.pool().num_free(), free0 + 2);
    m.check_invariants().unwrap();
}

fn drafts_on_a_shared_partial_block_copy_it_first<M: OneGroup>() {
    let m: M = prefilled();
    m.fork(1, 2).unwrap();
    let t = m.block_table(1).unwrap();
    m.append_tokens(1, &[100]).unwrap();
    let a = m.allocate_slots_with_drafts(1, 1, &[101, 102]).unwrap();
    assert_eq!(a.groups[0].copies.len(), 1);
    assert_eq!(a.groups[0].copies[0].0, t[1]);
    assert_eq!(m.block_table(2).unwrap(), t);
    m.accept_drafts(1, 1).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(
        m.block_table(2).unwrap(),
        t,
        "the sibling's table is untouched"
    );
}

fn keeping_rejected_blocks_leaves_the_table_growing_only<M: OneGroup>() {
    let m: M = prefilled();
    verify_step(&m, 100, &[101, 102, 103, 104, 105, 106]);
    let t = m.block_table(1).unwrap();
    let free = m.pool().num_free();
    // One of six accepted: 8 tokens, 2 blocks needed, the other two kept as spares.
    assert!(m.accept_drafts_keeping_blocks(1, 1).unwrap().is_empty());
    assert_eq!(m.block_table(1).unwrap(), t);
    assert_eq!(m.pool().num_free(), free);
    assert_eq!(m.num_computed_tokens(1).unwrap(), 8);
    // Block 1 is full of accepted tokens: cached; the spares are not.
    assert_eq!(stored_tokens(&m.take_events()), vec![vec![4, 5, 100, 101]]);
    assert_eq!(m.pool().block_hash(t[2]), None);
    m.check_invariants().unwrap();
    // The next verify step fills the spares before taking a fresh block.
    let out = verify_step(&m, 7, &[8, 9, 10, 11, 12]);
    assert_eq!(out.error, None);
    assert!(
        out.new_block_ids.is_empty(),
        "spares used: 14 slots in 4 blocks"
    );
    assert_eq!(out.table_start, vec![4], "no entry changed");
    m.check_invariants().unwrap();
    // A fork does not share the spares; a full acceptance fills what it can.
    m.accept_drafts_keeping_blocks(1, 0).unwrap();
    m.fork(1, 2).unwrap();
    assert_eq!(m.block_table(2).unwrap(), t[..3].to_vec());
    m.check_invariants().unwrap();
    assert!(m.free(1) && m.free(2));
    m.check_invariants().unwrap();
}

fn copy_on_write_before_spare_blocks_copies_the_partial_block<M: OneGroup>() {
    let m: M = prefilled();
    verify_step(&m, 100, &[101, 102, 103, 104, 105, 106]);
    m.accept_drafts_keeping_blocks(1, 0).unwrap();
    let t = m.block_table(1).unwrap();
    assert_eq!(t.len(), 4, "7 tokens in 2 blocks, 2 spares");
    m.fork(1, 2).unwrap();
    m.append_tokens(1, &[9]).unwrap();
    let a = m.allocate_slots(1, 1).unwrap();
    // Position 7 is in shared block 1: that block is copied, the spares stay in place.
    assert_eq!(a.groups[0].copies.len(), 1);
    let (src, dst) = a.groups[0].copies[0];
    assert_eq!(src, t[1]);
    assert_eq!(m.block_table(1).unwrap(), vec![t[0], dst, t[2], t[3]]);
    assert_eq!(m.block_table(2).unwrap(), t[..2].to_vec());
    m.check_invariants().unwrap();
}

/// Lookahead-only allocation (no token scheduled, slots for drafts after the computed ones):
/// an asynchronous scheduler's slots for tokens whose ids a step in flight has not reported.
/// The block it opens is never hashed; the placeholders are rejected, the block kept as a spare
/// and the real token computed into it. Refused for a first allocation or with uncomputed
/// tokens left, state unchanged.
fn lookahead_only_allocation_holds_a_block_for_an_unknown_token<M: OneGroup>() {
    let m: M = manager(16, 4);
    m.add_sequence(1, &[0, 1, 2, 3, 4, 5, 6, 7], SequenceSpec::default())
        .unwrap();
    // First allocation: refused (the prefix hit is taken by scheduling tokens).
    let before = (snapshot(&m), seq_state(&m, 1));
    assert!(matches!(
        m.allocate_slots_with_drafts(1, 0, &[0]),
        Err(Error::InvalidArgument {
            arg: "num_new_tokens",
            ..
        })
    ));
    assert_eq!((snapshot(&m), seq_state(&m, 1)), before);
    m.allocate_slots(1, 8).unwrap();
    assert_eq!(
        stored_tokens(&m.take_events()),
        vec![(0..8).collect::<Vec<u32>>()]
    );
    // Nothing without drafts.
    assert!(matches!(
        m.allocate_slots(1, 0),
        Err(Error::InvalidArgument {
            arg: "num_new_tokens",
            ..
        })
    ));
    // Slot 8 (token unknown) opens block 2.
    let a = m.allocate_slots_with_drafts(1, 0, &[0]).unwrap();
    assert_eq!(a.num_scheduled_tokens, 0);
    assert_eq!(a.num_context_tokens, 8);
    assert_eq!(a.groups[0].new_block_ids.len(), 1);
    let spare = a.groups[0].new_block_ids[0];
    assert_eq!(m.num_computed_tokens(1).unwrap(), 8);
    assert_eq!(m.num_draft_tokens(1).unwrap(), 1);
    assert!(
        m.take_events().is_empty(),
        "nothing hashed for a placeholder"
    );
    assert_eq!(m.pool().block_hash(spare), None);
    // The token arrives: placeholder rejected, block kept, token computed into it.
    assert!(m.accept_drafts_keeping_blocks(1, 0).unwrap().is_empty());
    m.append_tokens(1, &[100]).unwrap();
    // Uncomputed tokens left: lookahead alone is refused, state unchanged.
    let before = (snapshot(&m), seq_state(&m, 1));
    assert!(matches!(
        m.allocate_slots_with_drafts(1, 0, &[0]),
        Err(Error::InvalidArgument {
            arg: "num_new_tokens",
            ..
        })
    ));
    assert_eq!((snapshot(&m), seq_state(&m, 1)), before);
    let b = m.allocate_slots_with_drafts(1, 1, &[0]).unwrap();
    assert!(
        b.groups[0].new_block_ids.is_empty(),
        "the spare holds slots 8 and 9"
    );
    assert_eq!(m.block_table(1).unwrap()[2], spare);
    assert_eq!(m.num_computed_tokens(1).unwrap(), 9);
    m.check_invariants().unwrap();
    assert!(m.free(1));
    m.check_invariants().unwrap();
}

one_group_tests!(
    verify_step_gives_lookahead_slots_in_the_same_call,
    partial_acceptance_frees_the_rejected_tail_and_hashes_filled_blocks,
    rejecting_every_draft_releases_every_lookahead_block,
    prefix_reuse_with_speculation_equals_reuse_without,
    bad_draft_input_is_refused_with_the_state_unchanged,
    preemption_and_free_drop_pending_drafts,
    drafts_on_a_shared_partial_block_copy_it_first,
    keeping_rejected_blocks_leaves_the_table_growing_only,
    copy_on_write_before_spare_blocks_copies_the_partial_block,
    lookahead_only_allocation_holds_a_block_for_an_unknown_token,
);
