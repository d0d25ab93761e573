"""The torch reference of paged attention (the CPU engine's attention and the oracle of the
Triton kernel) against dense SDPA over contiguous K/V."""

import pytest
import torch
from helpers.kernel_cases import dense_attention, make_case, poison_unread_slots, random_seqs

from kernels import reference


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_reference_matches_dense_fp32(kind, group, block_size):
    seqs = random_seqs(kind, 5, max_ctx=1000, max_q=500, seed=group * 100 + block_size)
    case = make_case(seqs, block_size=block_size, num_kv_heads=2, group=group, head_size=64, seed=block_size + group)
    scale = 64**-0.5
    out = reference.paged_attention(*case.attn_args(), softmax_scale=scale)
    assert out.dtype == torch.float32 and out.shape == case.query.shape
    torch.testing.assert_close(out, dense_attention(case, scale), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_matches_dense_half(kind, dtype):
    seqs = random_seqs(kind, 4, max_ctx=300, max_q=100, seed=7)
    case = make_case(seqs, block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=dtype)
    out = reference.paged_attention(*case.attn_args(), softmax_scale=0.125)
    assert out.dtype == dtype
    # Math is fp32 on the same (rounded) inputs; only the final rounding may differ (1 ulp).
    want = dense_attention(case, 0.125).to(dtype)
    ulp = 2.0 ** (-10 if dtype == torch.float16 else -7)
    torch.testing.assert_close(out.float(), want.float(), atol=1e-5, rtol=ulp)


@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_reference_head_sizes(head_size):
    case = make_case([(40, 9), (100, 1), (0, 33)], block_size=16, num_kv_heads=1, group=3, head_size=head_size)
    out = reference.paged_attention(*case.attn_args(), softmax_scale=0.07)
    torch.testing.assert_close(out, dense_attention(case, 0.07), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 64])
def test_reference_sliding_window(window):
    case = make_case([(100, 1), (0, 90), (50, 30), (3, 1)], block_size=16, num_kv_heads=2, group=2, head_size=64)
    out = reference.paged_attention(*case.attn_args(), softmax_scale=0.125, sliding_window=window)
    torch.testing.assert_close(out, dense_attention(case, 0.125, window), atol=2e-6, rtol=1e-5)


def test_reference_window_one_returns_own_value():
    # A window of 1 sees only the query's own position: output == that position's V.
    case = make_case([(10, 5)], block_size=8, num_kv_heads=1, group=2, head_size=16)
    out = reference.paged_attention(*case.attn_args(), softmax_scale=1.0, sliding_window=1)
    want = case.values[0][10:15].repeat_interleave(2, 1)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)


def test_reference_out_buffer_and_empty_sequence():
    # A sequence with zero query tokens contributes no rows and does not disturb the others.
    case = make_case([(20, 3), (50, 0), (7, 1)], block_size=16, num_kv_heads=1, group=1, head_size=32)
    out = torch.full_like(case.query, float("nan"))
    ret = reference.paged_attention(*case.attn_args(), softmax_scale=0.2, out=out)
    assert ret is out
    torch.testing.assert_close(out, dense_attention(case, 0.2), atol=2e-6, rtol=1e-5)


def test_reference_single_token_context_is_value():
    # Attention over exactly one key returns that key's value for any query.
    case = make_case([(0, 1)], block_size=16, num_kv_heads=1, group=4, head_size=8)
    out = reference.paged_attention(*case.attn_args(), softmax_scale=0.3)
    torch.testing.assert_close(out, case.values[0].repeat_interleave(4, 1), atol=0, rtol=0)


@pytest.mark.slow
def test_reference_large_batch_dense():
    seqs = random_seqs("mixed", 32, max_ctx=4000, max_q=1000, seed=3)
    case = make_case(seqs, block_size=16, num_kv_heads=4, group=8, head_size=128)
    out = reference.paged_attention(*case.attn_args(), softmax_scale=128**-0.5)
    torch.testing.assert_close(out, dense_attention(case, 128**-0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 8])
def test_reference_ignores_slots_it_does_not_read(fill, dtype, window):
    # Decodes gather whole blocks (the last block's unused tail, block 0 for padding) and mask
    # them out; a NaN or inf there, or before the window, must not reach the output: the
    # Triton kernel never reads those slots. Decodes of different lengths share one padded
    # group here; the prefills with and without a cached prefix gather whole blocks too.
    seqs = [(37, 1), (5, 1), (90, 1), (0, 13), (21, 9), (0, 1)]
    case = make_case(seqs, block_size=16, num_kv_heads=2, group=2, head_size=32, dtype=dtype, seed=5)
    want = dense_attention(case, 0.125, window)
    poison_unread_slots(case, fill, window)
    got = reference.paged_attention(*case.attn_args(), softmax_scale=0.125, sliding_window=window)
    assert torch.isfinite(got).all()
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
