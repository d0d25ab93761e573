"""The KV event stream has set semantics per cache (see ``docs/design.md``, "KV events").

Every ``BlockStored`` carries the manager's ``hash_root`` (its hash algorithm and seed: the
cache identity), equal to that of an indexer with the same algorithm and seed.

Replaying the events into a set of hashes -- insert on ``BlockStored``, remove on
``BlockRemoved``, clear on ``AllBlocksCleared`` -- must give, after every operation, exactly the
hashes that a prefix lookup in that manager resolves; each hash is announced at most once while
it stays resolvable, and every ``BlockStored``'s parent is in the set (or ``None``). A router
keeping one set per worker therefore never drops a live prefix and never sees an orphan chain.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import pagedkv

BLOCK_SIZE = 4
NUM_BLOCKS = 12  # 11 usable: small enough that evictions are frequent
NUM_CPU_BLOCKS = 8

# Prompts drawn from a few shared stems so that prefixes (and same-step duplicates) are common.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]
prompts = st.builds(
    lambda stem, tail: STEMS[stem] + tail, st.integers(0, len(STEMS) - 1), st.lists(st.integers(1, 3), max_size=6)
)


def resolvable_hashes(m: pagedkv.KVCacheManager) -> set[bytes]:
    """Ground truth: the hashes the pool carries, each checked to resolve through lookup."""
    pool = m.pool
    carried = {h for b in range(1, NUM_BLOCKS) if (h := pool.block_hash(b)) is not None}
    for h in carried:
        assert pool.lookup(h) is not None, "a carried hash does not resolve"
    return carried


class EventSetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = pagedkv.KVCacheManager(
            pagedkv.CacheConfig(NUM_BLOCKS, BLOCK_SIZE, num_cpu_blocks=NUM_CPU_BLOCKS, enable_events=True)
        )
        self.root = pagedkv.KVIndexer(BLOCK_SIZE).hash_root  # same algorithm, same (empty) seed
        self.replayed: set[bytes] = set()
        self.ever_announced: set[bytes] = set()
        self.seqs: list[int] = []
        self.next_id = 1

    def _call(self, fn, *args) -> object | None:  # type: ignore[no-untyped-def]
        try:
            return fn(*args)
        except pagedkv.PagedKVError:
            return None  # a refused call changes nothing; the invariant still checks the stream

    @rule(prompt=prompts)
    def add(self, prompt: list[int]) -> None:
        sid = self.next_id
        self.next_id += 1
        self.m.add_sequence(sid, prompt)
        self.seqs.append(sid)

    @precondition(lambda self: len(self.seqs) >= 1)
    @rule(data=st.data(), budget=st.integers(1, 12))
    def step_several(self, data: st.DataObject, budget: int) -> None:
        """One batched step over a few sequences: same-step prefills of one prompt happen here."""
        ids = data.draw(st.lists(st.sampled_from(self.seqs), min_size=1, max_size=3, unique=True))
        runnable = [s for s in ids if self.m.status(s) in ("running", "preempted")]
        if not runnable:
            return
        out = self.m.step(runnable, [budget] * len(runnable))
        assert out.num_scheduled <= len(runnable)

    @precondition(lambda self: len(self.seqs) >= 1)
    @rule(data=st.data(), token=st.integers(1, 3))
    def decode(self, data: st.DataObject, token: int) -> None:
        sid = data.draw(st.sampled_from(self.seqs))
        if self.m.status(sid) != "running" or self.m.num_computed_tokens(sid) < self.m.num_tokens(sid):
            return
        self.m.append_tokens(sid, [token])
        self._call(self.m.allocate_slots, sid, 1)

    @precondition(lambda self: len(self.seqs) >= 1)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.seqs))
        if self.m.status(parent) != "running":
            return
        child = self.next_id
        self.next_id += 1
        if self._call(self.m.fork, parent, child) is None and child not in self._known():
            return
        self.seqs.append(child)

    def _known(self) -> set[int]:
        known = set()
        for s in range(1, self.next_id):
            try:
                self.m.status(s)
                known.add(s)
            except pagedkv.UnknownSequenceError:
                pass
        return known

    @precondition(lambda self: len(self.seqs) >= 1)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.seqs))
        self.m.free(sid)
        self.seqs.remove(sid)

    @precondition(lambda self: len(self.seqs) >= 1)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.seqs))
        self._call(self.m.preempt, [sid])

    @precondition(lambda self: len(self.seqs) >= 1)
    @rule(data=st.data())
    def swap_out_then_maybe_in(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.seqs))
        if self._call(self.m.swap_out, [sid]) is not None and data.draw(st.booleans()):
            self._call(self.m.swap_in, [sid])

    @precondition(lambda self: len(self.seqs) >= 1)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.seqs))
        if self.m.status(sid) == "swapped":
            self._call(self.m.swap_in, [sid])

    @rule()
    def reset(self) -> None:
        self._call(self.m.reset_prefix_cache)

    @invariant()
    def stream_replays_to_the_resolvable_set(self) -> None:
        for ev in self.m.take_events():
            if isinstance(ev, pagedkv.BlockStored):
                assert ev.hash_root == self.root, "BlockStored without the manager's hash root"
                parent = ev.parent_block_hash
                assert parent is None or parent in self.replayed, "BlockStored with an unknown parent"
                for h in ev.block_hashes:
                    assert h not in self.replayed, "hash announced twice while resolvable"
                    self.replayed.add(h)
                    self.ever_announced.add(h)
                    parent = h
            elif isinstance(ev, pagedkv.BlockRemoved):
                for h in ev.block_hashes:
                    assert h in self.replayed, "BlockRemoved for a hash not in the set"
                    self.replayed.remove(h)
            else:
                assert isinstance(ev, pagedkv.AllBlocksCleared)
                self.replayed.clear()
        assert self.replayed == resolvable_hashes(self.m)


TestEventSet = EventSetMachine.TestCase
TestEventSet.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_two_copies_of_one_prompt_announce_each_hash_once() -> None:
    """Two sequences prefilling the same prompt in one step, the first in a small chunk: neither
    can hit the other's blocks, so each caches its own copy of both full blocks. The stream
    announces each hash once, and evicting the first copy announces nothing."""
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(NUM_BLOCKS, BLOCK_SIZE, enable_events=True))
    prompt = list(range(1, 10))  # 2 full blocks + 1 token
    m.add_sequence(1, prompt)
    m.add_sequence(2, prompt)
    m.step([1, 2], [2, 9]).raise_for_error()  # seq 1's first block is not full yet
    m.step([1], [7]).raise_for_error()
    copies = [m.block_table(s)[:2].tolist() for s in (1, 2)]
    assert set(copies[0]).isdisjoint(copies[1])  # two physical copies, both cached
    assert [m.pool.block_hash(b) for b in copies[0]] == [m.pool.block_hash(b) for b in copies[1]]
    stored = [e for e in m.take_events() if isinstance(e, pagedkv.BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    assert hashes == [m.pool.block_hash(b) for b in copies[1]]  # once each
    m.free(1)
    m.free(2)
    # Allocate everything else: the LRU evicts the cached copies one by one.
    m.add_sequence(3, [7] * (BLOCK_SIZE * (NUM_BLOCKS - 1)))
    m.allocate_slots(3, BLOCK_SIZE * (NUM_BLOCKS - 1))
    removed = [h for e in m.take_events() if isinstance(e, pagedkv.BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(hashes)  # once each, when the last copy went
