"""Launch configurations of the Triton kernels: the one table the launchers select from and the
ahead-of-time check (:mod:`.aot`) compiles in full.

Every tile size, warp count and pipeline depth a launcher uses comes from here, so the AOT check
covers exactly what users get. The table is arch-independent: each entry compiles without
register spills or stack on sm_80 and sm_90 and stays inside sm_80's shared memory (163 KB per
block), which :mod:`.aot` verifies.

Attention tiles are keyed by (precision class, padded head size ``BLOCK_D``, phase):

- ``decode`` (every query of the launch is one token): ``BLOCK_M`` rows hold the GQA group of one
  query token (row ``r`` = head ``r % G``), so 16 rows -- the smallest ``tl.dot`` M -- cover
  groups up to 16; ``BLOCK_N`` positions per K/V step.
- ``prefill`` (some query is longer than one token): taller tiles reuse each K/V tile for more
  query rows.

fp32 runs ``tl.dot`` in IEEE precision (no tensor cores: FMA dot), whose operands live in
registers, so its tiles are smaller than the half-precision ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "AttentionTile",
    "ATTENTION_TILES",
    "attention_tile",
    "block_d_for",
    "precision_class",
    "MERGE_BLOCK_S",
    "MERGE_WARPS",
    "COPY_CHUNK",
    "COPY_WARPS",
    "CACHE_WRITE_WARPS",
    "SM80_MAX_SMEM_BYTES",
    "MAX_KV_SPLITS",
    "SPLIT_MIN_TOKENS",
    "DTYPES",
    "HEAD_SIZES",
    "BLOCK_SIZES",
    "GQA_GROUPS",
    "KV_HEADS",
    "ARCHS",
]


@dataclass(frozen=True)
class AttentionTile:
    """One attention launch configuration.

    Attributes:
        block_m: query rows per program (query tokens x GQA group), power of two >= 16.
        block_n: KV positions per inner-loop step, power of two >= 16.
        num_warps: warps per program.
        num_stages: software-pipeline depth of the K/V loads (shared-memory buffers).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


#: (precision class ``"half"`` | ``"fp32"``, BLOCK_D, phase) -> tile. Chosen with the AOT check
#: (``python -m pagedkv.kernels.aot``): zero spill bytes and zero stack on sm_80 / sm_90 / sm_100,
#: under 99 KB of shared memory (so sm_86 / sm_89 parts fit too). Half-precision prefill keeps
#: one warp per 16 rows (the FlashAttention-2 split: each warp owns whole rows, P stays in
#: registers); 16-row decode tiles put the warps along the KV / head dims. fp32's FMA dot
#: holds both operands in registers, hence its narrow BLOCK_N and 8 warps.
ATTENTION_TILES: dict[tuple[str, int, str], AttentionTile] = {
    ("half", 64, "decode"): AttentionTile(16, 64, 4, 3),
    ("half", 128, "decode"): AttentionTile(16, 64, 4, 3),
    ("half", 256, "decode"): AttentionTile(16, 32, 4, 3),
    ("half", 64, "prefill"): AttentionTile(64, 64, 4, 2),
    ("half", 128, "prefill"): AttentionTile(128, 32, 8, 3),
    ("half", 256, "prefill"): AttentionTile(64, 32, 8, 2),
    ("fp32", 64, "decode"): AttentionTile(16, 64, 4, 3),
    ("fp32", 128, "decode"): AttentionTile(16, 64, 8, 2),
    ("fp32", 256, "decode"): AttentionTile(16, 16, 8, 3),
    ("fp32", 64, "prefill"): AttentionTile(64, 32, 8, 2),
    ("fp32", 128, "prefill"): AttentionTile(32, 16, 8, 2),
    ("fp32", 256, "prefill"): AttentionTile(32, 16, 8, 2),
}

#: Split-KV partials merged per step of the merge kernel's loop (any split count works).
MERGE_BLOCK_S = 16
MERGE_WARPS = 4
#: Most KV partitions the launcher picks on its own, and the fewest KV positions per partition.
MAX_KV_SPLITS = 64
SPLIT_MIN_TOKENS = 256
#: Elements one copy_blocks program moves (a block plane is cut into chunks of this size).
COPY_CHUNK = 4096
COPY_WARPS = 4
CACHE_WRITE_WARPS = 4

#: Largest dynamic shared memory one block may use on sm_80 (A100: 163 KB opt-in per block).
SM80_MAX_SMEM_BYTES = 163 * 1024

# The launch space the AOT check sweeps (everything the launchers can select for these shapes).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_SIZES = (64, 80, 96, 128, 160, 192, 256)
BLOCK_SIZES = (8, 16, 32, 64, 128)
GQA_GROUPS = (1, 2, 3, 4, 5, 6, 7, 8)
#: KV heads per layer for the cache-write kernel (its tile covers all heads of a token).
KV_HEADS = (1, 2, 3, 4, 8, 16, 32)
#: Compute capabilities checked: 80 (A100), 90 (H100/H200), 100 (B200) when ptxas supports it.
ARCHS = (80, 90, 100)


def precision_class(dtype: torch.dtype) -> str:
    """``"fp32"`` for float32 (IEEE dot, no tensor cores), ``"half"`` for fp16 / bf16."""
    return "fp32" if dtype == torch.float32 else "half"


def block_d_for(head_size: int) -> int:
    """Head size padded to the kernel's power-of-two ``BLOCK_D`` (at least 16; columns past
    ``head_size`` are masked)."""
    bd = 16
    while bd < head_size:
        bd *= 2
    return bd


def attention_tile(dtype: torch.dtype, head_size: int, group: int, max_query_len: int) -> AttentionTile:
    """The tile :func:`pagedkv.kernels.attention.paged_attention` launches with.

    Args:
        dtype: query / cache dtype (fp16, bf16 or fp32).
        head_size: head dimension, 1..256.
        group: query heads per KV head (GQA group ``G``), >= 1.
        max_query_len: longest query (tokens) of the launch; the decode tile is used while
            ``max_query_len * group`` rows fit in it (decode, short speculative queries; a
            group taller than the tile gets ``next_pow2(group)`` rows).

    Returns:
        The table entry, with ``block_m`` raised to ``next_pow2(group)`` when the group is
        taller than the table's tile (MQA-like groups over 16; outside the AOT-checked space).

    Raises:
        KeyError: ``head_size`` above 256 (the launcher rejects it earlier with a ValueError).
    """
    # Head sizes under 64 use the 64 entry: a narrower BLOCK_D only shrinks the working set.
    key_d = max(64, block_d_for(head_size))
    prec = precision_class(dtype)
    need = 1
    while need < group:
        need *= 2
    tile = ATTENTION_TILES[(prec, key_d, "decode")]
    if max_query_len * group > max(tile.block_m, need):
        tile = ATTENTION_TILES[(prec, key_d, "prefill")]
    if need > tile.block_m:
        return AttentionTile(need, tile.block_n, tile.num_warps, tile.num_stages)
    return tile
