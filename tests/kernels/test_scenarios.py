"""Scenarios S10 (cached prefix == full prefill) and S11 (page offsets past 2^31), for the
torch reference and the Triton kernels."""

import importlib.util

import pytest
import torch

import kernels

BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])
TOL = {"torch": 1e-6, "triton": 1e-5}


def _write(backend, k, v, kc, vc, table, start, bs):
    pos = torch.arange(start, start + k.shape[0])
    slots = table[pos // bs].long() * bs + pos % bs
    kernels.reshape_and_cache(k, v, kc, vc, slots, backend=backend)


def _attend(backend, q, kc, vc, tables, seq_lens, q_lens, scale):
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    bt = torch.stack(tables).to(torch.int32)
    return kernels.paged_attention(
        q, kc, vc, bt, torch.tensor(seq_lens, dtype=torch.int32), qsl, softmax_scale=scale, backend=backend
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_s10_prefill_with_cached_context_equals_full_prefill(backend):
    g = torch.Generator().manual_seed(10)
    n, bs, hkv, grp, d = 75, 16, 2, 2, 32
    nblk = -(-n // bs)
    k = torch.randn(n, hkv, d, generator=g)
    v = torch.randn(n, hkv, d, generator=g)
    q = torch.randn(n, hkv * grp, d, generator=g)
    scale = d**-0.5

    # Uncached: one prefill of all n tokens into blocks 1..nblk.
    kc = torch.zeros(2 * nblk + 2, bs, hkv, d)
    vc = torch.zeros_like(kc)
    table_a = torch.arange(1, nblk + 1, dtype=torch.int32)
    _write(backend, k, v, kc, vc, table_a, 0, bs)
    full = _attend(backend, q, kc, vc, [table_a], [n], [n], scale)

    # Cached: another sequence's prefix blocks (3 full blocks = 48 tokens) are already in the
    # pool in other physical blocks; only the tail is written and attended.
    ctx = 48
    table_b = torch.tensor([9, 7, 2 * nblk + 1, 8, 6], dtype=torch.int32)
    kc2 = kc.clone()
    vc2 = vc.clone()
    _write(backend, k[:ctx], v[:ctx], kc2, vc2, table_b, 0, bs)
    _write(backend, k[ctx:], v[ctx:], kc2, vc2, table_b, ctx, bs)
    tail = _attend(backend, q[ctx:], kc2, vc2, [table_b], [n], [n - ctx], scale)
    torch.testing.assert_close(tail, full[ctx:], atol=TOL[backend], rtol=TOL[backend])

    # Chunked prefill in 3 uneven chunks, batched with a decode of the full sequence.
    outs = []
    for c0, c1 in ((0, 20), (20, 51), (51, n)):
        o = _attend(
            backend, torch.cat([q[c0:c1], q[n - 1 :]]), kc2, vc2, [table_b, table_a], [c1, n], [c1 - c0, 1], scale
        )
        outs.append(o[: c1 - c0])
        torch.testing.assert_close(o[c1 - c0 :], full[n - 1 :], atol=TOL[backend], rtol=TOL[backend])
    torch.testing.assert_close(torch.cat(outs), full, atol=TOL[backend], rtol=TOL[backend])


def _huge_cache(num_blocks, bs, h, d, dtype):
    """Virtual-memory-only cache (torch.empty never touches untouched pages)."""
    try:
        return torch.empty(num_blocks, bs, h, d, dtype=dtype), torch.empty(num_blocks, bs, h, d, dtype=dtype)
    except RuntimeError as e:  # no overcommit on this machine
        pytest.skip(f"cannot reserve a >2^31-element virtual cache: {e}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_s11_page_offsets_past_int32(backend):
    bs, h, d = 16, 1, 16
    num_blocks = 2**31 // (bs * h * d) + 64  # 8.4M blocks: last element offset > 2^31
    kc, vc = _huge_cache(num_blocks, bs, h, d, torch.float16)
    assert (num_blocks - 1) * kc.stride(0) > 2**31
    g = torch.Generator().manual_seed(11)
    n = 50
    table = torch.tensor([num_blocks - 1, 5, num_blocks - 40, num_blocks - 2], dtype=torch.int32)
    k = torch.randn(n, h, d, generator=g).half()
    v = torch.randn(n, h, d, generator=g).half()
    _write(backend, k, v, kc, vc, table, 0, bs)
    assert torch.equal(kc[num_blocks - 1], k[:16]) and torch.equal(vc[num_blocks - 2, :2], v[48:])
    assert torch.equal(kc[num_blocks - 40], k[32:48])
    q = torch.randn(n, 2, d, generator=g).half()
    out = _attend(backend, q, kc, vc, [table], [n], [n], 0.25)
    # Oracle: dense attention over the contiguous tokens in fp32.
    kk = k.float().transpose(0, 1).repeat_interleave(2, 0)
    vv = v.float().transpose(0, 1).repeat_interleave(2, 0)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), kk, vv, attn_mask=mask, scale=0.25
    ).transpose(0, 1)
    torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_s11_copy_blocks_past_int32(backend):
    bs, h, d = 16, 1, 16
    num_blocks = 2**31 // (2 * bs * h * d) + 8  # the V plane starts past 2^31 elements
    try:
        kv = torch.empty(1, 2, num_blocks, bs, h, d, dtype=torch.float16)
    except RuntimeError as e:
        pytest.skip(f"cannot reserve a >2^31-element virtual cache: {e}")
    assert kv.stride(1) * 1 + (num_blocks - 1) * kv.stride(2) > 2**31
    src = torch.randn(2, bs, h, d).half()
    kv[0, :, num_blocks - 1] = src
    kernels.copy_blocks(kv, torch.tensor([[num_blocks - 1, num_blocks - 3]]), backend=backend)
    assert torch.equal(kv[0, :, num_blocks - 3], src)
