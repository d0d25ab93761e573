"""Block swap between a GPU all-layer KV cache and a pinned CPU one (swap preemption).

For each ``(src, dst)`` pair, every layer's K and V block plane is copied with an
asynchronous ``cudaMemcpyAsync`` (``Tensor.copy_(non_blocking=True)``) on the caller's
stream; runs of consecutive src *and* dst ids are merged into one copy per plane, so a
contiguous swap plan costs ``2 * num_layers`` copies. Returns a CUDA event recorded after
the last copy: the caller waits on it (``event.synchronize()`` or
``stream.wait_event(event)``) before reading the destination or reusing the source blocks.
Mirrors the per-block memcpy loop of PagedAttention/vLLM's swap_blocks.
"""

from __future__ import annotations

import torch

from . import reference
from . import validate as V


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Merge ``(src, dst)`` pairs into ``(src0, dst0, length)`` runs of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for s, d in pairs:
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def swap_blocks(
    src_kv_cache: torch.Tensor,
    dst_kv_cache: torch.Tensor,
    block_mapping: torch.Tensor,
    stream: torch.cuda.Stream | None = None,
) -> torch.cuda.Event | None:
    """Copy blocks ``src_kv_cache[:, :, src] -> dst_kv_cache[:, :, dst]`` for every pair.

    Args:
        src_kv_cache, dst_kv_cache: ``[num_layers, 2, num_blocks_x, block_size, num_kv_heads,
            head_size]``, same dtype and per-block shape; one on CUDA and one a *pinned* CPU
            tensor (or both CUDA). Each must be contiguous.
        block_mapping: int32/int64 ``[K, 2]`` (src, dst) ids; must be on the CPU (the plan
            is read on the host to issue copies).
        stream: CUDA stream to issue on (default: the current stream).

    Returns:
        A ``torch.cuda.Event`` recorded on ``stream`` after the copies, or ``None`` when
        neither cache is on CUDA (then the copy is done synchronously by the reference).

    Raises:
        ValueError: bad shapes/dtypes/ids, a mapping not on the CPU, a CPU side that is not
            pinned (the copy would silently become synchronous), or non-contiguous caches.

    Cost: ``2 * num_layers * num_runs`` async copies of ``run_len * block_bytes`` each.
    """
    op = "swap_blocks"
    reference._check_swap(op, src_kv_cache, dst_kv_cache, block_mapping)
    if not (src_kv_cache.is_cuda or dst_kv_cache.is_cuda):
        return reference.swap_blocks(src_kv_cache, dst_kv_cache, block_mapping)
    V.check_tensor(op, "block_mapping", block_mapping, device=torch.device("cpu"))
    for name, t in (("src_kv_cache", src_kv_cache), ("dst_kv_cache", dst_kv_cache)):
        V.check_tensor(op, name, t, contiguous=True)
        if not t.is_cuda and not t.is_pinned():
            raise V.KernelInputError(f"{op}: {name} is a pageable CPU tensor, expected pinned memory (pin_memory=True)")
    stream = stream if stream is not None else torch.cuda.current_stream()
    runs = _runs([tuple(p) for p in block_mapping.tolist()])
    layers = src_kv_cache.shape[0]
    with torch.cuda.stream(stream):
        for layer in range(layers):
            for kv in range(2):
                s_plane, d_plane = src_kv_cache[layer, kv], dst_kv_cache[layer, kv]
                for s0, d0, n in runs:
                    d_plane[d0 : d0 + n].copy_(s_plane[s0 : s0 + n], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event
