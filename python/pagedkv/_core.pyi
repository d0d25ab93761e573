"""Type stubs of the Rust extension ``pagedkv._core`` (hand-written; checked by mypy.stubtest)."""

from collections.abc import Iterable, Sequence
from typing import Any, final

import numpy as np
import numpy.typing as npt

from pagedkv.block_identity import SequenceSpec
from pagedkv.errors import PagedKVError

__all__ = [
    "__version__",
    "NULL_BLOCK",
    "MAX_BLOCK_SIZE",
    "MAX_UNCACHED_BLOCK_SIZE",
    "MAX_BLOCKS",
    "HOST_EVICTIONS",
    "CacheConfig",
    "KVCacheManager",
    "SlotAllocation",
    "StepOutput",
    "BlockPool",
    "HostBlockPool",
    "CacheStats",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVIndexer",
    "BlockTable",
    "KVCacheGroupSpec",
]

__version__: str
NULL_BLOCK: int
MAX_BLOCK_SIZE: int
MAX_UNCACHED_BLOCK_SIZE: int
MAX_BLOCKS: int
HOST_EVICTIONS: tuple[str, ...]
"""The host tier's eviction policies ``CacheConfig(host_eviction=)`` accepts, default first:
``("lru", "arc")``."""

_Int32Array = npt.NDArray[np.int32]
_Int64Array = npt.NDArray[np.int64]
# Token ids, block ids and sequence ids: a sequence of ints or a 1-D integer numpy array.
_IntArrayLike = Any

@final
class CacheConfig:
    """Configuration of a KV cache manager (frozen; validated on construction; ``==`` compares
    every field).

    ``CacheConfig(num_blocks, block_size)``: one full-attention KV cache group of
    ``block_size`` tokens per block (``groups`` is that group, ``layer_groups`` ``[]``).
    ``CacheConfig(num_blocks, groups=[...], layer_groups=[...])``: the KV cache groups of a
    hybrid model (:class:`KVCacheGroupSpec`: full attention, sliding window, chunked local) in
    one pool of equal-size pages, ``layer_groups[i]`` the group of model layer ``i``;
    ``block_size`` may be omitted (then group 0's) or must equal every group's.
    """

    def __new__(
        cls,
        num_blocks: int,
        block_size: int | None = None,
        *,
        groups: Sequence[KVCacheGroupSpec] | None = None,
        layer_groups: Sequence[int] | None = None,
        retention_interval: int = 0,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        hash_seed: bytes | None = None,
        num_cpu_blocks: int | None = None,
        enable_events: bool = False,
        num_host_blocks: int = 0,
        host_admission_min_seen: int = 2,
        host_eviction: str = "lru",
        hash_lookahead_tokens: int = 0,
    ) -> CacheConfig:
        """``num_blocks``: pages including the null block 0, 2..=2**28; ``block_size``: tokens,
        1..=``MAX_BLOCK_SIZE`` (required without ``groups``). ``retention_interval``: tokens, 0
        (cache every full block) or a multiple of the hit unit (the LCM of the groups' block
        sizes): a windowed group keeps cached only what a hit at a multiple of it needs.

        ``num_host_blocks`` > 0 adds the prefix cache's host tier (docs/design.md, "Host
        tier"): cached blocks the device pool evicts are stored to host blocks once their hash
        was used ``host_admission_min_seen`` times, and prefix lookups load them back.
        ``num_host_blocks``: blocks, 0..=2**28 (0: no host tier; the manager allocates the
        tier's bookkeeping, about 54 bytes of host memory per block, when it is built: 14.4 GB
        at 2**28); ``host_admission_min_seen``:
        uses, 1..=2**32 - 1; ``host_eviction``: ``"lru"`` or ``"arc"`` (ARC, Megiddo and
        Modha, FAST'03: a one-off run of blocks does not flush reused ones); one host tier
        serves every group, keyed by (hash, group).

        ``hash_lookahead_tokens``: tokens, 0..=64 (0: default, a block's key covers its own
        tokens only): successor-aware hashing, each block's key also covers the next
        ``hash_lookahead_tokens`` tokens, so a block is cached once they are known and a hit of
        ``p`` tokens needs ``p + hash_lookahead_tokens`` known tokens (EAGLE / MTP drafters:
        no recompute of a hit's last block). Needs prefix caching; refused with events, a host
        tier or a state group.

        Speculative state blocks are the state groups' ``spare_blocks``
        (``KVCacheGroupSpec("state", ..., spare_blocks=k)``): every state group must carry the
        same ``k``, 0..=16, and with ``k > 0`` one block size and no swap space.

        Raises ``InvalidConfigError`` (a ``ValueError``) naming the field, nothing built: a
        value of the wrong type or out of range, ``block_size`` missing without ``groups``,
        ``layer_groups`` without ``groups`` or missing with them, a ``block_size`` unlike a
        group's, page sizes that differ between groups, a layer mapped to no group, a group
        without layers, a retention interval that is not a multiple of the hit unit, a host
        tier with prefix caching off, an unknown policy (the message lists the accepted
        names), a hash lookahead out of range or with a setting it does not support,
        state groups' ``spare_blocks`` that differ, are out of range or come with a setting they
        do not support (field ``spare_blocks``)."""
    @property
    def groups(self) -> list[KVCacheGroupSpec]:
        """The KV cache groups (one-group form: the full-attention group it implies)."""
    @property
    def layer_groups(self) -> list[int]:
        """Per model layer, its group index (``[]`` for the one-group form)."""
    @property
    def num_groups(self) -> int: ...
    @property
    def retention_interval(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def hash_algo(self) -> str: ...
    @property
    def hash_seed(self) -> bytes: ...
    @property
    def num_cpu_blocks(self) -> int: ...
    @property
    def enable_events(self) -> bool: ...
    @property
    def num_host_blocks(self) -> int: ...
    @property
    def host_admission_min_seen(self) -> int: ...
    @property
    def host_eviction(self) -> str: ...
    @property
    def hash_lookahead_tokens(self) -> int: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...

@final
class SlotAllocation:
    """What one ``allocate_slots`` call did (``G`` KV cache groups)."""

    @property
    def num_scheduled_tokens(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def num_context_tokens(self) -> int: ...
    @property
    def num_draft_tokens(self) -> int: ...
    @property
    def new_block_indptr(self) -> _Int32Array:
        """``int32[G + 1]`` CSR offsets into ``new_block_ids``, one entry per group."""
    @property
    def new_block_ids(self) -> _Int32Array:
        """``int32[k]`` blocks newly taken, group-major, each group's in table order."""
    @property
    def copies(self) -> _Int32Array:
        """``int32[c, 3]`` copy-on-write ``(group, src, dst)`` rows (a state group's live-state
        moves and prefix-hit copies included)."""
    @property
    def zero_blocks(self) -> _Int32Array:
        """``int32[z, 2]`` ``(group, block)`` fresh state blocks to zero after the copies."""

@final
class StepOutput:
    """The result of one batched ``KVCacheManager.step``: kernel inputs with a leading group
    dimension (``G`` groups, ``S`` scheduled sequences, ``T`` scheduled tokens, ``W`` the
    longest table). ``slot_mapping`` / ``block_table`` are group 0's rows (views), the
    one-group spelling: reading them on an output with ``G > 1`` raises
    ``InvalidArgumentError``."""

    @property
    def num_scheduled(self) -> int: ...
    @property
    def error(self) -> PagedKVError | None: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def max_query_len(self) -> int: ...
    @property
    def seq_ids(self) -> npt.NDArray[np.uint64]: ...
    @property
    def num_cached_tokens(self) -> _Int32Array: ...
    @property
    def query_start_loc(self) -> _Int32Array: ...
    @property
    def seq_lens(self) -> _Int32Array: ...
    @property
    def context_lens(self) -> _Int32Array: ...
    @property
    def input_ids(self) -> _Int64Array: ...
    @property
    def num_draft_tokens(self) -> _Int32Array: ...
    @property
    def slot_mappings(self) -> _Int64Array:
        """``int64[G, T]`` each token's KV slot in each group's layers (``(G, 0)`` after
        ``step(token_arrays=False)``)."""
    @property
    def block_tables(self) -> _Int32Array:
        """``int32[G, S, W]`` dense tables with ``step(block_table=True)``, else ``(G, S, 0)``."""
    @property
    def slot_mapping(self) -> _Int64Array:
        """``int64[T]``: ``slot_mappings[0]`` (a view); ``InvalidArgumentError`` for ``G > 1``."""
    @property
    def block_table(self) -> _Int32Array:
        """``int32[S, W]``: ``block_tables[0]`` (a view); ``InvalidArgumentError`` for ``G > 1``."""
    @property
    def table_start(self) -> _Int32Array:
        """``int32[S, G]`` first changed logical block of each (sequence, group) table."""
    @property
    def table_version(self) -> npt.NDArray[np.uint64]: ...
    @property
    def table_delta_indptr(self) -> _Int32Array:
        """``int32[S * G + 1]`` CSR offsets into ``table_delta``, entry ``k * G + g``."""
    @property
    def table_delta(self) -> _Int32Array: ...
    @property
    def new_block_indptr(self) -> _Int32Array:
        """``int32[S * G + 1]`` CSR offsets into ``new_block_ids``, entry ``k * G + g``."""
    @property
    def new_block_ids(self) -> _Int32Array: ...
    @property
    def copies(self) -> _Int32Array:
        """``int32[c, 3]`` copy-on-write ``(group, src, dst)`` rows, before the K/V writes (a
        state group's live-state moves and prefix-hit copies included); read every source
        before writing any destination (a block one row releases may be another's dst)."""
    @property
    def zero_blocks(self) -> _Int32Array:
        """``int32[z, 2]`` ``(group, block)`` fresh state blocks of state groups to zero after
        the copies, before the forward pass."""
    @property
    def host_stores(self) -> _Int32Array:
        """``int32[n, 3]`` host-tier stores ``(group, device_block, host_block)``: run first."""
    @property
    def host_loads(self) -> _Int32Array:
        """``int32[n, 3]`` host-tier loads ``(group, host_block, device_block)``: after stores
        and swaps, before copy-on-write and the forward pass."""
    def raise_for_error(self) -> None: ...

@final
class CacheStats:
    """A point-in-time snapshot of the KV cache."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def used(self) -> int: ...
    @property
    def free(self) -> int: ...
    @property
    def cached_free(self) -> int: ...
    @property
    def usage(self) -> float: ...
    @property
    def kv_utilization(self) -> float: ...
    @property
    def prefix_queries_tokens(self) -> int: ...
    @property
    def prefix_hits_tokens(self) -> int: ...
    @property
    def evictions(self) -> int: ...
    @property
    def copies(self) -> int: ...
    @property
    def swaps_out_blocks(self) -> int: ...
    @property
    def swaps_in_blocks(self) -> int: ...
    @property
    def preemptions(self) -> int: ...
    @property
    def num_cpu_blocks(self) -> int: ...
    @property
    def cpu_used(self) -> int: ...
    @property
    def num_host_blocks(self) -> int: ...
    @property
    def host_used(self) -> int: ...
    @property
    def host_hits_tokens(self) -> int: ...
    @property
    def host_stores_blocks(self) -> int: ...
    @property
    def host_loads_blocks(self) -> int: ...
    @property
    def prefix_hit_rate(self) -> float: ...
    def as_dict(self) -> dict[str, int | float]: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...

@final
class BlockStored:
    """Full blocks were registered in the prefix cache.

    ``hash_root`` (32 bytes) is the root of the emitting manager's hash chains, a digest of
    its hash algorithm and chain seed: for ``LLMEngine`` the seed is its cache identity (model
    weights, tokenizer, chat template, adapter, KV dtype, RoPE), so events of engines that may
    share blocks carry equal roots. None for events decoded from vLLM's wire format.
    ``group`` is the KV cache group of the blocks (0 with one group).
    """

    @property
    def block_hashes(self) -> list[bytes]: ...
    @property
    def parent_block_hash(self) -> bytes | None: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def block_size(self) -> int: ...
    @property
    def extra_keys(self) -> list[tuple[Any, ...]]: ...
    @property
    def hash_root(self) -> bytes | None: ...
    @property
    def tier(self) -> str:
        """``"device"`` or ``"host"`` (the host tier; vLLM's ``medium`` ``"CPU"``)."""
    @property
    def group(self) -> int:
        """The KV cache group of the blocks (0 with one group)."""
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...

@final
class BlockRemoved:
    """Blocks were evicted from the prefix cache."""

    @property
    def block_hashes(self) -> list[bytes]: ...
    @property
    def tier(self) -> str:
        """``"device"`` or ``"host"``: the tier the hashes left."""
    @property
    def group(self) -> int:
        """The KV cache group of the blocks (0 with one group)."""
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...

@final
class AllBlocksCleared:
    """The prefix cache was reset."""

    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...

@final
class BlockPool:
    """A pool of fixed-size KV blocks (standalone, or a read-only view of a manager's pool).

    On the view returned by ``KVCacheManager.pool`` the mutating methods raise
    ``ReadOnlyPoolError`` (a ``RuntimeError``).
    """

    def __new__(cls, num_blocks: int) -> BlockPool: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_usable(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_cached_free(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    @property
    def num_hashed(self) -> int:
        """Blocks carrying a prefix hash (referenced or free)."""
    def cached_blocks(self) -> tuple[list[bytes], _Int32Array]:
        """Every block carrying a prefix hash: ``(hashes, block_ids)`` in block-id order."""
    def allocate(self, n: int) -> _Int32Array: ...
    def allocate_list(self, n: int) -> list[int]:
        """Takes ``n`` blocks like ``allocate``, as a list of int block ids (cheaper than an
        array for a few blocks handed out one by one, as in a decode step). Raises
        ``OutOfBlocksError`` (nothing taken) when fewer than ``n`` are free.
        """
    def free(self, ids: _IntArrayLike) -> None: ...
    def free_table(self, table: _IntArrayLike) -> None:
        """Releases a block table tail first, as ``free(table[::-1])`` without the copy."""
    def incref(self, ids: _IntArrayLike) -> None: ...
    def touch(self, ids: _IntArrayLike) -> None: ...
    def cache_block(self, block_id: int, hash: bytes) -> bool: ...
    def lookup(self, hash: bytes) -> int | None: ...
    def reset_prefix_cache(self) -> None: ...
    def ref_count(self, block_id: int) -> int:
        """Reference count of ``block_id``; 0 for the null block 0. O(1).

        Raises ``InvalidBlockError`` for ``block_id >= num_blocks`` (as ``free`` does) and
        ``InvalidArgumentError`` for a negative or non-int id.
        """
    def block_hash(self, block_id: int) -> bytes | None:
        """The 32-byte prefix hash of ``block_id``, or None when it carries none. O(1).

        Raises ``InvalidBlockError`` for ``block_id >= num_blocks`` and ``InvalidArgumentError``
        for a negative or non-int id.
        """
    def free_queue(self) -> _Int32Array: ...
    def counters(self) -> dict[str, int]: ...
    def check_invariants(self) -> None: ...

@final
class HostBlockPool:
    """The prefix cache's host tier on its own, shaped for an offloading connector's scheduler
    side (``pagedkv.integrations.vllm.offloading``). Keys are ``bytes`` of any length (36
    bytes, vLLM's ``OffloadKey``, used exactly; others by their SHA-256). Keys are passed head
    to tail and enter the eviction order tail first. Bad input raises
    ``InvalidArgumentError`` and changes nothing.
    """

    def __new__(cls, num_blocks: int, *, admission_min_seen: int = 1, eviction: str = "lru") -> HostBlockPool: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def admission_min_seen(self) -> int: ...
    @property
    def eviction(self) -> str: ...
    @property
    def num_used(self) -> int: ...
    @property
    def num_held(self) -> int: ...
    def counters(self) -> dict[str, int]: ...
    def lookup(self, hashes: Iterable[bytes]) -> int:
        """Number of leading ``hashes`` that are readable (stored and completed)."""
    def state(self, hash: bytes) -> int:
        """0: not on host, 1: a store in flight, 2: readable."""
    def prepare_load(self, hashes: Iterable[bytes]) -> _Int32Array:
        """Pins readable blocks for loads; their host block ids."""
    def complete_load(self, hashes: Iterable[bytes]) -> None: ...
    def touch(self, hashes: Iterable[bytes]) -> None: ...
    def prepare_store(self, hashes: Iterable[bytes]) -> tuple[list[bytes], _Int32Array, list[bytes]] | None:
        """``(to_store, host block ids, evicted)``, or ``None`` when the admitted keys do not fit."""
    def complete_store(self, hashes: Iterable[bytes], success: bool = True) -> None: ...
    def reset(self) -> None: ...
    def check_invariants(self) -> None: ...

@final
class KVCacheManager:
    """The paged KV cache manager, for one full-attention KV cache group and for the groups of
    a hybrid model alike (``G = num_groups``; results with a group dimension have it always)."""

    def __new__(cls, config: CacheConfig) -> KVCacheManager: ...
    @property
    def config(self) -> CacheConfig: ...
    @property
    def pool(self) -> BlockPool: ...
    @property
    def groups(self) -> list[KVCacheGroupSpec]: ...
    @property
    def layer_groups(self) -> list[int]: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def hit_unit(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_cpu_blocks(self) -> int: ...
    @property
    def num_host_blocks(self) -> int: ...
    @property
    def retention_interval(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def num_sequences(self) -> int: ...
    def add_sequence(
        self,
        seq_id: int,
        prompt_token_ids: _IntArrayLike,
        *,
        spec: SequenceSpec | None = None,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        extra_keys: list[tuple[str, bytes]] | None = None,
        mm_items: list[tuple[bytes, int, int]] | None = None,
    ) -> None: ...
    def append_tokens(self, seq_id: int, token_ids: _IntArrayLike) -> None: ...
    def lookup_prefix(self, seq_id: int) -> int: ...
    def lookup_prefix_group(self, seq_id: int, group: int, limit: int) -> int:
        """The longest prefix (at most ``min(limit, num_tokens)`` tokens) group ``group`` alone
        serves from the prefix cache."""
    def set_hit_limit(self, seq_id: int, limit: int | None) -> None:
        """Cap a first allocation's prefix hit at ``min(limit, num_tokens)`` tokens (rounded
        down to ``hit_unit``); ``None``: the default ``num_tokens - 1``."""
    def set_state_from_load(self, seq_id: int, on: bool) -> None:
        """With ``on``, the first allocation's prefix hit ignores state groups (a KV connector
        loads the state); only ``allocate_external`` with external tokens allocates then.
        Cleared by the first allocation."""
    def num_blocks_needed(self, seq_id: int, num_new_tokens: int) -> tuple[int, int]:
        """``(take, release)``; the allocation succeeds exactly when ``take <= num_free_blocks
        + release`` (release is 0 for full-attention groups)."""
    def num_blocks_needed_per_group(self, seq_id: int, num_new_tokens: int) -> list[tuple[int, int]]: ...
    def num_blocks_needed_with_drafts(
        self, seq_id: int, num_new_tokens: int, num_draft_tokens: int, num_lookahead_slots: int | None = None
    ) -> tuple[int, int]: ...
    def allocate_slots(
        self,
        seq_id: int,
        num_new_tokens: int,
        draft_token_ids: _IntArrayLike | None = None,
        num_lookahead_slots: int | None = None,
    ) -> SlotAllocation:
        """``num_lookahead_slots``: slots past the scheduled tokens and drafts whose tokens do
        not exist yet (EAGLE / MTP), held as spare blocks."""
    def allocate_external(
        self,
        seq_id: int,
        num_external_tokens: int,
        num_new_tokens: int = 0,
        *,
        staged: bool = False,
        reserve_blocks: int = 0,
    ) -> SlotAllocation:
        """First allocation with ``E`` KV-connector tokens after the local hit ``H``, then ``n`` to compute.

        ``num_cached_tokens == H``, ``num_context_tokens == H + E``, ``num_scheduled_tokens == n``.
        ``staged=True`` (``n == 0``): status ``"loading"``, blocks from ``H`` on staged (never
        matched, registered, announced or stored to the host tier) until ``commit_external``.
        State groups: one live block at column ``(H + E + n - 1) // block_size`` for the loaded
        state. Raises ``UnknownSequenceError``, ``InvalidSequenceStateError`` (holds blocks),
        ``InvalidArgumentError``, ``OutOfBlocksError``; state unchanged on error.
        """
    def num_blocks_needed_external(
        self, seq_id: int, num_external_tokens: int, num_new_tokens: int = 0
    ) -> tuple[int, int]:
        """``(take, release)`` of ``allocate_external`` with these arguments; no side effects."""
    def commit_external(self, seq_id: int, num_valid_tokens: int) -> int:
        """Ends a load: ``"loading"`` -> ``"running"`` with ``num_valid_tokens`` computed; returns blocks registered.

        With state groups the loaded state is published too (aligned ``H + E``) and only
        ``num_valid_tokens == H + E`` commits (``InvalidArgumentError`` otherwise, nothing changed).
        """
    def cache_computed(self, seq_id: int) -> None:
        """Registers ``seq_id``'s computed full blocks not cached yet whose lookahead tokens
        (``CacheConfig.hash_lookahead_tokens``) were appended since its last allocation,
        without allocating; a no-op without hash lookahead. Raises ``UnknownSequenceError``."""
    def commit_computed(self, seq_id: int, num_tokens: int) -> int:
        """The commit fence of state groups: every forward pass that computed positions below
        ``num_tokens`` completed. Publishes the held state blocks of aligned step ends
        ``<= num_tokens``; returns how many. Raises ``UnknownSequenceError``,
        ``InvalidArgumentError`` (above the computed tokens); state unchanged on error.
        """
    def commit_all_computed(self, seq_ids: _IntArrayLike) -> int:
        """``commit_computed`` of every computed token of each of ``seq_ids`` under one lock (a
        step's forward pass over them completed); returns the state blocks published. Raises
        ``UnknownSequenceError`` (nothing changed)."""
    def rollback(self, seq_id: int, num_computed_tokens: int, *, poisoned: bool) -> int:
        """Truncates the computed range (blocks kept, recomputed in place); ``poisoned``
        unregisters them and their dependents.

        Returns blocks unregistered. Raises ``UnknownSequenceError``,
        ``InvalidSequenceStateError`` (not running, drafts pending), ``InvalidArgumentError``.
        """
    def evict_blocks(self, block_ids: _IntArrayLike) -> int:
        """Unregisters these blocks and their dependents (invalid KV); returns how many.
        Raises ``InvalidBlockError``."""
    def free_deferred(self, seq_id: int) -> int:
        """Frees the sequence, keeping its blocks referenced under the returned handle until ``release_deferred``."""
    def preempt_deferred(self, seq_ids: _IntArrayLike) -> int:
        """``preempt``, the members' blocks kept under the returned handle until ``release_deferred``."""
    def release_deferred(self, handle: int) -> int:
        """Releases a deferred release's blocks (tail first); returns how many. Raises ``InvalidArgumentError``."""
    def deferred_blocks(self, handle: int) -> _Int32Array:
        """Blocks kept under ``handle``, in release order. Raises ``InvalidArgumentError``."""
    def num_deferred_blocks(self) -> int:
        """Blocks kept by every pending deferred release."""
    def num_staged_tokens(self, seq_id: int) -> int:
        """Tokens being loaded into staged blocks (0 unless ``"loading"``)."""
    def accept_drafts(self, seq_id: int, num_accepted: int, *, release_blocks: bool = True) -> list[_Int32Array]:
        """Released blocks, one ``int32[r_g]`` array per group (tail first)."""
    def release_skipped_blocks(self, seq_id: int, num_tokens: int) -> list[_Int32Array]:
        """Out-of-window blocks released once queries below ``num_tokens`` completed, per group."""
    def num_draft_tokens(self, seq_id: int) -> int: ...
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def free(self, seq_id: int) -> bool: ...
    def preempt(self, seq_ids: _IntArrayLike) -> None: ...
    def swap_out(self, seq_ids: _IntArrayLike) -> _Int32Array: ...
    def swap_in(self, seq_ids: _IntArrayLike) -> _Int32Array: ...
    def reset_prefix_cache(self) -> None: ...
    def block_table(self, seq_id: int, group: int = 0) -> _Int32Array: ...
    def block_tables(self, seq_id: int) -> list[_Int32Array]: ...
    def num_blocks_held(self, seq_id: int) -> list[int]: ...
    def num_tokens(self, seq_id: int) -> int: ...
    def num_computed_tokens(self, seq_id: int) -> int: ...
    def status(self, seq_id: int) -> str:
        """``"running"``, ``"preempted"``, ``"swapped"`` or ``"loading"``."""
    def num_uncomputed_tokens(self, seq_ids: _IntArrayLike) -> _Int32Array: ...
    def num_blocks_owed(self, seq_ids: _IntArrayLike) -> int: ...
    def token_ids(self, seq_id: int) -> _Int64Array: ...
    def step(
        self,
        seq_ids: _IntArrayLike,
        num_new_tokens: int | _IntArrayLike,
        append_token_ids: _IntArrayLike | list[_IntArrayLike] | None = None,
        *,
        draft_token_ids: _IntArrayLike | list[_IntArrayLike] | None = None,
        block_table: bool = False,
        token_arrays: bool = True,
        reserve_blocks: int = 0,
    ) -> StepOutput: ...
    def take_host_transfers(self) -> tuple[_Int32Array, _Int32Array]:
        """Host-tier ``(stores, loads)`` ``int32[n, 3]`` ``(group, src, dst)`` rows planned
        since the last hand-out, for callers allocating outside ``step``. Run the stores
        before any ``swap_in`` copy planned since (a store may read an evicted block a swap-in
        destination reuses)."""
    def stats(self) -> CacheStats: ...
    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]: ...
    def check_invariants(self) -> None: ...

# A KV event as KVIndexer.apply takes it: a pagedkv event object, or a vLLM wire event already
# msgpack-decoded into a list whose first item is its type name.
_IndexerEvent = BlockStored | BlockRemoved | AllBlocksCleared | list[Any] | tuple[Any, ...]
# A block hash: 32 bytes (pagedkv), shorter bytes, or an int (vLLM).
_WireHash = bytes | int

@final
class KVIndexer:
    """Which worker (engine replica) holds which cached block, from the workers' KV events.

    Routers use it for KV-aware routing: ``overlap(prompt)`` gives, for every worker, how many
    leading blocks of the request that worker's prefix cache already holds. Peers: NVIDIA
    Dynamo's KV router, llm-d's precise prefix-cache scorer, SGLang's cache-aware router.

    Each worker sends its events in batches numbered ``seq = 0, 1, 2, ...``. A batch with the
    expected number is applied, an older one is ignored (``"duplicate"``), a newer one waits in
    a reorder buffer of ``max_pending`` batches (``"buffered"``). A newer batch that finds the
    buffer full means batches were lost (``"gap"``): the worker's entries are cleared, the
    buffered batches applied, and ``needs_resync(worker)`` is True until ``apply_snapshot``.
    A worker's index is always a subset of its cache as of its last applied batch (never a
    stale entry) and equal to it while nothing was lost since the last snapshot or ``seq`` 0.

    Incarnations: every registration of a worker id (``add_worker``, or a first ``apply`` of
    an unknown id) gets a new incarnation number, larger than any before, and starts a new
    sequence. A batch or snapshot sent with ``incarnation=`` an earlier registration's number
    (a restarted worker's old batches still in flight) is refused as ``"stale"`` and changes
    nothing.

    A worker holds a hash or not: a ``BlockStored`` of a hash it holds already changes nothing
    (vLLM's ``kv_cache_report_mode="full"`` re-announces prefix-cache hits so), and a
    ``BlockRemoved`` drops it (an engine caching one hash in two blocks and evicting one is
    under-reported, never over-reported). Workers with
    ``hash_source="engine"`` (the default; pagedkv engines with this ``hash_algo`` and
    ``hash_seed``) are indexed by their event hashes; ``"tokens"`` workers (vLLM) are rehashed
    from each ``BlockStored``'s token ids and parent, so token queries match them too.

    Identity: hashes of engines with different seeds (for ``LLMEngine``, different cache
    identities) never coincide, so they never merge here; an ``"engine"`` worker's
    ``BlockStored`` carrying a ``hash_root`` other than this indexer's is refused.

    Costs: ``apply`` O(blocks in the batch) expected (a clear is O(blocks held), amortised over
    the stores); ``overlap`` O(request blocks x ceil(workers / 64) + workers), independent of
    the number of blocks the workers hold. Thread-safe (a mutex; the GIL is released).

    Raises ``InvalidArgumentError`` for ``block_size == 0``, an unknown ``hash_algo`` or a
    ``max_pending`` outside ``0..=2**20``, or a wrong-typed argument.
    """

    def __new__(
        cls,
        block_size: int,
        *,
        hash_algo: str = "sha256",
        hash_seed: bytes | None = None,
        max_pending: int = 0,
    ) -> KVIndexer: ...
    @property
    def block_size(self) -> int:
        """Tokens per block (events with another block size are rejected)."""
    @property
    def hash_algo(self) -> str:
        """``"sha256"`` or ``"xxh3_128"``: must match the engines' ``CacheConfig``."""
    @property
    def hash_seed(self) -> bytes:
        """Chain seed of the prefix hashes: must match the engines' ``CacheConfig``."""
    @property
    def hash_root(self) -> bytes:
        """Root of the hash chains (32 bytes, from ``hash_algo`` and ``hash_seed``): the
        ``BlockStored.hash_root`` of the engines this indexer serves."""
    @property
    def max_pending(self) -> int:
        """Reorder buffer per worker, in batches (0: any missing batch is a gap)."""
    @property
    def num_hashes(self) -> int:
        """Distinct block hashes held by at least one worker."""
    def add_worker(
        self,
        worker_id: int,
        *,
        hash_source: str = "engine",
        groups: Sequence[KVCacheGroupSpec | str] | None = None,
    ) -> int:
        """Registers ``worker_id`` (``hash_source`` ``"engine"`` or ``"tokens"``); returns the
        registration's incarnation number (pass it to ``apply`` with that registration's
        batches).

        ``groups``: the attention kinds of the worker's KV cache groups in its engine's order
        (``KVCacheGroupSpec`` objects or ``"full"`` / ``"sliding_window"`` /
        ``"chunked_local"`` / ``"state"``; None: one full-attention group). Only the first
        full-attention group's events are indexed: a sliding-window, chunked-local or state
        group's blocks serve no prefix on their own (llm-d-router #2362). Workers are also
        registered as ``"engine"`` with one full-attention group by their first ``apply``.
        Raises ``InvalidArgumentError`` if already registered, for another ``hash_source``, an
        empty ``groups`` or another kind.
        """
    def remove_worker(self, worker_id: int) -> bool:
        """Drops the worker and all its entries (dead or restarted); False if unknown."""
    def worker_ids(self) -> list[int]:
        """Registered workers."""
    def worker_status(self, worker_id: int) -> dict[str, Any] | None:
        """``worker_id``, ``incarnation``, ``hash_source``, ``num_blocks``, ``next_seq``,
        ``num_pending``, ``needs_resync``, ``gaps``; None for an unknown worker."""
    def needs_resync(self, worker_id: int) -> bool:
        """True after a gap (or a first batch with ``seq > 0``) until ``apply_snapshot``."""
    def worker_hashes(self, worker_id: int) -> list[bytes]:
        """The (indexer-side, 32-byte) hashes the worker holds, sorted; [] if unknown."""
    def apply(
        self,
        worker_id: int,
        seq: int,
        events: Iterable[_IndexerEvent],
        *,
        hash_root: bytes | None = None,
        incarnation: int | None = None,
    ) -> str:
        """Applies batch ``seq`` of ``worker_id``; returns ``"applied"``, ``"buffered"``,
        ``"duplicate"``, ``"gap"`` or ``"stale"``. ``hash_root`` (32 bytes) is the hash root of
        the batch's wire ``BlockStored`` events, which carry none themselves (event objects
        keep theirs). ``incarnation``: the registration the batch came from (``add_worker``'s
        number; None: the current one); a batch of an earlier one, or of a removed worker, is
        ``"stale"`` and changes nothing.

        ``events``: pagedkv ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` objects,
        ``(group, event)`` pairs of them (the pair's group wins over the event's ``group``), or vLLM wire
        events (``["BlockStored", hashes, parent, token_ids, block_size,
        lora_id, medium, lora_name, extra_keys, ...]``, ``["BlockRemoved", hashes, ...]``,
        ``["AllBlocksCleared"]``; hashes bytes of at most 32 or ints). Only the events of the
        worker's first full-attention KV cache group (``add_worker``'s ``groups``; an unnamed
        group, ``group_idx`` None, is group 0) and clears are indexed. A ``"tokens"`` worker's
        blocks are rehashed with the LoRA name (else ``str(lora_id)``) as adapter key and the
        cache salt vLLM names in a request's first block as the salt of its whole chain; a block
        with multimodal or prompt-embedding keys, and the rest of its event, is not indexed.
        A LoRA event's block whose keys do not start with the LoRA name (vLLM puts it first in
        every block's) is not indexed either, nor is the rest of its event, and likewise a
        block whose vLLM hash covers tokens after it (``lookahead_token_ids``, field 15).
        Raises ``InvalidArgumentError`` (and applies nothing) for a malformed event, a
        ``BlockStored`` whose ``block_size`` differs, for an ``"engine"`` worker, whose
        ``hash_root`` is set and is not :attr:`hash_root` (another cache identity), an
        ``extra_keys`` field that is not one tuple or None per block, a ``lora_name`` that is
        not a str or None, a ``lookahead_token_ids`` that is not one list per block, or, for a
        ``"tokens"`` worker, whose token count is not ``len(block_hashes) * block_size``; for
        a ``hash_root`` that is not 32 bytes; and for an ``incarnation`` never issued to
        ``worker_id``.
        """
    def apply_snapshot(
        self,
        worker_id: int,
        seq: int,
        block_hashes: Iterable[_WireHash],
        *,
        hash_root: bytes | None = None,
        incarnation: int | None = None,
    ) -> str:
        """Sets the worker's entries to ``block_hashes`` (its whole cache) as of its batch
        ``seq``; later batches continue at ``seq + 1``. Clears ``needs_resync``. ``hash_root``
        (32 bytes): the root of the worker's hash chains, as its ``BlockStored`` events carry
        it. Returns ``"applied"``, or ``"stale"`` (nothing changed) for a snapshot of an
        earlier ``incarnation`` (as for ``apply``). Raises ``InvalidArgumentError`` (nothing
        changed) for a ``"tokens"`` worker, for a ``hash_root`` other than :attr:`hash_root`
        (another cache identity), for one that is not 32 bytes and for an ``incarnation`` never
        issued to ``worker_id``."""
    def block_hashes(
        self,
        token_ids: _IntArrayLike,
        *,
        num_blocks: int | None = None,
        spec: SequenceSpec | None = None,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        extra_keys: list[tuple[str, bytes]] | None = None,
        mm_items: list[tuple[bytes, int, int]] | None = None,
    ) -> list[bytes]:
        """Chained hashes (32 bytes) of the first ``num_blocks`` (default: all) full blocks of
        ``token_ids`` with the keys of ``KVCacheManager.add_sequence`` (``spec``, a
        :class:`pagedkv.SequenceSpec`, or the separate keys): exactly the hashes a manager with
        this hash algorithm and seed computes. Raises ``InvalidArgumentError``
        when ``num_blocks`` exceeds the full blocks."""
    def overlap(
        self,
        token_ids: _IntArrayLike,
        *,
        spec: SequenceSpec | None = None,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        extra_keys: list[tuple[str, bytes]] | None = None,
        mm_items: list[tuple[bytes, int, int]] | None = None,
    ) -> dict[int, int]:
        """``{worker_id: blocks}`` for every worker: how many leading blocks of the prompt it
        holds, counting only the full blocks before the last prompt token (what the worker's
        ``lookup_prefix`` could serve; the last token is always computed)."""
    def overlap_by_tier(
        self,
        token_ids: _IntArrayLike,
        *,
        spec: SequenceSpec | None = None,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        extra_keys: list[tuple[str, bytes]] | None = None,
        mm_items: list[tuple[bytes, int, int]] | None = None,
    ) -> dict[int, tuple[int, int]]:
        """``{worker_id: (device, any_tier)}``: ``device`` is ``overlap``'s figure,
        ``any_tier`` the leading blocks held on the device or in the worker's host tier."""
    def overlap_hashes(self, block_hashes: Iterable[_WireHash]) -> dict[int, int]:
        """``{worker_id: blocks}``: leading blocks of ``block_hashes`` (in order) each worker
        holds."""

@final
class BlockTable:
    """Block tables of every KV cache group kept across scheduler steps, updated from the step
    outputs' table deltas; ``update`` returns the batch's dense tables ``int32[G, S, W]`` (a
    one-group caller takes ``[0]``) as a view of a persistent buffer (valid until the next
    ``update``). Documented as
    ``pagedkv.tensors.BlockTable``."""

    def __new__(cls, manager: KVCacheManager, *, rows: int | None = None, width: int | None = None) -> BlockTable: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def num_rows(self) -> int: ...
    @property
    def num_table_reads(self) -> int: ...
    def update(
        self,
        steps: StepOutput | list[StepOutput] | tuple[StepOutput, ...],
    ) -> _Int32Array: ...

@final
class KVCacheGroupSpec:
    """One KV cache group: attention kind (full, sliding window, chunked local, state) and page
    layout."""

    def __new__(
        cls,
        kind: str,
        block_size: int,
        bytes_per_token: int,
        *,
        window: int | None = None,
        chunk: int | None = None,
        state_bytes: int | None = None,
        prefix_cacheable: bool = True,
        spare_blocks: int | None = None,
    ) -> KVCacheGroupSpec:
        """``spare_blocks`` (blocks, vLLM's ``num_speculative_blocks``: the states a
        speculative drafter's drafts write), per kind: on a group out of the prefix cache
        (``prefix_cacheable=False``), blocks a sequence holds past its slots (an allocation
        ending at slot ``end`` keeps ``ceil(end / block_size) + spare_blocks`` blocks, never
        cached); on a ``"state"`` group, 0..=16 speculative state blocks: ``k`` spare blocks
        after the live state's block for the states a verify step writes after each of its (at
        most ``k``) drafts, laid out and moved as vLLM's align-mode Mamba manager does
        (docs/design/kv-cache-groups.md, "Speculative state blocks"): a first allocation takes
        ``1 + k`` state blocks, a move of the live block one; drafts may be rejected
        (``accept_drafts`` leaves a state group's table as it is). ``CacheConfig`` checks that
        every state group carries the same value, of one block size, without swap space.

        Raises ``InvalidConfigError`` (a ``ValueError``) naming the field: an unknown kind, a
        missing or extra ``window`` / ``chunk`` / ``state_bytes``, ``prefix_cacheable=False``
        on a full or state group, ``spare_blocks`` above 0 on another group in the prefix
        cache or above 16 on a state group, a value that is not a non-negative int."""
    @property
    def kind(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def bytes_per_token(self) -> int: ...
    @property
    def window(self) -> int | None: ...
    @property
    def chunk(self) -> int | None: ...
    @property
    def page_bytes(self) -> int | None: ...
    @property
    def prefix_cacheable(self) -> bool: ...
    @property
    def spare_blocks(self) -> int: ...
