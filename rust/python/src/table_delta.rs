//! `pagedkv._core.apply_table_deltas`: the inner loop of `pagedkv.tensors.BlockTable`, which
//! keeps block tables across scheduler steps and applies the step outputs' table deltas (as
//! vLLM's GPU model runner keeps its block table and applies only the changes). Done here in one
//! pass over the batch instead of a dozen numpy calls per step.

use crate::convert::bad;
use crate::manager::PyStepOutput;
use numpy::ndarray::Array2;
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

/// The byte range `[start, end)` of a C-contiguous array's data.
fn span(a: &Bound<'_, PyUntypedArray>) -> PyResult<(usize, usize)> {
    if !a.is_c_contiguous() {
        let reason = "expected C-contiguous arrays";
        return Err(bad(a.py(), "table_deltas", "a strided array", reason));
    }
    // SAFETY: reads the array struct's data pointer and item size, no data.
    let (ptr, item) = unsafe {
        (
            (*a.as_array_ptr()).fields.data as usize,
            a.dtype().itemsize(),
        )
    };
    Ok((ptr, ptr + a.len() * item))
}

/// `(width or columns needed, (rows to re-read, dense batch table) or None)`.
type DeltaResult = (usize, Option<(Vec<usize>, Py<PyArray2<i32>>)>);

/// Applies one batch's table deltas to the persistent tables, in place.
///
/// ``table`` is ``int32[R, C]`` (C-contiguous; entries past a row's length are 0),
/// ``lens`` / ``versions`` are ``int64[R]`` (entries held and table version of each row; a
/// version that no delta follows, e.g. -2 for a fresh row). ``steps`` are the batch's
/// ``StepOutput``s in order; batch sequence ``k`` (counted across them) lives in row
/// ``rows[k]`` (``int64[S]``), and its delta is the output's ``table_start``,
/// ``table_version`` and ``table_delta`` slice. A delta applies when it starts at 0 or follows
/// the version held (``version == held + 1``) from within the held entries; the row then
/// becomes ``row[:start] + delta``, zero-padded. Rows whose delta does not apply are left for a
/// whole re-read.
///
/// Returns ``(width, (reread, dense))``: the longest applied table, the batch indices ``k`` to
/// re-read whole, and the batch's dense table ``int32[S, max(width, 1)]`` gathered from the
/// rows (a fresh C-contiguous array; re-read rows not filled in); or, when some delta ends past
/// column ``C``, ``(columns needed, None)`` with nothing written (grow the table and call
/// again). Raises ``InvalidArgumentError`` for arrays that are strided, share memory with a
/// written one, or disagree in shape, and for a row out of range (nothing written).
#[pyfunction]
pub(crate) fn apply_table_deltas(
    py: Python<'_>,
    table: &Bound<'_, PyArray2<i32>>,
    lens: &Bound<'_, PyArray1<i64>>,
    versions: &Bound<'_, PyArray1<i64>>,
    rows: &Bound<'_, PyArray1<i64>>,
    steps: Vec<PyRef<'_, PyStepOutput>>,
) -> PyResult<DeltaResult> {
    let cols = table.shape()[1];
    let shape_err = |what: &str| bad(py, "table_deltas", what.to_string(), "shapes disagree");
    // The written arrays must share memory with no other argument (the step outputs' arrays
    // are the core's own): that, C-contiguity and the GIL held for the whole call make the
    // unchecked slices below sound. numpy's borrow tracking would cost more than the whole
    // update of a decode batch.
    let spans = [
        span(table.as_untyped())?,
        span(lens.as_untyped())?,
        span(versions.as_untyped())?,
        span(rows.as_untyped())?,
    ];
    for (i, a) in spans.iter().enumerate() {
        for b in &spans[i + 1..] {
            if a.0 < b.1 && b.0 < a.1 {
                return Err(shape_err("arrays share memory"));
            }
        }
    }
    // SAFETY: contiguous (checked by `span`), the written arrays alias nothing else (checked
    // above; the step outputs' arrays are separate core-made buffers), and the GIL is held.
    let (t, l, v, rows) = unsafe {
        (
            table.as_slice_mut().map_err(|_| shape_err("table"))?,
            lens.as_slice_mut().map_err(|_| shape_err("lens"))?,
            versions.as_slice_mut().map_err(|_| shape_err("versions"))?,
            rows.as_slice().map_err(|_| shape_err("rows"))?,
        )
    };
    if l.len() != v.len() || t.len() != l.len() * cols {
        return Err(shape_err("table / lens / versions"));
    }
    // The steps' delta arrays, as (start, version, indptr, delta) slices.
    let mut parts = Vec::with_capacity(steps.len());
    for step in &steps {
        // SAFETY: the core made these arrays from Vecs (contiguous) and nothing writes them.
        unsafe {
            parts.push((
                step.table_start
                    .bind(py)
                    .as_slice()
                    .map_err(|_| shape_err("start"))?,
                step.table_version
                    .bind(py)
                    .as_slice()
                    .map_err(|_| shape_err("version"))?,
                step.table_delta_indptr
                    .bind(py)
                    .as_slice()
                    .map_err(|_| shape_err("indptr"))?,
                step.table_delta
                    .bind(py)
                    .as_slice()
                    .map_err(|_| shape_err("delta"))?,
            ));
        }
    }
    let n: usize = parts.iter().map(|p| p.0.len()).sum();
    if rows.len() != n {
        return Err(shape_err("rows"));
    }
    // Validate everything first, so that bad input writes nothing.
    let mut needed = 0usize;
    let mut k = 0;
    for (start, _, indptr, _) in &parts {
        for (j, &st) in start.iter().enumerate() {
            let r = rows[k];
            if r < 0 || r as usize >= l.len() {
                return Err(shape_err("row out of range"));
            }
            needed = needed.max(st as usize + (indptr[j + 1] - indptr[j]) as usize);
            k += 1;
        }
    }
    if needed > cols {
        return Ok((needed, None));
    }
    let mut width = 0usize;
    let mut reread = Vec::new();
    let mut k = 0;
    for (start, version, indptr, delta) in &parts {
        for j in 0..start.len() {
            let r = rows[k] as usize;
            let st = start[j] as usize;
            let held = l[r].max(0) as usize;
            let follows = i64::from(version[j]) == v[r] + 1 && st <= held;
            if st != 0 && !follows {
                reread.push(k);
                k += 1;
                continue;
            }
            let (a, b) = (indptr[j] as usize, indptr[j + 1] as usize);
            let row = &mut t[r * cols..(r + 1) * cols];
            let end = st + (b - a);
            row[st..end].copy_from_slice(&delta[a..b]);
            if end < held {
                row[end..held.min(cols)].fill(0);
            }
            l[r] = end as i64;
            v[r] = i64::from(version[j]);
            width = width.max(end);
            k += 1;
        }
    }
    // The batch's dense table, row by row from the persistent rows.
    let w = width.max(1);
    let mut dense = Vec::with_capacity(n * w);
    for &r in rows {
        let r = r as usize;
        dense.extend_from_slice(&t[r * cols..r * cols + w]);
    }
    let dense = Array2::from_shape_vec((n, w), dense)
        .expect("n x w buffer")
        .into_pyarray(py)
        .unbind();
    Ok((width, Some((reread, dense))))
}
