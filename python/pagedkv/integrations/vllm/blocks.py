"""The ``KVCacheBlocks`` results ``PagedKVCacheManager`` hands vLLM's scheduler.

vLLM's scheduler reads a ``KVCacheBlocks`` per allocation (``get_block_ids``, concatenation,
``blocks`` for lengths). pagedkv's block ids live in Rust, so these results carry plain id lists
(one KV cache group) instead of one Python ``KVCacheBlock`` per block:

- :data:`PagedKVBlocks`: a subclass of vLLM's ``KVCacheBlocks`` over a list of block ids;
- :data:`GroupedBlocks`: the same over one id list per KV cache group (hybrid models);
- :class:`DeferredBlocks`: the new block of a deferred decode, whose id exists once the
  deferred decodes are flushed into pagedkv (reading it flushes them);
- :class:`DeferredGroupedBlocks`: the same for a deferred decode of the hybrid manager (one
  new block per KV cache group);
- :class:`PrefixHit`: a prefix hit between ``get_computed_blocks`` and ``allocate_slots`` (its
  length only: pagedkv takes the hit blocks itself when it allocates).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from pagedkv.errors import InvalidSequenceStateError

if TYPE_CHECKING:
    from pagedkv.integrations.vllm.decode_deferral import DecodeDeferral

__all__ = ["DeferredBlocks", "DeferredGroupedBlocks", "GroupedBlocks", "PagedKVBlocks", "PrefixHit"]


def _kv_cache_blocks_type() -> type:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    return cast(type, KVCacheBlocks)


def _make_blocks_class() -> type:
    KVCacheBlocks = _kv_cache_blocks_type()

    class PagedKVBlocksImpl(KVCacheBlocks):  # type: ignore[misc, valid-type]
        """vLLM ``KVCacheBlocks`` backed by a list of pagedkv block ids (one KV cache group).

        The scheduler only asks for ids (``get_block_ids``) and concatenates results; those
        work on the id list without building a Python object per block. ``blocks`` builds
        ``KVCacheBlock`` views on demand (id only: ref counts and hashes live in pagedkv).
        """

        def __init__(self, ids: list[int]) -> None:
            self.ids = ids

        @property  # type: ignore[override, unused-ignore]
        def blocks(self) -> tuple[list[Any], ...]:
            """One group of vLLM ``KVCacheBlock`` views (block id only), built per access."""
            from vllm.v1.core.kv_cache_utils import KVCacheBlock

            return ([KVCacheBlock(block_id=b) for b in self.ids],)

        def get_block_ids(
            self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
        ) -> tuple[list[int], ...] | None:
            """Block ids per KV cache group, as vLLM's ``KVCacheBlocks.get_block_ids``: one group
            (``([id, ...],)``); ``None`` when ``allow_none`` and there are no blocks; empty lists
            for requested groups other than 0."""
            if allow_none and not self.ids:
                return None
            if group_ids is not None and list(group_ids) != [0]:
                return tuple([] if g != 0 else list(self.ids) for g in group_ids)
            return (list(self.ids),)

        def get_unhashed_block_ids(self) -> list[int]:
            """Every block id (vLLM's API; pagedkv tracks hashes itself, so all are listed)."""
            return list(self.ids)

        def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
            """``[get_unhashed_block_ids()]``: the one KV cache group."""
            return [list(self.ids)]

        def __add__(self, other: Any) -> Any:
            other_ids = other.get_block_ids()[0] if other is not None else []
            return PagedKVBlocksImpl(self.ids + list(other_ids))

        def new_empty(self) -> Any:
            """vLLM's empty ``KVCacheBlocks`` (one group, no blocks)."""
            return KVCacheBlocks(((),))

        def __eq__(self, other: object) -> bool:
            if isinstance(other, KVCacheBlocks):
                theirs: Any = other
                return bool(theirs.get_block_ids() == self.get_block_ids())
            return NotImplemented

        __hash__ = None  # type: ignore[assignment]

        def __repr__(self) -> str:
            return f"PagedKVBlocks(block_ids={self.ids})"

    PagedKVBlocksImpl.__name__ = PagedKVBlocksImpl.__qualname__ = "PagedKVBlocks"
    return PagedKVBlocksImpl


PagedKVBlocks: Any = _make_blocks_class()


def _make_grouped_class() -> type:
    KVCacheBlocks = _kv_cache_blocks_type()

    class GroupedBlocksImpl(KVCacheBlocks):  # type: ignore[misc, valid-type]
        """vLLM ``KVCacheBlocks`` over one list of pagedkv block ids per KV cache group (the
        hybrid manager's results; the null block 0 marks a released sliding-window entry, as
        vLLM's own null block does)."""

        def __init__(self, groups: tuple[list[int], ...]) -> None:
            self.groups = groups

        @property  # type: ignore[override, unused-ignore]
        def blocks(self) -> tuple[list[Any], ...]:
            """Per group, vLLM ``KVCacheBlock`` views (block id only), built per access."""
            from vllm.v1.core.kv_cache_utils import KVCacheBlock

            return tuple([KVCacheBlock(block_id=b) for b in ids] for ids in self.groups)

        def get_block_ids(
            self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
        ) -> tuple[list[int], ...] | None:
            """Block ids per KV cache group (all groups, or ``group_ids``); ``None`` when
            ``allow_none`` and every selected group is empty."""
            groups = self.groups if group_ids is None else tuple(self.groups[g] for g in group_ids)
            if allow_none and not any(groups):
                return None
            return tuple(list(ids) for ids in groups)

        def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
            """Every non-null block id per group (pagedkv tracks hashes itself)."""
            return [[b for b in ids if b != 0] for ids in self.groups]

        def __add__(self, other: Any) -> Any:
            theirs = other.get_block_ids() if other is not None else ()
            return GroupedBlocksImpl(
                tuple(ids + list(more) for ids, more in zip(self.groups, theirs, strict=False))
                if theirs
                else self.groups
            )

        def new_empty(self) -> Any:
            """vLLM's empty ``KVCacheBlocks`` with this result's number of groups."""
            return KVCacheBlocks(tuple(() for _ in self.groups))

        def __eq__(self, other: object) -> bool:
            if isinstance(other, KVCacheBlocks):
                theirs: Any = other
                return bool(theirs.get_block_ids() == self.get_block_ids())
            return NotImplemented

        __hash__ = None  # type: ignore[assignment]

        def __repr__(self) -> str:
            return f"GroupedBlocks(block_ids={self.groups})"

    GroupedBlocksImpl.__name__ = GroupedBlocksImpl.__qualname__ = "GroupedBlocks"
    return GroupedBlocksImpl


GroupedBlocks: Any = _make_grouped_class()


class DeferredBlocks(PagedKVBlocks):  # type: ignore[misc, valid-type, unused-ignore]
    """The new block of a deferred decode (:class:`~pagedkv.integrations.vllm.decode_deferral.
    DecodeDeferral`): its id is known once the pending decodes are flushed into pagedkv, which
    reading ``ids`` does."""

    def __init__(self, deferral: DecodeDeferral) -> None:
        self._deferral = deferral
        self._ids: list[int] = []

    @property
    def ids(self) -> list[int]:
        """The new block's id (flushes the pending decodes into pagedkv first)."""
        if self._deferral.pending_seqs:
            self._deferral.flush()
        return self._ids


class DeferredGroupedBlocks(GroupedBlocks):  # type: ignore[misc, valid-type, unused-ignore]
    """The new blocks (one per KV cache group) of a decode ``HybridPagedKVCacheManager``
    deferred: their ids are known once the deferred decodes are flushed into pagedkv, which
    reading ``groups`` does (``flush`` is the manager's ``flush_decodes``)."""

    def __init__(self, flush: Callable[[], Any]) -> None:
        self._flush = flush
        self._groups: tuple[list[int], ...] | None = None

    @property
    def groups(self) -> tuple[list[int], ...]:
        """One id list per group (flushes the deferred decodes into pagedkv first)."""
        if self._groups is None:
            self._flush()
        assert self._groups is not None, "the flush fills in every deferred decode's blocks"
        return self._groups


class PrefixHit:
    """What ``get_computed_blocks`` returns for a hit: the scheduler passes it back to
    ``allocate_slots`` unchanged (pagedkv takes the hit blocks itself while allocating), so only
    the hit length is kept; ids exist once allocated (``get_blocks``).

    Attributes: ``num_tokens`` (hit tokens, whole blocks), ``blocks`` (per KV cache group,
    ``num_tokens / block_size`` placeholders of that group, for vLLM's length checks),
    ``seq_id`` (the request's pagedkv sequence).
    """

    __slots__ = ("num_tokens", "blocks", "seq_id")

    def __init__(self, num_tokens: int, num_blocks: int | Sequence[int], seq_id: int) -> None:
        """``num_blocks``: the hit's blocks in the one group, or one count per group."""
        self.num_tokens = num_tokens
        counts = (num_blocks,) if isinstance(num_blocks, int) else tuple(num_blocks)
        self.blocks = tuple((None,) * n for n in counts)
        self.seq_id = seq_id

    def get_block_ids(self, allow_none: bool = False, **_: Any) -> Any:
        """Always raises ``InvalidSequenceStateError`` (a ``RuntimeError``): a hit's physical
        block ids exist only once ``allocate_slots`` has taken the blocks (read them with
        ``PagedKVCacheManager.get_blocks(request_id)``)."""
        raise InvalidSequenceStateError(
            "block ids of a prefix hit are known after allocate_slots; use get_blocks(request_id)",
            seq_id=self.seq_id,
            state="prefix hit looked up, not allocated",
            operation="get_block_ids",
            expected="allocated by allocate_slots",
        )

    def __add__(self, other: Any) -> Any:
        return other
