//! Speculative state blocks (`GroupSpec::state(..).with_spare_blocks(k)`): a state group keeps
//! `k` spare blocks after its live column for the states a verify step writes after each
//! draft (vLLM's align-mode `num_speculative_blocks`). Layout and move rule, the held column
//! the live state left, admission counts, the commit of known and accepted ends only, draft
//! rejection keeping the state table, refusals; a proptest checks that no prefix hit ever
//! returns a state the runner did not write (drafts rejected at random).

use std::collections::HashSet;

use pagedkv_core::{CacheConfig, Error, GroupSpec, KvCacheManager, SequenceSpec, NULL_BLOCK};

const FULL: usize = 0;
const STATE: usize = 1;

/// One full-attention group and one state group of `bs`-token blocks, `k` speculative blocks.
fn cfg(num_blocks: u32, bs: u32, k: u32) -> CacheConfig {
    CacheConfig::with_groups(
        num_blocks,
        vec![
            GroupSpec::full(bs, 8),
            GroupSpec::state(bs, 8).with_spare_blocks(k),
        ],
        vec![0, 1, 1],
    )
}

fn mgr(num_blocks: u32, bs: u32, k: u32) -> KvCacheManager {
    KvCacheManager::new(cfg(num_blocks, bs, k)).unwrap()
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt * 1000 + 1).collect()
}

fn ok(m: &KvCacheManager) {
    m.check_invariants().unwrap();
}

fn state_table(m: &KvCacheManager, seq: u64) -> Vec<u32> {
    m.block_tables(seq).unwrap()[STATE].clone()
}

fn invalid_config(c: CacheConfig, needle: &str) {
    match KvCacheManager::new(c) {
        Err(Error::InvalidConfig { field, reason, .. }) => {
            assert_eq!(field, "spare_blocks");
            assert!(reason.contains(needle), "{reason}");
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[test]
fn config_refusals_are_typed() {
    invalid_config(cfg(16, 4, 17), "at most 16");
    // Spare blocks on a full group in the prefix cache (speculative state blocks need a state
    // group).
    let c = CacheConfig::with_groups(
        16,
        vec![GroupSpec::full(4, 8).with_spare_blocks(1)],
        vec![0],
    );
    invalid_config(c, "a state group");
    let c = CacheConfig::with_groups(
        16,
        vec![
            GroupSpec::state(4, 8).with_spare_blocks(1),
            GroupSpec::state(8, 4).with_spare_blocks(1),
        ],
        vec![0, 1],
    );
    invalid_config(c, "one block size");
    // Every state group carries the same speculative blocks.
    let c = CacheConfig::with_groups(
        16,
        vec![
            GroupSpec::full(4, 8),
            GroupSpec::state(4, 8).with_spare_blocks(2),
            GroupSpec::state(4, 8),
        ],
        vec![0, 1, 2],
    );
    invalid_config(c, "the same spare blocks");
    let mut c = cfg(16, 4, 2);
    c.num_cpu_blocks = 4;
    invalid_config(c, "swap space");
    // In range: accepted.
    KvCacheManager::new(cfg(16, 4, 16)).unwrap();
}

/// A first allocation takes the live block and `k` spares; a later one that moves the live
/// column takes one block, the spares left below it moving (in order) to the end.
#[test]
fn layout_and_move_rule() {
    let (bs, k) = (4, 2);
    let m = mgr(32, bs, k);
    m.add_sequence(1, toks(16, 0), SequenceSpec::default())
        .unwrap();
    // Chunk 1: [0, 4): live column 0, spares at 1, 2.
    let a = m.allocate_slots(1, 4).unwrap();
    let ids = a.groups[STATE].new_block_ids.clone();
    assert_eq!(ids.len(), 3);
    assert_eq!(state_table(&m, 1), ids);
    assert_eq!(a.groups[STATE].zero_blocks, vec![ids[0]]);
    assert!(a.groups[STATE].copies.is_empty());
    ok(&m);
    m.commit_computed(1, 4).unwrap();
    // Chunk 2: [4, 16): live column 3. The spares at 1 and 2 are below it: they move to the
    // end (their columns become null), then one fresh block; the column the live state left
    // (0) is held: the computed tokens (4) have not passed its end.
    let free = m.pool().num_free();
    let a = m.allocate_slots(1, 12).unwrap();
    let t = state_table(&m, 1);
    assert_eq!(t.len(), 3 + 1 + k as usize);
    assert_eq!(t[0], ids[0]);
    assert_eq!(&t[1..3], &[NULL_BLOCK, NULL_BLOCK]);
    assert_eq!(&t[3..5], &ids[1..3]);
    let new = a.groups[STATE].new_block_ids.clone();
    assert_eq!(new, vec![ids[1], ids[2], t[5]]);
    assert_eq!(free - m.pool().num_free(), 3 + 1); // 3 attention blocks, 1 state
    ok(&m);
}

/// Moves within the spares: the spare at the new live column becomes the live block and
/// nothing moves; a jump past some spares moves only those.
#[test]
fn moves_over_spares_and_the_held_column() {
    let (bs, k) = (2, 2);
    let m = mgr(64, bs, k);
    m.add_sequence(1, toks(3, 0), SequenceSpec::default())
        .unwrap();
    // Prefill 3: live column 1, spares 2, 3 (null at 0).
    m.allocate_slots(1, 3).unwrap();
    let t0 = state_table(&m, 1);
    assert_eq!(t0[0], NULL_BLOCK);
    assert_eq!(t0.len(), 4);
    m.commit_computed(1, 3).unwrap();
    // Verify: computed 3, known end 4, drafts 2 -> n = 6, live column 2 (the spare there).
    m.append_tokens(1, &[500]).unwrap();
    let a = m.allocate_slots_with_drafts(1, 1, &[501, 502]).unwrap();
    let t1 = state_table(&m, 1);
    assert_eq!(&t1[..4], &t0[..]);
    assert_eq!(t1.len(), 5);
    assert_eq!(a.groups[STATE].new_block_ids, vec![t1[4]]);
    ok(&m);
    // All drafts rejected: the state table stays (the live column never moves back).
    let released = m.accept_drafts(1, 0).unwrap();
    assert!(released[STATE].is_empty());
    assert_eq!(state_table(&m, 1), t1);
    ok(&m);
    // Computed 4 (aligned, the known end): its state is in column 1, which stays held.
    assert_eq!(m.commit_computed(1, 4).unwrap(), 1);
    assert_eq!(state_table(&m, 1), t1);
    ok(&m);
    // Next verify: computed 4, known 5, drafts 2 -> n = 7, live column 3 (a spare). Column
    // 1's state (published) is still held: the computed tokens (4) do not pass its end.
    m.append_tokens(1, &[600]).unwrap();
    let a = m.allocate_slots_with_drafts(1, 1, &[601, 602]).unwrap();
    let t2 = state_table(&m, 1);
    assert_eq!(&t2[..5], &t1[..]);
    assert_eq!(t2.len(), 3 + 1 + 2);
    assert_eq!(a.groups[STATE].new_block_ids, vec![t2[5]]);
    ok(&m);
    // Both accepted: computed 7; next verify from 7 (known 8, drafts 2: n = 10, live 4).
    m.accept_drafts(1, 2).unwrap();
    m.commit_computed(1, 7).unwrap();
    m.append_tokens(1, &[700]).unwrap();
    let held = m.pool().num_free();
    let a = m.allocate_slots_with_drafts(1, 1, &[701, 702]).unwrap();
    let t3 = state_table(&m, 1);
    // Columns below (7 - 1) / 2 = 3 are released: 1 (published) and 2 (the live column of
    // the first verify, its state only the drafts ran past); 3 is held; 4 the live block.
    assert_eq!(&t3[..3], &[NULL_BLOCK, NULL_BLOCK, NULL_BLOCK]);
    assert_eq!(t3[3], t2[3]);
    assert_eq!(&t3[4..6], &t2[4..6]);
    assert_eq!(t3.len(), 4 + 1 + 2);
    assert_eq!(a.groups[STATE].new_block_ids, vec![t3[6]]);
    assert!(a.groups[STATE].released.contains(&t1[1]));
    assert!(a.groups[STATE].released.contains(&t1[2]));
    // Two state blocks back, one taken; one attention block taken for [8, 10)... the full
    // group covers 10 slots: 5 blocks, it had 4 (7 slots after acceptance).
    assert_eq!(m.pool().num_free() as i64 - held as i64, 2 - 1 - 1);
    ok(&m);
}

/// Admission: `1 + k` blocks for a first allocation, one per move, none otherwise.
#[test]
fn admission_counts() {
    let (bs, k) = (4u32, 3u32);
    // 1 null + 1 full block + (1 + 3) state blocks = 6: a 7th block short of nothing.
    let m = mgr(6, bs, k);
    m.add_sequence(1, toks(4, 0), SequenceSpec::default())
        .unwrap();
    assert_eq!(
        m.num_blocks_needed(1, 4).unwrap().per_group,
        vec![(1, 0), (1 + k as usize, 0)]
    );
    m.allocate_slots(1, 4).unwrap();
    assert_eq!(m.pool().num_free(), 0);
    ok(&m);
    let m = mgr(5, bs, k);
    m.add_sequence(1, toks(4, 0), SequenceSpec::default())
        .unwrap();
    match m.allocate_slots(1, 4) {
        Err(Error::OutOfBlocks {
            requested,
            available,
        }) => {
            assert_eq!((requested, available), (5, 4));
        }
        other => panic!("expected OutOfBlocks, got {other:?}"),
    }
    assert_eq!(m.block_tables(1).unwrap()[STATE], Vec::<u32>::new());
    ok(&m);
    // A verify step that stays in the live column takes nothing from the state group; one
    // that moves it takes one.
    let m = mgr(32, bs, k);
    m.add_sequence(1, toks(5, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 5).unwrap(); // live column 1
    m.append_tokens(1, &[9]).unwrap();
    // n = 5 + 1 + 2 = 8: live column 1, no move; the full group: 8 slots, 2 blocks held.
    assert_eq!(m.num_blocks_needed_with_drafts(1, 1, 2).unwrap().take, 0);
    m.allocate_slots_with_drafts(1, 1, &[10, 11]).unwrap();
    m.accept_drafts_keeping_blocks(1, 2).unwrap();
    m.append_tokens(1, &[12]).unwrap();
    // From computed 8: n = 8 + 1 + 3 = 12: live column 2, a move (1), the full group 1.
    assert_eq!(
        m.num_blocks_needed_with_drafts(1, 1, 3).unwrap().per_group,
        vec![(1, 0), (1, 0)]
    );
    ok(&m);
}

/// The commit publishes a step's known end and an accepted end, never a state the accepted
/// tokens ran past within one step nor one only drafts reached; a sibling hits only those.
#[test]
fn commit_publishes_known_and_accepted_ends_only() {
    let (bs, k) = (4, 3);
    let m = mgr(64, bs, k);
    let base = toks(4, 0);
    m.add_sequence(1, base.clone(), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 4).unwrap();
    assert_eq!(m.commit_computed(1, 4).unwrap(), 1); // known end 4
                                                     // Decode one (known end 5), then verify from 5: known 6, drafts [6, 7, 8] -> all accepted
                                                     // (computed 9): the aligned 8 was run past within the step.
    m.append_tokens(1, &[100]).unwrap();
    m.allocate_slots(1, 1).unwrap();
    m.commit_computed(1, 5).unwrap();
    m.append_tokens(1, &[101]).unwrap();
    m.allocate_slots_with_drafts(1, 1, &[102, 103, 104])
        .unwrap();
    m.accept_drafts(1, 3).unwrap();
    assert_eq!(m.commit_computed(1, 9).unwrap(), 0);
    ok(&m);
    let mut seen = base.clone();
    seen.extend([100, 101, 102, 103, 104, 105]);
    m.add_sequence(2, seen.clone(), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 4);
    // Seq 3: the same prompt, verify from 5 with drafts [102, 103]: accepted end 8 (aligned)
    // is published.
    m.add_sequence(3, base.clone(), SequenceSpec::default())
        .unwrap();
    let a = m.allocate_slots(3, 4).unwrap();
    assert_eq!(a.num_cached_tokens, 0); // a hit leaves at least one token to compute
    m.commit_computed(3, 4).unwrap();
    m.append_tokens(3, &[100]).unwrap();
    m.allocate_slots(3, 1).unwrap();
    m.commit_computed(3, 5).unwrap();
    m.append_tokens(3, &[101]).unwrap();
    m.allocate_slots_with_drafts(3, 1, &[102, 103]).unwrap();
    m.accept_drafts(3, 2).unwrap();
    assert_eq!(m.commit_computed(3, 8).unwrap(), 1);
    ok(&m);
    assert_eq!(m.lookup_prefix(2).unwrap(), 8);
    // Seq 4: drafts rejected: the states the drafts reached are never published.
    let mut other = base.clone();
    other.extend([100, 101, 200, 201, 202, 203]);
    m.add_sequence(4, base.clone(), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(4, 4).unwrap();
    m.append_tokens(4, &[100]).unwrap();
    m.allocate_slots(4, 1).unwrap();
    m.append_tokens(4, &[101]).unwrap();
    m.allocate_slots_with_drafts(4, 1, &[200, 201, 202])
        .unwrap();
    m.accept_drafts(4, 0).unwrap();
    m.commit_computed(4, 6).unwrap();
    m.add_sequence(5, other, SequenceSpec::default()).unwrap();
    assert_eq!(m.lookup_prefix(5).unwrap(), 4);
    ok(&m);
}

/// Preemption and free give every block back; a resumed sequence is laid out as a new one.
#[test]
fn preempt_and_free_release_everything() {
    let (bs, k) = (4, 2);
    let m = mgr(40, bs, k);
    let total = m.pool().num_free();
    m.add_sequence(1, toks(9, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 9).unwrap();
    m.append_tokens(1, &[1]).unwrap();
    m.allocate_slots_with_drafts(1, 1, &[2, 3]).unwrap();
    m.preempt_recompute(&[1]).unwrap();
    assert_eq!(m.pool().num_free(), total);
    ok(&m);
    let a = m.allocate_slots(1, 10).unwrap();
    assert_eq!(a.groups[STATE].new_block_ids.len(), 1 + k as usize);
    assert_eq!(state_table(&m, 1).len(), 2 + 1 + k as usize);
    ok(&m);
    m.append_tokens(1, &[2]).unwrap();
    m.allocate_slots_with_drafts(1, 1, &[3, 4]).unwrap();
    assert!(m.free(1));
    assert_eq!(m.pool().num_free(), total);
    ok(&m);
}

/// Refusals: more drafts than speculative blocks, lookahead slots; nothing changes.
#[test]
fn refusals_change_nothing() {
    let m = mgr(32, 4, 2);
    m.add_sequence(1, toks(4, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 4).unwrap();
    m.append_tokens(1, &[1]).unwrap();
    let before = m.block_tables(1).unwrap();
    match m.allocate_slots_with_drafts(1, 1, &[2, 3, 4]) {
        Err(Error::InvalidArgument { arg, reason, .. }) => {
            assert_eq!(arg, "draft_tokens");
            assert!(reason.contains("at most 2"), "{reason}");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert_eq!(m.block_tables(1).unwrap(), before);
    ok(&m);
}

/// Lookahead slots (an EAGLE / MTP drafter's own tokens) take attention blocks only: the
/// state groups lay out by the scheduled tokens and drafts, as vLLM's align mode does.
#[test]
fn lookahead_slots_take_no_state_block() {
    let m = mgr(32, 4, 2);
    m.add_sequence(1, toks(4, 0), SequenceSpec::default())
        .unwrap();
    // 4 tokens + 3 lookahead slots: the full group covers 7 slots (2 blocks), the state
    // group's live column is 0 (not 1).
    let a = m.allocate_slots_with_lookahead(1, 4, &[], 3).unwrap();
    assert_eq!(a.groups[FULL].new_block_ids.len(), 2);
    assert_eq!(state_table(&m, 1).len(), 1 + 2);
    ok(&m);
    m.append_tokens(1, &[1]).unwrap();
    // Verify from 4: known end 5, drafts 2 -> n = 7: live column 1 (a spare), lookahead 3
    // more slots in the full group (10: 3 blocks).
    let a = m.allocate_slots_with_lookahead(1, 1, &[2, 3], 3).unwrap();
    assert_eq!(a.groups[FULL].new_block_ids.len(), 1);
    assert_eq!(state_table(&m, 1).len(), 2 + 2);
    ok(&m);
}

mod model {
    //! Random verify steps (drafts accepted or rejected at random), prefill chunks, commits,
    //! preemptions and siblings sharing prefixes: the invariants hold after every operation,
    //! and every prefix hit is the state after a prefix some sequence's accepted tokens
    //! reached within a completed step (the runner wrote it); states only drafts reached are
    //! never hit.

    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::FileFailurePersistence;
    use std::collections::HashMap;

    #[derive(Debug, Clone)]
    enum Op {
        /// Add a sequence: prompt length, shared-prefix salt.
        Add(usize, u32),
        /// Step a sequence (index mod the live ones): chunk size for a prefill, drafts and
        /// accepted count for a verify step, commit or not.
        Step(usize, usize, usize, usize, bool),
        Preempt(usize),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => (1usize..14, 0u32..3).prop_map(|(n, s)| Op::Add(n, s)),
            8 => (0usize..8, 1usize..9, 0usize..4, 0usize..4, prop::bool::weighted(0.85))
                .prop_map(|(i, c, d, a, commit)| Op::Step(i, c, d, a, commit)),
            1 => (0usize..8).prop_map(Op::Preempt),
            1 => (0usize..8).prop_map(Op::Free),
        ]
    }

    struct Sim {
        m: KvCacheManager,
        bs: usize,
        k: usize,
        live: Vec<u64>,
        next: u64,
        /// Token prefixes whose state the runner wrote (aligned ends the accepted tokens of
        /// a completed step crossed).
        written: HashSet<Vec<u32>>,
        /// Token prefixes at the ends vLLM hashes (a step's known end, an accepted end):
        /// every hit must be one of them too (no hit where stock misses).
        hashed: HashSet<Vec<u32>>,
        /// Per sequence: its token counter for fresh decode tokens.
        counter: HashMap<u64, u32>,
        /// Prefix hits seen (coverage).
        hits: usize,
    }

    impl Sim {
        fn check_hit(&self, seq: u64, hit: usize) {
            if hit == 0 {
                return;
            }
            let t = self.m.tokens(seq).unwrap();
            assert!(
                self.written.contains(&t[..hit]),
                "seq {seq}: hit of {hit} tokens on a state never written"
            );
            assert!(
                self.hashed.contains(&t[..hit]),
                "seq {seq}: hit of {hit} tokens on a state at neither a known nor an accepted end"
            );
        }

        fn step(&mut self, seq: u64, chunk: usize, drafts: usize, accepted: usize, commit: bool) {
            let c = self.counter.entry(seq).or_insert(0);
            *c += 10;
            let base = 10_000 + seq as u32 * 1_000 + *c;
            let m = &self.m;
            let computed = m.num_computed_tokens(seq).unwrap();
            let total = m.num_tokens(seq).unwrap();
            let first = m.block_tables(seq).unwrap()[STATE].is_empty();
            if computed < total {
                // Prefill (or the first chunk of a resumed sequence).
                let q = chunk.min(total - computed);
                let a = match m.allocate_slots(seq, q) {
                    Ok(a) => a,
                    Err(Error::OutOfBlocks { .. }) => return,
                    Err(e) => panic!("{e:?}"),
                };
                if first {
                    self.check_hit(seq, a.num_cached_tokens);
                    self.hits += usize::from(a.num_cached_tokens > 0);
                }
                // A prefill chunk's state is written at its end only.
                let end = a.num_context_tokens + a.num_scheduled_tokens;
                if end % self.bs == 0 {
                    let p = m.tokens(seq).unwrap()[..end].to_vec();
                    self.written.insert(p.clone());
                    self.hashed.insert(p);
                }
                if commit {
                    m.commit_computed(seq, end).unwrap();
                }
                return;
            }
            // Verify step: one new token, then drafts (at most k); a random accepted count.
            // The runner copies the state at every aligned end the accepted tokens cross.
            m.append_tokens(seq, &[base]).unwrap();
            let drafts: Vec<u32> = (0..drafts.min(self.k))
                .map(|i| base + 1 + i as u32)
                .collect();
            // An EAGLE / MTP drafter's lookahead slots on some steps (attention blocks only).
            let lookahead = chunk % 3;
            let a = match m.allocate_slots_with_lookahead(seq, 1, &drafts, lookahead) {
                Ok(a) => a,
                Err(Error::OutOfBlocks { .. }) => return,
                Err(e) => panic!("{e:?}"),
            };
            let ctx = a.num_context_tokens;
            let acc = accepted.min(drafts.len());
            if !drafts.is_empty() {
                m.accept_drafts_keeping_blocks(seq, acc).unwrap();
            }
            let end = ctx + 1 + acc;
            let toks = m.tokens(seq).unwrap();
            for x in (ctx + 1..=end).filter(|x| x % self.bs == 0) {
                self.written.insert(toks[..x].to_vec());
                if x == ctx + 1 || x == end {
                    self.hashed.insert(toks[..x].to_vec());
                }
            }
            if commit {
                m.commit_computed(seq, end).unwrap();
            }
        }
    }

    fn run(bs: usize, k: usize, num_blocks: u32, ops: Vec<Op>) {
        let mut s = Sim {
            m: mgr(num_blocks, bs as u32, k as u32),
            bs,
            k,
            live: Vec::new(),
            next: 1,
            written: HashSet::new(),
            hashed: HashSet::new(),
            counter: HashMap::new(),
            hits: 0,
        };
        for op in ops {
            match op {
                Op::Add(n, salt) => {
                    let id = s.next;
                    s.next += 1;
                    let mut t = toks(n.max(1), salt);
                    // Siblings of one salt share a prefix, then differ.
                    t.push(id as u32 * 100_000);
                    s.m.add_sequence(id, t, SequenceSpec::default()).unwrap();
                    s.live.push(id);
                }
                Op::Step(i, chunk, d, a, commit) if !s.live.is_empty() => {
                    let id = s.live[i % s.live.len()];
                    s.step(id, chunk, d, a, commit);
                }
                Op::Preempt(i) if !s.live.is_empty() => {
                    let id = s.live[i % s.live.len()];
                    s.m.preempt_recompute(&[id]).unwrap();
                }
                Op::Free(i) if !s.live.is_empty() => {
                    let id = s.live.remove(i % s.live.len());
                    assert!(s.m.free(id));
                }
                _ => {}
            }
            s.m.check_invariants().unwrap();
        }
        HITS.fetch_add(s.hits, std::sync::atomic::Ordering::Relaxed);
        for id in std::mem::take(&mut s.live) {
            s.m.free(id);
        }
        assert_eq!(s.m.pool().num_free(), num_blocks as usize - 1);
        s.m.check_invariants().unwrap();
    }

    static HITS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    fn cases() -> u32 {
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(256)
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: cases(),
            failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
            ..ProptestConfig::default()
        })]

        #[test]
        fn no_hit_returns_an_unwritten_state(
            bs in prop::sample::select(vec![1usize, 2, 4]),
            k in 1usize..4,
            num_blocks in 8u32..48,
            ops in prop::collection::vec(op(), 1..80),
        ) {
            run(bs, k, num_blocks, ops);
        }
    }

    /// The property is not vacuous: the stream above hits states (a fixed stream).
    #[test]
    fn the_model_hits_states() {
        let mut ops = vec![Op::Add(9, 1), Op::Add(9, 1)];
        ops.extend([Op::Step(0, 8, 0, 0, true), Op::Step(0, 1, 0, 0, true)]);
        for _ in 0..6 {
            ops.push(Op::Step(0, 1, 3, 2, true));
        }
        ops.push(Op::Step(1, 8, 0, 0, true));
        let before = HITS.load(std::sync::atomic::Ordering::Relaxed);
        run(4, 3, 64, ops);
        assert!(HITS.load(std::sync::atomic::Ordering::Relaxed) > before);
    }
}

/// A first allocation's hit state stays held at its column (the copy source of the live
/// block), as vLLM holds it, until an allocation's computed tokens pass its end.
#[test]
fn hit_state_held_until_passed() {
    let (bs, k) = (4, 2);
    let m = mgr(64, bs, k);
    m.add_sequence(1, toks(12, 0), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 8).unwrap();
    m.commit_computed(1, 8).unwrap();
    let cached = state_table(&m, 1)[1];
    // A sibling hits the state after 8 tokens: it is held at column 1 and copied from.
    m.add_sequence(2, toks(12, 0), SequenceSpec::default())
        .unwrap();
    let a = m.allocate_slots(2, 2).unwrap();
    assert_eq!(a.num_cached_tokens, 8);
    let t = state_table(&m, 2);
    assert_eq!(t[1], cached);
    let live = t[(10 - 1) / 4];
    assert_eq!(a.groups[STATE].copies, vec![(cached, live)]);
    assert_eq!(t.len(), 2 + 1 + k as usize);
    ok(&m);
    // Computed 10: (10 - 1) / 4 = 2 > 1, the next allocation releases it (still cached).
    let a = m.allocate_slots(2, 2).unwrap();
    assert_eq!(state_table(&m, 2)[1], NULL_BLOCK);
    assert!(a.groups[STATE].released.contains(&cached));
    ok(&m);
    m.add_sequence(3, toks(12, 0), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix(3).unwrap(), 8);
}

/// External loads (KV connectors) with speculative state blocks are refused: a loaded state's
/// spare blocks are not laid out. The refusal changes nothing.
#[test]
fn external_loads_refused_with_speculative_blocks() {
    let m = mgr(32, 4, 2);
    m.add_sequence(1, toks(12, 0), SequenceSpec::default())
        .unwrap();
    let free = m.pool().num_free();
    for (staged, n) in [(false, 1), (true, 0)] {
        match m.allocate_external(1, 8, n, staged, 0) {
            Err(Error::InvalidArgument { arg, reason, .. }) => {
                assert_eq!(arg, "num_external_tokens");
                assert!(reason.contains("spare_blocks = 2"), "{reason}");
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        assert_eq!(m.pool().num_free(), free);
        assert!(m.block_tables(1).unwrap().iter().all(|t| t.is_empty()));
        assert_eq!(m.num_computed_tokens(1).unwrap(), 0);
        ok(&m);
    }
}
