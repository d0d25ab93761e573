"""pagedkv.kernels: paged KV-cache GPU ops (Triton) with pure-torch reference twins.

Ops (PagedAttention, Kwon et al., SOSP'23; attention uses FlashAttention-2's online softmax,
Dao 2023):

- :func:`reshape_and_cache` -- write new K/V rows into cache slots by ``slot_mapping``.
- :func:`paged_attention` -- causal varlen attention over a paged cache (prefill, prefill
  with cached prefix, chunked prefill and decode in one call; GQA/MQA; sliding window).
- :func:`plan_paged_attention` -- validate a step's attention metadata and precompute the
  reference's slot indices and masks once, for every layer (:class:`AttentionPlan`).
- :func:`copy_blocks` -- copy-on-write block copies over all layers, K and V, one launch.
- :func:`swap_blocks` -- async GPU <-> pinned-CPU block swap on a caller-visible stream.

Cache layout: ONE tensor for all layers,
``kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]`` (0 = K, 1 = V);
``kv_cache[l, 0]`` / ``kv_cache[l, 1]`` are the per-layer ``key_cache`` / ``value_cache``.
Block copies and swaps take the whole tensor, so one plan covers every layer.

Modules: :mod:`.reference` (torch), :mod:`.plan` (per-step attention plans),
:mod:`.validate` (input checks), :mod:`.cache_write`,
:mod:`.attention`, :mod:`.block_copy` (Triton), :mod:`.swap` (async CUDA copies).

Dispatch: every op takes ``backend="auto" | "triton" | "torch"``. ``auto`` runs Triton when
the tensors are on CUDA and Triton is installed, else the reference in
:mod:`pagedkv.kernels.reference`. ``triton`` forces the kernels (on CPU tensors this needs
``TRITON_INTERPRET=1`` set before Triton is first imported). Triton is imported lazily, so
CPU-only use works without it (``backend="triton"`` without it raises
:class:`pagedkv.errors.MissingDependencyError`, as does importing this package without torch).
All ops raise ``pagedkv.errors.KernelInputError`` (a
``ValueError``) naming the bad tensor, what it got and what it expected, before launching
anything.
"""

from __future__ import annotations

import importlib
import importlib.util

from pagedkv._optional import missing_dependency, optional_imports
from pagedkv.errors import KernelInputError

with optional_imports("pagedkv.kernels", "torch"):
    import torch

    from . import reference
    from .plan import AttentionPlan, plan_paged_attention

__all__ = [
    "reshape_and_cache",
    "paged_attention",
    "plan_paged_attention",
    "AttentionPlan",
    "copy_blocks",
    "swap_blocks",
    "triton_available",
    "reference",
]

_BACKENDS = ("auto", "triton", "torch")


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _use_triton(backend: str, t: torch.Tensor, op: str) -> bool:
    if backend not in _BACKENDS:
        raise KernelInputError(f"{op}: backend is {backend!r}, expected one of {_BACKENDS}")
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_available():
            raise missing_dependency(f"pagedkv.kernels.{op}(backend='triton')", "triton", "torch")
        return True
    return bool(getattr(t, "is_cuda", False)) and triton_available()


def _impl(module: str):
    return importlib.import_module(f"{__name__}.{module}")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    plan: AttentionPlan | None = None,
    backend: str = "auto",
) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_size]`` into the per-layer caches
    ``[num_blocks, block_size, num_kv_heads, head_size]`` at int64 ``slot_mapping[T]``
    (slot = block * block_size + row; slots < 0 skipped). In place; see
    :func:`pagedkv.kernels.reference.reshape_and_cache`.

    ``plan``: an :class:`AttentionPlan` built with this ``slot_mapping``
    (``plan_paged_attention(..., slot_mapping=...)``); the torch reference then skips the
    per-layer value checks. The Triton kernel ignores it."""
    if _use_triton(backend, key_cache, "reshape_and_cache"):
        return _impl("cache_write").reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, plan=plan)


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
    plan: AttentionPlan | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal varlen attention of ``query[T, Hq, D]`` over the paged cache; returns
    ``[T, Hq, D]``. Query ``i`` of sequence ``b`` sits at position
    ``seq_lens[b] - q_len + i`` and sees positions ``<=`` it (and ``> pos - sliding_window``).

    ``plan``: an :class:`AttentionPlan` from :func:`plan_paged_attention`, built once per step
    from the same metadata tensors; the torch reference then skips the per-layer value checks
    and index/mask building (O(1) checks per call). The Triton kernel reads the metadata on
    the device itself and ignores the plan (except for its ``sliding_window`` when the call
    passes none). Full contract: :func:`pagedkv.kernels.reference.paged_attention`."""
    if _use_triton(backend, query, "paged_attention"):
        if sliding_window is None and plan is not None:
            sliding_window = plan.sliding_window
        return _impl("attention").paged_attention(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            query_start_loc,
            softmax_scale=softmax_scale,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            sliding_window=sliding_window,
            out=out,
        )
    return reference.paged_attention(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        softmax_scale=softmax_scale,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        sliding_window=sliding_window,
        out=out,
        plan=plan,
    )


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor, *, backend: str = "auto") -> None:
    """Copy-on-write: ``kv_cache[:, :, dst] = kv_cache[:, :, src]`` for each row of
    ``block_mapping[K, 2]`` over all layers and K/V in one launch (in place).
    See :func:`pagedkv.kernels.reference.copy_blocks`."""
    if _use_triton(backend, kv_cache, "copy_blocks"):
        return _impl("block_copy").copy_blocks(kv_cache, block_mapping)
    return reference.copy_blocks(kv_cache, block_mapping)


def swap_blocks(
    src_kv_cache: torch.Tensor,
    dst_kv_cache: torch.Tensor,
    block_mapping: torch.Tensor,
    stream: torch.cuda.Stream | None = None,
    *,
    backend: str = "auto",
) -> torch.cuda.Event | None:
    """Swap blocks between all-layer caches (GPU <-> pinned CPU). Asynchronous on ``stream``
    when either side is on CUDA (returns the event to wait on); synchronous on CPU (returns
    ``None``). ``backend`` is accepted for symmetry: the CUDA path uses async memcpy, not
    Triton. See :func:`pagedkv.kernels.swap.swap_blocks`."""
    if backend not in _BACKENDS:
        raise KernelInputError(f"swap_blocks: backend is {backend!r}, expected one of {_BACKENDS}")
    on_cuda = any(getattr(t, "is_cuda", False) for t in (src_kv_cache, dst_kv_cache))
    if backend != "torch" and on_cuda:
        return _impl("swap").swap_blocks(src_kv_cache, dst_kv_cache, block_mapping, stream)
    return reference.swap_blocks(src_kv_cache, dst_kv_cache, block_mapping, stream)
