"""N engine replicas as Ray actors behind a KV-aware router.

Dispatch loop (:meth:`ReplicaCluster.serve`): route every waiting request
(:class:`pagedkv.routing.Router`: overlap from the :class:`pagedkv.KVIndexer` plus predicted
blocks of requests in flight, load as last reported plus requests routed since); keep one
``EngineReplica.run`` call in flight per replica that has work, carrying the requests routed to it
since its previous call; when a call returns, record the finished outputs, apply the replica's
event batch to the index (a gap asks the replica for a snapshot), and take its load report.

Failures: a call that fails because the actor died (``ray.exceptions.RayActorError``: process
killed, node lost) drops the replica from the router and the index and sends every request
routed to it and not yet answered back to routing, on the other replicas. Results are only taken
from completed calls and keyed by request id, so a request is never answered twice; the loop ends
when every request is answered, and raises :class:`~pagedkv.cluster.errors.NoLiveReplicaError`
when no replica is left.

Cache identity: the router hashes each prompt with the :class:`pagedkv.SequenceSpec` a replica's
engine derives for it (``EngineReplica.prompt_specs``: the cache salt, a dict's own salt winning,
and the engine's keys such as a length-dependent RoPE's), the value the replica's engine
registers, and indexes the replicas under their common :class:`pagedkv.HashScheme`.

The same code runs on one machine (``address=None`` starts a local Ray cluster) and on a
multi-node Ray cluster (``address="auto"`` or ``"ray://host:port"``); replicas are placed by Ray
with ``num_cpus`` / ``num_gpus`` per replica.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv._optional import optional_imports
from pagedkv.block_identity import HashScheme, SequenceSpec
from pagedkv.cluster.errors import NoLiveReplicaError, ReplicaMismatchError
from pagedkv.errors import InvalidArgumentError
from pagedkv.routing import Router, RoutingPolicy, WorkerLoad

__all__ = ["ClusterRequest", "ClusterResult", "ReplicaCluster"]


@dataclass(frozen=True)
class ClusterRequest:
    """One request: ``request_id`` (unique), ``prompt`` (text, token ids or a prompt dict, as for
    ``LLMEngine.add_request``), ``params`` (a ``SamplingParams`` or None), ``chat_template``,
    ``cache_salt`` (a prompt dict's ``"cache_salt"`` wins, as in the engine)."""

    request_id: str
    prompt: Any
    params: Any = None
    chat_template: bool = False
    cache_salt: str | None = None


@dataclass
class ClusterResult:
    """How a request ended: ``output`` (the engine's ``RequestOutput``) or ``error`` (the
    engine refused it), the ``replica`` that answered, how often it was routed (``attempts``,
    > 1 after a replica died), and its cached-prefix ``overlap_blocks`` at the last routing."""

    request_id: str
    replica: int
    attempts: int
    overlap_blocks: int
    output: Any = None
    error: str | None = None


def _ray() -> Any:
    with optional_imports("pagedkv.cluster", "ray"):
        import ray  # noqa: PLC0415
    return ray


@dataclass
class _Pending:
    req: ClusterRequest
    tokens: list[int]  # as the engine tokenizes the prompt ([] for a prompt it refuses)
    spec: SequenceSpec | None  # as the engine derives it (None: refused; routed by load alone)
    attempts: int = 0
    overlap: int = 0


@dataclass
class _ReplicaState:
    actor: Any
    outbox: list[_Pending] = field(default_factory=list)
    assigned: dict[str, _Pending] = field(default_factory=dict)
    call: Any = None


class ReplicaCluster:
    """Starts ``num_replicas`` :class:`~pagedkv.cluster.replica.EngineReplica` actors and serves
    requests over them.

    Args:
        num_replicas: replicas to start (>= 1).
        model: model for every replica (a path visible on every node, or None for the default).
        engine_kwargs: ``LLMEngine`` keyword arguments for every replica.
        policy: routing policy (default ``KVAwarePolicy()``).
        address: Ray cluster address (None: start or join a local one).
        num_cpus, num_gpus: Ray resources each replica reserves.
        ray_init_kwargs: extra ``ray.init`` arguments when this call starts Ray.
        steps_per_call: engine steps per ``run`` call (more: fewer round trips, coarser routing).

    Raises:
        pagedkv.InvalidArgumentError: ``num_replicas`` is not an int >= 1 (a ``ValueError``).
        ReplicaMismatchError: replicas disagreeing on block size or hashing (a ``ValueError``).
        pagedkv.MissingDependencyError: Ray is not installed (an ``ImportError``; the message
            names the ``ray`` extra).
    """

    def __init__(
        self,
        num_replicas: int,
        model: Any = None,
        *,
        engine_kwargs: dict[str, Any] | None = None,
        policy: RoutingPolicy | None = None,
        address: str | None = None,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        ray_init_kwargs: dict[str, Any] | None = None,
        steps_per_call: int = 4,
    ) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            reason = "expected an int >= 1"
            raise InvalidArgumentError(
                f"num_replicas={num_replicas!r} is invalid: {reason}",
                arg="num_replicas",
                value=repr(num_replicas),
                reason=reason,
            )
        ray = _ray()
        if not ray.is_initialized():
            kw = {"include_dashboard": False, "log_to_driver": False, **(ray_init_kwargs or {})}
            ray.init(address=address, **kw)
        from pagedkv.cluster.replica import EngineReplica  # noqa: PLC0415

        actor_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0)(EngineReplica)
        self._ray = ray
        self.steps_per_call = max(1, int(steps_per_call))
        self.replicas: dict[int, _ReplicaState] = {
            i: _ReplicaState(actor_cls.remote(i, model, engine_kwargs)) for i in range(num_replicas)
        }
        infos = ray.get([r.actor.info.remote() for r in self.replicas.values()])
        first = infos[0]
        scheme: HashScheme = first["hash_scheme"]
        for info in infos[1:]:
            if info["hash_scheme"] != scheme:
                raise ReplicaMismatchError(
                    f"replicas disagree on KV hashing: replica {first['replica_id']} has {scheme}, "
                    f"replica {info['replica_id']} {info['hash_scheme']}",
                    replica_id=info["replica_id"],
                    first_id=first["replica_id"],
                )
        self.infos = {info["replica_id"]: info for info in infos}
        self.router = Router(scheme.indexer(), policy)
        for i in self.replicas:  # only a full-attention KV cache group's blocks count toward overlap
            self.router.add_worker(i, groups=self.infos[i].get("kv_groups"))  # None: one full group
        self.dead: list[int] = []

    @property
    def live_replicas(self) -> list[int]:
        """Ids of the replicas still serving."""
        return sorted(self.replicas)

    def num_unanswered(self, replica_id: int) -> int:
        """Requests routed to a live replica and not answered yet (0 for a dead one)."""
        st = self.replicas.get(replica_id)
        return 0 if st is None else len(st.assigned)

    def actor(self, replica_id: int) -> Any:
        """The Ray actor handle of a live replica."""
        return self.replicas[replica_id].actor

    def _drop(self, rid: int, waiting: collections.deque[_Pending]) -> None:
        """A dead replica: out of the router and index; its unanswered requests re-queued."""
        state = self.replicas.pop(rid)
        self.router.remove_worker(rid)
        self.dead.append(rid)
        for p in list(state.assigned.values()) + state.outbox:
            self.router.finished(p.req.request_id)
            waiting.appendleft(p)

    def _no_replica(self, unanswered: int) -> NoLiveReplicaError:
        return NoLiveReplicaError(
            f"no live replica (died: {self.dead or 'none; shut down'}); {unanswered} request(s) unanswered",
            dead=list(self.dead),
            unanswered=unanswered,
        )

    def _prompt_specs(
        self, requests: Sequence[ClusterRequest], waiting: collections.deque[_Pending]
    ) -> list[tuple[list[int], SequenceSpec] | None]:
        """Token ids and :class:`pagedkv.SequenceSpec` of each request for routing, derived by
        a live replica's engine exactly as it registers them (``None`` for a prompt it
        refuses); a replica found dead here is dropped."""
        ray = self._ray
        args = [(r.prompt, r.chat_template, r.cache_salt) for r in requests]
        while True:
            if not self.replicas:
                raise self._no_replica(len(requests))
            rid = self.live_replicas[0]
            try:
                return list(ray.get(self.replicas[rid].actor.prompt_specs.remote(args)))
            except ray.exceptions.RayActorError:
                self._drop(rid, waiting)

    def serve(
        self, requests: Sequence[ClusterRequest], on_result: Callable[[ClusterResult], None] | None = None
    ) -> dict[str, ClusterResult]:
        """Serves ``requests`` to completion; returns ``{request_id: result}`` (every request,
        exactly once). ``on_result`` is called as each result arrives (tests kill replicas from
        it). A prompt the engines refuse is answered with its ``error``.

        Raises:
            pagedkv.InvalidArgumentError: duplicate request ids (a ``ValueError``).
            NoLiveReplicaError: no replica is left: each died, or after :meth:`shutdown` (a
                ``RuntimeError``).
        """
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            dup = next(i for i, n in collections.Counter(ids).items() if n > 1)
            reason = "request ids must be unique"
            raise InvalidArgumentError(
                f"request_id={dup!r} is invalid: {reason}", arg="request_id", value=repr(dup), reason=reason
            )
        ray = self._ray
        if not self.replicas:
            raise self._no_replica(len(requests))
        waiting: collections.deque[_Pending] = collections.deque()
        for r, keys in zip(requests, self._prompt_specs(requests, waiting)):
            waiting.append(_Pending(r, [], None) if keys is None else _Pending(r, keys[0], keys[1]))
        results: dict[str, ClusterResult] = {}
        while len(results) < len(requests):
            if not self.replicas:
                raise self._no_replica(len(requests) - len(results))
            while waiting:
                p = waiting.popleft()
                p.attempts += 1
                d = self.router.route(p.tokens, spec=p.spec, request_id=p.req.request_id)
                p.overlap = d.overlap_blocks
                st = self.replicas[d.worker]
                st.outbox.append(p)
                st.assigned[p.req.request_id] = p
                old = self.router.load(d.worker)
                self.router.report_load(
                    d.worker, WorkerLoad(old.num_running, old.num_waiting + 1, old.kv_blocks_used, old.kv_blocks_total)
                )
            for st in self.replicas.values():
                if st.call is None and st.assigned:
                    batch = [
                        (p.req.request_id, p.req.prompt, p.req.params, p.req.chat_template, p.req.cache_salt)
                        for p in st.outbox
                    ]
                    st.outbox = []
                    st.call = st.actor.run.remote(batch, self.steps_per_call)
            calls = {st.call: rid for rid, st in self.replicas.items() if st.call is not None}
            ready, _ = ray.wait(list(calls), num_returns=1)
            for ref in ready:
                rid = calls[ref]
                st = self.replicas[rid]
                st.call = None
                try:
                    step = ray.get(ref)
                except ray.exceptions.RayActorError:
                    self._drop(rid, waiting)
                    continue
                answered = [(o.request_id, o, None) for o in step.outputs]
                answered += [(req_id, None, msg) for req_id, msg in step.failed]
                for req_id, out, err in answered:
                    if req_id not in st.assigned or req_id in results:
                        continue  # not ours (cannot happen) or already answered
                    p = st.assigned.pop(req_id)
                    self.router.finished(req_id)
                    res = ClusterResult(req_id, rid, p.attempts, p.overlap, out, err)
                    results[req_id] = res
                    if on_result is not None:
                        on_result(res)
                if step.events is not None:
                    seq, payload = step.events
                    batch = _decode(payload)
                    if self.router.apply_events(rid, seq, batch.events, hash_root=batch.hash_root) == "gap":
                        try:
                            snap_seq, hashes, root = ray.get(st.actor.snapshot.remote())
                        except ray.exceptions.RayActorError:
                            self._drop(rid, waiting)
                            continue
                        self.router.indexer.apply_snapshot(rid, snap_seq, hashes, hash_root=root)
                if rid in self.replicas:
                    ld = step.load  # plus what was routed here while the call ran
                    self.router.report_load(
                        rid, WorkerLoad(ld.num_running, len(st.outbox), ld.kv_blocks_used, ld.kv_blocks_total)
                    )
        return {i: results[i] for i in ids}

    def shutdown(self) -> None:
        """Kills the replicas (Ray itself stays up)."""
        for st in self.replicas.values():
            self._ray.kill(st.actor)
        self.replicas.clear()


def _decode(payload: bytes) -> Any:
    """The :class:`pagedkv.routing.wire.EventBatch` of a replica's payload (its events and the
    hash root naming the replica's cache identity)."""
    from pagedkv.routing.wire import decode_event_batch  # noqa: PLC0415

    return decode_event_batch(payload)
