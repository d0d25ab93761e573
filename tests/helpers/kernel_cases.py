"""Builders for paged-cache test cases: random K/V per sequence scattered into shuffled
physical blocks, plus the dense (contiguous) attention oracle."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import reference


@dataclass
class PagedCase:
    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor  # [num_blocks, bs, Hkv, D]
    value_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B+1]
    keys: list[torch.Tensor]  # contiguous per-sequence K [seq_len, Hkv, D]
    values: list[torch.Tensor]
    seqs: Sequence[tuple[int, int]]  # (context_len, query_len)

    def attn_args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_lens, self.query_start_loc)


def make_case(
    seqs: Sequence[tuple[int, int]],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    extra_cols: int = 2,
) -> PagedCase:
    """Random case. ``seqs`` = (context_len, query_len) per sequence. Physical blocks are a
    random permutation of 1..N (0 is the null block, used for padding); K/V are written with
    the reference ``reshape_and_cache`` through a slot mapping."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-(c + q) // block_size) for c, q in seqs]
    num_blocks = sum(nblk) + 4
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).to(torch.int32)
    bt = torch.zeros(len(seqs), max(nblk + [0]) + extra_cols, dtype=torch.int32)
    keys, values, slots = [], [], []
    used = 0
    for b, (c, q) in enumerate(seqs):
        bt[b, : nblk[b]] = perm[used : used + nblk[b]]
        used += nblk[b]
        n = c + q
        keys.append(torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype))
        values.append(torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype))
        pos = torch.arange(n)
        slots.append(bt[b, pos // block_size].long() * block_size + pos % block_size)
    if seqs:
        reference.reshape_and_cache(torch.cat(keys), torch.cat(values), key_cache, value_cache, torch.cat(slots))
    q_lens = torch.tensor([q for _, q in seqs], dtype=torch.int64)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    query = torch.randn(int(qsl[-1]), num_kv_heads * group, head_size, generator=g).to(dtype)
    return PagedCase(
        query,
        key_cache,
        value_cache,
        bt,
        torch.tensor([c + q for c, q in seqs], dtype=torch.int32),
        qsl,
        keys,
        values,
        list(seqs),
    )


def dense_attention(case: PagedCase, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Oracle: per sequence, torch SDPA (fp32) on the contiguous K/V with an explicit causal
    (and window) mask and K/V heads repeated for GQA. Returns fp32 ``[T, Hq, D]``."""
    hq = case.query.shape[1]
    outs = []
    for b, (c, q) in enumerate(case.seqs):
        if q == 0:
            continue
        s0 = int(case.query_start_loc[b])
        qq = case.query[s0 : s0 + q].float().transpose(0, 1)  # [Hq, q, D]
        rep = hq // case.keys[b].shape[1]
        k = case.keys[b].float().transpose(0, 1).repeat_interleave(rep, 0)
        v = case.values[b].float().transpose(0, 1).repeat_interleave(rep, 0)
        pos = torch.arange(c, c + q).unsqueeze(1)
        kpos = torch.arange(c + q).unsqueeze(0)
        mask = kpos <= pos
        if sliding_window is not None:
            mask &= kpos > pos - sliding_window
        outs.append(F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=scale).transpose(0, 1))
    if not outs:
        return torch.empty(0, hq, case.query.shape[2])
    return torch.cat(outs)


def poison_unread_slots(case: PagedCase, fill: float, sliding_window: int | None = None) -> None:
    """Fill every cache slot that attention must not read with ``fill`` (NaN or inf, as a
    cache made with ``torch.empty`` may hold): the null block 0, each last block's unused tail,
    spare blocks, and with a window the positions before the first query's window."""
    bs = case.key_cache.shape[1]
    read = torch.zeros(case.key_cache.shape[0] * bs, dtype=torch.bool)
    for b, (c, _) in enumerate(case.seqs):
        lo = 0 if sliding_window is None else max(0, c - sliding_window + 1)
        pos = torch.arange(lo, int(case.seq_lens[b]))
        read[case.block_table[b, pos // bs].long() * bs + pos % bs] = True
    for cache in (case.key_cache, case.value_cache):
        cache.view(-1, *cache.shape[2:])[~read] = fill


def random_seqs(kind: str, n: int, *, max_ctx: int, max_q: int, seed: int) -> list[tuple[int, int]]:
    """(context, query) lengths: decode (q=1), prefill (context 0) or mixed (includes a
    prefill-with-context and a decode at the extremes)."""
    g = torch.Generator().manual_seed(seed)

    def ri(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    if kind == "decode":
        return [(ri(0, max_ctx), 1) for _ in range(n - 1)] + [(max_ctx, 1)]
    if kind == "prefill":
        return [(0, ri(1, max_q)) for _ in range(n - 1)] + [(0, max_q)]
    seqs = [(max_ctx, 1), (0, max_q), (ri(1, max_ctx), ri(2, max_q))]
    for _ in range(n - 3):
        seqs.append(([0, ri(0, max_ctx)][ri(0, 1)], [1, ri(1, max_q)][ri(0, 1)]))
    return seqs
