"""A read-only view of pagedkv's block pool in the shape of vLLM's ``BlockPool``.

vLLM's ``KVConnectorBase_V1.bind_kv_cache_manager`` reads ``kv_cache_manager.block_pool``, and
vLLM's tests and scheduler read a few of its attributes (``blocks[i].ref_cnt`` /
``block_hash``, ``free_block_queue.num_free_blocks``, ``get_num_free_blocks()``,
``num_gpu_blocks``, ``cached_block_hash_to_block``). :class:`BlockPoolView` answers those from
pagedkv's pool at the moment they are read (live: a block view taken before an eviction reads
the evicted state after it). Its one write is ``free_blocks`` of the deferred release that
``PagedKVCacheManager.pop_blocks_for_free`` returned; every other write of vLLM's pool API
(``touch``, ``get_new_blocks``, ``cache_full_blocks``, ...) raises :class:`ReadOnlyPoolError`,
so a connector that tries to manage vLLM's blocks fails loudly instead of silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pagedkv.errors import InvalidArgumentError
from pagedkv.integrations.vllm.errors import UnsupportedVllmCallError

if TYPE_CHECKING:
    from pagedkv.integrations.vllm.kv_cache_manager import PagedKVCacheManager

__all__ = ["BlockPoolView", "DeferredFree", "ReadOnlyPoolError", "block_view"]


class ReadOnlyPoolError(UnsupportedVllmCallError):
    """A write to vLLM's block pool API through the plug-in's read-only view (a
    ``NotImplementedError``): pagedkv's pool is changed only by pagedkv's manager."""


_WRITES = (
    "get_new_blocks",
    "touch",
    "cache_full_blocks",
    "cache_partial_block",
    "evict_blocks",
    "reset_prefix_cache",
    "move_block_hashes",
    "unpin_blocks",
    "get_cached_block",
)


def _block_view_class() -> type:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    class PagedKVBlockView(KVCacheBlock):  # type: ignore[misc, valid-type, unused-ignore]
        """vLLM ``KVCacheBlock`` whose fields read pagedkv's pool when read (``ref_cnt``,
        ``block_hash`` / ``_block_hash``: the 32-byte pagedkv hash or None, ``is_null``).
        Built by :func:`block_view`; writing a field raises ``ReadOnlyPoolError``."""

        pool = None
        prev_free_block = None
        next_free_block = None
        _block_hash_num_tokens = None

        @property  # type: ignore[override, misc, unused-ignore]
        def block_id(self) -> int:
            return self.__dict__["_id"]  # type: ignore[no-any-return]

        @property  # type: ignore[override, misc, unused-ignore]
        def ref_cnt(self) -> int:
            return int(self.__dict__["_pool"].ref_count(self.__dict__["_id"]))

        @property  # type: ignore[override, misc, unused-ignore]
        def _block_hash(self) -> bytes | None:
            return self.__dict__["_pool"].block_hash(self.__dict__["_id"])  # type: ignore[no-any-return]

        @property  # type: ignore[override, misc, unused-ignore]
        def block_hash(self) -> bytes | None:
            return self._block_hash

        @property  # type: ignore[override, misc, unused-ignore]
        def is_null(self) -> bool:
            return self.__dict__["_id"] == 0  # type: ignore[no-any-return]

        def __setattr__(self, name: str, value: Any) -> None:
            raise ReadOnlyPoolError(
                f"KVCacheBlock.{name} of pagedkv block {self.block_id} is read-only",
                operation=f"KVCacheBlock.{name} =",
                feature="writes to vLLM's block pool",
            )

        def set_block_hash(self, *args: Any, **kwargs: Any) -> None:
            self.__setattr__("_block_hash", None)

        def reset_hash(self) -> None:
            self.__setattr__("_block_hash", None)

        def __eq__(self, other: object) -> bool:
            if isinstance(other, PagedKVBlockView):
                return bool(other.block_id == self.block_id)
            return NotImplemented

        def __hash__(self) -> int:
            return hash(self.block_id)

        def __repr__(self) -> str:
            hashed = self.block_hash is not None
            return f"PagedKVBlockView(block_id={self.block_id}, ref_cnt={self.ref_cnt}, hashed={hashed})"

    PagedKVBlockView.__name__ = PagedKVBlockView.__qualname__ = "PagedKVBlockView"
    return PagedKVBlockView


_VIEW_CLASS: type | None = None


def block_view(pool: Any, block_id: int) -> Any:
    """A live vLLM ``KVCacheBlock`` view of ``block_id`` in pagedkv's ``pool`` (a
    ``pagedkv.BlockPool``)."""
    global _VIEW_CLASS
    if _VIEW_CLASS is None:
        _VIEW_CLASS = _block_view_class()
    view: Any = object.__new__(_VIEW_CLASS)
    view.__dict__["_pool"] = pool
    view.__dict__["_id"] = int(block_id)
    return view


class DeferredFree:
    """Blocks of a request whose release is deferred (``pop_blocks_for_free``): kept in
    pagedkv under ``handle`` until ``BlockPoolView.free_blocks`` receives this object (or
    ``reversed(...)`` of it, as vLLM's scheduler passes it). Iterates the blocks as live views;
    true when it holds blocks."""

    __slots__ = ("handle", "_blocks", "released")

    def __init__(self, handle: int, blocks: list[Any]) -> None:
        self.handle = handle
        self._blocks = blocks
        self.released = False

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._blocks)

    def __reversed__(self) -> DeferredFree:
        return self

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice) and i == slice(None, None, -1):
            return self
        return self._blocks[i]

    def __repr__(self) -> str:
        return f"DeferredFree(handle={self.handle}, blocks={[b.block_id for b in self._blocks]})"


class _FreeQueueView:
    """``free_block_queue`` of vLLM's pool: ``num_free_blocks`` only."""

    def __init__(self, owner: PagedKVCacheManager) -> None:
        self._owner = owner

    @property
    def num_free_blocks(self) -> int:
        """Free blocks (evictable cached ones included), as vLLM's free queue counts them."""
        return int(self._owner.num_free_blocks_now())


class _CachedIndexView:
    """``cached_block_hash_to_block``: ``len`` (blocks carrying a hash) and ``_cache``
    (hash -> block view), built when read."""

    def __init__(self, owner: PagedKVCacheManager) -> None:
        self._owner = owner

    def __len__(self) -> int:
        return int(self._owner.pool_now().num_hashed)

    @property
    def _cache(self) -> dict[bytes, Any]:
        pool = self._owner.pool_now()
        hashes, ids = pool.cached_blocks()
        return {h: block_view(pool, b) for h, b in zip(hashes, ids.tolist(), strict=True)}


class _BlocksView:
    """``blocks``: a sequence of live block views, one per pool block (0 is the null block)."""

    def __init__(self, owner: PagedKVCacheManager) -> None:
        self._owner = owner

    def __len__(self) -> int:
        return int(self._owner.num_blocks)

    def __getitem__(self, i: int) -> Any:
        n = len(self)
        if not isinstance(i, int) or not -n <= i < n:
            raise IndexError(i)
        return block_view(self._owner.pool_now(), i % n)

    def __iter__(self) -> Iterator[Any]:
        pool = self._owner.pool_now()
        return (block_view(pool, b) for b in range(len(self)))


class BlockPoolView:
    """vLLM ``BlockPool`` read-only view over a ``PagedKVCacheManager`` (see the module docs)."""

    def __init__(self, owner: PagedKVCacheManager) -> None:
        self._owner = owner
        self.blocks = _BlocksView(owner)
        self.free_block_queue = _FreeQueueView(owner)
        self.cached_block_hash_to_block = _CachedIndexView(owner)

    @property
    def num_gpu_blocks(self) -> int:
        """Blocks in the pool, the null block 0 included."""
        return int(self._owner.num_blocks)

    @property
    def enable_caching(self) -> bool:
        """vLLM's ``enable_prefix_caching``."""
        return bool(self._owner.enable_caching)

    @property
    def hash_block_size(self) -> int:
        """vLLM's prefix-hash granularity in tokens (``Request.block_hashes``; a divisor of
        every group's block size)."""
        return int(self._owner.hash_block_size)

    @property
    def null_block(self) -> Any:
        """The null block 0's view (one object)."""
        return self._owner.null_block_view

    def get_num_free_blocks(self) -> int:
        """Free blocks (evictable cached ones included)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """The manager's ``usage``."""
        return float(self._owner.usage)

    def free_blocks(self, ordered_blocks: Any) -> None:
        """Releases a :class:`DeferredFree` (from ``pop_blocks_for_free``, possibly
        ``reversed``) tail first. Raises ``ReadOnlyPoolError`` for anything else (vLLM's own
        blocks are never handed to this pool) and ``InvalidArgumentError`` for a deferred
        release already released."""
        if not isinstance(ordered_blocks, DeferredFree):
            raise ReadOnlyPoolError(
                "BlockPool.free_blocks of blocks pagedkv did not defer",
                operation="BlockPool.free_blocks",
                feature="writes to vLLM's block pool",
            )
        if ordered_blocks.released:
            raise InvalidArgumentError(
                f"deferred release {ordered_blocks.handle} was already released",
                arg="ordered_blocks",
                value=repr(ordered_blocks),
                reason="released twice",
            )
        self._owner.release_deferred(ordered_blocks)

    def __getattr__(self, name: str) -> Any:
        if name in _WRITES:

            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise ReadOnlyPoolError(
                    f"BlockPool.{name}: pagedkv's pool is read-only to vLLM and its connectors",
                    operation=f"BlockPool.{name}",
                    feature="writes to vLLM's block pool",
                )

            return refuse
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"BlockPoolView(num_gpu_blocks={self.num_gpu_blocks})"
