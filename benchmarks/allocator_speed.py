"""Allocator speed: one continuous-batching operation trace replayed through pagedkv's Python
API, vLLM's V1 KV cache manager (with its block pool) and nano-vllm's block manager, on the same
machine in the same run.

The trace (see ``op_trace.py``): real request lengths (by default both the Mooncake conversation
trace, whose hash ids give real prefix sharing and long prompts, and the Azure conversation
trace, no sharing and ~1.2k-token prompts), Poisson arrivals, about
``--max-running`` (256) running sequences, whole-prompt prefill, one decode token per running
sequence per step, prefix caching on in every system, block size 16, a pool large enough that
nothing is preempted. Each system is replayed in its own subprocess (its own Python
environment) on a fresh manager, ``--repeats`` times; the fastest run is reported.

Also the bare block pools (``pagedkv.BlockPool`` vs vLLM's ``BlockPool`` with caching off) on
the same trace's block traffic: one allocate per admitted request, one batched allocate for the
decodes that start a block, one free per finished request (``replay_common.run_pool``).

What pagedkv's manager row computes per step is what vLLM's KV cache manager returns: each
sequence's new block ids (plus lengths and block-table deltas); vLLM's model runner builds the
per-token slot mapping on the GPU from its block tables. The row "+ per-token arrays" is the same
replay with steps that also write the kernel-ready per-token slot mapping and input ids
(``step(..., token_arrays=True)``, pagedkv's engine path; 16 bytes per scheduled token).

Reported: µs per scheduler step (everything the system does for the step, see
``replay_common.py``) and ns per block operation, where the block operations of the trace are
counted once, identically for every system (each block of each request obtained once and
released once), so the per-op ratio equals the total-time ratio.

Usage:
  python benchmarks/allocator_speed.py --vllm-python ~/venvs/vllm/bin/python \\
      --nanovllm-path ~/src/nano-vllm [--nanovllm-python PY] [--traces mooncake azure_conv]
      [--steps 400]
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
RUST_MANAGER = "core alone, Rust (sha256)"
#: pagedkv's manager whose steps also write the per-token slot mapping and input ids.
WITH_TOKEN_ARRAYS = "pagedkv (sha256) + per-token arrays"
RUST_POOL = "core BlockPool, Rust"


def run_replay(
    script: str, python: str, trace_file: Path, repeats: int, extra: list[str], timeout: float
) -> dict[str, Any]:
    """Run one replay subprocess; returns its result dict, or ``{"skipped": reason}``."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [
        python,
        str(HERE / script),
        "--trace-file",
        str(trace_file),
        "--out",
        str(out),
        "--repeats",
        str(repeats),
        *extra,
    ]
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


def build_rust_replay() -> tuple[str | None, str]:
    """Build the core's trace replay (``rust/core/examples/replay.rs``) in release mode.
    Returns ``(path, "")`` or ``(None, why)`` when cargo is missing or the build fails."""
    cmd = ["cargo", "build", "--release", "-p", "pagedkv-core", "--example", "replay", "--message-format=short"]
    try:
        p = subprocess.run(cmd, cwd=common.REPO_DIR, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"cargo build failed: {e}"
    if p.returncode != 0:
        return None, "cargo build failed: " + " | ".join(p.stderr.strip().splitlines()[-3:])
    target = Path(os.environ.get("CARGO_TARGET_DIR", Path(common.REPO_DIR) / "target"))
    return str(target / "release" / "examples" / "replay"), ""


def run_rust_replay(
    binary: str, trace_file: Path, tokens_file: Path, repeats: int, extra: list[str], timeout: float
) -> dict[str, Any]:
    """Run the Rust replay of the same trace; returns its result dict or ``{"skipped": reason}``."""
    cmd = [binary, str(trace_file), str(tokens_file), "--repeats", str(repeats), *extra]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"skipped": f"rust replay: {e}"}
    if p.returncode != 0:
        return {"skipped": f"exit {p.returncode}: " + " | ".join(p.stderr.strip().splitlines()[-4:])}
    res = json.loads(p.stdout)
    b = res["best"]
    # Fields the Python replays report and the Rust one has no use for.
    b.setdefault("us_per_step_p50", None)
    b.setdefault("us_per_step_p99", None)
    res["version"] = {"version": "core alone", "hash": res.get("hash")}
    return res


def measure_trace(a: argparse.Namespace, name: str) -> dict[str, Any]:
    """Build the operation trace of workload ``name`` and replay it through every system."""
    w = common.load_workload(name, a.traces_dir)
    trace = op_trace.build(w, num_steps=a.steps, block_size=a.block_size, max_running=a.max_running, seed=a.seed)
    tdir = Path(tempfile.mkdtemp(prefix="pagedkv-bench-"))
    trace_file = tdir / "op_trace.json"
    tokens_file = tdir / "op_trace.tokens.bin"
    trace.save(trace_file)
    trace.save_tokens(tokens_file)
    systems: list[tuple[str, str | None, str, list[str], int]] = [
        ("pagedkv (sha256)", sys.executable, "replay_pagedkv.py", ["--hash-algo", "sha256"], a.repeats),
        ("pagedkv (xxh3_128)", sys.executable, "replay_pagedkv.py", ["--hash-algo", "xxh3_128"], a.repeats),
        (
            WITH_TOKEN_ARRAYS,
            sys.executable,
            "replay_pagedkv.py",
            ["--hash-algo", "sha256", "--token-arrays"],
            a.repeats,
        ),
        ("vLLM V1 KVCacheManager", a.vllm_python, "replay_vllm.py", [], a.baseline_repeats),
        (
            "nano-vllm BlockManager",
            a.nanovllm_python if a.nanovllm_path else None,
            "replay_nanovllm.py",
            ["--lib-path", a.nanovllm_path] if a.nanovllm_path else [],
            a.baseline_repeats,
        ),
        # The bare block pools on the same trace's block traffic (no hashing, no sequences).
        ("pagedkv BlockPool", sys.executable, "replay_pagedkv.py", ["--mode", "pool"], a.repeats),
        ("vLLM BlockPool", a.vllm_python, "replay_vllm.py", ["--mode", "pool"], a.baseline_repeats),
        # The same trace through the Rust core alone (no Python): the floor of the two pagedkv rows.
        (RUST_MANAGER, a.rust_replay, "", ["--hash-algo", "sha256"], a.repeats),
        (RUST_POOL, a.rust_replay, "", ["--mode", "pool"], a.repeats),
    ]
    results: dict[str, dict[str, Any]] = {}
    bar = common.progress(total=len(systems), desc=f"allocator replays ({name})")
    for label, python, script, extra, reps in systems:
        bar.set_postfix_str(label)
        if python is None:
            what = "--vllm-python" if "vLLM" in label else "--nanovllm-path"
            results[label] = {"skipped": f"not measured: {what} not given"}
        elif label in (RUST_MANAGER, RUST_POOL):
            results[label] = run_rust_replay(python, trace_file, tokens_file, reps, extra, a.timeout)
        else:
            results[label] = run_replay(script, python, trace_file, reps, extra, a.timeout)
        if "skipped" in results[label]:
            print(f"{label}: skipped ({results[label]['skipped']})", file=sys.stderr)
        bar.update(1)
    bar.close()
    trace_file.unlink(missing_ok=True)
    tokens_file.unlink(missing_ok=True)
    tdir.rmdir()
    refs = {"manager": results["pagedkv (sha256)"].get("best"), "pool": results["pagedkv BlockPool"].get("best")}

    def ref_of(label: str) -> dict[str, Any] | None:
        return refs["pool" if "BlockPool" in label else "manager"]

    rows = []
    for label, r in results.items():
        if "skipped" in r:
            rows.append([label, None, None, None, None, None, None, None, "skipped: " + r["skipped"][:120]])
            continue
        b = r["best"]
        ref = ref_of(label)
        ratio = b["ns_per_block_op"] / ref["ns_per_block_op"] if ref else None
        v = r["version"]
        ver = v.get("version") or (v.get("commit") or "")[:12]
        rows.append(
            [
                label,
                b["us_per_step_mean"],
                b["us_per_step_p50"],
                b["us_per_step_p99"],
                b["ns_per_block_op"],
                ratio,
                b["wall_ns_per_block_op"],
                r["counters"].get("cached_prompt_tokens"),
                f"{ver} hash={v.get('hash')}",
            ]
        )
    common.print_table(
        f"Allocator speed: {trace.num_steps} steps of the {trace.workload} trace, "
        f"{trace.mean_running:.0f} running seqs on average, {trace.block_ops:,} block ops, "
        f"block size {trace.block_size}",
        [
            "system",
            "CPU µs/step mean",
            "µs/step p50",
            "µs/step p99",
            "CPU ns/block op",
            "x pagedkv",
            "wall ns/block op",
            "cached prompt tokens",
            "version / hash",
        ],
        rows,
        footnote="Same trace, same machine, same run; each system in its own subprocess; best of the repeats. "
        "CPU = thread CPU time (robust on a shared machine); wall = elapsed. 'x pagedkv': against "
        "pagedkv (sha256) for managers, against pagedkv BlockPool for the bare pools. pagedkv's "
        "manager rows return block ids and table deltas (what vLLM's KV cache manager returns); "
        "'+ per-token arrays' also writes the per-token slot mapping and input ids. "
        "The 'Rust' rows replay the same trace through the core with no Python "
        "(rust/core/examples/replay.rs). Targets: vLLM >= 20x and nano-vllm >= 5x pagedkv's ns per "
        "block op; vLLM BlockPool >= 5x pagedkv BlockPool; Python <= 2x Rust.",
    )
    python_over_rust = {}
    for py_label, rust_label in (("pagedkv (sha256)", RUST_MANAGER), ("pagedkv BlockPool", RUST_POOL)):
        if "best" in results[py_label] and "best" in results[rust_label]:
            python_over_rust[py_label] = (
                results[py_label]["best"]["ns_per_block_op"] / results[rust_label]["best"]["ns_per_block_op"]
            )
    if python_over_rust:
        print(
            "Through Python / Rust core alone (ns per block op): "
            + ", ".join(f"{k} {v:.2f}x" for k, v in python_over_rust.items())
            + "  (target <= 2x)"
        )
    return {
        "python_over_rust": python_over_rust,
        "trace": {
            "workload": w.describe(),
            "steps": trace.num_steps,
            "requests": len(trace.prompt_lens),
            "block_ops": trace.block_ops,
            "mean_running": trace.mean_running,
            "max_running": trace.max_running,
            "block_size": trace.block_size,
            "pool_blocks": trace.num_blocks,
            "arrival_rate_per_step": trace.arrival_rate_per_step,
            "seed": trace.seed,
        },
        "results": results,
        "ratios_vs_pagedkv_sha256": {
            k: r["best"]["ns_per_block_op"] / ref_of(k)["ns_per_block_op"]
            for k, r in results.items()
            if "best" in r and ref_of(k)
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--traces",
        nargs="+",
        default=["mooncake", "azure_conv"],
        choices=["mooncake", "azure_conv", "azure_code"],
        help="workloads to build traces from",
    )
    ap.add_argument("--traces-dir", default=None, help="folder with the full traces (default: bundled excerpts)")
    ap.add_argument("--steps", type=int, default=400, help="scheduler steps in each trace")
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each pagedkv replay (best is kept)")
    ap.add_argument("--baseline-repeats", type=int, default=1, help="runs of each baseline replay")
    ap.add_argument("--vllm-python", default=None, help="python of an environment with vllm installed")
    ap.add_argument("--nanovllm-path", default=None, help="nano-vllm checkout (outside this repo)")
    ap.add_argument(
        "--nanovllm-python",
        default=sys.executable,
        help="python with numpy and xxhash for the nano-vllm replay (default: this one)",
    )
    ap.add_argument(
        "--rust-replay",
        default=None,
        help="the built core replay binary (default: cargo builds rust/core/examples/replay.rs)",
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds per replay subprocess")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="300 steps per trace (for run_all)")
    ap.add_argument("--results-dir", default=str(common.RESULTS_DIR))
    a = ap.parse_args(argv)
    if a.quick:
        a.steps = min(a.steps, 300)
    if a.rust_replay is None:
        a.rust_replay, why = build_rust_replay()
        if why:
            print(f"Rust replay: skipped ({why})", file=sys.stderr)
    per_trace = {name: measure_trace(a, name) for name in a.traces}
    # 1 / 5 / 15-minute load averages as the run ends (the README table names them).
    payload = {"description": __doc__.split("\n\n")[0], "traces": per_trace, "load_average": list(os.getloadavg())}
    path = common.write_json("allocator_speed", payload, Path(a.results_dir))
    png = plot(per_trace, Path(a.results_dir) / "allocator_speed.png")
    print(f"wrote {path} and {png}")
    return payload


def plot(per_trace: dict[str, dict[str, Any]], path: Path) -> Path:
    """Per trace, bar charts (log scale) of CPU ns per block op and CPU µs per step."""
    plt = common.pyplot()
    fig, axes = plt.subplots(len(per_trace), 2, figsize=(11, 4.0 * len(per_trace)), squeeze=False)
    colors = {
        "pagedkv (sha256)": "#1971c2",
        "pagedkv (xxh3_128)": "#4dabf7",
        WITH_TOKEN_ARRAYS: "#74c0fc",
        "vLLM V1 KVCacheManager": "#e8590c",
        "nano-vllm BlockManager": "#2f9e44",
        "pagedkv BlockPool": "#a5d8ff",
        "vLLM BlockPool": "#ffc078",
    }
    for row, (name, d) in zip(axes, per_trace.items()):
        done = [(k, r["best"]) for k, r in d["results"].items() if "best" in r]
        labels = [
            k.replace(" KVCacheManager", "\nKVCacheManager")
            .replace(" BlockManager", "\nBlockManager")
            .replace(" BlockPool", "\nBlockPool")
            .replace(" (", "\n(")
            for k, _ in done
        ]
        tr = d["trace"]
        for ax, key, title in (
            (row[0], "ns_per_block_op", "CPU ns per block operation"),
            (row[1], "us_per_step_mean", "CPU µs per scheduler step (mean)"),
        ):
            vals = [b[key] for _, b in done]
            ax.bar(range(len(done)), vals, color=[colors.get(k, "#868e96") for k, _ in done])
            for i, v in enumerate(vals):
                ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
            ax.set_yscale("log")
            ax.set_xticks(range(len(done)))
            ax.set_xticklabels(labels, fontsize=7)
            ax.set_title(
                f"{name}: {title}\n({tr['steps']} steps, ~{tr['mean_running']:.0f} running seqs, "
                f"block size {tr['block_size']})",
                fontsize=9,
            )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
