"""Threads calling one ``BlockPool`` and one ``KVCacheManager`` at once, with the GIL released
inside every call, so the Rust hot paths really run in parallel.

Pool: allocate, free, incref as a fork does, cache + lookup + touch as prefix hits do, and
read-only queries; a shared Python-side ledger records every reference a thread holds, so a
block handed out by ``allocate`` while someone holds it is caught (no block owned twice).
Manager: shared prompt prefixes (hits cross threads), allocation, forks with copy-on-write,
batched steps, frees, pool views read while another thread mutates. At the end, after every
thread released what it holds, no block is lost (free == usable, every ref count 0, the free
queue holds every usable block exactly once) and ``check_invariants`` passes.

The number of operations is fixed (not a time budget) so a run is reproducible in size; the
interleaving is whatever the OS scheduler makes of it. The loom models in
``rust/core/tests/loom.rs`` explore interleavings exhaustively for small cases.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable

import numpy as np

import pagedkv
from pagedkv import errors as E

THREADS = 4
OPS_PER_THREAD = 10_000
NUM_BLOCKS = 64


class Ledger:
    """References each thread holds, per block; allocate must never return a held block."""

    def __init__(self, n: int) -> None:
        self.lock = threading.Lock()
        self.held = [0] * n
        self.violations: list[str] = []

    def got_fresh(self, who: int, ids: list[int]) -> None:
        with self.lock:
            for b in ids:
                if self.held[b] != 0:
                    self.violations.append(f"thread {who} got block {b} held {self.held[b]} time(s)")
                self.held[b] += 1

    def add(self, ids: list[int]) -> None:
        with self.lock:
            for b in ids:
                self.held[b] += 1

    def drop(self, ids: list[int]) -> None:
        # Called before the pool call that releases them (see module docs).
        with self.lock:
            for b in ids:
                self.held[b] -= 1


def run_threads(n: int, body: Callable[[int], None]) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def wrapped(i: int) -> None:
        try:
            barrier.wait()
            body(i)
        except BaseException as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
        assert not t.is_alive(), "a worker thread hung"
    if errors:
        raise errors[0]


def assert_pool_whole(p: pagedkv.BlockPool) -> None:
    p.check_invariants()
    assert p.num_free == p.num_usable
    assert p.num_used == 0
    assert all(p.ref_count(b) == 0 for b in range(p.num_blocks))
    q = p.free_queue().tolist()
    assert sorted(q) == list(range(1, p.num_blocks)), "a block was lost or queued twice"


def test_pool_threads_no_block_lost_or_owned_twice() -> None:
    pool = pagedkv.BlockPool(NUM_BLOCKS)
    ledger = Ledger(NUM_BLOCKS)
    counts: list[dict[str, int]] = [dict() for _ in range(THREADS)]

    def body(me: int) -> None:
        rng = random.Random(1000 + me)
        held: list[int] = []  # one entry per reference this thread holds
        hashed: dict[int, bytes] = {}  # held blocks this thread cached, with their hash
        c = counts[me]
        for k in range(OPS_PER_THREAD):
            op = rng.random()
            if op < 0.35:
                try:
                    ids = pool.allocate(rng.randint(1, 4)).tolist()
                except E.OutOfBlocksError:
                    c["oob"] = c.get("oob", 0) + 1
                    continue
                ledger.got_fresh(me, ids)
                held.extend(ids)
                c["alloc"] = c.get("alloc", 0) + 1
            elif op < 0.65 and held:
                rng.shuffle(held)
                drop = held[: rng.randint(1, len(held))]
                del held[: len(drop)]
                ledger.drop(drop)
                pool.free(drop)
                for b in drop:
                    if b not in held:
                        hashed.pop(b, None)
                c["free"] = c.get("free", 0) + 1
            elif op < 0.75 and held:
                b = rng.choice(held)  # fork: one more reference to a block we hold
                ledger.add([b])
                pool.incref([b])
                held.append(b)
                c["incref"] = c.get("incref", 0) + 1
            elif op < 0.85 and held:
                # Prefix caching: register a held block under a unique hash, find it, hit it.
                b = rng.choice(held)
                if b not in hashed:
                    h = me.to_bytes(1, "little") + k.to_bytes(4, "little") + bytes(27)
                    pool.cache_block(b, h)
                    carried = pool.block_hash(b)  # the first hash a block gets stays
                    assert carried is not None
                    hashed[b] = carried
                found = pool.lookup(hashed[b])
                assert found == b, f"lookup of a held cached block returned {found}, not {b}"
                ledger.add([b])
                pool.touch([b])
                held.append(b)
                c["hit"] = c.get("hit", 0) + 1
            else:
                # Read-only queries racing with the writers.
                if held:
                    assert pool.ref_count(rng.choice(held)) >= 1
                assert 0 <= pool.num_free <= pool.num_usable
                c["read"] = c.get("read", 0) + 1
        ledger.drop(held)
        pool.free(held)

    run_threads(THREADS, body)
    assert ledger.violations == []
    assert all(h == 0 for h in ledger.held)
    assert_pool_whole(pool)
    total = {k: sum(c.get(k, 0) for c in counts) for k in ("alloc", "free", "incref", "hit", "read")}
    # Every kind of operation happened many times (the mix is seeded per thread).
    assert all(v > 500 for v in total.values()), total
    stats = pool.counters()
    assert stats["allocations"] >= total["alloc"]
    assert stats["prefix_touches"] == total["hit"]


def test_pool_threads_contend_for_the_last_blocks() -> None:
    """All threads allocate from a pool that is almost always exhausted: reservations must never
    over-commit (no block twice, no OutOfBlocks with enough free), and nothing leaks."""
    pool = pagedkv.BlockPool(9)  # 8 usable blocks, 4 threads taking 1-3 each
    ledger = Ledger(9)

    def body(me: int) -> None:
        rng = random.Random(me)
        for _ in range(OPS_PER_THREAD):
            try:
                ids = pool.allocate(rng.randint(1, 3)).tolist()
            except E.OutOfBlocksError as e:
                assert e.requested > e.available >= 0
                continue
            ledger.got_fresh(me, ids)
            ledger.drop(ids)
            pool.free(ids[::-1])

    run_threads(THREADS, body)
    assert ledger.violations == []
    assert_pool_whole(pool)


def test_pool_threads_bulk_free_while_others_allocate() -> None:
    """Large tail-first frees (the batched uncached push path) racing with allocations of every
    size, until the pool is nearly exhausted: no block twice, none lost."""
    pool = pagedkv.BlockPool(257)
    ledger = Ledger(257)

    def body(me: int) -> None:
        rng = random.Random(500 + me)
        for _ in range(OPS_PER_THREAD // 10):
            try:
                ids = pool.allocate(rng.randint(20, 70)).tolist()
            except E.OutOfBlocksError:
                continue
            ledger.got_fresh(me, ids)
            if rng.random() < 0.5:
                pool.incref(ids[: len(ids) // 2])  # fork half: those need two frees
                ids = ids + ids[: len(ids) // 2]
            ledger.drop(list(dict.fromkeys(ids)))
            pool.free(ids[::-1])

    run_threads(THREADS, body)
    assert ledger.violations == []
    assert_pool_whole(pool)


def test_manager_threads_share_prefixes_and_stay_consistent() -> None:
    """Threads drive their own sequences on one manager: shared prompt prefixes (so hits cross
    threads), allocation, forks with copy-on-write, batched steps, frees; then everything is
    freed and the pool is whole."""
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(96, 4, enable_events=False))
    shared_prefix = list(range(100, 124))
    done = [0] * THREADS

    def body(me: int) -> None:
        rng = random.Random(77 + me)
        mine: list[int] = []
        next_id = me * 1_000_000
        for _ in range(OPS_PER_THREAD // 4):
            op = rng.random()
            try:
                if op < 0.3 or not mine:
                    seq = next_id
                    next_id += 1
                    m.add_sequence(
                        seq, shared_prefix[: rng.randint(1, 24)] + [rng.randint(0, 3) for _ in range(rng.randint(0, 6))]
                    )
                    mine.append(seq)
                    m.allocate_slots(seq, rng.randint(1, 32))
                elif op < 0.5:
                    seq = rng.choice(mine)
                    child = next_id
                    next_id += 1
                    m.fork(seq, child)
                    mine.append(child)
                    m.append_tokens(child, [rng.randint(0, 3)])
                    m.allocate_slots(child, 4)
                elif op < 0.75:
                    batch = rng.sample(mine, min(len(mine), 3))
                    out = m.step(batch, [rng.randint(1, 4)] * len(batch), [[rng.randint(0, 3)] for _ in batch])
                    assert out.num_scheduled <= len(batch)
                elif op < 0.95:
                    seq = mine.pop(rng.randrange(len(mine)))
                    assert m.free(seq) is True
                    assert m.free(seq) is False
                else:
                    m.lookup_prefix(rng.choice(mine))
            except E.OutOfBlocksError:
                pass  # the pool is shared and small: a full pool is a normal outcome
            except E.InvalidArgumentError:
                pass  # nothing left to schedule for that sequence
            done[me] += 1
        for seq in mine:
            assert m.free(seq)

    run_threads(THREADS, body)
    assert done == [OPS_PER_THREAD // 4] * THREADS
    m.check_invariants()
    assert m.stats().prefix_hits_tokens > 0
    assert m.num_sequences == 0
    assert_pool_whole(m.pool)
    m.reset_prefix_cache()
    assert all(m.pool.block_hash(b) is None for b in range(m.pool.num_blocks))


def test_step_from_threads_on_distinct_sequences() -> None:
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(1025, 16))
    per_thread = 32

    def worker(i: int) -> None:
        seqs = np.arange(per_thread, dtype=np.uint64) + i * 1000
        for s in seqs.tolist():
            m.add_sequence(s, [i, s % 7, 3])
        out = m.step(seqs, 16)
        assert out.error is None and out.num_scheduled == per_thread
        for t in range(20):
            out = m.step(seqs, 1, append_token_ids=np.full(per_thread, t, dtype=np.int64))
            assert out.error is None and out.slot_mapping.shape == (per_thread,)
        assert [m.num_tokens(s) for s in seqs.tolist()] == [23] * per_thread

    run_threads(THREADS, worker)
    m.check_invariants()
    # 4 threads x 32 sequences x ceil(23 / 16) = 2 blocks.
    assert m.stats().used == THREADS * per_thread * 2


def test_concurrent_pool_views_read_while_manager_mutates() -> None:
    threads = 2
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(65, 4))
    stop = threading.Event()
    seen: list[int] = []

    assert m.pool is m.pool  # one view, built with the manager

    def reader(_: int) -> None:
        view = m.pool
        while not stop.is_set():
            free, used = view.num_free, view.num_used
            seen.append(free)
            assert 0 <= free <= 64 and 0 <= used <= 64

    def writer() -> None:
        for k in range(300):
            m.add_sequence(k, list(range(k % 13 + 1)))
            m.allocate_slots(k, 100)
            if k >= 5:
                m.free(k - 5)
        stop.set()

    readers = [threading.Thread(target=reader, args=(i,)) for i in range(threads)]
    for r in readers:
        r.start()
    writer()
    for r in readers:
        r.join()
    assert seen
    m.check_invariants()


def test_gil_is_released_during_a_call() -> None:
    """Deterministic check: with a huge switch interval, the main thread can only run Python
    while the worker is inside a native call if that call released the GIL. The worker runs
    `BlockPool.check_invariants` on a large pool (hundreds of ms); the main thread counts to
    1000 and stops, or stops when the worker signals it has finished."""
    pool = pagedkv.BlockPool(1 << 22)
    started, done = threading.Event(), threading.Event()

    def worker() -> None:
        started.set()
        pool.check_invariants()  # GIL released inside
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        results = []
        for _ in range(3):  # the OS may not schedule us in time; retry
            started.clear()
            done.clear()
            t = threading.Thread(target=worker)
            t.start()
            started.wait()
            count = 0
            while not done.is_set() and count < 1000:
                count += 1
            t.join()
            results.append(count)
            if count == 1000:
                break
    finally:
        sys.setswitchinterval(old)
    assert 1000 in results, f"main thread never ran during the native call: {results}"
