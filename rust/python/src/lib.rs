//! PyO3 bindings: exposes `pagedkv-core` as the private module `pagedkv._core`.
//!
//! A thin layer: frozen pyclasses over an `Arc` of the core objects, the GIL released around
//! every call that takes a lock or does real work, numpy `int32` / `int64` arrays for block ids,
//! plans and kernel inputs (no per-block Python objects), and one exhaustive mapping from core
//! errors to the exceptions of `pagedkv.errors` ([`errors`]). The public API is re-exported,
//! documented and typed by the Python package `pagedkv` (`python/pagedkv/_core.pyi`).

mod block_table;
mod config;
mod convert;
mod errors;
mod events;
mod groups;
mod host_pool;
mod indexer;
mod manager;
mod pool;
mod stats;
mod step_output;

use pyo3::prelude::*;

/// The `pagedkv._core` extension module.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::init(m.py())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("NULL_BLOCK", pagedkv_core::NULL_BLOCK)?;
    m.add("MAX_BLOCK_SIZE", pagedkv_core::kv_groups::MAX_BLOCK_SIZE)?;
    m.add(
        "MAX_UNCACHED_BLOCK_SIZE",
        pagedkv_core::kv_groups::MAX_UNCACHED_BLOCK_SIZE,
    )?;
    m.add("MAX_BLOCKS", pagedkv_core::pool::MAX_BLOCKS)?;
    // The host tier's eviction policy names, so callers (the engine's CLI) keep no second list.
    let evictions = pagedkv_core::host_tier::HostEviction::ALL.map(|e| e.name());
    m.add(
        "HOST_EVICTIONS",
        pyo3::types::PyTuple::new(m.py(), evictions)?,
    )?;
    m.add_class::<config::PyCacheConfig>()?;
    m.add_class::<manager::PyKvCacheManager>()?;
    m.add_class::<step_output::PySlotAllocation>()?;
    m.add_class::<step_output::PyStepOutput>()?;
    m.add_class::<pool::PyBlockPool>()?;
    m.add_class::<host_pool::PyHostBlockPool>()?;
    m.add_class::<stats::PyCacheStats>()?;
    m.add_class::<events::PyBlockStored>()?;
    m.add_class::<events::PyBlockRemoved>()?;
    m.add_class::<events::PyAllBlocksCleared>()?;
    m.add_class::<indexer::PyKvIndexer>()?;
    m.add_class::<block_table::PyBlockTable>()?;
    m.add_class::<groups::PyGroupSpec>()?;
    Ok(())
}
