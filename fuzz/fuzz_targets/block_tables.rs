//! Fuzz target `block_tables`: arbitrary bytes -> operations on the manager with one
//! full-attention group (add / step / fork /
//! free / preempt / swap / reset, sequence ids reused on purpose) whose step outputs feed a
//! `BlockTables` (the consumer's side of the block-table deltas): applied, skipped, merged two
//! at a time, replayed late, or replaced by arbitrary arrays (as a caller writing into the
//! output arrays could make them, with version 0 so that no real delta follows them).
//!
//! Checks: every batch applied right after its steps equals the manager's own tables of its
//! sequences (padded with the null block); a replayed output fails only with `UnknownSequence`
//! and an arbitrary one only with `InvalidArgument` / `UnknownSequence`, each leaving the
//! buffer unchanged, and neither panics; after every operation every buffer entry outside the
//! held rows' tables is 0.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv_core::block_tables::{BlockTables, TableDeltas};
use pagedkv_core::{
    CacheConfig, Error, KvCacheManager, SeqId, SeqStatus, SequenceSpec, StepOutput, StepRequest,
};

/// Sequence ids are taken modulo this, so ids are reused often.
const ID_SPACE: u8 = 8;
/// Bound on operations per input.
const MAX_OPS: usize = 80;

#[derive(Arbitrary, Debug)]
enum Op {
    Add {
        id: u8,
        len: u8,
        family: u8,
    },
    Step {
        ids: Vec<u8>,
        n: u8,
        skip: bool,
    },
    Merged {
        ids: Vec<u8>,
        n: u8,
        cut: u8,
    },
    Replay {
        back: u8,
    },
    Raw {
        ids: Vec<u8>,
        start: Vec<i32>,
        version: Vec<u64>,
        indptr: Vec<i32>,
        delta: Vec<i32>,
    },
    Fork {
        parent: u8,
        child: u8,
    },
    Free {
        id: u8,
    },
    Preempt {
        id: u8,
    },
    SwapOut {
        id: u8,
    },
    SwapIn {
        id: u8,
    },
    Reset,
}

#[derive(Arbitrary, Debug)]
struct Input {
    rows: u8,
    cols: u8,
    ops: Vec<Op>,
}

struct Kept {
    tables: BlockTables,
    buf: Vec<i32>,
}

impl Kept {
    fn update(
        &mut self,
        m: &KvCacheManager,
        parts: &[TableDeltas<'_>],
    ) -> Result<Vec<Vec<i32>>, Error> {
        let pending = self.tables.prepare_groups(parts, |id| m.block_tables(id))?;
        if let Some((rows, cols)) = self.tables.grown_shape(&pending) {
            let mut grown = vec![-1; rows * cols];
            self.tables.regrow(&self.buf, &mut grown, rows, cols);
            self.buf = grown;
        }
        let (n, w) = self.tables.apply(&mut self.buf, pending);
        let cols = self.tables.shape().1;
        Ok((0..n)
            .map(|k| self.buf[k * cols..k * cols + w].to_vec())
            .collect())
    }

    fn check_padding(&self) {
        let cols = self.tables.shape().1;
        let mut live = vec![false; self.buf.len()];
        let mut rows = 0;
        for id in 0..SeqId::from(u8::MAX) + 1 {
            if let Some((r, len)) = self.tables.row_of(id) {
                rows += 1;
                live[r * cols..r * cols + len].fill(true);
            }
        }
        assert_eq!(rows, self.tables.num_rows());
        for (&b, &l) in self.buf.iter().zip(&live) {
            assert!(l || b == 0, "nonzero entry outside the held tables");
        }
    }
}

fn step(m: &KvCacheManager, ids: &[SeqId], n: u8) -> (Vec<SeqId>, StepOutput) {
    let mut req = StepRequest {
        seq_ids: ids.to_vec(),
        num_new_tokens: vec![u32::from(n.max(1)); ids.len()],
        append_indptr: vec![0],
        append_tokens: Vec::new(),
    };
    for &id in ids {
        if m.num_uncomputed_tokens(&[id]).is_ok_and(|u| u[0] == 0) {
            req.append_tokens.push(7);
        }
        req.append_indptr.push(req.append_tokens.len() as u32);
    }
    let out = m.step(&req);
    (req.seq_ids, out)
}

fn schedulable(m: &KvCacheManager, ids: &[u8]) -> Vec<SeqId> {
    let mut out: Vec<SeqId> = Vec::new();
    for &id in ids.iter().take(8) {
        let id = SeqId::from(id % ID_SPACE);
        if !out.contains(&id) && m.status(id).is_ok_and(|s| s != SeqStatus::Swapped) {
            out.push(id);
        }
    }
    out
}

fn dense(m: &KvCacheManager, ids: &[SeqId]) -> Vec<Vec<i32>> {
    let tables: Vec<Vec<i32>> = ids
        .iter()
        .map(|&id| {
            m.block_tables(id).unwrap()[0]
                .iter()
                .map(|&b| b as i32)
                .collect()
        })
        .collect();
    let w = tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
    tables
        .into_iter()
        .map(|mut t| {
            t.resize(w, 0);
            t
        })
        .collect()
}

fuzz_target!(|input: Input| {
    let mut cfg = CacheConfig::new(24, 4);
    cfg.num_cpu_blocks = 8;
    let m = KvCacheManager::new(cfg).unwrap();
    let tables = BlockTables::new(usize::from(input.rows % 8), usize::from(input.cols % 8));
    let (r, c) = tables.shape();
    let mut kept = Kept {
        tables,
        buf: vec![0; r * c],
    };
    let mut history: Vec<(Vec<SeqId>, StepOutput)> = Vec::new();
    for op in input.ops.into_iter().take(MAX_OPS) {
        match op {
            Op::Add { id, len, family } => {
                let prompt: Vec<u32> = (0..u32::from(len % 24) + 1)
                    .map(|t| t % 5 + u32::from(family % 3) * 10)
                    .collect();
                let _ = m.add_sequence(SeqId::from(id % ID_SPACE), prompt, SequenceSpec::default());
            }
            Op::Step { ids, n, skip } => {
                let ids = schedulable(&m, &ids);
                let out = step(&m, &ids, n % 10);
                let scheduled = ids[..out.1.num_scheduled].to_vec();
                if !skip {
                    let got = kept
                        .update(&m, &[TableDeltas::new(&out.0, &out.1)])
                        .unwrap();
                    assert_eq!(got, dense(&m, &scheduled));
                }
                history.push(out);
            }
            Op::Merged { ids, n, cut } => {
                let ids = schedulable(&m, &ids);
                let (x, y) = ids.split_at(usize::from(cut).min(ids.len()));
                let a = step(&m, x, n % 10);
                let b = step(&m, y, n % 10);
                let mut scheduled = x[..a.1.num_scheduled].to_vec();
                scheduled.extend_from_slice(&y[..b.1.num_scheduled]);
                let parts = [TableDeltas::new(&a.0, &a.1), TableDeltas::new(&b.0, &b.1)];
                assert_eq!(kept.update(&m, &parts).unwrap(), dense(&m, &scheduled));
            }
            Op::Replay { back } => {
                if let Some(old) = history.iter().rev().nth(usize::from(back % 4)) {
                    let before = kept.buf.clone();
                    if let Err(e) = kept.update(&m, &[TableDeltas::new(&old.0, &old.1)]) {
                        assert!(matches!(e, Error::UnknownSequence { .. }), "{e}");
                        assert_eq!(kept.buf, before);
                    }
                }
            }
            Op::Raw {
                ids,
                start,
                version,
                indptr,
                delta,
            } => {
                let ids: Vec<SeqId> = ids
                    .iter()
                    .take(8)
                    .map(|&i| SeqId::from(i % ID_SPACE))
                    .collect();
                let start: Vec<i32> = start.into_iter().take(9).map(|s| s % 64).collect();
                let indptr: Vec<i32> = indptr.into_iter().take(10).map(|s| s % 64).collect();
                let delta: Vec<i32> = delta.into_iter().take(64).collect();
                // Version 0 follows nothing and nothing follows it: the rows it writes are
                // read whole again by the next real output, so later batches stay exact.
                let version: Vec<u64> = version.iter().take(9).map(|_| 0).collect();
                let part = TableDeltas {
                    seq_ids: &ids,
                    table_start: &start,
                    table_version: &version,
                    table_delta_indptr: &indptr,
                    table_delta: &delta,
                };
                let before = kept.buf.clone();
                if let Err(e) = kept.update(&m, &[part]) {
                    assert!(
                        matches!(
                            e,
                            Error::InvalidArgument { .. } | Error::UnknownSequence { .. }
                        ),
                        "{e}"
                    );
                    assert_eq!(kept.buf, before);
                }
            }
            Op::Fork { parent, child } => {
                let _ = m.fork(
                    SeqId::from(parent % ID_SPACE),
                    SeqId::from(child % ID_SPACE),
                );
            }
            Op::Free { id } => {
                m.free(SeqId::from(id % ID_SPACE));
            }
            Op::Preempt { id } => {
                let _ = m.preempt_recompute(&[SeqId::from(id % ID_SPACE)]);
            }
            Op::SwapOut { id } => {
                let _ = m.swap_out(&[SeqId::from(id % ID_SPACE)]);
            }
            Op::SwapIn { id } => {
                let _ = m.swap_in(&[SeqId::from(id % ID_SPACE)]);
            }
            Op::Reset => {
                let _ = m.reset_prefix_cache();
            }
        }
        kept.check_padding();
    }
});
