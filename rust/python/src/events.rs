//! KV cache events as frozen Python objects: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`
//! (the schema serving routers consume). Hashes are 32-byte `bytes`.

use pagedkv_core::events::{KvEvent, Tier};
use pagedkv_core::{BlockHash, ExtraKey, GroupEvent};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

fn hash_bytes<'py>(py: Python<'py>, h: &BlockHash) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &h.0)
}

/// An extra key as a tuple whose first item names its kind: ``("adapter", name)``,
/// ``("cache_salt", salt)``, ``("multimodal", item_hash: bytes, offset: int)`` or
/// ``("tagged", tag, value: bytes)``.
fn extra_key<'py>(py: Python<'py>, key: &ExtraKey) -> PyResult<Bound<'py, PyTuple>> {
    match key {
        ExtraKey::Adapter(name) => ("adapter", name.as_str()).into_pyobject(py),
        ExtraKey::CacheSalt(salt) => ("cache_salt", salt.as_str()).into_pyobject(py),
        ExtraKey::Multimodal { item_hash, offset } => {
            ("multimodal", PyBytes::new(py, item_hash), *offset).into_pyobject(py)
        }
        ExtraKey::Tagged { tag, value } => {
            ("tagged", tag.as_str(), PyBytes::new(py, value)).into_pyobject(py)
        }
    }
}

/// Full blocks were registered in the prefix cache.
///
/// ``block_hashes[i]`` (32 bytes) is the hash of the block holding
/// ``token_ids[i * block_size:(i + 1) * block_size]``; ``parent_block_hash`` is the hash of the
/// block before the first one (None for a sequence's first block). ``extra_keys``: see
/// ``KVCacheManager.take_events``. ``hash_root`` (32 bytes) names the emitting manager's hash
/// algorithm and seed -- for ``LLMEngine`` its cache identity -- or is None (vLLM's events).
/// ``group`` is the KV cache group the blocks belong to (0 with one group); the hashes are the
/// plain chain hashes of that group's block size.
#[pyclass(frozen, eq, module = "pagedkv._core", name = "BlockStored")]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PyBlockStored {
    hashes: Vec<BlockHash>,
    parent: Option<BlockHash>,
    token_ids: Vec<u32>,
    block_size: u32,
    extra_keys: Vec<ExtraKey>,
    hash_root: Option<BlockHash>,
    tier: Tier,
    group: u32,
}

#[pymethods]
impl PyBlockStored {
    /// Hashes of the stored blocks (32 bytes each), in block order.
    #[getter]
    fn block_hashes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.hashes.iter().map(|h| hash_bytes(py, h)))
    }

    /// Hash of the block before the first stored one, or None.
    #[getter]
    fn parent_block_hash<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.parent.as_ref().map(|h| hash_bytes(py, h))
    }

    /// Token ids of the stored blocks (``len(block_hashes) * block_size`` of them).
    #[getter]
    fn token_ids(&self) -> Vec<u32> {
        self.token_ids.clone()
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Extra keys mixed into the hashes, as ``(kind, ...)`` tuples.
    #[getter]
    fn extra_keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items = self
            .extra_keys
            .iter()
            .map(|k| extra_key(py, k))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// Root of the emitting manager's hash chains (32 bytes): a digest of its hash algorithm
    /// and chain seed, so equal roots mean the same cache identity. None when the engine does
    /// not say (events decoded from vLLM's wire format).
    #[getter]
    fn hash_root<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.hash_root.as_ref().map(|h| hash_bytes(py, h))
    }

    /// The prefix-cache tier the blocks became resolvable in: ``"device"`` (the block pool)
    /// or ``"host"`` (the host-memory tier; vLLM's ``medium`` ``"CPU"``).
    #[getter]
    fn tier(&self) -> &'static str {
        self.tier.name()
    }

    /// The KV cache group the blocks belong to (0 with one group).
    #[getter]
    fn group(&self) -> u32 {
        self.group
    }

    fn __repr__(&self) -> String {
        let short = |h: Option<BlockHash>| {
            h.map(|h| h.to_hex()[..16].to_string())
                .unwrap_or_else(|| "None".into())
        };
        format!(
            "BlockStored(blocks={}, block_size={}, parent={}, extra_keys={}, hash_root={}, tier={:?}, group={})",
            self.hashes.len(),
            self.block_size,
            short(self.parent),
            self.extra_keys.len(),
            short(self.hash_root),
            self.tier.name(),
            self.group
        )
    }
}

/// Blocks were evicted from the prefix cache: their hashes no longer resolve to them.
/// ``group`` is the KV cache group they belonged to (0 with one group).
#[pyclass(frozen, eq, module = "pagedkv._core", name = "BlockRemoved")]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PyBlockRemoved {
    hashes: Vec<BlockHash>,
    tier: Tier,
    group: u32,
}

#[pymethods]
impl PyBlockRemoved {
    /// Hashes of the evicted blocks (32 bytes each).
    #[getter]
    fn block_hashes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.hashes.iter().map(|h| hash_bytes(py, h)))
    }

    /// The prefix-cache tier the hashes left: ``"device"`` or ``"host"``.
    #[getter]
    fn tier(&self) -> &'static str {
        self.tier.name()
    }

    /// The KV cache group the blocks belonged to (0 with one group).
    #[getter]
    fn group(&self) -> u32 {
        self.group
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockRemoved(blocks={}, tier={:?}, group={})",
            self.hashes.len(),
            self.tier.name(),
            self.group
        )
    }
}

/// The prefix cache was reset: every hash dropped, in every tier (device and host).
#[pyclass(frozen, eq, module = "pagedkv._core", name = "AllBlocksCleared")]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PyAllBlocksCleared {}

#[pymethods]
impl PyAllBlocksCleared {
    fn __repr__(&self) -> &'static str {
        "AllBlocksCleared()"
    }
}

impl PyBlockStored {
    /// The KV cache group of the event.
    pub(crate) fn group_index(&self) -> u32 {
        self.group
    }

    /// The core event this object stands for.
    pub(crate) fn to_core(&self) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: self.hashes.clone(),
            parent_block_hash: self.parent,
            token_ids: self.token_ids.clone(),
            block_size: self.block_size,
            extra_keys: self.extra_keys.clone(),
            hash_root: self.hash_root,
            tier: self.tier,
        }
    }
}

impl PyBlockRemoved {
    /// The KV cache group of the event.
    pub(crate) fn group_index(&self) -> u32 {
        self.group
    }

    /// The core event this object stands for.
    pub(crate) fn to_core(&self) -> KvEvent {
        KvEvent::BlockRemoved {
            block_hashes: self.hashes.clone(),
            tier: self.tier,
        }
    }
}

/// One core event of a KV cache group (none: group 0) as its Python object.
pub(crate) fn event_object(py: Python<'_>, event: GroupEvent) -> PyResult<Py<PyAny>> {
    let group = event.group.unwrap_or(0);
    Ok(match event.event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            extra_keys,
            hash_root,
            tier,
        } => Py::new(
            py,
            PyBlockStored {
                hashes: block_hashes,
                parent: parent_block_hash,
                token_ids,
                block_size,
                extra_keys,
                hash_root,
                tier,
                group,
            },
        )?
        .into_any(),
        KvEvent::BlockRemoved { block_hashes, tier } => Py::new(
            py,
            PyBlockRemoved {
                hashes: block_hashes,
                tier,
                group,
            },
        )?
        .into_any(),
        KvEvent::AllBlocksCleared => Py::new(py, PyAllBlocksCleared {})?.into_any(),
    })
}
