//! Proptest state machine of speculative decoding: random verify steps (k draft tokens after
//! the sampled one), acceptances (valid and invalid), plain decodes, forks, preemption, swap and
//! frees against a pure model of each sequence (tokens, computed count, pending drafts,
//! status). After every operation: `check_invariants`, model agreement, failed calls leave the
//! state bit-identical, blocks taken or released are exactly those predicted, and every block
//! ever announced (KV events) holds finalized tokens of a sequence at its own position, never a
//! draft that was rejected (drafts use token ids no finalized token has).

mod common;

use common::OneGroup;
use pagedkv_core::events::KvEvent;
use pagedkv_core::{
    BlockHash, BlockId, CacheConfig, Error, KvCacheManager, SeqStatus, SequenceSpec, StepDrafts,
    StepOptions, StepRequest,
};
use proptest::prelude::*;

const BS: usize = 4;
const NUM_BLOCKS: u32 = 14;
/// Token ids from here on are drafts that are never accepted.
const REJECTED: u32 = 1_000_000;

#[derive(Debug, Clone)]
enum Op {
    Add { family: u8, len: u8 },
    Prefill { seq: usize },
    Verify { seqs: Vec<usize>, k: u8, right: u8 },
    Accept { seq: usize, m: u8, keep: bool },
    Decode { seq: usize },
    Fork { seq: usize },
    Preempt { seq: usize },
    SwapOut { seq: usize },
    SwapIn { seq: usize },
    Free { seq: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0u8..2, 1u8..14).prop_map(|(family, len)| Op::Add { family, len }),
        3 => any::<usize>().prop_map(|seq| Op::Prefill { seq }),
        5 => (proptest::collection::vec(any::<usize>(), 1..4), 0u8..7, 0u8..7)
            .prop_map(|(seqs, k, right)| Op::Verify { seqs, k, right }),
        5 => (any::<usize>(), 0u8..8, any::<bool>()).prop_map(|(seq, m, keep)| Op::Accept { seq, m, keep }),
        2 => any::<usize>().prop_map(|seq| Op::Decode { seq }),
        1 => any::<usize>().prop_map(|seq| Op::Fork { seq }),
        1 => any::<usize>().prop_map(|seq| Op::Preempt { seq }),
        1 => any::<usize>().prop_map(|seq| Op::SwapOut { seq }),
        1 => any::<usize>().prop_map(|seq| Op::SwapIn { seq }),
        1 => any::<usize>().prop_map(|seq| Op::Free { seq }),
    ]
}

#[derive(Debug, Clone)]
struct MSeq {
    id: u64,
    tokens: Vec<u32>,
    computed: usize,
    drafts: Vec<u32>,
    /// Leading drafts that are the true continuation (the verifier accepts at most these).
    right: usize,
    status: SeqStatus,
}

type Snapshot = (
    Vec<u32>,
    Vec<Option<BlockHash>>,
    Vec<BlockId>,
    Vec<Vec<BlockId>>,
);

fn snapshot<M: OneGroup>(m: &M, model: &[MSeq]) -> Snapshot {
    let p = m.pool();
    let n = p.num_blocks();
    (
        (0..n).map(|b| p.ref_count(b)).collect(),
        (0..n).map(|b| p.block_hash(b)).collect(),
        p.free_queue(),
        model.iter().map(|s| m.block_table(s.id).unwrap()).collect(),
    )
}

/// Every stored block's tokens are block `k` of some sequence's finalized tokens (the
/// sequences alive now, or any that ever lived: `history`).
fn check_events<M: OneGroup>(m: &M, history: &[Vec<u32>]) -> Result<(), TestCaseError> {
    for ev in m.take_events() {
        if let KvEvent::BlockStored { token_ids, .. } = ev {
            for block in token_ids.chunks(BS) {
                prop_assert!(
                    block.iter().all(|&t| t < REJECTED),
                    "a rejected draft was announced: {:?}",
                    block
                );
                let found = history
                    .iter()
                    .any(|toks| toks.chunks(BS).any(|c| c.len() == BS && c == block));
                prop_assert!(found, "announced block {:?} is no sequence's", block);
            }
        }
    }
    Ok(())
}

fn run<M: OneGroup>(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut cfg = CacheConfig::new(NUM_BLOCKS, BS as u32);
    cfg.enable_events = true;
    cfg.num_cpu_blocks = 6;
    let m = M::build(cfg).unwrap();
    let mut model: Vec<MSeq> = Vec::new();
    let mut history: Vec<Vec<u32>> = Vec::new();
    let mut next_id = 0u64;
    let mut tok = 10_000u32;
    let mut bad = REJECTED;
    for op in ops {
        let pick = |i: usize, model: &Vec<MSeq>| (!model.is_empty()).then(|| i % model.len());
        match op {
            Op::Add { family, len } => {
                let prompt: Vec<u32> = (0..u32::from(len))
                    .map(|i| u32::from(family) * 100 + i)
                    .collect();
                m.add_sequence(next_id, &prompt, SequenceSpec::default())
                    .unwrap();
                model.push(MSeq {
                    id: next_id,
                    tokens: prompt,
                    computed: 0,
                    drafts: vec![],
                    right: 0,
                    status: SeqStatus::Running,
                });
                next_id += 1;
            }
            Op::Prefill { seq } | Op::Decode { seq } => {
                let Some(i) = pick(seq, &model) else { continue };
                let s = &mut model[i];
                let before = snapshot(&m, std::slice::from_ref(s));
                if matches!(op, Op::Decode { .. }) {
                    let r = m.append_tokens(s.id, &[tok]);
                    if s.drafts.is_empty() {
                        r.unwrap();
                        s.tokens.push(tok);
                        tok += 1;
                    } else {
                        let refused = matches!(r, Err(Error::InvalidSequenceState { .. }));
                        prop_assert!(refused);
                        prop_assert_eq!(snapshot(&m, std::slice::from_ref(s)), before);
                        continue;
                    }
                }
                let before = snapshot(&m, std::slice::from_ref(s));
                let predicted = m.num_blocks_needed(s.id, 64);
                let free = m.pool().num_free();
                match m.allocate_slots(s.id, 64) {
                    Ok(a) => {
                        prop_assert_eq!(free - m.pool().num_free(), predicted.unwrap());
                        s.computed = a.num_context_tokens + a.num_scheduled_tokens;
                        prop_assert_eq!(s.computed, s.tokens.len());
                        s.status = SeqStatus::Running;
                    }
                    Err(e) => {
                        let expected = matches!(e, Error::OutOfBlocks { .. })
                            || s.status == SeqStatus::Swapped
                            || !s.drafts.is_empty()
                            || s.computed == s.tokens.len();
                        prop_assert!(expected, "{}", e);
                        prop_assert_eq!(snapshot(&m, std::slice::from_ref(s)), before);
                    }
                }
            }
            Op::Verify { seqs, k, right } => {
                if model.is_empty() {
                    continue;
                }
                let mut idx: Vec<usize> = seqs.iter().map(|&s| s % model.len()).collect();
                idx.sort_unstable();
                idx.dedup();
                // Sampled token, then `right` true continuations and the rest wrong ones.
                let mut req = StepRequest::default();
                let mut drafts = StepDrafts {
                    indptr: vec![0],
                    tokens: vec![],
                };
                req.append_indptr.push(0);
                for &i in &idx {
                    req.seq_ids.push(model[i].id);
                    req.num_new_tokens.push(64);
                    req.append_tokens.push(tok);
                    tok += 1;
                    req.append_indptr.push(req.append_tokens.len() as u32);
                    for j in 0..k {
                        if j < right {
                            drafts.tokens.push(tok);
                            tok += 1;
                        } else {
                            drafts.tokens.push(bad);
                            bad += 1;
                        }
                    }
                    drafts.indptr.push(drafts.tokens.len() as u32);
                }
                let before = snapshot(&m, &model);
                let out = m.step_with_drafts(&req, &drafts, StepOptions::default());
                prop_assert_eq!(out.input_ids.len(), out.slot_mapping.len());
                for (n, &i) in idx.iter().enumerate().take(out.num_scheduled) {
                    let s = &mut model[i];
                    s.tokens.push(req.append_tokens[n]);
                    let d =
                        &drafts.tokens[drafts.indptr[n] as usize..drafts.indptr[n + 1] as usize];
                    let q = out.query_start_loc[n] as usize..out.query_start_loc[n + 1] as usize;
                    prop_assert_eq!(out.num_draft_tokens[n] as usize, d.len());
                    let want: Vec<i64> = s.tokens[out.context_lens[n] as usize..]
                        .iter()
                        .chain(d)
                        .map(|&t| i64::from(t))
                        .collect();
                    prop_assert_eq!(&out.input_ids[q], &want[..]);
                    prop_assert_eq!(out.seq_lens[n] as usize, s.tokens.len() + d.len());
                    s.computed = s.tokens.len();
                    s.drafts = d.to_vec();
                    s.right = usize::from(right.min(k));
                    s.status = SeqStatus::Running;
                }
                if out.num_scheduled < idx.len() {
                    let failed = &model[idx[out.num_scheduled]];
                    let ok = match out.error.as_ref().expect("stopped by an error") {
                        Error::OutOfBlocks { .. } => true,
                        Error::InvalidSequenceState { .. } => {
                            failed.status == SeqStatus::Swapped || !failed.drafts.is_empty()
                        }
                        Error::InvalidArgument {
                            arg: "draft_tokens",
                            ..
                        } => {
                            // More uncomputed tokens than the step schedules.
                            failed.tokens.len() + 1 - failed.computed > 64
                        }
                        _ => false,
                    };
                    prop_assert!(ok, "{:?}", out.error);
                    if out.num_scheduled == 0 {
                        prop_assert_eq!(snapshot(&m, &model), before);
                    }
                }
            }
            Op::Accept { seq, m: n, keep } => {
                let Some(i) = pick(seq, &model) else { continue };
                let s = &mut model[i];
                let before = snapshot(&m, std::slice::from_ref(s));
                // A verifier accepts a prefix of the true drafts; n > k is the bad input.
                let mut n = usize::from(n);
                if n <= s.drafts.len() {
                    n = n.min(s.right);
                }
                let free = m.pool().num_free();
                let blocks = m.block_table(s.id).unwrap().len();
                let r = if keep {
                    m.accept_drafts_keeping_blocks(s.id, n)
                } else {
                    m.accept_drafts(s.id, n)
                };
                match r {
                    Ok(released) => {
                        prop_assert!(!s.drafts.is_empty() && n <= s.drafts.len());
                        let needed = (s.computed + n).div_ceil(BS);
                        let after = m.block_table(s.id).unwrap().len();
                        if keep {
                            prop_assert!(released.is_empty());
                            prop_assert_eq!(after, blocks, "kept blocks stay in the table");
                        } else {
                            prop_assert_eq!(released.len(), blocks - after);
                            prop_assert_eq!(after, needed);
                        }
                        prop_assert_eq!(m.pool().num_free(), free + released.len());
                        s.tokens.extend(s.drafts.drain(..).take(n));
                        s.computed += n;
                    }
                    Err(Error::InvalidSequenceState { .. }) => {
                        prop_assert!(s.drafts.is_empty());
                        prop_assert_eq!(snapshot(&m, std::slice::from_ref(s)), before);
                    }
                    Err(Error::InvalidArgument {
                        arg: "num_accepted",
                        ..
                    }) => {
                        prop_assert!(n > s.drafts.len() && !s.drafts.is_empty());
                        prop_assert_eq!(snapshot(&m, std::slice::from_ref(s)), before);
                    }
                    Err(e) => prop_assert!(false, "{}", e),
                }
            }
            Op::Fork { seq } => {
                let Some(i) = pick(seq, &model) else { continue };
                let before = snapshot(&m, &model);
                let r = m.fork(model[i].id, next_id);
                if model[i].status == SeqStatus::Swapped || !model[i].drafts.is_empty() {
                    let refused = matches!(r, Err(Error::InvalidSequenceState { .. }));
                    prop_assert!(refused);
                    prop_assert_eq!(snapshot(&m, &model), before);
                } else {
                    r.unwrap();
                    let mut c = model[i].clone();
                    c.id = next_id;
                    model.push(c);
                    next_id += 1;
                }
            }
            Op::Preempt { seq } => {
                let Some(i) = pick(seq, &model) else { continue };
                let s = &mut model[i];
                match m.preempt_recompute(&[s.id]) {
                    Ok(()) => {
                        prop_assert!(s.status != SeqStatus::Swapped);
                        s.status = SeqStatus::Preempted;
                        s.computed = 0;
                        s.drafts.clear();
                    }
                    Err(_) => prop_assert_eq!(s.status, SeqStatus::Swapped),
                }
            }
            Op::SwapOut { seq } | Op::SwapIn { seq } => {
                let Some(i) = pick(seq, &model) else { continue };
                let s = &mut model[i];
                let before = snapshot(&m, std::slice::from_ref(s));
                let out = matches!(op, Op::SwapOut { .. });
                let r = if out {
                    m.swap_out(&[s.id])
                } else {
                    m.swap_in(&[s.id])
                };
                match r {
                    Ok(_) => {
                        prop_assert!(s.drafts.is_empty());
                        s.status = if out {
                            SeqStatus::Swapped
                        } else {
                            SeqStatus::Running
                        };
                    }
                    Err(e) => {
                        let expected =
                            matches!(e, Error::OutOfSwapSpace { .. } | Error::OutOfBlocks { .. })
                                || !s.drafts.is_empty()
                                || (out && s.status != SeqStatus::Running)
                                || (!out && s.status != SeqStatus::Swapped);
                        prop_assert!(expected, "{}", e);
                        prop_assert_eq!(snapshot(&m, std::slice::from_ref(s)), before);
                    }
                }
            }
            Op::Free { seq } => {
                let Some(i) = pick(seq, &model) else { continue };
                let s = model.remove(i);
                history.push(s.tokens);
                prop_assert!(m.free(s.id));
            }
        }
        let mut all = history.clone();
        all.extend(model.iter().map(|s| s.tokens.clone()));
        check_events(&m, &all)?;
        for s in &model {
            prop_assert_eq!(m.tokens(s.id).unwrap(), s.tokens.clone());
            prop_assert_eq!(m.num_computed_tokens(s.id).unwrap(), s.computed);
            prop_assert_eq!(m.num_draft_tokens(s.id).unwrap(), s.drafts.len());
            prop_assert_eq!(m.status(s.id).unwrap(), s.status);
        }
        m.check_invariants().map_err(TestCaseError::fail)?;
    }
    for s in model.drain(..) {
        prop_assert!(m.free(s.id));
    }
    prop_assert_eq!(m.pool().num_free(), (NUM_BLOCKS - 1) as usize);
    m.check_invariants().map_err(TestCaseError::fail)?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn one_full_group_speculation_matches_model_and_keeps_invariants(ops in proptest::collection::vec(op(), 1..60)) {
        run::<KvCacheManager>(ops)?;
    }
}
