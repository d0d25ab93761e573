"""Triton paged attention for varlen batches (prefill with cached context, chunked prefill,
decode) in one launch.

Algorithm: FlashAttention-2 online softmax (Dao, 2023) over K/V gathered through a block
table (PagedAttention, Kwon et al., SOSP'23), with an optional split of the KV range into
partitions whose partial results are merged by a second kernel (flash-decoding) so a small
decode batch over a long context still fills the GPU.

Work decomposition. Grid ``(B * q_tiles, num_kv_heads, num_splits)``. A program owns one
sequence, one KV head and a tile of ``BLOCK_M`` rows; row ``r`` is query token
``tile * (BLOCK_M // G) + r // G`` of head ``kv_head * G + r % G`` (``G`` = query heads per
KV head). Packing the GQA group into rows means each K/V tile is loaded once for all query
heads that read it, which is what makes decode bandwidth-bound rather than
head-count-bound. KV tiles are ``BLOCK_N`` token positions; each position's page is looked
up in the block table, so the manager's block size and the kernel tile are independent.
Page offsets are computed in int64 (scenario S11).

Sliding window (``USE_WINDOW``): a tile's KV loop starts at the window start of its first row,
so no position before it is read -- neither its block table entry nor its page. A hybrid
model's sliding-window KV cache group may release those blocks (their entries pointing at the
null block, their pages reused): each layer passes its own group's block table and window.

Tiles, warps and pipeline depth come from :mod:`.configs` (one table, checked ahead of time
for every configuration by :mod:`.aot`). Arguments that change from step to step (token
counts, tiles, splits, window, block-table stride) and the model's group/heads/block size are
not specialised by the JIT (``do_not_specialize``): one compiled kernel serves every batch of
a model, and the AOT check's deduplicated configurations are exactly the kernels that exist.
"""

from __future__ import annotations

import torch

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.kernels.attention", "torch"):
    import triton
    import triton.language as tl

from . import configs as C
from . import validate as V
from .launch import KernelLaunch

_LOG2E = 1.4426950408889634


# Runtime values that vary per step or per model: compiled as plain integers, never specialised.
_ATTN_RUNTIME_INTS = [
    "stride_bt",
    "num_q_tiles",
    "num_tokens",
    "num_q_heads",
    "G",
    "TPT",
    "block_size",
    "window",
    "num_splits",
]


@triton.jit(do_not_specialize=_ATTN_RUNTIME_INTS)
def _paged_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    scale_log2,
    num_q_tiles,
    num_tokens,
    num_q_heads,
    G,
    TPT,
    head_size,
    block_size,
    window,
    num_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid0 = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    b = pid0 // num_q_tiles
    tile = pid0 % num_q_tiles

    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    tok = tile * TPT + r // G  # query index within the sequence
    head = kv_head * G + r % G  # query head
    row_ok = (r < TPT * G) & (tok < q_len)
    pos = ctx + tok  # absolute position of each query row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_size

    # KV range this tile needs: causal end of its last row, window start of its first row.
    first = tile * TPT
    has_rows = first < q_len
    kv_end = tl.where(has_rows, ctx + tl.minimum(first + TPT, q_len), 0)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(ctx + first - window + 1, 0)
    kv_end = tl.maximum(kv_end, kv_start)
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, num_splits), BLOCK_N) * BLOCK_N
        lo = kv_start + split * chunk
        hi = tl.minimum(kv_end, lo + chunk)
    else:
        lo = kv_start
        hi = kv_end

    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kv_head64 = kv_head.to(tl.int64)

    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        page = tl.load(bt_row + j // block_size, mask=j_ok, other=0).to(tl.int64)
        slot = (j % block_size).to(tl.int64)
        k_off = page * stride_kb + slot * stride_ks + kv_head64 * stride_kh
        v_off = page * stride_vb + slot * stride_vs + kv_head64 * stride_vh
        kt = tl.load(k_ptr + k_off[None, :] + d[:, None], mask=j_ok[None, :] & d_ok[:, None], other=0.0)
        if DOT_F32:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2
        ok = j_ok[None, :] & (j[None, :] <= pos[:, None])
        if USE_WINDOW:
            ok = ok & (j[None, :] > pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if SPLIT:
        # Partial (unnormalised acc, running max, running sum) per split, merged by _merge_kernel.
        idx = (split * num_tokens + q_rows) * num_q_heads + head
        tl.store(part_m_ptr + idx, m_i, mask=row_ok)
        tl.store(part_l_ptr + idx, l_i, mask=row_ok)
        tl.store(part_acc_ptr + idx[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit(do_not_specialize=["num_tokens", "num_q_heads", "num_splits"])
def _merge_kernel(
    o_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    stride_ot,
    stride_oh,
    num_tokens,
    num_q_heads,
    head_size,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (token, query head). Two passes over the splits, BLOCK_S at a time, so
    # any split count runs with one compiled kernel: the largest running max, then the
    # partials weighted by exp2(m - max) (flash-decoding's reduction).
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_size
    m_max = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        idx = (s * num_tokens + t) * num_q_heads + h
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + idx, mask=s < num_splits, other=float("-inf")))
    mx = tl.max(m_max, 0)  # every valid row saw its own position in some split: finite
    acc = tl.zeros([BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < num_splits
        idx = (s * num_tokens + t) * num_q_heads + h
        m = tl.load(part_m_ptr + idx, mask=s_ok, other=float("-inf"))
        w = tl.where(s_ok, tl.exp2(m - mx), 0.0)
        den += w * tl.load(part_l_ptr + idx, mask=s_ok, other=0.0)
        part = tl.load(
            part_acc_ptr + idx[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
        )
        acc += tl.sum(part * w[:, None], 0)
    out = acc / tl.sum(den, 0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_kv_splits(programs: int, max_seq_len: int, num_sms: int) -> int:
    """KV partitions the launcher picks: enough for about two programs per SM when the batch
    alone gives fewer, each partition at least :data:`configs.SPLIT_MIN_TOKENS` positions, at
    most :data:`configs.MAX_KV_SPLITS` (flash-decoding's split-KV)."""
    want = 2 * num_sms
    if programs >= want:
        return 1
    return max(1, min(triton.cdiv(want, programs), triton.cdiv(max_seq_len, C.SPLIT_MIN_TOKENS), C.MAX_KV_SPLITS))


def attention_launches(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    *,
    softmax_scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None,
    num_kv_splits: int | None,
    block_m: int | None,
    block_n: int | None,
    num_sms: int | None,
    on_gpu: bool,
) -> list[KernelLaunch]:
    """The launches :func:`paged_attention` runs (attention, then the split-KV merge when the KV
    range is split), for already validated inputs; allocates the split partials.

    ``num_sms``: SM count for the default split choice (None: no split unless asked).
    ``on_gpu``: compile for a GPU (False: the CPU interpreter, which needs the bf16 dot upcast).

    Raises:
        KernelInputError (a ValueError): a ``block_m`` / ``block_n`` / ``num_kv_splits`` override out
            of range.
    """
    t, hq, d = query.shape
    _, bs, hkv, _ = key_cache.shape
    g = hq // hkv
    bsz = block_table.shape[0]
    tile = C.attention_tile(query.dtype, d, g, max_query_len)
    block_d = C.block_d_for(d)
    block_m = tile.block_m if block_m is None else block_m
    block_n = tile.block_n if block_n is None else block_n
    for name, val, lo in (("block_m", block_m, max(16, g)), ("block_n", block_n, 16)):
        if val < lo or val & (val - 1):
            raise V.KernelInputError(f"paged_attention: {name} is {val}, expected a power of two >= {lo}")
    tpt = block_m // g
    n_q_tiles = triton.cdiv(max_query_len, tpt)
    programs = bsz * n_q_tiles * hkv
    if num_kv_splits is None:
        num_kv_splits = 1 if num_sms is None else default_num_kv_splits(programs, max_seq_len, num_sms)
    if num_kv_splits < 1:
        raise V.KernelInputError(f"paged_attention: num_kv_splits is {num_kv_splits}, expected >= 1")
    split = num_kv_splits > 1
    if split:
        part_acc = torch.empty(num_kv_splits, t, hq, block_d, dtype=torch.float32, device=query.device)
        part_m = torch.empty(num_kv_splits, t, hq, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    # The Triton CPU interpreter computes bf16 tl.dot wrongly (Triton 3.5); upcast there only.
    dot_f32 = query.dtype == torch.bfloat16 and not on_gpu
    precision = "ieee" if query.dtype == torch.float32 or dot_f32 else "tf32"
    launches = [
        KernelLaunch(
            _paged_attn_kernel,
            (bsz * n_q_tiles, hkv, num_kv_splits),
            (
                query,
                key_cache,
                value_cache,
                out,
                block_table,
                seq_lens,
                query_start_loc,
                part_acc,
                part_m,
                part_l,
                query.stride(0),
                query.stride(1),
                out.stride(0),
                out.stride(1),
                key_cache.stride(0),
                key_cache.stride(1),
                key_cache.stride(2),
                value_cache.stride(0),
                value_cache.stride(1),
                value_cache.stride(2),
                block_table.stride(0),
                float(softmax_scale) * _LOG2E,
                n_q_tiles,
                t,
                hq,
                g,
                tpt,
                d,
                bs,
                int(sliding_window or 0),
                num_kv_splits,
            ),
            dict(
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                BLOCK_D=block_d,
                USE_WINDOW=sliding_window is not None,
                SPLIT=split,
                PRECISION=precision,
                DOT_F32=dot_f32,
                num_warps=tile.num_warps,
                num_stages=tile.num_stages,
            ),
        )
    ]
    if split:
        launches.append(
            KernelLaunch(
                _merge_kernel,
                (t, hq),
                (out, part_acc, part_m, part_l, out.stride(0), out.stride(1), t, hq, d, num_kv_splits),
                dict(BLOCK_S=C.MERGE_BLOCK_S, BLOCK_D=block_d, num_warps=C.MERGE_WARPS),
            )
        )
    return launches


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    softmax_scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`pagedkv.kernels.reference.paged_attention` (same contract).

    Extra tuning knobs (all optional; defaults from :mod:`pagedkv.kernels.configs`):
        num_kv_splits: KV partitions per (sequence, tile, KV head); > 1 adds a merge launch.
            Default on CUDA: enough to give ~2 programs per SM when the batch is small.
        block_m: rows per tile (query tokens x GQA group), power of two >= 16.
        block_n: KV positions per inner step, power of two >= 16.
    Overrides of ``block_m`` / ``block_n`` are outside the configurations the AOT check covers.

    ``max_query_len`` / ``max_seq_len`` size the grid; passing them avoids a device sync.
    Head sizes up to 256 (padded to a power of two and masked). Raises ``ValueError`` on bad
    input before launching.
    """
    V.check_paged_attention(
        "paged_attention",
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        softmax_scale,
        sliding_window,
        out,
    )
    t, hq, d = query.shape
    if d > V.MAX_HEAD_SIZE:
        raise V.KernelInputError(f"paged_attention: query has head_size {d}, expected <= {V.MAX_HEAD_SIZE}")
    bsz = block_table.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if t == 0 or bsz == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    for launch in attention_launches(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        out,
        softmax_scale=softmax_scale,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        sliding_window=sliding_window,
        num_kv_splits=num_kv_splits,
        block_m=block_m,
        block_n=block_n,
        num_sms=_num_sms(query.device) if query.is_cuda else None,
        on_gpu=query.is_cuda,
    ):
        launch.run()
    return out
