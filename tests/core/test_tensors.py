"""pagedkv.tensors against plain-Python constructions of the same arrays."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv import tensors
from pagedkv.errors import InvalidArgumentError

torch = pytest.importorskip("torch")

block_tables_st = st.lists(st.lists(st.integers(1, 10_000), max_size=9), max_size=8)


def py_csr(tables: list[list[int]]) -> tuple[list[int], list[int]]:
    indptr = [0]
    indices: list[int] = []
    for t in tables:
        indices.extend(t)
        indptr.append(len(indices))
    return indptr, indices


def py_dense(tables: list[list[int]], width: int) -> list[list[int]]:
    return [t + [0] * (width - len(t)) for t in tables]


@given(block_tables_st)
def test_block_table_csr_matches_python(tables: list[list[int]]) -> None:
    indptr, indices = tensors.block_table_csr([np.array(t, dtype=np.int32) for t in tables])
    want_ip, want_ix = py_csr(tables)
    assert indptr.dtype == np.int32 and indices.dtype == np.int32
    assert indptr.tolist() == want_ip
    assert indices.tolist() == want_ix


@given(block_tables_st, st.integers(0, 4))
def test_dense_block_table_matches_python(tables: list[list[int]], extra: int) -> None:
    indptr, indices = py_csr(tables)
    longest = max((len(t) for t in tables), default=0)
    got = tensors.dense_block_table(indptr, indices, device=None)
    assert got.dtype == np.int32
    assert got.tolist() == py_dense(tables, max(longest, 1)) or (not tables and got.shape == (0, 1))
    padded = tensors.dense_block_table(indptr, indices, pad_to=longest + extra, device="cpu")
    assert padded.dtype == torch.int32 and padded.device.type == "cpu"
    assert padded.tolist() == py_dense(tables, longest + extra)


def test_dense_block_table_example() -> None:
    got = tensors.dense_block_table([0, 2, 2, 5], [7, 3, 9, 1, 4], device="cpu")
    assert got.tolist() == [[7, 3, 0], [0, 0, 0], [9, 1, 4]]
    assert got.dtype == torch.int32


@given(
    st.lists(st.tuples(st.integers(0, 70), st.integers(0, 3)), max_size=8),
    st.sampled_from([1, 4, 16]),
)
def test_csr_block_table_matches_python(seqs: list[tuple[int, int]], block_size: int) -> None:
    # Each sequence: seq_len tokens, a block table covering it plus `spare` reserved blocks.
    tables, lens = [], []
    next_id = 1
    for seq_len, spare in seqs:
        n = -(-seq_len // block_size) + spare
        tables.append(list(range(next_id, next_id + n)))
        next_id += n
        lens.append(seq_len)
    indptr, indices = py_csr(tables)
    ip, ix, last = tensors.csr_block_table(indptr, indices, lens, block_size, device=None)
    want_ip, want_ix, want_last = [0], [], []
    for t, seq_len in zip(tables, lens):
        pages = -(-seq_len // block_size)
        want_ix.extend(t[:pages])
        want_ip.append(len(want_ix))
        want_last.append(0 if seq_len == 0 else seq_len - (pages - 1) * block_size)
    assert (ip.dtype, ix.dtype, last.dtype) == (np.int32, np.int32, np.int32)
    assert ip.tolist() == want_ip
    assert ix.tolist() == want_ix
    assert last.tolist() == want_last


def test_csr_block_table_last_page_len_example() -> None:
    ip, ix, last = tensors.csr_block_table([0, 2, 3], [5, 6, 8], [17, 16], 16, device="cpu")
    assert ip.tolist() == [0, 2, 3]
    assert ix.tolist() == [5, 6, 8]
    assert last.tolist() == [1, 16]
    assert ip.dtype == ix.dtype == last.dtype == torch.int32


def test_csr_block_table_rejects_short_table() -> None:
    with pytest.raises(InvalidArgumentError, match="sequence 1 has 1 block\\(s\\) but seq_len 17 needs 2"):
        tensors.csr_block_table([0, 1, 2], [5, 6], [3, 17], 16)


def test_slot_mapping_padding() -> None:
    got = tensors.slot_mapping([33, 34, 70], pad_to=6, device="cpu")
    assert got.dtype == torch.int64
    assert got.tolist() == [33, 34, 70, -1, -1, -1]
    assert tensors.slot_mapping(np.array([], dtype=np.int64), device=None).tolist() == []


def test_seq_lens_and_query_start_loc() -> None:
    sl = tensors.seq_lens([5, 1, 9], pad_to=4, device="cpu")
    assert sl.dtype == torch.int32 and sl.tolist() == [5, 1, 9, 0]
    qsl = tensors.query_start_loc([5, 1, 1], pad_to=5, device="cpu")
    assert qsl.dtype == torch.int32 and qsl.tolist() == [0, 5, 6, 7, 7, 7]
    assert tensors.query_start_loc([], device=None).tolist() == [0]


@given(st.lists(st.integers(0, 1000), max_size=20))
def test_query_start_loc_matches_python(qlens: list[int]) -> None:
    want = [0]
    for q in qlens:
        want.append(want[-1] + q)
    assert tensors.query_start_loc(qlens, device=None).tolist() == want


def test_results_do_not_alias_inputs() -> None:
    slots = np.array([1, 2, 3], dtype=np.int64)
    out = tensors.slot_mapping(slots, device="cpu")
    slots[0] = 99
    assert out.tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: tensors.dense_block_table([1, 2], [3]), "indptr = .*must start at 0, starts at 1"),
        (lambda: tensors.dense_block_table([0, 2, 1], [3, 4]), "indptr = .*must be non-decreasing"),
        (lambda: tensors.dense_block_table([0, 3], [3, 4]), "ends at 3 but indices has 2 entries"),
        (lambda: tensors.dense_block_table([0, 1], [-4]), "block ids must be >= 0, found -4"),
        (lambda: tensors.dense_block_table([0, 2], [1, 2], pad_to=1), "pad_to = 1: smaller than the 2"),
        (lambda: tensors.dense_block_table([0.0, 1.0], [1]), "expected integers, got dtype float64"),
        (lambda: tensors.dense_block_table([[0, 1]], [1]), "expected a 1-D array, got shape \\(1, 2\\)"),
        (lambda: tensors.slot_mapping([1, 2, 3], pad_to=2), "pad_to = 2: smaller than the 3"),
        (lambda: tensors.seq_lens([3, -1]), "lengths = .*lengths must be >= 0"),
        (lambda: tensors.seq_lens([2**31]), "do not fit in int32"),
        (lambda: tensors.query_start_loc([True, False]), "expected integers, got dtype bool"),
        (lambda: tensors.csr_block_table([0, 1], [1], [3], 0), "block_size = 0: must be >= 1"),
        (lambda: tensors.csr_block_table([0, 1], [1], [3, 4], 4), "has 2 entries for 1 sequences"),
    ],
)
def test_bad_input_raises_typed_error(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentError, match=message) as info:
        call()
    assert isinstance(info.value, ValueError)


def test_numpy_path_does_not_need_torch_device() -> None:
    out = tensors.dense_block_table([0, 1], [4], device=None)
    assert isinstance(out, np.ndarray) and out.tolist() == [[4]]
