"""The manager's group queries and the step's kernel-layout outputs (``num_uncomputed_tokens``,
``num_blocks_owed``, ``StepOutput.block_table`` / ``input_ids``), with exact values."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import CacheConfig, KVCacheManager
from pagedkv import errors as E


def _manager(num_blocks: int = 32, block_size: int = 4, cpu: int = 16) -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_blocks, block_size, num_cpu_blocks=cpu))


def test_step_dense_block_table_and_input_ids() -> None:
    m = _manager()
    m.add_sequence(1, list(range(6)))
    m.add_sequence(2, [100, 101, 102])
    out = m.step([1, 2], [6, 3], block_table=True)
    assert out.block_table.dtype == np.int32 and out.block_table.shape == (2, 2)
    assert out.block_table.tolist() == [[1, 2], [3, 0]]
    assert out.block_table.flags.c_contiguous
    assert out.input_ids.dtype == np.int64
    assert out.input_ids.tolist() == [0, 1, 2, 3, 4, 5, 100, 101, 102]
    out = m.step([2, 1], 1, append_token_ids=np.array([7, 8]), block_table=True)
    assert out.input_ids.tolist() == [7, 8]
    assert out.block_table.tolist() == [[3, 0], [1, 2]]
    # a step refused as a whole: zero rows, one column
    out = m.step([1, 1], 1, block_table=True)
    assert out.num_scheduled == 0 and out.block_table.shape == (0, 1)


def test_step_without_block_table_schedules_the_same() -> None:
    m = _manager()
    m.add_sequence(1, list(range(4)))
    m.add_sequence(2, [100, 101, 102])
    out = m.step([1, 2], [4, 3])  # the default: tables as deltas only
    assert out.block_table.shape == (2, 0) and out.block_table.dtype == np.int32
    assert out.block_tables.shape == (1, 2, 0)
    assert out.table_start.tolist() == [[0], [0]] and out.table_delta.tolist() == [1, 2]
    assert out.new_block_ids.tolist() == [1, 2] and out.new_block_indptr.tolist() == [0, 1, 2]
    assert out.slot_mapping.tolist() == [4, 5, 6, 7, 8, 9, 10]
    # the next decode opens a new block for seq 1 only; the tables are the ones a full step shows
    out = m.step([1, 2], 1, append_token_ids=np.array([7, 8]), block_table=False)
    assert out.new_block_ids.tolist() == [3] and out.new_block_indptr.tolist() == [0, 1, 1]
    assert out.context_lens.tolist() == [4, 3] and out.block_table.shape == (2, 0)
    assert m.block_table(1).tolist() == [1, 3] and m.block_table(2).tolist() == [2]


def test_num_uncomputed_tokens() -> None:
    m = _manager()
    m.add_sequence(1, list(range(10)))
    m.add_sequence(2, list(range(5)))
    m.allocate_slots(1, 6)
    got = m.num_uncomputed_tokens(np.array([1, 2], dtype=np.uint64))
    assert got.dtype == np.int32 and got.tolist() == [4, 5]
    m.preempt([1])
    assert m.num_uncomputed_tokens([1]).tolist() == [10]
    with pytest.raises(E.UnknownSequenceError) as ei:
        m.num_uncomputed_tokens([2, 9])
    assert ei.value.seq_id == 9


def test_num_blocks_owed_matches_the_blocks_a_step_takes() -> None:
    m = _manager()
    m.add_sequence(1, list(range(10)))
    assert m.num_blocks_owed([1]) == 3
    m.allocate_slots(1, 5)
    assert m.num_blocks_owed([1]) == 1
    m.allocate_slots(1, 5)
    m.fork(1, 2)
    m.append_tokens(1, [50])
    m.append_tokens(2, [51])
    assert m.num_blocks_owed([1, 2]) == 1  # one copy-on-write of the shared partial block
    m.preempt([1, 2])
    owed = m.num_blocks_owed([1, 2])
    free = m.pool.num_free
    m.step([1, 2], 100).raise_for_error()
    assert owed == free - m.pool.num_free == 4
    m.swap_out([1, 2])
    assert m.num_blocks_owed([1, 2]) == 4
    with pytest.raises(E.InvalidArgumentError):
        m.num_blocks_owed([1, 1])
    with pytest.raises(E.UnknownSequenceError):
        m.num_blocks_owed([3])
    m.check_invariants()
