"""Output tokens/s of the pagedkv reference engine vs transformers on CPU (SmolLM2-135M, fp32).

Two workloads, each run by every system on the same prompts in one process:

(a) ``trace``: prompt and output lengths of the first requests of the Azure LLM inference trace
    (conversation, ``benchmarks/data/azure_llm_2023/``, CC-BY-4.0, Patel et al., ISCA'24),
    scaled by ``--trace-scale`` and clamped to fit a CPU run; synthetic token ids; every request
    generates exactly its traced output length (EOS ignored).
(b) ``trace-large``: the same trace with ``--large-trace-requests`` (64) requests, where
    continuous batching matters more (the static batch pads to the longest prompt and runs to
    the longest output); ``--large-rounds`` runs per system (default 1: it is the longest run).
(c) ``equal``: 32 distinct prompts of equal length (32 tokens) x 64 new tokens (no padding
    waste: the best case for a static batch); ``--equal-rounds`` (3) alternating runs per system,
    best of each, so the verdict against the static batch is not a single noisy run; the
    speedup of each round's back-to-back pair is printed and stored too
    (``speedup_vs_hf-static_per_round``), so a verdict that flips between rounds shows.

Systems:
- ``pagedkv``: :class:`pagedkv.engine.LLMEngine` (continuous batching over the paged cache).
- ``hf-static``: transformers ``generate`` on the whole workload as one left-padded batch; it
  runs until the longest output is done (``min_new_tokens`` keeps EOS away).
- ``hf-cb``: transformers' own continuous batching (``generate_batch``'s manager, per-request
  ``max_new_tokens``, EOS off), with a KV cache of the same size and the same token budget.

Output tokens/s counts each request's requested output tokens only (the tokens a client
receives), over the wall time of the system's run (model already loaded, one small warm-up).
Each system runs ``--rounds`` times in alternating order and its best wall time counts (the
machine is shared; hf-cb, the slowest, runs once and only on the trace workload).
Targets: trace >= 1.5x hf-static and >= 3x hf-cb; equal >= 1.0x hf-static.

Run: ``python benchmarks/engine_throughput.py`` (about 10-15 minutes on 2 cores). Prints a table
and writes ``benchmarks/results/engine_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "benchmarks" / "data" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
RESULTS = REPO / "benchmarks" / "results" / "engine_throughput.json"

Workload = list[tuple[list[int], int]]  # (prompt token ids, output tokens)


def trace_workload(n: int, scale: float, max_prompt: int, max_output: int, vocab: int) -> Workload:
    from pagedkv.engine.inputs import read_trace, synthetic_prompt

    reqs = read_trace(TRACE, limit=n, scale=scale, max_prompt_tokens=max_prompt, max_output_tokens=max_output)
    return [(synthetic_prompt(r.prompt_tokens, vocab, 1000 + i), r.output_tokens) for i, r in enumerate(reqs)]


def equal_workload(n: int, prompt_len: int, out_len: int, vocab: int) -> Workload:
    from pagedkv.engine.inputs import synthetic_prompt

    return [(synthetic_prompt(prompt_len, vocab, 5000 + i), out_len) for i in range(n)]


def run_pagedkv(hf: Any, tok: Any, work: Workload, args: argparse.Namespace,
                on_start: Callable[[], None] | None = None) -> dict[str, Any]:
    """The pagedkv engine on ``work``; ``on_start`` is called after the warm-up, right before
    the timed run."""
    from pagedkv.engine import LLMEngine, SamplingParams

    engine = LLMEngine(hf, tokenizer=tok, num_kv_blocks=args.kv_blocks, block_size=args.block_size,
                       max_tokens_per_step=args.max_tokens_per_step, device="cpu")
    engine.generate([work[0][0][:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    engine.reset_metrics()
    if on_start is not None:
        on_start()
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in work]
    t = time.perf_counter()
    outs = engine.generate([p for p, _ in work], params)
    wall = time.perf_counter() - t
    got = sum(len(o.token_ids) for o in outs)
    assert got == sum(o for _, o in work), (got, sum(o for _, o in work))
    m = engine.metrics()
    return {"wall_s": wall, "extra": {"steps": m.num_steps, "peak_blocks": m.peak_blocks_used,
                                      "preemptions": m.preemptions, "ttft_p50_s": m.ttft_p50_s,
                                      "tpot_p50_s": m.tpot_p50_s}}


def run_hf_static(hf: Any, tok: Any, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    longest = max(len(p) for p, _ in work)
    ids = torch.full((len(work), longest), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(work):  # left padding
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    new = max(o for _, o in work)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.generate(ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=2, do_sample=False,
                    pad_token_id=pad)  # warm-up
        t = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=pad)
        wall = time.perf_counter() - t
    assert out.shape[1] == longest + new
    return {"wall_s": wall, "extra": {"padded_prompt": longest, "steps": new}}


def run_hf_cb(hf: Any, tok: Any, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if not hasattr(hf, "continuous_batching_context_manager"):
        return {"wall_s": None, "extra": {"skipped": "transformers has no continuous batching"}}
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(o for _, o in work),
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cbc = ContinuousBatchingConfig(num_blocks=args.kv_blocks, page_size=args.block_size,
                                   max_batch_tokens=args.max_tokens_per_step)

    def serve(items: Workload) -> int:
        done = 0
        tokens = 0
        with hf.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cbc,
                                                    block=True, timeout=5, warmup=False) as manager:
            for p, o in items:
                manager.add_request(p, max_new_tokens=o, eos_token_id=-1)  # -1: no EOS
            while done < len(items):
                r = manager.get_result(timeout=1)
                if r is not None and r.is_finished():
                    done += 1
                    tokens += len(r.generated_tokens)
                elif r is None and not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped unexpectedly")
        return tokens

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        serve([(work[0][0][:8], 2)])  # warm-up
        t = time.perf_counter()
        got = serve(work)
        wall = time.perf_counter() - t
    return {"wall_s": wall, "extra": {"generated": got}}


SYSTEMS: dict[str, Callable[..., dict[str, Any]]] = {
    "hf-static": run_hf_static,
    "hf-cb": run_hf_cb,
    "pagedkv": run_pagedkv,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads for every system (1 is fastest on a shared 2-core machine)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per system (best wall time counts; "
                    "hf-cb runs once)")
    ap.add_argument("--trace-requests", type=int, default=16)
    ap.add_argument("--trace-scale", type=float, default=0.25)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--large-trace-requests", type=int, default=64, help="requests of the trace-large workload")
    ap.add_argument("--large-rounds", type=int, default=1, help="runs per system on trace-large")
    ap.add_argument("--equal-rounds", type=int, default=3, help="runs per system on equal (best counts)")
    ap.add_argument("--equal-requests", type=int, default=32)
    ap.add_argument("--equal-prompt", type=int, default=32)
    ap.add_argument("--equal-output", type=int, default=64)
    ap.add_argument("--kv-blocks", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tokens-per-step", type=int, default=1024)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    ap.add_argument("--workloads", default="trace,trace-large,equal")
    ap.add_argument("--output", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from pagedkv.engine.loader import load_hf_model

    hf, tok = load_hf_model()
    vocab = hf.config.vocab_size
    workloads = {
        "trace": trace_workload(args.trace_requests, args.trace_scale, args.max_prompt, args.max_output, vocab),
        "trace-large": trace_workload(args.large_trace_requests, args.trace_scale, args.max_prompt,
                                      args.max_output, vocab),
        "equal": equal_workload(args.equal_requests, args.equal_prompt, args.equal_output, vocab),
    }
    rounds = {"trace": args.rounds, "trace-large": args.large_rounds, "equal": args.equal_rounds}
    results: dict[str, Any] = {"machine": {"python": sys.version.split()[0], "torch": torch.__version__,
                                           "platform": platform.platform(), "threads": args.threads},
                               "config": vars(args) | {"output": str(args.output)}, "workloads": {}}
    plan = {"trace": ["hf-static", "hf-cb", "pagedkv"], "trace-large": ["hf-static", "pagedkv"],
            "equal": ["hf-static", "pagedkv"]}
    wanted = args.systems.split(",")
    for wname in args.workloads.split(","):
        work = workloads[wname]
        useful = sum(o for _, o in work)
        entry: dict[str, Any] = {"requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work),
                                 "output_tokens": useful, "systems": {}}
        names = [n for n in plan[wname] if n in wanted]
        for rnd in range(rounds[wname]):
            # alternate the order each round so slow drifts of a shared machine's load even out
            for sname in (names if rnd % 2 == 0 else names[::-1]):
                if rnd > 0 and sname == "hf-cb":
                    continue  # one round: it is the slowest and only the trace target needs it
                print(f"[{wname}] round {rnd + 1}: {sname} ...", file=sys.stderr, flush=True)
                r = SYSTEMS[sname](hf, tok, work, args)
                print(f"[{wname}] {sname}: {r['wall_s'] or 0:.1f} s", file=sys.stderr, flush=True)
                prev = entry["systems"].setdefault(sname, {"walls_s": [], "extra": r["extra"]})
                if r["wall_s"] is not None:
                    prev["walls_s"].append(r["wall_s"])
        for r in entry["systems"].values():
            r["wall_s"] = min(r["walls_s"]) if r["walls_s"] else None  # best of the rounds
            r["output_tokens_per_s"] = useful / r["wall_s"] if r["wall_s"] else None
        pk = entry["systems"].get("pagedkv", {}).get("output_tokens_per_s")
        for other in ("hf-static", "hf-cb"):
            o = entry["systems"].get(other, {}).get("output_tokens_per_s")
            if pk and o:
                entry[f"speedup_vs_{other}"] = pk / o
                # Each round's pair (run back to back): the verdict holds only if it holds per round.
                pairs = list(zip(entry["systems"][other]["walls_s"], entry["systems"]["pagedkv"]["walls_s"]))
                if len(pairs) > 1:
                    entry[f"speedup_vs_{other}_per_round"] = [ow / pw for ow, pw in pairs]
                    print(f"[{wname}] pagedkv vs {other} per round: "
                          + ", ".join(f"{ow / pw:.2f}x" for ow, pw in pairs), file=sys.stderr)
        results["workloads"][wname] = entry

    _print_table(results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _print_table(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="engine throughput, SmolLM2-135M fp32 on CPU (output tokens/s)")
    for col in ("workload", "requests", "system", "wall s", "out tok/s", "pagedkv speedup", "target"):
        t.add_column(col, justify="right" if col not in ("workload", "system") else "left")
    targets = {("trace", "hf-static"): 1.5, ("trace", "hf-cb"): 3.0, ("trace-large", "hf-static"): 1.5,
               ("equal", "hf-static"): 1.0}
    for wname, w in results["workloads"].items():
        for sname, r in w["systems"].items():
            sp = w.get(f"speedup_vs_{sname}")
            tgt = targets.get((wname, sname))
            per = w.get(f"speedup_vs_{sname}_per_round")
            verdict = ""
            if tgt:
                verdict = f">= {tgt}x {'met' if sp and sp >= tgt else 'NOT met'}"
                if per:
                    verdict += f" (per round: {', '.join(f'{x:.2f}x' for x in per)})"
            t.add_row(wname, str(w["requests"]), sname, f"{r['wall_s']:.1f}" if r["wall_s"] else "-",
                      f"{r['output_tokens_per_s']:.1f}" if r["output_tokens_per_s"] else "-",
                      f"{sp:.2f}x" if sp else "", verdict)
    Console().print(t)


if __name__ == "__main__":
    sys.exit(main())
