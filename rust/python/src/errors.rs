//! The one mapping from core [`Error`] variants to the Python exceptions of `pagedkv.errors`.
//!
//! The exception classes live in Python (`python/pagedkv/errors.py`) so they carry attributes,
//! pickle and document themselves like any Python class; this module only picks the class and
//! its keyword fields. The `match` is exhaustive on purpose: a new core variant fails to compile
//! until it is mapped here.

use pagedkv_core::Error;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyModule};

static ERRORS_MODULE: GILOnceCell<Py<PyModule>> = GILOnceCell::new();

fn errors_module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    ERRORS_MODULE
        .get_or_try_init(py, || Ok(PyModule::import(py, "pagedkv.errors")?.unbind()))
        .map(|m| m.bind(py))
}

/// The Python exception instance (not raised) for a core error: class chosen by variant,
/// message = the core's `Display`, the variant's fields as keyword attributes.
pub(crate) fn error_instance<'py>(py: Python<'py>, err: &Error) -> PyResult<Bound<'py, PyAny>> {
    let kw = PyDict::new(py);
    let class = match err {
        Error::OutOfBlocks {
            requested,
            available,
        } => {
            kw.set_item("requested", requested)?;
            kw.set_item("available", available)?;
            "OutOfBlocksError"
        }
        Error::OutOfSwapSpace {
            requested,
            available,
        } => {
            kw.set_item("requested", requested)?;
            kw.set_item("available", available)?;
            "OutOfSwapSpaceError"
        }
        Error::InvalidBlockId {
            block_id,
            num_blocks,
        } => {
            kw.set_item("block_id", block_id)?;
            kw.set_item("num_blocks", num_blocks)?;
            "InvalidBlockError"
        }
        Error::RefCountUnderflow { block_id } => {
            kw.set_item("block_id", block_id)?;
            "RefCountUnderflowError"
        }
        Error::UnknownSequence { seq_id } => {
            kw.set_item("seq_id", seq_id)?;
            "UnknownSequenceError"
        }
        Error::SequenceExists { seq_id } => {
            kw.set_item("seq_id", seq_id)?;
            "SequenceExistsError"
        }
        Error::InvalidConfig {
            field,
            value,
            reason,
        } => {
            kw.set_item("field", field)?;
            kw.set_item("value", value)?;
            kw.set_item("reason", reason)?;
            "InvalidConfigError"
        }
        Error::InvalidArgument { arg, value, reason } => {
            kw.set_item("arg", arg)?;
            kw.set_item("value", value)?;
            kw.set_item("reason", reason)?;
            "InvalidArgumentError"
        }
        Error::InvalidSequenceState {
            seq_id,
            state,
            operation,
            expected,
        } => {
            kw.set_item("seq_id", seq_id)?;
            kw.set_item("state", state)?;
            kw.set_item("operation", operation)?;
            kw.set_item("expected", expected)?;
            "InvalidSequenceStateError"
        }
        Error::CacheInUse { blocks_in_use } => {
            kw.set_item("blocks_in_use", blocks_in_use)?;
            "CacheInUseError"
        }
    };
    errors_module(py)?
        .getattr(class)?
        .call((err.to_string(),), Some(&kw))
}

/// `pagedkv.errors.ReadOnlyPoolError` for a mutating `BlockPool.{operation}` call on a
/// manager's pool view (a binding-level rule, so it has no core variant).
pub(crate) fn read_only_pool(py: Python<'_>, operation: &str) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let kw = PyDict::new(py);
        kw.set_item("operation", operation)?;
        let msg = format!(
            "BlockPool.{operation}: this pool belongs to a KVCacheManager and is a read-only \
             view; use the manager's methods (allocate_slots, free, ...)"
        );
        let value = errors_module(py)?
            .getattr("ReadOnlyPoolError")?
            .call((msg,), Some(&kw))?;
        Ok(PyErr::from_value(value))
    };
    build().unwrap_or_else(|e| e)
}

/// The core error as a raisable `PyErr`.
pub(crate) fn to_pyerr(py: Python<'_>, err: &Error) -> PyErr {
    match error_instance(py, err) {
        Ok(value) => PyErr::from_value(value),
        Err(e) => e,
    }
}

/// Converts a core `Result` into a `PyResult` through [`to_pyerr`].
pub(crate) trait IntoPyResult<T> {
    fn py(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for pagedkv_core::Result<T> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_pyerr(py, &e))
    }
}

/// A binding-level bad argument (wrong dtype, shape, negative id...) as the core's
/// `InvalidArgument`, so it maps to `InvalidArgumentError` like every other bad argument.
pub(crate) fn bad_arg(
    arg: &'static str,
    value: impl Into<String>,
    reason: impl Into<String>,
) -> Error {
    let mut value = value.into();
    if value.len() > 120 {
        let mut cut = 117;
        while !value.is_char_boundary(cut) {
            cut -= 1;
        }
        value.truncate(cut);
        value.push_str("...");
    }
    Error::InvalidArgument {
        arg,
        value,
        reason: reason.into(),
    }
}
