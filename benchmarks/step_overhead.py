"""Python-level cost of one scheduler step through pagedkv's batched API.

Workload: 256 running decode sequences at block size 16 with prefix caching on, in steady state
(continuous batching): sequence lengths are spread over 64..576 tokens; a sequence reaching 576
is freed and replaced by a new 64-token request, prefilled outside the timed region. Each timed
step appends one sampled token to every sequence and schedules one token for each, in ONE call
(``KVCacheManager.step``, GIL released); about one sequence in 16 takes a new block per step.
Variants measured on the same manager, interleaved so machine load hits all alike:

- ``step (numpy appends)``: ``step(seq_ids uint64[256], 1, append_token_ids=int64[256])``;
- ``step (list appends)``: the same with ``append_token_ids`` as a list of 256 one-token lists;
- ``step + BatchTensors (numpy)``: plus every kernel input from
  ``pagedkv.tensors.BatchTensors.from_steps`` (the path the engine's runner takes) as numpy
  arrays (``device=None``);
- ``step + BatchTensors (torch cpu)``: the same as kernel-ready CPU torch tensors (skipped
  without torch): the whole allocator-to-kernel path of one decode step;
- ``per-sequence calls``: ``append_tokens`` + ``allocate_slots`` for each sequence (512 crossings),
  the baseline the batched API replaces.

Reports the median and p90 of wall-clock µs per step, the median thread CPU time per step
(``time.thread_time_ns``: excludes time the OS gave to other processes, which matters on a
shared 2-core machine), and the median ns per sequence; target: under 50 µs per step for the
batched call, and at most 1.5x the bare step for the whole path (step + torch tensors). Prints
a table with the figures measured before the one-path change beside (``OLD_US``: same workload,
same machine class) and writes ``benchmarks/results/step_overhead.json``.

``--tables`` measures instead one decode step plus its block tables, the engine's dense path
against the Rust keeper, at 8 / 32 / 64 sequences of 600 / 600 / 2,000 tokens (lengths spread
over the next 256 tokens, a sequence reaching the end replaced by a new one, prefilled outside
the timed region), for one group (``KVCacheManager(CacheConfig(num_blocks, block_size))``) and
six (the groups form of ``CacheConfig`` on Gemma 3's layout: one full-attention group and five
sliding-window groups of window 512), block size 16. Variants, each on its own manager with the
same workload, interleaved in rounds:

- ``dense``: ``step(..., block_table=True)``, the step output's dense ``block_tables``;
- ``keeper``: ``step(..., block_table=False)`` and ``BlockTable.update`` (the deltas applied in
  Rust, every group in one call);
- ``dense + BatchTensors`` / ``keeper + BatchTensors``: the same plus every kernel input as CPU
  torch tensors (``BatchTensors.from_steps``, ``block_tables=None`` / the keeper): the whole
  path the engine's runner takes.

Prints the median µs per step of each and the keeper / dense ratios, and writes
``benchmarks/results/step_tables.json``.

Usage: python benchmarks/step_overhead.py [--seqs 256] [--steps 2000] [--block-size 16]
       [--min-len 64] [--max-len 576]
       python benchmarks/step_overhead.py --tables [--steps 600]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import pagedkv
from pagedkv import tensors

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_US = 50.0
#: Whole path (step + kernel-ready torch tensors) at most this multiple of the bare step.
TARGET_RATIO = 1.5
#: p50 µs per step before the one-path change (BatchTensors.from_step re-validating and copying
#: the core's arrays; the engine's runner built its own metadata): issue 12's review figures.
OLD_US = {"step (numpy appends)": 43.0, "step + BatchTensors (torch cpu)": 129.0}


class Workload:
    """256 decode sequences in steady state: lengths spread over [min_len, max_len); a sequence
    reaching max_len is freed and replaced by a fresh prompt (outside the timed region)."""

    def __init__(self, num_seqs: int, min_len: int, max_len: int, block_size: int) -> None:
        blocks = num_seqs * (max_len // block_size + 2) + 1
        self.m = pagedkv.KVCacheManager(pagedkv.CacheConfig(blocks, block_size))
        self.rng = np.random.default_rng(0)
        self.min_len, self.max_len = min_len, max_len
        self.ids = np.arange(num_seqs, dtype=np.uint64)
        self.next_id = num_seqs
        start = np.linspace(min_len, max_len - 1, num_seqs).astype(np.int64)
        for s, n in zip(self.ids.tolist(), start.tolist()):
            self._admit(s, n)
        self.lens = start.copy()

    def _admit(self, seq: int, n: int) -> None:
        self.m.add_sequence(seq, self.rng.integers(0, 32_000, n))
        self.m.allocate_slots(seq, n)

    def grew(self, by: int = 1) -> None:
        """Account for `by` tokens appended to every sequence; replace finished ones."""
        self.lens += by
        for i in np.nonzero(self.lens >= self.max_len)[0].tolist():
            self.m.free(int(self.ids[i]))
            self.ids[i] = self.next_id
            self._admit(self.next_id, self.min_len)
            self.next_id += 1
            self.lens[i] = self.min_len


#: ``--tables`` workloads: (sequences, shortest length in tokens); lengths spread over the next
#: ``TABLES_SPAN`` tokens.
TABLES_CONFIGS = ((8, 600), (32, 600), (64, 2000))
TABLES_SPAN = 256
#: Gemma 3's layout: one full-attention group and five sliding-window groups (window 512).
TABLES_WINDOW = 512


class TablesWorkload:
    """``n`` decode sequences of ``length .. length + TABLES_SPAN`` tokens on a manager of
    ``groups`` KV cache groups (1: the one-group config), its block tables dense from each step
    (``keep=False``) or kept by a :class:`pagedkv.tensors.BlockTable` from the deltas."""

    def __init__(self, groups: int, n: int, length: int, keep: bool, block_size: int = 16) -> None:
        # a prefill holds every block of its chunk in each group until the next step releases
        # what fell out of the window
        blocks = n * groups * ((length + TABLES_SPAN) // block_size + 2) + 1
        if groups == 1:
            config = pagedkv.CacheConfig(blocks, block_size)
        else:
            specs = [pagedkv.KVCacheGroupSpec("full", block_size, 8)] + [
                pagedkv.KVCacheGroupSpec("sliding_window", block_size, 8, window=TABLES_WINDOW)
            ] * (groups - 1)
            config = pagedkv.CacheConfig(blocks, groups=specs, layer_groups=list(range(groups)))
        self.m = pagedkv.KVCacheManager(config)
        self.keep = keep
        self.kept = tensors.BlockTable(self.m) if keep else None
        self.rng = np.random.default_rng(0)
        self.length = length
        self.ids = np.arange(n, dtype=np.uint64)
        self.next_id = n
        self.lens = np.linspace(length, length + TABLES_SPAN - 1, n).astype(np.int64)
        for s, k in zip(self.ids.tolist(), self.lens.tolist()):
            self._admit(s, k)
        self.tokens = self.rng.integers(0, 32_000, n)

    def _admit(self, seq: int, n: int) -> None:
        self.m.add_sequence(seq, self.rng.integers(0, 32_000, n))
        out = self.m.step([seq], [n], block_table=not self.keep)
        assert out.error is None
        if self.kept is not None:  # the keeper sees every output, as the runner's does
            self.kept.update(out)

    def step(self) -> Any:
        """One decode step of every sequence and its dense tables, ``int32[G, S, W]``."""
        out = self.m.step(self.ids, 1, self.tokens, block_table=not self.keep)
        return out.block_tables if self.kept is None else self.kept.update(out)

    def step_tensors(self) -> Any:
        """One decode step of every sequence and every kernel input as CPU torch tensors."""
        out = self.m.step(self.ids, 1, self.tokens, block_table=not self.keep)
        return tensors.BatchTensors.from_steps(out, "cpu", block_tables=self.kept)

    def grew(self) -> None:
        """One token more in every sequence; one at the end of its span is replaced."""
        self.lens += 1
        for i in np.nonzero(self.lens >= self.length + TABLES_SPAN)[0].tolist():
            self.m.free(int(self.ids[i]))
            self.ids[i] = self.next_id
            self._admit(self.next_id, self.length)
            self.next_id += 1
            self.lens[i] = self.length


def tables_main(steps: int, out_path: Path) -> list[dict[str, Any]]:
    """``--tables``: decode step + block tables, dense vs the Rust keeper (module docs)."""
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # pragma: no cover - torch is optional
        torch = None
    rows: list[dict[str, Any]] = []
    print(
        "decode step + block tables, dense (step(block_table=True)) vs the Rust keeper "
        "(step(block_table=False) + BlockTable.update); µs per step, median"
    )
    header = (
        f"{'groups':>6} {'seqs':>5} {'tokens':>11} {'dense':>8} {'keeper':>8} {'ratio':>6}"
        f" {'dense+BT':>9} {'keeper+BT':>10} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for groups in (1, 6):
        for n, length in TABLES_CONFIGS:
            dense = TablesWorkload(groups, n, length, keep=False)
            kept = TablesWorkload(groups, n, length, keep=True)
            dense_bt = TablesWorkload(groups, n, length, keep=False)
            kept_bt = TablesWorkload(groups, n, length, keep=True)
            variants: list[tuple[str, TablesWorkload, Callable[[], Any]]] = [
                ("dense", dense, dense.step),
                ("keeper", kept, kept.step),
            ]
            if torch is not None:
                variants += [
                    ("dense + BatchTensors", dense_bt, dense_bt.step_tensors),
                    ("keeper + BatchTensors", kept_bt, kept_bt.step_tensors),
                ]
            for _, w, fn in variants:  # warm-up
                for _ in range(20):
                    fn()
                    w.grew()
            samples: dict[str, list[float]] = {name: [] for name, _, _ in variants}
            rounds = 10  # interleaved, so load spikes hit every variant alike
            for _ in range(rounds):
                for name, w, fn in variants:
                    for _ in range(max(steps // rounds, 1)):
                        t0 = time.perf_counter_ns()
                        fn()
                        samples[name].append((time.perf_counter_ns() - t0) / 1e3)
                        w.grew()
            # the keeper's tables are the manager's: one more step checked entry by entry
            got = kept.step()
            for k, s in enumerate(kept.ids.tolist()):
                for g, t in enumerate(kept.m.block_tables(s)):
                    assert got[g, k, : len(t)].tolist() == t.tolist() and not got[g, k, len(t) :].any()
            med = {name: statistics.median(xs) for name, xs in samples.items()}
            row = {
                "groups": groups,
                "seqs": n,
                "tokens": [length, length + TABLES_SPAN - 1],
                "steps": steps,
                "us_per_step_median": med,
                "keeper_over_dense": med["keeper"] / med["dense"],
            }
            if torch is not None:
                row["keeper_over_dense_batch_tensors"] = med["keeper + BatchTensors"] / med["dense + BatchTensors"]
            rows.append(row)
            bt = (
                f" {med['dense + BatchTensors']:9.1f} {med['keeper + BatchTensors']:10.1f}"
                f" {row['keeper_over_dense_batch_tensors']:6.2f}"
                if torch is not None
                else ""
            )
            print(
                f"{groups:6d} {n:5d} {f'{length}..{length + TABLES_SPAN - 1}':>11} {med['dense']:8.1f} "
                f"{med['keeper']:8.1f} {row['keeper_over_dense']:6.2f}{bt}"
            )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(
        json.dumps(
            {
                "benchmark": "step_tables",
                "window": TABLES_WINDOW,
                "block_size": 16,
                "results": rows,
                "machine": {
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "loadavg_1min": os.getloadavg()[0],
                    "pagedkv": pagedkv.__version__,
                },
            },
            indent=2,
        )
        + "\n"
    )
    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)\nwrote {out_path}")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000, help="timed steps per variant")
    ap.add_argument("--min-len", type=int, default=64, help="tokens of a new request's prompt")
    ap.add_argument("--max-len", type=int, default=576, help="a sequence is replaced at this length")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None, help="JSON results (default under benchmarks/results/)")
    ap.add_argument("--tables", action="store_true", help="decode step + block tables, dense vs keeper")
    a = ap.parse_args(argv)
    if a.tables:
        tables_main(a.steps if a.steps != 2000 else 600, a.out or RESULTS / "step_tables.json")
        return
    a.out = a.out or RESULTS / "step_overhead.json"

    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional
        torch = None

    n = a.seqs
    bs = a.block_size
    w = Workload(n, a.min_len, a.max_len, bs)
    m = w.m
    rng = np.random.default_rng(1)
    # Sampled tokens are drawn before the clock starts (a sampler produces them anyway).
    next_tokens = rng.integers(0, 32_000, n)
    next_lists = [[t] for t in next_tokens.tolist()]

    def step_numpy() -> Any:
        return m.step(w.ids, 1, append_token_ids=next_tokens)

    def step_lists() -> Any:
        return m.step(w.ids, 1, append_token_ids=next_lists)

    # The block tables kept across steps, as the engine's runner keeps them.
    kept = tensors.BlockTable(m)

    def step_tensors_numpy() -> Any:
        return tensors.BatchTensors.from_steps(step_numpy(), device=None, block_tables=kept)

    def step_tensors_torch() -> Any:
        return tensors.BatchTensors.from_steps(step_numpy(), device="cpu", block_tables=kept)

    def per_sequence() -> None:
        for s, t in zip(w.ids.tolist(), next_lists):
            m.append_tokens(s, t)
            m.allocate_slots(s, 1)

    variants: list[tuple[str, Callable[[], Any], int]] = [
        ("step (numpy appends)", step_numpy, a.steps),
        ("step (list appends)", step_lists, a.steps),
        ("step + BatchTensors (numpy)", step_tensors_numpy, a.steps),
    ]
    if torch is not None:
        torch.set_num_threads(1)
        variants.append(("step + BatchTensors (torch cpu)", step_tensors_torch, a.steps))
    variants.append(("per-sequence calls (baseline)", per_sequence, max(a.steps // 10, 20)))

    for _, fn, _ in variants:  # warm-up
        for _ in range(20):
            fn()
            w.grew()

    samples: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    rounds = 10  # interleave the variants in rounds so load spikes hit all of them
    for _ in range(rounds):
        for name, fn, k in variants:
            chunk = k // rounds
            for _ in range(chunk):
                c0 = time.thread_time_ns()
                t0 = time.perf_counter_ns()
                out = fn()
                t1 = time.perf_counter_ns()
                c1 = time.thread_time_ns()
                samples[name].append((t1 - t0) / 1e3)
                cpu[name].append((c1 - c0) / 1e3)
                if isinstance(out, pagedkv.StepOutput):
                    assert out.error is None
                w.grew()
    m.check_invariants()
    mean_blocks = float(np.mean((w.lens + bs - 1) // bs))

    rows = []
    for name, _, _ in variants:
        xs = sorted(samples[name])
        med = statistics.median(xs)
        p90 = xs[int(0.9 * (len(xs) - 1))]
        cpu_med = statistics.median(cpu[name])
        rows.append(
            {
                "variant": name,
                "steps": len(xs),
                "us_per_step_median": med,
                "us_per_step_p90": p90,
                "cpu_us_per_step_median": cpu_med,
                "ns_per_seq_median": med * 1e3 / n,
            }
        )
    for r_ in rows:
        r_["old_us_per_step_median"] = OLD_US.get(r_["variant"])
    header = (
        f"{'variant':34} {'steps':>6} {'µs/step p50':>12} {'µs/step p90':>12} {'CPU µs p50':>11} "
        f"{'ns/seq p50':>11} {'old µs p50':>11}"
    )
    print(
        f"pagedkv step overhead: {n} running decode sequences, block size {bs}, lengths "
        f"{a.min_len}..{a.max_len} tokens (mean block table {mean_blocks:.1f} blocks)"
    )
    print(header)
    print("-" * len(header))
    for r_ in rows:
        old = r_["old_us_per_step_median"]
        print(
            f"{r_['variant']:34} {r_['steps']:6d} {r_['us_per_step_median']:12.1f} "
            f"{r_['us_per_step_p90']:12.1f} {r_['cpu_us_per_step_median']:11.1f} {r_['ns_per_seq_median']:11.0f} "
            f"{'-' if old is None else f'{old:.1f}':>11}"
        )
    batched = rows[0]["us_per_step_median"]
    batched_cpu = rows[0]["cpu_us_per_step_median"]
    verdict = "meets" if batched < TARGET_US else "MISSES"
    print(
        f"\nbatched step: {batched:.1f} µs per step wall ({batched_cpu:.1f} µs CPU) -> {verdict} the "
        f"{TARGET_US:.0f} µs target (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    )
    whole = next((r_ for r_ in rows if r_["variant"] == "step + BatchTensors (torch cpu)"), None)
    ratio = None
    if whole is not None:
        ratio = whole["us_per_step_median"] / batched
        print(
            f"whole path (step + kernel-ready torch tensors): {whole['us_per_step_median']:.1f} µs = "
            f"{ratio:.2f}x the bare step -> {'meets' if ratio <= TARGET_RATIO else 'MISSES'} the "
            f"{TARGET_RATIO}x target (was {OLD_US['step + BatchTensors (torch cpu)']:.0f} µs = "
            f"{OLD_US['step + BatchTensors (torch cpu)'] / OLD_US['step (numpy appends)']:.2f}x)"
        )

    md_rows = [
        "| variant | µs / step (p50) | µs / step (p90) | CPU µs / step (p50) | ns / sequence (p50) | before (µs p50) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    md_rows += [
        f"| {r_['variant']} | {r_['us_per_step_median']:.1f} | {r_['us_per_step_p90']:.1f} | "
        f"{r_['cpu_us_per_step_median']:.1f} | {r_['ns_per_seq_median']:.0f} | "
        f"{'-' if r_['old_us_per_step_median'] is None else r_['old_us_per_step_median']} |"
        for r_ in rows
    ]
    md = (
        f"{n} running decode sequences (lengths {a.min_len}..{a.max_len} tokens), block size {bs}: "
        f"one batched `step` costs "
        f"{batched:.1f} µs wall, {batched_cpu:.1f} µs CPU (target < {TARGET_US:.0f} µs; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores during the run)."
        + (
            f" The whole path to kernel-ready torch tensors (`BatchTensors.from_steps`) costs "
            f"{ratio:.2f}x the bare step (target <= {TARGET_RATIO}x; {OLD_US['step + BatchTensors (torch cpu)']:.0f} "
            f"µs = {OLD_US['step + BatchTensors (torch cpu)'] / OLD_US['step (numpy appends)']:.1f}x before "
            "the one-path change)."
            if ratio is not None
            else ""
        )
        + "\n\n"
        + "\n".join(md_rows)
        + "\n\nReproduce: `python benchmarks/step_overhead.py`"
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "benchmark": "step_overhead",
                "num_seqs": n,
                "block_size": bs,
                "min_len": a.min_len,
                "max_len": a.max_len,
                "mean_block_table_blocks": mean_blocks,
                "target_us_per_step": TARGET_US,
                "target_whole_path_ratio": TARGET_RATIO,
                "whole_path_ratio": ratio,
                "results": rows,
                "machine": {
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "loadavg_1min": os.getloadavg()[0],
                    "pagedkv": pagedkv.__version__,
                    "numpy": np.__version__,
                    "torch": getattr(torch, "__version__", None),
                },
                "summary_markdown": md,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
