"""A KV-aware router: a :class:`pagedkv.KVIndexer` fed by the workers' event batches and load
reports, and a :mod:`routing policy <pagedkv.routing.policy>` that picks the worker."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pagedkv import KVIndexer
from pagedkv.routing.policy import KVAwarePolicy, RoutingPolicy, WorkerLoad

__all__ = ["Router", "RoutingDecision"]


@dataclass(frozen=True)
class RoutingDecision:
    """Where a request goes: ``worker``, its cached ``overlap_blocks`` there, and the request's
    cacheable ``num_blocks`` (full blocks before the last prompt token)."""

    worker: int
    overlap_blocks: int
    num_blocks: int


class Router:
    """Routes requests to workers by a policy over the indexer's overlaps and reported loads.

    Args:
        indexer: the block index (its block size, hash algorithm and seed must match the
            workers' ``CacheConfig``).
        policy: a routing policy (default :class:`KVAwarePolicy` with its default weights).

    Not thread-safe (the indexer itself is); one router per dispatch loop.
    """

    def __init__(self, indexer: KVIndexer, policy: RoutingPolicy | None = None) -> None:
        self.indexer = indexer
        self.policy: RoutingPolicy = policy if policy is not None else KVAwarePolicy()
        self._loads: dict[int, WorkerLoad] = {}

    @property
    def workers(self) -> list[int]:
        """Live workers, sorted."""
        return sorted(self._loads)

    def add_worker(self, worker_id: int, *, hash_source: str = "engine") -> None:
        """Registers a worker (idle, empty cache). Raises ``InvalidArgumentError`` if known."""
        self.indexer.add_worker(worker_id, hash_source=hash_source)
        self._loads[worker_id] = WorkerLoad()

    def remove_worker(self, worker_id: int) -> bool:
        """Drops a dead worker: no more routing to it, its index entries cleared."""
        known = self._loads.pop(worker_id, None) is not None
        return self.indexer.remove_worker(worker_id) or known

    def report_load(self, worker_id: int, load: WorkerLoad) -> None:
        """The worker's current load. Raises KeyError for an unknown worker."""
        if worker_id not in self._loads:
            raise KeyError(f"unknown worker {worker_id}")
        self._loads[worker_id] = load

    def load(self, worker_id: int) -> WorkerLoad:
        """Last known load of a worker (KeyError if unknown)."""
        return self._loads[worker_id]

    def apply_events(self, worker_id: int, seq: int, events: Iterable[Any]) -> str:
        """Applies one numbered event batch of a live worker (see ``KVIndexer.apply``); a
        batch of a removed worker is ignored (``"duplicate"``)."""
        if worker_id not in self._loads:
            return "duplicate"
        return self.indexer.apply(worker_id, seq, events)

    def route(
        self,
        token_ids: Any,
        *,
        exclude: Iterable[int] = (),
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> RoutingDecision:
        """Picks a worker for a prompt (token ids; the keys as for ``add_sequence``), among the
        live workers not in ``exclude``. Raises RuntimeError when none is left."""
        skip = set(exclude)
        workers = [w for w in sorted(self._loads) if w not in skip]
        if not workers:
            raise RuntimeError("no live worker to route to")
        n_tokens = len(token_ids)
        num_blocks = max(n_tokens - 1, 0) // self.indexer.block_size
        overlaps = self.indexer.overlap(token_ids, cache_salt=cache_salt, adapter_id=adapter_id)
        w = self.policy.choose(workers, overlaps, num_blocks, self._loads)
        return RoutingDecision(w, overlaps.get(w, 0), num_blocks)
