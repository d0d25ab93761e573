"""Operations per second of the block pool and the manager on 1 and 2 Python threads.

Each thread runs a fixed number of operations against ONE shared object; the GIL is released
inside every pool / manager call, so the Rust work of two threads can overlap. Workloads:

- ``pool alloc/free``: allocate 1-4 blocks, free them tail-first (the uncached LIFO hot path:
  CAS reservation + Treiber pop / push, lock-free).
- ``pool fork+hit``: incref (fork) a held block and touch a held cached block, then free both
  references (ref-count changes; the touch takes the pool lock).
- ``manager step``: add a sequence with a shared 64-token prefix, one batched ``step`` of its
  prefill, three decode steps with appended tokens, free (prefix hits; the manager's mutex).

Prints a table (ops/s per workload and thread count, speedup of 2 threads over 1) and writes
JSON to benchmarks/results/concurrency.json. ops = calls into pagedkv. The figures depend on
the machine and on other load on it; the JSON records the CPU count.

Usage: python benchmarks/concurrency.py [--ops N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pagedkv

RESULTS = Path(__file__).resolve().parent / "results" / "concurrency.json"


def pool_alloc_free(pool: pagedkv.BlockPool, me: int, n: int) -> int:
    ops = 0
    k = 1 + me
    for _ in range(n // 2):
        ids = pool.allocate(k % 4 + 1)
        pool.free(ids[::-1])
        k += 1
        ops += 2
    return ops


def pool_fork_hit(pool: pagedkv.BlockPool, me: int, n: int) -> int:
    (b,) = pool.allocate(1).tolist()
    pool.cache_block(b, bytes([me + 1]) * 32)
    ops = 0
    for _ in range(n // 3):
        pool.incref([b])
        pool.touch([b])
        pool.free([b, b])
        ops += 3
    pool.free([b])
    return ops


def manager_step(m: pagedkv.KVCacheManager, me: int, n: int) -> int:
    prefix = list(range(64))
    ops = 0
    seq = me * 10_000_000
    while ops < n:
        m.add_sequence(seq, prefix + [seq % 7, me])
        m.step([seq], [1024]).raise_for_error()
        for t in range(3):
            m.step([seq], [1], [[t]]).raise_for_error()
        m.free(seq)
        seq += 1
        ops += 6
    return ops


def run(workload: Callable[[Any, int, int], int], target: Any, threads: int, ops_per_thread: int) -> float:
    barrier = threading.Barrier(threads + 1)
    done = [0] * threads

    def body(i: int) -> None:
        barrier.wait()
        done[i] = workload(target, i, ops_per_thread)

    ts = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - start
    return sum(done) / elapsed


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=RESULTS.parent, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=200_000, help="operations per thread (default 200000)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; the best is reported (default 3)")
    args = ap.parse_args()

    workloads: list[tuple[str, Callable[[], Any], Callable[[Any, int, int], int]]] = [
        ("pool alloc/free", lambda: pagedkv.BlockPool(4096), pool_alloc_free),
        ("pool fork+hit", lambda: pagedkv.BlockPool(4096), pool_fork_hit),
        (
            "manager step",
            lambda: pagedkv.KVCacheManager(pagedkv.CacheConfig(4096, 16)),
            manager_step,
        ),
    ]
    rows = []
    for name, make, fn in workloads:
        row: dict[str, Any] = {"workload": name}
        run(fn, make(), 1, max(args.ops // 10, 100))  # warm-up (page faults, caches, lazy init)
        for threads in (1, 2):
            best = 0.0
            for _ in range(args.repeats):
                target = make()
                # Same total work for 1 and 2 threads: split the operations.
                best = max(best, run(fn, target, threads, args.ops // threads))
            row[f"ops_per_s_{threads}t"] = round(best)
        row["speedup_2t"] = round(float(row["ops_per_s_2t"]) / float(row["ops_per_s_1t"]), 2)
        rows.append(row)

    print(f"{'workload':<18} {'1 thread ops/s':>16} {'2 threads ops/s':>16} {'speedup':>8}")
    for r in rows:
        print(f"{r['workload']:<18} {r['ops_per_s_1t']:>16,} {r['ops_per_s_2t']:>16,} {r['speedup_2t']:>8.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "concurrency",
                "ops_per_thread_total": args.ops,
                "repeats": args.repeats,
                "cpu_count": os.cpu_count(),
                "load_avg_1m": os.getloadavg()[0],
                "machine": platform.machine(),
                "commit": git_commit(),
                "python": platform.python_version(),
                "pagedkv": pagedkv.__version__,
                "results": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
