"""State groups (Mamba / linear-attention recurrent states) under a hypothesis state machine.

A ``RuleBasedStateMachine`` drives layouts with one state group (full + state, full + sliding
window + state, a full group of half the state group's block size, a state group aligned on
twice the full group's block size) through adds with shared prefixes, batched ``step`` calls
with appends, the commit fence (``commit_computed`` at, below and above the computed count,
``commit_all_computed``), an asynchronous scheduler's decode (a placeholder slot settled
keeping its blocks, then its token computed into them), frees, recompute and swap preemption,
swap-in, lookups and the refused operations. A small oracle written from docs/design/kv-cache-groups.md ("State groups
and the commit fence") and docs/design/invariants.md (invariant 10), independent of the Rust
code, keeps per sequence the tokens, the computed count, the live state block and the aligned
step ends still waiting for their commit, plus the token prefixes whose state a commit
published. After every rule: ``check_invariants()``; a state group's table holds exactly the
live block plus the pending aligned blocks; no prefix lookup returns a hit whose state was not
published. Each step: state ``slot_mapping`` rows are -1; a zero row exactly for a fresh state
(first allocation without a hit, resume after preemption); a copy row exactly when the live
index moves (old live block -> new one) or on a state hit. A refused or bad call raises its
typed error and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import pagedkv
from pagedkv import CacheConfig, KVCacheGroupSpec, KVCacheManager

# (kind, block_size, bytes_per_token, window); the layer -> group map. Every page is 32 bytes.
LAYOUTS: list[tuple[list[tuple[str, int, int, int | None]], list[int]]] = [
    ([("full", 4, 8, None), ("state", 4, 8, None)], [0, 1, 1]),
    # Hit unit 4: the full group's blocks are half the state group's.
    ([("full", 2, 16, None), ("state", 4, 8, None)], [1, 0]),
    ([("full", 4, 8, None), ("sliding_window", 4, 8, 6), ("state", 4, 8, None)], [0, 1, 2, 2]),
    # The state group first, aligned on 8 tokens (hit unit 8).
    ([("state", 8, 4, None), ("full", 4, 8, None)], [0, 1]),
]
APPENDED = 3  # the token a step appends


def spec(kind: str, bs: int, bpt: int, window: int | None) -> KVCacheGroupSpec:
    if kind == "sliding_window":
        return KVCacheGroupSpec(kind, bs, bpt, window=window)
    return KVCacheGroupSpec(kind, bs, bpt)


@dataclass
class Seq:
    tokens: list[int]
    computed: int = 0
    status: str = "running"
    # The live state block (0 before the first allocation and after a preemption).
    live: int = 0
    # Aligned step ends whose state block is held until its commit.
    pending: set[int] = field(default_factory=set)


class StateGroupMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.seqs: dict[int, Seq] = {}
        self.next_id = 1
        # Token prefixes whose state a commit published: the only ones a hit may return.
        self.published: set[tuple[int, ...]] = set()

    @initialize(
        layout=st.integers(0, len(LAYOUTS) - 1),
        num_blocks=st.integers(8, 40),
        caching=st.sampled_from([True, True, True, False]),
        sparse=st.booleans(),
        lengths=st.lists(st.integers(9, 30), min_size=2, max_size=3),
    )
    def setup(self, layout: int, num_blocks: int, caching: bool, sparse: bool, lengths: list[int]) -> None:
        groups, layers = LAYOUTS[layout]
        specs = [spec(*g) for g in groups]
        self.sg = next(g for g, s in enumerate(specs) if s.kind == "state")
        self.bs = specs[self.sg].block_size
        self.unit = int(np.lcm.reduce([g.block_size for g in specs]))
        self.retention = 2 * self.unit if sparse else 0
        self.m = KVCacheManager(
            CacheConfig(
                num_blocks,
                groups=specs,
                layer_groups=layers,
                enable_prefix_caching=caching,
                retention_interval=self.retention,
                num_cpu_blocks=16,
            )
        )
        assert self.m.hit_unit == self.unit
        self.groups = specs
        self.caching = caching
        for n in lengths:  # sequences sharing a prefix from the start, so that commits soon hit
            self.add(0, n)

    # -- helpers -------------------------------------------------------------------------------

    def ids(self) -> list[int]:
        return sorted(self.seqs)

    def pick(self, i: int) -> int | None:
        ids = self.ids()
        return ids[i % len(ids)] if ids else None

    def snapshot(self) -> tuple[int, list[tuple[int, str, int, int, list[list[int]]]]]:
        return self.m.num_free_blocks, [
            (
                s,
                self.m.status(s),
                self.m.num_computed_tokens(s),
                self.m.num_tokens(s),
                [t.tolist() for t in self.m.block_tables(s)],
            )
            for s in self.ids()
        ]

    def publishable(self, end: int) -> bool:
        """Whether a step ending at ``end`` leaves a state held until its commit."""
        return self.caching and end % self.bs == 0 and (self.retention == 0 or end % self.retention == 0)

    def check_hit(self, sid: int, hit: int) -> None:
        assert hit % self.unit == 0
        if hit > 0:
            prefix = tuple(self.seqs[sid].tokens[:hit])
            assert prefix in self.published, f"hit of {hit} tokens on a state never committed"

    # -- rules ---------------------------------------------------------------------------------

    @rule(family=st.integers(0, 2), n=st.integers(1, 30))
    def add(self, family: int, n: int) -> None:
        sid = self.next_id
        self.next_id += 1
        tokens = [family * 100 + i for i in range(n)]
        if n > 5:
            tokens[-1] = 10_000 + sid
        self.m.add_sequence(sid, tokens)
        self.seqs[sid] = Seq(tokens)
        self.check_hit(sid, self.m.lookup_prefix(sid))

    def schedulable(self, picks: list[int]) -> list[int]:
        chosen: list[int] = []
        for i in picks:
            sid = self.pick(i)
            if sid is not None and sid not in chosen and self.seqs[sid].status != "swapped":
                chosen.append(sid)
        return chosen

    @rule(picks=st.lists(st.integers(0, 99), min_size=1, max_size=3), n=st.integers(1, 12), append=st.booleans())
    def step(self, picks: list[int], n: int, append: bool) -> None:
        chosen = self.schedulable(picks)
        if chosen:
            self.run_step(chosen, [n] * len(chosen), append)

    @rule(picks=st.lists(st.integers(0, 99), min_size=1, max_size=3), commit=st.booleans())
    def step_to_alignment(self, picks: list[int], commit: bool) -> None:
        """Each sequence up to its next aligned end (a first allocation: from its hit, itself
        aligned), then, as an engine does once the forward pass completed, the commit."""
        chosen = self.schedulable(picks)
        if not chosen:
            return
        ns = [self.bs - self.seqs[sid].computed % self.bs for sid in chosen]
        scheduled = self.run_step(chosen, ns, False)
        if commit:
            want = sum(self.commit_expectation(sid, self.seqs[sid].computed) for sid in scheduled)
            assert self.m.commit_all_computed(scheduled) == want
            for sid in scheduled:
                self.note_commit(sid, self.seqs[sid].computed)

    def run_step(self, chosen: list[int], ns: list[int], append: bool) -> list[int]:
        """One ``step`` of ``chosen`` (``ns[j]`` new tokens each) checked against the oracle;
        returns the sequences scheduled."""
        first = self.seqs[chosen[0]]
        predicted = None
        if not append and (first.computed < len(first.tokens) or first.computed == 0):
            predicted = self.m.num_blocks_needed(chosen[0], ns[0])
        free0 = self.m.num_free_blocks
        appends = np.full(len(chosen), APPENDED, dtype=np.int64) if append else None
        out = self.m.step(np.array(chosen, dtype=np.uint64), np.array(ns, dtype=np.int64), appends, block_table=True)
        k = out.num_scheduled
        assert out.seq_ids.tolist() == chosen[:k]
        if k < len(chosen):
            event("step stopped short")
        if k == 0:
            assert self.m.num_free_blocks == free0
        if predicted is not None and k == 1:
            take, release = predicted
            assert free0 - self.m.num_free_blocks == take - release
        copies = [tuple(int(x) for x in r) for r in out.copies.tolist()]
        zeros = [tuple(int(x) for x in r) for r in out.zero_blocks.tolist()]
        assert all(g == self.sg for g, _, _ in copies), "a copy row outside the state group"
        assert all(g == self.sg for g, _ in zeros)
        want_zeros: list[tuple[int, int]] = []
        moves: list[tuple[int, int, int]] = []
        hit_dsts: list[int] = []
        qsl = out.query_start_loc
        for j, sid in enumerate(chosen[:k]):
            s = self.seqs[sid]
            if append:
                s.tokens.append(APPENDED)
            ctx = int(out.context_lens[j])
            q = int(qsl[j + 1] - qsl[j])
            end = ctx + q
            assert q == min(ns[j], len(s.tokens) - ctx) and q > 0
            live = int(out.block_tables[self.sg, j, (end - 1) // self.bs])
            assert live != pagedkv.NULL_BLOCK
            assert (out.slot_mappings[self.sg, qsl[j] : qsl[j + 1]] == -1).all()
            if s.computed == 0:
                hit = int(out.num_cached_tokens[j])
                assert ctx == hit
                self.check_hit(sid, hit)
                if hit == 0:
                    want_zeros.append((self.sg, live))
                else:
                    event("state hit")
                    hit_dsts.append(live)
            else:
                assert ctx == s.computed
                if (end - 1) // self.bs != (ctx - 1) // self.bs:
                    # The old live block is released in the same call when its state is not
                    # publishable; handed back as the new live block, the state is in place
                    # and no copy row is due.
                    if live != s.live:
                        event("live state moved with a copy row")
                        moves.append((self.sg, s.live, live))
                    else:
                        event("live state moved onto its own released block")
                        assert not self.publishable(ctx) or ctx not in s.pending
                else:
                    assert live == s.live, "a decode inside one block moved the state"
            s.computed, s.live, s.status = end, live, "running"
            if self.publishable(end):
                s.pending.add(end)
        assert sorted(zeros) == sorted(want_zeros)
        for row in moves:
            assert row in copies, f"no copy row {row} for a moved live state"
        rest = [r for r in copies if r not in moves]
        # A hit copies the committed state into the fresh live block, unless this call evicted
        # the hit block and took it again as that live block (the state is already there).
        assert len(rest) <= len(hit_dsts)
        for _, src, dst in rest:
            assert dst in hit_dsts and src != dst
        assert len({dst for _, _, dst in rest}) == len(rest)
        return chosen[:k]

    @rule(i=st.integers(0, 99), commit=st.booleans())
    def async_decode(self, i: int, commit: bool) -> None:
        """An asynchronous scheduler's decode: a placeholder slot for the token being sampled
        (a draft slot the live state moves over), settled keeping its blocks (rejecting it
        while giving its blocks back is refused and changes nothing), then the token, once
        known, computed into the held slots with no block taken and no copy row. The state the
        placeholder leads to is never matchable before that and its commit."""
        sid = self.pick(i)
        if sid is None:
            return
        s = self.seqs[sid]
        if s.status != "running" or s.computed == 0 or s.computed < len(s.tokens):
            return
        before = self.snapshot()
        try:
            out = self.m.allocate_slots(sid, 0, draft_token_ids=[0])
        except pagedkv.OutOfBlocksError:
            assert self.snapshot() == before
            return
        end = s.computed + 1
        live = int(self.m.block_table(sid, self.sg)[(end - 1) // self.bs])
        assert live != pagedkv.NULL_BLOCK
        copies = [tuple(int(x) for x in r) for r in out.copies.tolist()]
        if (end - 1) // self.bs != (s.computed - 1) // self.bs and live != s.live:
            event("placeholder moved the live state")
            assert copies == [(self.sg, s.live, live)]
        else:
            assert copies == []
        assert len(out.zero_blocks) == 0
        placed = self.snapshot()
        with pytest.raises(pagedkv.InvalidArgumentError, match="placeholder"):
            self.m.accept_drafts(sid, 0)
        assert self.snapshot() == placed
        released = self.m.accept_drafts(sid, 0, release_blocks=False)
        assert all(len(r) == 0 for r in released) and self.m.num_draft_tokens(sid) == 0
        for other in self.ids():
            if self.seqs[other].computed == 0 and self.seqs[other].status != "swapped":
                self.check_hit(other, self.m.lookup_prefix(other))
        self.m.append_tokens(sid, [APPENDED])
        s.tokens.append(APPENDED)
        free = self.m.num_free_blocks
        again = self.m.allocate_slots(sid, 1)
        assert len(again.new_block_ids) == 0 and len(again.copies) == 0 and len(again.zero_blocks) == 0
        assert self.m.num_free_blocks == free
        s.computed, s.live = end, live
        if self.publishable(end):
            s.pending.add(end)
        if commit:
            assert self.m.commit_computed(sid, end) == self.commit_expectation(sid, end)
            self.note_commit(sid, end)

    def commit_expectation(self, sid: int, n: int) -> int:
        s = self.seqs[sid]
        if s.status != "running":
            return 0
        return sum(1 for e in s.pending if e <= n)

    def note_commit(self, sid: int, n: int) -> None:
        s = self.seqs[sid]
        if s.status != "running":
            return
        done = {e for e in s.pending if e <= n}
        for e in done:
            event("state published")
            self.published.add(tuple(s.tokens[:e]))
        s.pending -= done

    @rule(i=st.integers(0, 99), below=st.integers(0, 12))
    def commit(self, i: int, below: int) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        n = max(0, self.seqs[sid].computed - below)
        want = self.commit_expectation(sid, n)
        assert self.m.commit_computed(sid, n) == want
        self.note_commit(sid, n)

    @rule(i=st.integers(0, 99), above=st.integers(1, 5), negative=st.booleans())
    def commit_bad_value(self, i: int, above: int, negative: bool) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        before = self.snapshot()
        n = -above if negative else self.m.num_computed_tokens(sid) + above
        with pytest.raises(pagedkv.InvalidArgumentError):
            self.m.commit_computed(sid, n)
        assert self.snapshot() == before

    @rule(picks=st.lists(st.integers(0, 99), max_size=4), unknown=st.booleans())
    def commit_all(self, picks: list[int], unknown: bool) -> None:
        chosen = sorted({sid for i in picks if (sid := self.pick(i)) is not None})
        if unknown:
            before = self.snapshot()
            with pytest.raises(pagedkv.UnknownSequenceError):
                self.m.commit_all_computed([*chosen, self.next_id + 1000])
            assert self.snapshot() == before
            with pytest.raises(pagedkv.UnknownSequenceError):
                self.m.commit_computed(self.next_id + 1000, 0)
            assert self.snapshot() == before
            return
        want = sum(self.commit_expectation(sid, self.seqs[sid].computed) for sid in chosen)
        assert self.m.commit_all_computed(np.asarray(chosen, dtype=np.uint64)) == want
        for sid in chosen:
            self.note_commit(sid, self.seqs[sid].computed)

    @rule(
        i=st.integers(0, 99),
        kind=st.sampled_from(["lookahead", "fork", "rollback"]),
    )
    def refused(self, i: int, kind: str) -> None:
        sid = self.pick(i)
        if sid is None or self.seqs[sid].status != "running":
            return
        if kind == "rollback" and self.seqs[sid].computed == 0:
            return  # nothing to roll back
        before = self.snapshot()
        with pytest.raises(pagedkv.InvalidArgumentError):
            if kind == "lookahead":
                self.m.allocate_slots(sid, 1, num_lookahead_slots=2)
            elif kind == "fork":
                self.m.fork(sid, self.next_id + 1000)
            else:  # below the computed tokens: an earlier recurrent state cannot be restored
                self.m.rollback(sid, (self.seqs[sid].computed - 1) // 2, poisoned=i % 2 == 1)
        assert self.snapshot() == before

    @rule(
        i=st.integers(0, 99),
        ext=st.integers(1, 30),
        outcome=st.sampled_from(["commit", "free", "preempt", "partial"]),
    )
    def external_load(self, i: int, ext: int, outcome: str) -> None:
        """A KV connector's async load (staged) into a sequence with no block yet: while it
        loads, no lookup returns a state it holds; a commit in full publishes the loaded
        live state (when aligned); a partial commit is refused and changes nothing; a freed
        or preempted load leaves nothing matchable."""
        sid = self.pick(i)
        if sid is None:
            return
        s = self.seqs[sid]
        if s.status not in ("running", "preempted") or s.computed > 0:
            return
        hit = self.m.lookup_prefix(sid)
        ext = min(ext, len(s.tokens) - hit - 1)
        if ext <= 0:
            return
        before = self.snapshot()
        take, release = self.m.num_blocks_needed_external(sid, ext)
        try:
            a = self.m.allocate_external(sid, ext, staged=True)
        except pagedkv.OutOfBlocksError:
            assert self.snapshot() == before
            return
        assert before[0] + release - self.m.num_free_blocks == take
        assert (a.num_cached_tokens, a.num_context_tokens) == (hit, hit + ext)
        assert self.m.status(sid) == "loading"
        self.m.check_invariants()
        for other in self.ids():
            if other != sid:
                self.check_hit(other, self.m.lookup_prefix(other))
        end = hit + ext
        if outcome == "partial":
            mid = self.snapshot()
            with pytest.raises(pagedkv.InvalidArgumentError, match="num_valid_tokens"):
                self.m.commit_external(sid, end - 1)
            assert self.snapshot() == mid
            outcome = "free"
        if outcome == "free":
            assert self.m.free(sid)
            del self.seqs[sid]
        elif outcome == "preempt":
            self.m.preempt([sid])
            s.computed, s.status, s.live = 0, "preempted", 0
            s.pending.clear()
        else:
            self.m.commit_external(sid, end)
            s.computed, s.status = end, "running"
            s.live = int(self.m.block_tables(sid)[self.sg][(end - 1) // self.bs])
            s.pending.clear()
            if self.publishable(end):
                self.published.add(tuple(s.tokens[:end]))
        self.m.check_invariants()

    @rule(i=st.integers(0, 99))
    def free(self, i: int) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        assert self.m.free(sid)
        del self.seqs[sid]

    @rule(i=st.integers(0, 99))
    def preempt(self, i: int) -> None:
        sid = self.pick(i)
        if sid is None or self.seqs[sid].status == "swapped":
            return
        self.m.preempt([sid])
        s = self.seqs[sid]
        s.computed, s.status, s.live = 0, "preempted", 0
        s.pending.clear()  # released unpublished

    @rule(i=st.integers(0, 99))
    def swap_out(self, i: int) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        before = self.snapshot()
        try:
            self.m.swap_out([sid])
        except (pagedkv.InvalidSequenceStateError, pagedkv.OutOfSwapSpaceError):
            assert self.snapshot() == before
            return
        s = self.seqs[sid]
        s.status = "swapped"
        s.pending.clear()  # pending states released unpublished; the live one never published

    @rule(i=st.integers(0, 99))
    def swap_in(self, i: int) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        before = self.snapshot()
        try:
            self.m.swap_in([sid])
        except (pagedkv.InvalidSequenceStateError, pagedkv.OutOfBlocksError):
            assert self.snapshot() == before
            return
        s = self.seqs[sid]
        s.status = "running"
        if s.computed > 0:
            s.live = int(self.m.block_tables(sid)[self.sg][(s.computed - 1) // self.bs])

    @rule(i=st.integers(0, 99))
    def lookup(self, i: int) -> None:
        sid = self.pick(i)
        if sid is None:
            return
        hit = self.m.lookup_prefix(sid)
        assert hit < len(self.seqs[sid].tokens)
        self.check_hit(sid, hit)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def state_tables_hold_live_and_pending_only(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        for sid, s in self.seqs.items():
            assert self.m.token_ids(sid).tolist() == s.tokens
            assert self.m.status(sid) == s.status
            assert self.m.num_computed_tokens(sid) == s.computed
            if s.status == "swapped":
                continue
            table = self.m.block_tables(sid)[self.sg]
            assert len(table) == -(-s.computed // self.bs)
            held = {j for j, b in enumerate(table.tolist()) if b != pagedkv.NULL_BLOCK}
            want = {e // self.bs - 1 for e in s.pending}
            if s.computed > 0:
                live = (s.computed - 1) // self.bs
                want.add(live)
                assert int(table[live]) == s.live
            assert held == want, f"state table {table.tolist()} holds more than live + pending"

    def teardown(self) -> None:
        if hasattr(self, "m"):
            for sid in self.ids():
                self.m.free(sid)
            self.m.check_invariants()
            assert self.m.num_free_blocks == self.m.num_blocks - 1


# The profile's settings (tests/conftest.py), three times its examples: "ci" runs 600 machines
# of up to 50 steps (about 8 s on one core).
TestStateGroupMachine = StateGroupMachine.TestCase
TestStateGroupMachine.settings = settings(max_examples=3 * settings().max_examples)
