"""Attention plans: the per-step half of the torch reference ``paged_attention``.

A step's attention metadata (block table, sequence lengths, query offsets) is the same for
every layer of the model, so everything derived from it -- validation of the values, which
sequences are decodes and which are prefills, the cache slots each sequence reads, the causal
and sliding-window masks -- is built once per step by :func:`plan_paged_attention` and reused
by every layer's :func:`pagedkv.kernels.reference.paged_attention` call, which is then left
with O(1) tensor checks, the K/V gathers and the math. This is the plan/run split of
FlashInfer (Ye et al., 2025: "plan" once per batch, "run" per layer), written for the CPU
reference.

The Triton kernel reads the metadata on the device and does not use plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import validate as V

__all__ = ["AttentionPlan", "PrefillPart", "DecodeGroup", "plan_paged_attention"]

# Upper bound on gathered K elements per batched decode group (keeps CPU memory bounded).
DECODE_GROUP_ELEMS = 1 << 26


@dataclass(frozen=True)
class PrefillPart:
    """One sequence with ``q_len > 1`` (prefill, prefill over a cached prefix, chunked prefill).

    Attributes:
        seq: index of the sequence in the batch.
        q_start, q_end: its query rows ``query[q_start:q_end]`` (``q_len = q_end - q_start``).
        slots: int64 ``[S]`` cache slot (``block * block_size + row``) of each of its ``S =
            seq_len`` cached positions, in position order.
        mask: bool ``[G * q_len, S]``; row ``g * q_len + i`` (query ``i`` of any query head in
            a KV group of ``G`` heads) may see position ``j`` (causal, and inside the window).
    """

    seq: int
    q_start: int
    q_end: int
    slots: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class DecodeGroup:
    """Decode sequences (``q_len == 1``) attended together as one padded batch.

    Attributes:
        rows: query row of each of the ``n`` sequences: a ``slice`` when they are one
            contiguous run (cheaper to read and write), else an int64 ``[n]`` tensor.
        slots: int64 ``[n, S]`` cache slots of positions ``0..S-1`` (``S`` = the group's
            longest ``seq_len``); positions past a sequence's end point at slot 0 (masked).
        mask: bool ``[n, 1, 1, S]``, True where the sequence's single query sees the position.
    """

    rows: slice | torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor

    @property
    def size(self) -> int:
        """Number of sequences ``n``."""
        return self.slots.shape[0]


@dataclass(frozen=True)
class AttentionPlan:
    """Validated, precomputed attention metadata of one step, shared by all layers.

    Build with :func:`plan_paged_attention`; pass as ``plan=`` to
    :func:`pagedkv.kernels.paged_attention` together with the same ``block_table``,
    ``seq_lens`` and ``query_start_loc`` tensors it was built from.

    Attributes:
        block_table, seq_lens, query_start_loc: the metadata tensors the plan was built from
            (int32; identity is checked per call, O(1)).
        cache_shape: per-layer cache shape ``(num_blocks, block_size, num_kv_heads,
            head_size)`` the plan is valid for.
        num_q_heads: query heads per token.
        num_tokens: query rows ``T`` (``query_start_loc[-1]``).
        sliding_window: window in tokens, or None.
        device: device of the metadata, caches and query.
        prefills: one :class:`PrefillPart` per sequence with ``q_len > 1``.
        decodes: :class:`DecodeGroup` s covering every sequence with ``q_len == 1``.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    cache_shape: tuple[int, int, int, int]
    num_q_heads: int
    num_tokens: int
    sliding_window: int | None
    device: torch.device
    prefills: tuple[PrefillPart, ...] = field(repr=False)
    decodes: tuple[DecodeGroup, ...] = field(repr=False)

    def check_call(
        self,
        op: str,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        block_table: object,
        seq_lens: object,
        query_start_loc: object,
        sliding_window: int | None,
    ) -> None:
        """O(1) check that a per-layer call matches this plan (same metadata tensors, cache
        shape, head count, token count and window).

        Raises:
            ValueError: naming the argument that differs from what the plan was built for.
        """
        for name, got, want in (
            ("block_table", block_table, self.block_table),
            ("seq_lens", seq_lens, self.seq_lens),
            ("query_start_loc", query_start_loc, self.query_start_loc),
        ):
            if got is not want:
                raise V.KernelInputError(
                    f"{op}: {name} is not the tensor the plan was built from, "
                    "expected the same tensor object as passed to plan_paged_attention"
                )
        if tuple(key_cache.shape) != self.cache_shape:
            raise V.KernelInputError(
                f"{op}: key_cache has shape {tuple(key_cache.shape)}, expected "
                f"{self.cache_shape} (the plan's cache_shape)"
            )
        if query.shape[0] != self.num_tokens or query.shape[1] != self.num_q_heads:
            raise V.KernelInputError(
                f"{op}: query has shape {tuple(query.shape)}, expected "
                f"({self.num_tokens}, {self.num_q_heads}, {self.cache_shape[3]}) "
                "(the plan's tokens and heads)"
            )
        if not V.same_device(key_cache.device, self.device):
            raise V.KernelInputError(
                f"{op}: key_cache is on device {key_cache.device}, expected device {self.device} (the plan's)"
            )
        if sliding_window is not None and sliding_window != self.sliding_window:
            allowed = (
                "None (the plan has no window)"
                if self.sliding_window is None
                else f"None or {self.sliding_window} (the plan's window)"
            )
            raise V.KernelInputError(f"{op}: sliding_window is {sliding_window!r}, expected {allowed}")


def plan_paged_attention(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    cache_shape: Sequence[int],
    num_q_heads: int,
    sliding_window: int | None = None,
    num_tokens: int | None = None,
) -> AttentionPlan:
    """Validate one step's attention metadata and precompute what every layer's reference
    attention needs (FlashInfer-style plan; see the module docs).

    Args:
        block_table: int32 ``[B, max_blocks]`` physical block ids; entries past a sequence's
            ``ceil(seq_len / block_size)`` blocks are ignored (never read).
        seq_lens: int32 ``[B]`` tokens in cache per sequence, this step's tokens included.
        query_start_loc: int32 ``[B+1]`` prefix sums of query lengths (tokens).
        cache_shape: the per-layer ``key_cache`` shape ``(num_blocks, block_size,
            num_kv_heads, head_size)``.
        num_q_heads: query heads per token, a multiple of ``num_kv_heads`` (GQA/MQA).
        sliding_window: optional window in tokens (>= 1), counting the query's own position.
        num_tokens: query rows ``T`` the layers will pass; checked against
            ``query_start_loc[-1]`` when given (default: taken from it).

    Returns:
        An :class:`AttentionPlan` on ``block_table``'s device.

    Raises:
        ValueError: bad dtype/shape/device, offsets not running 0..T, a query longer than its
            sequence, a block table too narrow or holding ids outside ``[0, num_blocks)``, a
            bad window or head count (the message names the argument).

    Cost: O(B * max_blocks) validation plus O(sum_b G * q_len_b * seq_len_b) mask elements
    for prefills and O(B * max_seq_len) slot and mask elements for decodes; the metadata is
    read to the host once.
    """
    return build_plan(
        "plan_paged_attention",
        block_table,
        seq_lens,
        query_start_loc,
        cache_shape=cache_shape,
        num_q_heads=num_q_heads,
        sliding_window=sliding_window,
        num_tokens=num_tokens,
        device=None,
    )


def build_plan(
    op: str,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    cache_shape: Sequence[int],
    num_q_heads: int,
    sliding_window: int | None,
    num_tokens: int | None,
    device: torch.device | None,
) -> AttentionPlan:
    """:func:`plan_paged_attention` with the op name ``op`` in its error messages and the
    metadata expected on ``device`` (default: ``block_table``'s). The plan-less
    ``paged_attention`` builds its plan through here with the caches' device."""
    if len(cache_shape) != 4:
        raise V.KernelInputError(
            f"{op}: cache_shape is {tuple(cache_shape)}, expected (num_blocks, block_size, num_kv_heads, head_size)"
        )
    num_blocks, bs, hkv, d = (int(x) for x in cache_shape)
    if num_q_heads < 1 or num_q_heads % hkv != 0:
        raise V.KernelInputError(
            f"{op}: num_q_heads is {num_q_heads}, expected a positive multiple of num_kv_heads={hkv}"
        )
    if device is not None:
        dev = device
    else:
        dev = block_table.device if isinstance(block_table, torch.Tensor) else torch.device("cpu")
    V.check_attention_metadata(
        op,
        block_table,
        seq_lens,
        query_start_loc,
        num_tokens=num_tokens,
        num_blocks=num_blocks,
        block_size=bs,
        device=dev,
        sliding_window=sliding_window,
    )
    qsl = query_start_loc.tolist()
    if qsl[0] != 0:  # metadata off the CPU is not value-checked above
        raise V.KernelInputError(f"{op}: query_start_loc starts at {qsl[0]}, expected 0")
    g = num_q_heads // hkv
    sls = seq_lens.tolist()
    bt_host = block_table.to("cpu", torch.int64)
    prefills = []
    decode = []
    for b, sl in enumerate(sls):
        q_len = qsl[b + 1] - qsl[b]
        if q_len == 1:
            decode.append(b)
        elif q_len > 1:
            pos = torch.arange(sl)
            slots = bt_host[b, pos // bs] * bs + pos % bs
            qpos = torch.arange(sl - q_len, sl).unsqueeze(1)
            mask = pos.unsqueeze(0) <= qpos
            if sliding_window is not None:
                mask &= pos.unsqueeze(0) > qpos - sliding_window
            prefills.append(PrefillPart(b, qsl[b], qsl[b + 1], slots.to(dev), mask.repeat(g, 1).to(dev)))
    return AttentionPlan(
        block_table=block_table,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        cache_shape=(num_blocks, bs, hkv, d),
        num_q_heads=num_q_heads,
        num_tokens=int(qsl[-1]),
        sliding_window=sliding_window,
        device=dev,
        prefills=tuple(prefills),
        decodes=_decode_groups(decode, sls, qsl, bt_host, bs, hkv * d, sliding_window, dev),
    )


def _decode_groups(
    decode: list[int],
    sls: list[int],
    qsl: list[int],
    bt_host: torch.Tensor,
    bs: int,
    elems_per_pos: int,
    sliding_window: int | None,
    dev: torch.device,
) -> tuple[DecodeGroup, ...]:
    """Decode sequences cut into groups whose padded K gather stays under
    :data:`DECODE_GROUP_ELEMS` elements (``elems_per_pos`` = num_kv_heads * head_size)."""
    if not decode:
        return ()
    longest = max(sls[b] for b in decode)
    if len(decode) * longest * elems_per_pos <= DECODE_GROUP_ELEMS:
        # One group in batch order: its query rows are then usually one contiguous run.
        cuts = [decode]
    else:
        # Length-sorted, so each group pads to a similar length.
        order = sorted(decode, key=lambda b: sls[b])
        cuts = []
        i = 0
        while i < len(order):
            j = i + 1
            while j < len(order) and (j + 1 - i) * sls[order[j]] * elems_per_pos <= DECODE_GROUP_ELEMS:
                j += 1
            cuts.append(order[i:j])
            i = j
    groups = []
    for grp in cuts:
        smax = max(sls[b] for b in grp)
        idx = torch.tensor(grp)
        pos = torch.arange(smax)
        lens = torch.tensor([sls[b] for b in grp]).unsqueeze(1)
        live = pos.unsqueeze(0) < lens  # the query sits at position len-1: causal == inside
        mask = live.clone()
        if sliding_window is not None:
            mask &= pos.unsqueeze(0) > lens - 1 - sliding_window
        slots = bt_host[idx][:, pos // bs] * bs + pos % bs
        slots = torch.where(live, slots, torch.zeros((), dtype=torch.int64))  # dead columns: slot 0
        row_list = [qsl[b] for b in grp]
        run = row_list == list(range(row_list[0], row_list[0] + len(row_list)))
        groups.append(
            DecodeGroup(
                rows=slice(row_list[0], row_list[0] + len(row_list)) if run else torch.tensor(row_list).to(dev),
                slots=slots.to(dev),
                mask=mask[:, None, None, :].to(dev),
            )
        )
    return tuple(groups)
