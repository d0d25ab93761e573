"""KV-aware routing over engine replicas: policies, a router, and the KV event wire format.

- :class:`~pagedkv.routing.policy.KVAwarePolicy` -- picks the worker by cached-prefix overlap
  against load, with user-set weights (formula in its docstring);
  :class:`~pagedkv.routing.policy.RoundRobinPolicy` and
  :class:`~pagedkv.routing.policy.LeastLoadedPolicy` are the baselines.
- :class:`~pagedkv.routing.router.Router` -- a :class:`pagedkv.KVIndexer` fed by the workers'
  numbered event batches plus their load reports, and a policy: ``route(prompt) -> worker``.
- :mod:`pagedkv.routing.wire` -- vLLM's KV event batch format (msgpack): decode a payload for
  ``KVIndexer.apply``, encode pagedkv events the same way (how pagedkv replicas publish).

Needs numpy only (``msgspec`` for the wire format).
"""

from __future__ import annotations

from pagedkv.routing.policy import (
    KVAwarePolicy,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
    WorkerLoad,
    policy_by_name,
)
from pagedkv.routing.router import Router, RoutingDecision

__all__ = [
    "KVAwarePolicy",
    "LeastLoadedPolicy",
    "RoundRobinPolicy",
    "Router",
    "RoutingDecision",
    "RoutingPolicy",
    "WorkerLoad",
    "policy_by_name",
]
