//! `pagedkv.BlockPool`: the block pool on its own (for allocators and stress tests), or a
//! read-only view of a manager's pool.

use crate::convert::{bad, block_ids, bytes_arg, count, uint};
use crate::errors::{read_only_pool, to_pyerr, IntoPyResult};
use numpy::{PyArray1, PyArrayMethods};
use pagedkv_core::events::EventSink;
use pagedkv_core::pool::BlockPool;
use pagedkv_core::{BlockHash, BlockId, KvCacheManager};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::sync::Arc;

/// Who owns the pool: a standalone pool, or the manager whose pool this views.
#[derive(Debug, Clone)]
enum Owner {
    Standalone(Arc<BlockPool>),
    Manager(Arc<KvCacheManager>),
}

/// A pool of ``num_blocks`` fixed-size KV blocks with reference counts, prefix hashes and the
/// free queue of PagedAttention (block 0 is the null block: never allocated).
///
/// ``BlockPool(num_blocks)`` makes a standalone pool (thread-safe; calls on more than 1,024
/// blocks release the GIL, smaller ones keep it, which is cheaper than releasing it; the
/// uncached free list and ref counts are lock-free). ``KVCacheManager.pool`` returns a
/// read-only view of the manager's pool: its mutating methods raise ``ReadOnlyPoolError`` (a
/// ``RuntimeError``), because
/// changing the pool behind the manager's back breaks the manager's bookkeeping.
///
/// Raises ``InvalidConfigError`` unless ``2 <= num_blocks <= 2**28``.
#[pyclass(frozen, module = "pagedkv._core", name = "BlockPool")]
#[derive(Debug)]
pub(crate) struct PyBlockPool {
    owner: Owner,
}

impl PyBlockPool {
    pub(crate) fn view_of(manager: Arc<KvCacheManager>) -> Self {
        Self {
            owner: Owner::Manager(manager),
        }
    }

    fn pool(&self) -> &BlockPool {
        match &self.owner {
            Owner::Standalone(p) => p,
            Owner::Manager(m) => m.pool(),
        }
    }

    /// The pool for a mutating call: standalone only.
    fn writable(&self, op: &str) -> PyResult<&BlockPool> {
        match &self.owner {
            Owner::Standalone(p) => Ok(p),
            Owner::Manager(_) => Err(Python::attach(|py| read_only_pool(py, op))),
        }
    }

    /// A block id argument below `num_blocks` (the null block 0 included).
    fn block_id_in_range(&self, py: Python<'_>, block_id: &Bound<'_, PyAny>) -> PyResult<BlockId> {
        let id = uint(block_id, "block_id", u64::from(u32::MAX))? as u32;
        let num_blocks = self.pool().num_blocks();
        if id >= num_blocks {
            return Err(to_pyerr(
                py,
                &pagedkv_core::Error::InvalidBlockId {
                    block_id: id,
                    num_blocks,
                },
            ));
        }
        Ok(id)
    }
}

/// Calls on at most this many blocks keep the GIL: the lock-free pool does them in well under a
/// microsecond, less than releasing and re-taking the GIL costs. The core never waits on Python,
/// so holding the GIL while it runs cannot deadlock; larger calls release it.
const GIL_HELD_MAX_BLOCKS: usize = 1024;

/// Runs `f` with the GIL released when the call touches more than [`GIL_HELD_MAX_BLOCKS`]
/// blocks, else with the GIL held.
fn run<T: Send>(py: Python<'_>, blocks: usize, f: impl FnOnce() -> T + Send) -> T {
    if blocks > GIL_HELD_MAX_BLOCKS {
        py.detach(f)
    } else {
        f()
    }
}

/// `ids` as a new `int32` numpy array (numpy owns its buffer: cheaper to make than an array
/// over a Rust `Vec`, which needs a Python object to own the `Vec`).
fn id_array<'py>(py: Python<'py>, ids: &[BlockId]) -> Bound<'py, PyArray1<i32>> {
    let arr = PyArray1::<i32>::zeros(py, ids.len(), false);
    // SAFETY: a fresh C-contiguous array nothing else references yet.
    let dst = unsafe { arr.as_slice_mut() }.expect("a new 1-D array is contiguous");
    for (d, &id) in dst.iter_mut().zip(ids) {
        *d = id as i32; // ids are < MAX_BLOCKS = 2^28
    }
    arr
}

/// A 32-byte block hash argument.
fn hash_arg(hash: &Bound<'_, PyAny>) -> PyResult<BlockHash> {
    let bytes = bytes_arg(hash, "hash")?;
    let arr: [u8; 32] = bytes.try_into().map_err(|_| {
        let value = format!("<{} bytes>", bytes.len());
        bad(hash.py(), "hash", value, "a block hash is exactly 32 bytes")
    })?;
    Ok(BlockHash(arr))
}

#[pymethods]
impl PyBlockPool {
    #[new]
    fn new(py: Python<'_>, num_blocks: &Bound<'_, PyAny>) -> PyResult<Self> {
        let n = uint(num_blocks, "num_blocks", u64::from(u32::MAX)).map_err(|_| {
            crate::errors::to_pyerr(
                py,
                &pagedkv_core::Error::InvalidConfig {
                    field: "num_blocks",
                    value: num_blocks.repr().map(|r| r.to_string()).unwrap_or_default(),
                    reason: format!("expected an int in 2..={}", pagedkv_core::pool::MAX_BLOCKS),
                },
            )
        })? as u32;
        let pool = py
            .detach(|| BlockPool::new(n, Arc::new(EventSink::new(false))))
            .py(py)?;
        Ok(Self {
            owner: Owner::Standalone(Arc::new(pool)),
        })
    }

    /// Physical blocks, the null block included.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.pool().num_blocks()
    }

    /// Usable blocks: ``num_blocks - 1``.
    #[getter]
    fn num_usable(&self) -> usize {
        self.pool().num_usable()
    }

    /// Free blocks (ref count 0: uncached + cached-evictable). Wait-free.
    #[getter]
    fn num_free(&self) -> usize {
        self.pool().num_free()
    }

    /// Free blocks that still carry a prefix hash (evictable).
    #[getter]
    fn num_cached_free(&self) -> usize {
        self.pool().num_cached_free()
    }

    /// Blocks with ref count > 0.
    #[getter]
    fn num_used(&self) -> usize {
        self.pool().num_used()
    }

    /// Blocks carrying a prefix hash (referenced or free): the prefix index's size.
    #[getter]
    fn num_hashed(&self) -> usize {
        self.pool().num_hashed()
    }

    /// Every block carrying a prefix hash: ``(hashes, block_ids)``, a list of 32-byte
    /// ``bytes`` and ``int32[n]``, in block-id order. O(num_blocks).
    fn cached_blocks<'py>(
        &self,
        py: Python<'py>,
    ) -> (Vec<Bound<'py, PyBytes>>, Py<numpy::PyArray1<i32>>) {
        let pairs = self.pool().cached_blocks();
        let hashes = pairs.iter().map(|(_, h)| PyBytes::new(py, &h.0)).collect();
        let ids: Vec<i32> = pairs.iter().map(|&(b, _)| b as i32).collect();
        (hashes, numpy::PyArray1::from_vec(py, ids).unbind())
    }

    /// Takes ``n`` blocks, all or nothing: ``int32[n]`` block ids, each with ref count 1 and no
    /// hash. Uncached free blocks first (LIFO), then cached ones evicted LRU-first.
    /// Raises ``OutOfBlocksError`` (nothing taken) when fewer than ``n`` are free. Lock-free
    /// unless it evicts. GIL released above 1,024 blocks.
    fn allocate<'py>(
        &self,
        py: Python<'py>,
        n: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let n = count(n, "n")?;
        let pool = self.writable("allocate")?;
        let ids = run(py, n, || pool.allocate(n)).py(py)?;
        Ok(id_array(py, &ids))
    }

    /// Takes ``n`` blocks like ``allocate``, returned as a ``list[int]`` of block ids instead
    /// of an array. For a few blocks handed out one by one, for example the decode step that
    /// gives one new block to each sequence whose last block is full, a list is cheaper to
    /// make than an array and its items are already Python ints (no ``.tolist()``); for many
    /// blocks kept together (a prompt's table), ``allocate``'s array is cheaper. Same errors
    /// (``OutOfBlocksError``, nothing taken) and order as ``allocate``. GIL released above
    /// 1,024 blocks.
    fn allocate_list<'py>(
        &self,
        py: Python<'py>,
        n: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let n = count(n, "n")?;
        let pool = self.writable("allocate_list")?;
        let ids = run(py, n, || pool.allocate(n)).py(py)?;
        PyList::new(py, ids)
    }

    /// Releases one reference per id, in the given order (pass tables tail-first). A block
    /// reaching 0 goes to the front of the free queue (no hash) or the back of the LRU (hashed).
    /// Validates every id first: ``InvalidBlockError``, ``RefCountUnderflowError`` (duplicates
    /// counted) leave everything unchanged. GIL released above 1,024 blocks.
    fn free(&self, py: Python<'_>, ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = block_ids(ids, "ids")?;
        let pool = self.writable("free")?;
        run(py, ids.len(), || pool.free(&ids)).py(py)
    }

    /// Releases a block table tail first: ``free(table[::-1])`` without the reversed copy. A
    /// finished sequence returns its blocks this way so that its last (least shared) blocks
    /// are evicted before the prefix blocks other prompts may still hit. Same validation and
    /// errors as ``free`` (nothing changed on error). GIL released above 1,024 blocks.
    fn free_table(&self, py: Python<'_>, table: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = block_ids(table, "table")?;
        ids.reverse();
        let pool = self.writable("free_table")?;
        run(py, ids.len(), || pool.free(&ids)).py(py)
    }

    /// Adds one reference per id (fork); every id must already have ref count > 0
    /// (``InvalidBlockError`` otherwise, nothing changed). GIL released above 1,024 blocks.
    fn incref(&self, py: Python<'_>, ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = block_ids(ids, "ids")?;
        let pool = self.writable("incref")?;
        run(py, ids.len(), || pool.incref(&ids)).py(py)
    }

    /// Prefix hits: one reference per id; a free cached block leaves the LRU (O(1)) and
    /// consumes free capacity. Free ids must carry a hash. All or nothing
    /// (``InvalidBlockError``, ``OutOfBlocksError``). GIL released above 1,024 blocks.
    fn touch(&self, py: Python<'_>, ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = block_ids(ids, "ids")?;
        let pool = self.writable("touch")?;
        run(py, ids.len(), || pool.touch(&ids)).py(py)
    }

    /// Registers block ``block_id`` (ref count > 0) under a 32-byte ``hash`` in the prefix
    /// index; a block that already has a hash keeps it. Returns True when ``hash`` became
    /// resolvable by this call (no other block carried it). GIL released.
    fn cache_block(
        &self,
        py: Python<'_>,
        block_id: &Bound<'_, PyAny>,
        hash: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let id = uint(block_id, "block_id", u64::from(u32::MAX))? as u32;
        let hash = hash_arg(hash)?;
        let pool = self.writable("cache_block")?;
        py.detach(|| pool.cache_block(id, hash)).py(py)
    }

    /// A block carrying ``hash`` (32 bytes), or None. No side effects.
    fn lookup(&self, py: Python<'_>, hash: &Bound<'_, PyAny>) -> PyResult<Option<BlockId>> {
        let hash = hash_arg(hash)?;
        Ok(py.detach(|| self.pool().lookup(&hash)))
    }

    /// Drops every hash (all free blocks become uncached). ``CacheInUseError`` while any
    /// block is in use.
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<()> {
        let pool = self.writable("reset_prefix_cache")?;
        py.detach(|| pool.reset_prefix_cache()).py(py)
    }

    /// Reference count of ``block_id``; 0 for the null block 0 (never referenced). O(1).
    ///
    /// Raises ``InvalidBlockError`` for an id ``>= num_blocks`` (like ``free``), and
    /// ``InvalidArgumentError`` for a negative or non-int id.
    fn ref_count(&self, py: Python<'_>, block_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let id = self.block_id_in_range(py, block_id)?;
        Ok(self.pool().ref_count(id))
    }

    /// The 32-byte prefix hash of ``block_id``, or None when the block carries none (the null
    /// block never does). O(1), takes the pool's lock.
    ///
    /// Raises ``InvalidBlockError`` for an id ``>= num_blocks``, and ``InvalidArgumentError``
    /// for a negative or non-int id.
    fn block_hash<'py>(
        &self,
        py: Python<'py>,
        block_id: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let id = self.block_id_in_range(py, block_id)?;
        Ok(self.pool().block_hash(id).map(|h| PyBytes::new(py, &h.0)))
    }

    /// The logical free queue, front (next allocated) to back: ``int32[num_free]``. Takes the
    /// pool's lock; for tests and invariant checks.
    fn free_queue<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        let q = py.detach(|| self.pool().free_queue());
        id_array(py, &q)
    }

    /// Cumulative counters (blocks): ``evictions``, ``allocations``, ``frees``,
    /// ``prefix_touches``.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.pool().counters();
        let d = PyDict::new(py);
        d.set_item("evictions", c.evictions)?;
        d.set_item("allocations", c.allocations)?;
        d.set_item("frees", c.frees)?;
        d.set_item("prefix_touches", c.prefix_touches)?;
        Ok(d)
    }

    /// Checks the pool invariants (docs/design.md, "Invariants" 1-3); raises ``InvariantViolationError`` (an ``AssertionError``) naming the first
    /// violation. O(num_blocks). GIL released.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.pool().check_invariants())
            .map_err(|msg| crate::errors::invariant_violation(py, msg))
    }

    fn __repr__(&self) -> String {
        let p = self.pool();
        format!(
            "BlockPool(num_blocks={}, used={}, free={}, cached_free={}{})",
            p.num_blocks(),
            p.num_used(),
            p.num_free(),
            p.num_cached_free(),
            if matches!(self.owner, Owner::Manager(_)) {
                ", view"
            } else {
                ""
            }
        )
    }
}
