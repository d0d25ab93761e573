"""Pure-torch reference implementations of the pagedkv kernel ops.

These are the test oracle for the Triton kernels and the path the reference engine uses on
CPU to serve a real model, so they are exact (attention math in fp32) and vectorized: one
gather + one SDPA call per prefill sequence, and decode sequences (query length 1) batched
together, never a Python loop over tokens.

Cache layout (PagedAttention, Kwon et al., SOSP'23): one tensor for all layers
``kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]`` (index 0 = K,
1 = V). Per-layer views ``kv_cache[l, 0]`` / ``kv_cache[l, 1]`` are the ``key_cache`` /
``value_cache`` arguments of :func:`reshape_and_cache` and :func:`paged_attention`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import validate as V

# Upper bound on gathered K elements per batched decode group (keeps CPU memory bounded).
_DECODE_GROUP_ELEMS = 1 << 26


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V rows into their cache slots, in place.

    Args:
        key, value: ``[T, num_kv_heads, head_size]``, same dtype as the cache.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``.
        slot_mapping: int64 ``[T]``; token ``t`` goes to block ``slot // block_size``, row
            ``slot % block_size``. Slots ``< 0`` (padding) are skipped.

    Raises:
        ValueError: bad dtype/shape/device, or a slot past the end of the cache.

    Cost: O(T * num_kv_heads * head_size).
    """
    V.check_reshape_and_cache("reshape_and_cache", key, value, key_cache, value_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    nb, bs = key_cache.shape[:2]
    # index_put_ on a (blocks, rows) pair works for any strided per-layer view.
    blk, row = slots // bs, slots % bs
    key_cache[blk, row] = key[keep]
    value_cache[blk, row] = value[keep]


def _gather_kv(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous ``[..., length, H, D]`` K or V from block ids ``blocks[..., n_blocks]``."""
    g = cache[blocks.long()]  # [..., n_blocks, block_size, H, D]
    g = g.reshape(*blocks.shape[:-1], -1, cache.shape[2], cache.shape[3])
    return g[..., :length, :, :]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    softmax_scale: float,
    max_query_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    sliding_window: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
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
        out: optional ``[T, num_q_heads, head_size]`` output buffer.

    Returns:
        ``[T, num_q_heads, head_size]`` in ``query.dtype`` (``out`` if given). Math in fp32.

    Raises:
        ValueError: bad dtype/shape/device/contiguity or inconsistent lengths (message names
            the tensor).

    Cost: O(sum_b q_len_b * seq_len_b * num_q_heads * head_size); memory O(q_len * seq_len)
    per prefill sequence and a bounded padded gather for batched decodes.
    """
    V.check_paged_attention(
        "paged_attention", query, key_cache, value_cache, block_table, seq_lens,
        query_start_loc, softmax_scale, sliding_window, out,
    )
    t, hq, d = query.shape
    hkv = key_cache.shape[2]
    bs = key_cache.shape[1]
    g = hq // hkv
    result = torch.empty(t, hq, d, dtype=torch.float32, device=query.device)
    qsl = query_start_loc.tolist()
    sls = seq_lens.tolist()
    scale = float(softmax_scale)
    decode = []
    for b, sl in enumerate(sls):
        q0, q1 = qsl[b], qsl[b + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        if q_len == 1:
            decode.append(b)
            continue
        nblk = -(-sl // bs)
        k = _gather_kv(key_cache, block_table[b, :nblk], sl).float().transpose(0, 1)  # [Hkv,S,D]
        v = _gather_kv(value_cache, block_table[b, :nblk], sl).float().transpose(0, 1)
        # Query heads of one KV group stacked along rows: [Hkv, G*q_len, D] (no K/V repeat).
        q = query[q0:q1].float().reshape(q_len, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * q_len, d)
        pos = torch.arange(sl - q_len, sl, device=query.device).unsqueeze(1)
        kpos = torch.arange(sl, device=query.device).unsqueeze(0)
        mask = kpos <= pos
        if sliding_window is not None:
            mask &= kpos > pos - sliding_window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(g, 1), scale=scale)
        result[q0:q1] = o.reshape(hkv, g, q_len, d).permute(2, 0, 1, 3).reshape(q_len, hq, d)
    if decode:
        _decode_batched(query, key_cache, value_cache, block_table, sls, qsl, decode, scale,
                        sliding_window, result)
    if out is None:
        out = torch.empty_like(query)
    out.copy_(result)
    return out


def _decode_batched(query, key_cache, value_cache, block_table, sls, qsl, decode, scale,
                    sliding_window, result) -> None:
    """Decode rows (q_len == 1), length-sorted and batched under a memory budget."""
    hkv, d = key_cache.shape[2], key_cache.shape[3]
    bs = key_cache.shape[1]
    hq = query.shape[1]
    g = hq // hkv
    dev = query.device
    order = sorted(decode, key=lambda b: sls[b])
    i = 0
    while i < len(order):
        # Grow the group while the padded gather stays under budget.
        j = i + 1
        while j < len(order) and (j + 1 - i) * sls[order[j]] * hkv * d <= _DECODE_GROUP_ELEMS:
            j += 1
        grp = order[i:j]
        i = j
        smax = sls[grp[-1]]
        nblk = -(-smax // bs)
        idx = torch.tensor(grp, device=dev)
        bt = block_table[idx, :nblk]
        k = _gather_kv(key_cache, bt, smax).float().transpose(1, 2)  # [n, Hkv, S, D]
        v = _gather_kv(value_cache, bt, smax).float().transpose(1, 2)
        rows = torch.tensor([qsl[b] for b in grp], device=dev)
        q = query[rows].float().reshape(len(grp), hkv, g, d)
        lens = torch.tensor([sls[b] for b in grp], device=dev).unsqueeze(1)
        kpos = torch.arange(smax, device=dev).unsqueeze(0)
        mask = kpos < lens  # query sits at position len-1: causal == "inside the sequence"
        if sliding_window is not None:
            mask &= kpos > lens - 1 - sliding_window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
        result[rows] = o.reshape(len(grp), hq, d)


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
    stream: Optional["torch.cuda.Stream"] = None,
) -> Optional["torch.cuda.Event"]:
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
    V.check_tensor(op, "dst_kv_cache", dst_kv_cache, dtypes=(src_kv_cache.dtype,),
                   shape=(s[0], 2, None, s[3], s[4], s[5]))
    assert isinstance(dst_kv_cache, torch.Tensor)
    V.check_block_mapping(op, block_mapping, s[2], dst_kv_cache.shape[2], cow=False)
