"""What the engine asks of a KV cache manager: :class:`EngineKVManager`, a :class:`typing.Protocol`.

The scheduler, the request registry, the sequence groups, the engine and its replica ask a
manager exactly these questions, whatever the model's KV cache groups (one full-attention group
or a hybrid model's several). Two managers answer them: :class:`pagedkv.KVCacheManager` (the
paged layout, every model) and
:class:`~pagedkv.engine.virtual.manager.VirtualKVManager` (``kv_layout="virtual"``: capacity in
pages of a virtual layout, bookkeeping in a ``KVCacheManager``). Both are checked against the
protocol by mypy (the assignments at the end of :mod:`pagedkv.engine.virtual.manager`) and by
tests/engine/test_virtual_layout.py at run time.

Units: block counts are the manager's capacity units (blocks of the pool; pages of the virtual
layout); token counts are tokens. Array arguments are anything the core takes as an integer
array (a list, a numpy array).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, CacheConfig, KVCacheGroupSpec, PagedKVError

__all__ = ["EngineKVManager", "ManagerPool", "StepResult"]


@runtime_checkable
class ManagerPool(Protocol):
    """The manager's capacity now (``manager.pool``): read-only counts."""

    @property
    def num_free(self) -> int:
        """Free units (uncached and evictable cached blocks; uncommitted pages)."""

    @property
    def num_used(self) -> int:
        """Units in use (blocks with a reference count > 0; committed pages)."""


@runtime_checkable
class StepResult(Protocol):
    """What the scheduler reads of one ``step`` output (a :class:`pagedkv.StepOutput`, or the
    virtual layout's cut view of one). ``S`` scheduled sequences."""

    @property
    def num_scheduled(self) -> int:
        """Sequences scheduled, a prefix of the ones asked for."""

    @property
    def error(self) -> PagedKVError | None:
        """Why the step stopped before the rest (``OutOfBlocksError`` when the pool ran dry), or None."""

    @property
    def seq_lens(self) -> npt.NDArray[np.int32]:
        """``int32[S]`` context + scheduled tokens (drafts included) of each sequence."""

    @property
    def num_cached_tokens(self) -> npt.NDArray[np.int32]:
        """``int32[S]`` prompt tokens served by the prefix cache at each sequence's first step."""

    @property
    def num_draft_tokens(self) -> npt.NDArray[np.int32]:
        """``int32[S]`` draft tokens scheduled after each sequence's last token."""

    @property
    def host_stores(self) -> npt.NDArray[np.int32]:
        """``int32[n, 3]`` ``(group, device_block, host_block)`` host-tier stores, run first."""

    @property
    def host_loads(self) -> npt.NDArray[np.int32]:
        """``int32[n, 3]`` ``(group, host_block, device_block)`` host-tier loads, run last."""


@runtime_checkable
class EngineKVManager(Protocol):
    """Every question the engine asks of its KV cache manager (see the module docs). Methods
    raise the core's typed errors (:mod:`pagedkv.errors`) for an unknown sequence or a bad
    argument, leaving the manager unchanged."""

    # ---- configuration and capacity ------------------------------------------------------------

    @property
    def config(self) -> CacheConfig:
        """The manager's configuration (hash scheme, pool sizes, host tier settings)."""

    @property
    def groups(self) -> Sequence[KVCacheGroupSpec]:
        """Its KV cache groups in order (one full-attention group for a one-group model)."""

    @property
    def num_blocks(self) -> int:
        """Blocks of the device pool, the null block included."""

    @property
    def num_free_blocks(self) -> int:
        """Free capacity units now (``pool.num_free``)."""

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the prefix cache's host tier (0: none)."""

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether the manager's own prefix cache is on."""

    @property
    def num_sequences(self) -> int:
        """Sequences registered now."""

    @property
    def pool(self) -> ManagerPool:
        """The capacity counts (:class:`ManagerPool`)."""

    # ---- sequences -------------------------------------------------------------------------------

    def add_sequence(self, seq_id: int, prompt_token_ids: Any, /, *, spec: Any = ...) -> None:
        """Register a sequence holding ``prompt_token_ids``; its prefix hashes mix in ``spec``
        (a :class:`pagedkv.SequenceSpec`)."""

    def append_tokens(self, seq_id: int, token_ids: Any, /) -> None:
        """Append tokens (sampled, not yet computed) to a sequence."""

    def lookup_prefix(self, seq_id: int, /) -> int:
        """Tokens of a new or resumed sequence the prefix cache serves."""

    def fork(self, parent_id: int, child_id: int, /) -> None:
        """A child sharing every block of the parent (copy-on-write)."""

    def free(self, seq_id: int, /) -> bool:
        """Free a sequence's blocks; False when it is not registered (idempotent)."""

    def preempt(self, seq_ids: Any, /) -> None:
        """Preempt sequences by recompute (their blocks freed, tokens kept)."""

    def swap_out(self, seq_ids: Any, /) -> npt.NDArray[np.int32]:
        """Swap sequences out to CPU blocks: ``int32[k, 2]`` (device, CPU) pairs to copy."""

    def swap_in(self, seq_ids: Any, /) -> npt.NDArray[np.int32]:
        """Swap sequences back in: ``int32[k, 2]`` (CPU, device) pairs to copy."""

    def accept_drafts(self, seq_id: int, num_accepted: int, /) -> Any:
        """Keep the first ``num_accepted`` drafts of a verify step, drop the rest."""

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache (legal when no block is referenced)."""

    # ---- questions -------------------------------------------------------------------------------

    def status(self, seq_id: int, /) -> str:
        """``"running"``, ``"preempted"`` or ``"swapped"``."""

    def num_computed_tokens(self, seq_id: int, /) -> int:
        """Tokens of the sequence with KV computed."""

    def num_uncomputed_tokens(self, seq_ids: Any, /) -> npt.NDArray[np.int32]:
        """``int32[n]`` tokens of each sequence without KV."""

    def num_blocks_owed(self, seq_ids: Any, /) -> int:
        """Free units the sequences' remaining tokens still take (exact, one allocation)."""

    def num_blocks_needed(self, seq_id: int, num_new_tokens: int, /) -> tuple[int, int]:
        """``(take, release)`` units of the next allocation of ``num_new_tokens`` tokens: it
        succeeds exactly when ``take - release`` fits the free units."""

    def num_blocks_held(self, seq_id: int, /) -> list[int]:
        """Blocks (device or swap) the sequence holds, per KV cache group."""

    # ---- the step --------------------------------------------------------------------------------

    def step(
        self, seq_ids: Any, num_new_tokens: Any, append_token_ids: Any = ..., /, *, draft_token_ids: Any = ...
    ) -> StepResult:
        """Append each sequence's pending tokens and allocate slots for its next tokens (and
        drafts), in order, stopping at the first that does not fit (:attr:`StepResult.error`)."""

    # ---- observation -----------------------------------------------------------------------------

    def stats(self) -> Any:
        """The manager's counters: a :class:`pagedkv.CacheStats`, or an object with its fields
        (the virtual layout's, its prefix-cache counters the layout's)."""

    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The KV events buffered since the last call (with ``enable_events``)."""

    def check_invariants(self) -> None:
        """Raise when the manager's state is inconsistent (tests)."""
