//! `pagedkv.KVCacheManager`: THE KV cache manager, one full-attention group or several KV
//! cache groups in one pool, over the core's manager.
//!
//! Every method converts its arguments while holding the GIL, releases the GIL around the core
//! call (which takes the manager's mutex), and converts the result back into numpy arrays (no
//! per-block Python objects).

use crate::config::PyCacheConfig;
use crate::convert::{
    bad, count, list_items, opt_str, repr, token_ids, type_name, uint, uint_array,
};
use crate::errors::IntoPyResult;
use crate::events::event_object;
use crate::groups::PyGroupSpec;
use crate::pool::PyBlockPool;
use crate::stats::PyCacheStats;
use crate::step_output::{block_array, pairs_array, triples, PySlotAllocation, PyStepOutput};
use numpy::{PyArray1, PyArray2, PyUntypedArray};
use pagedkv_core::{
    ExtraKey, KvCacheManager, MmItem, SequenceSpec, StepDrafts, StepOptions, StepRequest,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList};
use std::sync::Arc;

/// The paged KV cache manager (PagedAttention, Kwon et al., SOSP'23): per-sequence block
/// tables over one block pool, for one full-attention KV cache group or for the KV cache
/// groups of a hybrid model (``CacheConfig(groups=...)``: full attention, sliding window,
/// chunked local; one block table per group per sequence, out-of-window blocks released).
/// Automatic prefix caching (chained SHA-256 block hashes, as vLLM's V1 KV cache manager; a
/// hit is the longest prefix every group serves, a multiple of ``hit_unit``), copy-on-write
/// after ``fork``, preemption by recompute or swap, speculative lookahead slots, a host-memory
/// prefix-cache tier, and a batched ``step`` for the scheduler. See docs/design.md.
///
/// ``G`` (``num_groups``) is 1 for ``CacheConfig(num_blocks, block_size)``; results with a
/// group dimension have it for every layout.
///
/// Thread-safe: every method releases the GIL around the core call, which takes one mutex over
/// the per-sequence state. Every failing call raises a ``pagedkv.PagedKVError`` subclass and
/// leaves the state unchanged. Units: tokens for token counts, blocks for block counts; block
/// ids are ``int32`` arrays (GPU ids ``1..num_blocks``; 0 is the null block; a block id names
/// one page of every layer of its group).
///
/// Raises ``InvalidArgumentError`` when ``config`` is not a ``CacheConfig``.
#[pyclass(frozen, module = "pagedkv._core", name = "KVCacheManager")]
pub(crate) struct PyKvCacheManager {
    pub(crate) inner: Arc<KvCacheManager>,
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
        let inner = Arc::new(py.detach(|| KvCacheManager::new(cfg)).py(py)?);
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

    /// A read-only view of the one block pool (ref counts, hashes, free queue), for every
    /// layout.
    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyBlockPool> {
        self.pool.clone_ref(py)
    }

    /// The KV cache groups' specs, in group order (``config.groups``).
    #[getter]
    fn groups(&self) -> Vec<PyGroupSpec> {
        (self.inner.config().groups.iter())
            .map(|&inner| PyGroupSpec { inner })
            .collect()
    }

    /// Per model layer, the index of its group (``config.layer_groups``; ``[]`` for the
    /// one-group configuration).
    #[getter]
    fn layer_groups(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(self.config.bind(py).getattr("layer_groups")?.unbind())
    }

    /// ``G``: KV cache groups (1 for the one-group configuration).
    #[getter]
    fn num_groups(&self) -> usize {
        self.inner.num_groups()
    }

    /// Tokens; prefix hits are multiples of it (the LCM of the groups' block sizes:
    /// ``block_size`` with one group).
    #[getter]
    fn hit_unit(&self) -> usize {
        self.inner.hit_unit()
    }

    /// Pages (blocks) in the pool, the null block included.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.config().num_blocks
    }

    /// Free pages (uncached + evictable cached).
    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.pool().num_free()
    }

    /// CPU swap blocks (0: no swapping).
    #[getter]
    fn num_cpu_blocks(&self) -> u32 {
        self.inner.config().num_cpu_blocks
    }

    /// Host-memory blocks of the prefix cache's second tier (0: none).
    #[getter]
    fn num_host_blocks(&self) -> u32 {
        self.inner.config().num_host_blocks
    }

    /// The retention interval in tokens (0: every full block of a windowed group is cached).
    #[getter]
    fn retention_interval(&self) -> u32 {
        self.inner.config().retention_interval
    }

    /// Whether full blocks are cached by their chained hashes (prefix caching).
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.config().enable_prefix_caching
    }

    /// Registered sequences.
    #[getter]
    fn num_sequences(&self) -> usize {
        self.inner.num_sequences()
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
        py.detach(|| m.add_sequence(seq, prompt, spec)).py(py)
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

    /// Tokens a first allocation of ``seq_id`` would take from the prefix cache now: the
    /// longest prefix every group serves (a multiple of ``hit_unit``, at most
    /// ``num_tokens - 1``, or the limit ``set_hit_limit`` set). No side effects. Raises
    /// ``UnknownSequenceError``.
    fn lookup_prefix(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.detach(|| m.lookup_prefix(seq)).py(py)
    }

    /// The longest prefix of ``seq_id`` (at most ``min(limit, num_tokens)`` tokens, a multiple
    /// of ``hit_unit``) that KV cache group ``group`` alone serves from the prefix cache (a
    /// full-attention group: its chain of cached blocks; a windowed group: the largest boundary
    /// whose window blocks are cached). 0 with prefix caching off. No side effects. Raises
    /// ``UnknownSequenceError``, ``InvalidArgumentError`` (``group`` out of range).
    fn lookup_prefix_group(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        group: &Bound<'_, PyAny>,
        limit: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let g = count(group, "group")?;
        let l = count(limit, "limit")?;
        let m = &self.inner;
        py.detach(|| m.lookup_prefix_group(seq, g, l)).py(py)
    }

    /// Caps the prefix hit of ``seq_id``'s first allocation (and ``lookup_prefix``) at
    /// ``min(limit, num_tokens)`` tokens, rounded down to ``hit_unit``; ``None`` restores the
    /// default ``num_tokens - 1``. A limit of ``num_tokens`` is for probing with
    /// ``lookup_prefix`` only (an allocation with nothing left to compute fails). Kept until
    /// set again. Raises ``UnknownSequenceError``.
    #[pyo3(signature = (seq_id, limit))]
    fn set_hit_limit(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        limit: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let limit = match limit.filter(|l| !l.is_none()) {
            Some(l) => Some(count(l, "limit")?),
            None => None,
        };
        let m = &self.inner;
        py.detach(|| m.set_hit_limit(seq, limit)).py(py)
    }

    /// With ``on``, the prefix hit of ``seq_id``'s first allocation (and ``lookup_prefix``)
    /// ignores state groups: the longest prefix the other groups serve, the state groups
    /// taking no hit block, because a KV connector loads the state after the loaded tokens
    /// (vLLM's divergent local hybrid hits). Only ``allocate_external`` with external tokens
    /// may allocate then. Cleared by the first allocation. A no-op without state groups.
    /// Raises ``UnknownSequenceError``; ``InvalidSequenceStateError`` unless the sequence
    /// holds no block; ``InvalidArgumentError`` if ``on`` is not a bool.
    #[pyo3(signature = (seq_id, on))]
    fn set_state_from_load(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        on: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        // Required: None is refused like any other non-bool (no silent default).
        if on.is_none() {
            let why = "expected a bool, got NoneType";
            return Err(crate::convert::bad(py, "on", "None", why));
        }
        let on = crate::convert::flag(Some(on), "on", false)?;
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.detach(|| m.set_state_from_load(seq, on)).py(py)
    }

    /// ``(take, release)``: exactly the blocks the next ``allocate_slots(seq_id,
    /// num_new_tokens)`` takes from the free pool (fresh blocks, prefix hits on free cached
    /// blocks, copy-on-write) and gives back (out-of-window blocks; 0 for full-attention
    /// groups); it succeeds exactly when ``take <= num_free_blocks + release``. Of a
    /// ``"loading"`` sequence: what that allocation takes once its load is committed in full
    /// (an in-flight load's reservation). No side effects. Raises ``UnknownSequenceError``,
    /// ``InvalidSequenceStateError``,
    /// ``InvalidArgumentError`` (as ``allocate_slots`` except ``OutOfBlocksError``).
    fn num_blocks_needed(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<(usize, usize)> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let q = count(num_new_tokens, "num_new_tokens")?;
        let m = &self.inner;
        let d = py.detach(|| m.num_blocks_needed(seq, q)).py(py)?;
        Ok((d.take, d.release))
    }

    /// ``num_blocks_needed`` per group: one ``(take, release)`` pair per group, in group order
    /// (they sum to ``num_blocks_needed``'s). Same errors, no side effects.
    fn num_blocks_needed_per_group(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(usize, usize)>> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let q = count(num_new_tokens, "num_new_tokens")?;
        let m = &self.inner;
        Ok(py.detach(|| m.num_blocks_needed(seq, q)).py(py)?.per_group)
    }

    /// ``(take, release)`` of a verify step: ``num_blocks_needed`` with lookahead slots for
    /// ``num_draft_tokens`` drafts after the ``num_new_tokens`` scheduled ones (as
    /// ``allocate_slots`` / ``step`` with drafts take them), and ``num_lookahead_slots``
    /// lookahead slots after them (as ``allocate_slots`` takes them). Same errors, plus
    /// ``InvalidArgumentError`` when the scheduled tokens do not reach the last token with
    /// drafts. No side effects.
    #[pyo3(signature = (seq_id, num_new_tokens, num_draft_tokens, num_lookahead_slots = None))]
    fn num_blocks_needed_with_drafts(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
        num_draft_tokens: &Bound<'_, PyAny>,
        num_lookahead_slots: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(usize, usize)> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let q = count(num_new_tokens, "num_new_tokens")?;
        let k = count(num_draft_tokens, "num_draft_tokens")?;
        let la = match num_lookahead_slots {
            Some(l) => count(l, "num_lookahead_slots")?,
            None => 0,
        };
        let m = &self.inner;
        let d = py
            .detach(|| m.num_blocks_needed_with_lookahead(seq, q, k, la))
            .py(py)?;
        Ok((d.take, d.release))
    }

    /// Schedules up to ``num_new_tokens`` uncomputed tokens of ``seq_id`` and makes room for
    /// their KV in every group: prefix hits first on a sequence's first allocation, new blocks
    /// as needed, a private copy of a shared partially filled last block (copy-on-write),
    /// out-of-window blocks released. Newly full blocks are hashed into the prefix cache. All or
    /// nothing. The per-request call of a scheduler (``step`` batches it).
    ///
    /// ``draft_token_ids`` (speculative decoding's verify step: ``k`` proposed tokens, list
    /// or 1-D integer array) also gives the drafts lookahead slots at positions
    /// ``num_computed_tokens .. + k`` in the same call; they are not tokens of the sequence
    /// (nothing hashed, cached or announced for them) until ``accept_drafts`` keeps a prefix.
    /// With a state group they are placeholder slots (an asynchronous scheduler's tokens
    /// being sampled): the live state moves over them and they are settled keeping their
    /// blocks (``accept_drafts(..., release_blocks=False)``), never rejected, so real drafts
    /// of speculative decoding must not be passed there, unless the config has speculative
    /// state blocks (``spare_blocks = k`` on the state groups): drafts (at most ``k``)
    /// are then real drafts, the state groups lay out their live block at the end with the
    /// drafts and ``k`` spares after it, and rejecting drafts leaves their tables as they are.
    ///
    /// ``num_lookahead_slots`` (a drafter with its own forward pass, EAGLE / MTP): slots past
    /// the scheduled tokens and drafts whose tokens do not exist yet, in every group; their
    /// blocks are held as spare blocks (private, never hashed) that the next allocations fill
    /// first. Allowed mid-prompt.
    ///
    /// Raises: ``UnknownSequenceError``; ``InvalidSequenceStateError`` (swapped out, or drafts
    /// pending); ``InvalidArgumentError`` (``num_new_tokens == 0``, nothing left to compute, or
    /// drafts while the scheduled tokens do not reach the last token); ``OutOfBlocksError``.
    #[pyo3(signature = (seq_id, num_new_tokens, draft_token_ids = None, num_lookahead_slots = None))]
    fn allocate_slots(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
        draft_token_ids: Option<&Bound<'_, PyAny>>,
        num_lookahead_slots: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PySlotAllocation> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let q = count(num_new_tokens, "num_new_tokens")?;
        let drafts = match draft_token_ids.filter(|d| !d.is_none()) {
            Some(d) => token_ids(d, "draft_token_ids")?,
            None => Vec::new(),
        };
        let la = match num_lookahead_slots {
            Some(l) => count(l, "num_lookahead_slots")?,
            None => 0,
        };
        let m = &self.inner;
        let a = py
            .detach(|| m.allocate_slots_with_lookahead(seq, q, &drafts, la))
            .py(py)?;
        Ok(PySlotAllocation::from_core(a))
    }

    /// First allocation of ``seq_id`` with ``num_external_tokens`` (``E``) tokens whose KV a
    /// KV connector loads right after the local prefix hit ``H`` (taken as ``allocate_slots``
    /// takes it), then ``num_new_tokens`` (``n``, capped at the tokens left) to compute. Every
    /// group gets blocks for ``H + E + n`` tokens (a windowed group none out of the window of
    /// ``H + E``: null entries). The result reports ``num_cached_tokens == H``,
    /// ``num_context_tokens == H + E``, ``num_scheduled_tokens == n`` (the forward pass
    /// computes positions ``H + E`` on); the connector writes the blocks of ``[H, H + E)``.
    ///
    /// ``staged=False``: a synchronous load (done before the forward pass); the loaded blocks
    /// are registered in the prefix cache now, as ``allocate_slots(seq_id, E + n)`` would.
    /// ``staged=True`` (requires ``n == 0``): an asynchronous load; ``status`` becomes
    /// ``"loading"`` and the blocks from ``H`` on are *staged*: held, but never matched by a
    /// prefix lookup, registered, announced in a KV event or offered to the host tier until
    /// ``commit_external``. A loading sequence refuses ``allocate_slots``, ``step``, ``fork``,
    /// ``swap_out``, ``append_tokens`` and ``accept_drafts`` (``InvalidSequenceStateError``);
    /// ``free`` and ``preempt`` release its staged blocks unregistered (abort, failed load).
    /// ``reserve_blocks``: blocks that must stay free after the call (other in-flight loads'
    /// reservations, see ``num_blocks_needed``); as ``step(reserve_blocks=)``.
    /// State groups: one live block at column ``(H + E + n - 1) // block_size`` (the connector
    /// writes the loaded state there; null entries before it, the hit's state as its copy
    /// source); staged, it is never matched or published until ``commit_external``.
    ///
    /// Raises (state unchanged): ``UnknownSequenceError``; ``InvalidSequenceStateError``
    /// unless the sequence holds no block (new, or preempted); ``InvalidArgumentError``
    /// (``num_external_tokens`` past the last token, ``num_new_tokens > 0`` with ``staged``,
    /// nothing to allocate); ``OutOfBlocksError`` (``requested`` counts ``reserve_blocks``).
    #[pyo3(signature = (seq_id, num_external_tokens, num_new_tokens = None, *, staged = None, reserve_blocks = None),
           text_signature = "(self, seq_id, num_external_tokens, num_new_tokens=0, *, staged=False, reserve_blocks=0)")]
    fn allocate_external(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_external_tokens: &Bound<'_, PyAny>,
        num_new_tokens: Option<&Bound<'_, PyAny>>,
        staged: Option<&Bound<'_, PyAny>>,
        reserve_blocks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PySlotAllocation> {
        let staged = crate::convert::flag(staged, "staged", false)?;
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let e = count(num_external_tokens, "num_external_tokens")?;
        let q = opt_count(num_new_tokens, "num_new_tokens")?;
        let r = opt_count(reserve_blocks, "reserve_blocks")?;
        let m = &self.inner;
        let a = py
            .detach(|| m.allocate_external(seq, e, q, staged, r))
            .py(py)?;
        Ok(PySlotAllocation::from_core(a))
    }

    /// ``(take, release)``: exactly what ``allocate_external(seq_id, num_external_tokens,
    /// num_new_tokens)`` takes from and gives back to the free pool (staged or not). Same
    /// errors except ``OutOfBlocksError``; no side effects.
    #[pyo3(signature = (seq_id, num_external_tokens, num_new_tokens = None),
           text_signature = "(self, seq_id, num_external_tokens, num_new_tokens=0)")]
    fn num_blocks_needed_external(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_external_tokens: &Bound<'_, PyAny>,
        num_new_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(usize, usize)> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let e = count(num_external_tokens, "num_external_tokens")?;
        let q = opt_count(num_new_tokens, "num_new_tokens")?;
        let m = &self.inner;
        let d = py
            .detach(|| m.num_blocks_needed_external(seq, e, q))
            .py(py)?;
        Ok((d.take, d.release))
    }

    /// Ends the asynchronous load of a ``"loading"`` sequence (vLLM's ``cache_blocks`` after
    /// ``finished_recving``): its KV is valid up to ``num_valid_tokens`` (``H <= n <= H + E``;
    /// less than ``H + E`` after a partial failure); it becomes ``"running"`` with that many
    /// computed tokens and the full blocks below it are registered now (KV events, host-tier
    /// notes). Blocks past ``ceil(n / block_size)`` stay held for the next allocations to
    /// compute into. Returns the number of blocks registered (every group). With state groups
    /// the loaded live state is published too (when ``H + E`` is block-aligned, counted in
    /// the return value), and only a load valid in full commits (free or preempt a failed one).
    ///
    /// Raises (state unchanged): ``UnknownSequenceError``; ``InvalidSequenceStateError``
    /// unless loading; ``InvalidArgumentError`` (``num_valid_tokens`` outside ``[H, H + E]``,
    /// below ``H + E`` with state groups,
    /// or a windowed group whose window at ``n`` reads blocks the load never took: preempt
    /// the sequence to recompute it instead).
    fn commit_external(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_valid_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let n = count(num_valid_tokens, "num_valid_tokens")?;
        let m = &self.inner;
        py.detach(|| m.commit_external(seq, n)).py(py)
    }

    /// The commit fence of state groups: every forward pass of ``seq_id`` that computed
    /// positions below ``num_tokens`` has completed. Publishes (prefix index, ``BlockStored``
    /// events, host tier) each state block still held whose state is the one after an aligned
    /// step end ``e = (j + 1) * block_size <= num_tokens`` (with a retention interval, only its
    /// multiples), and releases the published ones that are no longer live. Returns the number
    /// of blocks published (0 without state groups, for a number below an earlier commit, or
    /// a sequence not running). States whose step ended between alignment points are never
    /// published; a free, preemption or abort before the commit releases them unpublished.
    /// With speculative state blocks only the states at a step's known end and at an accepted
    /// end are published, and a column the live state left stays held until an allocation's
    /// computed tokens pass its end.
    ///
    /// Raises (state unchanged): ``UnknownSequenceError``; ``InvalidArgumentError``
    /// (``num_tokens`` above the computed tokens).
    fn commit_computed(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let n = count(num_tokens, "num_tokens")?;
        let m = &self.inner;
        py.detach(|| m.commit_computed(seq, n)).py(py)
    }

    /// ``commit_computed(seq_id, num_computed_tokens(seq_id))`` for each of ``seq_ids``
    /// (a sequence of ints or a ``uint64`` array) under one lock: what an engine calls once a
    /// step's forward pass over these sequences completed. Returns the state blocks published
    /// over all of them (0 without state groups).
    ///
    /// Raises (state unchanged): ``UnknownSequenceError`` for the first id not held.
    fn commit_all_computed(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        py.detach(|| m.commit_all_computed(&seqs)).py(py)
    }

    /// Truncates the computed range of running ``seq_id`` to ``num_computed_tokens`` (``n``):
    /// KV from ``n`` on is computed again (after a failed or partial load, or vLLM's rewind
    /// of a full hit's last token). Every block stays in the tables (a model runner's block
    /// table stays valid): the next allocations compute into them in place, without
    /// copy-on-write, before taking new ones.
    ///
    /// ``poisoned=False``: the kept blocks' KV is valid; their registrations stay.
    /// ``poisoned=True``: the KV from ``n`` on is invalid: every registered block of the
    /// sequence's tables from logical block ``n // block_size`` on (every group) is
    /// unregistered with its dependents, as ``evict_blocks`` does, and registered again once
    /// recomputed. Returns the number of blocks unregistered (0 unless poisoned).
    ///
    /// Raises (state unchanged): ``UnknownSequenceError``; ``InvalidSequenceStateError``
    /// unless running without pending drafts; ``InvalidArgumentError``
    /// (``num_computed_tokens`` above the computed tokens, or a windowed group's window at
    /// ``n`` reads blocks it released or never took: preempt the sequence instead).
    #[pyo3(signature = (seq_id, num_computed_tokens, *, poisoned))]
    fn rollback(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
        poisoned: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        // Required: None is refused like any other non-bool (no silent default).
        if poisoned.is_none() {
            let why = "expected a bool, got NoneType";
            return Err(crate::convert::bad(py, "poisoned", "None", why));
        }
        let poisoned = crate::convert::flag(Some(poisoned), "poisoned", false)?;
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let n = count(num_computed_tokens, "num_computed_tokens")?;
        let m = &self.inner;
        py.detach(|| m.rollback(seq, n, poisoned)).py(py)
    }

    /// Drops the prefix-cache registration of each of ``block_ids`` (list or 1-D integer
    /// array) that has one (vLLM's ``BlockPool.evict_blocks``: their KV is invalid) and of
    /// every registered block whose chain (in its KV cache group) descends from one of them.
    /// Held blocks stay held, and their holders register nothing from there on until a
    /// ``rollback`` to or below it or a preemption; cached free blocks become plain free
    /// blocks. ``BlockRemoved`` events for the hashes that no longer resolve; the host tier
    /// forgets the blocks dropped. Unregistered ids are skipped. Returns the number of blocks
    /// unregistered, dependents included.
    ///
    /// Raises ``InvalidBlockError`` (the null block 0 or an id ``>= num_blocks``; nothing
    /// changed).
    fn evict_blocks(&self, py: Python<'_>, block_ids: &Bound<'_, PyAny>) -> PyResult<usize> {
        let ids = crate::convert::block_ids(block_ids, "block_ids")?;
        let m = &self.inner;
        py.detach(|| m.evict_blocks(&ids)).py(py)
    }

    /// Frees ``seq_id`` (forgets it, as ``free``) but keeps its blocks referenced under the
    /// returned handle until ``release_deferred(handle)`` (vLLM's ``pop_blocks_for_free``:
    /// a worker may still read them, asynchronous scheduling on a KV consumer). The blocks
    /// stay counted as used and keep their registrations (still prefix hits); a loading
    /// sequence's staged blocks stay unregistered. Handles start at 1, never reused.
    ///
    /// Raises (nothing changed): ``UnknownSequenceError``; ``InvalidSequenceStateError`` for
    /// a swapped-out sequence (no GPU block to keep: ``free`` it).
    fn free_deferred(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<u64> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.detach(|| m.free_deferred(seq)).py(py)
    }

    /// ``preempt`` whose members' blocks stay referenced under the returned handle (tail
    /// first per member) until ``release_deferred``: the members are preempted at once (a
    /// re-admitted one allocates afresh, its old registered blocks are hits) while a worker
    /// may still read the old blocks. Same errors as ``preempt``, nothing changed then.
    fn preempt_deferred(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<u64> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        py.detach(|| m.preempt_deferred(&seqs)).py(py)
    }

    /// Releases the blocks kept under ``handle`` (tail first, as ``free`` would have);
    /// returns how many. Raises ``InvalidArgumentError`` for a handle never given out or
    /// released already (nothing changed).
    fn release_deferred(&self, py: Python<'_>, handle: &Bound<'_, PyAny>) -> PyResult<usize> {
        let h = count(handle, "handle")? as u64;
        let m = &self.inner;
        py.detach(|| m.release_deferred(h)).py(py)
    }

    /// The blocks kept under ``handle``, ``int32[n]`` in release order. Raises
    /// ``InvalidArgumentError`` unless the handle is pending.
    fn deferred_blocks(
        &self,
        py: Python<'_>,
        handle: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyArray1<i32>>> {
        let h = count(handle, "handle")? as u64;
        let m = &self.inner;
        let b = py.detach(|| m.deferred_blocks(h)).py(py)?;
        Ok(PyArray1::from_vec(py, b.into_iter().map(|x| x as i32).collect()).unbind())
    }

    /// Blocks kept by every pending deferred release (counted used by the pool).
    fn num_deferred_blocks(&self, py: Python<'_>) -> usize {
        let m = &self.inner;
        py.detach(|| m.num_deferred_blocks())
    }

    /// Tokens of ``seq_id`` an asynchronous load is writing into staged blocks (``E`` while
    /// ``"loading"``, else 0). Raises ``UnknownSequenceError``.
    fn num_staged_tokens(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.detach(|| m.num_staged_tokens(seq)).py(py)
    }

    /// Resolves the pending drafts of ``seq_id`` after its verify step: the first
    /// ``num_accepted`` become tokens (KV computed); in every group the rejected tail's slots
    /// are free for the next step and blocks that held only rejected drafts are released
    /// (never hashed); blocks filled by accepted tokens are cached (by the retention rule).
    /// The token sampled after them is appended as usual. Returns one ``int32[r_g]`` array of
    /// released blocks per group (tail first).
    ///
    /// ``release_blocks=False`` keeps those blocks as spare lookahead blocks the next
    /// allocations fill first (nothing released), for a consumer whose copy of the tables only
    /// grows while a request runs (vLLM's model runner); a flag like ``step``'s.
    ///
    /// Raises: ``UnknownSequenceError``; ``InvalidSequenceStateError`` (no drafts pending);
    /// ``InvalidArgumentError`` (``num_accepted`` negative, not an int, or more than proposed).
    #[pyo3(signature = (seq_id, num_accepted, *, release_blocks = None),
           text_signature = "(self, seq_id, num_accepted, *, release_blocks=True)")]
    fn accept_drafts(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_accepted: &Bound<'_, PyAny>,
        release_blocks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<Py<PyArray1<i32>>>> {
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
        Ok(released.into_iter().map(|g| block_array(py, g)).collect())
    }

    /// Releases the blocks of ``seq_id``'s windowed groups that no query from position
    /// ``num_tokens`` on reads, once every forward pass whose query starts below
    /// ``num_tokens`` has completed (vLLM's ``remove_skipped_blocks`` on the settled-token
    /// basis: its scheduler prunes a finishing request's table this way before a KV
    /// connector reads it). The rule an allocation applies once its context reaches
    /// ``num_tokens``, applied early; ``num_tokens`` is capped at the computed tokens and
    /// full-attention groups keep everything. Released entries become null; registered blocks
    /// stay cached. Returns one ``int32[r_g]`` array of released blocks per group (tail first).
    ///
    /// Raises: ``UnknownSequenceError``; ``InvalidSequenceStateError`` unless running;
    /// ``InvalidArgumentError`` (``num_tokens`` negative or not an int).
    fn release_skipped_blocks(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Py<PyArray1<i32>>>> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let n = count(num_tokens, "num_tokens")?;
        let m = &self.inner;
        let released = py.detach(|| m.release_skipped_blocks(seq, n)).py(py)?;
        Ok(released.into_iter().map(|g| block_array(py, g)).collect())
    }

    /// Registers ``seq_id``'s computed full blocks not cached yet whose lookahead tokens
    /// (``CacheConfig.hash_lookahead_tokens``) were appended since its last allocation, without
    /// allocating; a no-op without hash lookahead. Raises ``UnknownSequenceError``.
    fn cache_computed(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.detach(|| m.cache_computed(seq)).py(py)
    }

    /// Draft tokens pending on ``seq_id`` (0 unless its last allocation had drafts not yet
    /// resolved by ``accept_drafts``). Raises ``UnknownSequenceError``.
    fn num_draft_tokens(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.detach(|| m.num_draft_tokens(seq)).py(py)
    }

    /// Forks ``parent_id`` into a new sequence ``child_id`` sharing every group's blocks (ref
    /// counts +1; nothing allocated). Raises ``UnknownSequenceError`` (parent),
    /// ``SequenceExistsError`` (child), ``InvalidSequenceStateError`` (swapped-out parent).
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
    /// once. Returns ``int32[k, 2]`` ``(gpu_block, cpu_block)`` rows for the copy kernel (a
    /// block id names one page of every layer of its group). Raises ``OutOfSwapSpaceError``,
    /// ``UnknownSequenceError``, ``InvalidSequenceStateError``.
    fn swap_out(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<Py<PyArray2<i32>>> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        let plan = py.detach(|| m.swap_out(&seqs)).py(py)?;
        Ok(pairs_array(py, &plan))
    }

    /// Swaps a group back in, all or nothing: ``int32[k, 2]`` ``(cpu_block, gpu_block)`` rows.
    /// Its full blocks are cached again, unless ``reset_prefix_cache`` ran while it was out
    /// (its KV predates the reset: nothing of it is cached or announced until a recompute
    /// preemption). Raises ``OutOfBlocksError``, ``UnknownSequenceError``,
    /// ``InvalidSequenceStateError``.
    fn swap_in(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<Py<PyArray2<i32>>> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        let plan = py.detach(|| m.swap_in(&seqs)).py(py)?;
        Ok(pairs_array(py, &plan))
    }

    /// Drops every prefix hash of every group, those of swapped-out blocks included. Raises
    /// ``CacheInUseError`` while any block is in use (nothing changed).
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<()> {
        let m = &self.inner;
        py.detach(|| m.reset_prefix_cache()).py(py)
    }

    /// Group ``group``'s block table of ``seq_id``: ``int32[n]`` physical block ids in logical
    /// order (0 for released entries; CPU swap-block ids while swapped out, -1 for released
    /// entries). Raises ``UnknownSequenceError``; ``InvalidArgumentError`` for a group out of
    /// range.
    #[pyo3(signature = (seq_id, group = None), text_signature = "(self, seq_id, group=0)")]
    fn block_table(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        group: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyArray1<i32>>> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let g = match group {
            Some(g) => count(g, "group")?,
            None => 0,
        };
        let n = self.inner.num_groups();
        if g >= n {
            let reason = format!("expected a group index in 0..{n}");
            return Err(bad(py, "group", g.to_string(), reason));
        }
        let m = &self.inner;
        let mut tables = py.detach(|| m.block_tables(seq)).py(py)?;
        Ok(block_array(py, tables.swap_remove(g)))
    }

    /// The block tables of ``seq_id``, one ``int32[n_g]`` array per group (as
    /// ``block_table(seq_id, g)``). Raises ``UnknownSequenceError``.
    fn block_tables(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Py<PyArray1<i32>>>> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        let tables = py.detach(|| m.block_tables(seq)).py(py)?;
        Ok(tables.into_iter().map(|t| block_array(py, t)).collect())
    }

    /// Blocks ``seq_id`` holds in each group (its non-null table entries; CPU blocks while
    /// swapped out). Raises ``UnknownSequenceError``.
    fn num_blocks_held(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.detach(|| m.num_blocks_held(seq)).py(py)
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

    /// ``"running"``, ``"preempted"``, ``"swapped"`` or ``"loading"`` (an asynchronous
    /// external load in flight, see ``allocate_external``). Raises ``UnknownSequenceError``.
    fn status(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        Ok(py.detach(|| m.status(seq)).py(py)?.name())
    }

    /// The token ids of ``seq_id`` as ``int64[n]`` (prompt + appended). Raises
    /// ``UnknownSequenceError``.
    fn token_ids(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<Py<PyArray1<i64>>> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        let t = py.detach(|| m.tokens(seq)).py(py)?;
        Ok(PyArray1::from_vec(py, t.into_iter().map(i64::from).collect()).unbind())
    }

    /// Per sequence, in order: ``num_tokens - num_computed_tokens`` (tokens known but not yet
    /// scheduled), as ``int32[n]``. Raises ``UnknownSequenceError`` (nothing changed).
    fn num_uncomputed_tokens(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyArray1<i32>>> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        let v = py.detach(|| m.num_uncomputed_tokens(&seqs)).py(py)?;
        Ok(PyArray1::from_vec(py, v).unbind())
    }

    /// Device blocks the group ``seq_ids`` still has to take so every known token of every
    /// member has a KV slot: what scheduling all their uncomputed tokens now, in this order,
    /// would need free (the peak of ``take - release`` over the members: fresh blocks, prefix
    /// hits on free cached blocks, copy-on-write; the group's own sharing counted once); a
    /// swapped-out member counts the distinct blocks ``swap_in`` would take. For admission
    /// control. No side effects. Raises ``UnknownSequenceError``, ``InvalidArgumentError`` (an
    /// id listed twice).
    fn num_blocks_owed(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        py.detach(|| m.num_blocks_owed(&seqs)).py(py)
    }

    /// One scheduler step in ONE call with the GIL released: for each sequence in order,
    /// append its new tokens, then ``allocate_slots(seq, num_new_tokens[i])`` in every group;
    /// stop at the first failure (reported in ``StepOutput.error``, not raised).
    ///
    /// Args:
    ///     seq_ids: ``S`` sequence ids (list or 1-D integer array, e.g. ``uint64``/``int64``).
    ///     num_new_tokens: one int for all, or ``S`` ints (list or ``int32`` array).
    ///     append_token_ids: None; a 1-D integer array of ``S`` tokens (one per sequence, the
    ///         decode case); or ``S`` lists / arrays of tokens.
    ///     draft_token_ids: None, or per sequence its draft tokens (speculative decoding's
    ///         verify step; forms as ``append_token_ids``): they get lookahead slots after the
    ///         scheduled tokens in every group, the query is the tokens then the drafts
    ///         (``StepOutput.num_draft_tokens``), nothing is hashed for them, and the sequence
    ///         stays pending until ``accept_drafts``. A windowed group releases by the
    ///         committed context only.
    ///     block_table: also copy every scheduled sequence's whole tables out as one dense
    ///         padded ``int32[G, S, W]`` array (``StepOutput.block_tables``; O(G x S x longest
    ///         table)); default False: the tables come as deltas (``table_start`` /
    ///         ``table_delta``: only the entries that changed since each sequence's last
    ///         report), which ``pagedkv.BlockTable`` applies to the tables it keeps.
    ///     token_arrays: fill the per-token ``slot_mappings`` and ``input_ids`` (default True);
    ///         False leaves them empty (``int64[G, 0]`` / ``int64[0]``), for a caller that needs
    ///         only block ids and lengths (a scheduler, or a model runner that builds slot
    ///         mappings on the device).
    ///     reserve_blocks: blocks that must stay free after each sequence's allocation (an
    ///         admission watermark; default 0): a sequence that would leave fewer stops the
    ///         step with ``OutOfBlocksError`` in ``error`` (``requested`` counts the reserve).
    ///
    /// The flags take a bool or numpy.bool_ (None: the default); anything else is an
    /// ``InvalidArgumentError``.
    ///
    /// Raises ``InvalidArgumentError`` for arguments it cannot read (wrong types, negative ids,
    /// lengths that disagree; nothing done). A request refused as a whole by the core (a
    /// sequence listed twice) is not raised either: it comes back with ``num_scheduled == 0``
    /// and ``error`` set, nothing changed. ``StepOutput.raise_for_error()`` raises any of these.
    // The flags are read by hand so that a wrong type (``token_arrays=0``) is an
    // InvalidArgumentError naming the argument, as for every other argument of ``step``.
    #[pyo3(signature = (seq_ids, num_new_tokens, append_token_ids = None, *, draft_token_ids = None, block_table = None, token_arrays = None, reserve_blocks = None),
           text_signature = "(self, seq_ids, num_new_tokens, append_token_ids=None, *, draft_token_ids=None, block_table=False, token_arrays=True, reserve_blocks=0)")]
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
        reserve_blocks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyStepOutput> {
        let block_table = crate::convert::flag(block_table, "block_table", false)?;
        let token_arrays = crate::convert::flag(token_arrays, "token_arrays", true)?;
        let reserve_blocks = match reserve_blocks {
            Some(r) => count(r, "reserve_blocks")?,
            None => 0,
        };
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
        let opts = StepOptions {
            skip_block_table: !block_table,
            skip_token_arrays: !token_arrays,
            reserve_blocks,
        };
        let m = &self.inner;
        let out = py.detach(|| m.step_with(&req, &drafts, opts));
        PyStepOutput::from_core(py, out, &req.seq_ids, token_arrays, block_table)
    }

    /// The host-tier copies planned since the last hand-out, for callers that allocate with
    /// ``allocate_slots`` / ``swap_in`` outside ``step`` (which hands them out itself in
    /// ``StepOutput.host_stores`` / ``host_loads``): ``(stores, loads)``, ``int32[s, 3]``
    /// ``(group, device_block, host_block)`` and ``int32[l, 3]`` ``(group, host_block,
    /// device_block)`` rows. Run the stores first, before any ``swap_in`` copy planned since
    /// (a store may read an evicted block that a swap-in destination reuses), the loads before
    /// the forward pass that reads them; the loads' host blocks stay pinned until the next
    /// ``step`` call returns. Both ``(0, 3)`` without a host tier.
    fn take_host_transfers(&self, py: Python<'_>) -> (Py<PyArray2<i32>>, Py<PyArray2<i32>>) {
        let m = &self.inner;
        let t = py.detach(|| m.take_host_transfers());
        let flat = |v: Vec<(u32, u32, u32)>| -> Vec<i32> {
            v.into_iter()
                .flat_map(|(g, a, b)| [g as i32, a as i32, b as i32])
                .collect()
        };
        (triples(py, flat(t.stores)), triples(py, flat(t.loads)))
    }

    /// A snapshot of usage and counters over the whole pool (``CacheStats``; every group's
    /// pages count; ``block_size`` is group 0's).
    fn stats(&self, py: Python<'_>) -> PyCacheStats {
        let m = &self.inner;
        PyCacheStats {
            inner: py.detach(|| m.stats()),
        }
    }

    /// Drains the buffered KV events, oldest first (always empty unless the config has
    /// ``enable_events=True``): ``BlockStored`` and ``BlockRemoved`` (their ``group`` is the
    /// KV cache group they are about; their hashes are the plain chain hashes of that group's
    /// block size), ``AllBlocksCleared``.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let m = &self.inner;
        let events = py.detach(|| m.take_events());
        let objs = events
            .into_iter()
            .map(|e| event_object(py, e))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, objs)
    }

    /// Checks the invariants of docs/design.md (the pool's, the host tier's, the KV cache
    /// groups'); raises ``InvariantViolationError`` (an ``AssertionError``) naming the first
    /// violation. O(num_blocks + blocks of all sequences).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let m = &self.inner;
        py.detach(|| m.check_invariants())
            .map_err(|msg| crate::errors::invariant_violation(py, msg))
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        let p = self.inner.pool();
        let groups = match c.groups.len() {
            1 => String::new(),
            g => format!("num_groups={g}, "),
        };
        format!(
            "KVCacheManager(num_blocks={}, {groups}block_size={}, used={}, free={})",
            c.num_blocks,
            c.groups.first().map_or(0, |g| g.block_size),
            p.num_used(),
            p.num_free()
        )
    }
}

/// An optional count argument (``None`` or absent: 0), checked as [`count`].
fn opt_count(v: Option<&Bound<'_, PyAny>>, name: &'static str) -> PyResult<usize> {
    v.filter(|v| !v.is_none()).map_or(Ok(0), |v| count(v, name))
}
