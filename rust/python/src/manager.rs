//! `pagedkv.KVCacheManager` and its results (`SlotAllocation`, `StepOutput`).
//!
//! Every method converts its arguments while holding the GIL, releases the GIL around the core
//! call (which takes the manager's mutex), and converts the result back into numpy arrays (no
//! per-block Python objects).

use crate::config::PyCacheConfig;
use crate::convert::{
    bad, count, list_items, opt_str, repr, token_ids, type_name, uint, uint_array,
};
use crate::errors::{error_instance, IntoPyResult};
use crate::events::event_object;
use crate::pool::PyBlockPool;
use crate::stats::PyCacheStats;
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyUntypedArray, PyUntypedArrayMethods};
use pagedkv_core::one_group::OneGroupManager;
use pagedkv_core::{BlockId, ExtraKey, MmItem, SequenceSpec, StepDrafts, StepOptions, StepRequest};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList};
use std::sync::Arc;

/// Block ids as an ``int32`` array. Ids are below `MAX_BLOCKS` (2**28), so the cast is exact;
/// the `u32 -> i32` collect reuses the vector's buffer.
fn block_array(py: Python<'_>, ids: Vec<BlockId>) -> Py<PyArray1<i32>> {
    PyArray1::from_vec(py, ids.into_iter().map(|b| b as i32).collect()).unbind()
}

/// A row-major `rows x cols` buffer as a 2-D array, without copying it.
fn matrix(py: Python<'_>, flat: Vec<i32>, cols: usize) -> Py<PyArray2<i32>> {
    Array2::from_shape_vec((flat.len() / cols, cols), flat)
        .expect("rows x cols buffer")
        .into_pyarray(py)
        .unbind()
}

/// `(a, b)` block pairs as `int32[k, 2]`.
fn pairs_array(py: Python<'_>, pairs: &[(BlockId, BlockId)]) -> Py<PyArray2<i32>> {
    let flat = pairs
        .iter()
        .flat_map(|&(a, b)| [a as i32, b as i32])
        .collect();
    matrix(py, flat, 2)
}

/// What one ``allocate_slots`` call did (each attribute's docstring gives its unit).
#[pyclass(frozen, module = "pagedkv._core", name = "SlotAllocation")]
pub(crate) struct PySlotAllocation {
    /// Tokens scheduled by this call (the query length): ``min(num_new_tokens, uncomputed)``.
    #[pyo3(get)]
    num_scheduled_tokens: usize,
    /// Tokens served from the prefix cache by this call (first allocation only; a multiple of
    /// block_size).
    #[pyo3(get)]
    num_cached_tokens: usize,
    /// Tokens with KV present before the scheduled ones; the scheduled tokens occupy positions
    /// ``num_context_tokens .. num_context_tokens + num_scheduled_tokens``.
    #[pyo3(get)]
    num_context_tokens: usize,
    /// ``int32[k]`` blocks newly taken from the free pool, in block-table order.
    #[pyo3(get)]
    new_block_ids: Py<PyArray1<i32>>,
    /// ``int32[c, 2]`` copy-on-write plan: ``(src, dst)`` block pairs to copy before writing.
    #[pyo3(get)]
    copies: Py<PyArray2<i32>>,
    /// Draft tokens (speculative decoding) given lookahead slots right after the scheduled
    /// ones, pending until ``KVCacheManager.accept_drafts``; 0 without drafts.
    #[pyo3(get)]
    num_draft_tokens: usize,
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

/// The result of one batched ``KVCacheManager.step``: the scheduled sequences' kernel inputs
/// as numpy arrays, built by the core in the dtype and layout the kernels take (``int32`` block
/// ids and lengths, ``int64`` slots and token ids; ``block_table`` dense and C-contiguous, so
/// ``torch.from_numpy`` shares it without a copy). Each attribute's docstring gives its dtype
/// and shape.
///
/// Sequences are processed in request order; processing stops at the first failure, so the
/// arrays describe the first ``num_scheduled`` sequences (``S``, ``T`` scheduled tokens) and
/// ``error`` holds the exception (not raised) that stopped the step, or None. The failed
/// sequence is unchanged (its appended tokens removed again); the ones before it keep their
/// allocations.
#[pyclass(frozen, module = "pagedkv._core", name = "StepOutput")]
pub(crate) struct PyStepOutput {
    /// ``S``: sequences scheduled (a prefix of the request).
    #[pyo3(get)]
    num_scheduled: usize,
    /// The ``PagedKVError`` (not raised) that stopped the step, or None.
    #[pyo3(get)]
    error: Option<Py<PyAny>>,
    /// ``int32[S]`` prefix-hit tokens of each first allocation, else 0.
    #[pyo3(get)]
    num_cached_tokens: Py<PyArray1<i32>>,
    /// ``int32[S]`` draft tokens (speculative decoding) at the end of each sequence's query,
    /// in lookahead slots; all 0 for a step without ``draft_token_ids``.
    #[pyo3(get)]
    num_draft_tokens: Py<PyArray1<i32>>,
    /// ``int32[S + 1]`` cumulative query lengths (tokens).
    #[pyo3(get)]
    query_start_loc: Py<PyArray1<i32>>,
    /// ``int32[S]`` context + query tokens per sequence.
    #[pyo3(get)]
    seq_lens: Py<PyArray1<i32>>,
    /// ``int32[S]`` tokens with KV present before this step.
    #[pyo3(get)]
    context_lens: Py<PyArray1<i32>>,
    /// Tokens scheduled in this step (``query_start_loc[-1]``), also when the per-token arrays
    /// were left empty (``step(..., token_arrays=False)``).
    #[pyo3(get)]
    num_tokens: usize,
    /// The longest ``seq_lens`` entry (tokens; 0 when nothing was scheduled).
    #[pyo3(get)]
    max_seq_len: usize,
    /// The longest query (``query_start_loc`` step; tokens; 0 when nothing was scheduled).
    #[pyo3(get)]
    max_query_len: usize,
    /// ``int64[T]`` KV slot of each scheduled token: ``block_id * block_size + offset``
    /// (``T`` = ``num_tokens``; empty after ``step(..., token_arrays=False)``).
    #[pyo3(get)]
    slot_mapping: Py<PyArray1<i64>>,
    /// ``int32[S + 1]`` CSR offsets into ``new_block_ids``.
    #[pyo3(get)]
    new_block_indptr: Py<PyArray1<i32>>,
    /// ``int32[n]`` blocks newly taken, per sequence (see ``new_block_indptr``).
    #[pyo3(get)]
    new_block_ids: Py<PyArray1<i32>>,
    /// ``int32[c, 2]`` copy-on-write ``(src, dst)`` pairs, to run before the K/V writes.
    #[pyo3(get)]
    copies: Py<PyArray2<i32>>,
    /// ``int64[T]`` token id of each scheduled token, in ``slot_mapping`` order (empty after
    /// ``step(..., token_arrays=False)``).
    #[pyo3(get)]
    input_ids: Py<PyArray1<i64>>,
    /// ``int32[S, W]`` the scheduled sequences' full block tables, one row each, padded with
    /// the null block 0 (``W`` = the longest table; row ``k`` holds ``ceil(seq_lens[k] /
    /// block_size)`` blocks), only when ``step(..., block_table=True)``; else shape ``(0, 0)``.
    /// C-contiguous: ``torch.from_numpy`` shares it.
    #[pyo3(get)]
    block_table: Py<PyArray2<i32>>,
    /// ``uint64[S]`` the scheduled sequences' ids, in batch order (a prefix of the request).
    #[pyo3(get)]
    pub(crate) seq_ids: Py<PyArray1<u64>>,
    /// ``int32[S]`` the block-table delta: per sequence, the first logical block of its table
    /// that changed since the last step output that reported it (0 for a table new to the
    /// outputs: first allocation, resumed preemption, swap-in, fork child). Row ``k`` is now
    /// its previous row up to ``table_start[k]``, then
    /// ``table_delta[table_delta_indptr[k]:table_delta_indptr[k+1]]``.
    /// ``pagedkv.BlockTable`` applies these deltas to tables it keeps across steps.
    #[pyo3(get)]
    pub(crate) table_start: Py<PyArray1<i32>>,
    /// ``uint64[S]`` the version of each sequence's table this output reports: one more than
    /// its previous report's, and a sequence's first report is above every version this
    /// manager reported before (so a reused id never repeats one). A delta applies to the
    /// version before it (``table_version - 1``) only.
    #[pyo3(get)]
    pub(crate) table_version: Py<PyArray1<u64>>,
    /// ``int32[S + 1]`` CSR offsets into ``table_delta``.
    #[pyo3(get)]
    pub(crate) table_delta_indptr: Py<PyArray1<i32>>,
    /// ``int32[n]`` per sequence, its table entries from ``table_start`` to its end.
    #[pyo3(get)]
    pub(crate) table_delta: Py<PyArray1<i32>>,
    /// ``int32[s, 2]`` host-tier stores ``(device_block, host_block)``: copy these FIRST in
    /// the step (before swap-out, swap-in, host loads, copy-on-write and the forward pass):
    /// the device blocks are about to be reused. Includes the stores of calls made since the
    /// previous step (e.g. ``swap_in``). Shape ``(0, 2)`` without a host tier.
    #[pyo3(get)]
    host_stores: Py<PyArray2<i32>>,
    /// ``int32[l, 2]`` host-tier loads ``(host_block, device_block)``: copy after the stores
    /// and swaps, before copy-on-write and the forward pass. Their host blocks stay pinned
    /// until the next ``step`` call returns. Shape ``(0, 2)`` without a host tier.
    #[pyo3(get)]
    host_loads: Py<PyArray2<i32>>,
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
    pub(crate) inner: Arc<OneGroupManager>,
    config: Py<PyCacheConfig>,
    /// The read-only pool view, built once (the scheduler reads it every step).
    pool: Py<PyBlockPool>,
}

/// The hashing inputs of one call (`add_sequence`, `KVIndexer.block_hashes` / `overlap`), read
/// in one place: a `pagedkv.SequenceSpec` passed as `spec` (read through its `keywords()`, the
/// request's one value), or the separate `cache_salt` / `adapter_id` / `extra_keys` /
/// `mm_items` keys. Both at once is an `InvalidArgumentError` (which would win is a guess), as
/// is a `spec` without `keywords()` returning a dict.
pub(crate) fn call_spec(
    spec: Option<&Bound<'_, PyAny>>,
    cache_salt: Option<&Bound<'_, PyAny>>,
    adapter_id: Option<&Bound<'_, PyAny>>,
    extra_keys: Option<&Bound<'_, PyAny>>,
    mm_items: Option<&Bound<'_, PyAny>>,
) -> PyResult<SequenceSpec> {
    let Some(spec) = spec.filter(|s| !s.is_none()) else {
        let salt = opt_str(cache_salt, "cache_salt")?;
        return sequence_spec(
            salt,
            opt_str(adapter_id, "adapter_id")?,
            extra_keys,
            mm_items,
        );
    };
    let py = spec.py();
    let given = [cache_salt, adapter_id, extra_keys, mm_items];
    if given.iter().any(|k| k.is_some_and(|k| !k.is_none())) {
        let reason =
            "pass either spec or the separate cache_salt / adapter_id / extra_keys / mm_items";
        return Err(bad(py, "spec", repr(spec), reason));
    }
    let refuse = || {
        let reason = format!("expected a pagedkv.SequenceSpec, got {}", type_name(spec));
        bad(py, "spec", repr(spec), reason)
    };
    let keywords = spec.call_method0("keywords").map_err(|_| refuse())?;
    let keywords = keywords.cast::<PyDict>().map_err(|_| refuse())?;
    let get = |key: &str| keywords.get_item(key);
    let (salt, adapter) = (get("cache_salt")?, get("adapter_id")?);
    let (keys, items) = (get("extra_keys")?, get("mm_items")?);
    sequence_spec(
        opt_str(salt.as_ref(), "cache_salt")?,
        opt_str(adapter.as_ref(), "adapter_id")?,
        keys.as_ref().filter(|k| !k.is_none()),
        items.as_ref().filter(|k| !k.is_none()),
    )
}

/// Hashing inputs of `add_sequence`: the salt and adapter as extra keys, `(tag, bytes)` extra
/// keys, `(item_hash, start_token, num_tokens)` multimodal items.
/// Shared with `KVIndexer` through [`call_spec`]: its queries must hash exactly like the manager.
fn sequence_spec(
    cache_salt: Option<String>,
    adapter_id: Option<String>,
    extra_keys: Option<&Bound<'_, PyAny>>,
    mm_items: Option<&Bound<'_, PyAny>>,
) -> PyResult<SequenceSpec> {
    let mut spec = SequenceSpec::default();
    spec.extra_keys.extend(adapter_id.map(ExtraKey::Adapter));
    spec.extra_keys.extend(cache_salt.map(ExtraKey::CacheSalt));
    let at = |item: &Bound<'_, PyAny>, i: usize| {
        let r = item.repr().map(|r| r.to_string()).unwrap_or_default();
        format!("{r} at index {i}")
    };
    if let Some(keys) = extra_keys {
        for (i, item) in list_items(keys, "extra_keys")?.iter().enumerate() {
            let (tag, value): (String, Vec<u8>) = item.extract().map_err(|_| {
                let reason = "expected (tag: str, value: bytes) tuples";
                bad(item.py(), "extra_keys", at(item, i), reason)
            })?;
            spec.extra_keys.push(ExtraKey::Tagged { tag, value });
        }
    }
    if let Some(items) = mm_items {
        for (i, item) in list_items(items, "mm_items")?.iter().enumerate() {
            let refuse = || {
                let reason = "expected (item_hash: bytes, start_token: int >= 0, num_tokens: int >= 1) tuples";
                bad(item.py(), "mm_items", at(item, i), reason)
            };
            let (hash, start, len): (Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>) =
                item.extract().map_err(|_| refuse())?;
            let item_hash = hash
                .cast::<PyBytes>()
                .map_err(|_| refuse())?
                .as_bytes()
                .to_vec();
            let start = uint(&start, "mm_items", u64::MAX).map_err(|_| refuse())?;
            let len = uint(&len, "mm_items", u64::MAX).map_err(|_| refuse())?;
            spec.mm_items.push(MmItem {
                item_hash,
                start,
                len,
            });
        }
    }
    Ok(spec)
}

/// `step`'s per-sequence `num_new_tokens`: one int for every sequence, or an array-like of
/// `n` ints.
fn step_num_new_tokens(obj: &Bound<'_, PyAny>, n: usize) -> PyResult<Vec<u32>> {
    const ARG: &str = "num_new_tokens";
    let max = u64::from(u32::MAX);
    if obj.is_instance_of::<PyInt>() {
        return Ok(vec![uint(obj, ARG, max)? as u32; n]);
    }
    let v = uint_array(obj, ARG, max)?;
    if v.len() != n {
        let reason = format!("expected one per sequence ({n})");
        return Err(bad(obj.py(), ARG, format!("{} entries", v.len()), reason));
    }
    Ok(v.into_iter().map(|x| x as u32).collect())
}

/// `step`'s `append_token_ids` (or `draft_token_ids`: `arg` names it) as CSR `(indptr,
/// tokens)`: None; a 1-D integer array of `n` tokens (one per sequence, the decode case); or a
/// list / tuple of `n` array-likes of tokens.
fn step_appends(
    obj: Option<&Bound<'_, PyAny>>,
    n: usize,
    arg: &'static str,
) -> PyResult<(Vec<u32>, Vec<u32>)> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok((Vec::new(), Vec::new()));
    };
    let wrong_len = |got: usize| {
        let reason = format!("expected one per sequence ({n})");
        bad(obj.py(), arg, format!("{got} entries"), reason)
    };
    if obj.is_instance_of::<PyUntypedArray>() {
        let tokens = token_ids(obj, arg)?;
        if tokens.len() != n {
            return Err(wrong_len(tokens.len()));
        }
        return Ok(((0..=n as u32).collect(), tokens));
    }
    let rows = list_items(obj, arg)?;
    if rows.len() != n {
        return Err(wrong_len(rows.len()));
    }
    let mut indptr = Vec::with_capacity(n + 1);
    indptr.push(0u32);
    let mut tokens = Vec::new();
    for row in &rows {
        tokens.extend(token_ids(row, arg)?);
        let end = u32::try_from(tokens.len()).map_err(|_| {
            bad(
                obj.py(),
                arg,
                format!("{} tokens", tokens.len()),
                "too many tokens",
            )
        })?;
        indptr.push(end);
    }
    Ok((indptr, tokens))
}

#[pymethods]
impl PyKvCacheManager {
    #[new]
    fn new(py: Python<'_>, config: &Bound<'_, PyAny>) -> PyResult<Self> {
        let config: Py<PyCacheConfig> = config
            .cast::<PyCacheConfig>()
            .map_err(|_| {
                let reason = format!("expected a CacheConfig, got {}", type_name(config));
                bad(py, "config", repr(config), reason)
            })?
            .clone()
            .unbind();
        let cfg = config.get().inner.clone();
        let inner = py.detach(|| OneGroupManager::new(cfg)).py(py)?;
        let inner = Arc::new(inner);
        let pool = Py::new(py, PyBlockPool::view_of(inner.clone()))?;
        Ok(Self {
            inner,
            config,
            pool,
        })
    }

    /// The configuration (frozen).
    #[getter]
    fn config(&self, py: Python<'_>) -> Py<PyCacheConfig> {
        self.config.clone_ref(py)
    }

    /// A read-only view of the underlying block pool (ref counts, hashes, free queue).
    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyBlockPool> {
        self.pool.clone_ref(py)
    }

    /// Registers sequence ``seq_id`` with its prompt (``int`` token ids, list or 1-D integer
    /// array; no blocks yet). ``cache_salt`` / ``adapter_id`` / ``extra_keys`` ((tag, bytes)
    /// pairs) are mixed into every block hash, so sequences that differ in any of them never
    /// share cached blocks; ``mm_items`` are ``(item_hash, start_token, num_tokens)`` multimodal
    /// items keying the blocks they overlap. ``spec``, a ``pagedkv.SequenceSpec``, carries all
    /// of them as one value (then pass none of the separate keys).
    ///
    /// Raises: ``SequenceExistsError``; ``InvalidArgumentError`` (empty prompt, negative or
    /// non-integer ids, malformed keys / items, ``spec`` together with a separate key).
    #[pyo3(signature = (seq_id, prompt_token_ids, *, spec = None, cache_salt = None, adapter_id = None, extra_keys = None, mm_items = None))]
    #[allow(clippy::too_many_arguments)]
    fn add_sequence(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        spec: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        adapter_id: Option<&Bound<'_, PyAny>>,
        extra_keys: Option<&Bound<'_, PyAny>>,
        mm_items: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let prompt = token_ids(prompt_token_ids, "prompt_token_ids")?;
        let spec = call_spec(spec, cache_salt, adapter_id, extra_keys, mm_items)?;
        let m = &self.inner;
        py.detach(|| m.add_sequence_owned(seq, prompt, spec)).py(py)
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
        py.detach(|| m.append_tokens(seq, &tokens)).py(py)
    }

    /// Tokens that would be served from the prefix cache if ``seq_id`` were allocated from
    /// scratch now (a multiple of ``block_size``, at most ``num_tokens - 1``). No side effects.
    /// Raises ``UnknownSequenceError``.
    fn lookup_prefix(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.detach(|| m.lookup_prefix(seq)).py(py)
    }

    /// Exactly the number of blocks the next ``allocate_slots(seq_id, num_new_tokens)`` takes
    /// from the free pool (fresh blocks + prefix hits on free cached blocks + copy-on-write).
    /// No side effects. Raises as ``allocate_slots`` except ``OutOfBlocksError``.
    fn num_blocks_needed(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let q = count(num_new_tokens, "num_new_tokens")?;
        let m = &self.inner;
        py.detach(|| m.num_blocks_needed(seq, q)).py(py)
    }

    /// Schedules up to ``num_new_tokens`` uncomputed tokens of ``seq_id`` and makes room for
    /// their KV: prefix hits first on a sequence's first allocation, new blocks as needed, a
    /// private copy of a shared partially filled last block (copy-on-write). Newly full blocks
    /// are hashed into the prefix cache. All or nothing.
    ///
    /// ``draft_token_ids`` (speculative decoding's verify step: ``k`` proposed tokens, list
    /// or 1-D integer array) also gives the drafts lookahead slots at positions
    /// ``num_computed_tokens .. + k`` in the same call; they are not tokens of the sequence
    /// (nothing hashed, cached or announced for them) until ``accept_drafts`` keeps a prefix.
    ///
    /// Raises: ``UnknownSequenceError``; ``InvalidSequenceStateError`` (swapped out, or drafts
    /// pending); ``InvalidArgumentError`` (``num_new_tokens == 0``, nothing left to compute, or
    /// drafts while the scheduled tokens do not reach the last token); ``OutOfBlocksError``.
    #[pyo3(signature = (seq_id, num_new_tokens, draft_token_ids = None))]
    fn allocate_slots(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
        draft_token_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PySlotAllocation> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let q = count(num_new_tokens, "num_new_tokens")?;
        let drafts = match draft_token_ids.filter(|d| !d.is_none()) {
            Some(d) => token_ids(d, "draft_token_ids")?,
            None => Vec::new(),
        };
        let m = &self.inner;
        let a = py
            .detach(|| m.allocate_slots_with_drafts(seq, q, &drafts))
            .py(py)?;
        Ok(PySlotAllocation {
            num_scheduled_tokens: a.num_scheduled_tokens,
            num_cached_tokens: a.num_cached_tokens,
            num_context_tokens: a.num_context_tokens,
            new_block_ids: block_array(py, a.new_block_ids),
            copies: pairs_array(py, &a.copies),
            num_draft_tokens: a.num_draft_tokens,
        })
    }

    /// Resolves the pending drafts of ``seq_id`` after verification: the first
    /// ``num_accepted`` become tokens of the sequence (KV computed); the rejected tail's slots
    /// are free for the next step and blocks that held only rejected drafts are released.
    /// Blocks filled by accepted tokens are hashed and cached. The token sampled after them is
    /// appended as usual. Returns the released blocks as ``int32[r]`` (tail first).
    ///
    /// ``release_blocks=False`` keeps those blocks in the table as spare lookahead blocks that
    /// the next allocations fill first (nothing released; for a consumer whose copy of the
    /// table only grows while a request runs, as vLLM's model runner); a flag like ``step``'s.
    ///
    /// Raises: ``UnknownSequenceError``; ``InvalidSequenceStateError`` (no drafts pending);
    /// ``InvalidArgumentError`` (``num_accepted`` negative, not an int, or more than proposed).
    #[pyo3(signature = (seq_id, num_accepted, *, release_blocks = None),
           text_signature = "(self, seq_id, num_accepted, *, release_blocks=True)")]
    fn accept_drafts<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
        num_accepted: &Bound<'py, PyAny>,
        release_blocks: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Py<PyArray1<i32>>> {
        let release = crate::convert::flag(release_blocks, "release_blocks", true)?;
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let n = count(num_accepted, "num_accepted")?;
        let m = &self.inner;
        let released = py
            .detach(|| {
                if release {
                    m.accept_drafts(seq, n)
                } else {
                    m.accept_drafts_keeping_blocks(seq, n)
                }
            })
            .py(py)?;
        Ok(block_array(py, released))
    }

    /// Draft tokens pending on ``seq_id`` (0 unless its last allocation had drafts not yet
    /// resolved by ``accept_drafts``). Raises ``UnknownSequenceError``.
    fn num_draft_tokens(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.detach(|| m.num_draft_tokens(seq)).py(py)
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
        py.detach(|| m.fork(parent, child)).py(py)
    }

    /// Frees ``seq_id`` (blocks released tail-first, cached ones keep their hashes) and forgets
    /// it. Idempotent: False for an unknown or already freed id.
    fn free(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        Ok(py.detach(|| m.free(seq)))
    }

    /// Preempts a group of sequences by recompute, all or nothing: blocks released, tokens
    /// kept, ``num_computed_tokens`` back to 0. Raises ``UnknownSequenceError``,
    /// ``InvalidArgumentError`` (duplicate id), ``InvalidSequenceStateError`` (swapped out).
    fn preempt(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        py.detach(|| m.preempt_recompute(&seqs)).py(py)
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
        let plan = py.detach(|| m.swap_out(&seqs)).py(py)?;
        Ok(pairs_array(py, &plan))
    }

    /// Swaps a group back in, all or nothing; its full blocks are cached again, unless the prefix
    /// cache was reset while they were out. Returns ``int32[k, 2]`` ``(cpu_block, gpu_block)``
    /// rows. Raises ``OutOfBlocksError``, ``UnknownSequenceError``, ``InvalidSequenceStateError``.
    fn swap_in<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Py<PyArray2<i32>>> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        let plan = py.detach(|| m.swap_in(&seqs)).py(py)?;
        Ok(pairs_array(py, &plan))
    }

    /// Drops every prefix hash, those of swapped-out blocks included: a sequence swapped out now
    /// caches none of its blocks after its swap-in (its KV predates the reset) until a
    /// recompute preemption. Raises ``CacheInUseError`` while any block is in use.
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<()> {
        let m = &self.inner;
        py.detach(|| m.reset_prefix_cache()).py(py)
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
        let t = py.detach(|| m.block_table(seq)).py(py)?;
        Ok(block_array(py, t))
    }

    /// Known (finalized) tokens of ``seq_id``. Raises ``UnknownSequenceError``.
    fn num_tokens(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.detach(|| m.num_tokens(seq)).py(py)
    }

    /// Tokens of ``seq_id`` whose KV is (scheduled to be) written. Raises
    /// ``UnknownSequenceError``.
    fn num_computed_tokens(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.detach(|| m.num_computed_tokens(seq)).py(py)
    }

    /// ``"running"``, ``"preempted"`` or ``"swapped"``. Raises ``UnknownSequenceError``.
    fn status(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        Ok(py.detach(|| m.status(seq)).py(py)?.name())
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
        let t = py.detach(|| m.tokens(seq)).py(py)?;
        Ok(PyArray1::from_vec(py, t.into_iter().map(i64::from).collect()).unbind())
    }

    /// Registered sequences.
    #[getter]
    fn num_sequences(&self, py: Python<'_>) -> usize {
        let m = &self.inner;
        py.detach(|| m.num_sequences())
    }

    /// One scheduler step in ONE call with the GIL released: for each sequence in order, append
    /// its new tokens, then ``allocate_slots(seq, num_new_tokens[i])``; stop at the first
    /// failure (reported in ``StepOutput.error``, not raised).
    ///
    /// Args:
    ///     seq_ids: ``S`` sequence ids (list or 1-D integer array, e.g. ``uint64``/``int64``).
    ///     num_new_tokens: one int for all, or ``S`` ints (list or ``int32`` array).
    ///     append_token_ids: None; a 1-D integer array of ``S`` tokens (one per sequence, the
    ///         decode case); or ``S`` lists / arrays of tokens.
    ///
    /// Raises ``InvalidArgumentError`` for arguments it cannot read (wrong types, negative ids,
    /// lengths that disagree; nothing done). A request refused as a whole by the core (a
    /// sequence listed twice) is not raised either: it comes back with ``num_scheduled == 0``
    /// and ``error`` set, nothing changed. ``StepOutput.raise_for_error()`` raises any of these.
    ///
    /// The block tables come back as a delta (``StepOutput.table_start`` / ``table_delta``:
    /// only the entries that changed since each sequence's last reported table), which
    /// ``pagedkv.BlockTable`` applies to the tables it keeps across steps.
    /// ``block_table=True`` also copies out every scheduled sequence's whole table as one dense
    /// padded ``int32[S, W]`` matrix (``StepOutput.block_table``; O(S x longest table)); by
    /// default it is empty (shape ``(0, 0)``).
    /// ``token_arrays=False`` leaves the per-token ``slot_mapping`` and ``input_ids`` empty
    /// (``int64[0]``): for a caller that needs only block ids and lengths (a scheduler, or a
    /// model runner that builds slot mappings on the device from the block tables), it saves
    /// 16 bytes of fresh memory per scheduled token. Either flag takes a bool or numpy.bool_
    /// (None: its default); anything else is an ``InvalidArgumentError``.
    // The flags are read by hand so that a wrong type (``token_arrays=0``) is an
    // InvalidArgumentError naming the argument, as for every other argument of ``step``.
    ///
    /// ``draft_token_ids`` (speculative decoding's verify step; None, or as
    /// ``append_token_ids``: ``S`` rows of proposed tokens) gives each sequence lookahead slots
    /// for its drafts after its scheduled tokens, as ``allocate_slots(..., draft_token_ids)``:
    /// its query is its tokens then its drafts (``StepOutput.num_draft_tokens``), nothing is
    /// hashed for them, and it stays pending until ``accept_drafts``.
    #[pyo3(signature = (seq_ids, num_new_tokens, append_token_ids = None, *, draft_token_ids = None, block_table = None, token_arrays = None),
           text_signature = "(self, seq_ids, num_new_tokens, append_token_ids=None, *, draft_token_ids=None, block_table=False, token_arrays=True)")]
    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
        append_token_ids: Option<&Bound<'_, PyAny>>,
        draft_token_ids: Option<&Bound<'_, PyAny>>,
        block_table: Option<&Bound<'_, PyAny>>,
        token_arrays: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyStepOutput> {
        let block_table = crate::convert::flag(block_table, "block_table", false)?;
        let token_arrays = crate::convert::flag(token_arrays, "token_arrays", true)?;
        let seq_ids = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let num_new_tokens = step_num_new_tokens(num_new_tokens, seq_ids.len())?;
        let (append_indptr, append_tokens) =
            step_appends(append_token_ids, seq_ids.len(), "append_token_ids")?;
        let (draft_indptr, draft_tokens) =
            step_appends(draft_token_ids, seq_ids.len(), "draft_token_ids")?;
        let drafts = StepDrafts {
            indptr: draft_indptr,
            tokens: draft_tokens,
        };
        let req = StepRequest {
            seq_ids,
            num_new_tokens,
            append_indptr,
            append_tokens,
        };
        let m = &self.inner;
        let opts = StepOptions {
            skip_block_table: !block_table,
            skip_token_arrays: !token_arrays,
        };
        let out = py.detach(|| m.step_with_drafts(&req, &drafts, opts));
        let error = match &out.error {
            Some(e) => Some(error_instance(py, e)?.unbind()),
            None => None,
        };
        let arr = |v: Vec<i32>| PyArray1::from_vec(py, v).unbind();
        // Two scalars the kernels' launch needs, here in O(S) instead of two numpy reductions.
        let max_seq_len = out.seq_lens.iter().copied().max().unwrap_or(0).max(0) as usize;
        let max_query_len = (out.query_start_loc.windows(2))
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0)
            .max(0) as usize;
        Ok(PyStepOutput {
            num_tokens: out.query_start_loc.last().copied().unwrap_or(0).max(0) as usize,
            max_seq_len,
            max_query_len,
            num_scheduled: out.num_scheduled,
            error,
            num_draft_tokens: arr(if out.num_draft_tokens.is_empty() {
                vec![0; out.num_scheduled]
            } else {
                out.num_draft_tokens
            }),
            num_cached_tokens: arr(out.num_cached_tokens),
            query_start_loc: arr(out.query_start_loc),
            seq_lens: arr(out.seq_lens),
            context_lens: arr(out.context_lens),
            slot_mapping: PyArray1::from_vec(py, out.slot_mapping).unbind(),
            new_block_indptr: arr(out.new_block_indptr),
            new_block_ids: arr(out.new_block_ids),
            copies: matrix(py, out.copies, 2),
            input_ids: PyArray1::from_vec(py, out.input_ids).unbind(),
            block_table: if out.block_table_width == 0 {
                Array2::<i32>::zeros((0, 0)).into_pyarray(py).unbind()
            } else {
                matrix(py, out.block_table, out.block_table_width)
            },
            seq_ids: PyArray1::from_slice(py, &req.seq_ids[..out.num_scheduled]).unbind(),
            table_start: arr(out.table_start),
            table_version: PyArray1::from_vec(py, out.table_version).unbind(),
            table_delta_indptr: arr(out.table_delta_indptr),
            table_delta: arr(out.table_delta),
            host_stores: matrix(py, out.host_stores, 2),
            host_loads: matrix(py, out.host_loads, 2),
        })
    }

    /// Per sequence, in order: ``num_tokens - num_computed_tokens`` (tokens known but not yet
    /// scheduled), as ``int32[n]``. Raises ``UnknownSequenceError`` (nothing changed).
    fn num_uncomputed_tokens<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Py<PyArray1<i32>>> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        let v = py.detach(|| m.num_uncomputed_tokens(&seqs)).py(py)?;
        Ok(PyArray1::from_vec(py, v).unbind())
    }

    /// Device blocks the group ``seq_ids`` still has to take so every known token of every
    /// member has a KV slot: what scheduling all their uncomputed tokens now, in this order,
    /// would take from the free pool (fresh blocks, prefix hits on free cached blocks,
    /// copy-on-write), the group's own sharing counted once; a swapped-out member counts the
    /// distinct blocks ``swap_in`` would take. For admission control. No side effects.
    /// Raises ``UnknownSequenceError``, ``InvalidArgumentError`` (an id listed twice).
    fn num_blocks_owed(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        py.detach(|| m.num_blocks_owed(&seqs)).py(py)
    }

    /// The host-tier copies planned since the last hand-out, for callers that allocate with
    /// ``allocate_slots`` / ``swap_in`` outside ``step`` (which hands them out itself in
    /// ``StepOutput.host_stores`` / ``host_loads``): ``(stores, loads)``, ``int32[s, 2]``
    /// ``(device_block, host_block)`` and ``int32[l, 2]`` ``(host_block, device_block)``. Run
    /// the stores first, before any ``swap_in`` copy planned since (a store may read an evicted
    /// block that a swap-in destination reuses), the loads before the forward pass that reads
    /// them; the loads' host
    /// blocks stay pinned until the next ``step`` call returns. Both ``(0, 2)`` without a
    /// host tier.
    fn take_host_transfers<'py>(&self, py: Python<'py>) -> (Py<PyArray2<i32>>, Py<PyArray2<i32>>) {
        let m = &self.inner;
        let t = py.detach(|| m.take_host_transfers());
        (pairs_array(py, &t.stores), pairs_array(py, &t.loads))
    }

    /// A snapshot of usage and counters (``CacheStats``).
    fn stats(&self, py: Python<'_>) -> PyCacheStats {
        let m = &self.inner;
        PyCacheStats {
            inner: py.detach(|| m.stats()),
        }
    }

    /// Drains the buffered KV events, oldest first (always empty unless the config has
    /// ``enable_events=True``): ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let m = &self.inner;
        let events = py.detach(|| m.take_events());
        let objs = events
            .into_iter()
            .map(|e| event_object(py, e))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, objs)
    }

    /// Checks invariants 1-4 and 9 (the host tier) of docs/design.md (the pool's included); raises
    /// ``InvariantViolationError`` (an ``AssertionError``) naming the first violation. O(num_blocks + blocks of all sequences).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let m = &self.inner;
        py.detach(|| m.check_invariants())
            .map_err(|msg| crate::errors::invariant_violation(py, msg))
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
