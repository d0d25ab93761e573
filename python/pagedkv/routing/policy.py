"""Routing policies: which worker (engine replica) serves a request.

A policy sees, per candidate worker, the request's cached-prefix overlap on it (from
:class:`pagedkv.KVIndexer`, in blocks) and the worker's load (:class:`WorkerLoad`, as the worker
last reported it plus what the router dispatched since), and returns one worker id.

KV-aware (:class:`KVAwarePolicy`), for a request of ``n`` cacheable blocks with overlap ``o_w``
on worker ``w``, load ``q_w = running_w + waiting_w`` requests, KV usage ``u_w`` (blocks in
use / total, 0 when unknown) and ``p_w`` prompt tokens waiting to be prefilled (0 when
unknown)::

    cost_w = overlap_weight * (n - o_w) / max(n, 1)      # share of the prompt to prefill on w
           + load_weight    * q_w / (mean_v q_v + 1)      # requests ahead of it, relative
           + kv_weight      * u_w                         # memory pressure (eviction, preemption)
           + prefill_weight * p_w / (mean_v p_v + 1)      # prefill tokens queued ahead, relative

and picks ``argmin cost_w`` among the workers whose load ``q_w`` is at most
``max_imbalance * mean_v q_v + 1`` (all workers when ``max_imbalance`` is None). Ties go to the
fewer requests, then the lower worker id. The defaults (``overlap_weight = 3``,
``load_weight = 1``, ``prefill_weight = 0.5``, ``kv_weight = 0``, ``max_imbalance = 1.25``) are
the best of a small sweep in ``benchmarks/cluster_sim.py`` (Mooncake trace): a worker holding
the whole prompt wins over an empty-cache one until it runs about three mean loads more requests,
and queued prefill tokens keep long prompts from piling up behind each other (p99 TTFT).
Peers: NVIDIA Dynamo's KV router (prefill blocks + active blocks, weighted), SGLang's
cache-aware router (prefix match unless the load imbalance passes a threshold), llm-d's
prefix-cache + load scorers.

Baselines: :class:`RoundRobinPolicy` (workers in turn, ignoring caches and load) and
:class:`LeastLoadedPolicy` (fewest ``running + waiting``, then lowest KV usage).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "KVAwarePolicy",
    "LeastLoadedPolicy",
    "RoundRobinPolicy",
    "RoutingPolicy",
    "WorkerLoad",
    "policy_by_name",
]


@dataclass(frozen=True)
class WorkerLoad:
    """Load of one worker.

    Attributes:
        num_running: requests being prefilled or decoded (>= 0).
        num_waiting: requests queued, not yet scheduled (>= 0).
        kv_blocks_used: KV blocks in use (>= 0).
        kv_blocks_total: usable KV blocks (0: unknown, usage counts as 0).
        num_prefill_tokens: prompt tokens admitted or queued and not yet prefilled (0: unknown).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_prefill_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "num_prefill_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"WorkerLoad.{name} must be an int >= 0, got {v!r}")

    @property
    def num_requests(self) -> int:
        """``num_running + num_waiting``."""
        return self.num_running + self.num_waiting

    @property
    def kv_usage(self) -> float:
        """``kv_blocks_used / kv_blocks_total`` in [0, 1] (0 when the total is unknown)."""
        if self.kv_blocks_total == 0:
            return 0.0
        return min(1.0, self.kv_blocks_used / self.kv_blocks_total)


class RoutingPolicy(Protocol):
    """Chooses a worker for one request."""

    name: str

    def choose(
        self,
        workers: Sequence[int],
        overlaps: Mapping[int, int],
        num_blocks: int,
        loads: Mapping[int, WorkerLoad],
    ) -> int:
        """One of ``workers`` (non-empty). ``overlaps[w]``: leading cached blocks of the
        request on ``w`` (missing = 0); ``num_blocks``: the request's cacheable blocks;
        ``loads[w]``: its load (missing = idle)."""
        ...


def _check_workers(workers: Sequence[int]) -> None:
    if len(workers) == 0:
        raise ValueError("no worker to route to")


_IDLE = WorkerLoad()


@dataclass
class KVAwarePolicy:
    """Cached-prefix overlap against load; see the module docstring for the cost formula.

    Args:
        overlap_weight: weight of the uncached share of the prompt (>= 0).
        load_weight: weight of the relative request load (>= 0).
        kv_weight: weight of the KV usage fraction (>= 0).
        prefill_weight: weight of the relative queued prefill tokens (>= 0).
        max_imbalance: workers with more than ``max_imbalance * mean + 1`` requests are not
            candidates (>= 1, or None for no cap).

    Raises:
        ValueError: a negative or non-finite weight, or ``max_imbalance < 1``.
    """

    overlap_weight: float = 3.0
    load_weight: float = 1.0
    kv_weight: float = 0.0
    max_imbalance: float | None = 1.25
    prefill_weight: float = 0.5
    name: str = "kv_aware"

    def __post_init__(self) -> None:
        for field in ("overlap_weight", "load_weight", "kv_weight", "prefill_weight"):
            v = getattr(self, field)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"KVAwarePolicy.{field} must be a finite number >= 0, got {v!r}")
        m = self.max_imbalance
        if m is not None and not (isinstance(m, (int, float)) and math.isfinite(m) and m >= 1):
            raise ValueError(f"KVAwarePolicy.max_imbalance must be >= 1 or None, got {m!r}")

    def costs(
        self,
        workers: Sequence[int],
        overlaps: Mapping[int, int],
        num_blocks: int,
        loads: Mapping[int, WorkerLoad],
    ) -> dict[int, float]:
        """``{worker: cost}`` for the candidate workers (after the ``max_imbalance`` cap)."""
        _check_workers(workers)
        q = {w: loads.get(w, _IDLE).num_requests for w in workers}
        mean = sum(q.values()) / len(workers)
        cand = list(workers)
        if self.max_imbalance is not None:
            cap = self.max_imbalance * mean + 1
            cand = [w for w in workers if q[w] <= cap] or list(workers)
        n = max(num_blocks, 1)
        p = {w: loads.get(w, _IDLE).num_prefill_tokens for w in workers}
        mean_p = sum(p.values()) / len(workers)
        return {
            w: self.overlap_weight * (num_blocks - min(overlaps.get(w, 0), num_blocks)) / n
            + self.load_weight * q[w] / (mean + 1)
            + self.kv_weight * loads.get(w, _IDLE).kv_usage
            + self.prefill_weight * p[w] / (mean_p + 1)
            for w in cand
        }

    def choose(
        self,
        workers: Sequence[int],
        overlaps: Mapping[int, int],
        num_blocks: int,
        loads: Mapping[int, WorkerLoad],
    ) -> int:
        """The candidate of least cost (ties: fewer requests, then lower id)."""
        costs = self.costs(workers, overlaps, num_blocks, loads)
        return min(costs, key=lambda w: (costs[w], loads.get(w, _IDLE).num_requests, w))


@dataclass
class RoundRobinPolicy:
    """Workers in turn (in sorted id order), ignoring caches and load."""

    name: str = "round_robin"
    _next: int = 0

    def choose(
        self,
        workers: Sequence[int],
        overlaps: Mapping[int, int],
        num_blocks: int,
        loads: Mapping[int, WorkerLoad],
    ) -> int:
        """The next worker after the previous choice (wrapping)."""
        _check_workers(workers)
        ordered = sorted(workers)
        w = ordered[self._next % len(ordered)]
        self._next += 1
        return w


@dataclass
class LeastLoadedPolicy:
    """Fewest ``running + waiting`` requests; ties: lower KV usage, then lower id."""

    name: str = "least_loaded"

    def choose(
        self,
        workers: Sequence[int],
        overlaps: Mapping[int, int],
        num_blocks: int,
        loads: Mapping[int, WorkerLoad],
    ) -> int:
        """The least loaded worker."""
        _check_workers(workers)
        return min(
            workers,
            key=lambda w: (loads.get(w, _IDLE).num_requests, loads.get(w, _IDLE).kv_usage, w),
        )


def policy_by_name(name: str, **weights: float | None) -> RoutingPolicy:
    """``"kv_aware"`` (``weights`` passed to :class:`KVAwarePolicy`), ``"round_robin"`` or
    ``"least_loaded"``. Raises ValueError for another name, or weights for a baseline."""
    if name == "kv_aware":
        return KVAwarePolicy(**weights)  # type: ignore[arg-type]
    if weights:
        raise ValueError(f"policy {name!r} takes no weights, got {sorted(weights)}")
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    raise ValueError(f"unknown routing policy {name!r}: expected kv_aware, round_robin or least_loaded")
