"""pagedkv: a paged KV-cache memory manager (PagedAttention, Kwon et al., SOSP'23).

The KV cache of each sequence is cut into blocks of ``block_size`` tokens; a block table maps
logical block ``i`` to a physical block id; blocks are shared through reference counts (prefix
caching, parallel sampling, beam search) and copied only on write. The core is Rust
(``pagedkv._core``); this package re-exports it with docs, types and typed exceptions.

Allocator API (needs numpy only):

- :class:`CacheConfig` -- frozen configuration (``num_blocks`` incl. the null block 0,
  ``block_size`` in tokens, or the KV cache ``groups`` of a hybrid model and each layer's
  group; prefix caching, hash algorithm and seed, CPU swap blocks, events, host tier).
- :class:`KVCacheManager` -- THE manager, for one full-attention group and for the KV cache
  groups of hybrid models (:class:`KVCacheGroupSpec`: full-attention, sliding-window and
  chunked-local layers) in one block pool: per-sequence block tables (one per group),
  ``add_sequence``, ``allocate_slots``, ``fork``, ``free``, ``preempt``, ``swap_out`` /
  ``swap_in``, the batched ``step``, ``stats``, ``take_events``, ``check_invariants``.
- :func:`HybridKVCacheManager` -- deprecated alias: builds a :class:`KVCacheManager` from
  groups (kept for one release).
- :class:`BlockPool` -- the block pool alone (thread-safe, GIL released in every call).
- :class:`HostBlockPool` -- the prefix cache's host tier alone, for offloading connectors.
- :class:`SlotAllocation`, :class:`StepOutput`, :class:`CacheStats`, :class:`BlockStored`,
  :class:`BlockRemoved`, :class:`AllBlocksCleared` -- results.
- :class:`KVIndexer` -- the routers' side of the events: which worker holds which block, and
  each worker's cached-prefix overlap with a request (KV-aware routing over replicas).
- :class:`SequenceSpec`, :class:`HashScheme` -- a block's cache identity besides its tokens:
  the request's keys (cache salt, adapter, typed extra keys, multimodal items) and the
  engine's hash scheme (block size, hash algorithm, seed), one value each
  (:mod:`pagedkv.block_identity`).
- Exceptions (:mod:`pagedkv.errors`): :class:`PagedKVError` and its subclasses, each also a
  builtin (``MemoryError``, ``KeyError``, ``ValueError``, ``RuntimeError``,
  ``ModuleNotFoundError``).

Submodules imported on first use (they need torch): :mod:`pagedkv.tensors` (kernel inputs:
dense / CSR block tables, slot mapping, lengths; its numpy path works without torch),
:mod:`pagedkv.routing` (router policies and the vLLM wire decoder; numpy only),
:mod:`pagedkv.cluster` (engine replicas on Ray),
:mod:`pagedkv.kernels` (Triton kernels + torch references), :mod:`pagedkv.engine` (the
reference engine). A part used without the extra of ``pyproject.toml`` it needs raises
:class:`MissingDependencyError` naming the missing package and ``pip install "pagedkv[<extra>]"``.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedkv._core import (
    HOST_EVICTIONS,
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_UNCACHED_BLOCK_SIZE,
    NULL_BLOCK,
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    CacheConfig,
    CacheStats,
    HostBlockPool,
    KVCacheGroupSpec,
    KVCacheManager,
    KVIndexer,
    SlotAllocation,
    StepOutput,
    __version__,
)
from pagedkv.block_identity import HashScheme, SequenceSpec
from pagedkv.errors import (
    CacheInUseError,
    EngineError,
    InvalidArgumentError,
    InvalidBlockError,
    InvalidConfigError,
    InvalidSequenceStateError,
    InvariantViolationError,
    KernelInputError,
    MissingDependencyError,
    OutOfBlocksError,
    OutOfSwapSpaceError,
    PagedKVError,
    ReadOnlyPoolError,
    RefCountUnderflowError,
    SequenceExistsError,
    UnknownSequenceError,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pagedkv import cluster, engine, kernels, routing, tensors

__all__ = [
    "MAX_BLOCKS",
    "HOST_EVICTIONS",
    "MAX_BLOCK_SIZE",
    "MAX_UNCACHED_BLOCK_SIZE",
    "NULL_BLOCK",
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "CacheInUseError",
    "CacheStats",
    "EngineError",
    "HostBlockPool",
    "HashScheme",
    "HybridKVCacheManager",
    "InvalidArgumentError",
    "InvalidBlockError",
    "InvalidConfigError",
    "InvalidSequenceStateError",
    "InvariantViolationError",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVIndexer",
    "KernelInputError",
    "MissingDependencyError",
    "OutOfBlocksError",
    "OutOfSwapSpaceError",
    "PagedKVError",
    "ReadOnlyPoolError",
    "RefCountUnderflowError",
    "SequenceExistsError",
    "SequenceSpec",
    "SlotAllocation",
    "StepOutput",
    "UnknownSequenceError",
    "__version__",
    "cluster",
    "engine",
    "kernels",
    "routing",
    "tensors",
]


def HybridKVCacheManager(  # noqa: N802 - the name of the class it replaces
    groups: Sequence[KVCacheGroupSpec],
    layer_groups: Sequence[int],
    num_blocks: int,
    **kwargs: Any,
) -> KVCacheManager:
    """Deprecated alias, kept for one release: ``KVCacheManager(CacheConfig(num_blocks,
    groups=groups, layer_groups=layer_groups, **kwargs))``.

    :class:`KVCacheManager` serves one KV cache group and many alike; build it from a
    :class:`CacheConfig` with ``groups`` / ``layer_groups`` instead.

    Args:
        groups: the :class:`KVCacheGroupSpec` of each group (list or tuple, at least one).
        layer_groups: per model layer, the index of its group.
        num_blocks: pages in the pool, the null block included.
        **kwargs: the other keywords of :class:`CacheConfig` (``retention_interval``,
            ``enable_prefix_caching``, ``hash_algo``, ``num_cpu_blocks``, ...).

    Returns:
        A :class:`KVCacheManager` (the same class every layout uses).

    Raises:
        InvalidConfigError: as :class:`CacheConfig` (nothing built).

    Warns:
        DeprecationWarning: on every call.
    """
    warnings.warn(
        "pagedkv.HybridKVCacheManager is deprecated: use "
        "pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks, groups=..., layer_groups=...))",
        DeprecationWarning,
        stacklevel=2,
    )
    return KVCacheManager(CacheConfig(num_blocks, groups=groups, layer_groups=layer_groups, **kwargs))


# Submodules that import torch (directly or through their dependencies) load on first access,
# so `import pagedkv` works on a machine without torch or triton.
_LAZY_SUBMODULES = frozenset({"tensors", "kernels", "engine", "routing", "cluster"})


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY_SUBMODULES)
