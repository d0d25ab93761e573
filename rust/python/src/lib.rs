//! PyO3 bindings: exposes `pagedkv-core` as the private module `pagedkv._core`.
use pyo3::prelude::*;

/// The `pagedkv._core` extension module.
#[pymodule]
fn _core(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
