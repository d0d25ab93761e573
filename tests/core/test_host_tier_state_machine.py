"""Stateful property test of the prefix cache's host tier, with a simulated executor.

A hypothesis ``RuleBasedStateMachine`` drives a ``pagedkv.KVCacheManager`` with a small device
pool, a small host tier (LRU or ARC eviction) and a few CPU swap blocks through random adds (prompts that share
block-aligned prefixes, with or without a cache salt), single and batched steps with appended
tokens, frees, recompute and swap preemption, swap-ins, prefix-cache resets and empty steps.

Besides ``check_invariants()`` after every rule (docs/design.md, "Invariants", 1-4 and 9:
host index <-> host blocks, pins only on blocks being loaded, no block free and mapped), it
runs every step output the way an executor must (docs/design.md, "Host tier"): host stores,
the swap-outs and swap-ins since the previous step, host loads, copy-on-write copies, then
the forward pass writing the scheduled tokens' KV, on a model of the KV memory where each
device, host and CPU block holds the token prefix (and cache salt) whose KV it contains.
After each step, every block of every scheduled sequence's table must hold exactly that
sequence's prefix: a prefix hit served from the device or loaded from the host that put
another prompt's KV (or stale KV) in front of the model fails it. It also checks that a step
that fails leaves the stats, the free queue and the block tables unchanged, that the blocks a
single-sequence step takes equal ``num_blocks_needed``'s prediction and that such a step
succeeds whenever the prediction fits the free pool (so nothing waits while it could run),
and that ``lookup_prefix`` predicts the cached tokens of a first allocation.

Profiles: ``HYPOTHESIS_PROFILE=ci`` (default) or ``long`` (tests/conftest.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv
from pagedkv import errors as E

BS = 4
FAMILY = {f: [100 * (f + 1) + i for i in range(20)] for f in range(3)}
# Few families and mostly long cuts, so prefixes come back after the device evicted them.
PROMPTS = st.tuples(
    st.sampled_from([0, 0, 1, 2]),
    st.sampled_from([1, 5, 9, 12, 16, 17, 20]),
    st.lists(st.integers(0, 3), max_size=3),
    st.sampled_from((None, None, "t")),
)

Content = tuple[Any, tuple[int, ...]]  # (cache salt, token prefix whose KV a block holds)


class HostTierMachine(RuleBasedStateMachine):
    """Manager + a model of the KV bytes each block holds, moved as the executor would."""

    m: pagedkv.KVCacheManager

    @initialize(
        num_blocks=st.integers(4, 10),
        num_host=st.integers(1, 8),
        min_seen=st.sampled_from([1, 1, 2, 3]),
        events=st.booleans(),
        eviction=st.sampled_from(["lru", "arc"]),
    )
    def setup(self, num_blocks: int, num_host: int, min_seen: int, events: bool, eviction: str) -> None:
        cfg = pagedkv.CacheConfig(
            num_blocks,
            BS,
            num_cpu_blocks=4,
            num_host_blocks=num_host,
            host_admission_min_seen=min_seen,
            host_eviction=eviction,
            enable_events=events,
        )
        self.m = pagedkv.KVCacheManager(cfg)
        self.salt: dict[int, Any] = {}
        self.next_id = 0
        self.device: dict[int, Content] = {}
        self.host: dict[int, Content] = {}
        self.cpu: dict[int, Content] = {}
        # Swap plans since the previous step, in call order: ("out", gpu, cpu) / ("in", cpu, gpu).
        self.swaps: list[tuple[str, int, int]] = []
        # Hash -> resolvable per tier, from the events (set semantics per tier).
        self.resolvable: dict[str, set[bytes]] = {"device": set(), "host": set()}

    def ids(self) -> list[int]:
        return sorted(self.salt)

    def snapshot(self) -> tuple[Any, ...]:
        m = self.m
        return (
            m.stats(),
            m.pool.free_queue().tolist(),
            [(i, m.status(i), m.block_table(i).tolist(), m.num_computed_tokens(i)) for i in self.ids()],
        )

    # -- the simulated executor ----------------------------------------------------------

    def run(self, out: pagedkv.StepOutput, seq_ids: list[int]) -> None:
        """Runs a step output's plans in the executor's order (host stores, the swaps since
        the previous step in call order, host loads, copies, forward), then checks the KV
        model."""
        for g, d, h in out.host_stores.tolist():
            assert g == 0  # one group
            self.host[h] = self.device.get(d, (None, ()))
        for kind, a, b in self.swaps:
            if kind == "out":
                self.cpu[b] = self.device.get(a, (None, ()))
            else:
                self.device[b] = self.cpu.get(a, (None, ()))
        self.swaps = []
        for g, h, d in out.host_loads.tolist():
            assert g == 0
            self.device[d] = self.host.get(h, (None, ()))
        for g, src, dst in out.copies.tolist():
            assert g == 0
            self.device[dst] = self.device.get(src, (None, ()))
        m = self.m
        for k in range(out.num_scheduled):
            seq = seq_ids[k]
            ctx, end = int(out.context_lens[k]), int(out.seq_lens[k])
            table = m.block_table(seq).tolist()
            tokens = tuple(m.token_ids(seq).tolist())
            salt = self.salt[seq]
            for j in range(ctx // BS, (end - 1) // BS + 1):
                self.device[table[j]] = (salt, tokens[: min(end, (j + 1) * BS)])
            # Every block the model reads this step holds this sequence's own prefix.
            for j in range((end - 1) // BS + 1):
                want = (salt, tokens[: min(end, (j + 1) * BS)])
                assert self.device.get(table[j]) == want, (seq, j, table[j], self.device.get(table[j]), want)

    def drain_events(self) -> None:
        for e in self.m.take_events():
            if isinstance(e, pagedkv.AllBlocksCleared):
                self.resolvable = {"device": set(), "host": set()}
                continue
            assert e.group == 0  # one group
            got = self.resolvable[e.tier]
            for h in e.block_hashes:
                if isinstance(e, pagedkv.BlockStored):
                    assert h not in got, "BlockStored twice while resolvable"
                    got.add(h)
                else:
                    assert h in got, "BlockRemoved of a hash that was not resolvable"
                    got.discard(h)

    # -- rules ---------------------------------------------------------------------------

    @rule(prompt=PROMPTS)
    def add(self, prompt: tuple[int, int, list[int], Any]) -> None:
        family, cut, tail, salt = prompt
        tokens = FAMILY[family][:cut] + [7 + t for t in tail]
        i = self.next_id
        self.next_id += 1
        self.m.add_sequence(i, tokens, cache_salt=salt)
        self.salt[i] = salt

    @precondition(lambda self: bool(self.salt))
    @rule(data=st.data(), n=st.integers(1, 12), appended=st.lists(st.integers(0, 3), max_size=2))
    def step_one(self, data: st.DataObject, n: int, appended: list[int]) -> None:
        m = self.m
        i = data.draw(st.sampled_from(self.ids()))
        if m.status(i) == "swapped":
            return
        if appended:
            m.append_tokens(i, [9 + t for t in appended])
        first = m.num_computed_tokens(i) == 0 and len(m.block_table(i)) == 0
        try:
            predicted, release = m.num_blocks_needed(i, n)
        except E.InvalidArgumentError:
            return  # nothing left to compute
        assert release == 0  # a full-attention group releases nothing
        lookup = m.lookup_prefix(i) if first else 0
        before = self.snapshot()
        free = m.stats().free
        out = m.step([i], [n])
        if out.error is not None:
            assert isinstance(out.error, E.OutOfBlocksError), out.error
            assert predicted > free, (predicted, free)
            assert self.snapshot() == before
            # The failed step still hands out the plans of earlier calls.
            self.run(out, [])
            return
        assert free - m.stats().free == predicted
        if first:
            assert int(out.num_cached_tokens[0]) == lookup
        self.run(out, [i])

    @precondition(lambda self: len(self.salt) >= 2)
    @rule(data=st.data())
    def step_batch(self, data: st.DataObject) -> None:
        m = self.m
        running = [i for i in self.ids() if m.status(i) != "swapped" and m.num_uncomputed_tokens([i])[0] > 0]
        if not running:
            return
        seqs = data.draw(st.lists(st.sampled_from(running), min_size=1, max_size=3, unique=True))
        nums = data.draw(st.lists(st.integers(1, 9), min_size=len(seqs), max_size=len(seqs)))
        out = m.step(seqs, nums)
        if out.error is not None:
            assert isinstance(out.error, E.OutOfBlocksError), out.error
        self.run(out, seqs[: out.num_scheduled])

    @rule(prompts=st.lists(PROMPTS, min_size=1, max_size=4))
    def serve(self, prompts: list[tuple[int, int, list[int], Any]]) -> None:
        """Whole requests one after another: each added, its prefill run in one step, freed
        (the traffic that fills the device pool with cached blocks and evicts them)."""
        m = self.m
        for prompt in prompts:
            self.add(prompt)
            i = self.next_id - 1
            out = m.step([i], [64])
            self.run(out, [i][: out.num_scheduled])
            m.free(i)
            del self.salt[i]

    @rule()
    def empty_step(self) -> None:
        out = self.m.step([], [])
        assert out.error is None
        self.run(out, [])

    @precondition(lambda self: bool(self.salt))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self.ids()))
        assert self.m.free(i)
        del self.salt[i]

    @precondition(lambda self: bool(self.salt))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self.ids()))
        if self.m.status(i) != "swapped":
            self.m.preempt([i])

    @precondition(lambda self: bool(self.salt))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self.ids()))
        if self.m.status(i) != "running":
            return
        try:
            plan = self.m.swap_out([i])
        except E.OutOfSwapSpaceError:
            return
        self.swaps.extend(("out", g, c) for g, c in plan.tolist())

    @precondition(lambda self: bool(self.salt))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self.ids()))
        if self.m.status(i) != "swapped":
            return
        before = self.snapshot()
        try:
            plan = self.m.swap_in([i])
        except E.OutOfBlocksError:
            assert self.snapshot() == before
            return
        self.swaps.extend(("in", c, g) for c, g in plan.tolist())

    @rule()
    def reset(self) -> None:
        before = self.snapshot()
        try:
            self.m.reset_prefix_cache()
        except E.CacheInUseError:
            assert self.snapshot() == before
            return
        for i in self.ids():
            if self.m.status(i) != "swapped":
                assert self.m.lookup_prefix(i) == 0

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        self.drain_events()
        s = self.m.stats()
        assert 0 <= s.host_used <= s.num_host_blocks
        assert s.host_hits_tokens <= s.prefix_hits_tokens

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        m = self.m
        for i in self.ids():
            assert m.free(i)
        m.step([], [])
        m.step([], [])  # hands out and then releases every load: nothing pinned or held
        m.check_invariants()
        assert m.pool.num_free == m.pool.num_blocks - 1
        m.reset_prefix_cache()
        assert m.stats().host_used == 0
        assert np.asarray(m.take_host_transfers()[1]).shape == (0, 3)


TestHostTierStateMachine = HostTierMachine.TestCase
