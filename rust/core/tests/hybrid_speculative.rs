//! Speculative decoding's verify steps on `KvCacheManager` (docs/design.md, "Speculative
//! decoding" and "KV cache groups"): a sliding-window group keeps the block a verify step's
//! first query row reads past the window of its last row (vLLM #44082), releases out of the
//! window by committed tokens only (never by lookahead positions), and a rejection never
//! leaves the next step's window short.

use pagedkv_core::{
    BlockId, CacheConfig, Error, GroupSpec, KvCacheManager, SequenceSpec, StepDrafts, StepOutput,
    StepRequest, NULL_BLOCK,
};

const BS: u32 = 16;

/// One full-attention group and one sliding-window group of window `w`, block size 16.
fn manager(num_blocks: u32, w: u32, retention: u32) -> KvCacheManager {
    let mut cfg = CacheConfig::with_groups(
        num_blocks,
        vec![GroupSpec::full(BS, 8), GroupSpec::sliding_window(BS, 8, w)],
        vec![0, 1, 1],
    );
    cfg.retention_interval = retention;
    cfg.enable_events = true;
    KvCacheManager::new(cfg).unwrap()
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt * 1000 + 1).collect()
}

/// One sequence's step: `n` new tokens after appending `append`, with `drafts`.
fn step1(m: &KvCacheManager, seq: u64, n: u32, append: &[u32], drafts: &[u32]) -> StepOutput {
    let req = StepRequest {
        seq_ids: vec![seq],
        num_new_tokens: vec![n],
        append_indptr: vec![0, append.len() as u32],
        append_tokens: append.to_vec(),
    };
    let d = StepDrafts {
        indptr: vec![0, drafts.len() as u32],
        tokens: drafts.to_vec(),
    };
    let out = m.step_with_drafts(&req, &d);
    assert!(out.error.is_none(), "{:?}", out.error);
    m.check_invariants().unwrap();
    out
}

/// Group `g`'s block-table row of scheduled sequence `k`.
fn row(out: &StepOutput, g: usize, k: usize) -> &[i32] {
    let w = out.block_table_width;
    &out.block_table[(g * out.num_scheduled + k) * w..][..w]
}

/// Asserts that every position each query row of the step reads (`[first_read(p), p]` in
/// every group) is backed by a live block of that group's table, and that each row's slot
/// lies in its table's block. Returns the first position read in each group, per sequence.
fn assert_reads_backed(m: &KvCacheManager, out: &StepOutput) -> Vec<Vec<usize>> {
    let t = out.query_start_loc[out.num_scheduled] as usize;
    let mut first = Vec::new();
    for k in 0..out.num_scheduled {
        let ctx = out.context_lens[k] as usize;
        let q = (out.query_start_loc[k + 1] - out.query_start_loc[k]) as usize;
        let mut per_group = Vec::new();
        for g in 0..out.num_groups {
            let spec = m.config().groups[g];
            let bs = spec.block_size as usize;
            let r = row(out, g, k);
            for i in 0..q {
                let p = ctx + i;
                for x in spec.first_read(p)..=p {
                    assert_ne!(
                        r[x / bs],
                        NULL_BLOCK as i32,
                        "group {g}: query row {i} (position {p}) reads position {x}, whose block {} is released",
                        x / bs
                    );
                }
                let slot = out.slot_mapping[g * t + out.query_start_loc[k] as usize + i];
                assert_eq!(slot, r[p / bs] as i64 * bs as i64 + (p % bs) as i64);
            }
            per_group.push(spec.first_read(ctx));
        }
        first.push(per_group);
    }
    first
}

/// The sliding-window group's live table entries `(first, end)`: null before `first`, real
/// from `first` to `end` (the table's length).
fn live_range(m: &KvCacheManager, seq: u64, g: usize) -> (usize, usize) {
    let t = &m.block_tables(seq).unwrap()[g];
    let first = t.iter().position(|&b| b != NULL_BLOCK).unwrap_or(t.len());
    assert!(t[first..].iter().all(|&b| b != NULL_BLOCK), "{t:?}");
    (first, t.len())
}

/// The exact case of the issue: block size 16, window 32, context 110, k = 4 drafts. The
/// verify query is positions 110..=114; row 0 reads from 79 (block 4), row 4 from 83 (block
/// 5). A release by the lookahead end (what a manager counting drafts as computed tokens
/// does) frees block 4 under row 0.
#[test]
fn verify_step_keeps_the_block_its_first_row_reads() {
    let m = manager(64, 32, 0);
    m.add_sequence(1, toks(110, 1), SequenceSpec::default())
        .unwrap();
    step1(&m, 1, 512, &[], &[]);
    // The sampled token, then 4 drafts: query 110..=114.
    let out = step1(&m, 1, 1, &[5], &[6, 7, 8, 9]);
    assert_eq!(out.context_lens, vec![110]);
    assert_eq!(out.seq_lens, vec![115]);
    assert_eq!(out.num_draft_tokens, vec![4]);
    assert_eq!(out.input_ids, vec![5, 6, 7, 8, 9]);
    assert_reads_backed(&m, &out);
    let w = &m.block_tables(1).unwrap()[1];
    assert_eq!(w.len(), 8); // ceil(115 / 16): block 7 is a lookahead block (112..=114)
    assert_eq!(&w[..4], &[NULL_BLOCK; 4]); // 0..64: no query from 110 on reads them
    assert_ne!(w[4], NULL_BLOCK, "block 4 (64..80): row 0 reads 79");
    assert_eq!(m.num_blocks_held(1).unwrap(), vec![8, 4]);

    // Every draft rejected: the lookahead block goes, the window is not short.
    let released = m.accept_drafts(1, 0).unwrap();
    assert_eq!(released[0].len(), 1);
    assert_eq!(released[1].len(), 1);
    assert_eq!(m.num_computed_tokens(1).unwrap(), 111);
    assert_eq!(m.num_tokens(1).unwrap(), 111);
    assert_eq!(live_range(&m, 1, 1), (4, 7));
    // Next verify from 111 (row 0 reads from 80): block 4 goes now, not before.
    let out = step1(&m, 1, 1, &[10], &[11, 12, 13]);
    assert_reads_backed(&m, &out);
    assert_eq!(live_range(&m, 1, 1), (5, 8));
    m.accept_drafts(1, 3).unwrap();
    assert_eq!(m.num_computed_tokens(1).unwrap(), 115);
    assert_eq!(live_range(&m, 1, 1), (5, 8));
    assert!(m.free(1));
    m.check_invariants().unwrap();
    assert_eq!(m.pool().num_free(), 63);
}

/// Every context offset within a block, windows 32 and 40 (a window that is not a multiple
/// of the block size), k = 3..=5, every acceptance count: the window group's table holds
/// exactly the blocks from the first row's window to the last lookahead slot, every read is
/// backed, and after the acceptance the next verify step is backed too.
#[test]
fn every_offset_window_and_acceptance_keeps_reads_backed() {
    for w in [32u32, 40] {
        for k in 3usize..=5 {
            for accepted in 0..=k {
                for len in 64usize..64 + BS as usize {
                    let m = manager(64, w, 0);
                    m.add_sequence(1, toks(len, 2), SequenceSpec::default())
                        .unwrap();
                    step1(&m, 1, 512, &[], &[]);
                    let drafts: Vec<u32> = (0..k as u32).map(|i| 100 + i).collect();
                    let out = step1(&m, 1, 1, &[99], &drafts);
                    let first = assert_reads_backed(&m, &out);
                    let spec = m.config().groups[1];
                    let bs = BS as usize;
                    let ctx = len;
                    assert_eq!(first[0][1], spec.first_read(ctx));
                    assert_eq!(
                        live_range(&m, 1, 1),
                        (spec.first_read(ctx) / bs, (ctx + 1 + k).div_ceil(bs)),
                        "w {w} k {k} len {len}"
                    );
                    let before = m.pool().num_free();
                    let released = m.accept_drafts(1, accepted).unwrap();
                    let end = ctx + 1 + accepted;
                    let lookahead = (ctx + 1 + k).div_ceil(bs) - end.div_ceil(bs);
                    assert_eq!(released[1].len(), lookahead, "w {w} k {k} len {len}");
                    assert_eq!(released[0].len(), lookahead);
                    assert_eq!(m.pool().num_free(), before + 2 * lookahead);
                    // Nothing released out of the window by the acceptance.
                    assert_eq!(live_range(&m, 1, 1).0, spec.first_read(ctx) / bs);
                    m.check_invariants().unwrap();
                    // The bonus token, then k more drafts from the committed end.
                    let out = step1(&m, 1, 1, &[98], &drafts);
                    assert_eq!(out.context_lens, vec![end as i32]);
                    assert_reads_backed(&m, &out);
                    assert_eq!(live_range(&m, 1, 1).0, spec.first_read(end) / bs);
                    m.accept_drafts(1, 0).unwrap();
                    assert!(m.free(1));
                    m.check_invariants().unwrap();
                    assert_eq!(m.pool().num_free(), 63);
                }
            }
        }
    }
}

/// A long speculative decode with a fixed acceptance pattern against decoding the same
/// tokens one by one: same tokens, every read backed at every verify step, and afterwards a
/// request repeating the sequence hits the same prefix in both (nothing of a rejected draft
/// was cached), with dense and with sparse retention.
#[test]
fn speculative_decode_matches_plain_decode_and_its_prefix_hits() {
    for (w, retention) in [(32u32, 0u32), (40, 0), (40, 32)] {
        let spec_m = manager(128, w, retention);
        let plain = manager(128, w, retention);
        let prompt = toks(37, 3);
        let target: Vec<u32> = (0..150u32).map(|i| 5000 + i % 17).collect();
        for m in [&spec_m, &plain] {
            m.add_sequence(1, prompt.clone(), SequenceSpec::default())
                .unwrap();
            step1(m, 1, 512, &[], &[]);
        }
        // Plain: one token per step.
        for &t in &target {
            step1(&plain, 1, 1, &[t], &[]);
        }
        // Speculative: k drafts, the first `ok` right, the rest wrong.
        let (mut pos, mut i) = (0usize, 0usize);
        while pos < target.len() {
            let k = 3 + i % 3;
            let ok = [0, 2, k, 1, 3][i % 5].min(k);
            let rest = target.len() - pos - 1; // tokens after the one appended now
            let k = k.min(rest);
            let ok = ok.min(k);
            let drafts: Vec<u32> = (0..k)
                .map(|j| if j < ok { target[pos + 1 + j] } else { 1 })
                .collect();
            let out = step1(&spec_m, 1, 1, &[target[pos]], &drafts);
            assert_reads_backed(&spec_m, &out);
            if k > 0 {
                spec_m.accept_drafts(1, ok).unwrap();
                spec_m.check_invariants().unwrap();
            }
            pos += 1 + ok;
            i += 1;
        }
        let all: Vec<u32> = prompt.iter().chain(&target).copied().collect();
        assert_eq!(spec_m.num_tokens(1).unwrap(), all.len());
        assert_eq!(
            spec_m.num_computed_tokens(1).unwrap(),
            plain.num_computed_tokens(1).unwrap()
        );
        for m in [&spec_m, &plain] {
            assert!(m.free(1));
            m.add_sequence(2, all.clone(), SequenceSpec::default())
                .unwrap();
        }
        let hit = plain.lookup_prefix(2).unwrap();
        assert!(hit > 0, "w {w} retention {retention}");
        assert_eq!(
            spec_m.lookup_prefix(2).unwrap(),
            hit,
            "w {w} retention {retention}"
        );
    }
}

/// `accept_drafts_keeping_blocks`: the rejected drafts' blocks stay as spare lookahead
/// blocks, the next allocation fills them before taking fresh ones, a fork does not share
/// them, and the window still releases by the committed context.
#[test]
fn kept_lookahead_blocks_are_filled_first_and_not_forked() {
    let m = manager(64, 32, 0);
    m.add_sequence(1, toks(110, 4), SequenceSpec::default())
        .unwrap();
    step1(&m, 1, 512, &[], &[]);
    step1(&m, 1, 1, &[5], &[6, 7, 8, 9]);
    let tables = m.block_tables(1).unwrap();
    assert_eq!(
        m.accept_drafts_keeping_blocks(1, 0).unwrap(),
        vec![Vec::<BlockId>::new(); 2]
    );
    assert_eq!(m.block_tables(1).unwrap(), tables); // nothing released
    m.check_invariants().unwrap();
    // A fork's tables end with its tokens (111: 7 blocks).
    m.fork(1, 2).unwrap();
    assert_eq!(m.block_tables(2).unwrap()[0], tables[0][..7].to_vec());
    m.check_invariants().unwrap();
    assert!(m.free(2));
    // The next decode (111 -> 112) fills block 6; the spare block 7 is the 113th token's.
    let free = m.pool().num_free();
    let out = step1(&m, 1, 1, &[10], &[11]);
    assert_eq!(m.pool().num_free(), free + 1); // block 4 left the window; nothing taken
    assert_eq!(m.block_tables(1).unwrap()[0][7], tables[0][7]);
    assert_reads_backed(&m, &out);
    m.accept_drafts(1, 1).unwrap();
    assert!(m.free(1));
    m.check_invariants().unwrap();
    assert_eq!(m.pool().num_free(), 63);
}

/// Bad input and pending drafts: typed errors, state unchanged.
#[test]
fn bad_acceptances_and_calls_with_pending_drafts_are_refused() {
    let m = manager(64, 32, 0);
    m.add_sequence(1, toks(40, 5), SequenceSpec::default())
        .unwrap();
    assert!(matches!(
        m.allocate_slots_with_drafts(1, 8, &[1, 2]),
        Err(Error::InvalidArgument {
            arg: "draft_tokens",
            ..
        })
    ));
    assert!(matches!(
        m.accept_drafts(1, 0),
        Err(Error::InvalidSequenceState { .. })
    ));
    let a = m.allocate_slots_with_drafts(1, 64, &[1, 2, 3]).unwrap();
    assert_eq!((a.num_scheduled_tokens, a.num_draft_tokens), (40, 3));
    let tables = m.block_tables(1).unwrap();
    let free = m.pool().num_free();
    assert!(matches!(
        m.accept_drafts(1, 4),
        Err(Error::InvalidArgument {
            arg: "num_accepted",
            ..
        })
    ));
    for e in [
        m.append_tokens(1, &[1]).unwrap_err(),
        m.allocate_slots(1, 1).unwrap_err(),
        m.fork(1, 2).unwrap_err(),
        m.swap_out(&[1]).unwrap_err(),
        m.num_blocks_needed(1, 1).unwrap_err(),
    ] {
        assert!(matches!(e, Error::InvalidSequenceState { .. }), "{e:?}");
    }
    assert_eq!(m.block_tables(1).unwrap(), tables);
    assert_eq!(m.pool().num_free(), free);
    assert_eq!(m.num_draft_tokens(1).unwrap(), 3);
    m.check_invariants().unwrap();
    // Preemption drops the drafts with the rest.
    m.preempt_recompute(&[1]).unwrap();
    assert_eq!(m.num_draft_tokens(1).unwrap(), 0);
    assert_eq!(m.num_tokens(1).unwrap(), 40);
    m.check_invariants().unwrap();
}

/// The demand of a verify step is predicted exactly, lookahead blocks included, and a step
/// whose lookahead blocks do not fit fails with nothing changed.
#[test]
fn verify_demand_is_exact_and_a_failed_verify_changes_nothing() {
    let m = manager(12, 32, 0);
    m.add_sequence(1, toks(47, 6), SequenceSpec::default())
        .unwrap();
    step1(&m, 1, 512, &[], &[]); // 3 + 3 blocks
    m.append_tokens(1, &[9]).unwrap();
    // 47 computed + 1 + 4 drafts = 52 slots: block 3 in each group; the window group
    // releases block 0 (the first row, at 47, reads from 16), by the context alone.
    let d = m.num_blocks_needed_with_drafts(1, 1, 4).unwrap();
    assert_eq!((d.take, d.release), (2, 1));
    let d = m.num_blocks_needed_with_drafts(1, 1, 56).unwrap();
    assert_eq!((d.take, d.release), (2 * 4, 1)); // 104 slots: blocks 3..=6
    let tables = m.block_tables(1).unwrap();
    let free = m.pool().num_free();
    assert_eq!(free, 5);
    let drafts: Vec<u32> = (0..56).collect();
    assert!(matches!(
        m.allocate_slots_with_drafts(1, 1, &drafts),
        Err(Error::OutOfBlocks {
            requested: 8,
            available: 6
        })
    ));
    assert_eq!(m.block_tables(1).unwrap(), tables);
    assert_eq!(m.pool().num_free(), free);
    assert_eq!(m.num_draft_tokens(1).unwrap(), 0);
    let a = m.allocate_slots_with_drafts(1, 1, &[1, 2, 3, 4]).unwrap();
    assert_eq!(m.pool().num_free(), free - 1);
    assert_eq!(a.num_draft_tokens, 4);
    m.check_invariants().unwrap();
}

/// Lookahead-only step (no token scheduled, drafts after the computed tokens): an asynchronous
/// scheduler's slot for a token whose id is not known yet opens a block in every group, nothing
/// is hashed for it, the window does not move; the placeholder is rejected keeping the blocks
/// and the real token is computed into them.
#[test]
fn lookahead_only_step_opens_blocks_for_an_unknown_token() {
    let m = manager(64, 32, 0);
    m.add_sequence(1, toks(64, 6), SequenceSpec::default())
        .unwrap();
    step1(&m, 1, 64, &[], &[]);
    m.take_events();
    let tables = m.block_tables(1).unwrap();
    let out = step1(&m, 1, 0, &[], &[0]);
    assert_eq!(out.num_draft_tokens, vec![1]);
    assert_eq!(out.context_lens, vec![64]);
    let after = m.block_tables(1).unwrap();
    for g in 0..2 {
        assert_eq!(
            after[g].len(),
            tables[g].len() + 1,
            "group {g}: slot 64 opens block 4"
        );
    }
    assert_eq!(after[0][..4], tables[0][..]);
    // The window group releases by the committed context (64: blocks 0 and 1 left the window).
    assert_eq!(
        after[1][..4],
        [NULL_BLOCK, NULL_BLOCK, tables[1][2], tables[1][3]]
    );
    assert!(
        m.take_events().is_empty(),
        "nothing hashed for a placeholder"
    );
    assert_reads_backed(&m, &out);
    assert_eq!(
        m.accept_drafts_keeping_blocks(1, 0).unwrap(),
        vec![Vec::<BlockId>::new(); 2]
    );
    let out = step1(&m, 1, 1, &[99], &[]);
    assert_eq!(
        out.new_block_indptr.last(),
        Some(&0),
        "the kept blocks hold slot 64"
    );
    assert_eq!(m.block_tables(1).unwrap()[0], after[0]);
    assert!(m.free(1));
    m.check_invariants().unwrap();
}
