"""pagedkv.KVIndexer against ground truth from the workers' own managers.

A hypothesis state machine runs several workers, each a ``KVCacheManager`` doing random
operations (prefill steps, decode, fork, free, preemption, swap, reset, restart); every operation
publishes the worker's events as one numbered batch, and delivery rules hand batches to the
indexer in order, reordered (the next two swapped) or dropped. After every step, for every
worker, the indexer's hash set must equal the worker's resolvable set as of the last batch the
indexer applied (a subset while a gap awaits its snapshot), and overlaps of probe prompts must
equal the leading blocks that the manager's own ``lookup_prefix`` would serve. A restarted
worker's undelivered batches stay in flight, named with its old incarnation, and are delivered
late: each must be refused as stale and change nothing.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import pagedkv

BLOCK_SIZE = 4
NUM_BLOCKS = 12
NUM_CPU_BLOCKS = 6
NUM_WORKERS = 3
MAX_PENDING = 1

STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]
prompts = st.builds(
    lambda stem, tail: STEMS[stem] + tail, st.integers(0, len(STEMS) - 1), st.lists(st.integers(1, 3), max_size=6)
)
PROBES = [STEMS[0] + [1, 1, 1, 1, 2], STEMS[1] + [2], STEMS[2] + [1, 2, 3, 1, 1], [1, 2, 3, 4, 1]]


def new_manager() -> pagedkv.KVCacheManager:
    return pagedkv.KVCacheManager(
        pagedkv.CacheConfig(NUM_BLOCKS, BLOCK_SIZE, num_cpu_blocks=NUM_CPU_BLOCKS, enable_events=True)
    )


def resolvable(m: pagedkv.KVCacheManager) -> frozenset[bytes]:
    pool = m.pool
    out = frozenset(h for b in range(1, NUM_BLOCKS) if (h := pool.block_hash(b)) is not None)
    assert all(pool.lookup(h) is not None for h in out)
    return out


def lookup_blocks(m: pagedkv.KVCacheManager, prompt: list[int]) -> int:
    """Leading cached blocks the manager itself would serve for ``prompt`` (no side effect)."""
    probe = 10**9
    m.add_sequence(probe, prompt)
    try:
        return m.lookup_prefix(probe) // BLOCK_SIZE
    finally:
        m.free(probe)


class Worker:
    def __init__(self, incarnation: int) -> None:
        self.incarnation = incarnation  # the indexer's number for this registration
        self.m = new_manager()
        self.seqs: list[int] = []
        self.next_seq = 0  # next batch number to publish
        self.outbox: list[tuple[int, list[object]]] = []
        self.truth: dict[int, frozenset[bytes]] = {}  # batch number -> resolvable set after it


class IndexerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ix = pagedkv.KVIndexer(BLOCK_SIZE, max_pending=MAX_PENDING)
        self.workers = [Worker(self.ix.add_worker(w)) for w in range(NUM_WORKERS)]
        # Batches of restarted workers' earlier incarnations, still in flight.
        self.late: list[tuple[int, int, int, list[object]]] = []
        self.next_sid = 1

    # ---- worker operations (each publishes one batch) --------------------------------------

    def _publish(self, w: int) -> None:
        wk = self.workers[w]
        events = wk.m.take_events()
        wk.truth[wk.next_seq] = resolvable(wk.m)
        wk.outbox.append((wk.next_seq, events))
        wk.next_seq += 1

    def _try(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        try:
            fn(*args)
        except pagedkv.PagedKVError:
            pass

    @rule(w=st.integers(0, NUM_WORKERS - 1), prompt=prompts, budget=st.integers(1, 16))
    def prefill(self, w: int, prompt: list[int], budget: int) -> None:
        wk = self.workers[w]
        sid = self.next_sid
        self.next_sid += 1
        wk.m.add_sequence(sid, prompt)
        wk.seqs.append(sid)
        out = wk.m.step([sid], [budget])
        if out.error is not None:
            wk.m.free(sid)
            wk.seqs.remove(sid)
        self._publish(w)

    @rule(w=st.integers(0, NUM_WORKERS - 1), data=st.data(), token=st.integers(1, 3))
    def advance(self, w: int, data: st.DataObject, token: int) -> None:
        wk = self.workers[w]
        if wk.seqs:
            sid = data.draw(st.sampled_from(wk.seqs))
            if wk.m.status(sid) == "running":
                if wk.m.num_computed_tokens(sid) == wk.m.num_tokens(sid):
                    wk.m.append_tokens(sid, [token])
                self._try(wk.m.allocate_slots, sid, 4)
        self._publish(w)

    @rule(
        w=st.integers(0, NUM_WORKERS - 1),
        data=st.data(),
        op=st.sampled_from(["free", "preempt", "swap_out", "swap_in", "fork"]),
    )
    def other(self, w: int, data: st.DataObject, op: str) -> None:
        wk = self.workers[w]
        if wk.seqs:
            sid = data.draw(st.sampled_from(wk.seqs))
            if op == "free":
                wk.m.free(sid)
                wk.seqs.remove(sid)
            elif op == "preempt":
                self._try(wk.m.preempt, [sid])
            elif op == "swap_out":
                self._try(wk.m.swap_out, [sid])
            elif op == "swap_in":
                self._try(wk.m.swap_in, [sid])
            elif wk.m.status(sid) == "running":
                child = self.next_sid
                self.next_sid += 1
                wk.m.fork(sid, child)
                wk.seqs.append(child)
        self._publish(w)

    @rule(w=st.integers(0, NUM_WORKERS - 1))
    def reset(self, w: int) -> None:
        wk = self.workers[w]
        for sid in wk.seqs:
            wk.m.free(sid)
        wk.seqs.clear()
        wk.m.reset_prefix_cache()
        self._publish(w)

    @rule(w=st.integers(0, NUM_WORKERS - 1))
    def restart(self, w: int) -> None:
        """The worker dies and comes back empty: the router drops it and re-registers it; its
        undelivered batches are still in flight."""
        old = self.workers[w]
        self.late += [(w, old.incarnation, seq, events) for seq, events in old.outbox]
        assert self.ix.remove_worker(w)
        self.workers[w] = Worker(self.ix.add_worker(w))
        assert self.workers[w].incarnation > old.incarnation

    # ---- delivery --------------------------------------------------------------------------

    def _deliver(self, w: int, seq: int, events: list[object]) -> None:
        outcome = self.ix.apply(w, seq, events, incarnation=self.workers[w].incarnation)
        assert outcome in ("applied", "buffered", "duplicate", "gap")
        if outcome == "gap":
            assert self.ix.needs_resync(w)

    @precondition(lambda self: any(wk.outbox for wk in self.workers))
    @rule(data=st.data())
    def deliver_in_order(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from([i for i, wk in enumerate(self.workers) if wk.outbox]))
        self._deliver(w, *self.workers[w].outbox.pop(0))

    @precondition(lambda self: any(len(wk.outbox) >= 2 for wk in self.workers))
    @rule(data=st.data())
    def deliver_reordered(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from([i for i, wk in enumerate(self.workers) if len(wk.outbox) >= 2]))
        out = self.workers[w].outbox
        second = out.pop(1)
        first = out.pop(0)
        self._deliver(w, *second)
        self._deliver(w, *first)

    @precondition(lambda self: any(wk.outbox for wk in self.workers))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from([i for i, wk in enumerate(self.workers) if wk.outbox]))
        self.workers[w].outbox.pop(0)

    @precondition(lambda self: bool(self.late))
    @rule(data=st.data())
    def deliver_late(self, data: st.DataObject) -> None:
        """A batch of a restarted worker's old incarnation arrives after the re-add."""
        w, inc, seq, events = self.late.pop(data.draw(st.integers(0, len(self.late) - 1)))
        before = (self.ix.worker_status(w), self.ix.worker_hashes(w))
        assert self.ix.apply(w, seq, events, incarnation=inc) == "stale"
        assert (self.ix.worker_status(w), self.ix.worker_hashes(w)) == before

    @rule(w=st.integers(0, NUM_WORKERS - 1))
    def resync_if_needed(self, w: int) -> None:
        """What a replica does when the router reports a gap: a snapshot numbered in its stream."""
        wk = self.workers[w]
        if not self.ix.needs_resync(w):
            return
        self._publish(w)  # the snapshot takes the next number; batches before it are stale
        seq, _ = wk.outbox.pop()
        assert self.ix.apply_snapshot(w, seq, sorted(wk.truth[seq]), incarnation=wk.incarnation) == "applied"
        assert not self.ix.needs_resync(w)

    # ---- checks ----------------------------------------------------------------------------

    @invariant()
    def index_matches_each_managers_cache(self) -> None:
        for w, wk in enumerate(self.workers):
            st_ = self.ix.worker_status(w)
            assert st_ is not None
            held = set(self.ix.worker_hashes(w))
            if st_["next_seq"] is None:
                assert held == set()
                continue
            truth = wk.truth[st_["next_seq"] - 1] if st_["next_seq"] - 1 in wk.truth else frozenset()
            if st_["needs_resync"]:
                assert held <= truth, "stale entry after a gap"
            else:
                assert held == truth
            up_to_date = not st_["needs_resync"] and st_["next_seq"] == wk.next_seq
            for prompt in PROBES:
                got = self.ix.overlap(prompt)[w]
                if up_to_date:
                    assert got == lookup_blocks(wk.m, prompt)
                else:
                    hashes = self.ix.block_hashes(prompt, num_blocks=(len(prompt) - 1) // BLOCK_SIZE)
                    want = 0
                    while want < len(hashes) and hashes[want] in held:
                        want += 1
                    assert got == want


TestIndexerMachine = IndexerMachine.TestCase
TestIndexerMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


# ---- hand-written cases ------------------------------------------------------------------------


def _stored(hashes: list[bytes]) -> list[object]:
    return ["BlockStored", hashes, None, [], BLOCK_SIZE, None, None]


def test_overlap_counts_leading_blocks_only() -> None:
    ix = pagedkv.KVIndexer(BLOCK_SIZE)
    a, b, c = (bytes([i]) * 32 for i in (1, 2, 3))
    assert ix.apply(0, 0, [_stored([a, b, c])]) == "applied"
    assert ix.apply(1, 0, [_stored([a, c])]) == "applied"
    assert ix.overlap_hashes([a, b, c]) == {0: 3, 1: 1}
    assert ix.overlap_hashes([b, c]) == {0: 2, 1: 0}
    assert ix.overlap_hashes([]) == {0: 0, 1: 0}
    assert ix.num_hashes == 3


def test_token_queries_hash_like_the_manager_with_keys() -> None:
    m = new_manager()
    prompt = list(range(1, 14))
    m.add_sequence(1, prompt, cache_salt="tenant", mm_items=[(b"img", 2, 3)])
    m.allocate_slots(1, len(prompt))
    ix = pagedkv.KVIndexer(BLOCK_SIZE)
    ix.apply(7, 0, m.take_events())
    assert ix.overlap(prompt, cache_salt="tenant", mm_items=[(b"img", 2, 3)]) == {7: 3}
    assert ix.overlap(prompt, cache_salt="tenant") == {7: 0}
    assert ix.overlap(prompt) == {7: 0}
    assert ix.block_hashes(prompt, cache_salt="tenant", mm_items=[(b"img", 2, 3)]) == [
        m.pool.block_hash(b) for b in m.block_table(1)[:3].tolist()
    ]


def test_seed_and_algorithm_must_match_the_engines() -> None:
    cfg = pagedkv.CacheConfig(NUM_BLOCKS, BLOCK_SIZE, hash_algo="xxh3_128", hash_seed=b"s", enable_events=True)
    m = pagedkv.KVCacheManager(cfg)
    prompt = list(range(9))
    m.add_sequence(1, prompt)
    m.allocate_slots(1, 9)
    events = m.take_events()
    same = pagedkv.KVIndexer(BLOCK_SIZE, hash_algo="xxh3_128", hash_seed=b"s")
    other = pagedkv.KVIndexer(BLOCK_SIZE, hash_algo="xxh3_128")
    same.apply(0, 0, events)
    assert same.overlap(prompt) == {0: 2}
    # The events name their hash root (algorithm + seed: the engine's cache identity); an
    # indexer with another seed refuses them instead of holding hashes no query can match.
    assert events[0].hash_root == same.hash_root != other.hash_root
    with pytest.raises(pagedkv.InvalidArgumentError, match="hash root"):
        other.apply(0, 0, events)
    assert other.worker_ids() == [] and other.num_hashes == 0
    # A "tokens" worker is rehashed with the indexer's own hasher: its root does not matter.
    other.add_worker(1, hash_source="tokens")
    other.apply(1, 0, events)
    assert other.overlap(prompt) == {1: 2}
    assert (same.hash_algo, same.hash_seed, same.block_size, same.max_pending) == ("xxh3_128", b"s", 4, 0)
    assert len(same.hash_root) == 32


def test_bad_input_raises_typed_errors_and_changes_nothing() -> None:
    ix = pagedkv.KVIndexer(BLOCK_SIZE)
    good = _stored([b"\x01" * 32])
    with pytest.raises(pagedkv.InvalidArgumentError, match="block_size"):
        ix.apply(0, 0, [good, ["BlockStored", [b"\x02" * 32], None, [], 8, None]])
    with pytest.raises(pagedkv.InvalidArgumentError, match="unknown event type"):
        ix.apply(0, 0, [good, ["BlockEvicted", []]])
    with pytest.raises(pagedkv.InvalidArgumentError, match="at most 32 bytes"):
        ix.apply(0, 0, [_stored([b"\x01" * 33])])
    with pytest.raises(pagedkv.InvalidArgumentError, match="list of events"):
        ix.apply(0, 0, b"payload")
    with pytest.raises(pagedkv.InvalidArgumentError):
        ix.apply(-1, 0, [good])
    assert ix.worker_ids() == [] and ix.num_hashes == 0
    ix.add_worker(3, hash_source="tokens")
    with pytest.raises(pagedkv.InvalidArgumentError, match="token ids"):
        ix.apply(3, 0, [good])  # a tokens worker needs the block's tokens
    with pytest.raises(pagedkv.InvalidArgumentError, match="snapshots"):
        ix.apply_snapshot(3, 0, [])
    with pytest.raises(pagedkv.InvalidArgumentError, match="already registered"):
        ix.add_worker(3)
    with pytest.raises(pagedkv.InvalidArgumentError, match="hash_source"):
        ix.add_worker(4, hash_source="vllm")
    with pytest.raises(pagedkv.InvalidArgumentError, match="block_size"):
        pagedkv.KVIndexer(0)
    with pytest.raises(pagedkv.InvalidArgumentError, match="hash_algo"):
        pagedkv.KVIndexer(4, hash_algo="md5")
    with pytest.raises(pagedkv.InvalidArgumentError, match="num_blocks"):
        ix.block_hashes([1, 2, 3], num_blocks=1)
    assert ix.worker_status(3) == {
        "worker_id": 3,
        "incarnation": 1,
        "hash_source": "tokens",
        "num_blocks": 0,
        "next_seq": None,
        "num_pending": 0,
        "needs_resync": False,
        "gaps": 0,
    }
    assert ix.worker_status(99) is None


def test_joining_mid_stream_needs_a_snapshot() -> None:
    ix = pagedkv.KVIndexer(BLOCK_SIZE)
    assert ix.apply(0, 5, [_stored([b"\x01" * 32])]) == "applied"
    assert ix.needs_resync(0)
    ix.apply_snapshot(0, 6, [b"\x02" * 32])
    assert ix.worker_hashes(0) == [b"\x02" * 32]
    assert ix.apply(0, 6, []) == "duplicate"
    assert ix.apply(0, 7, [["BlockRemoved", [b"\x02" * 32]]]) == "applied"
    assert ix.worker_hashes(0) == []


def test_a_snapshot_of_another_cache_identity_is_refused() -> None:
    ix = pagedkv.KVIndexer(BLOCK_SIZE, hash_seed=b"model-a")
    other = pagedkv.KVIndexer(BLOCK_SIZE, hash_seed=b"model-b")
    assert ix.apply(0, 0, [["BlockStored", [b"\x01" * 32], None, [], BLOCK_SIZE]]) == "applied"
    with pytest.raises(pagedkv.InvalidArgumentError, match="hash root"):
        ix.apply_snapshot(0, 1, [b"\x02" * 32], hash_root=other.hash_root)
    with pytest.raises(pagedkv.InvalidArgumentError, match="32 bytes"):
        ix.apply_snapshot(0, 1, [b"\x02" * 32], hash_root=b"short")
    assert ix.worker_hashes(0) == [b"\x01" * 32]  # nothing changed
    assert ix.worker_status(0)["next_seq"] == 1  # type: ignore[index]
    ix.apply_snapshot(0, 1, [b"\x02" * 32], hash_root=ix.hash_root)
    assert ix.worker_hashes(0) == [b"\x02" * 32]


def test_a_block_re_announced_by_vllm_full_report_mode_is_held_once() -> None:
    """vLLM's per-request ``kv_cache_report_mode="full"`` stores a prefix hit's blocks again
    (one more ``BlockStored``, no ``BlockRemoved`` to match): the worker holds each hash once, so
    after vLLM evicts the prefix (one ``BlockRemoved`` per block) the index no longer claims it."""
    toks = list(range(1, 9))
    for source, hashes in (("tokens", [11, 12]), ("engine", [b"\x0b" * 32, b"\x0c" * 32])):
        ix = pagedkv.KVIndexer(BLOCK_SIZE)
        ix.add_worker(9, hash_source=source)
        stored = ["BlockStored", hashes, None, toks, BLOCK_SIZE, None, "GPU"]
        assert ix.apply(9, 0, [stored]) == "applied"  # first request computes the prefix
        assert ix.apply(9, 1, [stored]) == "applied"  # a second request hits it: re-announced
        assert ix.worker_status(9)["num_blocks"] == 2  # type: ignore[index]
        held = ix.overlap(toks + [0]) if source == "tokens" else ix.overlap_hashes(hashes)
        assert held == {9: 2}
        evict = [["BlockRemoved", [hashes[1]], "GPU"], ["BlockRemoved", [hashes[0]], "GPU"]]
        assert ix.apply(9, 2, evict) == "applied"
        assert ix.worker_hashes(9) == [] and ix.num_hashes == 0
        held = ix.overlap(toks + [0]) if source == "tokens" else ix.overlap_hashes(hashes)
        assert held == {9: 0}


def test_a_re_added_worker_refuses_its_old_incarnations_late_batches() -> None:
    """A worker removed and re-added under its id: a late batch (and snapshot) of its old
    incarnation is refused as stale, and the new incarnation's batches 0, 1, ... apply (they
    were dropped as duplicates of the old incarnation's numbers); no snapshot needed."""
    toks = list(range(1, 13))
    ix = pagedkv.KVIndexer(BLOCK_SIZE, max_pending=4)
    old = ix.add_worker(3, hash_source="tokens")
    for seq in range(57):
        assert ix.apply(3, seq, [], incarnation=old) == "applied"
    assert ix.remove_worker(3)
    # Late before the re-add: stale, and the removed worker is not registered again.
    assert ix.apply(3, 57, [["BlockStored", [1], None, toks[:4], BLOCK_SIZE]], incarnation=old) == "stale"
    assert ix.worker_ids() == []
    new = ix.add_worker(3, hash_source="tokens")
    assert new > old and ix.worker_status(3)["incarnation"] == new  # type: ignore[index]
    old_batch = [["BlockStored", [21, 22], None, toks[4:12], BLOCK_SIZE]]
    assert ix.apply(3, 58, old_batch, incarnation=old) == "stale"
    assert ix.apply_snapshot(3, 59, [], incarnation=old) == "stale"
    assert ix.worker_status(3)["next_seq"] is None and ix.worker_hashes(3) == []  # type: ignore[index]
    assert ix.apply(3, 0, [["BlockStored", [31, 32], None, toks[:8], BLOCK_SIZE]], incarnation=new) == "applied"
    assert ix.apply(3, 1, [["BlockStored", [33], 32, toks[8:12], BLOCK_SIZE]], incarnation=new) == "applied"
    assert ix.overlap(toks + [0]) == {3: 3}
    assert not ix.needs_resync(3)
    assert ix.apply(3, 2, [], incarnation=None) == "applied"  # None: the current incarnation
    # An incarnation never issued to this id: refused, nothing changed.
    with pytest.raises(pagedkv.InvalidArgumentError, match="incarnation"):
        ix.apply(3, 3, [], incarnation=new + 1)
    with pytest.raises(pagedkv.InvalidArgumentError, match="incarnation"):
        ix.apply(3, 3, [], incarnation=-1)
    assert ix.worker_status(3)["next_seq"] == 3  # type: ignore[index]


def test_wire_values_are_moved_as_they_are() -> None:
    """The binding hands wire events to the core as value trees: numpy token arrays as their
    lists, unsigned 128-bit hashes as their bits, too-large ints and deep nesting refused or
    cut by the core's rules, never a crash."""
    np = pytest.importorskip("numpy")
    ix = pagedkv.KVIndexer(BLOCK_SIZE)
    ix.add_worker(1, hash_source="tokens")
    toks = np.arange(1, 9, dtype=np.int64)
    assert ix.apply(1, 0, [("BlockStored", (2**128 - 1, 5), None, toks, BLOCK_SIZE)]) == "applied"
    assert ix.overlap(list(range(1, 9)) + [0]) == {1: 2}
    assert ix.apply(1, 1, [["BlockRemoved", [-1, 5]]]) == "applied"  # -1: the same 128 bits
    assert ix.overlap(list(range(1, 9)) + [0]) == {1: 0}
    with pytest.raises(pagedkv.InvalidArgumentError, match="128 bits"):
        ix.apply(1, 2, [["BlockRemoved", [2**129]]])
    with pytest.raises(pagedkv.InvalidArgumentError, match="token_ids"):
        ix.apply(1, 2, [["BlockStored", [7], None, [1, 2, 3, 2**40], BLOCK_SIZE]])
    deep: list[object] = []
    for _ in range(200):
        deep = [deep]
    # extra_keys whose only entry nests 200 lists: not a key the indexer can hash with, so the
    # block is left out (under-reported), and nothing overflows.
    assert ix.apply(1, 2, [["BlockStored", [8], None, [1, 2, 3, 4], BLOCK_SIZE, None, None, None, [deep]]]) == "applied"
    assert ix.worker_status(1)["num_blocks"] == 0  # type: ignore[index]
    assert ix.overlap_hashes(np.array([3, 4], dtype=np.uint64)) == {1: 0}


def test_only_full_attention_groups_count_toward_the_overlap() -> None:
    """llm-d-router #2362: a hybrid worker's sliding-window group holds a prefix's last window
    only and serves no prefix; an indexer that counted it (vLLM orders groups by its own rules,
    so the sliding-window group may be group 0) routed to workers that cannot serve the prefix.
    A worker registered with its groups has only its first full-attention group indexed."""
    groups = [pagedkv.KVCacheGroupSpec("sliding_window", 4, 8, window=8), pagedkv.KVCacheGroupSpec("full", 4, 8)]
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(65, groups=groups, layer_groups=[0, 1], enable_events=True))
    prompt = list(range(1, 18))
    m.add_sequence(1, prompt)
    m.step([1], 17).raise_for_error()
    events = m.take_events()
    assert {e.group for e in events} == {0, 1}
    ix = pagedkv.KVIndexer(BLOCK_SIZE)
    ix.add_worker(1, groups=groups)  # receives only the sliding-window group's blocks
    ix.add_worker(2, groups=["sliding_window", "full"])  # receives every group's
    ix.add_worker(3, groups=["sliding_window"])  # no group serves a prefix
    assert ix.apply(1, 0, [e for e in events if e.group == 0]) == "applied"
    assert ix.apply(2, 0, events) == "applied"
    assert ix.apply(3, 0, events) == "applied"
    probe = prompt + [99]
    assert ix.overlap(probe) == {1: 0, 2: 4, 3: 0}
    # Evicted by another request: the sliding-window group's removals leave the prefix, the
    # full-attention group's cut it.
    m.free(1)
    m.add_sequence(2, list(range(1000, 1128)))
    m.step([2], 128).raise_for_error()
    removed = [e for e in m.take_events() if isinstance(e, pagedkv.BlockRemoved)]
    assert {e.group for e in removed} == {0, 1}
    assert ix.apply(2, 1, [e for e in removed if e.group == 0]) == "applied"
    assert ix.overlap(probe)[2] == 4
    assert ix.apply(2, 2, [e for e in removed if e.group == 1]) == "applied"
    assert ix.overlap(probe)[2] == 0

    # vLLM wire events name the group in group_idx (field 9 / 3): group 0 sliding here.
    toks = list(range(1, 13))
    stored = ["BlockStored", [11, 12, 13], None, toks, BLOCK_SIZE, None, "GPU", None, None]
    vx = pagedkv.KVIndexer(BLOCK_SIZE)
    vx.add_worker(7, hash_source="tokens", groups=["sliding_window", "full"])
    vx.add_worker(8, hash_source="tokens")  # one full-attention group: group 0
    assert vx.apply(7, 0, [stored + [0]]) == "applied"
    assert vx.apply(8, 0, [stored + [0]]) == "applied"
    assert vx.overlap(toks + [0]) == {7: 0, 8: 3}
    assert vx.apply(7, 1, [stored + [1], ["BlockRemoved", [11, 12], "GPU", 0]]) == "applied"
    assert vx.overlap(toks + [0]) == {7: 3, 8: 3}


def test_bad_worker_groups_are_refused() -> None:
    ix = pagedkv.KVIndexer(BLOCK_SIZE)
    for bad in ([], ["global"], "full", [1], None.__class__):
        with pytest.raises(pagedkv.InvalidArgumentError, match="groups"):
            ix.add_worker(1, groups=bad)  # type: ignore[arg-type]
    assert ix.worker_ids() == []
    ix.add_worker(1, groups=["full"])
    m = pagedkv.KVCacheManager(
        pagedkv.CacheConfig(8, groups=[pagedkv.KVCacheGroupSpec("full", 4, 8)], layer_groups=[0], enable_events=True)
    )
    m.add_sequence(1, [1, 2, 3, 4, 5])
    m.step([1], 5).raise_for_error()
    [stored] = m.take_events()
    assert isinstance(stored, pagedkv.BlockStored) and stored.group == 0
    for bad_group in (-1, "0", 1.5):
        with pytest.raises(pagedkv.InvalidArgumentError, match="group must be an int"):
            ix.apply(1, 0, [(0, stored), (bad_group, stored)])
    assert ix.worker_status(1)["next_seq"] is None  # type: ignore[index]


def test_router_registers_a_workers_groups() -> None:
    """``Router.add_worker(groups=...)`` hands the group kinds to its indexer: a worker whose
    sliding-window group 0 holds a prefix has no overlap there, its full-attention group does."""
    from pagedkv.routing import Router

    router = Router(pagedkv.KVIndexer(BLOCK_SIZE))
    router.add_worker(1, hash_source="tokens", groups=["sliding_window", "full"])
    toks = list(range(1, 9))
    stored = ["BlockStored", [11, 12], None, toks, BLOCK_SIZE, None, "GPU", None, None]
    router.apply_events(1, 0, [stored + [0]])
    assert router.indexer.overlap(toks + [0]) == {1: 0}
    router.apply_events(1, 1, [stored + [1]])
    assert router.indexer.overlap(toks + [0]) == {1: 2}
    with pytest.raises(pagedkv.InvalidArgumentError, match="groups"):
        router.add_worker(2, groups=[])
