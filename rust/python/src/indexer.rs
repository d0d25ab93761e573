//! `pagedkv.KVIndexer`: the cluster-wide index of cached blocks per worker, fed by KV event
//! batches (pagedkv event objects or vLLM's wire form, already msgpack-decoded into lists).
//!
//! Events are converted while holding the GIL; the core call runs with the GIL released under
//! the indexer's mutex.

use crate::convert::{bad, bytes_arg, list_items, opt_str, repr, token_ids, type_name, uint};
use crate::errors::IntoPyResult;
use crate::events::{PyAllBlocksCleared, PyBlockRemoved, PyBlockStored};
use crate::manager::sequence_spec;
use pagedkv_core::events::KvEvent;
use pagedkv_core::{
    BlockHash, ExtraKey, HashAlgo, HashSource, KvIndexer, PrefixHasher, WorkerId, WorkerStatus,
};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyString};
use std::sync::Mutex;

fn invalid(py: Python<'_>, arg: &'static str, value: String, reason: impl Into<String>) -> PyErr {
    bad(py, arg, value, reason)
}

/// A block hash from the wire: 32 bytes as they are (pagedkv), shorter bytes zero-padded, or an
/// int in the signed / unsigned 128-bit range stored little-endian in the first 16 bytes (vLLM
/// publishes 64-bit ints or bytes). Each engine uses one form, so the forms never meet in one
/// worker's key space.
fn wire_hash(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<BlockHash> {
    let py = obj.py();
    let mut out = [0u8; 32];
    if let Ok(b) = obj.cast::<PyBytes>() {
        let bytes = b.as_bytes();
        if bytes.len() > 32 {
            return Err(invalid(
                py,
                arg,
                format!("<{} bytes>", bytes.len()),
                "block hashes are at most 32 bytes",
            ));
        }
        out[..bytes.len()].copy_from_slice(bytes);
        return Ok(BlockHash(out));
    }
    if obj.is_instance_of::<PyInt>() {
        let v: i128 = match obj.extract::<i128>() {
            Ok(v) => v,
            Err(_) => obj
                .extract::<u128>()
                .map(|u| u as i128)
                .map_err(|_| invalid(py, arg, repr(obj), "int block hashes fit in 128 bits"))?,
        };
        out[..16].copy_from_slice(&v.to_le_bytes());
        return Ok(BlockHash(out));
    }
    Err(invalid(
        py,
        arg,
        repr(obj),
        "expected a block hash (bytes or int)",
    ))
}

fn wire_hashes(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<Vec<BlockHash>> {
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyString>() {
        return Err(invalid(
            obj.py(),
            arg,
            repr(obj),
            "expected a list of block hashes",
        ));
    }
    list_items(obj, arg)?
        .iter()
        .map(|h| wire_hash(h, arg))
        .collect()
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

/// The extra keys of a vLLM wire `BlockStored` (`fields`: the event list, `[tag, hashes,
/// parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys, ...]`) as the keys a
/// pagedkv query hashes with, and how many of its `n_blocks` blocks can be rehashed with them.
///
/// The adapter key is `lora_name` (vLLM hashes blocks by LoRA name), or `str(lora_id)` from
/// engines that send no name. `extra_keys` is one untagged tuple (or None) per block: the LoRA
/// name when the request has an adapter, `(mm_identifier, offset)` pairs, the cache salt (stock
/// vLLM names it in a request's first block only, pagedkv's vLLM plug-in in every block),
/// prompt-embedding digests (bytes). The salt becomes `CacheSalt` (the indexer carries it down
/// the chain; see `KvIndexer`). A block with multimodal, prompt-embedding or unknown keys, or
/// another salt than the event's first, or, in a LoRA request's event, without the LoRA name
/// first (another name than `lora_name`), cannot be rehashed as a pagedkv query would hash it:
/// the event is cut before that block (its later blocks chain from it), which under-reports and
/// never matches a query wrongly. Err: why the fields are malformed (a `lora_name` that is not a
/// str, an `extra_keys` that is not one tuple or None per block).
fn wire_stored_keys(
    fields: &[Bound<'_, PyAny>],
    n_blocks: usize,
) -> Result<(Vec<ExtraKey>, usize), String> {
    let present = |i: usize| fields.get(i).filter(|v| !v.is_none());
    let text = |v: &Bound<'_, PyAny>| v.str().map(|s| s.to_string()).map_err(|e| e.to_string());
    let lora_name = match present(7) {
        Some(name) if name.is_instance_of::<PyString>() => Some(text(name)?),
        Some(name) => {
            return Err(format!(
                "lora_name must be a str or None, got {}",
                type_name(name)
            ))
        }
        None => None,
    };
    let adapter = match (&lora_name, present(5)) {
        (Some(name), _) => Some(name.clone()),
        (None, Some(id)) => Some(text(id)?),
        (None, None) => None,
    };
    let mut keys: Vec<ExtraKey> = adapter.iter().cloned().map(ExtraKey::Adapter).collect();
    let Some(per_block) = present(8) else {
        return Ok((keys, n_blocks));
    };
    let entries = list_items(per_block, "events")
        .map_err(|_| "extra_keys must be a list with one tuple or None per block".to_string())?;
    // One entry per block: with fewer, a block's own keys (a multimodal item) would be unknown.
    if entries.len() != n_blocks {
        return Err(format!(
            "extra_keys has {} entries for {n_blocks} blocks (one tuple or None per block)",
            entries.len()
        ));
    }
    let mut salt: Option<String> = None;
    let mut usable = n_blocks;
    'blocks: for (i, entry) in entries.iter().enumerate() {
        let parts = if entry.is_none() {
            Vec::new()
        } else {
            list_items(entry, "events")
                .map_err(|_| format!("extra_keys[{i}] must be a tuple of keys or None"))?
        };
        let mut rest = parts.as_slice();
        if adapter.is_some() {
            // vLLM keys every block of a LoRA request by its name, first: a block without it
            // (or, when the event names the LoRA, with another name) was hashed otherwise.
            let first_is_name = match (rest.first(), &lora_name) {
                (Some(p), Some(name)) => p.is_instance_of::<PyString>() && text(p)? == *name,
                (Some(p), None) => p.is_instance_of::<PyString>(),
                (None, _) => false,
            };
            if !first_is_name {
                usable = i;
                break 'blocks;
            }
            rest = &rest[1..];
        }
        for part in rest {
            let same_salt = part.is_instance_of::<PyString>()
                && match &salt {
                    None => i == 0,
                    Some(s) => *s == text(part)?,
                };
            if !same_salt {
                usable = i;
                break 'blocks;
            }
            salt = Some(text(part)?);
        }
    }
    keys.extend(salt.map(ExtraKey::CacheSalt));
    Ok((keys, usable))
}

/// How many blocks of a vLLM wire `BlockStored` precede the first one whose hash also covers
/// tokens after the block (`lookahead_token_ids`, field 15: one list per block, None when
/// lookahead hashing is off). Such a block cannot be rehashed from its own tokens as a query
/// hashes it (a query would match where vLLM needs the following tokens too), so the event is
/// cut there. Err: why the field is malformed.
fn lookahead_cut(fields: &[Bound<'_, PyAny>], n_blocks: usize) -> Result<usize, String> {
    let Some(per_block) = fields.get(15).filter(|v| !v.is_none()) else {
        return Ok(n_blocks);
    };
    let malformed = || "lookahead_token_ids must be a list with one list of token ids per block";
    let entries = list_items(per_block, "events").map_err(|_| malformed().to_string())?;
    if entries.len() != n_blocks {
        return Err(format!(
            "lookahead_token_ids has {} entries for {n_blocks} blocks",
            entries.len()
        ));
    }
    for (i, entry) in entries.iter().enumerate() {
        if !entry.is_none()
            && !list_items(entry, "events")
                .map_err(|_| malformed().to_string())?
                .is_empty()
        {
            return Ok(i);
        }
    }
    Ok(n_blocks)
}

/// Field of a wire `BlockStored` / `BlockRemoved` holding `group_idx` (vLLM 0.33 order).
const STORED_GROUP_FIELD: usize = 9;
const REMOVED_GROUP_FIELD: usize = 3;

/// Whether a wire event belongs to the first KV cache group: its `group_idx` field is absent,
/// None or 0. A hybrid model (full and sliding-window attention layers, say) publishes one
/// event per group for the same block hashes; a sliding-window group frees a prompt's early
/// blocks long before the full-attention group does, so reading its removals as the first
/// group's would drop prefixes the worker still holds. Only the first group is indexed.
/// Err: a `group_idx` that is not an int >= 0 or None.
fn in_first_group(fields: &[Bound<'_, PyAny>], at: usize) -> Result<bool, String> {
    match fields.get(at).filter(|g| !g.is_none()) {
        None => Ok(true),
        Some(g) if g.is_instance_of::<PyBool>() => {
            Err(format!("group_idx must be an int, got {}", repr(g)))
        }
        Some(g) => g
            .extract::<u64>()
            .map(|idx| idx == 0)
            .map_err(|_| format!("group_idx must be an int >= 0 or None, got {}", repr(g))),
    }
}

/// One event: a pagedkv event object, or a vLLM wire event (a list / tuple whose first item is
/// the type tag): `["BlockStored", hashes, parent, token_ids, block_size, lora_id, ...]`,
/// `["BlockRemoved", hashes, ...]`, `["AllBlocksCleared"]`. Trailing fields newer engines add
/// are ignored; the LoRA name (or id) and the cache salt become extra keys
/// (`wire_stored_keys`). A wire `BlockStored` gets
/// `batch_root` as its hash root (the wire events themselves carry none). `None`: a wire event
/// of another KV cache group than the first (see `in_first_group`), not indexed.
fn event(
    obj: &Bound<'_, PyAny>,
    i: usize,
    batch_root: Option<BlockHash>,
) -> PyResult<Option<KvEvent>> {
    let py = obj.py();
    if let Ok(ev) = obj.cast::<PyBlockStored>() {
        return Ok(Some(ev.get().to_core()));
    }
    if let Ok(ev) = obj.cast::<PyBlockRemoved>() {
        return Ok(Some(ev.get().to_core()));
    }
    if obj.cast::<PyAllBlocksCleared>().is_ok() {
        return Ok(Some(KvEvent::AllBlocksCleared));
    }
    let malformed = |why: &str| {
        invalid(
            py,
            "events",
            format!("{} at index {i}", repr(obj)),
            why.to_string(),
        )
    };
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(malformed(
            "expected an event object or a [tag, fields...] list",
        ));
    }
    let fields: Vec<Bound<'_, PyAny>> = list_items(obj, "events")
        .map_err(|_| malformed("expected an event object or a [tag, fields...] list"))?;
    let tag: String = fields
        .first()
        .and_then(|t| t.extract().ok())
        .ok_or_else(|| malformed("the first item must be the event type name"))?;
    match tag.as_str() {
        "BlockStored" => {
            if fields.len() < 5 {
                return Err(malformed(
                    "BlockStored needs block_hashes, parent_block_hash, token_ids, block_size",
                ));
            }
            // Read in full whatever its group, so a malformed event is refused alike.
            let first =
                in_first_group(&fields, STORED_GROUP_FIELD).map_err(|why| malformed(&why))?;
            let block_hashes = wire_hashes(&fields[1], "events")?;
            let parent_block_hash = if fields[2].is_none() {
                None
            } else {
                Some(wire_hash(&fields[2], "events")?)
            };
            let mut block_hashes = block_hashes;
            let mut token_ids = token_ids(&fields[3], "events")?;
            let block_size = uint(&fields[4], "events", u64::from(u32::MAX))? as u32;
            let (extra_keys, usable) = wire_stored_keys(&fields, block_hashes.len())
                .and_then(|(keys, usable)| {
                    Ok((
                        keys,
                        usable.min(lookahead_cut(&fields, block_hashes.len())?),
                    ))
                })
                .map_err(|why| malformed(&why))?;
            let whole = block_hashes.len() * block_size as usize;
            if usable < block_hashes.len() && token_ids.len() == whole {
                block_hashes.truncate(usable);
                token_ids.truncate(usable * block_size as usize);
            }
            Ok(first.then_some(KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                extra_keys,
                hash_root: batch_root,
            }))
        }
        "BlockRemoved" => {
            let hashes = fields
                .get(1)
                .ok_or_else(|| malformed("BlockRemoved needs block_hashes"))?;
            let block_hashes = wire_hashes(hashes, "events")?;
            let first =
                in_first_group(&fields, REMOVED_GROUP_FIELD).map_err(|why| malformed(&why))?;
            Ok(first.then_some(KvEvent::BlockRemoved { block_hashes }))
        }
        "AllBlocksCleared" => Ok(Some(KvEvent::AllBlocksCleared)),
        _ => Err(malformed(
            "unknown event type (expected BlockStored, BlockRemoved or AllBlocksCleared)",
        )),
    }
}

fn worker_id(obj: &Bound<'_, PyAny>) -> PyResult<WorkerId> {
    uint(obj, "worker_id", u64::MAX)
}

fn status_dict<'py>(py: Python<'py>, st: &WorkerStatus) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("worker_id", st.id)?;
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
    /// they are) or ``"tokens"`` (blocks rehashed from their token ids). Raises
    /// ``InvalidArgumentError`` if it is registered already.
    #[pyo3(signature = (worker_id, *, hash_source = None),
           text_signature = "($self, worker_id, *, hash_source='engine')")]
    fn add_worker(
        &self,
        py: Python<'_>,
        worker_id: &Bound<'_, PyAny>,
        hash_source: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
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
        self.with(py, |ix| ix.add_worker(id, source)).py(py)
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

    /// Applies event batch ``seq`` of ``worker_id``; returns ``"applied"``, ``"buffered"``,
    /// ``"duplicate"`` or ``"gap"``. ``hash_root`` is the batch's hash root for wire events
    /// (which carry none). Raises ``InvalidArgumentError`` (nothing applied) for a malformed
    /// event, or an engine worker's event whose hash root is not the indexer's.
    #[pyo3(signature = (worker_id, seq, events, *, hash_root = None))]
    fn apply(
        &self,
        py: Python<'_>,
        worker_id: &Bound<'_, PyAny>,
        seq: &Bound<'_, PyAny>,
        events: &Bound<'_, PyAny>,
        hash_root: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<&'static str> {
        let id = self::worker_id(worker_id)?;
        let seq = uint(seq, "seq", u64::MAX)?;
        let batch_root = root_arg(hash_root)?;
        if events.is_instance_of::<PyString>() || events.is_instance_of::<PyBytes>() {
            return Err(invalid(
                py,
                "events",
                repr(events),
                "expected a list of events (decode a wire payload first)",
            ));
        }
        let events: Vec<KvEvent> = list_items(events, "events")?
            .iter()
            .enumerate()
            .map(|(i, e)| event(e, i, batch_root))
            .collect::<PyResult<Vec<_>>>()?
            .into_iter()
            .flatten()
            .collect();
        self.with(py, |ix| ix.apply_batch(id, seq, events))
            .py(py)
            .map(|o| o.name())
    }

    /// Replaces the worker's entries with ``block_hashes`` as of its batch ``seq``; a
    /// ``hash_root`` (32 bytes) other than the indexer's is refused.
    #[pyo3(signature = (worker_id, seq, block_hashes, *, hash_root = None))]
    fn apply_snapshot(
        &self,
        py: Python<'_>,
        worker_id: &Bound<'_, PyAny>,
        seq: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        hash_root: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let id = self::worker_id(worker_id)?;
        let seq = uint(seq, "seq", u64::MAX)?;
        let hashes = wire_hashes(block_hashes, "block_hashes")?;
        let root = root_arg(hash_root)?;
        self.with(py, |ix| ix.apply_snapshot(id, seq, &hashes, root))
            .py(py)
    }

    /// Chained 32-byte hashes of the prompt's first ``num_blocks`` full blocks, as a manager
    /// computes them.
    #[pyo3(signature = (token_ids, *, num_blocks = None, cache_salt = None, adapter_id = None, extra_keys = None, mm_items = None))]
    #[allow(clippy::too_many_arguments)]
    fn block_hashes<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'_, PyAny>,
        num_blocks: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        adapter_id: Option<&Bound<'_, PyAny>>,
        extra_keys: Option<&Bound<'_, PyAny>>,
        mm_items: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let tokens = crate::convert::token_ids(token_ids, "token_ids")?;
        let spec = sequence_spec(
            opt_str(cache_salt, "cache_salt")?,
            opt_str(adapter_id, "adapter_id")?,
            extra_keys,
            mm_items,
        )?;
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
    #[pyo3(signature = (token_ids, *, cache_salt = None, adapter_id = None, extra_keys = None, mm_items = None))]
    fn overlap<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        adapter_id: Option<&Bound<'_, PyAny>>,
        extra_keys: Option<&Bound<'_, PyAny>>,
        mm_items: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let tokens = crate::convert::token_ids(token_ids, "token_ids")?;
        let spec = sequence_spec(
            opt_str(cache_salt, "cache_salt")?,
            opt_str(adapter_id, "adapter_id")?,
            extra_keys,
            mm_items,
        )?;
        let pairs = self.with(py, |ix| ix.overlap_tokens(&tokens, &spec));
        overlap_dict(py, pairs)
    }

    /// ``{worker_id: leading blocks held}`` for a list of block hashes.
    fn overlap_hashes<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let hashes = wire_hashes(block_hashes, "block_hashes")?;
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
