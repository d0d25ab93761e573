"""Memory efficiency of paged KV (pagedkv) against contiguous reservation, after Fig. 2 of the
PagedAttention paper (Kwon et al., SOSP'23: earlier systems kept only 20.4%-38.2% of KV memory
holding token states; 96.3% with paging).

A step simulator replays each workload under a fixed KV budget (tokens). All requests are queued
at step 0 and served FCFS with continuous batching: each step admits waiting requests while they
fit (the whole prompt is prefilled in one step and samples the first token), and every running
request decodes one token. Measurements are taken in every step where the queue is not empty
(the system is saturated, as in the paper's high-load runs) and averaged over those steps.

Systems:
- ``pagedkv bs=N``: the real pagedkv Python API (``KVCacheManager.add_sequence`` / ``step`` /
  ``preempt`` / ``free``, prefix caching off so no block is shared) at block size N; admission
  keeps ``--watermark`` of the blocks free (default 0, vLLM V1's default; V0 kept 1%); when a
  decode step lacks blocks the newest request is preempted by recompute (vLLM's policy). Each
  step the blocks in use reported by the pool are checked against ``sum(ceil(kv_tokens / N))`` over running requests.
- ``contiguous <policy>``: one contiguous range per request, reserved at admission for the
  request's lifetime (``max`` / ``pow2`` / ``oracle``, see ``contiguous.py``), placed first-fit in
  a linear address space so external fragmentation shows.

Budget breakdown (fractions of the KV budget): token states (KV of tokens written so far),
reservation (slots reserved for a request's future tokens), internal fragmentation (reserved
beyond what the request will ever use; for paging, the unwritten slots of allocated blocks),
external fragmentation & other (unallocated memory while requests wait).

Usage: ``python benchmarks/memory_efficiency.py [--traces-dir DIR] [--quick]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from contiguous import FirstFitAllocator, reservation  # noqa: E402

WORKLOADS = ["azure_conv", "azure_code", "sharegpt_like", "alpaca_like", "mooncake"]
BLOCK_SIZES = [8, 16, 32, 64, 128]
POLICIES = ["max", "pow2", "oracle"]
PAPER_FIG2 = {"contiguous max": 20.4, "contiguous pow2": 26.8, "contiguous oracle": 38.2, "paged (vLLM)": 96.3}


@dataclass
class Breakdown:
    """Time-averaged shares of the KV budget over saturated steps (fractions, sum to 1)."""

    token_states: float
    reservation: float
    internal_frag: float
    external_other: float
    concurrency: float
    saturated_steps: int
    total_steps: int
    preemptions: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _Accum:
    """Accumulates per-step measurements while the queue is non-empty."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.n = 0
        self.tok = 0.0
        self.res = 0.0
        self.intf = 0.0
        self.alloc = 0.0
        self.conc = 0.0

    def add(self, token_states: int, reserved_future: int, allocated: int, running: int) -> None:
        self.n += 1
        self.tok += token_states
        self.res += reserved_future
        self.alloc += allocated
        self.intf += allocated - token_states - reserved_future
        self.conc += running

    def result(self, total_steps: int, preemptions: int) -> Breakdown:
        n = max(self.n, 1)
        b = self.budget * n
        return Breakdown(
            token_states=self.tok / b,
            reservation=self.res / b,
            internal_frag=self.intf / b,
            external_other=(b - self.alloc) / b,
            concurrency=self.conc / n,
            saturated_steps=self.n,
            total_steps=total_steps,
            preemptions=preemptions,
        )


def simulate_contiguous(w: common.Workload, policy: str, budget: int, max_len: int) -> Breakdown:
    """Replay ``w`` with contiguous per-request reservations placed first-fit in ``budget`` slots.

    A request that reaches the queue head but finds no hole large enough waits (FCFS, no
    overtaking), even when the free total would suffice: that is external fragmentation.
    """
    p = w.prompt_lens.tolist()
    o = w.output_lens.tolist()
    alloc = FirstFitAllocator(budget)
    waiting = deque(range(len(w)))
    running: list[int] = []
    where: dict[int, tuple[int, int]] = {}
    sampled = {}
    acc = _Accum(budget)
    steps = 0
    # Running sums, updated incrementally: KV tokens written, KV tokens each request will need.
    written_sum = 0
    need_sum = 0
    while waiting or running:
        steps += 1
        admitted = []
        while waiting:
            r = waiting[0]
            size = reservation(policy, p[r], o[r], max_len)
            start = alloc.allocate(size)
            if start is None:
                break
            where[r] = (start, size)
            waiting.popleft()
            admitted.append(r)
        if not admitted and not running:
            raise RuntimeError(f"request {waiting[0]} can never fit in a budget of {budget} slots")
        # Decode: each running request writes the token sampled last step.
        written_sum += len(running)
        for r in running:
            sampled[r] += 1
        for r in admitted:
            sampled[r] = 1
            written_sum += p[r]
            need_sum += p[r] + o[r] - 1
        running.extend(admitted)
        if waiting:
            acc.add(written_sum, need_sum - written_sum, alloc.allocated, len(running))
        done = [r for r in running if sampled[r] == o[r]]
        if done:
            for r in done:
                start, size = where.pop(r)
                alloc.free_range(start, size)
                written_sum -= p[r] + o[r] - 1
                need_sum -= p[r] + o[r] - 1
                del sampled[r]
            dset = set(done)
            running = [r for r in running if r not in dset]
    return acc.result(steps, 0)


def simulate_paged(
    w: common.Workload, block_size: int, budget: int, watermark: float = 0.0, check: bool = True
) -> Breakdown:
    """Replay ``w`` through pagedkv's Python API with ``budget // block_size`` usable blocks.

    Prefix caching is off (each request's prompt tokens are unique anyway), so blocks in use
    equal ``sum(ceil(kv_tokens / block_size))``; with ``check`` that is asserted every step.
    Raises ImportError when pagedkv is not importable.
    """
    import pagedkv  # noqa: PLC0415

    bs = block_size
    usable = budget // bs
    mgr = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=usable + 1, block_size=bs, enable_prefix_caching=False))
    pool = mgr.pool
    wm = int(watermark * usable)
    p = w.prompt_lens.tolist()
    o = w.output_lens.tolist()
    waiting: deque[int] = deque(range(len(w)))
    running: list[int] = []
    sampled: dict[int, int] = {}  # tokens sampled so far (kept across preemption)
    written: dict[int, int] = {}  # KV tokens written (0 while preempted)
    registered: set[int] = set()
    out_tokens: dict[int, list[int]] = {}
    acc = _Accum(usable * bs)
    steps = 0
    preemptions = 0
    written_sum = 0
    blocks_sum = 0  # sum of ceil(written / bs) over running requests
    while waiting or running:
        steps += 1
        # 1. Blocks the running requests need for this decode; preempt the newest while short.
        free = pool.num_free
        need = sum(1 for r in running if written[r] % bs == 0)
        while need > free:
            victim = running.pop()
            mgr.preempt([victim])
            preemptions += 1
            if written[victim] % bs == 0:
                need -= 1
            written_sum -= written[victim]
            blocks_sum -= -(-written[victim] // bs)
            free += -(-written[victim] // bs)
            written[victim] = 0
            waiting.appendleft(victim)
        # 2. Admit FCFS while the prompt (plus tokens already generated, for a resumed
        #    request) fits above the watermark.
        free -= need
        admitted = []
        while waiting:
            r = waiting[0]
            g = sampled.get(r, 0)
            nb = -(-(p[r] + g) // bs)
            if nb > free - wm:
                break
            free -= nb
            waiting.popleft()
            admitted.append(r)
        if not admitted and not running:
            raise RuntimeError(f"request {waiting[0]} can never fit in {usable} blocks of {bs}")
        # 3. One batched step for everyone.
        ids, num_new, app = [], [], []
        for r in running:
            ids.append(r)
            num_new.append(1)
            app.append([out_tokens[r][sampled[r] - 1]])
        for r in admitted:
            g = sampled.get(r, 0)
            if r not in registered:
                mgr.add_sequence(r, common.unique_tokens(r, p[r]))
                registered.add(r)
                out_tokens[r] = common.unique_tokens(r, o[r], salt=2).tolist()
                app.append([])
            else:  # resumed after recompute preemption: re-prefill prompt + generated tokens
                app.append([out_tokens[r][g - 1]])
            ids.append(r)
            num_new.append(p[r] + g)
        out = mgr.step(ids, num_new, app)
        if out.error is not None:
            raise RuntimeError(f"pagedkv step failed at step {steps}: {out.error!r}")
        for r in running:
            written[r] += 1
            written_sum += 1
            if written[r] % bs == 1 or bs == 1:
                blocks_sum += 1
            sampled[r] += 1
        for r in admitted:
            g = sampled.get(r, 0)
            written[r] = p[r] + g
            written_sum += written[r]
            blocks_sum += -(-written[r] // bs)
            sampled[r] = g + 1
        running.extend(admitted)
        if check and pool.num_used != blocks_sum:
            raise AssertionError(f"step {steps}: pool reports {pool.num_used} blocks in use, expected {blocks_sum}")
        if waiting:
            acc.add(written_sum, 0, blocks_sum * bs, len(running))
        done = [r for r in running if sampled[r] == o[r]]
        if done:
            for r in done:
                mgr.free(r)
                written_sum -= written[r]
                blocks_sum -= -(-written[r] // bs)
                del written[r], sampled[r], out_tokens[r]
            dset = set(done)
            running = [r for r in running if r not in dset]
    if check:
        mgr.check_invariants()
        if pool.num_used != 0:
            raise AssertionError(f"{pool.num_used} blocks still in use after the replay")
    return acc.result(steps, preemptions)


def max_len_for(w: common.Workload) -> int:
    """The model context a deployment serving ``w`` needs: the next power of two >= the longest
    request (prompt + output), and at least 2048 (OPT's context, the paper's setting)."""
    longest = int((w.prompt_lens + w.output_lens).max())
    return max(2048, 1 << (longest - 1).bit_length())


def load_workloads(
    names: list[str], traces_dir: str | None, n_synth: int, n_trace: int | None
) -> list[common.Workload]:
    """The workloads by name; synthetic ones get ``n_synth`` requests, traces their first ``n_trace``."""
    out = []
    for name in names:
        if name.endswith("_like"):
            out.append(common.load_workload(name, n=n_synth))
        else:
            out.append(common.load_workload(name, traces_dir, n=n_trace))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces-dir", default=None, help="folder with the full traces (default: bundled excerpts)")
    ap.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    ap.add_argument("--block-sizes", nargs="+", type=int, default=BLOCK_SIZES)
    ap.add_argument(
        "--budget-max-lens",
        type=int,
        default=16,
        help="KV budget in units of the workload's max context length (default 16)",
    )
    ap.add_argument("--requests", type=int, default=None, help="requests per trace (default: all in the file)")
    ap.add_argument("--synthetic-requests", type=int, default=4000)
    ap.add_argument(
        "--watermark",
        type=float,
        default=0.0,
        help="fraction of blocks kept free at admission (vLLM V1 default 0; V0 used 0.01)",
    )
    ap.add_argument("--quick", action="store_true", help="fewer requests (for run_all)")
    ap.add_argument("--results-dir", default=str(common.RESULTS_DIR))
    a = ap.parse_args(argv)
    if a.quick:
        a.requests = a.requests or 1500
        a.synthetic_requests = min(a.synthetic_requests, 2500)
    workloads = load_workloads(a.workloads, a.traces_dir, a.synthetic_requests, a.requests)
    try:
        import pagedkv  # noqa: F401, PLC0415

        have_pagedkv = True
    except ImportError as e:
        have_pagedkv = False
        print(f"pagedkv not importable ({e}); paged rows skipped", file=sys.stderr)
    jobs = []
    for w in workloads:
        for pol in POLICIES:
            jobs.append((w, "contiguous", pol))
        if have_pagedkv:
            for bs in a.block_sizes:
                jobs.append((w, "paged", bs))
    results: list[dict[str, Any]] = []
    bar = common.progress(total=len(jobs), desc="memory efficiency")
    for w, kind, param in jobs:
        max_len = max_len_for(w)
        budget = a.budget_max_lens * max_len
        bar.set_postfix_str(f"{w.name} {kind} {param}")
        t0 = time.perf_counter()
        if kind == "contiguous":
            b = simulate_contiguous(w, param, budget, max_len)
            system = f"contiguous {param}"
        else:
            b = simulate_paged(w, param, budget, a.watermark)
            system = f"pagedkv bs={param}"
        results.append(
            {
                "workload": w.name,
                "system": system,
                "kind": kind,
                "param": param,
                "max_len": max_len,
                "budget_tokens": budget,
                "seconds": time.perf_counter() - t0,
                **b.as_dict(),
            }
        )
        bar.update(1)
    bar.close()
    rows = []
    for r in results:
        rows.append(
            [
                r["workload"],
                r["system"],
                100 * r["token_states"],
                100 * r["reservation"],
                100 * r["internal_frag"],
                100 * r["external_other"],
                r["concurrency"],
                r["preemptions"],
                r["budget_tokens"],
            ]
        )
    common.print_table(
        "KV memory efficiency under a fixed budget (% of the KV budget, averaged over saturated steps)",
        [
            "workload",
            "system",
            "token states %",
            "reservation %",
            "internal frag %",
            "external frag & other %",
            "concurrent reqs",
            "preemptions",
            "budget (tokens)",
        ],
        rows,
        footnote="Paper Fig. 2 (OPT-13B, ShareGPT): token states 20.4% (Orca max), 26.8% (pow2), "
        "38.2% (oracle), 96.3% (vLLM).",
    )
    payload = {
        "description": __doc__.split("\n\n")[0],
        "workloads": [w.describe() for w in workloads],
        "settings": {
            "budget_max_lens": a.budget_max_lens,
            "watermark": a.watermark,
            "block_sizes": a.block_sizes,
            "pagedkv_version": common.pagedkv_version(),
        },
        "paper_fig2_token_states_pct": PAPER_FIG2,
        "results": results,
    }
    path = common.write_json("memory_efficiency", payload, Path(a.results_dir))
    png = plot(results, Path(a.results_dir) / "memory_efficiency.png")
    print(f"wrote {path} and {png}")
    return payload


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    """Two panels: Fig. 2-style stacked budget breakdown per workload (contiguous policies and
    pagedkv bs=16), and token-state share against block size."""
    plt = common.pyplot()
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [2.2, 1]})
    systems = ["contiguous max", "contiguous pow2", "contiguous oracle", "pagedkv bs=16"]
    parts = [
        ("token_states", "token states", "#2b8a3e"),
        ("reservation", "reservation", "#f59f00"),
        ("internal_frag", "internal frag.", "#e03131"),
        ("external_other", "external frag. & other", "#868e96"),
    ]
    width = 0.8 / len(systems)
    for si, sysname in enumerate(systems):
        for wi, wl in enumerate(workloads):
            row = next((r for r in results if r["workload"] == wl and r["system"] == sysname), None)
            if row is None:
                continue
            bottom = 0.0
            x = wi + (si - (len(systems) - 1) / 2) * width
            for key, label, color in parts:
                v = 100 * row[key]
                ax1.bar(
                    x,
                    v,
                    width * 0.95,
                    bottom=bottom,
                    color=color,
                    label=label if (si == 0 and wi == 0) else None,
                    edgecolor="white",
                    linewidth=0.3,
                )
                bottom += v
            ax1.text(
                x,
                101,
                sysname.replace("contiguous ", "").replace("pagedkv bs=16", "paged"),
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax1.set_xticks(range(len(workloads)))
    ax1.set_xticklabels(workloads)
    ax1.set_ylim(0, 125)
    ax1.set_ylabel("% of KV budget")
    ax1.set_title("KV budget breakdown (contiguous first-fit vs pagedkv, block 16)")
    ax1.legend(loc="upper left", fontsize=8, ncol=4)
    for wl in workloads:
        rows = sorted((r for r in results if r["workload"] == wl and r["kind"] == "paged"), key=lambda r: r["param"])
        if rows:
            ax2.plot([r["param"] for r in rows], [100 * r["token_states"] for r in rows], marker="o", label=wl)
    ax2.axhline(96.3, color="k", ls="--", lw=0.8, label="paper vLLM 96.3%")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("block size (tokens)")
    ax2.set_ylabel("token states, % of KV budget")
    ax2.set_title("pagedkv: token-state share vs block size")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
