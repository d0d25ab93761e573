"""Ahead-of-time compile check (no GPU needed): the quick subset of every Triton kernel's
configurations compiles for sm_80 and sm_90 with no register spill, no stack and shared memory
within sm_80's limit; the launch table covers what the launchers select; and the decode
traffic model gives the figures it should.

The compile runs in a subprocess without TRITON_INTERPRET (the rest of the kernel tests run
the interpreter, which replaces the JIT functions this check compiles). Results are cached
per kernel under ~/.cache/pagedkv/kernels-aot, so a rerun with unchanged kernels takes seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from kernels import configs as C  # noqa: E402
from kernels import traffic  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "kernels.aot",
            "--quick",
            "--arch",
            "80",
            "90",
            "--jobs",
            str(min(4, os.cpu_count() or 1)),
            "--no-progress",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if not out.exists():
        pytest.fail(f"aot check did not write its report (exit {p.returncode}):\n{p.stderr[-4000:]}")
    return p.returncode, json.loads(out.read_text()), p.stdout


def test_quick_subset_compiles_without_spills(quick_report):
    rc, report, stdout = quick_report
    assert report["problems"] == [], "\n".join(report["problems"])
    assert rc == 0, stdout[-3000:]
    rows = report["kernels"]
    names = {r["kernel"] for r in rows}
    assert names == {"_paged_attn_kernel", "_merge_kernel", "_reshape_and_cache_kernel", "_copy_blocks_kernel"}
    assert {r["arch"] for r in rows} == {80, 90}
    for r in rows:
        assert r["registers"] > 0 and r["stack_bytes"] == 0
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0
        assert 0 <= r["shared_bytes"] <= C.SM80_MAX_SMEM_BYTES


def test_quick_subset_covers_every_attention_tile(quick_report):
    _, report, _ = quick_report
    seen = {
        (
            r["dtype"],
            r["arch"],
            r["constexprs"]["BLOCK_M"],
            r["constexprs"]["BLOCK_N"],
            r["constexprs"]["BLOCK_D"],
            r["num_warps"],
            r["num_stages"],
        )
        for r in report["kernels"]
        if r["kernel"] == "_paged_attn_kernel"
    }
    for (prec, bd, _phase), t in C.ATTENTION_TILES.items():
        dt = "fp32" if prec == "fp32" else "bf16"
        for arch in (80, 90):
            assert (dt, arch, t.block_m, t.block_n, bd, t.num_warps, t.num_stages) in seen


def test_quick_subset_compiles_the_sliding_window_variant(quick_report):
    # A hybrid model's local layers launch the window variant (USE_WINDOW, no split) for decode
    # and prefill; every tile of the table compiles in it too, beside the full-attention one.
    _, report, _ = quick_report
    by_window: dict[bool, set] = {False: set(), True: set()}
    for r in report["kernels"]:
        if r["kernel"] == "_paged_attn_kernel" and not r["constexprs"]["SPLIT"]:
            c = r["constexprs"]
            by_window[c["USE_WINDOW"]].add((r["dtype"], r["arch"], c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_D"]))
    assert by_window[True] == by_window[False]
    for (prec, bd, _phase), t in C.ATTENTION_TILES.items():
        dt = "fp32" if prec == "fp32" else "bf16"
        for arch in (80, 90):
            assert (dt, arch, t.block_m, t.block_n, bd) in by_window[True]


def test_launcher_selects_from_the_table():
    # The launch the attention launcher builds carries the table's tile for its shape.
    from kernels import aot

    for dt, hs, phase in [("bf16", 80, "decode"), ("fp32", 192, "prefill"), ("fp16", 64, "prefill")]:
        case = aot.Case("attention", dt, hs, 16, group=4, num_kv_heads=2, phase=phase, split=True)
        attn, merge = aot.case_launches(case)
        t = C.attention_tile(aot._DTYPES[dt], hs, 4, 1 if phase == "decode" else 64)
        kw = attn.kwargs
        assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]) == (
            t.block_m,
            t.block_n,
            t.num_warps,
            t.num_stages,
        )
        assert kw["BLOCK_D"] == C.block_d_for(hs) and kw["SPLIT"] is True
        assert merge.kwargs["BLOCK_S"] == C.MERGE_BLOCK_S


def test_attention_tile_rules():
    half, f32 = torch.bfloat16, torch.float32
    assert C.attention_tile(half, 128, 4, 1) == C.ATTENTION_TILES[("half", 128, "decode")]
    # 4 query tokens x group 4 = 16 rows still fit the decode tile; 5 do not.
    assert C.attention_tile(half, 128, 4, 4) == C.ATTENTION_TILES[("half", 128, "decode")]
    assert C.attention_tile(half, 128, 4, 5) == C.ATTENTION_TILES[("half", 128, "prefill")]
    assert C.attention_tile(f32, 32, 1, 1) == C.ATTENTION_TILES[("fp32", 64, "decode")]
    assert C.attention_tile(half, 160, 1, 1) == C.ATTENTION_TILES[("half", 256, "decode")]
    assert C.attention_tile(half, 64, 32, 1).block_m == 32  # MQA-like group taller than the tile
    assert [C.block_d_for(h) for h in (16, 24, 64, 80, 128, 160, 256)] == [16, 32, 64, 128, 128, 256, 256]


def test_aot_refuses_interpreter_mode():
    # This process interprets Triton (TRITON_INTERPRET=1): there is no JIT kernel to compile.
    from kernels import aot

    launch = aot.case_launches(aot.Case("copy_blocks", "fp16", 64, 16))[0]
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET is set"):
        aot.specialize(launch, 90)


# ---------------------------------------------------------------- decode traffic model


def test_traffic_single_sequence_by_hand():
    # One sequence of 100 tokens, 2 KV heads x group 2, head 64 bf16, block 16, no split.
    # K/V rows are 128 B = 4 sectors: 2 * 100 * 2 heads * 128 B = 51,200 B, read exactly.
    # Query: 2 rows of 128 B per KV-head program. Block table: decode tile BLOCK_N=64 -> steps
    # [0,64) pages 0..3 (16 B, 1 sector) and [64,100) pages 4..6 (bytes 16..27, 1 sector).
    shape = traffic.DecodeShape("t", 4, 2, 64, torch.bfloat16, 16, batch=1, seq_len=100)
    t = traffic.decode_traffic(shape, num_kv_splits=1)
    assert C.attention_tile(torch.bfloat16, 64, 2, 1).block_n == 64
    assert t.kv_bytes == 51_200
    assert t.query_bytes == 2 * 2 * 128
    assert t.block_table_bytes == 2 * 2 * 32
    assert t.metadata_bytes == 2 * 3 * 32
    assert t.min_bytes == 51_200 + 4 * 128 + 4 * 7
    assert t.read_bytes == 51_200 + 512 + 128 + 192
    assert t.split_bytes == 0 and t.ratio == pytest.approx(t.read_bytes / t.min_bytes)


def test_traffic_split_partials_and_no_kv_reread():
    shape = traffic.DecodeShape("t", 8, 1, 128, torch.float16, 16, batch=1, seq_len=4096)
    one = traffic.decode_traffic(shape, num_kv_splits=1)
    four = traffic.decode_traffic(shape, num_kv_splits=4)
    assert one.kv_bytes == four.kv_bytes == 2 * 4096 * 128 * 2  # partitions never overlap
    assert four.query_bytes == 4 * one.query_bytes
    assert four.split_bytes == 2 * 4 * 8 * (4 * 128 + 8)


def test_engine_shapes_within_target():
    rows = traffic.engine_report()
    assert {r["shape"] for r in rows} == {s[0] for s in traffic.ENGINE_SHAPES}
    for r in rows:
        assert 1.0 <= r["ratio"] <= 1.1, r
        assert r["ratio"] <= r["ratio_with_split"] <= 1.1, r
