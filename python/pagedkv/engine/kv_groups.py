"""KV cache groups of the engine's model: which layers attend alike, and what each group's
attention reads in a step.

A hybrid model mixes attention kinds: Gemma 3 interleaves sliding-window layers (window 512) with
full-attention ones, 5 to 1. Layers of one kind read the same KV positions, so they can share
one *KV cache group* (vLLM V1's term; its hybrid KV cache manager keeps one block table per
group): a sliding-window group needs the blocks of the last ``W`` positions only, a
full-attention group every block. :func:`layer_windows` reads each layer's kind from the
transformers config, :func:`kv_cache_groups` groups the layers, and :func:`plan_groups` builds
the step's attention plans, one per group, each from that group's block table
(:func:`group_block_table`).

Groups of equal layer counts. All groups share one pool of equal-size pages, and a block id
names one page in every layer of the group that holds it. The KV cache is one tensor per
*layer slot* (``[layers_per_group, 2, num_blocks, ...]``, layer ``i`` at its index within its
group, :attr:`KVCacheGroup.layers`), so a page costs the same in every group only when every
group has the same number of layers: :func:`kv_cache_groups` splits each kind into groups of
``layers_per_group`` layers (as vLLM's hybrid allocator does). Gemma 3 270M's 15 sliding and 3
full layers become five sliding-window groups of 3 layers and one full-attention group of 3,
and one block holds ``block_size`` tokens of K and V of 3 layers.

One block table or one per group. Every model runs on ``pagedkv.KVCacheManager``. A model
without sliding-window layers has one group of every layer: its manager has the one
full-attention group of ``CacheConfig(num_blocks, block_size)`` (one block table per sequence: a
:class:`~pagedkv.tensors.BatchTensors` of one group). A model with them gets one manager group
per KV cache group (:func:`group_specs`, the groups form of ``CacheConfig``; its steps as a
:class:`~pagedkv.tensors.BatchTensors` of ``G`` groups): one table and one slot mapping per
group, a sliding-window group's blocks released once they fall out of every future window (their
entries then the null block 0). :func:`group_block_table` and :func:`group_slot_mapping` read
either, and the kernels never read before a window (tests/kernels/test_sliding_window.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

from pagedkv import kernels
from pagedkv.tensors import BatchTensors

from .errors import EngineConfigError

__all__ = [
    "StepTensors",
    "KVCacheGroup",
    "layer_windows",
    "kv_cache_groups",
    "layers_per_group",
    "group_specs",
    "group_block_table",
    "group_slot_mapping",
    "plan_groups",
    "STATE",
]

#: transformers' ``config.layer_types`` entries the engine implements.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: :attr:`KVCacheGroup.kind` of a group of recurrent (state-space / linear-attention) layers.
STATE = "state"


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose attention reads the same KV positions and shares one block table.

    Attributes:
        sliding_window: window ``W`` in tokens (a query at position ``p`` sees positions in
            ``(p - W, p]``), or ``None`` for full attention (and for a state group).
        layers: indices of the decoder layers in the group, ascending; layer ``layers[j]``
            keeps its K/V in layer slot ``j`` of the KV cache.
        kind: ``"attention"`` (K/V per token) or ``"state"``: recurrent layers (Mamba-2...)
            whose blocks each hold the state of every layer of the group after an aligned
            prefix (:mod:`pagedkv.engine.state_pages`), a manager group of kind ``"state"``.
    """

    sliding_window: int | None
    layers: tuple[int, ...]
    kind: str = "attention"

    @property
    def is_state(self) -> bool:
        """Whether the group holds recurrent states rather than K/V."""
        return self.kind == STATE


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


def layers_per_group(windows: Sequence[int | None]) -> int:
    """Layers per KV cache group: the layer count of the smallest attention kind (layers of one
    window), or the largest kind's when it is within 25 % of the smallest (then every kind fits
    one group, the last groups of the other kinds padded). One kind: all its layers. vLLM's
    hybrid allocator sizes its groups the same way, so no page is left unused in a kind that
    divides evenly (Gemma 3 270M: 15 sliding and 3 full layers -> groups of 3)."""
    counts: dict[int | None, int] = {}
    for w in windows:
        counts[w] = counts.get(w, 0) + 1
    if not counts:
        return 0
    low, high = min(counts.values()), max(counts.values())
    return high if high < 1.25 * low else low


def kv_cache_groups(windows: Sequence[int | None], *, split: bool = True) -> tuple[KVCacheGroup, ...]:
    """The layers grouped by window into groups of :func:`layers_per_group` layers (the last
    group of a kind may hold fewer), groups in order of their first layer.

    ``windows``: each layer's sliding window (``None``: full attention), as from
    :func:`layer_windows`. Only layers with equal windows share a group; a model of one kind
    gets one group of every layer. ``split=False``: one group per window, unsplit (for one
    block table shared by every layer, where groups only pick each layer's window).
    """
    size = layers_per_group(windows) if split else len(windows)
    order: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        order.setdefault(w, []).append(i)
    groups = [
        KVCacheGroup(w, tuple(layers[k : k + size])) for w, layers in order.items() for k in range(0, len(layers), size)
    ]
    return tuple(sorted(groups, key=lambda g: g.layers[0]))


def group_specs(
    groups: Sequence[KVCacheGroup],
    num_layers: int,
    *,
    block_size: int,
    bytes_per_token: int,
    state_bytes: int | None = None,
) -> tuple[list[Any], list[int]]:
    """The groups form of a ``pagedkv.CacheConfig`` for a model with these KV cache groups:
    ``(specs, layer_groups)``, one ``pagedkv.KVCacheGroupSpec`` per group (``"full"`` or
    ``"sliding_window"`` with its window), all of ``block_size`` tokens and ``bytes_per_token``
    bytes per token and layer (``2 * num_kv_heads * head_size * dtype bytes``), and each of the
    ``num_layers`` layers' group index. Retention interval 0 (the config's default): a windowed
    group caches every full block, so a prefix hit can end at any block boundary. A state group
    (:attr:`KVCacheGroup.is_state`) is a ``"state"`` spec of the same page (``block_size`` is its
    alignment unit) whose state takes ``state_bytes`` of it; a layer in no group (an MLP-only
    layer) gets index 0, and only the first ``num_layers`` layers are listed.

    Raises:
        pagedkv.InvalidConfigError: a size above the core's limits (names it).
    """
    import pagedkv

    specs = [
        pagedkv.KVCacheGroupSpec("state", block_size, bytes_per_token, state_bytes=state_bytes)
        if g.is_state
        else pagedkv.KVCacheGroupSpec("full", block_size, bytes_per_token)
        if g.sliding_window is None
        else pagedkv.KVCacheGroupSpec("sliding_window", block_size, bytes_per_token, window=g.sliding_window)
        for g in groups
    ]
    layer_groups = [0] * num_layers
    for gi, g in enumerate(groups):
        for li in g.layers:
            layer_groups[li] = gi
    return specs, layer_groups


StepTensors = BatchTensors
"""A step's kernel inputs: a :class:`~pagedkv.tensors.BatchTensors` with one block table and slot
mapping per KV cache group of its manager (one for a manager of one group, serving every group of
the model)."""


def group_block_table(meta: StepTensors, group: int) -> torch.Tensor:
    """The block table the layers of KV cache group ``group`` read this step:
    int32 ``[B, max_blocks]``.

    Row ``group`` of ``meta.block_tables`` ``[num_groups, B, max_blocks]`` (a manager group per
    KV cache group of the model), where a sliding-window group's entries before the window may
    be the null block 0 (nothing there is read); from a one-group
    :class:`~pagedkv.tensors.BatchTensors` (one table for every group of the model) its one
    table."""
    table: torch.Tensor = meta.block_tables[group if meta.num_groups > 1 else 0]
    return table


def group_slot_mapping(meta: StepTensors, group: int) -> torch.Tensor:
    """The cache slots the layers of KV cache group ``group`` write this step: int64 ``[T]``,
    row ``group`` of ``meta.slot_mappings`` (``[num_groups, T]``; its one row for a one-group
    step, one slot mapping for every group of the model)."""
    slots: torch.Tensor = meta.slot_mappings[group if meta.num_groups > 1 else 0]
    return slots


def plan_groups(
    groups: Sequence[KVCacheGroup], meta: StepTensors, *, cache_shape: Sequence[int], num_q_heads: int
) -> tuple[kernels.AttentionPlan | None, ...]:
    """The step's attention plans, one per KV cache group (same order), for the torch reference
    attention: each built from its group's block table, window and slot mapping, checking the
    slot mapping once for every layer's cache write; ``None`` for a state group (no attention).

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
        if not grp.is_state
        else None
        for g, grp in enumerate(groups)
    )
