"""How fast can ANY engine run the trace workload of ``engine_throughput.py`` on this CPU?

A GEMM floor for SmolLM2-135M in fp32 with torch's CPU GEMM (MKL), so the targets there can be
checked against what the hardware allows rather than against each other.

Measured: ``t(M)``, the wall time of one pass of M tokens through every linear layer of the
model, and ``h(M)``, the LM head for M tokens, with the pagedkv engine's own weights and GEMM:
the tensors its model multiplies (fused QKV, output, fused gate/up, down projections of all
layers and the LM head, stored ``[in, out]`` with the RMSNorm weights folded in) through its
``pagedkv.engine.models.model.linear`` (1 torch thread). MKL runs that layout 1.1-1.45x faster than
``F.linear``'s ``[out, in]`` at decode sizes, so a floor measured with ``F.linear`` would not be a
floor for the engine; that table is still measured once and printed as a reference. ``t`` and
``h`` are measured at every M the staged schedule below uses (MKL's cost is not monotone in M:
with ``F.linear``, M = 12 cost 22% more than the straight line between M = 8 and 16 that an
interpolated table assumed) and at powers of two up to 1024 for the plot. A pass streams
~540 MB of weights, so small M is bound by memory bandwidth and large M by FMA throughput
(``t(M)/M`` falls until the GEMMs become compute bound).

From these, for the trace workloads (prompt and output lengths of the Azure conversation trace,
as in ``engine_throughput.py``: ``trace``, 16 requests, and ``trace-large``, 64 requests, where
continuous batching matters more; every request arrives at t = 0):

- ``compute floor``: every token at the best per-token cost seen at any M, plus one LM-head row
  per output token at its best per-token cost. No schedule of these GEMMs can beat it (it ignores
  attention, norms, sampling and the fact that each request's decode tokens are sequential).
- ``pass floor``: tighter and still schedule-free: the longest request needs one forward pass
  per output token (its decode steps are sequential), and a pass costs at least ``t(1)`` plus
  the best marginal cost ``max(0, min (t(M) - t(1)) / (M - 1))`` per further token (same for
  the LM head; clamped at 0, which a noisy ``t(1)`` above ``t(2)`` used to drive negative).
- ``staged schedule``: what a continuous-batching engine with a token budget does here (and what
  both pagedkv and transformers' ``generate_batch`` do): the prompts in budget-sized chunked-
  prefill steps, then decode steps whose batch is the number of requests still generating,
  costed with the measured ``t(M) + h(M)`` at exactly those M.

The engine against its floor, in one process: ``--engine-rounds`` (2) rounds of the pagedkv
engine on every workload (the runner of ``engine_throughput.py``), with a GEMM table measured
before the first round and after each; a round's ``engine share of floor`` is its staged-
schedule GEMM time (from the mean of the tables just before and after it) divided by its engine
wall (target >= 90%), so the load of a shared machine hits both sides of the ratio alike; the
1-minute load average is recorded next to each. Each engine run also times its own GEMM calls
(``pagedkv.engine.models.model.linear``; the output and down projections there also accumulate the
residual add, which the table's plain products leave out): their share of its wall is what the
floor ratio would be if the engine's GEMMs cost exactly the table's, and it moves far less with
the load than walls measured minutes apart.

The floors printed use the best GEMM time per M over the tables. Also prints the walls of
``benchmarks/results/engine_throughput.json`` (if present, trace workload) and the wall a given
speedup over transformers' ``generate_batch`` would need, and plots GEMM cost per token against
M to ``benchmarks/results/engine_roofline.png``.

Usage: python benchmarks/engine_roofline.py [--threads 1] [--max-tokens-per-step 1024]
       [--workloads trace,trace-large] [--engine-rounds 2]
       [--trace-requests 16 --large-trace-requests 64 --trace-scale 0.25 --max-prompt 256 --max-output 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from engine_throughput import RESULTS as THROUGHPUT_JSON  # noqa: E402
from engine_throughput import trace_workload  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


# A GEMM of the table: (x [M, in], weight) -> [M, out], and the in-features of a weight.
Gemm = tuple[Any, Any]


def engine_gemm(hf: Any) -> tuple[list[torch.Tensor], torch.Tensor, Gemm]:
    """The projections and LM head exactly as the pagedkv engine's model stores and multiplies
    them (fp32 ``[in_features, out_features]``, QKV and gate/up fused, norm weights folded in,
    built by the engine's own constructor), and its GEMM ``pagedkv.engine.models.model.linear``."""
    from pagedkv.engine.models import model as engine_model

    m = engine_model.LlamaForCausalLM.from_hf(hf, device="cpu", dtype=torch.float32)
    ws = [w for layer in m.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert m.lm_head_t is not None  # the CPU model always keeps a transposed LM head
    return ws, m.lm_head_t, (engine_model.linear, lambda w: w.shape[0])


def f_linear_gemm(hf: Any) -> tuple[list[torch.Tensor], torch.Tensor, Gemm]:
    """The same fused projections in ``nn.Linear``'s ``[out_features, in_features]`` layout
    through ``F.linear`` (what the floor used before the engine changed layout; a reference)."""
    ws: list[torch.Tensor] = []
    for layer in hf.model.layers:
        a, m = layer.self_attn, layer.mlp
        ws.append(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().float().contiguous())
        ws.append(a.o_proj.weight.detach().float().contiguous())
        ws.append(torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach().float().contiguous())
        ws.append(m.down_proj.weight.detach().float().contiguous())
    head = hf.lm_head.weight.detach().float().contiguous()
    return ws, head, (torch.nn.functional.linear, lambda w: w.shape[1])


def best_time(fn: Any, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(
    ws: list[torch.Tensor], head: torch.Tensor, gemm: Gemm, sizes: list[int], verbose: bool = True
) -> dict[int, tuple[float, float]]:
    """{M: (t(M) s, h(M) s)}: best-of-3 wall of all layer GEMMs and of the LM head."""
    mm, in_features = gemm
    out = {}
    for m in sizes:
        xs = {k: torch.randn(m, k) for k in {in_features(w) for w in ws}}
        t = best_time(lambda xs=xs: [mm(xs[in_features(w)], w) for w in ws], 3)
        h = best_time(lambda xs=xs: mm(xs[in_features(head)], head), 3)
        out[m] = (t, h)
        if verbose:
            print(
                f"  M={m:5d}: layers {t * 1e3:8.1f} ms  ({t / m * 1e3:6.2f} ms/token)   LM head {h * 1e3:7.1f} ms",
                file=sys.stderr,
                flush=True,
            )
    return out


def schedule_sizes(prompts: list[int], outputs: list[int], budget: int) -> set[int]:
    """Every M at which :func:`staged_schedule` costs a GEMM pass or an LM head."""
    sizes = {len(prompts)}
    left = sum(prompts)
    while left > 0:
        sizes.add(min(budget, left))
        left -= budget
    sizes |= {sum(1 for o in outputs if o > k) for k in range(1, max(outputs))}
    return sizes - {0}


def interp(table: dict[int, tuple[float, float]], m: int, which: int) -> float:
    ms = sorted(table)
    return float(np.interp(m, ms, [table[k][which] for k in ms]))


def staged_schedule(
    prompts: list[int], outputs: list[int], budget: int, table: dict[int, tuple[float, float]]
) -> tuple[float, int]:
    """GEMM time and step count of chunked prefill in budget-sized steps, then batched decode.
    The first output token of a request comes from its last prefill chunk."""
    total_prompt = sum(prompts)
    t = 0.0
    steps = 0
    left = total_prompt
    while left > 0:
        m = min(budget, left)
        t += interp(table, m, 0)
        left -= m
        steps += 1
    t += interp(table, len(prompts), 1)  # LM head rows of the first output tokens
    for k in range(1, max(outputs)):
        batch = sum(1 for o in outputs if o > k)
        t += interp(table, batch, 0) + interp(table, batch, 1)
        steps += 1
    return t, steps


def engine_run(hf: Any, tok: Any, work: list[tuple[list[int], int]], a: argparse.Namespace) -> tuple[float, float]:
    """Wall of the pagedkv engine on ``work`` and the time its GEMM calls
    (``pagedkv.engine.models.model.linear``) took inside that wall (timed per call; the share GEMMs
    have of the wall, measured under the same load)."""
    from engine_throughput import run_pagedkv

    from pagedkv.engine.models import model as engine_model

    spent = [0.0]

    def timed(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> torch.Tensor:
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[0] += time.perf_counter() - t
            return out

        return run

    # The engine's model looks both up at call time: its own linear() for every GEMM on the
    # CPU, F.linear only for a tied LM head off the CPU.
    saved = engine_model.linear, torch.nn.functional.linear
    engine_model.linear, torch.nn.functional.linear = timed(saved[0]), timed(saved[1])
    try:
        wall = run_pagedkv(hf, tok, work, a, on_start=lambda: spent.__setitem__(0, 0.0))["wall_s"]
    finally:
        engine_model.linear, torch.nn.functional.linear = saved
    return wall, spent[0]


def floors(
    prompts: list[int], outputs: list[int], budget: int, table: dict[int, tuple[float, float]]
) -> dict[str, float]:
    """The three GEMM floors of a workload from one GEMM table (see the module docs), seconds."""
    best_tok = min(t / m for m, (t, _) in table.items())
    best_head = min(h / m for m, (_, h) in table.items())
    staged, steps = staged_schedule(prompts, outputs, budget, table)
    passes = max(outputs)
    t1, h1 = table[1]
    marg = max(0.0, min((t - t1) / (m - 1) for m, (t, _) in table.items() if m > 1))
    marg_head = max(0.0, min((h - h1) / (m - 1) for m, (_, h) in table.items() if m > 1))
    total = sum(prompts) + sum(outputs)
    return {
        "compute_floor_s": (sum(prompts) + sum(outputs)) * best_tok + sum(outputs) * best_head,
        "pass_floor_s": passes * t1 + (total - passes) * marg + passes * h1 + (sum(outputs) - passes) * marg_head,
        "staged_schedule_gemm_s": staged,
        "staged_steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens-per-step", type=int, default=1024)
    ap.add_argument("--trace-requests", type=int, default=16)
    ap.add_argument("--large-trace-requests", type=int, default=64, help="requests of the trace-large workload")
    ap.add_argument("--trace-scale", type=float, default=0.25)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--workloads", default="trace,trace-large", help="comma-separated: trace, trace-large")
    ap.add_argument(
        "--engine-rounds",
        type=int,
        default=2,
        help="rounds of the pagedkv engine on every workload in this process, a GEMM table measured "
        "before the first and after each; a round's engine wall is divided by the floor from the "
        "tables around it (0: floors only, one table)",
    )
    ap.add_argument("--kv-blocks", type=int, default=1024, help="engine KV blocks (as engine_throughput.py)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--output", type=Path, default=RESULTS / "engine_roofline.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from pagedkv.engine.models.loader import load_hf_model

    hf, tok = load_hf_model()
    ws, head, engine_mm = engine_gemm(hf)
    weight_mb = (sum(w.numel() for w in ws) + head.numel()) * 4 / 1e6
    sizes = {"trace": a.trace_requests, "trace-large": a.large_trace_requests}
    works = {
        w: trace_workload(sizes[w], a.trace_scale, a.max_prompt, a.max_output, hf.config.vocab_size)
        for w in a.workloads.split(",")
    }
    table_sizes = set(SIZES)
    for work in works.values():
        table_sizes |= schedule_sizes([len(p) for p, _ in work], [o for _, o in work], a.max_tokens_per_step)
    all_sizes = sorted(table_sizes)
    rounds: list[dict[str, Any]] = []

    def table_now(label: str) -> dict[int, tuple[float, float]]:
        print(
            f"{label}: measuring the engine's GEMM passes at {len(all_sizes)} sizes ({weight_mb:.0f} MB of "
            f"fp32 weights, {a.threads} thread(s)) ...",
            file=sys.stderr,
        )
        return measure(ws, head, engine_mm, all_sizes, verbose=False)

    print(
        "reference: F.linear with [out, in] weights (the layout before the engine's), powers of two ...",
        file=sys.stderr,
    )
    f_ws, f_head, f_gemm = f_linear_gemm(hf)
    f_linear_table = measure(f_ws, f_head, f_gemm, SIZES)
    del f_ws, f_head
    tables = [table_now("before round 1")]
    for rnd in range(max(1, a.engine_rounds)):
        walls: dict[str, tuple[float, list[float]]] = {}
        if a.engine_rounds > 0:
            for wname, work in works.items():
                load = os.getloadavg()[0]
                print(f"round {rnd + 1}: pagedkv engine on {wname} ({len(work)} requests) ...", file=sys.stderr)
                wall, gemm = engine_run(hf, tok, work, a)
                walls[wname] = (wall, gemm, [load, os.getloadavg()[0]])
            tables.append(table_now(f"after round {rnd + 1}"))
        # The floor of a round: GEMM times averaged over the tables measured just before and just
        # after its engine runs, so a load that drifts during the round hits both sides alike.
        before, after = tables[-2] if walls else tables[-1], tables[-1]
        table = {m: ((before[m][0] + after[m][0]) / 2, (before[m][1] + after[m][1]) / 2) for m in all_sizes}
        entry: dict[str, Any] = {}
        for wname, work in works.items():
            prompts, outputs = [len(p) for p, _ in work], [o for _, o in work]
            f = floors(prompts, outputs, a.max_tokens_per_step, table)
            if wname in walls:
                wall, gemm, load_avg = walls[wname]
                f |= {
                    "engine_wall_s": wall,
                    "engine_share_of_floor": f["staged_schedule_gemm_s"] / wall,
                    "engine_gemm_s": gemm,
                    "engine_gemm_share": gemm / wall,
                    "load_1min": load_avg,
                }
                print(
                    f"  {wname}: engine {wall:.1f} s against a staged GEMM floor of "
                    f"{f['staged_schedule_gemm_s']:.1f} s: {f['engine_share_of_floor']:.0%} of the floor; "
                    f"its own GEMMs {gemm:.1f} s = {gemm / wall:.0%} of its wall (load {load_avg[0]:.1f})",
                    file=sys.stderr,
                )
            entry[wname] = f
        rounds.append(entry)

    # Floors from the best GEMM time seen at each M over the rounds; engine figures per round.
    best = {m: (min(t[m][0] for t in tables), min(t[m][1] for t in tables)) for m in all_sizes}
    measured: dict[str, float] = {}
    if THROUGHPUT_JSON.exists() and "trace" in works:
        tr = json.loads(THROUGHPUT_JSON.read_text()).get("workloads", {}).get("trace", {})
        same = tr.get("prompt_tokens") == sum(len(p) for p, _ in works["trace"])
        if tr.get("requests") == len(works["trace"]) and same:
            measured = {k: v["wall_s"] for k, v in tr.get("systems", {}).items() if v.get("wall_s")}
    out: dict[str, Any] = {
        "benchmark": "engine_roofline",
        "threads": a.threads,
        "weights_mb": weight_mb,
        "gemm": "pagedkv.engine.models.model.linear, [in, out] weights",
        "gemm_pass_s": {str(m): {"layers": t, "lm_head": h} for m, (t, h) in best.items()},
        "f_linear_gemm_pass_s": {str(m): {"layers": t, "lm_head": h} for m, (t, h) in f_linear_table.items()},
        "workloads": {},
        "rounds": rounds,
    }
    md_parts = []
    for wname, work in works.items():
        prompts, outputs = [len(p) for p, _ in work], [o for _, o in work]
        f = floors(prompts, outputs, a.max_tokens_per_step, best)
        w: dict[str, Any] = {"requests": len(work), "prompt_tokens": sum(prompts), "output_tokens": sum(outputs), **f}
        if a.engine_rounds > 0:
            per = [r[wname] for r in rounds]
            # Medians, not the best round: a round whose load fell between its tables and its
            # engine run can show any share, even over 100%.
            w |= {
                "engine_walls_s": [r["engine_wall_s"] for r in per],
                "engine_gemm_share_per_round": [r["engine_gemm_share"] for r in per],
                "engine_share_of_floor_per_round": [r["engine_share_of_floor"] for r in per],
                "engine_share_of_floor": statistics.median(r["engine_share_of_floor"] for r in per),
                "engine_gemm_share": statistics.median(r["engine_gemm_share"] for r in per),
                "load_1min_per_round": [r["load_1min"] for r in per],
            }
        out["workloads"][wname] = w
        print(
            f"\n{wname} workload: {len(work)} requests, {sum(prompts)} prompt + {sum(outputs)} output tokens; "
            f"token budget {a.max_tokens_per_step}"
        )
        f_old = staged_schedule(prompts, outputs, a.max_tokens_per_step, f_linear_table)[0]
        w["f_linear_staged_schedule_gemm_s"] = f_old
        rows = [
            ("GEMM compute floor (any schedule)", f["compute_floor_s"]),
            (f"GEMM pass floor ({max(outputs)} sequential passes)", f["pass_floor_s"]),
            (f"GEMM time of the staged schedule ({f['staged_steps']} steps)", f["staged_schedule_gemm_s"]),
            ("  F.linear [out, in] (reference: 1 table, powers of 2)", f_old),
        ]
        if wname == "trace":
            rows += [(f"measured: {k} (engine_throughput.json)", v) for k, v in measured.items()]
        print(f"{'':52} {'wall s':>8} {'out tok/s':>10}")
        for name, wall in rows:
            print(f"{name:52} {wall:8.1f} {sum(outputs) / wall:10.1f}")
        md = [
            f"**{wname}** ({len(work)} requests, {sum(prompts)} prompt + {sum(outputs)} output tokens)",
            "",
            "| wall | s | output tokens/s |",
            "|---|---:|---:|",
        ]
        md += [f"| {name} | {wall:.1f} | {sum(outputs) / wall:.1f} |" for name, wall in rows]
        if a.engine_rounds > 0:
            runs = ", ".join(
                f"{r['engine_wall_s']:.1f} s vs floor {r['staged_schedule_gemm_s']:.1f} s = "
                f"{r['engine_share_of_floor']:.0%}, own GEMMs {r['engine_gemm_share']:.0%} of the wall "
                f"(load {r['load_1min'][0]:.1f})"
                for r in per
            )
            line = (
                f"pagedkv engine in the same process, per round: {runs}; median "
                f"{w['engine_share_of_floor']:.0%} of the staged GEMM floor (target >= 90%), its own GEMMs "
                f"a median {w['engine_gemm_share']:.0%} of its wall"
            )
            print(line)
            md += ["", line]
        md_parts.append("\n".join(md))
        if wname == "trace":  # the trace figures stay at the top level, as before
            out |= {
                "trace": {k: w[k] for k in ("requests", "prompt_tokens", "output_tokens")},
                **f,
                "measured_walls_s": measured,
            }
            cb = measured.get("hf-cb")
            if cb:
                for x in (1.5, 3.0):
                    out[f"{x}x_hf_cb_needs_wall_s"] = cb / x
                    print(f"{x}x transformers generate_batch needs a wall of {cb / x:.1f} s")
    out["summary_markdown"] = (
        f"GEMM floors of SmolLM2-135M fp32 on this CPU with the engine's own GEMM and weights ({a.threads} torch "
        f"thread(s), best GEMM time per M over {len(tables)} table(s), measured at every M of the schedule); any "
        "engine's wall is at least a GEMM floor plus attention, norms and sampling. "
        "The pagedkv engine runs in the same process, in rounds with a GEMM table measured before the first and "
        "after each: engine share of floor = staged-schedule GEMM time (tables around the round) / engine wall."
        "\n\n"
        + "\n\n".join(md_parts)
        + "\n\n![GEMM cost per token](engine_roofline.png)\n\nReproduce: `python benchmarks/engine_roofline.py`"
    )
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(out, indent=2))
    _plot(best, f_linear_table, a.output.with_suffix(".png"), a.threads)
    print(f"wrote {a.output} and {a.output.with_suffix('.png')}", file=sys.stderr)
    return 0


def _plot(
    table: dict[int, tuple[float, float]], reference: dict[int, tuple[float, float]], path: Path, threads: int
) -> None:
    plt = common.pyplot()
    ms = sorted(table)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(ms, [table[m][0] / m * 1e3 for m in ms], marker="o", label="all layer linears")
    ax.plot(ms, [table[m][1] / m * 1e3 for m in ms], marker="s", label="LM head")
    rs = sorted(reference)
    ax.plot(
        rs,
        [reference[m][0] / m * 1e3 for m in rs],
        ls="--",
        color="gray",
        label="all layer linears, F.linear [out, in] (reference)",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per forward pass (M)")
    ax.set_ylabel("ms per token")
    ax.set_title(f"SmolLM2-135M fp32 GEMM cost per token, engine's GEMM, {threads} CPU thread(s)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
