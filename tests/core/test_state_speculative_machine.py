"""Speculative state blocks (``KVCacheGroupSpec("state", ..., spare_blocks=k)``) under a hypothesis
state machine, through the Python API.

Layouts of one full-attention group and one state group (block sizes 2 and 4), ``k`` 1 to 3.
Rules: adds with shared prefixes, prefill chunks, verify steps (one known token, up to ``k``
drafts, a random number accepted: drafts rejected often), each step committed once it
"completed" (as a synchronous scheduler's fence does), recompute preemptions and frees. A
small oracle written from docs/design/kv-cache-groups.md ("Speculative state blocks"),
independent of the Rust code, replays vLLM's align-mode rule on the block ids the manager
returns: a first allocation's ``1 + k`` ids after null columns, a move's spares left below the
new live column moved in order to the end plus one fresh id (the ids it returns), columns
below ``(m - 1) // block_size`` released at an allocation of ``m`` computed tokens; rejection
leaves the table as it is. After every rule: the manager's state table equals the oracle's,
``check_invariants()`` holds, and every prefix hit is the state after a prefix some step
wrote (an aligned end the accepted tokens of a completed step crossed, or a prefill chunk's
end) at a known or accepted end, never one only drafts reached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedkv import CacheConfig, InvalidConfigError, KVCacheGroupSpec, KVCacheManager

FULL, STATE = 0, 1


@dataclass
class Seq:
    tokens: list[int]
    computed: int = 0
    # The slots of the latest allocation, drafts included (0: none since the last preemption).
    slots: int = 0
    # The oracle's state table.
    table: list[int] = field(default_factory=list)


class SpeculativeStateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.seqs: dict[int, Seq] = {}
        self.next_id = 1
        self.counter = 0
        self.written: set[tuple[int, ...]] = set()
        self.hashed: set[tuple[int, ...]] = set()

    @initialize(
        bs=st.sampled_from([2, 4]),
        k=st.integers(1, 3),
        num_blocks=st.integers(10, 48),
        lengths=st.lists(st.integers(1, 10), min_size=2, max_size=3),
    )
    def setup(self, bs: int, k: int, num_blocks: int, lengths: list[int]) -> None:
        self.bs, self.k = bs, k
        groups = [KVCacheGroupSpec("full", bs, 32 // bs), KVCacheGroupSpec("state", bs, 32 // bs, spare_blocks=k)]
        self.m = KVCacheManager(CacheConfig(num_blocks, groups=groups, layer_groups=[0, 1]))
        for n in lengths:  # siblings sharing a prefix from the start, so that commits soon hit
            self.add(0, n)

    def pick(self, i: int) -> int | None:
        ids = sorted(self.seqs)
        return ids[i % len(ids)] if ids else None

    def apply_allocation(self, s: Seq, alloc: object, context: int, slots: int) -> None:
        """The oracle's state table after an allocation of ``slots`` slots from ``context``."""
        bs, k = self.bs, self.k
        indptr = alloc.new_block_indptr.tolist()  # type: ignore[attr-defined]
        new = alloc.new_block_ids.tolist()[indptr[STATE] : indptr[STATE + 1]]  # type: ignore[attr-defined]
        if not s.table:
            live = (slots - 1) // bs
            assert len(new) == 1 + k
            s.table = [0] * live + new
            hit = alloc.num_cached_tokens  # type: ignore[attr-defined]
            if hit:
                # The hit's state stays held at its column (the copy source of the live block).
                rows = [r for r in alloc.copies.tolist() if r[0] == STATE]  # type: ignore[attr-defined]
                assert [r[2] for r in rows] == [new[0]]
                s.table[hit // bs - 1] = rows[0][1]
            s.slots = slots
            return
        floor = (context - 1) // bs
        for j in range(min(floor, len(s.table))):
            s.table[j] = 0
        live_before = (s.slots - 1) // bs
        s.slots = max(s.slots, slots)
        live = (s.slots - 1) // bs
        if live == live_before:
            assert new == []
            return
        prev_len = len(s.table)
        s.table += [0] * max(0, live - prev_len)
        moved = []
        for j in range(prev_len - k, prev_len):
            if j >= live:
                break
            moved.append(s.table[j])
            s.table[j] = 0
        assert new[:-1] == moved, f"new ids {new}, moved {moved}"
        event("move" if not moved else "move with spares moved")
        s.table += moved + [new[-1]]

    @rule(family=st.integers(0, 2), n=st.integers(1, 14))
    def add(self, family: int, n: int) -> None:
        sid = self.next_id
        self.next_id += 1
        tokens = [family * 1000 + i + 1 for i in range(n)] + [100_000 + sid]
        self.m.add_sequence(sid, tokens)
        self.seqs[sid] = Seq(tokens)

    @rule(i=st.integers(0, 7), chunk=st.integers(1, 9), drafts=st.integers(0, 3), accepted=st.integers(0, 3))
    def step_a(self, i: int, chunk: int, drafts: int, accepted: int) -> None:
        self.step(i, chunk, drafts, accepted)

    @rule(i=st.integers(0, 7), chunk=st.integers(1, 9), drafts=st.integers(0, 3), accepted=st.integers(0, 3))
    def step(self, i: int, chunk: int, drafts: int, accepted: int) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        s = self.seqs[sid]
        m = self.m
        bs = self.bs
        if s.computed < len(s.tokens):
            q = min(chunk, len(s.tokens) - s.computed)
            take, release = m.num_blocks_needed(sid, q)
            if take > m.num_free_blocks + release:
                return
            first = not s.table
            alloc = m.allocate_slots(sid, q)
            ctx = alloc.num_context_tokens
            if first:
                hit = alloc.num_cached_tokens
                if hit:
                    event("prefix hit on a state")
                    assert tuple(s.tokens[:hit]) in self.written & self.hashed, f"hit {hit} on an unwritten state"
                s.computed = ctx
            end = ctx + alloc.num_scheduled_tokens
            self.apply_allocation(s, alloc, ctx, end)
            s.computed = end
            if end % bs == 0:
                self.written.add(tuple(s.tokens[:end]))
                self.hashed.add(tuple(s.tokens[:end]))
            m.commit_computed(sid, end)
            return
        self.counter += 10
        token = 50_000 + self.counter
        m.append_tokens(sid, [token])
        s.tokens.append(token)
        proposed = [token + 1 + j for j in range(min(drafts, self.k))]
        take, release = m.num_blocks_needed_with_drafts(sid, 1, len(proposed))
        if take > m.num_free_blocks + release:
            return  # the token stays known; a later step schedules it
        ctx = s.computed
        alloc = m.allocate_slots(sid, 1, proposed or None)
        self.apply_allocation(s, alloc, ctx, ctx + 1 + len(proposed))
        acc = min(accepted, len(proposed))
        event("verify step" if proposed else "decode step")
        if acc < len(proposed):
            event("drafts rejected")
        if proposed:
            released = m.accept_drafts(sid, acc)
            assert len(released[STATE]) == 0
            s.tokens += proposed[:acc]
        end = ctx + 1 + acc
        s.computed = end
        for x in range(ctx + 1, end + 1):
            if x % bs == 0:
                self.written.add(tuple(s.tokens[:x]))
                if x in (ctx + 1, end):
                    self.hashed.add(tuple(s.tokens[:x]))
        m.commit_computed(sid, end)

    @rule(i=st.integers(0, 7))
    def preempt(self, i: int) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        self.m.preempt([sid])
        s = self.seqs[sid]
        s.computed, s.slots, s.table = 0, 0, []

    @rule(i=st.integers(0, 7))
    def free(self, i: int) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        assert self.m.free(sid)
        del self.seqs[sid]

    @invariant()
    def tables_match_the_oracle(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        for sid, s in self.seqs.items():
            assert self.m.num_computed_tokens(sid) == s.computed
            assert self.m.block_table(sid, STATE).tolist() == s.table, f"seq {sid}"
            if s.table:
                live = (s.slots - 1) // self.bs
                assert len(s.table) == live + 1 + self.k
                assert all(b != 0 for b in s.table[live:])


TestSpeculativeStateMachine = SpeculativeStateMachine.TestCase
TestSpeculativeStateMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


def test_spare_blocks_of_state_groups_are_the_speculative_state_blocks() -> None:
    # Set on the state groups (KVCacheGroupSpec.spare_blocks), checked by CacheConfig: the
    # same on every state group, at most 16, one block size, no swap space; typed refusals
    # naming spare_blocks.
    state = KVCacheGroupSpec("state", 4, 8, spare_blocks=2)
    assert state.spare_blocks == 2 and "spare_blocks=2" in repr(state)
    assert KVCacheGroupSpec("state", 4, 8).spare_blocks == 0
    full = KVCacheGroupSpec("full", 4, 8)
    m = KVCacheManager(CacheConfig(16, groups=[full, state], layer_groups=[0, 1]))
    m.add_sequence(0, list(range(1, 7)))
    m.allocate_slots(0, 6)
    assert len(m.block_table(0, STATE)) == 2 + 2  # null column 0, live column 1, 2 spares
    assert m.block_table(0, STATE).tolist()[0] == 0
    with pytest.raises(InvalidConfigError) as err:
        KVCacheGroupSpec("state", 4, 8, spare_blocks=17)
    assert err.value.field == "spare_blocks"
    refusals = [
        ([full, state, KVCacheGroupSpec("state", 4, 8)], 0, "the same spare blocks"),
        ([state, KVCacheGroupSpec("state", 8, 4, spare_blocks=2)], 0, "one block size"),
        ([full, state], 4, "swap space"),
    ]
    for groups, swap, reason in refusals:
        with pytest.raises(InvalidConfigError, match=reason) as err:
            CacheConfig(16, groups=groups, layer_groups=list(range(len(groups))), num_cpu_blocks=swap)
        assert err.value.field == "spare_blocks"
    # One spelling: the manager-wide keyword is gone.
    removed: dict[str, Any] = {"state_speculative_blocks": 2}
    with pytest.raises(TypeError):
        CacheConfig(16, groups=[full, state], layer_groups=[0, 1], **removed)
