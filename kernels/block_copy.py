"""Triton kernel: copy-on-write block copies over every layer's K and V in one launch.

Works on the all-layer cache ``kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_size]`` (PagedAttention's copy-on-write, Kwon et al., SOSP'23): grid
``(num_pairs, num_layers * 2, chunks_per_block)``; each program copies one chunk of one block
plane from ``src`` to ``dst``. Offsets are int64.
"""

from __future__ import annotations

import torch

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.kernels.block_copy", "torch"):
    import triton
    import triton.language as tl

from . import configs as C
from . import validate as V
from .launch import KernelLaunch
from .reference import _check_kv_cache


@triton.jit
def _copy_blocks_kernel(
    kv_ptr,
    map_ptr,
    stride_plane,
    stride_block,
    block_numel,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(map_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(map_ptr + 2 * pair + 1).to(tl.int64)
    off = chunk * BLOCK + tl.arange(0, BLOCK)
    m = off < block_numel
    base = kv_ptr + plane * stride_plane
    x = tl.load(base + src * stride_block + off, mask=m)
    tl.store(base + dst * stride_block + off, x, mask=m)


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Triton twin of :func:`pagedkv.kernels.reference.copy_blocks` (same contract).

    ``kv_cache`` must be contiguous. ``block_mapping`` may live on the CPU (it is moved to
    the cache's device; values are validated there first) or on the cache's device.
    Raises ``ValueError`` on bad input before launching.
    """
    _check_kv_cache("copy_blocks", "kv_cache", kv_cache)
    V.check_tensor("copy_blocks", "kv_cache", kv_cache, contiguous=True)
    V.check_block_mapping("copy_blocks", block_mapping, kv_cache.shape[2], kv_cache.shape[2], cow=True)
    if block_mapping.device.type != "cpu":
        V.check_tensor("copy_blocks", "block_mapping", block_mapping, device=kv_cache.device)
    k = block_mapping.shape[0]
    if k == 0 or kv_cache.numel() == 0:
        return
    copy_blocks_launch(kv_cache, block_mapping.to(kv_cache.device).contiguous()).run()


def copy_blocks_launch(kv_cache: torch.Tensor, mapping: torch.Tensor) -> KernelLaunch:
    """The launch :func:`copy_blocks` runs for a validated contiguous cache and a mapping on
    its device: grid ``(pairs, layers * 2, chunks)``, chunks of ``min(COPY_CHUNK,
    next_pow2(block_numel))`` elements."""
    block_numel = kv_cache.stride(2)
    chunk = min(C.COPY_CHUNK, triton.next_power_of_2(block_numel))
    return KernelLaunch(
        _copy_blocks_kernel,
        (mapping.shape[0], kv_cache.shape[0] * 2, triton.cdiv(block_numel, chunk)),
        (kv_cache, mapping, kv_cache.stride(1), kv_cache.stride(2), block_numel),
        dict(BLOCK=chunk, num_warps=C.COPY_WARPS),
    )
