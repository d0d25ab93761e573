//! Fuzz target `manager_ops`: arbitrary bytes -> a cache configuration and a sequence of
//! operations on [`KvCacheManager`] with one full-attention group (add / append / allocate_slots / step, with speculative
//! decoding's draft tokens or without / accept_drafts / fork / free / preempt / swap_out /
//! swap_in / reset / lookup / events), with unknown and duplicate sequence ids on purpose.
//!
//! Two managers with the same configuration are driven in lockstep: `m` gets the batched
//! `step`, the `twin` gets the same work as single `append_tokens` + `allocate_slots` calls, so
//! the batched entry point is checked differentially against the per-sequence one (both are
//! deterministic, so block ids and hashes must agree exactly). After every operation:
//! - `check_invariants()` holds on both (docs/design.md, "Invariants" 1–4);
//! - a failed call left the whole observable state unchanged (snapshot compare, invariant 5)
//!   and emitted no event;
//! - an allocation took exactly the number of blocks `num_blocks_needed` predicted
//!   (invariant 6), and failed with `OutOfBlocks` exactly when that number exceeded the free
//!   blocks;
//! - the expected outcome (success or which error) matches what the arguments imply;
//! - draft tokens: a verify step's query ends with them in lookahead slots, nothing is hashed
//!   for them, and acceptance keeps a prefix of them and releases exactly the blocks that held
//!   only rejected ones (the twin gets `allocate_slots_with_drafts`).
//!
//! At the end every sequence is freed: the pool must be whole (invariant 7) and a prefix-cache
//! reset must succeed and leave no hash (invariant 8).

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv_core::{
    BlockHash, BlockId, CacheConfig, CacheStats, Error, ExtraKey, HashAlgo, KvCacheManager, MmItem,
    SeqId, SeqStatus, SequenceSpec, StepDrafts, StepOptions, StepRequest,
};
use std::collections::HashSet;

/// Sequence ids are taken modulo this, so collisions, unknown ids and duplicates are common.
const ID_SPACE: u8 = 8;
/// Bound on operations per input (keeps every execution short).
const MAX_OPS: usize = 96;

#[derive(Arbitrary, Debug)]
struct Cfg {
    num_blocks: u8,
    block_size: u8,
    caching: bool,
    xxh3: bool,
    cpu_blocks: u8,
    seed: u8,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Add {
        seq: u8,
        family: u8,
        len: u8,
        salt: Option<u8>,
        mm: Option<(u8, u8, u8)>,
    },
    Append {
        seq: u8,
        tokens: Vec<u8>,
    },
    Allocate {
        seq: u8,
        num_new: u8,
    },
    Step {
        entries: Vec<(u8, u8, Vec<u8>, Vec<u8>)>,
        with_appends: bool,
        with_drafts: bool,
    },
    Accept {
        seq: u8,
        num_accepted: u8,
        keep_blocks: bool,
    },
    Fork {
        parent: u8,
        child: u8,
    },
    Free {
        seq: u8,
    },
    Preempt {
        seqs: Vec<u8>,
    },
    SwapOut {
        seqs: Vec<u8>,
    },
    SwapIn {
        seqs: Vec<u8>,
    },
    Reset,
    Lookup {
        seq: u8,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    cfg: Cfg,
    ops: Vec<Op>,
}

/// Everything observable about one sequence.
#[derive(Debug, Clone, PartialEq)]
struct SeqSnap {
    blocks: Vec<BlockId>,
    tokens: Vec<u32>,
    computed: usize,
    drafts: usize,
    status: SeqStatus,
}

/// Everything observable about a manager (ids `0..ID_SPACE` cover every sequence).
#[derive(Debug, Clone, PartialEq)]
struct Snap {
    refs: Vec<u32>,
    hashes: Vec<Option<BlockHash>>,
    free_queue: Vec<BlockId>,
    seqs: Vec<Option<SeqSnap>>,
    num_sequences: usize,
    stats: CacheStats,
}

/// The sequence's block table (its one group's).
fn table(m: &KvCacheManager, id: SeqId) -> Result<Vec<BlockId>, Error> {
    Ok(m.block_tables(id)?.swap_remove(0))
}

/// Blocks the allocation takes from the free pool (one full-attention group releases none).
fn needed(m: &KvCacheManager, id: SeqId, num_new: usize) -> Result<usize, Error> {
    let d = m.num_blocks_needed(id, num_new)?;
    assert_eq!(d.release, 0, "a full-attention group releases nothing");
    Ok(d.take)
}

fn seq_snap(m: &KvCacheManager, id: SeqId) -> Option<SeqSnap> {
    Some(SeqSnap {
        blocks: table(m, id).ok()?,
        tokens: m.tokens(id).ok()?,
        computed: m.num_computed_tokens(id).ok()?,
        drafts: m.num_draft_tokens(id).ok()?,
        status: m.status(id).ok()?,
    })
}

fn snap(m: &KvCacheManager) -> Snap {
    let p = m.pool();
    let n = p.num_blocks();
    Snap {
        refs: (0..n).map(|b| p.ref_count(b)).collect(),
        hashes: (0..n).map(|b| p.block_hash(b)).collect(),
        free_queue: p.free_queue(),
        seqs: (0..u64::from(ID_SPACE)).map(|id| seq_snap(m, id)).collect(),
        num_sequences: m.num_sequences(),
        stats: m.stats(),
    }
}

fn id(x: u8) -> SeqId {
    SeqId::from(x % ID_SPACE)
}

fn toks(v: &[u8]) -> Vec<u32> {
    // A small alphabet: different sequences often append identical tokens, so full blocks
    // produced by decoding also collide in the prefix cache.
    v.iter().take(24).map(|&t| u32::from(t % 4)).collect()
}

fn group(v: &[u8]) -> Vec<SeqId> {
    v.iter().take(4).map(|&x| id(x)).collect()
}

/// Expected validation outcome of a group call (preempt / swap): known, distinct, status ok.
fn group_valid(before: &Snap, ids: &[SeqId], ok: impl Fn(SeqStatus) -> bool) -> bool {
    let mut seen = HashSet::new();
    ids.iter().all(|&i| {
        seen.insert(i)
            && before.seqs[i as usize]
                .as_ref()
                .is_some_and(|s| ok(s.status))
    })
}

/// Runs `f` on both managers; the results must agree, and on error nothing may change.
fn both<T: PartialEq + std::fmt::Debug>(
    m: &KvCacheManager,
    twin: &KvCacheManager,
    before: &Snap,
    f: impl Fn(&KvCacheManager) -> Result<T, Error>,
) -> Result<T, Error> {
    let a = f(m);
    let b = f(twin);
    assert_eq!(a, b, "manager and twin disagree");
    if a.is_err() {
        assert_eq!(&snap(m), before, "failed call {a:?} changed the state");
        assert!(m.take_events().is_empty(), "failed call emitted events");
        assert!(twin.take_events().is_empty());
    }
    a
}

fn spec_for(salt: Option<u8>, mm: Option<(u8, u8, u8)>) -> SequenceSpec {
    let mut spec = SequenceSpec::default();
    if let Some(s) = salt {
        spec.extra_keys
            .push(ExtraKey::CacheSalt(format!("tenant-{}", s % 2)));
    }
    if let Some((h, start, len)) = mm {
        spec.mm_items.push(MmItem {
            item_hash: vec![h % 3],
            start: u64::from(start % 32),
            len: u64::from(len % 9),
        });
    }
    spec
}

/// One `allocate_slots` on both managers with the prediction, lookup and all-or-nothing
/// checks. Returns the allocation when it succeeded.
fn allocate_checked(
    m: &KvCacheManager,
    twin: &KvCacheManager,
    seq: SeqId,
    num_new: usize,
) -> Option<pagedkv_core::SlotAllocation> {
    let before = snap(m);
    let predicted = needed(m, seq, num_new);
    assert_eq!(predicted, needed(twin, seq, num_new));
    assert_eq!(snap(m), before, "num_blocks_needed had side effects");
    let s = before.seqs[seq as usize].clone();
    let first = s
        .as_ref()
        .is_some_and(|s| s.blocks.is_empty() && s.computed == 0 && s.status != SeqStatus::Swapped);
    let looked_up = if first {
        m.lookup_prefix(seq).ok()
    } else {
        None
    };
    let free_before = m.pool().num_free();
    let result = both(m, twin, &before, |x| x.allocate_slots(seq, num_new));
    match (predicted, result) {
        (Ok(p), Ok(a)) => {
            let s = s.expect("allocated an unknown sequence");
            let after = snap(m);
            assert_eq!(free_before - m.pool().num_free(), p, "predicted != taken");
            assert_eq!(a.groups.len(), 1);
            let g = &a.groups[0];
            assert!(g.copies.len() <= 1 && g.released.is_empty());
            let context = if first {
                a.num_cached_tokens
            } else {
                s.computed
            };
            assert_eq!(a.num_context_tokens, context);
            if let Some(l) = looked_up {
                assert_eq!(a.num_cached_tokens, l, "lookup_prefix != cached tokens");
            } else {
                assert_eq!(a.num_cached_tokens, 0);
            }
            assert_eq!(
                a.num_scheduled_tokens,
                num_new.min(s.tokens.len() - context)
            );
            let bs = m.config().groups[0].block_size as usize;
            let ns = after.seqs[seq as usize].as_ref().unwrap();
            assert_eq!(ns.computed, context + a.num_scheduled_tokens);
            assert!(ns.blocks.len() >= ns.computed.div_ceil(bs));
            // Blocks taken = new blocks + prefix hits on blocks that were free.
            let hits_free = ns
                .blocks
                .iter()
                .filter(|b| !s.blocks.contains(b) && !g.new_block_ids.contains(b))
                .filter(|&&b| before.refs[b as usize] == 0)
                .count();
            assert_eq!(g.new_block_ids.len() + hits_free, p);
            for &b in &g.new_block_ids {
                assert_eq!(before.refs[b as usize], 0, "new block {b} was in use");
                assert_eq!(after.refs[b as usize], 1, "new block {b} not private");
                assert_eq!(after.hashes[b as usize].is_some(), {
                    let k = ns.blocks.iter().position(|&x| x == b).unwrap();
                    m.config().enable_prefix_caching && (k + 1) * bs <= ns.computed
                });
            }
            for &(src, dst) in &g.copies {
                // Only a partially filled shared block is copied: the one the next token goes
                // into (the last one, unless spare lookahead blocks follow it).
                assert!(before.refs[src as usize] > 1, "copied an unshared block");
                assert_eq!(s.blocks.get(context / bs), Some(&src));
                assert_ne!(context % bs, 0, "copied a full block");
                assert_eq!(ns.blocks[context / bs], dst);
            }
            Some(a)
        }
        (
            Ok(p),
            Err(Error::OutOfBlocks {
                requested,
                available,
            }),
        ) => {
            assert_eq!((requested, available), (p, free_before));
            assert!(p > free_before, "failed although {p} <= {free_before} free");
            None
        }
        (Err(e1), Err(e2)) => {
            assert_eq!(e1, e2);
            match e1 {
                Error::UnknownSequence { .. } => assert!(s.is_none()),
                Error::InvalidSequenceState { .. } => {
                    let s = s.unwrap();
                    assert!(s.status == SeqStatus::Swapped || s.drafts > 0)
                }
                Error::InvalidArgument { .. } => {
                    let s = s.unwrap();
                    assert!(num_new == 0 || (!first && s.computed == s.tokens.len()));
                }
                other => panic!("unexpected error {other}"),
            }
            None
        }
        (p, r) => panic!("prediction {p:?} vs result {r:?}"),
    }
}

fn check_all(m: &KvCacheManager, twin: &KvCacheManager) {
    if let Err(e) = m.check_invariants() {
        panic!("invariant violated: {e}");
    }
    if let Err(e) = twin.check_invariants() {
        panic!("twin invariant violated: {e}");
    }
    assert_eq!(snap(m), snap(twin), "manager and twin diverged");
    assert_eq!(m.take_events(), twin.take_events(), "events diverged");
}

fn run(input: Input) {
    let c = &input.cfg;
    let mut cfg = CacheConfig::new(
        2 + u32::from(c.num_blocks % 23),
        1 + u32::from(c.block_size % 8),
    );
    cfg.enable_prefix_caching = c.caching || c.num_blocks & 0x80 != 0;
    cfg.hash_algo = if c.xxh3 {
        HashAlgo::Xxh3_128
    } else {
        HashAlgo::Sha256
    };
    cfg.hash_seed = vec![c.seed % 2];
    cfg.num_cpu_blocks = u32::from(c.cpu_blocks % 10);
    cfg.enable_events = true;
    let m = KvCacheManager::new(cfg.clone()).expect("valid config");
    let twin = KvCacheManager::new(cfg.clone()).expect("valid config");
    let bs = cfg.groups[0].block_size as usize;

    for op in input.ops.into_iter().take(MAX_OPS) {
        let before = snap(&m);
        match op {
            Op::Add {
                seq,
                family,
                len,
                salt,
                mm,
            } => {
                let seq = id(seq);
                // Prompts of one family share prefixes, so prefix hits happen.
                let prompt: Vec<u32> = (0..u32::from(len % 40))
                    .map(|i| u32::from(family % 3) * 1000 + i)
                    .collect();
                let spec = spec_for(salt, mm);
                let bad_mm = spec.mm_items.iter().any(|i| i.len == 0);
                let r = both(&m, &twin, &before, |x| {
                    x.add_sequence(seq, prompt.clone(), spec.clone())
                });
                let known = before.seqs[seq as usize].is_some();
                match r {
                    Ok(()) => assert!(!known && !prompt.is_empty() && !bad_mm),
                    Err(Error::SequenceExists { seq_id }) => assert!(known && seq_id == seq),
                    Err(Error::InvalidArgument { .. }) => assert!(prompt.is_empty() || bad_mm),
                    Err(e) => panic!("add_sequence: unexpected {e}"),
                }
            }
            Op::Append { seq, tokens } => {
                let seq = id(seq);
                let t = toks(&tokens);
                let r = both(&m, &twin, &before, |x| x.append_tokens(seq, &t));
                let s = before.seqs[seq as usize].as_ref();
                assert_eq!(r.is_ok(), s.is_some_and(|s| s.drafts == 0), "{r:?}");
                if r.is_ok() {
                    let mut want = before.seqs[seq as usize].clone().unwrap().tokens;
                    want.extend(&t);
                    assert_eq!(m.tokens(seq).unwrap(), want);
                }
            }
            Op::Allocate { seq, num_new } => {
                allocate_checked(&m, &twin, id(seq), usize::from(num_new % 48));
            }
            Op::Accept {
                seq,
                num_accepted,
                keep_blocks,
            } => {
                let seq = id(seq);
                let n = usize::from(num_accepted % 10);
                let r = both(&m, &twin, &before, |x| {
                    let per_group = if keep_blocks {
                        x.accept_drafts_keeping_blocks(seq, n)
                    } else {
                        x.accept_drafts(seq, n)
                    };
                    per_group.map(|mut v| {
                        assert_eq!(v.len(), 1, "one group");
                        v.swap_remove(0)
                    })
                });
                let s = before.seqs[seq as usize].clone();
                match r {
                    Ok(released) => {
                        let s = s.unwrap();
                        assert!(n <= s.drafts);
                        let ns = seq_snap(&m, seq).unwrap();
                        assert_eq!(ns.computed, s.computed + n);
                        assert_eq!(ns.tokens.len(), s.tokens.len() + n);
                        assert_eq!(ns.tokens[..s.tokens.len()], s.tokens[..]);
                        assert_eq!(ns.drafts, 0);
                        if keep_blocks {
                            assert!(released.is_empty());
                            assert_eq!(ns.blocks, s.blocks, "kept blocks stay in the table");
                        } else {
                            assert_eq!(ns.blocks.len(), ns.computed.div_ceil(bs));
                        }
                        assert_eq!(ns.blocks[..], s.blocks[..ns.blocks.len()]);
                        let mut gone: Vec<BlockId> = s.blocks[ns.blocks.len()..].to_vec();
                        gone.reverse();
                        assert_eq!(released, gone, "released = the tail, tail first");
                        for &b in &released {
                            assert_eq!(m.pool().ref_count(b), 0);
                            assert_eq!(m.pool().block_hash(b), None, "a draft block was hashed");
                        }
                    }
                    Err(Error::UnknownSequence { .. }) => assert!(s.is_none()),
                    Err(Error::InvalidSequenceState { .. }) => assert_eq!(s.unwrap().drafts, 0),
                    Err(Error::InvalidArgument { .. }) => {
                        let s = s.unwrap();
                        assert!(s.drafts > 0 && n > s.drafts);
                    }
                    Err(e) => panic!("accept_drafts: unexpected {e}"),
                }
            }
            Op::Step {
                entries,
                with_appends,
                with_drafts,
            } => {
                let entries: Vec<(SeqId, u32, Vec<u32>, Vec<u32>)> = entries
                    .iter()
                    .take(4)
                    .map(|(s, n, t, d)| {
                        let d = if with_drafts { toks(d) } else { Vec::new() };
                        (
                            id(*s),
                            u32::from(n % 20),
                            toks(t),
                            d.into_iter().take(9).collect(),
                        )
                    })
                    .collect();
                let mut req = StepRequest {
                    seq_ids: entries.iter().map(|e| e.0).collect(),
                    num_new_tokens: entries.iter().map(|e| e.1).collect(),
                    ..Default::default()
                };
                if with_appends {
                    req.append_indptr.push(0);
                    for e in &entries {
                        req.append_tokens.extend(&e.2);
                        req.append_indptr.push(req.append_tokens.len() as u32);
                    }
                }
                let mut drafts = StepDrafts::default();
                if with_drafts {
                    drafts.indptr.push(0);
                    for e in &entries {
                        drafts.tokens.extend(&e.3);
                        drafts.indptr.push(drafts.tokens.len() as u32);
                    }
                }
                let out = m.step_with(&req, &drafts, StepOptions::default());
                assert_eq!(out.num_groups, 1);
                // The twin does the same work one sequence at a time.
                let mut qsl = 0i32;
                assert_eq!(out.query_start_loc.len(), out.num_scheduled + 1);
                assert_eq!(
                    out.block_table.len(),
                    out.num_scheduled * out.block_table_width
                );
                assert_eq!(out.new_block_indptr.len(), out.num_scheduled + 1);
                assert_eq!(out.num_cached_tokens.len(), out.num_scheduled);
                let mut copy_k = 0;
                for (k, (seq, n, t, d)) in entries.iter().enumerate().take(out.num_scheduled) {
                    if with_appends {
                        twin.append_tokens(*seq, t).expect("scheduled seq is known");
                    }
                    let a = twin
                        .allocate_slots_with_drafts(*seq, *n as usize, d)
                        .unwrap_or_else(|e| {
                            panic!("step scheduled seq {seq} but twin failed: {e}")
                        });
                    assert_eq!(a.num_draft_tokens, d.len());
                    if with_drafts {
                        assert_eq!(out.num_draft_tokens[k] as usize, d.len());
                    }
                    // The query ends with the drafts, in lookahead slots after the scheduled ones.
                    let q_end = out.query_start_loc[k] as usize
                        + a.num_scheduled_tokens
                        + a.num_draft_tokens;
                    let want_drafts: Vec<i64> = d.iter().map(|&x| i64::from(x)).collect();
                    assert_eq!(out.input_ids[q_end - d.len()..q_end], want_drafts[..]);
                    let ts = seq_snap(&twin, *seq).unwrap();
                    assert_eq!(ts.drafts, d.len());
                    assert_eq!(ts.computed, a.num_context_tokens + a.num_scheduled_tokens);
                    // Spare blocks kept by an earlier acceptance may remain past the slots.
                    assert!(ts.blocks.len() >= (ts.computed + d.len()).div_ceil(bs));
                    for &b in &ts.blocks[ts.computed.div_ceil(bs)..] {
                        assert_eq!(twin.pool().block_hash(b), None, "lookahead block hashed");
                    }
                    assert_eq!(out.num_cached_tokens[k] as usize, a.num_cached_tokens);
                    assert_eq!(out.context_lens[k] as usize, a.num_context_tokens);
                    assert_eq!(
                        out.seq_lens[k] as usize,
                        a.num_context_tokens + a.num_scheduled_tokens + a.num_draft_tokens
                    );
                    assert_eq!(out.query_start_loc[k], qsl);
                    qsl += (a.num_scheduled_tokens + a.num_draft_tokens) as i32;
                    assert_eq!(out.query_start_loc[k + 1], qsl);
                    let (lo, hi) = (
                        out.new_block_indptr[k] as usize,
                        out.new_block_indptr[k + 1] as usize,
                    );
                    let new: Vec<BlockId> = out.new_block_ids[lo..hi]
                        .iter()
                        .map(|&b| b as BlockId)
                        .collect();
                    assert_eq!(new, a.groups[0].new_block_ids);
                    for &(src, dst) in &a.groups[0].copies {
                        assert_eq!(
                            out.copies[3 * copy_k..3 * copy_k + 3],
                            [0, src as i32, dst as i32]
                        );
                        copy_k += 1;
                    }
                    let table = table(&twin, *seq).unwrap();
                    let row = out.block_table_row(0, k);
                    let got: Vec<BlockId> =
                        row[..table.len()].iter().map(|&b| b as BlockId).collect();
                    assert_eq!(got, table);
                    assert!(row[table.len()..].iter().all(|&b| b == 0), "padding");
                    for (j, pos) in (a.num_context_tokens
                        ..a.num_context_tokens + a.num_scheduled_tokens + a.num_draft_tokens)
                        .enumerate()
                    {
                        let slot = out.slot_mapping[out.query_start_loc[k] as usize + j];
                        assert_eq!(
                            slot,
                            i64::from(table[pos / bs]) * bs as i64 + (pos % bs) as i64
                        );
                    }
                }
                assert_eq!(3 * copy_k, out.copies.len());
                assert_eq!(out.slot_mapping.len() as i32, qsl);
                match &out.error {
                    None => assert_eq!(out.num_scheduled, entries.len()),
                    Some(e) => {
                        assert!(out.num_scheduled < entries.len());
                        let (seq, n, t, _) = &entries[out.num_scheduled];
                        let s = seq_snap(&m, *seq);
                        match e {
                            Error::UnknownSequence { seq_id } => {
                                assert_eq!(seq_id, seq);
                                assert!(s.is_none());
                            }
                            Error::OutOfBlocks {
                                requested,
                                available,
                            } => {
                                assert_eq!(*available, m.pool().num_free());
                                assert!(requested > available);
                                if (!with_appends || t.is_empty()) && !with_drafts {
                                    // Unchanged sequence: the prediction names the same need.
                                    assert_eq!(
                                        needed(&m, *seq, *n as usize).as_ref(),
                                        Ok(requested)
                                    );
                                }
                            }
                            Error::InvalidSequenceState { .. } => {
                                let s = s.unwrap();
                                assert!(s.status == SeqStatus::Swapped || s.drafts > 0)
                            }
                            Error::InvalidArgument { .. } => {}
                            other => panic!("step: unexpected error {other}"),
                        }
                    }
                }
            }
            Op::Fork { parent, child } => {
                let (p, ch) = (id(parent), id(child));
                let r = both(&m, &twin, &before, |x| x.fork(p, ch));
                let ps = before.seqs[p as usize].as_ref();
                let expect_ok = ps.is_some_and(|s| s.status != SeqStatus::Swapped && s.drafts == 0)
                    && before.seqs[ch as usize].is_none();
                assert_eq!(r.is_ok(), expect_ok, "fork({p}, {ch}) -> {r:?}");
                if r.is_ok() {
                    assert_eq!(m.pool().num_free(), before.stats.free, "fork allocated");
                    assert_eq!(seq_snap(&m, ch), ps.cloned());
                }
            }
            Op::Free { seq } => {
                let seq = id(seq);
                let a = m.free(seq);
                assert_eq!(a, twin.free(seq));
                assert_eq!(a, before.seqs[seq as usize].is_some());
                let after = snap(&m);
                assert!(!m.free(seq), "second free must be a no-op");
                assert!(!twin.free(seq));
                assert_eq!(snap(&m), after);
            }
            Op::Preempt { seqs } => {
                let ids = group(&seqs);
                let r = both(&m, &twin, &before, |x| x.preempt_recompute(&ids));
                assert_eq!(
                    r.is_ok(),
                    group_valid(&before, &ids, |s| s != SeqStatus::Swapped)
                );
                if r.is_ok() {
                    for &i in &ids {
                        let s = seq_snap(&m, i).unwrap();
                        assert!(s.blocks.is_empty() && s.computed == 0 && s.drafts == 0);
                        assert_eq!(s.status, SeqStatus::Preempted);
                        assert_eq!(s.tokens, before.seqs[i as usize].as_ref().unwrap().tokens);
                    }
                }
            }
            Op::SwapOut { seqs } => {
                let ids = group(&seqs);
                let r = both(&m, &twin, &before, |x| x.swap_out(&ids));
                let valid = group_valid(&before, &ids, |s| s == SeqStatus::Running)
                    && ids
                        .iter()
                        .all(|&i| before.seqs[i as usize].as_ref().unwrap().drafts == 0);
                let distinct: Vec<BlockId> = {
                    let mut seen = HashSet::new();
                    let mut v = Vec::new();
                    for &i in ids.iter().filter(|_| valid) {
                        for &b in &before.seqs[i as usize].as_ref().unwrap().blocks {
                            if seen.insert(b) {
                                v.push(b);
                            }
                        }
                    }
                    v
                };
                let cpu_free = before.stats.num_cpu_blocks as usize - before.stats.cpu_used;
                match r {
                    Ok(plan) => {
                        assert!(valid && distinct.len() <= cpu_free);
                        let gpu: Vec<BlockId> = plan.iter().map(|p| p.0).collect();
                        assert_eq!(gpu, distinct);
                        let cpu: HashSet<BlockId> = plan.iter().map(|p| p.1).collect();
                        assert_eq!(cpu.len(), plan.len(), "CPU block planned twice");
                    }
                    Err(Error::OutOfSwapSpace {
                        requested,
                        available,
                    }) => {
                        assert!(valid);
                        assert_eq!((requested, available), (distinct.len(), cpu_free));
                        assert!(requested > available);
                    }
                    Err(_) => assert!(!valid),
                }
            }
            Op::SwapIn { seqs } => {
                let ids = group(&seqs);
                let r = both(&m, &twin, &before, |x| x.swap_in(&ids));
                let valid = group_valid(&before, &ids, |s| s == SeqStatus::Swapped);
                let distinct: HashSet<BlockId> = ids
                    .iter()
                    .filter(|_| valid)
                    .flat_map(|&i| before.seqs[i as usize].as_ref().unwrap().blocks.clone())
                    .collect();
                match r {
                    Ok(plan) => {
                        assert!(valid);
                        assert_eq!(plan.len(), distinct.len());
                        assert_eq!(before.stats.free - m.pool().num_free(), plan.len());
                        for &i in &ids {
                            let s = seq_snap(&m, i).unwrap();
                            let old = before.seqs[i as usize].as_ref().unwrap();
                            assert_eq!(s.status, SeqStatus::Running);
                            assert_eq!(s.computed, old.computed);
                            // Table entries map through the plan, keeping the sharing.
                            for (&c, &g) in old.blocks.iter().zip(&s.blocks) {
                                assert!(plan.contains(&(c, g)));
                            }
                        }
                    }
                    Err(Error::OutOfBlocks {
                        requested,
                        available,
                    }) => {
                        assert!(valid);
                        assert_eq!((requested, available), (distinct.len(), before.stats.free));
                        assert!(requested > available);
                    }
                    Err(_) => assert!(!valid),
                }
            }
            Op::Reset => {
                let r = both(&m, &twin, &before, |x| x.reset_prefix_cache());
                match r {
                    Ok(()) => {
                        assert_eq!(before.stats.used, 0);
                        assert!(snap(&m).hashes.iter().all(Option::is_none));
                    }
                    Err(e) => assert_eq!(
                        e,
                        Error::CacheInUse {
                            blocks_in_use: before.stats.used
                        }
                    ),
                }
            }
            Op::Lookup { seq } => {
                let seq = id(seq);
                let r = both(&m, &twin, &before, |x| x.lookup_prefix(seq));
                assert_eq!(snap(&m), before, "lookup had side effects");
                match r {
                    Ok(n) => {
                        let s = before.seqs[seq as usize].as_ref().unwrap();
                        assert_eq!(n % bs, 0);
                        assert!(n < s.tokens.len(), "last token must be recomputed");
                        if !cfg.enable_prefix_caching {
                            assert_eq!(n, 0);
                        }
                    }
                    Err(e) => assert_eq!(e, Error::UnknownSequence { seq_id: seq }),
                }
            }
        }
        check_all(&m, &twin);
    }

    // Invariant 7: free everything, the pool is whole again.
    for i in 0..u64::from(ID_SPACE) {
        m.free(i);
        twin.free(i);
    }
    check_all(&m, &twin);
    let p = m.pool();
    assert_eq!(p.num_free(), p.num_usable());
    assert!((0..p.num_blocks()).all(|b| p.ref_count(b) == 0));
    assert_eq!(m.num_sequences(), 0);
    assert_eq!(m.stats().cpu_used, 0);
    // Invariant 8: reset succeeds when nothing is in use and leaves no hash.
    m.reset_prefix_cache().expect("nothing in use");
    assert!((0..p.num_blocks()).all(|b| p.block_hash(b).is_none()));
    m.check_invariants().expect("after reset");
}

fuzz_target!(|input: Input| run(input));
