"""vLLM's V1 Scheduler CPU time per step: stock vs ``PagedKVScheduler``, in one run.

Needs an environment with vLLM and pagedkv (``make vllm-venv``, then
``target/vllm-venv/bin/python benchmarks/vllm_scheduler.py``). No GPU, no model: the scheduler
is vLLM's real one (``pagedkv.integrations.vllm.cpu_harness`` builds it from a tiny local model
config), and a fake model samples one token per request per step.

Workloads (each scheduler gets the same request stream):

- ``decode256``: 256 requests with distinct 512-token prompts, measured once all are decoding
  (steady state: every step schedules 256 single-token decodes).
- ``azure_conv``: the Azure LLM inference conversation trace (prompt / output lengths, distinct
  token ids), closed loop: new requests are admitted whenever fewer than 256 are unfinished.
- ``mooncake``: the Mooncake conversation trace, prompts built from its ``hash_ids`` (equal ids
  give equal 512-token blocks, so requests share prefixes), same closed loop.

Reported per step (mean over the measured steps, CPU time of this thread): ``schedule()``,
``update_from_output()`` and their sum; the KV-manager share is measured in a second,
instrumented run (every call on ``scheduler.kv_cache_manager`` plus vLLM's per-request Python
block hasher, timed with ``perf_counter``), as a fraction of that run's scheduler time.
Request objects (and the engine core's prompt hashing inside them) are built before the clock
starts. Variants: pagedkv with the batched decode path off, and with vLLM's Python block
hashes kept (the "hash twice" alternative). Results: a table on stdout and
``benchmarks/results/vllm_scheduler.json``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    expand_hash_ids,
    load_workload,
    machine_info,
    print_table,
    unique_tokens,
    write_json,
)

from pagedkv.integrations.vllm import PagedKVScheduler  # noqa: E402
from pagedkv.integrations.vllm.cpu_harness import (  # noqa: E402
    build_scheduler,
    fake_model_output,
    make_request,
    make_vllm_config,
)

BS = 16


class PagedKVPerRequest(PagedKVScheduler):
    """pagedkv without the batched decode path (one call into Rust per request)."""

    batch_decode = False


class PagedKVHashTwice(PagedKVScheduler):
    """pagedkv that also keeps vLLM's Python block hashes growing (hashing twice)."""

    keep_vllm_block_hashes = True


VARIANTS: dict[str, Any] = {}


def _variants() -> dict[str, Any]:
    from vllm.v1.core.sched.scheduler import Scheduler

    return {
        "vLLM stock": Scheduler,
        "pagedkv": PagedKVScheduler,
        "pagedkv per-request": PagedKVPerRequest,
        "pagedkv + vLLM hashes": PagedKVHashTwice,
    }


class KVTimer:
    """Sums the time spent in KV-cache work: every method of the scheduler's
    ``kv_cache_manager`` (wrapped on the instance), pagedkv's batched decode preparation, and
    vLLM's per-request Python block hasher. Nested calls count once. The wrapper's own cost per
    call (calibrated on a no-op) is subtracted."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0
        self.bias = 0.0
        noop = self.wrap(lambda: None)
        for _ in range(20_000):
            noop()
        self.bias = self.seconds / self.calls
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth = 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += clock() - t0
                self.calls += 1
                self._depth = 0

        return timed

    def net_seconds(self) -> float:
        return self.seconds - self.calls * self.bias

    def instrument(self, sched: Any, requests: list[Any]) -> None:
        manager = sched.kv_cache_manager
        for name in dir(type(manager)):
            if name.startswith("__"):
                continue
            attr = getattr(type(manager), name, None)
            if callable(attr) and not isinstance(attr, type):
                setattr(manager, name, self.wrap(getattr(manager, name)))
        if hasattr(sched, "_prepare_decodes"):
            sched._prepare_decodes = self.wrap(sched._prepare_decodes)
        for r in requests:
            if getattr(r, "_block_hasher", None) is not None:
                r._block_hasher = self.wrap(r._block_hasher)


def _requests_decode(n: int, prompt_len: int, out_len: int) -> list[tuple[int, Any]]:
    return [
        (0, (f"d{i}", unique_tokens(i, prompt_len, 4000).tolist(), out_len)) for i in range(n)
    ]


def _requests_trace(name: str, n: int, max_prompt: int) -> list[tuple[int, Any]]:
    w = load_workload(name)
    out = []
    for i in range(min(n, len(w))):
        p = int(min(w.prompt_lens[i], max_prompt))
        o = int(min(w.output_lens[i], 512))
        if w.hash_ids is not None:
            toks = expand_hash_ids(w.hash_ids[i], p, 4000)
        else:
            toks = unique_tokens(i, p, 4000)
        out.append((0, (f"{name}{i}", (toks + 16).tolist(), o)))
    return out


def run_one(
    cls: Any,
    specs: list[tuple[int, Any]],
    *,
    num_blocks: int,
    max_running: int,
    warmup_steps: int,
    steps: int,
    instrument: bool,
    wait_all_decoding: bool,
) -> dict[str, float]:
    """Drives ``cls`` over the request specs; returns per-step means in microseconds."""
    cfg = make_vllm_config(
        num_blocks=num_blocks,
        block_size=BS,
        max_num_seqs=max_running,
        max_num_batched_tokens=8192,
        max_model_len=32768,
    )
    sched = build_scheduler(cls, cfg, log_stats=False)
    reqs = [make_request(rid, prompt, out, block_size=BS) for _, (rid, prompt, out) in specs]
    timer = KVTimer() if instrument else None
    if timer is not None:
        timer.instrument(sched, reqs)
    pending = list(reversed(reqs))

    def top_up() -> None:
        while pending and len(sched.requests) < max_running:
            sched.add_request(pending.pop())

    top_up()
    done_warmup = 0
    while done_warmup < warmup_steps or (
        wait_all_decoding
        and any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running)
        or (wait_all_decoding and len(sched.running) < max_running)
    ):
        out = sched.schedule()
        sched.update_from_output(out, fake_model_output(sched, out))
        top_up()
        done_warmup += 1
        if done_warmup > 10_000:
            raise RuntimeError("warm-up did not reach steady state")
    gc.collect()
    gc.disable()
    t_sched = t_upd = 0.0
    kv_before = timer.net_seconds() if timer else 0.0
    wall_sched = wall_upd = 0.0
    scheduled_reqs = 0
    try:
        for _ in range(steps):
            c0, w0 = time.thread_time(), time.perf_counter()
            out = sched.schedule()
            c1, w1 = time.thread_time(), time.perf_counter()
            model_out = fake_model_output(sched, out)
            c2, w2 = time.thread_time(), time.perf_counter()
            sched.update_from_output(out, model_out)
            c3, w3 = time.thread_time(), time.perf_counter()
            t_sched += c1 - c0
            t_upd += c3 - c2
            wall_sched += w1 - w0
            wall_upd += w3 - w2
            scheduled_reqs += len(out.num_scheduled_tokens)
            top_up()
    finally:
        gc.enable()
    res = {
        "schedule_us": 1e6 * t_sched / steps,
        "update_us": 1e6 * t_upd / steps,
        "total_us": 1e6 * (t_sched + t_upd) / steps,
        "wall_total_us": 1e6 * (wall_sched + wall_upd) / steps,
        "scheduled_reqs_per_step": scheduled_reqs / steps,
    }
    if timer is not None:
        kv = timer.net_seconds() - kv_before
        res["kv_us"] = 1e6 * kv / steps
        res["kv_share"] = kv / (t_sched + t_upd)
    return res


def hashing_cost(num_tokens: int = 8192, repeats: int = 20) -> dict[str, float]:
    """CPU µs per 16-token block: vLLM's Python block hasher (what the engine core runs for
    every prompt and ``update_from_output`` for every filled output block) vs pagedkv hashing,
    allocating and caching the same blocks in Rust (``allocate_slots`` of the whole prompt)."""
    import pagedkv

    tokens = (unique_tokens(7, num_tokens, 4000) + 16).tolist()
    blocks = num_tokens // BS
    request = make_request("h", tokens, 1, block_size=BS)
    hasher = request._block_hasher
    best_vllm = best_pkv = float("inf")
    for _ in range(repeats):
        request.block_hashes.clear()
        t0 = time.thread_time()
        request.block_hashes.extend(hasher(request))
        best_vllm = min(best_vllm, time.thread_time() - t0)
        kvm = pagedkv.KVCacheManager(pagedkv.CacheConfig(blocks + 2, BS))
        kvm.add_sequence(0, tokens)
        t0 = time.thread_time()
        kvm.allocate_slots(0, num_tokens)
        best_pkv = min(best_pkv, time.thread_time() - t0)
    assert len(request.block_hashes) == blocks
    return {
        "vllm_python_hash_us_per_block": 1e6 * best_vllm / blocks,
        "pagedkv_hash_allocate_cache_us_per_block": 1e6 * best_pkv / blocks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="measured steps per workload")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per variant (best kept)")
    ap.add_argument("--workloads", default="decode256,azure_conv,mooncake")
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variants")
    ap.add_argument(
        "--trace-variants",
        default="vLLM stock,pagedkv",
        help="variants run on the trace workloads (all variants run on decode256)",
    )
    ap.add_argument("--no-write", action="store_true", help="do not write the results JSON")
    args = ap.parse_args()
    variants = _variants()
    if args.variants:
        variants = {k: variants[k] for k in args.variants.split(",")}

    workloads = {
        "decode256": dict(
            specs=_requests_decode(256, 512, 100_000),
            num_blocks=256 * 48 + 1,
            warmup_steps=5,
            wait_all_decoding=True,
        ),
        "azure_conv": dict(
            specs=_requests_trace("azure_conv", 1500, 8192),
            num_blocks=160_000,
            warmup_steps=300,
            wait_all_decoding=False,
        ),
        "mooncake": dict(
            specs=_requests_trace("mooncake", 1200, 16384),
            num_blocks=160_000,
            warmup_steps=300,
            wait_all_decoding=False,
        ),
    }
    rows = []
    results: dict[str, Any] = {}
    hashing = hashing_cost()
    print(
        f"block hashing, CPU us per 16-token block: vLLM Python hasher "
        f"{hashing['vllm_python_hash_us_per_block']:.2f}, pagedkv hash+allocate+cache in Rust "
        f"{hashing['pagedkv_hash_allocate_cache_us_per_block']:.3f}",
        flush=True,
    )
    for wname in args.workloads.split(","):
        w = workloads[wname]
        results[wname] = {}
        chosen = variants
        if wname != "decode256":
            chosen = {k: v for k, v in variants.items() if k in args.trace_variants.split(",")}
        for vname, cls in chosen.items():
            timed = [
                run_one(cls, w["specs"], num_blocks=w["num_blocks"], max_running=256,
                        warmup_steps=w["warmup_steps"], steps=args.steps, instrument=False,
                        wait_all_decoding=w["wait_all_decoding"])
                for _ in range(args.repeats)
            ]
            best = min(timed, key=lambda r: r["total_us"])
            inst = run_one(cls, w["specs"], num_blocks=w["num_blocks"], max_running=256,
                           warmup_steps=w["warmup_steps"], steps=args.steps, instrument=True,
                           wait_all_decoding=w["wait_all_decoding"])
            best["kv_us"] = inst["kv_us"]
            best["kv_share"] = inst["kv_us"] / best["total_us"]
            best["runs_total_us"] = [r["total_us"] for r in timed]
            results[wname][vname] = best
            print(f"{wname:10s} {vname:22s} {best}", file=sys.stderr, flush=True)
        base = results[wname]["vLLM stock"] if "vLLM stock" in results[wname] else None
        for vname, r in results[wname].items():
            rows.append([
                wname, vname, f"{r['scheduled_reqs_per_step']:.0f}",
                f"{r['schedule_us']:.0f}", f"{r['update_us']:.0f}", f"{r['total_us']:.0f}",
                f"{base['total_us'] / r['total_us']:.2f}x" if base else "-",
                f"{r['kv_us']:.0f}",
                f"{100 * r['kv_share']:.1f}%",
                f"{base['kv_share'] / r['kv_share']:.1f}x" if base else "-",
            ])
    print_table(
        "vLLM Scheduler CPU time per step (us), stock vs PagedKVScheduler",
        ["workload", "scheduler", "reqs/step", "schedule", "update", "total", "speed-up",
         "KV us", "KV share", "share ratio"],
        rows,
    )
    if not args.no_write:
        import vllm

        path = write_json("vllm_scheduler", {
            "benchmark": "vllm_scheduler",
            "vllm": vllm.__version__,
            "steps": args.steps,
            "repeats": args.repeats,
            "machine": machine_info(),
            "results": results,
            "hashing": hashing,
            "notes": [
                "CPU time (thread_time) per step; KV share from a separate instrumented run "
                "(perf_counter around every kv_cache_manager call and vLLM's block hasher)",
                "requests (and the engine core's Python prompt hashing) built before timing",
            ],
        })
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
