"""Every error :mod:`pagedkv.cluster` raises is a ``PagedKVError`` and the builtin a caller
would catch; checked without Ray through a stand-in for the few Ray calls the cluster makes
before and outside its dispatch loop."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

import pagedkv
from pagedkv.cluster import NoLiveReplicaError, ReplicaCluster, ReplicaMismatchError
from pagedkv.cluster import cluster as cluster_mod


class _FakeRay:
    """``ray.init`` / ``remote`` / ``get`` for replicas whose ``info`` is given."""

    class exceptions:  # noqa: N801 - mirrors ray.exceptions
        class RayActorError(Exception):
            pass

    def __init__(self, infos: list[dict[str, Any]]) -> None:
        self.infos = infos

    def is_initialized(self) -> bool:
        return True

    def remote(self, **_: Any) -> Any:
        infos = self.infos

        class _Method:
            def __init__(self, value: Any) -> None:
                self.value = value

            def remote(self, *args: Any) -> Any:
                return self.value

        class _Actor:
            def __init__(self, i: int) -> None:
                self.info = _Method(infos[i])

        class _ActorClass:
            @staticmethod
            def remote(i: int, model: Any, kwargs: Any) -> _Actor:
                return _Actor(i)

        return lambda cls: _ActorClass

    def get(self, refs: Any) -> Any:
        return refs

    def kill(self, actor: Any) -> None:
        pass


def _info(i: int, seed: bytes = b"model") -> dict[str, Any]:
    return {"replica_id": i, "hash_scheme": pagedkv.HashScheme(4, "sha256", seed), "cache_identity": seed.hex()}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_replica_count_is_an_invalid_argument(bad: Any) -> None:
    with pytest.raises(pagedkv.InvalidArgumentError, match="num_replicas") as info:
        ReplicaCluster(bad)
    assert isinstance(info.value, ValueError) and info.value.arg == "num_replicas"


def test_replicas_hashing_differently_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_mod, "_ray", lambda: _FakeRay([_info(0), _info(1), _info(2, b"another model")]))
    with pytest.raises(ReplicaMismatchError, match="replica 0 has .* replica 2") as info:
        ReplicaCluster(3)
    err = info.value
    assert isinstance(err, pagedkv.PagedKVError) and isinstance(err, ValueError)
    assert (err.replica_id, err.first_id) == (2, 0)
    assert pickle.loads(pickle.dumps(err)).replica_id == 2  # crosses process boundaries intact


def test_serve_refuses_duplicate_ids_and_a_cluster_without_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_mod, "_ray", lambda: _FakeRay([_info(0), _info(1)]))
    cluster = ReplicaCluster(2)
    assert cluster.router.hash_scheme == pagedkv.HashScheme(4, "sha256", b"model")
    assert cluster.router.workers == [0, 1]
    reqs = [cluster_mod.ClusterRequest("x", [1, 2, 3]), cluster_mod.ClusterRequest("x", [4, 5])]
    with pytest.raises(pagedkv.InvalidArgumentError, match="request_id='x'") as dup:
        cluster.serve(reqs)
    assert isinstance(dup.value, ValueError)
    cluster.shutdown()
    with pytest.raises(NoLiveReplicaError, match="1 request") as none_left:
        cluster.serve(reqs[:1])
    assert isinstance(none_left.value, RuntimeError) and isinstance(none_left.value, pagedkv.PagedKVError)
    assert none_left.value.unanswered == 1 and none_left.value.dead == []
