"""Errors of :mod:`pagedkv.cluster`: each a :class:`pagedkv.PagedKVError` and the builtin a
caller would catch (bad arguments are :class:`pagedkv.InvalidArgumentError`, a ``ValueError``).

============================ ================ ===============================================
class                        also a           raised when
============================ ================ ===============================================
``ReplicaMismatchError``     ``ValueError``   the replicas' engines hash blocks differently
                                              (block size, hash algorithm or seed: another
                                              model or settings), so one index cannot serve
                                              them
``NoLiveReplicaError``       ``RuntimeError`` no replica is left (each died, or the cluster
                                              was shut down) with requests unanswered
============================ ================ ===============================================
"""

from __future__ import annotations

from pagedkv.errors import PagedKVError

__all__ = ["ClusterError", "NoLiveReplicaError", "ReplicaMismatchError"]


class ClusterError(PagedKVError):
    """Base class of the errors :class:`pagedkv.cluster.ReplicaCluster` raises itself."""


class ReplicaMismatchError(ClusterError, ValueError):
    """Two replicas' engines have different :class:`pagedkv.HashScheme`\\ s (block size, hash
    algorithm, seed), so their block hashes cannot share one :class:`pagedkv.KVIndexer`.

    Attributes:
        replica_id: the replica that disagrees with replica ``first_id``.
        first_id: the replica whose scheme the others are compared with.
    """

    _fields = ("replica_id", "first_id")
    replica_id: int
    first_id: int


class NoLiveReplicaError(ClusterError, RuntimeError):
    """No replica is left to serve requests (each died, or the cluster was shut down).

    Attributes:
        dead: ids of the replicas that died, in the order they were dropped.
        unanswered: requests of the current call not answered.
    """

    _fields = ("dead", "unanswered")
    dead: list[int]
    unanswered: int
