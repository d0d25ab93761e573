//! `pagedkv.CacheConfig`: the frozen, validated configuration of a KV cache manager: one
//! full-attention group of `block_size` tokens, or several KV cache groups
//! (`KVCacheGroupSpec`) in one pool. It holds the core's groups configuration either way.

use crate::convert::{repr, type_name, uint};
use crate::errors::to_pyerr;
use crate::groups::{config_uint, PyGroupSpec};
use pagedkv_core::host_tier::{HostEviction, MAX_HOST_BLOCKS};
use pagedkv_core::kv_groups::{MAX_BLOCK_SIZE, MAX_HASH_LOOKAHEAD_TOKENS};
use pagedkv_core::pool::MAX_BLOCKS;
use pagedkv_core::{CacheConfig, Error, GroupSpec, HashAlgo};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyList, PyString, PyTuple};

/// Configuration of a KV cache manager (frozen; validated on construction; ``==`` compares
/// every field).
///
/// Two forms:
///
/// - ``CacheConfig(num_blocks, block_size)``: one full-attention KV cache group of
///   ``block_size`` tokens per block (``groups`` is then that one group, ``layer_groups``
///   ``[]``).
/// - ``CacheConfig(num_blocks, groups=[KVCacheGroupSpec, ...], layer_groups=[...])``: several
///   KV cache groups (full attention, sliding window, chunked local) of a hybrid model in one
///   pool of equal-size pages; ``layer_groups[i]`` is the group index of model layer ``i``.
///   ``block_size`` may be omitted (it is then group 0's) or must equal every group's.
///
/// Args:
///     num_blocks: pages (blocks) in the pool including the null block 0 (``num_blocks - 1``
///         usable), ``2..=MAX_BLOCKS``.
///     block_size: tokens per block, ``1..=MAX_BLOCK_SIZE``.
///     groups, layer_groups: the KV cache groups (list or tuple, at least one) and each
///         model layer's group index.
///     retention_interval: tokens, 0 (default: cache every full block) or a multiple of the
///         hit unit (the LCM of the groups' block sizes): a windowed group then keeps cached
///         only the blocks a hit at a multiple of it needs (docs/design.md, "KV cache groups").
///     enable_prefix_caching, hash_algo (``"sha256"`` or ``"xxh3_128"``), hash_seed (bytes),
///     num_cpu_blocks (swap blocks), enable_events, num_host_blocks, host_admission_min_seen,
///     host_eviction, hash_lookahead_tokens: see the properties.
///
/// Raises ``InvalidConfigError`` naming the field (nothing built): a value of the wrong type
/// or out of range, ``block_size`` missing without ``groups``, ``layer_groups`` without
/// ``groups`` (or missing with them), a ``block_size`` that differs from a group's, page
/// sizes that differ between groups, a layer mapped to no group, a group without layers, a
/// retention interval that is not a multiple of the hit unit, a host tier without prefix
/// caching, ``hash_lookahead_tokens`` above 64 or with prefix caching off, events, a host
/// tier or a state group, and (field ``spare_blocks``) state groups whose ``spare_blocks``
/// (speculative state blocks) differ, are above 16, or are set with state groups of
/// different block sizes or with swap space.
#[pyclass(frozen, eq, module = "pagedkv._core", name = "CacheConfig")]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PyCacheConfig {
    /// The core's configuration (the one-group form: one full group, `layer_groups == [0]`).
    pub(crate) inner: CacheConfig,
    /// Built in the one-group form (`groups=None`).
    one_group: bool,
    /// `block_size` as given, or group 0's.
    block_size: u32,
}

fn config_error(py: Python<'_>, field: &'static str, value: String, reason: String) -> PyErr {
    to_pyerr(
        py,
        &Error::InvalidConfig {
            field,
            value,
            reason,
        },
    )
}

/// A non-negative int that fits `u32`; anything else (negative, too large, not an int) is an
/// `InvalidConfigError` naming `field` and quoting its real range `lo..=hi` (in `unit`), not
/// the `u32` range. In-range `u32` values are left to the core's validation, which reports
/// them with its own reason.
fn u32_field(
    obj: &Bound<'_, PyAny>,
    field: &'static str,
    (lo, hi): (u32, u32),
    unit: &str,
) -> PyResult<u32> {
    uint(obj, field, u64::from(u32::MAX))
        .map(|v| v as u32)
        .map_err(|_| {
            let value = obj.repr().map(|r| r.to_string()).unwrap_or_default();
            config_error(
                obj.py(),
                field,
                value,
                format!("expected an int in {lo}..={hi} {unit}"),
            )
        })
}

/// A field of one Python type (`bool`, `str`, `bytes`), else `InvalidConfigError` naming it.
fn typed_field<'a, 'py, T: pyo3::PyTypeCheck>(
    obj: &'a Bound<'py, PyAny>,
    field: &'static str,
    what: &str,
) -> PyResult<&'a Bound<'py, T>> {
    obj.cast::<T>().map_err(|_| {
        let reason = format!("expected {what}, got {}", type_name(obj));
        config_error(obj.py(), field, repr(obj), reason)
    })
}

/// The host-tier keywords (`num_host_blocks`, `host_admission_min_seen`,
/// `host_eviction`), each None or absent for its default (0, 2, ``"lru"``). Errors:
/// `InvalidConfigError` naming the field for a wrong type, a value out of range or an unknown
/// policy; the ranges against the rest of the configuration are checked by the core.
pub(crate) fn host_tier_fields(
    num_host_blocks: Option<&Bound<'_, PyAny>>,
    host_admission_min_seen: Option<&Bound<'_, PyAny>>,
    host_eviction: Option<&Bound<'_, PyAny>>,
) -> PyResult<(u32, u32, HostEviction)> {
    let mut fields = (0, 2, HostEviction::Lru);
    if let Some(n) = num_host_blocks.filter(|n| !n.is_none()) {
        fields.0 = u32_field(n, "num_host_blocks", (0, MAX_HOST_BLOCKS), "blocks")?;
    }
    if let Some(n) = host_admission_min_seen {
        fields.1 = u32_field(n, "host_admission_min_seen", (1, u32::MAX), "uses")?;
    }
    if let Some(o) = host_eviction {
        let name = typed_field::<PyString>(o, "host_eviction", "a str")?.to_str()?;
        fields.2 = HostEviction::from_name(name).ok_or_else(|| {
            config_error(
                o.py(),
                "host_eviction",
                format!("{name:?}"),
                format!(
                    "expected one of {}",
                    HostEviction::ALL
                        .map(|e| format!("{:?}", e.name()))
                        .join(", ")
                ),
            )
        })?;
    }
    Ok(fields)
}

/// `groups` as a list of specs, else `InvalidConfigError` naming it.
fn read_groups(obj: &Bound<'_, PyAny>) -> PyResult<Vec<GroupSpec>> {
    let items: Vec<Bound<'_, PyAny>> = if let Ok(l) = obj.cast::<PyList>() {
        l.iter().collect()
    } else if let Ok(t) = obj.cast::<PyTuple>() {
        t.iter().collect()
    } else {
        let reason = format!(
            "expected a list of KVCacheGroupSpec, got {}",
            type_name(obj)
        );
        return Err(config_error(obj.py(), "groups", repr(obj), reason));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, g)| {
            g.cast::<PyGroupSpec>().map(|s| s.get().inner).map_err(|_| {
                let reason = format!(
                    "expected KVCacheGroupSpec items, got {} at index {i}",
                    type_name(g)
                );
                config_error(obj.py(), "groups", repr(g), reason)
            })
        })
        .collect()
}

/// `layer_groups` as group indices, else `InvalidConfigError` naming it.
fn read_layer_groups(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let items: Vec<Bound<'_, PyAny>> = if let Ok(l) = obj.cast::<PyList>() {
        l.iter().collect()
    } else if let Ok(t) = obj.cast::<PyTuple>() {
        t.iter().collect()
    } else {
        let reason = format!("expected a list of ints, got {}", type_name(obj));
        return Err(config_error(obj.py(), "layer_groups", repr(obj), reason));
    };
    items
        .iter()
        .map(|l| config_uint(l, "layer_groups", u64::from(u32::MAX)).map(|v| v as u32))
        .collect()
}

#[pymethods]
impl PyCacheConfig {
    #[new]
    // The typed fields are read by hand (so a wrong type is an InvalidConfigError naming the
    // field); the text signature shows their real defaults.
    #[pyo3(signature = (num_blocks, block_size = None, *, groups = None, layer_groups = None,
                        retention_interval = None, enable_prefix_caching = None, hash_algo = None,
                        hash_seed = None, num_cpu_blocks = None, enable_events = None,
                        num_host_blocks = None, host_admission_min_seen = None, host_eviction = None,
                        hash_lookahead_tokens = None),
           text_signature = "(num_blocks, block_size=None, *, groups=None, layer_groups=None, retention_interval=0, enable_prefix_caching=True, hash_algo='sha256', hash_seed=None, num_cpu_blocks=None, enable_events=False, num_host_blocks=0, host_admission_min_seen=2, host_eviction='lru', hash_lookahead_tokens=0)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: &Bound<'_, PyAny>,
        block_size: Option<&Bound<'_, PyAny>>,
        groups: Option<&Bound<'_, PyAny>>,
        layer_groups: Option<&Bound<'_, PyAny>>,
        retention_interval: Option<&Bound<'_, PyAny>>,
        enable_prefix_caching: Option<&Bound<'_, PyAny>>,
        hash_algo: Option<&Bound<'_, PyAny>>,
        hash_seed: Option<&Bound<'_, PyAny>>,
        num_cpu_blocks: Option<&Bound<'_, PyAny>>,
        enable_events: Option<&Bound<'_, PyAny>>,
        num_host_blocks: Option<&Bound<'_, PyAny>>,
        host_admission_min_seen: Option<&Bound<'_, PyAny>>,
        host_eviction: Option<&Bound<'_, PyAny>>,
        hash_lookahead_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let flag = |obj: Option<&Bound<'_, PyAny>>, field, default| match obj {
            // pyo3's bool extraction also takes numpy.bool_.
            Some(o) => o
                .extract::<bool>()
                .or_else(|_| typed_field::<PyBool>(o, field, "a bool").map(|b| b.is_true())),
            None => Ok::<bool, PyErr>(default),
        };
        let enable_prefix_caching = flag(enable_prefix_caching, "enable_prefix_caching", true)?;
        let enable_events = flag(enable_events, "enable_events", false)?;
        let hash_algo = match hash_algo {
            Some(o) => typed_field::<PyString>(o, "hash_algo", "a str")?
                .to_str()?
                .to_owned(),
            None => "sha256".to_owned(),
        };
        let hash_algo = hash_algo.as_str();
        let hash_seed = match hash_seed.filter(|s| !s.is_none()) {
            Some(seed) => typed_field::<PyBytes>(seed, "hash_seed", "bytes")?
                .as_bytes()
                .to_vec(),
            None => Vec::new(),
        };
        let num_blocks = u32_field(num_blocks, "num_blocks", (2, MAX_BLOCKS), "blocks")?;
        let block_size = match block_size.filter(|b| !b.is_none()) {
            Some(b) => Some(u32_field(b, "block_size", (1, MAX_BLOCK_SIZE), "tokens")?),
            None => None,
        };
        let groups = groups.filter(|g| !g.is_none());
        let layer_groups = layer_groups.filter(|l| !l.is_none());
        let one_group = groups.is_none();
        let (specs, layers, block_size) = match (groups, layer_groups) {
            (None, Some(l)) => {
                let reason = "layer_groups needs groups (without groups the config has one \
                              full-attention group)";
                return Err(config_error(py, "layer_groups", repr(l), reason.into()));
            }
            (None, None) => {
                let Some(bs) = block_size else {
                    let reason = "block_size is required without groups".into();
                    return Err(config_error(py, "block_size", "None".into(), reason));
                };
                if bs == 0 || bs > MAX_BLOCK_SIZE {
                    let reason = format!("must be in 1..={MAX_BLOCK_SIZE} tokens");
                    return Err(config_error(py, "block_size", bs.to_string(), reason));
                }
                (vec![GroupSpec::full(bs, 1)], vec![0], bs)
            }
            (Some(g), l) => {
                let specs = read_groups(g)?;
                let Some(l) = l else {
                    let reason = "groups needs layer_groups (each model layer's group)".into();
                    return Err(config_error(py, "layer_groups", "None".into(), reason));
                };
                let layers = read_layer_groups(l)?;
                let first = specs.first().map_or(0, |s| s.block_size);
                let bs = match block_size {
                    Some(bs) => {
                        if let Some((i, s)) =
                            specs.iter().enumerate().find(|(_, s)| s.block_size != bs)
                        {
                            let reason = format!(
                                "must equal every group's block size (group {i}: {})",
                                s.block_size
                            );
                            return Err(config_error(py, "block_size", bs.to_string(), reason));
                        }
                        bs
                    }
                    None => first,
                };
                (specs, layers, bs)
            }
        };
        let mut cfg = CacheConfig::with_groups(num_blocks, specs, layers);
        cfg.enable_prefix_caching = enable_prefix_caching;
        if let Some(r) = retention_interval.filter(|r| !r.is_none()) {
            cfg.retention_interval =
                config_uint(r, "retention_interval", u64::from(u32::MAX))? as u32;
        }
        cfg.hash_algo = HashAlgo::from_name(hash_algo).ok_or_else(|| {
            config_error(
                py,
                "hash_algo",
                format!("{hash_algo:?}"),
                "expected \"sha256\" or \"xxh3_128\"".into(),
            )
        })?;
        cfg.hash_seed = hash_seed;
        cfg.num_cpu_blocks = match num_cpu_blocks.filter(|n| !n.is_none()) {
            Some(n) => u32_field(n, "num_cpu_blocks", (0, u32::MAX), "blocks")?,
            None => 0,
        };
        cfg.enable_events = enable_events;
        (
            cfg.num_host_blocks,
            cfg.host_admission_min_seen,
            cfg.host_eviction,
        ) = host_tier_fields(num_host_blocks, host_admission_min_seen, host_eviction)?;
        if let Some(k) = hash_lookahead_tokens.filter(|k| !k.is_none()) {
            cfg.hash_lookahead_tokens = u32_field(
                k,
                "hash_lookahead_tokens",
                (0, MAX_HASH_LOOKAHEAD_TOKENS),
                "tokens",
            )?;
        }
        if cfg.num_blocks > MAX_BLOCKS {
            return Err(config_error(
                py,
                "num_blocks",
                cfg.num_blocks.to_string(),
                format!("at most {MAX_BLOCKS} blocks"),
            ));
        }
        cfg.validate().map_err(|e| to_pyerr(py, &e))?;
        Ok(Self {
            inner: cfg,
            one_group,
            block_size,
        })
    }

    /// The KV cache groups, in group order (the one-group form: the one full-attention group
    /// of ``block_size`` it implies, ``bytes_per_token`` 1).
    #[getter]
    fn groups(&self) -> Vec<PyGroupSpec> {
        self.inner
            .groups
            .iter()
            .map(|&inner| PyGroupSpec { inner })
            .collect()
    }

    /// Per model layer, the index of its group (``[]`` for the one-group form).
    #[getter]
    fn layer_groups(&self) -> Vec<u32> {
        if self.one_group {
            Vec::new()
        } else {
            self.inner.layer_groups.clone()
        }
    }

    /// ``G``: KV cache groups (1 for the one-group form).
    #[getter]
    fn num_groups(&self) -> usize {
        self.inner.groups.len()
    }

    /// Tokens; 0 caches every full block of a windowed group (see the class docs).
    #[getter]
    fn retention_interval(&self) -> u32 {
        self.inner.retention_interval
    }

    /// Physical GPU blocks including the null block 0 (``num_blocks - 1`` usable).
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.num_blocks
    }

    /// Tokens per block (with ``groups``: as given, or group 0's).
    #[getter]
    fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Whether full blocks are hashed and reused across sequences.
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.enable_prefix_caching
    }

    /// ``"sha256"`` (default) or ``"xxh3_128"``.
    #[getter]
    fn hash_algo(&self) -> &'static str {
        self.inner.hash_algo.name()
    }

    /// Chain seed of the prefix hashes.
    #[getter]
    fn hash_seed<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.hash_seed)
    }

    /// CPU swap-space blocks (0: swapping disabled).
    #[getter]
    fn num_cpu_blocks(&self) -> u32 {
        self.inner.num_cpu_blocks
    }

    /// Whether KV events are buffered for ``take_events``.
    #[getter]
    fn enable_events(&self) -> bool {
        self.inner.enable_events
    }

    /// Host-memory blocks of the prefix cache's second tier (0: no host tier).
    #[getter]
    fn num_host_blocks(&self) -> u32 {
        self.inner.num_host_blocks
    }

    /// Uses (computed registrations and prefix hits) a block hash needs before an eviction
    /// stores it to the host tier (1: every evicted cached block).
    #[getter]
    fn host_admission_min_seen(&self) -> u32 {
        self.inner.host_admission_min_seen
    }

    /// The host tier's eviction policy: ``"lru"`` or ``"arc"`` (docs/design.md, "Host tier").
    #[getter]
    fn host_eviction(&self) -> &'static str {
        self.inner.host_eviction.name()
    }

    /// Successor-aware hashing: tokens after each block that its prefix-cache key also covers
    /// (0: a block's own tokens only). A block is cached once those tokens are known; a hit of
    /// ``p`` tokens needs ``p + hash_lookahead_tokens`` known tokens (docs/design/
    /// speculative-decoding.md, "Lookahead block hashes").
    #[getter]
    fn hash_lookahead_tokens(&self) -> u32 {
        self.inner.hash_lookahead_tokens
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "CacheConfig(num_blocks={}, block_size={}, enable_prefix_caching={}, hash_algo={:?}, \
             hash_seed=<{} bytes>, num_cpu_blocks={}, enable_events={}{}{}{})",
            c.num_blocks,
            self.block_size,
            if c.enable_prefix_caching {
                "True"
            } else {
                "False"
            },
            c.hash_algo.name(),
            c.hash_seed.len(),
            c.num_cpu_blocks,
            if c.enable_events { "True" } else { "False" },
            // The host tier's fields only when there is one (the one-tier repr is unchanged).
            if c.num_host_blocks == 0 {
                String::new()
            } else {
                format!(
                    ", num_host_blocks={}, host_admission_min_seen={}, host_eviction={:?}",
                    c.num_host_blocks,
                    c.host_admission_min_seen,
                    c.host_eviction.name()
                )
            },
            // Only when set (the default repr is unchanged).
            if c.hash_lookahead_tokens == 0 {
                String::new()
            } else {
                format!(", hash_lookahead_tokens={}", c.hash_lookahead_tokens)
            },
            // The groups only for the groups form (the one-group repr is unchanged).
            if self.one_group {
                String::new()
            } else {
                format!(
                    ", num_groups={}, layer_groups=<{} layers>, retention_interval={}",
                    c.groups.len(),
                    c.layer_groups.len(),
                    c.retention_interval
                )
            },
        )
    }
}
