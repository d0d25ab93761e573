"""Every Triton op against its torch reference, on CPU under TRITON_INTERPRET=1.

Shapes are small: the interpreter costs ~10-20 ms per program instance."""

import pytest
import torch

pytest.importorskip("triton")

from helpers.kernel_cases import dense_attention, make_case, poison_unread_slots  # noqa: E402

import kernels  # noqa: E402
from kernels import attention, block_copy, cache_write, reference  # noqa: E402

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
# Tolerance of kernel vs fp32 reference: fp32 exact-ish; half types round p before P@V.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _close(got, want, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------- reshape_and_cache


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("head_size,num_kv_heads,block_size", [(64, 2, 16), (80, 3, 8), (16, 1, 128)])
def test_reshape_and_cache_matches_reference(dtype, head_size, num_kv_heads, block_size):
    g = torch.Generator().manual_seed(1)
    t, nb = 21, 6
    key = torch.randn(t, num_kv_heads, head_size, generator=g).to(dtype)
    value = torch.randn(t, num_kv_heads, head_size, generator=g).to(dtype)
    slots = torch.randperm((nb - 1) * block_size, generator=g)[:t] + block_size  # block 0 is null
    slots[[2, 9, 20]] = -1  # padding tokens are skipped
    caches = [torch.randn(nb, block_size, num_kv_heads, head_size, generator=g).to(dtype) for _ in range(2)]
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)
    tri_k, tri_v = caches[0].clone(), caches[1].clone()
    cache_write.reshape_and_cache(key, value, tri_k, tri_v, slots)
    assert torch.equal(tri_k, ref_k) and torch.equal(tri_v, ref_v)
    # The reference itself: written rows hold the token, untouched rows keep old contents.
    keep = slots >= 0
    s = slots[keep]
    assert torch.equal(ref_k.view(-1, num_kv_heads, head_size)[s], key[keep])
    written = torch.zeros(nb * block_size, dtype=torch.bool)
    written[s] = True
    assert torch.equal(
        ref_v.view(-1, num_kv_heads, head_size)[~written], caches[1].view(-1, num_kv_heads, head_size)[~written]
    )


def test_reshape_and_cache_on_all_layer_view():
    # Per-layer views of the all-layer cache are what the engine passes.
    kv = torch.zeros(3, 2, 5, 8, 2, 16)
    key = torch.randn(4, 2, 16)
    value = torch.randn(4, 2, 16)
    slots = torch.tensor([8, 9, 39, -5])  # block 0 is the null block
    cache_write.reshape_and_cache(key, value, kv[1, 0], kv[1, 1], slots)
    want = torch.zeros_like(kv)
    reference.reshape_and_cache(key, value, want[1, 0], want[1, 1], slots)
    assert torch.equal(kv, want)
    assert torch.equal(kv[1, 0, 4, 7], key[2]) and torch.equal(kv[1, 1, 1, 1], value[1])
    assert torch.equal(kv[1, 0, 1, 0], key[0]) and kv[1, :, 0].abs().sum() == 0
    assert kv[0].abs().sum() == 0 and kv[2].abs().sum() == 0


# ---------------------------------------------------------------- paged_attention

MIXED = [(0, 13), (37, 1), (90, 1), (21, 9), (0, 1)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_attention_mixed_batch(dtype, group):
    case = make_case(MIXED, block_size=16, num_kv_heads=1, group=group, head_size=64, dtype=dtype, seed=group)
    ref = reference.paged_attention(*case.attn_args(), softmax_scale=0.125)
    out = attention.paged_attention(*case.attn_args(), softmax_scale=0.125)
    assert out.dtype == dtype
    _close(out, ref, dtype)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_attention_block_sizes_independent_of_tile(block_size):
    # block_n=16 < block_size and block_n=32 > block_size=8/16 both read the right pages.
    case = make_case(
        [(70, 1), (5, 20), (140, 3)], block_size=block_size, num_kv_heads=2, group=2, head_size=32, seed=block_size
    )
    ref = reference.paged_attention(*case.attn_args(), softmax_scale=0.2)
    for bn in (16, 32):
        out = attention.paged_attention(*case.attn_args(), softmax_scale=0.2, block_n=bn)
        _close(out, ref, torch.float32)


@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_attention_head_sizes(head_size):
    case = make_case([(30, 1), (9, 7)], block_size=16, num_kv_heads=1, group=2, head_size=head_size)
    scale = head_size**-0.5
    out = attention.paged_attention(*case.attn_args(), softmax_scale=scale)
    _close(out, dense_attention(case, scale), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [96, 192])
def test_attention_half_precision_tiles(dtype, head_size):
    # The half-precision decode and prefill tiles of the wider BLOCK_D entries (128, 256).
    case = make_case(
        [(30, 1), (9, 20)], block_size=16, num_kv_heads=1, group=2, head_size=head_size, dtype=dtype, seed=head_size
    )
    ref = reference.paged_attention(*case.attn_args(), softmax_scale=head_size**-0.5)
    out = attention.paged_attention(*case.attn_args(), softmax_scale=head_size**-0.5)
    _close(out, ref, dtype)


@pytest.mark.parametrize("window", [1, 10, 40])
def test_attention_sliding_window(window):
    case = make_case([(60, 1), (0, 30), (25, 8)], block_size=8, num_kv_heads=1, group=2, head_size=32)
    ref = reference.paged_attention(*case.attn_args(), softmax_scale=0.3, sliding_window=window)
    out = attention.paged_attention(*case.attn_args(), softmax_scale=0.3, sliding_window=window)
    _close(out, ref, torch.float32)


@pytest.mark.parametrize("window", [None, 8])
def test_attention_and_reference_ignore_unread_slots(window):
    # NaN in every slot attention must not read (block 0, the tails of last blocks, slots
    # before the window): the kernel and the reference both give the dense result.
    case = make_case([(37, 1), (5, 1), (21, 9), (0, 13)], block_size=16, num_kv_heads=1, group=2, head_size=32)
    want = dense_attention(case, 0.2, window)
    poison_unread_slots(case, float("nan"), window)
    for op in (attention.paged_attention, reference.paged_attention):
        _close(op(*case.attn_args(), softmax_scale=0.2, sliding_window=window), want, torch.float32)


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_split_kv_merge(splits, dtype):
    # Flash-decoding path: KV range partitioned, partials merged; includes splits that see
    # no key at all for some rows (short sequences, window).
    case = make_case([(150, 1), (3, 1), (40, 4)], block_size=16, num_kv_heads=2, group=4, head_size=32, dtype=dtype)
    for window in (None, 20):
        ref = reference.paged_attention(*case.attn_args(), softmax_scale=0.2, sliding_window=window)
        out = attention.paged_attention(
            *case.attn_args(), softmax_scale=0.2, sliding_window=window, num_kv_splits=splits
        )
        _close(out, ref, dtype)


def test_attention_split_kv_merge_loops_over_split_chunks():
    # More splits than the merge kernel takes per step (configs.MERGE_BLOCK_S): its two passes
    # loop over chunks of splits; many splits see no key at all for the short sequence.
    from kernels import configs

    splits = configs.MERGE_BLOCK_S + 4
    case = make_case(
        [(300, 1), (5, 1)], block_size=8, num_kv_heads=1, group=2, head_size=32, dtype=torch.float16, seed=7
    )
    ref = reference.paged_attention(*case.attn_args(), softmax_scale=0.2)
    out = attention.paged_attention(*case.attn_args(), softmax_scale=0.2, num_kv_splits=splits, block_n=16)
    _close(out, ref, torch.float16)


def test_attention_out_buffer_and_zero_query_sequence():
    case = make_case([(20, 3), (50, 0), (7, 1)], block_size=16, num_kv_heads=1, group=1, head_size=32)
    out = torch.full_like(case.query, float("nan"))
    ret = attention.paged_attention(*case.attn_args(), softmax_scale=0.2, out=out, max_query_len=3, max_seq_len=50)
    assert ret is out
    _close(out, dense_attention(case, 0.2), torch.float32)


def test_attention_dispatch_backends():
    case = make_case([(12, 4)], block_size=8, num_kv_heads=1, group=2, head_size=16)
    a = kernels.paged_attention(*case.attn_args(), softmax_scale=0.25, backend="triton")
    b = kernels.paged_attention(*case.attn_args(), softmax_scale=0.25)  # CPU -> reference
    _close(a, b, torch.float32)
    with pytest.raises(ValueError, match="backend is 'cuda', expected one of"):
        kernels.paged_attention(*case.attn_args(), softmax_scale=0.25, backend="cuda")


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_attention_large_mixed_vs_dense(group, block_size):
    seqs = [(1000, 1), (0, 200), (300, 120), (511, 1), (64, 64)]
    case = make_case(seqs, block_size=block_size, num_kv_heads=2, group=group, head_size=64)
    out = attention.paged_attention(*case.attn_args(), softmax_scale=0.125)
    _close(out, dense_attention(case, 0.125), torch.float32)


# ---------------------------------------------------------------- copy_blocks


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_copy_blocks_matches_reference(dtype, idx_dtype):
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(3, 2, 10, 8, 2, 24, generator=g).to(dtype)
    mapping = torch.tensor([[1, 7], [4, 2], [1, 9]], dtype=idx_dtype)  # one src copied twice
    ref = kv.clone()
    reference.copy_blocks(ref, mapping)
    tri = kv.clone()
    block_copy.copy_blocks(tri, mapping)
    assert torch.equal(tri, ref)
    for s, d in mapping.tolist():
        assert torch.equal(ref[:, :, d], kv[:, :, s])
    untouched = [b for b in range(10) if b not in (7, 2, 9)]
    assert torch.equal(ref[:, :, untouched], kv[:, :, untouched])


def test_copy_blocks_empty_mapping_is_noop():
    kv = torch.randn(1, 2, 4, 4, 1, 8)
    before = kv.clone()
    kernels.copy_blocks(kv, torch.empty(0, 2, dtype=torch.int64), backend="triton")
    assert torch.equal(kv, before)


# ---------------------------------------------------------------- swap_blocks (CPU fallback)


def test_swap_blocks_cpu_fallback_synchronous():
    src = torch.randn(2, 2, 6, 4, 1, 8)
    dst = torch.zeros(2, 2, 3, 4, 1, 8)
    mapping = torch.tensor([[5, 0], [2, 2]])
    assert kernels.swap_blocks(src, dst, mapping) is None
    assert torch.equal(dst[:, :, 0], src[:, :, 5]) and torch.equal(dst[:, :, 2], src[:, :, 2])
    assert dst[:, :, 1].abs().sum() == 0


def test_swap_runs_merge_consecutive_pairs():
    from kernels.swap import _runs

    assert _runs([(3, 10), (4, 11), (5, 12), (9, 1), (10, 3), (11, 4)]) == [(3, 10, 3), (9, 1, 1), (10, 3, 2)]
