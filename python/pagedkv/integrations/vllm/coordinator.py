"""Read-only views of ``PagedKVCacheManager`` in the shape of vLLM's KV cache coordinator.

vLLM's own ``KVCacheManager`` is a facade over a ``KVCacheCoordinator``, which holds one
``SingleTypeKVCacheManager`` per KV cache group. Code outside the scheduler reads through that
structure: the engine core computes the attention block size at start-up from
``kv_cache_manager.coordinator.single_type_managers[*].block_size / .kv_cache_spec``
(``EngineCore._initialize_effective_attention_block_size``), and
``EngineCore.get_kv_cache_group_metadata`` reports each group's ``block_size`` to event
consumers. pagedkv has no coordinator (one manager serves every group), so
:class:`CoordinatorView` answers those reads from the manager's configuration and state. Each
view is read-only (attributes are properties, assignment raises ``AttributeError``); nothing
in it allocates or frees. docs/design.md ("vLLM seam") lists every read and where it is
answered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.errors import InvalidArgumentError, UnknownSequenceError

if TYPE_CHECKING:
    from pagedkv.integrations.vllm.kv_cache_manager import PagedKVCacheManager

__all__ = ["CoordinatorView", "GroupManagerView"]


class GroupManagerView:
    """What vLLM reads from one entry of ``coordinator.single_type_managers``: one KV cache group
    of a ``PagedKVCacheManager``.

    Attributes (read-only): ``kv_cache_group_id`` (the group's index), ``block_size`` (tokens
    per block of that group), ``kv_cache_spec`` (the group's
    ``vllm.v1.kv_cache_interface.KVCacheSpec`` from the manager's ``KVCacheConfig``),
    ``enable_caching`` (prefix caching on).
    """

    __slots__ = ("_manager", "_group")

    def __init__(self, manager: Any, group: int = 0) -> None:
        self._manager = manager
        self._group = group

    @property
    def kv_cache_group_id(self) -> int:
        """The group's index in the scheduler's ``KVCacheConfig.kv_cache_groups``."""
        return self._group

    @property
    def block_size(self) -> int:
        """Tokens per block of this group."""
        return int(self._manager.group_block_sizes[self._group])

    @property
    def kv_cache_spec(self) -> Any:
        """The group's vLLM ``KVCacheSpec`` (``FullAttentionSpec``, ``SlidingWindowSpec``...)."""
        return self._manager.kv_cache_config.kv_cache_groups[self._group].kv_cache_spec

    @property
    def enable_caching(self) -> bool:
        """Whether prefix caching is on."""
        return bool(self._manager.enable_caching)

    @property
    def req_to_blocks(self) -> dict[str, list[Any]]:
        """Request id -> live ``KVCacheBlock`` views of this group's blocks it holds (vLLM's
        ``SingleTypeKVCacheManager.req_to_blocks``), for the requests that hold blocks now
        (a preempted one holds none; blocks of a deferred release are not a request's).
        Built when read."""
        views: dict[str, list[Any]] = self._manager.held_block_views(self._group)
        return views

    @property
    def _null_block(self) -> Any:
        """The null block 0's view (the entry of a released windowed block in
        ``req_to_blocks``, the same object every time)."""
        return self._manager.null_block_view

    @property
    def num_cached_block(self) -> dict[str, int]:
        """Request id -> how many of this group's blocks it holds carry a prefix hash, for the
        requests in ``req_to_blocks``."""
        return {rid: sum(1 for b in blocks if b.block_hash is not None) for rid, blocks in self.req_to_blocks.items()}

    def __repr__(self) -> str:
        spec = type(self.kv_cache_spec).__name__
        return f"GroupManagerView(kv_cache_group_id={self._group}, block_size={self.block_size}, kv_cache_spec={spec})"


class CoordinatorView:
    """``PagedKVCacheManager.coordinator``: the attributes and queries vLLM reads from its
    ``KVCacheCoordinator``, answered from pagedkv.

    Attributes (read-only): ``single_type_managers`` (one :class:`GroupManagerView` per KV cache
    group), ``num_single_type_manager`` (the number of groups), ``kv_cache_config`` (the one the
    manager was built from), ``block_size``,
    ``scheduler_block_size`` (the same), ``hash_block_size`` (vLLM's prefix-hash granularity),
    ``enable_partial_hash_hits`` (False: hits are multiples of the scheduler block size, as
    vLLM's without Mamba layers), ``num_reprefillable_tokens`` (0: no multi-token
    re-prefill).
    """

    __slots__ = ("_manager", "_groups")

    def __init__(self, manager: PagedKVCacheManager | Any) -> None:
        self._manager = manager
        self._groups = tuple(GroupManagerView(manager, g) for g in range(len(manager.group_block_sizes)))

    @property
    def single_type_managers(self) -> tuple[GroupManagerView, ...]:
        """One view per KV cache group, in group order."""
        return self._groups

    @property
    def num_single_type_manager(self) -> int:
        """The number of KV cache groups."""
        return len(self._groups)

    @property
    def kv_cache_config(self) -> Any:
        """The ``KVCacheConfig`` the manager was built from."""
        return self._manager.kv_cache_config

    @property
    def block_size(self) -> int:
        """The scheduler's block size in tokens (the groups' hit unit)."""
        return self._manager.block_size

    @property
    def scheduler_block_size(self) -> int:
        """The scheduler's block size in tokens (the LCM of the groups' block sizes)."""
        return self._manager.block_size

    @property
    def hash_block_size(self) -> int:
        """vLLM's prefix-hash granularity in tokens (``Request.block_hashes``)."""
        return self._manager.hash_block_size

    @property
    def enable_partial_hash_hits(self) -> bool:
        """False: hits are multiples of the scheduler block size (vLLM enables partial hash
        hits only for Mamba layers with sub-block prefix hashes, which are refused)."""
        return False

    @property
    def num_reprefillable_tokens(self) -> int:
        """0: no group re-prefills tokens before its prefix hit."""
        return 0

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any = None,
        num_encoder_tokens: int = 0,
        total_computed_tokens: int = 0,
        num_local_computed_tokens: int = 0,
        num_tokens_main_model: int | None = None,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Blocks the request still needs to give slots to ``num_tokens`` tokens in total
        (vLLM's ``KVCacheCoordinator.get_num_blocks_to_allocate`` for a running request): per
        group, ``ceil(num_tokens / block_size)`` minus the entries of its pagedkv block table
        (released sliding-window entries count, as vLLM's null blocks do), at least 0, summed
        over the groups; a request pagedkv does not hold needs them all. Reads only.

        vLLM's scheduler asks this with no prefix-hit blocks (``new_computed_blocks`` empty);
        hit blocks are taken by ``allocate_slots`` itself, so a non-empty one raises
        ``InvalidArgumentError``, as does ``num_tokens < 0`` or ``num_encoder_tokens > 0``
        (cross-attention is refused). A state group (align-mode Mamba) counts at most one
        block, its moved live state. ``apply_admission_cap`` caps a windowed group's blocks at
        vLLM's recycling-aware admission cap (as vLLM reserves for in-flight loads). The
        remaining arguments change nothing.
        """
        if num_tokens < 0:
            raise InvalidArgumentError(
                f"num_tokens must be >= 0 (got {num_tokens})",
                arg="num_tokens",
                value=str(num_tokens),
                reason="a token count",
            )
        if num_encoder_tokens:
            raise InvalidArgumentError(
                f"num_encoder_tokens={num_encoder_tokens}: cross-attention is not managed",
                arg="num_encoder_tokens",
                value=str(num_encoder_tokens),
                reason="refused by check_supported_config",
            )
        if new_computed_blocks is not None and any(len(group) for group in new_computed_blocks):
            raise InvalidArgumentError(
                "new_computed_blocks must be empty: PagedKVCacheManager takes prefix-hit blocks in allocate_slots",
                arg="new_computed_blocks",
                value=f"{sum(len(g) for g in new_computed_blocks)} blocks",
                reason="prefix hits are taken by allocate_slots",
            )
        manager = self._manager
        sizes = manager.group_block_sizes
        try:
            # Lengths only: vLLM asks this for every running request each step with a connector.
            lengths = manager.table_lengths(request_id)
        except UnknownSequenceError:
            lengths = [0] * len(sizes)
        caps = manager._admission_caps if apply_admission_cap else [None] * len(sizes)
        state = set(getattr(manager, "_state_groups", ()))
        total = 0
        for g, (bs, n, cap) in enumerate(zip(sizes, lengths, caps, strict=True)):
            required = -(-num_tokens // bs)
            if g in state:
                # A state group takes at most one block (the moved live state), as vLLM's
                # align-mode Mamba manager.
                total += min(1, max(0, required - n))
                continue
            if cap is not None:
                # vLLM's recycling-aware cap of a windowed group (in-flight load reservations).
                required = min(required, cap)
            total += max(0, required - n)
        return total

    def __repr__(self) -> str:
        return f"CoordinatorView(single_type_managers={self._groups!r})"
