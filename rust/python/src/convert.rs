//! Argument reading: one Python int, or one array-like of ints (a 1-D numpy integer array, or
//! a list / tuple of ints), into the core's integer types. Anything else is an
//! `InvalidArgumentError` naming the argument and the offending value; nothing else is coerced
//! (no generic iterables, no strings or bytes read as sequences).

use crate::errors::{bad_arg, to_pyerr};
use numpy::{PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString, PyTuple};

/// `InvalidArgumentError` for argument `arg`.
pub(crate) fn bad(
    py: Python<'_>,
    arg: &'static str,
    value: impl Into<String>,
    reason: impl Into<String>,
) -> PyErr {
    to_pyerr(py, &bad_arg(arg, value, reason))
}

/// A keyword flag: a Python bool or numpy.bool_, ``default`` when absent or None; anything
/// else (``0``, ``"no"``) is an ``InvalidArgumentError`` naming ``arg``, not a silent truthiness.
pub(crate) fn flag(
    obj: Option<&Bound<'_, PyAny>>,
    arg: &'static str,
    default: bool,
) -> PyResult<bool> {
    match obj.filter(|o| !o.is_none()) {
        None => Ok(default),
        Some(o) => o.extract::<bool>().map_err(|_| {
            bad(
                o.py(),
                arg,
                repr(o),
                format!("expected a bool, got {}", type_name(o)),
            )
        }),
    }
}

pub(crate) fn repr(obj: &Bound<'_, PyAny>) -> String {
    obj.repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unprintable>".into())
}

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// One Python int (or numpy integer scalar) in `0..=max`; bools are refused.
pub(crate) fn uint(obj: &Bound<'_, PyAny>, arg: &'static str, max: u64) -> PyResult<u64> {
    let py = obj.py();
    if !obj.is_instance_of::<PyBool>() {
        match obj.extract::<u64>() {
            Ok(v) if v <= max => return Ok(v),
            Ok(v) => return Err(bad(py, arg, v.to_string(), format!("must be <= {max}"))),
            Err(_) => {
                if let Ok(v) = obj.extract::<i64>() {
                    return Err(bad(py, arg, v.to_string(), "must be >= 0"));
                }
                if obj.is_instance_of::<PyInt>() {
                    return Err(bad(py, arg, repr(obj), format!("out of range 0..={max}")));
                }
            }
        }
    }
    Err(bad(
        py,
        arg,
        repr(obj),
        format!("expected an int, got {}", type_name(obj)),
    ))
}

/// Appends the values of a 1-D numpy array of integer dtype `T`, each checked against `max`.
fn read_array<T>(a: &Bound<'_, PyArray1<T>>, arg: &'static str, max: u64) -> PyResult<Vec<u64>>
where
    T: numpy::Element + Copy + TryInto<u64> + std::fmt::Display,
{
    let ro = a.readonly();
    let view = ro.as_array();
    let mut out = Vec::with_capacity(view.len());
    for (i, &x) in view.iter().enumerate() {
        match x.try_into() {
            Ok(v) if v <= max => out.push(v),
            _ => {
                return Err(bad(
                    a.py(),
                    arg,
                    format!("{x} at index {i}"),
                    format!("values must be in 0..={max}"),
                ))
            }
        }
    }
    Ok(out)
}

/// A 1-D numpy integer array, every value in `0..=max`: int64 / uint64 / int32 / uint32 are
/// read in place, narrower integer dtypes through one `astype(int64)`.
fn array_values(
    arr: &Bound<'_, PyUntypedArray>,
    arg: &'static str,
    max: u64,
) -> PyResult<Vec<u64>> {
    let py = arr.py();
    if arr.ndim() != 1 {
        let shape = format!("array of shape {:?}", arr.shape());
        return Err(bad(py, arg, shape, "expected a 1-D array"));
    }
    let kind = arr.dtype().kind();
    if kind != b'i' && kind != b'u' {
        let dtype = format!("array of dtype {}", arr.dtype());
        return Err(bad(py, arg, dtype, "expected an integer dtype"));
    }
    macro_rules! in_place {
        ($($t:ty),*) => {$(
            if let Ok(a) = arr.cast::<PyArray1<$t>>() {
                return read_array(a, arg, max);
            }
        )*};
    }
    in_place!(i64, u64, i32, u32);
    let wide = arr.call_method1("astype", ("int64",))?;
    read_array(wide.cast::<PyArray1<i64>>()?, arg, max)
}

/// An array-like of ints: a 1-D numpy integer array or a list / tuple of ints, every value in
/// `0..=max`.
pub(crate) fn uint_array(
    obj: &Bound<'_, PyAny>,
    arg: &'static str,
    max: u64,
) -> PyResult<Vec<u64>> {
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        return array_values(arr, arg, max);
    }
    // Lists and tuples are read through their own iterators (no iterator protocol).
    if let Ok(list) = obj.cast::<PyList>() {
        return items_values(list.iter(), list.len(), arg, max);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return items_values(tuple.iter(), tuple.len(), arg, max);
    }
    let reason = format!(
        "expected a 1-D integer array or a list of ints, got {}",
        type_name(obj)
    );
    Err(bad(obj.py(), arg, repr(obj), reason))
}

fn items_values<'py>(
    items: impl Iterator<Item = Bound<'py, PyAny>>,
    len: usize,
    arg: &'static str,
    max: u64,
) -> PyResult<Vec<u64>> {
    let mut out = Vec::with_capacity(len);
    for (i, item) in items.enumerate() {
        let v = uint(&item, arg, max).map_err(|_| {
            let reason = if item.is_instance_of::<PyInt>() && !item.is_instance_of::<PyBool>() {
                format!("values must be in 0..={max}")
            } else {
                format!("expected ints, got {}", type_name(&item))
            };
            bad(
                item.py(),
                arg,
                format!("{} at index {i}", repr(&item)),
                reason,
            )
        })?;
        out.push(v);
    }
    Ok(out)
}

/// A native integer dtype ids arrive in: a branch-free range check and the narrowing, so that
/// a contiguous array converts with vector instructions.
trait IdInt: Copy {
    /// Whether the value is in `0..=u32::MAX`.
    fn fits_u32(self) -> bool;
    /// The value as `u32` (only called after [`IdInt::fits_u32`]).
    fn narrow(self) -> u32;
}

impl IdInt for i64 {
    fn fits_u32(self) -> bool {
        // A negative value becomes a huge u64: one unsigned compare covers both ends.
        (self as u64) <= u64::from(u32::MAX)
    }
    fn narrow(self) -> u32 {
        self as u32
    }
}

impl IdInt for u64 {
    fn fits_u32(self) -> bool {
        self <= u64::from(u32::MAX)
    }
    fn narrow(self) -> u32 {
        self as u32
    }
}

impl IdInt for i32 {
    fn fits_u32(self) -> bool {
        self >= 0
    }
    fn narrow(self) -> u32 {
        self as u32
    }
}

impl IdInt for u32 {
    fn fits_u32(self) -> bool {
        true
    }
    fn narrow(self) -> u32 {
        self
    }
}

/// Token ids (`0..=u32::MAX`), converted straight into the `Vec<u32>` the core keeps (a prompt
/// of 100k tokens staged through a `u64` buffer would fault in fresh pages twice its size).
///
/// Fast paths: a 1-D numpy array of native-endian int32 / uint32 / int64 / uint64 is read from
/// its buffer (any stride: a table reversed with `[::-1]` is not copied; a contiguous one checked
/// and narrowed in two vectorised passes), a list of ints item by item. Anything else, or a
/// value out of range, takes the general path, which names the offending value.
pub(crate) fn token_ids(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<Vec<u32>> {
    let fast = if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        int_array_u32(arr)
    } else if let Ok(list) = obj.cast::<PyList>() {
        int_list_u32(list)
    } else {
        None
    };
    match fast {
        Some(v) => Ok(v),
        None => {
            let v = uint_array(obj, arg, u64::from(u32::MAX))?;
            Ok(v.into_iter().map(|x| x as u32).collect())
        }
    }
}

/// Block ids (`0..=u32::MAX`; the core rejects 0 and out-of-pool ids with `InvalidBlockError`),
/// read as [`token_ids`]. The pool's calls take a few blocks at a time, so the fixed cost of
/// reading the argument is most of their cost: hence the fast paths there.
pub(crate) fn block_ids(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<Vec<u32>> {
    token_ids(obj, arg)
}

/// The values of a 1-D numpy array of native-endian int32 / uint32 / int64 / uint64, or `None`
/// (other shapes or dtypes, or a value outside `0..=u32::MAX`).
fn int_array_u32(arr: &Bound<'_, PyUntypedArray>) -> Option<Vec<u32>> {
    if arr.ndim() != 1 {
        return None;
    }
    let dtype = arr.dtype();
    if dtype.is_native_byteorder() == Some(false) {
        return None;
    }
    let (len, stride) = (arr.len(), arr.strides()[0]);
    if len == 0 {
        return Some(Vec::new());
    }
    // SAFETY: a 1-D ndarray holds `len` items of `itemsize` bytes at `data + k * stride` (the
    // dtype checked below). The GIL is held for the whole read, no Python code runs meanwhile,
    // and this package never writes an array with the GIL released; nothing borrows the array
    // past this call. This skips rust-numpy's borrow tracking (a global table lookup per call,
    // about a third of the cost of a small pool call).
    unsafe {
        let data = (*arr.as_array_ptr()).fields.data.cast_const().cast::<u8>();
        match (dtype.kind(), dtype.itemsize()) {
            (b'i', 4) => read_ints::<i32>(data, len, stride),
            (b'u', 4) => read_ints::<u32>(data, len, stride),
            (b'i', 8) => read_ints::<i64>(data, len, stride),
            (b'u', 8) => read_ints::<u64>(data, len, stride),
            _ => None,
        }
    }
}

/// `len >= 1` values of type `T` at `data + k * stride`, as `u32`, or `None` if one does not
/// fit. A contiguous, aligned run is read as a slice (vectorised check, then narrowing).
///
/// # Safety
/// `data + k * stride` must be readable as a `T` for every `k < len` (alignment not needed).
unsafe fn read_ints<T: IdInt>(data: *const u8, len: usize, stride: isize) -> Option<Vec<u32>> {
    let size = std::mem::size_of::<T>();
    if stride == size as isize && (data as usize) % std::mem::align_of::<T>() == 0 {
        // SAFETY: contiguous and aligned, `len` items readable (the caller's contract).
        let slice = unsafe { std::slice::from_raw_parts(data.cast::<T>(), len) };
        // `fold`, not `all`: no early exit, so the check vectorises (a bad value is rare).
        if !slice.iter().fold(true, |ok, &x| ok & x.fits_u32()) {
            return None;
        }
        return Some(slice.iter().map(|&x| x.narrow()).collect());
    }
    let mut out = Vec::with_capacity(len);
    let mut at = data;
    for _ in 0..len {
        // SAFETY: the caller's contract; `wrapping_offset` keeps the last step in bounds of
        // the arithmetic even though it is never read.
        let x = unsafe { at.cast::<T>().read_unaligned() };
        if !x.fits_u32() {
            return None;
        }
        out.push(x.narrow());
        at = at.wrapping_offset(stride);
    }
    Some(out)
}

/// The values of a list of (exact) Python ints in `0..=u32::MAX`, or `None` (another item
/// type, bools and numpy scalars included, or a value out of range). Relies on the GIL: the
/// module does not declare itself free-threading safe, so a free-threaded interpreter keeps
/// the GIL on while it is loaded.
fn int_list_u32(list: &Bound<'_, PyList>) -> Option<Vec<u32>> {
    use pyo3::ffi;
    let len = list.len();
    let mut out = Vec::with_capacity(len);
    let ptr = list.as_ptr();
    for k in 0..len {
        // SAFETY: `k < len` and the GIL is held with no Python code run inside the loop (an
        // exact int converts without calling back into Python), so the list cannot change
        // under us; the item is borrowed from the list for the two calls below.
        let v = unsafe {
            let item = ffi::PyList_GetItem(ptr, k as ffi::Py_ssize_t);
            if item.is_null() || ffi::Py_TYPE(item) != std::ptr::addr_of_mut!(ffi::PyLong_Type) {
                ffi::PyErr_Clear();
                return None;
            }
            let v = ffi::PyLong_AsUnsignedLong(item);
            if v == std::ffi::c_ulong::MAX && !ffi::PyErr_Occurred().is_null() {
                ffi::PyErr_Clear(); // negative or too large: the general path names it
                return None;
            }
            v
        };
        out.push(u32::try_from(v).ok()?);
    }
    Some(out)
}

/// Sequence ids (`0..=u64::MAX`).
pub(crate) fn seq_ids(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<Vec<u64>> {
    uint_array(obj, arg, u64::MAX)
}

/// One sequence id.
pub(crate) fn seq_id(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<u64> {
    uint(obj, arg, u64::MAX)
}

/// A non-negative count (tokens or blocks).
pub(crate) fn count(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<usize> {
    Ok(uint(obj, arg, usize::MAX as u64)? as usize)
}

/// A `bytes` argument.
pub(crate) fn bytes_arg<'a>(obj: &'a Bound<'_, PyAny>, arg: &'static str) -> PyResult<&'a [u8]> {
    match obj.cast::<PyBytes>() {
        Ok(b) => Ok(b.as_bytes()),
        Err(_) => Err(bad(
            obj.py(),
            arg,
            repr(obj),
            format!("expected bytes, got {}", type_name(obj)),
        )),
    }
}

/// An optional `str` argument.
pub(crate) fn opt_str(
    obj: Option<&Bound<'_, PyAny>>,
    arg: &'static str,
) -> PyResult<Option<String>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    match obj.cast::<PyString>() {
        Ok(s) => Ok(Some(s.to_str()?.to_owned())),
        Err(_) => Err(bad(
            obj.py(),
            arg,
            repr(obj),
            format!("expected a str, got {}", type_name(obj)),
        )),
    }
}

/// A list / tuple argument's items (anything else refused).
pub(crate) fn list_items<'py>(
    obj: &Bound<'py, PyAny>,
    arg: &'static str,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if let Ok(list) = obj.cast::<PyList>() {
        return Ok(list.iter().collect());
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return Ok(tuple.iter().collect());
    }
    Err(bad(
        obj.py(),
        arg,
        repr(obj),
        format!("expected a list, got {}", type_name(obj)),
    ))
}
