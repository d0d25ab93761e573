"""``KVCacheManager.step(..., token_arrays=False)`` against the default step, in lockstep.

Two managers get the same random calls (prefills split into chunks, decodes with appended
tokens, forks then copy-on-write appends, recompute and swap preemption, swap-in, frees,
duplicate and unknown ids); only one asks for the per-token arrays. Every step output must
agree except ``slot_mapping`` / ``input_ids``, which the lean step leaves empty (``int64[0]``)
while ``num_tokens`` still counts the scheduled tokens; failures raise the same error class,
and the block tables and stats stay equal throughout.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv
from pagedkv import CacheConfig, KVCacheManager

# Fields of a StepOutput that do not depend on token_arrays.
SHARED_FIELDS = (
    "num_scheduled",
    "num_tokens",
    "max_seq_len",
    "max_query_len",
    "num_cached_tokens",
    "query_start_loc",
    "seq_lens",
    "context_lens",
    "new_block_indptr",
    "new_block_ids",
    "copies",
    "block_table",
    "seq_ids",
    "table_start",
    "table_version",
    "table_delta_indptr",
    "table_delta",
)

IDS = st.integers(0, 5)  # 0-3 start live; 4 and 5 come from adds and forks
STEP = st.tuples(
    st.just("step"),
    st.one_of(
        st.lists(IDS, min_size=1, max_size=4, unique=True),
        st.lists(IDS, min_size=1, max_size=4),  # unknown and repeated ids too
    ),
    st.integers(1, 12),
    st.sampled_from((True, True, False)),  # append one token per sequence (decode)
    st.booleans(),  # block_table=True
)
OPS = st.one_of(
    STEP,
    STEP,
    STEP,
    st.tuples(st.just("add"), IDS, st.integers(0, 2), st.integers(1, 20)),
    st.tuples(st.just("fork"), st.integers(0, 3), st.integers(4, 5)),
    st.tuples(st.just("fork"), st.integers(0, 3), st.integers(4, 5)),
    st.tuples(st.just("preempt"), IDS),
    st.tuples(st.just("swap_out"), IDS),
    st.tuples(st.just("swap_in"), IDS),
    st.tuples(st.just("swap_in_all")),
    st.tuples(st.just("free"), IDS),
)


def _call(m: KVCacheManager, op: tuple[Any, ...], token_arrays: bool) -> Any:
    kind = op[0]
    if kind == "add":
        _, seq, family, n = op
        return m.add_sequence(seq, [1000 * family + i for i in range(n)])
    if kind == "step":
        _, seqs, n, decode, table = op
        append = [[7 + s] for s in seqs] if decode else None
        return m.step(seqs, n, append, block_table=table, token_arrays=token_arrays)
    if kind == "fork":
        return m.fork(op[1], op[2])
    if kind == "swap_in_all":  # every swapped sequence: a resume after a swap preemption
        swapped = [s for s in range(6) if m.num_sequences and _status(m, s) == "swapped"]
        return m.swap_in(swapped)
    if kind in ("preempt", "swap_out", "swap_in"):
        return getattr(m, kind)([op[1]])
    return m.free(op[1])


def _status(m: KVCacheManager, seq: int) -> str | None:
    try:
        return m.status(seq)
    except pagedkv.UnknownSequenceError:
        return None


def _outcome(m: KVCacheManager, op: tuple[Any, ...], token_arrays: bool) -> Any:
    try:
        return _call(m, op, token_arrays)
    except pagedkv.PagedKVError as e:
        return type(e)


@settings(max_examples=150)
@given(st.lists(st.integers(1, 20), min_size=4, max_size=4), st.lists(OPS, min_size=10, max_size=30))
def test_lean_steps_match_full_steps(prompt_lens: list[int], ops: list[tuple[Any, ...]]) -> None:
    full, lean = (KVCacheManager(CacheConfig(12, 4, num_cpu_blocks=6)) for _ in range(2))
    # Four live sequences, two of them sharing a prompt family (prefix hits).
    start = [("add", seq, seq % 3, n) for seq, n in enumerate(prompt_lens)]
    for op in start + ops:
        a, b = _outcome(full, op, True), _outcome(lean, op, False)
        if op[0] != "step" or isinstance(a, type):
            assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, op
            continue
        assert type(a.error) is type(b.error), op
        for name in SHARED_FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            assert np.array_equal(x, y) and np.shape(x) == np.shape(y), (op, name)
        assert a.num_tokens == a.slot_mapping.size == a.input_ids.size
        for arr in (b.slot_mapping, b.input_ids):
            assert arr.dtype == np.int64 and arr.shape == (0,)
        assert repr(a) == repr(b)
        assert repr(full.stats()) == repr(lean.stats())
    for seq in range(6):
        try:
            expected = full.block_table(seq).tolist()
        except pagedkv.UnknownSequenceError:
            with pytest.raises(pagedkv.UnknownSequenceError):
                lean.block_table(seq)
            continue
        assert lean.block_table(seq).tolist() == expected
        assert lean.num_computed_tokens(seq) == full.num_computed_tokens(seq)
        assert lean.status(seq) == full.status(seq)
    lean.check_invariants()


def test_flags_must_be_bools_and_a_refused_call_changes_nothing() -> None:
    m = KVCacheManager(CacheConfig(8, 4))
    m.add_sequence(1, list(range(6)))
    for flag in ("token_arrays", "block_table"):
        for value in (0, 1, "no", 0.0, []):
            with pytest.raises(pagedkv.InvalidArgumentError, match=f"{flag} = .*expected a bool"):
                m.step([1], 6, **{flag: value})
    assert m.num_computed_tokens(1) == 0 and m.stats().used == 0
    # numpy bools are bools; None means the default (as for CacheConfig's flags).
    lean = m.step([1], 2, token_arrays=np.bool_(False), block_table=None)
    assert (lean.num_tokens, lean.slot_mapping.size, lean.block_table.shape) == (2, 0, (1, 0))
    assert lean.slot_mappings.shape == (1, 0)
    full = m.step([1], 2, token_arrays=None, block_table=np.bool_(True))
    assert full.slot_mapping.tolist() == [6, 7] and full.block_table.tolist() == [[1]]  # block 0: null


def test_kernel_inputs_refuse_a_lean_step_in_any_position_and_keep_the_table() -> None:
    from pagedkv.tensors import BatchTensors, BlockTable

    m = KVCacheManager(CacheConfig(32, 4))
    m.add_sequence(1, list(range(10)))
    m.add_sequence(2, list(range(3)))
    table = BlockTable(m)
    first = m.step([1], 5)
    view = BatchTensors.from_steps(first, block_tables=table).block_table  # CPU: the table's buffer
    before = (repr(table), view.tolist())
    lean = m.step([2], 3, token_arrays=False)
    full = m.step([1], 5)
    for steps in (lean, [full, lean], [lean, full]):
        with pytest.raises(pagedkv.InvalidArgumentError, match="token_arrays=False"):
            BatchTensors.from_steps(steps, block_tables=table)  # type: ignore[arg-type]
        assert (repr(table), view.tolist()) == before
    # A lean step that schedules nothing (here a refused one) lacks no token: it is accepted.
    empty = m.step([1, 1], 1, [[10], [11]], token_arrays=False)
    assert empty.num_scheduled == 0 and empty.num_tokens == 0
    assert BatchTensors.from_steps(empty, block_tables=table).num_tokens == 0
    # The deltas the refused steps carried are not lost: the next full step's tables are whole.
    out = BatchTensors.from_steps(m.step([1, 2], 1, [[10], [3]]), block_tables=table)
    assert out.block_table.tolist() == [m.block_table(1).tolist(), m.block_table(2).tolist() + [0, 0]]
