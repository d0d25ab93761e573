"""Ahead-of-time check of the Triton kernels: compile every configuration the launchers can
select, for real GPU targets, on a machine without a GPU, and report registers, spills, stack
and shared memory.

    python -m pagedkv.kernels.aot [--quick] [--arch 80 90 100] [--jobs N] [--json PATH] [--md PATH]

How a configuration becomes a kernel. For each launch case (:class:`Case`: op, dtype, head size,
block size, GQA group, phase, split-KV, sliding window...) the launcher's own launch builder
(:func:`.attention.attention_launches`, :func:`.cache_write.cache_write_launch`,
:func:`.block_copy.copy_blocks_launch`) is called on small CPU tensors of that shape, and the
arguments go through Triton's JIT argument binder for the target, exactly as a launch on a GPU
would: the same signature, constexprs, divisibility attributes and options, hence the same
compiled kernel. Cases that bind to the same kernel are compiled once (the report lists how
many cases each kernel serves). ``triton.compile`` then produces PTX and a cubin for
``GPUTarget("cuda", arch, 32)``; ptxas's ``-v`` report (the one Triton runs) gives registers,
stack frame and spill bytes, Triton's metadata the dynamic shared memory.

Swaps are not a Triton kernel (``swap_blocks`` issues ``cudaMemcpyAsync`` copies) and have
nothing to compile; the report says so.

Why the JIT's binder and not a hand-written signature: the divisibility attributes it derives
from real arguments (16-byte-aligned pointers, strides and head size divisible by 16) are what
let Triton prove the K/V gather contiguous and emit 16-byte ``cp.async`` loads. Compiled
without them, head-128 decode turns into 2-byte scalar loads with a 64-bit address each and
ptxas reports 32 registers and a 3.8 KB stack on sm_90 -- a kernel no launch ever runs.

Must run without ``TRITON_INTERPRET=1`` (the interpreter replaces the JIT functions). Results
are cached per kernel under ``~/.cache/pagedkv/kernels-aot`` (or ``$PAGEDKV_AOT_CACHE``), keyed
by the kernel source, specialization, options, target and Triton version.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import io
import itertools
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.kernels.aot", "torch"):
    import triton

from . import configs as C
from . import traffic
from .attention import attention_launches
from .block_copy import copy_blocks_launch
from .cache_write import cache_write_launch
from .launch import KernelLaunch

__all__ = ["Case", "cases", "case_launches", "specialize", "compile_report", "run", "main"]

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


@dataclass(frozen=True)
class Case:
    """One configuration a launcher can be called with.

    Attributes:
        op: ``"attention"``, ``"cache_write"`` or ``"copy_blocks"``.
        dtype: ``"fp16"``, ``"bf16"`` or ``"fp32"``.
        head_size: head dimension.
        block_size: cache block size (tokens per block).
        group: query heads per KV head (attention).
        num_kv_heads: KV heads per layer.
        phase: ``"decode"`` (one-token queries) or ``"prefill"`` (attention).
        split: split-KV on (attention; adds the merge launch).
        window: sliding window on (attention).
        index_dtype: ``"i32"`` / ``"i64"`` block mapping (copy_blocks).
    """

    op: str
    dtype: str
    head_size: int
    block_size: int
    group: int = 1
    num_kv_heads: int = 2
    phase: str = "decode"
    split: bool = False
    window: bool = False
    index_dtype: str = "i64"


def cases(quick: bool = False) -> list[Case]:
    """The launch space of :mod:`.configs`.

    ``quick``: the subset ``make test`` compiles -- every attention tile of the table (bf16 for
    both half types, and fp32; one head size per padded BLOCK_D; decode and prefill) without
    split-KV or window, the same tiles with the sliding window on (a hybrid model's local layers:
    the window bounds the KV loop, so the variant is its own kernel), the half-precision decode
    tiles also with both split-KV and window on (ptxas allocates each variant differently: one
    does not stand for another), their merge kernels, one cache write and one block copy.
    """
    out: list[Case] = []
    if quick:
        for dt, hs, ph, win in itertools.product(
            ("bf16", "fp32"), (64, 128, 256), ("decode", "prefill"), (False, True)
        ):
            out.append(Case("attention", dt, hs, 16, group=3, num_kv_heads=3, phase=ph, window=win))
        for hs in (64, 128, 256):
            out.append(Case("attention", "bf16", hs, 16, group=3, num_kv_heads=3, split=True, window=True))
        out.append(Case("cache_write", "bf16", 128, 16, num_kv_heads=8))
        out.append(Case("copy_blocks", "bf16", 128, 16, num_kv_heads=8))
        return out
    dts = [_DTYPE_NAMES[d] for d in C.DTYPES]
    for dt, hs, bs, g, ph, sp, win in itertools.product(
        dts, C.HEAD_SIZES, C.BLOCK_SIZES, C.GQA_GROUPS, ("decode", "prefill"), (False, True), (False, True)
    ):
        out.append(Case("attention", dt, hs, bs, group=g, num_kv_heads=2, phase=ph, split=sp, window=win))
    for dt, hs, bs, hkv in itertools.product(dts, C.HEAD_SIZES, C.BLOCK_SIZES, C.KV_HEADS):
        out.append(Case("cache_write", dt, hs, bs, num_kv_heads=hkv))
        for idx in ("i32", "i64"):
            out.append(Case("copy_blocks", dt, hs, bs, num_kv_heads=hkv, index_dtype=idx))
    return out


def case_launches(case: Case) -> list[KernelLaunch]:
    """The launches the launcher builds for ``case`` (small CPU tensors of the case's shapes;
    the arguments that select a kernel -- dtypes, strides, alignment, constexprs, options --
    are those of a real call)."""
    dt = _DTYPES[case.dtype]
    hkv, d, bs = case.num_kv_heads, case.head_size, case.block_size
    if case.op == "attention":
        hq = hkv * case.group
        q_len = 1 if case.phase == "decode" else 64
        seq = q_len + 3 * bs
        nblk = triton.cdiv(seq, bs)
        kv = torch.empty(1, 2, nblk + 1, bs, hkv, d, dtype=dt)  # values are never read
        query = torch.empty(q_len, hq, d, dtype=dt)
        bt = torch.arange(1, nblk + 1, dtype=torch.int32).unsqueeze(0)
        return attention_launches(
            query,
            kv[0, 0],
            kv[0, 1],
            bt,
            torch.tensor([seq], dtype=torch.int32),
            torch.tensor([0, q_len], dtype=torch.int32),
            torch.empty_like(query),
            softmax_scale=d**-0.5,
            max_query_len=q_len,
            max_seq_len=seq,
            sliding_window=bs if case.window else None,
            num_kv_splits=2 if case.split else 1,
            block_m=None,
            block_n=None,
            num_sms=None,
            on_gpu=True,
        )
    kv = torch.empty(2, 2, 3, bs, hkv, d, dtype=dt)
    if case.op == "cache_write":
        kv_new = torch.empty(3, 2, hkv, d, dtype=dt)  # K and V of 3 tokens, as a fused projection gives
        return [
            cache_write_launch(
                kv_new[:, 0], kv_new[:, 1], kv[0, 0], kv[0, 1], torch.tensor([bs, bs + 1, -1], dtype=torch.int64)
            )
        ]
    if case.op == "copy_blocks":
        idx = torch.int32 if case.index_dtype == "i32" else torch.int64
        return [copy_blocks_launch(kv, torch.tensor([[1, 2]], dtype=idx))]
    raise ValueError(f"aot: unknown op {case.op!r}")


@dataclass(frozen=True)
class Spec:
    """A kernel as the JIT would compile it for one target."""

    kernel: str
    key: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    aligned: list[str]
    options: dict[str, Any]


def require_compiler() -> None:
    """Raise RuntimeError when Triton runs in interpreter mode in this process (then the
    kernels are interpreter functions and there is nothing to compile)."""
    from triton.runtime.jit import JITFunction

    if not isinstance(attention_launches.__globals__["_paged_attn_kernel"], JITFunction):
        raise RuntimeError(
            "pagedkv.kernels.aot: TRITON_INTERPRET is set; the AOT check compiles real GPU "
            "kernels and must run in a process without it"
        )


@functools.cache
def _backend(arch: int) -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    return make_backend(GPUTarget("cuda", arch, 32))


@functools.cache
def _binder(fn: Any, arch: int) -> Any:
    from triton.runtime.jit import create_function_from_signature

    return create_function_from_signature(fn.signature, fn.params, _backend(arch))


def _binder_inputs(launch: KernelLaunch, arch: int) -> tuple[Any, ...]:
    """Triton's JIT path (``JITFunction.run``) up to the compile call, for a chosen target."""
    from triton import knobs

    fn = launch.kernel
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    bound, specialization, options = _binder(fn, arch)(*launch.args, **kwargs)
    return fn._pack_args(_backend(arch), kwargs, bound, specialization, options)


def specialize(launch: KernelLaunch, arch: int) -> tuple[Spec, Any, Any]:
    """Bind ``launch``'s arguments for ``sm_<arch>`` as the JIT does.

    Returns:
        ``(spec, source, options)``: a summary with a dedup ``key`` (identical keys compile to
        identical kernels), the ``ASTSource`` and the backend options to compile.
    """
    from triton.compiler import ASTSource

    require_compiler()
    options, signature, constexprs, attrs = _binder_inputs(launch, arch)
    src = ASTSource(launch.kernel, signature, constexprs, attrs)
    key = hashlib.sha256(f"{src.hash()}|{options.hash()}|{arch}|{triton.__version__}".encode()).hexdigest()[:24]
    names = launch.kernel.arg_names
    cx = {names[k[0]]: (v if isinstance(v, (int, float, bool, str)) else str(v)) for k, v in constexprs.items()}
    aligned = [names[k[0]] for k, v in attrs.items() if ["tt.divisibility", 16] in v]
    return (
        Spec(
            launch.kernel.__name__,
            key,
            dict(signature),
            cx,
            aligned,
            {"num_warps": options.num_warps, "num_stages": options.num_stages},
        ),
        src,
        options,
    )


_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def _parse_ptxas(log: str) -> dict[str, int] | None:
    st, rg = _PTXAS_STACK.search(log), _PTXAS_REGS.search(log)
    if not (st and rg):
        return None
    return {
        "registers": int(rg.group(1)),
        "stack_bytes": int(st.group(1)),
        "spill_store_bytes": int(st.group(2)),
        "spill_load_bytes": int(st.group(3)),
    }


def _ptxas_again(ptx: str, arch: int) -> str:
    """ptxas -v with Triton's flags, for a kernel Triton took from its own cache (no log)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        cmd = [
            get_ptxas(arch).path,
            "-lineinfo",
            "-v",
            "--regAllocOptLevel=2",
            f"--gpu-name={sm_arch_from_capability(arch)}",
            f.name,
            "-o",
            os.devnull,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stderr


def compile_report(case: Case, launch_index: int, arch: int) -> dict[str, Any]:
    """Compile one launch of ``case`` for ``sm_<arch>``; returns its resource usage
    (registers, stack and spill bytes per thread, dynamic shared memory bytes per block)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    launch = case_launches(case)[launch_index]
    spec, src, options = specialize(launch, arch)
    t0 = time.perf_counter()
    buf = io.StringIO()
    old = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(buf):
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options.__dict__)
    finally:
        knobs.nvidia.dump_ptxas_log = old
    usage = _parse_ptxas(buf.getvalue()) or _parse_ptxas(_ptxas_again(k.asm["ptx"], arch))
    if usage is None:
        raise RuntimeError(f"aot: no ptxas report for {spec.kernel} on sm_{arch}")
    return {**usage, "shared_bytes": int(k.metadata.shared), "compile_s": round(time.perf_counter() - t0, 2)}


def _cache_dir() -> Path:
    if os.environ.get("PAGEDKV_AOT_CACHE"):
        return Path(os.environ["PAGEDKV_AOT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedkv" / "kernels-aot"


def _worker(job: tuple[str, Case, int, int]) -> tuple[str, dict[str, Any]]:
    key, case, idx, arch = job
    path = _cache_dir() / f"{key}.json"
    try:
        rep = compile_report(case, idx, arch)
    except Exception as e:  # noqa: BLE001 -- a failed compile is a result to report
        rep = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    if "error" not in rep:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rep))
    return key, rep


def arch_supported(arch: int) -> str | None:
    """None when Triton's bundled ptxas can target ``sm_<arch>``, else the reason."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    try:
        out = subprocess.run([get_ptxas(arch).path, "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"ptxas not runnable: {e}"
    name = sm_arch_from_capability(arch).rstrip("a")
    return None if name in out else f"the bundled ptxas does not list {name}"


def run(case_list: Iterable[Case], archs: Iterable[int], *, jobs: int = 1, progress: bool = True) -> dict[str, Any]:
    """Specialize every case for every arch, dedupe, compile the distinct kernels (in ``jobs``
    processes, cached) and return the report: ``kernels`` (one row per distinct kernel with its
    resource usage and case count), ``archs`` skipped with the reason, counts and timings."""
    case_list = list(case_list)
    t0 = time.perf_counter()
    kernels: dict[str, dict[str, Any]] = {}
    todo: list[tuple[str, Case, int, int]] = []
    skipped: dict[str, str] = {}
    n_launches = 0
    for arch in archs:
        why = arch_supported(arch)
        if why:
            skipped[f"sm_{arch}"] = why
            continue
        for case in case_list:
            for idx, launch in enumerate(case_launches(case)):
                n_launches += 1
                spec, _, _ = specialize(launch, arch)
                row = kernels.get(spec.key)
                if row is None:
                    row = kernels[spec.key] = {
                        "kernel": spec.kernel,
                        "arch": arch,
                        "key": spec.key,
                        "dtype": case.dtype,
                        "constexprs": spec.constexprs,
                        **spec.options,
                        "divisible_by_16": spec.aligned,
                        "example_case": asdict(case),
                        "cases": 0,
                        "phases": [],
                        "head_sizes": [],
                    }
                    cached = _cache_dir() / f"{spec.key}.json"
                    if cached.exists():
                        row.update(json.loads(cached.read_text()), cached=True)
                    else:
                        todo.append((spec.key, case, idx, arch))
                row["cases"] += 1
                if case.op == "attention" and case.phase not in row["phases"]:
                    row["phases"].append(case.phase)
                if case.head_size not in row["head_sizes"]:
                    row["head_sizes"].append(case.head_size)
    t_spec = time.perf_counter() - t0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc="aot compile", unit="kernel", file=sys.stderr)
    if todo:
        if jobs > 1:
            # spawn: forked children of a process that imported torch can deadlock
            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
                for key, rep in ex.map(_worker, todo):
                    kernels[key].update(rep, cached=False)
                    if bar:
                        bar.update(1)
        else:
            for job in todo:
                key, rep = _worker(job)
                kernels[key].update(rep, cached=False)
                if bar:
                    bar.update(1)
    if bar:
        bar.close()
    return {
        "triton": triton.__version__,
        "archs_skipped": skipped,
        "cases": len(case_list),
        "launches": n_launches,
        "distinct_kernels": len(kernels),
        "compiled_now": len(todo),
        "specialize_s": round(t_spec, 1),
        "total_s": round(time.perf_counter() - t0, 1),
        "sm80_max_smem_bytes": C.SM80_MAX_SMEM_BYTES,
        "swap": "swap_blocks has no Triton kernel (cudaMemcpyAsync per run of blocks): nothing to compile",
        "kernels": sorted(
            kernels.values(),
            key=lambda r: (r["kernel"], r["arch"], r["dtype"], json.dumps(r["constexprs"], sort_keys=True)),
        ),
    }


def problems(report: dict[str, Any]) -> list[str]:
    """Every kernel that failed to compile, spills, uses stack, or exceeds sm_80's shared memory."""
    bad = []
    for r in report["kernels"]:
        tag = f"{r['kernel']} sm_{r['arch']} {r['dtype']} {r['constexprs']} w{r['num_warps']} s{r['num_stages']}"
        if "error" in r:
            bad.append(f"{tag}: compile failed: {r['error']}")
            continue
        if r["spill_store_bytes"] or r["spill_load_bytes"] or r["stack_bytes"]:
            bad.append(
                f"{tag}: {r['registers']} registers, {r['stack_bytes']} B stack, "
                f"{r['spill_store_bytes']} B spill stores, {r['spill_load_bytes']} B spill loads"
            )
        if r["shared_bytes"] > C.SM80_MAX_SMEM_BYTES:
            bad.append(f"{tag}: {r['shared_bytes']} B shared memory > sm_80 limit {C.SM80_MAX_SMEM_BYTES}")
    return bad


def _tile(r: dict[str, Any]) -> str:
    c = r["constexprs"]
    if r["kernel"] == "_paged_attn_kernel":
        return (
            f"{'+'.join(r['phases'])} {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_D']}"
            f"{' split' if c['SPLIT'] else ''}{' window' if c['USE_WINDOW'] else ''}"
        )
    return " ".join(f"{k}={v}" for k, v in c.items() if k.isupper() and k not in ("PRECISION", "DOT_F32"))


def markdown(report: dict[str, Any]) -> str:
    """Two tables: worst case per (kernel, dtype, arch), then every attention kernel."""
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in report["kernels"]:
        if "error" in r:
            continue
        k = (r["kernel"], r["dtype"], r["arch"])
        w = rows.setdefault(k, {"n": 0, "regs": 0, "stack": 0, "spill": 0, "smem": 0, "cases": 0})
        w["n"] += 1
        w["cases"] += r["cases"]
        w["regs"] = max(w["regs"], r["registers"])
        w["stack"] = max(w["stack"], r["stack_bytes"])
        w["spill"] = max(w["spill"], r["spill_store_bytes"] + r["spill_load_bytes"])
        w["smem"] = max(w["smem"], r["shared_bytes"])
    out = [
        f"Triton {report['triton']}: {report['cases']} launch cases, {report['launches']} launches, "
        f"{report['distinct_kernels']} distinct kernels.",
        "",
    ]
    if report["archs_skipped"]:
        out += ["Skipped: " + "; ".join(f"{a} ({w})" for a, w in report["archs_skipped"].items()), ""]
    out += [
        "| kernel | dtype | arch | kernels | cases | max registers | max stack B | max spill B (st+ld) "
        "| max shared KB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (kn, dt, arch), w in sorted(rows.items()):
        out.append(
            f"| {kn} | {dt} | sm_{arch} | {w['n']} | {w['cases']} | {w['regs']} | {w['stack']} | "
            f"{w['spill']} | {w['smem'] / 1024:.1f} |"
        )
    errors = [r for r in report["kernels"] if "error" in r]
    if errors:
        out += [
            "",
            f"{len(errors)} kernels failed to compile: "
            + "; ".join(f"{r['kernel']} sm_{r['arch']}: {r['error']}" for r in errors[:5]),
        ]
    out += [
        "",
        "Attention kernels (tile BLOCK_M x BLOCK_N x BLOCK_D, warps, stages):",
        "",
        "| dtype | arch | tile | warps | stages | head sizes | registers | stack B | spill B | shared KB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["kernels"]:
        if r["kernel"] != "_paged_attn_kernel" or "error" in r:
            continue
        out.append(
            f"| {r['dtype']} | sm_{r['arch']} | {_tile(r)} | {r['num_warps']} | {r['num_stages']} | "
            f"{','.join(map(str, sorted(r['head_sizes'])))} | {r['registers']} | {r['stack_bytes']} | "
            f"{r['spill_store_bytes'] + r['spill_load_bytes']} | {r['shared_bytes'] / 1024:.1f} |"
        )
    return "\n".join(out) + "\n"


def full_report(quick: bool, archs: Iterable[int], jobs: int, progress: bool = True) -> tuple[dict[str, Any], str]:
    """:func:`run` plus the decode traffic model and the problem list; returns the report and
    its markdown (compile tables, then the traffic table)."""
    report = run(cases(quick), archs, jobs=jobs, progress=progress)
    report["traffic"] = traffic.engine_report()
    report["problems"] = problems(report)
    md = markdown(report) + "\n" + traffic.markdown(report["traffic"])
    return report, md


def main(argv: list[str] | None = None) -> int:
    """Command line: compile the configurations, print the tables, optionally write the JSON.
    Returns 1 when any kernel spills, uses stack, exceeds sm_80's shared memory or fails."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the subset make test runs")
    ap.add_argument("--arch", type=int, nargs="+", default=list(C.ARCHS), help="compute capabilities")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--md", default=None, help="write the markdown tables here")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    report, md = full_report(a.quick, a.arch, a.jobs, progress=not a.no_progress)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    if a.md:
        Path(a.md).write_text(md)
    print(md)
    print(
        f"{report['distinct_kernels']} kernels ({report['compiled_now']} compiled now) for "
        f"{report['launches']} launches in {report['total_s']} s"
    )
    for b in report["problems"]:
        print("PROBLEM:", b)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
