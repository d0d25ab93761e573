"""Threads calling the pool and the manager at once, with the GIL released inside each call.

After a fixed number of operations per thread, no block is lost or owned twice: every block a
thread still holds has exactly the references it took, and after releasing everything the pool
is whole again (free == usable, invariants hold).
"""

from __future__ import annotations

import sys
import threading
from collections import Counter

import numpy as np
import pytest

import pagedkv

THREADS = 4
OPS = 2_000


def run_threads(target, n: int = THREADS) -> None:  # type: ignore[no-untyped-def]
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def wrapped(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_pool_threads_allocate_incref_free() -> None:
    pool = pagedkv.BlockPool(257)                    # 256 usable: threads compete for them
    held: list[Counter[int]] = [Counter() for _ in range(THREADS)]

    def worker(i: int) -> None:
        rng = np.random.default_rng(i)
        mine = held[i]
        for _ in range(OPS):
            op = rng.integers(0, 4)
            if op <= 1:                              # allocate a few (may fail: all-or-nothing)
                n = int(rng.integers(1, 9))
                try:
                    ids = pool.allocate(n)
                except pagedkv.OutOfBlocksError as e:
                    assert e.requested == n and e.available < n
                    continue
                assert len(ids) == n
                mine.update(ids.tolist())
            elif op == 2 and mine:                   # share some of mine (fork)
                some = rng.choice(sorted(mine), size=min(3, len(mine)), replace=False)
                pool.incref(some)
                mine.update(some.tolist())
            elif mine:                               # release some references, tail first
                some = rng.choice(sorted(mine), size=min(4, len(mine)), replace=False)
                pool.free(some[::-1])
                mine.subtract(some.tolist())
                for b in some.tolist():
                    if mine[b] == 0:
                        del mine[b]

    run_threads(worker)
    # No block owned by two threads, ref counts exactly the references taken.
    owners: Counter[int] = Counter()
    for mine in held:
        owners.update(mine.keys())
    assert all(c == 1 for c in owners.values()), "a block is owned by two threads"
    for mine in held:
        for b, refs in mine.items():
            assert pool.ref_count(b) == refs
    assert pool.num_used == len(owners)
    assert pool.num_free == 256 - len(owners)
    pool.check_invariants()
    for mine in held:
        pool.free(list(mine.elements()))
    assert (pool.num_free, pool.num_used) == (256, 0)
    assert sorted(pool.free_queue().tolist()) == list(range(1, 257))
    pool.check_invariants()


def test_manager_threads_share_prefixes() -> None:
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(129, 4))
    system = list(range(1000, 1016))                 # 4 full blocks shared by every request

    def worker(i: int) -> None:
        rng = np.random.default_rng(100 + i)
        for k in range(OPS // 20):
            seq = i * 1_000_000 + k
            m.add_sequence(seq, system + rng.integers(0, 50, int(rng.integers(1, 9))).tolist())
            try:
                m.allocate_slots(seq, 64)
                for _ in range(int(rng.integers(0, 5))):
                    m.append_tokens(seq, [int(rng.integers(0, 50))])
                    m.allocate_slots(seq, 1)
                if rng.integers(0, 2):
                    m.fork(seq, seq + 500_000)
                    m.free(seq + 500_000)
            except pagedkv.OutOfBlocksError:
                pass
            assert m.free(seq) is True

    run_threads(worker)
    m.check_invariants()
    s = m.stats()
    assert (s.used, s.free, m.num_sequences) == (0, 128, 0)
    assert s.prefix_hits_tokens > 0


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

    run_threads(worker)
    m.check_invariants()
    # 4 threads x 32 sequences x ceil(23 / 16) = 2 blocks.
    assert m.stats().used == THREADS * per_thread * 2


def test_gil_is_released_during_a_call() -> None:
    """Deterministic check: with a huge switch interval, the main thread can only run Python
    while the worker is inside a native call if that call released the GIL. The worker runs
    `BlockPool.check_invariants` on a large pool (hundreds of ms); the main thread counts to
    1000 and stops, or stops when the worker signals it has finished."""
    pool = pagedkv.BlockPool(1 << 22)
    started, done = threading.Event(), threading.Event()

    def worker() -> None:
        started.set()
        pool.check_invariants()                      # GIL released inside
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        results = []
        for _ in range(3):                           # the OS may not schedule us in time; retry
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


@pytest.mark.parametrize("threads", [2])
def test_concurrent_pool_views_read_while_manager_mutates(threads: int) -> None:
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(65, 4))
    stop = threading.Event()
    seen: list[int] = []

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
