//! `pagedkv.KVCacheGroupSpec`, `pagedkv.HybridKVCacheManager` and `HybridStepOutput`: KV
//! cache groups (full attention, sliding window, chunked local) in one block pool, for hybrid
//! models. One `step` call returns every group's slot mapping and block tables as numpy
//! arrays with a leading group dimension (C-contiguous, so `torch.from_numpy` shares them).

use crate::config::host_tier_fields;
use crate::convert::{bad, count, repr, token_ids, type_name, uint};
use crate::errors::{error_instance, to_pyerr, IntoPyResult};
use crate::events::event_object;
use crate::manager::call_spec;
use crate::stats::PyCacheStats;
use numpy::ndarray::{Array2, Array3};
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArray3};
use pagedkv_core::{
    AttentionKind, BlockId, Error, GroupSpec, HashAlgo, HybridConfig, HybridManager,
    HybridStepOptions, StepDrafts, StepRequest,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyTuple};
use std::sync::Arc;

fn config_error(py: Python<'_>, field: &'static str, value: String, reason: &str) -> PyErr {
    to_pyerr(
        py,
        &Error::InvalidConfig {
            field,
            value,
            reason: reason.into(),
        },
    )
}

/// A non-negative int field of a configuration, else `InvalidConfigError` naming it.
fn config_uint(obj: &Bound<'_, PyAny>, field: &'static str, max: u64) -> PyResult<u64> {
    uint(obj, field, max).map_err(|_| {
        config_error(
            obj.py(),
            field,
            repr(obj),
            &format!("expected an int in 0..={max}"),
        )
    })
}

/// One KV cache group: the attention kind of its layers and its page layout (frozen).
///
/// ``kind`` is ``"full"``, ``"sliding_window"`` (``window`` tokens: a query at position ``p``
/// reads ``(p - window, p]``) or ``"chunked_local"`` (``chunk`` tokens: it reads from
/// ``floor(p / chunk) * chunk``). ``block_size`` is in tokens; ``bytes_per_token`` is what one
/// token takes in one layer of the group (``2 * num_kv_heads * head_size * dtype bytes``), so
/// a page is ``block_size * bytes_per_token`` bytes. Every group of a manager must have the
/// same page size (checked by ``HybridKVCacheManager``).
///
/// Raises ``InvalidConfigError`` for an unknown kind, a missing or extra ``window`` /
/// ``chunk``, or a value that is not a non-negative int.
#[pyclass(frozen, eq, module = "pagedkv._core", name = "KVCacheGroupSpec")]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PyGroupSpec {
    pub(crate) inner: GroupSpec,
}

#[pymethods]
impl PyGroupSpec {
    #[new]
    #[pyo3(signature = (kind, block_size, bytes_per_token, *, window = None, chunk = None))]
    fn new(
        py: Python<'_>,
        kind: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        bytes_per_token: &Bound<'_, PyAny>,
        window: Option<&Bound<'_, PyAny>>,
        chunk: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let kind_s: String = kind.extract().map_err(|_| {
            let reason = format!("expected a str, got {}", type_name(kind));
            config_error(py, "kind", repr(kind), &reason)
        })?;
        let bs = config_uint(block_size, "block_size", u64::from(u32::MAX))? as u32;
        let bpt = config_uint(bytes_per_token, "bytes_per_token", u64::MAX)?;
        let window = window.filter(|w| !w.is_none());
        let chunk = chunk.filter(|c| !c.is_none());
        let span = |o: Option<&Bound<'_, PyAny>>, field: &'static str| -> PyResult<u32> {
            match o {
                Some(o) => Ok(config_uint(o, field, u64::from(u32::MAX))? as u32),
                None => Err(config_error(
                    py,
                    field,
                    "None".into(),
                    &format!("a {kind_s} group needs {field}"),
                )),
            }
        };
        let extra = |o: Option<&Bound<'_, PyAny>>, field: &'static str| -> PyResult<()> {
            match o {
                Some(o) => Err(config_error(
                    py,
                    field,
                    repr(o),
                    &format!("a {kind_s} group takes no {field}"),
                )),
                None => Ok(()),
            }
        };
        let inner = match kind_s.as_str() {
            "full" => {
                extra(window, "window")?;
                extra(chunk, "chunk")?;
                GroupSpec::full(bs, bpt)
            }
            "sliding_window" => {
                extra(chunk, "chunk")?;
                GroupSpec::sliding_window(bs, bpt, span(window, "window")?)
            }
            "chunked_local" => {
                extra(window, "window")?;
                GroupSpec::chunked_local(bs, bpt, span(chunk, "chunk")?)
            }
            _ => {
                return Err(config_error(
                    py,
                    "kind",
                    format!("{kind_s:?}"),
                    "expected \"full\", \"sliding_window\" or \"chunked_local\"",
                ))
            }
        };
        Ok(Self { inner })
    }

    /// ``"full"``, ``"sliding_window"`` or ``"chunked_local"``.
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.kind.name()
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.block_size
    }

    /// Bytes one token takes in one layer of the group.
    #[getter]
    fn bytes_per_token(&self) -> u64 {
        self.inner.bytes_per_token
    }

    /// The sliding window in tokens, or None.
    #[getter]
    fn window(&self) -> Option<u32> {
        match self.inner.kind {
            AttentionKind::SlidingWindow { window } => Some(window),
            _ => None,
        }
    }

    /// The local-attention chunk in tokens, or None.
    #[getter]
    fn chunk(&self) -> Option<u32> {
        match self.inner.kind {
            AttentionKind::ChunkedLocal { chunk } => Some(chunk),
            _ => None,
        }
    }

    /// Page size in bytes (``block_size * bytes_per_token``; None on overflow).
    #[getter]
    fn page_bytes(&self) -> Option<u64> {
        self.inner.page_bytes()
    }

    fn __repr__(&self) -> String {
        let span = match self.inner.kind {
            AttentionKind::SlidingWindow { window } => format!(", window={window}"),
            AttentionKind::ChunkedLocal { chunk } => format!(", chunk={chunk}"),
            AttentionKind::Full => String::new(),
        };
        format!(
            "KVCacheGroupSpec({:?}, block_size={}, bytes_per_token={}{span})",
            self.inner.kind.name(),
            self.inner.block_size,
            self.inner.bytes_per_token
        )
    }
}

/// The result of one ``HybridKVCacheManager.step``: the scheduled sequences' kernel inputs with
/// a leading group dimension (``G`` groups, ``S`` scheduled sequences, ``T`` scheduled tokens,
/// ``W`` the longest table of any group). Every array is C-contiguous numpy, so
/// ``torch.from_numpy`` shares it without a copy; group ``g``'s table is ``block_table[g]``.
///
/// Processing stops at the first failure: the arrays describe the first ``num_scheduled``
/// sequences and ``error`` holds the exception (not raised), or None.
#[pyclass(frozen, module = "pagedkv._core", name = "HybridStepOutput")]
pub(crate) struct PyHybridStepOutput {
    /// ``S``: sequences scheduled (a prefix of the request).
    #[pyo3(get)]
    num_scheduled: usize,
    /// The ``PagedKVError`` (not raised) that stopped the step, or None.
    #[pyo3(get)]
    error: Option<Py<PyAny>>,
    /// ``G``: KV cache groups.
    #[pyo3(get)]
    pub(crate) num_groups: usize,
    /// ``T``: tokens scheduled.
    #[pyo3(get)]
    num_tokens: usize,
    /// The longest ``seq_lens`` entry (tokens; 0 when nothing was scheduled).
    #[pyo3(get)]
    max_seq_len: usize,
    /// The longest query (tokens; 0 when nothing was scheduled).
    #[pyo3(get)]
    max_query_len: usize,
    /// ``uint64[S]`` scheduled sequence ids, in batch order.
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
    /// ``int64[T]`` token id of each scheduled token.
    #[pyo3(get)]
    input_ids: Py<PyArray1<i64>>,
    /// ``int32[S]`` draft tokens (speculative decoding) at the end of each sequence's query,
    /// in lookahead slots; all 0 for a step without ``draft_token_ids``.
    #[pyo3(get)]
    num_draft_tokens: Py<PyArray1<i32>>,
    /// ``int64[G, T]`` KV slot of each scheduled token in each group's layers:
    /// ``block_id * block_size_g + offset``.
    #[pyo3(get)]
    slot_mapping: Py<PyArray2<i64>>,
    /// ``int32[G, S, W]`` every group's block tables, padded with the null block 0; a
    /// windowed group's released entries are 0 too. Shape ``(0, 0, 0)`` after
    /// ``step(..., block_table=False)``.
    #[pyo3(get)]
    block_table: Py<PyArray3<i32>>,
    /// ``int32[S, G]`` the block-table deltas: entry ``[k, g]`` is the first logical block of
    /// sequence ``k``'s group-``g`` table that changed since the last step output that
    /// reported it (0 for a table new to the outputs: first allocation, resumed preemption,
    /// swap-in, fork child). That table is now its previous one up to ``table_start[k, g]``,
    /// then ``table_delta[table_delta_indptr[k * G + g]:table_delta_indptr[k * G + g + 1]]``.
    /// A window release counts as a change: the released entries come as the null block 0.
    #[pyo3(get)]
    pub(crate) table_start: Py<PyArray2<i32>>,
    /// ``uint64[S]`` the version of each sequence's tables this output reports (all groups):
    /// one more than its previous report's; a sequence's first report is above every version
    /// this manager reported before. A delta applies to the version before it only.
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
    /// ``int32[n]`` blocks newly taken per (sequence, group).
    #[pyo3(get)]
    new_block_ids: Py<PyArray1<i32>>,
    /// ``int32[c, 3]`` copy-on-write ``(group, src, dst)`` rows, to run (in that group's
    /// layers) before the K/V writes.
    #[pyo3(get)]
    copies: Py<PyArray2<i32>>,
    /// ``int32[n, 3]`` host-tier stores ``(group, device block, host block)``: copy FIRST in
    /// the step, from that group's device cache to its host cache (before swaps, host loads,
    /// copy-on-write and the forward pass). Shape ``(0, 3)`` without a host tier.
    #[pyo3(get)]
    host_stores: Py<PyArray2<i32>>,
    /// ``int32[n, 3]`` host-tier loads ``(group, host block, device block)``: copy after the
    /// stores and swaps, before copy-on-write and the forward pass. Their host blocks stay
    /// pinned until the next ``step`` returns. Shape ``(0, 3)`` without a host tier.
    #[pyo3(get)]
    host_loads: Py<PyArray2<i32>>,
}

#[pymethods]
impl PyHybridStepOutput {
    /// Raises ``error`` if the step stopped early; returns None otherwise.
    fn raise_for_error(&self, py: Python<'_>) -> PyResult<()> {
        match &self.error {
            Some(e) => Err(PyErr::from_value(e.bind(py).clone())),
            None => Ok(()),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "HybridStepOutput(num_scheduled={}, num_groups={}, num_tokens={}, error={})",
            self.num_scheduled,
            self.num_groups,
            self.num_tokens,
            if self.error.is_some() { "set" } else { "None" }
        )
    }
}

/// `step`'s `append_token_ids` as CSR `(indptr, tokens)`: None; a 1-D integer array of `n`
/// tokens (one per sequence); or a list / tuple of `n` array-likes of tokens.
fn appends(obj: Option<&Bound<'_, PyAny>>, n: usize) -> PyResult<(Vec<u32>, Vec<u32>)> {
    rows_csr(obj, n, "append_token_ids")
}

/// `obj` (argument `arg` of `step`: append or draft tokens) as CSR `(indptr, tokens)`, in the
/// forms `appends` takes.
fn rows_csr(
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
    if obj.is_instance_of::<numpy::PyUntypedArray>() {
        let tokens = token_ids(obj, arg)?;
        if tokens.len() != n {
            return Err(wrong_len(tokens.len()));
        }
        return Ok(((0..=n as u32).collect(), tokens));
    }
    let rows = crate::convert::list_items(obj, arg)?;
    if rows.len() != n {
        return Err(wrong_len(rows.len()));
    }
    let mut indptr = vec![0u32];
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

/// A flat row-major vector of triples as an ``int32[n, 3]`` array.
fn triples(py: Python<'_>, v: Vec<i32>) -> Py<PyArray2<i32>> {
    let n = v.len() / 3;
    Array2::from_shape_vec((n, 3), v)
        .expect("triples")
        .into_pyarray(py)
        .unbind()
}

fn pairs(py: Python<'_>, p: &[(BlockId, BlockId)]) -> Py<PyArray2<i32>> {
    let flat: Vec<i32> = p.iter().flat_map(|&(a, b)| [a as i32, b as i32]).collect();
    Array2::from_shape_vec((p.len(), 2), flat)
        .expect("pairs")
        .into_pyarray(py)
        .unbind()
}

/// KV cache manager of a hybrid model: several KV cache groups (``KVCacheGroupSpec``: full
/// attention, sliding window, chunked local) with one block table per group per sequence,
/// all over one pool of ``num_blocks`` equal-size pages (block 0 is the null block).
///
/// A windowed group releases the blocks no future query can read (their table entries become
/// 0); a prefix hit is the longest prefix every group can serve (a multiple of ``hit_unit``,
/// the LCM of the block sizes). ``retention_interval`` (tokens; 0 = cache every full block)
/// keeps only the window blocks a hit at a multiple of it needs, plus each sequence's latest
/// replayable point, cached; the others are released uncached. See docs/design.md, "KV cache
/// groups".
///
/// Args:
///     groups: the ``KVCacheGroupSpec`` of each group (list or tuple, at least one).
///     layer_groups: per model layer, the index of its group.
///     num_blocks: pages in the pool, the null block included.
///     enable_prefix_caching: cache full blocks by their chained hashes (default True).
///     retention_interval: tokens, 0 (default) or a multiple of ``hit_unit`` (see above).
///     hash_algo, hash_seed: ``"sha256"`` (default) or ``"xxh3_128"``, and the chain seed
///         (bytes), as ``CacheConfig``'s.
///     num_cpu_blocks: CPU swap blocks for ``swap_out`` (default 0: no swapping).
///     enable_events: buffer KV events for ``take_events`` (default False).
///
/// Raises ``InvalidConfigError`` (nothing built) for page sizes that differ between groups, a
/// window or chunk < 1, a layer mapped to no group, a group without layers, a retention
/// interval that is not a multiple of the hit unit, or any other out-of-range value.
/// Thread-safe; every failing call raises a ``pagedkv.PagedKVError`` subclass and leaves the
/// state unchanged.
#[pyclass(frozen, module = "pagedkv._core", name = "HybridKVCacheManager")]
pub(crate) struct PyHybridManager {
    pub(crate) inner: Arc<HybridManager>,
    groups: Vec<Py<PyGroupSpec>>,
}

fn read_list<'py>(
    obj: &Bound<'py, PyAny>,
    field: &'static str,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if let Ok(l) = obj.cast::<PyList>() {
        return Ok(l.iter().collect());
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return Ok(t.iter().collect());
    }
    let reason = format!("expected a list, got {}", type_name(obj));
    Err(config_error(obj.py(), field, repr(obj), &reason))
}

#[pymethods]
impl PyHybridManager {
    #[new]
    #[pyo3(signature = (groups, layer_groups, num_blocks, *, enable_prefix_caching = None,
                        retention_interval = None, hash_algo = None, hash_seed = None,
                        num_cpu_blocks = None, enable_events = None, num_host_blocks = None,
                        host_admission_min_seen = None, host_eviction = None),
           text_signature = "(groups, layer_groups, num_blocks, *, enable_prefix_caching=True, retention_interval=0, hash_algo='sha256', hash_seed=None, num_cpu_blocks=0, enable_events=False, num_host_blocks=0, host_admission_min_seen=2, host_eviction='lru')")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        groups: &Bound<'_, PyAny>,
        layer_groups: &Bound<'_, PyAny>,
        num_blocks: &Bound<'_, PyAny>,
        enable_prefix_caching: Option<&Bound<'_, PyAny>>,
        retention_interval: Option<&Bound<'_, PyAny>>,
        hash_algo: Option<&Bound<'_, PyAny>>,
        hash_seed: Option<&Bound<'_, PyAny>>,
        num_cpu_blocks: Option<&Bound<'_, PyAny>>,
        enable_events: Option<&Bound<'_, PyAny>>,
        num_host_blocks: Option<&Bound<'_, PyAny>>,
        host_admission_min_seen: Option<&Bound<'_, PyAny>>,
        host_eviction: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let flag = |o: Option<&Bound<'_, PyAny>>, field: &'static str, default: bool| match o
            .filter(|o| !o.is_none())
        {
            None => Ok(default),
            Some(o) => o.extract::<bool>().map_err(|_| {
                let reason = format!("expected a bool, got {}", type_name(o));
                config_error(py, field, repr(o), &reason)
            }),
        };
        let enable_prefix_caching = flag(enable_prefix_caching, "enable_prefix_caching", true)?;
        let enable_events = flag(enable_events, "enable_events", false)?;
        let hash_algo: String = match hash_algo.filter(|o| !o.is_none()) {
            None => "sha256".into(),
            Some(o) => o.extract().map_err(|_| {
                let reason = format!("expected a str, got {}", type_name(o));
                config_error(py, "hash_algo", repr(o), &reason)
            })?,
        };
        let hash_algo = hash_algo.as_str();
        let hash_seed = match hash_seed.filter(|o| !o.is_none()) {
            None => Vec::new(),
            Some(o) => o
                .cast::<PyBytes>()
                .map_err(|_| {
                    let reason = format!("expected bytes, got {}", type_name(o));
                    config_error(py, "hash_seed", repr(o), &reason)
                })?
                .as_bytes()
                .to_vec(),
        };
        let mut specs = Vec::new();
        let mut handles = Vec::new();
        for (i, g) in read_list(groups, "groups")?.iter().enumerate() {
            let spec = g.cast::<PyGroupSpec>().map_err(|_| {
                let reason = format!(
                    "expected KVCacheGroupSpec items, got {} at index {i}",
                    type_name(g)
                );
                config_error(py, "groups", repr(g), &reason)
            })?;
            specs.push(spec.get().inner);
            handles.push(spec.clone().unbind());
        }
        let layers = read_list(layer_groups, "layer_groups")?
            .iter()
            .map(|l| config_uint(l, "layer_groups", u64::from(u32::MAX)).map(|v| v as u32))
            .collect::<PyResult<Vec<u32>>>()?;
        let n = config_uint(num_blocks, "num_blocks", u64::from(u32::MAX))? as u32;
        let mut cfg = HybridConfig::new(n, specs, layers);
        cfg.enable_prefix_caching = enable_prefix_caching;
        cfg.enable_events = enable_events;
        if let Some(r) = retention_interval.filter(|r| !r.is_none()) {
            cfg.retention_interval =
                config_uint(r, "retention_interval", u64::from(u32::MAX))? as u32;
        }
        if let Some(c) = num_cpu_blocks.filter(|c| !c.is_none()) {
            cfg.num_cpu_blocks = config_uint(c, "num_cpu_blocks", u64::from(u32::MAX))? as u32;
        }
        cfg.hash_algo = HashAlgo::from_name(hash_algo).ok_or_else(|| {
            config_error(
                py,
                "hash_algo",
                format!("{hash_algo:?}"),
                "expected \"sha256\" or \"xxh3_128\"",
            )
        })?;
        cfg.hash_seed = hash_seed;
        (
            cfg.num_host_blocks,
            cfg.host_admission_min_seen,
            cfg.host_eviction,
        ) = host_tier_fields(num_host_blocks, host_admission_min_seen, host_eviction)?;
        let inner = py.detach(|| HybridManager::new(cfg)).py(py)?;
        Ok(Self {
            inner: Arc::new(inner),
            groups: handles,
        })
    }

    /// The groups' specs, in group order.
    #[getter]
    fn groups(&self, py: Python<'_>) -> Vec<Py<PyGroupSpec>> {
        self.groups.iter().map(|g| g.clone_ref(py)).collect()
    }

    /// Per model layer, the index of its group.
    #[getter]
    fn layer_groups(&self) -> Vec<u32> {
        self.inner.config().layer_groups.clone()
    }

    /// Number of KV cache groups.
    #[getter]
    fn num_groups(&self) -> usize {
        self.inner.num_groups()
    }

    /// Tokens; prefix hits are multiples of it (LCM of the groups' block sizes).
    #[getter]
    fn hit_unit(&self) -> usize {
        self.inner.hit_unit()
    }

    /// Pages in the pool, the null block included.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.config().num_blocks
    }

    /// Free pages (uncached + evictable cached).
    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.pool().num_free()
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

    /// CPU swap blocks (0: no swapping).
    #[getter]
    fn num_cpu_blocks(&self) -> u32 {
        self.inner.config().num_cpu_blocks
    }

    /// A snapshot of usage and counters over the whole pool (``CacheStats``; every group's
    /// pages count; ``block_size`` is group 0's; prefix queries and hits in tokens, each
    /// sequence's first lookup counted once; preemptions by recompute and swap).
    fn stats(&self, py: Python<'_>) -> PyCacheStats {
        let m = &self.inner;
        PyCacheStats {
            inner: py.detach(|| m.stats()),
        }
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

    /// Registers sequence ``seq_id`` with its prompt (list or 1-D integer array). The keys are
    /// as ``KVCacheManager.add_sequence``'s (``spec``: a ``pagedkv.SequenceSpec`` carrying
    /// them as one value). Raises ``SequenceExistsError``, ``InvalidArgumentError``.
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

    /// Appends finalized tokens. Raises ``UnknownSequenceError``, ``InvalidArgumentError``.
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

    /// Tokens a first allocation would take from the prefix cache now: the longest prefix every
    /// group serves (a multiple of ``hit_unit``, at most ``num_tokens - 1``). No side effects.
    /// Raises ``UnknownSequenceError``.
    fn lookup_prefix(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.detach(|| m.lookup_prefix(seq)).py(py)
    }

    /// ``(take, release)``: exactly the blocks the next allocation of ``num_new_tokens`` for
    /// ``seq_id`` takes from the free pool and gives back (out-of-window blocks); it succeeds
    /// exactly when ``take <= num_free_blocks + release``. No side effects. Raises
    /// ``UnknownSequenceError``, ``InvalidSequenceStateError``, ``InvalidArgumentError``.
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

    /// ``(take, release)`` of a verify step: ``num_blocks_needed`` with lookahead slots for
    /// ``num_draft_tokens`` drafts after the ``num_new_tokens`` scheduled ones (as ``step``
    /// with ``draft_token_ids`` takes them). Same errors, plus ``InvalidArgumentError`` when
    /// the scheduled tokens do not reach the last token. No side effects.
    fn num_blocks_needed_with_drafts(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
        num_draft_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<(usize, usize)> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let q = count(num_new_tokens, "num_new_tokens")?;
        let k = count(num_draft_tokens, "num_draft_tokens")?;
        let m = &self.inner;
        let d = py
            .detach(|| m.num_blocks_needed_with_drafts(seq, q, k))
            .py(py)?;
        Ok((d.take, d.release))
    }

    /// Resolves the pending drafts of ``seq_id`` after its verify step: the first
    /// ``num_accepted`` become tokens (KV computed); in every group the rejected tail's slots
    /// are free for the next step and blocks that held only rejected drafts are released
    /// (never hashed); blocks filled by accepted tokens are cached by the retention rule. No
    /// block leaves a window here (the next step releases by the committed context). Returns
    /// one ``int32[r_g]`` array of released blocks per group (tail first).
    ///
    /// ``release_blocks=False`` keeps those blocks as spare lookahead blocks the next steps
    /// fill first (nothing released), for a consumer whose copy of the tables only grows.
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
        Ok(released
            .into_iter()
            .map(|g| PyArray1::from_vec(py, g.into_iter().map(|b| b as i32).collect()).unbind())
            .collect())
    }

    /// Draft tokens pending on ``seq_id`` (0 unless its last step gave it drafts not yet
    /// resolved by ``accept_drafts``). Raises ``UnknownSequenceError``.
    fn num_draft_tokens(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.detach(|| m.num_draft_tokens(seq)).py(py)
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

    /// Free blocks the group ``seq_ids`` needs so that scheduling all their uncomputed tokens
    /// now, in this order, succeeds for every member (the peak of ``take - release`` over the
    /// members, plus the CPU blocks of swapped-out members). For admission control. No side
    /// effects. Raises ``UnknownSequenceError``, ``InvalidArgumentError``.
    fn num_blocks_owed(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        py.detach(|| m.num_blocks_owed(&seqs)).py(py)
    }

    /// Forks ``parent_id`` into ``child_id``, sharing every group's blocks. Raises
    /// ``UnknownSequenceError``, ``SequenceExistsError``, ``InvalidSequenceStateError``.
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

    /// Frees ``seq_id``. Idempotent: False for an unknown or already freed id.
    fn free(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        Ok(py.detach(|| m.free(seq)))
    }

    /// Preempts a group by recompute, all or nothing. Raises ``UnknownSequenceError``,
    /// ``InvalidArgumentError`` (duplicate id), ``InvalidSequenceStateError`` (swapped out).
    fn preempt(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        py.detach(|| m.preempt_recompute(&seqs)).py(py)
    }

    /// Swaps a group out, all or nothing: ``int32[k, 2]`` ``(gpu_block, cpu_block)`` rows (a
    /// block id names one page of every layer of its group). Raises ``OutOfSwapSpaceError``,
    /// ``UnknownSequenceError``, ``InvalidSequenceStateError``.
    fn swap_out(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<Py<PyArray2<i32>>> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        let plan = py.detach(|| m.swap_out(&seqs)).py(py)?;
        Ok(pairs(py, &plan))
    }

    /// Swaps a group back in: ``int32[k, 2]`` ``(cpu_block, gpu_block)`` rows. Its full blocks
    /// are cached again, unless ``reset_prefix_cache`` ran while it was out (its KV predates
    /// the reset: nothing of it is cached or announced until a recompute preemption). Raises
    /// ``OutOfBlocksError``, ``UnknownSequenceError``, ``InvalidSequenceStateError``.
    fn swap_in(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<Py<PyArray2<i32>>> {
        let seqs = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let m = &self.inner;
        let plan = py.detach(|| m.swap_in(&seqs)).py(py)?;
        Ok(pairs(py, &plan))
    }

    /// Drops every prefix hash of every group, those of swapped-out blocks included. Raises
    /// ``CacheInUseError`` while any block is in use (nothing changed).
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<()> {
        let m = &self.inner;
        py.detach(|| m.reset_prefix_cache()).py(py)
    }

    /// The block tables of ``seq_id``, one ``int32[n_g]`` array per group (0 for released
    /// entries; CPU ids while swapped out, with -1 for released entries). Raises
    /// ``UnknownSequenceError``.
    fn block_tables(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Py<PyArray1<i32>>>> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        let tables = py.detach(|| m.block_tables(seq)).py(py)?;
        Ok(tables
            .into_iter()
            .map(|t| PyArray1::from_vec(py, t.into_iter().map(|b| b as i32).collect()).unbind())
            .collect())
    }

    /// Blocks ``seq_id`` holds in each group (its non-null table entries; CPU blocks while
    /// swapped out). Raises
    /// ``UnknownSequenceError``.
    fn num_blocks_held(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
        let seq = crate::convert::seq_id(seq_id, "seq_id")?;
        let m = &self.inner;
        py.detach(|| m.num_blocks_held(seq)).py(py)
    }

    /// Known tokens of ``seq_id``. Raises ``UnknownSequenceError``.
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

    /// Registered sequences.
    #[getter]
    fn num_sequences(&self) -> usize {
        self.inner.num_sequences()
    }

    /// One scheduler step in ONE call with the GIL released: for each sequence in order,
    /// append its new tokens, then schedule up to ``num_new_tokens[i]`` tokens in every group;
    /// stop at the first failure (in ``HybridStepOutput.error``, not raised).
    ///
    /// Args:
    ///     seq_ids: ``S`` sequence ids (list or 1-D integer array).
    ///     num_new_tokens: one int for all, or ``S`` ints.
    ///     append_token_ids: None; a 1-D integer array of ``S`` tokens (one per sequence); or
    ///         ``S`` lists / arrays of tokens.
    ///     draft_token_ids: None, or per sequence its draft tokens (speculative decoding's
    ///         verify step; forms as ``append_token_ids``): they get lookahead slots after the
    ///         scheduled tokens in every group, the query is the tokens then the drafts
    ///         (``num_draft_tokens``), nothing is hashed for them, and the sequence stays
    ///         pending until ``accept_drafts``. A windowed group releases by the committed
    ///         context only (the first query row reads ``W - 1`` tokens back).
    ///
    ///     block_table: copy every group's dense tables out (``HybridStepOutput.block_table``,
    ///         ``int32[G, S, W]``; default True). A caller that keeps the tables across steps
    ///         from the deltas (``table_start`` / ``table_delta``, e.g.
    ///         ``BatchTensors.from_steps(..., block_tables=BlockTable(manager))``)
    ///         passes False: the dense copy is O(G x S x longest table) per step.
    ///     token_arrays: fill the per-token ``slot_mapping`` and ``input_ids`` (default True);
    ///         False leaves them empty (``int64[G, 0]`` / ``int64[0]``), for a caller that needs
    ///         only block ids and lengths (a scheduler).
    ///     reserve_blocks: blocks that must stay free after each sequence's allocation (an
    ///         admission watermark, as vLLM's ``KVCacheManager(watermark=)``; default 0): a
    ///         sequence that would leave fewer stops the step with ``OutOfBlocksError`` in
    ///         ``error`` (``requested`` counts the reserve), so admitting a request is one
    ///         ``step`` without a ``num_blocks_needed`` call first.
    ///
    /// Raises ``InvalidArgumentError`` for arguments it cannot read (nothing done).
    #[pyo3(signature = (seq_ids, num_new_tokens, append_token_ids = None, *, draft_token_ids = None, block_table = None, token_arrays = None, reserve_blocks = None),
           text_signature = "(self, seq_ids, num_new_tokens, append_token_ids=None, *, draft_token_ids=None, block_table=True, token_arrays=True, reserve_blocks=0)")]
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
    ) -> PyResult<PyHybridStepOutput> {
        let opts = HybridStepOptions {
            skip_block_table: !crate::convert::flag(block_table, "block_table", true)?,
            skip_token_arrays: !crate::convert::flag(token_arrays, "token_arrays", true)?,
            reserve_blocks: match reserve_blocks.filter(|r| !r.is_none()) {
                Some(r) => count(r, "reserve_blocks")?,
                None => 0,
            },
        };
        let seq_ids = crate::convert::seq_ids(seq_ids, "seq_ids")?;
        let n = seq_ids.len();
        let num_new_tokens = if num_new_tokens.is_instance_of::<PyInt>() {
            vec![uint(num_new_tokens, "num_new_tokens", u64::from(u32::MAX))? as u32; n]
        } else {
            let v =
                crate::convert::uint_array(num_new_tokens, "num_new_tokens", u64::from(u32::MAX))?;
            if v.len() != n {
                let reason = format!("expected one per sequence ({n})");
                return Err(bad(
                    py,
                    "num_new_tokens",
                    format!("{} entries", v.len()),
                    reason,
                ));
            }
            v.into_iter().map(|x| x as u32).collect()
        };
        let (append_indptr, append_tokens) = appends(append_token_ids, n)?;
        let (draft_indptr, draft_tokens) = rows_csr(draft_token_ids, n, "draft_token_ids")?;
        let req = StepRequest {
            seq_ids,
            num_new_tokens,
            append_indptr,
            append_tokens,
        };
        let drafts = StepDrafts {
            indptr: draft_indptr,
            tokens: draft_tokens,
        };
        let m = &self.inner;
        let out = py.detach(|| m.step_with(&req, &drafts, opts));
        let error = match &out.error {
            Some(e) => Some(error_instance(py, e)?.unbind()),
            None => None,
        };
        let g = out.num_groups;
        let s = out.num_scheduled;
        let t = out.query_start_loc.last().copied().unwrap_or(0).max(0) as usize;
        let w = out.block_table_width;
        let max_seq_len = out.seq_lens.iter().copied().max().unwrap_or(0).max(0) as usize;
        let max_query_len = out
            .query_start_loc
            .windows(2)
            .map(|x| x[1] - x[0])
            .max()
            .unwrap_or(0)
            .max(0) as usize;
        let arr = |v: Vec<i32>| PyArray1::from_vec(py, v).unbind();
        let copies = triples(py, out.copies);
        let host_stores = triples(py, out.host_stores);
        let host_loads = triples(py, out.host_loads);
        Ok(PyHybridStepOutput {
            num_scheduled: s,
            error,
            num_groups: g,
            num_tokens: t,
            max_seq_len,
            max_query_len,
            seq_ids: PyArray1::from_slice(py, &req.seq_ids[..s]).unbind(),
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
            slot_mapping: Array2::from_shape_vec(
                (g, if opts.skip_token_arrays { 0 } else { t }),
                out.slot_mapping,
            )
            .expect("G x T")
            .into_pyarray(py)
            .unbind(),
            block_table: if opts.skip_block_table {
                Array3::<i32>::zeros((0, 0, 0)).into_pyarray(py).unbind()
            } else {
                Array3::from_shape_vec((g, s, w), out.block_table)
                    .expect("G x S x W")
                    .into_pyarray(py)
                    .unbind()
            },
            table_start: Array2::from_shape_vec((s, g), out.table_start)
                .expect("S x G")
                .into_pyarray(py)
                .unbind(),
            table_version: PyArray1::from_vec(py, out.table_version).unbind(),
            table_delta_indptr: arr(out.table_delta_indptr),
            table_delta: arr(out.table_delta),
            new_block_indptr: arr(out.new_block_indptr),
            new_block_ids: arr(out.new_block_ids),
            copies,
            host_stores,
            host_loads,
        })
    }

    /// The host-tier copies planned since the last hand-out, as ``(stores, loads)``:
    /// ``int32[n, 3]`` ``(group, device block, host block)`` and ``(group, host block, device
    /// block)`` rows, for a caller that allocates outside ``step`` (which hands them out in
    /// ``HybridStepOutput.host_stores`` / ``host_loads``). Run stores first, before any
    /// ``swap_in`` copy planned since (a store may read an evicted block that a swap-in
    /// destination reuses), loads before the forward pass that reads the loaded blocks; the loads' host blocks stay pinned until the
    /// next ``step`` returns. Empty without a host tier.
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

    /// Host-memory blocks of the prefix cache's second tier (0: none).
    #[getter]
    fn num_host_blocks(&self) -> u32 {
        self.inner.config().num_host_blocks
    }

    /// Drains the buffered KV events, oldest first, as ``(group, event)`` pairs: ``group`` is
    /// the KV cache group the event is about (None for ``AllBlocksCleared``); the event's hashes
    /// are the plain chain hashes of that group's block size. Empty unless
    /// ``enable_events=True``.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let m = &self.inner;
        let events = py.detach(|| m.take_events());
        let objs = events
            .into_iter()
            .map(|e| {
                let ev = event_object(py, e.event)?;
                Ok(
                    PyTuple::new(py, [e.group.into_pyobject(py)?.into_any().unbind(), ev])?
                        .unbind(),
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, objs)
    }

    /// Checks the invariants of docs/design.md, "KV cache groups"; raises
    /// ``InvariantViolationError`` naming the first violation.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let m = &self.inner;
        py.detach(|| m.check_invariants())
            .map_err(|msg| crate::errors::invariant_violation(py, msg))
    }

    fn __repr__(&self) -> String {
        format!(
            "HybridKVCacheManager(num_groups={}, num_blocks={}, free={})",
            self.inner.num_groups(),
            self.inner.config().num_blocks,
            self.inner.pool().num_free()
        )
    }
}
