"""``PagedKVScheduler``: vLLM's V1 ``Scheduler`` with pagedkv as its KV cache manager.

Usable wherever vLLM takes a scheduler class::

    vllm serve MODEL --scheduler-cls pagedkv.integrations.vllm.PagedKVScheduler

Scheduling decisions (admission, chunked prefill, preemption order, stop handling, outputs) are
vLLM's own code; the KV cache calls go to :class:`PagedKVCacheManager`. Two changes on top:

- batched decode: before vLLM's running loop, the longest prefix of running requests that the
  loop will certainly give exactly one token each is allocated in one call into Rust
  (``PagedKVCacheManager.prepare_decodes``); the loop's per-request ``allocate_slots``
  calls then return those results. The first request that does not fit and everything after
  it take vLLM's normal path, so preemption happens exactly where stock vLLM preempts.
- no double hashing: pagedkv hashes blocks in Rust as it caches them, so by default the
  request's Python block hasher is dropped when a request is added (vLLM's engine core has
  already hashed the prompt; output blocks are no longer hashed in Python in
  ``update_from_output``). Set ``keep_vllm_block_hashes = True`` on a subclass to keep
  ``request.block_hashes`` growing (nothing in the supported configurations reads them).

Unsupported configurations raise ``UnsupportedVllmConfigError`` from ``__init__`` before vLLM's
scheduler is built (see :func:`check_supported_config`); streaming-input (resumable) requests
raise ``InvalidArgumentError`` from ``add_request``.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from pagedkv.errors import InvalidArgumentError
from pagedkv.integrations.vllm.config_check import check_supported_config
from pagedkv.integrations.vllm.kv_cache_manager import PagedKVCacheManager

__all__ = ["PagedKVScheduler"]

_BASE_INIT = inspect.signature(Scheduler.__init__)


class PagedKVScheduler(Scheduler):  # type: ignore[misc, unused-ignore]
    """vLLM V1 ``Scheduler`` whose ``kv_cache_manager`` is a :class:`PagedKVCacheManager`.

    Takes exactly the constructor arguments of ``vllm.v1.core.sched.scheduler.Scheduler``.
    Raises ``pagedkv.integrations.vllm.UnsupportedVllmConfigError`` (a ``ValueError``) naming
    the first unsupported setting, before anything is built.
    """

    #: Keep vLLM's Python block hashes growing on output tokens (off: pagedkv hashes in Rust).
    keep_vllm_block_hashes: bool = False
    #: Allocate decode slots of running requests in one batched call per step.
    batch_decode: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _BASE_INIT.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        check_supported_config(a["vllm_config"], a["kv_cache_config"], a["block_size"], a.get("hash_block_size"))
        super().__init__(*args, **kwargs)
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

        spec = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        # Replaces the stock manager vLLM built (it held no request yet).
        self.kv_cache_manager: Any = PagedKVCacheManager(
            self.kv_cache_config.num_blocks,
            self.block_size,
            enable_caching=bool(self.cache_config.enable_prefix_caching),
            hash_algo=self.cache_config.prefix_caching_hash_algo,
            log_stats=self.log_stats,
            enable_kv_cache_events=self.enable_kv_cache_events,
            watermark=self.scheduler_config.watermark,
            spec_kind=get_kv_cache_spec_kind(spec).value,
        )
        self._num_sampled = self.num_sampled_tokens_per_step

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
        if not self.keep_vllm_block_hashes:
            request._block_hasher = None
        super().add_request(request)

    def _prepare_decodes(self) -> None:
        """Allocates, in one call, the decode slots of the longest prefix of ``self.running``
        that vLLM's running loop will schedule with exactly one token each and no other KV call
        in between (this mirrors the loop's skip and cap conditions for the synchronous
        scheduler: one known uncomputed token, no draft tokens or output placeholders, eligible
        this step, below ``max_model_len``, within the token budgets)."""
        from vllm.v1.core.sched.interface import PauseState

        if self._pause_state == PauseState.PAUSED_ALL:
            return
        budget = min(self.max_num_scheduled_tokens, self.scheduler_config.max_num_batched_tokens)
        step = self.current_step + 1
        limit = self.max_model_len - self._num_sampled
        manager = self.kv_cache_manager
        seq_of = manager._seq_of
        known = manager._num_known
        ec = self.ec_connector is not None
        rids: list[str] = []
        seqs: list[int] = []
        tokens: list[int] = []
        lens: list[int] = []
        for request in self.running[:budget]:
            all_tokens = request._all_token_ids
            n = len(all_tokens)
            rid = request.request_id
            if (
                request.num_computed_tokens != n - 1
                or known.get(rid) != n - 1
                or n - 1 >= limit
                or request.spec_token_ids
                or request.num_output_placeholders
                or step < request.next_decode_eligible_step
                or (ec and request.mm_features)
            ):
                break
            rids.append(rid)
            seqs.append(seq_of[rid])
            tokens.append(all_tokens[-1])
            lens.append(n)
        if rids:
            manager.prepare_decodes(rids, seqs, tokens, lens)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``schedule``, with the running decodes' slots allocated in one batch first."""
        manager = self.kv_cache_manager
        if self.batch_decode and self.running:
            self._prepare_decodes()
        try:
            out = super().schedule(*args, **kwargs)
        except BaseException:
            manager.take_unused_prepared()
            raise
        unused = manager.take_unused_prepared()
        if unused:
            raise RuntimeError(f"batched decode allocated slots the scheduler did not use: {unused}")
        return out
