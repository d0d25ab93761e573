"""KV-aware routing over engine replicas: policies, a router, and the KV event wire format.

- :class:`~pagedkv.routing.policy.KVAwarePolicy` -- picks the worker by cached-prefix overlap
  against load, with user-set weights (formula in its docstring);
  :class:`~pagedkv.routing.policy.RoundRobinPolicy` and
  :class:`~pagedkv.routing.policy.LeastLoadedPolicy` are the baselines.
- :class:`~pagedkv.routing.router.Router` -- a :class:`pagedkv.KVIndexer` fed by the workers'
  numbered event batches plus their load reports, and a policy: ``route(prompt) -> worker``.
- :mod:`pagedkv.routing.wire` -- vLLM's KV event batch format (msgpack): decode a payload for
  ``KVIndexer.apply``, encode pagedkv events the same way (how pagedkv replicas publish).
- :mod:`pagedkv.routing.errors` -- its errors, all :class:`pagedkv.PagedKVError` (bad arguments
  raise the package's ``InvalidArgumentError`` / ``InvalidConfigError``).

Needs numpy only (``msgspec`` for the wire format).
"""

from __future__ import annotations

from pagedkv.routing.errors import NotAKVEventError, NoWorkerError, RoutingError, UnknownWorkerError, WireFormatError
from pagedkv.routing.policy import (
    DEFAULT_MAX_IMBALANCE,
    DEFAULT_TARGET_IMBALANCE,
    KVAwarePolicy,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
    WorkerLoad,
    load_bound,
    policy_by_name,
)
from pagedkv.routing.router import Router, RoutingDecision

__all__ = [
    "DEFAULT_MAX_IMBALANCE",
    "DEFAULT_TARGET_IMBALANCE",
    "KVAwarePolicy",
    "LeastLoadedPolicy",
    "NoWorkerError",
    "NotAKVEventError",
    "RoundRobinPolicy",
    "Router",
    "RoutingDecision",
    "RoutingError",
    "RoutingPolicy",
    "UnknownWorkerError",
    "WireFormatError",
    "WorkerLoad",
    "load_bound",
    "policy_by_name",
]
