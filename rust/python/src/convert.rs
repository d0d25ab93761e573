//! Argument conversion: Python ints, sequences of ints and 1-D numpy integer arrays into the
//! core's integer types, with typed errors (`InvalidArgumentError`) that name the argument and
//! the offending value. numpy arrays of any integer dtype are read without a per-element Python
//! object; lists are read item by item.

use crate::errors::{bad_arg, to_pyerr};
use numpy::{PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyInt, PyList, PyString, PyTuple};

fn err(
    py: Python<'_>,
    arg: &'static str,
    value: impl Into<String>,
    reason: impl Into<String>,
) -> PyErr {
    to_pyerr(py, &bad_arg(arg, value, reason))
}

fn short_repr(obj: &Bound<'_, PyAny>) -> String {
    obj.repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unprintable>".into())
}

/// One Python int in `0..=max` (bools and non-ints rejected).
pub(crate) fn uint_arg(obj: &Bound<'_, PyAny>, arg: &'static str, max: u64) -> PyResult<u64> {
    let py = obj.py();
    if obj.is_instance_of::<PyBool>() {
        return Err(err(py, arg, short_repr(obj), "expected an int, got a bool"));
    }
    match obj.extract::<u64>() {
        Ok(v) if v <= max => Ok(v),
        Ok(v) => Err(err(py, arg, v.to_string(), format!("must be <= {max}"))),
        Err(_) => match obj.extract::<i64>() {
            Ok(v) if v < 0 => Err(err(py, arg, v.to_string(), "must be >= 0")),
            _ if obj.is_instance_of::<PyInt>() || obj.hasattr("__index__").unwrap_or(false) => Err(
                err(py, arg, short_repr(obj), format!("out of range 0..={max}")),
            ),
            _ => Err(err(
                py,
                arg,
                short_repr(obj),
                format!("expected an int, got {}", type_name(obj)),
            )),
        },
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Reads a 1-D numpy array of integer dtype `T` into `Vec<u64>` checking `0..=max`.
fn read_array<T>(
    arr: &Bound<'_, PyArray1<T>>,
    arg: &'static str,
    max: u64,
    out: &mut Vec<u64>,
) -> PyResult<()>
where
    T: numpy::Element + Copy + TryInto<u64> + std::fmt::Display,
{
    let py = arr.py();
    let ro = arr.readonly();
    let view = ro.as_array();
    out.reserve(view.len());
    for (i, &x) in view.iter().enumerate() {
        match x.try_into() {
            Ok(v) if v <= max => out.push(v),
            _ => {
                return Err(err(
                    py,
                    arg,
                    format!("{x} at index {i}"),
                    format!("values must be in 0..={max}"),
                ))
            }
        }
    }
    Ok(())
}

/// A 1-D integer numpy array or a sequence of ints, every value in `0..=max`.
pub(crate) fn uint_vec(obj: &Bound<'_, PyAny>, arg: &'static str, max: u64) -> PyResult<Vec<u64>> {
    let py = obj.py();
    let mut out = Vec::new();
    if let Ok(arr) = obj.downcast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Err(err(
                py,
                arg,
                format!("array of shape {:?}", arr.shape()),
                "expected a 1-D array",
            ));
        }
        let kind = arr.dtype().kind();
        if kind != b'i' && kind != b'u' {
            return Err(err(
                py,
                arg,
                format!("array of dtype {}", arr.dtype()),
                "expected an integer dtype",
            ));
        }
        macro_rules! try_dtype {
            ($($t:ty),*) => {$(
                if let Ok(a) = obj.downcast::<PyArray1<$t>>() {
                    read_array(a, arg, max, &mut out)?;
                    return Ok(out);
                }
            )*};
        }
        try_dtype!(i64, i32, u32, u64, i16, u16, i8, u8);
        return Err(err(
            py,
            arg,
            format!("array of dtype {}", arr.dtype()),
            "unsupported integer dtype",
        ));
    }
    // Fast path for the common list / tuple of Python ints (no iterator protocol, no type probes).
    if let Ok(list) = obj.downcast::<PyList>() {
        out.reserve(list.len());
        for (i, item) in list.iter().enumerate() {
            out.push(seq_item(&item, arg, max, i)?);
        }
        return Ok(out);
    }
    if let Ok(tuple) = obj.downcast::<PyTuple>() {
        out.reserve(tuple.len());
        for (i, item) in tuple.iter().enumerate() {
            out.push(seq_item(&item, arg, max, i)?);
        }
        return Ok(out);
    }
    if obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
        || obj.is_instance_of::<PyInt>()
    {
        return Err(err(
            py,
            arg,
            short_repr(obj),
            format!(
                "expected a sequence of ints or a 1-D integer array, got {}",
                type_name(obj)
            ),
        ));
    }
    let iter = obj.try_iter().map_err(|_| {
        err(
            py,
            arg,
            short_repr(obj),
            format!(
                "expected a sequence of ints or a 1-D integer array, got {}",
                type_name(obj)
            ),
        )
    })?;
    if let Ok(n) = obj.len() {
        out.reserve(n);
    }
    for (i, item) in iter.enumerate() {
        out.push(seq_item(&item?, arg, max, i)?);
    }
    Ok(out)
}

/// Item `i` of a sequence argument, with an error naming its index.
fn seq_item(item: &Bound<'_, PyAny>, arg: &'static str, max: u64, i: usize) -> PyResult<u64> {
    uint_arg(item, arg, max).map_err(|_| {
        let what = if item.is_instance_of::<PyInt>() && !item.is_instance_of::<PyBool>() {
            format!("values must be in 0..={max}")
        } else {
            format!("expected ints, got {}", type_name(item))
        };
        err(
            item.py(),
            arg,
            format!("{} at index {i}", short_repr(item)),
            what,
        )
    })
}

/// Token ids (`0..=u32::MAX`) from an array or a sequence.
pub(crate) fn token_ids(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<Vec<u32>> {
    Ok(uint_vec(obj, arg, u64::from(u32::MAX))?
        .into_iter()
        .map(|v| v as u32)
        .collect())
}

/// Block ids (`0..=u32::MAX`; the core rejects 0 and out-of-pool ids with `InvalidBlockError`).
pub(crate) fn block_ids(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<Vec<u32>> {
    token_ids(obj, arg)
}

/// Sequence ids (`0..=u64::MAX`).
pub(crate) fn seq_ids(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<Vec<u64>> {
    uint_vec(obj, arg, u64::MAX)
}

/// One sequence id.
pub(crate) fn seq_id(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<u64> {
    uint_arg(obj, arg, u64::MAX)
}

/// A non-negative count (tokens or blocks) as `usize`.
pub(crate) fn count(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<usize> {
    Ok(uint_arg(obj, arg, usize::MAX as u64)? as usize)
}
