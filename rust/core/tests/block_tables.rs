//! `BlockTables`, the consumer's side of the step outputs' block-table deltas: each delta
//! kind, the recovery paths (skipped outputs, reused ids, released rows, late outputs), the
//! refused updates, and proptests driving the manager with one full-attention group (in the one-group words of
//! `common::OneGroup`) and with (full-attention, sliding-window and chunked-local groups, tables kept in one
//! `[G, rows, cols]` buffer) through random operations with outputs applied, skipped, merged
//! or replayed, checking every applied batch against the manager's own tables and the buffer's
//! zero padding.

mod common;

use common::OneGroup;
use pagedkv_core::block_tables::{BlockTables, PendingUpdate, TableDeltas, KEEP_ABSENT};
use pagedkv_core::{
    CacheConfig, Error, GroupSpec, KvCacheManager, SeqId, SeqStatus, SequenceSpec, StepOutput,
    StepRequest,
};
use proptest::prelude::*;

/// A `BlockTables` with its buffer, as a model runner keeps it.
struct Kept {
    tables: BlockTables,
    buf: Vec<i32>,
}

impl Kept {
    fn new(rows: usize, cols: usize) -> Self {
        let tables = BlockTables::new(rows, cols);
        let (r, c) = tables.shape();
        Self {
            tables,
            buf: vec![0; r * c],
        }
    }

    /// Applies `outs` (request ids, output) as one batch; returns the dense rows.
    fn update(
        &mut self,
        m: &impl OneGroup,
        outs: &[(Vec<SeqId>, StepOutput)],
    ) -> Result<Vec<Vec<i32>>, Error> {
        let parts: Vec<TableDeltas<'_>> = outs
            .iter()
            .map(|(ids, out)| TableDeltas::new(ids, out))
            .collect();
        let pending = self.tables.prepare(&parts, |id| m.block_table(id))?;
        if let Some((rows, cols)) = self.tables.grown_shape(&pending) {
            // Garbage in the new buffer: regrow must set every entry it does not copy.
            let mut grown = vec![-7; rows * cols];
            self.tables.regrow(&self.buf, &mut grown, rows, cols);
            self.buf = grown;
        }
        let (n, w) = self.tables.apply(&mut self.buf, pending);
        let cols = self.tables.shape().1;
        Ok((0..n)
            .map(|k| self.buf[k * cols..k * cols + w].to_vec())
            .collect())
    }

    /// Every entry outside the held rows' tables is the null block 0, and `ids` (a superset of
    /// the ids held) account for every held row.
    fn check_padding(&self, ids: impl Iterator<Item = SeqId>) {
        let cols = self.tables.shape().1;
        let mut live = vec![false; self.buf.len()];
        let mut rows = 0;
        for id in ids {
            if let Some((r, len)) = self.tables.row_of(id) {
                rows += 1;
                live[r * cols..r * cols + len].fill(true);
            }
        }
        assert_eq!(rows, self.tables.num_rows(), "held rows");
        for (i, (&b, &l)) in self.buf.iter().zip(&live).enumerate() {
            assert!(l || b == 0, "entry {i} ({b}) outside the held tables");
        }
    }
}

fn manager(num_blocks: u32, caching: bool, cpu: u32) -> impl OneGroup {
    let mut cfg = CacheConfig::new(num_blocks, 4);
    cfg.enable_prefix_caching = caching;
    cfg.num_cpu_blocks = cpu;
    <KvCacheManager as OneGroup>::build(cfg).unwrap()
}

/// One step of `ids`, each scheduling up to `n` tokens (a decode appends one token first
/// when nothing is left to compute).
fn step(m: &impl OneGroup, ids: &[SeqId], n: u32) -> (Vec<SeqId>, StepOutput) {
    let mut req = StepRequest {
        seq_ids: ids.to_vec(),
        num_new_tokens: vec![n; ids.len()],
        append_indptr: vec![0],
        append_tokens: Vec::new(),
    };
    for &id in ids {
        let done = m.num_uncomputed_tokens(&[id]).is_ok_and(|u| u[0] == 0);
        if done {
            req.append_tokens.push(id as u32 + 100);
        }
        req.append_indptr.push(req.append_tokens.len() as u32);
    }
    let out = m.step(&req);
    (req.seq_ids, out)
}

fn table(m: &impl OneGroup, id: SeqId) -> Vec<i32> {
    m.block_table(id)
        .unwrap()
        .iter()
        .map(|&b| b as i32)
        .collect()
}

/// The dense rows the manager's tables of `ids` make: padded to the longest (at least 1).
fn dense(m: &impl OneGroup, ids: &[SeqId]) -> Vec<Vec<i32>> {
    let tables: Vec<Vec<i32>> = ids.iter().map(|&id| table(m, id)).collect();
    let w = tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
    tables
        .into_iter()
        .map(|mut t| {
            t.resize(w, 0);
            t
        })
        .collect()
}

#[test]
fn decode_deltas_apply_without_reading_tables() {
    let m = manager(32, true, 0);
    let mut kept = Kept::new(1, 1);
    for s in 1..=3 {
        m.add_sequence(s, &[s as u32; 4], SequenceSpec::default())
            .unwrap();
    }
    for _ in 0..6 {
        let out = step(&m, &[1, 2, 3], 4);
        assert_eq!(kept.update(&m, &[out]).unwrap(), dense(&m, &[1, 2, 3]));
    }
    assert_eq!(kept.tables.num_table_reads(), 0);
    assert_eq!(
        kept.tables.shape().1,
        4,
        "columns grew by doubling (3 blocks)"
    );
    // A new batch order moves rows; a subset leaves the others held.
    let out = step(&m, &[3, 1], 1);
    assert_eq!(kept.update(&m, &[out]).unwrap(), dense(&m, &[3, 1]));
    assert_eq!(kept.tables.num_rows(), 3);
    assert_eq!(kept.tables.row_of(3).map(|r| r.0), Some(0));
    kept.check_padding(1..=3);
    assert_eq!(kept.tables.num_table_reads(), 0);
}

#[test]
fn a_skipped_output_or_a_reused_id_reads_the_table_whole() {
    let m = manager(32, false, 0);
    let mut kept = Kept::new(4, 4);
    m.add_sequence(1, &[1; 6], SequenceSpec::default()).unwrap();
    m.add_sequence(2, &[2; 6], SequenceSpec::default()).unwrap();
    let out = step(&m, &[1, 2], 6);
    kept.update(&m, &[out]).unwrap();
    // Skipped: a copy-on-write of seq 1's shared last block.
    m.fork(1, 3).unwrap();
    let _skipped = step(&m, &[1], 1);
    let out = step(&m, &[1], 1);
    assert_eq!(out.1.table_start, vec![2]);
    assert_eq!(kept.update(&m, &[out]).unwrap(), dense(&m, &[1]));
    assert_eq!(kept.tables.num_table_reads(), 1);
    // Seq 2 freed, its id reused, the new sequence's first output skipped: the next delta
    // (empty, from block 2) does not follow the old sequence's version.
    m.free(2);
    m.add_sequence(2, &[9; 6], SequenceSpec::default()).unwrap();
    let _skipped = step(&m, &[2], 6);
    let out = step(&m, &[2], 1);
    assert_eq!(out.1.table_start, vec![2]);
    let version = out.1.table_version[0];
    assert_eq!(kept.update(&m, &[out]).unwrap(), dense(&m, &[2]));
    assert!(version > 2, "above every earlier version");
    assert_eq!(kept.tables.num_table_reads(), 2);
    kept.check_padding(1..=3);
}

#[test]
fn a_whole_report_fed_again_does_not_bring_back_an_older_table() {
    let m = manager(32, false, 0);
    let mut kept = Kept::new(2, 2);
    m.add_sequence(1, &[1; 6], SequenceSpec::default()).unwrap();
    let first = step(&m, &[1], 6);
    assert_eq!(first.1.table_start, vec![0], "a whole report");
    kept.update(&m, std::slice::from_ref(&first)).unwrap();
    for _ in 0..3 {
        let out = step(&m, &[1], 1); // the third decode opens block 3
        kept.update(&m, &[out]).unwrap();
    }
    assert_eq!(table(&m, 1).len(), 3);
    // The first output again (twice, or late): the row keeps the current table.
    assert_eq!(kept.update(&m, &[first]).unwrap(), dense(&m, &[1]));
    let out = step(&m, &[1], 1);
    assert_eq!(kept.update(&m, &[out]).unwrap(), dense(&m, &[1]));
    kept.check_padding(1..=1);
}

#[test]
fn a_shorter_table_is_zero_padded_and_growth_keeps_the_rows() {
    let m = manager(64, false, 0);
    let mut kept = Kept::new(1, 1);
    m.add_sequence(1, &[1; 20], SequenceSpec::default())
        .unwrap();
    m.add_sequence(2, &[2; 3], SequenceSpec::default()).unwrap();
    let out = step(&m, &[1, 2], 20);
    assert_eq!(kept.update(&m, &[out]).unwrap(), dense(&m, &[1, 2]));
    m.preempt_recompute(&[1]).unwrap();
    let out = step(&m, &[1, 2], 4); // seq 1 restarts with 1 block
    assert_eq!(kept.update(&m, &[out]).unwrap(), dense(&m, &[1, 2]));
    kept.check_padding(1..=2);
    // A wider table regrows the buffer: the rows move, the rest is zero.
    m.append_tokens(2, &[5; 60]).unwrap();
    let out = step(&m, &[2], 60);
    assert_eq!(kept.update(&m, &[out]).unwrap(), dense(&m, &[2]));
    assert!(kept.tables.shape().1 >= 16);
    kept.check_padding(1..=2);
    let out = step(&m, &[1, 2], 1);
    assert_eq!(kept.update(&m, &[out]).unwrap(), dense(&m, &[1, 2]));
    assert_eq!(kept.tables.num_table_reads(), 0);
}

#[test]
fn absent_rows_are_released_past_the_limit() {
    let n = KEEP_ABSENT as u64 + 6;
    let m = manager(512, false, 0);
    let mut kept = Kept::new(8, 2);
    let ids: Vec<SeqId> = (0..n).collect();
    for &s in &ids {
        m.add_sequence(s, &[s as u32; 5], SequenceSpec::default())
            .unwrap();
    }
    let out = step(&m, &ids, 5);
    assert_eq!(kept.update(&m, &[out]).unwrap(), dense(&m, &ids));
    let out = step(&m, &[0], 1); // n - 1 absent > 1 + KEEP_ABSENT: released
    kept.update(&m, &[out]).unwrap();
    assert_eq!(kept.tables.num_rows(), 1);
    kept.check_padding(ids.iter().copied());
    let out = step(&m, &[0, 1], 1);
    assert_eq!(kept.update(&m, &[out]).unwrap(), dense(&m, &[0, 1]));
    assert_eq!(kept.tables.num_table_reads(), 1);
}

#[test]
fn several_outputs_merge_and_refused_updates_change_nothing() {
    let m = manager(32, true, 0);
    let mut kept = Kept::new(2, 2);
    for s in 1..=3 {
        m.add_sequence(s, &[s as u32; 5], SequenceSpec::default())
            .unwrap();
    }
    let a = step(&m, &[1, 2], 5);
    let b = step(&m, &[3], 5);
    assert_eq!(
        kept.update(&m, &[a.clone(), b]).unwrap(),
        dense(&m, &[1, 2, 3])
    );
    let before = (kept.buf.clone(), kept.tables.num_rows());
    match kept.update(&m, &[a.clone(), a.clone()]) {
        Err(Error::InvalidArgument {
            arg: "steps",
            reason,
            ..
        }) => {
            assert!(reason.contains("scheduled twice"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // Arrays that disagree (as a caller writing into them could make) are refused.
    let mut bad = a.clone();
    bad.1.table_delta_indptr[1] = 99;
    assert!(matches!(
        kept.update(&m, &[bad]),
        Err(Error::InvalidArgument {
            arg: "table_delta_indptr",
            ..
        })
    ));
    let mut bad = a.clone();
    bad.1.table_start.pop();
    assert!(matches!(
        kept.update(&m, &[bad]),
        Err(Error::InvalidArgument {
            arg: "table_start",
            ..
        })
    ));
    // A late output of a freed sequence whose table must be read whole.
    m.fork(2, 4).unwrap();
    let _skipped = step(&m, &[4], 1);
    let late = step(&m, &[4], 1);
    m.free(4);
    assert_eq!(
        kept.update(&m, &[late]),
        Err(Error::UnknownSequence { seq_id: 4 })
    );
    assert_eq!((kept.buf.clone(), kept.tables.num_rows()), before);
    assert_eq!(kept.update(&m, &[]).unwrap(), Vec::<Vec<i32>>::new());
    kept.check_padding(1..=4);
}

#[derive(Debug, Clone)]
enum Op {
    Add { id: u8, len: u8, family: u8 },
    Step { ids: Vec<u8>, n: u8, skip: bool },
    Merged { ids: Vec<u8>, n: u8, cut: u8 },
    Replay { back: u8 },
    Fork { parent: u8, child: u8 },
    Free { id: u8 },
    Preempt { id: u8 },
    SwapOut { id: u8 },
    SwapIn { id: u8 },
    Reset,
}

const IDS: u8 = 5;

fn op() -> impl Strategy<Value = Op> {
    let ids = prop::collection::vec(0..IDS, 0..6);
    prop_oneof![
        3 => (0..IDS, 1u8..24, 0u8..3).prop_map(|(id, len, family)| Op::Add { id, len, family }),
        5 => (ids.clone(), 1u8..10, prop::bool::weighted(0.3))
            .prop_map(|(ids, n, skip)| Op::Step { ids, n, skip }),
        1 => (ids, 1u8..10, 0u8..6).prop_map(|(ids, n, cut)| Op::Merged { ids, n, cut }),
        1 => (0u8..4).prop_map(|back| Op::Replay { back }),
        1 => (0..IDS, 0..IDS).prop_map(|(parent, child)| Op::Fork { parent, child }),
        2 => (0..IDS).prop_map(|id| Op::Free { id }),
        1 => (0..IDS).prop_map(|id| Op::Preempt { id }),
        1 => (0..IDS).prop_map(|id| Op::SwapOut { id }),
        1 => (0..IDS).prop_map(|id| Op::SwapIn { id }),
        1 => Just(Op::Reset),
    ]
}

/// The ids of a step: known, not swapped out, each once.
fn schedulable(m: &impl OneGroup, ids: &[u8]) -> Vec<SeqId> {
    let mut out: Vec<SeqId> = Vec::new();
    for &id in ids {
        let id = SeqId::from(id);
        if !out.contains(&id) && m.status(id).is_ok_and(|s| s != SeqStatus::Swapped) {
            out.push(id);
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Every batch applied is the manager's tables of its sequences, whatever was skipped,
    /// replayed or reused before; nothing outside the held tables is ever nonzero.
    #[test]
    fn kept_tables_follow_the_manager(ops in prop::collection::vec(op(), 1..60)) {
        let m = manager(40, true, 12);
        let mut kept = Kept::new(1, 1);
        let mut history: Vec<(Vec<SeqId>, StepOutput)> = Vec::new();
        for op in ops {
            match op {
                Op::Add { id, len, family } => {
                    let prompt: Vec<u32> = (0..u32::from(len)).map(|t| t % 9 + u32::from(family) * 50).collect();
                    let _ = m.add_sequence(SeqId::from(id), &prompt, SequenceSpec::default());
                }
                Op::Step { ids, n, skip } => {
                    let ids = schedulable(&m, &ids);
                    let out = step(&m, &ids, u32::from(n));
                    let scheduled = ids[..out.1.num_scheduled].to_vec();
                    history.push(out.clone());
                    if !skip {
                        let got = kept.update(&m, &[out]).unwrap();
                        prop_assert_eq!(got, dense(&m, &scheduled));
                    }
                }
                Op::Merged { ids, n, cut } => {
                    // Two outputs of one scheduler step (disjoint sequences), applied together.
                    let ids = schedulable(&m, &ids);
                    let (x, y) = ids.split_at(usize::from(cut).min(ids.len()));
                    let a = step(&m, x, u32::from(n));
                    let b = step(&m, y, u32::from(n));
                    let mut scheduled = x[..a.1.num_scheduled].to_vec();
                    scheduled.extend_from_slice(&y[..b.1.num_scheduled]);
                    let got = kept.update(&m, &[a, b]).unwrap();
                    prop_assert_eq!(got, dense(&m, &scheduled));
                }
                Op::Replay { back } => {
                    // An old output applied late: any result, or UnknownSequence, but no
                    // panic, and later batches are still exact.
                    if let Some(old) = history.iter().rev().nth(usize::from(back)) {
                        let before = (kept.buf.clone(), kept.tables.num_rows());
                        if let Err(e) = kept.update(&m, std::slice::from_ref(old)) {
                            prop_assert!(matches!(e, Error::UnknownSequence { .. }), "{}", e);
                            prop_assert_eq!((kept.buf.clone(), kept.tables.num_rows()), before);
                        }
                    }
                }
                Op::Fork { parent, child } => {
                    let _ = m.fork(SeqId::from(parent), SeqId::from(child));
                }
                Op::Free { id } => {
                    m.free(SeqId::from(id));
                }
                Op::Preempt { id } => {
                    let _ = m.preempt_recompute(&[SeqId::from(id)]);
                }
                Op::SwapOut { id } => {
                    let _ = m.swap_out(&[SeqId::from(id)]);
                }
                Op::SwapIn { id } => {
                    let _ = m.swap_in(&[SeqId::from(id)]);
                }
                Op::Reset => {
                    let _ = m.reset_prefix_cache();
                }
            }
            kept.check_padding(0..SeqId::from(IDS));
        }
    }
}

// ---- KV cache groups: one keeper for every group's tables ----

/// A `BlockTables` of `G` groups with its `[G, rows, cols]` buffer.
struct GroupKept {
    tables: BlockTables,
    buf: Vec<i32>,
}

/// Dense tables `[G][S][W]`.
type Dense3 = Vec<Vec<Vec<i32>>>;

impl GroupKept {
    fn new(groups: usize, rows: usize, cols: usize) -> Self {
        let tables = BlockTables::with_groups(groups, rows, cols);
        Self {
            buf: vec![0; tables.buffer_len()],
            tables,
        }
    }

    /// Applies `outs` as one batch; returns each group's dense rows.
    fn update(
        &mut self,
        m: &KvCacheManager,
        outs: &[(Vec<SeqId>, StepOutput)],
    ) -> Result<Dense3, Error> {
        let parts: Vec<TableDeltas<'_>> = outs
            .iter()
            .map(|(ids, out)| TableDeltas::new(ids, out))
            .collect();
        let pending = self
            .tables
            .prepare_groups(&parts, |id| m.block_tables(id))?;
        if let Some((rows, cols)) = self.tables.grown_shape(&pending) {
            let mut grown = vec![-7; self.tables.groups() * rows * cols];
            self.tables.regrow(&self.buf, &mut grown, rows, cols);
            self.buf = grown;
        }
        let (n, w) = self.tables.apply(&mut self.buf, pending);
        let (rows, cols) = self.tables.shape();
        Ok((0..self.tables.groups())
            .map(|g| {
                (0..n)
                    .map(|k| {
                        let at = (g * rows + k) * cols;
                        self.buf[at..at + w].to_vec()
                    })
                    .collect()
            })
            .collect())
    }

    /// Every entry outside the held tables is 0, and `ids` account for every held row.
    fn check_padding(&self, ids: impl Iterator<Item = SeqId>) {
        let (rows, cols) = self.tables.shape();
        let mut live = vec![false; self.buf.len()];
        let mut held = 0;
        for id in ids {
            if let Some((r, lens)) = self.tables.row_lens(id) {
                held += 1;
                for (g, &len) in lens.iter().enumerate() {
                    let at = (g * rows + r) * cols;
                    live[at..at + len].fill(true);
                }
            }
        }
        assert_eq!(held, self.tables.num_rows(), "held rows");
        for (i, (&b, &l)) in self.buf.iter().zip(&live).enumerate() {
            assert!(l || b == 0, "entry {i} ({b}) outside the held tables");
        }
    }
}

/// Full attention, a sliding window of 6 tokens and chunks of 8, block size 4.
fn hybrid(num_blocks: u32, cpu: u32) -> KvCacheManager {
    let mut c = CacheConfig::with_groups(
        num_blocks,
        vec![
            GroupSpec::full(4, 8),
            GroupSpec::sliding_window(4, 8, 6),
            GroupSpec::chunked_local(4, 8, 8),
        ],
        vec![0, 1, 2],
    );
    c.num_cpu_blocks = cpu;
    KvCacheManager::new(c).unwrap()
}

/// One step of `ids` on a `KvCacheManager` (as [`step`]).
fn hstep(m: &KvCacheManager, ids: &[SeqId], n: u32) -> (Vec<SeqId>, StepOutput) {
    let mut req = StepRequest {
        seq_ids: ids.to_vec(),
        num_new_tokens: vec![n; ids.len()],
        append_indptr: vec![0],
        append_tokens: Vec::new(),
    };
    for &id in ids {
        if m.num_uncomputed_tokens(&[id]).is_ok_and(|u| u[0] == 0) {
            req.append_tokens.push(id as u32 + 100);
        }
        req.append_indptr.push(req.append_tokens.len() as u32);
    }
    let out = m.step(&req);
    (req.seq_ids, out)
}

/// The manager's tables of `ids`, `[G][S][W]` padded to the longest of any group (at least 1).
fn hdense(m: &KvCacheManager, ids: &[SeqId]) -> Dense3 {
    let tables: Vec<Vec<Vec<i32>>> = ids
        .iter()
        .map(|&id| {
            m.block_tables(id)
                .unwrap()
                .into_iter()
                .map(|t| t.into_iter().map(|b| b as i32).collect())
                .collect()
        })
        .collect();
    let g = m.num_groups();
    let w = tables
        .iter()
        .flatten()
        .map(Vec::len)
        .max()
        .unwrap_or(0)
        .max(1);
    (0..g)
        .map(|x| {
            tables
                .iter()
                .map(|t| {
                    let mut row = t[x].clone();
                    row.resize(w, 0);
                    row
                })
                .collect()
        })
        .collect()
}

#[test]
fn group_decode_deltas_apply_without_reading_tables() {
    let m = hybrid(96, 0);
    let mut kept = GroupKept::new(3, 1, 1);
    for s in 1..=3 {
        m.add_sequence(s, vec![s as u32; 6], SequenceSpec::default())
            .unwrap();
    }
    let mut released = false;
    for _ in 0..8 {
        let out = hstep(&m, &[1, 2, 3], 3);
        assert_eq!(kept.update(&m, &[out]).unwrap(), hdense(&m, &[1, 2, 3]));
        // the window group's released entries come as 0 in front of its live ones
        released |= m.block_tables(1).unwrap()[1].first() == Some(&0);
    }
    assert!(
        released,
        "the window released blocks (null entries applied)"
    );
    assert_eq!(kept.tables.num_table_reads(), 0);
    // A new batch order moves every group's rows; a subset leaves the others held.
    let out = hstep(&m, &[3, 1], 1);
    assert_eq!(kept.update(&m, &[out]).unwrap(), hdense(&m, &[3, 1]));
    let out = hstep(&m, &[2, 3, 1], 1);
    assert_eq!(kept.update(&m, &[out]).unwrap(), hdense(&m, &[2, 3, 1]));
    assert_eq!(kept.tables.num_table_reads(), 0);
    assert_eq!(kept.tables.num_rows(), 3);
    kept.check_padding(1..4);
}

#[test]
fn group_skipped_outputs_and_stale_whole_reports_read_the_tables_whole() {
    let m = hybrid(64, 0);
    let mut kept = GroupKept::new(3, 2, 2);
    m.add_sequence(1, vec![4; 10], SequenceSpec::default())
        .unwrap();
    let prefill = hstep(&m, &[1], 10);
    assert!(
        prefill.1.table_start.iter().all(|&s| s == 0),
        "whole report"
    );
    kept.update(&m, std::slice::from_ref(&prefill)).unwrap();
    let _skipped = hstep(&m, &[1], 1);
    let out = hstep(&m, &[1], 1);
    assert_eq!(kept.update(&m, &[out]).unwrap(), hdense(&m, &[1]));
    assert_eq!(
        kept.tables.num_table_reads(),
        1,
        "the skipped output's sequence read whole"
    );
    // The prefill's whole report fed again is older than the version held: read whole, and
    // the window's released entries stay released.
    assert_eq!(kept.update(&m, &[prefill]).unwrap(), hdense(&m, &[1]));
    assert_eq!(kept.tables.num_table_reads(), 2);
    // A freed id reused by a new sequence reports above every earlier version: applied whole.
    m.free(1);
    m.add_sequence(1, vec![9; 3], SequenceSpec::default())
        .unwrap();
    let out = hstep(&m, &[1], 3);
    assert_eq!(kept.update(&m, &[out]).unwrap(), hdense(&m, &[1]));
    assert_eq!(kept.tables.num_table_reads(), 2);
    kept.check_padding(1..2);
}

/// The argument an update refused names.
fn refused(r: Result<PendingUpdate<'_>, Error>) -> &'static str {
    match r {
        Err(Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn group_refused_updates_change_nothing() {
    let m = hybrid(64, 0);
    let mut kept = GroupKept::new(3, 4, 4);
    for s in 1..=2 {
        m.add_sequence(s, vec![s as u32; 5], SequenceSpec::default())
            .unwrap();
    }
    let out = hstep(&m, &[1, 2], 5);
    kept.update(&m, &[out]).unwrap();
    let before = (kept.buf.clone(), kept.tables.num_rows());
    let (ids, out) = hstep(&m, &[1, 2], 1);

    // prepare reads one table per sequence: refused for three groups
    let parts = [TableDeltas::new(&ids, &out)];
    let r = kept
        .tables
        .prepare(&parts, |id| Ok(m.block_tables(id)?.remove(0)));
    assert_eq!(refused(r), "groups");
    // a one-group output's arrays do not fit three groups
    let one = manager(16, false, 0);
    one.add_sequence(1, &[1; 4], SequenceSpec::default())
        .unwrap();
    let (one_ids, one_out) = step(&one, &[1], 4);
    let one_parts = [TableDeltas::new(&one_ids, &one_out)];
    let r = kept
        .tables
        .prepare_groups(&one_parts, |id| m.block_tables(id));
    assert_eq!(refused(r), "table_start");
    // a table reader returning another number of tables
    let stale = GroupKept::new(3, 1, 1);
    assert_eq!(
        refused(stale.tables.prepare_groups(&parts, |_| Ok(vec![vec![1]]))),
        "read_whole"
    );
    // one sequence twice across two outputs
    let twice = [TableDeltas::new(&ids, &out), TableDeltas::new(&ids, &out)];
    assert_eq!(
        refused(kept.tables.prepare_groups(&twice, |id| m.block_tables(id))),
        "steps"
    );
    // an offset past the deltas
    let mut bad = out.clone();
    *bad.table_delta_indptr.last_mut().unwrap() += 1;
    let bad_parts = [TableDeltas::new(&ids, &bad)];
    let r = kept
        .tables
        .prepare_groups(&bad_parts, |id| m.block_tables(id));
    assert_eq!(refused(r), "table_delta_indptr");
    // a negative start
    let mut bad = out.clone();
    bad.table_start[1] = -1;
    let bad_parts = [TableDeltas::new(&ids, &bad)];
    let r = kept
        .tables
        .prepare_groups(&bad_parts, |id| m.block_tables(id));
    assert_eq!(refused(r), "table_start");
    assert_eq!((kept.buf.clone(), kept.tables.num_rows()), before);
    // and the real output still applies
    assert_eq!(kept.update(&m, &[(ids, out)]).unwrap(), hdense(&m, &[1, 2]));
}

#[test]
fn group_rows_grow_and_absent_rows_are_released_past_the_limit() {
    let m = hybrid(4096, 0);
    let mut kept = GroupKept::new(3, 1, 1);
    let all: Vec<SeqId> = (0..(KEEP_ABSENT as SeqId + 4)).collect();
    for &s in &all {
        m.add_sequence(s, vec![s as u32 % 7; 9], SequenceSpec::default())
            .unwrap();
    }
    let out = hstep(&m, &all, 9);
    assert_eq!(kept.update(&m, &[out]).unwrap(), hdense(&m, &all));
    assert!(kept.tables.shape().0 >= all.len());
    kept.check_padding(all.iter().copied());
    // a batch of one: S + KEEP_ABSENT < absent, so every absent row is released (zeroed)
    let out = hstep(&m, &[2], 1);
    assert_eq!(kept.update(&m, &[out]).unwrap(), hdense(&m, &[2]));
    assert_eq!(kept.tables.num_rows(), 1);
    kept.check_padding(all.iter().copied());
}

#[test]
fn one_group_is_the_same_keeper() {
    // BlockTables::new is with_groups(1, ..): same shape, same tables, same buffer layout.
    let a = BlockTables::new(3, 5);
    let b = BlockTables::with_groups(1, 3, 5);
    assert_eq!(
        (a.groups(), a.shape(), a.buffer_len()),
        (b.groups(), b.shape(), b.buffer_len())
    );
    assert_eq!((a.shape(), a.buffer_len()), ((3, 5), 15));
    // A one-group KvCacheManager's outputs go through prepare_groups too.
    let m = KvCacheManager::new(CacheConfig::with_groups(
        32,
        vec![GroupSpec::full(4, 8)],
        vec![0],
    ))
    .unwrap();
    let mut kept = GroupKept::new(1, 1, 1);
    m.add_sequence(1, vec![3; 6], SequenceSpec::default())
        .unwrap();
    for n in [6, 1, 1, 1] {
        let out = hstep(&m, &[1], n);
        assert_eq!(kept.update(&m, &[out]).unwrap(), hdense(&m, &[1]));
    }
    assert_eq!(kept.tables.num_table_reads(), 0);
}

/// The ids of a hybrid step: known, not swapped out, each once.
fn hschedulable(m: &KvCacheManager, ids: &[u8]) -> Vec<SeqId> {
    let mut out: Vec<SeqId> = Vec::new();
    for &id in ids {
        let id = SeqId::from(id);
        if !out.contains(&id) && m.status(id).is_ok_and(|s| s != SeqStatus::Swapped) {
            out.push(id);
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Every batch applied is the manager's tables of its sequences in every group (window
    /// and chunk releases as null entries), whatever was skipped, replayed or reused before;
    /// nothing outside the held tables is ever nonzero.
    #[test]
    fn kept_group_tables_follow_the_manager(ops in prop::collection::vec(op(), 1..60)) {
        let m = hybrid(80, 24);
        let mut kept = GroupKept::new(3, 1, 1);
        let mut history: Vec<(Vec<SeqId>, StepOutput)> = Vec::new();
        for op in ops {
            match op {
                Op::Add { id, len, family } => {
                    let prompt: Vec<u32> = (0..u32::from(len)).map(|t| t % 9 + u32::from(family) * 50).collect();
                    let _ = m.add_sequence(SeqId::from(id), prompt, SequenceSpec::default());
                }
                Op::Step { ids, n, skip } => {
                    let ids = hschedulable(&m, &ids);
                    let out = hstep(&m, &ids, u32::from(n));
                    let scheduled = ids[..out.1.num_scheduled].to_vec();
                    history.push(out.clone());
                    if !skip {
                        let got = kept.update(&m, &[out]).unwrap();
                        prop_assert_eq!(got, hdense(&m, &scheduled));
                    }
                }
                Op::Merged { ids, n, cut } => {
                    let ids = hschedulable(&m, &ids);
                    let (x, y) = ids.split_at(usize::from(cut).min(ids.len()));
                    let a = hstep(&m, x, u32::from(n));
                    let b = hstep(&m, y, u32::from(n));
                    let mut scheduled = x[..a.1.num_scheduled].to_vec();
                    scheduled.extend_from_slice(&y[..b.1.num_scheduled]);
                    let got = kept.update(&m, &[a, b]).unwrap();
                    prop_assert_eq!(got, hdense(&m, &scheduled));
                }
                Op::Replay { back } => {
                    if let Some(old) = history.iter().rev().nth(usize::from(back)) {
                        let before = (kept.buf.clone(), kept.tables.num_rows());
                        // An old output applied late: any result, or UnknownSequence, but
                        // no panic, and later batches are still exact.
                        if let Err(e) = kept.update(&m, std::slice::from_ref(old)) {
                            prop_assert!(matches!(e, Error::UnknownSequence { .. }), "{}", e);
                            prop_assert_eq!((kept.buf.clone(), kept.tables.num_rows()), before);
                        }
                    }
                }
                Op::Fork { parent, child } => {
                    let _ = m.fork(SeqId::from(parent), SeqId::from(child));
                }
                Op::Free { id } => {
                    m.free(SeqId::from(id));
                }
                Op::Preempt { id } => {
                    let _ = m.preempt_recompute(&[SeqId::from(id)]);
                }
                Op::SwapOut { id } => {
                    let _ = m.swap_out(&[SeqId::from(id)]);
                }
                Op::SwapIn { id } => {
                    let _ = m.swap_in(&[SeqId::from(id)]);
                }
                Op::Reset => {
                    let _ = m.reset_prefix_cache();
                }
            }
            kept.check_padding(0..SeqId::from(IDS));
        }
    }
}
