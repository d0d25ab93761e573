//! `pagedkv.CacheStats`: a frozen snapshot of the KV cache's usage and counters.

use pagedkv_core::CacheStats;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// A point-in-time snapshot of the KV cache (from ``KVCacheManager.stats()``).
///
/// Units: ``num_blocks``, ``used``, ``free``, ``cached_free``, ``evictions``, ``copies``,
/// ``swaps_out_blocks``, ``swaps_in_blocks``, ``num_cpu_blocks``, ``cpu_used``,
/// ``num_host_blocks``, ``host_used``, ``host_stores_blocks``, ``host_loads_blocks`` are blocks;
/// ``block_size``, ``prefix_queries_tokens``, ``prefix_hits_tokens``, ``host_hits_tokens`` are tokens;
/// ``preemptions`` counts sequences; ``usage`` and ``kv_utilization`` are fractions in [0, 1].
/// Snapshots compare equal when every field is equal.
#[pyclass(frozen, eq, module = "pagedkv._core", name = "CacheStats")]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PyCacheStats {
    pub(crate) inner: CacheStats,
}

macro_rules! getters {
    ($($(#[$doc:meta])* $name:ident: $t:ty;)*) => {
        #[pymethods]
        impl PyCacheStats {
            $(
                $(#[$doc])*
                #[getter]
                fn $name(&self) -> $t {
                    self.inner.$name
                }
            )*

            /// ``prefix_hits_tokens / prefix_queries_tokens`` (0.0 when nothing was queried).
            #[getter]
            fn prefix_hit_rate(&self) -> f64 {
                self.inner.prefix_hit_rate()
            }

            /// Every field as a ``dict`` (plus ``prefix_hit_rate``), for logging and JSON.
            fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                let d = PyDict::new(py);
                $( d.set_item(stringify!($name), self.inner.$name)?; )*
                d.set_item("prefix_hit_rate", self.inner.prefix_hit_rate())?;
                Ok(d)
            }

            fn __repr__(&self) -> String {
                let mut parts: Vec<String> = Vec::new();
                $( parts.push(format!("{}={:?}", stringify!($name), self.inner.$name)); )*
                format!("CacheStats({})", parts.join(", "))
            }
        }
    };
}

getters! {
    /// Physical GPU blocks including the null block.
    num_blocks: u32;
    /// Tokens per block.
    block_size: u32;
    /// Blocks with ref count > 0.
    used: usize;
    /// Blocks with ref count 0 (uncached + cached-evictable); never the null block.
    free: usize;
    /// Free blocks still carrying a prefix hash (evictable, reusable by a prefix hit).
    cached_free: usize;
    /// ``used / (num_blocks - 1)``.
    usage: f64;
    /// Token slots holding computed tokens / allocated slots over live sequences' distinct blocks.
    kv_utilization: f64;
    /// Prompt tokens that went through a prefix lookup (first allocations; not a resume after
    /// a recompute preemption, vLLM #25780).
    prefix_queries_tokens: u64;
    /// Of those, tokens served from the prefix cache.
    prefix_hits_tokens: u64;
    /// Cached blocks evicted to satisfy allocations.
    evictions: u64;
    /// Copy-on-write block copies planned.
    copies: u64;
    /// Distinct GPU blocks planned out to CPU by swap-out.
    swaps_out_blocks: u64;
    /// Distinct CPU blocks planned back to GPU by swap-in.
    swaps_in_blocks: u64;
    /// Sequences preempted (recompute or swap).
    preemptions: u64;
    /// CPU (swap space) blocks.
    num_cpu_blocks: u32;
    /// CPU blocks holding swapped-out KV.
    cpu_used: usize;
    /// Host-tier blocks of the prefix cache (0: no host tier).
    num_host_blocks: u32;
    /// Host-tier blocks holding a cached block or pinned by a load.
    host_used: usize;
    /// Of ``prefix_hits_tokens``, tokens served from the host tier (loaded, not recomputed),
    /// counted at a sequence's first lookup only, as ``prefix_hits_tokens`` is.
    host_hits_tokens: u64;
    /// Device -> host copies planned (stores of evicted cached blocks).
    host_stores_blocks: u64;
    /// Host -> device copies planned (loads of host-tier prefix hits), every one, including a
    /// resume's after a recompute preemption (so ``host_loads_blocks * block_size`` may
    /// exceed ``host_hits_tokens``).
    host_loads_blocks: u64;
}
