//! `pagedkv.HostBlockPool`: the host tier of the prefix cache on its own, shaped for a
//! scheduler-side offloading manager (vLLM's `OffloadingManager`,
//! `pagedkv.integrations.vllm.offloading`): lookups of block-hash chains, loads pinned until
//! they complete, stores prepared (host blocks chosen, evictions made) and then completed or
//! rolled back.
//!
//! The blocks, their keys, admission and eviction are the core's [`HostTier`] (the tier the
//! `KVCacheManager` uses); this module adds what an asynchronous offloading connector needs on
//! top: a *store in flight* state (the host block is allocated but the KV is not copied yet:
//! neither readable nor evictable), load pins that are checked on release, all-or-nothing
//! store preparation, and bytes keys of any length.
//!
//! Order within a chain. Keys are passed head (first block of the prompt) to tail; the pool
//! enters them into the eviction order tail first, so when the tier is full a chain loses its
//! tail before its head (a prefix lookup cannot use a tail whose head is gone).

use crate::convert::{bad, repr, type_name, uint};
use crate::errors::{invariant_violation, IntoPyResult};
use numpy::PyArray1;
use pagedkv_core::host_tier::{HostEviction, HostKey, HostTier, MAX_HOST_BLOCKS};
use pagedkv_core::{BlockHash, BlockId, HashAlgo, PrefixHasher};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use std::collections::{HashMap, HashSet};

/// The "device blocks" the tier is told it sits beside. This pool has no device pool: the
/// number only sizes the tier's seen table (`2 x (host + device blocks)` keys, so at least
/// 64,000 keys, the size of vLLM's store-threshold tracker); plan_store's "KV written" check
/// reads device block 0, which never registers, so it always passes.
const SEEN_DEVICE_BLOCKS: u32 = 32_000;

/// The group id marking a key that was hashed (not a 36-byte vLLM offload key).
const HASHED_GROUP: u32 = u32::MAX;

/// Chain seed of the SHA-256 that turns a key of another length into a [`HostKey`].
const KEY_DOMAIN: &[u8] = b"pagedkv.HostBlockPool.key";

/// The host key of `bytes` and whether it was hashed. A 36-byte key (vLLM's `OffloadKey`: a
/// 32-byte block hash then the KV cache group as 4 big-endian bytes) maps exactly to
/// `(hash, group)`; any other key (or a group of `u32::MAX`) maps to the SHA-256 of its bytes
/// under [`KEY_DOMAIN`], in group `u32::MAX`. The pool keeps a hashed key's bytes to report
/// it back.
fn host_key(bytes: &[u8]) -> (HostKey, bool) {
    if bytes.len() == 36 {
        let group = u32::from_be_bytes(bytes[32..].try_into().expect("4 bytes"));
        if group != HASHED_GROUP {
            let hash: [u8; 32] = bytes[..32].try_into().expect("32 bytes");
            return (HostKey::new(BlockHash(hash), group), false);
        }
    }
    let mut seeded = Vec::with_capacity(KEY_DOMAIN.len() + bytes.len());
    seeded.extend_from_slice(KEY_DOMAIN);
    seeded.extend_from_slice(bytes);
    let hash = PrefixHasher::new(HashAlgo::Sha256, &seeded).root();
    (HostKey::new(hash, HASHED_GROUP), true)
}

/// Cumulative counters of a [`HostPool`], in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct PoolCounters {
    stores_prepared: u64,
    stores_completed: u64,
    stores_failed: u64,
    loads: u64,
    evictions: u64,
    stores_refused: u64,
}

/// What [`HostPool::prepare_store`] decided: the keys to copy (head to tail), their host
/// blocks, and the keys evicted to make room.
#[derive(Debug, Default)]
struct StorePlan {
    keys: Vec<HostKey>,
    blocks: Vec<BlockId>,
    evicted: Vec<Vec<u8>>,
}

/// Host blocks with stores in flight and load pins over a [`HostTier`] (see the module docs).
/// Not synchronised: the Python class holds it behind PyO3's borrow flag.
#[derive(Debug)]
struct HostPool {
    tier: HostTier,
    /// Bytes of the hashed keys on host (see [`host_key`]).
    originals: HashMap<HostKey, Box<[u8]>>,
    /// Per host block: a store is in flight (allocated, KV not written yet).
    storing: Vec<bool>,
    /// Per host block: loads prepared and not completed.
    load_pins: Vec<u32>,
    /// Host blocks storing or load-pinned (neither evictable nor store destinations).
    held: usize,
    counters: PoolCounters,
}

impl HostPool {
    /// Errors: the tier's `InvalidConfig` for `num_blocks` outside `1..=MAX_HOST_BLOCKS` or
    /// `admission_min_seen == 0`.
    fn new(
        num_blocks: u32,
        admission_min_seen: u32,
        eviction: HostEviction,
    ) -> pagedkv_core::Result<Self> {
        let tier = HostTier::new(
            num_blocks,
            admission_min_seen,
            eviction,
            SEEN_DEVICE_BLOCKS,
            false,
        )?;
        let n = num_blocks as usize;
        Ok(Self {
            tier,
            originals: HashMap::new(),
            storing: vec![false; n],
            load_pins: vec![0; n],
            held: 0,
            counters: PoolCounters::default(),
        })
    }

    /// The bytes of `key` (exact keys rebuilt, hashed ones from [`Self::originals`]).
    fn key_bytes(&self, key: &HostKey) -> Vec<u8> {
        if key.group == HASHED_GROUP {
            return self
                .originals
                .get(key)
                .map(|b| b.to_vec())
                .unwrap_or_default();
        }
        let mut out = Vec::with_capacity(36);
        out.extend_from_slice(&key.hash.0);
        out.extend_from_slice(&key.group.to_be_bytes());
        out
    }

    /// 0: not on host; 1: a store in flight; 2: readable.
    fn state(&self, key: &HostKey) -> u8 {
        match self.tier.lookup(key) {
            None => 0,
            Some(h) if self.storing[h as usize] => 1,
            Some(_) => 2,
        }
    }

    /// Leading keys of `keys` that are readable.
    fn lookup(&self, keys: &[HostKey]) -> usize {
        keys.iter().take_while(|k| self.state(k) == 2).count()
    }

    fn hold(&mut self, h: BlockId) {
        let i = h as usize;
        if !self.storing[i] && self.load_pins[i] == 0 {
            self.held += 1;
        }
    }

    fn release(&mut self, h: BlockId) {
        let i = h as usize;
        if !self.storing[i] && self.load_pins[i] == 0 {
            self.held -= 1;
        }
    }

    /// Pins the readable blocks of `keys` for loads; returns their host blocks. Errors (nothing
    /// pinned): `Err(index)` of the first key that is not readable.
    fn prepare_load(&mut self, keys: &[HostKey]) -> Result<Vec<BlockId>, usize> {
        let mut blocks = Vec::with_capacity(keys.len());
        for (i, k) in keys.iter().enumerate() {
            match self.tier.lookup(k) {
                Some(h) if !self.storing[h as usize] => blocks.push(h),
                _ => return Err(i),
            }
        }
        for &h in &blocks {
            self.hold(h);
            self.load_pins[h as usize] += 1;
            self.tier.pin(h).expect("a readable block holds a key");
        }
        self.counters.loads += blocks.len() as u64;
        Ok(blocks)
    }

    /// Releases one load pin per key, tail first. Errors (nothing released): `Err(index)` of
    /// the first key without a load pin left (not on host, or more completes than prepares).
    fn complete_load(&mut self, keys: &[HostKey]) -> Result<(), usize> {
        let mut blocks = Vec::with_capacity(keys.len());
        let mut taken: HashMap<BlockId, u32> = HashMap::new();
        for (i, k) in keys.iter().enumerate() {
            let Some(h) = self.tier.lookup(k) else {
                return Err(i);
            };
            let t = taken.entry(h).or_insert(0);
            if *t >= self.load_pins[h as usize] {
                return Err(i);
            }
            *t += 1;
            blocks.push(h);
        }
        for &h in blocks.iter().rev() {
            self.load_pins[h as usize] -= 1;
            self.release(h);
            self.tier.unpin(h);
        }
        Ok(())
    }

    /// Marks the readable, unpinned blocks of `keys` used, tail first (the eviction policy's
    /// "use": LRU moves them to the back). Other keys are ignored.
    fn touch(&mut self, keys: &[HostKey]) {
        for k in keys.iter().rev() {
            if let Some(h) = self.tier.lookup(k) {
                let i = h as usize;
                if !self.storing[i] && self.load_pins[i] == 0 {
                    // On host already: plan_store only records the use.
                    self.tier.plan_store(0, *k);
                }
            }
        }
    }

    /// Prepares storing `keys` (head to tail, duplicates ignored). Each offer counts toward
    /// admission. A key not on host whose seen count reached `admission_min_seen` is a store
    /// candidate; keys on host (readable or storing) are not stored again. `None` (nothing
    /// allocated, nothing evicted) when the candidates do not fit in the free and evictable
    /// blocks, not counting the offered keys already on host, which are never evicted by
    /// their own offer. Otherwise every candidate gets a host block (free, else the eviction
    /// policy's victim), and is *storing* until [`Self::complete_store`]; the offered readable
    /// keys are used (as [`Self::touch`]).
    fn prepare_store(&mut self, keys: &[HostKey], raw: &[&[u8]]) -> Option<StorePlan> {
        let min_seen = self.tier.admission_min_seen();
        let mut seen = HashSet::with_capacity(keys.len());
        let mut candidates = Vec::new();
        let mut protect = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            if !seen.insert(*k) {
                continue;
            }
            // Admission is decided right after the key's own offer is counted (noting later
            // keys may age this count).
            self.tier.note_seen(*k);
            if self.tier.seen_count(k) == 0 {
                // This very offer aged the table and was halved away: count it again.
                self.tier.note_seen(*k);
            }
            match self.tier.lookup(k) {
                Some(h) if !self.storing[h as usize] && self.load_pins[h as usize] == 0 => {
                    protect.push(h);
                }
                Some(_) => {}
                None if self.tier.seen_count(k) >= min_seen => candidates.push(i),
                None => {}
            }
        }
        let room = self.tier.num_blocks() as usize - self.held - protect.len();
        if candidates.len() > room {
            self.counters.stores_refused += candidates.len() as u64;
            return None;
        }
        // Offered keys on host stay out of the eviction lists while the candidates are placed.
        for &h in protect.iter().rev() {
            self.tier.pin(h).expect("a listed block holds a key");
        }
        let mut plan = StorePlan::default();
        let mut placed = Vec::with_capacity(candidates.len());
        for &i in candidates.iter().rev() {
            let k = keys[i];
            // Admitted above; noting a later key may have aged this count since: restore it
            // (an admission decision is not undone halfway through one call).
            while self.tier.seen_count(&k) < min_seen {
                self.tier.note_seen(k);
            }
            let out = self.tier.plan_store(0, k);
            let h = out.stored.expect("room was checked");
            if let Some(old) = out.evicted {
                plan.evicted.push(self.key_bytes(&old));
                self.originals.remove(&old);
                self.counters.evictions += 1;
            }
            if k.group == HASHED_GROUP {
                self.originals.insert(k, raw[i].into());
            }
            self.tier.pin(h).expect("a stored block holds a key");
            self.hold(h);
            self.storing[h as usize] = true;
            placed.push((k, h));
        }
        for &h in protect.iter().rev() {
            self.tier.unpin(h);
        }
        // The tier's copy plans are the manager's business; this pool's caller copies.
        let _ = self.tier.take_plans();
        placed.reverse();
        plan.keys = placed.iter().map(|&(k, _)| k).collect();
        plan.blocks = placed.iter().map(|&(_, h)| h).collect();
        self.counters.stores_prepared += plan.keys.len() as u64;
        Some(plan)
    }

    /// Ends the stores of `keys`: with `success` their blocks become readable and evictable
    /// (entered tail first), else they are dropped and their blocks freed. Errors (nothing
    /// changed): `Err(index)` of the first key without a store in flight (or repeated).
    fn complete_store(&mut self, keys: &[HostKey], success: bool) -> Result<(), usize> {
        let mut blocks = Vec::with_capacity(keys.len());
        let mut done = HashSet::with_capacity(keys.len());
        for (i, k) in keys.iter().enumerate() {
            match self.tier.lookup(k) {
                Some(h) if self.storing[h as usize] && done.insert(h) => blocks.push(h),
                _ => return Err(i),
            }
        }
        for (&h, k) in blocks.iter().zip(keys).rev() {
            self.storing[h as usize] = false;
            self.release(h);
            if !success {
                self.tier.discard(k);
                self.originals.remove(k);
            }
            self.tier.unpin(h);
        }
        let n = blocks.len() as u64;
        if success {
            self.counters.stores_completed += n;
        } else {
            self.counters.stores_failed += n;
        }
        Ok(())
    }

    /// Drops every block (stores and loads in flight included: their completions must not
    /// come). The counters are kept.
    fn reset(&mut self) {
        let tier = HostTier::new(
            self.tier.num_blocks(),
            self.tier.admission_min_seen(),
            self.tier.eviction(),
            SEEN_DEVICE_BLOCKS,
            false,
        )
        .expect("the same config was accepted");
        let n = self.storing.len();
        *self = Self {
            tier,
            originals: HashMap::new(),
            storing: vec![false; n],
            load_pins: vec![0; n],
            held: 0,
            counters: self.counters,
        };
    }

    /// The pool's invariants: `held` counts the storing or load-pinned blocks; those hold a
    /// key that maps back to them; the hashed keys kept are the hashed keys on host.
    fn check(&self) -> Result<(), String> {
        let mut held = 0;
        let mut hashed = 0;
        for h in 0..self.storing.len() {
            let key = self.tier.key_of(h as BlockId);
            if let Some(k) = key {
                if self.tier.lookup(&k) != Some(h as BlockId) {
                    return Err(format!("host block {h}: its key maps elsewhere"));
                }
                if k.group == HASHED_GROUP {
                    hashed += 1;
                    if !self.originals.contains_key(&k) {
                        return Err(format!("host block {h}: hashed key without its bytes"));
                    }
                }
            }
            if self.storing[h] || self.load_pins[h] > 0 {
                held += 1;
                if key.is_none() {
                    return Err(format!(
                        "host block {h} is storing or pinned but holds no key"
                    ));
                }
            }
        }
        if held != self.held {
            return Err(format!("{held} host blocks held, counted {}", self.held));
        }
        if hashed != self.originals.len() {
            return Err(format!(
                "{} hashed keys kept, {hashed} on host",
                self.originals.len()
            ));
        }
        Ok(())
    }
}

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

fn host_keys(items: &[Bound<'_, PyBytes>]) -> Vec<HostKey> {
    items.iter().map(|b| host_key(b.as_bytes()).0).collect()
}

/// `InvalidArgumentError` naming key `index` of `items`.
fn bad_key(py: Python<'_>, items: &[Bound<'_, PyBytes>], index: usize, reason: &str) -> PyErr {
    let value = items
        .get(index)
        .map(|b| repr(b.as_any()))
        .unwrap_or_default();
    bad(py, "hashes", value, format!("hashes[{index}]: {reason}"))
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
        self.pool.tier.num_blocks()
    }

    /// Offers a key needs before it is stored.
    #[getter]
    fn admission_min_seen(&self) -> u32 {
        self.pool.tier.admission_min_seen()
    }

    /// The eviction policy's name.
    #[getter]
    fn eviction(&self) -> &'static str {
        self.pool.tier.eviction().name()
    }

    /// Host blocks holding a key (readable or storing).
    #[getter]
    fn num_used(&self) -> usize {
        self.pool.tier.num_used()
    }

    /// Host blocks storing or pinned by loads (not evictable).
    #[getter]
    fn num_held(&self) -> usize {
        self.pool.held
    }

    /// Cumulative counters in blocks: ``stores_prepared``, ``stores_completed``,
    /// ``stores_failed``, ``stores_refused`` (candidates of a ``prepare_store`` that returned
    /// ``None``), ``loads`` (blocks pinned by ``prepare_load``) and ``evictions``.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.pool.counters;
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
        Ok(self.pool.lookup(&host_keys(&items)))
    }

    /// One key's state: 0 not on host, 1 storing (a store in flight), 2 readable. Raises
    /// ``InvalidArgumentError`` unless ``hash`` is bytes.
    fn state(&self, hash: &Bound<'_, PyAny>) -> PyResult<u8> {
        let b = crate::convert::bytes_arg(hash, "hash")?;
        Ok(self.pool.state(&host_key(b).0))
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
        let blocks = self.pool.prepare_load(&host_keys(&items)).map_err(|i| {
            bad_key(
                py,
                &items,
                i,
                "not readable on host (absent or still storing)",
            )
        })?;
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
            .complete_load(&host_keys(&items))
            .map_err(|i| bad_key(py, &items, i, "no load of this key is in flight"))
    }

    /// Marks the readable, unpinned blocks of ``hashes`` used (tail first); other keys are
    /// ignored.
    fn touch(&mut self, hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        let items = keys_arg(hashes)?;
        self.pool.touch(&host_keys(&items));
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
        let raw: Vec<&[u8]> = items.iter().map(|b| b.as_bytes()).collect();
        let keys = host_keys(&items);
        let Some(plan) = self.pool.prepare_store(&keys, &raw) else {
            return Ok(None);
        };
        let index: HashMap<HostKey, usize> =
            keys.iter().enumerate().map(|(i, k)| (*k, i)).collect();
        let to_store = PyList::empty(py);
        for k in &plan.keys {
            to_store.append(&items[index[k]])?;
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
            .complete_store(&host_keys(&items), success)
            .map_err(|i| bad_key(py, &items, i, "no store of this key is in flight"))
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
            self.pool.tier.num_blocks(),
            self.pool.tier.num_used(),
            self.pool.held,
            self.pool.tier.eviction().name()
        )
    }
}
