"""Where the pagedkv engine's CPU time goes: shares of its wall in GEMMs, attention, KV cache
writes, the rest of the forward pass and everything outside it (torch.profiler).

Runs one workload of ``engine_throughput.py`` (``trace``: 16 Azure conversation requests,
``trace-large``: 64, ``equal``: 32 x 32-token prompts, 64 new tokens) through
:class:`pagedkv.engine.LLMEngine` on SmolLM2-135M fp32, 1 torch thread, under
``torch.profiler`` with the attention and cache-write kernels and the model forward tagged, and
prints:

- ``GEMM``: self time of ``aten::mm`` / ``addmm`` / ``addmm_`` / ``bmm`` (the linear layers and the LM head;
  what ``engine_roofline.py``'s GEMM floor counts);
- ``attention``: :func:`pagedkv.kernels.paged_attention` calls, everything inside them;
- ``cache write``: :func:`pagedkv.kernels.reshape_and_cache` calls;
- ``other forward``: the rest of the forward pass (norms, RoPE, SwiGLU, residual adds, Python);
- ``outside forward``: scheduling, block tables, sampling, outputs.

The engine's share of its GEMM floor is about the GEMM share here (the floor *is* the GEMM time
of the same schedule), and shares move far less with the load of a shared machine than walls
do. The profiler adds a few microseconds per op, which inflates the small-op parts a little.

Usage: python benchmarks/engine_profile.py [--workload trace] [--top 25]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_throughput import equal_workload, trace_workload  # noqa: E402

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")


def _tagged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    from torch.profiler import record_function

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("trace", "trace-large", "equal"), default="trace")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=0, help="also print the N ops with the most self time")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from torch.profiler import ProfilerActivity, profile

    from pagedkv import kernels
    from pagedkv.engine import LLMEngine, SamplingParams
    from pagedkv.engine.models.loader import load_hf_model

    hf, tok = load_hf_model()
    vocab = hf.config.vocab_size
    work = (
        equal_workload(32, 32, 64, vocab)
        if a.workload == "equal"
        else trace_workload(16 if a.workload == "trace" else 64, 0.25, 256, 64, vocab)
    )
    engine = LLMEngine(hf, tokenizer=tok, num_kv_blocks=1024, block_size=16, max_tokens_per_step=1024, device="cpu")
    engine.generate([work[0][0][:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in work]
    # The model module calls kernels.<op> through the package at call time: tag them there.
    saved = kernels.paged_attention, kernels.reshape_and_cache, engine.runner.model.forward
    kernels.paged_attention = _tagged("pagedkv::attention", kernels.paged_attention)
    kernels.reshape_and_cache = _tagged("pagedkv::cache_write", kernels.reshape_and_cache)
    engine.runner.model.forward = _tagged("pagedkv::forward", engine.runner.model.forward)  # type: ignore[method-assign]
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            engine.generate([p for p, _ in work], params)
            wall = time.perf_counter() - t
    finally:
        kernels.paged_attention, kernels.reshape_and_cache, engine.runner.model.forward = saved
    ops = {e.key: e for e in prof.key_averages()}

    def total(key: str) -> float:
        return ops[key].cpu_time_total / 1e6 if key in ops else 0.0

    gemm = sum(ops[k].self_cpu_time_total / 1e6 for k in GEMM_OPS if k in ops)
    attn, write, fwd = total("pagedkv::attention"), total("pagedkv::cache_write"), total("pagedkv::forward")
    parts = {
        "GEMM": gemm,
        "attention": attn,
        "cache write": write,
        "other forward": fwd - gemm - attn - write,
        "outside forward": wall - fwd,
    }
    print(
        f"pagedkv engine, {a.workload} workload ({len(work)} requests), {a.threads} thread(s): "
        f"wall {wall:.2f} s under the profiler"
    )
    for name, sec in parts.items():
        print(f"  {name:16s} {sec:7.2f} s  {sec / wall:6.1%}")
    if a.top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
