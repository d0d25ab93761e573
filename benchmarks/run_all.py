"""Run the CPU benchmarks in one go (about 10-20 minutes on 2 cores, plus about 20 for a first
kernels_aot run with an empty compile cache) and write
``benchmarks/results/SUMMARY.md``, the markdown tables the README carries.

Runs, each in its own subprocess with a time limit: ``allocator_speed.py`` (Mooncake, Azure
conversation and Azure code traces), ``scaling.py``, ``memory_efficiency.py``, ``sharing.py``,
``prefix_caching.py``, ``host_tier.py`` (each with ``--quick``), ``cluster_sim.py`` (about 3 minutes),
``vllm_scheduler.py`` (with ``--vllm-python``, run by that interpreter), and
``step_overhead.py`` / ``engine_throughput.py`` / ``engine_roofline.py`` when present, and
``kernels_aot.py`` (every Triton kernel configuration compiled for sm_80/90/100 without a GPU;
not ``kernels.py``, which needs CUDA). Each script's output goes to
``benchmarks/results/logs/<name>.log``; its tables are echoed when it ends. A script that fails
or times out is reported in the summary, never hidden.

The README's benchmark blocks (between their ``<!-- BENCH_..._START -->`` / ``END`` markers:
the main benchmark table, the allocator table, the vLLM scheduler table and the simulated
cluster table) are then rewritten from the run's JSON by ``readme_tables.py``, with a header
naming the run's commit, date, CPU count and load average, so one ``make bench`` regenerates
them; a benchmark that failed, did not run, or left a JSON older than the run shows as such
instead of its old figures. ``--summary-only`` rewrites SUMMARY.md and the README from the
existing JSON and run record (``results/run_all_status.json``); ``--no-readme`` leaves the
README alone.

Usage:
  python benchmarks/run_all.py [--vllm-python ~/venvs/vllm/bin/python]
      [--nanovllm-path ~/src/nano-vllm] [--nanovllm-python PY] [--only NAME ...]
      [--summary-only] [--no-readme]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import readme_tables  # noqa: E402

HERE = Path(__file__).resolve().parent
README = HERE.parent / "README.md"


def plan(a: argparse.Namespace) -> list[tuple[str, list[str], float]]:
    """(name, command, timeout seconds) of each benchmark to run, in order."""
    py = sys.executable
    speed = [py, str(HERE / "allocator_speed.py"), "--quick", "--traces", "mooncake", "azure_conv", "azure_code"]
    if a.vllm_python:
        speed += ["--vllm-python", a.vllm_python]
    if a.nanovllm_path:
        speed += ["--nanovllm-path", a.nanovllm_path, "--nanovllm-python", a.nanovllm_python]
    jobs: list[tuple[str, list[str], float]] = [
        ("allocator_speed", speed, 1200),
        ("scaling", [py, str(HERE / "scaling.py"), "--quick"], 600),
        ("memory_efficiency", [py, str(HERE / "memory_efficiency.py"), "--quick"], 300),
        ("sharing", [py, str(HERE / "sharing.py"), "--quick"], 900),
        ("prefix_caching", [py, str(HERE / "prefix_caching.py"), "--quick"], 240),
        (
            # Its --quick run writes host_tier_quick.json (the committed host_tier.json is a full run).
            "host_tier_quick",
            [py, str(HERE / "host_tier.py"), "--quick", *(["--vllm-python", a.vllm_python] if a.vllm_python else [])],
            300,
        ),
        ("cluster_sim", [py, str(HERE / "cluster_sim.py")], 600),
    ]
    if a.vllm_python:
        # vLLM's own Scheduler, stock vs PagedKVScheduler, run by vLLM's interpreter.
        jobs.append(
            (
                "vllm_scheduler",
                [a.vllm_python, str(HERE / "vllm_scheduler.py"), "--steps", "200", "--repeats", "3"],
                1200,
            )
        )
    if (HERE / "step_overhead.py").exists():
        jobs.append(("step_overhead", [py, str(HERE / "step_overhead.py")], 180))
    if (HERE / "engine_throughput.py").exists():
        jobs.append(
            ("engine_throughput", [py, str(HERE / "engine_throughput.py"), *(a.engine_args or ["--rounds", "1"])], 1500)
        )
    if (HERE / "engine_roofline.py").exists():
        jobs.append(("engine_roofline", [py, str(HERE / "engine_roofline.py")], 1800))
    if (HERE / "kernels_aot.py").exists():
        # A fresh run compiles a few hundred kernels; cached per kernel afterwards.
        jobs.append(("kernels_aot", [py, str(HERE / "kernels_aot.py")], 3600))
    if a.only:
        jobs = [j for j in jobs if j[0] in a.only]
    return jobs


def run_jobs(jobs: list[tuple[str, list[str], float]], results_dir: Path) -> dict[str, dict[str, Any]]:
    """Run the jobs one after another under a progress bar; returns status per job."""
    logs = results_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    status: dict[str, dict[str, Any]] = {}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    bar = common.progress(total=len(jobs), desc="benchmarks", disable=False)
    for name, cmd, timeout in jobs:
        bar.set_postfix_str(name)
        t0 = time.perf_counter()
        started = time.time()
        log = logs / f"{name}.log"
        with open(log, "w") as f:
            try:
                p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env, cwd=HERE.parent)
                rc: int | None = p.returncode
            except subprocess.TimeoutExpired:
                rc = None
        dt = time.perf_counter() - t0
        out = results_dir / f"{name}.json"
        # A JSON not rewritten during its job is an older run's: the README must not quote it.
        wrote = out.exists() and out.stat().st_mtime >= started - 1.0
        status[name] = {
            "rc": rc,
            "seconds": dt,
            "log": str(log.relative_to(HERE.parent)),
            "command": " ".join(Path(c).name if c == sys.executable else c for c in cmd),
            "started": datetime.fromtimestamp(started).isoformat(timespec="seconds"),
            "wrote_json": wrote,
            "commit": common.git_commit(),
            "json_when": datetime.fromtimestamp(out.stat().st_mtime).isoformat(timespec="seconds") if wrote else None,
        }
        bar.write(f"\n=== {name}: {'timed out' if rc is None else f'exit {rc}'} in {dt:.0f} s (log {log})")
        bar.write(_tail_tables(log))
        bar.update(1)
    bar.close()
    return status


def _tail_tables(log: Path, max_lines: int = 80) -> str:
    # Echo the script's output without progress-bar carriage returns.
    text = log.read_text(errors="replace").replace("\r", "\n")
    lines = [ln for ln in text.splitlines() if ln.strip() and "it/s]" not in ln and "s/it]" not in ln]
    return "\n".join(lines[-max_lines:])


def _load(results_dir: Path, name: str) -> dict[str, Any] | None:
    p = results_dir / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def summary_markdown(results_dir: Path, status: dict[str, dict[str, Any]]) -> str:
    """SUMMARY.md: a headline table and one table per benchmark, from the result JSON files."""
    out = ["# pagedkv benchmark summary", ""]
    spd = _load(results_dir, "allocator_speed")
    mem = _load(results_dir, "memory_efficiency")
    shr = _load(results_dir, "sharing")
    pfx = _load(results_dir, "prefix_caching")
    any_json = spd or mem or shr or pfx
    if any_json:
        m = any_json["machine"]
        out += [
            f"Machine: {m['cpu']} ({m['cpus']} CPUs), Python {m['python']}, pagedkv commit "
            f"`{(m.get('pagedkv_commit') or '?')[:12]}`, {m['when']}.",
            "",
        ]
    head: list[list[Any]] = []
    for tname, t in (spd or {}).get("traces", {}).items():
        r = t["results"]
        ratios = t.get("ratios_vs_pagedkv_sha256", {})
        for k in ("vLLM V1 KVCacheManager", "nano-vllm BlockManager", "vLLM BlockPool"):
            ref = r.get("pagedkv BlockPool" if "BlockPool" in k else "pagedkv (sha256)", {}).get("best")
            if k in ratios and ref:
                head.append(
                    [
                        f"allocator speed vs {k}, {tname} trace (CPU ns per block op)",
                        f"{ref['ns_per_block_op']:,.0f} ns",
                        f"{r[k]['best']['ns_per_block_op']:,.0f} ns",
                        f"pagedkv {ratios[k]:.1f}x faster",
                        "target >= 5x" if "BlockPool" in k or "nano" in k else "target >= 20x",
                    ]
                )
            elif k in r:
                head.append(
                    [
                        f"allocator speed vs {k.split()[0]}, {tname} trace",
                        "",
                        "not measured",
                        r[k].get("skipped", ""),
                        "",
                    ]
                )
        for k, ratio in t.get("python_over_rust", {}).items():
            head.append(
                [
                    f"{k} through Python / the Rust core alone, {tname} trace (ns per block op)",
                    f"{r[k]['best']['ns_per_block_op']:,.0f} ns",
                    "",
                    f"{ratio:.2f}x the core's own cost",
                    "target <= 2x",
                ]
            )
    if mem:
        for row in mem["results"]:
            if row["system"] == "pagedkv bs=16" and row["workload"] in ("sharegpt_like",):
                ora = next(
                    (
                        x
                        for x in mem["results"]
                        if x["workload"] == row["workload"] and x["system"] == "contiguous oracle"
                    ),
                    None,
                )
                mx = next(
                    (x for x in mem["results"] if x["workload"] == row["workload"] and x["system"] == "contiguous max"),
                    None,
                )
                head.append(
                    [
                        f"KV memory holding token states ({row['workload']}, block 16)",
                        f"{100 * row['token_states']:.1f}%",
                        f"{100 * mx['token_states']:.1f}% max / {100 * ora['token_states']:.1f}% oracle"
                        if mx and ora
                        else "",
                        "",
                        "paper: 96.3% vs 20.4-38.2%",
                    ]
                )
    if shr:
        for row in shr["results"]:
            if row["k"] == 6:
                head.append(
                    [
                        f"blocks saved, {row['mode']} (k=6)",
                        f"{100 * row['saving']:.1f}%",
                        "",
                        row["source"].split(" (")[0],
                        f"paper: {row['paper_saving_pct']}%",
                    ]
                )
    if pfx:
        best = max((x for x in pfx["results"] if x["caching"]), key=lambda x: x["budget_tokens"], default=None)
        if best:
            head.append(
                [
                    f"Mooncake prefix-cache hit rate ({best['budget_tokens']:,} token budget)",
                    f"{100 * best['first_admission_hit_rate']:.1f}%",
                    "0% (caching off)",
                    f"prefill saved {100 * best['prefill_saved_frac']:.1f}%",
                    f"unbounded cache: {100 * pfx['ideal']['hit_rate']:.1f}%",
                ]
            )
    csim = _load(results_dir, "cluster_sim")
    for n in sorted({r["replicas"] for r in (csim or {}).get("rows", [])}):
        rows_n = {r["policy"]: r for r in csim["rows"] if r["replicas"] == n}  # type: ignore[index]
        kv, bound = rows_n.get("kv_aware"), rows_n.get("one_big_cache")
        if kv and bound:
            others = ", ".join(
                f"{p} {rows_n[p]['ttft_p99_s']:.2f} s" for p in ("round_robin", "least_loaded") if p in rows_n
            )
            head.append(
                [
                    f"KV-aware routing, {n} simulated replicas, Mooncake (hit rate; TTFT p99)",
                    f"{100 * kv['hit_rate']:.1f}%; {kv['ttft_p99_s']:.2f} s",
                    others,
                    f"max/mean load {kv['load_max_over_mean']:.2f}",
                    f"one big cache {100 * bound['hit_rate']:.1f}% (target >= 90% of it)",
                ]
            )
    if head:
        out += ["| benchmark | pagedkv | baseline | note | reference |", "|---|---|---|---|---|"]
        out += ["| " + " | ".join(str(c) for c in h) + " |" for h in head]
        out.append("")
    for tname, t in (spd or {}).get("traces", {}).items():
        tr = t["trace"]
        out += [
            f"## Allocator speed: {tr['steps']} steps of the {tname} trace ({tr['requests']} requests, "
            f"{tr['mean_running']:.0f} running seqs on average, {tr['block_ops']:,} block ops, block size "
            f"{tr['block_size']}, prefix caching on)",
            "",
        ]
        rows = []
        for k, r in t["results"].items():
            if "best" not in r:
                rows.append([k, "—", "—", "—", "—", "skipped: " + r.get("skipped", "")])
                continue
            b = r["best"]
            v = r["version"]
            rows.append(
                [
                    k,
                    f"{b['us_per_step_mean']:,.0f}",
                    f"{b['ns_per_block_op']:,.0f}",
                    f"{t['ratios_vs_pagedkv_sha256'].get(k, 0):.1f}",
                    f"{b['wall_ns_per_block_op']:,.0f}",
                    f"{v.get('version') or (v.get('commit') or '')[:12]}, hash {v.get('hash')}",
                ]
            )
        out += [
            common.markdown_table(
                ["system", "CPU µs / step", "CPU ns / block op", "time vs pagedkv", "wall ns / block op", "version"],
                rows,
            ),
            "",
        ]
    if spd:
        out += [
            "CPU = CPU time of the replaying thread (the figure compared); wall = elapsed time, inflated "
            "when other processes share the machine. Block ops = each block of each request obtained once "
            "and released once, counted identically for every system. Time vs pagedkv: managers against pagedkv "
            "(sha256), bare block pools against pagedkv BlockPool.",
            "",
        ]
    scl = _load(results_dir, "scaling")
    if scl:
        st = scl["settings"]
        for sweep, title in (
            ("running", "running sequences (pool fitted to each trace)"),
            ("pool", f"KV pool size ({st['pool_running']} running sequences)"),
        ):
            rows = [
                [f"{x['running']:,}", f"{x['pool_blocks']:,}", f"{x['block_ops']:,}"]
                + [
                    f"{x[side][key]:,.2f}" if key in x[side] else "—"
                    for side, key in (
                        ("python", "ns_per_block_op"),
                        ("rust", "ns_per_block_op"),
                        ("python", "us_per_step_mean"),
                        ("python", "us_per_step_per_seq"),
                        ("rust", "us_per_step_per_seq"),
                    )
                ]
                for x in scl["sweeps"][sweep]
            ]
            out += [
                f"## Cost against {title}: {st['steps']} steps, prompts ~{st['prompt_mean']:.0f} / outputs "
                f"~{st['output_mean']:.0f} tokens",
                "",
                common.markdown_table(
                    [
                        "running",
                        "pool blocks",
                        "block ops",
                        "Python ns / block op",
                        "Rust ns / block op",
                        "Python µs / step",
                        "Python µs / step / seq",
                        "Rust µs / step / seq",
                    ],
                    rows,
                ),
                "",
            ]
        out += ["Plot: `benchmarks/results/scaling.png`.", ""]
    if mem:
        bss = sorted({x["param"] for x in mem["results"] if x["kind"] == "paged"})
        cols = (
            ["workload", "contig. max", "contig. pow2", "contig. oracle"]
            + [f"pagedkv bs={b}" for b in bss]
            + ["concurrent reqs (oracle → paged bs=16)"]
        )
        rows = []
        for wl in dict.fromkeys(x["workload"] for x in mem["results"]):
            get = {x["system"]: x for x in mem["results"] if x["workload"] == wl}
            row = [wl] + [
                f"{100 * get[s]['token_states']:.1f}%" if s in get else "—"
                for s in ["contiguous max", "contiguous pow2", "contiguous oracle"] + [f"pagedkv bs={b}" for b in bss]
            ]
            o, p = get.get("contiguous oracle"), get.get("pagedkv bs=16")
            row.append(f"{o['concurrency']:.0f} → {p['concurrency']:.0f}" if o and p else "—")
            rows.append(row)
        out += [
            "## KV memory holding token states (share of a fixed KV budget, saturated steps)",
            "",
            common.markdown_table(cols, rows),
            "",
            "Paper Fig. 2 (OPT-13B, ShareGPT): 20.4% / 26.8% / 38.2% (Orca max / pow2 / oracle), 96.3% (vLLM).",
            "",
        ]
    if shr:
        rows = [
            [x["mode"], x["k"], f"{100 * x['saving']:.2f}%", f"{x['paper_saving_pct']}%", x["source"]]
            for x in shr["results"]
        ]
        out += [
            "## Blocks saved by sharing (block size 16)",
            "",
            common.markdown_table(["mode", "n / width", "pagedkv", "paper (OPT-13B, Alpaca)", "source"], rows),
            "",
        ]
    if pfx:
        rows = [["unbounded cache (bound)", "on", "—", f"{100 * pfx['ideal']['hit_rate']:.1f}%", "—"]]
        for x in pfx["results"]:
            rows.append(
                [
                    f"pagedkv bs={x['block_size']}",
                    "on" if x["caching"] else "off",
                    f"{x['budget_tokens']:,}",
                    f"{100 * x['first_admission_hit_rate']:.1f}%",
                    f"{100 * x['prefill_saved_frac']:.1f}%",
                ]
            )
        wl = pfx["workload"]
        out += [
            f"## Prefix caching, Mooncake conversation trace ({wl['requests']} requests, "
            f"mean prompt {wl['prompt_mean']:.0f} tokens)",
            "",
            common.markdown_table(
                ["system", "caching", "KV budget (tokens)", "hit rate", "prefill tokens saved"], rows
            ),
            "",
        ]
    for name in ("step_overhead", "engine_throughput", "engine_roofline", "kernels_aot"):
        d = _load(results_dir, name)
        if d is not None:
            md = d.get("summary_markdown")
            if not isinstance(md, str) and name == "engine_throughput":
                md = _engine_table(d)
            out += [f"## {name.replace('_', ' ').capitalize()}", "", md or f"See `benchmarks/results/{name}.json`.", ""]
    if status:
        rows = [
            [
                k,
                "timed out" if s["rc"] is None else ("ok" if s["rc"] == 0 else f"failed (exit {s['rc']})"),
                f"{s['seconds']:.0f}",
                f"`{s['log']}`",
            ]
            for k, s in status.items()
        ]
        total = sum(s["seconds"] for s in status.values())
        out += [
            f"## Runs ({total / 60:.1f} min in all)",
            "",
            common.markdown_table(["benchmark", "status", "seconds", "log"], rows),
            "",
        ]
    out += [
        "Reproduce: `python benchmarks/run_all.py --vllm-python ~/venvs/vllm/bin/python "
        "--nanovllm-path ~/src/nano-vllm --nanovllm-python ~/venvs/nanovllm/bin/python` "
        "(see benchmarks/README.md for setting up the two baselines).",
        "",
    ]
    return "\n".join(out)


def _engine_table(d: dict[str, Any]) -> str | None:
    """Output tokens/s and goodput per workload and system from engine_throughput.json (None if
    its layout is not the one known here; "-" for goodput in files written before it existed)."""
    try:
        rows = []
        slo = d.get("slo")
        for wl, w in d["workloads"].items():
            for sysname, r in w["systems"].items():
                good = (
                    (
                        f"{r['goodput_share']:.0%} ({r['good_requests']}/{w['requests']}), "
                        f"{r['goodput_requests_per_s']:.2f} req/s"
                    )
                    if "goodput_share" in r
                    else "-"
                )
                rows.append([wl, sysname, f"{r['output_tokens_per_s']:.1f}", f"{r['wall_s']:.1f}", good])
        head = f"goodput (TTFT <= {slo['ttft_s']:g} s, TPOT <= {slo['tpot_s']:g} s)" if slo else "goodput"
        return common.markdown_table(["workload", "system", "output tokens/s", "wall s", head], rows)
    except (KeyError, TypeError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=os.environ.get("PAGEDKV_BENCH_VLLM_PYTHON"))
    ap.add_argument("--nanovllm-path", default=os.environ.get("PAGEDKV_BENCH_NANOVLLM_PATH"))
    ap.add_argument("--nanovllm-python", default=os.environ.get("PAGEDKV_BENCH_NANOVLLM_PYTHON", sys.executable))
    ap.add_argument(
        "--engine-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="arguments passed to engine_throughput.py (everything after this flag; default --rounds 1)",
    )
    ap.add_argument("--only", nargs="+", default=None, help="run only these benchmarks")
    ap.add_argument(
        "--summary-only", action="store_true", help="rewrite SUMMARY.md and the README from the existing JSON"
    )
    ap.add_argument("--results-dir", default=str(common.RESULTS_DIR))
    ap.add_argument("--no-readme", action="store_true", help="do not rewrite the README's benchmark tables")
    a = ap.parse_args(argv)
    results_dir = Path(a.results_dir)
    status_file = results_dir / "run_all_status.json"
    run, status = readme_tables.read_status(status_file)
    if not a.summary_only:
        t0 = time.perf_counter()
        run = {
            "started": datetime.now().isoformat(timespec="seconds"),
            "commit": common.git_commit(),
            "cpus": os.cpu_count(),
            "only": a.only,
            "load_average_start": list(os.getloadavg()),
        }
        status.update(run_jobs(plan(a), results_dir))
        # 1 / 5 / 15-minute load averages at the end of the run (the last covers most of it).
        run["load_average_end"] = list(os.getloadavg())
        status_file.write_text(json.dumps({"run": run, "jobs": status}, indent=2) + "\n")
        print(f"\nall benchmarks done in {(time.perf_counter() - t0) / 60:.1f} min")
    md = summary_markdown(results_dir, status)
    (results_dir / "SUMMARY.md").write_text(md)
    print(md)
    print(f"wrote {results_dir / 'SUMMARY.md'}")
    if not a.no_readme:
        done = readme_tables.write_readme(readme_tables.readme_blocks(results_dir, run, status), README)
        for block, what in done.items():
            print(
                f"README {block} block: {what}"
                + (
                    " (no allocator run with the vLLM baseline)"
                    if block == "allocator" and what == "left as it is"
                    else ""
                )
            )
    if any(s["rc"] != 0 for s in status.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
