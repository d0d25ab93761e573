//! `pagedkv.KVIndexer`: the cluster-wide index of cached blocks per worker, fed by KV event
//! batches (pagedkv event objects or vLLM's wire form, already msgpack-decoded into lists).
//!
//! Events are moved into the core's types while holding the GIL (pagedkv event objects as they
//! are, wire events as `WireValue` trees read by the core's `vllm_event`); the core call runs
//! with the GIL released under the indexer's mutex.

use crate::convert::{bad, bytes_arg, list_items, opt_str, repr, type_name, uint};
use crate::errors::IntoPyResult;
use crate::events::{PyAllBlocksCleared, PyBlockRemoved, PyBlockStored};
use crate::groups::PyGroupSpec;
use crate::manager::call_spec;
use numpy::PyUntypedArray;
use pagedkv_core::events::KvEvent;
use pagedkv_core::kv_groups::AttentionKind;
use pagedkv_core::kv_indexer::vllm_event::{self, WireValue};
use pagedkv_core::{
    BlockHash, HashAlgo, HashSource, KvIndexer, PrefixHasher, WorkerId, WorkerStatus,
};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use std::sync::Mutex;

fn invalid(py: Python<'_>, arg: &'static str, value: String, reason: impl Into<String>) -> PyErr {
    bad(py, arg, value, reason)
}

/// Deepest nesting read from an event (vLLM's are 4 deep); deeper values are refused.
const MAX_DEPTH: usize = 16;

/// A decoded wire value as the core's [`WireValue`]: data moved as it is (None, bool, int,
/// float, str, bytes, list / tuple, a 1-D numpy array as its list); anything else is
/// `WireValue::Other` with its type name and repr, which the core refuses where a typed field
/// is read. Ints outside the signed and unsigned 128-bit ranges are `Other` too.
fn wire_value(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<WireValue> {
    let other = |obj: &Bound<'_, PyAny>| WireValue::Other {
        type_name: type_name(obj),
        repr: repr(obj),
    };
    if obj.is_none() {
        return Ok(WireValue::Nil);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(WireValue::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return Ok(match obj.extract::<i128>() {
            Ok(v) => WireValue::Int(v),
            // Unsigned above i128::MAX: the same 128 bits (a hash's bytes are what matter).
            Err(_) => obj
                .extract::<u128>()
                .map_or_else(|_| other(obj), |u| WireValue::Int(u as i128)),
        });
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(WireValue::Float(f.value()));
    }
    if let Ok(t) = obj.cast::<PyString>() {
        return Ok(WireValue::Str(t.to_cow()?.into_owned()));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(WireValue::Bytes(b.as_bytes().to_vec()));
    }
    let items = if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        list_items(obj, "events")?
    } else if obj.is_instance_of::<PyUntypedArray>() {
        list_items(&obj.call_method0("tolist")?, "events")?
    } else {
        return Ok(other(obj));
    };
    if depth >= MAX_DEPTH {
        return Ok(other(obj));
    }
    items
        .iter()
        .map(|item| wire_value(item, depth + 1))
        .collect::<PyResult<Vec<_>>>()
        .map(WireValue::List)
}

/// A list of block hashes argument (bytes or ints; see the core's `wire_hash`).
fn hashes_arg(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<Vec<BlockHash>> {
    vllm_event::hashes_arg(&wire_value(obj, 0)?, arg).py(obj.py())
}

/// The optional ``hash_root`` argument: None, or exactly 32 bytes.
fn root_arg(hash_root: Option<&Bound<'_, PyAny>>) -> PyResult<Option<BlockHash>> {
    let Some(r) = hash_root.filter(|r| !r.is_none()) else {
        return Ok(None);
    };
    let b = bytes_arg(r, "hash_root")?;
    let arr: [u8; 32] = b.try_into().map_err(|_| {
        invalid(
            r.py(),
            "hash_root",
            format!("<{} bytes>", b.len()),
            "expected 32 bytes",
        )
    })?;
    Ok(Some(BlockHash(arr)))
}

/// A pagedkv event object as the core's event and the group it names (`None` for
/// `AllBlocksCleared`), `None` for anything else.
fn pagedkv_event(obj: &Bound<'_, PyAny>) -> Option<(Option<u64>, KvEvent)> {
    if let Ok(ev) = obj.cast::<PyBlockStored>() {
        let ev = ev.get();
        return Some((Some(u64::from(ev.group_index())), ev.to_core()));
    }
    if let Ok(ev) = obj.cast::<PyBlockRemoved>() {
        let ev = ev.get();
        return Some((Some(u64::from(ev.group_index())), ev.to_core()));
    }
    obj.cast::<PyAllBlocksCleared>()
        .is_ok()
        .then_some((None, KvEvent::AllBlocksCleared))
}

/// One event with the KV cache group it names (`None`: unnamed, group 0): a pagedkv event
/// object (its `group`), a `(group, event)` pair of one (group an int >= 0 or None, which
/// overrides the object's), or a vLLM wire event (a list / tuple whose first item is the
/// type tag) read by the core's `vllm_event::parse_group_event` (with `batch_root` as a
/// `BlockStored`'s hash root).
fn event(
    obj: &Bound<'_, PyAny>,
    i: usize,
    batch_root: Option<BlockHash>,
) -> PyResult<(Option<u64>, KvEvent)> {
    if let Some(ev) = pagedkv_event(obj) {
        return Ok(ev);
    }
    if let Ok(pair) = obj.cast::<PyTuple>() {
        if pair.len() == 2 {
            if let Some((_, ev)) = pagedkv_event(&pair.get_item(1)?) {
                let g = pair.get_item(0)?;
                let group = if g.is_none() {
                    None
                } else {
                    Some(uint(&g, "events", u64::MAX).map_err(|_| {
                        invalid(
                            obj.py(),
                            "events",
                            format!("{} at index {i}", repr(obj)),
                            "a (group, event) pair's group must be an int >= 0 or None",
                        )
                    })?)
                };
                return Ok((group, ev));
            }
        }
    }
    vllm_event::parse_group_event(&wire_value(obj, 0)?, i, batch_root).py(obj.py())
}

/// The attention kinds of a worker's KV cache groups: a list of ``KVCacheGroupSpec`` or kind
/// names (``"full"``, ``"sliding_window"``, ``"chunked_local"``; a name's window or chunk is
/// not needed and reads 0).
fn group_kinds(obj: &Bound<'_, PyAny>) -> PyResult<Vec<AttentionKind>> {
    let py = obj.py();
    if obj.is_instance_of::<PyString>() {
        return Err(invalid(
            py,
            "groups",
            repr(obj),
            "expected a list of KV cache group kinds",
        ));
    }
    list_items(obj, "groups")?
        .iter()
        .map(|g| {
            if let Ok(spec) = g.cast::<PyGroupSpec>() {
                return Ok(spec.get().inner.kind);
            }
            match g.extract::<String>().ok().as_deref() {
                Some("full") => Ok(AttentionKind::Full),
                Some("sliding_window") => Ok(AttentionKind::SlidingWindow { window: 0 }),
                Some("chunked_local") => Ok(AttentionKind::ChunkedLocal { chunk: 0 }),
                Some("state") => Ok(AttentionKind::State),
                _ => Err(invalid(
                    py,
                    "groups",
                    repr(g),
                    "expected a KVCacheGroupSpec or \"full\", \"sliding_window\", \"chunked_local\", \"state\"",
                )),
            }
        })
        .collect()
}

fn worker_id(obj: &Bound<'_, PyAny>) -> PyResult<WorkerId> {
    uint(obj, "worker_id", u64::MAX)
}

/// An optional int >= 0 keyword argument (None when absent or None).
fn opt_uint(obj: Option<&Bound<'_, PyAny>>, arg: &'static str) -> PyResult<Option<u64>> {
    obj.filter(|o| !o.is_none())
        .map(|o| uint(o, arg, u64::MAX))
        .transpose()
}

fn status_dict<'py>(py: Python<'py>, st: &WorkerStatus) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("worker_id", st.id)?;
    d.set_item("incarnation", st.incarnation)?;
    d.set_item("hash_source", st.source.name())?;
    d.set_item("num_blocks", st.num_blocks)?;
    d.set_item("next_seq", st.next_seq)?;
    d.set_item("num_pending", st.num_pending)?;
    d.set_item("needs_resync", st.needs_resync)?;
    d.set_item("gaps", st.gaps)?;
    Ok(d)
}

fn overlap_dict<'py>(
    py: Python<'py>,
    pairs: Vec<(WorkerId, usize)>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (w, n) in pairs {
        d.set_item(w, n)?;
    }
    Ok(d)
}

/// Which worker holds which cached block, from the workers' KV event batches; answers each
/// worker's cached-prefix overlap with a request. See ``pagedkv.KVIndexer`` (the Python
/// docstring in ``_core.pyi``) for the contract.
#[pyclass(frozen, module = "pagedkv._core", name = "KVIndexer")]
pub(crate) struct PyKvIndexer {
    inner: Mutex<KvIndexer>,
    hash_seed: Vec<u8>,
}

impl PyKvIndexer {
    fn with<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut KvIndexer) -> T + Send) -> T {
        py.detach(|| {
            let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            f(&mut guard)
        })
    }
}

#[pymethods]
impl PyKvIndexer {
    #[new]
    // Keyword arguments arrive as objects so a wrong type is an InvalidArgumentError naming the
    // argument; the text signature shows the real defaults.
    #[pyo3(signature = (block_size, *, hash_algo = None, hash_seed = None, max_pending = None),
           text_signature = "(block_size, *, hash_algo='sha256', hash_seed=None, max_pending=0)")]
    fn new(
        py: Python<'_>,
        block_size: &Bound<'_, PyAny>,
        hash_algo: Option<&Bound<'_, PyAny>>,
        hash_seed: Option<&Bound<'_, PyAny>>,
        max_pending: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let block_size = uint(block_size, "block_size", u64::from(u32::MAX))? as u32;
        let hash_algo = opt_str(hash_algo, "hash_algo")?.unwrap_or_else(|| "sha256".into());
        let algo = HashAlgo::from_name(&hash_algo).ok_or_else(|| {
            invalid(
                py,
                "hash_algo",
                format!("{hash_algo:?}"),
                "expected \"sha256\" or \"xxh3_128\"",
            )
        })?;
        let seed = match hash_seed.filter(|s| !s.is_none()) {
            Some(s) => bytes_arg(s, "hash_seed")?.to_vec(),
            None => Vec::new(),
        };
        let max_pending = match max_pending {
            Some(m) => uint(m, "max_pending", 1 << 20)? as usize,
            None => 0,
        };
        let inner =
            KvIndexer::new(block_size, PrefixHasher::new(algo, &seed), max_pending).py(py)?;
        Ok(Self {
            inner: Mutex::new(inner),
            hash_seed: seed,
        })
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self, py: Python<'_>) -> u32 {
        self.with(py, |ix| ix.block_size())
    }

    /// ``"sha256"`` or ``"xxh3_128"``.
    #[getter]
    fn hash_algo(&self, py: Python<'_>) -> &'static str {
        self.with(py, |ix| ix.hasher().algo().name())
    }

    /// Chain seed of the prefix hashes.
    #[getter]
    fn hash_seed<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.hash_seed)
    }

    /// Root of the hash chains (32 bytes; from the algorithm and seed): the ``hash_root`` an
    /// engine worker's ``BlockStored`` events must carry.
    #[getter]
    fn hash_root<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let root = self.with(py, |ix| ix.hasher().root());
        PyBytes::new(py, &root.0)
    }

    /// Reorder buffer per worker, in batches.
    #[getter]
    fn max_pending(&self, py: Python<'_>) -> usize {
        self.with(py, |ix| ix.max_pending())
    }

    /// Distinct block hashes held by at least one worker.
    #[getter]
    fn num_hashes(&self, py: Python<'_>) -> usize {
        self.with(py, |ix| ix.num_hashes())
    }

    /// Registers ``worker_id`` with ``hash_source`` ``"engine"`` (its event hashes are used as
    /// they are) or ``"tokens"`` (blocks rehashed from their token ids); returns the
    /// registration's incarnation number. ``groups``: the attention kinds of the worker's KV
    /// cache groups in its engine's order (``KVCacheGroupSpec`` objects or kind names; None:
    /// one full-attention group); only the first full-attention group's events are indexed,
    /// since a sliding-window or chunked-local group's blocks serve no prefix. Raises
    /// ``InvalidArgumentError`` if it is registered already, for an empty ``groups`` or an
    /// unknown kind.
    #[pyo3(signature = (worker_id, *, hash_source = None, groups = None),
           text_signature = "($self, worker_id, *, hash_source='engine', groups=None)")]
    fn add_worker(
        &self,
        py: Python<'_>,
        worker_id: &Bound<'_, PyAny>,
        hash_source: Option<&Bound<'_, PyAny>>,
        groups: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let id = self::worker_id(worker_id)?;
        let hash_source = opt_str(hash_source, "hash_source")?.unwrap_or_else(|| "engine".into());
        let source = HashSource::from_name(&hash_source).ok_or_else(|| {
            invalid(
                py,
                "hash_source",
                format!("{hash_source:?}"),
                "expected \"engine\" or \"tokens\"",
            )
        })?;
        let kinds = match groups.filter(|g| !g.is_none()) {
            Some(g) => group_kinds(g)?,
            None => vec![AttentionKind::Full],
        };
        self.with(py, |ix| ix.add_worker_with_groups(id, source, &kinds))
            .py(py)
    }

    /// Drops the worker and all its entries; False if it was unknown.
    fn remove_worker(&self, py: Python<'_>, worker_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = self::worker_id(worker_id)?;
        Ok(self.with(py, |ix| ix.remove_worker(id)))
    }

    /// Registered worker ids.
    fn worker_ids(&self, py: Python<'_>) -> Vec<WorkerId> {
        self.with(py, |ix| ix.worker_ids())
    }

    /// The worker's state and counters as a dict, or None if unknown.
    fn worker_status<'py>(
        &self,
        py: Python<'py>,
        worker_id: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let id = self::worker_id(worker_id)?;
        match self.with(py, |ix| ix.worker_status(id)) {
            Some(st) => Ok(Some(status_dict(py, &st)?)),
            None => Ok(None),
        }
    }

    /// Whether the worker may miss entries since a gap, until ``apply_snapshot``.
    fn needs_resync(&self, py: Python<'_>, worker_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = self::worker_id(worker_id)?;
        Ok(self.with(py, |ix| ix.needs_resync(id)))
    }

    /// The 32-byte hashes the worker holds, sorted.
    fn worker_hashes<'py>(
        &self,
        py: Python<'py>,
        worker_id: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let id = self::worker_id(worker_id)?;
        let hashes = self.with(py, |ix| ix.worker_hashes(id));
        PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, &h.0)))
    }

    /// Applies event batch ``seq`` of ``worker_id``'s registration ``incarnation`` (None: the
    /// current one); returns ``"applied"``, ``"buffered"``, ``"duplicate"``, ``"gap"`` or
    /// ``"stale"`` (an earlier incarnation's). ``hash_root`` is the batch's hash root for wire
    /// events (which carry none). An event is a pagedkv event object (``KVCacheManager.take_events``;
    /// its ``group`` names its KV cache group), a ``(group, event)`` pair of one or a vLLM
    /// wire event; only the
    /// worker's first full-attention KV cache group (see ``add_worker``; an unnamed group is
    /// group 0) and clears are indexed. Raises ``InvalidArgumentError`` (nothing applied) for
    /// a malformed event, or an engine worker's event whose hash root is not the indexer's.
    #[pyo3(signature = (worker_id, seq, events, *, hash_root = None, incarnation = None))]
    fn apply(
        &self,
        py: Python<'_>,
        worker_id: &Bound<'_, PyAny>,
        seq: &Bound<'_, PyAny>,
        events: &Bound<'_, PyAny>,
        hash_root: Option<&Bound<'_, PyAny>>,
        incarnation: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<&'static str> {
        let id = self::worker_id(worker_id)?;
        let seq = uint(seq, "seq", u64::MAX)?;
        let incarnation = opt_uint(incarnation, "incarnation")?;
        let batch_root = root_arg(hash_root)?;
        if events.is_instance_of::<PyString>() || events.is_instance_of::<PyBytes>() {
            return Err(invalid(
                py,
                "events",
                repr(events),
                "expected a list of events (decode a wire payload first)",
            ));
        }
        let events: Vec<(Option<u64>, KvEvent)> = list_items(events, "events")?
            .iter()
            .enumerate()
            .map(|(i, e)| event(e, i, batch_root))
            .collect::<PyResult<Vec<_>>>()?;
        self.with(py, |ix| ix.apply_group_batch(id, incarnation, seq, events))
            .py(py)
            .map(|o| o.name())
    }

    /// Replaces the worker's entries with ``block_hashes`` as of its batch ``seq``; a
    /// ``hash_root`` (32 bytes) other than the indexer's is refused. Returns ``"applied"``, or
    /// ``"stale"`` for a snapshot of an earlier ``incarnation`` (nothing changed).
    #[pyo3(signature = (worker_id, seq, block_hashes, *, hash_root = None, incarnation = None))]
    fn apply_snapshot(
        &self,
        py: Python<'_>,
        worker_id: &Bound<'_, PyAny>,
        seq: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        hash_root: Option<&Bound<'_, PyAny>>,
        incarnation: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<&'static str> {
        let id = self::worker_id(worker_id)?;
        let seq = uint(seq, "seq", u64::MAX)?;
        let hashes = hashes_arg(block_hashes, "block_hashes")?;
        let root = root_arg(hash_root)?;
        let incarnation = opt_uint(incarnation, "incarnation")?;
        self.with(py, |ix| {
            ix.apply_snapshot(id, incarnation, seq, &hashes, root)
        })
        .py(py)
        .map(|o| o.name())
    }

    /// Chained 32-byte hashes of the prompt's first ``num_blocks`` full blocks, as a manager
    /// computes them.
    #[pyo3(signature = (token_ids, *, num_blocks = None, spec = None, cache_salt = None, adapter_id = None, extra_keys = None, mm_items = None))]
    #[allow(clippy::too_many_arguments)]
    fn block_hashes<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'_, PyAny>,
        num_blocks: Option<&Bound<'_, PyAny>>,
        spec: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        adapter_id: Option<&Bound<'_, PyAny>>,
        extra_keys: Option<&Bound<'_, PyAny>>,
        mm_items: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let tokens = crate::convert::token_ids(token_ids, "token_ids")?;
        let spec = call_spec(spec, cache_salt, adapter_id, extra_keys, mm_items)?;
        let n = match num_blocks {
            Some(n) => uint(n, "num_blocks", u64::from(u32::MAX))? as usize,
            None => tokens.len() / self.block_size(py) as usize,
        };
        let hashes = self
            .with(py, |ix| ix.block_hashes(&tokens, &spec, n))
            .py(py)?;
        PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, &h.0)))
    }

    /// ``{worker_id: leading cached blocks}`` of a prompt for every worker.
    #[pyo3(signature = (token_ids, *, spec = None, cache_salt = None, adapter_id = None, extra_keys = None, mm_items = None))]
    #[allow(clippy::too_many_arguments)]
    fn overlap<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'_, PyAny>,
        spec: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        adapter_id: Option<&Bound<'_, PyAny>>,
        extra_keys: Option<&Bound<'_, PyAny>>,
        mm_items: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let tokens = crate::convert::token_ids(token_ids, "token_ids")?;
        let spec = call_spec(spec, cache_salt, adapter_id, extra_keys, mm_items)?;
        let pairs = self.with(py, |ix| ix.overlap_tokens(&tokens, &spec));
        overlap_dict(py, pairs)
    }

    /// ``{worker_id: (device, any_tier)}`` leading blocks of a prompt per worker: ``device`` is
    /// ``overlap``'s figure, ``any_tier`` counts blocks held on the device or in the worker's
    /// host tier (loaded instead of recomputed). Same arguments as ``overlap``.
    #[pyo3(signature = (token_ids, *, spec = None, cache_salt = None, adapter_id = None, extra_keys = None, mm_items = None))]
    #[allow(clippy::too_many_arguments)]
    fn overlap_by_tier<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'_, PyAny>,
        spec: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        adapter_id: Option<&Bound<'_, PyAny>>,
        extra_keys: Option<&Bound<'_, PyAny>>,
        mm_items: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let tokens = crate::convert::token_ids(token_ids, "token_ids")?;
        let spec = call_spec(spec, cache_salt, adapter_id, extra_keys, mm_items)?;
        let rows = self.with(py, |ix| {
            let n = tokens.len().saturating_sub(1) / ix.block_size() as usize;
            let hashes = ix.block_hashes(&tokens, &spec, n)?;
            Ok::<_, pagedkv_core::Error>(ix.overlap_hashes_by_tier(&hashes))
        });
        let d = PyDict::new(py);
        for (w, device, any) in rows.py(py)? {
            d.set_item(w, (device, any))?;
        }
        Ok(d)
    }

    /// ``{worker_id: leading blocks held}`` for a list of block hashes.
    fn overlap_hashes<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let hashes = hashes_arg(block_hashes, "block_hashes")?;
        let pairs = self.with(py, |ix| ix.overlap_hashes(&hashes));
        overlap_dict(py, pairs)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        self.with(py, |ix| {
            format!(
                "KVIndexer(block_size={}, workers={}, hashes={})",
                ix.block_size(),
                ix.worker_ids().len(),
                ix.num_hashes()
            )
        })
    }
}
