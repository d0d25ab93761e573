"""Allocator speed: one continuous-batching operation trace replayed through pagedkv's Python
API, vLLM's V1 KV cache manager (with its block pool) and nano-vllm's block manager, on the same
machine in the same run.

The trace (see ``op_trace.py``): real request lengths (Mooncake conversation trace by default,
whose hash ids give real prefix sharing; or the Azure traces), Poisson arrivals, about
``--max-running`` (256) running sequences, whole-prompt prefill, one decode token per running
sequence per step, prefix caching on in every system, block size 16, a pool large enough that
nothing is preempted. Each system is replayed in its own subprocess (its own Python
environment) on a fresh manager, ``--repeats`` times; the fastest run is reported.

Reported: µs per scheduler step (everything the system does for the step, see
``replay_common.py``) and ns per block operation, where the block operations of the trace are
counted once, identically for every system (each block of each request obtained once and
released once), so the per-op ratio equals the total-time ratio.

Usage:
  python benchmarks/allocator_speed.py --vllm-python /work/venvs/vllm/bin/python \\
      --nanovllm-path /work/ext/nano-vllm [--nanovllm-python PY] [--trace mooncake] [--steps 400]
A baseline whose location is not given (or does not import) is skipped, and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import op_trace  # noqa: E402

HERE = Path(__file__).resolve().parent


def run_replay(script: str, python: str, trace_file: Path, repeats: int, extra: list[str],
               timeout: float) -> dict[str, Any]:
    """Run one replay subprocess; returns its result dict, or ``{"skipped": reason}``."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [python, str(HERE / script), "--trace-file", str(trace_file), "--out", str(out),
           "--repeats", str(repeats), *extra]
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"skipped": f"timed out after {timeout:.0f} s"}
    except OSError as e:
        return {"skipped": f"could not start {python}: {e}"}
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-6:]
        return {"skipped": f"exit {p.returncode}: " + " | ".join(tail)}
    res = json.loads(out.read_text())
    out.unlink(missing_ok=True)
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="mooncake", choices=["mooncake", "azure_conv", "azure_code"])
    ap.add_argument("--traces-dir", default=None, help="folder with the full traces (default: bundled excerpts)")
    ap.add_argument("--steps", type=int, default=400, help="scheduler steps in the trace")
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="runs per system for pagedkv (best is kept)")
    ap.add_argument("--baseline-repeats", type=int, default=1, help="runs per baseline system")
    ap.add_argument("--vllm-python", default=None, help="python of an environment with vllm installed")
    ap.add_argument("--nanovllm-path", default=None, help="nano-vllm checkout (outside this repo)")
    ap.add_argument("--nanovllm-python", default=sys.executable,
                    help="python with numpy and xxhash for the nano-vllm replay (default: this one)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per replay subprocess")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="fewer steps (for run_all)")
    ap.add_argument("--results-dir", default=str(common.RESULTS_DIR))
    a = ap.parse_args(argv)
    if a.quick:
        a.steps = min(a.steps, 250)
    w = common.load_workload(a.trace, a.traces_dir)
    trace = op_trace.build(w, num_steps=a.steps, block_size=a.block_size, max_running=a.max_running, seed=a.seed)
    tdir = Path(tempfile.mkdtemp(prefix="pagedkv-bench-"))
    trace_file = tdir / "op_trace.json"
    trace.save(trace_file)
    systems: list[tuple[str, str | None, str, list[str], int]] = [
        ("pagedkv (sha256)", sys.executable, "replay_pagedkv.py", ["--hash-algo", "sha256"], a.repeats),
        ("pagedkv (xxh3_128)", sys.executable, "replay_pagedkv.py", ["--hash-algo", "xxh3_128"], a.repeats),
        ("vLLM V1 KVCacheManager", a.vllm_python, "replay_vllm.py", [], a.baseline_repeats),
        ("nano-vllm BlockManager", a.nanovllm_python if a.nanovllm_path else None, "replay_nanovllm.py",
         ["--lib-path", a.nanovllm_path] if a.nanovllm_path else [], a.baseline_repeats),
    ]
    results: dict[str, dict[str, Any]] = {}
    bar = common.progress(total=len(systems), desc="allocator replays")
    for label, python, script, extra, reps in systems:
        bar.set_postfix_str(label)
        if python is None:
            what = "--vllm-python" if "vLLM" in label else "--nanovllm-path"
            results[label] = {"skipped": f"not measured: {what} not given"}
        else:
            results[label] = run_replay(script, python, trace_file, reps, extra, a.timeout)
        if "skipped" in results[label]:
            print(f"{label}: skipped ({results[label]['skipped']})", file=sys.stderr)
        bar.update(1)
    bar.close()
    ref = results["pagedkv (sha256)"].get("best")
    rows = []
    for label, r in results.items():
        if "skipped" in r:
            rows.append([label, None, None, None, None, None, None, "skipped: " + r["skipped"][:120]])
            continue
        b = r["best"]
        ratio = b["ns_per_block_op"] / ref["ns_per_block_op"] if ref else None
        v = r["version"]
        ver = v.get("version") or v.get("commit", "")[:12]
        rows.append([label, b["us_per_step_mean"], b["us_per_step_p50"], b["us_per_step_p99"],
                     b["ns_per_block_op"], ratio, r["counters"].get("cached_prompt_tokens"),
                     f"{ver} hash={v.get('hash')}"])
    common.print_table(
        f"Allocator speed: {trace.num_steps} steps of the {trace.workload} trace, "
        f"{trace.mean_running:.0f} running seqs on average, {trace.block_ops:,} block ops, block size {trace.block_size}",
        ["system", "µs/step mean", "µs/step p50", "µs/step p99", "ns/block op", "x slower than pagedkv",
         "cached prompt tokens", "version / hash"],
        rows,
        footnote="Same trace, same machine, same run; each system in its own subprocess; best of the repeats. "
                 "Target: vLLM's block pool >= 20x pagedkv's ns/block op.",
    )
    payload = {
        "description": __doc__.split("\n\n")[0],
        "trace": {"workload": w.describe(), "steps": trace.num_steps, "requests": len(trace.prompt_lens),
                  "block_ops": trace.block_ops, "mean_running": trace.mean_running,
                  "max_running": trace.max_running, "block_size": trace.block_size,
                  "pool_blocks": trace.num_blocks, "arrival_rate_per_step": trace.arrival_rate_per_step,
                  "seed": trace.seed},
        "results": results,
        "ratios_vs_pagedkv_sha256": {
            k: r["best"]["ns_per_block_op"] / ref["ns_per_block_op"]
            for k, r in results.items() if "best" in r and ref
        },
    }
    path = common.write_json("allocator_speed", payload, Path(a.results_dir))
    png = plot(results, Path(a.results_dir) / "allocator_speed.png", payload["trace"])
    print(f"wrote {path} and {png}")
    return payload


def plot(results: dict[str, dict[str, Any]], path: Path, tr: dict[str, Any]) -> Path:
    """Bar charts (log scale): ns per block op and µs per step, per system."""
    plt = common.pyplot()
    done = [(k, r["best"]) for k, r in results.items() if "best" in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = [k.replace(" KVCacheManager", "\nKVCacheManager").replace(" BlockManager", "\nBlockManager") for k, _ in done]
    colors = ["#1971c2", "#4dabf7", "#e8590c", "#2f9e44"][: len(done)]
    for ax, key, title in ((axes[0], "ns_per_block_op", "ns per block operation"),
                           (axes[1], "us_per_step_mean", "µs per scheduler step (mean)")):
        vals = [b[key] for _, b in done]
        ax.bar(range(len(done)), vals, color=colors)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(done)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(title)
    fig.suptitle(f"{tr['steps']} steps, {tr['workload']['name']} trace, ~{tr['mean_running']:.0f} running seqs, "
                 f"block size {tr['block_size']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
