//! `pagedkv.SlotAllocation` and `pagedkv.StepOutput`: the results of
//! `KVCacheManager.allocate_slots` and `KVCacheManager.step`, as numpy arrays with a group
//! dimension (`G` KV cache groups; `G = 1` for the one-group configuration), built from the
//! core's vectors without copying them.

use crate::convert::bad;
use crate::errors::error_instance;
use numpy::ndarray::{Array2, Array3};
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArray3, PyUntypedArrayMethods};
use pagedkv_core::manager::SlotAllocation;
use pagedkv_core::{BlockId, StepOutput};
use pyo3::prelude::*;

/// Block ids as an ``int32`` array. Ids are below `MAX_BLOCKS` (2**28), so the cast is exact;
/// the `u32 -> i32` collect reuses the vector's buffer.
pub(crate) fn block_array(py: Python<'_>, ids: Vec<BlockId>) -> Py<PyArray1<i32>> {
    PyArray1::from_vec(py, ids.into_iter().map(|b| b as i32).collect()).unbind()
}

/// A row-major `rows x cols` buffer as a 2-D array, without copying it.
pub(crate) fn matrix<T: numpy::Element>(
    py: Python<'_>,
    flat: Vec<T>,
    rows: usize,
    cols: usize,
) -> Py<PyArray2<T>> {
    Array2::from_shape_vec((rows, cols), flat)
        .expect("rows x cols buffer")
        .into_pyarray(py)
        .unbind()
}

/// A flat row-major vector of triples as an ``int32[n, 3]`` array.
pub(crate) fn triples(py: Python<'_>, v: Vec<i32>) -> Py<PyArray2<i32>> {
    let n = v.len() / 3;
    matrix(py, v, n, 3)
}

/// `(a, b)` block pairs as `int32[k, 2]`.
pub(crate) fn pairs_array(py: Python<'_>, pairs: &[(BlockId, BlockId)]) -> Py<PyArray2<i32>> {
    let flat = pairs
        .iter()
        .flat_map(|&(a, b)| [a as i32, b as i32])
        .collect();
    matrix(py, flat, pairs.len(), 2)
}

/// The one-group spelling of a group-shaped array (`arr[0]`, a view), or
/// `InvalidArgumentError` when there are several groups.
fn group0<'py>(
    py: Python<'py>,
    arr: &Bound<'py, PyAny>,
    num_groups: usize,
    name: &'static str,
    plural: &str,
) -> PyResult<Bound<'py, PyAny>> {
    if num_groups != 1 {
        let reason = format!("{num_groups} KV cache groups: use {plural}[g]");
        return Err(bad(py, name, format!("{num_groups} groups"), reason));
    }
    arr.get_item(0)
}

/// What one ``KVCacheManager.allocate_slots`` call did (``G`` KV cache groups; each
/// attribute's docstring gives its unit). The arrays are built when read (each read returns a
/// new array), so the per-request call pays for none it does not use.
#[pyclass(frozen, module = "pagedkv._core", name = "SlotAllocation")]
pub(crate) struct PySlotAllocation {
    /// Tokens scheduled by this call (the query length): ``min(num_new_tokens, uncomputed)``.
    #[pyo3(get)]
    num_scheduled_tokens: usize,
    /// Tokens served from the prefix cache by this call (first allocation only; a multiple of
    /// the hit unit, ``block_size`` with one group).
    #[pyo3(get)]
    num_cached_tokens: usize,
    /// Tokens with KV present before the scheduled ones; the scheduled tokens occupy positions
    /// ``num_context_tokens .. num_context_tokens + num_scheduled_tokens``.
    #[pyo3(get)]
    num_context_tokens: usize,
    /// Draft tokens (speculative decoding) given lookahead slots right after the scheduled
    /// ones, pending until ``KVCacheManager.accept_drafts``; 0 without drafts.
    #[pyo3(get)]
    num_draft_tokens: usize,
    indptr: Vec<i32>,
    ids: Vec<i32>,
    /// Row-major `(group, src, dst)` triples.
    copy_rows: Vec<i32>,
    /// Row-major `(group, block)` pairs.
    zero_rows: Vec<i32>,
}

impl PySlotAllocation {
    /// The Python form of the core's allocation.
    pub(crate) fn from_core(a: SlotAllocation) -> Self {
        let g = a.groups.len();
        let mut indptr = Vec::with_capacity(g + 1);
        indptr.push(0i32);
        let mut ids = Vec::new();
        let mut copy_rows = Vec::new();
        let mut zero_rows = Vec::new();
        for (i, grp) in a.groups.into_iter().enumerate() {
            for &b in &grp.zero_blocks {
                zero_rows.extend([i as i32, b as i32]);
            }
            if ids.is_empty() && g == 1 {
                // one group: the core's vector, cast in place
                ids = grp.new_block_ids.into_iter().map(|b| b as i32).collect();
            } else {
                ids.extend(grp.new_block_ids.iter().map(|&b| b as i32));
            }
            indptr.push(ids.len() as i32);
            for (src, dst) in grp.copies {
                copy_rows.extend([i as i32, src as i32, dst as i32]);
            }
        }
        Self {
            num_scheduled_tokens: a.num_scheduled_tokens,
            num_cached_tokens: a.num_cached_tokens,
            num_context_tokens: a.num_context_tokens,
            num_draft_tokens: a.num_draft_tokens,
            indptr,
            ids,
            copy_rows,
            zero_rows,
        }
    }
}

#[pymethods]
impl PySlotAllocation {
    /// ``int32[G + 1]`` CSR offsets into ``new_block_ids``, one entry per group.
    #[getter]
    fn new_block_indptr<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        PyArray1::from_slice(py, &self.indptr)
    }

    /// ``int32[k]`` blocks newly taken from the free pool, group-major, each group's in
    /// block-table order (``new_block_ids[new_block_indptr[g]:new_block_indptr[g + 1]]``).
    #[getter]
    fn new_block_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        PyArray1::from_slice(py, &self.ids)
    }

    /// ``int32[c, 3]`` copy-on-write plan: ``(group, src, dst)`` rows to copy (in that
    /// group's layers) before writing.
    #[getter]
    fn copies(&self, py: Python<'_>) -> Py<PyArray2<i32>> {
        triples(py, self.copy_rows.clone())
    }

    /// ``int32[z, 2]`` ``(group, block)`` rows: fresh state blocks of state groups (no prefix
    /// hit: a first allocation or a resume after a recompute preemption) to zero after the
    /// copies, before the forward pass. Shape ``(0, 2)`` without state groups.
    #[getter]
    fn zero_blocks(&self, py: Python<'_>) -> Py<PyArray2<i32>> {
        let n = self.zero_rows.len() / 2;
        matrix(py, self.zero_rows.clone(), n, 2)
    }

    fn __repr__(&self) -> String {
        format!(
            "SlotAllocation(num_scheduled_tokens={}, num_cached_tokens={}, num_context_tokens={}, \
             num_draft_tokens={}, new_block_ids={:?}, copies={})",
            self.num_scheduled_tokens,
            self.num_cached_tokens,
            self.num_context_tokens,
            self.num_draft_tokens,
            self.ids,
            self.copy_rows.len() / 3,
        )
    }
}

/// The result of one batched ``KVCacheManager.step``: the scheduled sequences' kernel inputs
/// with a leading group dimension (``G`` KV cache groups, 1 for the one-group configuration;
/// ``S`` scheduled sequences, ``T`` scheduled tokens, ``W`` the longest table of any group).
/// Every array is C-contiguous numpy built by the core in the dtype the kernels take
/// (``int32`` block ids and lengths, ``int64`` slots and token ids), so ``torch.from_numpy``
/// shares it without a copy.
///
/// ``slot_mapping`` and ``block_table`` are the one-group spelling: group 0's row of
/// ``slot_mappings`` / ``block_tables`` (a view); with several groups reading them raises
/// ``InvalidArgumentError`` (use ``slot_mappings[g]`` / ``block_tables[g]``).
///
/// Sequences are processed in request order; processing stops at the first failure, so the
/// arrays describe the first ``num_scheduled`` sequences and ``error`` holds the exception (not
/// raised) that stopped the step, or None. The failed sequence is unchanged (its appended
/// tokens removed again); the ones before it keep their allocations.
#[pyclass(frozen, module = "pagedkv._core", name = "StepOutput")]
pub(crate) struct PyStepOutput {
    /// ``S``: sequences scheduled (a prefix of the request).
    #[pyo3(get)]
    num_scheduled: usize,
    /// The ``PagedKVError`` (not raised) that stopped the step, or None.
    #[pyo3(get)]
    error: Option<Py<PyAny>>,
    /// ``G``: KV cache groups.
    #[pyo3(get)]
    pub(crate) num_groups: usize,
    /// ``T``: tokens scheduled in this step (``query_start_loc[-1]``), also when the per-token
    /// arrays were left empty (``step(..., token_arrays=False)``).
    #[pyo3(get)]
    num_tokens: usize,
    /// The longest ``seq_lens`` entry (tokens; 0 when nothing was scheduled).
    #[pyo3(get)]
    max_seq_len: usize,
    /// The longest query (tokens; 0 when nothing was scheduled).
    #[pyo3(get)]
    max_query_len: usize,
    /// ``uint64[S]`` the scheduled sequences' ids, in batch order (a prefix of the request).
    #[pyo3(get)]
    pub(crate) seq_ids: Py<PyArray1<u64>>,
    /// ``int32[S]`` prefix-hit tokens of each first allocation, else 0.
    #[pyo3(get)]
    num_cached_tokens: Py<PyArray1<i32>>,
    /// ``int32[S + 1]`` cumulative query lengths (tokens).
    #[pyo3(get)]
    query_start_loc: Py<PyArray1<i32>>,
    /// ``int32[S]`` context + query tokens per sequence.
    #[pyo3(get)]
    seq_lens: Py<PyArray1<i32>>,
    /// ``int32[S]`` tokens with KV present before this step.
    #[pyo3(get)]
    context_lens: Py<PyArray1<i32>>,
    /// ``int64[T]`` token id of each scheduled token, in slot-mapping order (empty after
    /// ``step(..., token_arrays=False)``).
    #[pyo3(get)]
    input_ids: Py<PyArray1<i64>>,
    /// ``int32[S]`` draft tokens (speculative decoding) at the end of each sequence's query,
    /// in lookahead slots; all 0 for a step without ``draft_token_ids``.
    #[pyo3(get)]
    num_draft_tokens: Py<PyArray1<i32>>,
    /// ``int64[G, T]`` KV slot of each scheduled token in each group's layers:
    /// ``block_id * block_size_g + offset`` (shape ``(G, 0)`` after
    /// ``step(..., token_arrays=False)``).
    #[pyo3(get)]
    slot_mappings: Py<PyArray2<i64>>,
    /// ``int32[G, S, W]`` every group's block tables, one row per scheduled sequence, padded
    /// with the null block 0 (a windowed group's released entries are 0 too), only with
    /// ``step(..., block_table=True)``; else shape ``(G, S, 0)``.
    #[pyo3(get)]
    block_tables: Py<PyArray3<i32>>,
    /// ``int32[S, G]`` the block-table deltas: entry ``[k, g]`` is the first logical block of
    /// sequence ``k``'s group-``g`` table that changed since the last step output that
    /// reported it (0 for a table new to the outputs: first allocation, resumed preemption,
    /// swap-in, fork child). That table is now its previous one up to ``table_start[k, g]``,
    /// then ``table_delta[table_delta_indptr[k * G + g]:table_delta_indptr[k * G + g + 1]]``.
    /// A window release counts as a change: the released entries come as the null block 0.
    /// ``pagedkv.BlockTable`` applies these deltas to tables it keeps across steps.
    #[pyo3(get)]
    pub(crate) table_start: Py<PyArray2<i32>>,
    /// ``uint64[S]`` the version of each sequence's tables this output reports (all groups):
    /// one more than its previous report's; a sequence's first report is above every version
    /// this manager reported before (so a reused id never repeats one). A delta applies to the
    /// version before it (``table_version - 1``) only.
    #[pyo3(get)]
    pub(crate) table_version: Py<PyArray1<u64>>,
    /// ``int32[S * G + 1]`` CSR offsets into ``table_delta``, entry ``k * G + g``.
    #[pyo3(get)]
    pub(crate) table_delta_indptr: Py<PyArray1<i32>>,
    /// ``int32[n]`` per (sequence, group), its table entries from ``table_start`` to its end.
    #[pyo3(get)]
    pub(crate) table_delta: Py<PyArray1<i32>>,
    /// ``int32[S * G + 1]`` CSR offsets into ``new_block_ids``, entry ``k * G + g`` for
    /// sequence ``k`` and group ``g``.
    #[pyo3(get)]
    new_block_indptr: Py<PyArray1<i32>>,
    /// ``int32[n]`` blocks newly taken per (sequence, group), in block-table order.
    #[pyo3(get)]
    new_block_ids: Py<PyArray1<i32>>,
    /// ``int32[c, 3]`` copy-on-write ``(group, src, dst)`` rows, to run (in that group's
    /// layers) before the K/V writes; for a state group, the move of a live state into its new
    /// block (or out of a prefix-hit block).
    #[pyo3(get)]
    copies: Py<PyArray2<i32>>,
    /// ``int32[z, 2]`` ``(group, block)`` rows: fresh state blocks of state groups to zero
    /// after the copies, before the forward pass. Shape ``(0, 2)`` without state groups.
    #[pyo3(get)]
    zero_blocks: Py<PyArray2<i32>>,
    /// ``int32[n, 3]`` host-tier stores ``(group, device_block, host_block)``: copy these FIRST
    /// in the step (before swap-out, swap-in, host loads, copy-on-write and the forward pass):
    /// the device blocks are about to be reused. Includes the stores of calls made since the
    /// previous step (e.g. ``swap_in``). Shape ``(0, 3)`` without a host tier.
    #[pyo3(get)]
    host_stores: Py<PyArray2<i32>>,
    /// ``int32[n, 3]`` host-tier loads ``(group, host_block, device_block)``: copy after the
    /// stores and swaps, before copy-on-write and the forward pass. Their host blocks stay
    /// pinned until the next ``step`` call returns. Shape ``(0, 3)`` without a host tier.
    #[pyo3(get)]
    host_loads: Py<PyArray2<i32>>,
}

impl PyStepOutput {
    /// The Python form of the core's step output; `seq_ids` is the request's (its first
    /// `num_scheduled` are kept).
    pub(crate) fn from_core(
        py: Python<'_>,
        out: StepOutput,
        seq_ids: &[u64],
        token_arrays: bool,
        block_table: bool,
    ) -> PyResult<Self> {
        let error = match &out.error {
            Some(e) => Some(error_instance(py, e)?.unbind()),
            None => None,
        };
        let g = out.num_groups;
        let s = out.num_scheduled;
        let t = out.query_start_loc.last().copied().unwrap_or(0).max(0) as usize;
        // Two scalars the kernels' launch needs, here in O(S) instead of two numpy reductions.
        let max_seq_len = out.seq_lens.iter().copied().max().unwrap_or(0).max(0) as usize;
        let max_query_len = (out.query_start_loc.windows(2))
            .map(|x| x[1] - x[0])
            .max()
            .unwrap_or(0)
            .max(0) as usize;
        let arr = |v: Vec<i32>| PyArray1::from_vec(py, v).unbind();
        let w = if block_table {
            out.block_table_width
        } else {
            0
        };
        let tables = if block_table {
            out.block_table
        } else {
            Vec::new()
        };
        Ok(Self {
            num_scheduled: s,
            error,
            num_groups: g,
            num_tokens: t,
            max_seq_len,
            max_query_len,
            seq_ids: PyArray1::from_slice(py, &seq_ids[..s]).unbind(),
            num_cached_tokens: arr(out.num_cached_tokens),
            query_start_loc: arr(out.query_start_loc),
            seq_lens: arr(out.seq_lens),
            context_lens: arr(out.context_lens),
            input_ids: PyArray1::from_vec(py, out.input_ids).unbind(),
            num_draft_tokens: arr(if out.num_draft_tokens.is_empty() {
                vec![0; s]
            } else {
                out.num_draft_tokens
            }),
            slot_mappings: matrix(py, out.slot_mapping, g, if token_arrays { t } else { 0 }),
            block_tables: Array3::from_shape_vec((g, s, w), tables)
                .expect("G x S x W")
                .into_pyarray(py)
                .unbind(),
            table_start: matrix(py, out.table_start, s, g),
            table_version: PyArray1::from_vec(py, out.table_version).unbind(),
            table_delta_indptr: arr(out.table_delta_indptr),
            table_delta: arr(out.table_delta),
            new_block_indptr: arr(out.new_block_indptr),
            new_block_ids: arr(out.new_block_ids),
            copies: triples(py, out.copies),
            zero_blocks: {
                let n = out.zero_blocks.len() / 2;
                matrix(py, out.zero_blocks, n, 2)
            },
            host_stores: triples(py, out.host_stores),
            host_loads: triples(py, out.host_loads),
        })
    }
}

#[pymethods]
impl PyStepOutput {
    /// ``int64[T]``: group 0's slot mapping (``slot_mappings[0]``, a view), the one-group
    /// spelling. Raises ``InvalidArgumentError`` when the output has several groups.
    #[getter]
    fn slot_mapping<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let arr = self.slot_mappings.bind(py).as_any();
        group0(py, arr, self.num_groups, "slot_mapping", "slot_mappings")
    }

    /// ``int32[S, W]``: group 0's block tables (``block_tables[0]``, a view; shape ``(S, 0)``
    /// without ``step(..., block_table=True)``), the one-group spelling. Raises
    /// ``InvalidArgumentError`` when the output has several groups.
    #[getter]
    fn block_table<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let arr = self.block_tables.bind(py).as_any();
        group0(py, arr, self.num_groups, "block_table", "block_tables")
    }

    /// Raises ``error`` if the step stopped early; returns None otherwise.
    fn raise_for_error(&self, py: Python<'_>) -> PyResult<()> {
        match &self.error {
            Some(e) => Err(PyErr::from_value(e.bind(py).clone())),
            None => Ok(()),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "StepOutput(num_scheduled={}, num_groups={}, num_tokens={}, new_blocks={}, copies={}, \
             error={})",
            self.num_scheduled,
            self.num_groups,
            self.num_tokens,
            self.new_block_ids.bind(py).len(),
            self.copies.bind(py).shape()[0],
            match &self.error {
                Some(e) => e.bind(py).repr().map(|r| r.to_string()).unwrap_or_default(),
                None => "None".into(),
            }
        )
    }
}
