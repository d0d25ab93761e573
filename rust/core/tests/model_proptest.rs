//! Proptest state machine: random operation sequences against a small pure model of each
//! sequence (tokens, computed count, status), checking docs/design.md's invariants after every op:
//! 1–4 through `check_invariants`, 5 (a failed call leaves the state bit-identical), 6
//! (predicted blocks == blocks taken), 7 (everything freed ⇒ pool whole, no sequence left) and
//! 8 (reset only when nothing is in use; afterwards no hash). Runs on the KV cache manager with one full-attention group ([`common::OneGroup`]).

mod common;

use common::OneGroup;
use pagedkv_core::{
    BlockHash, BlockId, CacheConfig, Error, KvCacheManager, SeqStatus, SequenceSpec, StepRequest,
};
use proptest::prelude::*;

const BS: u32 = 4;
const NUM_BLOCKS: u32 = 12;

#[derive(Debug, Clone)]
enum Op {
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
        num_new: u8,
    },
    Fork {
        seq: usize,
    },
    Free {
        seq: usize,
    },
    Preempt {
        seq: usize,
        with_next: bool,
    },
    SwapOut {
        seq: usize,
        with_next: bool,
    },
    SwapIn {
        seq: usize,
    },
    Reset,
    Lookup {
        seq: usize,
    },
    Step {
        seqs: Vec<usize>,
        num_new: u8,
        append: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 1u8..20).prop_map(|(family, len)| Op::Add { family, len }),
        2 => (any::<usize>(), 1u8..6).prop_map(|(seq, n)| Op::Append { seq, n }),
        5 => (any::<usize>(), 1u8..17).prop_map(|(seq, num_new)| Op::Allocate { seq, num_new }),
        1 => any::<usize>().prop_map(|seq| Op::Fork { seq }),
        2 => any::<usize>().prop_map(|seq| Op::Free { seq }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(seq, with_next)| Op::Preempt { seq, with_next }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(seq, with_next)| Op::SwapOut { seq, with_next }),
        1 => any::<usize>().prop_map(|seq| Op::SwapIn { seq }),
        1 => Just(Op::Reset),
        1 => any::<usize>().prop_map(|seq| Op::Lookup { seq }),
        2 => (proptest::collection::vec(any::<usize>(), 1..4), 1u8..9, any::<bool>())
            .prop_map(|(seqs, num_new, append)| Op::Step { seqs, num_new, append }),
    ]
}

/// The model of one sequence.
#[derive(Debug, Clone)]
struct MSeq {
    id: u64,
    tokens: Vec<u32>,
    computed: usize,
    status: SeqStatus,
}

type Snapshot = (
    Vec<u32>,
    Vec<Option<BlockHash>>,
    Vec<BlockId>,
    Vec<Vec<BlockId>>,
    Vec<usize>,
);

fn snapshot<M: OneGroup>(m: &M, model: &[MSeq]) -> Snapshot {
    let p = m.pool();
    let n = p.num_blocks();
    (
        (0..n).map(|b| p.ref_count(b)).collect(),
        (0..n).map(|b| p.block_hash(b)).collect(),
        p.free_queue(),
        model.iter().map(|s| m.block_table(s.id).unwrap()).collect(),
        model.iter().map(|s| m.num_tokens(s.id).unwrap()).collect(),
    )
}

/// Applies one allocation to the model, checking predicted == taken and the computed counts.
fn check_alloc<M: OneGroup>(
    m: &M,
    s: &mut MSeq,
    num_new: usize,
    model_snapshot: Snapshot,
) -> Result<(), TestCaseError> {
    let predicted = m.num_blocks_needed(s.id, num_new);
    let free_before = m.pool().num_free();
    let result = m.allocate_slots(s.id, num_new);
    match (predicted, result) {
        (Ok(p), Ok(a)) => {
            prop_assert_eq!(free_before - m.pool().num_free(), p, "predicted != taken");
            let context = if s.computed == 0 {
                a.num_cached_tokens
            } else {
                s.computed
            };
            prop_assert_eq!(a.num_context_tokens, context);
            prop_assert_eq!(a.num_cached_tokens % BS as usize, 0);
            prop_assert!(
                a.num_cached_tokens < s.tokens.len(),
                "last token must be recomputed"
            );
            prop_assert_eq!(
                a.num_scheduled_tokens,
                num_new.min(s.tokens.len() - context)
            );
            prop_assert!(a.groups[0].copies.len() <= 1);
            s.computed = context + a.num_scheduled_tokens;
            s.status = SeqStatus::Running;
        }
        (
            Ok(p),
            Err(Error::OutOfBlocks {
                requested,
                available,
            }),
        ) => {
            prop_assert_eq!((requested, available), (p, free_before));
            prop_assert_eq!(
                snapshot(m, std::slice::from_ref(s)),
                model_snapshot,
                "failed allocation changed state"
            );
        }
        (Err(e1), Err(e2)) => {
            prop_assert_eq!(&e1, &e2);
            let swapped_or_done = s.status == SeqStatus::Swapped || s.computed == s.tokens.len();
            prop_assert!(swapped_or_done, "unexpected error {}", e1);
        }
        (p, r) => prop_assert!(false, "prediction {:?} vs result {:?}", p, r),
    }
    Ok(())
}

fn run<M: OneGroup>(ops: Vec<Op>, cpu_blocks: u32) -> Result<(), TestCaseError> {
    let mut cfg = CacheConfig::new(NUM_BLOCKS, BS);
    cfg.num_cpu_blocks = cpu_blocks;
    cfg.enable_events = true;
    let m = M::build(cfg).unwrap();
    let mut model: Vec<MSeq> = Vec::new();
    let mut next_id = 0u64;
    let mut tok = 10_000u32;
    for op in ops {
        let pick = |i: usize, model: &Vec<MSeq>| {
            if model.is_empty() {
                None
            } else {
                Some(i % model.len())
            }
        };
        match op {
            Op::Add { family, len } => {
                // Prompts of one family share prefixes, so prefix hits happen.
                let prompt: Vec<u32> = (0..u32::from(len))
                    .map(|i| u32::from(family) * 1000 + i)
                    .collect();
                m.add_sequence(next_id, &prompt, SequenceSpec::default())
                    .unwrap();
                model.push(MSeq {
                    id: next_id,
                    tokens: prompt,
                    computed: 0,
                    status: SeqStatus::Running,
                });
                next_id += 1;
            }
            Op::Append { seq, n } => {
                if let Some(i) = pick(seq, &model) {
                    let new: Vec<u32> = (0..u32::from(n)).map(|j| tok + j).collect();
                    tok += 7;
                    m.append_tokens(model[i].id, &new).unwrap();
                    model[i].tokens.extend(new);
                }
            }
            Op::Allocate { seq, num_new } => {
                if let Some(i) = pick(seq, &model) {
                    let snap = snapshot(&m, &[model[i].clone()]);
                    check_alloc(&m, &mut model[i], usize::from(num_new), snap)?;
                }
            }
            Op::Fork { seq } => {
                if let Some(i) = pick(seq, &model) {
                    let free = m.pool().num_free();
                    let r = m.fork(model[i].id, next_id);
                    if model[i].status == SeqStatus::Swapped {
                        let refused = matches!(r, Err(Error::InvalidSequenceState { .. }));
                        prop_assert!(refused);
                    } else {
                        r.unwrap();
                        prop_assert_eq!(m.pool().num_free(), free, "fork allocated");
                        let mut c = model[i].clone();
                        c.id = next_id;
                        model.push(c);
                        next_id += 1;
                    }
                }
            }
            Op::Free { seq } => {
                if let Some(i) = pick(seq, &model) {
                    let id = model.remove(i).id;
                    prop_assert!(m.free(id));
                    let snap = snapshot(&m, &model);
                    prop_assert!(!m.free(id), "second free must be a no-op");
                    prop_assert_eq!(snapshot(&m, &model), snap);
                }
            }
            Op::Preempt { seq, with_next } | Op::SwapOut { seq, with_next } => {
                let swap = matches!(op, Op::SwapOut { .. });
                if let Some(i) = pick(seq, &model) {
                    let mut group = vec![i];
                    if with_next && model.len() > 1 {
                        group.push((i + 1) % model.len());
                    }
                    let ids: Vec<u64> = group.iter().map(|&g| model[g].id).collect();
                    let before = snapshot(&m, &model);
                    let r = if swap {
                        m.swap_out(&ids).map(|_| ())
                    } else {
                        m.preempt_recompute(&ids)
                    };
                    let allowed = |s: SeqStatus| {
                        if swap {
                            s == SeqStatus::Running
                        } else {
                            s != SeqStatus::Swapped
                        }
                    };
                    let ok = group.iter().all(|&g| allowed(model[g].status));
                    match r {
                        Ok(()) => {
                            prop_assert!(ok);
                            for &g in &group {
                                if swap {
                                    model[g].status = SeqStatus::Swapped;
                                } else {
                                    model[g].status = SeqStatus::Preempted;
                                    model[g].computed = 0;
                                }
                            }
                        }
                        Err(e) => {
                            prop_assert!(!ok || matches!(e, Error::OutOfSwapSpace { .. }), "{}", e);
                            prop_assert_eq!(snapshot(&m, &model), before);
                        }
                    }
                }
            }
            Op::SwapIn { seq } => {
                if let Some(i) = pick(seq, &model) {
                    let before = snapshot(&m, &model);
                    match m.swap_in(&[model[i].id]) {
                        Ok(_) => {
                            prop_assert_eq!(model[i].status, SeqStatus::Swapped);
                            model[i].status = SeqStatus::Running;
                        }
                        Err(e) => {
                            let expected = model[i].status != SeqStatus::Swapped
                                || matches!(e, Error::OutOfBlocks { .. });
                            prop_assert!(expected, "{}", e);
                            prop_assert_eq!(snapshot(&m, &model), before);
                        }
                    }
                }
            }
            Op::Reset => {
                let in_use = m.pool().num_used();
                match m.reset_prefix_cache() {
                    Ok(()) => {
                        prop_assert_eq!(in_use, 0);
                        prop_assert!((0..NUM_BLOCKS).all(|b| m.pool().block_hash(b).is_none()));
                    }
                    Err(e) => prop_assert_eq!(
                        e,
                        Error::CacheInUse {
                            blocks_in_use: in_use
                        }
                    ),
                }
            }
            Op::Lookup { seq } => {
                if let Some(i) = pick(seq, &model) {
                    let before = snapshot(&m, &model);
                    let n = m.lookup_prefix(model[i].id).unwrap();
                    prop_assert_eq!(n % BS as usize, 0);
                    prop_assert!(n < model[i].tokens.len());
                    prop_assert_eq!(snapshot(&m, &model), before, "lookup had side effects");
                }
            }
            Op::Step {
                seqs,
                num_new,
                append,
            } => {
                if model.is_empty() {
                    continue;
                }
                let idx: Vec<usize> = seqs.iter().map(|&s| s % model.len()).collect();
                let mut req = StepRequest {
                    seq_ids: idx.iter().map(|&i| model[i].id).collect(),
                    num_new_tokens: vec![u32::from(num_new); idx.len()],
                    ..Default::default()
                };
                if append {
                    req.append_indptr = (0..=idx.len() as u32).collect();
                    req.append_tokens = (0..idx.len() as u32).map(|j| tok + j).collect();
                    tok += 11;
                }
                let before = snapshot(&m, &model);
                let mut distinct = req.seq_ids.clone();
                distinct.sort_unstable();
                distinct.dedup();
                let owed = (distinct.len() == idx.len() && !append)
                    .then(|| m.num_blocks_owed(&req.seq_ids).unwrap());
                let free_before = m.pool().num_free();
                let out = m.step(&req);
                prop_assert_eq!(out.query_start_loc.len(), out.num_scheduled + 1);
                let w = out.block_table_width;
                prop_assert_eq!(out.block_table.len(), out.num_scheduled * w);
                for k in 0..out.num_scheduled {
                    let row = out.block_table_row(0, k);
                    let len = (out.seq_lens[k] as usize).div_ceil(BS as usize);
                    let table: Vec<i32> = m
                        .block_table(req.seq_ids[k])
                        .unwrap()
                        .iter()
                        .map(|&b| b as i32)
                        .collect();
                    prop_assert_eq!(&row[..len], &table[..]);
                    prop_assert!(row[len..].iter().all(|&b| b == 0));
                }
                prop_assert_eq!(out.input_ids.len(), out.slot_mapping.len());
                // Scheduling every uncomputed token of the group takes exactly what it owed.
                if let Some(owed) = owed {
                    let all_done = out.error.is_none()
                        && req
                            .seq_ids
                            .iter()
                            .all(|&id| m.num_uncomputed_tokens(&[id]).unwrap() == vec![0]);
                    if all_done {
                        prop_assert_eq!(free_before - m.pool().num_free(), owed);
                    }
                }
                prop_assert_eq!(
                    out.slot_mapping.len() as i32,
                    *out.query_start_loc.last().unwrap()
                );
                for (k, &i) in idx.iter().enumerate().take(out.num_scheduled) {
                    if append {
                        model[i].tokens.push(req.append_tokens[k]);
                    }
                    let q =
                        (out.query_start_loc[k] as usize)..(out.query_start_loc[k + 1] as usize);
                    let want: Vec<i64> = model[i].tokens
                        [out.context_lens[k] as usize..out.seq_lens[k] as usize]
                        .iter()
                        .map(|&t| i64::from(t))
                        .collect();
                    prop_assert_eq!(&out.input_ids[q], &want[..]);
                    model[i].computed = out.seq_lens[k] as usize;
                    model[i].status = SeqStatus::Running;
                    let table = out.block_table_row(0, k);
                    for (j, pos) in (out.context_lens[k]..out.seq_lens[k]).enumerate() {
                        let slot = out.slot_mapping[out.query_start_loc[k] as usize + j];
                        let block = table[pos as usize / BS as usize];
                        prop_assert_eq!(
                            slot,
                            i64::from(block) * i64::from(BS) + i64::from(pos as u32 % BS)
                        );
                    }
                }
                if out.num_scheduled == 0 && out.error.is_some() {
                    prop_assert_eq!(snapshot(&m, &model), before, "failed step changed state");
                }
            }
        }
        // Model agreement + invariants 1-4.
        for s in &model {
            prop_assert_eq!(m.num_tokens(s.id).unwrap(), s.tokens.len());
            prop_assert_eq!(m.num_computed_tokens(s.id).unwrap(), s.computed);
            prop_assert_eq!(m.status(s.id).unwrap(), s.status);
        }
        prop_assert_eq!(m.num_sequences(), model.len());
        if let Err(e) = m.check_invariants() {
            prop_assert!(false, "invariant violated: {}", e);
        }
    }
    // Invariant 7: free everything.
    for s in model.drain(..) {
        prop_assert!(m.free(s.id));
    }
    prop_assert_eq!(m.pool().num_free(), (NUM_BLOCKS - 1) as usize);
    prop_assert!((0..NUM_BLOCKS).all(|b| m.pool().ref_count(b) == 0));
    prop_assert_eq!(m.num_sequences(), 0);
    prop_assert_eq!(m.stats().cpu_used, 0);
    m.check_invariants().map_err(TestCaseError::fail)?;
    // Invariant 8.
    m.reset_prefix_cache().unwrap();
    prop_assert!((0..NUM_BLOCKS).all(|b| m.pool().block_hash(b).is_none()));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn one_full_group_matches_model_and_keeps_invariants(ops in proptest::collection::vec(op(), 1..80), cpu in 0u32..6) {
        run::<KvCacheManager>(ops, cpu)?;
    }
}
