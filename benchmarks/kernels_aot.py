"""Ahead-of-time compile report of every pagedkv Triton kernel configuration, no GPU needed.

    python benchmarks/kernels_aot.py [--quick] [--arch 80 90 100] [--jobs N]

Runs :mod:`pagedkv.kernels.aot` over the full launch space (fp16/bf16/fp32; head sizes 64..256;
block sizes 8..128; GQA groups 1..8; decode and prefill; split-KV and sliding window on/off;
cache write, block copy, split-KV merge) for sm_80, sm_90 and sm_100, deduplicated to the
distinct kernels, and the static decode-traffic model. Writes
``benchmarks/results/kernels_aot.json`` (one row per distinct kernel: registers, stack, spill
bytes, shared memory, the cases it serves; the traffic rows) and ``kernels_aot.md`` (tables).
Exits 1 when any kernel spills, uses stack, exceeds sm_80's shared memory or fails to compile.
A fresh run compiles a few hundred kernels (about 20 minutes on 2 cores); results are cached
per kernel under ~/.cache/pagedkv/kernels-aot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Repo root first: its `kernels/` package must win over benchmarks/kernels.py.
sys.path.insert(0, str(REPO))
os.environ.pop("TRITON_INTERPRET", None)  # must be gone before triton is imported

from kernels import aot  # noqa: E402
from kernels import configs as C  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the make-test subset")
    ap.add_argument("--arch", type=int, nargs="+", default=list(C.ARCHS))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(RESULTS / "kernels_aot.json"))
    a = ap.parse_args(argv)
    report, md = aot.full_report(a.quick, a.arch, a.jobs)
    head = md.split("\n\nAttention kernels")[0]
    tr = md[md.index("Decode attention memory traffic") :].split("\n")[0]
    report["summary_markdown"] = (
        head
        + "\n\n"
        + tr
        + "\n\nFull tables: `benchmarks/results/kernels_aot.md`"
        + (
            f"\n\n{len(report['problems'])} problems: " + "; ".join(report["problems"][:5])
            if report["problems"]
            else "\n\nNo kernel spills or uses stack."
        )
    )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text("# AOT compile report (`python benchmarks/kernels_aot.py`)\n\n" + md)
    print(md)
    print(
        f"{report['distinct_kernels']} distinct kernels ({report['compiled_now']} compiled now) for "
        f"{report['launches']} launches of {report['cases']} cases in {report['total_s']} s; wrote {out}"
    )
    for p in report["problems"]:
        print("PROBLEM:", p)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
