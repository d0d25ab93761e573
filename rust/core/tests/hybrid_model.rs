//! Proptest state machines of `KvCacheManager` (docs/design.md, "KV cache groups"):
//! 1. random operations on random group layouts against a small model of each sequence
//!    (tokens, computed count, status), checking after every operation the invariants
//!    (`check_invariants`), that a failed call changes nothing, that the predicted demand is
//!    exactly what a call takes and gives back, that `num_blocks_owed` is exactly the peak
//!    demand of scheduling a group, and that freeing everything leaves the pool whole. (One
//!    full-attention group is held to the one-group suites through `common::OneGroup`.)
//!
//! It drives speculative decoding's verify steps (`Verify`: lookahead slots for `k` drafts)
//! and their acceptance (`Accept`, releasing or keeping the rejected drafts' blocks), and KV
//! loaded from outside (docs/design/external-kv.md): synchronous and staged loads, commits,
//! rollbacks, `evict_blocks` and deferred releases. The KV events keep set semantics per group
//! throughout (a `BlockStored` names hashes its group does not hold, a `BlockRemoved` hashes it
//! holds), and no staged block is ever registered.

use pagedkv_core::events::KvEvent;
use pagedkv_core::manager::CPU_NULL;
use pagedkv_core::{
    BlockHash, BlockId, CacheConfig, Error, GroupSpec, KvCacheManager, SeqId, SeqStatus,
    SequenceSpec, StepRequest, NULL_BLOCK,
};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use std::collections::{HashMap, HashSet};

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
        n: u8,
    },
    Step {
        seqs: Vec<usize>,
        n: u8,
        append: bool,
    },
    Fork {
        seq: usize,
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
    Owed {
        seqs: Vec<usize>,
    },
    Verify {
        seq: usize,
        n: u8,
        k: u8,
    },
    Accept {
        seq: usize,
        m: u8,
        keep: bool,
    },
    /// `allocate_external`: staged loads schedule nothing else.
    Load {
        seq: usize,
        e: u8,
        n: u8,
        staged: bool,
    },
    /// `commit_external` at `frac / 4` of the staged range.
    Commit {
        seq: usize,
        frac: u8,
    },
    Rollback {
        seq: usize,
        back: u8,
        poisoned: bool,
    },
    Evict {
        block: u32,
    },
    DeferFree {
        seq: usize,
    },
    Release {
        i: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 1u8..40).prop_map(|(family, len)| Op::Add { family, len }),
        2 => (any::<usize>(), 1u8..8).prop_map(|(seq, n)| Op::Append { seq, n }),
        4 => (any::<usize>(), 1u8..24).prop_map(|(seq, n)| Op::Allocate { seq, n }),
        2 => (prop::collection::vec(any::<usize>(), 1..4), 1u8..12, any::<bool>())
            .prop_map(|(seqs, n, append)| Op::Step { seqs, n, append }),
        1 => any::<usize>().prop_map(|seq| Op::Fork { seq }),
        1 => any::<usize>().prop_map(|seq| Op::Free { seq }),
        1 => any::<usize>().prop_map(|seq| Op::Preempt { seq }),
        1 => any::<usize>().prop_map(|seq| Op::SwapOut { seq }),
        1 => any::<usize>().prop_map(|seq| Op::SwapIn { seq }),
        1 => any::<usize>().prop_map(|seq| Op::Lookup { seq }),
        1 => prop::collection::vec(any::<usize>(), 1..4).prop_map(|seqs| Op::Owed { seqs }),
        2 => (any::<usize>(), 1u8..24, 1u8..7).prop_map(|(seq, n, k)| Op::Verify { seq, n, k }),
        2 => (any::<usize>(), 0u8..8, any::<bool>()).prop_map(|(seq, m, keep)| Op::Accept { seq, m, keep }),
        2 => (any::<usize>(), 0u8..30, 0u8..6, any::<bool>())
            .prop_map(|(seq, e, n, staged)| Op::Load { seq, e, n: if staged { 0 } else { n }, staged }),
        3 => (any::<usize>(), 0u8..5).prop_map(|(seq, frac)| Op::Commit { seq, frac }),
        1 => (any::<usize>(), 0u8..12, any::<bool>())
            .prop_map(|(seq, back, poisoned)| Op::Rollback { seq, back, poisoned }),
        1 => any::<u32>().prop_map(|block| Op::Evict { block }),
        1 => any::<usize>().prop_map(|seq| Op::DeferFree { seq }),
        1 => any::<usize>().prop_map(|i| Op::Release { i }),
    ]
}

/// Group layouts: Gemma-like, Llama-4-like, window only, mixed block sizes, three groups,
/// full attention only at two block sizes (the manager's step without the general plan).
fn layout(k: u8) -> (Vec<GroupSpec>, Vec<u32>) {
    match k % 6 {
        0 => (
            vec![GroupSpec::full(4, 8), GroupSpec::sliding_window(4, 8, 6)],
            vec![1, 1, 0],
        ),
        1 => (
            vec![GroupSpec::full(4, 8), GroupSpec::chunked_local(4, 8, 8)],
            vec![0, 1, 1],
        ),
        2 => (vec![GroupSpec::sliding_window(2, 8, 5)], vec![0]),
        3 => (
            vec![GroupSpec::full(4, 4), GroupSpec::sliding_window(2, 8, 7)],
            vec![0, 1],
        ),
        5 => (
            vec![GroupSpec::full(4, 4), GroupSpec::full(2, 8)],
            vec![0, 1],
        ),
        _ => (
            vec![
                GroupSpec::full(2, 8),
                GroupSpec::sliding_window(2, 8, 3),
                GroupSpec::chunked_local(2, 8, 6),
            ],
            vec![0, 1, 2],
        ),
    }
}

fn prompt(family: u8, len: u8, salt: u64) -> Vec<u32> {
    // Families share prefixes; the tail differs per sequence.
    let mut p: Vec<u32> = (0..len as u32)
        .map(|i| u32::from(family) * 100 + i)
        .collect();
    if len > 6 {
        let n = p.len();
        p[n - 1] = 10_000 + salt as u32;
    }
    p
}

/// Everything a failed call must leave unchanged.
type Snapshot = (
    Vec<BlockId>,
    Vec<(SeqId, Vec<Vec<BlockId>>, usize, usize, SeqStatus)>,
);

fn snapshot(m: &KvCacheManager, ids: &[SeqId]) -> Snapshot {
    let mut seqs = Vec::new();
    for &id in ids {
        if let Ok(t) = m.block_tables(id) {
            seqs.push((
                id,
                t,
                m.num_tokens(id).unwrap(),
                m.num_computed_tokens(id).unwrap(),
                m.status(id).unwrap(),
            ));
        }
    }
    (m.pool().free_queue(), seqs)
}

/// Replays the manager's events into per-group hash sets, checking set semantics.
fn replay(sets: &mut [HashSet<BlockHash>], m: &KvCacheManager) {
    for e in m.take_events() {
        match (e.group, e.event) {
            (None, KvEvent::AllBlocksCleared) => sets.iter_mut().for_each(|s| s.clear()),
            (Some(g), KvEvent::BlockStored { block_hashes, .. }) => {
                for h in block_hashes {
                    assert!(sets[g as usize].insert(h), "group {g}: hash stored twice");
                }
            }
            (Some(g), KvEvent::BlockRemoved { block_hashes, .. }) => {
                for h in block_hashes {
                    assert!(
                        sets[g as usize].remove(&h),
                        "group {g}: removed an unknown hash"
                    );
                }
            }
            (g, e) => panic!("unexpected event {e:?} for group {g:?}"),
        }
    }
}

fn pick(ids: &[SeqId], i: usize) -> Option<SeqId> {
    (!ids.is_empty()).then(|| ids[i % ids.len()])
}

fn distinct_cpu(m: &KvCacheManager, seqs: &[SeqId]) -> usize {
    let mut set = HashSet::new();
    for &s in seqs {
        if m.status(s).unwrap() == SeqStatus::Swapped {
            for t in m.block_tables(s).unwrap() {
                set.extend(t.into_iter().filter(|&b| b != CPU_NULL));
            }
        }
    }
    set.len()
}

fn run(layout_k: u8, num_blocks: u32, sparse: bool, caching: bool, ops: Vec<Op>) {
    let (groups, layers) = layout(layout_k);
    let mut cfg = CacheConfig::with_groups(num_blocks, groups, layers);
    cfg.enable_prefix_caching = caching;
    cfg.num_cpu_blocks = 24;
    cfg.enable_events = true;
    let unit = cfg.hit_unit().unwrap();
    cfg.retention_interval = if sparse { 2 * unit } else { 0 };
    let unit = unit as usize;
    let m = KvCacheManager::new(cfg).unwrap();
    let mut ids: Vec<SeqId> = Vec::new();
    let mut next: SeqId = 1;
    // Model: tokens and computed counts per sequence.
    let mut model: HashMap<SeqId, (usize, usize)> = HashMap::new();
    // Pending draft tokens per sequence.
    let mut pending: HashMap<SeqId, usize> = HashMap::new();
    // Sequences with an asynchronous load in flight; pending deferred releases.
    let mut loading: HashSet<SeqId> = HashSet::new();
    let mut handles: Vec<u64> = Vec::new();
    let mut sets = vec![HashSet::new(); m.num_groups()];
    for op in ops {
        let before = snapshot(&m, &ids);
        let free0 = m.pool().num_free();
        let failed = match op {
            Op::Add { family, len } => {
                m.add_sequence(next, prompt(family, len, next), SequenceSpec::default())
                    .unwrap();
                model.insert(next, (len as usize, 0));
                ids.push(next);
                next += 1;
                false
            }
            Op::Append { seq, n } => {
                let Some(id) = pick(&ids, seq) else { continue };
                let r = m.append_tokens(id, &vec![7; n as usize]);
                if pending.get(&id).copied().unwrap_or(0) > 0 || loading.contains(&id) {
                    assert!(
                        matches!(r, Err(Error::InvalidSequenceState { .. })),
                        "{r:?}"
                    );
                    true
                } else {
                    r.unwrap();
                    model.get_mut(&id).unwrap().0 += n as usize;
                    false
                }
            }
            Op::Allocate { seq, n } => {
                let Some(id) = pick(&ids, seq) else { continue };
                let need = m.num_blocks_needed(id, n as usize);
                let (tokens, computed) = model[&id];
                match m.allocate_slots(id, n as usize) {
                    Ok(a) => {
                        let d = need.unwrap();
                        assert!(d.take <= free0 + d.release);
                        assert_eq!(
                            free0 as isize - m.pool().num_free() as isize,
                            d.net(),
                            "demand {d:?}"
                        );
                        let new: usize = a.groups.iter().map(|g| g.new_block_ids.len()).sum();
                        assert!(new <= d.take);
                        // Per group: the parts sum to the totals; a group's take is its new
                        // blocks (plus its hits on free cached blocks, first allocation only);
                        // its release is the released blocks that reached ref 0 (some of them
                        // taken again by this very call).
                        let sum = d
                            .per_group
                            .iter()
                            .fold((0, 0), |a, p| (a.0 + p.0, a.1 + p.1));
                        assert_eq!(sum, (d.take, d.release));
                        let all_new: HashSet<BlockId> = a
                            .groups
                            .iter()
                            .flat_map(|g| g.new_block_ids.iter().copied())
                            .collect();
                        for (g, ga) in a.groups.iter().enumerate() {
                            let (take, release) = d.per_group[g];
                            if computed > 0 {
                                assert_eq!(take, ga.new_block_ids.len(), "group {g}");
                            } else {
                                assert!(take >= ga.new_block_ids.len(), "group {g}");
                            }
                            let freed = ga
                                .released
                                .iter()
                                .filter(|&&b| m.pool().ref_count(b) == 0 || all_new.contains(&b))
                                .count();
                            assert_eq!(release, freed, "group {g}");
                        }
                        if computed > 0 {
                            assert_eq!(a.num_context_tokens, computed);
                        } else {
                            assert_eq!(a.num_context_tokens, a.num_cached_tokens);
                            assert_eq!(a.num_cached_tokens % unit, 0);
                            assert!(a.num_cached_tokens < tokens);
                        }
                        let q = (n as usize).min(tokens - a.num_context_tokens);
                        assert_eq!(a.num_scheduled_tokens, q);
                        model.get_mut(&id).unwrap().1 = a.num_context_tokens + q;
                        false
                    }
                    Err(Error::OutOfBlocks {
                        requested,
                        available,
                    }) => {
                        let d = need.unwrap();
                        assert_eq!((requested, available), (d.take, free0 + d.release));
                        assert!(d.take > free0 + d.release);
                        true
                    }
                    Err(e) if loading.contains(&id) => {
                        assert!(matches!(e, Error::InvalidSequenceState { .. }), "{e:?}");
                        true
                    }
                    Err(e) => {
                        assert_eq!(need.unwrap_err(), e);
                        true
                    }
                }
            }
            Op::Step { seqs, n, append } => {
                let mut chosen: Vec<SeqId> = Vec::new();
                for s in seqs {
                    if let Some(id) = pick(&ids, s) {
                        if !chosen.contains(&id) {
                            chosen.push(id);
                        }
                    }
                }
                if chosen.is_empty() {
                    continue;
                }
                let k = chosen.len();
                let req = StepRequest {
                    seq_ids: chosen.clone(),
                    num_new_tokens: vec![n as u32; k],
                    append_indptr: if append {
                        (0..=k as u32).collect()
                    } else {
                        vec![]
                    },
                    append_tokens: if append { vec![3; k] } else { vec![] },
                };
                let out = m.step(&req);
                for (i, &id) in chosen[..out.num_scheduled].iter().enumerate() {
                    let e = model.get_mut(&id).unwrap();
                    if append {
                        e.0 += 1;
                    }
                    e.1 = out.seq_lens[i] as usize;
                    assert_eq!(m.num_computed_tokens(id).unwrap(), e.1);
                }
                // Slot mapping: each group's row, from that group's tables.
                let t = out.query_start_loc[out.num_scheduled] as usize;
                assert_eq!(out.slot_mapping.len(), out.num_groups * t);
                let w = out.block_table_width;
                for g in 0..out.num_groups {
                    let bs = m.config().groups[g].block_size as i64;
                    for k in 0..out.num_scheduled {
                        let row = &out.block_table[(g * out.num_scheduled + k) * w..][..w];
                        for tok in out.query_start_loc[k]..out.query_start_loc[k + 1] {
                            let pos = (out.context_lens[k] + tok - out.query_start_loc[k]) as i64;
                            let slot = out.slot_mapping[g * t + tok as usize];
                            assert_eq!(slot, row[(pos / bs) as usize] as i64 * bs + pos % bs);
                            assert_ne!(slot / bs, NULL_BLOCK as i64);
                        }
                    }
                }
                false
            }
            Op::Fork { seq } => {
                let Some(id) = pick(&ids, seq) else { continue };
                match m.fork(id, next) {
                    Ok(()) => {
                        model.insert(next, model[&id]);
                        ids.push(next);
                        next += 1;
                        false
                    }
                    Err(_) => true,
                }
            }
            Op::Free { seq } => {
                let Some(id) = pick(&ids, seq) else { continue };
                assert!(m.free(id));
                assert!(!m.free(id));
                ids.retain(|&x| x != id);
                model.remove(&id);
                pending.remove(&id);
                loading.remove(&id);
                false
            }
            Op::Preempt { seq } => {
                let Some(id) = pick(&ids, seq) else { continue };
                match m.preempt_recompute(&[id]) {
                    Ok(()) => {
                        model.get_mut(&id).unwrap().1 = 0;
                        pending.remove(&id); // dropped with the rest
                        loading.remove(&id); // staged blocks released unregistered
                        false
                    }
                    Err(_) => true,
                }
            }
            Op::Verify { seq, n, k } => {
                let Some(id) = pick(&ids, seq) else { continue };
                let drafts: Vec<u32> = (0..k as u32).map(|i| 50 + i).collect();
                let need = m.num_blocks_needed_with_drafts(id, n as usize, drafts.len());
                match m.allocate_slots_with_drafts(id, n as usize, &drafts) {
                    Ok(a) => {
                        let d = need.unwrap();
                        assert_eq!(
                            free0 as isize - m.pool().num_free() as isize,
                            d.net(),
                            "verify demand {d:?}"
                        );
                        let (tokens, _) = model[&id];
                        assert_eq!(a.num_draft_tokens, k as usize);
                        assert_eq!(a.num_context_tokens + a.num_scheduled_tokens, tokens);
                        model.get_mut(&id).unwrap().1 = tokens;
                        pending.insert(id, k as usize);
                        // A windowed group keeps every block its first query row reads.
                        for (g, t) in m.block_tables(id).unwrap().iter().enumerate() {
                            let spec = m.config().groups[g];
                            let bs = spec.block_size as usize;
                            let from = spec.first_read(a.num_context_tokens) / bs;
                            assert!(t.len() >= (tokens + k as usize).div_ceil(bs));
                            assert!(
                                t[from..].iter().all(|&b| b != NULL_BLOCK),
                                "group {g}: {t:?}"
                            );
                        }
                        false
                    }
                    Err(Error::OutOfBlocks {
                        requested,
                        available,
                    }) => {
                        let d = need.unwrap();
                        assert_eq!((requested, available), (d.take, free0 + d.release));
                        true
                    }
                    Err(e) if loading.contains(&id) => {
                        assert!(matches!(e, Error::InvalidSequenceState { .. }), "{e:?}");
                        true
                    }
                    Err(e) => {
                        assert_eq!(need.unwrap_err(), e);
                        true
                    }
                }
            }
            Op::Accept { seq, m: acc, keep } => {
                let Some(id) = pick(&ids, seq) else { continue };
                let k = pending.get(&id).copied().unwrap_or(0);
                let acc = acc as usize;
                let r = if keep {
                    m.accept_drafts_keeping_blocks(id, acc)
                } else {
                    m.accept_drafts(id, acc)
                };
                match r {
                    Ok(released) => {
                        assert!(k > 0 && acc <= k);
                        let e = model.get_mut(&id).unwrap();
                        e.0 += acc;
                        e.1 += acc;
                        pending.remove(&id);
                        let n: usize = released.iter().map(Vec::len).sum();
                        assert_eq!(m.pool().num_free(), free0 + n);
                        if keep {
                            assert_eq!(n, 0);
                        }
                        false
                    }
                    Err(Error::InvalidSequenceState { .. }) => {
                        assert_eq!(k, 0);
                        true
                    }
                    Err(Error::InvalidArgument { .. }) => {
                        assert!(acc > k);
                        true
                    }
                    Err(e) => panic!("{e:?}"),
                }
            }
            Op::SwapOut { seq } => {
                let Some(id) = pick(&ids, seq) else { continue };
                m.swap_out(&[id]).is_err()
            }
            Op::SwapIn { seq } => {
                let Some(id) = pick(&ids, seq) else { continue };
                let owed = m.num_blocks_owed(&[id]).unwrap();
                let r = m.swap_in(&[id]);
                if r.is_ok() {
                    assert_eq!(free0 - m.pool().num_free(), owed);
                }
                r.is_err()
            }
            Op::Lookup { seq } => {
                let Some(id) = pick(&ids, seq) else { continue };
                let hit = m.lookup_prefix(id).unwrap();
                assert_eq!(hit % unit, 0);
                assert!(hit < m.num_tokens(id).unwrap());
                if !caching {
                    assert_eq!(hit, 0);
                }
                false
            }
            Op::Load { seq, e, n, staged } => {
                let Some(id) = pick(&ids, seq) else { continue };
                let (e, n) = (e as usize, n as usize);
                let need = m.num_blocks_needed_external(id, e, n);
                match m.allocate_external(id, e, n, staged, 0) {
                    Ok(a) => {
                        let d = need.unwrap();
                        assert_eq!(free0 as isize - m.pool().num_free() as isize, d.net());
                        assert_eq!(a.num_context_tokens, a.num_cached_tokens + e);
                        let computed = a.num_context_tokens + a.num_scheduled_tokens;
                        model.get_mut(&id).unwrap().1 = computed;
                        if staged {
                            assert_eq!(m.num_staged_tokens(id).unwrap(), e);
                            loading.insert(id);
                        }
                        false
                    }
                    Err(Error::OutOfBlocks { requested, .. }) => {
                        assert_eq!(requested, need.unwrap().take);
                        true
                    }
                    Err(err) => {
                        assert_eq!(need.unwrap_err(), err);
                        true
                    }
                }
            }
            Op::Commit { seq, frac } => {
                // Mostly a loading sequence; sometimes any (refused unless loading).
                let mut in_flight: Vec<SeqId> = loading.iter().copied().collect();
                in_flight.sort_unstable();
                let from = if seq % 4 == 0 { &ids } else { &in_flight };
                let Some(id) = pick(from, seq / 4).or_else(|| pick(&ids, seq)) else {
                    continue;
                };
                let staged = m.num_staged_tokens(id).unwrap();
                let hi = model[&id].1;
                let valid = hi - staged + staged * frac as usize / 4;
                match m.commit_external(id, valid) {
                    Ok(_) => {
                        assert!(loading.remove(&id));
                        model.get_mut(&id).unwrap().1 = valid;
                        false
                    }
                    Err(Error::InvalidSequenceState { .. }) => {
                        assert!(!loading.contains(&id));
                        true
                    }
                    Err(Error::InvalidArgument { .. }) => true, // a window never loaded
                    Err(e) => panic!("{e:?}"),
                }
            }
            Op::Rollback {
                seq,
                back,
                poisoned,
            } => {
                let Some(id) = pick(&ids, seq) else { continue };
                let n = model[&id].1.saturating_sub(back as usize);
                match m.rollback(id, n, poisoned) {
                    Ok(_) => {
                        model.get_mut(&id).unwrap().1 = n;
                        false
                    }
                    Err(Error::InvalidSequenceState { .. } | Error::InvalidArgument { .. }) => true,
                    Err(e) => panic!("{e:?}"),
                }
            }
            Op::Evict { block } => {
                let b = 1 + block % (num_blocks - 1);
                let hashed = m.pool().is_hashed(b);
                let n = m.evict_blocks(&[b]).unwrap();
                assert!(!m.pool().is_hashed(b));
                assert_eq!(n > 0, hashed);
                false
            }
            Op::DeferFree { seq } => {
                let Some(id) = pick(&ids, seq) else { continue };
                let used = m.pool().num_used();
                match m.free_deferred(id) {
                    Ok(h) => {
                        assert_eq!(m.pool().num_used(), used);
                        handles.push(h);
                        ids.retain(|&x| x != id);
                        model.remove(&id);
                        pending.remove(&id);
                        loading.remove(&id);
                        false
                    }
                    Err(_) => true,
                }
            }
            Op::Release { i } => {
                if handles.is_empty() {
                    continue;
                }
                let h = handles.remove(i % handles.len());
                let kept = m.deferred_blocks(h).unwrap().len();
                assert_eq!(m.release_deferred(h).unwrap(), kept);
                assert!(m.release_deferred(h).is_err());
                false
            }
            Op::Owed { seqs } => {
                let mut chosen: Vec<SeqId> = Vec::new();
                for s in seqs {
                    if let Some(id) = pick(&ids, s) {
                        if !chosen.contains(&id) && !loading.contains(&id) {
                            chosen.push(id);
                        }
                    }
                }
                if chosen.is_empty() {
                    continue;
                }
                let owed = m.num_blocks_owed(&chosen).unwrap();
                let owed = owed - distinct_cpu(&m, &chosen);
                // Schedule every uncomputed token of each member, in order: the peak of the
                // running demand must be exactly `owed`.
                let (mut net, mut peak, mut ok) = (0isize, 0isize, true);
                for &id in &chosen {
                    if m.status(id).unwrap() == SeqStatus::Swapped {
                        continue;
                    }
                    let (tokens, computed) = model[&id];
                    if tokens == computed {
                        continue;
                    }
                    let f = m.pool().num_free() as isize;
                    match m.allocate_slots(id, tokens - computed) {
                        Ok(_) => {
                            net += f - m.pool().num_free() as isize;
                            peak = peak.max(net);
                            model.get_mut(&id).unwrap().1 = tokens;
                        }
                        Err(Error::OutOfBlocks { .. }) => {
                            ok = false;
                            break;
                        }
                        Err(e) => panic!("{e:?}"),
                    }
                    m.check_invariants().unwrap();
                }
                if ok {
                    assert_eq!(peak as usize, owed, "owed for {chosen:?}");
                } else {
                    assert!(owed > free0, "owed {owed} but free {free0} failed");
                }
                false
            }
        };
        if failed {
            assert_eq!(
                before,
                snapshot(&m, &ids),
                "a failed call changed the state"
            );
        }
        m.check_invariants().unwrap();
        replay(&mut sets, &m);
        for &id in &loading {
            let tables = m.block_tables(id).unwrap();
            let from = model[&id].1 - m.num_staged_tokens(id).unwrap();
            for (g, t) in tables.iter().enumerate() {
                let bs = m.config().groups[g].block_size as usize;
                assert!(t[from / bs..].iter().all(|&b| !m.pool().is_hashed(b)));
            }
        }
        for (&id, &(tokens, computed)) in &model {
            assert_eq!(
                m.num_draft_tokens(id).unwrap(),
                pending.get(&id).copied().unwrap_or(0)
            );
            assert_eq!(m.num_tokens(id).unwrap(), tokens);
            if m.status(id).unwrap() != SeqStatus::Swapped {
                assert_eq!(m.num_computed_tokens(id).unwrap(), computed);
            }
        }
    }
    for id in ids {
        assert!(m.free(id));
    }
    for h in handles {
        m.release_deferred(h).unwrap();
    }
    m.check_invariants().unwrap();
    assert_eq!(m.pool().num_free(), num_blocks as usize - 1);
    assert_eq!(m.num_sequences(), 0);
}

/// 300 cases, or `PROPTEST_CASES` when set (an explicit `cases` would override it).
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

proptest! {
    // Failures are saved to, and replayed first from, hybrid_model.proptest-regressions next
    // to this file (the default looks for a lib.rs above tests/ and warns when it finds none).
    #![proptest_config(ProptestConfig {
        cases: cases(),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn groups_against_the_model(
        layout_k in 0u8..6,
        num_blocks in 8u32..40,
        sparse in any::<bool>(),
        caching in prop::bool::weighted(0.85),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(layout_k, num_blocks, sparse, caching, ops);
    }
}

/// The proptest case (CI rehearsal) behind
/// `owed_hits_the_oldest_in_use_holder_of_a_key_registered_again` in tests/hybrid.rs: a
/// decoding fork re-registers keys another member's window blocks carry; `num_blocks_owed`
/// took the later member's hit to be on the new block and owed 18 where scheduling took 19.
#[test]
fn replay_owed_forked_members() {
    use Op::*;
    run(
        2,
        27,
        true,
        true,
        vec![
            Add { family: 2, len: 32 },
            Fork { seq: 0 },
            Step {
                seqs: vec![3602547625798120572],
                n: 1,
                append: false,
            },
            Owed {
                seqs: vec![23539795102401131],
            },
            Append {
                seq: 3177818874295755451,
                n: 2,
            },
            Append {
                seq: 1816253536190836550,
                n: 1,
            },
            Add { family: 2, len: 29 },
            Allocate {
                seq: 5479767155288152528,
                n: 2,
            },
            Add { family: 0, len: 1 },
            Append {
                seq: 12685461765038449637,
                n: 1,
            },
            Append { seq: 0, n: 1 },
            Preempt {
                seq: 2242648704774426174,
            },
            Fork {
                seq: 93701587210264346,
            },
            Fork {
                seq: 291739246583355630,
            },
            Owed {
                seqs: vec![
                    8596098061540104827,
                    7029480143774145098,
                    4036450269373819819,
                ],
            },
        ],
    );
}

/// The proptest case behind `owed_releases_out_of_window_blocks_tail_first` in
/// tests/hybrid.rs (seq indexes already reduced): `num_blocks_owed` said 10 with 10 free, and
/// the second member's allocation failed.
#[test]
fn replay_owed_release_order() {
    use Op::*;
    run(
        2,
        33,
        false,
        true,
        vec![
            Add { family: 0, len: 6 },
            Fork { seq: 0 },
            Add { family: 1, len: 27 },
            Step {
                seqs: vec![2, 1],
                n: 1,
                append: false,
            },
            Step {
                seqs: vec![0, 1],
                n: 7,
                append: true,
            },
            Allocate { seq: 2, n: 8 },
            Allocate { seq: 2, n: 5 },
            Allocate { seq: 2, n: 13 },
            Add { family: 0, len: 37 },
            Fork { seq: 0 },
            Add { family: 0, len: 1 },
            Step {
                seqs: vec![3],
                n: 10,
                append: false,
            },
            Add { family: 0, len: 15 },
            Owed { seqs: vec![3, 6] },
        ],
    );
}
