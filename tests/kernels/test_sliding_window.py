"""Sliding-window attention reads only in-window KV, and each layer reads its own KV cache
group's block table (a hybrid model's sliding-window and full-attention layers).

A sliding-window KV cache group releases the blocks no future query can see (their block table
entries then point at the null block 0), so the kernels must not read anything before the
window of a sequence's first query: every such slot is filled with NaN here (and, in one
variant, its block table entry pointed at a NaN-filled null block), and the output must still
equal dense attention. Triton runs under TRITON_INTERPRET=1 on CPU; the torch reference is
checked on the same cases.
"""

import pytest
import torch

pytest.importorskip("triton")

from helpers.kernel_cases import dense_attention, make_case  # noqa: E402

import kernels  # noqa: E402
from kernels import attention, reference  # noqa: E402

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}
# Decodes, a prefill, a chunked prefill over a cached prefix, a long decode, a sequence with no
# query this step: windows shorter and longer than the contexts.
SEQS = [(60, 1), (0, 30), (25, 8), (100, 1), (40, 0), (3, 1)]


def _close(got, want, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def _first_visible(seq_len: int, q_len: int, window: int) -> int:
    """First position any of the sequence's queries sees: the window start of its first query."""
    return max(0, seq_len - q_len - window + 1)


def _release_out_of_window(case, window: int, *, fill: float, unmap: bool) -> int:
    """Poison every slot before each sequence's first visible position (and the null block)
    with ``fill``; with ``unmap`` also point the block table entries of the whole blocks
    before it at the null block, as a sliding-window group does when it releases them.
    Returns the number of block table entries unmapped."""
    bs = case.key_cache.shape[1]
    unmapped = 0
    for cache in (case.key_cache, case.value_cache):
        cache[0] = fill
    for b, (ctx, q) in enumerate(case.seqs):
        start = _first_visible(ctx + q, q, window) if q else ctx  # no query: nothing is read
        pos = torch.arange(start)
        blocks = case.block_table[b, pos // bs].long()
        for cache in (case.key_cache, case.value_cache):
            cache[blocks, pos % bs] = fill
        if unmap:
            case.block_table[b, : start // bs] = 0
            unmapped += start // bs
    return unmapped


@pytest.mark.parametrize("unmap", [False, True])
@pytest.mark.parametrize("window", [1, 10, 17])
def test_triton_window_never_reads_before_the_window(window, unmap):
    case = make_case(SEQS, block_size=8, num_kv_heads=1, group=2, head_size=32, seed=3)
    want = dense_attention(case, 0.3, window)
    unmapped = _release_out_of_window(case, window, fill=float("nan"), unmap=unmap)
    assert unmapped > 0 or not unmap  # the case does release blocks
    out = attention.paged_attention(*case.attn_args(), softmax_scale=0.3, sliding_window=window)
    assert torch.isfinite(out).all()
    _close(out, want, torch.float32)


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_window_split_kv_never_reads_before_the_window(splits, dtype):
    # Split-KV partitions the in-window range only: no partition starts before the window.
    case = make_case([(150, 1), (3, 1), (40, 4)], block_size=16, num_kv_heads=2, group=4, head_size=32, dtype=dtype)
    want = dense_attention(case, 0.2, 20)
    _release_out_of_window(case, 20, fill=float("nan"), unmap=True)
    out = attention.paged_attention(*case.attn_args(), softmax_scale=0.2, sliding_window=20, num_kv_splits=splits)
    assert torch.isfinite(out).all()
    _close(out, want, dtype)


def test_triton_window_multi_tile_chunk():
    # A 40-token chunk over a 90-token prefix cut into several query tiles (block_m=16, group 2:
    # 8 tokens a tile): each tile starts its KV loop at its own first row's window start.
    case = make_case([(90, 40)], block_size=8, num_kv_heads=1, group=2, head_size=16, seed=11)
    want = dense_attention(case, 0.25, 12)
    _release_out_of_window(case, 12, fill=float("nan"), unmap=True)
    out = attention.paged_attention(*case.attn_args(), softmax_scale=0.25, sliding_window=12, block_m=16, block_n=16)
    assert torch.isfinite(out).all()
    _close(out, want, torch.float32)


@pytest.mark.parametrize("unmap", [False, True])
@pytest.mark.parametrize("window", [1, 10, 17])
def test_reference_window_never_reads_before_the_window(window, unmap):
    case = make_case(SEQS, block_size=8, num_kv_heads=1, group=2, head_size=32, seed=3)
    want = dense_attention(case, 0.3, window)
    _release_out_of_window(case, window, fill=float("nan"), unmap=unmap)
    out = reference.paged_attention(*case.attn_args(), softmax_scale=0.3, sliding_window=window)
    assert torch.isfinite(out).all()
    _close(out, want, torch.float32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_each_layer_reads_its_group_block_table(backend):
    # One step of a hybrid model: the full-attention group's table holds every block, the
    # sliding-window group's table has its out-of-window entries at the null block (poisoned).
    # Both layers share the step's seq_lens / query_start_loc; with the reference each group
    # has its own plan, built once for all of its layers.
    window = 9
    full = make_case(SEQS, block_size=8, num_kv_heads=1, group=2, head_size=32, seed=4)
    want_full = dense_attention(full, 0.3)
    want_local = dense_attention(full, 0.3, window)
    local_table = full.block_table.clone()
    for b, (ctx, q) in enumerate(full.seqs):
        local_table[b, : (_first_visible(ctx + q, q, window) if q else ctx) // 8] = 0
    for cache in (full.key_cache, full.value_cache):
        cache[0] = float("nan")
    shape = tuple(full.key_cache.shape)
    plans = {
        "full": kernels.plan_paged_attention(
            full.block_table, full.seq_lens, full.query_start_loc, cache_shape=shape, num_q_heads=2
        ),
        "local": kernels.plan_paged_attention(
            local_table, full.seq_lens, full.query_start_loc, cache_shape=shape, num_q_heads=2, sliding_window=window
        ),
    }
    args = (full.query, full.key_cache, full.value_cache)
    meta = (full.seq_lens, full.query_start_loc)
    use_plan = backend == "torch"
    out_full = kernels.paged_attention(
        *args, full.block_table, *meta, softmax_scale=0.3, plan=plans["full"] if use_plan else None, backend=backend
    )
    out_local = kernels.paged_attention(
        *args,
        local_table,
        *meta,
        softmax_scale=0.3,
        sliding_window=None if use_plan else window,  # the plan carries its group's window
        plan=plans["local"] if use_plan else None,
        backend=backend,
    )
    _close(out_full, want_full, torch.float32)
    _close(out_local, want_local, torch.float32)
    # A layer handed another group's table is refused with a plan built for the other.
    if use_plan:
        with pytest.raises(ValueError, match="block_table is not the tensor the plan was built from"):
            kernels.paged_attention(*args, local_table, *meta, softmax_scale=0.3, plan=plans["full"])


def test_reference_decode_gathers_only_the_window_blocks():
    # A sliding-window decode gathers from the block holding its window's first position: at
    # most ceil(W / block_size) + 1 blocks whatever the sequence's length, none before.
    window, bs = 16, 8
    case = make_case([(500, 1), (37, 1), (3, 1), (16, 1)], block_size=bs, num_kv_heads=1, group=2, head_size=16)
    plan = kernels.plan_paged_attention(
        case.block_table,
        case.seq_lens,
        case.query_start_loc,
        cache_shape=tuple(case.key_cache.shape),
        num_q_heads=2,
        sliding_window=window,
    )
    gathered = torch.cat([g.blocks.reshape(-1) for g in plan.decodes])
    assert max(g.blocks.shape[1] for g in plan.decodes) <= -(-window // bs) + 1
    for b, sl in enumerate(case.seq_lens.tolist()):
        before = case.block_table[b, : max(0, sl - window) // bs]
        assert not torch.isin(before.long(), gathered).any()
    out = reference.paged_attention(*case.attn_args(), softmax_scale=0.5, plan=plan)
    _close(out, dense_attention(case, 0.5, window), torch.float32)
