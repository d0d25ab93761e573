"""The README's benchmark tables, generated from the result JSON of one ``run_all.py`` run.

Each generated block sits between a pair of HTML comment markers in README.md (``BLOCKS``);
prose outside the markers is hand-written and never touched. Every figure comes from
``benchmarks/results/<benchmark>.json``; paper figures (PagedAttention, Kwon et al., SOSP'23)
and targets are constant text with their attribution. A benchmark whose JSON is missing, whose
run failed or timed out, or whose JSON predates the run is shown as a "not run" / "failed" /
"stale" row instead of its old numbers (:func:`load_source`).

The run record comes from ``run_all_status.json``: ``{"run": {...}, "jobs": {name: {...}}}``,
written by ``run_all.py`` (a file from before the record existed is a flat ``{name: job}`` map
and has no ``run``). A job records ``rc`` (None: timed out), ``started`` / ``json_when`` (ISO
local times) and ``wrote_json`` (whether the JSON file changed during the job).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import common

README = Path(__file__).resolve().parent.parent / "README.md"

#: block name -> (start marker, end marker) in README.md
BLOCKS: dict[str, tuple[str, str]] = {
    "summary": ("<!-- BENCH_SUMMARY_TABLE_START -->", "<!-- BENCH_SUMMARY_TABLE_END -->"),
    "allocator": ("<!-- BENCH_ALLOCATOR_TABLE_START -->", "<!-- BENCH_ALLOCATOR_TABLE_END -->"),
    "vllm_scheduler": ("<!-- BENCH_VLLM_SCHEDULER_TABLE_START -->", "<!-- BENCH_VLLM_SCHEDULER_TABLE_END -->"),
    "cluster": ("<!-- BENCH_CLUSTER_TABLE_START -->", "<!-- BENCH_CLUSTER_TABLE_END -->"),
}

PAPER = "PagedAttention paper (Kwon et al., SOSP'23)"
#: PagedAttention Fig. 2 (OPT-13B, ShareGPT): share of KV memory holding token states, percent.
PAPER_FIG2 = {"contiguous max": 20.4, "contiguous pow2": 26.8, "contiguous oracle": 38.2, "paged (vLLM)": 96.3}
#: PagedAttention Fig. 15 (OPT-13B, Alpaca): blocks saved, percent, by n / beam width.
PAPER_FIG15 = {"parallel": {2: 6.09, 4: 8.53, 6: 9.79}, "beam": {2: 37.56, 4: 53.13, 6: 55.16}}
#: engine_throughput.py's targets: pagedkv's output tokens/s over the baseline's.
ENGINE_TARGETS = {
    ("trace", "hf-static"): 1.5,
    ("trace", "hf-cb"): 3.0,
    ("trace-large", "hf-static"): 1.5,
    ("equal", "hf-static"): 1.0,
}
ENGINE_FLOOR_TARGET = 0.9  # share of the staged schedule's GEMM floor the engine should reach


# ----------------------------------------------------------------------------- run record


def read_status(path: Path) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """``(run, jobs)`` from ``run_all_status.json``; ``(None, {})`` when it does not exist, and
    ``run`` None for a file in the older flat layout (jobs only)."""
    if not path.exists():
        return None, {}
    d = json.loads(path.read_text())
    if isinstance(d.get("jobs"), dict):
        return d.get("run"), d["jobs"]
    return None, {k: v for k, v in d.items() if isinstance(v, dict) and "rc" in v}


def _time(s: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(s) if isinstance(s, str) else None
    except ValueError:
        return None


@dataclass
class Source:
    """One benchmark's JSON and whether the README may quote it.

    ``problem`` is None when the figures may be shown, else the text that replaces them
    ("not run", "failed (exit 1)", "timed out", "stale: ..."); ``when`` / ``commit`` say which
    run measured the figures (None when the JSON and the run record do not say)."""

    name: str
    data: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None
    when: str | None = None
    commit: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.problem is None and bool(self.data)

    def stamp(self) -> str:
        """``2026-11-30 12:30, `b534c860`` for a table's last column."""
        parts = [self.when.replace("T", " ")[:16] if self.when else "date not recorded"]
        if self.commit:
            parts.append(f"`{self.commit[:8]}`")
        return ", ".join(parts)

    def measured(self) -> str:
        """``measured 2026-11-30 12:30, `b534c860``` for a sentence (or "date not recorded")."""
        return f"measured {self.stamp()}" if self.when else self.stamp()

    def status_row(self, what: str, ncols: int) -> str:
        """A table row saying this benchmark's figures are absent, and why."""
        cells = [what, f"{self.problem} (`benchmarks/{self.name}.py`)"] + [""] * (ncols - 2)
        return "| " + " | ".join(cells) + " |"


def load_source(results_dir: Path, name: str, run: dict[str, Any] | None, jobs: dict[str, dict[str, Any]]) -> Source:
    """The JSON of benchmark ``name`` with its freshness judged against the run record.

    Failed / timed-out job -> "failed (exit N)" / "timed out"; a job that ended without writing
    its JSON -> "stale"; no JSON -> "not run"; a JSON older than the run that no job of the run
    record produced -> "not run in this run". A JSON produced by an earlier run_all run that the
    record keeps (``--only`` reruns of other benchmarks) is quoted, with its own date."""
    src = Source(name)
    job = jobs.get(name)
    if job is not None:
        if job.get("rc") is None:
            src.problem = "timed out"
        elif job["rc"] != 0:
            src.problem = f"failed (exit {job['rc']})"
        elif job.get("wrote_json") is False:
            src.problem = "stale: its run wrote no new JSON"
        if src.problem:
            return src
    path = results_dir / f"{name}.json"
    if not path.exists():
        src.problem = "not run"
        return src
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        src.problem = f"unreadable JSON ({type(e).__name__})"
        return src
    if not isinstance(data, dict):
        src.problem = "unreadable JSON (not an object)"
        return src
    src.data = data
    machine: dict[str, Any] = data["machine"] if isinstance(data.get("machine"), dict) else {}
    src.when = machine.get("when") or (job or {}).get("json_when")
    src.commit = machine.get("pagedkv_commit") or (job or {}).get("commit")
    started, measured = _time((run or {}).get("started")), _time(src.when)
    if job is None and started and (measured is None or measured < started):
        src.problem = f"not run in this run (its JSON is from {src.when or 'an unknown date'})"
        src.data = {}
    return src


def header_line(run: dict[str, Any] | None, sources: list[Source]) -> str:
    """Which run the figures come from: commit, date, CPU count, load average."""
    if run:
        load = run.get("load_average_end")
        load_s = (
            " / ".join(f"{x:.1f}" for x in load) + " (1 / 5 / 15 min, as the run ended)" if load else "not recorded"
        )
        only = f", `--only {' '.join(run['only'])}`" if run.get("only") else ""
        return (
            f"Generated by `make bench` (`benchmarks/run_all.py`{only}) from the run started "
            f"{str(run.get('started', '?')).replace('T', ' ')} at commit `{(run.get('commit') or '?')[:12]}`, "
            f"{run.get('cpus', '?')} CPUs, load average {load_s}. The last column gives the date and commit of "
            "the JSON each row quotes; ratios are taken within one benchmark's run."
        )
    cpus = next(
        (
            s.data["machine"]["cpus"]
            for s in sources
            if s.ok and isinstance(s.data.get("machine"), dict) and s.data["machine"].get("cpus")
        ),
        "?",
    )
    return (
        "Generated by `benchmarks/run_all.py --summary-only` from the JSON in `benchmarks/results/` "
        f"(no run record: commit and date are each JSON's own, in the last column), {cpus} CPUs, load "
        "average not recorded for the run. Ratios are taken within one benchmark's run."
    )


# ----------------------------------------------------------------------------- formatting


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def _n(x: float | None) -> str:
    """A figure for the README: thousands separated, one decimal below 100."""
    if x is None:
        return "-"
    return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def _get(d: Any, *keys: Any) -> Any:
    """``d[k0][k1]...``, None as soon as a level is missing (JSON layouts change under us)."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _tps(x: float | None) -> str:
    """Tokens per second, one decimal."""
    return "-" if x is None else f"{x:,.1f}"


def _us(x: float | None) -> str:
    """Microseconds, whole and thousands separated."""
    return "-" if x is None else f"{x:,.0f}"


def _row(*cells: Any) -> str:
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def _guard(src: Source, what: str, ncols: int, build: Callable[[], list[str]]) -> list[str]:
    """``build()``'s rows when ``src`` may be quoted, else its status row; a JSON whose layout
    lacks the keys used gives an "unexpected layout" row rather than an exception."""
    if not src.ok:
        return [src.status_row(what, ncols)]
    try:
        rows = build()
    except (KeyError, TypeError, ValueError, ZeroDivisionError, IndexError, AttributeError) as e:
        src.problem = f"JSON layout not understood ({type(e).__name__}: {e})"
        return [src.status_row(what, ncols)]
    return rows or [Source(src.name, problem="no rows in its JSON").status_row(what, ncols)]


# ----------------------------------------------------------------------------- summary table

SUMMARY_COLUMNS = ["what", "pagedkv", "baseline", "reference / target", "measured"]


def _memory_rows(src: Source) -> list[str]:
    res = src.data["results"]
    get = {(x["workload"], x["system"]): x["token_states"] for x in res}
    paper = src.data.get("paper_fig2_token_states_pct") or PAPER_FIG2
    rows = []
    if ("sharegpt_like", "pagedkv bs=16") in get:
        rows.append(
            _row(
                "KV memory holding token states, ShareGPT-like lengths, block 16",
                _pct(get[("sharegpt_like", "pagedkv bs=16")]),
                f"contiguous max-length {_pct(get.get(('sharegpt_like', 'contiguous max')))}, oracle-length "
                f"{_pct(get.get(('sharegpt_like', 'contiguous oracle')))}",
                f"paper Fig. 2: {paper['paged (vLLM)']}% vs {paper['contiguous max']}–{paper['contiguous oracle']}%",
                src.stamp(),
            )
        )
    traces = [
        (w, n)
        for w, n in (("azure_conv", "Azure conversation"), ("azure_code", "code"), ("mooncake", "Mooncake"))
        if (w, "pagedkv bs=16") in get
    ]
    if traces:
        rows.append(
            _row(
                f"same, {' / '.join(n for _, n in traces)} traces, block 16",
                " / ".join(_pct(get[(w, "pagedkv bs=16")]) for w, _ in traces),
                "contiguous oracle " + " / ".join(_pct(get.get((w, "contiguous oracle"))) for w, _ in traces),
                "",
                src.stamp(),
            )
        )
    return rows


def _sharing_rows(src: Source) -> list[str]:
    res = src.data["results"]

    def by(mode: str) -> dict[int, dict[str, Any]]:
        return {int(x["k"]): x for x in res if x["mode"] == mode}

    beam, par, sim = by("beam search"), by("parallel sampling"), by("parallel sampling, simulated lengths")
    rows = []

    def series(d: dict[int, dict[str, Any]]) -> str:
        return " / ".join(f"{100 * d[k]['saving']:.1f}" for k in sorted(d)) + "%"

    def paper(kind: str, ks: list[int]) -> str:
        return " / ".join(str(PAPER_FIG15[kind].get(k, "?")) for k in ks) + "%"

    if beam:
        ks = sorted(beam)
        rows.append(
            _row(
                f"blocks saved by beam search, width {' / '.join(map(str, ks))} (real engine, SmolLM2)",
                series(beam),
                "",
                f"paper Fig. 15: {paper('beam', ks)}",
                src.stamp(),
            )
        )
    if par or sim:
        ks = sorted(par or sim)
        p_in = sum(x.get("prompt_tokens_mean", 0) for x in par.values()) / len(par) if par else 0
        p_out = sum(x.get("output_tokens_mean", 0) for x in par.values()) / len(par) if par else 0
        mi, mo = common.PAPER_LENGTH_MEANS["alpaca"]
        bs = _get(src.data, "settings", "block_size") or 16
        note = (
            f"; the saving follows the prompt : output ratio (engine prompts ~{p_in:.0f} tokens = "
            f"{int(p_in // bs)} full shared blocks vs ~{p_out:.0f} output tokens)"
            if par
            else ""
        )
        rows.append(
            _row(
                f"blocks saved by parallel sampling, n = {' / '.join(map(str, ks))}: real engine (SmolLM2, "
                "chat-templated instructions, Poisson arrivals, every step counted)",
                series(par) if par else "not measured",
                f"Alpaca-like lengths ({mi:.0f} prompt / {mo:.0f} output tokens, simulated): {series(sim)}"
                if sim
                else "",
                f"paper Fig. 15: {paper('parallel', ks)}{note}",
                src.stamp(),
            )
        )
    return rows


def _prefix_rows(src: Source) -> list[str]:
    d = src.data
    on = [x for x in d["results"] if x["caching"]]
    off = [x for x in d["results"] if not x["caching"]]
    best = max(on, key=lambda x: x["budget_tokens"])
    budget = best["budget_tokens"]
    budget_s = f"{budget / 2**20:g}M" if budget % 2**20 == 0 else f"{budget:,}"
    return [
        _row(
            f"Mooncake prefix-cache hit rate, {budget_s}-token KV budget",
            f"{_pct(best['prefill_saved_frac'])} of prefill saved",
            f"caching off: {_pct(off[0]['prefill_saved_frac'], 0)}" if off else "",
            f"unbounded cache: {_pct(_get(d, 'ideal', 'hit_rate'))}",
            src.stamp(),
        )
    ]


def _engine_rows(eng: Source, roof: Source) -> list[str]:
    wls = eng.data["workloads"]
    slo = eng.data.get("slo") if isinstance(eng.data.get("slo"), dict) else None
    threads = _get(eng.data, "machine", "threads") or _get(eng.data, "config", "threads")
    threads_s = "1 thread" if threads == 1 else f"{threads or '?'} threads"
    names = {"hf-static": "static `generate`", "hf-cb": "`generate_batch`"}
    rows = []

    def tps(w: dict[str, Any], s: str) -> Any:
        return _get(w, "systems", s, "output_tokens_per_s")

    def wall(w: dict[str, Any], s: str) -> Any:
        return _get(w, "systems", s, "wall_s")

    def verdicts(wname: str, w: dict[str, Any]) -> tuple[str, list[str]]:
        base, targets = [], []
        for s in ("hf-static", "hf-cb"):
            t = tps(w, s)
            if t is None:
                continue
            sp = w.get(f"speedup_vs_{s}") or ((tps(w, "pagedkv") or 0) / t)
            per = w.get(f"speedup_vs_{s}_per_round")
            per_s = f", per round {' / '.join(f'{x:.2f}×' for x in per)}" if isinstance(per, list) and per else ""
            base.append(f"{names[s]} {_tps(t)} ({wall(w, s):.1f} s): {sp:.2f}×{per_s}")
            tgt = ENGINE_TARGETS.get((wname, s))
            if tgt:
                targets.append(f"≥ {tgt:g}× {names[s]}: {'met' if sp >= tgt else 'not met'}")
        return "; ".join(base), targets

    def floor(wname: str) -> str:
        """The engine against the staged schedule's GEMM floor (engine_roofline.json)."""
        if not roof.ok:
            return f"GEMM floor: {roof.problem}" if roof.problem else ""
        w = _get(roof.data, "workloads", wname)
        if isinstance(w, dict) and w.get("engine_share_of_floor") is not None:
            # The engine run beside its GEMM tables in engine_roofline.py (its own walls).
            share = w["engine_share_of_floor"]
            n = len(w.get("engine_share_of_floor_per_round") or [])
            what = (
                f"the engine at {share:.0%} of the staged schedule's GEMM floor (median of {n} rounds beside "
                "its GEMM tables, `engine_roofline.py`)"
            )
        elif wname == "trace" and roof.data.get("staged_schedule_gemm_s"):
            g = roof.data["staged_schedule_gemm_s"]
            pk = wall(wls["trace"], "pagedkv") or _get(roof.data, "measured_walls_s", "pagedkv")
            if not pk:
                return ""
            share = g / pk
            what = (
                f"this wall is {pk / g:.2f}× the staged schedule's GEMM time ({g:.1f} s, `engine_roofline.py`), "
                f"i.e. {share:.0%} of that floor"
            )
        else:
            return ""
        verdict = "met" if share >= ENGINE_FLOOR_TARGET else "not met"
        return f"{what}; target ≥ {ENGINE_FLOOR_TARGET:.0%}: {verdict}"

    titles = {
        "trace": lambda w: (
            f"engine output tokens/s, trace workload ({w['requests']} requests), SmolLM2 fp32 CPU, "
            f"{threads_s} (`benchmarks/engine_throughput.py`)"
        ),
        "trace-large": lambda w: f"engine output tokens/s, {w['requests']}-request trace (`trace-large`, same run)",
        "equal": lambda w: (
            f"engine output tokens/s, {w['requests']} equal prompts × "
            f"{w['output_tokens'] // max(1, w['requests'])} tokens, best of "
            f"{len(_get(w, 'systems', 'pagedkv', 'walls_s') or [1])} alternating runs"
        ),
    }
    for wname in ("trace", "trace-large", "equal"):
        w = wls.get(wname)
        if not isinstance(w, dict) or tps(w, "pagedkv") is None:
            continue
        base, targets = verdicts(wname, w)
        ref = targets + ([floor(wname)] if wname != "equal" else [])
        rows.append(
            _row(
                titles[wname](w),
                f"{_tps(tps(w, 'pagedkv'))} ({wall(w, 'pagedkv'):.1f} s)",
                base,
                "; ".join(r for r in ref if r),
                eng.stamp(),
            )
        )
        if slo and "goodput_share" in (_get(w, "systems", "pagedkv") or {}):
            good = [
                f"{names.get(s, s)} {r['goodput_share']:.0%} ({r['goodput_requests_per_s']:.2f} req/s)"
                for s, r in w["systems"].items()
                if s != "pagedkv" and isinstance(r, dict) and "goodput_share" in r
            ]
            pr = w["systems"]["pagedkv"]
            rows.append(
                _row(
                    f"goodput, same workload (TTFT ≤ {slo['ttft_s']:g} s and TPOT ≤ {slo['tpot_s']:g} s)",
                    f"{pr['goodput_share']:.0%} ({pr['goodput_requests_per_s']:.2f} req/s)",
                    "; ".join(good),
                    "",
                    eng.stamp(),
                )
            )
    return rows


def summary_table(sources: dict[str, Source], run: dict[str, Any] | None) -> str:
    """The README's main benchmark table (memory, sharing, prefix caching, engine) with its
    header line, between the ``summary`` markers."""
    n = len(SUMMARY_COLUMNS)
    rows: list[str] = []
    rows += _guard(
        sources["memory_efficiency"],
        "KV memory holding token states",
        n,
        lambda: _memory_rows(sources["memory_efficiency"]),
    )
    rows += _guard(
        sources["sharing"],
        "blocks saved by beam search and parallel sampling",
        n,
        lambda: _sharing_rows(sources["sharing"]),
    )
    rows += _guard(
        sources["prefix_caching"], "Mooncake prefix-cache hit rate", n, lambda: _prefix_rows(sources["prefix_caching"])
    )
    rows += _guard(
        sources["engine_throughput"],
        "engine output tokens/s",
        n,
        lambda: _engine_rows(sources["engine_throughput"], sources["engine_roofline"]),
    )
    start, end = BLOCKS["summary"]
    used = [
        sources[k] for k in ("memory_efficiency", "sharing", "prefix_caching", "engine_throughput", "engine_roofline")
    ]
    return "\n".join([start, header_line(run, used), "", _row(*SUMMARY_COLUMNS), "|" + "---|" * n, *rows, end])


# ----------------------------------------------------------------------------- allocator block


def allocator_table(sources: dict[str, Source], run: dict[str, Any] | None) -> str | None:
    """The README's allocator table (allocator speed with the vLLM and nano-vllm baselines, the
    Rust replay, scaling, step overhead), or None when the allocator run has figures but no vLLM
    baseline (a run without the baselines leaves the published ratios alone). A failed, missing
    or stale allocator run gives a block that says so."""
    start, end = BLOCKS["allocator"]
    spd = sources["allocator_speed"]
    if not spd.ok:
        return "\n".join([start, f"Allocator speed: {spd.problem} (`benchmarks/allocator_speed.py`).", end])
    traces = spd.data["traces"]
    names = {"mooncake": "Mooncake", "azure_conv": "Azure conversation", "azure_code": "Azure code"}
    order = [t for t in ("mooncake", "azure_conv", "azure_code") if t in traces]
    if not order or not all("best" in traces[t]["results"].get("vLLM V1 KVCacheManager", {}) for t in order):
        return None

    def best(t: str, label: str) -> float | None:
        r = traces[t]["results"].get(label, {})
        return r["best"]["ns_per_block_op"] if "best" in r else None

    def ratio(a: float | None, b: float | None) -> str:
        return f"{b / a:.1f}×" if a and b else "-"

    m = spd.data.get("machine", {})
    load = spd.data.get("load_average") or (run or {}).get("load_average_end")
    load_s = " / ".join(f"{x:.1f}" for x in load) if load else "not recorded"
    vllm_ver = traces[order[0]]["results"]["vLLM V1 KVCacheManager"]["version"].get("version", "vLLM")
    lines = [
        start,
        f"Allocator figures generated by `make bench` (`benchmarks/run_all.py`) from one run: pagedkv "
        f"commit `{(m.get('pagedkv_commit') or '?')[:12]}`, {m.get('when', 'date not recorded')}, "
        f"{m.get('cpus', '?')} CPUs, load average {load_s}; {vllm_ver} and nano-vllm beside it in the same run. "
        "CPU ns per block op (thread CPU time, best of the repeats), ~256 running sequences, block size 16, "
        "prefix caching on (SHA-256); the ratio is the baseline's time over pagedkv's. pagedkv's manager "
        "returns what vLLM's KV cache manager returns (new block ids, lengths, block-table deltas; vLLM's "
        "model runner builds slot mappings on the GPU); in brackets, the same steps also writing the "
        "kernel-ready per-token slot mapping and input ids (`step(..., token_arrays=True)`, pagedkv's "
        "engine path).",
        "",
        "| trace | pagedkv manager (with per-token arrays) | vLLM KVCacheManager | nano-vllm | pagedkv BlockPool "
        "| vLLM BlockPool | Rust core alone: manager / pool | through Python ÷ Rust: manager / pool |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in order:
        pk, vl, nv = best(t, "pagedkv (sha256)"), best(t, "vLLM V1 KVCacheManager"), best(t, "nano-vllm BlockManager")
        pp, vp = best(t, "pagedkv BlockPool"), best(t, "vLLM BlockPool")
        pa = best(t, "pagedkv (sha256) + per-token arrays")
        pk_cell = f"{_n(pk)} ({_n(pa)})" if pa else _n(pk)
        rm, rp = best(t, "core alone, Rust (sha256)"), best(t, "core BlockPool, Rust")
        lines.append(
            f"| {names[t]} | {pk_cell} | {_n(vl)} ({ratio(pk, vl)}) | {_n(nv)} ({ratio(pk, nv)}) | {_n(pp)} "
            f"| {_n(vp)} ({ratio(pp, vp)}) | {_n(rm)} / {_n(rp)} | "
            f"{(pk / rm if pk and rm else 0):.2f} / {(pp / rp if pp and rp else 0):.2f} |"
        )
    lines += ["", "Targets: vLLM ≥ 20×, nano-vllm ≥ 5×, vLLM BlockPool ≥ 5×, Python ÷ Rust ≤ 2×."]
    sc = sources["scaling"]
    run_s, pool = (
        (_get(sc.data, "sweeps", "running") or [], _get(sc.data, "sweeps", "pool") or []) if sc.ok else ([], [])
    )
    if run_s and pool:
        lines += [
            "",
            "Cost against scale (`benchmarks/scaling.py`, plot `benchmarks/results/scaling.png`), CPU ns "
            f"per block op through Python (Rust core alone): {run_s[0]['running']} → {run_s[-1]['running']} "
            f"running sequences {_n(run_s[0]['python']['ns_per_block_op'])} → "
            f"{_n(run_s[-1]['python']['ns_per_block_op'])} ({_n(run_s[0]['rust']['ns_per_block_op'])} → "
            f"{_n(run_s[-1]['rust']['ns_per_block_op'])}); pool of "
            + " → ".join(f"{p['pool_blocks']:,}" for p in pool)
            + " blocks: "
            + " → ".join(_n(p["python"]["ns_per_block_op"]) for p in pool)
            + " ("
            + " → ".join(_n(p["rust"]["ns_per_block_op"]) for p in pool)
            + f"); {sc.measured()}.",
        ]
    else:
        lines += ["", f"Cost against scale: {sc.problem or 'no sweeps in its JSON'} (`benchmarks/scaling.py`)."]
    so = sources["step_overhead"]
    by = {r["variant"]: r for r in (_get(so.data, "results") or [])} if so.ok else {}
    bare, whole = by.get("step (numpy appends)"), by.get("step + BatchTensors (torch cpu)")
    if bare and whole:
        lines += [
            "",
            f"One batched decode step of {so.data['num_seqs']} sequences (`benchmarks/step_overhead.py`, "
            f"{so.measured()}): {bare['us_per_step_median']:.1f} µs; with every kernel input as torch "
            "tensors (`BatchTensors.from_steps`, block tables kept across steps): "
            f"{whole['us_per_step_median']:.1f} µs "
            f"= {whole['us_per_step_median'] / bare['us_per_step_median']:.2f}× (targets < 50 µs, ≤ 1.5×).",
        ]
    else:
        lines += [
            "",
            f"Step overhead: {so.problem or 'variants missing from its JSON'} (`benchmarks/step_overhead.py`).",
        ]
    lines.append(end)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- vLLM scheduler block

VLLM_WORKLOADS = {
    "decode256": "256 decoding requests",
    "azure_conv": "Azure conversation trace, 256 running",
    "mooncake": "Mooncake trace (long shared prompts), 256 running",
}


def vllm_scheduler_table(src: Source) -> str:
    """The "Inside vLLM" table: vLLM's own Scheduler CPU time per step, stock against
    PagedKVScheduler (``vllm_scheduler.json``), with the per-request and keep-vLLM-hashes
    variants in a line under it."""
    start, end = BLOCKS["vllm_scheduler"]
    if not src.ok:
        return "\n".join(
            [
                start,
                f"vLLM scheduler benchmark: {src.problem} (`benchmarks/vllm_scheduler.py`, "
                "run by the vLLM venv's interpreter).",
                end,
            ]
        )
    d = src.data
    try:
        res = d["results"]
        ver = d.get("vllm", "?")
        la = d.get("load_average_1_5_15min") or {}
        loads = [x[0] for x in (la.get("start"), la.get("end")) if x]
        load_s = f"{min(loads):.1f}–{max(loads):.1f}" if loads else "not recorded"
        samples = [r["samples"] for w in res.values() for r in w.values() if isinstance(r, dict) and "samples" in r]
        labels = {
            "vLLM stock": f"vLLM {ver} stock",
            "pagedkv": "`PagedKVScheduler`",
            "bound: free decodes": "bound: decodes answered by a no-op (no scheduler)",
        }
        lines = [
            start,
            f"{src.measured().capitalize()} (`vllm_scheduler.py --steps {d.get('steps', '?')} --repeats "
            f"{d.get('repeats', '?')} --sample-runs {d.get('sample_runs', '?')}`, vLLM {ver}, "
            f"{_get(d, 'machine', 'cpus') or '?'} CPUs, 1-minute load average {load_s}; "
            + (f"{min(samples):,}–{max(samples):,} CPU-time samples per row" if samples else "no samples")
            + "):",
            "",
            "| workload | scheduler | `schedule()` µs | `update_from_output()` µs | total µs | KV share (µs) |",
            "|---|---|---|---|---|---|",
        ]
        for wname, w in res.items():
            stock = w.get("vLLM stock")
            first = True
            for key in ("vLLM stock", "pagedkv", "bound: free decodes"):
                r = w.get(key)
                if not isinstance(r, dict):
                    continue
                label = labels[key] if key != "vLLM stock" or wname == next(iter(res)) else "stock"
                total = _us(r["total_us"])
                share = f"{_pct(r.get('kv_share'))} ({_us(r.get('kv_us'))})"
                if stock and key != "vLLM stock":
                    total += f" ({stock['total_us'] / r['total_us']:.2f}×)"
                    if r.get("kv_share"):
                        share += f", {stock['kv_share'] / r['kv_share']:.1f}× lower"
                lines.append(
                    _row(
                        VLLM_WORKLOADS.get(wname, wname) if first else "",
                        label,
                        _us(r["schedule_us"]),
                        _us(r["update_us"]),
                        total,
                        share,
                    )
                )
                first = False
        dec = res.get("decode256", {})
        stock, pr, kh, pk = (
            dec.get(k) for k in ("vLLM stock", "pagedkv per-request", "pagedkv + vLLM hashes", "pagedkv")
        )
        extra = []
        if stock and pr:
            extra.append(
                f"with the deferred decode path off (one crossing into Rust per request) the total is "
                f"{_us(pr['total_us'])} µs ({stock['total_us'] / pr['total_us']:.2f}×) and the KV share "
                f"{_pct(pr.get('kv_share'))}"
            )
        if pk and kh:
            extra.append(
                f"keeping vLLM's block hashes as well costs {kh['update_us'] - pk['update_us']:,.0f} µs more "
                "`update_from_output()` per step"
            )
        if extra:
            lines += ["", "At 256 decodes, " + "; ".join(extra) + "."]
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        lines = [start, f"vLLM scheduler benchmark: JSON layout not understood ({type(e).__name__}: {e}).", end]
        return "\n".join(lines)
    lines.append(end)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- cluster block

POLICY_NAMES = {
    "kv_aware": "kv-aware",
    "round_robin": "round-robin",
    "least_loaded": "least-loaded",
    "one_big_cache": "one-big-cache",
}
CLUSTER_TARGETS = (0.90, 1.25)  # KV-aware hit rate over one big cache's, max/mean load


def cluster_table(src: Source) -> str:
    """The routing section's simulated-cluster table (``cluster_sim.json``) with the verdict on
    its targets (KV-aware >= 90% of the one-big-cache hit rate, max/mean load <= 1.25, best
    p99 TTFT of the routed policies) at each replica count."""
    start, end = BLOCKS["cluster"]
    if not src.ok:
        return "\n".join([start, f"Simulated cluster: {src.problem} (`benchmarks/cluster_sim.py`).", end])
    d = src.data
    try:
        p, wl = d.get("params", {}), d.get("workload", {})
        kv = p.get("kv_tokens_per_replica")
        kv_s = f"{kv / 2**20:g}M" if kv and kv % 2**20 == 0 else f"{kv:,}" if kv else "?"
        lines = [
            start,
            f"Simulated cluster (`benchmarks/cluster_sim.py`, {src.measured()}: each replica a pagedkv "
            f"manager with {kv_s} tokens of KV and a step time model, Mooncake conversation excerpt, "
            f"{wl.get('requests', '?'):,} requests at {p.get('rate_per_replica', '?')} request/s per replica):",
            "",
            "| replicas | policy | prefix hit rate | of one big cache | TTFT p50 | TTFT p99 | max/mean load |",
            "|---|---|---|---|---|---|---|",
        ]
        verdicts = []
        for n in sorted({r["replicas"] for r in d["rows"]}):
            rows = {r["policy"]: r for r in d["rows"] if r["replicas"] == n}
            bound = rows.get("one_big_cache")
            for pol, r in rows.items():
                of = f"{r['hit_rate'] / bound['hit_rate']:.1%}" if bound and bound["hit_rate"] else "-"
                lm = r.get("load_max_over_mean")
                lines.append(
                    _row(
                        n,
                        POLICY_NAMES.get(pol, pol),
                        _pct(r["hit_rate"]),
                        of,
                        f"{r['ttft_p50_s']:.2f} s",
                        f"{r['ttft_p99_s']:.2f} s",
                        f"{lm:.2f}" if lm is not None else "—",
                    )
                )
            kvr = rows.get("kv_aware")
            if kvr and bound:
                routed = [r for k, r in rows.items() if k != "one_big_cache"]
                ok = [
                    kvr["hit_rate"] >= CLUSTER_TARGETS[0] * bound["hit_rate"],
                    (kvr.get("load_max_over_mean") or 0) <= CLUSTER_TARGETS[1],
                    kvr["ttft_p99_s"] <= min(r["ttft_p99_s"] for r in routed),
                ]
                verdicts.append(f"{n} replicas: {'met' if all(ok) else 'not met'}")
        lines += [
            "",
            "Targets (KV-aware ≥ 90% of the one-big-cache hit rate, max/mean load ≤ 1.25, best p99 TTFT "
            "of the routed policies): " + ("; ".join(verdicts) or "no KV-aware row") + ".",
        ]
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        return "\n".join([start, f"Simulated cluster: JSON layout not understood ({type(e).__name__}: {e}).", end])
    lines.append(end)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- README


SOURCES = (
    "allocator_speed",
    "scaling",
    "step_overhead",
    "memory_efficiency",
    "sharing",
    "prefix_caching",
    "engine_throughput",
    "engine_roofline",
    "vllm_scheduler",
    "cluster_sim",
)


def readme_blocks(
    results_dir: Path, run: dict[str, Any] | None, jobs: dict[str, dict[str, Any]]
) -> dict[str, str | None]:
    """Every generated README block by name (``BLOCKS``); None: leave that block as it is."""
    s = {name: load_source(results_dir, name, run, jobs) for name in SOURCES}
    return {
        "summary": summary_table(s, run),
        "allocator": allocator_table(s, run),
        "vllm_scheduler": vllm_scheduler_table(s["vllm_scheduler"]),
        "cluster": cluster_table(s["cluster_sim"]),
    }


def replace_block(text: str, block: str, start: str, end: str) -> str | None:
    """``text`` with the span from ``start`` through ``end`` replaced by ``block`` (which carries
    both markers); None when the markers are missing, out of order or not unique."""
    a, b = text.find(start), text.find(end)
    if a < 0 or b < a or text.count(start) != 1 or text.count(end) != 1:
        return None
    return text[:a] + block + text[b + len(end) :]


def write_readme(blocks: dict[str, str | None], readme: Path = README) -> dict[str, str]:
    """Rewrite each block of ``readme`` between its markers; returns block name -> what happened
    ("rewritten", "left as it is", "markers not found"). Text outside the markers is kept."""
    text = readme.read_text()
    done: dict[str, str] = {}
    for name, block in blocks.items():
        if block is None:
            done[name] = "left as it is"
            continue
        new = replace_block(text, block, *BLOCKS[name])
        if new is None:
            done[name] = "markers not found"
        else:
            text, done[name] = new, "rewritten"
    readme.write_text(text)
    return done
