//! Fuzz target `hybrid_ops`: arbitrary bytes -> a KV cache group layout (full attention,
//! sliding window, chunked local, state; any block sizes, windows, page sizes, layer mapping,
//! retention interval, some of them invalid on purpose) and a sequence of operations on
//! [`KvCacheManager`] with unknown and duplicate sequence ids.
//!
//! An invalid layout must be refused with `InvalidConfig`. Otherwise two managers with the same
//! configuration run in lockstep: `m` gets the batched `step`, the `twin` the same work as
//! `append_tokens` + `allocate_slots` calls, so block tables must agree exactly. After every
//! operation:
//! - `check_invariants()` holds on both (docs/design.md, "KV cache groups"), also after
//!   `release_skipped_blocks` (what a window left, released once the caller's steps settled);
//! - a failed call left the observable state unchanged;
//! - an allocation changed the free count by exactly `take - release` of `num_blocks_needed`,
//!   and failed with `OutOfBlocks` exactly when `take > free + release`;
//! - the events keep set semantics per group: a `BlockStored` names hashes its group does not
//!   hold, a `BlockRemoved` hashes it holds.
//!
//! Speculative decoding: `Verify` is a `step_with_drafts` (the twin: `append_tokens` +
//! `allocate_slots_with_drafts`) and `Accept` an `accept_drafts` (or the keeping variant) on
//! both; a verify step's slots must lie in non-null blocks, and so must every position its first
//! query row reads in each group.
//!
//! KV loaded from outside (docs/design/external-kv.md): `Load` (`allocate_external`, staged or
//! not), `Commit`, `Rollback` (poisoned or not), `Evict` (`evict_blocks`), `DeferFree` and
//! `Release` (deferred releases) on both managers, with equal results; a staged load's demand is
//! `num_blocks_needed_external`'s, and a loading sequence's staged blocks are never registered.
//!
//! State groups (docs/design.md, "KV cache groups", state groups): `CommitComputed`
//! (`commit_computed`) on both managers with equal results; a state group's slot rows are -1,
//! its live block is held, and no prefix lookup ever returns a state no commit covered (the
//! token prefixes of every commit are recorded; a hit's prefix must be among them).
//!
//! At the end every sequence is freed, every deferred release released, and the pool must be
//! whole.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv_core::events::KvEvent;
use pagedkv_core::{
    BlockHash, BlockId, CacheConfig, Error, GroupSpec, KvCacheManager, SeqId, SeqStatus,
    SequenceSpec, StepDrafts, StepRequest, NULL_BLOCK,
};
use std::collections::HashSet;

const ID_SPACE: u8 = 8;
const MAX_OPS: usize = 96;

#[derive(Arbitrary, Debug)]
struct Group {
    kind: u8,
    block_size: u8,
    bytes_per_token: u8,
    span: u8,
}

#[derive(Arbitrary, Debug)]
struct Cfg {
    num_blocks: u8,
    groups: Vec<Group>,
    layers: Vec<u8>,
    retention_units: u8,
    caching: bool,
    cpu_blocks: u8,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Add { seq: u8, family: u8, len: u8 },
    Append { seq: u8, n: u8 },
    Allocate { seq: u8, n: u8 },
    Step { seqs: Vec<u8>, n: u8, append: bool },
    Fork { parent: u8, child: u8 },
    Free { seq: u8 },
    Preempt { seqs: Vec<u8> },
    SwapOut { seqs: Vec<u8> },
    SwapIn { seqs: Vec<u8> },
    Lookup { seq: u8 },
    Owed { seqs: Vec<u8> },
    Reset,
    Verify { seqs: Vec<u8>, n: u8, k: u8 },
    Accept { seq: u8, m: u8, keep: bool },
    Load { seq: u8, e: u8, n: u8, staged: bool },
    Commit { seq: u8, back: u8 },
    Rollback { seq: u8, back: u8, poisoned: bool },
    Evict { blocks: Vec<u8> },
    DeferFree { seq: u8 },
    DeferPreempt { seqs: Vec<u8> },
    Release { i: u8 },
    Prune { seq: u8, back: u8 },
    Lookahead { seq: u8, n: u8, k: u8 },
    HitLimit { seq: u8, limit: Option<u8> },
    CommitComputed { seq: u8, back: u8 },
}

#[derive(Arbitrary, Debug)]
struct Input {
    cfg: Cfg,
    ops: Vec<Op>,
}

fn config(c: &Cfg) -> CacheConfig {
    let groups = c
        .groups
        .iter()
        .take(4)
        .map(|g| {
            let bs = u32::from(g.block_size % 9);
            let bpt = u64::from(g.bytes_per_token % 3) * 8;
            let span = u32::from(g.span % 24);
            if g.kind >= 200 {
                return GroupSpec::state(bs, bpt);
            }
            match g.kind % 3 {
                0 => GroupSpec::full(bs, bpt),
                1 => GroupSpec::sliding_window(bs, bpt, span),
                _ => GroupSpec::chunked_local(bs, bpt, span),
            }
        })
        .collect::<Vec<_>>();
    let layers = c.layers.iter().take(8).map(|&l| u32::from(l % 5)).collect();
    let mut cfg = CacheConfig::with_groups(u32::from(c.num_blocks % 48), groups, layers);
    cfg.enable_prefix_caching = c.caching;
    cfg.num_cpu_blocks = u32::from(c.cpu_blocks % 16);
    cfg.enable_events = true;
    // Mostly a multiple of the hit unit, sometimes not (refused).
    let unit = cfg.hit_unit().unwrap_or(1);
    cfg.retention_interval =
        u32::from(c.retention_units % 4) * unit + u32::from(c.retention_units >= 250);
    cfg
}

type Snapshot = (Vec<BlockId>, Vec<(SeqId, Vec<Vec<BlockId>>, usize, usize)>);

fn snapshot(m: &KvCacheManager) -> Snapshot {
    let mut seqs = Vec::new();
    for id in 0..u64::from(ID_SPACE) {
        if let Ok(t) = m.block_tables(id) {
            seqs.push((
                id,
                t,
                m.num_tokens(id).unwrap(),
                m.num_computed_tokens(id).unwrap(),
            ));
        }
    }
    (m.pool().free_queue(), seqs)
}

fn ids(v: &[u8]) -> Vec<SeqId> {
    v.iter().take(4).map(|&s| u64::from(s % ID_SPACE)).collect()
}

/// Replays one manager's events into per-group hash sets, checking set semantics.
fn replay(sets: &mut Vec<HashSet<BlockHash>>, m: &KvCacheManager) {
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

fuzz_target!(|input: Input| {
    let cfg = config(&input.cfg);
    let m = match KvCacheManager::new(cfg.clone()) {
        Ok(m) => m,
        Err(Error::InvalidConfig { .. }) => {
            assert!(cfg.validate().is_err());
            return;
        }
        Err(e) => panic!("construction failed with {e:?}"),
    };
    let twin = KvCacheManager::new(cfg.clone()).unwrap();
    let mut sets = vec![HashSet::new(); cfg.groups.len()];
    let mut twin_sets = sets.clone();
    let mut handles: Vec<u64> = Vec::new();
    let has_state = cfg.groups.iter().any(GroupSpec::is_state);
    // Token prefixes some commit_computed or full load commit covered: the only states a hit may
    // return.
    let mut committed: HashSet<Vec<u32>> = HashSet::new();
    for op in input.ops.into_iter().take(MAX_OPS) {
        let before = snapshot(&m);
        let free0 = m.pool().num_free();
        let failed = match op {
            Op::Add { seq, family, len } => {
                let id = u64::from(seq % ID_SPACE);
                let p: Vec<u32> = (0..u32::from(len % 64))
                    .map(|i| u32::from(family % 3) * 100 + i)
                    .collect();
                let r = m.add_sequence(id, p.clone(), SequenceSpec::default());
                assert_eq!(r, twin.add_sequence(id, p, SequenceSpec::default()));
                r.is_err()
            }
            Op::Append { seq, n } => {
                let id = u64::from(seq % ID_SPACE);
                let t = vec![9; usize::from(n % 8)];
                let r = m.append_tokens(id, &t);
                assert_eq!(r, twin.append_tokens(id, &t));
                r.is_err()
            }
            Op::Allocate { seq, n } => {
                let id = u64::from(seq % ID_SPACE);
                let n = usize::from(n % 40);
                let loading = m.status(id) == Ok(SeqStatus::Loading);
                let need = m.num_blocks_needed(id, n);
                let r = m.allocate_slots(id, n);
                let r2 = twin.allocate_slots(id, n);
                assert_eq!(r, r2);
                match (&need, &r) {
                    // A loading sequence's demand is the reservation of its in-flight load; its
                    // allocation waits for commit_external.
                    (_, r) if loading => {
                        assert!(
                            matches!(r, Err(Error::InvalidSequenceState { .. })),
                            "{r:?}"
                        )
                    }
                    (Ok(d), Ok(_)) => {
                        assert!(d.take <= free0 + d.release);
                        assert_eq!(free0 as isize - m.pool().num_free() as isize, d.net());
                    }
                    (Ok(d), Err(Error::OutOfBlocks { .. })) => assert!(d.take > free0 + d.release),
                    (Err(a), Err(b)) => assert_eq!(a, b),
                    (a, b) => panic!("demand {a:?} but allocation {b:?}"),
                }
                r.is_err()
            }
            Op::Step { seqs, n, append } => {
                let seq_ids = ids(&seqs);
                let k = seq_ids.len();
                let n = u32::from(n % 24);
                let req = StepRequest {
                    seq_ids: seq_ids.clone(),
                    num_new_tokens: vec![n; k],
                    append_indptr: if append {
                        (0..=k as u32).collect()
                    } else {
                        vec![]
                    },
                    append_tokens: if append { vec![4; k] } else { vec![] },
                };
                let out = m.step(&req);
                // The twin does the scheduled sequences' work one call at a time; the one that
                // failed (if any) was left unchanged by the step, so the twin skips it.
                for &id in &seq_ids[..out.num_scheduled] {
                    if append {
                        twin.append_tokens(id, &[4]).unwrap();
                    }
                    twin.allocate_slots(id, n as usize).unwrap();
                }
                out.num_scheduled == 0 && out.error.is_some()
            }
            Op::Fork { parent, child } => {
                let (p, c) = (u64::from(parent % ID_SPACE), u64::from(child % ID_SPACE));
                let r = m.fork(p, c);
                assert_eq!(r, twin.fork(p, c));
                r.is_err()
            }
            Op::Free { seq } => {
                let id = u64::from(seq % ID_SPACE);
                assert_eq!(m.free(id), twin.free(id));
                false
            }
            Op::Preempt { seqs } => {
                let r = m.preempt_recompute(&ids(&seqs));
                assert_eq!(r, twin.preempt_recompute(&ids(&seqs)));
                r.is_err()
            }
            Op::SwapOut { seqs } => {
                let r = m.swap_out(&ids(&seqs));
                assert_eq!(r, twin.swap_out(&ids(&seqs)));
                r.is_err()
            }
            Op::SwapIn { seqs } => {
                let r = m.swap_in(&ids(&seqs));
                assert_eq!(r, twin.swap_in(&ids(&seqs)));
                r.is_err()
            }
            Op::Lookup { seq } => {
                let id = u64::from(seq % ID_SPACE);
                if let Ok(hit) = m.lookup_prefix(id) {
                    assert_eq!(hit % m.hit_unit(), 0);
                    if has_state && hit > 0 {
                        let t = m.tokens(id).unwrap();
                        assert!(
                            committed.contains(&t[..hit]),
                            "a hit on an uncommitted state"
                        );
                    }
                }
                false
            }
            Op::CommitComputed { seq, back } => {
                let id = u64::from(seq % ID_SPACE);
                let n = m
                    .num_computed_tokens(id)
                    .unwrap_or(0)
                    .saturating_sub(usize::from(back % 24))
                    + usize::from(back >= 250);
                let r = m.commit_computed(id, n);
                assert_eq!(r, twin.commit_computed(id, n));
                if r.is_ok() && m.status(id) == Ok(SeqStatus::Running) {
                    let t = m.tokens(id).unwrap();
                    committed.extend((1..=n).map(|e| t[..e].to_vec()));
                }
                r.is_err()
            }
            Op::Owed { seqs } => {
                let _ = m.num_blocks_owed(&ids(&seqs));
                false
            }
            Op::Reset => {
                let r = m.reset_prefix_cache();
                assert_eq!(r, twin.reset_prefix_cache());
                r.is_err()
            }
            Op::Verify { seqs, n, k } => {
                let seq_ids = ids(&seqs);
                let ns = seq_ids.len();
                let n = u32::from(n % 24);
                let drafts: Vec<u32> = (0..u32::from(k % 7)).map(|i| 70 + i).collect();
                let req = StepRequest {
                    seq_ids: seq_ids.clone(),
                    num_new_tokens: vec![n; ns],
                    append_indptr: (0..=ns as u32).collect(),
                    append_tokens: vec![4; ns],
                };
                let d = StepDrafts {
                    indptr: (0..=ns).map(|i| (i * drafts.len()) as u32).collect(),
                    tokens: drafts.repeat(ns),
                };
                let out = m.step_with_drafts(&req, &d);
                for &id in &seq_ids[..out.num_scheduled] {
                    twin.append_tokens(id, &[4]).unwrap();
                    twin.allocate_slots_with_drafts(id, n as usize, &drafts)
                        .unwrap();
                }
                // Every slot of the query, and every position its first row reads, is backed.
                let t = out.query_start_loc[out.num_scheduled] as usize;
                let w = out.block_table_width;
                for g in 0..out.num_groups {
                    let spec = m.config().groups[g];
                    let bs = spec.block_size as usize;
                    for i in 0..out.num_scheduled {
                        let row = &out.block_table[(g * out.num_scheduled + i) * w..][..w];
                        let ctx = out.context_lens[i] as usize;
                        let end = out.seq_lens[i] as usize;
                        if spec.is_state() {
                            // The live state only; no per-token slot.
                            assert_ne!(row[(end - 1) / bs], NULL_BLOCK as i32);
                            for q in out.query_start_loc[i]..out.query_start_loc[i + 1] {
                                assert_eq!(out.slot_mapping[g * t + q as usize], -1);
                            }
                            continue;
                        }
                        for p in spec.first_read(ctx)..end {
                            assert_ne!(row[p / bs], NULL_BLOCK as i32, "group {g}: position {p}");
                        }
                        for q in out.query_start_loc[i]..out.query_start_loc[i + 1] {
                            assert!(out.slot_mapping[g * t + q as usize] / bs as i64 > 0);
                        }
                    }
                }
                out.num_scheduled == 0 && out.error.is_some()
            }
            Op::Accept { seq, m: acc, keep } => {
                let id = u64::from(seq % ID_SPACE);
                let acc = usize::from(acc % 8);
                let (r, r2) = if keep {
                    (
                        m.accept_drafts_keeping_blocks(id, acc),
                        twin.accept_drafts_keeping_blocks(id, acc),
                    )
                } else {
                    (m.accept_drafts(id, acc), twin.accept_drafts(id, acc))
                };
                assert_eq!(r, r2);
                if let Ok(released) = &r {
                    let n: usize = released.iter().map(Vec::len).sum();
                    assert_eq!(m.pool().num_free(), free0 + n);
                }
                r.is_err()
            }
            Op::Load { seq, e, n, staged } => {
                let id = u64::from(seq % ID_SPACE);
                let (e, n) = (usize::from(e % 48), usize::from(n % 8));
                let need = m.num_blocks_needed_external(id, e, n);
                let r = m.allocate_external(id, e, n, staged, 0);
                assert_eq!(r, twin.allocate_external(id, e, n, staged, 0));
                match (&need, &r) {
                    (Ok(d), Ok(a)) => {
                        assert_eq!(free0 as isize - m.pool().num_free() as isize, d.net());
                        assert_eq!(a.num_context_tokens, a.num_cached_tokens + e);
                    }
                    (Ok(d), Err(Error::OutOfBlocks { .. })) => assert!(d.take > free0 + d.release),
                    (_, Err(_)) => {}
                    (Err(a), Ok(b)) => panic!("demand {a:?} but allocation {b:?}"),
                }
                r.is_err()
            }
            Op::Commit { seq, back } => {
                let id = u64::from(seq % ID_SPACE);
                let valid = m
                    .num_computed_tokens(id)
                    .unwrap_or(0)
                    .saturating_sub(usize::from(back % 16));
                let r = m.commit_external(id, valid);
                assert_eq!(r, twin.commit_external(id, valid));
                if r.is_ok() {
                    // A load completed in full publishes its loaded state (state groups).
                    let t = m.tokens(id).unwrap();
                    committed.insert(t[..valid].to_vec());
                }
                r.is_err()
            }
            Op::Rollback {
                seq,
                back,
                poisoned,
            } => {
                let id = u64::from(seq % ID_SPACE);
                let n = m
                    .num_computed_tokens(id)
                    .unwrap_or(0)
                    .saturating_sub(usize::from(back % 16));
                let r = m.rollback(id, n, poisoned);
                assert_eq!(r, twin.rollback(id, n, poisoned));
                r.is_err()
            }
            Op::Evict { blocks } => {
                let b: Vec<BlockId> = blocks.iter().take(4).map(|&b| u32::from(b % 50)).collect();
                let r = m.evict_blocks(&b);
                assert_eq!(r, twin.evict_blocks(&b));
                if r.is_ok() {
                    assert!(b.iter().all(|&x| !m.pool().is_hashed(x)));
                }
                r.is_err()
            }
            Op::DeferFree { seq } => {
                let id = u64::from(seq % ID_SPACE);
                let used = m.pool().num_used();
                let r = m.free_deferred(id);
                assert_eq!(r, twin.free_deferred(id));
                if let Ok(h) = r {
                    assert_eq!(m.pool().num_used(), used);
                    handles.push(h);
                }
                r.is_err()
            }
            Op::DeferPreempt { seqs } => {
                let r = m.preempt_deferred(&ids(&seqs));
                assert_eq!(r, twin.preempt_deferred(&ids(&seqs)));
                if let Ok(h) = r {
                    handles.push(h);
                }
                r.is_err()
            }
            Op::Release { i } => {
                if handles.is_empty() {
                    continue;
                }
                let h = handles.remove(usize::from(i) % handles.len());
                let r = m.release_deferred(h);
                assert_eq!(r, twin.release_deferred(h));
                assert!(m.release_deferred(h).is_err());
                assert!(twin.release_deferred(h).is_err());
                false
            }
            Op::Lookahead { seq, n, k } => {
                let id = u64::from(seq % ID_SPACE);
                let (n, k) = (usize::from(n % 40), usize::from(k % 12));
                let loading = m.status(id) == Ok(SeqStatus::Loading);
                let need = m.num_blocks_needed_with_lookahead(id, n, 0, k);
                let r = m.allocate_slots_with_lookahead(id, n, &[], k);
                assert_eq!(r, twin.allocate_slots_with_lookahead(id, n, &[], k));
                match (&need, &r) {
                    (_, r) if loading => {
                        assert!(
                            matches!(r, Err(Error::InvalidSequenceState { .. })),
                            "{r:?}"
                        )
                    }
                    (Ok(d), Ok(_)) => {
                        assert!(d.take <= free0 + d.release);
                        assert_eq!(free0 as isize - m.pool().num_free() as isize, d.net());
                        // Every group's table covers the lookahead positions.
                        let end = m.num_computed_tokens(id).unwrap() + k;
                        for (g, t) in m.block_tables(id).unwrap().iter().enumerate() {
                            let bs = m.config().groups[g].block_size as usize;
                            assert!(
                                t.len() * bs >= end,
                                "group {g}: {} slots < {end}",
                                t.len() * bs
                            );
                        }
                    }
                    (Ok(d), Err(Error::OutOfBlocks { .. })) => assert!(d.take > free0 + d.release),
                    (Err(a), Err(b)) => assert_eq!(a, b),
                    (a, b) => panic!("demand {a:?} but allocation {b:?}"),
                }
                r.is_err()
            }
            Op::HitLimit { seq, limit } => {
                let id = u64::from(seq % ID_SPACE);
                let limit = limit.map(usize::from);
                let r = m.set_hit_limit(id, limit);
                assert_eq!(r, twin.set_hit_limit(id, limit));
                if r.is_ok() {
                    let hit = m.lookup_prefix(id).unwrap();
                    assert_eq!(hit, twin.lookup_prefix(id).unwrap());
                    assert!(
                        limit.is_none_or(|l| hit <= l),
                        "hit {hit} over the limit {limit:?}"
                    );
                }
                r.is_err()
            }
            Op::Prune { seq, back } => {
                let id = u64::from(seq % ID_SPACE);
                let n = m
                    .num_computed_tokens(id)
                    .unwrap_or(0)
                    .saturating_sub(usize::from(back % 40))
                    + usize::from(back >= 240);
                let r = m.release_skipped_blocks(id, n);
                assert_eq!(r, twin.release_skipped_blocks(id, n));
                if let Ok(released) = &r {
                    let n = released.iter().map(Vec::len).sum::<usize>();
                    assert!(m.pool().num_free() >= free0 && m.pool().num_free() - free0 <= n);
                }
                r.is_err()
            }
        };
        if failed {
            assert_eq!(before, snapshot(&m), "a failed call changed the state");
        }
        // A loading sequence's staged blocks are never registered.
        for id in 0..u64::from(ID_SPACE) {
            let Ok(staged) = m.num_staged_tokens(id) else {
                continue;
            };
            if staged == 0 {
                continue;
            }
            let from = m.num_computed_tokens(id).unwrap() - staged;
            for (g, t) in m.block_tables(id).unwrap().iter().enumerate() {
                let bs = m.config().groups[g].block_size as usize;
                assert!(t[from / bs..].iter().all(|&b| !m.pool().is_hashed(b)));
            }
        }
        m.check_invariants().unwrap();
        twin.check_invariants().unwrap();
        replay(&mut sets, &m);
        replay(&mut twin_sets, &twin);
        assert_eq!(
            snapshot(&m).1,
            snapshot(&twin).1,
            "step and per-sequence calls disagree"
        );
    }
    for id in 0..u64::from(ID_SPACE) {
        m.free(id);
    }
    for h in handles {
        m.release_deferred(h).unwrap();
    }
    m.check_invariants().unwrap();
    assert_eq!(m.pool().num_free(), m.pool().num_usable());
    replay(&mut sets, &m);
});
