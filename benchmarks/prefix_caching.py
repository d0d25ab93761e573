"""Prefix caching on the Mooncake conversation trace (Qin et al., FAST'25): hit rate and prefill
tokens saved, with caching on (at several KV budgets) and off.

Each request's ``hash_ids`` (one id per 512-token block of its prompt; equal ids = equal prefix
block) are expanded into deterministic token ids (:func:`common.expand_hash_ids`), so requests
that share hash ids share real token prefixes; pagedkv then re-derives the sharing by hashing
its own blocks (block size 16 by default). The replay is continuous batching through pagedkv's
Python API (``add_sequence`` / ``num_blocks_needed`` / ``step`` / ``preempt`` / ``free``): FCFS
admission in trace order while the batch has room (``--max-running``) and the pool has the
blocks the prompt needs after prefix hits; one decode token per running request per step;
recompute preemption of the newest request when a decode step lacks blocks. Prefill tokens are
the tokens each (re)admission has to compute; cached tokens are those served from the prefix
cache.

"unbounded cache" is the hit rate of a cache that never evicts and saw every earlier request
(computed in Python from the expanded tokens, see :func:`ideal_hits`): the bound for any budget.

Usage: ``python benchmarks/prefix_caching.py [--traces-dir DIR] [--quick]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

DEFAULT_BUDGETS = [1 << 19, 1 << 20, 1 << 21, 1 << 22, 1 << 23, 1 << 24]  # KV tokens


def ideal_hits(w: common.Workload, block_size: int) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of an unbounded prefix cache that has seen every earlier
    request: per request, the longest run of leading full blocks (of ``block_size`` tokens,
    after the same hash-id expansion) that an earlier request also had, at most prompt - 1
    tokens. Chained keys, like the prefix hash: a block matches only with its whole prefix."""
    seen: set[int] = set()
    total = cached = 0
    for r, plen in enumerate(w.prompt_lens.tolist()):
        toks = common.expand_hash_ids(w.hash_ids[r], plen)
        total += plen
        nfull = plen // block_size
        blocks = toks[: nfull * block_size].reshape(nfull, block_size)
        keys = []
        k = 0
        for b in blocks:
            k = hash((k, b.tobytes()))
            keys.append(k)
        hit = 0
        limit = (plen - 1) // block_size
        while hit < limit and keys[hit] in seen:
            hit += 1
        cached += hit * block_size
        seen.update(keys)
    return total, cached


def replay(
    w: common.Workload, *, block_size: int, budget_tokens: int, caching: bool, max_running: int, hash_algo: str
) -> dict[str, Any]:
    """Replay the workload through pagedkv; returns counters (see module docstring)."""
    import pagedkv  # noqa: PLC0415

    bs = block_size
    usable = budget_tokens // bs
    mgr = pagedkv.KVCacheManager(
        pagedkv.CacheConfig(num_blocks=usable + 1, block_size=bs, enable_prefix_caching=caching, hash_algo=hash_algo)
    )
    pool = mgr.pool
    p = w.prompt_lens.tolist()
    o = w.output_lens.tolist()
    longest = max(a + b for a, b in zip(p, o))
    if -(-longest // bs) > usable:
        raise ValueError(f"budget {budget_tokens} tokens cannot hold the longest request ({longest} tokens)")
    waiting: deque[int] = deque(range(len(w)))
    running: list[int] = []
    sampled: dict[int, int] = {}
    written: dict[int, int] = {}
    registered: set[int] = set()
    outs: dict[int, list[int]] = {}
    prompt_tokens = sum(p)
    prefill_tokens = 0
    cached_tokens = 0
    first_cached = 0  # cached tokens at first admission only
    preemptions = 0
    steps = 0
    t0 = time.perf_counter()
    while waiting or running:
        steps += 1
        free = pool.num_free
        need = sum(1 for r in running if written[r] % bs == 0)
        while need > free:
            victim = running.pop()
            mgr.preempt([victim])
            preemptions += 1
            need -= written[victim] % bs == 0
            free = pool.num_free
            written[victim] = 0
            waiting.appendleft(victim)
        free -= need
        ids, num_new, app = [], [], []
        for r in running:
            ids.append(r)
            num_new.append(1)
            app.append([outs[r][sampled[r] - 1]])
        admitted = []
        while waiting and len(running) + len(admitted) < max_running:
            r = waiting[0]
            g = sampled.get(r, 0)
            if r not in registered:
                mgr.add_sequence(r, common.expand_hash_ids(w.hash_ids[r], p[r]))
                registered.add(r)
                outs[r] = common.unique_tokens(r, o[r], salt=2).tolist()  # never shared
            # Resumed requests: the last sampled token is appended by the step itself, so
            # count its block by hand (+1 token).
            nb = mgr.num_blocks_needed(r, p[r] + g)[0] + (1 if g and (p[r] + g - 1) % bs == 0 else 0)
            if nb > free:
                break
            free -= nb
            waiting.popleft()
            admitted.append(r)
            ids.append(r)
            num_new.append(p[r] + g)
            app.append([outs[r][g - 1]] if g else [])
        if not ids:
            raise RuntimeError(f"request {waiting[0]} can never fit in {usable} blocks")
        out = mgr.step(ids, num_new, app)
        if out.error is not None:
            raise RuntimeError(f"pagedkv step {steps} failed: {out.error!r}")
        nrun = len(running)
        q = out.query_start_loc
        for r in running:
            written[r] += 1
            sampled[r] += 1
        for j, r in enumerate(admitted):
            i = nrun + j
            c = int(out.num_cached_tokens[i])
            sched = int(q[i + 1] - q[i])
            cached_tokens += c
            prefill_tokens += sched
            if r not in sampled:
                first_cached += c
            g = sampled.get(r, 0)
            written[r] = p[r] + g
            sampled[r] = g + 1
        running.extend(admitted)
        done = [r for r in running if sampled[r] == o[r]]
        if done:
            for r in done:
                mgr.free(r)
                del sampled[r], written[r], outs[r]
            dset = set(done)
            running = [r for r in running if r not in dset]
    mgr.check_invariants()
    st = mgr.stats()
    return {
        "caching": caching,
        "budget_tokens": budget_tokens,
        "block_size": bs,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": prefill_tokens,
        "cached_tokens": cached_tokens,
        "first_admission_hit_rate": first_cached / prompt_tokens,
        "prefill_saved_frac": 1 - prefill_tokens / prompt_tokens,
        "manager_hit_rate": st.prefix_hits_tokens / st.prefix_queries_tokens if st.prefix_queries_tokens else 0.0,
        "evictions": st.evictions,
        "preemptions": preemptions,
        "steps": steps,
        "seconds": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces-dir", default=None, help="folder with the full traces (default: bundled excerpt)")
    ap.add_argument("--requests", type=int, default=None, help="first N requests of the trace (default: all)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budgets", nargs="+", type=int, default=DEFAULT_BUDGETS, help="KV budgets in tokens")
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--hash-algo", default="sha256", choices=["sha256", "xxh3_128"])
    ap.add_argument("--quick", action="store_true", help="four budgets, 1M to 8M tokens (for run_all)")
    ap.add_argument("--results-dir", default=str(common.RESULTS_DIR))
    a = ap.parse_args(argv)
    if a.quick:
        a.budgets = [1 << 20, 1 << 21, 1 << 22, 1 << 23]
    w = common.load_workload("mooncake", a.traces_dir, n=a.requests)
    total, ideal = ideal_hits(w, a.block_size)
    runs = [(b, True) for b in a.budgets] + [(max(a.budgets), False)]
    results = []
    bar = common.progress(total=len(runs), desc="prefix caching")
    for budget, caching in runs:
        bar.set_postfix_str(f"budget {budget} caching {'on' if caching else 'off'}")
        results.append(
            replay(
                w,
                block_size=a.block_size,
                budget_tokens=budget,
                caching=caching,
                max_running=a.max_running,
                hash_algo=a.hash_algo,
            )
        )
        bar.update(1)
    bar.close()
    rows = [
        [
            "unbounded cache (bound)",
            "on",
            None,
            total,
            total - ideal,
            ideal,
            100 * ideal / total,
            100 * ideal / total,
            None,
            None,
        ]
    ]
    for r in results:
        rows.append(
            [
                f"pagedkv bs={r['block_size']}",
                "on" if r["caching"] else "off",
                r["budget_tokens"],
                r["prompt_tokens"],
                r["prefill_tokens_computed"],
                r["cached_tokens"],
                100 * r["first_admission_hit_rate"],
                100 * r["prefill_saved_frac"],
                r["evictions"],
                r["preemptions"],
            ]
        )
    common.print_table(
        f"Prefix caching on the Mooncake conversation trace ({len(w)} requests, "
        f"{w.prompt_lens.mean():.0f} prompt tokens on average)",
        [
            "system",
            "caching",
            "KV budget (tokens)",
            "prompt tokens",
            "prefill tokens computed",
            "cached tokens",
            "hit rate %",
            "prefill saved %",
            "evictions",
            "preemptions",
        ],
        rows,
        footnote="hit rate: cached tokens at each request's first admission / prompt tokens. prefill saved: "
        "1 - computed prefill tokens (re-prefills after preemption included) / prompt tokens.",
    )
    payload = {
        "description": __doc__.split("\n\n")[0],
        "workload": w.describe(),
        "settings": {
            "block_size": a.block_size,
            "max_running": a.max_running,
            "hash_algo": a.hash_algo,
            "pagedkv_version": common.pagedkv_version(),
        },
        "ideal": {"prompt_tokens": total, "cached_tokens": ideal, "hit_rate": ideal / total},
        "results": results,
    }
    path = common.write_json("prefix_caching", payload, Path(a.results_dir))
    png = plot(payload, Path(a.results_dir) / "prefix_caching.png")
    print(f"wrote {path} and {png}")
    return payload


def plot(payload: dict[str, Any], path: Path) -> Path:
    """Hit rate and prefill saved against the KV budget, with the unbounded-cache bound."""
    plt = common.pyplot()
    on = sorted((r for r in payload["results"] if r["caching"]), key=lambda r: r["budget_tokens"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r["budget_tokens"] for r in on]
    ax.plot(x, [100 * r["first_admission_hit_rate"] for r in on], marker="o", label="hit rate (caching on)")
    ax.plot(x, [100 * r["prefill_saved_frac"] for r in on], marker="s", label="prefill tokens saved (caching on)")
    ax.axhline(100 * payload["ideal"]["hit_rate"], color="k", ls="--", lw=0.8, label="unbounded cache")
    ax.axhline(0, color="r", lw=0.8, label="caching off")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV budget (tokens)")
    ax.set_ylabel("%")
    ax.set_title("Mooncake conversation trace: prefix caching in pagedkv")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
