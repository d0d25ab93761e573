"""Where a token's K/V lives: pagedkv's block ids mapped onto transformers' cache tensor.

transformers' continuous batching keeps the KV cache of all layers in one flat byte tensor cut
into equal *sectors*; the first two sectors are trash (padding tokens read from sector 0 and
write to sector 1). Each attention type's allocator (one per KV cache group) cuts a sector into
``blocks_per_sector`` blocks of ``page_size`` tokens for every layer of its group, and addresses
a token through a per-layer row view: row ``transformers_block * row_stride + offset``.

The integration gives pagedkv one block per sector: pagedkv block ``b`` (``1 <= b <
num_blocks``; 0 is pagedkv's null block) is sector ``b + 1``, and group ``g`` sees it as
``blocks_per_sector`` consecutive transformers blocks, i.e. a pagedkv block of
``page_size * blocks_per_sector`` tokens. Every group's block is then the same number of bytes
(one sector), as pagedkv's one pool requires, and no sector is shared by two groups, as in
transformers. Everything here is numpy over whole token ranges (no per-token Python loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

__all__ = ["SECTOR_OF_BLOCK", "GroupGeometry"]

#: pagedkv block ``b`` is transformers sector ``b + SECTOR_OF_BLOCK`` (sectors 0 and 1 are the trash
#: sectors; pagedkv's block 0 is its null block and has no sector).
SECTOR_OF_BLOCK = 1


@dataclass(frozen=True)
class GroupGeometry:
    """One transformers allocator (attention type) seen as a pagedkv KV cache group.

    Attributes:
        name: the attention type (``"full_attention"``, ``"sliding_attention"``).
        page_size: tokens per transformers page (``tokens_per_page``).
        blocks_per_sector: the allocator's blocks per sector.
        row_stride: rows of the allocator's per-layer token view per transformers block
            (``block_physical_stride``).
        window: the sliding window in tokens (a query at ``p`` reads ``p - window + 1 .. p``), or
            ``None`` for full attention.
    """

    name: str
    page_size: int
    blocks_per_sector: int
    row_stride: int
    window: int | None

    @property
    def block_size(self) -> int:
        """Tokens of one pagedkv block (one sector) in this group."""
        return self.page_size * self.blocks_per_sector

    def first_read(self, past_length: int) -> int:
        """First position a query starting at ``past_length`` reads: 0 for full attention,
        ``max(0, past_length - window + 1)`` for a sliding window."""
        if self.window is None:
            return 0
        return max(0, past_length - self.window + 1)

    @cached_property
    def _block_offsets(self) -> npt.NDArray[np.int64]:
        """Row of each token of a pagedkv block relative to the block's first row
        (``int64[block_size]``): page ``k`` of the block is transformers block ``first + k``."""
        pages = np.arange(self.blocks_per_sector, dtype=np.int64)[:, None] * self.row_stride
        offsets: npt.NDArray[np.int64] = (pages + np.arange(self.page_size, dtype=np.int64)[None, :]).ravel()
        return offsets

    def rows(self, table: npt.NDArray[np.int32], start: int, stop: int) -> npt.NDArray[np.int64]:
        """Row indices (``int64[stop - start]``) of positions ``start .. stop - 1`` in the
        allocator's per-layer token views, read through the group's pagedkv block table
        ``table`` (``int32[n]``, pagedkv block ids, 0 where released). The caller checks that
        no position falls on a released entry (:meth:`reads_released`)."""
        bs = self.block_size
        first, last = start // bs, (stop - 1) // bs
        blocks = table[first : last + 1].astype(np.int64)
        base = (blocks + SECTOR_OF_BLOCK) * (self.blocks_per_sector * self.row_stride)
        rows = (base[:, None] + self._block_offsets[None, :]).ravel()
        out: npt.NDArray[np.int64] = rows[start - first * bs : stop - first * bs]
        return out

    def reads_released(self, table: npt.NDArray[np.int32], start: int, stop: int) -> bool:
        """Whether positions ``start .. stop - 1`` need an entry past the table's end or one that
        is released (pagedkv's null block 0)."""
        if stop <= start:
            return False
        bs = self.block_size
        first, last = start // bs, (stop - 1) // bs
        return last >= len(table) or not table[first : last + 1].all()

    def page_table(self, table: npt.NDArray[np.int32], num_tokens: int, pages_stride: int) -> npt.NDArray[np.int64]:
        """The rows of a kernel block table (transformers' decode fast path) for a request of
        ``num_tokens`` tokens: one entry per transformers page, the page index in the
        allocator's per-layer page views (``transformers_block * pages_stride``)."""
        pages = np.arange(-(-num_tokens // self.page_size), dtype=np.int64)
        blocks = table[pages // self.blocks_per_sector].astype(np.int64)
        tblock = (blocks + SECTOR_OF_BLOCK) * self.blocks_per_sector + pages % self.blocks_per_sector
        out: npt.NDArray[np.int64] = tblock * pages_stride
        return out
