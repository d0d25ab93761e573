"""Pure-torch reference implementations of the pagedkv kernel ops.

These are the test oracle for the Triton kernels and the path the reference engine uses on
CPU to serve a real model, so they are exact (attention math in fp32) and vectorized: one
gather of whole cache blocks + one SDPA call per prefill sequence (``is_causal`` without a
mask for a prompt with no cached prefix), and decode sequences (query length 1) batched
together in length-sorted groups, never a Python loop over tokens. Attention's per-step work
(metadata validation, block indices, masks, decode groups) lives in an
:class:`~pagedkv.kernels.plan.AttentionPlan` that a model builds once per step and passes to
every layer. Like the Triton kernel, the result never depends on cache slots no query sees
(the unused tail of a last block, padding block 0, positions before a sliding window): a
prefill drops them from its gather and a decode group zeroes them, so a cache made with
``torch.empty`` (NaN or inf in unwritten slots) gives the same output as a zeroed one.

Cache layout (PagedAttention, Kwon et al., SOSP'23): one tensor for all layers
``kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]`` (index 0 = K,
1 = V). Per-layer views ``kv_cache[l, 0]`` / ``kv_cache[l, 1]`` are the ``key_cache`` /
``value_cache`` arguments of :func:`reshape_and_cache` and :func:`paged_attention`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import validate as V
from .plan import AttentionPlan, DecodeGroup, build_plan


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    plan: AttentionPlan | None = None,
) -> None:
    """Write new K/V rows into their cache slots, in place.

    Args:
        key, value: ``[T, num_kv_heads, head_size]``, same dtype as the cache.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``.
        slot_mapping: int64 ``[T]``; token ``t`` goes to block ``slot // block_size``, row
            ``slot % block_size``. Slots ``< 0`` (padding) are skipped.
        plan: the step's :class:`~pagedkv.kernels.plan.AttentionPlan`. Built with this same
            ``slot_mapping`` (``plan_paged_attention(..., slot_mapping=...)``), its values were
            checked there and a call only runs O(1) checks (what a model writing every layer
            should pass); a plan built without one changes nothing (full checks).

    Raises:
        ValueError: bad dtype/shape/device, a slot past the end of the cache or in the null
            block, or a plan built from another slot mapping or cache shape.

    Cost: O(T * num_kv_heads * head_size).
    """
    op = "reshape_and_cache"
    if plan is None or plan.slot_mapping is None:
        lo = V.check_reshape_and_cache(op, key, value, key_cache, value_cache, slot_mapping)
    else:
        plan.check_write(op, key, value, key_cache, value_cache, slot_mapping)
        lo = plan.min_slot
    nb, bs, h, d = key_cache.shape
    flat = all(c.stride(0) == bs * c.stride(1) for c in (key_cache, value_cache))
    if lo is None and slot_mapping.numel():
        lo = int(slot_mapping.min())  # off-CPU metadata is not value-checked
    if flat and (lo is None or lo >= 0):
        # No padding slots and caches viewable as flat rows: one index_copy_ each (the
        # engine's case; cheaper than a masked (block, row) index_put_).
        key_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, key)
        value_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, value)
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # index_put_ on a (blocks, rows) pair works for any strided per-layer view.
    blk, row = slots // bs, slots % bs
    key_cache[blk, row] = key[keep]
    value_cache[blk, row] = value[keep]


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
) -> torch.Tensor:
    """Causal attention of a varlen batch of queries over a paged KV cache.

    Sequence ``b`` owns query rows ``query_start_loc[b]:query_start_loc[b+1]`` (its
    ``q_len`` newest tokens) and ``seq_lens[b]`` cached tokens reached through
    ``block_table[b]``. Query ``i`` sits at position ``p = seq_len - q_len + i`` and attends
    to cached positions ``j`` with ``j <= p`` and, when ``sliding_window`` is set,
    ``j > p - sliding_window``. One call mixes prefill (context 0), prefill with a cached
    prefix, chunked prefill and decode (``q_len == 1``).

    Args:
        query: ``[T, num_q_heads, head_size]``, fp16/bf16/fp32; ``num_q_heads`` a multiple of
            ``num_kv_heads`` (GQA/MQA).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``.
        block_table: int32 ``[B, max_blocks]`` physical block ids (padding ignored).
        seq_lens: int32 ``[B]`` tokens in cache per sequence, new tokens included.
        query_start_loc: int32 ``[B+1]`` prefix sums of query lengths.
        softmax_scale: multiplier of ``q.k`` before softmax (usually ``head_size**-0.5``).
        max_query_len, max_seq_len: accepted for signature parity; unused here.
        sliding_window: optional window in tokens (>= 1), counting the query's own position.
            With a plan: None (use the plan's) or equal to the plan's.
        out: optional ``[T, num_q_heads, head_size]`` output buffer.
        plan: the step's :class:`~pagedkv.kernels.plan.AttentionPlan` from
            :func:`~pagedkv.kernels.plan.plan_paged_attention`, built from these same
            ``block_table`` / ``seq_lens`` / ``query_start_loc`` tensors. With it a call only
            runs O(1) tensor checks before the math; without it one is built here (value
            checks, indices and masks: what a model with many layers should do once per step).

    Returns:
        ``[T, num_q_heads, head_size]`` in ``query.dtype`` (``out`` if given). Math in fp32.

    Raises:
        ValueError: bad dtype/shape/device/contiguity or inconsistent lengths (message names
            the tensor), or a plan built for other metadata, cache shape or token count.

    Cost: O(sum_b q_len_b * seq_len_b * num_q_heads * head_size); memory O(q_len * seq_len)
    per prefill sequence and a bounded padded gather for batched decodes.
    """
    op = "paged_attention"
    V.check_attention_tensors(op, query, key_cache, value_cache, softmax_scale, out)
    if plan is None:
        plan = build_plan(
            op,
            block_table,
            seq_lens,
            query_start_loc,
            cache_shape=tuple(key_cache.shape),
            num_q_heads=query.shape[1],
            sliding_window=sliding_window,
            num_tokens=query.shape[0],
            device=key_cache.device,
        )
    else:
        plan.check_call(op, query, key_cache, block_table, seq_lens, query_start_loc, sliding_window)
    t, hq, d = query.shape
    hkv = key_cache.shape[2]
    g = hq // hkv
    scale = float(softmax_scale)
    # fp32 math: write straight into a fresh fp32 output, else into a scratch buffer copied at
    # the end (a caller's ``out`` may alias ``query``, which the later groups still read).
    direct = query.dtype == torch.float32 and out is None
    if out is None:
        out = torch.empty_like(query)
    result = out if direct else torch.empty(t, hq, d, dtype=torch.float32, device=query.device)
    k_blocks, v_blocks = _cache_blocks(key_cache), _cache_blocks(value_cache)
    for part in plan.prefills:
        q_len = part.q_end - part.q_start
        # Only the positions some query sees, kv_start..S: the unused ends of the first and
        # last gathered blocks are sliced off (the mask covers exactly these).
        lo = part.kv_start % plan.cache_shape[1]
        s = part.seq_len - part.kv_start
        k = k_blocks(part.blocks).reshape(-1, hkv, d)[lo : lo + s].float().transpose(0, 1)  # [Hkv, S, D]
        v = v_blocks(part.blocks).reshape(-1, hkv, d)[lo : lo + s].float().transpose(0, 1)
        q = query[part.q_start : part.q_end].float().reshape(q_len, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, q, D]
        if part.mask is None:
            # Plain causal prompt (q_len == S): is_causal, K/V broadcast over the G query heads
            # of their group (a stride-0 view, no repeat).
            o = F.scaled_dot_product_attention(
                q, k.unsqueeze(1).expand(hkv, g, s, d), v.unsqueeze(1).expand(hkv, g, s, d), is_causal=True, scale=scale
            )
        else:
            # Query heads of one KV group stacked along rows: [Hkv, G*q_len, D] (no K/V repeat).
            o = F.scaled_dot_product_attention(q.reshape(hkv, g * q_len, d), k, v, attn_mask=part.mask, scale=scale)
        result[part.q_start : part.q_end] = o.reshape(hkv, g, q_len, d).permute(2, 0, 1, 3).reshape(q_len, hq, d)
    for grp in plan.decodes:
        n = grp.size
        k, v = _gather_visible(k_blocks, grp), _gather_visible(v_blocks, grp)  # [n, Hkv, nb*bs, D]
        rows = grp.rows
        if isinstance(rows, slice):
            q = query[rows].float().reshape(n, hkv, g, d)
            result[rows] = F.scaled_dot_product_attention(q, k, v, attn_mask=grp.mask, scale=scale).reshape(n, hq, d)
        else:  # index_select / index_copy_: several times cheaper on CPU than [rows] get / set
            q = query.index_select(0, rows).float().reshape(n, hkv, g, d)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=grp.mask, scale=scale)
            result.index_copy_(0, rows, o.reshape(n, hq, d))
    if not direct:
        out.copy_(result)
    return out


def _gather_visible(blocks_of: Callable[[torch.Tensor], torch.Tensor], grp: DecodeGroup) -> torch.Tensor:
    """A decode group's padded K or V ``[n, num_kv_heads, nb * block_size, head_size]`` in
    fp32, with the positions no query sees (``grp.hidden``) zeroed.

    The -inf mask alone does not keep them out: a NaN or inf there gives a NaN score, and even
    a weight of exactly 0 times a NaN value is NaN. The gather is a fresh tensor, so it is
    zeroed in place; only the hidden rows are written."""
    n = grp.size
    x = blocks_of(grp.blocks)
    if grp.hidden.numel():
        x.view(-1, x.shape[-2] * x.shape[-1]).index_fill_(0, grp.hidden, 0)
    return x.view(n, -1, *x.shape[-2:]).float().transpose(1, 2)


def _cache_blocks(cache: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``blocks[...] -> cache blocks [..., block_size, num_kv_heads, head_size]`` for int64
    block ids.

    A per-layer view of the all-layer cache holds each block as one contiguous run, so the ids
    index it with one ``index_select`` of whole blocks (on CPU several times cheaper than
    gathering the same rows one position at a time); other strides fall back to advanced
    indexing."""
    nb, bs, h, d = cache.shape
    if cache[0].is_contiguous():
        flat = cache.view(nb, bs * h * d)
        return lambda blocks: flat.index_select(0, blocks.reshape(-1)).view(*blocks.shape, bs, h, d)
    return lambda blocks: cache[blocks]


def _check_kv_cache(op: str, name: str, kv: object) -> None:
    V.check_tensor(op, name, kv, shape=(None, 2, None, None, None, None))


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy-on-write block copies across all layers and both K and V, in place.

    For every pair ``(src, dst)`` in ``block_mapping`` sets
    ``kv_cache[:, :, dst] = kv_cache[:, :, src]``.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``.
        block_mapping: int32/int64 ``[K, 2]``; dst ids distinct and disjoint from src ids.

    Raises:
        ValueError: bad shapes/dtypes, ids out of range, repeated or overlapping dst.

    Cost: O(K * num_layers * block_size * num_kv_heads * head_size) element copies.
    """
    _check_kv_cache("copy_blocks", "kv_cache", kv_cache)
    V.check_block_mapping("copy_blocks", block_mapping, kv_cache.shape[2], kv_cache.shape[2], cow=True)
    if block_mapping.numel() == 0:
        return
    m = block_mapping.to(device=kv_cache.device, dtype=torch.int64)
    kv_cache[:, :, m[:, 1]] = kv_cache[:, :, m[:, 0]]


def swap_blocks(
    src_kv_cache: torch.Tensor,
    dst_kv_cache: torch.Tensor,
    block_mapping: torch.Tensor,
    stream: torch.cuda.Stream | None = None,
) -> torch.cuda.Event | None:
    """Synchronous block swap between two all-layer caches (reference; any devices).

    Sets ``dst_kv_cache[:, :, dst] = src_kv_cache[:, :, src]`` for every ``(src, dst)`` pair.
    ``stream`` is accepted for signature parity and ignored; returns ``None`` (the copy is
    complete on return).

    Raises:
        ValueError: caches of different dtype or per-block shape, bad mapping.
    """
    _check_swap("swap_blocks", src_kv_cache, dst_kv_cache, block_mapping)
    if block_mapping.numel() == 0:
        return None
    m = block_mapping.to(torch.int64)
    src = m[:, 0].to(src_kv_cache.device)
    dst = m[:, 1].to(dst_kv_cache.device)
    dst_kv_cache[:, :, dst] = src_kv_cache[:, :, src].to(dst_kv_cache.device)
    return None


def _check_swap(op: str, src_kv_cache: object, dst_kv_cache: object, block_mapping: object) -> None:
    _check_kv_cache(op, "src_kv_cache", src_kv_cache)
    assert isinstance(src_kv_cache, torch.Tensor)
    s = src_kv_cache.shape
    V.check_tensor(
        op, "dst_kv_cache", dst_kv_cache, dtypes=(src_kv_cache.dtype,), shape=(s[0], 2, None, s[3], s[4], s[5])
    )
    assert isinstance(dst_kv_cache, torch.Tensor)
    # Only a device pool has a null block; the CPU swap pool uses ids from 0 (swap-out dst).
    V.check_block_mapping(
        op, block_mapping, s[2], dst_kv_cache.shape[2], cow=False, dst_has_null_block=dst_kv_cache.device.type != "cpu"
    )
