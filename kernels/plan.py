"""Attention plans: the per-step half of the torch reference ``paged_attention``.

A step's attention metadata (block table, sequence lengths, query offsets) is the same for
every layer of the model, so everything derived from it -- validation of the values, which
sequences are decodes and which are prefills, the cache slots each sequence reads, the causal
and sliding-window masks -- is built once per step by :func:`plan_paged_attention` and reused
by every layer's :func:`pagedkv.kernels.reference.paged_attention` call, which is then left
with O(1) tensor checks, the K/V gathers and the math. A plan built with the step's
``slot_mapping`` also carries its value checks, so every layer's
:func:`pagedkv.kernels.reference.reshape_and_cache` is left with O(1) checks and the writes.
This is the plan/run split of FlashInfer (Ye et al., 2025: "plan" once per batch, "run" per
layer), written for the CPU reference.

The Triton kernel reads the metadata on the device and does not use plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import validate as V

__all__ = ["AttentionPlan", "PrefillPart", "DecodeGroup", "plan_paged_attention", "additive_mask"]

# Upper bound on gathered K elements per batched decode group (keeps CPU memory bounded).
DECODE_GROUP_ELEMS = 1 << 26
# Fixed cost of one more decode group (its gathers and attention call), in padded positions
# gathered and attended: decodes are split into length-sorted groups only where the padding
# saved outweighs it. Measured on CPU for 64-dim heads: about 100 us per group and layer
# against 0.5 us per padded position (gather + read of its K and V rows).
DECODE_GROUP_COST_POSITIONS = 192


@dataclass(frozen=True)
class PrefillPart:
    """One sequence with ``q_len > 1`` (prefill, prefill over a cached prefix, chunked prefill).

    Attributes:
        seq: index of the sequence in the batch.
        q_start, q_end: its query rows ``query[q_start:q_end]`` (``q_len = q_end - q_start``).
        seq_len: ``S``, its cached positions, this step's included.
        kv_start: the first position any of its queries sees (0 without a sliding window;
            else the window start of its first query). Positions before it are not read, as
            the Triton kernel does not read them: a sliding-window cache may have released
            their blocks.
        blocks: int64 ``[ceil(S / block_size) - kv_start // block_size]`` its physical blocks
            in position order from the one holding ``kv_start`` (the reference gathers whole
            blocks, then keeps positions ``kv_start..S`` only: the tail of the last block and
            the head of the first are never used, whatever they hold).
        mask: None when the part is plain causal attention (a prompt with no cached prefix:
            ``q_len == S``, and no window shorter than ``q_len``), which the reference runs as
            ``is_causal`` -- no mask, and the score tiles above the diagonal are skipped. Else
            an additive fp32 mask ``[G * q_len, S - kv_start]`` (see :func:`additive_mask`):
            row ``g * q_len + i`` (query ``i`` of any query head in a KV group of ``G`` heads)
            may see position ``kv_start + j`` (causal, and inside the window) where it is 0.
    """

    seq: int
    q_start: int
    q_end: int
    seq_len: int
    blocks: torch.Tensor
    mask: torch.Tensor | None
    kv_start: int = 0


@dataclass(frozen=True)
class DecodeGroup:
    """Decode sequences (``q_len == 1``) attended together as one padded batch.

    Attributes:
        rows: query row of each of the ``n`` sequences: a ``slice`` when they are one
            contiguous run (cheaper to read and write), else an int64 ``[n]`` tensor.
        blocks: int64 ``[n, nb]`` physical blocks of each sequence in position order from the
            one holding its window's first position (its first block without a window),
            padded to the group's widest gather (``nb`` blocks) with block 0 (masked out).
        mask: additive fp32 ``[n, 1, 1, nb * block_size]`` (see :func:`additive_mask`), 0
            where the sequence's single query sees the gathered position.
        hidden: int64 ``[h]`` the gathered positions no query sees, as flat indices into
            ``n * nb * block_size`` (sequence-major): the unused tail of each last block, the
            padding blocks, positions before the window. The reference zeroes their gathered
            K/V rows before the math, so whatever an unwritten slot holds (NaN or inf in a
            cache made with ``torch.empty``) cannot reach the output through ``0 * NaN``.
    """

    rows: slice | torch.Tensor
    blocks: torch.Tensor
    mask: torch.Tensor
    hidden: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    @property
    def size(self) -> int:
        """Number of sequences ``n``."""
        return self.blocks.shape[0]


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
        slot_mapping: the int64 ``[num_tokens]`` slot mapping the plan checked (identity is
            checked per ``reshape_and_cache`` call), or None when built without one.
        min_slot: its smallest slot when its values were read (on the CPU, not empty; a
            negative one means padding slots), else None.
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
    slot_mapping: torch.Tensor | None = field(default=None, repr=False)
    min_slot: int | None = None

    def check_write(
        self,
        op: str,
        key: object,
        value: object,
        key_cache: torch.Tensor,
        value_cache: object,
        slot_mapping: object,
    ) -> None:
        """O(1) check that a per-layer cache write matches this plan, which carries a slot
        mapping: the same slot mapping tensor, caches of the plan's shape (same dtype and
        device, contiguous head dim), and ``key``/``value`` ``[num_tokens, num_kv_heads,
        head_size]`` of the caches' dtype.

        Raises:
            ValueError: naming the argument that differs from what the plan was built for.
        """
        if slot_mapping is not self.slot_mapping:
            raise V.KernelInputError(
                f"{op}: slot_mapping is not the tensor the plan was built from, "
                "expected the same tensor object as passed to plan_paged_attention"
            )
        V.check_cache_pair(op, key_cache, value_cache)
        if tuple(key_cache.shape) != self.cache_shape:
            raise V.KernelInputError(
                f"{op}: key_cache has shape {tuple(key_cache.shape)}, expected "
                f"{self.cache_shape} (the plan's cache_shape)"
            )
        if not V.same_device(key_cache.device, self.device):
            raise V.KernelInputError(
                f"{op}: key_cache is on device {key_cache.device}, expected device {self.device} (the plan's)"
            )
        _, _, hkv, d = self.cache_shape
        for name, t in (("key", key), ("value", value)):
            V.check_tensor(
                op,
                name,
                t,
                dtypes=(key_cache.dtype,),
                shape=(self.num_tokens, hkv, d),
                device=key_cache.device,
                last_dim_contiguous=True,
            )

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
    slot_mapping: torch.Tensor | None = None,
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
        slot_mapping: optional int64 ``[T]`` cache slot of each token, as every layer's
            :func:`~pagedkv.kernels.reference.reshape_and_cache` will get it: its values are
            checked here once (slots in the cache, none in the null block 0) and the plan can
            then be passed to those writes too.

    Returns:
        An :class:`AttentionPlan` on ``block_table``'s device.

    Raises:
        ValueError: bad dtype/shape/device, offsets not running 0..T, a query longer than its
            sequence, a block table too narrow or holding ids outside ``[0, num_blocks)``, a
            bad window or head count, a slot past the cache or in the null block (the message
            names the argument).

    Cost: O(B * max_blocks) validation plus O(sum_b G * q_len_b * seq_len_b) mask elements
    for prefills over a cached prefix (none for plain causal prefills), O(B * max_seq_len)
    mask elements for decodes and O(B^2) at worst to group them; the metadata is read to the
    host once.
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
        slot_mapping=slot_mapping,
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
    slot_mapping: torch.Tensor | None = None,
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
    min_slot = None
    if slot_mapping is not None:
        min_slot = V.check_slot_mapping(
            op, slot_mapping, num_tokens=int(qsl[-1]), num_blocks=num_blocks, block_size=bs, device=dev
        )
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
            # Positions before the first query's window are seen by no query: not gathered.
            kv_start = 0 if sliding_window is None else max(0, sl - q_len - sliding_window + 1)
            blocks = bt_host[b, kv_start // bs : -(-sl // bs)]
            mask = None
            if sl != q_len or (sliding_window is not None and sliding_window < q_len):
                pos = torch.arange(kv_start, sl)
                qpos = torch.arange(sl - q_len, sl).unsqueeze(1)
                mask = pos.unsqueeze(0) <= qpos
                if sliding_window is not None:
                    mask &= pos.unsqueeze(0) > qpos - sliding_window
                mask = additive_mask(mask.repeat(g, 1)).to(dev)
            prefills.append(PrefillPart(b, qsl[b], qsl[b + 1], sl, blocks.to(dev), mask, kv_start))
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
        slot_mapping=slot_mapping,
        min_slot=min_slot,
    )


def additive_mask(visible: torch.Tensor) -> torch.Tensor:
    """fp32 attention mask from a bool one: 0 where ``visible``, -inf elsewhere.

    The reference's math is fp32, and ``scaled_dot_product_attention`` turns a bool mask into
    exactly this before use (``where``); built once per step here, not once per layer and call."""
    return torch.zeros(visible.shape, dtype=torch.float32).masked_fill_(~visible, float("-inf"))


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
    """Decode sequences cut into groups (``elems_per_pos`` = num_kv_heads * head_size).

    Each sequence's gather starts at the block holding its window's first position (block 0
    without a window), so a sliding-window decode reads ``ceil(W / block_size) + 1`` blocks at
    most, whatever its length, and never a block before its window (a sliding-window KV cache
    group may have released those). One group in batch order when that is cheapest; else
    groups sorted by blocks gathered, chosen by :func:`_split_sorted` to minimise padded
    positions plus :data:`DECODE_GROUP_COST_POSITIONS` per group, each group's padded K gather
    under :data:`DECODE_GROUP_ELEMS` elements."""
    if not decode:
        return ()
    # First gathered block and blocks gathered, per sequence (the query sits at len - 1).
    first = {b: 0 if sliding_window is None else max(0, sls[b] - sliding_window) // bs for b in decode}
    span = {b: -(-sls[b] // bs) - first[b] for b in decode}
    order = sorted(decode, key=lambda b: (span[b], sls[b]))
    nblocks = [span[b] for b in order]
    cuts = _split_sorted(nblocks, bs, max(1, DECODE_GROUP_ELEMS // (bs * elems_per_pos)))
    groups_of = [decode] if len(cuts) == 1 else [order[i:j] for i, j in cuts]  # one group: batch order
    groups = []
    for grp in groups_of:
        nb = max(span[b] for b in grp)
        idx = torch.tensor(grp)
        start = torch.tensor([first[b] for b in grp]).unsqueeze(1)  # [n, 1] first block
        cols = start + torch.arange(nb).unsqueeze(0)  # [n, nb] block table columns gathered
        live_blocks = torch.arange(nb).unsqueeze(0) < torch.tensor([span[b] for b in grp]).unsqueeze(1)
        table = bt_host[idx].gather(1, cols.clamp(max=bt_host.shape[1] - 1))
        blocks = torch.where(live_blocks, table, torch.zeros((), dtype=torch.int64))  # pad: block 0
        pos = start * bs + torch.arange(nb * bs).unsqueeze(0)  # [n, nb * bs] absolute positions
        lens = torch.tensor([sls[b] for b in grp]).unsqueeze(1)
        mask = pos < lens  # the query sits at position len-1: causal == inside
        if sliding_window is not None:
            mask &= pos > lens - 1 - sliding_window
        row_list = [qsl[b] for b in grp]
        run = row_list == list(range(row_list[0], row_list[0] + len(row_list)))
        groups.append(
            DecodeGroup(
                rows=slice(row_list[0], row_list[0] + len(row_list)) if run else torch.tensor(row_list).to(dev),
                blocks=blocks.to(dev),
                mask=additive_mask(mask[:, None, None, :]).to(dev),
                hidden=(~mask).reshape(-1).nonzero().squeeze(1).to(dev),
            )
        )
    return tuple(groups)


def _split_sorted(nblocks: list[int], bs: int, max_group_blocks: int) -> list[tuple[int, int]]:
    """Cut ascending per-sequence block counts into runs ``[i, j)`` minimising the sum over
    runs of ``DECODE_GROUP_COST_POSITIONS + (j - i) * nblocks[j - 1] * bs`` (padded
    positions plus a fixed cost per group), each run's ``(j - i) * nblocks[j - 1]`` at most
    ``max_group_blocks`` (a single sequence always forms a run). Exact dynamic programme over
    the sorted order (optimal runs of a sorted list are contiguous), O(n^2) for n sequences."""
    n = len(nblocks)
    cost = [0.0] + [float("inf")] * n
    start = [0] * (n + 1)
    for j in range(1, n + 1):
        width = nblocks[j - 1]
        for i in range(j - 1, -1, -1):
            run = DECODE_GROUP_COST_POSITIONS + (j - i) * width * bs
            if i < j - 1 and ((j - i) * width > max_group_blocks or run >= cost[j]):
                break  # cost[i] >= 0: a longer run cannot be cheaper
            c = cost[i] + run
            if c < cost[j]:
                cost[j], start[j] = c, i
    cuts = []
    j = n
    while j > 0:
        cuts.append((start[j], j))
        j = start[j]
    return cuts[::-1]
