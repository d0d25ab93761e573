"""The verify step of speculative decoding through the attention kernels (issue 25, item 2).

A verify step schedules a decoding sequence's last token plus its ``k`` draft tokens as one
``k + 1``-token query over the sequence's cached context, through the same varlen (prefill)
path as a prompt, causally masked: draft ``i`` sees the context, the last token and drafts
``< i``, never a later draft. Here verify queries for ``k`` in {1, 2, 4, 7} share a batch with
plain prefills, chunked-prefill chunks and 1-token decodes; their contexts end mid-block, at a
block boundary, and with drafts crossing into the next block, for block sizes 1 and 16. Every
cache slot no query may read (each last block's tail, the null block, spare blocks and, with a
sliding window, the positions before the first query row's window) holds NaN, and the Triton
kernel (interpreted on CPU) and the torch reference must both equal dense causal attention on
the unpaged K/V.
"""

import pytest
import torch

pytest.importorskip("triton")

from helpers.kernel_cases import dense_attention, make_case, poison_unread_slots  # noqa: E402

from kernels import attention, reference  # noqa: E402

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}
DRAFTS = (1, 2, 4, 7)


def verify_batch(block_size: int) -> list[tuple[int, int]]:
    """(context_len, query_len) per sequence: for each ``k`` a verify query whose context ends
    mid-block, one whose context ends at a block boundary and one whose drafts cross a block
    boundary, mixed with a prefill, a chunked-prefill chunk and decodes."""
    bs = block_size
    seqs = []
    for k in DRAFTS:
        seqs.append((2 * bs + bs // 2 + 1, k + 1))  # context ends mid-block (bs=1: any length)
        seqs.append((2 * bs, k + 1))  # context fills its last block exactly
        seqs.append((3 * bs - k // 2 - 1 if bs > k else 3 * bs + 1, k + 1))  # drafts cross a boundary
    seqs += [(0, 19), (3 * bs + 5, 12), (bs, 1), (bs + 3, 1), (1, 1)]  # prefill, chunk, decodes
    return seqs


def _check_layout(seqs, block_size: int) -> None:
    # The batch holds what its docstring claims (so the cases cannot silently degenerate).
    verify = [(c, q) for c, q in seqs if q in {k + 1 for k in DRAFTS} and c > 0]
    assert {q - 1 for _, q in verify} >= set(DRAFTS)
    if block_size > 1:
        assert any(c % block_size == 0 for c, _ in verify)
        assert any(c % block_size != 0 for c, _ in verify)
        assert any(c // block_size != (c + q - 1) // block_size for c, q in verify)
    assert any(c == 0 and q > 1 for c, q in seqs)  # prefill
    assert any(c > 0 and q == 1 for c, q in seqs)  # decode


def _close(got, want, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def _case(block_size, dtype, window=None, *, group=2, seed=0):
    seqs = verify_batch(block_size)
    _check_layout(seqs, block_size)
    case = make_case(seqs, block_size=block_size, num_kv_heads=2, group=group, head_size=16, dtype=dtype, seed=seed)
    want = dense_attention(case, 0.25, window)
    poison_unread_slots(case, float("nan"), window)
    return case, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_triton_verify_step(block_size, dtype):
    case, want = _case(block_size, dtype)
    out = attention.paged_attention(*case.attn_args(), softmax_scale=0.25)
    assert torch.isfinite(out).all()
    _close(out, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_reference_verify_step(block_size, dtype):
    case, want = _case(block_size, dtype)
    out = reference.paged_attention(*case.attn_args(), softmax_scale=0.25)
    assert torch.isfinite(out).all()
    _close(out, want, dtype)


@pytest.mark.parametrize(("block_m", "splits"), [(16, 1), (16, 3), (32, 1)])
def test_triton_verify_query_split_across_tiles_and_kv_partitions(block_m, splits):
    # GQA group 4: a 16-row tile holds 4 query tokens, so a k=4 or k=7 verify query spans two or
    # more tiles, each with its own causal end; split-KV partitions each tile's range.
    case, want = _case(16, torch.float32, group=4, seed=5)
    out = attention.paged_attention(*case.attn_args(), softmax_scale=0.25, block_m=block_m, num_kv_splits=splits)
    assert torch.isfinite(out).all()
    _close(out, want, torch.float32)


def _unmap_before_window(case, window: int) -> int:
    """Point the block table entries of whole blocks before each sequence's first visible
    position at the (NaN) null block, as a sliding-window group releases them."""
    bs = case.key_cache.shape[1]
    unmapped = 0
    for b, (c, _) in enumerate(case.seqs):
        start = max(0, c - window + 1)
        case.block_table[b, : start // bs] = 0
        unmapped += start // bs
    return unmapped


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(("block_size", "window"), [(16, 5), (16, 20), (1, 6)])
def test_verify_step_sliding_window(backend, block_size, window):
    # A verify query's first row's window starts k positions before its last row's: the rows in
    # between must each see their own window, and nothing before the first row's is read (NaN,
    # whole blocks unmapped to the NaN null block).
    case, want = _case(block_size, torch.float32, window, seed=7)
    assert any(q > 1 and c - window + 1 > 0 for c, q in case.seqs)  # windows cut into contexts
    assert _unmap_before_window(case, window) > 0
    if backend == "triton":
        out = attention.paged_attention(*case.attn_args(), softmax_scale=0.25, sliding_window=window)
    else:
        out = reference.paged_attention(*case.attn_args(), softmax_scale=0.25, sliding_window=window)
    assert torch.isfinite(out).all()
    _close(out, want, torch.float32)
    # The case tells per-row windows apart: every row of a sequence cut at its first row's
    # window start (what a kernel masking only by its tile's KV range would compute) differs.
    assert not torch.allclose(want, _dense_first_row_window(case, 0.25, window), atol=1e-3)


def _dense_first_row_window(case, scale: float, window: int) -> torch.Tensor:
    """Causal attention where every query row of a sequence sees from its first row's window
    start on (a wrong answer the per-row window must not give), fp32 ``[T, Hq, D]``."""
    outs = []
    for b, (c, q) in enumerate(case.seqs):
        s0 = int(case.query_start_loc[b])
        rep = case.query.shape[1] // case.keys[b].shape[1]
        k = case.keys[b].float().transpose(0, 1).repeat_interleave(rep, 0)
        v = case.values[b].float().transpose(0, 1).repeat_interleave(rep, 0)
        pos = torch.arange(c, c + q).unsqueeze(1)
        kpos = torch.arange(c + q).unsqueeze(0)
        mask = (kpos <= pos) & (kpos > c - window)
        qq = case.query[s0 : s0 + q].float().transpose(0, 1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=scale))
    return torch.cat([o.transpose(0, 1) for o in outs])
