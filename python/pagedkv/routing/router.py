"""A KV-aware router: a :class:`pagedkv.KVIndexer` fed by the workers' event batches and load
reports, and a :mod:`routing policy <pagedkv.routing.policy>` that picks the worker."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv import KVCacheGroupSpec, KVIndexer
from pagedkv.block_identity import HashScheme, SequenceSpec
from pagedkv.errors import InvalidArgumentError
from pagedkv.routing.errors import NoWorkerError, UnknownWorkerError
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
        indexer: the block index (its :class:`pagedkv.HashScheme`, block size, hash algorithm
            and seed, must be the workers').
        policy: a routing policy (default :class:`KVAwarePolicy` with its default weights).

    Raises:
        InvalidArgumentError: ``indexer`` is not a :class:`pagedkv.KVIndexer` or ``policy`` has
            no callable ``choose``.

    Requests routed with a ``request_id`` count as cached on their worker until
    :meth:`finished` (or until the worker's own events report the blocks): their blocks are kept
    in a second index of predicted blocks, so requests sharing a prefix that arrive together
    follow each other before the first one's ``BlockStored`` events come back. A request's
    overlap on a worker is the larger of the confirmed and the predicted one. (NVIDIA Dynamo's
    router predicts routed blocks the same way.)

    Not thread-safe (the indexer itself is); one router per dispatch loop.
    """

    def __init__(self, indexer: KVIndexer, policy: RoutingPolicy | None = None) -> None:
        if not isinstance(indexer, KVIndexer):
            raise _bad_argument("indexer", indexer, "indexer must be a pagedkv.KVIndexer")
        if policy is not None and not callable(getattr(policy, "choose", None)):
            raise _bad_argument("policy", policy, "policy must be a routing policy (an object with a choose method)")
        self.indexer = indexer
        self.policy: RoutingPolicy = policy if policy is not None else KVAwarePolicy()
        self._loads: dict[int, WorkerLoad] = {}
        self.hash_scheme = HashScheme.of(indexer)
        self._predicted: KVIndexer = self.hash_scheme.indexer()
        self._predicted_seq: dict[int, int] = {}
        self._inflight: dict[str, tuple[int, list[bytes]]] = {}

    @property
    def workers(self) -> list[int]:
        """Live workers, sorted."""
        return sorted(self._loads)

    def add_worker(
        self,
        worker_id: int,
        *,
        hash_source: str = "engine",
        groups: Sequence[KVCacheGroupSpec | str] | None = None,
    ) -> int:
        """Registers a worker (idle, empty cache); returns the registration's incarnation number
        (see :meth:`apply_events`). ``groups``: the attention kinds of its KV cache groups in its
        engine's order (None: one full-attention group); only a full-attention group's blocks
        count toward its overlap (see :meth:`pagedkv.KVIndexer.add_worker`). Raises
        ``InvalidArgumentError`` if known or for bad ``groups``."""
        incarnation = self.indexer.add_worker(worker_id, hash_source=hash_source, groups=groups)
        self._predicted.remove_worker(worker_id)
        self._predicted.add_worker(worker_id)
        self._predicted_seq[worker_id] = 0
        self._loads[worker_id] = WorkerLoad()
        return incarnation

    def remove_worker(self, worker_id: int) -> bool:
        """Drops a dead worker: no more routing to it, its index entries cleared."""
        known = self._loads.pop(worker_id, None) is not None
        self._predicted.remove_worker(worker_id)
        self._predicted_seq.pop(worker_id, None)
        for rid in [r for r, (w, _) in self._inflight.items() if w == worker_id]:
            del self._inflight[rid]
        return self.indexer.remove_worker(worker_id) or known

    def _predict(self, worker_id: int, event: list[Any]) -> None:
        seq = self._predicted_seq[worker_id]
        self._predicted_seq[worker_id] = seq + 1
        self._predicted.apply(worker_id, seq, [event])

    def finished(self, request_id: str) -> bool:
        """Forgets the predicted blocks of a request routed with ``request_id`` (call it when
        the request is answered, or rerouted). False if it was not tracked."""
        entry = self._inflight.pop(request_id, None)
        if entry is None:
            return False
        worker, hashes = entry
        if worker in self._loads and hashes:
            self._predict(worker, ["BlockRemoved", hashes])
        return True

    def report_load(self, worker_id: int, load: WorkerLoad) -> None:
        """The worker's current load. Raises :class:`~pagedkv.routing.errors.UnknownWorkerError`
        (a ``KeyError``) for an unknown worker, ``InvalidArgumentError`` (a ``ValueError``) for
        a ``load`` that is not a :class:`WorkerLoad`."""
        self._check_known(worker_id)
        if not isinstance(load, WorkerLoad):
            raise _bad_argument("load", load, "expected a pagedkv.routing.WorkerLoad")
        self._loads[worker_id] = load

    def load(self, worker_id: int) -> WorkerLoad:
        """Last known load of a worker. Raises
        :class:`~pagedkv.routing.errors.UnknownWorkerError` (a ``KeyError``) if unknown."""
        self._check_known(worker_id)
        return self._loads[worker_id]

    def _check_known(self, worker_id: int) -> None:
        if worker_id not in self._loads:
            raise UnknownWorkerError(f"unknown worker {worker_id} (never added, or removed)", worker_id=worker_id)

    def apply_events(
        self,
        worker_id: int,
        seq: int,
        events: Iterable[Any],
        *,
        hash_root: bytes | None = None,
        incarnation: int | None = None,
    ) -> str:
        """Applies one numbered event batch of a live worker (see ``KVIndexer.apply``;
        ``hash_root`` is a wire batch's root, :attr:`pagedkv.routing.wire.EventBatch.hash_root`;
        ``incarnation`` the number :meth:`add_worker` returned for the registration the batch
        came from, None: the current one). A batch of a removed worker, or of an earlier
        incarnation of a re-added one, is ignored (``"stale"``). Raises
        ``InvalidArgumentError`` for a batch of another cache identity (nothing applied)."""
        if worker_id not in self._loads:
            return "stale"
        return self.indexer.apply(worker_id, seq, events, hash_root=hash_root, incarnation=incarnation)

    def route(
        self,
        token_ids: Any,
        *,
        spec: SequenceSpec | None = None,
        exclude: Iterable[int] = (),
        request_id: str | None = None,
    ) -> RoutingDecision:
        """Picks a worker for a prompt (token ids) whose blocks hash with ``spec``, the
        request's :class:`pagedkv.SequenceSpec` as its engine derives it (``None``: no keys;
        for a pagedkv engine ``LLMEngine.prompt_spec``, which carries the cache salt and the
        engine's own keys such as a length-dependent RoPE's), among the live workers not in
        ``exclude``; with a ``request_id`` its blocks count as predicted on that worker until
        :meth:`finished`. Raises :class:`~pagedkv.routing.errors.NoWorkerError` (a
        ``RuntimeError``) when no worker is left, ``InvalidArgumentError`` (a ``ValueError``) for
        a ``request_id`` already in flight, ``token_ids`` that are not a 1-D integer array or
        list of ints (token ids in ``0..2**32``), a ``spec`` that is not a ``SequenceSpec`` or an
        ``exclude`` that is not iterable; nothing changes then."""
        try:
            num_tokens = len(token_ids)
        except TypeError:
            raise _bad_argument("token_ids", token_ids, "expected a 1-D integer array or a list of ints") from None
        try:
            skip = set(exclude)
        except TypeError:
            raise _bad_argument("exclude", exclude, "expected an iterable of worker ids") from None
        workers = [w for w in sorted(self._loads) if w not in skip]
        if not workers:
            raise NoWorkerError(f"no live worker to route to (live: {sorted(self._loads)}, excluded: {sorted(skip)})")
        if request_id is not None and request_id in self._inflight:
            raise InvalidArgumentError(
                f"request {request_id!r} is already routed (call finished first)",
                arg="request_id",
                value=repr(request_id),
                reason="already routed and not finished",
            )
        num_blocks = max(num_tokens - 1, 0) // self.indexer.block_size
        hashes = self.indexer.block_hashes(token_ids, num_blocks=num_blocks, spec=spec)
        overlaps = self.indexer.overlap_hashes(hashes)
        if self._inflight:
            for w, n in self._predicted.overlap_hashes(hashes).items():
                overlaps[w] = max(overlaps.get(w, 0), n)
        w = self.policy.choose(workers, overlaps, num_blocks, self._loads)
        if request_id is not None:
            self._inflight[request_id] = (w, hashes)
            if hashes:
                self._predict(w, ["BlockStored", hashes, None, [], self.indexer.block_size])
        return RoutingDecision(w, overlaps.get(w, 0), num_blocks)


def _bad_argument(arg: str, value: Any, reason: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"invalid argument {arg} = {value!r}: {reason}", arg=arg, value=repr(value), reason=reason
    )
