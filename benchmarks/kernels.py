"""GPU benchmark of pagedkv.kernels on one CUDA device (< 8 minutes on an H200).

    python benchmarks/kernels.py [--quick] [--out benchmarks/results/kernels.json]

1. Correctness: every Triton op (and the async swap) against its torch reference on the GPU,
   in fp16 and bf16 (mixed prefill/decode batch, GQA, head sizes 80/128/256, window, split-KV).
2. Decode attention: batch 1..256 x context 512..32k, 32 query / 8 KV heads, head 128, bf16,
   block 16, blocks shuffled in the pool. Reported as achieved bandwidth (K/V bytes read /
   time) and as the time ratio to torch SDPA (flash/efficient/cuDNN backends, enable_gqa) on
   a contiguous cache of the same shape.
3. Prefill (causal, with and without cached context): TFLOP/s (4 * visible pairs * head
   size * heads), and the ratio to causal SDPA on contiguous K/V.
4. Block copy (copy_blocks, all layers) and swap (GPU <-> pinned CPU) in GB/s, plus plain
   device-to-device copy bandwidth (``Tensor.copy_``) as the machine reference.

Bandwidth convention: decode counts bytes read; copy_blocks and the device-to-device
reference count read + write bytes; swap counts bytes moved over the bus once.
Targets (issue 4, H200-class): decode at batch x context >= 64 x 8k reaches >= 80% of the
device-to-device bandwidth and <= 1.15x the SDPA time.

Prints a table and writes JSON. Exits with status 2 and a message on a machine without CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Repo root first: its `kernels/` package must win over this script's own name (kernels.py).
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DEADLINE_S = 7 * 60  # stop starting new measurements after this (the whole run must stay < 8 min)
T0 = time.time()


def _left() -> float:
    return DEADLINE_S - (time.time() - T0)


def bench_ms(fn, *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds per call (triton.testing.do_bench: flushes L2 between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def make_paged(batch, ctx, q_len, hq, hkv, d, bs, dtype, *, shuffle=True, seed=0):
    """Random paged batch: every sequence has ``ctx`` cached + ``q_len`` new tokens."""
    dev = "cuda"
    seq_len = ctx + q_len
    nblk = -(-seq_len // bs)
    num_blocks = batch * nblk + 1
    g = torch.Generator(device=dev).manual_seed(seed)
    kc = torch.empty(num_blocks, bs, hkv, d, dtype=dtype, device=dev).normal_(generator=g)
    vc = torch.empty_like(kc).normal_(generator=g)
    ids = torch.arange(1, num_blocks, device=dev, dtype=torch.int32)
    if shuffle:
        ids = ids[torch.randperm(num_blocks - 1, device=dev, generator=g)]
    bt = ids.reshape(batch, nblk).contiguous()
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, batch + 1, dtype=torch.int32, device=dev) * q_len
    q = torch.empty(batch * q_len, hq, d, dtype=dtype, device=dev).normal_(generator=g)
    return q, kc, vc, bt, seq_lens, qsl


def contiguous_kv(kc, bt, seq_len):
    """The same K (or V) laid out contiguously as [B, Hkv, seq_len, D] for SDPA."""
    b, nblk = bt.shape
    x = kc[bt.long()].reshape(b, nblk * kc.shape[1], kc.shape[2], kc.shape[3])[:, :seq_len]
    return x.transpose(1, 2).contiguous()


def sdpa_fn(q, k, v, is_causal):
    """SDPA on fused backends only (no math fallback), GQA without repeating K/V."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]

    def run():
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)

    return run


# ----------------------------------------------------------------------------- correctness


def check_correctness(kernels, reference, rows):
    """Triton vs reference on the GPU; returns True when all pass."""
    from kernels import attention

    ok_all = True
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
    for dtype in (torch.float16, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        # paged attention: mixed batch of prefill-with-context, chunk and decodes.
        for d, hq, hkv, bs, window, splits in (
            (128, 32, 8, 16, None, None),
            (80, 12, 4, 32, None, 3),
            (256, 8, 1, 8, 100, None),
            (128, 24, 8, 128, 64, 4),
            (64, 8, 8, 64, None, None),
        ):
            lens = [(0, 300), (700, 1), (1500, 1), (200, 77), (33, 1), (4000, 1)]
            nblk = [-(-(c + q) // bs) for c, q in lens]
            nb = sum(nblk) + 1
            kc = torch.randn(nb, bs, hkv, d, dtype=dtype, device="cuda")
            vc = torch.randn_like(kc)
            ids = (torch.randperm(nb - 1, device="cuda") + 1).to(torch.int32)
            bt = torch.zeros(len(lens), max(nblk), dtype=torch.int32, device="cuda")
            used = 0
            for i, n in enumerate(nblk):
                bt[i, :n] = ids[used : used + n]
                used += n
            sl = torch.tensor([c + q for c, q in lens], dtype=torch.int32, device="cuda")
            qsl = torch.tensor(
                [0] + list(torch.cumsum(torch.tensor([q for _, q in lens]), 0)), dtype=torch.int32, device="cuda"
            )
            q = torch.randn(int(qsl[-1]), hq, d, dtype=dtype, device="cuda")
            scale = d**-0.5
            ref = reference.paged_attention(q, kc, vc, bt, sl, qsl, softmax_scale=scale, sliding_window=window)
            out = attention.paged_attention(
                q, kc, vc, bt, sl, qsl, softmax_scale=scale, sliding_window=window, num_kv_splits=splits
            )
            err = (out.float() - ref.float()).abs().max().item()
            ok = err <= tol[dtype] * max(1.0, ref.float().abs().max().item())
            ok_all &= ok
            rows.append(
                dict(
                    op="paged_attention",
                    dtype=name,
                    head_size=d,
                    heads=f"{hq}/{hkv}",
                    block_size=bs,
                    window=window,
                    splits=splits,
                    max_abs_err=err,
                    ok=ok,
                )
            )
        # reshape_and_cache
        kc = torch.randn(64, 16, 8, 128, dtype=dtype, device="cuda")
        vc = torch.randn_like(kc)
        k = torch.randn(500, 8, 128, dtype=dtype, device="cuda")
        v = torch.randn_like(k)
        slots = torch.randperm(64 * 16, device="cuda")[:500]
        slots[::7] = -1
        rk, rv = kc.clone(), vc.clone()
        reference.reshape_and_cache(k, v, rk, rv, slots)
        kernels.reshape_and_cache(k, v, kc, vc, slots)
        ok = torch.equal(kc, rk) and torch.equal(vc, rv)
        ok_all &= ok
        rows.append(dict(op="reshape_and_cache", dtype=name, ok=ok))
        # copy_blocks
        kv = torch.randn(4, 2, 64, 16, 8, 128, dtype=dtype, device="cuda")
        mapping = torch.tensor([[3, 40], [7, 41], [3, 50], [63, 1]], dtype=torch.int64)
        ref_kv = kv.clone()
        reference.copy_blocks(ref_kv, mapping)
        kernels.copy_blocks(kv, mapping)
        ok = torch.equal(kv, ref_kv)
        ok_all &= ok
        rows.append(dict(op="copy_blocks", dtype=name, ok=ok))
        # swap out and back in
        gpu = torch.randn(4, 2, 64, 16, 8, 128, dtype=dtype, device="cuda")
        cpu = torch.zeros(4, 2, 32, 16, 8, 128, dtype=dtype, pin_memory=True)
        out_map = torch.tensor([[5, 0], [6, 1], [7, 2], [40, 9]])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        ev = kernels.swap_blocks(gpu, cpu, out_map, stream)
        ev.synchronize()
        ok = all(torch.equal(cpu[:, :, c], gpu[:, :, g].cpu()) for g, c in out_map.tolist())
        back = torch.zeros_like(gpu)
        stream.wait_stream(torch.cuda.current_stream())
        ev = kernels.swap_blocks(cpu, back, out_map[:, [1, 0]], stream)
        torch.cuda.current_stream().wait_event(ev)
        ok &= all(torch.equal(back[:, :, g], gpu[:, :, g]) for g, _ in out_map.tolist())
        ok_all &= ok
        rows.append(dict(op="swap_blocks", dtype=name, ok=ok))
    return ok_all


# ----------------------------------------------------------------------------- measurements


def bench_d2d(rows):
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    gbps = 2 * n / ms / 1e6
    rows.append(dict(op="d2d_copy", bytes=n, ms=ms, gb_s=gbps))
    del a, b
    return gbps


def bench_decode(kernels, rows, batches, contexts, d2d):
    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    for ctx in contexts:
        for batch in batches:
            kv_bytes = 2 * batch * ctx * hkv * d * 2
            if kv_bytes * 2.6 > torch.cuda.mem_get_info()[0] or _left() < 20:
                rows.append(dict(op="decode", batch=batch, context=ctx, skipped="memory or time"))
                continue
            q, kc, vc, bt, sl, qsl = make_paged(batch, ctx - 1, 1, hq, hkv, d, bs, dtype)
            out = torch.empty_like(q)
            scale = d**-0.5

            def paged():
                kernels.paged_attention(
                    q, kc, vc, bt, sl, qsl, softmax_scale=scale, max_query_len=1, max_seq_len=ctx, out=out
                )

            ms = bench_ms(paged)
            kk = contiguous_kv(kc, bt, ctx)
            vv = contiguous_kv(vc, bt, ctx)
            qq = q.reshape(batch, hq, 1, d)
            try:
                sdpa_ms = bench_ms(sdpa_fn(qq, kk, vv, False))
            except RuntimeError as e:  # no fused backend for this shape
                sdpa_ms = float("nan")
                print(f"  sdpa unavailable for batch {batch} ctx {ctx}: {e}", file=sys.stderr)
            gbps = kv_bytes / ms / 1e6
            rows.append(
                dict(
                    op="decode",
                    batch=batch,
                    context=ctx,
                    ms=ms,
                    gb_s=gbps,
                    pct_of_d2d=100 * gbps / d2d,
                    sdpa_ms=sdpa_ms,
                    ratio_to_sdpa=ms / sdpa_ms,
                )
            )
            del q, kc, vc, bt, kk, vv, out
            torch.cuda.empty_cache()


def bench_decode_sweep(kernels, rows, batch=64, ctx=8192):
    """Tile-size sweep at one large decode shape (input for tuning the defaults)."""
    from kernels import attention

    q, kc, vc, bt, sl, qsl = make_paged(batch, ctx - 1, 1, 32, 8, 128, 16, torch.bfloat16)
    kv_bytes = 2 * batch * ctx * 8 * 128 * 2
    for bn in (16, 32, 64, 128):
        for splits in (None, 1, 2, 4):
            if _left() < 10:
                return
            ms = bench_ms(
                lambda: attention.paged_attention(
                    q,
                    kc,
                    vc,
                    bt,
                    sl,
                    qsl,
                    softmax_scale=0.088,
                    max_query_len=1,
                    max_seq_len=ctx,
                    block_n=bn,
                    num_kv_splits=splits,
                )
            )
            rows.append(
                dict(
                    op="decode_sweep",
                    batch=batch,
                    context=ctx,
                    block_n=bn,
                    splits=splits,
                    ms=ms,
                    gb_s=kv_bytes / ms / 1e6,
                )
            )


def bench_prefill(kernels, rows):
    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    for batch, ctx, q_len in ((4, 0, 4096), (1, 0, 16384), (4, 4096, 4096), (16, 0, 1024)):
        if _left() < 20:
            rows.append(dict(op="prefill", batch=batch, context=ctx, query=q_len, skipped="time"))
            continue
        q, kc, vc, bt, sl, qsl = make_paged(batch, ctx, q_len, hq, hkv, d, bs, dtype)
        scale = d**-0.5
        ms = bench_ms(
            lambda: kernels.paged_attention(
                q, kc, vc, bt, sl, qsl, softmax_scale=scale, max_query_len=q_len, max_seq_len=ctx + q_len
            )
        )
        # Visible (query, key) pairs: each query i sees ctx + i + 1 keys.
        pairs = batch * (q_len * ctx + q_len * (q_len + 1) / 2)
        tflops = 4 * pairs * d * hq / ms / 1e9
        row = dict(op="prefill", batch=batch, context=ctx, query=q_len, ms=ms, tflop_s=tflops)
        if ctx == 0:
            kk = contiguous_kv(kc, bt, q_len)
            vv = contiguous_kv(vc, bt, q_len)
            qq = q.reshape(batch, q_len, hq, d).transpose(1, 2).contiguous()
            try:
                sdpa_ms = bench_ms(sdpa_fn(qq, kk, vv, True))
                row.update(sdpa_ms=sdpa_ms, ratio_to_sdpa=ms / sdpa_ms)
            except RuntimeError as e:
                print(f"  sdpa unavailable for prefill {batch}x{q_len}: {e}", file=sys.stderr)
            del kk, vv
        rows.append(row)
        del q, kc, vc
        torch.cuda.empty_cache()


def bench_copy_swap(kernels, rows):
    layers, nb, bs, hkv, d, dtype = 32, 2048, 16, 8, 128, torch.bfloat16
    kv = torch.empty(layers, 2, nb, bs, hkv, d, dtype=dtype, device="cuda")  # 8 GiB
    block_bytes = bs * hkv * d * kv.element_size()
    perm = torch.randperm(nb - 1) + 1
    for pairs in (64, 512):
        mapping = torch.stack([perm[:pairs], perm[pairs : 2 * pairs]], 1)
        gpu_map = mapping.cuda()
        ms = bench_ms(lambda: kernels.copy_blocks(kv, gpu_map))
        moved = 2 * pairs * layers * 2 * block_bytes  # read + write
        rows.append(dict(op="copy_blocks", pairs=pairs, layers=layers, ms=ms, gb_s=moved / ms / 1e6))
    cpu = torch.empty(layers, 2, 1024, bs, hkv, d, dtype=dtype, pin_memory=True)  # 4 GiB pinned
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    for kind in ("contiguous", "scattered"):
        n = 512
        gsrc = torch.arange(1, n + 1) if kind == "contiguous" else perm[:n]
        cdst = torch.arange(n) if kind == "contiguous" else torch.randperm(1024)[:n]
        for direction, (src, dst, m) in (
            ("gpu_to_cpu", (kv, cpu, torch.stack([gsrc, cdst], 1))),
            ("cpu_to_gpu", (cpu, kv, torch.stack([cdst, gsrc], 1))),
        ):
            if _left() < 10:
                return

            def swap():
                kernels.swap_blocks(src, dst, m, stream).synchronize()

            swap()
            t = time.perf_counter()
            reps = 3
            for _ in range(reps):
                swap()
            ms = (time.perf_counter() - t) * 1e3 / reps
            moved = n * layers * 2 * block_bytes
            rows.append(
                dict(op="swap_blocks", direction=direction, mapping=kind, blocks=n, ms=ms, gb_s=moved / ms / 1e6)
            )
    del kv, cpu
    torch.cuda.empty_cache()


def _clean(x):
    """JSON-safe copy: NaN/inf -> None, unknown objects -> str."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def print_table(rows):
    for r in rows:
        cells = []
        for k, v in r.items():
            if isinstance(v, float):
                v = f"{v:.4g}"
            cells.append(f"{k}={v}")
        print("  " + "  ".join(cells))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer decode sizes (smoke run)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kernels.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(
            "benchmarks/kernels.py needs a CUDA GPU; none is visible (torch.cuda.is_available() is "
            "False). Nothing was measured.",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("benchmarks/kernels.py needs the triton package.", file=sys.stderr)
        sys.exit(2)
    import kernels
    from kernels import reference

    torch.backends.cuda.matmul.allow_tf32 = False
    result: dict = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        python=platform.python_version(),
        started=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    sections: dict = {}
    print(f"device: {result['device']}")

    print("[1/5] correctness vs torch reference (fp16, bf16)")
    rows: list[dict] = []
    ok = check_correctness(kernels, reference, rows)
    print_table(rows)
    sections["correctness"] = rows
    result["correct"] = ok

    print("[2/5] device-to-device copy reference")
    rows = []
    d2d = bench_d2d(rows)
    print_table(rows)
    sections["d2d"] = rows

    print("[3/5] decode attention (bf16, 32q/8kv heads, head 128, block 16)")
    rows = []
    batches = (1, 16, 64, 256) if args.quick else (1, 8, 32, 64, 128, 256)
    contexts = (512, 8192) if args.quick else (512, 2048, 8192, 32768)
    bench_decode(kernels, rows, batches, contexts, d2d)
    print_table(rows)
    sections["decode"] = rows
    target = [r for r in rows if "ms" in r and r["batch"] >= 64 and r["context"] >= 8192]
    result["decode_targets"] = dict(
        rows=len(target),
        min_pct_of_d2d=min((r["pct_of_d2d"] for r in target), default=None),
        max_ratio_to_sdpa=max((r["ratio_to_sdpa"] for r in target), default=None),
        target_pct_of_d2d=80.0,
        target_ratio_to_sdpa=1.15,
    )
    rows = []
    if not args.quick:
        bench_decode_sweep(kernels, rows)
        print_table(rows)
    sections["decode_sweep"] = rows

    print("[4/5] prefill")
    rows = []
    bench_prefill(kernels, rows)
    print_table(rows)
    sections["prefill"] = rows

    print("[5/5] copy_blocks and swap_blocks")
    rows = []
    bench_copy_swap(kernels, rows)
    print_table(rows)
    sections["copy_swap"] = rows

    result.update(sections)
    result["elapsed_s"] = time.time() - T0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_clean(result), indent=1))
    t = result["decode_targets"]
    print(
        f"decode targets (batch>=64, ctx>=8k): min {t['min_pct_of_d2d']} % of d2d (target >= 80), "
        f"max {t['max_ratio_to_sdpa']} x SDPA (target <= 1.15)"
    )
    print(f"correctness: {'PASS' if ok else 'FAIL'}; wrote {out} in {result['elapsed_s']:.0f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
