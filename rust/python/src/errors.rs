//! The one mapping from core [`Error`] variants to the Python exceptions of `pagedkv.errors`.
//!
//! The exception classes live in Python (`python/pagedkv/errors.py`) so they carry attributes,
//! pickle and document themselves like any Python class. They are looked up once, when
//! `pagedkv._core` is imported ([`init`]), into typed handles: a class missing from
//! `pagedkv.errors` fails the import, not the first error. The `match` is exhaustive on
//! purpose: a new core variant fails to compile until it is mapped here.

use pagedkv_core::Error;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

/// Handles to the exception classes of `pagedkv.errors`, one per core variant plus the
/// binding-level ones.
struct Classes {
    out_of_blocks: Py<PyType>,
    out_of_swap_space: Py<PyType>,
    invalid_block: Py<PyType>,
    ref_count_underflow: Py<PyType>,
    unknown_sequence: Py<PyType>,
    sequence_exists: Py<PyType>,
    invalid_config: Py<PyType>,
    invalid_argument: Py<PyType>,
    invalid_sequence_state: Py<PyType>,
    cache_in_use: Py<PyType>,
    read_only_pool: Py<PyType>,
    invariant_violation: Py<PyType>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

/// Imports `pagedkv.errors` and binds every class the bindings raise. Called from the module
/// initialiser, so a missing or renamed class makes `import pagedkv._core` fail.
pub(crate) fn init(py: Python<'_>) -> PyResult<()> {
    let m = py.import("pagedkv.errors")?;
    let class = |name: &str| -> PyResult<Py<PyType>> {
        Ok(m.getattr(name)?.cast_into::<PyType>()?.unbind())
    };
    let classes = Classes {
        out_of_blocks: class("OutOfBlocksError")?,
        out_of_swap_space: class("OutOfSwapSpaceError")?,
        invalid_block: class("InvalidBlockError")?,
        ref_count_underflow: class("RefCountUnderflowError")?,
        unknown_sequence: class("UnknownSequenceError")?,
        sequence_exists: class("SequenceExistsError")?,
        invalid_config: class("InvalidConfigError")?,
        invalid_argument: class("InvalidArgumentError")?,
        invalid_sequence_state: class("InvalidSequenceStateError")?,
        cache_in_use: class("CacheInUseError")?,
        read_only_pool: class("ReadOnlyPoolError")?,
        invariant_violation: class("InvariantViolationError")?,
    };
    // A second initialisation (sub-interpreter, reload) keeps the first handles.
    let _ = CLASSES.set(py, classes);
    Ok(())
}

fn classes(py: Python<'_>) -> &Classes {
    CLASSES
        .get(py)
        .expect("pagedkv._core initialises its error classes at import")
}

/// The Python exception instance (not raised) for a core error: class chosen by variant,
/// message = the core's `Display`, the variant's fields as keyword attributes.
pub(crate) fn error_instance<'py>(py: Python<'py>, err: &Error) -> PyResult<Bound<'py, PyAny>> {
    let kw = PyDict::new(py);
    let c = classes(py);
    let class = match err {
        Error::OutOfBlocks {
            requested,
            available,
        } => {
            kw.set_item("requested", requested)?;
            kw.set_item("available", available)?;
            &c.out_of_blocks
        }
        Error::OutOfSwapSpace {
            requested,
            available,
        } => {
            kw.set_item("requested", requested)?;
            kw.set_item("available", available)?;
            &c.out_of_swap_space
        }
        Error::InvalidBlockId {
            block_id,
            num_blocks,
        } => {
            kw.set_item("block_id", block_id)?;
            kw.set_item("num_blocks", num_blocks)?;
            &c.invalid_block
        }
        Error::RefCountUnderflow { block_id } => {
            kw.set_item("block_id", block_id)?;
            &c.ref_count_underflow
        }
        Error::UnknownSequence { seq_id } => {
            kw.set_item("seq_id", seq_id)?;
            &c.unknown_sequence
        }
        Error::SequenceExists { seq_id } => {
            kw.set_item("seq_id", seq_id)?;
            &c.sequence_exists
        }
        Error::InvalidConfig {
            field,
            value,
            reason,
        } => {
            kw.set_item("field", field)?;
            kw.set_item("value", value)?;
            kw.set_item("reason", reason)?;
            &c.invalid_config
        }
        Error::InvalidArgument { arg, value, reason } => {
            kw.set_item("arg", arg)?;
            kw.set_item("value", value)?;
            kw.set_item("reason", reason)?;
            &c.invalid_argument
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
            &c.invalid_sequence_state
        }
        Error::CacheInUse { blocks_in_use } => {
            kw.set_item("blocks_in_use", blocks_in_use)?;
            &c.cache_in_use
        }
    };
    class.bind(py).call((err.to_string(),), Some(&kw))
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
        let value = classes(py)
            .read_only_pool
            .bind(py)
            .call((msg,), Some(&kw))?;
        Ok(PyErr::from_value(value))
    };
    build().unwrap_or_else(|e| e)
}

/// `pagedkv.errors.InvariantViolationError` (an `AssertionError`) naming the first broken
/// invariant found by a `check_invariants` call.
pub(crate) fn invariant_violation(py: Python<'_>, message: String) -> PyErr {
    match classes(py).invariant_violation.bind(py).call1((message,)) {
        Ok(value) => PyErr::from_value(value),
        Err(e) => e,
    }
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
