"""Engine replicas on Ray with KV-aware routing.

- :class:`~pagedkv.cluster.replica.EngineReplica` -- one :class:`pagedkv.engine.LLMEngine` per
  Ray actor; each call adds the requests routed to it, runs engine steps, and returns the
  finished outputs, its KV events as one numbered batch (vLLM's msgpack wire format) and its
  load.
- :class:`~pagedkv.cluster.cluster.ReplicaCluster` -- starts N replicas (local Ray cluster, or an
  existing one by address), routes requests with :class:`pagedkv.routing.Router` over a
  :class:`pagedkv.KVIndexer`, and serves them; a replica that dies is dropped from the index
  and its unanswered requests are routed again, so every request is answered exactly once.
- ``python -m pagedkv.cluster`` (:mod:`pagedkv.cluster.cli`) -- serve a prompts file or a trace.

Needs ``ray`` and the engine's packages (``pip install "pagedkv[ray]"`` brings both), imported
on first use: a :class:`ReplicaCluster` without Ray raises :class:`pagedkv.MissingDependencyError`
naming the extra.

Errors (:mod:`pagedkv.cluster.errors`) are :class:`pagedkv.PagedKVError` subclasses that are also the
builtin a caller would catch: :class:`~pagedkv.cluster.errors.ReplicaMismatchError`
(``ValueError``), :class:`~pagedkv.cluster.errors.NoLiveReplicaError` (``RuntimeError``), and
:class:`pagedkv.InvalidArgumentError` for bad arguments.
"""

from __future__ import annotations

from pagedkv.cluster.cluster import ClusterRequest, ClusterResult, ReplicaCluster
from pagedkv.cluster.errors import ClusterError, NoLiveReplicaError, ReplicaMismatchError
from pagedkv.cluster.replica import EngineReplica

__all__ = [
    "ClusterError",
    "ClusterRequest",
    "ClusterResult",
    "EngineReplica",
    "NoLiveReplicaError",
    "ReplicaCluster",
    "ReplicaMismatchError",
]
