"""Shared driver for the allocator replays (pagedkv, vLLM, nano-vllm).

Each replay script is run as ``python replay_<system>.py --trace-file T --out R.json ...`` in the
Python environment that has the system under test; it implements a :class:`Replayer` and calls
:func:`main`. Token id lists are built before the clock starts; the clocks (thread CPU time, the primary
figure, and wall time) cover everything the
system does for a step: registering new requests (hashing their prompt blocks where the system
does it then), prefix-cache lookups, slot allocation, appending the sampled tokens, hashing newly
full blocks and freeing finished requests.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from op_trace import OpTrace  # noqa: E402


class Replayer:
    """One system under test. Subclasses set ``name`` and implement the four hooks.

    ``prepare`` runs untimed; ``step`` is timed; ``finish`` returns counters for the result.
    """

    name = "?"

    def version(self) -> dict[str, Any]:
        """What was measured: package version / commit and the settings used."""
        raise NotImplementedError

    def prepare(self, trace: OpTrace, prompts: list[Any], outputs: list[Any]) -> None:
        """Create a fresh manager for ``trace`` (untimed)."""
        raise NotImplementedError

    def step(self, t: int, admit: list[int], decode: list[int], finish: list[int]) -> None:
        """Do scheduler step ``t``: allocate prompts of ``admit`` (which then sample their first
        token), one decode slot for each of ``decode`` (for the token sampled last step), and
        free ``finish`` after sampling."""
        raise NotImplementedError

    def counters(self) -> dict[str, Any]:
        """Counters after the replay (cached prompt tokens, blocks still in use, ...)."""
        return {}


def run(replayer: Replayer, trace: OpTrace, repeats: int, token_format: str) -> dict[str, Any]:
    """Replay ``trace`` ``repeats`` times on fresh managers; returns timings and counters.

    ``token_format`` is ``"list"`` (Python lists of int) or ``"numpy"`` (int64 arrays): the
    input each system takes natively, converted before the clock starts.
    """
    prompts = [trace.prompt_tokens(r) for r in range(len(trace.prompt_lens))]
    outputs = [trace.output_tokens(r) for r in range(len(trace.prompt_lens))]
    if token_format == "list":
        prompts = [p.tolist() for p in prompts]
        outputs = [o.tolist() for o in outputs]
    runs = []
    counters: dict[str, Any] = {}
    for _ in range(repeats):
        replayer.prepare(trace, prompts, outputs)
        running: list[int] = []
        wall_ns = np.zeros(trace.num_steps, dtype=np.int64)
        cpu_ns = np.zeros(trace.num_steps, dtype=np.int64)
        gc.collect()
        gc.disable()  # a collection in one system's run but not another's would skew the ratio
        try:
            for t in range(trace.num_steps):
                admit = trace.admit[t]
                fin = trace.finish[t]
                # The wall clock is read outside the CPU interval and the figures stored after
                # both (as in run_pool and the Rust replay): the CPU interval holds the step.
                w0 = time.perf_counter_ns()
                c0 = time.thread_time_ns()
                replayer.step(t, admit, running, fin)
                c1 = time.thread_time_ns()
                w1 = time.perf_counter_ns()
                cpu_ns[t] = c1 - c0
                wall_ns[t] = w1 - w0
                if fin:
                    done = set(fin)
                    running = [r for r in running if r not in done]
                running.extend(r for r in admit if r not in set(fin))
        finally:
            gc.enable()
        counters = replayer.counters()
        runs.append(_run_figures(trace, cpu_ns, wall_ns))
    best = min(runs, key=lambda r: r["cpu_total_ns"])
    return {
        "system": replayer.name,
        "version": replayer.version(),
        "repeats": repeats,
        "best": best,
        "runs": runs,
        "counters": counters,
    }


class PoolAdapter:
    """A system's bare block pool, for the pool-level replay (no hashing, no sequences)."""

    def allocate(self, n: int) -> Any:
        """Take ``n`` blocks; returns a handle list/array (``n`` items)."""
        raise NotImplementedError

    def allocate_items(self, n: int) -> Any:
        """Take ``n`` blocks for ``n`` decoding requests that each start a block; returns an
        iterable of ``n`` handles, one per request (one batched call into the pool)."""
        raise NotImplementedError

    def free_request(self, parts: list[Any]) -> None:
        """Free one finished request's blocks tail first (its last block is evicted first), as
        the system's own manager releases a request: ``parts`` is its prompt's ``allocate``
        result, then one item (from :meth:`allocate_items`) per decode block. No copy that the
        system's manager would not make."""
        raise NotImplementedError


def _run_figures(trace: OpTrace, cpu_ns: np.ndarray, wall_ns: np.ndarray) -> dict[str, Any]:
    """One replay's figures from its per-step thread CPU and wall nanoseconds. CPU time of the
    replaying thread is the compared figure: robust against other processes on a shared machine
    (the systems under test are single-threaded; pagedkv works in the caller's thread with the
    GIL released)."""
    return {
        "cpu_total_ns": int(cpu_ns.sum()),
        "us_per_step_mean": cpu_ns.sum() / trace.num_steps / 1e3,
        "us_per_step_p50": float(np.percentile(cpu_ns, 50)) / 1e3,
        "us_per_step_p99": float(np.percentile(cpu_ns, 99)) / 1e3,
        "ns_per_block_op": cpu_ns.sum() / trace.block_ops,
        "wall_total_ns": int(wall_ns.sum()),
        "wall_us_per_step_mean": wall_ns.sum() / trace.num_steps / 1e3,
        "wall_ns_per_block_op": wall_ns.sum() / trace.block_ops,
    }


def run_pool(make_pool, trace: OpTrace, repeats: int) -> dict[str, Any]:
    """Replay only the block-pool traffic of ``trace``: per step one ``allocate`` per admitted
    request (its prompt blocks), one batched ``allocate`` for the decoding requests that start
    a new block, and one ``free`` per finished request (its blocks, tail first). Prefix caching
    plays no part. ``make_pool(num_blocks)`` returns a fresh :class:`PoolAdapter`.

    Per step only the pool's work and the loop that hands blocks to requests sit between the
    two reads of the thread's CPU clock; the wall clock is read outside them and the figures
    are stored after both, so the clocks themselves cost about one ``thread_time_ns`` call
    per step (as in the Rust replay of the same schedule)."""
    bs = trace.block_size
    admit_at, _ = _schedule(trace)
    p_lens = trace.prompt_lens
    steps = []
    running: list[int] = []
    for t in range(trace.num_steps):
        # Decode at step t writes token position p + (t - admit - 1).
        needs = [r for r in running if (p_lens[r] + t - admit_at[r] - 1) % bs == 0]
        steps.append(([(r, -(-p_lens[r] // bs)) for r in trace.admit[t]], needs, trace.finish[t]))
        done = set(trace.finish[t])
        running = [r for r in running if r not in done] + [r for r in trace.admit[t] if r not in done]
    runs = []
    for _ in range(repeats):
        pool = make_pool(trace.num_blocks)
        held: dict[int, list[Any]] = {}
        cpu_ns = np.zeros(trace.num_steps, dtype=np.int64)
        wall_ns = np.zeros(trace.num_steps, dtype=np.int64)
        gc.collect()
        gc.disable()
        try:
            for t, (adm, needs, fin) in enumerate(steps):
                w0 = time.perf_counter_ns()
                c0 = time.thread_time_ns()
                if needs:
                    for r, b in zip(needs, pool.allocate_items(len(needs))):
                        held[r].append(b)
                for r, n in adm:
                    held[r] = [pool.allocate(n)]
                for r in fin:
                    pool.free_request(held.pop(r))
                c1 = time.thread_time_ns()
                w1 = time.perf_counter_ns()
                cpu_ns[t] = c1 - c0
                wall_ns[t] = w1 - w0
        finally:
            gc.enable()
        if held:
            raise AssertionError(f"{len(held)} requests still hold blocks after the pool replay")
        runs.append(_run_figures(trace, cpu_ns, wall_ns))
    return {"best": min(runs, key=lambda r: r["cpu_total_ns"]), "runs": runs, "repeats": repeats}


def _schedule(trace: OpTrace) -> tuple[dict[int, int], dict[int, int]]:
    a = {r: t for t, rs in enumerate(trace.admit) for r in rs}
    f = {r: t for t, rs in enumerate(trace.finish) for r in rs}
    return a, f


def main(replayer_factory, add_arguments=None) -> None:
    """Command-line entry of a replay script: parse args, replay, write the JSON result.

    ``replayer_factory(args)`` returns ``(Replayer, token_format)``; ``args`` has ``lib_path``
    and ``hash_algo``, plus whatever ``add_arguments(parser)`` adds (a system's own options).
    """
    ap = argparse.ArgumentParser()
    if add_arguments is not None:
        add_arguments(ap)
    ap.add_argument("--trace-file", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lib-path", default=None, help="checkout of the system under test, if any")
    ap.add_argument("--hash-algo", default=None, help="prefix hash of the system, where it has a choice")
    ap.add_argument(
        "--mode",
        choices=["manager", "pool"],
        default="manager",
        help="manager: the whole KV cache manager; pool: the bare block pool only",
    )
    a = ap.parse_args()
    trace = OpTrace.load(a.trace_file)
    replayer, token_format = replayer_factory(a)
    if a.mode == "pool":
        res = {
            "system": replayer.name,
            "version": {**replayer.version(), "hash": "none (bare pool)"},
            "counters": {},
            **run_pool(replayer.pool_adapter, trace, a.repeats),
        }
    else:
        res = run(replayer, trace, a.repeats, token_format)
    Path(a.out).write_text(json.dumps(res, indent=2))
