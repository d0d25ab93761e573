"""pagedkv.tensors.BlockTable: block tables kept across steps from the step outputs' table
deltas, against the dense tables the core copies out (``step(..., block_table=True)``) and the
manager's own ``block_table``. The random-operation equivalence (every step of random
add / step / allocate / fork / COW / preempt / swap / free / reset sequences) lives in
``test_state_machine.py``; these cases pin each delta kind and the recovery paths."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pagedkv import CacheConfig, KVCacheManager
from pagedkv.errors import InvalidArgumentError, UnknownSequenceError
from pagedkv.tensors import BlockTable


def make(num_blocks: int = 32, block_size: int = 4, **kw: object) -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_blocks, block_size, **kw))  # type: ignore[arg-type]


def step_groups(m: KVCacheManager, tables: BlockTable, seqs: list[int], n: int | list[int], appends=None):
    """One step through both paths; returns the kept ``[G, S, W]`` tables (``G = 1``) after
    checking them."""
    out = m.step(np.array(seqs, np.uint64), n, appends, block_table=True)
    out.raise_for_error()
    kept3 = tables.update([out])
    assert kept3.shape[0] == 1 and kept3.tolist() == out.block_tables.tolist()  # one group
    kept = kept3[0]
    assert kept.tolist() == out.block_table.tolist()
    assert kept.tolist() == [t + [0] * (kept.shape[1] - len(t)) for t in (m.block_table(s).tolist() for s in seqs)]
    return out, kept3


def step(m: KVCacheManager, tables: BlockTable, seqs: list[int], n: int | list[int], appends=None):
    """One step through both paths; returns the one group's kept table after checking it."""
    out, kept3 = step_groups(m, tables, seqs, n, appends)
    return out, kept3[0]


def test_decode_deltas_carry_only_new_blocks() -> None:
    m = make()
    tables = BlockTable(m, rows=1, width=1)  # grows in both dimensions
    for s in (1, 2, 3):
        m.add_sequence(s, [s] * 4)
    out, kept = step(m, tables, [1, 2, 3], 4)
    assert out.table_start.tolist() == [[0], [0], [0]] and out.table_version.tolist() == [1, 1, 1]
    out, kept = step(m, tables, [1, 2, 3], 1, np.array([7, 8, 9]))
    # each sequence starts block 2: its delta is that one block, from logical block 1
    assert out.table_start.tolist() == [[1], [1], [1]] and out.table_version.tolist() == [2, 2, 2]
    assert out.table_delta.tolist() == out.new_block_ids.tolist()
    out, kept = step(m, tables, [1, 2, 3], 1, np.array([1, 2, 3]))
    assert out.table_delta.size == 0 and out.table_start.tolist() == [[2], [2], [2]]
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
    assert out.copies.shape == (1, 3) and out.copies[0, 0] == 0  # the child then holds its block alone
    assert out.table_start.tolist() == [[1], [0]]
    assert tables.num_table_reads == 0


def test_preempted_sequence_comes_back_shorter_zero_padded() -> None:
    m = make(enable_prefix_caching=False)
    tables = BlockTable(m)
    m.add_sequence(1, list(range(20)))
    m.add_sequence(2, list(range(3)))
    step(m, tables, [1, 2], 20)  # seq 1: 5 blocks
    m.preempt([1])
    out, kept = step(m, tables, [1, 2], [4, 1], [[], [5]])  # seq 1 restarts with 1 block
    assert out.table_start.tolist() == [[0], [1]]
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
    assert out.table_start.tolist()[0] == [0]


def test_a_skipped_output_makes_the_table_read_whole() -> None:
    m = make(enable_prefix_caching=False)
    tables = BlockTable(m)
    m.add_sequence(1, [1, 2, 3, 4, 5, 6])
    step(m, tables, [1], 6)
    m.fork(1, 2)
    skipped = m.step(np.array([1], np.uint64), 1, np.array([7]))  # COW of block 1, not applied
    assert skipped.table_start.tolist() == [[1]]
    out, kept = step(m, tables, [1], 1, np.array([8]))
    # the version check catches the gap: the delta alone would keep the pre-COW block
    assert out.table_start.tolist() == [[2]] and tables.num_table_reads == 1


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
    assert kept.tolist() == [[m.block_table(s).tolist() for s in (1, 2, 3)]]
    assert tables.update([]).shape == (1, 0, 1)
    with pytest.raises(InvalidArgumentError, match="scheduled twice"):
        tables.update([a, a])


def test_block_table_needs_a_manager() -> None:
    with pytest.raises(InvalidArgumentError, match="manager"):
        BlockTable(object())  # type: ignore[arg-type]


def test_bad_arguments_are_refused_with_typed_errors() -> None:
    m = make()
    for kw in ({"rows": -1}, {"width": 2.5}, {"rows": "8"}):
        with pytest.raises(InvalidArgumentError):
            BlockTable(m, **kw)  # type: ignore[arg-type]
    tables = BlockTable(m)
    for bad in (None, [None], [np.zeros(3)], "steps"):
        with pytest.raises(InvalidArgumentError, match="steps"):
            tables.update(bad)  # type: ignore[arg-type]
    assert tables.num_rows == 0


def test_an_initial_capacity_too_large_to_allocate_is_refused_not_a_crash() -> None:
    """``rows`` / ``width`` are capacity hints; one too large to allocate (``rows=2**40``
    aborted the interpreter: the buffer's allocation failed in Rust) is an
    ``InvalidArgumentError`` naming it. Run in a child process so a crash is a failure."""
    code = (
        "import pagedkv\n"
        "from pagedkv.tensors import BlockTable\n"
        "m = pagedkv.KVCacheManager(pagedkv.CacheConfig(8, 4))\n"
        "for kw in ({'rows': 2**40}, {'width': 2**40}, {'rows': 2**20 + 1},\n"
        "           {'width': pagedkv.MAX_BLOCKS + 1}, {'rows': 2**14, 'width': 2**15}):\n"
        "    try:\n"
        "        BlockTable(m, **kw)\n"
        "    except pagedkv.InvalidArgumentError as e:\n"
        "        print(isinstance(e, ValueError), sorted(kw)[0] in str(e))\n"
        "t = BlockTable(m, rows=2**20, width=64)\n"
        "print(t.num_rows)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n") == ["True True"] * 5 + ["0", ""]


def test_refused_updates_change_nothing() -> None:
    m = make(enable_prefix_caching=False)
    tables = BlockTable(m)
    for s in (1, 2):
        m.add_sequence(s, [s] * 5)
    first = m.step(np.array([1, 2], np.uint64), 5)
    kept = tables.update(first)[0].tolist()
    dup = m.step(np.array([1], np.uint64), 1, np.array([7]))
    with pytest.raises(InvalidArgumentError, match="scheduled twice"):
        tables.update([dup, dup])
    # an output skipped, then one of a sequence freed since: its table cannot be read whole
    m.fork(2, 3)
    skipped = m.step(np.array([3], np.uint64), 1, np.array([8]))
    late = m.step(np.array([3], np.uint64), 1, np.array([9]))
    m.free(3)
    with pytest.raises(UnknownSequenceError):
        tables.update([late])
    assert (tables.num_rows, tables.num_table_reads) == (2, 0)
    # the state is intact: the next real outputs still apply as deltas
    assert skipped.table_start.tolist() == [[0]]
    out = m.step(np.array([2, 1], np.uint64), 1, np.array([5, 6]))
    got = tables.update(out)
    assert got.tolist() == [[m.block_table(2).tolist(), m.block_table(1).tolist()]]
    assert kept == [m.block_table(1).tolist(), m.block_table(2).tolist()]
    assert tables.num_table_reads == 1  # seq 1's output `dup` was never applied


def test_rows_follow_the_batch_order_and_the_result_is_a_reused_view() -> None:
    m = make(num_blocks=256, enable_prefix_caching=False)
    tables = BlockTable(m, rows=2, width=2)
    ids = list(range(1, 9))
    for s in ids:
        m.add_sequence(s, [s] * (4 * s))  # seq s: s blocks
    rng = np.random.default_rng(0)
    out, kept = step(m, tables, ids, [4 * s for s in ids])
    for _ in range(12):
        batch = rng.permutation(ids)[: rng.integers(1, len(ids) + 1)].tolist()
        out, kept = step(m, tables, batch, 1, [[1]] * len(batch))  # checked against the manager
        assert kept.dtype == np.int32 and kept.shape[0] == len(batch)
    assert tables.num_table_reads == 0
    # the same batch shape again: the very same array, its contents updated in place
    out, a = step_groups(m, tables, batch, 1, [[1]] * len(batch))
    out, b = step_groups(m, tables, batch, 1, [[1]] * len(batch))
    assert a is b
    # a wider table replaces the buffer; the last view keeps the old one (and its contents)
    before = b.tolist()
    m.append_tokens(batch[0], [2] * 200)
    out, c = step_groups(m, tables, batch, [200] + [0] * (len(batch) - 1))
    assert c is not b and c.shape[2] > b.shape[2] and b.tolist() == before


def test_step_output_reports_its_longest_sequence_and_query() -> None:
    m = make()
    m.add_sequence(1, [1] * 9)
    m.add_sequence(2, [2] * 3)
    out = m.step(np.array([1, 2], np.uint64), [5, 3])
    assert (out.max_seq_len, out.max_query_len) == (5, 5)
    out = m.step(np.array([1, 2], np.uint64), [4, 1], [[], [7]])
    assert (out.max_seq_len, out.max_query_len) == (9, 4)
    empty = m.step(np.zeros(0, np.uint64), 1)
    assert (empty.max_seq_len, empty.max_query_len) == (0, 0)


def test_batch_tensors_reuse_the_table_tensor_while_the_shape_holds() -> None:
    torch = pytest.importorskip("torch")
    from pagedkv.tensors import BatchTensors

    m = make(num_blocks=64, enable_prefix_caching=False)
    tables = BlockTable(m)
    for s in (1, 2):
        m.add_sequence(s, [s] * 6)
    seqs = np.array([1, 2], np.uint64)
    BatchTensors.from_steps(m.step(seqs, 6), "cpu", block_tables=tables)
    a = BatchTensors.from_steps(m.step(seqs, 1, np.array([3, 4])), "cpu", block_tables=tables)
    b = BatchTensors.from_steps(m.step(seqs, 1, np.array([5, 6])), "cpu", block_tables=tables)
    # 8 tokens each: 2 blocks, the same shape -> the same tensor, showing the latest tables
    assert b.block_table is a.block_table and b.block_table.tolist() == [m.block_table(s).tolist() for s in (1, 2)]
    c = BatchTensors.from_steps(m.step(seqs, 1, np.array([7, 8])), "cpu", block_tables=tables)
    assert c.block_table is not b.block_table and c.block_table.shape == (2, 3)  # a third block
    assert c.block_table.tolist() == [m.block_table(s).tolist() for s in (1, 2)]
    assert c.copies.dtype == torch.int32 and c.copies.shape == (0, 3)
    assert (c.max_seq_len, c.max_query_len) == (9, 1)


def test_a_reused_sequence_id_never_takes_a_delta_meant_for_its_new_sequence() -> None:
    # Sequence 1 reported once (version 1) and freed; a new sequence under id 1 whose first
    # output is skipped: its second delta must not be applied to the old sequence's row (the
    # row would keep the freed blocks before table_start).
    m = make(enable_prefix_caching=False)
    tables = BlockTable(m)
    m.add_sequence(1, [1] * 6)
    m.add_sequence(2, [2] * 6)
    step(m, tables, [1, 2], 6)
    freed = m.block_table(1).tolist()
    m.free(1)
    m.add_sequence(4, [4] * 8)
    m.step(np.array([4], np.uint64), 8)  # takes the freed blocks (output not applied)
    m.add_sequence(1, [3] * 6)
    m.step(np.array([1], np.uint64), 6)  # the new sequence's whole table: skipped
    assert not set(m.block_table(1).tolist()) & set(freed)
    out, kept = step(m, tables, [1], 1, np.array([7]))  # an empty delta from logical block 2
    assert out.table_start.tolist() == [[2]] and out.table_version.tolist() == [4]
    assert tables.num_table_reads == 1
    # versions keep rising for every new sequence: a fork child starts above them too
    m.fork(1, 3)
    out, kept = step(m, tables, [3, 2], 1, np.array([8, 9]))
    assert out.table_version.tolist() == [5, 2] and out.table_version.dtype == np.uint64
