//! `pagedkv._core.BlockTable`: block tables kept across scheduler steps and updated from the
//! step outputs' table deltas, as vLLM's GPU model runner keeps its block table and applies
//! only the changes. One call per step does all of it (seq-id -> row bookkeeping, the deltas,
//! the batch's dense table), so a steady decode step costs O(batch + changed entries) here.
//!
//! Layout: one persistent C-contiguous `int32[capacity, cols]` numpy buffer. Rows `0..S` hold
//! the last batch's sequences in batch order, so the batch's dense table is the view
//! `buffer[:S, :W]` (no gather, no copy); rows `S..held` keep recently absent sequences. A
//! sequence that changes position is moved by swapping two rows. Entries past a row's length
//! are always 0 (the null block), which is the dense table's padding.

use crate::convert::{bad, count, list_items, repr, type_name};
use crate::errors::IntoPyResult;
use crate::manager::{PyKvCacheManager, PyStepOutput};
use numpy::ndarray::{ArrayView2, ShapeBuilder};
use numpy::{PyArray2, PyArrayMethods};
use pagedkv_core::KvCacheManager;
use pyo3::prelude::*;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Version of a row no delta follows (new to this object): its table comes from a delta that
/// starts at 0, or is read whole.
const FRESH: i64 = -2;

/// Absent sequences kept beyond the batch before they are all released.
const KEEP_ABSENT: usize = 64;

/// One step output's arrays, borrowed for one update.
struct Part<'a> {
    ids: &'a [u64],
    start: &'a [i32],
    version: &'a [u32],
    indptr: &'a [i32],
    delta: &'a [i32],
}

/// Block tables kept across scheduler steps, updated from the step outputs' table deltas
/// (PagedAttention's block tables, Kwon et al., SOSP'23; kept on the consumer side as vLLM's
/// GPU model runner keeps its block table and applies the scheduler's new block ids).
///
/// ``KVCacheManager.step`` reports, per scheduled sequence, only the entries of its block table
/// that changed since the last step output that reported it (``StepOutput.table_start`` /
/// ``table_delta``: the blocks appended this step, or the whole table after a first
/// allocation, a resumed preemption, a swap-in or a fork, or the tail from a copy-on-write
/// on). ``update`` applies them in one call and returns the batch's dense table. Rows are kept
/// in batch order, so a batch of the same sequences as the last one costs O(S + changed
/// entries) and its dense table is a view of the persistent buffer (no copy); a sequence that
/// changes position costs one row swap.
///
/// A delta applies only to the version of the table it follows (``StepOutput.table_version``);
/// a sequence whose previous report this object did not see (a new ``BlockTable``, a sequence
/// released while absent, an output skipped) is read whole from the manager, so the result is
/// always the manager's current table. Feed it every step output of its manager, in order,
/// before the next ``step``. Sequences missing from a batch keep their rows while at most
/// ``S + 64`` of them are absent (``S`` = the batch), else all absent ones are released. Not
/// thread-safe (a concurrent call raises ``RuntimeError``).
///
/// Args:
///     manager: the ``KVCacheManager`` whose step outputs are applied.
///     rows, width: initial capacity (sequences x blocks, each >= 1); both grow on demand.
///
/// Raises:
///     InvalidArgumentError: ``manager`` is not a ``KVCacheManager``, or ``rows`` / ``width``
///         is not a non-negative int.
#[pyclass(module = "pagedkv._core", name = "BlockTable")]
pub(crate) struct PyBlockTable {
    manager: Arc<KvCacheManager>,
    /// `int32[capacity, cols]`, C-contiguous; replaced (not resized) when it grows, so views
    /// handed out earlier keep their own buffer alive.
    buffer: Py<PyArray2<i32>>,
    cols: usize,
    /// Per row: its sequence (rows `held..` are None), entries held, table version.
    seqs: Vec<Option<u64>>,
    lens: Vec<usize>,
    versions: Vec<i64>,
    row_of: HashMap<u64, usize>,
    /// The last view handed out, `(rows, columns, view)`: the next batch of the same shape
    /// gets the same array object back (its contents updated in place), so consumers can
    /// reuse what they built on it (a torch tensor sharing it).
    view: Option<(usize, usize, Py<PyArray2<i32>>)>,
    /// Rows `0..held` hold a sequence; the last batch is rows `0..S`.
    held: usize,
    /// Whole tables read from the manager so far (sequences whose previous report this object
    /// did not apply); every other row was updated from its delta alone.
    #[pyo3(get)]
    num_table_reads: u64,
}

#[pymethods]
impl PyBlockTable {
    #[new]
    #[pyo3(signature = (manager, *, rows = None, width = None))]
    fn new(
        py: Python<'_>,
        manager: &Bound<'_, PyAny>,
        rows: Option<&Bound<'_, PyAny>>,
        width: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let Ok(m) = manager.cast::<PyKvCacheManager>() else {
            let reason = format!(
                "expected a pagedkv.KVCacheManager, got {}",
                type_name(manager)
            );
            return Err(bad(py, "manager", repr(manager), reason));
        };
        let rows = rows.map_or(Ok(64), |r| count(r, "rows"))?.max(1);
        let cols = width.map_or(Ok(64), |w| count(w, "width"))?.max(1);
        Ok(Self {
            manager: m.get().inner.clone(),
            buffer: PyArray2::zeros(py, (rows, cols), false).unbind(),
            cols,
            seqs: vec![None; rows],
            lens: vec![0; rows],
            versions: vec![FRESH; rows],
            row_of: HashMap::new(),
            view: None,
            held: 0,
            num_table_reads: 0,
        })
    }

    /// Sequences whose tables are held (the last batch, plus recently absent ones).
    #[getter]
    fn num_rows(&self) -> usize {
        self.held
    }

    /// Applies the table deltas of ``steps`` (the ``StepOutput``s of one scheduler step, in
    /// batch order; one output or a list / tuple of them) and returns the batch's dense block
    /// table ``int32[S, W]``: row ``k`` is the ``k``-th scheduled sequence's table (physical
    /// block ids in logical order) padded with the null block 0, ``W`` the longest table (at
    /// least 1).
    ///
    /// The result is a view of this object's buffer (row stride >= ``W``; ``torch.from_numpy``
    /// shares it): valid until the next ``update``, which may overwrite it; do not write to it.
    /// The next ``update`` of a batch of the same shape returns the same array object.
    /// O(S + changed entries) when the batch keeps its order, plus one row swap per sequence
    /// that moved and one manager read per sequence whose previous report was not applied.
    ///
    /// Raises:
    ///     InvalidArgumentError: ``steps`` is not a ``StepOutput`` or a list / tuple of them,
    ///         or schedules a sequence twice.
    ///     UnknownSequenceError: a table to read whole belongs to a sequence the manager no
    ///         longer holds (an output applied after its sequence was freed).
    ///
    /// On error nothing changes.
    fn update<'py>(
        &mut self,
        py: Python<'py>,
        steps: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let steps: Vec<Bound<'py, PyStepOutput>> = match steps.cast::<PyStepOutput>() {
            Ok(s) => vec![s.clone()],
            Err(_) => list_items(steps, "steps")?
                .iter()
                .map(|s| {
                    s.cast::<PyStepOutput>().cloned().map_err(|_| {
                        let reason = format!("expected a pagedkv.StepOutput, got {}", type_name(s));
                        bad(py, "steps", repr(s), reason)
                    })
                })
                .collect::<PyResult<_>>()?,
        };
        let mut parts = Vec::with_capacity(steps.len());
        for step in &steps {
            let s = step.get();
            // SAFETY: the core made these arrays from Vecs (contiguous), the getters hand out
            // the same arrays but nothing in the package writes them, and the GIL is held.
            unsafe {
                parts.push(Part {
                    ids: s.seq_ids.bind(py).as_slice()?,
                    start: s.table_start.bind(py).as_slice()?,
                    version: s.table_version.bind(py).as_slice()?,
                    indptr: s.table_delta_indptr.bind(py).as_slice()?,
                    delta: s.table_delta.bind(py).as_slice()?,
                });
            }
        }
        let n: usize = parts.iter().map(|p| p.ids.len()).sum();
        if parts.len() > 1 {
            // One output never lists a sequence twice (the core refuses it); several might.
            let mut seen = HashSet::with_capacity(n);
            if let Some(s) = parts.iter().flat_map(|p| p.ids).find(|s| !seen.insert(**s)) {
                let reason = format!("sequence {s} is scheduled twice in one batch");
                return Err(bad(py, "steps", format!("{n} sequences"), reason));
            }
        }

        // Everything that can fail happens before the first write: which deltas follow the
        // rows held, and the whole tables of those that do not.
        let mut rereads: Vec<(usize, Vec<i32>)> = Vec::new();
        let (mut needed, mut new_seqs, mut k) = (1usize, 0usize, 0usize);
        let mut in_order = true;
        for p in &parts {
            for (j, &id) in p.ids.iter().enumerate() {
                let row = self.row(k, id);
                new_seqs += usize::from(row.is_none());
                in_order &= row == Some(k);
                let (len, version) = row.map_or((0, FRESH), |r| (self.lens[r], self.versions[r]));
                let start = p.start[j] as usize;
                if start == 0 || (i64::from(p.version[j]) == version + 1 && start <= len) {
                    needed = needed.max(start + (p.indptr[j + 1] - p.indptr[j]) as usize);
                } else {
                    let m = &self.manager;
                    let whole = py.detach(|| m.block_table(id)).py(py)?;
                    needed = needed.max(whole.len());
                    rereads.push((k, whole.into_iter().map(|b| b as i32).collect()));
                }
                k += 1;
            }
        }
        self.reserve(py, self.held + new_seqs, needed);

        // SAFETY: the buffer is C-contiguous and private; the views handed out of it are only
        // read (documented), and the GIL is held for the whole update.
        let buffer = self.buffer.bind(py).clone();
        let table = unsafe { buffer.as_slice_mut()? };
        let cols = self.cols;
        // Rows in batch order: row k takes the k-th sequence (swapped in from its row, or
        // from a fresh one). Rows before k already hold the batch, so a sequence is at row
        // >= k, and each batch sequence is held or new: n <= held + new_seqs <= capacity.
        let mut k = 0;
        for p in parts.iter().filter(|_| !in_order) {
            for &id in p.ids {
                if self.seqs[k] != Some(id) {
                    let r = match self.row_of.get(&id) {
                        Some(&r) => r,
                        None => {
                            let r = self.held;
                            self.held += 1;
                            self.seqs[r] = Some(id);
                            self.lens[r] = 0;
                            self.versions[r] = FRESH;
                            self.row_of.insert(id, r);
                            r
                        }
                    };
                    self.swap_rows(table, cols, k, r);
                }
                k += 1;
            }
        }
        if self.held - n > n + KEEP_ABSENT {
            // Too many sequences absent from the batch (finished, or waiting): release them.
            for r in n..self.held {
                table[r * cols..r * cols + self.lens[r]].fill(0);
                if let Some(id) = self.seqs[r].take() {
                    self.row_of.remove(&id);
                }
                self.lens[r] = 0;
                self.versions[r] = FRESH;
            }
            self.held = n;
        }

        // The deltas (or whole tables), each into its row; stale entries past the new end
        // (a preempted sequence restarting shorter) are zeroed.
        let (mut width, mut k) = (0usize, 0usize);
        // rereads are in batch order: the next one's batch index, usize::MAX after the last
        let (mut next, mut reread_at) = (0, rereads.first().map_or(usize::MAX, |r| r.0));
        for p in &parts {
            for j in 0..p.ids.len() {
                let row = &mut table[k * cols..(k + 1) * cols];
                let (start, entries) = if k == reread_at {
                    let whole = &rereads[next].1;
                    next += 1;
                    reread_at = rereads.get(next).map_or(usize::MAX, |r| r.0);
                    self.num_table_reads += 1;
                    row[..whole.len()].copy_from_slice(whole);
                    (0, whole.len())
                } else {
                    let (a, b) = (p.indptr[j] as usize, p.indptr[j + 1] as usize);
                    let start = p.start[j] as usize;
                    // most decode deltas are empty or one new block: no memcpy call
                    match b - a {
                        0 => {}
                        1 => row[start] = p.delta[a],
                        _ => row[start..start + (b - a)].copy_from_slice(&p.delta[a..b]),
                    }
                    (start, b - a)
                };
                let end = start + entries;
                if end < self.lens[k] {
                    row[end..self.lens[k]].fill(0);
                }
                self.lens[k] = end;
                self.versions[k] = i64::from(p.version[j]);
                width = width.max(end);
                k += 1;
            }
        }

        let w = width.max(1);
        if let Some((rows, cols, view)) = &self.view {
            if (*rows, *cols) == (n, w) {
                return Ok(view.bind(py).clone());
            }
        }
        // SAFETY: rows 0..n and columns 0..w lie inside the buffer (n <= capacity, w <= cols),
        // and the view keeps the buffer alive as its base object; the buffer is never resized
        // in place (growing replaces it).
        unsafe {
            let view = ArrayView2::from_shape_ptr((n, w).strides((cols, 1)), table.as_ptr());
            let view = PyArray2::borrow_from_array(&view, buffer.into_any());
            self.view = Some((n, w, view.clone().unbind()));
            Ok(view)
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockTable(num_rows={}, capacity={}x{}, num_table_reads={})",
            self.held,
            self.seqs.len(),
            self.cols,
            self.num_table_reads
        )
    }
}

impl PyBlockTable {
    /// The row holding `id` (checked at row `k` first: the steady state), if any.
    fn row(&self, k: usize, id: u64) -> Option<usize> {
        if self.seqs.get(k) == Some(&Some(id)) {
            return Some(k);
        }
        self.row_of.get(&id).copied()
    }

    /// Grows the buffer to at least `rows` x `cols` (doubling), keeping the held rows.
    fn reserve(&mut self, py: Python<'_>, rows: usize, cols: usize) {
        let (old_rows, old_cols) = (self.seqs.len(), self.cols);
        if rows <= old_rows && cols <= old_cols {
            return;
        }
        let new_rows = if rows > old_rows {
            rows.max(2 * old_rows)
        } else {
            old_rows
        };
        let new_cols = if cols > old_cols {
            cols.max(2 * old_cols)
        } else {
            old_cols
        };
        let grown = PyArray2::<i32>::zeros(py, (new_rows, new_cols), false);
        {
            // SAFETY: both buffers are C-contiguous and private (the new one just made); GIL held.
            let (old, new) = unsafe {
                (
                    self.buffer.bind(py).as_slice().expect("contiguous"),
                    grown.as_slice_mut().expect("contiguous"),
                )
            };
            for r in 0..self.held {
                let len = self.lens[r];
                new[r * new_cols..r * new_cols + len]
                    .copy_from_slice(&old[r * old_cols..r * old_cols + len]);
            }
        }
        self.buffer = grown.unbind();
        self.view = None; // it shows the old buffer
        self.cols = new_cols;
        self.seqs.resize(new_rows, None);
        self.lens.resize(new_rows, 0);
        self.versions.resize(new_rows, FRESH);
    }

    /// Swaps rows `a` and `b` with their bookkeeping (entries past both lengths are 0 in both).
    fn swap_rows(&mut self, table: &mut [i32], cols: usize, a: usize, b: usize) {
        if a == b {
            return;
        }
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
