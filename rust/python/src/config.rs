//! `pagedkv.CacheConfig`: the frozen, validated configuration of a KV cache manager.

use crate::convert::uint;
use crate::errors::to_pyerr;
use pagedkv_core::manager::MAX_BLOCK_SIZE;
use pagedkv_core::pool::MAX_BLOCKS;
use pagedkv_core::{CacheConfig, Error, HashAlgo};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// Configuration of a KV cache manager (frozen; validated on construction).
#[pyclass(frozen, eq, module = "pagedkv._core", name = "CacheConfig")]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PyCacheConfig {
    pub(crate) inner: CacheConfig,
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

#[pymethods]
impl PyCacheConfig {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, *, enable_prefix_caching = true, hash_algo = "sha256",
                        hash_seed = None, num_cpu_blocks = None, enable_events = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        enable_prefix_caching: bool,
        hash_algo: &str,
        hash_seed: Option<&[u8]>,
        num_cpu_blocks: Option<&Bound<'_, PyAny>>,
        enable_events: bool,
    ) -> PyResult<Self> {
        let mut cfg = CacheConfig::new(
            u32_field(num_blocks, "num_blocks", (2, MAX_BLOCKS), "blocks")?,
            u32_field(block_size, "block_size", (1, MAX_BLOCK_SIZE), "tokens")?,
        );
        cfg.enable_prefix_caching = enable_prefix_caching;
        cfg.hash_algo = HashAlgo::from_name(hash_algo).ok_or_else(|| {
            config_error(
                py,
                "hash_algo",
                format!("{hash_algo:?}"),
                "expected \"sha256\" or \"xxh3_128\"".into(),
            )
        })?;
        cfg.hash_seed = hash_seed.unwrap_or_default().to_vec();
        cfg.num_cpu_blocks = match num_cpu_blocks {
            Some(n) => u32_field(n, "num_cpu_blocks", (0, u32::MAX), "blocks")?,
            None => 0,
        };
        cfg.enable_events = enable_events;
        if cfg.num_blocks > MAX_BLOCKS {
            return Err(config_error(
                py,
                "num_blocks",
                cfg.num_blocks.to_string(),
                format!("at most {MAX_BLOCKS} blocks"),
            ));
        }
        cfg.validate().map_err(|e| to_pyerr(py, &e))?;
        Ok(Self { inner: cfg })
    }

    /// Physical GPU blocks including the null block 0 (``num_blocks - 1`` usable).
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.num_blocks
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.block_size
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

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "CacheConfig(num_blocks={}, block_size={}, enable_prefix_caching={}, hash_algo={:?}, \
             hash_seed=<{} bytes>, num_cpu_blocks={}, enable_events={})",
            c.num_blocks,
            c.block_size,
            if c.enable_prefix_caching {
                "True"
            } else {
                "False"
            },
            c.hash_algo.name(),
            c.hash_seed.len(),
            c.num_cpu_blocks,
            if c.enable_events { "True" } else { "False" },
        )
    }
}
