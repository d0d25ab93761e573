//! `pagedkv.HostBlockPool`: the core's [`HostPool`] (the host tier on its own, with stores in
//! flight, load pins and all-or-nothing store preparation; `pagedkv_core::host_pool`) for a
//! scheduler-side offloading manager (vLLM's `OffloadingManager`,
//! `pagedkv.integrations.vllm.offloading`). This module only converts arguments and results.

use crate::convert::{bad, repr, type_name, uint};
use crate::errors::{invariant_violation, IntoPyResult};
use numpy::PyArray1;
use pagedkv_core::host_pool::{HostPool, KeyRefused};
use pagedkv_core::host_tier::{HostEviction, MAX_HOST_BLOCKS};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

/// The keys of a list / tuple / iterable of `bytes` (each any length), with their bytes.
fn keys_arg<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let item = |o: Bound<'py, PyAny>| -> PyResult<Bound<'py, PyBytes>> {
        o.cast_into::<PyBytes>().map_err(|e| {
            let o = e.into_inner();
            bad(
                o.py(),
                "hashes",
                repr(&o),
                format!("each block hash is bytes, got {}", type_name(&o)),
            )
        })
    };
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyString>() {
        return Err(bad(
            obj.py(),
            "hashes",
            repr(obj),
            "expected a sequence of bytes block hashes, got one value",
        ));
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return list.iter().map(item).collect();
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t.iter().map(item).collect();
    }
    let it = obj.try_iter().map_err(|_| {
        bad(
            obj.py(),
            "hashes",
            repr(obj),
            format!("expected an iterable of bytes, got {}", type_name(obj)),
        )
    })?;
    it.map(|o| item(o?)).collect()
}

/// The byte strings of `items`.
fn raw<'a>(items: &'a [Bound<'_, PyBytes>]) -> Vec<&'a [u8]> {
    items.iter().map(|b| b.as_bytes()).collect()
}

/// `InvalidArgumentError` naming the refused key of `items`.
fn bad_key(py: Python<'_>, items: &[Bound<'_, PyBytes>], e: KeyRefused) -> PyErr {
    let value = items
        .get(e.index)
        .map(|b| repr(b.as_any()))
        .unwrap_or_default();
    bad(
        py,
        "hashes",
        value,
        format!("hashes[{}]: {}", e.index, e.reason),
    )
}

/// A host-memory block pool for an offloading connector: the prefix cache's host tier
/// (``CacheConfig(num_host_blocks=...)`` uses the same core tier) on its own, keyed by block
/// hashes as ``bytes``.
///
/// ``HostBlockPool(num_blocks, *, admission_min_seen=1, eviction="lru")``: ``num_blocks`` host
/// blocks ids ``0..num_blocks`` (the caller owns the memory; one block is one unit of copy,
/// e.g. one vLLM offloading chunk); a key is stored once it has been offered
/// ``admission_min_seen`` times (1: every offer; counts age as in the tier: TinyLFU); the
/// eviction policy by name (``"lru"``, or another policy the core tier has). Raises
/// ``InvalidConfigError`` (a ``ValueError``) for ``num_blocks`` outside ``1..=2**28``,
/// ``admission_min_seen < 1`` or an unknown eviction name.
///
/// Keys: ``bytes`` of any length. A 36-byte key (vLLM's ``OffloadKey``: a 32-byte block hash
/// and a 4-byte big-endian KV cache group) is used exactly; any other length is keyed by its
/// SHA-256 (collision resistant), and the pool keeps its bytes to report it back.
///
/// A block is *free*, *storing* (``prepare_store`` gave it to a key, the copy has not
/// completed: not readable, not evictable), *readable* (evictable unless pinned by a load) or
/// *pinned* by loads (``prepare_load`` until ``complete_load``). Sequences of keys are passed
/// head to tail; they enter the eviction order tail first, so a full pool evicts a chain's tail
/// before its head. Every method checks its whole input first: a bad key raises
/// ``InvalidArgumentError`` (a ``ValueError``) and changes nothing.
#[pyclass(module = "pagedkv._core", name = "HostBlockPool")]
#[derive(Debug)]
pub(crate) struct PyHostBlockPool {
    pool: HostPool,
}

#[pymethods]
impl PyHostBlockPool {
    #[new]
    #[pyo3(signature = (num_blocks, *, admission_min_seen = None, eviction = None),
           text_signature = "(num_blocks, *, admission_min_seen=1, eviction='lru')")]
    fn new(
        py: Python<'_>,
        num_blocks: &Bound<'_, PyAny>,
        admission_min_seen: Option<&Bound<'_, PyAny>>,
        eviction: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let config_err = |field: &'static str, value: String, reason: String| {
            crate::errors::to_pyerr(
                py,
                &pagedkv_core::Error::InvalidConfig {
                    field,
                    value,
                    reason,
                },
            )
        };
        let n = uint(num_blocks, "num_blocks", u64::from(MAX_HOST_BLOCKS)).map_err(|_| {
            config_err(
                "num_host_blocks",
                repr(num_blocks),
                format!("expected an int in 1..={MAX_HOST_BLOCKS}"),
            )
        })? as u32;
        let min_seen = match admission_min_seen {
            None => 1,
            Some(o) => uint(o, "admission_min_seen", u64::from(u32::MAX)).map_err(|_| {
                config_err(
                    "host_admission_min_seen",
                    repr(o),
                    "expected an int >= 1".into(),
                )
            })? as u32,
        };
        let eviction = match eviction {
            None => HostEviction::default(),
            Some(o) => {
                let name = o
                    .cast::<PyString>()
                    .ok()
                    .and_then(|s| s.to_str().ok().map(str::to_owned));
                name.as_deref()
                    .and_then(HostEviction::from_name)
                    .ok_or_else(|| {
                        config_err(
                            "host_eviction",
                            repr(o),
                            format!(
                                "expected one of {}",
                                HostEviction::ALL
                                    .map(|e| format!("{:?}", e.name()))
                                    .join(", ")
                            ),
                        )
                    })?
            }
        };
        let pool = HostPool::new(n, min_seen, eviction).py(py)?;
        Ok(Self { pool })
    }

    /// Host blocks.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.pool.num_blocks()
    }

    /// Offers a key needs before it is stored.
    #[getter]
    fn admission_min_seen(&self) -> u32 {
        self.pool.admission_min_seen()
    }

    /// The eviction policy's name.
    #[getter]
    fn eviction(&self) -> &'static str {
        self.pool.eviction().name()
    }

    /// Host blocks holding a key (readable or storing).
    #[getter]
    fn num_used(&self) -> usize {
        self.pool.num_used()
    }

    /// Host blocks storing or pinned by loads (not evictable).
    #[getter]
    fn num_held(&self) -> usize {
        self.pool.num_held()
    }

    /// Cumulative counters in blocks: ``stores_prepared``, ``stores_completed``,
    /// ``stores_failed``, ``stores_refused`` (candidates of a ``prepare_store`` that returned
    /// ``None``), ``loads`` (blocks pinned by ``prepare_load``) and ``evictions``.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.pool.counters();
        let d = PyDict::new(py);
        d.set_item("stores_prepared", c.stores_prepared)?;
        d.set_item("stores_completed", c.stores_completed)?;
        d.set_item("stores_failed", c.stores_failed)?;
        d.set_item("stores_refused", c.stores_refused)?;
        d.set_item("loads", c.loads)?;
        d.set_item("evictions", c.evictions)?;
        Ok(d)
    }

    /// Number of leading ``hashes`` (head to tail) that are readable. No side effects.
    fn lookup(&self, hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        let items = keys_arg(hashes)?;
        Ok(self.pool.lookup(&raw(&items)))
    }

    /// One key's state: 0 not on host, 1 storing (a store in flight), 2 readable. Raises
    /// ``InvalidArgumentError`` unless ``hash`` is bytes.
    fn state(&self, hash: &Bound<'_, PyAny>) -> PyResult<u8> {
        let b = crate::convert::bytes_arg(hash, "hash")?;
        Ok(self.pool.state(b) as u8)
    }

    /// Pins the blocks of ``hashes`` (each readable) for loads and returns their host block
    /// ids (``int32``, one per hash): they are not evicted until ``complete_load``. A key may
    /// be pinned more than once (one ``complete_load`` each). Raises ``InvalidArgumentError``,
    /// pinning nothing, for a key that is not readable.
    fn prepare_load<'py>(
        &mut self,
        py: Python<'py>,
        hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let items = keys_arg(hashes)?;
        let blocks = self
            .pool
            .prepare_load(&raw(&items))
            .map_err(|e| bad_key(py, &items, e))?;
        Ok(PyArray1::from_vec(
            py,
            blocks.into_iter().map(|h| h as i32).collect(),
        ))
    }

    /// Releases one load pin per hash (tail first back into the eviction order). Raises
    /// ``InvalidArgumentError``, releasing nothing, for a key without a load pin left.
    fn complete_load(&mut self, py: Python<'_>, hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        let items = keys_arg(hashes)?;
        self.pool
            .complete_load(&raw(&items))
            .map_err(|e| bad_key(py, &items, e))
    }

    /// Marks the readable, unpinned blocks of ``hashes`` used (tail first); other keys are
    /// ignored.
    fn touch(&mut self, hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        let items = keys_arg(hashes)?;
        self.pool.touch(&raw(&items));
        Ok(())
    }

    /// Prepares storing ``hashes`` (head to tail; repeated keys count once). Each offer counts
    /// toward admission. Returns ``None`` when the admitted keys not on host do not fit in the
    /// free and evictable blocks (nothing allocated or evicted), else ``(to_store, block_ids,
    /// evicted)``: the keys to copy (head to tail, a subset of ``hashes``), their host blocks
    /// (``int32``), and the keys evicted to make room. Keys to store are *storing* until
    /// ``complete_store``; never evicted: storing or pinned blocks and the offered keys
    /// already on host (those count as used).
    fn prepare_store<'py>(
        &mut self,
        py: Python<'py>,
        hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let items = keys_arg(hashes)?;
        let Some(plan) = self.pool.prepare_store(&raw(&items)) else {
            return Ok(None);
        };
        let to_store = PyList::empty(py);
        for &i in &plan.indices {
            to_store.append(&items[i])?;
        }
        let evicted = PyList::empty(py);
        for b in &plan.evicted {
            evicted.append(PyBytes::new(py, b))?;
        }
        let blocks = PyArray1::from_vec(py, plan.blocks.iter().map(|&h| h as i32).collect());
        Ok(Some(PyTuple::new(
            py,
            [to_store.into_any(), blocks.into_any(), evicted.into_any()],
        )?))
    }

    /// Ends the stores of ``hashes``: ``success=True`` makes them readable (tail first into the
    /// eviction order), ``False`` drops them and frees their blocks. Raises
    /// ``InvalidArgumentError``, changing nothing, for a key without a store in flight
    /// (absent, readable already, or repeated) or a ``success`` that is not a bool.
    #[pyo3(signature = (hashes, success = None), text_signature = "($self, hashes, success=True)")]
    fn complete_store(
        &mut self,
        py: Python<'_>,
        hashes: &Bound<'_, PyAny>,
        success: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        // A bool (None: the default); anything else is an InvalidArgumentError, as for every
        // pagedkv flag, not pyo3's bare TypeError.
        let success = crate::convert::flag(success, "success", true)?;
        let items = keys_arg(hashes)?;
        self.pool
            .complete_store(&raw(&items), success)
            .map_err(|e| bad_key(py, &items, e))
    }

    /// Drops every block, stores and loads in flight included (their completions must not be
    /// reported afterwards: they raise). Counters are kept.
    fn reset(&mut self) {
        self.pool.reset();
    }

    /// Raises ``InvariantViolationError`` (an ``AssertionError``) naming the first broken
    /// invariant of the pool's bookkeeping. O(num_blocks).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.pool.check().map_err(|m| invariant_violation(py, m))
    }

    fn __repr__(&self) -> String {
        format!(
            "HostBlockPool(num_blocks={}, used={}, held={}, eviction='{}')",
            self.pool.num_blocks(),
            self.pool.num_used(),
            self.pool.num_held(),
            self.pool.eviction().name()
        )
    }
}
