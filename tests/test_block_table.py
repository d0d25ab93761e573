"""pagedkv.tensors.BlockTable: block tables kept across steps from the step outputs' table
deltas, against the dense tables the core copies out (``step(..., block_table=True)``) and the
manager's own ``block_table``. The random-operation equivalence (every step of random
add / step / allocate / fork / COW / preempt / swap / free / reset sequences) lives in
``test_state_machine.py``; these cases pin each delta kind and the recovery paths."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import CacheConfig, KVCacheManager
from pagedkv.errors import InvalidArgumentError
from pagedkv.tensors import BlockTable


def make(num_blocks: int = 32, block_size: int = 4, **kw: object) -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_blocks, block_size, **kw))  # type: ignore[arg-type]


def step(m: KVCacheManager, tables: BlockTable, seqs: list[int], n: int | list[int], appends=None):
    """One step through both paths; returns the kept table after checking it."""
    out = m.step(np.array(seqs, np.uint64), n, appends, block_table=True)
    out.raise_for_error()
    kept = tables.update([out])
    assert kept.tolist() == out.block_table.tolist()
    assert kept.tolist() == [t + [0] * (kept.shape[1] - len(t)) for t in (m.block_table(s).tolist() for s in seqs)]
    return out, kept


def test_decode_deltas_carry_only_new_blocks() -> None:
    m = make()
    tables = BlockTable(m, rows=1, width=1)  # grows in both dimensions
    for s in (1, 2, 3):
        m.add_sequence(s, [s] * 4)
    out, kept = step(m, tables, [1, 2, 3], 4)
    assert out.table_start.tolist() == [0, 0, 0] and out.table_version.tolist() == [1, 1, 1]
    out, kept = step(m, tables, [1, 2, 3], 1, np.array([7, 8, 9]))
    # each sequence starts block 2: its delta is that one block, from logical block 1
    assert out.table_start.tolist() == [1, 1, 1] and out.table_version.tolist() == [2, 2, 2]
    assert out.table_delta.tolist() == out.new_block_ids.tolist()
    out, kept = step(m, tables, [1, 2, 3], 1, np.array([1, 2, 3]))
    assert out.table_delta.size == 0 and out.table_start.tolist() == [2, 2, 2]
    assert tables.num_table_reads == 0


def test_copy_on_write_rewrites_the_last_entry() -> None:
    m = make(enable_prefix_caching=False)
    tables = BlockTable(m)
    m.add_sequence(1, [1, 2, 3, 4, 5, 6])
    step(m, tables, [1], 6)
    m.fork(1, 2)
    # the child is new to the outputs: its whole table comes; the parent's shared last block
    # is copied on write, so its delta rewrites logical block 1
    out, kept = step(m, tables, [1, 2], 1, np.array([7, 8]))
    assert out.copies.shape == (1, 2)  # the child then holds its block alone
    assert out.table_start.tolist() == [1, 0]
    assert tables.num_table_reads == 0


def test_preempted_sequence_comes_back_shorter_zero_padded() -> None:
    m = make(enable_prefix_caching=False)
    tables = BlockTable(m)
    m.add_sequence(1, list(range(20)))
    m.add_sequence(2, list(range(3)))
    step(m, tables, [1, 2], 20)  # seq 1: 5 blocks
    m.preempt([1])
    out, kept = step(m, tables, [1, 2], [4, 1], [[], [5]])  # seq 1 restarts with 1 block
    assert out.table_start.tolist() == [0, 1]
    assert kept.shape == (2, 1)
    # no stale entries: once the other sequence's table is wider, seq 1's row (now 2 blocks)
    # shows the null block where its pre-preemption blocks 2..4 were
    m.append_tokens(2, list(range(20)))
    out, kept = step(m, tables, [1, 2], [1, 20])
    assert kept.shape[1] == 6 and kept[0, 2:].tolist() == [0, 0, 0, 0]


def test_swap_in_rewrites_the_whole_table() -> None:
    m = make(enable_prefix_caching=False, num_cpu_blocks=8)
    tables = BlockTable(m)
    m.add_sequence(1, list(range(9)))
    step(m, tables, [1], 8)
    m.swap_out([1])
    m.add_sequence(2, list(range(12)))
    step(m, tables, [2], 12)  # takes the blocks seq 1 gave up
    m.swap_in([1])
    out, kept = step(m, tables, [1, 2], 1, [[], [1]])
    assert out.table_start.tolist()[0] == 0


def test_a_skipped_output_makes_the_table_read_whole() -> None:
    m = make(enable_prefix_caching=False)
    tables = BlockTable(m)
    m.add_sequence(1, [1, 2, 3, 4, 5, 6])
    step(m, tables, [1], 6)
    m.fork(1, 2)
    skipped = m.step(np.array([1], np.uint64), 1, np.array([7]))  # COW of block 1, not applied
    assert skipped.table_start.tolist() == [1]
    out, kept = step(m, tables, [1], 1, np.array([8]))
    # the version check catches the gap: the delta alone would keep the pre-COW block
    assert out.table_start.tolist() == [2] and tables.num_table_reads == 1


def test_absent_sequences_are_released_and_read_back() -> None:
    m = make(num_blocks=512, enable_prefix_caching=False)
    tables = BlockTable(m)
    ids = list(range(70))
    for s in ids:
        m.add_sequence(s, [s] * 5)
    step(m, tables, ids, 5)
    step(m, tables, [0], 1, np.array([1]))  # 69 absent > 1 + 64: released
    assert tables.num_rows == 1
    step(m, tables, [0, 1], 1, np.array([2, 3]))
    assert tables.num_table_reads == 1  # seq 1 came back after its rows were released


def test_several_outputs_of_one_scheduler_step_merge_in_order() -> None:
    m = make()
    tables = BlockTable(m)
    for s in (1, 2, 3):
        m.add_sequence(s, [s] * 5)
    a = m.step(np.array([1, 2], np.uint64), 5, block_table=True)
    b = m.step(np.array([3], np.uint64), 5, block_table=True)
    kept = tables.update([a, b])
    assert kept.tolist() == [m.block_table(s).tolist() for s in (1, 2, 3)]
    assert tables.update([]).shape == (0, 1)
    with pytest.raises(InvalidArgumentError, match="scheduled twice"):
        tables.update([a, a])


def test_block_table_needs_a_manager() -> None:
    with pytest.raises(InvalidArgumentError, match="manager"):
        BlockTable(object())  # type: ignore[arg-type]


