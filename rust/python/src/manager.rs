//! `pagedkv.KVCacheManager` and its results (`SlotAllocation`, `StepOutput`).
//!
//! Every method converts its arguments while holding the GIL, releases the GIL around the core
//! call (which takes the manager's mutex), and converts the result back into numpy arrays (no
//! per-block Python objects).

use crate::config::PyCacheConfig;
use crate::convert::{count, token_ids, uint_arg, uint_vec};
use crate::errors::{bad_arg, error_instance, to_pyerr, IntoPyResult};
use crate::events::event_object;
use crate::pool::PyBlockPool;
use crate::stats::PyCacheStats;
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyUntypedArray, PyUntypedArrayMethods};
use pagedkv_core::{BlockId, ExtraKey, KvCacheManager, MmItem, SequenceSpec, StepRequest};
use pyo3::exceptions::PyAssertionError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};
use std::sync::Arc;

fn i32_array(py: Python<'_>, v: Vec<i32>) -> Py<PyArray1<i32>> {
    PyArray1::from_vec(py, v).unbind()
}

/// `(a, b)` block pairs as `int32[k, 2]`.
fn pairs_array(py: Python<'_>, pairs: &[(BlockId, BlockId)]) -> Py<PyArray2<i32>> {
    let flat: Vec<i32> = pairs
        .iter()
        .flat_map(|&(a, b)| [a as i32, b as i32])
        .collect();
    Array2::from_shape_vec((pairs.len(), 2), flat)
        .expect("k x 2 shape matches 2k elements")
        .into_pyarray(py)
        .unbind()
}

/// What one ``allocate_slots`` call did.
///
/// Attributes:
///     num_scheduled_tokens: tokens scheduled (the query length), ``min(max_new_tokens, uncomputed)``.
///     num_cached_tokens: tokens served from the prefix cache by this call (first allocation).
///     num_context_tokens: tokens with KV present before the scheduled ones; the scheduled
///         tokens occupy positions ``num_context_tokens .. num_context_tokens + num_scheduled_tokens``.
///     new_block_ids: ``int32[k]`` blocks newly taken from the free pool, in block-table order.
///     copies: ``int32[c, 2]`` copy-on-write plan, ``(src, dst)`` rows (c <= 1).
#[pyclass(frozen, module = "pagedkv._core", name = "SlotAllocation")]
pub(crate) struct PySlotAllocation {
    /// Tokens scheduled by this call (the query length).
    #[pyo3(get)]
    num_scheduled_tokens: usize,
    /// Tokens served from the prefix cache by this call (first allocation only; a multiple of
    /// block_size).
    #[pyo3(get)]
    num_cached_tokens: usize,
    /// Tokens with KV present before the scheduled ones.
    #[pyo3(get)]
    num_context_tokens: usize,
    /// ``int32[k]`` blocks newly taken from the free pool, in block-table order.
    #[pyo3(get)]
    new_block_ids: Py<PyArray1<i32>>,
    /// ``int32[c, 2]`` copy-on-write plan: ``(src, dst)`` block pairs to copy before writing.
    #[pyo3(get)]
    copies: Py<PyArray2<i32>>,
}

#[pymethods]
impl PySlotAllocation {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "SlotAllocation(num_scheduled_tokens={}, num_cached_tokens={}, num_context_tokens={}, \
             new_block_ids={}, copies={})",
            self.num_scheduled_tokens,
            self.num_cached_tokens,
            self.num_context_tokens,
            self.new_block_ids
                .bind(py)
                .repr()
                .map(|r| r.to_string())
                .unwrap_or_default(),
            self.copies.bind(py).shape()[0],
        )
    }
}

/// The result of one batched ``KVCacheManager.step``: flat arrays ready to become kernel inputs
/// (see ``pagedkv.tensors.BatchTensors.from_step``).
///
/// Sequences are processed in request order; processing stops at the first failure, so the
/// arrays describe the first ``num_scheduled`` sequences (``S``) and ``error`` holds the
/// exception (not raised) that stopped the step, or None. The failed sequence is unchanged
/// (its appended tokens removed again); the ones before it keep their allocations.
///
/// Attributes:
///     num_scheduled: ``S``, sequences scheduled.
///     error: the ``PagedKVError`` instance that stopped the step, or None.
///     num_cached_tokens: ``int32[S]`` prefix-hit tokens of each sequence's first allocation, else 0.
///     query_start_loc: ``int32[S + 1]`` cumulative query lengths (tokens).
///     seq_lens: ``int32[S]`` context + query tokens.
///     context_lens: ``int32[S]`` tokens with KV present before this step.
///     slot_mapping: ``int64[T]`` per scheduled token, ``block_id * block_size + offset``.
///     block_table_indptr: ``int32[S + 1]`` CSR offsets into ``block_table_indices``.
///     block_table_indices: ``int32[nnz]`` the scheduled sequences' full block tables.
///     new_block_indptr: ``int32[S + 1]`` CSR offsets into ``new_block_ids``.
///     new_block_ids: ``int32[n]`` blocks newly taken per sequence.
///     copies: ``int32[c, 2]`` copy-on-write ``(src, dst)`` pairs, to run before the writes.
#[pyclass(frozen, module = "pagedkv._core", name = "StepOutput")]
pub(crate) struct PyStepOutput {
    /// ``S``: sequences scheduled (a prefix of the request).
    #[pyo3(get)]
    num_scheduled: usize,
    /// The ``PagedKVError`` (not raised) that stopped the step, or None.
    #[pyo3(get)]
    error: Option<PyObject>,
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
    /// ``int64[T]`` KV slot of each scheduled token: ``block_id * block_size + offset``.
    #[pyo3(get)]
    slot_mapping: Py<PyArray1<i64>>,
    /// ``int32[S + 1]`` CSR offsets into ``block_table_indices``.
    #[pyo3(get)]
    block_table_indptr: Py<PyArray1<i32>>,
    /// ``int32[nnz]`` the scheduled sequences' full block tables, concatenated.
    #[pyo3(get)]
    block_table_indices: Py<PyArray1<i32>>,
    /// ``int32[S + 1]`` CSR offsets into ``new_block_ids``.
    #[pyo3(get)]
    new_block_indptr: Py<PyArray1<i32>>,
    /// ``int32[n]`` blocks newly taken, per sequence (see ``new_block_indptr``).
    #[pyo3(get)]
    new_block_ids: Py<PyArray1<i32>>,
    /// ``int32[c, 2]`` copy-on-write ``(src, dst)`` pairs, to run before the K/V writes.
    #[pyo3(get)]
    copies: Py<PyArray2<i32>>,
}

#[pymethods]
impl PyStepOutput {
    /// Raises ``error`` if the step stopped early; returns None otherwise.
    fn raise_for_error(&self, py: Python<'_>) -> PyResult<()> {
        match &self.error {
            Some(e) => Err(PyErr::from_value(e.bind(py).clone())),
            None => Ok(()),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "StepOutput(num_scheduled={}, num_tokens={}, new_blocks={}, copies={}, error={})",
            self.num_scheduled,
            self.slot_mapping.bind(py).len(),
            self.new_block_ids.bind(py).len(),
            self.copies.bind(py).shape()[0],
            match &self.error {
                Some(e) => e.bind(py).repr().map(|r| r.to_string()).unwrap_or_default(),
                None => "None".into(),
            }
        )
    }
}

/// The paged KV cache manager (PagedAttention, Kwon et al., SOSP'23): per-sequence block
/// tables over a block pool, automatic prefix caching (chained SHA-256 block hashes, as vLLM's
/// V1 KV cache manager), copy-on-write after ``fork``, preemption by recompute or swap, and a
/// batched ``step`` for the scheduler.
///
/// Thread-safe: every method releases the GIL around the core call, which takes one mutex over
/// the per-sequence state. Every failing call raises a ``pagedkv.PagedKVError`` subclass and
/// leaves the state unchanged. Units: tokens for token counts, blocks for block counts; block
/// ids are ``int32`` arrays (GPU ids ``1..num_blocks``; 0 is the null block).
#[pyclass(frozen, module = "pagedkv._core", name = "KVCacheManager")]
pub(crate) struct PyKvCacheManager {
    inner: Arc<KvCacheManager>,
    config: Py<PyCacheConfig>,
}

/// The hashing inputs of a sequence from `add_sequence`'s keyword arguments (shared with
/// `KVIndexer`, whose queries must hash exactly like the manager).
pub(crate) fn sequence_spec(
    py: Python<'_>,
    cache_salt: Option<&str>,
    adapter_id: Option<&str>,
    extra_keys: Option<&Bound<'_, PyAny>>,
    mm_items: Option<&Bound<'_, PyAny>>,
) -> PyResult<SequenceSpec> {
    let mut spec = SequenceSpec::default();
    if let Some(a) = adapter_id {
        spec.extra_keys.push(ExtraKey::Adapter(a.to_owned()));
    }
    if let Some(s) = cache_salt {
        spec.extra_keys.push(ExtraKey::CacheSalt(s.to_owned()));
    }
    if let Some(keys) = extra_keys {
        for (i, item) in keys.try_iter()?.enumerate() {
            let item = item?;
            let (tag, value): (String, Vec<u8>) = item.extract().map_err(|_| {
                to_pyerr(
                    py,
                    &bad_arg(
                        "extra_keys",
                        format!(
                            "{} at index {i}",
                            item.repr().map(|r| r.to_string()).unwrap_or_default()
                        ),
                        "expected (tag: str, value: bytes) tuples",
                    ),
                )
            })?;
            spec.extra_keys.push(ExtraKey::Tagged { tag, value });
        }
    }
    if let Some(items) = mm_items {
        for (i, item) in items.try_iter()?.enumerate() {
            let item = item?;
            let bad = || {
                to_pyerr(
                    py,
                    &bad_arg(
                        "mm_items",
                        format!("{} at index {i}", item.repr().map(|r| r.to_string()).unwrap_or_default()),
                        "expected (item_hash: bytes, start_token: int >= 0, num_tokens: int >= 1) tuples",
                    ),
                )
            };
            let (hash, start, len): (Vec<u8>, Bound<'_, PyAny>, Bound<'_, PyAny>) =
                item.extract().map_err(|_| bad())?;
            if item
                .get_item(0)
                .map(|h| h.is_instance_of::<PyString>())
                .unwrap_or(false)
            {
                return Err(bad());
            }
            let start = uint_arg(&start, "mm_items", u64::MAX).map_err(|_| bad())?;
            let len = uint_arg(&len, "mm_items", u64::MAX).map_err(|_| bad())?;
            spec.mm_items.push(MmItem {
                item_hash: hash,
                start,
                len,
            });
        }
    }
    Ok(spec)
}

/// Per-sequence `max_new_tokens` for `step`: an int (same for all) or one per sequence.
fn step_max_new_tokens(obj: &Bound<'_, PyAny>, n: usize) -> PyResult<Vec<u32>> {
    let py = obj.py();
    let v: Vec<u32> = if obj.downcast::<pyo3::types::PyInt>().is_ok() {
        vec![uint_arg(obj, "max_new_tokens", u64::from(u32::MAX))? as u32; n]
    } else {
        uint_vec(obj, "max_new_tokens", u64::from(u32::MAX))?
            .into_iter()
            .map(|x| x as u32)
            .collect()
    };
    if v.len() != n {
        return Err(to_pyerr(
            py,
            &bad_arg(
                "max_new_tokens",
                format!("{} entries", v.len()),
                format!("expected one per sequence ({n})"),
            ),
        ));
    }
    Ok(v)
}

/// `append_token_ids` for `step` as CSR: None; a 1-D integer array with one token per
/// sequence; or a sequence of per-sequence token lists / arrays.
fn step_appends(obj: Option<&Bound<'_, PyAny>>, n: usize) -> PyResult<(Vec<u32>, Vec<u32>)> {
    let Some(obj) = obj else {
        return Ok((Vec::new(), Vec::new()));
    };
    let py = obj.py();
    let wrong_len = |got: usize| {
        to_pyerr(
            py,
            &bad_arg(
                "append_token_ids",
                format!("{got} entries"),
                format!("expected one per sequence ({n})"),
            ),
        )
    };
    if obj
        .downcast::<PyUntypedArray>()
        .map(|a| a.ndim() == 1)
        .unwrap_or(false)
    {
        let tokens = token_ids(obj, "append_token_ids")?;
        if tokens.len() != n {
            return Err(wrong_len(tokens.len()));
        }
        return Ok(((0..=n as u32).collect(), tokens));
    }
    let mut indptr = Vec::with_capacity(n + 1);
    indptr.push(0u32);
    let mut tokens = Vec::new();
    let mut rows = 0usize;
    for row in obj.try_iter()? {
        let row = row?;
        tokens.extend(token_ids(&row, "append_token_ids")?);
        let end = u32::try_from(tokens.len()).map_err(|_| {
            to_pyerr(
                py,
                &bad_arg(
                    "append_token_ids",
                    format!("{} tokens", tokens.len()),
                    "too many tokens",
                ),
            )
        })?;
        indptr.push(end);
        rows += 1;
    }
    if rows != n {
        return Err(wrong_len(rows));
    }
    Ok((indptr, tokens))
}

#[pymethods]
impl PyKvCacheManager {
    #[new]
    fn new(py: Python<'_>, config: Py<PyCacheConfig>) -> PyResult<Self> {
        let cfg = config.get().inner.clone();
        let inner = py.allow_threads(|| KvCacheManager::new(cfg)).py(py)?;
        Ok(Self {
            inner: Arc::new(inner),
            config,
        })
    }

    /// The configuration (frozen).
    #[getter]
    fn config(&self, py: Python<'_>) -> Py<PyCacheConfig> {
        self.config.clone_ref(py)
    }

    /// A read-only view of the underlying block pool (ref counts, hashes, free queue).
    #[getter]
    fn pool(&self) -> PyBlockPool {
        PyBlockPool::view_of(self.inner.clone())
    }

    /// Registers sequence ``seq_id`` with its prompt (``int`` token ids, list or 1-D integer
    /// array; no blocks yet). ``cache_salt`` / ``adapter_id`` / ``extra_keys`` ((tag, bytes)
    /// pairs) are mixed into every block hash, so sequences that differ in any of them never
    /// share cached blocks; ``mm_items`` are ``(item_hash, start_token, num_tokens)`` multimodal
    /// items keying the blocks they overlap.
    ///
    /// Raises: ``SequenceExistsError``; ``InvalidArgumentError`` (empty prompt, negative or
    /// non-integer ids, malformed keys / items).
    #[pyo3(signature = (seq_id, prompt_token_ids, *, cache_salt = None, adapter_id = None, extra_keys = None, mm_items = None))]
    #[allow(clippy::too_many_arguments)]
    fn add_sequence(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&str>,
        adapter_id: Option<&str>,
        extra_keys: Option<&Bound<'_, PyAny>>,
        mm_items: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let prompt = token_ids(prompt_token_ids, "prompt_token_ids")?;
        let spec = sequence_spec(py, cache_salt, adapter_id, extra_keys, mm_items)?;
        let m = &self.inner;
        py.allow_threads(|| m.add_sequence(seq, &prompt, spec))
            .py(py)
    }

    /// Appends newly sampled (finalized) tokens to ``seq_id``. Raises ``UnknownSequenceError``,
    /// ``InvalidArgumentError`` (bad ids).
    fn append_tokens(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let tokens = crate::convert::token_ids(token_ids, "token_ids")?;
        let m = &self.inner;
        py.allow_threads(|| m.append_tokens(seq, &tokens)).py(py)
    }

    /// Tokens that would be served from the prefix cache if ``seq_id`` were allocated from
    /// scratch now (a multiple of ``block_size``, at most ``num_tokens - 1``). No side effects.
    /// Raises ``UnknownSequenceError``.
    fn lookup_prefix(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.allow_threads(|| m.lookup_prefix(seq)).py(py)
    }

    /// Exactly the number of blocks the next ``allocate_slots(seq_id, max_new_tokens)`` takes
    /// from the free pool (fresh blocks + prefix hits on free cached blocks + copy-on-write).
    /// No side effects. Raises as ``allocate_slots`` except ``OutOfBlocksError``.
    fn num_blocks_needed(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let q = count(max_new_tokens, "max_new_tokens")?;
        let m = &self.inner;
        py.allow_threads(|| m.num_blocks_needed(seq, q)).py(py)
    }

    /// Schedules up to ``max_new_tokens`` uncomputed tokens of ``seq_id`` and makes room for
    /// their KV: prefix hits first on a sequence's first allocation, new blocks as needed, a
    /// private copy of a shared partially filled last block (copy-on-write). Newly full blocks
    /// are hashed into the prefix cache. All or nothing.
    ///
    /// Raises: ``UnknownSequenceError``; ``InvalidSequenceStateError`` (swapped out);
    /// ``InvalidArgumentError`` (``max_new_tokens == 0`` or nothing left to compute);
    /// ``OutOfBlocksError``.
    fn allocate_slots(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<PySlotAllocation> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let q = count(max_new_tokens, "max_new_tokens")?;
        let m = &self.inner;
        let a = py.allow_threads(|| m.allocate_slots(seq, q)).py(py)?;
        Ok(PySlotAllocation {
            num_scheduled_tokens: a.num_scheduled_tokens,
            num_cached_tokens: a.num_cached_tokens,
            num_context_tokens: a.num_context_tokens,
            new_block_ids: i32_array(py, a.new_block_ids.into_iter().map(|b| b as i32).collect()),
            copies: pairs_array(py, &a.copies),
        })
    }

    /// Forks ``parent_id`` into a new sequence ``child_id`` sharing every block (ref counts
    /// +1; nothing allocated). Raises ``UnknownSequenceError`` (parent), ``SequenceExistsError``
    /// (child), ``InvalidSequenceStateError`` (swapped-out parent).
    fn fork(
        &self,
        py: Python<'_>,
        parent_id: &Bound<'_, PyAny>,
        child_id: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let parent = crate::convert::seq_id(parent_id, "parent_id")?;
        let child = crate::convert::seq_id(child_id, "child_id")?;
        let m = &self.inner;
        py.allow_threads(|| m.fork(parent, child)).py(py)
    }

    /// Frees ``seq_id`` (blocks released tail-first, cached ones keep their hashes) and forgets
    /// it. Idempotent: False for an unknown or already freed id.
    fn free(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        Ok(py.allow_threads(|| m.free(seq)))
    }

    /// Preempts a group of sequences by recompute, all or nothing: blocks released, tokens
    /// kept, ``num_computed_tokens`` back to 0. Raises ``UnknownSequenceError``,
    /// ``InvalidArgumentError`` (duplicate id), ``InvalidSequenceStateError`` (swapped out).
    fn preempt(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        py.allow_threads(|| m.preempt_recompute(&seqs)).py(py)
    }

    /// Swaps a group of sequences out to CPU blocks, all or nothing; shared blocks are planned
    /// once. Returns ``int32[k, 2]`` ``(gpu_block, cpu_block)`` rows for the copy kernel.
    /// Raises ``OutOfSwapSpaceError``, ``UnknownSequenceError``, ``InvalidSequenceStateError``.
    fn swap_out<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Py<PyArray2<i32>>> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        let plan = py.allow_threads(|| m.swap_out(&seqs)).py(py)?;
        Ok(pairs_array(py, &plan))
    }

    /// Swaps a group back in, all or nothing. Returns ``int32[k, 2]`` ``(cpu_block, gpu_block)``
    /// rows. Raises ``OutOfBlocksError``, ``UnknownSequenceError``, ``InvalidSequenceStateError``.
    fn swap_in<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Py<PyArray2<i32>>> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        let plan = py.allow_threads(|| m.swap_in(&seqs)).py(py)?;
        Ok(pairs_array(py, &plan))
    }

    /// Drops every prefix hash. Raises ``CacheInUseError`` while any block is in use.
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<()> {
        let m = &self.inner;
        py.allow_threads(|| m.reset_prefix_cache()).py(py)
    }

    /// The block table of ``seq_id``: ``int32[n]`` physical block ids in logical order (CPU
    /// swap-block ids while swapped out). Raises ``UnknownSequenceError``.
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
    ) -> PyResult<Py<PyArray1<i32>>> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        let t = py.allow_threads(|| m.block_table(seq)).py(py)?;
        Ok(i32_array(py, t.into_iter().map(|b| b as i32).collect()))
    }

    /// Known (finalized) tokens of ``seq_id``. Raises ``UnknownSequenceError``.
    fn num_tokens(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.allow_threads(|| m.num_tokens(seq)).py(py)
    }

    /// Tokens of ``seq_id`` whose KV is (scheduled to be) written. Raises
    /// ``UnknownSequenceError``.
    fn num_computed_tokens(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.allow_threads(|| m.num_computed_tokens(seq)).py(py)
    }

    /// ``"running"``, ``"preempted"`` or ``"swapped"``. Raises ``UnknownSequenceError``.
    fn status(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        Ok(py.allow_threads(|| m.status(seq)).py(py)?.name())
    }

    /// The token ids of ``seq_id`` as ``int64[n]`` (prompt + appended). Raises
    /// ``UnknownSequenceError``.
    fn token_ids<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
    ) -> PyResult<Py<PyArray1<i64>>> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        let t = py.allow_threads(|| m.tokens(seq)).py(py)?;
        Ok(PyArray1::from_vec(py, t.into_iter().map(i64::from).collect()).unbind())
    }

    /// Registered sequences.
    #[getter]
    fn num_sequences(&self, py: Python<'_>) -> usize {
        let m = &self.inner;
        py.allow_threads(|| m.num_sequences())
    }

    /// One scheduler step in ONE call with the GIL released: for each sequence in order, append
    /// its new tokens, then ``allocate_slots(seq, max_new_tokens[i])``; stop at the first
    /// failure (reported in ``StepOutput.error``, not raised).
    ///
    /// Args:
    ///     seq_ids: ``S`` sequence ids (list or 1-D integer array, e.g. ``uint64``/``int64``).
    ///     max_new_tokens: one int for all, or ``S`` ints (list or ``int32`` array).
    ///     append_token_ids: None; a 1-D integer array of ``S`` tokens (one per sequence, the
    ///         decode case); or ``S`` lists / arrays of tokens.
    ///
    /// Raises ``InvalidArgumentError`` for arguments it cannot read (wrong types, negative ids,
    /// lengths that disagree; nothing done). A request refused as a whole by the core (a
    /// sequence listed twice) is not raised either: it comes back with ``num_scheduled == 0``
    /// and ``error`` set, nothing changed. ``StepOutput.raise_for_error()`` raises any of these.
    #[pyo3(signature = (seq_ids, max_new_tokens, append_token_ids = None))]
    fn step(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
        append_token_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyStepOutput> {
        let seq_ids = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let max_new_tokens = step_max_new_tokens(max_new_tokens, seq_ids.len())?;
        let (append_indptr, append_tokens) = step_appends(append_token_ids, seq_ids.len())?;
        let req = StepRequest {
            seq_ids,
            max_new_tokens,
            append_indptr,
            append_tokens,
        };
        let m = &self.inner;
        let out = py.allow_threads(|| m.step(&req));
        let error = match &out.error {
            Some(e) => Some(error_instance(py, e)?.unbind()),
            None => None,
        };
        let copies: Vec<(BlockId, BlockId)> = out
            .copy_src
            .iter()
            .zip(&out.copy_dst)
            .map(|(&s, &d)| (s as BlockId, d as BlockId))
            .collect();
        Ok(PyStepOutput {
            num_scheduled: out.num_scheduled,
            error,
            num_cached_tokens: i32_array(
                py,
                out.num_cached_tokens
                    .into_iter()
                    .map(|x| x as i32)
                    .collect(),
            ),
            query_start_loc: i32_array(py, out.query_start_loc),
            seq_lens: i32_array(py, out.seq_lens),
            context_lens: i32_array(py, out.context_lens),
            slot_mapping: PyArray1::from_vec(py, out.slot_mapping).unbind(),
            block_table_indptr: i32_array(py, out.block_table_indptr),
            block_table_indices: i32_array(py, out.block_table_indices),
            new_block_indptr: i32_array(py, out.new_block_indptr),
            new_block_ids: i32_array(py, out.new_block_ids),
            copies: pairs_array(py, &copies),
        })
    }

    /// A snapshot of usage and counters (``CacheStats``).
    fn stats(&self, py: Python<'_>) -> PyCacheStats {
        let m = &self.inner;
        PyCacheStats {
            inner: py.allow_threads(|| m.stats()),
        }
    }

    /// Drains the buffered KV events, oldest first (always empty unless the config has
    /// ``enable_events=True``): ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let m = &self.inner;
        let events = py.allow_threads(|| m.take_events());
        let objs = events
            .into_iter()
            .map(|e| event_object(py, e))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, objs)
    }

    /// Checks the invariants of DESIGN.md (1-4, the pool's included); raises
    /// ``AssertionError`` naming the first violation. O(num_blocks + blocks of all sequences).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let m = &self.inner;
        py.allow_threads(|| m.check_invariants())
            .map_err(PyAssertionError::new_err)
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        let p = self.inner.pool();
        format!(
            "KVCacheManager(num_blocks={}, block_size={}, used={}, free={})",
            c.num_blocks,
            c.block_size,
            p.num_used(),
            p.num_free()
        )
    }
}
