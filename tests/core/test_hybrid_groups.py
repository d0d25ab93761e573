"""KV cache groups through the Python API: ``pagedkv.KVCacheManager`` with ``CacheConfig(groups=...)``.

A hypothesis ``RuleBasedStateMachine`` drives random group layouts (full attention, sliding
window, chunked local, mixed block sizes) through adds with shared prefixes, batched ``step``
calls with appends, forks, frees, recompute and swap preemption and swap-in. A small oracle,
written from docs/design.md ("KV cache groups") and independent of the Rust code, predicts per
sequence the tokens and computed count, and per group which table entries a query can still
read (they must hold real blocks) and which no future query can read (they must be the null
block 0). After every rule: ``check_invariants()``; each step's ``slot_mapping[g]`` equals
``block_table[g][pos // block_size] * block_size + pos % block_size`` for every scheduled token;
``num_blocks_needed`` gives exactly the free-pool change of the next allocation; a failed call
leaves every table and the free count unchanged. Plus the typed errors of bad input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import pagedkv
from pagedkv import CacheConfig, KVCacheGroupSpec, KVCacheManager

LAYOUTS = [
    # Gemma 3-like: five sliding layers per full one.
    ([("full", 4, 8, None), ("sliding_window", 4, 8, 6)], [1, 1, 1, 1, 1, 0]),
    # Llama 4-like: chunked local and full.
    ([("full", 4, 8, None), ("chunked_local", 4, 8, 8)], [1, 1, 1, 0]),
    # Block sizes 4 and 2 with equal pages (hit unit 4).
    ([("full", 4, 4, None), ("sliding_window", 2, 8, 5)], [0, 1]),
    # Three groups.
    ([("full", 2, 8, None), ("sliding_window", 2, 8, 3), ("chunked_local", 2, 8, 6)], [0, 1, 2]),
]


def spec(kind: str, bs: int, bpt: int, span: int | None) -> KVCacheGroupSpec:
    if kind == "sliding_window":
        return KVCacheGroupSpec(kind, bs, bpt, window=span)
    if kind == "chunked_local":
        return KVCacheGroupSpec(kind, bs, bpt, chunk=span)
    return KVCacheGroupSpec(kind, bs, bpt)


def first_read(group: KVCacheGroupSpec, p: int) -> int:
    """The first position a query at ``p`` reads (docs/design.md, "KV cache groups")."""
    if group.kind == "sliding_window":
        assert group.window is not None
        return max(0, p + 1 - group.window)
    if group.kind == "chunked_local":
        assert group.chunk is not None
        return p // group.chunk * group.chunk
    return 0


@dataclass
class Seq:
    tokens: int
    computed: int = 0
    last_context: int = 0
    status: str = "running"


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.seqs: dict[int, Seq] = {}
        self.next_id = 1

    @initialize(
        layout=st.integers(0, len(LAYOUTS) - 1),
        num_blocks=st.integers(10, 48),
        sparse=st.booleans(),
        caching=st.booleans(),
    )
    def setup(self, layout: int, num_blocks: int, sparse: bool, caching: bool) -> None:
        groups, layers = LAYOUTS[layout]
        specs = [spec(*g) for g in groups]
        unit = int(np.lcm.reduce([g.block_size for g in specs]))
        self.m = KVCacheManager(
            CacheConfig(
                num_blocks,
                groups=specs,
                layer_groups=layers,
                enable_prefix_caching=caching,
                retention_interval=2 * unit if sparse else 0,
                num_cpu_blocks=16,
            )
        )
        assert self.m.hit_unit == unit
        self.groups = specs
        self.unit = unit
        self.sparse = sparse and caching

    def prompt(self, family: int, n: int, sid: int) -> list[int]:
        p = [family * 100 + i for i in range(n)]
        if n > 5:
            p[-1] = 10_000 + sid
        return p

    def ids(self) -> list[int]:
        return sorted(self.seqs)

    def pick(self, i: int) -> int | None:
        ids = self.ids()
        return ids[i % len(ids)] if ids else None

    def snapshot(self) -> tuple[int, list[tuple[int, list[list[int]]]]]:
        return self.m.num_free_blocks, [(s, [t.tolist() for t in self.m.block_tables(s)]) for s in self.ids()]

    @rule(family=st.integers(0, 2), n=st.integers(1, 30))
    def add(self, family: int, n: int) -> None:
        sid = self.next_id
        self.next_id += 1
        self.m.add_sequence(sid, self.prompt(family, n, sid))
        self.seqs[sid] = Seq(tokens=n)

    @rule(picks=st.lists(st.integers(0, 99), min_size=1, max_size=3), n=st.integers(1, 12), append=st.booleans())
    def step(self, picks: list[int], n: int, append: bool) -> None:
        chosen: list[int] = []
        for i in picks:
            picked = self.pick(i)
            if picked is not None and picked not in chosen:
                chosen.append(picked)
        if not chosen:
            return
        running = [s for s in chosen if self.seqs[s].status != "swapped"]
        first = running[0] if running else None
        # The first sequence's demand, read before the step, is exact.
        predicted = None
        if first is not None and first == chosen[0] and not append:
            s0 = self.seqs[first]
            if s0.tokens > s0.computed or s0.computed == 0:
                try:
                    predicted = self.m.num_blocks_needed(first, n)
                except pagedkv.InvalidArgumentError:
                    predicted = None
        free0 = self.m.num_free_blocks
        appends = np.full(len(chosen), 3, dtype=np.int64) if append else None
        out = self.m.step(np.array(chosen, dtype=np.uint64), n, appends, block_table=True)
        assert out.num_groups == len(self.groups)
        k = out.num_scheduled
        assert out.seq_ids.tolist() == chosen[:k]
        if k == 0 and out.error is not None:
            assert self.m.num_free_blocks == free0
        if predicted is not None and k >= 1:
            take, release = predicted
            if k == 1:
                assert free0 - self.m.num_free_blocks == take - release
        t = out.num_tokens
        assert out.slot_mappings.shape == (len(self.groups), t)
        assert out.block_tables.shape[:2] == (len(self.groups), k)
        assert out.block_tables.flags["C_CONTIGUOUS"] and out.slot_mappings.flags["C_CONTIGUOUS"]
        qsl = out.query_start_loc
        for j, sid in enumerate(chosen[:k]):
            s = self.seqs[sid]
            if append:
                s.tokens += 1
            ctx = int(out.context_lens[j])
            if s.computed == 0:
                assert ctx == int(out.num_cached_tokens[j]) and ctx % self.m.hit_unit == 0
            else:
                assert ctx == s.computed
            q = int(qsl[j + 1] - qsl[j])
            assert q == min(n, s.tokens - ctx)
            s.computed, s.last_context, s.status = ctx + q, ctx, "running"
            for g, group in enumerate(self.groups):
                bs = group.block_size
                row = out.block_tables[g, j]
                pos = np.arange(ctx, ctx + q)
                want = row[pos // bs].astype(np.int64) * bs + pos % bs
                assert np.array_equal(out.slot_mappings[g, qsl[j] : qsl[j + 1]], want)
                assert (row[pos // bs] != pagedkv.NULL_BLOCK).all()
        if k < len(chosen) and append:
            # The failed sequence kept its tokens as they were.
            failed = chosen[k]
            assert self.m.num_tokens(failed) == self.seqs[failed].tokens

    @rule(i=st.integers(0, 99))
    def fork(self, i: int) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        child = self.next_id
        self.next_id += 1
        if self.seqs[sid].status == "swapped":
            before = self.snapshot()
            with pytest.raises(pagedkv.InvalidSequenceStateError):
                self.m.fork(sid, child)
            assert self.snapshot() == before
            return
        self.m.fork(sid, child)
        p = self.seqs[sid]
        self.seqs[child] = Seq(p.tokens, p.computed, p.last_context, p.status)

    @rule(i=st.integers(0, 99))
    def free(self, i: int) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        assert self.m.free(sid)
        assert not self.m.free(sid)
        del self.seqs[sid]

    @rule(i=st.integers(0, 99))
    def preempt(self, i: int) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        if self.seqs[sid].status == "swapped":
            before = self.snapshot()
            with pytest.raises(pagedkv.InvalidSequenceStateError):
                self.m.preempt([sid])
            assert self.snapshot() == before
            return
        self.m.preempt([sid])
        s = self.seqs[sid]
        s.computed, s.last_context, s.status = 0, 0, "preempted"
        assert self.m.num_blocks_held(sid) == [0] * len(self.groups)

    @rule(i=st.integers(0, 99))
    def swap_out(self, i: int) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        before = self.snapshot()
        held = sum(self.m.num_blocks_held(sid))
        try:
            plan = self.m.swap_out([sid])
        except (pagedkv.InvalidSequenceStateError, pagedkv.OutOfSwapSpaceError):
            assert self.snapshot() == before
            return
        assert plan.shape == (held, 2)
        self.seqs[sid].status = "swapped"

    @rule(i=st.integers(0, 99))
    def swap_in(self, i: int) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        before = self.snapshot()
        owed = self.m.num_blocks_owed([sid])
        try:
            plan = self.m.swap_in([sid])
        except (pagedkv.InvalidSequenceStateError, pagedkv.OutOfBlocksError):
            assert self.snapshot() == before
            return
        assert before[0] - self.m.num_free_blocks == owed == plan.shape[0]
        self.seqs[sid].status = "running"

    @rule(i=st.integers(0, 99))
    def lookup(self, i: int) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        hit = self.m.lookup_prefix(sid)
        assert hit % self.m.hit_unit == 0 and hit < self.m.num_tokens(sid)

    @invariant()
    def tables_follow_the_windows(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        for sid, s in self.seqs.items():
            assert self.m.num_tokens(sid) == s.tokens
            assert self.m.status(sid) == s.status
            if s.status == "swapped":
                continue
            assert self.m.num_computed_tokens(sid) == s.computed
            for group, table in zip(self.groups, self.m.block_tables(sid), strict=True):
                bs = group.block_size
                assert len(table) == -(-s.computed // bs)
                # Entries a query from the last context on can read hold real blocks.
                read_from = first_read(group, s.last_context) // bs
                assert (table[read_from:] != pagedkv.NULL_BLOCK).all()
                if group.kind == "full":
                    assert (table != pagedkv.NULL_BLOCK).all()
                    continue
                # Entries no future query reads are released: before the window of the last
                # context, or with sparse retention of the older of the last two hit-unit
                # boundaries (the latest replayable point).
                keep_at = s.last_context
                if self.sparse:
                    keep_at = max(0, s.last_context // self.unit * self.unit - self.unit)
                assert (table[: first_read(group, keep_at) // bs] == pagedkv.NULL_BLOCK).all()

    def teardown(self) -> None:
        if hasattr(self, "m"):
            for sid in self.ids():
                self.m.free(sid)
            self.m.check_invariants()
            assert self.m.num_free_blocks == self.m.num_blocks - 1


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


def test_bad_group_specs_are_typed_errors() -> None:
    full = KVCacheGroupSpec("full", 4, 8)
    cases: list[Callable[[], Any]] = [
        lambda: KVCacheManager(
            CacheConfig(16, groups=[full, KVCacheGroupSpec("sliding_window", 4, 16, window=4)], layer_groups=[0, 1])
        ),
        lambda: KVCacheManager(
            CacheConfig(16, groups=[KVCacheGroupSpec("sliding_window", 4, 8, window=0)], layer_groups=[0])
        ),
        lambda: KVCacheManager(
            CacheConfig(16, groups=[KVCacheGroupSpec("chunked_local", 4, 8, chunk=0)], layer_groups=[0])
        ),
        lambda: KVCacheManager(CacheConfig(16, groups=[full], layer_groups=[0, 1])),
        lambda: KVCacheManager(CacheConfig(16, groups=[full, full], layer_groups=[0])),
        lambda: KVCacheManager(CacheConfig(16, groups=[], layer_groups=[])),
        lambda: KVCacheManager(CacheConfig(16, groups=[full], layer_groups=[0], retention_interval=6)),
        lambda: KVCacheManager(CacheConfig(1, groups=[full], layer_groups=[0])),
        lambda: KVCacheManager(CacheConfig(16, groups=[full], layer_groups=[0], hash_algo="md5")),
        lambda: KVCacheManager(CacheConfig(16, groups=[full], layer_groups=[0], enable_events=1)),  # type: ignore[arg-type]
        lambda: KVCacheManager(CacheConfig(16, groups=["full"], layer_groups=[0])),  # type: ignore[list-item]
        lambda: KVCacheGroupSpec("sliding_window", 4, 8),
        lambda: KVCacheGroupSpec("full", 4, 8, window=3),
        lambda: KVCacheGroupSpec("global", 4, 8),
        lambda: KVCacheGroupSpec("full", -1, 8),
    ]
    for make in cases:
        with pytest.raises(pagedkv.InvalidConfigError) as info:
            make()
        assert isinstance(info.value, ValueError)


def test_page_sizes_not_block_sizes_must_agree() -> None:
    m = KVCacheManager(
        CacheConfig(
            16,
            groups=[KVCacheGroupSpec("full", 8, 4), KVCacheGroupSpec("sliding_window", 4, 8, window=4)],
            layer_groups=[0, 1],
        )
    )
    assert m.hit_unit == 8
    assert [g.page_bytes for g in m.groups] == [32, 32]


def test_bad_calls_are_typed_and_change_nothing() -> None:
    m = KVCacheManager(
        CacheConfig(
            8,
            groups=[KVCacheGroupSpec("full", 4, 8), KVCacheGroupSpec("sliding_window", 4, 8, window=4)],
            layer_groups=[0, 1],
        )
    )
    m.add_sequence(1, list(range(9)))
    with pytest.raises(pagedkv.SequenceExistsError):
        m.add_sequence(1, [1])
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.add_sequence(2, [])
    with pytest.raises(pagedkv.UnknownSequenceError):
        m.lookup_prefix(5)
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.step([1], [1, 2])
    out = m.step([1, 1], 1, block_table=True)
    assert out.num_scheduled == 0 and isinstance(out.error, pagedkv.InvalidArgumentError)
    # 3 blocks per group for 9 tokens: 6 of the 7 usable pages.
    take, release = m.num_blocks_needed(1, 9)
    assert (take, release) == (6, 0)
    assert m.num_blocks_needed_per_group(1, 9) == [(3, 0), (3, 0)]
    m.add_sequence(2, list(range(100, 120)))
    before = m.num_free_blocks
    out = m.step([1, 2], 20, block_table=True)
    assert out.num_scheduled == 1 and isinstance(out.error, pagedkv.OutOfBlocksError)
    assert before - m.num_free_blocks == 6
    with pytest.raises(pagedkv.OutOfBlocksError):
        out.raise_for_error()
    with pytest.raises(pagedkv.OutOfSwapSpaceError):
        m.swap_out([1])
    m.check_invariants()


def test_step_output_is_zero_copy_to_torch() -> None:
    torch = pytest.importorskip("torch")
    m = KVCacheManager(
        CacheConfig(
            32,
            groups=[KVCacheGroupSpec("full", 4, 8), KVCacheGroupSpec("sliding_window", 4, 8, window=4)],
            layer_groups=[0, 1],
        )
    )
    m.add_sequence(1, list(range(13)))
    out = m.step([1], 13, block_table=True)
    bt = torch.from_numpy(out.block_tables)
    sm = torch.from_numpy(out.slot_mappings)
    assert bt.data_ptr() == out.block_tables.ctypes.data and bt.shape == (2, 1, 4)
    assert sm.data_ptr() == out.slot_mappings.ctypes.data and sm.dtype == torch.int64
    # Decode past the window: the sliding group's released entries read as the null block.
    for _ in range(8):
        out = m.step([1], 1, np.array([7]), block_table=True)
    assert out.block_tables[1, 0, :3].tolist() == [0, 0, 0]
    assert (out.block_tables[0, 0] != 0).all()
    assert m.num_blocks_held(1) == [6, 2]


def test_events_name_the_group() -> None:
    m = KVCacheManager(
        CacheConfig(
            32,
            groups=[KVCacheGroupSpec("full", 4, 8), KVCacheGroupSpec("sliding_window", 4, 8, window=4)],
            layer_groups=[0, 1],
            enable_events=True,
        )
    )
    m.add_sequence(1, list(range(9)))
    m.step([1], 9)
    events = m.take_events()
    stored = [e for e in events if isinstance(e, pagedkv.BlockStored)]
    assert sorted(e.group for e in stored) == [0, 1]
    assert [e.group for e in stored] == [0, 1] and "group=1" in repr(stored[1])
    hashes = {e.group: e.block_hashes for e in stored}
    assert hashes[0] == hashes[1] and len(hashes[0]) == 2
    m.free(1)
    m.reset_prefix_cache()
    events = m.take_events()
    assert [type(e).__name__ for e in events] == ["AllBlocksCleared"]
    assert not hasattr(events[0], "group")


def test_group_batch_tensors_from_steps() -> None:
    torch = pytest.importorskip("torch")
    from pagedkv.tensors import BatchTensors

    m = KVCacheManager(
        CacheConfig(
            64,
            groups=[KVCacheGroupSpec("full", 4, 8), KVCacheGroupSpec("sliding_window", 4, 8, window=4)],
            layer_groups=[0, 1],
        )
    )
    m.add_sequence(1, list(range(10)))
    m.add_sequence(2, list(range(100, 103)))
    running = m.step([1], 10, block_table=True)
    one = BatchTensors.from_steps(running)
    assert one.num_groups == 2
    assert one.block_tables.data_ptr() == running.block_tables.ctypes.data  # no host copy
    assert one.positions.tolist() == list(range(10))
    admitted = m.step([2], 3, block_table=True)
    both = BatchTensors.from_steps([running, admitted], device=None)
    assert both.block_tables.shape == (2, 2, 3)
    assert both.block_tables[:, 0].tolist() == running.block_tables[:, 0].tolist()
    assert both.block_tables[:, 1, :1].tolist() == admitted.block_tables[:, 0].tolist()
    assert (both.block_tables[:, 1, 1:] == 0).all()
    assert both.slot_mappings.shape == (2, 13)
    assert both.slot_mappings[:, 10:].tolist() == admitted.slot_mappings.tolist()
    with pytest.raises(pagedkv.InvalidArgumentError, match="slot_mappings"):
        _ = both.slot_mapping  # several groups: no one-group view
    with pytest.raises(pagedkv.InvalidArgumentError, match="block_tables"):
        _ = both.block_table
    assert both.query_start_loc.tolist() == [0, 10, 13]
    assert both.positions.tolist() == list(range(10)) + [0, 1, 2]
    assert (both.max_query_len, both.max_seq_len) == (10, 10)
    with pytest.raises(pagedkv.InvalidArgumentError):
        BatchTensors.from_steps([running, "not a step"])  # type: ignore[list-item]
    assert isinstance(one.slot_mappings, torch.Tensor)


def test_reset_drops_the_hashes_of_swapped_out_blocks() -> None:
    """issue 22.5 in every KV cache group: a request swapped out across ``reset_prefix_cache``
    comes back with KV that predates the reset, so swap-in neither caches nor announces it, and
    a new request with the same prompt misses; a recompute preemption caches it again."""
    m = KVCacheManager(
        CacheConfig(
            64,
            groups=[KVCacheGroupSpec("full", 4, 8), KVCacheGroupSpec("sliding_window", 4, 8, window=8)],
            layer_groups=[0, 1],
            num_cpu_blocks=32,
            enable_events=True,
        )
    )
    prompt = list(range(1, 19))
    m.add_sequence(1, prompt)
    m.step([1], 18).raise_for_error()
    m.swap_out([1])
    m.reset_prefix_cache()
    assert type(m.take_events()[-1]).__name__ == "AllBlocksCleared"
    m.swap_in([1])
    assert m.take_events() == []
    m.add_sequence(2, prompt)
    assert m.lookup_prefix(2) == 0
    m.append_tokens(1, [90])
    m.step([1], 1).raise_for_error()
    assert m.take_events() == []
    out = m.step([2], 18, block_table=True)
    out.raise_for_error()
    assert out.num_cached_tokens.tolist() == [0]
    m.check_invariants()
    # Recomputed after a preemption: cached again, so a third request hits 16 tokens.
    m.free(2)
    m.preempt([1])
    m.step([1], 100).raise_for_error()
    m.add_sequence(3, prompt)
    assert m.lookup_prefix(3) == 16
    m.check_invariants()


def test_release_skipped_blocks_releases_what_the_window_left_early() -> None:
    """Full + sliding window 8 (block size 4), 20 tokens computed and settled: a query from
    position 20 on reads from 13, so window blocks 0..2 go (tail first) and the full group
    keeps all five; the count is capped at the computed tokens; bad calls are typed and
    change nothing; the next allocations run on the pruned tables."""
    groups = [KVCacheGroupSpec("full", 4, 8), KVCacheGroupSpec("sliding_window", 4, 8, window=8)]
    m = KVCacheManager(CacheConfig(32, groups=groups, layer_groups=[0, 1]))
    m.add_sequence(1, list(range(1, 21)))
    m.allocate_slots(1, 20)
    full, window = (t.tolist() for t in m.block_tables(1))
    free = m.pool.num_free
    released = m.release_skipped_blocks(1, 100)  # capped at the 20 computed tokens
    assert [r.tolist() for r in released] == [[], [window[2], window[1], window[0]]]
    assert [t.tolist() for t in m.block_tables(1)] == [full, [0, 0, 0, *window[3:]]]
    assert m.pool.num_free == free + 3
    assert [r.tolist() for r in m.release_skipped_blocks(1, 12)] == [[], []]  # window of 12 already gone
    m.check_invariants()
    before = [t.tolist() for t in m.block_tables(1)], m.pool.free_queue().tolist()
    for call, cls in (
        (lambda: m.release_skipped_blocks(2, 4), pagedkv.UnknownSequenceError),
        (lambda: m.release_skipped_blocks(1, -1), pagedkv.InvalidArgumentError),
        (lambda: m.release_skipped_blocks(1, 1.5), pagedkv.InvalidArgumentError),
    ):
        with pytest.raises(cls):
            call()
    assert ([t.tolist() for t in m.block_tables(1)], m.pool.free_queue().tolist()) == before
    m.append_tokens(1, [99])
    m.allocate_slots(1, 1)
    assert [t.tolist() for t in m.block_tables(1)][1][:3] == [0, 0, 0] and m.num_computed_tokens(1) == 21
    m.check_invariants()
    m.preempt([1])
    with pytest.raises(pagedkv.InvalidSequenceStateError):
        m.release_skipped_blocks(1, 20)


def test_a_page_over_u64_is_named_as_such() -> None:
    """One group whose page (block_size x bytes_per_token) overflows 64 bits is refused for its
    size, not for a page-size mismatch it cannot have."""
    huge = KVCacheGroupSpec("full", 16, 2**62)
    assert huge.page_bytes is None
    with pytest.raises(pagedkv.InvalidConfigError, match="at most 2\\^64 - 1 bytes") as info:
        CacheConfig(8, groups=[huge], layer_groups=[0])
    assert "same size" not in str(info.value)
