//! `pagedkv._core.BlockTable`: block tables kept across scheduler steps and updated from the
//! step outputs' table deltas, as vLLM's GPU model runner keeps its block tables (one per KV
//! cache group) and applies only the changes. The algorithm (seq-id -> row bookkeeping, the
//! version check, row moves, the deltas) is the core's [`BlockTables`]; this wrapper keeps its
//! buffer as a numpy array, hands the step outputs' arrays to it and returns the dense tables
//! as a view, so a steady decode step costs O(batch x groups + changed entries).
//!
//! Layout: one persistent C-contiguous `int32[G, capacity, cols]` numpy buffer (`G` KV cache
//! groups of the manager, 1 for the one-group configuration); the batch's dense tables are the
//! view `buffer[:, :S, :W]` (no gather, no copy).

use crate::convert::{bad, count, list_items, repr, type_name};
use crate::errors::IntoPyResult;
use crate::manager::PyKvCacheManager;
use crate::step_output::PyStepOutput;
use numpy::ndarray::{ArrayView3, ShapeBuilder};
use numpy::{PyArray3, PyArrayMethods, PyUntypedArray};
use pagedkv_core::block_tables::{BlockTables, PendingUpdate, TableDeltas};
use pagedkv_core::HybridManager;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use std::sync::Arc;

/// Block tables kept across scheduler steps, updated from the step outputs' table deltas
/// (PagedAttention's block tables, Kwon et al., SOSP'23; kept on the consumer side as vLLM's
/// GPU model runner keeps its block tables, one per KV cache group, and applies the
/// scheduler's new block ids).
///
/// ``KVCacheManager.step`` reports, per scheduled sequence and KV cache group, only the entries of its block table that changed since the last step output that
/// reported it (``table_start`` / ``table_delta``: the blocks appended this step, or the whole
/// table after a first allocation, a resumed preemption, a swap-in or a fork, the tail from a
/// copy-on-write on, or a window release's null entries). ``update`` applies them in one call
/// and returns the batch's dense tables. Rows are kept in batch order, so a batch of the same
/// sequences as the last one costs O(S x G + changed entries) and its dense tables are a view
/// of the persistent buffer (no copy); a sequence that changes position costs one row swap
/// (every group).
///
/// A delta applies only to the version of the tables it follows (``table_version``, one per
/// sequence for every group); a sequence whose previous report this object did not see (a new
/// ``BlockTable``, a sequence released while absent, an output skipped, an id reused by a new
/// sequence: its versions continue above every earlier one) is read whole from the manager,
/// and so is one whose whole report is older than the version held (an output fed twice or
/// out of order), so the result is always the manager's current tables. Feed it every step
/// output of its manager, in order, before the next ``step``. Sequences missing from a batch
/// keep their rows while at most ``S + 64`` of them are absent (``S`` = the batch), else all
/// absent ones are released. Not thread-safe (a concurrent call raises ``RuntimeError``).
///
/// Args:
///     manager: the ``KVCacheManager`` whose step outputs (``StepOutput``) are applied;
///         ``update`` returns ``int32[G, S, W]`` (``G = manager.num_groups``; a one-group
///         caller takes ``[0]``).
///     rows, width: initial capacity (sequences x blocks; 0 counts as 1), at most ``2**20``
///         rows, ``MAX_BLOCKS`` columns and ``2**28`` entries over every group; both grow on
///         demand.
///
/// Raises:
///     InvalidArgumentError: ``manager`` is not a ``KVCacheManager``, or ``rows`` / ``width``
///         is not a non-negative int or is above those bounds.
#[pyclass(module = "pagedkv._core", name = "BlockTable")]
pub(crate) struct PyBlockTable {
    manager: Arc<HybridManager>,
    /// `int32[G, rows, cols]` of `tables.groups()` x `tables.shape()`, C-contiguous; replaced
    /// (not resized) when it grows, so views handed out earlier keep their own buffer alive.
    buffer: Py<PyArray3<i32>>,
    tables: BlockTables,
    /// The last view handed out, `(rows, columns, view)`: the next batch of the same shape
    /// gets the same array object back (its contents updated in place), so consumers can
    /// reuse what they built on it (a torch tensor sharing it).
    view: Option<(usize, usize, Py<PyUntypedArray>)>,
}

/// Largest initial `rows` (sequences) a `BlockTable` allocates at construction.
const MAX_ROWS: usize = 1 << 20;
/// Largest initial `width`: no table holds more blocks than a pool has.
const MAX_WIDTH: usize = pagedkv_core::pool::MAX_BLOCKS as usize;
/// Largest initial buffer, in int32 entries (1 GiB).
const MAX_ENTRIES: usize = 1 << 28;

/// `steps` (one output of type `T` or a list / tuple of them) as a list.
fn step_list<'py, T: pyo3::PyClass>(
    steps: &Bound<'py, PyAny>,
    expected: &str,
) -> PyResult<Vec<Bound<'py, T>>> {
    if let Ok(s) = steps.cast::<T>() {
        return Ok(vec![s.clone()]);
    }
    if !steps.is_instance_of::<PyList>() && !steps.is_instance_of::<PyTuple>() {
        let reason = format!(
            "expected a {expected} or a list / tuple of them, got {}",
            type_name(steps)
        );
        return Err(bad(steps.py(), "steps", repr(steps), reason));
    }
    list_items(steps, "steps")?
        .iter()
        .map(|s| {
            s.cast::<T>().cloned().map_err(|_| {
                let reason = format!("expected a {expected}, got {}", type_name(s));
                bad(steps.py(), "steps", repr(s), reason)
            })
        })
        .collect()
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
        let manager = match manager.cast::<PyKvCacheManager>() {
            Ok(m) => m.get().inner.clone(),
            Err(_) => {
                let reason = format!(
                    "expected a pagedkv.KVCacheManager, got {}",
                    type_name(manager)
                );
                return Err(bad(py, "manager", repr(manager), reason));
            }
        };
        let groups = manager.num_groups();
        let rows = rows.map_or(Ok(64), |r| count(r, "rows"))?;
        let cols = width.map_or(Ok(64), |w| count(w, "width"))?;
        // Capacity hints are allocated at once: one too large to allocate would abort the
        // process, so each is bounded (both still grow on demand past the hint).
        for (arg, value, max) in [("rows", rows, MAX_ROWS), ("width", cols, MAX_WIDTH)] {
            if value > max {
                let reason = format!("an initial capacity of at most {max}");
                return Err(bad(py, arg, value.to_string(), reason));
            }
        }
        let entries = rows.saturating_mul(cols).saturating_mul(groups);
        if entries > MAX_ENTRIES {
            let reason = format!(
                "groups x rows x width = {entries} entries; an initial capacity of at most \
                 {MAX_ENTRIES}"
            );
            return Err(bad(py, "rows", rows.to_string(), reason));
        }
        let tables = BlockTables::with_groups(groups, rows, cols);
        let (r, c) = tables.shape();
        Ok(Self {
            manager,
            buffer: PyArray3::zeros(py, (groups, r, c), false).unbind(),
            tables,
            view: None,
        })
    }

    /// ``G``: the KV cache groups whose tables are kept (the manager's ``num_groups``).
    #[getter]
    fn num_groups(&self) -> usize {
        self.tables.groups()
    }

    /// Sequences whose tables are held (the last batch, plus recently absent ones).
    #[getter]
    fn num_rows(&self) -> usize {
        self.tables.num_rows()
    }

    /// Sequences read whole from the manager so far (their previous report this object did
    /// not apply); every other row was updated from its deltas alone.
    #[getter]
    fn num_table_reads(&self) -> u64 {
        self.tables.num_table_reads()
    }

    /// Applies the table deltas of ``steps`` (the ``StepOutput`` s of one scheduler step, in
    /// batch order; one output or a list / tuple of them) and returns the batch's dense block
    /// tables ``int32[G, S, W]``: row ``k`` of group ``g`` is the ``k``-th scheduled
    /// sequence's group-``g`` table (physical block ids in logical order) padded, and for
    /// released window entries set, with the null block 0; ``W`` is the longest table of any
    /// group (at least 1). A one-group caller takes ``[0]``.
    ///
    /// The result is a view of this object's buffer (row stride >= ``W``; ``torch.from_numpy``
    /// shares it): valid until the next ``update``, which may overwrite it; do not write to it.
    /// The next ``update`` of a batch of the same shape returns the same array object.
    /// O(S x G + changed entries) when the batch keeps its order, plus one row swap per
    /// sequence that moved and one manager read per sequence whose previous report was not
    /// applied.
    ///
    /// Raises:
    ///     InvalidArgumentError: ``steps`` is not a ``StepOutput`` or a list / tuple of them,
    ///         has another number of groups than the manager, or schedules a sequence twice.
    ///     UnknownSequenceError: a table to read whole belongs to a sequence the manager no
    ///         longer holds (an output applied after its sequence was freed).
    ///
    /// On error nothing changes.
    fn update<'py>(
        &mut self,
        py: Python<'py>,
        steps: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // The outputs outlive `parts`, which borrows their arrays.
        let steps: Vec<Bound<'py, PyStepOutput>> =
            step_list::<PyStepOutput>(steps, "pagedkv.StepOutput")?;
        let g = self.tables.groups();
        let mut parts = Vec::with_capacity(steps.len());
        // Everything that can fail happens before the first write.
        for (i, step) in steps.iter().enumerate() {
            let s = step.get();
            if s.num_groups != g {
                let reason = format!("has {} groups; the manager has {g}", s.num_groups);
                return Err(bad(py, "steps", format!("steps[{i}]"), reason));
            }
            // SAFETY: the core made these arrays from Vecs (contiguous; table_start is a
            // C-contiguous [S, G] array), the getters hand out the same arrays but nothing in
            // the package writes them, the GIL is held and the slices do not outlive this call
            // (the core checks that they agree in length).
            unsafe {
                parts.push(TableDeltas {
                    seq_ids: s.seq_ids.bind(py).as_slice()?,
                    table_start: s.table_start.bind(py).as_slice()?,
                    table_version: s.table_version.bind(py).as_slice()?,
                    table_delta_indptr: s.table_delta_indptr.bind(py).as_slice()?,
                    table_delta: s.table_delta.bind(py).as_slice()?,
                });
            }
        }
        let m = &self.manager;
        let pending: PendingUpdate<'_> = self
            .tables
            .prepare_groups(&parts, |id| py.detach(|| m.block_tables(id)))
            .py(py)?;
        let g = self.tables.groups();
        if let Some((rows, cols)) = self.tables.grown_shape(&pending) {
            let grown = PyArray3::<i32>::zeros(py, (g, rows, cols), false);
            // SAFETY: both buffers are C-contiguous and private (the new one just made); GIL held.
            unsafe {
                let old = self.buffer.bind(py).as_slice()?;
                self.tables.regrow(old, grown.as_slice_mut()?, rows, cols);
            }
            self.buffer = grown.unbind();
            self.view = None; // it shows the old buffer
        }
        let buffer = self.buffer.bind(py).clone();
        // SAFETY: the buffer is C-contiguous and private; the views handed out of it are only
        // read (documented), and the GIL is held for the whole update.
        let table = unsafe { buffer.as_slice_mut()? };
        let (n, w) = self.tables.apply(table, pending);

        if let Some((rows, cols, view)) = &self.view {
            if (*rows, *cols) == (n, w) {
                return Ok(view.bind(py).clone().into_any());
            }
        }
        let (rows, cols) = self.tables.shape();
        // SAFETY: rows 0..n and columns 0..w of every group lie inside the buffer (n <= rows,
        // w <= cols), and the view keeps the buffer alive as its base object; the buffer is
        // never resized in place (growing replaces it).
        let view = unsafe {
            let v = ArrayView3::from_shape_ptr(
                (g, n, w).strides((rows * cols, cols, 1)),
                table.as_ptr(),
            );
            PyArray3::borrow_from_array(&v, buffer.into_any()).into_any()
        };
        self.view = Some((n, w, view.cast::<PyUntypedArray>()?.clone().unbind()));
        Ok(view)
    }

    fn __repr__(&self) -> String {
        let (rows, cols) = self.tables.shape();
        format!(
            "BlockTable(num_groups={}, num_rows={}, capacity={rows}x{cols}, num_table_reads={})",
            self.tables.groups(),
            self.tables.num_rows(),
            self.tables.num_table_reads()
        )
    }
}
