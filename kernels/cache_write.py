"""Triton kernel: write new K/V rows into the paged cache by ``slot_mapping``.

One program per token: it reads the token's slot, skips it when negative (padding), and
copies ``num_kv_heads * head_size`` elements of K and of V to
``block * stride_block + row * stride_row``. Offsets are int64 so pools whose
``num_blocks * block_size * num_kv_heads * head_size`` exceeds 2^31 work (scenario S11).
"""

from __future__ import annotations

import torch

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.kernels.cache_write", "torch"):
    import triton
    import triton.language as tl

from . import configs as C
from . import validate as V
from .launch import KernelLaunch


# block_size only feeds a division; num_heads is a model constant: neither is specialised.
@triton.jit(do_not_specialize=["block_size", "num_heads"])
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    num_heads,
    head_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        row = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        m = (h < num_heads) & (d < head_size)
        k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d, mask=m)
        v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d, mask=m)
        dst = blk * stride_cb + row * stride_cs + h * stride_ch + d
        tl.store(kc_ptr + dst, k, mask=m)
        tl.store(vc_ptr + dst, v, mask=m)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton twin of :func:`pagedkv.kernels.reference.reshape_and_cache` (same contract).

    ``key_cache`` and ``value_cache`` must share strides (true for the per-layer views of the
    all-layer cache). Raises ``ValueError`` on bad input before launching.
    """
    V.check_reshape_and_cache("reshape_and_cache", key, value, key_cache, value_cache, slot_mapping)
    if key_cache.stride() != value_cache.stride():
        raise V.KernelInputError(
            f"reshape_and_cache: value_cache has strides {value_cache.stride()}, expected the "
            f"key_cache strides {key_cache.stride()}"
        )
    if key.shape[0] == 0:
        return
    cache_write_launch(key, value, key_cache, value_cache, slot_mapping).run()


def cache_write_launch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> KernelLaunch:
    """The launch :func:`reshape_and_cache` runs for validated inputs (one program per token,
    a ``next_pow2(num_kv_heads) x next_pow2(head_size)`` tile each)."""
    t, h, d = key.shape
    return KernelLaunch(
        _reshape_and_cache_kernel,
        (t,),
        (
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            key_cache.shape[1],
            h,
            d,
        ),
        dict(BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d), num_warps=C.CACHE_WRITE_WARPS),
    )
