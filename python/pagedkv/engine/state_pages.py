"""Recurrent states in the paged KV pool: a state group's block holds, in its page, the state
of every layer of the group after an aligned prefix (the manager's ``"state"`` group kind).

The KV cache tensor is ``[num_kv_slots, 2, num_blocks, block_size, num_kv_heads, head_size]``
(:mod:`pagedkv.engine.models.model`); block ``b``'s page is ``kv_cache[:, :, b]``, ``P =
num_kv_slots * 2 * block_size * num_kv_heads * head_size`` numbers of the cache's dtype, the
same size in every group. A state block keeps its state as the first numbers of that page,
read row-major (slot, K/V, token, head, channel): layer ``j`` of the group at offset ``j *
per_layer``. Block copies (copy rows, swaps, host-tier copies) copy whole pages, so they move
states as they move K/V, and zeroing a page gives the state before the first token.

Per step the model reads each scheduled sequence's live state block
(``block_tables[g, s, (seq_len - 1) // block_size]``, after the step's copies and zeroing)
with :func:`read_pages`, updates the rows, and writes them back with :func:`write_pages`.
"""

from __future__ import annotations

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

__all__ = ["page_numel", "read_pages", "write_pages", "zero_pages", "live_state_blocks"]


def page_numel(kv_cache: torch.Tensor) -> int:
    """Numbers in one block's page (every layer slot, K and V): ``P`` of the module docs."""
    return kv_cache[:, :, 0].numel()


def read_pages(kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """A copy of the pages of ``blocks`` (int64 ``[B]`` block ids): ``[B, P]`` in the cache's
    dtype, one row per block (see the module docs for the order)."""
    return kv_cache[:, :, blocks].movedim(2, 0).reshape(blocks.shape[0], -1)


def write_pages(kv_cache: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor) -> None:
    """Store ``rows`` ``[B, P]`` as the pages of ``blocks`` (distinct int64 ``[B]`` block ids),
    in place; the inverse of :func:`read_pages`."""
    shape = (blocks.shape[0], kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
    kv_cache[:, :, blocks] = rows.view(shape).movedim(0, 2).to(kv_cache.dtype)


def zero_pages(kv_cache: torch.Tensor, blocks: torch.Tensor) -> None:
    """Zero the pages of ``blocks`` (int64 ``[B]``): the state before a sequence's first
    token (the manager's zero rows of a fresh state block)."""
    if blocks.numel():
        kv_cache[:, :, blocks] = 0


def live_state_blocks(table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each sequence's live state block: ``table[s, (seq_lens[s] - 1) // block_size]`` as int64
    ``[S]``, for a state group's block table ``table`` ``int32 [S, W]`` and the sequences'
    lengths after the step ``seq_lens`` (``>= 1``)."""
    index = (seq_lens.long() - 1) // block_size
    return table.long().gather(1, index[:, None]).squeeze(1)
