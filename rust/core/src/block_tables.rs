//! Block tables kept across scheduler steps on the consumer side (a model runner), updated
//! from the step outputs' table deltas ([`StepOutput::table_start`] / [`StepOutput::table_delta`]),
//! as vLLM's GPU model runner keeps its block table and applies only the scheduler's changes
//! (PagedAttention's block tables, Kwon et al., SOSP'23). The Python binding's `BlockTable`
//! is this type over a numpy buffer; it only moves the arrays in and out.
//!
//! Layout: the caller owns one row-major `i32[rows, cols]` buffer of the shape
//! [`BlockTables::shape`]. Rows `0..S` hold the last batch's sequences in batch order, so the
//! batch's dense table is `buffer[..S, ..W]` with row stride `cols` (no gather, no copy); rows
//! `S..held` keep recently absent sequences. A sequence that changes position is moved by
//! swapping two rows. Entries past a row's length are always 0 (the null block), which is the
//! dense table's padding.
//!
//! An update is two calls, so that the caller can grow its buffer in between and nothing
//! changes when a call fails: [`BlockTables::prepare`] checks the deltas, decides which follow
//! the rows held and reads whole the tables of those that do not; [`BlockTables::apply`]
//! writes. A delta applies only to the version of the table it follows
//! ([`StepOutput::table_version`]): a sequence whose previous report was not applied here (new
//! to this object, released while absent, an output skipped, or an id reused by a new sequence,
//! whose versions continue above every earlier one) is read whole, and so is one whose whole
//! report is older than the version held (an output fed twice or out of order), so every row
//! ends as the manager's current table.

use crate::error::{Error, Result};
use crate::manager::StepOutput;
use crate::{BlockId, SeqId, NULL_BLOCK};

/// Absent sequences kept beyond the batch before they are all released: a sequence missing
/// from a batch keeps its row while at most `S + KEEP_ABSENT` sequences are absent.
pub const KEEP_ABSENT: usize = 64;

/// One step output's table deltas, borrowed: the scheduled sequences' ids (a prefix of the
/// request's ids) and the output's `table_start`, `table_version`, `table_delta_indptr` and
/// `table_delta` arrays (see [`StepOutput`]).
#[derive(Debug, Clone, Copy)]
pub struct TableDeltas<'a> {
    /// The scheduled sequences, in batch order (`S` ids).
    pub seq_ids: &'a [SeqId],
    /// `S` first changed logical blocks.
    pub table_start: &'a [i32],
    /// `S` table versions.
    pub table_version: &'a [u64],
    /// `S + 1` CSR offsets into `table_delta`.
    pub table_delta_indptr: &'a [i32],
    /// The changed entries (block ids), sequence after sequence.
    pub table_delta: &'a [i32],
}

impl<'a> TableDeltas<'a> {
    /// The deltas of `out`, whose request listed `seq_ids` first (only the first
    /// `out.num_scheduled` are used). Panics if fewer ids than scheduled sequences are given.
    pub fn new(seq_ids: &'a [SeqId], out: &'a StepOutput) -> Self {
        Self {
            seq_ids: &seq_ids[..out.num_scheduled],
            table_start: &out.table_start,
            table_version: &out.table_version,
            table_delta_indptr: &out.table_delta_indptr,
            table_delta: &out.table_delta,
        }
    }

    /// Checks the arrays' lengths and the first and last offset, O(1); [`Self::check_entry`]
    /// checks each sequence's offsets and start as they are read, so that applying them cannot
    /// index out of bounds.
    fn validate(&self) -> Result<()> {
        let n = self.seq_ids.len();
        let bad = |arg: &'static str, reason: String| Error::InvalidArgument {
            arg,
            value: format!("{n} sequences"),
            reason,
        };
        if self.table_start.len() != n || self.table_version.len() != n {
            return Err(bad(
                "table_start",
                format!(
                    "table_start has {} entries and table_version {}, expected one per sequence",
                    self.table_start.len(),
                    self.table_version.len()
                ),
            ));
        }
        let p = self.table_delta_indptr;
        if p.len() != n + 1 || p[0] != 0 || p[n] as usize != self.table_delta.len() {
            return Err(self.bad_indptr());
        }
        Ok(())
    }

    /// Sequence `j`'s offsets do not go back or past `table_delta`, and its start is >= 0
    /// (after [`Self::validate`]).
    #[inline]
    fn check_entry(&self, j: usize) -> Result<()> {
        let (a, b) = (self.table_delta_indptr[j], self.table_delta_indptr[j + 1]);
        if a > b || b as usize > self.table_delta.len() {
            return Err(self.bad_indptr());
        }
        if self.table_start[j] < 0 {
            return Err(Error::InvalidArgument {
                arg: "table_start",
                value: self.table_start[j].to_string(),
                reason: "table starts must be >= 0".into(),
            });
        }
        Ok(())
    }

    fn bad_indptr(&self) -> Error {
        Error::InvalidArgument {
            arg: "table_delta_indptr",
            value: format!("{} sequences", self.seq_ids.len()),
            reason: format!(
                "expected {} non-decreasing offsets from 0 to len(table_delta) = {}",
                self.seq_ids.len() + 1,
                self.table_delta.len()
            ),
        }
    }

    /// Entries of sequence `j`'s delta.
    #[inline]
    fn entries(&self, j: usize) -> &'a [i32] {
        let (a, b) = (
            self.table_delta_indptr[j] as usize,
            self.table_delta_indptr[j + 1] as usize,
        );
        &self.table_delta[a..b]
    }
}

/// An update checked by [`BlockTables::prepare`], to be written by [`BlockTables::apply`].
#[derive(Debug)]
pub struct PendingUpdate<'a> {
    parts: &'a [TableDeltas<'a>],
    /// Sequences in the batch.
    n: usize,
    /// `(batch index, whole table)` of the sequences read whole, in batch order.
    rereads: Vec<(usize, Vec<i32>)>,
    /// Sequences of the batch no row holds yet.
    new_seqs: usize,
    /// Columns the longest row needs.
    cols: usize,
    /// Every sequence is already at its batch row.
    in_order: bool,
}

impl PendingUpdate<'_> {
    /// Sequences in the batch (`S`, the rows of the dense table [`BlockTables::apply`] makes).
    pub fn num_sequences(&self) -> usize {
        self.n
    }
}

/// Block tables kept across scheduler steps and updated from the step outputs' table deltas
/// (see the module docs). Not thread-safe by itself (`&mut self` updates).
///
/// Cost of an update: O(S + changed entries) when the batch keeps its order, plus one row
/// swap per sequence that moved and one whole-table read per sequence whose previous report
/// was not applied.
#[derive(Debug, Clone)]
pub struct BlockTables {
    cols: usize,
    /// Per row: its sequence (rows `held..` are None), entries held, table version (0: none,
    /// so no delta follows it; versions start at 1).
    seqs: Vec<Option<SeqId>>,
    lens: Vec<usize>,
    versions: Vec<u64>,
    row_of: foldhash::HashMap<SeqId, usize>,
    /// Rows `0..held` hold a sequence; the last batch is rows `0..S`.
    held: usize,
    num_table_reads: u64,
}

impl BlockTables {
    /// Empty tables for a buffer of `rows x cols` entries (each at least 1; both grow on
    /// demand, see [`Self::grown_shape`]).
    pub fn new(rows: usize, cols: usize) -> Self {
        let rows = rows.max(1);
        Self {
            cols: cols.max(1),
            seqs: vec![None; rows],
            lens: vec![0; rows],
            versions: vec![0; rows],
            row_of: foldhash::HashMap::default(),
            held: 0,
            num_table_reads: 0,
        }
    }

    /// `(rows, cols)` of the buffer the caller keeps: row-major, `rows * cols` entries.
    pub fn shape(&self) -> (usize, usize) {
        (self.seqs.len(), self.cols)
    }

    /// Sequences whose tables are held (the last batch, plus recently absent ones).
    pub fn num_rows(&self) -> usize {
        self.held
    }

    /// Whole tables read so far (sequences whose previous report was not applied); every
    /// other row was updated from its delta alone.
    pub fn num_table_reads(&self) -> u64 {
        self.num_table_reads
    }

    /// The row holding `seq` and its length in blocks, if held.
    pub fn row_of(&self, seq: SeqId) -> Option<(usize, usize)> {
        self.row_of.get(&seq).map(|&r| (r, self.lens[r]))
    }

    /// Checks `parts` (the step outputs of one scheduler step, in batch order) against the
    /// rows held, without changing anything: which deltas follow the version held, and, for
    /// the others, the whole table from `read_whole` (the manager's
    /// [`crate::KvCacheManager::block_table`]).
    ///
    /// Errors: [`Error::InvalidArgument`] (`arg` "steps") for a sequence scheduled twice across
    /// `parts`, or arrays that disagree (see [`TableDeltas`]); whatever `read_whole` returns
    /// ([`Error::UnknownSequence`] for a table to read whole of a sequence the manager no
    /// longer holds: an output applied after its sequence was freed).
    pub fn prepare<'a>(
        &self,
        parts: &'a [TableDeltas<'a>],
        mut read_whole: impl FnMut(SeqId) -> Result<Vec<BlockId>>,
    ) -> Result<PendingUpdate<'a>> {
        // The loop is compiled here once (not per caller), so its helpers inline.
        self.prepare_dyn(parts, &mut read_whole)
    }

    fn prepare_dyn<'a>(
        &self,
        parts: &'a [TableDeltas<'a>],
        read_whole: &mut dyn FnMut(SeqId) -> Result<Vec<BlockId>>,
    ) -> Result<PendingUpdate<'a>> {
        for p in parts {
            p.validate()?;
        }
        let n: usize = parts.iter().map(|p| p.seq_ids.len()).sum();
        if parts.len() > 1 {
            // One output never lists a sequence twice (the core refuses it); several might.
            let mut seen = foldhash::HashSet::with_capacity_and_hasher(n, Default::default());
            if let Some(s) = parts
                .iter()
                .flat_map(|p| p.seq_ids)
                .find(|s| !seen.insert(**s))
            {
                return Err(Error::InvalidArgument {
                    arg: "steps",
                    value: format!("{n} sequences"),
                    reason: format!("sequence {s} is scheduled twice in one batch"),
                });
            }
        }
        let mut rereads: Vec<(usize, Vec<i32>)> = Vec::new();
        let (mut cols, mut new_seqs, mut k) = (1usize, 0usize, 0usize);
        let mut in_order = true;
        for p in parts {
            for (j, &id) in p.seq_ids.iter().enumerate() {
                p.check_entry(j)?;
                let row = self.row(k, id);
                new_seqs += usize::from(row.is_none());
                in_order &= row == Some(k);
                let (len, version) = row.map_or((0, 0), |r| (self.lens[r], self.versions[r]));
                let start = p.table_start[j] as usize;
                let follows = version != 0 && version.checked_add(1) == Some(p.table_version[j]);
                // A whole report older than the row's version (an output fed twice or out of
                // order) is stale: the table is read whole instead.
                let whole_new = start == 0 && p.table_version[j] > version;
                if whole_new || (follows && start <= len) {
                    cols = cols.max(start + p.entries(j).len());
                } else {
                    let whole = read_whole(id)?;
                    cols = cols.max(whole.len());
                    rereads.push((k, whole.into_iter().map(|b| b as i32).collect()));
                }
                k += 1;
            }
        }
        Ok(PendingUpdate {
            parts,
            n,
            rereads,
            new_seqs,
            cols,
            in_order,
        })
    }

    /// The buffer shape `pending` needs when it is larger than [`Self::shape`] (each
    /// dimension that must grow at least doubles), else `None`. Grow with [`Self::regrow`].
    pub fn grown_shape(&self, pending: &PendingUpdate<'_>) -> Option<(usize, usize)> {
        let (old_rows, old_cols) = self.shape();
        let (rows, cols) = (self.held + pending.new_seqs, pending.cols);
        if rows <= old_rows && cols <= old_cols {
            return None;
        }
        let grow = |need: usize, old: usize| {
            if need > old {
                need.max(2 * old)
            } else {
                old
            }
        };
        Some((grow(rows, old_rows), grow(cols, old_cols)))
    }

    /// Moves the held rows from `old` (of [`Self::shape`]) into `new`, a buffer of `rows x
    /// cols` entries, and makes that the shape; every other entry of `new` is set to 0.
    /// Panics unless `rows` and `cols` are at least the current shape and the buffers have
    /// the sizes of their shapes. O(rows x cols).
    pub fn regrow(&mut self, old: &[i32], new: &mut [i32], rows: usize, cols: usize) {
        let (old_rows, old_cols) = self.shape();
        assert!(rows >= old_rows && cols >= old_cols, "tables only grow");
        assert_eq!(
            old.len(),
            old_rows * old_cols,
            "old buffer of the old shape"
        );
        assert_eq!(new.len(), rows * cols, "new buffer of the new shape");
        for (r, row) in new.chunks_exact_mut(cols).enumerate() {
            let len = if r < self.held {
                let len = self.lens[r];
                row[..len].copy_from_slice(&old[r * old_cols..r * old_cols + len]);
                len
            } else {
                0
            };
            row[len..].fill(NULL_BLOCK as i32);
        }
        self.cols = cols;
        self.seqs.resize(rows, None);
        self.lens.resize(rows, 0);
        self.versions.resize(rows, 0);
    }

    /// Writes `pending` (from [`Self::prepare`] on this object, with no other update in
    /// between) into `table`, the buffer of [`Self::shape`] (grown first if
    /// [`Self::grown_shape`] asked for it), and returns `(S, W)`: the batch's dense table is
    /// `table[..S * cols]` viewed as `S x W` with row stride `cols`, row `k` the `k`-th
    /// scheduled sequence's table padded with the null block, `W` the longest table (at
    /// least 1). Panics if `table` is smaller than the shape needs. Cannot fail otherwise.
    pub fn apply(&mut self, table: &mut [i32], pending: PendingUpdate<'_>) -> (usize, usize) {
        let (rows, cols) = self.shape();
        assert!(
            table.len() >= rows * cols && self.held + pending.new_seqs <= rows,
            "buffer of the shape the update needs (see grown_shape)"
        );
        assert!(pending.cols <= cols, "buffer wide enough (see grown_shape)");
        let PendingUpdate {
            parts,
            n,
            rereads,
            in_order,
            ..
        } = pending;
        // Rows in batch order: row k takes the k-th sequence (swapped in from its row, or
        // from a fresh one). Rows before k already hold the batch, so a sequence is at row
        // >= k, and each batch sequence is held or new: n <= held + new_seqs <= rows.
        if !in_order {
            for (k, &id) in parts.iter().flat_map(|p| p.seq_ids).enumerate() {
                if self.seqs[k] != Some(id) {
                    let r = match self.row_of.get(&id) {
                        Some(&r) => r,
                        None => {
                            let r = self.held;
                            self.held += 1;
                            self.seqs[r] = Some(id);
                            self.lens[r] = 0;
                            self.versions[r] = 0;
                            self.row_of.insert(id, r);
                            r
                        }
                    };
                    self.swap_rows(table, k, r);
                }
            }
        }
        if self.held - n > n + KEEP_ABSENT {
            // Too many sequences absent from the batch (finished, or waiting): release them.
            for r in n..self.held {
                table[r * cols..r * cols + self.lens[r]].fill(NULL_BLOCK as i32);
                if let Some(id) = self.seqs[r].take() {
                    self.row_of.remove(&id);
                }
                self.lens[r] = 0;
                self.versions[r] = 0;
            }
            self.held = n;
        }

        // The deltas (or whole tables), each into its row; stale entries past the new end
        // (a preempted sequence restarting shorter) are zeroed.
        let (mut width, mut k) = (0usize, 0usize);
        // rereads are in batch order: the next one's batch index, usize::MAX after the last
        // (a plain index: a peekable iterator here costs a store-forwarding stall per sequence)
        let (mut next, mut reread_at) = (0, rereads.first().map_or(usize::MAX, |r| r.0));
        for p in parts {
            for j in 0..p.seq_ids.len() {
                let row = &mut table[k * cols..(k + 1) * cols];
                let end = if k == reread_at {
                    let whole = &rereads[next].1;
                    next += 1;
                    reread_at = rereads.get(next).map_or(usize::MAX, |r| r.0);
                    self.num_table_reads += 1;
                    row[..whole.len()].copy_from_slice(whole);
                    whole.len()
                } else {
                    let start = p.table_start[j] as usize;
                    let entries = p.entries(j);
                    // most decode deltas are empty or one new block: no memcpy call
                    match entries.len() {
                        0 => {}
                        1 => row[start] = entries[0],
                        m => row[start..start + m].copy_from_slice(entries),
                    }
                    start + entries.len()
                };
                if end < self.lens[k] {
                    row[end..self.lens[k]].fill(NULL_BLOCK as i32);
                }
                self.lens[k] = end;
                self.versions[k] = p.table_version[j];
                width = width.max(end);
                k += 1;
            }
        }
        (n, width.max(1))
    }

    /// The row holding `id` (checked at row `k` first: the steady state), if any.
    #[inline]
    fn row(&self, k: usize, id: SeqId) -> Option<usize> {
        if self.seqs.get(k) == Some(&Some(id)) {
            return Some(k);
        }
        self.row_of.get(&id).copied()
    }

    /// Swaps rows `a` and `b` with their bookkeeping (entries past both lengths are 0 in both).
    fn swap_rows(&mut self, table: &mut [i32], a: usize, b: usize) {
        if a == b {
            return;
        }
        let cols = self.cols;
        let (lo, hi) = (a.min(b), a.max(b));
        let used = self.lens[a].max(self.lens[b]);
        let (head, tail) = table.split_at_mut(hi * cols);
        head[lo * cols..lo * cols + used].swap_with_slice(&mut tail[..used]);
        self.seqs.swap(a, b);
        self.lens.swap(a, b);
        self.versions.swap(a, b);
        for r in [a, b] {
            if let Some(id) = self.seqs[r] {
                self.row_of.insert(id, r);
            }
        }
    }
}
