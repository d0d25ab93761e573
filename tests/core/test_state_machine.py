"""Stateful property test of the public allocator API against a pure-Python oracle.

A hypothesis ``RuleBasedStateMachine`` drives ``pagedkv.KVCacheManager`` through random
sequences of: adding sequences whose prompts share prefixes (so prefix hits happen), single
allocations and batched ``step`` calls (with appended tokens), token appends, forks and the
appends that then trigger copy-on-write, frees (also of unknown ids), recompute and swap
preemption, swap-in, prefix-cache resets, prefix lookups and event draining, and speculative
decoding: verify steps with draft tokens in lookahead slots (single allocations and batched
steps) and acceptances of a prefix of them (also invalid ones: no drafts, more than proposed,
negative counts).

``Oracle`` below is a small model of the semantics in docs/design.md and the core API contract,
written independently of the Rust code (it lives only here, never in the package). It
predicts, for every call: success or the exact exception class and its fields, the number of
blocks taken from the free pool, prefix-hit tokens on first allocation, scheduled / context
tokens, copy-on-write pairs, the exact physical block ids (allocation order is deterministic:
uncached LIFO first, then LRU eviction), every block's ref count and hashed-ness, the exact
free-queue order, CPU swap blocks, stats counters and the event stream. The only choice it
leaves open is which of several blocks carrying the same hash a prefix hit picks (the index is
a multiset); there it checks that the pick is a legal candidate and follows it.

After every step the invariants of docs/design.md are checked through the Python API:
``check_invariants()`` (1-4), the oracle's ref counts / free queue / hashes / stats, and at
teardown the pool being whole after freeing everything (7) and a reset leaving no hash (8).
Failed calls are checked to leave a full snapshot unchanged (5); predicted block counts are
checked against blocks taken (6).

Profiles: ``HYPOTHESIS_PROFILE=ci`` (default; >= 200 examples of up to 50 steps) or ``long``
(see tests/conftest.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import pagedkv
from pagedkv import errors as E
from pagedkv.tensors import BlockTable

# Prompts are a family's base prompt cut at some length, plus an optional private tail, so
# prompts of one family share block-aligned prefixes.
FAMILY_BASE = {f: [100 * (f + 1) + i for i in range(24)] for f in range(3)}
SALTS = (None, "tenant-a", "tenant-b")

# (family, cut, private tail, cache salt, pass the prompt as a numpy array)
PROMPTS = st.tuples(
    st.integers(0, 2),
    st.integers(0, 24),
    st.lists(st.integers(0, 2), max_size=6),
    st.sampled_from(SALTS),
    st.booleans(),
)
# Mostly >= 1; 0 (an InvalidArgumentError) now and then.
NUM_NEW = st.sampled_from([0, *range(1, 13), *range(1, 9)])

Key = tuple[Any, tuple[int, ...]]  # (cache salt, token prefix through the end of the block)


@dataclass
class MSeq:
    """The oracle's view of one sequence."""

    tokens: list[int]
    salt: str | None
    status: str = "running"
    computed: int = 0
    table: list[int] = field(default_factory=list)
    ncached: int = 0
    stale: bool = False  # its KV predates the last reset (swapped out then): never cached
    drafts: list[int] = field(default_factory=list)  # pending draft tokens (lookahead slots)
    looked_up: bool = False  # its first lookup is counted; later first allocations are resumes


@dataclass
class Plan:
    """What an allocation will do (computed without side effects)."""

    first: bool
    hit_keys: list[Key]
    hit_candidates: list[list[int]]
    hits_free: int
    context: int
    q: int
    fresh: int
    cow: bool

    @property
    def taken(self) -> int:
        return self.hits_free + self.fresh + int(self.cow)


class Expected(Exception):
    """An exception the oracle predicts: its class and the fields it must carry."""

    def __init__(self, cls: type[Exception], **fields: Any) -> None:
        super().__init__(cls.__name__)
        self.cls = cls
        self.fields = fields


class Oracle:
    """Pure-Python model of the pool + manager (block ids, ref counts, queue, hashes)."""

    def __init__(self, num_blocks: int, bs: int, caching: bool, cpu_blocks: int) -> None:
        self.n = num_blocks
        self.bs = bs
        self.caching = caching
        self.refs = [0] * num_blocks
        self.key: list[Key | None] = [None] * num_blocks
        self.stack = list(range(num_blocks - 1, 0, -1))  # top (end) = front of the free queue
        self.lru: list[int] = []  # front (index 0) = next to evict
        self.index: dict[Key, list[int]] = defaultdict(list)
        self.cpu_refs = [0] * cpu_blocks
        self.cpu_free = list(range(cpu_blocks - 1, -1, -1))  # pop() from the end
        self.seqs: dict[int, MSeq] = {}
        self.counters = dict(
            evictions=0,
            copies=0,
            swaps_out_blocks=0,
            swaps_in_blocks=0,
            preemptions=0,
            prefix_queries_tokens=0,
            prefix_hits_tokens=0,
        )
        # Event stream since the last take_events: ("stored", key) / ("removed", key) / ("cleared",),
        # with set semantics: a key is stored when it becomes resolvable, removed when its last
        # copy is evicted.
        self.events: list[tuple[Any, ...]] = []

    # ---- pool ---------------------------------------------------------------------------
    @property
    def free(self) -> int:
        return len(self.stack) + len(self.lru)

    def free_queue(self) -> list[int]:
        return self.stack[::-1] + self.lru

    def allocate(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            if self.stack:
                b = self.stack.pop()
            else:
                b = self.lru.pop(0)
                key = self.key[b]
                assert key is not None
                self.index[key].remove(b)
                if not self.index[key]:
                    del self.index[key]
                self.key[b] = None
                self.counters["evictions"] += 1
                if key not in self.index:  # set semantics: the last copy went
                    self.events.append(("removed", key))
            self.refs[b] = 1
            out.append(b)
        return out

    def touch(self, ids: list[int]) -> None:
        for b in ids:
            if self.refs[b] == 0:
                self.lru.remove(b)
            self.refs[b] += 1

    def release(self, tail_first: list[int]) -> None:
        for b in tail_first:
            self.refs[b] -= 1
            assert self.refs[b] >= 0
            if self.refs[b] == 0:
                (self.lru if self.key[b] is not None else self.stack).append(b)

    # ---- hashing --------------------------------------------------------------------------
    def block_key(self, s: MSeq, k: int) -> Key:
        return (s.salt, tuple(s.tokens[: (k + 1) * self.bs]))

    def hit_candidates(self, key: Key) -> list[int]:
        cands = self.index.get(key, [])
        in_use = [b for b in cands if self.refs[b] > 0]
        return in_use or list(cands)

    def find_hits(self, s: MSeq) -> tuple[list[Key], list[list[int]]]:
        keys: list[Key] = []
        cands: list[list[int]] = []
        if not self.caching:
            return keys, cands
        for k in range((len(s.tokens) - 1) // self.bs):
            c = self.hit_candidates(self.block_key(s, k))
            if not c:
                break
            keys.append(self.block_key(s, k))
            cands.append(c)
        return keys, cands

    def cache_full_blocks(self, s: MSeq) -> None:
        if not self.caching or s.stale:
            return
        full = s.computed // self.bs
        for k in range(s.ncached, full):
            b = s.table[k]
            if self.key[b] is not None:
                continue
            key = self.block_key(s, k)
            self.key[b] = key
            if not self.index[key]:  # set semantics: the first copy makes it resolvable
                self.events.append(("stored", key))
            self.index[key].append(b)
        s.ncached = max(s.ncached, full)

    # ---- manager --------------------------------------------------------------------------
    def get(self, seq: int) -> MSeq:
        if seq not in self.seqs:
            raise Expected(E.UnknownSequenceError, seq_id=seq)
        return self.seqs[seq]

    def plan(self, seq: int, num_new: int, drafts: list[int] | None = None) -> Plan:
        k = len(drafts or [])
        s = self.get(seq)
        if s.status == "swapped":
            raise Expected(E.InvalidSequenceStateError)
        first = not s.table and s.computed == 0
        # A first allocation of no token adopts its prefix hit alone (refused without one).
        if num_new == 0 and (k or not first):
            raise Expected(E.InvalidArgumentError)
        if s.drafts:
            raise Expected(E.InvalidSequenceStateError, seq_id=seq)
        keys, cands = self.find_hits(s) if first else ([], [])
        if num_new == 0 and not keys:
            raise Expected(E.InvalidArgumentError, arg="num_new_tokens")
        # A hit picks a block in use when one carries the hash, so the count is determined.
        hits_free = sum(1 for c in cands if self.refs[c[0]] == 0)
        context = len(keys) * self.bs if first else s.computed
        remaining = len(s.tokens) - context
        if remaining == 0:
            raise Expected(E.InvalidArgumentError)
        q = min(num_new, remaining)
        if k and q < remaining:  # drafts follow the last token
            raise Expected(E.InvalidArgumentError, arg="draft_tokens")
        table_len = len(keys) if first else len(s.table)
        fresh = -(-(context + q + k) // self.bs) - table_len
        cow = (not first) and context % self.bs != 0 and self.refs[s.table[-1]] > 1
        return Plan(first, keys, cands, hits_free, context, q, fresh, cow)

    def check_capacity(self, p: Plan) -> None:
        if p.taken > self.free:
            raise Expected(E.OutOfBlocksError, requested=p.taken, available=self.free)

    def apply_allocation(
        self, seq: int, p: Plan, hit_ids: list[int], drafts: list[int] | None = None
    ) -> dict[str, Any]:
        """Applies a successful allocation; `hit_ids` are the blocks the manager picked."""
        s = self.seqs[seq]
        assert len(hit_ids) == len(p.hit_keys)
        for b, c in zip(hit_ids, p.hit_candidates):
            assert b in c, f"prefix hit picked block {b}, candidates {c}"
        self.touch(hit_ids)
        new = self.allocate(p.fresh + int(p.cow))
        copies = []
        if p.first:
            s.table = list(hit_ids)
            s.computed = p.context
            s.ncached = len(hit_ids)
            if self.caching and not s.looked_up:  # a resume is not a new lookup
                self.counters["prefix_queries_tokens"] += len(s.tokens)
                self.counters["prefix_hits_tokens"] += p.context
            s.looked_up = True
        rest = list(new)
        if p.cow:
            dst = rest.pop(0)
            src = s.table[-1]
            s.table[-1] = dst
            self.release([src])
            copies.append((src, dst))
            self.counters["copies"] += 1
        s.table.extend(rest)
        s.computed += p.q
        s.status = "running"
        s.drafts = list(drafts or [])
        self.cache_full_blocks(s)
        return dict(
            num_scheduled_tokens=p.q,
            num_cached_tokens=p.context if p.first else 0,
            num_context_tokens=p.context,
            new_block_ids=new,
            copies=copies,
        )

    def accept(self, seq: int, num_accepted: int) -> list[int]:
        """accept_drafts: keep the first `num_accepted` drafts, release blocks holding only
        rejected ones (tail first), cache blocks the accepted tokens fill."""
        if num_accepted < 0:  # refused while reading the arguments, before any lookup
            raise Expected(E.InvalidArgumentError, arg="num_accepted")
        s = self.get(seq)
        if not s.drafts:
            raise Expected(E.InvalidSequenceStateError, seq_id=seq)
        if num_accepted > len(s.drafts):
            raise Expected(E.InvalidArgumentError, arg="num_accepted")
        keep = -(-(s.computed + num_accepted) // self.bs)
        released = list(reversed(s.table[keep:]))
        self.release(released)
        s.tokens.extend(s.drafts[:num_accepted])
        s.computed += num_accepted
        s.table = s.table[:keep]
        s.drafts = []
        self.cache_full_blocks(s)
        return released

    def check_group(self, seqs: list[int], ok: set[str]) -> None:
        seen: set[int] = set()
        for i in seqs:
            if i in seen:
                raise Expected(E.InvalidArgumentError)
            seen.add(i)
            if self.get(i).status not in ok:
                raise Expected(E.InvalidSequenceStateError)

    def preempt(self, seqs: list[int]) -> None:
        self.check_group(seqs, {"running", "preempted"})
        tail_first = [b for i in seqs for b in reversed(self.seqs[i].table)]
        self.release(tail_first)
        for i in seqs:
            s = self.seqs[i]
            if s.status == "running":
                self.counters["preemptions"] += 1
            s.table, s.computed, s.ncached, s.status, s.stale = [], 0, 0, "preempted", False
            s.drafts = []

    def swap_out(self, seqs: list[int]) -> list[tuple[int, int]]:
        self.check_group(seqs, {"running"})
        if any(self.seqs[i].drafts for i in seqs):
            raise Expected(E.InvalidSequenceStateError)
        order: list[int] = []
        uses: dict[int, int] = defaultdict(int)
        for i in seqs:
            for b in self.seqs[i].table:
                if uses[b] == 0:
                    order.append(b)
                uses[b] += 1
        if len(order) > len(self.cpu_free):
            raise Expected(E.OutOfSwapSpaceError, requested=len(order), available=len(self.cpu_free))
        self.release([b for i in seqs for b in reversed(self.seqs[i].table)])
        mapping = {}
        for g in order:
            c = self.cpu_free.pop()
            self.cpu_refs[c] = uses[g]
            mapping[g] = c
        for i in seqs:
            s = self.seqs[i]
            s.table = [mapping[b] for b in s.table]
            s.ncached, s.status = 0, "swapped"
        self.counters["swaps_out_blocks"] += len(order)
        self.counters["preemptions"] += len(seqs)
        return [(g, mapping[g]) for g in order]

    def cpu_release(self, table: list[int]) -> None:
        for c in reversed(table):
            self.cpu_refs[c] -= 1
            if self.cpu_refs[c] == 0:
                self.cpu_free.append(c)

    def swap_in(self, seqs: list[int]) -> list[tuple[int, int]]:
        self.check_group(seqs, {"swapped"})
        order: list[int] = []
        extra: list[int] = []
        for i in seqs:
            for c in self.seqs[i].table:
                (extra if c in order else order).append(c)
        if len(order) > self.free:
            raise Expected(E.OutOfBlocksError, requested=len(order), available=self.free)
        gpu = self.allocate(len(order))
        mapping = dict(zip(order, gpu))
        for c in extra:
            self.refs[mapping[c]] += 1
        for i in seqs:
            s = self.seqs[i]
            self.cpu_release(s.table)
            s.table = [mapping[c] for c in s.table]
            s.ncached, s.status = 0, "running"
            self.cache_full_blocks(s)
        self.counters["swaps_in_blocks"] += len(order)
        return list(zip(order, gpu))

    def free_seq(self, seq: int) -> bool:
        s = self.seqs.pop(seq, None)
        if s is None:
            return False
        if s.status == "swapped":
            self.cpu_release(s.table)
        else:
            self.release(list(reversed(s.table)))
        return True

    def reset(self) -> None:
        used = sum(1 for r in self.refs if r > 0)
        if used:
            raise Expected(E.CacheInUseError, blocks_in_use=used)
        order = self.free_queue()
        self.stack = order[::-1]
        self.lru = []
        self.key = [None] * self.n
        self.index.clear()
        self.events.append(("cleared",))
        for s in self.seqs.values():  # swapped-out KV predates the reset: never cached again
            s.stale = s.stale or (s.status == "swapped" and s.computed > 0)


def snapshot(m: pagedkv.KVCacheManager, ids: list[int]) -> tuple[Any, ...]:
    """Everything observable through the public API (for 'a failed call changed nothing')."""
    p = m.pool
    n = p.num_blocks
    seqs: list[tuple[Any, ...]] = []
    for i in ids:
        try:
            seqs.append(
                (
                    i,
                    m.block_table(i).tolist(),
                    m.token_ids(i).tolist(),
                    m.num_computed_tokens(i),
                    m.status(i),
                    m.num_draft_tokens(i),
                )
            )
        except E.UnknownSequenceError:
            seqs.append((i, None))
    return (
        [p.ref_count(b) for b in range(n)],
        [p.block_hash(b) for b in range(n)],
        p.free_queue().tolist(),
        p.num_free,
        p.num_cached_free,
        m.num_sequences,
        m.stats().as_dict(),
        seqs,
    )


class ManagerMachine(RuleBasedStateMachine):
    """Drives one KVCacheManager and the Oracle in lockstep."""

    def __init__(self) -> None:
        super().__init__()
        self.m: pagedkv.KVCacheManager | None = None
        self.o: Oracle | None = None
        self.next_id = 0
        self.hash_of_key: dict[Key, bytes] = {}
        self.key_of_hash: dict[bytes, Key] = {}

    # ---- helpers ----------------------------------------------------------------------------
    def ids(self) -> list[int]:
        assert self.o is not None
        return sorted(self.o.seqs)

    def pick(self, i: int) -> int:
        """A known sequence id, or (when none or i says so) an unknown one."""
        ids = self.ids()
        if not ids or i % 23 == 22:
            return 10_000 + i
        return ids[i % len(ids)]

    def pick_in(self, i: int, statuses: set[str]) -> int:
        """Mostly a sequence in one of `statuses` (so the call can succeed); else any id."""
        assert self.o is not None
        ids = [k for k in self.ids() if self.o.seqs[k].status in statuses]
        if not ids or i % 7 == 6:
            return self.pick(i)
        return ids[i % len(ids)]

    def expect_failure(self, exc: Expected, call: Any) -> None:
        """`call` must raise exactly `exc`'s class with its fields, changing nothing."""
        assert self.m is not None
        self._check_events()  # drain what earlier calls emitted, so the failed call's are visible
        before = snapshot(self.m, self.ids())
        with pytest.raises(exc.cls) as info:
            call()
        assert type(info.value) is exc.cls, f"{type(info.value).__name__} != {exc.cls.__name__}"
        for name, value in exc.fields.items():
            assert getattr(info.value, name) == value, (name, info.value)
        assert str(info.value), "error without a message"
        assert snapshot(self.m, self.ids()) == before, f"failed call {exc.cls.__name__} changed state"
        assert self.m.take_events() == [], "failed call emitted events"

    def allocate(self, seq: int, num_new: int, drafts: list[int] | None = None) -> None:
        assert self.m is not None and self.o is not None
        m, o = self.m, self.o
        try:
            p = o.plan(seq, num_new, drafts)
        except Expected as exc:
            if not drafts:
                self.expect_failure(exc, lambda: m.num_blocks_needed(seq, num_new))
            self.expect_failure(exc, lambda: m.allocate_slots(seq, num_new, drafts))
            return
        if not drafts:
            assert m.num_blocks_needed(seq, num_new) == (p.taken, 0)  # a full group releases none
        if p.first and o.caching:
            assert m.lookup_prefix(seq) == p.context
        try:
            o.check_capacity(p)
        except Expected as exc:
            self.expect_failure(exc, lambda: m.allocate_slots(seq, num_new, drafts))
            return
        free_before = m.pool.num_free
        a = m.allocate_slots(seq, num_new, drafts)
        assert free_before - m.pool.num_free == p.taken, "predicted != taken"
        assert a.num_draft_tokens == len(drafts or [])
        hit_ids = m.block_table(seq).tolist()[: len(p.hit_keys)] if p.first else []
        want = o.apply_allocation(seq, p, hit_ids, drafts)
        got = dict(
            num_scheduled_tokens=a.num_scheduled_tokens,
            num_cached_tokens=a.num_cached_tokens,
            num_context_tokens=a.num_context_tokens,
            new_block_ids=a.new_block_ids.tolist(),
            copies=[tuple(r) for r in a.copies.tolist()],
        )
        # one group: every copy-on-write row is group 0's
        assert got == {**want, "copies": [(0, *c) for c in want["copies"]]}
        assert a.new_block_ids.dtype == np.int32 and a.copies.dtype == np.int32
        assert a.copies.shape == (len(want["copies"]), 3)
        assert a.new_block_indptr.tolist() == [0, len(want["new_block_ids"])]

    # ---- rules ------------------------------------------------------------------------------
    @initialize(
        bs=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(4, 18),
        caching=st.sampled_from([True, True, True, False]),
        cpu_blocks=st.integers(0, 8),
        initial=st.lists(PROMPTS, min_size=1, max_size=4),
    )
    def setup(
        self,
        bs: int,
        num_blocks: int,
        caching: bool,
        cpu_blocks: int,
        initial: list[tuple[int, int, list[int], str | None, bool]],
    ) -> None:
        cfg = pagedkv.CacheConfig(
            num_blocks,
            bs,
            enable_prefix_caching=caching,
            num_cpu_blocks=cpu_blocks,
            enable_events=True,
        )
        self.m = pagedkv.KVCacheManager(cfg)
        # Block tables kept across steps from the step outputs' deltas: after every step they
        # must equal the dense tables the core copies out (through COW, preemption, swap, free,
        # fork and resets in between).
        self.tables = BlockTable(self.m, rows=1, width=1)
        self.table_updates = 0
        self.o = Oracle(num_blocks, bs, caching, cpu_blocks)
        for args in initial:
            self.add(*args)

    @rule(args=PROMPTS)
    def add_prompt(self, args: tuple[int, int, list[int], str | None, bool]) -> None:
        self.add(*args)

    @precondition(lambda self: self.o is not None and bool(self.o.seqs))
    @rule(i=st.integers(0, 100), keep=st.integers(1, 40), tail=st.lists(st.integers(0, 2), max_size=4))
    def add_sharing_prefix(self, i: int, keep: int, tail: list[int]) -> None:
        """A new request whose prompt starts with a live sequence's tokens (same salt)."""
        assert self.o is not None
        src = self.o.seqs[self.ids()[i % len(self.ids())]]
        self.add_tokens(src.tokens[:keep] + tail, src.salt, False)

    def add(self, family: int, cut: int, tail: list[int], salt: str | None, as_array: bool) -> None:
        self.add_tokens(FAMILY_BASE[family][:cut] + tail, salt, as_array)

    def add_tokens(self, prompt: list[int], salt: str | None, as_array: bool) -> None:
        assert self.m is not None and self.o is not None
        seq = self.next_id
        arg: Any = np.asarray(prompt, dtype=np.int64) if as_array else prompt
        if not prompt:
            self.expect_failure(
                Expected(E.InvalidArgumentError), lambda: self.m.add_sequence(seq, arg, cache_salt=salt)
            )
            return
        self.m.add_sequence(seq, arg, cache_salt=salt)
        self.o.seqs[seq] = MSeq(tokens=list(prompt), salt=salt)
        self.next_id += 1

    @precondition(lambda self: self.o is not None and bool(self.o.seqs))
    @rule(i=st.integers(0, 100))
    def add_duplicate(self, i: int) -> None:
        m = self.m
        assert m is not None
        seq = self.ids()[i % len(self.ids())]
        self.expect_failure(Expected(E.SequenceExistsError, seq_id=seq), lambda: m.add_sequence(seq, [1, 2, 3]))

    @rule(i=st.integers(0, 100), num_new=NUM_NEW)
    def allocate_slots(self, i: int, num_new: int) -> None:
        self.allocate(self.pick_in(i, {"running", "preempted"}), num_new)

    @precondition(
        lambda self: self.o is not None and any(s.status == "running" and s.table for s in self.o.seqs.values())
    )
    @rule(i=st.integers(0, 100), token=st.integers(0, 2), rest=st.booleans())
    def decode(self, i: int, token: int, rest: bool) -> None:
        """A decode step of a running sequence: finish its prefill or append one sampled token
        and schedule it (after a fork this is what triggers copy-on-write)."""
        assert self.m is not None and self.o is not None
        ids = [k for k, s in self.o.seqs.items() if s.status == "running" and s.table and not s.drafts]
        if not ids:
            return
        seq = ids[i % len(ids)]
        s = self.o.seqs[seq]
        if s.computed == len(s.tokens):
            self.m.append_tokens(seq, [token])
            s.tokens.append(token)
        self.allocate(seq, len(s.tokens) if rest else 1)

    @rule(i=st.integers(0, 100), tokens=st.lists(st.integers(0, 2), max_size=6))
    def append(self, i: int, tokens: list[int]) -> None:
        assert self.m is not None and self.o is not None
        seq = self.pick(i)
        try:
            s = self.o.get(seq)
        except Expected as exc:
            self.expect_failure(exc, lambda: self.m.append_tokens(seq, tokens))
            return
        if s.drafts:
            exc = Expected(E.InvalidSequenceStateError, seq_id=seq)
            self.expect_failure(exc, lambda: self.m.append_tokens(seq, tokens))
            return
        self.m.append_tokens(seq, tokens)
        s.tokens.extend(tokens)

    @rule(
        picks=st.lists(st.integers(0, 100), min_size=1, max_size=4),
        num_new=st.lists(NUM_NEW, min_size=4, max_size=4),
        appends=st.one_of(st.none(), st.lists(st.lists(st.integers(0, 2), max_size=3), min_size=4, max_size=4)),
        drafts=st.one_of(st.none(), st.lists(st.lists(st.integers(0, 2), max_size=5), min_size=4, max_size=4)),
    )
    def step(
        self,
        picks: list[int],
        num_new: list[int],
        appends: list[list[int]] | None,
        drafts: list[list[int]] | None,
    ) -> None:
        """One batched step (a verify step when it carries drafts); the oracle replays it as
        appends + single allocations."""
        assert self.m is not None and self.o is not None
        m, o = self.m, self.o
        seqs = [self.pick(i) for i in picks]
        mx = num_new[: len(seqs)]
        app = appends[: len(seqs)] if appends is not None else None
        dr = drafts[: len(seqs)] if drafts is not None else None
        before = snapshot(m, self.ids())
        out = m.step(
            np.asarray(seqs, dtype=np.uint64),
            np.asarray(mx, dtype=np.int32),
            app,
            draft_token_ids=dr,
            block_table=True,
        )
        kept = self.tables.update([out])
        assert kept.dtype == np.int32 and kept.shape == out.block_tables.shape
        assert kept.tolist() == out.block_tables.tolist()
        assert kept[0].tolist() == out.block_table.tolist()
        assert out.seq_ids.tolist() == seqs[: out.num_scheduled]
        self.table_updates += out.num_scheduled
        dup = next((q for k, q in enumerate(seqs) if q in seqs[:k]), None)
        if dup is not None:
            # A sequence listed twice is rejected before anything is scheduled or appended.
            assert out.num_scheduled == 0
            assert isinstance(out.error, pagedkv.InvalidArgumentError)
            assert (out.error.arg, out.error.value) == ("seq_ids", str(dup))
            assert snapshot(m, self.ids()) == before, "rejected step changed state"
            return
        n_ok = 0
        error: Expected | None = None
        expected_rows = []
        for k, seq in enumerate(seqs):
            added = app[k] if app is not None else []
            try:
                s = o.get(seq)
                old_len = len(s.tokens)
                s.tokens.extend(added)
                try:
                    p = o.plan(seq, mx[k], dr[k] if dr is not None else None)
                    o.check_capacity(p)
                except Expected:
                    del s.tokens[old_len:]
                    raise
            except Expected as exc:
                error = exc
                break
            table = out.block_table[k, : -(-int(out.seq_lens[k]) // o.bs)].tolist()
            hit_ids = table[: len(p.hit_keys)] if p.first else []
            d = dr[k] if dr is not None else []
            want_row = o.apply_allocation(seq, p, hit_ids, d)
            want_row["drafts"] = d
            expected_rows.append((want_row, list(o.seqs[seq].table)))
            n_ok += 1
        assert out.num_scheduled == n_ok
        if error is None:
            assert out.error is None
        else:
            assert type(out.error) is error.cls, (out.error, error.cls)
            for name, value in error.fields.items():
                assert getattr(out.error, name) == value
            if n_ok == 0:
                assert snapshot(m, self.ids()) == before, "failed step changed state"
        qsl = [0]
        for k, (want, table) in enumerate(expected_rows):
            row = out.block_table[k].tolist()
            assert row[: len(table)] == table and set(row[len(table) :]) <= {0}
            lo, hi = int(out.new_block_indptr[k]), int(out.new_block_indptr[k + 1])
            assert out.new_block_ids[lo:hi].tolist() == want["new_block_ids"]
            assert int(out.num_cached_tokens[k]) == want["num_cached_tokens"]
            assert int(out.context_lens[k]) == want["num_context_tokens"]
            nq = want["num_scheduled_tokens"] + len(want["drafts"])
            assert int(out.seq_lens[k]) == want["num_context_tokens"] + nq
            assert int(out.num_draft_tokens[k]) == len(want["drafts"])
            qsl.append(qsl[-1] + nq)
            bs = o.bs
            start = want["num_context_tokens"]
            slots = [table[pos // bs] * bs + pos % bs for pos in range(start, start + nq)]
            assert out.slot_mapping[qsl[-2] : qsl[-1]].tolist() == slots
            # The query's tokens: the scheduled ones, then the drafts in their lookahead slots.
            seq_tokens = o.seqs[out.seq_ids[k].item()].tokens
            want_ids = seq_tokens[start : start + want["num_scheduled_tokens"]] + want["drafts"]
            assert out.input_ids[qsl[-2] : qsl[-1]].tolist() == want_ids
        assert out.query_start_loc.tolist() == qsl
        assert out.num_draft_tokens.dtype == np.int32 and len(out.num_draft_tokens) == out.num_scheduled
        assert out.slot_mapping.dtype == np.int64
        copies = [c for want, _ in expected_rows for c in want["copies"]]
        assert [tuple(r) for r in out.copies.tolist()] == [(0, *c) for c in copies]

    @rule(
        i=st.integers(0, 100),
        token=st.integers(0, 2),
        drafts=st.lists(st.integers(0, 2), max_size=7),
        num_new=st.sampled_from([1, 1, 2, 64]),
    )
    def verify(self, i: int, token: int, drafts: list[int], num_new: int) -> None:
        """Speculative decoding's verify step on one sequence: append the sampled token, then
        schedule it with `drafts` in lookahead slots (refused when drafts are pending, the
        sequence is swapped, or the scheduled tokens stop short of the last one)."""
        assert self.m is not None and self.o is not None
        seq = self.pick_in(i, {"running", "preempted"})
        s = self.o.seqs.get(seq)
        if s is not None and not s.drafts:
            self.m.append_tokens(seq, [token])
            s.tokens.append(token)
        self.allocate(seq, num_new, drafts)

    @rule(i=st.integers(0, 100), num_accepted=st.integers(-1, 8))
    def accept_drafts(self, i: int, num_accepted: int) -> None:
        """The verifier keeps a prefix of the drafts (or a bad count is refused)."""
        assert self.m is not None and self.o is not None
        with_drafts = [k for k, s in self.o.seqs.items() if s.drafts]
        seq = with_drafts[i % len(with_drafts)] if with_drafts and i % 5 else self.pick(i)
        saved = self._save()
        try:
            want = self.o.accept(seq, num_accepted)
        except Expected as exc:
            self._restore(saved)
            self.expect_failure(exc, lambda: self.m.accept_drafts(seq, num_accepted))
            return
        free = self.m.pool.num_free
        (got,) = self.m.accept_drafts(seq, num_accepted)  # one group
        assert got.dtype == np.int32 and got.tolist() == want
        assert self.m.pool.num_free == free + len(want)

    @rule(i=st.integers(0, 100), child_known=st.integers(0, 5))
    def fork(self, i: int, child_known: int) -> None:
        assert self.m is not None and self.o is not None
        parent = self.pick_in(i, {"running", "preempted"})
        child = self.ids()[0] if (child_known == 0 and self.ids()) else self.next_id
        self.do_fork(parent, child)

    def do_fork(self, parent: int, child: int) -> None:
        assert self.m is not None and self.o is not None
        try:
            p = self.o.get(parent)
            if p.status == "swapped" or p.drafts:
                raise Expected(E.InvalidSequenceStateError)
            if child in self.o.seqs:
                raise Expected(E.SequenceExistsError, seq_id=child)
        except Expected as exc:
            self.expect_failure(exc, lambda: self.m.fork(parent, child))
            return
        free = self.m.pool.num_free
        self.m.fork(parent, child)
        assert self.m.pool.num_free == free, "fork allocated"
        for b in p.table:
            self.o.refs[b] += 1
        self.o.seqs[child] = MSeq(
            list(p.tokens), p.salt, p.status, p.computed, list(p.table), p.ncached, p.stale, looked_up=p.looked_up
        )
        self.next_id += 1

    @precondition(lambda self: self.o is not None and bool(self.o.seqs))
    @precondition(
        lambda self: self.o is not None and any(s.status == "running" and s.table for s in self.o.seqs.values())
    )
    @rule(i=st.integers(0, 100), token=st.integers(0, 2), on_child=st.booleans())
    def fork_then_decode(self, i: int, token: int, on_child: bool) -> None:
        """Parallel sampling: fork a running sequence, then one side samples a token. When the
        last block is partially filled this must plan exactly one copy-on-write."""
        assert self.m is not None and self.o is not None
        ids = [k for k, s in self.o.seqs.items() if s.status == "running" and s.table and not s.drafts]
        if not ids:
            return
        parent = ids[i % len(ids)]
        child = self.next_id
        self.do_fork(parent, child)
        assert child in self.o.seqs
        writer = child if on_child else parent
        other = parent if on_child else child
        other_table = self.m.block_table(other).tolist()
        s = self.o.seqs[writer]
        if s.computed == len(s.tokens):
            self.m.append_tokens(writer, [token])
            s.tokens.append(token)
        copies_before = self.o.counters["copies"]
        partial = s.computed % self.o.bs != 0
        self.allocate(writer, 1)
        # The other side's block table is unchanged by the writer's allocation.
        assert self.m.block_table(other).tolist() == other_table
        if self.o.counters["copies"] != copies_before:
            assert partial

    @rule(i=st.integers(0, 100))
    def free(self, i: int) -> None:
        assert self.m is not None and self.o is not None
        seq = self.pick(i)
        assert self.m.free(seq) == self.o.free_seq(seq)
        before = snapshot(self.m, self.ids())
        assert self.m.free(seq) is False, "second free must be a no-op"
        assert snapshot(self.m, self.ids()) == before

    @rule(picks=st.lists(st.integers(0, 100), min_size=1, max_size=3))
    def preempt(self, picks: list[int]) -> None:
        assert self.m is not None and self.o is not None
        seqs = [self.pick_in(i, {"running"}) for i in picks]
        try:
            self.o.check_group(seqs, {"running", "preempted"})
        except Expected as exc:
            self.expect_failure(exc, lambda: self.m.preempt(seqs))
            return
        self.m.preempt(seqs)
        self.o.preempt(seqs)

    @rule(picks=st.lists(st.integers(0, 100), min_size=1, max_size=3))
    def swap_out(self, picks: list[int]) -> None:
        assert self.m is not None and self.o is not None
        seqs = [self.pick_in(i, {"running"}) for i in picks]
        saved = self._save()
        try:
            want = self.o.swap_out(seqs)
        except Expected as exc:
            self._restore(saved)
            self.expect_failure(exc, lambda: self.m.swap_out(seqs))
            return
        got = self.m.swap_out(seqs)
        assert got.dtype == np.int32 and got.shape == (len(want), 2)
        assert [tuple(r) for r in got.tolist()] == want

    @rule(picks=st.lists(st.integers(0, 100), min_size=1, max_size=3))
    def swap_in(self, picks: list[int]) -> None:
        assert self.m is not None and self.o is not None
        seqs = [self.pick_in(i, {"swapped"}) for i in picks]
        saved = self._save()
        try:
            want = self.o.swap_in(seqs)
        except Expected as exc:
            self._restore(saved)
            self.expect_failure(exc, lambda: self.m.swap_in(seqs))
            return
        got = self.m.swap_in(seqs)
        assert [tuple(r) for r in got.tolist()] == want

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.m is not None and self.o is not None
        try:
            self.o.reset()
        except Expected as exc:
            self.expect_failure(exc, self.m.reset_prefix_cache)
            return
        self.m.reset_prefix_cache()
        p = self.m.pool
        assert all(p.block_hash(b) is None for b in range(p.num_blocks))

    @rule(i=st.integers(0, 100))
    def lookup(self, i: int) -> None:
        assert self.m is not None and self.o is not None
        seq = self.pick(i)
        try:
            s = self.o.get(seq)
        except Expected as exc:
            self.expect_failure(exc, lambda: self.m.lookup_prefix(seq))
            return
        before = snapshot(self.m, self.ids())
        keys, _ = self.o.find_hits(s)
        assert self.m.lookup_prefix(seq) == len(keys) * self.o.bs
        assert snapshot(self.m, self.ids()) == before, "lookup had side effects"

    @rule()
    def take_events(self) -> None:
        """The event stream matches the oracle's; equal keys <-> equal hashes (no collision)."""
        self._check_events()

    def _check_events(self) -> None:
        assert self.m is not None and self.o is not None
        got: list[tuple[Any, ...]] = []
        for ev in self.m.take_events():
            if isinstance(ev, pagedkv.BlockStored):
                assert ev.block_size == self.o.bs
                assert len(ev.token_ids) == self.o.bs * len(ev.block_hashes)
                for j, h in enumerate(ev.block_hashes):
                    assert isinstance(h, bytes) and len(h) == 32
                    got.append(
                        (
                            "stored",
                            h,
                            list(ev.token_ids[j * self.o.bs : (j + 1) * self.o.bs]),
                            ev.parent_block_hash if j == 0 else None,
                            j,
                            ev.extra_keys,
                        )
                    )
            elif isinstance(ev, pagedkv.BlockRemoved):
                got.extend(("removed", h) for h in ev.block_hashes)
            else:
                assert isinstance(ev, pagedkv.AllBlocksCleared)
                got.append(("cleared",))
        want = self.o.events
        self.o.events = []
        assert [g[0] for g in got] == [w[0] for w in want]
        for g, w in zip(got, want):
            if w[0] == "cleared":
                continue
            key, h = w[1], g[1]
            # One key, one hash; one hash, one key.
            assert self.hash_of_key.setdefault(key, h) == h, "same block content, two hashes"
            assert self.key_of_hash.setdefault(h, key) == key, "hash collision across contents"
            if g[0] == "stored":
                salt, prefix = key
                assert g[2] == list(prefix[-self.o.bs :])
                assert g[5] == ([("cache_salt", salt)] if salt is not None else [])
                if g[4] == 0:
                    parent_key = (salt, prefix[: -self.o.bs])
                    if not parent_key[1]:
                        assert g[3] is None
                    elif parent_key in self.hash_of_key:
                        assert g[3] == self.hash_of_key[parent_key]

    # ---- state save/restore for oracle calls that may raise midway -----------------------
    def _save(self) -> Any:
        import copy

        return copy.deepcopy(self.o)

    def _restore(self, saved: Any) -> None:
        self.o = saved

    # ---- invariants -------------------------------------------------------------------------
    @invariant()
    def matches_oracle(self) -> None:
        if self.m is None or self.o is None:
            return
        m, o = self.m, self.o
        m.check_invariants()  # docs/design.md invariants 1-4 (raises AssertionError with the message)
        p = m.pool
        assert [p.ref_count(b) for b in range(o.n)] == o.refs
        assert [p.block_hash(b) is not None for b in range(o.n)] == [k is not None for k in o.key]
        assert p.free_queue().tolist() == o.free_queue()
        assert p.num_free == o.free and p.num_used == o.n - 1 - o.free
        assert p.num_cached_free == len(o.lru)
        # Invariant 1 from the outside: free + used + null == num_blocks.
        assert p.num_free + sum(1 for b in range(1, o.n) if p.ref_count(b) > 0) + 1 == o.n
        assert m.num_sequences == len(o.seqs)
        for i, s in o.seqs.items():
            assert m.status(i) == s.status
            assert m.num_tokens(i) == len(s.tokens)
            assert m.token_ids(i).tolist() == s.tokens
            assert m.num_computed_tokens(i) == s.computed
            assert m.num_draft_tokens(i) == len(s.drafts)
            assert m.block_table(i).tolist() == s.table
        stats = m.stats()
        for name, value in o.counters.items():
            assert getattr(stats, name) == value, name
        assert stats.used == o.n - 1 - o.free
        assert stats.free == o.free
        assert stats.cached_free == len(o.lru)
        assert stats.cpu_used == len(o.cpu_refs) - len(o.cpu_free)

    def teardown(self) -> None:
        if self.m is None or self.o is None:
            return
        # The deltas carried the tables: whole-table reads only for tables new to the outputs
        # that the core reported from a later start (none: a new table's delta starts at 0).
        assert self.tables.num_table_reads == 0, (self.tables.num_table_reads, self.table_updates)
        m = self.m
        for i in self.ids():
            assert m.free(i)
        m.check_invariants()
        p = m.pool
        # Invariant 7: everything freed -> all ref counts 0, the pool whole, no sequence left.
        assert p.num_free == p.num_blocks - 1
        assert all(p.ref_count(b) == 0 for b in range(p.num_blocks))
        assert m.num_sequences == 0 and m.stats().cpu_used == 0
        # Invariant 8: a reset now succeeds and leaves no hash.
        m.reset_prefix_cache()
        assert all(p.block_hash(b) is None for b in range(p.num_blocks))
        assert isinstance(m.take_events()[-1], pagedkv.AllBlocksCleared)


TestManagerStateMachine = ManagerMachine.TestCase
