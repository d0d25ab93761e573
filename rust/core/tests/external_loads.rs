//! KV loaded by a connector (`KvCacheManager::allocate_external` and what follows it): staged
//! blocks stay out of the prefix cache, the events and the host tier until
//! `commit_external`; a synchronous load is an ordinary allocation; every refused call leaves
//! the state unchanged. Each test runs over one full-attention group and over a full +
//! sliding-window layout.

use pagedkv_core::events::KvEvent;
use pagedkv_core::manager::GroupEvent;
use pagedkv_core::{
    BlockId, CacheConfig, Error, GroupSpec, KvCacheManager, SeqId, SeqStatus, SequenceSpec,
    StepRequest, NULL_BLOCK,
};

const BS: u32 = 4;
const WINDOW: u32 = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// One full-attention group.
    One,
    /// Full attention + a sliding window of 8 tokens, both of block size 4.
    Hybrid,
}

const LAYOUTS: [Layout; 2] = [Layout::One, Layout::Hybrid];

fn config(layout: Layout, num_blocks: u32) -> CacheConfig {
    let mut c = match layout {
        Layout::One => CacheConfig::new(num_blocks, BS),
        Layout::Hybrid => CacheConfig::with_groups(
            num_blocks,
            vec![
                GroupSpec::full(BS, 8),
                GroupSpec::sliding_window(BS, 8, WINDOW),
            ],
            vec![0, 1],
        ),
    };
    c.enable_events = true;
    c
}

fn manager(layout: Layout, num_blocks: u32) -> KvCacheManager {
    KvCacheManager::new(config(layout, num_blocks)).unwrap()
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt * 1000 + 1).collect()
}

fn add(m: &KvCacheManager, seq: SeqId, prompt: Vec<u32>) {
    m.add_sequence(seq, prompt, SequenceSpec::default())
        .unwrap();
}

fn ok(m: &KvCacheManager) {
    m.check_invariants().unwrap();
}

/// A sequence's id, status, tokens, computed tokens and block tables.
type SeqView = (SeqId, SeqStatus, usize, usize, Vec<Vec<BlockId>>);

/// Everything a refused call must leave as it was.
#[derive(Debug, PartialEq)]
struct Snapshot {
    seqs: Vec<SeqView>,
    free: usize,
    cached_free: usize,
    refs: Vec<u32>,
    hashes: Vec<bool>,
}

fn snapshot(m: &KvCacheManager, seqs: &[SeqId]) -> Snapshot {
    let pool = m.pool();
    Snapshot {
        seqs: seqs
            .iter()
            .filter(|&&s| m.status(s).is_ok())
            .map(|&s| {
                (
                    s,
                    m.status(s).unwrap(),
                    m.num_tokens(s).unwrap(),
                    m.num_computed_tokens(s).unwrap(),
                    m.block_tables(s).unwrap(),
                )
            })
            .collect(),
        free: pool.num_free(),
        cached_free: pool.num_cached_free(),
        refs: (0..pool.num_blocks()).map(|b| pool.ref_count(b)).collect(),
        hashes: (0..pool.num_blocks()).map(|b| pool.is_hashed(b)).collect(),
    }
}

fn stored(events: &[GroupEvent]) -> usize {
    events
        .iter()
        .map(|e| match &e.event {
            KvEvent::BlockStored { block_hashes, .. } => block_hashes.len(),
            _ => 0,
        })
        .sum()
}

fn is_state_error(r: Result<impl std::fmt::Debug, Error>, op: &str) {
    match r {
        Err(Error::InvalidSequenceState { operation, .. }) => assert_eq!(operation, op),
        other => panic!("{op}: expected InvalidSequenceState, got {other:?}"),
    }
}

/// Blocks group `g` registers for `n` computed tokens of a prompt computed from token 0 on,
/// as the layouts here cache them (the window group only from the window of `n` on).
fn registered(layout: Layout, ctx_window: usize, n: usize) -> usize {
    let full = n / BS as usize;
    match layout {
        Layout::One => full,
        Layout::Hybrid => {
            let from = (ctx_window + 1).saturating_sub(WINDOW as usize) / BS as usize;
            full + full.saturating_sub(from)
        }
    }
}

#[test]
fn staged_blocks_are_not_matched_registered_or_announced_until_commit() {
    for layout in LAYOUTS {
        let m = manager(layout, 64);
        add(&m, 1, toks(24, 1));
        add(&m, 2, toks(24, 1));
        let a = m.allocate_external(1, 20, 0, true, 0).unwrap();
        assert_eq!(
            (
                a.num_cached_tokens,
                a.num_context_tokens,
                a.num_scheduled_tokens
            ),
            (0, 20, 0),
            "{layout:?}"
        );
        assert_eq!(m.status(1).unwrap(), SeqStatus::Loading);
        assert_eq!(m.num_staged_tokens(1).unwrap(), 20);
        assert_eq!(m.num_computed_tokens(1).unwrap(), 20);
        let tables = m.block_tables(1).unwrap();
        assert_eq!(tables[0].len(), 5);
        if layout == Layout::Hybrid {
            // Only the window of token 20 (tokens 13..20: blocks 3 and 4) is taken.
            assert_eq!(&tables[1][..3], &[NULL_BLOCK; 3]);
            assert!(tables[1][3..].iter().all(|&b| b != NULL_BLOCK));
        }
        let held: usize = m.num_blocks_held(1).unwrap().iter().sum();
        assert_eq!(m.pool().num_used(), held);
        for t in &tables {
            for &b in t.iter().filter(|&&b| b != NULL_BLOCK) {
                assert!(!m.pool().is_hashed(b), "staged block {b} registered");
            }
        }
        assert_eq!(
            stored(&m.take_events()),
            0,
            "{layout:?}: staged blocks announced"
        );
        assert_eq!(
            m.lookup_prefix(2).unwrap(),
            0,
            "{layout:?}: staged blocks matched"
        );
        ok(&m);

        let n = m.commit_external(1, 20).unwrap();
        assert_eq!(n, registered(layout, 20, 20), "{layout:?}");
        assert_eq!(m.status(1).unwrap(), SeqStatus::Running);
        assert_eq!(m.num_staged_tokens(1).unwrap(), 0);
        assert_eq!(stored(&m.take_events()), n, "{layout:?}");
        assert_eq!(m.lookup_prefix(2).unwrap(), 20, "{layout:?}");
        ok(&m);
        // The sequence goes on as any running one: its last 4 tokens computed.
        let a = m.allocate_slots(1, 4).unwrap();
        assert_eq!((a.num_context_tokens, a.num_scheduled_tokens), (20, 4));
        ok(&m);
    }
}

#[test]
fn external_tokens_follow_the_local_hit() {
    for layout in LAYOUTS {
        let m = manager(layout, 64);
        add(&m, 1, toks(12, 1));
        m.allocate_slots(1, 12).unwrap();
        let mut p = toks(12, 1);
        p.extend(toks(16, 2));
        add(&m, 2, p);
        let hit = m.lookup_prefix(2).unwrap();
        assert_eq!(hit, 12);
        let a = m.allocate_external(2, 12, 0, true, 0).unwrap();
        assert_eq!((a.num_cached_tokens, a.num_context_tokens), (12, 24));
        assert_eq!(m.num_staged_tokens(2).unwrap(), 12);
        let mine = m.block_tables(2).unwrap();
        let theirs = m.block_tables(1).unwrap();
        // The hit blocks are shared (group 0: all three), the staged ones private.
        assert_eq!(&mine[0][..3], &theirs[0][..3]);
        for &b in &mine[0][3..] {
            assert_eq!(m.pool().ref_count(b), 1);
            assert!(!m.pool().is_hashed(b));
        }
        ok(&m);
        let n = m.commit_external(2, 24).unwrap();
        // Blocks 3..6 of the full group; the window group's blocks 4 and 5 (the window of
        // token 24 starts in block 4: its hit blocks 1 and 2 are not taken).
        assert_eq!(n, if layout == Layout::One { 3 } else { 5 }, "{layout:?}");
        ok(&m);
    }
}

#[test]
fn a_synchronous_load_is_an_ordinary_allocation() {
    for layout in LAYOUTS {
        let (a, b) = (manager(layout, 64), manager(layout, 64));
        for m in [&a, &b] {
            add(m, 1, toks(8, 1));
            m.allocate_slots(1, 8).unwrap();
            let mut p = toks(8, 1);
            p.extend(toks(22, 3));
            add(m, 2, p);
        }
        let x = a.allocate_external(2, 17, 3, false, 0).unwrap();
        let y = b.allocate_slots(2, 20).unwrap();
        assert_eq!(x.num_cached_tokens, 8);
        assert_eq!((x.num_context_tokens, x.num_scheduled_tokens), (25, 3));
        assert_eq!((y.num_context_tokens, y.num_scheduled_tokens), (8, 20));
        assert_eq!(a.status(2).unwrap(), SeqStatus::Running);
        assert_eq!(a.num_computed_tokens(2).unwrap(), 28);
        let (ea, eb) = (a.take_events(), b.take_events());
        match layout {
            Layout::One => {
                assert_eq!(ea, eb);
                assert_eq!(x.groups, y.groups);
                assert_eq!(a.block_tables(2).unwrap(), b.block_tables(2).unwrap());
            }
            // The window group takes no block out of the window of the loaded context.
            Layout::Hybrid => {
                let of = |e: &[GroupEvent], g| {
                    e.iter()
                        .filter(|e| e.group == Some(g))
                        .cloned()
                        .collect::<Vec<_>>()
                };
                assert_eq!(of(&ea, 0), of(&eb, 0));
                // Window blocks: seq 1's 2, then only 4..7 (the window of token 25 starts
                // at token 18, in block 4).
                assert_eq!(stored(&of(&ea, 1)), 2 + 3);
                assert_eq!(x.groups[0], y.groups[0]);
                let t = a.block_tables(2).unwrap();
                assert_eq!(t[0], b.block_tables(2).unwrap()[0]);
                let first = (25 + 1 - WINDOW as usize) / BS as usize;
                assert!(t[1][..first].iter().all(|&b| b == NULL_BLOCK), "{t:?}");
                assert!(t[1][first..].iter().all(|&b| b != NULL_BLOCK), "{t:?}");
            }
        }
        ok(&a);
        ok(&b);
    }
}

#[test]
fn a_partial_commit_registers_the_full_blocks_below_the_valid_count() {
    for layout in LAYOUTS {
        let m = manager(layout, 64);
        add(&m, 1, toks(24, 1));
        add(&m, 2, toks(24, 1));
        m.allocate_external(1, 20, 0, true, 0).unwrap();
        let before = snapshot(&m, &[1, 2]);
        if layout == Layout::Hybrid {
            // The window at 13 reads tokens 6.. (block 1), never loaded.
            let e = m.commit_external(1, 13).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidArgument {
                        arg: "num_valid_tokens",
                        ..
                    }
                ),
                "{e:?}"
            );
            assert_eq!(snapshot(&m, &[1, 2]), before);
        }
        let valid = if layout == Layout::One { 13 } else { 19 };
        let n = m.commit_external(1, valid).unwrap();
        assert_eq!(n, registered(layout, 19, valid), "{layout:?}");
        assert_eq!(m.num_computed_tokens(1).unwrap(), valid);
        // The window group misses blocks 0..3 (never loaded): no hit at all.
        let hit = if layout == Layout::One { 12 } else { 0 };
        assert_eq!(m.lookup_prefix(2).unwrap(), hit);
        // The rest of the staged blocks are filled first: one fresh block for token 20..24.
        let a = m.allocate_slots(1, 24 - valid).unwrap();
        assert_eq!(a.num_context_tokens, valid);
        assert_eq!(a.groups[0].new_block_ids.len(), 1, "{layout:?}");
        ok(&m);
    }
}

#[test]
fn a_loading_sequence_refuses_every_other_call_unchanged() {
    for layout in LAYOUTS {
        let mut c = config(layout, 64);
        c.num_cpu_blocks = 16;
        let m = KvCacheManager::new(c).unwrap();
        add(&m, 1, toks(24, 1));
        m.allocate_external(1, 16, 0, true, 0).unwrap();
        let before = snapshot(&m, &[1, 9]);
        is_state_error(m.allocate_slots(1, 4), "allocate_slots");
        is_state_error(
            m.allocate_slots_with_drafts(1, 8, &[1, 2]),
            "allocate_slots",
        );
        is_state_error(m.append_tokens(1, &[5]), "append_tokens");
        is_state_error(m.fork(1, 9), "fork");
        is_state_error(m.swap_out(&[1]), "swap_out");
        is_state_error(m.accept_drafts(1, 0), "accept_drafts");
        is_state_error(m.allocate_external(1, 4, 0, true, 0), "allocate_external");
        let out = m.step(&StepRequest {
            seq_ids: vec![1],
            num_new_tokens: vec![4],
            ..Default::default()
        });
        assert_eq!(out.num_scheduled, 0);
        assert!(
            matches!(out.error, Some(Error::InvalidSequenceState { .. })),
            "{:?}",
            out.error
        );
        // Reservations: what its remaining tokens take after the commit.
        let need = if layout == Layout::One { 2 } else { 4 };
        assert_eq!(m.num_blocks_needed(1, 8).unwrap().take, need);
        assert_eq!(m.num_blocks_owed(&[1]).unwrap(), need);
        assert_eq!(snapshot(&m, &[1, 9]), before, "{layout:?}");
        assert_eq!(stored(&m.take_events()), 0);
        ok(&m);
    }
}

#[test]
fn free_and_preempt_release_staged_blocks_unregistered() {
    for layout in LAYOUTS {
        let m = manager(layout, 64);
        add(&m, 1, toks(8, 1));
        m.allocate_slots(1, 8).unwrap();
        let mut p = toks(8, 1);
        p.extend(toks(16, 2));
        add(&m, 2, p.clone());
        add(&m, 3, p.clone());
        add(&m, 4, p);
        m.allocate_external(2, 12, 0, true, 0).unwrap();
        m.allocate_external(3, 12, 0, true, 0).unwrap();
        m.take_events();
        let hashed_before = (1..64).filter(|&b| m.pool().is_hashed(b)).count();
        assert!(m.free(2)); // an abort while the load is in flight
        m.preempt_recompute(&[3]).unwrap(); // a failed load
        assert_eq!(m.status(3).unwrap(), SeqStatus::Preempted);
        assert_eq!(m.num_computed_tokens(3).unwrap(), 0);
        assert_eq!(
            (1..64).filter(|&b| m.pool().is_hashed(b)).count(),
            hashed_before
        );
        assert_eq!(
            m.pool().num_used(),
            m.num_blocks_held(1).unwrap().iter().sum()
        );
        assert!(m.take_events().is_empty());
        assert_eq!(m.lookup_prefix(4).unwrap(), 8);
        ok(&m);
        // A preempted sequence loads again.
        m.allocate_external(3, 12, 0, true, 0).unwrap();
        assert_eq!(m.status(3).unwrap(), SeqStatus::Loading);
        ok(&m);
    }
}

#[test]
fn refused_external_allocations_change_nothing() {
    for layout in LAYOUTS {
        let m = manager(layout, 7);
        add(&m, 1, toks(24, 1));
        add(&m, 2, toks(4, 2));
        m.allocate_slots(2, 4).unwrap();
        let before = snapshot(&m, &[1, 2]);
        let bad_arg = |r: Result<_, Error>, name: &str| match r {
            Err(Error::InvalidArgument { arg, .. }) => assert_eq!(arg, name),
            other => panic!("{name}: {other:?}"),
        };
        bad_arg(
            m.allocate_external(1, 25, 0, true, 0),
            "num_external_tokens",
        );
        bad_arg(m.allocate_external(1, 8, 4, true, 0), "num_new_tokens");
        bad_arg(m.allocate_external(1, 0, 0, true, 0), "num_new_tokens");
        is_state_error(m.allocate_external(2, 1, 0, true, 0), "allocate_external");
        is_state_error(m.commit_external(2, 4), "commit_external");
        assert!(matches!(
            m.allocate_external(7, 4, 0, true, 0),
            Err(Error::UnknownSequence { seq_id: 7 })
        ));
        // 7 blocks, 1 null, 1 held by seq 2 (2 with the window group): not enough for 24.
        let need = m.num_blocks_needed_external(1, 23, 1).unwrap();
        assert!(need.take > m.pool().num_free(), "{need:?}");
        assert!(matches!(
            m.allocate_external(1, 23, 1, false, 0),
            Err(Error::OutOfBlocks { .. })
        ));
        // A reservation refuses what would otherwise fit.
        let need = m.num_blocks_needed_external(1, 8, 0).unwrap();
        assert!(need.take <= m.pool().num_free());
        let reserve = m.pool().num_free() - need.take + 1;
        match m.allocate_external(1, 8, 0, true, reserve) {
            Err(Error::OutOfBlocks {
                requested,
                available,
            }) => assert_eq!(
                (requested, available),
                (need.take + reserve, m.pool().num_free())
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(snapshot(&m, &[1, 2]), before, "{layout:?}");
        m.allocate_external(1, 8, 0, true, reserve - 1).unwrap();
        ok(&m);
    }
}

#[test]
fn the_host_tier_never_sees_staged_blocks() {
    for layout in LAYOUTS {
        for commit in [false, true] {
            let mut c = config(layout, 17);
            c.num_host_blocks = 32;
            c.host_admission_min_seen = 1;
            let m = KvCacheManager::new(c).unwrap();
            add(&m, 1, toks(24, 1));
            m.allocate_external(1, 20, 0, true, 0).unwrap();
            let n = if commit {
                m.commit_external(1, 20).unwrap()
            } else {
                0 // an aborted load: its blocks are reused without a store
            };
            assert!(m.free(1));
            // A step boundary: blocks registered before it hold their KV.
            assert!(m.step(&StepRequest::default()).error.is_none());
            // Every one of the 16 usable blocks: each cached block is evicted (and stored).
            let len = if layout == Layout::One { 64 } else { 32 };
            add(&m, 2, toks(len, 5));
            m.allocate_slots(2, len).unwrap();
            assert_eq!(m.pool().num_free(), 0);
            let t = m.take_host_transfers();
            assert_eq!(t.stores.len(), n, "{layout:?} commit={commit}: {t:?}");
            assert_eq!(n > 0, commit);
            ok(&m);
        }
    }
}

fn hashed(m: &KvCacheManager, b: BlockId) -> bool {
    m.pool().is_hashed(b)
}

fn removed(events: &[GroupEvent]) -> usize {
    events
        .iter()
        .map(|e| match &e.event {
            KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.len(),
            _ => 0,
        })
        .sum()
}

#[test]
fn a_rewind_keeps_blocks_and_recomputes_in_place() {
    for layout in LAYOUTS {
        let m = manager(layout, 64);
        add(&m, 1, toks(24, 1));
        m.allocate_slots(1, 24).unwrap();
        let mut p = toks(24, 1);
        p.extend(toks(4, 2));
        add(&m, 2, p);
        m.allocate_slots(2, 28).unwrap(); // shares the six blocks of seq 1 (group 0)
        let tables = m.block_tables(1).unwrap();
        let before = snapshot(&m, &[2]);
        m.take_events();
        // vLLM's rewind of a full hit's last token; here back into shared block 5.
        assert_eq!(m.rollback(1, 22, false).unwrap(), 0);
        assert_eq!(m.num_computed_tokens(1).unwrap(), 22);
        assert_eq!(m.block_tables(1).unwrap(), tables);
        // (The window group's next allocation releases its blocks out of the window.)
        let tables = &tables[..1];
        assert_eq!(
            snapshot(&m, &[2]),
            before,
            "{layout:?}: a rewind changes no block"
        );
        ok(&m);
        let a = m.allocate_slots(1, 2).unwrap();
        assert_eq!((a.num_context_tokens, a.num_scheduled_tokens), (22, 2));
        assert!(a
            .groups
            .iter()
            .all(|g| g.new_block_ids.is_empty() && g.copies.is_empty()));
        assert_eq!(&m.block_tables(1).unwrap()[..1], tables);
        assert!(m.take_events().is_empty());
        ok(&m);
    }
}

#[test]
fn a_poisoned_rollback_unregisters_own_blocks_and_their_descendants() {
    for layout in LAYOUTS {
        let m = manager(layout, 96);
        let a = toks(24, 1);
        add(&m, 1, a.clone());
        m.allocate_slots(1, 24).unwrap();
        // Seq 2 shares blocks 0..4 of seq 1, then its own 4 and 5 (children of block 3).
        let mut p = a[..16].to_vec();
        p.extend(toks(8, 2));
        add(&m, 2, p);
        m.allocate_slots(2, 24).unwrap();
        // Seq 3 extends all of seq 1; freed: its blocks 6 and 7 are cached free.
        let mut p = a.clone();
        p.extend(toks(8, 3));
        add(&m, 3, p);
        m.allocate_slots(3, 32).unwrap();
        let t3 = m.block_tables(3).unwrap();
        assert!(m.free(3));
        let (t1, t2) = (m.block_tables(1).unwrap(), m.block_tables(2).unwrap());
        assert_eq!(&t2[0][..4], &t1[0][..4]);
        assert!(t3[0][6..8].iter().all(|&b| hashed(&m, b)));
        let cached_free = m.pool().num_cached_free();
        m.take_events();

        // Blocks 2.. of seq 1 are invalid (a load failure found at token 8).
        let n = m.rollback(1, 8, true).unwrap();
        let full = |t: &[Vec<BlockId>], r: std::ops::Range<usize>| t[0][r].to_vec();
        let mut lost = full(&t1, 2..6);
        lost.extend(full(&t2, 4..6));
        lost.extend(full(&t3, 6..8));
        for &b in &lost {
            assert!(!hashed(&m, b), "{layout:?}: block {b} still registered");
        }
        for &b in &t1[0][..2] {
            assert!(hashed(&m, b), "{layout:?}: valid block {b} unregistered");
        }
        // Shared blocks stay held by seq 2; the freed dependents are plain free blocks.
        assert_eq!(m.pool().ref_count(t1[0][2]), 2);
        assert_eq!(m.pool().ref_count(t1[0][3]), 2);
        for &b in &t3[0][6..8] {
            assert_eq!(m.pool().ref_count(b), 0);
        }
        if layout == Layout::One {
            assert_eq!(m.pool().num_cached_free(), cached_free - 2);
            assert_eq!(n, 8);
            assert_eq!(removed(&m.take_events()), 8);
        } else {
            assert!(n > 8, "{n}: the window group's blocks too");
            assert_eq!(removed(&m.take_events()), n);
        }
        assert_eq!(m.block_tables(1).unwrap(), t1, "tables keep every block");
        assert_eq!(m.num_computed_tokens(1).unwrap(), 8);
        ok(&m);

        add(&m, 4, a.clone());
        assert_eq!(m.lookup_prefix(4).unwrap(), 8);
        // Seq 2 holds KV descending from the invalid blocks: none of it is registered again.
        m.append_tokens(2, &toks(4, 4)).unwrap();
        m.allocate_slots(2, 4).unwrap();
        assert!(!hashed(&m, m.block_tables(2).unwrap()[0][6]));
        ok(&m);
        // Seq 1 recomputes into its own blocks and registers them again.
        let r = m.allocate_slots(1, 16).unwrap();
        assert!(r.groups.iter().all(|g| g.new_block_ids.is_empty()));
        assert!(t1[0][2..6].iter().all(|&b| hashed(&m, b)));
        assert!(stored(&m.take_events()) >= 4);
        assert_eq!(m.lookup_prefix(4).unwrap(), 20);
        ok(&m);
        // Rolled back to its first tainted block (or, where its window group released
        // blocks before it, preempted), seq 2 registers again as it recomputes.
        if layout == Layout::One {
            m.rollback(2, 8, false).unwrap();
            m.allocate_slots(2, 20).unwrap();
        } else {
            match m.rollback(2, 8, false) {
                Err(Error::InvalidArgument { arg, .. }) => assert_eq!(arg, "num_computed_tokens"),
                other => panic!("{other:?}"),
            }
            m.preempt_recompute(&[2]).unwrap();
            m.allocate_slots(2, 28).unwrap();
        }
        assert!(m.block_tables(2).unwrap()[0][..7]
            .iter()
            .all(|&b| hashed(&m, b)));
        ok(&m);
    }
}

#[test]
fn evict_blocks_follows_dependents_and_checks_ids() {
    for layout in LAYOUTS {
        let m = manager(layout, 64);
        add(&m, 1, toks(24, 1));
        m.allocate_slots(1, 24).unwrap();
        let t = m.block_tables(1).unwrap();
        assert!(m.free(1));
        let before = snapshot(&m, &[]);
        for bad in [NULL_BLOCK, 64, 1000] {
            match m.evict_blocks(&[t[0][0], bad]) {
                Err(Error::InvalidBlockId { block_id, .. }) => assert_eq!(block_id, bad),
                other => panic!("{other:?}"),
            }
        }
        let unregistered = (1..64).find(|&b| !hashed(&m, b)).unwrap();
        assert_eq!(m.evict_blocks(&[unregistered]).unwrap(), 0);
        assert_eq!(snapshot(&m, &[]), before);
        m.take_events();
        // Block 3 of the full group: 3, 4 and 5 go (one chain); 0..2 stay.
        let n = m.evict_blocks(&[t[0][3]]).unwrap();
        assert_eq!(n, 3, "{layout:?}");
        assert_eq!(removed(&m.take_events()), 3);
        assert!(t[0][..3].iter().all(|&b| hashed(&m, b)));
        assert!(t[0][3..].iter().all(|&b| !hashed(&m, b)));
        add(&m, 2, toks(24, 1));
        assert_eq!(m.lookup_prefix(2).unwrap(), 12);
        ok(&m);
    }
}

#[test]
fn refused_rollbacks_change_nothing() {
    for layout in LAYOUTS {
        let m = manager(layout, 64);
        add(&m, 1, toks(24, 1));
        m.allocate_slots(1, 24).unwrap();
        add(&m, 2, toks(24, 2));
        m.allocate_external(2, 16, 0, true, 0).unwrap();
        add(&m, 3, toks(8, 3));
        m.allocate_slots_with_drafts(3, 8, &[1, 2]).unwrap();
        let before = snapshot(&m, &[1, 2, 3]);
        match m.rollback(1, 25, true) {
            Err(Error::InvalidArgument { arg, .. }) => assert_eq!(arg, "num_computed_tokens"),
            other => panic!("{other:?}"),
        }
        is_state_error(m.rollback(2, 8, true), "rollback");
        is_state_error(m.rollback(3, 4, true), "rollback");
        assert!(matches!(
            m.rollback(9, 0, false),
            Err(Error::UnknownSequence { seq_id: 9 })
        ));
        if layout == Layout::Hybrid {
            // Seq 1's window group released blocks before token 17's window... not yet: it
            // computed all 24 in one call, so every block is held. Seq 2's window group
            // never took blocks 0..2.
            m.commit_external(2, 16).unwrap();
            let before = snapshot(&m, &[1, 2, 3]);
            match m.rollback(2, 4, true) {
                Err(Error::InvalidArgument { arg, .. }) => {
                    assert_eq!(arg, "num_computed_tokens")
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(snapshot(&m, &[1, 2, 3]), before);
        } else {
            assert_eq!(snapshot(&m, &[1, 2, 3]), before);
        }
        ok(&m);
    }
}

#[test]
fn a_deferred_release_keeps_usage_then_frees_as_free_would() {
    for layout in LAYOUTS {
        let (m, plain) = (manager(layout, 64), manager(layout, 64));
        for x in [&m, &plain] {
            add(x, 1, toks(22, 1));
            x.allocate_slots(1, 22).unwrap();
        }
        let used = m.pool().num_used();
        let tables = m.block_tables(1).unwrap();
        let h = m.free_deferred(1).unwrap();
        assert!(plain.free(1));
        assert_eq!(m.num_sequences(), 0);
        assert_eq!(
            m.pool().num_used(),
            used,
            "{layout:?}: blocks still counted used"
        );
        assert_eq!(m.num_deferred_blocks(), used);
        let kept = m.deferred_blocks(h).unwrap();
        assert_eq!(kept.len(), used);
        assert_eq!(kept[0], *tables[0].last().unwrap(), "tail first");
        // Still registered, so still prefix hits (and in use: no free block taken).
        add(&m, 2, toks(22, 1));
        assert_eq!(m.lookup_prefix(2).unwrap(), 20);
        assert!(m.free(2));
        ok(&m);
        assert_eq!(m.release_deferred(h).unwrap(), used);
        assert_eq!(m.pool().num_used(), 0);
        assert_eq!(
            m.pool().free_queue(),
            plain.pool().free_queue(),
            "{layout:?}"
        );
        assert_eq!(m.num_deferred_blocks(), 0);
        for bad in [h, h + 1, 0] {
            match m.release_deferred(bad) {
                Err(Error::InvalidArgument { arg, .. }) => assert_eq!(arg, "handle"),
                other => panic!("{other:?}"),
            }
            assert!(m.deferred_blocks(bad).is_err());
        }
        ok(&m);
    }
}

#[test]
fn a_deferred_preemption_readmits_at_once() {
    for layout in LAYOUTS {
        let mut c = config(layout, 64);
        c.num_cpu_blocks = 8;
        let m = KvCacheManager::new(c).unwrap();
        add(&m, 1, toks(22, 1));
        m.allocate_slots(1, 22).unwrap();
        add(&m, 2, toks(16, 2));
        m.allocate_external(2, 12, 0, true, 0).unwrap();
        add(&m, 3, toks(8, 3));
        m.allocate_slots(3, 8).unwrap();
        m.swap_out(&[3]).unwrap();
        let used = m.pool().num_used();
        m.take_events();
        let before = snapshot(&m, &[1, 2, 3]);
        is_state_error(m.preempt_deferred(&[1, 3]), "preempt_deferred");
        is_state_error(m.free_deferred(3), "free_deferred");
        assert!(matches!(
            m.free_deferred(9),
            Err(Error::UnknownSequence { seq_id: 9 })
        ));
        assert_eq!(snapshot(&m, &[1, 2, 3]), before);
        let h = m.preempt_deferred(&[1, 2]).unwrap();
        assert_eq!(m.status(1).unwrap(), SeqStatus::Preempted);
        assert_eq!(m.status(2).unwrap(), SeqStatus::Preempted);
        assert_eq!(m.pool().num_used(), used);
        // The staged blocks of seq 2 are kept unregistered.
        for &b in &m.deferred_blocks(h).unwrap() {
            assert!(m.pool().ref_count(b) >= 1);
        }
        assert!(m.take_events().is_empty(), "nothing registered or removed");
        ok(&m);
        // Re-admitted while the old blocks wait: its own registered blocks are hits.
        let a = m.allocate_slots(1, 22).unwrap();
        assert_eq!(a.num_cached_tokens, 20);
        ok(&m);
        m.release_deferred(h).unwrap();
        assert_eq!(
            m.pool().num_used(),
            m.num_blocks_held(1).unwrap().iter().sum::<usize>()
        );
        ok(&m);
    }
}
