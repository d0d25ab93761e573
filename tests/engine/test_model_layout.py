"""The engine model's GEMM layout and fp32 RoPE: ``linear`` (transposed weights, residual
accumulated in place) and the interleaved-pair complex RoPE give transformers' numbers."""

from __future__ import annotations

import torch

from pagedkv.engine.models.model import LlamaForCausalLM, _interleave_rotary_halves, _projection, linear


def test_linear_matches_f_linear_and_accumulates_the_residual_in_place():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 7, generator=g), torch.randn(3, 7, generator=g), torch.randn(3, generator=g)
    wt = _projection(w)
    assert wt.shape == (7, 3) and wt.is_contiguous()
    torch.testing.assert_close(linear(x, wt), torch.nn.functional.linear(x, w), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(linear(x, wt, b), torch.nn.functional.linear(x, w, b), atol=1e-6, rtol=1e-6)
    res = torch.randn(5, 3, generator=g)
    want = res + torch.nn.functional.linear(x, w, b)
    out = linear(x, wt, b, residual=res)
    assert out is res
    torch.testing.assert_close(res, want, atol=1e-6, rtol=1e-6)


def test_norm_weight_folded_into_the_projection():
    g = torch.Generator().manual_seed(1)
    x, w, norm = torch.randn(4, 6, generator=g), torch.randn(2, 6, generator=g), torch.randn(6, generator=g)
    torch.testing.assert_close(linear(x, _projection(w, norm)), (x * norm) @ w.t(), atol=1e-6, rtol=1e-6)


def test_complex_rope_on_interleaved_heads_equals_rotate_half():
    g = torch.Generator().manual_seed(2)
    t, heads, d, rest = 6, 3, 8, 6
    w = torch.randn(heads * d + rest, 4, generator=g)  # [out, in]: 3 rotated heads, then 6 other columns
    x = torch.randn(t, 4, generator=g)
    wt = _projection(w)
    perm = _interleave_rotary_halves(wt, heads, d)
    assert torch.equal(perm[:, heads * d :], wt[:, heads * d :])  # columns past the heads untouched
    assert torch.equal(perm[:, :4], wt[:, [0, 4, 1, 5]])  # head 0: (x0, x4, x1, x5, ...)
    ang = torch.randn(t, d // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    ref = linear(x, wt)[:, : heads * d].view(t, heads, d)
    want = LlamaForCausalLM._rope(ref, cos.unsqueeze(1), sin.unsqueeze(1))
    got = linear(x, perm)[:, : heads * d].view(t, heads, d)
    LlamaForCausalLM._rope_complex(got, LlamaForCausalLM._cis(cos, sin).unsqueeze(1))
    # Back to rotate-half order to compare: pairs (i, i + d/2) were stored at (2i, 2i + 1).
    back = got.view(t, heads, d // 2, 2).transpose(-1, -2).reshape(t, heads, d)
    torch.testing.assert_close(back, want, atol=1e-6, rtol=1e-6)
    # q.k is the same in either order (what attention reads).
    torch.testing.assert_close(got @ got.transpose(-1, -2), want @ want.transpose(-1, -2), atol=1e-5, rtol=1e-5)
