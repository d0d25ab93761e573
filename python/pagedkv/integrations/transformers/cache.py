"""pagedkv as the KV cache of transformers' continuous batching.

:class:`PagedKVAttentionCache` stands in for transformers' ``PagedAttentionCache``: it keeps
transformers' cache tensor, sector layout and per-attention-type allocators (the attention reads
and writes through them), but every block decision is made by ONE
:class:`pagedkv.KVCacheManager` with one KV cache group per allocator: admission and
allocation, prefix hits, forks with copy-on-write, frees and preemption. The read and write
indices and the kernel block tables the attention uses come from pagedkv's block tables
(:mod:`pagedkv.integrations.transformers.geometry`). docs/design.md, "transformers seam", maps
every call transformers makes onto pagedkv.

The allocator classes (:class:`PagedKVFullAttentionAllocator`,
:class:`PagedKVSlidingAttentionAllocator`) are what ``install`` puts in transformers'
``ATTN_TYPE_TO_ALLOCATOR`` table; outside a :class:`PagedKVAttentionCache` they behave as
transformers' own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

import pagedkv
from pagedkv._optional import optional_imports

with optional_imports("pagedkv.integrations.transformers", "transformers"):
    import torch
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.cache_allocators import (
        SLIDING_ATTENTION,
        CacheAllocator,
        FullAttentionCacheAllocator,
        SlidingAttentionCacheAllocator,
    )

from pagedkv.errors import OutOfBlocksError
from pagedkv.integrations.transformers.errors import (
    CacheStateMismatchError,
    CacheTooSmallError,
    UnsupportedTransformersConfigError,
)
from pagedkv.integrations.transformers.geometry import SECTOR_OF_BLOCK, GroupGeometry
from pagedkv.integrations.transformers.layer_types import check_layer_types

if TYPE_CHECKING:
    from transformers.generation.continuous_batching.requests import RequestState

__all__ = [
    "PagedKVAttentionCache",
    "PagedKVFullAttentionAllocator",
    "PagedKVSlidingAttentionAllocator",
]


def _check_cb_config(cb_config: Any, distributed_helper: Any) -> None:
    """Refuse the continuous-batching settings the integration does not serve."""
    refused: list[tuple[str, Any, str]] = []
    if cb_config.use_async_batching:
        refused.append(
            (
                "use_async_batching",
                cb_config.use_async_batching,
                "asynchronous batching schedules a step before the previous step's tokens are known, "
                "and pagedkv hashes blocks from their tokens when it allocates them",
            )
        )
    if cb_config.cpu_offload_space:
        refused.append(
            (
                "cpu_offload_space",
                cb_config.cpu_offload_space,
                "CPU offloading copies transformers' own block tables; under pagedkv a preempted request "
                "is recomputed (set cpu_offload_space=0)",
            )
        )
    if getattr(distributed_helper, "tp_size", 1) > 1:
        refused.append(("tp_size", distributed_helper.tp_size, "tensor parallelism is not served"))
    if refused:
        field, value, reason = refused[0]
        raise UnsupportedTransformersConfigError(
            f"ContinuousBatchingConfig.{field}={value!r} is not served by pagedkv: {reason}",
            field=field,
            value=str(value),
            reason=reason,
        )


class _PagedKVAllocator(CacheAllocator):
    """What both pagedkv allocators add to transformers' allocator of their attention type:
    block counts, cache indices and block tables answered from the owning
    :class:`PagedKVAttentionCache` (its pagedkv manager), and an update that writes the new K/V
    rows before it reads (every position has its own slot under pagedkv: no ring buffer)."""

    _owner: PagedKVAttentionCache | None = None

    def needs_new_blocks(self, request_id: str, past_length: int, query_length: int) -> int:
        """pagedkv blocks this group takes net (taken minus released) for ``query_length`` more
        tokens of the request (transformers' own count outside a pagedkv cache)."""
        if self._owner is None:
            return super().needs_new_blocks(request_id, past_length, query_length)  # type: ignore[safe-super]
        return self._owner.group_blocks_needed(self.index, request_id, past_length, query_length)

    def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        """Rows to read for the request's keys/values, in position order, the query included."""
        if self._owner is None:
            return super().get_read_indices(request_id, past_length, query_length)  # type: ignore[safe-super]
        rows = self._owner.group_rows(self.index, request_id, past_length, query_length)
        return rows.tolist()  # type: ignore[no-any-return]

    def get_write_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        """Rows the request's ``query_length`` new tokens are written to."""
        if self._owner is None:
            return super().get_write_indices(request_id, past_length, query_length)  # type: ignore[safe-super]
        rows = self._owner.group_rows(self.index, request_id, past_length, query_length)
        return rows[len(rows) - query_length :].tolist()  # type: ignore[no-any-return]

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        read_index: torch.Tensor,
        write_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V (``[seqlen_q, kv_heads, head_dim]``) at ``write_index``, then return
        the rows at ``read_index`` (``[len(read_index), kv_heads, head_dim]``), or the new K/V
        themselves when nothing is read."""
        if self._owner is None:
            return super().update(key_states, value_states, layer_idx, read_index, write_index)  # type: ignore[safe-super]
        k_rows, v_rows = self._kv_token_views[layer_idx]  # type: ignore[attr-defined]
        k_rows.index_copy_(0, write_index, key_states)
        v_rows.index_copy_(0, write_index, value_states)
        if read_index.numel() == 0:
            return key_states, value_states
        return k_rows.index_select(0, read_index), v_rows.index_select(0, read_index)


class PagedKVFullAttentionAllocator(_PagedKVAllocator, FullAttentionCacheAllocator):
    """transformers' full-attention allocator whose blocks are pagedkv's (see the module docs)."""

    def fill_block_table(self, request_id: str, past_length: int, query_length: int, block_table: torch.Tensor) -> None:
        """Fill the request's row of the kernel block table (``int32[max_blocks_per_request]``)
        with the page indices of its pagedkv blocks."""
        if self._owner is None:
            super().fill_block_table(request_id, past_length, query_length, block_table)
            return
        entries = self._owner.group_page_table(self.index, request_id, past_length + query_length)
        block_table[: len(entries)].copy_(torch.from_numpy(entries).to(block_table.dtype), non_blocking=True)


class PagedKVSlidingAttentionAllocator(_PagedKVAllocator, SlidingAttentionCacheAllocator):
    """transformers' sliding-window allocator whose blocks are pagedkv's (see the module docs).
    The keys it returns are those of positions ``past - window + 1 ..`` in order, as transformers'
    own, read from pagedkv's window blocks instead of a ring buffer."""


class PagedKVAttentionCache(PagedAttentionCache):
    """transformers' ``PagedAttentionCache`` with pagedkv's :class:`~pagedkv.KVCacheManager`
    deciding every block (see the module docs).

    Built by transformers' continuous batching while the integration is installed, with the
    arguments of ``PagedAttentionCache``. Memory sizing, the cache tensor and its sector layout
    are transformers' own; pagedkv gets one block per sector (``manager.num_blocks - 1`` usable
    blocks) and one KV cache group per attention type, in the order of ``cache_allocators``.

    Raises:
        UnsupportedAttentionTypeError: a layer type pagedkv does not serve.
        UnsupportedTransformersConfigError: asynchronous batching, CPU offloading or tensor
            parallelism requested, or a geometry pagedkv cannot hold (a block over
            ``pagedkv.MAX_BLOCK_SIZE`` tokens).
    """

    manager: pagedkv.KVCacheManager

    def __init__(
        self,
        config: Any,
        continuous_batching_config: Any,
        device: torch.device | str,
        distributed_helper: Any,
        dtype: torch.dtype = torch.float16,
        model_supports_logits_to_keep: bool = False,
    ) -> None:
        check_layer_types(config)
        _check_cb_config(continuous_batching_config, distributed_helper)
        super().__init__(
            config,
            continuous_batching_config,
            device,
            distributed_helper,
            dtype=dtype,
            model_supports_logits_to_keep=model_supports_logits_to_keep,
        )
        self._geometry: list[GroupGeometry] = []
        specs = []
        layer_groups = [0] * config.num_hidden_layers
        for allocator in self.cache_allocators.values():
            if not isinstance(allocator, _PagedKVAllocator):
                raise UnsupportedTransformersConfigError(
                    f"allocator {type(allocator).__name__} of {allocator.layer_type!r} is not pagedkv's: "
                    "build the cache through pagedkv.integrations.transformers.install()",
                    field="ATTN_TYPE_TO_ALLOCATOR",
                    value=type(allocator).__name__,
                    reason="PagedKVAttentionCache needs pagedkv's allocators",
                )
            window = getattr(allocator, "sliding_window", None) if allocator.layer_type == SLIDING_ATTENTION else None
            geom = GroupGeometry(
                name=allocator.layer_type,
                page_size=allocator.tokens_per_page,
                blocks_per_sector=allocator.blocks_per_sector,
                row_stride=allocator.block_physical_stride,
                window=window,
            )
            if geom.block_size > pagedkv.MAX_BLOCK_SIZE:
                raise UnsupportedTransformersConfigError(
                    f"a cache sector holds {geom.block_size} tokens of {geom.name}, over pagedkv's "
                    f"MAX_BLOCK_SIZE {pagedkv.MAX_BLOCK_SIZE}: use a smaller page_size",
                    field="page_size",
                    value=str(geom.page_size),
                    reason=f"one pagedkv block (a sector) would hold {geom.block_size} tokens",
                )
            self._geometry.append(geom)
            per_token = self.bytes_per_sector // geom.block_size
            if window is None:
                specs.append(pagedkv.KVCacheGroupSpec("full", geom.block_size, per_token))
            else:
                specs.append(pagedkv.KVCacheGroupSpec("sliding_window", geom.block_size, per_token, window=window))
            for layer in allocator.layer_indices:
                layer_groups[layer] = allocator.index
        # A prefix hit allocates the hit and a slot for the next token at once (transformers takes
        # the hit before it schedules the request); a windowed group then releases by that one
        # token more, which drops the oldest position the query still reads exactly when
        # window = 2 (mod block size). Hits are off for that geometry.
        self._hit_safe = all(g.window is None or (g.window - 2) % g.block_size != 0 for g in self._geometry)
        self.use_prefix_sharing = bool(self.allow_block_sharing) and self._hit_safe
        self.manager = pagedkv.KVCacheManager(
            pagedkv.CacheConfig(
                self.num_sectors + 1,
                groups=specs,
                layer_groups=layer_groups,
                enable_prefix_caching=self.use_prefix_sharing,
            )
        )
        self._sectors = self.cache_tensor.view(-1, self.bytes_per_sector)
        self._seq_of: dict[str, int] = {}
        self._known: dict[str, int] = {}
        self._tables: dict[str, list[npt.NDArray[np.int32]]] = {}
        self._next_seq = 1
        for allocator in self.cache_allocators.values():
            allocator._owner = self  # type: ignore[attr-defined]
        from pagedkv.integrations.transformers.install import register_cache

        register_cache(self)

    # ------------------------------------------------------------------ requests and tokens

    def _tokens(self, state: RequestState, start: int) -> list[int]:
        """The request's known tokens (prompt, then generated) from ``start`` on."""
        initial, generated = state.initial_tokens, state.generated_tokens
        if start >= len(initial):
            return list(generated[start - len(initial) :])
        return list(initial[start:]) + list(generated)

    def _sync(self, state: RequestState) -> int:
        """The request's pagedkv sequence, registered on first sight, with every token
        transformers knows appended."""
        rid = state.request_id
        seq = self._seq_of.get(rid)
        total = len(state.initial_tokens) + len(state.generated_tokens)
        if seq is None:
            seq = self._new_seq(rid)
            self.manager.add_sequence(seq, np.asarray(self._tokens(state, 0), dtype=np.int64))
            self._known[rid] = total
        elif total > self._known[rid]:
            self.manager.append_tokens(seq, np.asarray(self._tokens(state, self._known[rid]), dtype=np.int64))
            self._known[rid] = total
        return seq

    def _new_seq(self, rid: str) -> int:
        seq = self._next_seq
        self._next_seq += 1
        self._seq_of[rid] = seq
        return seq

    def _apply(self, rid: str, out: pagedkv.StepOutput) -> None:
        """Run the step's copy-on-write copies (whole sectors) and keep the request's tables
        (the step's dense ``block_tables`` ``int32[G, 1, W]``: it ran with ``block_table=True``)."""
        copies = np.asarray(out.copies).reshape(-1, 3)
        if len(copies):
            src = torch.from_numpy(copies[:, 1].astype(np.int64) + SECTOR_OF_BLOCK)
            dst = torch.from_numpy(copies[:, 2].astype(np.int64) + SECTOR_OF_BLOCK)
            self._sectors.index_copy_(
                0, dst.to(self._sectors.device), self._sectors.index_select(0, src.to(self._sectors.device))
            )
        self._tables[rid] = list(out.block_tables[:, 0, :])

    def _tables_of(self, rid: str) -> list[npt.NDArray[np.int32]]:
        tables = self._tables.get(rid)
        if tables is None:
            seq = self._seq_of.get(rid)
            if seq is None:
                raise CacheStateMismatchError(
                    f"request {rid!r} has no pagedkv sequence but its cache indices were asked for",
                    request_id=rid,
                    reason="no sequence",
                )
            tables = self.manager.block_tables(seq)
            self._tables[rid] = tables
        return tables

    # ------------------------------------------------------------------ allocation

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        """Take the longest cached prefix of the prompt pagedkv's groups all serve (a multiple of
        its hit unit, at most ``len(prompt_ids) - 1`` tokens): pagedkv allocates the hit and a
        slot for the next token now, so the hit stays the request's. Returns the hit tokens."""
        if not self.use_prefix_sharing:
            return 0
        seq = self._seq_of.get(request_id)
        if seq is None:
            seq = self._new_seq(request_id)
            self.manager.add_sequence(seq, np.asarray(prompt_ids, dtype=np.int64))
            self._known[request_id] = len(prompt_ids)
        elif self.manager.num_computed_tokens(seq) > 0:
            return 0
        hit = self.manager.lookup_prefix(seq)
        if hit == 0:
            return 0
        out = self.manager.step([seq], [1], block_table=True, token_arrays=False)
        if out.error is not None:
            if isinstance(out.error, OutOfBlocksError):
                return 0
            raise out.error
        if int(out.num_cached_tokens[0]) != hit:
            raise CacheStateMismatchError(
                f"request {request_id!r}: pagedkv took {int(out.num_cached_tokens[0])} cached tokens, "
                f"its lookup said {hit}",
                request_id=request_id,
                reason="prefix hit changed between lookup and allocation",
            )
        self._apply(request_id, out)
        return hit

    def can_store_request_tokens(self, state: RequestState, request_len: int, dry_run: bool = False) -> bool:
        """Allocate (all groups at once, one pagedkv step) the slots of the request's next
        ``request_len`` tokens; ``False`` with nothing changed when the pool cannot hold them.
        With ``dry_run`` only say whether it would fit.

        Raises:
            CacheTooSmallError: the request cannot fit even with every other request gone,
                and no other request holds a block (until then it waits).
        """
        rid = state.request_id
        target = state.current_len() + request_len
        seq = self._seq_of.get(rid)
        if dry_run and seq is None:
            return self._blocks_from_empty(target) <= self.manager.num_free_blocks
        seq = self._sync(state)
        need = target - self.manager.num_computed_tokens(seq)
        if need <= 0:
            return True
        if dry_run:
            take, release = self.manager.num_blocks_needed(seq, need)
            return take <= self.manager.num_free_blocks + release
        out = self.manager.step([seq], [need], block_table=True, token_arrays=False)
        if out.error is not None:
            if isinstance(out.error, OutOfBlocksError):
                self._raise_if_never_fits(rid, seq, need, target)
                return False
            raise out.error
        if int(out.seq_lens[0]) != target:
            raise CacheStateMismatchError(
                f"request {rid!r}: pagedkv holds {int(out.seq_lens[0])} tokens, transformers scheduled up to {target}",
                request_id=rid,
                reason="token counts disagree",
            )
        self._apply(rid, out)
        return True

    def _blocks_from_empty(self, num_tokens: int) -> int:
        """Blocks a new request of ``num_tokens`` tokens in one chunk takes on an empty cache."""
        return sum(-(-num_tokens // g.block_size) for g in self._geometry)

    def _raise_if_never_fits(self, rid: str, seq: int, need: int, target: int) -> None:
        """Raise :class:`CacheTooSmallError` when the request cannot fit even with every other
        request gone and no other request holds a block any more. While others hold blocks the
        request waits (the caller answers ``False``): transformers fails every request in flight when its loop
        raises, so raising earlier would fail requests that fit (stock transformers fails only
        the one that never fits, once the others are done)."""
        take, release = self.manager.num_blocks_needed(seq, need)
        held = sum(self.manager.num_blocks_held(seq))
        usable = self.manager.num_blocks - 1
        if take > usable - held + release:
            others = (s for r, s in self._seq_of.items() if r != rid)
            if any(sum(self.manager.num_blocks_held(s)) > 0 for s in others):
                return
            # transformers fails the request (the loop's error path); pagedkv forgets it now, as
            # a failed waiting request is never freed by transformers.
            self.free_blocks(rid)
            raise CacheTooSmallError(
                f"request {rid!r} needs {take} more KV blocks for {target} tokens but the cache has "
                f"{usable} blocks ({usable - held + release} available with every other request gone): "
                "give continuous batching a larger cache (num_blocks) or a shorter request",
                request_id=rid,
                num_tokens=target,
                requested=take,
                num_blocks=usable,
            )

    def group_blocks_needed(self, group: int, request_id: str, past_length: int, query_length: int) -> int:
        """Net pagedkv blocks (taken minus released) group ``group`` needs for the request's
        ``query_length`` tokens after ``past_length`` (a request pagedkv does not know yet: its
        blocks from an empty cache)."""
        seq = self._seq_of.get(request_id)
        geom = self._geometry[group]
        if seq is None:
            return -(-(past_length + query_length) // geom.block_size)
        need = past_length + query_length - self.manager.num_computed_tokens(seq)
        if need <= 0:
            return 0
        take, release = self.manager.num_blocks_needed_per_group(seq, need)[group]
        return take - release

    def count_storable_requests(self, list_blocks_needed: list[dict[str, int]]) -> int:
        """How many of the requests (their per-group block counts, in order) fit in the free
        pagedkv blocks if admitted one by one."""
        free = self.manager.num_free_blocks
        for i, needed in enumerate(list_blocks_needed):
            free -= sum(needed.values())
            if free < 0:
                return i
        return len(list_blocks_needed)

    # ------------------------------------------------------------------ frees, preemption, forks

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """Release the request's blocks. ``no_cache`` (transformers preempting it to recompute
        later) is a pagedkv recompute preemption: the tokens stay, the blocks go back (full ones
        stay cached, as pagedkv keeps them for prefix hits); otherwise the request is freed and
        forgotten. Unknown ids are ignored."""
        seq = self._seq_of.get(request_id)
        if seq is None:
            return
        self._tables.pop(request_id, None)
        if no_cache:
            self.manager.preempt([seq])
            return
        self.manager.free(seq)
        del self._seq_of[request_id]
        del self._known[request_id]

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        """Free every request; with ``clear_ledgers`` also forget every cached prefix."""
        for rid in list(self._seq_of):
            self.free_blocks(rid)
        if clear_ledgers:
            self.manager.reset_prefix_cache()

    def reset(self) -> None:
        """Free every request and every cached prefix."""
        self.free_all_requests(clear_ledgers=True)
        self.pool.reset()

    def prepare_fork_request(
        self, src_state: RequestState, dst_req_ids: list[str], copy_src_and_dst: dict[str, tuple[list[int], list[int]]]
    ) -> list[str]:
        """Fork the source request into as many of ``dst_req_ids`` as the pool can give a
        copy-on-write block each (one per group whose last block is partly filled): pagedkv shares
        every block; the copy of a shared partial block happens when a fork first writes into it.
        Returns the ids forked; ``copy_src_and_dst`` is left empty (nothing to copy now)."""
        src = self._seq_of[src_state.request_id]
        computed = self.manager.num_computed_tokens(src)
        per_child = sum(1 for g in self._geometry if computed % g.block_size)
        forked: list[str] = []
        for dst in dst_req_ids:
            if self.manager.num_free_blocks < per_child * (len(forked) + 1):
                break
            self.manager.fork(src, self._new_seq(dst))
            self._known[dst] = self._known[src_state.request_id]
            forked.append(dst)
        return forked

    def perform_cache_copy(self, copy_src_and_dst: dict[str, tuple[list[int], list[int]]]) -> None:
        """Nothing to copy: pagedkv plans copy-on-write copies when a fork writes, and they run
        then (:meth:`can_store_request_tokens`)."""

    def count_new_complete_blocks(self, state: RequestState, request_len: int) -> dict[str, int]:
        """Nothing to count: pagedkv hashes full blocks when it allocates them."""
        return {}

    def mark_complete_blocks(self, state: RequestState, complete_blocks: dict[str, int]) -> None:
        """Nothing to mark: pagedkv hashes full blocks when it allocates them."""

    def evict_cached_blocks(self) -> bool:
        """``False``: pagedkv's free blocks already include the cached ones, which it evicts
        (least recently used first) only when an allocation needs them."""
        return False

    def compute_free_capacity(self, relative: bool = True) -> int | float:
        """Free pagedkv blocks (cached ones included) as a fraction of the usable blocks, or in
        bytes (one sector each)."""
        free = self.manager.num_free_blocks
        if relative:
            return free / max(1, self.manager.num_blocks - 1)
        return int(free * self.bytes_per_sector)

    # ------------------------------------------------------------------ attention inputs

    def group_rows(self, group: int, request_id: str, past_length: int, query_length: int) -> npt.NDArray[np.int64]:
        """Rows (``int64``) group ``group`` reads for the request's query after ``past_length``
        tokens, in position order; the last ``query_length`` are the rows it writes.

        Raises:
            CacheStateMismatchError: a position falls on no block (never when transformers
                follows the contract).
        """
        geom = self._geometry[group]
        table = self._tables_of(request_id)[group]
        start, stop = geom.first_read(past_length), past_length + query_length
        if geom.reads_released(table, start, stop):
            raise CacheStateMismatchError(
                f"request {request_id!r}: {geom.name} positions {start}..{stop - 1} are not all held by pagedkv",
                request_id=request_id,
                reason="read past the block table",
            )
        return geom.rows(table, start, stop)

    def group_page_table(self, group: int, request_id: str, num_tokens: int) -> npt.NDArray[np.int64]:
        """Kernel block-table entries of group ``group`` for the request's ``num_tokens`` tokens."""
        allocator = list(self.cache_allocators.values())[group]
        pages_stride = allocator.block_physical_stride // allocator.tokens_per_page
        return self._geometry[group].page_table(self._tables_of(request_id)[group], num_tokens, pages_stride)

    def extend_read_and_write_indices(
        self,
        request_id: str,
        past_length: int,
        query_length: int,
        read_index: Sequence[list[int]] | None,
        write_index: Sequence[list[int]],
    ) -> None:
        """Append the request's rows to each group's read and write index lists (one numpy
        computation per group; the write rows are the read rows' tail)."""
        for group in range(len(self._geometry)):
            rows = self.group_rows(group, request_id, past_length, query_length).tolist()
            write_index[group].extend(rows[len(rows) - query_length :])
            if read_index is not None:
                read_index[group].extend(rows)
