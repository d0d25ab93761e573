"""``PagedKVScheduler``: vLLM's V1 ``Scheduler`` with pagedkv as its KV cache manager.

Usable wherever vLLM takes a scheduler class::

    vllm serve MODEL --scheduler-cls pagedkv.integrations.vllm.PagedKVScheduler

It keeps the scheduling mode vLLM chose: with ``scheduler_config.async_scheduling`` on (vLLM's
default on a GPU) constructing ``PagedKVScheduler`` builds a :class:`PagedKVAsyncScheduler`
(vLLM's ``AsyncScheduler`` with the same KV cache manager), so the next step is scheduled while
the forward pass of the previous one runs; with it off, the synchronous scheduler.

Scheduling decisions (admission, chunked prefill, preemption order, stop handling, outputs) are
vLLM's own code; the KV cache calls go to :class:`PagedKVCacheManager`. Two changes on top:

- batched decode: vLLM's running loop still calls ``allocate_slots(request, 1)`` once per
  decoding request, but each such call is answered in Python without calling into Rust: a
  decode inside pagedkv's tail block that does not fill it returns the shared empty result
  after two integer comparisons (pagedkv gets its token later), and one that fills or opens a
  block (counted against the pool's free blocks) is deferred; the deferred decodes are allocated
  together in one call (``PagedKVCacheManager.flush_decodes``) before anything else reads or
  changes pagedkv, at the latest when ``schedule`` returns. A decode that needs a block when
  none is left takes the per-request path, so preemption happens exactly where stock vLLM
  preempts. With sliding-window or chunked-local groups every plain decode is deferred (each
  can move a window) and allocated in the same one call; one opening a block takes one in
  every group.
- no double hashing: pagedkv hashes blocks in Rust as it caches them, so by default the
  request's Python block hasher is dropped when a request is added (vLLM's engine core has
  already hashed the prompt; output blocks are no longer hashed in Python in
  ``update_from_output``). With a KV connector configured they are kept (connectors key their
  transfers and stores by ``request.block_hashes``); set ``keep_vllm_block_hashes = True`` on a
  subclass to keep them otherwise.
- KV connectors (``kv_transfer_config``, see :mod:`pagedkv.integrations.vllm.connectors` for
  which): the connector vLLM bound to its own manager is bound again to pagedkv's; a failed
  load's invalid blocks roll pagedkv's computed count back with vLLM's
  (``_update_requests_with_invalid_blocks``), as does the rewind of a fully loaded prompt
  (``_update_waiting_for_remote_kv``); transfer reports that match no request waiting for its
  KV or finished are dropped with a warning (``_update_from_kv_xfer_finished``; stock vLLM
  asserts).

A vLLM release outside 0.32 / 0.33 raises ``UnsupportedVllmVersionError`` and unsupported
configurations raise ``UnsupportedVllmConfigError`` from ``__init__``, before vLLM's scheduler
is built (see :func:`check_supported_version`, :func:`check_supported_config`); streaming-input (resumable) requests
raise ``InvalidArgumentError`` from ``add_request``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from pagedkv.errors import InvalidArgumentError
from pagedkv.integrations.vllm.config_check import check_supported_config
from pagedkv.integrations.vllm.connectors import check_built_connector
from pagedkv.integrations.vllm.kv_cache_manager import PagedKVCacheManager
from pagedkv.integrations.vllm.versions import check_supported_version

__all__ = ["PagedKVAsyncScheduler", "PagedKVScheduler", "async_variant"]

logger = logging.getLogger(__name__)

_BASE_INIT = inspect.signature(Scheduler.__init__)
# Subclass of PagedKVScheduler -> its AsyncScheduler variant (built once per class).
_ASYNC_VARIANTS: dict[type, type] = {}


class PagedKVScheduler(Scheduler):  # type: ignore[misc, unused-ignore]
    """vLLM V1 ``Scheduler`` whose ``kv_cache_manager`` is a :class:`PagedKVCacheManager` (one KV
    cache group of full attention, or several groups of full attention, sliding window, chunked
    local, or Mamba in vLLM's align or none cache mode beside full attention), built from the
    scheduler's ``KVCacheConfig`` as vLLM builds its own manager. With align-mode Mamba groups
    it is the commit fence's caller: a step's aligned states are published
    in pagedkv when vLLM reports the step (:meth:`update_from_output`).

    Takes exactly the constructor arguments of ``vllm.v1.core.sched.scheduler.Scheduler``.
    Raises ``pagedkv.integrations.vllm.UnsupportedVllmVersionError`` (a ``ValueError``) under a
    vLLM release other than 0.32 / 0.33, and ``UnsupportedVllmConfigError`` (a ``ValueError``)
    naming the first unsupported setting, before anything is built.

    With ``vllm_config.scheduler_config.async_scheduling`` true, ``PagedKVScheduler(...)`` (and
    any subclass that is not already an ``AsyncScheduler``) returns an instance of its async
    variant (:func:`async_variant`; :class:`PagedKVAsyncScheduler` for this class), so the
    one ``--scheduler-cls`` name serves both modes.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if not issubclass(cls, AsyncScheduler):
            bound = _BASE_INIT.bind(None, *args, **kwargs)
            if getattr(bound.arguments["vllm_config"].scheduler_config, "async_scheduling", False):
                cls = async_variant(cls)
        return super().__new__(cls)

    #: Keep vLLM's Python block hashes growing on output tokens (off: pagedkv hashes in Rust).
    keep_vllm_block_hashes: bool = False
    #: Allocate decode slots of running requests in one batched call per step.
    batch_decode: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_supported_version()
        bound = _BASE_INIT.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        check_supported_config(a["vllm_config"], a["kv_cache_config"], a["block_size"], a.get("hash_block_size"))
        super().__init__(*args, **kwargs)
        # Replaces the stock manager vLLM built (it held no request yet), built as vLLM builds
        # its own, from the same arguments.
        self.kv_cache_manager: Any = PagedKVCacheManager(
            kv_cache_config=self.kv_cache_config,
            max_model_len=self.max_model_len,
            scheduler_block_size=self.block_size,
            hash_block_size=getattr(self, "hash_block_size", None),
            max_in_flight_tokens=getattr(self.vllm_config, "max_in_flight_tokens", None),
            enable_caching=bool(self.cache_config.enable_prefix_caching),
            use_eagle=getattr(self, "use_eagle_block_drop", False),
            num_hash_lookahead_tokens=getattr(self, "num_hash_lookahead_tokens", 0),
            num_prefill_lookahead=getattr(self, "num_prefill_lookahead", 0),
            log_stats=self.log_stats,
            enable_kv_cache_events=self.enable_kv_cache_events,
            dcp_world_size=getattr(self, "dcp_world_size", 1),
            metrics_collector=getattr(self, "kv_metrics_collector", None),
            watermark=self.scheduler_config.watermark,
            hash_algo=self.cache_config.prefix_caching_hash_algo,
        )
        self.kv_cache_manager.defer_decodes = self.batch_decode
        # Mamba (state) groups: id(scheduler output) -> (it, request id -> end after the step,
        # request id -> its holding, the step's number), committed when vLLM reports the step
        # (the commit fence).
        self._step_ends: dict[int, tuple[Any, dict[str, int], dict[str, int], int]] = {}
        # Slots past a request's known tokens are output placeholders (see the module docs).
        self.kv_cache_manager.async_scheduling = isinstance(self, AsyncScheduler)
        if self.connector is not None:
            check_built_connector(self.connector)
            # vLLM bound the connector to the manager it built first: bind it to this one.
            self.connector.bind_kv_cache_manager(self.kv_cache_manager)

    def add_request(self, request: Any) -> None:
        """Queues ``request`` (vLLM's ``add_request``). Raises ``InvalidArgumentError`` for a
        streaming-input session (its tokens can be rewritten, pagedkv's only grow)."""
        if getattr(request, "resumable", False):
            raise InvalidArgumentError(
                f"request {request.request_id!r} is a streaming-input session "
                "(resumable=True), which PagedKVScheduler does not support",
                arg="request.resumable",
                value="True",
                reason="streaming-input sessions rewrite tokens",
            )
        if not self.keep_vllm_block_hashes and self.connector is None:
            # A KV connector keys its transfers and stores by request.block_hashes: kept then.
            request._block_hasher = None
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``schedule``; the decodes it deferred are in pagedkv when it returns. With
        Mamba (state) groups, each scheduled request's end position after the step is kept
        for the commit fence (:meth:`update_from_output`)."""
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self.kv_cache_manager.flush_decodes()
        if self.kv_cache_manager._state_groups:
            requests = self.requests
            ends = {rid: requests[rid].num_computed_tokens for rid in out.num_scheduled_tokens if rid in requests}
            kvm = self.kv_cache_manager
            self._step_ends[id(out)] = (out, ends, kvm.step_holdings(ends), kvm.step_no)
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """vLLM's ``update_from_output``. With Mamba (state) groups the step has completed, so
        first the commit fence: the states it wrote at block-aligned ends are published in
        pagedkv's prefix cache (``PagedKVCacheManager.commit_steps``), before vLLM may free
        a request it finished (a state freed before its commit is never published)."""
        # getattr: vLLM's own tests build schedulers field by field, without __init__.
        steps = getattr(self, "_step_ends", None)
        entry = steps.pop(id(scheduler_output), None) if steps else None
        if entry is not None:
            self.kv_cache_manager.commit_steps(entry[1], entry[2], entry[3])
        return super().update_from_output(scheduler_output, model_runner_output)

    # ---- KV connectors ---------------------------------------------------------------------

    def _update_requests_with_invalid_blocks(
        self, requests: Any, invalid_block_ids: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """vLLM's truncation of the requests a failed load left with invalid blocks; pagedkv's
        computed count of each running one follows vLLM's, its blocks from the first invalid
        one on leaving the prefix cache with their dependents (under both failure policies:
        their KV was never written). Loading requests are settled when their load ends."""
        affected, num_tokens, to_evict = super()._update_requests_with_invalid_blocks(
            requests, invalid_block_ids, *args, **kwargs
        )
        for rid in affected:
            request = self.requests.get(rid)
            if request is not None:
                self.kv_cache_manager.sync_computed(request, poisoned=True)
        return affected, num_tokens, to_evict

    def _update_waiting_for_remote_kv(self, request: Any) -> None:
        """vLLM's promotion of a request whose async load ended (``cache_blocks`` commits the
        load in pagedkv), then pagedkv's computed count follows vLLM's rewind of a fully loaded
        prompt to its last token."""
        super()._update_waiting_for_remote_kv(request)
        if getattr(request, "replay_start", 0) and self.prefix_replay_tokens:
            # vLLM rewound the count over the loaded hit's last window, recomputed for the
            # groups out of the prefix cache: pagedkv keeps the hit computed (its slots exist).
            self.kv_cache_manager.begin_replay(request)
        else:
            self.kv_cache_manager.sync_computed(request, poisoned=False)

    def _update_from_kv_xfer_finished(self, kv_connector_output: Any) -> None:
        """vLLM's handling of finished transfers, after dropping (with a warning) the reports it
        cannot match: a ``finished_recving`` for a request the scheduler does not have, or for
        one neither waiting for its KV nor finished (a load never matched), and a
        ``finished_sending`` for an unknown or unfinished request. Stock vLLM asserts on them;
        here they change nothing."""
        from vllm.v1.request import RequestStatus

        recving = kv_connector_output.finished_recving
        sending = kv_connector_output.finished_sending
        bad_recv = {
            rid
            for rid in recving or ()
            if rid not in self.requests
            or not (
                self.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS or self.requests[rid].is_finished()
            )
        }
        bad_send = {rid for rid in sending or () if rid not in self.requests or not self.requests[rid].is_finished()}
        if bad_recv or bad_send:
            logger.warning(
                "dropped KV transfer reports no request matches: finished_recving %s, finished_sending %s",
                sorted(bad_recv),
                sorted(bad_send),
            )
            kv_connector_output = dataclasses.replace(
                kv_connector_output,
                finished_recving=(set(recving) - bad_recv) or None if recving else recving,
                finished_sending=(set(sending) - bad_send) or None if sending else sending,
            )
        super()._update_from_kv_xfer_finished(kv_connector_output)


class PagedKVAsyncScheduler(PagedKVScheduler, AsyncScheduler):  # type: ignore[misc, unused-ignore]
    """vLLM's ``AsyncScheduler`` (async scheduling: step N+1 is scheduled while step N runs)
    with pagedkv as its KV cache manager; what ``PagedKVScheduler(...)`` builds when
    ``scheduler_config.async_scheduling`` is on. Same constructor arguments and errors as
    :class:`PagedKVScheduler`.

    A running request is scheduled again before the token ids of its step in flight are known
    (vLLM's output placeholders). pagedkv holds only known tokens: the slots of tokens whose
    ids are still unknown lie in blocks pagedkv already holds for the request, or in lookahead
    blocks taken for them (never hashed); the tokens are appended, marked computed and their
    full blocks cached once vLLM reports them (the request's next allocation, or
    ``cache_blocks`` from ``update_from_output``). Blocks are released as stock vLLM releases
    them (the GPU stream orders an in-flight step's writes before the next step's).
    """


_ASYNC_VARIANTS[PagedKVScheduler] = PagedKVAsyncScheduler


def async_variant(cls: type) -> type:
    """The ``AsyncScheduler`` variant of ``cls`` (``PagedKVScheduler`` or a subclass): ``cls``
    itself when it already is one, else a subclass of ``(cls, AsyncScheduler)`` built once and
    reused. Raises ``InvalidArgumentError`` for a class that is no ``PagedKVScheduler``."""
    if not (isinstance(cls, type) and issubclass(cls, PagedKVScheduler)):
        raise InvalidArgumentError(
            f"{cls!r} is not a PagedKVScheduler subclass",
            arg="cls",
            value=repr(cls),
            reason="must subclass PagedKVScheduler",
        )
    if issubclass(cls, AsyncScheduler):
        return cls
    variant = _ASYNC_VARIANTS.get(cls)
    if variant is None:
        variant = type(f"{cls.__name__}Async", (cls, AsyncScheduler), {"__module__": cls.__module__})
        _ASYNC_VARIANTS[cls] = variant
    return variant
