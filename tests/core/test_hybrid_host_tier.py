"""Stateful property test of the host tier under KV cache groups, with a simulated executor.

The one-group machine of tests/core/test_host_tier_state_machine.py (its rules: adds with shared
prefixes and cache salts, single and batched steps with appends, whole requests served one
after another, frees, recompute and swap preemption, swap-ins, resets, empty steps) drives a
``pagedkv.KVCacheManager`` through the group-shaped executor instead: a full-attention group
and a sliding-window or chunked-local group (tests/core/test_hybrid_groups.py's layouts), or the
one-group ``CacheConfig(num_blocks, block_size)``, over a small device pool, a small
host tier (LRU or ARC) and dense or sparse retention. The executor model keeps, per group
cache and per block, the token prefix (and salt) whose KV it holds, and runs each step
output in the executor's order: host stores ``(group, device, host)``, the swaps since the
previous step (every group's cache), host loads ``(group, host, device)``, copy-on-write
copies, then the forward pass. After each step, every block a scheduled sequence's query
reads in each group (full attention: all of its table; a window: from the window of its
first query token on) must hold exactly that sequence's own prefix. Also: a single-sequence
step takes exactly ``num_blocks_needed`` (take - release) and succeeds whenever it fits;
``lookup_prefix`` predicts a first allocation's cached tokens; a failed step changes nothing;
events keep set semantics per (tier, group); ``check_invariants`` after every rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule
from test_host_tier_state_machine import HostTierMachine
from test_hybrid_groups import first_read, spec

import pagedkv
from pagedkv import errors as E

LAYOUTS = [
    ([("full", 4, 8, None), ("sliding_window", 4, 8, 6)], [1, 1, 0]),
    ([("full", 4, 8, None), ("sliding_window", 4, 8, 9)], [1, 0]),
    ([("full", 4, 8, None), ("chunked_local", 4, 8, 8)], [1, 0]),
    None,  # CacheConfig(num_blocks, 4): the one-group form through the group-shaped executor
]


class HybridHostTierMachine(HostTierMachine):
    """The one-group host-tier machine over KV cache groups (per-group KV model)."""

    @initialize(
        layout=st.sampled_from(LAYOUTS),
        num_blocks=st.integers(5, 14),
        num_host=st.integers(1, 10),
        min_seen=st.sampled_from([1, 1, 2]),
        events=st.booleans(),
        eviction=st.sampled_from(["lru", "arc"]),
        retention=st.sampled_from([0, 0, 8]),
    )
    def setup(  # type: ignore[override]
        self,
        layout: tuple[list[tuple[str, int, int, int | None]], list[int]] | None,
        num_blocks: int,
        num_host: int,
        min_seen: int,
        events: bool,
        eviction: str,
        retention: int,
    ) -> None:
        shape: dict[str, Any] = {"block_size": 4}
        if layout is not None:
            groups, layers = layout
            shape = {"groups": [spec(*g) for g in groups], "layer_groups": layers}
        cfg = pagedkv.CacheConfig(
            num_blocks,
            **shape,
            retention_interval=retention,
            num_cpu_blocks=6,
            num_host_blocks=num_host,
            host_admission_min_seen=min_seen,
            host_eviction=eviction,
            enable_events=events,
        )
        self.m = pagedkv.KVCacheManager(cfg)
        self.groups = self.m.groups
        self.salt: dict[int, Any] = {}
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0
        # (group, block) -> content, per tier.
        self.device: dict[Any, Any] = {}
        self.host: dict[Any, Any] = {}
        self.cpu: dict[Any, Any] = {}
        self.swaps: list[tuple[str, int, int]] = []
        self.resolvable: dict[Any, set[bytes]] = {}

    def snapshot(self) -> tuple[Any, ...]:
        m = self.m
        return (
            m.stats(),
            m.num_free_blocks,
            [(i, m.status(i), [t.tolist() for t in m.block_tables(i)], m.num_computed_tokens(i)) for i in self.ids()],
        )

    # -- the simulated executor, per group cache -------------------------------------------

    def run(self, out: Any, seq_ids: list[int]) -> None:
        none = (None, ())
        for g, d, h in out.host_stores.tolist():
            self.host[g, h] = self.device.get((g, d), none)
        ng = len(self.groups)
        for kind, a, b in self.swaps:
            for g in range(ng):
                if kind == "out":
                    self.cpu[g, b] = self.device.get((g, a), none)
                else:
                    self.device[g, b] = self.cpu.get((g, a), none)
        self.swaps = []
        for g, h, d in out.host_loads.tolist():
            self.device[g, d] = self.host.get((g, h), none)
        for g, src, dst in out.copies.tolist():
            self.device[g, dst] = self.device.get((g, src), none)
        m = self.m
        for k in range(out.num_scheduled):
            seq = seq_ids[k]
            ctx, end = int(out.context_lens[k]), int(out.seq_lens[k])
            tokens = tuple(self.tokens[seq])
            salt = self.salt[seq]
            for g, (grp, table) in enumerate(zip(self.groups, m.block_tables(seq), strict=True)):
                bs = grp.block_size
                table = table.tolist()
                for j in range(ctx // bs, (end - 1) // bs + 1):
                    self.device[g, table[j]] = (salt, tokens[: min(end, (j + 1) * bs)])
                # Every block the query reads in this group holds this sequence's own prefix.
                for j in range(first_read(grp, ctx) // bs, (end - 1) // bs + 1):
                    want = (salt, tokens[: min(end, (j + 1) * bs)])
                    got = self.device.get((g, table[j]))
                    assert table[j] != 0 and got == want, (seq, g, j, table[j], got, want)

    def drain_events(self) -> None:
        for e in self.m.take_events():
            if isinstance(e, pagedkv.AllBlocksCleared):
                self.resolvable = {}
                continue
            got = self.resolvable.setdefault((e.tier, e.group), set())
            for h in e.block_hashes:
                if isinstance(e, pagedkv.BlockStored):
                    assert h not in got, "BlockStored twice while resolvable"
                    got.add(h)
                else:
                    assert h in got, "BlockRemoved of a hash that was not resolvable"
                    got.discard(h)

    # -- rules whose calls differ from the one-group manager's -------------------------------

    @rule(
        prompt=st.tuples(
            st.sampled_from([0, 0, 1, 2]),
            st.sampled_from([1, 5, 9, 12, 16, 17, 20]),
            st.lists(st.integers(0, 3), max_size=3),
            st.sampled_from((None, None, "t")),
        )
    )
    def add(self, prompt: tuple[int, int, list[int], Any]) -> None:
        super().add(prompt)
        i = self.next_id - 1
        family, cut, tail, _ = prompt
        self.tokens[i] = [100 * (family + 1) + t for t in range(20)][:cut] + [7 + t for t in tail]

    @precondition(lambda self: bool(self.salt))
    @rule(data=st.data(), n=st.integers(1, 12), appended=st.lists(st.integers(0, 3), max_size=2))
    def step_one(self, data: st.DataObject, n: int, appended: list[int]) -> None:
        m = self.m
        i = data.draw(st.sampled_from(self.ids()))
        if m.status(i) == "swapped":
            return
        if appended:
            m.append_tokens(i, [9 + t for t in appended])
            self.tokens[i] += [9 + t for t in appended]
        first = m.num_computed_tokens(i) == 0 and all(len(t) == 0 for t in m.block_tables(i))
        try:
            take, release = m.num_blocks_needed(i, n)
        except E.InvalidArgumentError:
            return  # nothing left to compute
        lookup = m.lookup_prefix(i) if first else 0
        # All of its uncomputed tokens at once: num_blocks_owed of one member is exact.
        t_all, r_all = m.num_blocks_needed(i, int(m.num_uncomputed_tokens([i])[0]))
        assert m.num_blocks_owed([i]) == max(0, t_all - r_all)
        before = self.snapshot()
        free = m.num_free_blocks
        out = m.step([i], [n])
        if out.error is not None:
            assert isinstance(out.error, E.OutOfBlocksError), out.error
            assert take > free + release, (take, release, free)
            assert self.snapshot()[1:] == before[1:]
            self.run(out, [])
            return
        assert free - m.num_free_blocks == take - release
        if first:
            assert int(out.num_cached_tokens[0]) == lookup
        self.run(out, [i])

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        m = self.m
        for i in self.ids():
            assert m.free(i)
        m.step([], [])
        m.step([], [])  # hands out and then releases every load: nothing pinned or held
        m.check_invariants()
        assert m.num_free_blocks == m.num_blocks - 1
        m.reset_prefix_cache()
        assert m.stats().host_used == 0
        assert np.asarray(m.take_host_transfers()[1]).shape == (0, 3)


TestHybridHostTierStateMachine = HybridHostTierMachine.TestCase


def test_a_multi_turn_conversation_is_served_from_the_host_tier() -> None:
    """A conversation whose earlier turn the device evicted: its blocks come back as loads of
    both groups (the window group's only for its window), every one into the block the new
    turn's table names, and the host figures count them."""
    g = [spec("full", 4, 8, None), spec("sliding_window", 4, 8, 6)]
    m = pagedkv.KVCacheManager(
        pagedkv.CacheConfig(9, groups=g, layer_groups=[1, 0], num_host_blocks=16, host_admission_min_seen=1)
    )
    turn = list(range(1, 14))
    m.add_sequence(1, turn)
    m.step([1], [13])
    m.free(1)
    m.add_sequence(2, list(range(50, 63)))
    stores = m.step([2], [13]).host_stores
    m.free(2)
    assert sorted(stores[:, 0].tolist()) == [0, 0, 0, 1, 1, 1]
    m.add_sequence(3, turn + [99, 98])
    out = m.step([3], [15])
    assert int(out.num_cached_tokens[0]) == 12
    loads = out.host_loads.tolist()
    tables = m.block_tables(3)
    # Full attention: blocks 0-2; the window of 6 at position 12 reads from position 7 on:
    # blocks 1 and 2 (ceil((6 - 1) / 4) = 2), block 0 stays on host.
    assert [(gr, d) for gr, _, d in loads] == [
        (0, tables[0][0]),
        (0, tables[0][1]),
        (0, tables[0][2]),
        (1, tables[1][1]),
        (1, tables[1][2]),
    ]
    assert tables[1][0] == 0
    s = m.stats()
    assert (s.host_loads_blocks, s.host_hits_tokens, s.prefix_hits_tokens) == (5, 12, 12)
    m.check_invariants()
