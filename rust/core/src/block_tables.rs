//! Block tables kept across scheduler steps on the consumer side (a model runner), updated
//! from the step outputs' table deltas ([`StepOutput::table_start`] /
//! [`StepOutput::table_delta`], per sequence and KV cache group), as vLLM's GPU model runner keeps its block tables (one per KV cache group) and applies only
//! the scheduler's changes (PagedAttention's block tables, Kwon et al., SOSP'23). The Python
//! binding's `BlockTable` is this type over a numpy buffer; it only moves the arrays in and out.
//!
//! Layout: the caller owns one row-major `i32[G, rows, cols]` buffer ([`BlockTables::shape`]
//! gives `(rows, cols)`, [`BlockTables::groups`] `G`; one group is `G = 1`, the same buffer as
//! a 2-D `[rows, cols]`). Row `r` of every group's plane belongs to one sequence: rows `0..S`
//! hold the last batch's sequences in batch order, so group `g`'s dense table of the batch is
//! `[g, ..S, ..W]` with row stride `cols` (no gather, no copy); rows `S..held` keep recently
//! absent sequences. A sequence that changes position is moved by swapping two rows (in every
//! group). Entries past a table's length are always 0 (the null block), which is the dense
//! table's padding; a windowed group's released entries arrive as 0 in the deltas.
//!
//! An update is two calls, so that the caller can grow its buffer in between and nothing
//! changes when a call fails: [`BlockTables::prepare`] (one group) or
//! [`BlockTables::prepare_groups`] checks the deltas, decides which follow the rows held and
//! reads whole the tables of those that do not; [`BlockTables::apply`] writes. A delta applies
//! only to the version of the tables it follows ([`StepOutput::table_version`], one per
//! sequence for every group): a sequence whose previous report was not applied here (new to
//! this object, released while absent, an output skipped, or an id reused by a new sequence,
//! whose versions continue above every earlier one) is read whole, and so is one whose whole
//! report is older than the version held (an output fed twice or out of order), so every row
//! ends as the manager's current tables.

use crate::error::{Error, Result};
use crate::manager::StepOutput;
use crate::{BlockId, SeqId, NULL_BLOCK};

/// Absent sequences kept beyond the batch before they are all released: a sequence missing
/// from a batch keeps its row while at most `S + KEEP_ABSENT` sequences are absent.
pub const KEEP_ABSENT: usize = 64;

/// One step output's table deltas, borrowed: the scheduled sequences' ids (a prefix of the
/// request's ids) and the output's `table_start`, `table_version`, `table_delta_indptr` and
/// `table_delta` arrays (see [`StepOutput`]). With `G` groups (1 for one full-attention
/// group) the per-table arrays have one entry per (sequence, group), entry
/// `k * G + g` for sequence `k` and group `g`; the version is per sequence.
#[derive(Debug, Clone, Copy)]
pub struct TableDeltas<'a> {
    /// The scheduled sequences, in batch order (`S` ids).
    pub seq_ids: &'a [SeqId],
    /// `S x G` first changed logical blocks (entry `k * G + g`).
    pub table_start: &'a [i32],
    /// `S` table versions (one per sequence, every group's tables).
    pub table_version: &'a [u64],
    /// `S x G + 1` CSR offsets into `table_delta` (entry `k * G + g`).
    pub table_delta_indptr: &'a [i32],
    /// The changed entries (block ids), table after table.
    pub table_delta: &'a [i32],
}

impl<'a> TableDeltas<'a> {
    /// The deltas of `out` (every group's), whose request listed `seq_ids` first (only the
    /// first `out.num_scheduled` are used), for [`BlockTables`] of `out.num_groups` groups.
    /// Panics if fewer ids than scheduled sequences are given.
    pub fn new(seq_ids: &'a [SeqId], out: &'a StepOutput) -> Self {
        Self {
            seq_ids: &seq_ids[..out.num_scheduled],
            table_start: &out.table_start,
            table_version: &out.table_version,
            table_delta_indptr: &out.table_delta_indptr,
            table_delta: &out.table_delta,
        }
    }

    /// Checks the arrays' lengths for `groups` groups and the first and last offset, O(1);
    /// [`Self::check_entry`] checks each table's offsets and start as they are read, so that
    /// applying them cannot index out of bounds.
    fn validate(&self, groups: usize) -> Result<()> {
        let n = self.seq_ids.len();
        if self.table_start.len() != n * groups || self.table_version.len() != n {
            return Err(Error::InvalidArgument {
                arg: "table_start",
                value: format!("{n} sequences x {groups} groups"),
                reason: format!(
                    "table_start has {} entries and table_version {}, expected one per \
                     (sequence, group) and one per sequence",
                    self.table_start.len(),
                    self.table_version.len()
                ),
            });
        }
        let p = self.table_delta_indptr;
        if p.len() != n * groups + 1
            || p[0] != 0
            || p[n * groups] as usize != self.table_delta.len()
        {
            return Err(self.bad_indptr(groups));
        }
        Ok(())
    }

    /// Table `i`'s offsets do not go back or past `table_delta`, and its start is >= 0 (after
    /// [`Self::validate`]).
    #[inline(always)]
    fn check_entry(&self, i: usize, groups: usize) -> Result<()> {
        let (a, b) = (self.table_delta_indptr[i], self.table_delta_indptr[i + 1]);
        if a > b || b as usize > self.table_delta.len() {
            return Err(self.bad_indptr(groups));
        }
        if self.table_start[i] < 0 {
            return Err(Error::InvalidArgument {
                arg: "table_start",
                value: self.table_start[i].to_string(),
                reason: "table starts must be >= 0".into(),
            });
        }
        Ok(())
    }

    fn bad_indptr(&self, groups: usize) -> Error {
        let n = self.seq_ids.len();
        Error::InvalidArgument {
            arg: "table_delta_indptr",
            value: format!("{n} sequences x {groups} groups"),
            reason: format!(
                "expected {} non-decreasing offsets from 0 to len(table_delta) = {}",
                n * groups + 1,
                self.table_delta.len()
            ),
        }
    }

    /// Entries of table `i`'s delta.
    #[inline(always)]
    fn entries(&self, i: usize) -> &'a [i32] {
        let (a, b) = (
            self.table_delta_indptr[i] as usize,
            self.table_delta_indptr[i + 1] as usize,
        );
        &self.table_delta[a..b]
    }
}

/// The tables read whole by [`BlockTables::prepare`], `G` per sequence, flat.
#[derive(Debug, Default)]
struct Rereads {
    /// Batch index of each sequence read whole, in batch order.
    seqs: Vec<usize>,
    /// End offset in `entries` of each table read (`G` per sequence).
    ends: Vec<usize>,
    entries: Vec<i32>,
    /// The longest table read.
    longest: usize,
}

impl Rereads {
    fn push(&mut self, table: &[BlockId]) {
        self.entries.extend(table.iter().map(|&b| b as i32));
        self.ends.push(self.entries.len());
        self.longest = self.longest.max(table.len());
    }

    /// Table `i` (the `i / G`-th sequence read, group `i % G`).
    #[inline]
    fn table(&self, i: usize) -> &[i32] {
        let a = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.entries[a..self.ends[i]]
    }
}

/// An update checked by [`BlockTables::prepare`], to be written by [`BlockTables::apply`].
#[derive(Debug)]
pub struct PendingUpdate<'a> {
    parts: &'a [TableDeltas<'a>],
    /// Sequences in the batch.
    n: usize,
    rereads: Rereads,
    /// Sequences of the batch no row holds yet.
    new_seqs: usize,
    /// Columns the longest table needs.
    cols: usize,
    /// Every sequence is already at its batch row.
    in_order: bool,
}

impl PendingUpdate<'_> {
    /// Sequences in the batch (`S`, the rows of the dense tables [`BlockTables::apply`] makes).
    pub fn num_sequences(&self) -> usize {
        self.n
    }
}

/// Block tables of `G` KV cache groups kept across scheduler steps and updated from the step
/// outputs' table deltas (see the module docs). Not thread-safe by itself (`&mut self`
/// updates).
///
/// Cost of an update: O(S x G + changed entries) when the batch keeps its order, plus one row
/// swap (every group) per sequence that moved and one whole read (every group) per sequence
/// whose previous report was not applied.
#[derive(Debug, Clone)]
pub struct BlockTables {
    groups: usize,
    cols: usize,
    /// Per row: its sequence (rows `held..` are None) and table version (0: none, so no delta
    /// follows it; versions start at 1).
    seqs: Vec<Option<SeqId>>,
    versions: Vec<u64>,
    /// Entries held per row and group, entry `row * G + group`.
    lens: Vec<usize>,
    row_of: foldhash::HashMap<SeqId, usize>,
    /// Rows `0..held` hold a sequence; the last batch is rows `0..S`.
    held: usize,
    num_table_reads: u64,
}

impl BlockTables {
    /// Empty tables of one group for a buffer of `rows x cols` entries (each at least 1; both
    /// grow on demand, see [`Self::grown_shape`]).
    pub fn new(rows: usize, cols: usize) -> Self {
        Self::with_groups(1, rows, cols)
    }

    /// Empty tables of `groups` KV cache groups (at least 1) for a buffer of `groups x rows x
    /// cols` entries (`rows`, `cols` each at least 1; both grow on demand).
    pub fn with_groups(groups: usize, rows: usize, cols: usize) -> Self {
        let (groups, rows) = (groups.max(1), rows.max(1));
        Self {
            groups,
            cols: cols.max(1),
            seqs: vec![None; rows],
            versions: vec![0; rows],
            lens: vec![0; rows * groups],
            row_of: foldhash::HashMap::default(),
            held: 0,
            num_table_reads: 0,
        }
    }

    /// `G`, the KV cache groups whose tables are kept.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// `(rows, cols)` of each group's plane of the buffer the caller keeps: row-major
    /// `[G, rows, cols]`, `G * rows * cols` entries ([`Self::buffer_len`]); group `g`'s row `r`
    /// starts at `(g * rows + r) * cols`.
    pub fn shape(&self) -> (usize, usize) {
        (self.seqs.len(), self.cols)
    }

    /// Entries of the buffer of [`Self::shape`]: `G * rows * cols`.
    pub fn buffer_len(&self) -> usize {
        self.groups * self.seqs.len() * self.cols
    }

    /// Sequences whose tables are held (the last batch, plus recently absent ones).
    pub fn num_rows(&self) -> usize {
        self.held
    }

    /// Sequences read whole so far (their previous report was not applied); every other row
    /// was updated from its deltas alone.
    pub fn num_table_reads(&self) -> u64 {
        self.num_table_reads
    }

    /// The row holding `seq` and its longest table over the groups, in blocks, if held.
    pub fn row_of(&self, seq: SeqId) -> Option<(usize, usize)> {
        self.row_lens(seq)
            .map(|(r, lens)| (r, lens.iter().copied().max().unwrap_or(0)))
    }

    /// The row holding `seq` and the length of each group's table there (`G` entries), if
    /// held.
    pub fn row_lens(&self, seq: SeqId) -> Option<(usize, &[usize])> {
        let g = self.groups;
        self.row_of
            .get(&seq)
            .map(|&r| (r, &self.lens[r * g..(r + 1) * g]))
    }

    /// Checks `parts` (the step outputs of one scheduler step, in batch order) against the
    /// rows held, without changing anything: which deltas follow the version held, and, for
    /// the others, the whole table from `read_whole` (the manager's
    /// [`crate::KvCacheManager::block_tables`]). One group only ([`Self::prepare_groups`]
    /// reads every group's tables).
    ///
    /// Errors: [`Error::InvalidArgument`] (`arg` "steps") for a sequence scheduled twice across
    /// `parts`, or arrays that disagree (see [`TableDeltas`]), or (`arg` "groups") tables of
    /// more than one group; whatever `read_whole` returns ([`Error::UnknownSequence`] for a
    /// table to read whole of a sequence the manager no longer holds: an output applied after
    /// its sequence was freed).
    pub fn prepare<'a>(
        &self,
        parts: &'a [TableDeltas<'a>],
        mut read_whole: impl FnMut(SeqId) -> Result<Vec<BlockId>>,
    ) -> Result<PendingUpdate<'a>> {
        if self.groups != 1 {
            return Err(Error::InvalidArgument {
                arg: "groups",
                value: self.groups.to_string(),
                reason: "prepare reads one table per sequence; use prepare_groups".into(),
            });
        }
        // The loop is compiled here once (not per caller), so its helpers inline.
        self.prepare_dyn(parts, &mut |id, rereads| {
            rereads.push(&read_whole(id)?);
            Ok(())
        })
    }

    /// [`Self::prepare`] for every group: `read_whole` returns a sequence's `G` tables (the
    /// manager's [`crate::KvCacheManager::block_tables`]).
    ///
    /// Errors: as [`Self::prepare`]; [`Error::InvalidArgument`] (`arg` "read_whole") when
    /// `read_whole` returns another number of tables than `G`.
    pub fn prepare_groups<'a>(
        &self,
        parts: &'a [TableDeltas<'a>],
        mut read_whole: impl FnMut(SeqId) -> Result<Vec<Vec<BlockId>>>,
    ) -> Result<PendingUpdate<'a>> {
        let g = self.groups;
        self.prepare_dyn(parts, &mut |id, rereads| {
            let tables = read_whole(id)?;
            if tables.len() != g {
                return Err(Error::InvalidArgument {
                    arg: "read_whole",
                    value: format!("{} tables", tables.len()),
                    reason: format!("expected one table per group ({g})"),
                });
            }
            for t in &tables {
                rereads.push(t);
            }
            Ok(())
        })
    }

    fn prepare_dyn<'a>(
        &self,
        parts: &'a [TableDeltas<'a>],
        read_whole: &mut dyn FnMut(SeqId, &mut Rereads) -> Result<()>,
    ) -> Result<PendingUpdate<'a>> {
        let g = self.groups;
        for p in parts {
            p.validate(g)?;
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
        // One group: the loops over groups compiled away (the one-group cost is unchanged).
        let (rereads, cols, new_seqs, in_order) = if g == 1 {
            self.scan::<1>(parts, read_whole)?
        } else {
            self.scan::<0>(parts, read_whole)?
        };
        Ok(PendingUpdate {
            parts,
            n,
            rereads,
            new_seqs,
            cols,
            in_order,
        })
    }

    /// The per-sequence pass of [`Self::prepare_dyn`]: `(rereads, columns needed, new
    /// sequences, in order)`. `FIXED`: the group count when known at compile time (1), else 0.
    #[inline(always)]
    fn scan<const FIXED: usize>(
        &self,
        parts: &[TableDeltas<'_>],
        read_whole: &mut dyn FnMut(SeqId, &mut Rereads) -> Result<()>,
    ) -> Result<(Rereads, usize, usize, bool)> {
        let g = if FIXED == 0 { self.groups } else { FIXED };
        let mut rereads = Rereads::default();
        let (mut cols, mut new_seqs, mut k) = (1usize, 0usize, 0usize);
        let mut in_order = true;
        for p in parts {
            for (j, &id) in p.seq_ids.iter().enumerate() {
                let row = self.row(k, id);
                new_seqs += usize::from(row.is_none());
                in_order &= row == Some(k);
                let version = row.map_or(0, |r| self.versions[r]);
                let reported = p.table_version[j];
                let follows = version != 0 && version.checked_add(1) == Some(reported);
                // Every group's delta fits on the table held; all start at 0: a whole report.
                let (mut fits, mut whole, mut end) = (true, true, 0usize);
                for x in 0..g {
                    let i = j * g + x;
                    p.check_entry(i, g)?;
                    let start = p.table_start[i] as usize;
                    fits &= row.is_some_and(|r| start <= self.lens[r * g + x]);
                    whole &= start == 0;
                    // checked above: the offsets do not go back
                    let m = (p.table_delta_indptr[i + 1] - p.table_delta_indptr[i]) as usize;
                    end = end.max(start + m);
                }
                // A whole report older than the row's version (an output fed twice or out of
                // order) is stale: the tables are read whole instead.
                if (whole && reported > version) || (follows && fits) {
                    cols = cols.max(end);
                } else {
                    read_whole(id, &mut rereads)?;
                    rereads.seqs.push(k);
                }
                k += 1;
            }
        }
        let cols = cols.max(rereads.longest);
        Ok((rereads, cols, new_seqs, in_order))
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

    /// Moves the held rows from `old` (of [`Self::shape`]) into `new`, a buffer of `G x rows x
    /// cols` entries, and makes that the shape; every other entry of `new` is set to 0.
    /// Panics unless `rows` and `cols` are at least the current shape and the buffers have
    /// the sizes of their shapes. O(G x rows x cols).
    pub fn regrow(&mut self, old: &[i32], new: &mut [i32], rows: usize, cols: usize) {
        let (old_rows, old_cols) = self.shape();
        let g = self.groups;
        assert!(rows >= old_rows && cols >= old_cols, "tables only grow");
        assert_eq!(old.len(), self.buffer_len(), "old buffer of the old shape");
        assert_eq!(new.len(), g * rows * cols, "new buffer of the new shape");
        for (i, row) in new.chunks_exact_mut(cols).enumerate() {
            let (x, r) = (i / rows, i % rows);
            let len = if r < self.held {
                let len = self.lens[r * g + x];
                let at = (x * old_rows + r) * old_cols;
                row[..len].copy_from_slice(&old[at..at + len]);
                len
            } else {
                0
            };
            row[len..].fill(NULL_BLOCK as i32);
        }
        self.cols = cols;
        self.seqs.resize(rows, None);
        self.versions.resize(rows, 0);
        self.lens.resize(rows * g, 0);
    }

    /// Writes `pending` (from [`Self::prepare`] or [`Self::prepare_groups`] on this object,
    /// with no other update in between) into `table`, the buffer of [`Self::shape`] (grown
    /// first if [`Self::grown_shape`] asked for it), and returns `(S, W)`: group `g`'s dense
    /// table of the batch is rows `0..S`, columns `0..W` of its plane (`table[g * rows * cols
    /// ..]` with row stride `cols`), row `k` the `k`-th scheduled sequence's group-`g` table
    /// padded with the null block, `W` the longest table of any group (at least 1). Panics if
    /// `table` is smaller than the shape needs. Cannot fail otherwise.
    pub fn apply(&mut self, table: &mut [i32], pending: PendingUpdate<'_>) -> (usize, usize) {
        let (rows, cols) = self.shape();
        let g = self.groups;
        assert!(
            table.len() >= g * rows * cols && self.held + pending.new_seqs <= rows,
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
                            self.lens[r * g..(r + 1) * g].fill(0);
                            self.versions[r] = 0;
                            self.row_of.insert(id, r);
                            r
                        }
                    };
                    self.swap_rows(table, k, r);
                }
            }
        }
        let plane = rows * cols;
        if self.held - n > n + KEEP_ABSENT {
            // Too many sequences absent from the batch (finished, or waiting): release them.
            for r in n..self.held {
                for x in 0..g {
                    let at = x * plane + r * cols;
                    table[at..at + self.lens[r * g + x]].fill(NULL_BLOCK as i32);
                }
                if let Some(id) = self.seqs[r].take() {
                    self.row_of.remove(&id);
                }
                self.lens[r * g..(r + 1) * g].fill(0);
                self.versions[r] = 0;
            }
            self.held = n;
        }

        let width = if g == 1 {
            self.write::<1>(table, parts, &rereads)
        } else {
            self.write::<0>(table, parts, &rereads)
        };
        (n, width.max(1))
    }

    /// The deltas pass of [`Self::apply`]; returns the longest table. `FIXED` as in
    /// [`Self::scan`].
    #[inline(always)]
    fn write<const FIXED: usize>(
        &mut self,
        table: &mut [i32],
        parts: &[TableDeltas<'_>],
        rereads: &Rereads,
    ) -> usize {
        // The deltas (or whole tables), each into its row; stale entries past the new end
        // (a preempted sequence restarting shorter) are zeroed.
        let g = if FIXED == 0 { self.groups } else { FIXED };
        let (rows, cols) = self.shape();
        let plane = rows * cols;
        let (mut width, mut k) = (0usize, 0usize);
        // rereads are in batch order: the next one's batch index, usize::MAX after the last
        // (a plain index: a peekable iterator here costs a store-forwarding stall per sequence)
        let (mut next, mut reread_at) = (0, rereads.seqs.first().copied().unwrap_or(usize::MAX));
        for p in parts {
            for j in 0..p.seq_ids.len() {
                let read = k == reread_at;
                for x in 0..g {
                    let at = x * plane + k * cols;
                    let row = &mut table[at..at + cols];
                    let end = if read {
                        let whole = rereads.table(next * g + x);
                        row[..whole.len()].copy_from_slice(whole);
                        whole.len()
                    } else {
                        let i = j * g + x;
                        let start = p.table_start[i] as usize;
                        let entries = p.entries(i);
                        // most decode deltas are empty or one new block: no memcpy call
                        match entries.len() {
                            0 => {}
                            1 => row[start] = entries[0],
                            m => row[start..start + m].copy_from_slice(entries),
                        }
                        start + entries.len()
                    };
                    let len = &mut self.lens[k * g + x];
                    if end < *len {
                        row[end..*len].fill(NULL_BLOCK as i32);
                    }
                    *len = end;
                    width = width.max(end);
                }
                if read {
                    next += 1;
                    reread_at = rereads.seqs.get(next).copied().unwrap_or(usize::MAX);
                    self.num_table_reads += 1;
                }
                self.versions[k] = p.table_version[j];
                k += 1;
            }
        }
        width
    }

    /// The row holding `id` (checked at row `k` first: the steady state), if any.
    #[inline]
    fn row(&self, k: usize, id: SeqId) -> Option<usize> {
        if self.seqs.get(k) == Some(&Some(id)) {
            return Some(k);
        }
        self.row_of.get(&id).copied()
    }

    /// Swaps rows `a` and `b` of every group with their bookkeeping (entries past both
    /// lengths are 0 in both).
    fn swap_rows(&mut self, table: &mut [i32], a: usize, b: usize) {
        if a == b {
            return;
        }
        let (g, cols) = (self.groups, self.cols);
        let plane = self.seqs.len() * cols;
        let (lo, hi) = (a.min(b), a.max(b));
        for x in 0..g {
            let used = self.lens[a * g + x].max(self.lens[b * g + x]);
            let (head, tail) = table[x * plane..].split_at_mut(hi * cols);
            head[lo * cols..lo * cols + used].swap_with_slice(&mut tail[..used]);
            self.lens.swap(a * g + x, b * g + x);
        }
        self.seqs.swap(a, b);
        self.versions.swap(a, b);
        for r in [a, b] {
            if let Some(id) = self.seqs[r] {
                self.row_of.insert(id, r);
            }
        }
    }
}
