"""The ``KVCacheBlocks`` results ``PagedKVCacheManager`` hands vLLM's scheduler.

vLLM's scheduler reads a ``KVCacheBlocks`` per allocation (``get_block_ids``, concatenation,
``blocks`` for lengths). pagedkv's block ids live in Rust, so these results carry plain id lists,
one per KV cache group, instead of one Python ``KVCacheBlock`` per block:

- :data:`PagedKVBlocks`: a subclass of vLLM's ``KVCacheBlocks`` over one id list per group (a
  released sliding-window or chunked-local entry is the null block 0, as vLLM's own null
  block); with one group its reads take a fast path (no walk over the groups);
- :class:`DeferredBlocks`: the new blocks of a deferred decode (one per group), whose ids exist
  once the deferred decodes are flushed into pagedkv (reading them flushes);
- :class:`PrefixHit`: a prefix hit between ``get_computed_blocks`` and ``allocate_slots`` (its
  length only: pagedkv takes the hit blocks itself when it allocates).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from pagedkv.errors import InvalidSequenceStateError

if TYPE_CHECKING:
    from pagedkv.integrations.vllm.decode_deferral import DecodeDeferral

__all__ = ["DeferredBlocks", "PagedKVBlocks", "PrefixHit"]


def _kv_cache_blocks_type() -> type:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    return cast(type, KVCacheBlocks)


def _make_blocks_class() -> type:
    KVCacheBlocks = _kv_cache_blocks_type()

    class PagedKVBlocksImpl(KVCacheBlocks):  # type: ignore[misc, valid-type]
        """vLLM ``KVCacheBlocks`` over one list of pagedkv block ids per KV cache group
        (``groups``, a tuple of lists; 0 marks a released windowed entry).

        The scheduler only asks for ids (``get_block_ids``) and concatenates results; those
        work on the id lists without building a Python object per block. ``blocks`` builds
        ``KVCacheBlock`` views on demand (id only: ref counts and hashes live in pagedkv).
        """

        #: The one group's id list when there is exactly one group (the fast path), else None.
        _one: list[int] | None = None
        #: pagedkv's ``BlockPool`` for a request's held blocks (``get_blocks``): ``blocks`` are
        #: then live views and the unhashed ids are read from it; None for new blocks.
        pool: Any = None

        def __init__(self, groups: tuple[list[int], ...]) -> None:
            self.groups = groups
            if len(groups) == 1:
                self._one = groups[0]

        @property  # type: ignore[override, unused-ignore]
        def blocks(self) -> tuple[list[Any], ...]:
            """Per group, vLLM ``KVCacheBlock`` views (block id only), built per access."""
            if not any(self.groups):
                # vLLM's scheduler reads the empty instance's blocks for every running request
                # each step with a connector: no views to build.
                return tuple([] for _ in self.groups)
            if self.pool is not None:
                from pagedkv.integrations.vllm.pool_view import block_view

                return tuple([block_view(self.pool, b) for b in ids] for ids in self.groups)
            from vllm.v1.core.kv_cache_utils import KVCacheBlock

            return tuple([KVCacheBlock(block_id=b) for b in ids] for ids in self.groups)

        def get_block_ids(
            self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
        ) -> tuple[list[int], ...] | None:
            """Block ids per KV cache group (all groups, or ``group_ids``: a group the
            result does not have reads as empty), as vLLM's ``KVCacheBlocks.get_block_ids``;
            ``None`` when ``allow_none`` and every selected group is empty."""
            ids = self._one
            if ids is None:
                groups = self.groups  # a deferred result's read flushes here
                if group_ids is not None:
                    return self._select(groups, allow_none, group_ids)
                if len(groups) != 1:
                    if allow_none and not any(groups):
                        return None
                    return tuple([*g] for g in groups)
                ids = groups[0]
            elif group_ids is not None:
                return self._select(self.groups, allow_none, group_ids)
            # One group: the scheduler's per-request read, one check.
            if allow_none and not ids:
                return None
            return (list(ids),)

        @staticmethod
        def _select(
            groups: tuple[list[int], ...], allow_none: bool, group_ids: Sequence[int] | None
        ) -> tuple[list[int], ...] | None:
            """``get_block_ids`` over several groups, or the ``group_ids`` selected."""
            if group_ids is not None:
                groups = tuple(groups[g] if 0 <= g < len(groups) else [] for g in group_ids)
            if allow_none and not any(groups):
                return None
            return tuple(list(ids) for ids in groups)

        def get_unhashed_block_ids(self) -> list[int]:
            """The one group's non-null block ids that carry no prefix hash (vLLM's one-group
            API): read from pagedkv's pool for a request's held blocks (``get_blocks``), every
            non-null id for new blocks (pagedkv hashes blocks as they fill)."""
            return self.get_unhashed_block_ids_all_groups()[0]

        def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
            """Per group, the non-null block ids that carry no prefix hash (see
            ``get_unhashed_block_ids``)."""
            pool = self.pool
            if pool is None:
                return [[b for b in ids if b != 0] for ids in self.groups]
            return [[b for b in ids if b != 0 and pool.block_hash(b) is None] for ids in self.groups]

        def __add__(self, other: Any) -> Any:
            theirs = other.get_block_ids() if other is not None else ()
            if not theirs:
                return PagedKVBlocksImpl(self.groups)
            return PagedKVBlocksImpl(tuple(ids + list(more) for ids, more in zip(self.groups, theirs, strict=False)))

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
            return f"PagedKVBlocks(block_ids={self.groups})"

    PagedKVBlocksImpl.__name__ = PagedKVBlocksImpl.__qualname__ = "PagedKVBlocks"
    return PagedKVBlocksImpl


PagedKVBlocks: Any = _make_blocks_class()


class DeferredBlocks(PagedKVBlocks):  # type: ignore[misc, valid-type, unused-ignore]
    """The new blocks (one per KV cache group) of a decode the
    :class:`~pagedkv.integrations.vllm.decode_deferral.DecodeDeferral` deferred: their ids are
    known once the deferred decodes are flushed into pagedkv, which reading ``groups`` does."""

    def __init__(self, deferral: DecodeDeferral) -> None:
        self._deferral = deferral
        self._groups: tuple[list[int], ...] | None = None

    @property
    def groups(self) -> tuple[list[int], ...]:
        """One id list per group (flushes the deferred decodes into pagedkv first)."""
        if self._groups is None:
            self._deferral.flush()
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

    def __init__(self, num_tokens: int, num_blocks: Sequence[int], seq_id: int) -> None:
        """``num_blocks``: the hit's blocks in each group."""
        self.num_tokens = num_tokens
        self.blocks = tuple((None,) * n for n in num_blocks)
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
