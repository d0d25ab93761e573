"""KV cache groups of the engine's model: which layers attend alike, and what each group's
attention reads in a step.

A hybrid model mixes attention kinds: Gemma 3 interleaves sliding-window layers (window 512) with
full-attention ones, 5 to 1. Layers of one kind read the same KV positions, so they form one
*KV cache group* (vLLM V1's term; its hybrid KV cache manager keeps one block table per group):
a sliding-window group needs the blocks of the last ``W`` positions only, a full-attention group
every block. :func:`layer_windows` reads each layer's kind from the transformers config,
:func:`kv_cache_groups` groups the layers, and :func:`plan_groups` builds the step's attention
plans, one per group, each from that group's block table (:func:`group_block_table`).

One block table or one per group. The engine's KV cache manager keeps one block table per
sequence, so every group reads it: a sliding-window layer reads only the blocks inside its
window, and the blocks before the window stay allocated (the local layers' KV memory is not
bounded by the window in the engine yet). A hybrid manager (``pagedkv.HybridKVCacheManager``,
its steps as :class:`~pagedkv.tensors.GroupBatchTensors`) has one table and one slot mapping
per group, releasing a sliding-window group's blocks once they fall out of every future window
(their entries then the null block 0); :func:`group_block_table` and :func:`group_slot_mapping`
read either, and the kernels never read before a window (tests/kernels/test_sliding_window.py),
so the model runs on both (tests/engine/test_hybrid_models.py drives it from a hybrid
manager's steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

from pagedkv import kernels
from pagedkv.tensors import BatchTensors, GroupBatchTensors

from .errors import EngineConfigError

__all__ = [
    "StepTensors",
    "KVCacheGroup",
    "layer_windows",
    "kv_cache_groups",
    "group_block_table",
    "group_slot_mapping",
    "plan_groups",
]

#: transformers' ``config.layer_types`` entries the engine implements.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose attention reads the same KV positions.

    Attributes:
        sliding_window: window ``W`` in tokens (a query at position ``p`` sees positions in
            ``(p - W, p]``), or ``None`` for full attention.
        layers: indices of the decoder layers in the group, ascending.
    """

    sliding_window: int | None
    layers: tuple[int, ...]


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each decoder layer's sliding window in tokens (``None``: full attention).

    From ``config.layer_types`` when the config has it (transformers >= 5 fills it for Gemma 2/3,
    Qwen2, ...: ``"sliding_attention"`` takes ``config.sliding_window``); else from Gemma's
    ``sliding_window_pattern`` (layer ``i`` is full attention when ``(i + 1) % pattern == 0``);
    else every layer has ``config.sliding_window`` when set and ``use_sliding_window`` is not
    False (Mistral), or none.

    Raises:
        EngineConfigError: a layer type the engine does not implement (chunked-local attention,
            linear attention...), a sliding layer without a window, a window < 1, or a
            ``layer_types`` list whose length is not ``num_hidden_layers``; the message names it.
    """
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", None)
        if pattern and window:
            types = [SLIDING_ATTENTION if (i + 1) % int(pattern) else FULL_ATTENTION for i in range(n)]
        elif window and getattr(config, "use_sliding_window", True):
            types = [SLIDING_ATTENTION] * n
        else:
            types = [FULL_ATTENTION] * n
    types = list(types)
    if len(types) != n:
        raise EngineConfigError(f"config.layer_types has {len(types)} entries, expected num_hidden_layers={n}")
    out: list[int | None] = []
    for i, kind in enumerate(types):
        if kind == FULL_ATTENTION:
            out.append(None)
        elif kind == SLIDING_ATTENTION:
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise EngineConfigError(
                    f"layer {i} is {SLIDING_ATTENTION!r} but config.sliding_window is {window!r}, expected an int >= 1"
                )
            out.append(window)
        else:
            raise EngineConfigError(
                f"layer {i} has attention type {kind!r}, which the engine does not implement "
                f"(it implements {FULL_ATTENTION!r} and {SLIDING_ATTENTION!r})"
            )
    return tuple(out)


def kv_cache_groups(windows: Sequence[int | None]) -> tuple[KVCacheGroup, ...]:
    """The layers grouped by window, groups in order of their first layer.

    ``windows``: each layer's sliding window (``None``: full attention), as from
    :func:`layer_windows`. Layers with equal windows share a group.
    """
    order: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        order.setdefault(w, []).append(i)
    return tuple(KVCacheGroup(w, tuple(layers)) for w, layers in order.items())


StepTensors = BatchTensors | GroupBatchTensors
"""A step's kernel inputs: :class:`~pagedkv.tensors.BatchTensors` (one block table and slot
mapping for every group) or :class:`~pagedkv.tensors.GroupBatchTensors` (one per group)."""


def group_block_table(meta: StepTensors, group: int) -> torch.Tensor:
    """The block table the layers of KV cache group ``group`` read this step:
    int32 ``[B, max_blocks]``.

    From a :class:`~pagedkv.tensors.BatchTensors` (the engine's ``KVCacheManager``: one table
    for every group) its ``block_table``; from a :class:`~pagedkv.tensors.GroupBatchTensors` (a
    ``pagedkv.HybridKVCacheManager`` step) row ``group`` of its ``block_tables``
    ``[num_groups, B, max_blocks]``, where a sliding-window group's entries before the window
    may be the null block 0 (nothing there is read)."""
    table: torch.Tensor = meta.block_tables[group] if isinstance(meta, GroupBatchTensors) else meta.block_table
    return table


def group_slot_mapping(meta: StepTensors, group: int) -> torch.Tensor:
    """The cache slots the layers of KV cache group ``group`` write this step: int64 ``[T]``,
    ``meta.slot_mapping`` itself (:class:`~pagedkv.tensors.BatchTensors`) or its row ``group``
    (:class:`~pagedkv.tensors.GroupBatchTensors`, ``[num_groups, T]``)."""
    slots: torch.Tensor = meta.slot_mapping[group] if isinstance(meta, GroupBatchTensors) else meta.slot_mapping
    return slots


def plan_groups(
    groups: Sequence[KVCacheGroup], meta: StepTensors, *, cache_shape: Sequence[int], num_q_heads: int
) -> tuple[kernels.AttentionPlan, ...]:
    """The step's attention plans, one per KV cache group (same order), for the torch reference
    attention: each built from its group's block table, window and slot mapping, checking the
    slot mapping once for every layer's cache write.

    Args:
        groups: the model's KV cache groups.
        meta: the step's kernel inputs.
        cache_shape: the per-layer cache shape ``(num_blocks, block_size, num_kv_heads, head_size)``.
        num_q_heads: query heads per token.

    Raises:
        ValueError: metadata the plan refuses (see :func:`pagedkv.kernels.plan_paged_attention`).
    """
    return tuple(
        kernels.plan_paged_attention(
            group_block_table(meta, g),
            meta.seq_lens,
            meta.query_start_loc,
            cache_shape=tuple(cache_shape),
            num_q_heads=num_q_heads,
            sliding_window=grp.sliding_window,
            slot_mapping=group_slot_mapping(meta, g),
        )
        for g, grp in enumerate(groups)
    )
