"""Per-group block-table deltas of ``KVCacheManager.step`` and their consumer,
``pagedkv.tensors.BlockTable`` / ``BatchTensors.from_steps(..., block_tables=...)``.

A hypothesis state machine drives random group layouts (the one-group configuration
``CacheConfig(num_blocks, block_size)`` among them: one code path for every layout) through adds with shared prefixes,
batched steps (prefill chunks, decodes with appends, verify steps with drafts then
``accept_drafts`` releasing or keeping the lookahead blocks), forks, frees, recompute and swap
preemption and swap-in. After every step: each (sequence, group) delta applied to a mirror of
its previous table gives the manager's table (window releases arrive as null entries); a
``BlockTable`` fed every output returns exactly the step's dense ``block_table`` (or the
manager's tables when the step skipped it), one fed only some outputs too (it re-reads what it
missed); and ``BatchTensors`` built from the deltas equals the one built from the dense
tables.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv
from pagedkv import CacheConfig, KVCacheGroupSpec, KVCacheManager
from pagedkv.tensors import BatchTensors, BlockTable

LAYOUTS = [
    ([("full", 4, None), ("sliding_window", 4, 6)], [1, 1, 0]),
    ([("full", 4, None), ("chunked_local", 4, 8)], [1, 0]),
    ([("full", 2, None), ("sliding_window", 2, 3), ("sliding_window", 2, 9), ("chunked_local", 2, 6)], [0, 1, 2, 3]),
    None,  # CacheConfig(num_blocks, 4): one full-attention group, the one-group form
]


def spec(kind: str, bs: int, span: int | None) -> KVCacheGroupSpec:
    if kind == "sliding_window":
        return KVCacheGroupSpec(kind, bs, 8, window=span)
    if kind == "chunked_local":
        return KVCacheGroupSpec(kind, bs, 8, chunk=span)
    return KVCacheGroupSpec(kind, bs, 8)


def dense(tables: list[list[np.ndarray]]) -> np.ndarray:
    """``int32[G, S, W]`` from per-sequence per-group tables (W the longest, at least 1)."""
    g = len(tables[0]) if tables else 0
    w = max([len(t) for row in tables for t in row] + [1])
    out = np.zeros((g, len(tables), w), np.int32)
    for k, row in enumerate(tables):
        for x, t in enumerate(row):
            out[x, k, : len(t)] = t
    return out


class TableDeltas(RuleBasedStateMachine):
    @initialize(layout=st.sampled_from(LAYOUTS), num_blocks=st.integers(24, 80), retention=st.sampled_from([0, 4]))
    def setup(self, layout, num_blocks: int, retention: int) -> None:
        unit = 4
        if layout is None:
            self.m = KVCacheManager(CacheConfig(num_blocks, 4, retention_interval=retention, num_cpu_blocks=64))
        else:
            groups, layers = layout
            self.m = KVCacheManager(
                CacheConfig(
                    num_blocks,
                    groups=[spec(*g) for g in groups],
                    layer_groups=layers,
                    retention_interval=retention if retention % unit == 0 else 0,
                    num_cpu_blocks=64,
                )
            )
        self.g = self.m.num_groups
        self.mirror: dict[int, tuple[int, list[np.ndarray]]] = {}  # seq -> (version, tables)
        self.every = BlockTable(self.m, rows=1, width=1)
        self.some = BlockTable(self.m, rows=2, width=3)
        self.seqs: set[int] = set()
        self.next_id = 0
        self.drafted: set[int] = set()
        for length in (5, 17, 30):  # a few sequences to start with, so most rules act
            self.add(length, True)

    def _status(self, s: int) -> str:
        return self.m.status(s)

    @rule(length=st.integers(1, 30), shared=st.booleans())
    def add_sequence(self, length: int, shared: bool) -> None:
        self.add(length, shared)

    def add(self, length: int, shared: bool) -> None:
        prompt = [7] * min(length, 12) + list(range(self.next_id * 100, self.next_id * 100 + length))
        if not shared:
            prompt = prompt[12:] or [1]
        self.m.add_sequence(self.next_id, prompt[:length] if shared else prompt)
        self.seqs.add(self.next_id)
        self.next_id += 1

    def _check_step(self, out: pagedkv.StepOutput, dense_on: bool, fed_some: bool) -> None:
        s, g = out.num_scheduled, self.g
        ids = out.seq_ids.tolist()
        assert out.table_start.shape == (s, g)
        assert out.table_delta_indptr.shape == (s * g + 1,)
        for k, sid in enumerate(ids):
            version, old = self.mirror.get(sid, (0, [np.zeros(0, np.int32)] * g))
            new = []
            for x in range(g):
                a, b = out.table_delta_indptr[k * g + x], out.table_delta_indptr[k * g + x + 1]
                start = int(out.table_start[k, x])
                if version + 1 != int(out.table_version[k]):
                    assert start == 0, "a sequence new to the outputs reports its tables whole"
                assert start <= len(old[x])
                new.append(np.concatenate([old[x][:start], out.table_delta[a:b]]).astype(np.int32))
            truth = self.m.block_tables(sid)
            for x in range(g):
                np.testing.assert_array_equal(new[x], truth[x])
            self.mirror[sid] = (int(out.table_version[k]), new)
        want = dense([self.m.block_tables(sid) for sid in ids])
        if dense_on:
            np.testing.assert_array_equal(out.block_tables, want)
        got = self.every.update(out)
        np.testing.assert_array_equal(got, want)
        if fed_some:
            np.testing.assert_array_equal(self.some.update(out), want)
        if dense_on and out.slot_mappings.shape[1] == out.num_tokens:
            a = BatchTensors.from_steps(out, None)
            b = BatchTensors.from_steps(out, None, block_tables=self.some if fed_some else BlockTable(self.m))
            np.testing.assert_array_equal(a.block_tables, b.block_tables)
            np.testing.assert_array_equal(a.slot_mappings, b.slot_mappings)
            np.testing.assert_array_equal(a.positions, b.positions)

    @rule(
        data=st.data(),
        n=st.integers(1, 12),
        dense_on=st.booleans(),
        tokens=st.booleans(),
        fed_some=st.booleans(),
    )
    def step(self, data, n: int, dense_on: bool, tokens: bool, fed_some: bool) -> None:
        live = sorted(s for s in self.seqs if self._status(s) != "swapped" and s not in self.drafted)
        if not live:
            return
        batch = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4, unique=True))
        appends = []
        for s in batch:
            done = self.m.num_computed_tokens(s) == self.m.num_tokens(s)
            appends.append([s % 50 + 3] if done else [])
        out = self.m.step(batch, n, appends, block_table=dense_on, token_arrays=tokens or dense_on)
        if out.num_scheduled:
            self._check_step(out, dense_on, fed_some)

    @rule(data=st.data(), k=st.integers(1, 3))
    def verify_drafts(self, data, k: int) -> None:
        live = sorted(
            s
            for s in self.seqs
            if self._status(s) != "swapped"
            and s not in self.drafted
            and self.m.num_computed_tokens(s) == self.m.num_tokens(s)
        )
        if not live:
            return
        s = data.draw(st.sampled_from(live))
        out = self.m.step([s], 1, [[5]], draft_token_ids=[[9] * k], block_table=True)
        if out.num_scheduled:
            self.drafted.add(s)
            self._check_step(out, True, True)

    @precondition(lambda self: bool(getattr(self, "drafted", None)))
    @rule(data=st.data(), release=st.booleans())
    def accept(self, data, release: bool) -> None:
        s = data.draw(st.sampled_from(sorted(self.drafted)))
        k = self.m.num_draft_tokens(s)
        self.m.accept_drafts(s, data.draw(st.integers(0, k)), release_blocks=release)
        self.drafted.discard(s)

    @rule(data=st.data())
    def fork(self, data) -> None:
        live = sorted(s for s in self.seqs if self._status(s) != "swapped" and s not in self.drafted)
        if live:
            self.m.fork(data.draw(st.sampled_from(live)), self.next_id)
            self.seqs.add(self.next_id)
            self.next_id += 1

    @rule(data=st.data())
    def free(self, data) -> None:
        if self.seqs:
            s = data.draw(st.sampled_from(sorted(self.seqs)))
            self.m.free(s)
            self.seqs.discard(s)
            self.drafted.discard(s)
            self.mirror.pop(s, None)

    @rule(data=st.data())
    def preempt(self, data) -> None:
        live = sorted(s for s in self.seqs if self._status(s) != "swapped")
        if live:
            s = data.draw(st.sampled_from(live))
            self.m.preempt([s])
            self.drafted.discard(s)

    @rule(data=st.data())
    def swap(self, data) -> None:
        running = sorted(s for s in self.seqs if self._status(s) == "running" and s not in self.drafted)
        swapped = sorted(s for s in self.seqs if self._status(s) == "swapped")
        if running and data.draw(st.booleans()):
            try:
                self.m.swap_out([data.draw(st.sampled_from(running))])
            except pagedkv.OutOfSwapSpaceError:
                pass
        elif swapped:
            try:
                self.m.swap_in([data.draw(st.sampled_from(swapped))])
            except pagedkv.OutOfBlocksError:
                pass

    @invariant()
    def invariants(self) -> None:
        if hasattr(self, "m"):
            self.m.check_invariants()


TableDeltas.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
test_table_deltas = TableDeltas.TestCase


def test_decode_delta_is_the_new_block_and_a_release_nulls_its_entries() -> None:
    """Gemma-like pair (full + window 32, block 16): a decode step that fills no block reports
    nothing; one that crosses into a new block reports that block; the step whose context
    leaves a window block reports the released entries as 0 from the first released on."""
    m = KVCacheManager(
        CacheConfig(
            64,
            groups=[KVCacheGroupSpec("full", 16, 8), KVCacheGroupSpec("sliding_window", 16, 8, window=32)],
            layer_groups=[0, 1],
        )
    )
    m.add_sequence(1, list(range(64)))
    first = m.step([1], 64, block_table=False, token_arrays=False)
    assert first.table_start.tolist() == [[0, 0]]
    assert first.block_tables.shape == (2, 1, 0) and first.slot_mappings.shape == (2, 0)
    np.testing.assert_array_equal(first.table_delta, np.concatenate(m.block_tables(1)))
    out = m.step([1], 1, np.array([5]), block_table=False)
    # the decode at position 64 needs block 4 in both groups; the window (33..64] released block 0 and 1
    full, win = m.block_tables(1)
    assert out.table_start.tolist() == [[4, 0]]
    assert out.table_delta.tolist() == [int(full[4])] + [0, 0] + [int(b) for b in win[2:]]
    assert out.table_version.tolist() == [first.table_version[0] + 1]
    quiet = m.step([1], 1, np.array([6]), block_table=False)
    assert quiet.table_start.tolist() == [[5, 5]] and quiet.table_delta.size == 0


def test_flags_are_typed() -> None:
    m = KVCacheManager(CacheConfig(8, groups=[KVCacheGroupSpec("full", 4, 8)], layer_groups=[0]))
    m.add_sequence(1, [1, 2, 3])
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.step([1], 3, block_table=0)
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.step([1], 3, token_arrays="no")
    assert m.num_computed_tokens(1) == 0  # nothing done


def test_from_steps_refuses_a_step_without_what_it_needs() -> None:
    m = KVCacheManager(CacheConfig(8, groups=[KVCacheGroupSpec("full", 4, 8)], layer_groups=[0]))
    m.add_sequence(1, [1, 2, 3])
    out = m.step([1], 3, block_table=False)
    with pytest.raises(pagedkv.InvalidArgumentError, match="block_tables"):
        BatchTensors.from_steps(out, None)
    bt = BatchTensors.from_steps(out, None, block_tables=BlockTable(m))
    np.testing.assert_array_equal(bt.block_tables[0, 0], m.block_tables(1)[0])
    m.add_sequence(2, [1, 2, 3])
    no_tokens = m.step([2], 3, token_arrays=False)
    with pytest.raises(pagedkv.InvalidArgumentError, match="token_arrays"):
        BatchTensors.from_steps(no_tokens, None)


def test_reserve_blocks_is_an_admission_watermark() -> None:
    """``step(reserve_blocks=k)`` schedules a sequence exactly when ``take + k <= free +
    release`` (``num_blocks_needed``'s figures); a refusal is an ``OutOfBlocksError`` in
    ``error`` counting the reserve, with nothing changed."""
    groups = [KVCacheGroupSpec("full", 4, 8), KVCacheGroupSpec("sliding_window", 4, 8, window=6)]
    m = KVCacheManager(CacheConfig(21, groups=groups, layer_groups=[0, 1]))  # 20 usable blocks
    m.add_sequence(1, list(range(40)))
    take, release = m.num_blocks_needed(1, 40)
    free = m.num_free_blocks
    assert (take, release, free) == (20, 0, 20)
    out = m.step([1], 40, reserve_blocks=1)
    assert out.num_scheduled == 0
    assert isinstance(out.error, pagedkv.OutOfBlocksError)
    assert "21" in str(out.error) and "20" in str(out.error)  # requested take + reserve, available
    assert m.num_computed_tokens(1) == 0 and m.num_free_blocks == free
    m.check_invariants()
    out = m.step([1], 40, reserve_blocks=0)
    assert out.num_scheduled == 1 and m.num_free_blocks == 0
    # A chunk whose releases pay for it passes the same watermark.
    m2 = KVCacheManager(CacheConfig(41, groups=groups, layer_groups=[0, 1]))
    m2.add_sequence(1, list(range(80)))
    m2.step([1], 40)
    take, release = m2.num_blocks_needed(1, 8)
    k = m2.num_free_blocks + release - take
    assert release > 0 and k >= 0
    refused = m2.step([1], 8, reserve_blocks=k + 1)
    assert refused.num_scheduled == 0 and isinstance(refused.error, pagedkv.OutOfBlocksError)
    assert m2.step([1], 8, reserve_blocks=k).num_scheduled == 1
    with pytest.raises(pagedkv.InvalidArgumentError):
        m2.step([1], 8, reserve_blocks=-1)


def _gemma_like() -> KVCacheManager:
    """Full attention and a sliding window of 8 tokens, block size 4."""
    return KVCacheManager(
        CacheConfig(
            64,
            groups=[KVCacheGroupSpec("full", 4, 8), KVCacheGroupSpec("sliding_window", 4, 8, window=8)],
            layer_groups=[0, 1],
        )
    )


def test_block_table_keeps_every_group_from_the_deltas_in_one_buffer() -> None:
    """``BlockTable`` over a manager of two groups: ``int32[G, S, W]`` equal to the steps'
    dense tables, decode deltas applied without reading a table, rows following the batch
    order, and the same array object while the batch keeps its shape."""
    m = _gemma_like()
    tables = BlockTable(m, rows=1, width=1)
    assert (tables.num_groups, tables.num_rows) == (2, 0)
    for s in (1, 2, 3):
        m.add_sequence(s, list(range(s * 10, s * 10 + 4 * s)))
    out = m.step([1, 2, 3], [4, 8, 12], block_table=True)
    np.testing.assert_array_equal(tables.update(out), out.block_tables)
    views = []
    for i in range(10):
        batch = [1, 2, 3] if i % 4 else [3, 1, 2]
        out = m.step(batch, 1, [[7]] * 3, block_table=True)
        got = tables.update(out)
        np.testing.assert_array_equal(got, out.block_tables)
        views.append(got)
    assert tables.num_table_reads == 0 and tables.num_rows == 3
    assert (views[-1][1] == 0).any(), "the window released blocks: null entries applied"
    # 10 steps of one token from 4..12 tokens: the shape held over the last two steps
    assert views[-1] is views[-2] or views[-1].shape != views[-2].shape
    assert "num_groups=2" in repr(tables)


def test_block_table_refuses_outputs_of_another_group_count() -> None:
    """A ``BlockTable`` takes ``StepOutput`` s of its manager's group count only; each refusal
    is an ``InvalidArgumentError`` and changes nothing."""
    m = _gemma_like()
    one = pagedkv.KVCacheManager(pagedkv.CacheConfig(16, 4))
    three = KVCacheManager(
        CacheConfig(
            64,
            groups=[KVCacheGroupSpec("full", 4, 8), KVCacheGroupSpec("sliding_window", 4, 8, window=8)] * 1
            + [KVCacheGroupSpec("chunked_local", 4, 8, chunk=8)],
            layer_groups=[0, 1, 2],
        )
    )
    for mgr in (m, one, three):
        mgr.add_sequence(1, [1, 2, 3, 4, 5])
    hybrid_out, one_out, three_out = (
        m.step([1], 5, block_table=True),
        one.step(np.array([1], np.uint64), 5),
        three.step([1], 5),
    )
    group_tables, one_tables = BlockTable(m), BlockTable(one)
    with pytest.raises(pagedkv.InvalidArgumentError, match="1 groups; the manager has 2"):
        group_tables.update(one_out)
    with pytest.raises(pagedkv.InvalidArgumentError, match="2 groups; the manager has 1"):
        one_tables.update(hybrid_out)
    with pytest.raises(pagedkv.InvalidArgumentError, match="expected a pagedkv.StepOutput"):
        one_tables.update(["not a step output"])  # type: ignore[list-item]
    with pytest.raises(pagedkv.InvalidArgumentError, match="3 groups; the manager has 2"):
        group_tables.update([hybrid_out, three_out])
    with pytest.raises(pagedkv.InvalidArgumentError, match="expected a pagedkv.KVCacheManager"):
        BlockTable(object())  # type: ignore[arg-type]
    assert (group_tables.num_rows, one_tables.num_rows) == (0, 0)
    # nothing changed: the real outputs still apply
    np.testing.assert_array_equal(group_tables.update(hybrid_out), hybrid_out.block_tables)
    assert one_tables.update(one_out).tolist() == [[one.block_table(1).tolist()]]


def test_batch_tensors_from_a_hybrid_keeper_equal_the_dense_path() -> None:
    """``BatchTensors.from_steps`` with a hybrid ``BlockTable`` (steps made with
    ``block_table=False``) gives the same kernel inputs as from the dense tables, with a group
    axis; the torch tensor of the tables is reused while the batch keeps its shape."""
    torch = pytest.importorskip("torch")
    dense_m, kept_m = _gemma_like(), _gemma_like()
    tables = BlockTable(kept_m)
    for mgr in (dense_m, kept_m):
        mgr.add_sequence(1, list(range(9)))
        mgr.add_sequence(2, list(range(100, 105)))
    prev, reused = None, 0
    for i in range(6):
        n, appends = ([9, 5], None) if i == 0 else (1, [[3], [4]])
        dense_out = dense_m.step([1, 2], n, appends, block_table=True)
        kept_out = kept_m.step([1, 2], n, appends, block_table=False)
        a = BatchTensors.from_steps(dense_out, None)  # numpy: the CPU tensors' mover untouched
        b = BatchTensors.from_steps(kept_out, "cpu", block_tables=tables)
        assert b.num_groups == a.num_groups == 2 and b.block_tables.dtype == torch.int32
        np.testing.assert_array_equal(a.block_tables, b.block_tables.numpy())
        np.testing.assert_array_equal(a.slot_mappings, b.slot_mappings.numpy())
        np.testing.assert_array_equal(a.positions, b.positions.numpy())
        if prev is not None and prev.block_tables.shape == b.block_tables.shape:
            assert b.block_tables is prev.block_tables
            reused += 1
        prev = b
    assert reused >= 2
    with pytest.raises(pagedkv.InvalidArgumentError, match="block_tables"):
        _ = b.block_table


def test_one_group_batch_tensors_have_the_group_axis_as_views() -> None:
    """A ``KVCacheManager``'s ``BatchTensors``: ``block_tables`` ``[1, S, W]`` and
    ``slot_mappings`` ``[1, T]`` share memory with ``block_table`` / ``slot_mapping``."""
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(32, 4))
    tables = BlockTable(m)
    m.add_sequence(1, list(range(6)))
    bt = BatchTensors.from_steps(m.step(np.array([1], np.uint64), 6), None, block_tables=tables)
    assert bt.num_groups == 1 and bt.block_tables.shape == (1, 1, 2) and bt.slot_mappings.shape == (1, 6)
    assert np.shares_memory(bt.block_tables, bt.block_table) and np.shares_memory(bt.slot_mappings, bt.slot_mapping)
    assert bt.block_table.tolist() == [m.block_table(1).tolist()]
    assert bt.slot_mappings[0].tolist() == bt.slot_mapping.tolist()
