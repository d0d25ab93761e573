"""Request lifecycle: the engine's live requests, their sequences in the KV cache manager, and
the aborts that keep both consistent after a failure.

A request lives from :meth:`RequestRegistry.add` until :meth:`RequestRegistry.finish` (served)
or :meth:`RequestRegistry.abort` (dropped without an output). Every sequence id it ever had is
recorded before the manager learns it, so an abort frees whatever the manager still holds.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

from pagedkv.block_identity import SequenceSpec

from .beam_search import BeamSearch
from .errors import InvalidRequestError
from .manager_protocol import EngineKVManager
from .prompts import PreparedRequest
from .request import Request, Sequence
from .sampling import make_generator
from .scheduler import Scheduler

__all__ = ["RequestRegistry"]


class RequestRegistry:
    """Live requests by id (see the module docs).

    Args:
        manager: the KV cache manager the sequences are registered in.
        scheduler: the queues the requests wait and run in.
        seed: engine seed; a request without a seed draws its own from it.
    """

    def __init__(self, manager: EngineKVManager, scheduler: Scheduler, seed: int) -> None:
        self.manager = manager
        self.scheduler = scheduler
        self._live: dict[str, Request] = {}
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._arrivals = itertools.count()
        self._seq_ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        """The live requests, in the order they were added."""
        return iter(list(self._live.values()))

    def get(self, request_id: str) -> Request | None:
        """The live request ``request_id``, or ``None``."""
        return self._live.get(request_id)

    def check_id(self, request_id: str | None) -> None:
        """Raises InvalidRequestError when ``request_id`` belongs to a live request."""
        if request_id is not None and request_id in self._live:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")

    def check(self, prepared: PreparedRequest) -> PreparedRequest:
        """``prepared``, after the checks that need engine state: its id is free and it can
        ever fit (:meth:`Scheduler.check_fits`). Changes no state.

        Raises:
            InvalidRequestError: the id is in use. RequestTooLargeError: it can never fit.
        """
        self.check_id(prepared.request_id)
        self.scheduler.check_fits(len(prepared.token_ids), prepared.params)
        return prepared

    def add(
        self,
        prepared: PreparedRequest,
        beam: BeamSearch | None,
        spec: SequenceSpec,
    ) -> str:
        """Register a prepared request's first sequence with the manager (its prefix hashes
        mix in ``spec``, the request's :class:`pagedkv.SequenceSpec`) and queue it. Returns its
        id (default: the arrival number).

        Raises:
            InvalidRequestError: the id is already in use (nothing registered).
        """
        params, ids = prepared.params, prepared.token_ids
        arrival = next(self._arrivals)
        rid = prepared.request_id if prepared.request_id is not None else str(arrival)
        self.check_id(rid)
        seed = (
            params.seed
            if params.seed is not None
            else int(torch.randint(0, 2**31 - 1, (1,), generator=self._seed_rng).item())
        )
        req = Request(rid, prepared.text, ids, params, arrival, time.perf_counter(), seed, beam=beam)
        first = self.new_sequence(req, ids, 0)
        self.manager.add_sequence(first.seq_id, ids, spec=spec)
        req.seqs.append(first)
        self._live[rid] = req
        self.scheduler.add(req)
        return rid

    def new_sequence(self, req: Request, tokens: list[int], index: int) -> Sequence:
        """A new sequence of ``req`` holding ``tokens`` (not yet registered in the manager;
        its id is recorded in ``req.seq_ids`` first, for :meth:`abort`)."""
        gen = None if req.params.greedy else make_generator(req.seed, index)
        seq = Sequence(next(self._seq_ids), list(tokens), len(req.prompt_token_ids), sample_index=index, generator=gen)
        req.seq_ids.append(seq.seq_id)
        return seq

    def fork(self, req: Request, parent: Sequence, index: int) -> Sequence:
        """A child of ``parent`` sharing its blocks (manager fork; copy-on-write on the first
        divergent write). The child inherits the parent's pending tokens."""
        child = self.new_sequence(req, parent.token_ids, index)
        child.pending = list(parent.pending)
        self.manager.fork(parent.seq_id, child.seq_id)
        return child

    def finish(self, req: Request) -> None:
        """Take a request whose sequences are all freed off the queues and the registry."""
        self.scheduler.finish(req)
        self._live.pop(req.request_id, None)

    def abort(self, req: Request) -> None:
        """Drop ``req`` without an output: free every sequence the manager still holds for it
        and take it off the queues. Safe in any state (mid-fork, mid-beam-step, swapped...)."""
        for seq_id in req.seq_ids:
            self.manager.free(seq_id)  # idempotent: False for a sequence already freed
        req.seqs = []
        self.finish(req)

    def recover_from_failed_step(self, exc: BaseException, lost: list[str]) -> None:
        """Make the engine usable after a step failed with ``exc`` (see
        :meth:`pagedkv.engine.LLMEngine.step`): abort every request holding KV, drop the prefix
        cache (no block of the failed step may be hit later) and note on ``exc`` the requests
        dropped (``lost``: those that finished within the failed step)."""
        aborted = self.abort_holding_kv()
        if self.scheduler.prefix_caching:
            self.manager.reset_prefix_cache()  # legal now: no block is referenced
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(
                f"pagedkv engine: the step failed; aborted requests {aborted}"
                + (f" and the outputs of requests {lost} finished in it" if lost else "")
                + " (KV freed, prefix cache dropped); the engine remains usable"
            )

    def abort_holding_kv(self) -> list[str]:
        """Abort every request that holds KV anywhere (device or swap blocks, or computed
        tokens); requests waiting with none stay queued. Returns the aborted ids."""
        aborted = []
        for req in self:
            if not self._holds_no_kv(req):
                self.abort(req)
                aborted.append(req.request_id)
        return aborted

    def _holds_no_kv(self, req: Request) -> bool:
        """True for a request queued with no KV: waiting, and the manager counts neither a
        computed token nor a block (device or swap) for any of its sequences."""
        return req in self.scheduler.waiting and all(
            self.manager.num_computed_tokens(s.seq_id) == 0 and self._num_blocks(s.seq_id) == 0 for s in req.seqs
        )

    def _num_blocks(self, seq_id: int) -> int:
        """Blocks (device or swap) the manager holds for ``seq_id``, over every KV cache group."""
        return sum(self.manager.num_blocks_held(seq_id))
