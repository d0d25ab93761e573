"""pagedkv as the KV cache manager of vLLM's V1 scheduler.

Use it from the command line::

    vllm serve MODEL --scheduler-cls pagedkv.integrations.vllm.PagedKVScheduler

or from code, ``SchedulerConfig(scheduler_cls=PagedKVScheduler, ...)``. With async scheduling on
(vLLM's default on a GPU) that name builds :class:`PagedKVAsyncScheduler`, vLLM's
``AsyncScheduler`` with the same manager; with it off, the synchronous scheduler. The scheduler
is vLLM's own (same admission, chunked prefill, preemption and output handling); only its
``kv_cache_manager`` is replaced by :class:`PagedKVCacheManager` (built from the scheduler's
``KVCacheConfig`` as vLLM builds its own: one KV cache group of full attention, or several of
full attention, sliding window, chunked local), whose block pool, prefix cache (chained SHA-256
block hashes computed in Rust) and block tables are pagedkv's.

Needs the optional extra ``pagedkv[vllm]`` (vLLM 0.32 or 0.33, :data:`SUPPORTED_VLLM_RELEASES`);
without vLLM, importing it raises :class:`pagedkv.MissingDependencyError` naming that extra, and
building the scheduler under another release raises :class:`UnsupportedVllmVersionError`.
Configurations the adapter cannot serve exactly raise :class:`UnsupportedVllmConfigError`
naming the setting when the scheduler is built (see :func:`check_supported_config`).
"""

from __future__ import annotations

from pagedkv._optional import optional_imports

# Every module of the plug-in (this package's __init__ runs before any of them) needs vLLM.
with optional_imports("pagedkv.integrations.vllm", "vllm"):
    import vllm  # noqa: F401

    from pagedkv.integrations.vllm.blocks import PagedKVBlocks
    from pagedkv.integrations.vllm.config_check import check_supported_config
    from pagedkv.integrations.vllm.coordinator import CoordinatorView, GroupManagerView
    from pagedkv.integrations.vllm.decode_deferral import DecodeDeferral
    from pagedkv.integrations.vllm.errors import (
        UnsupportedVllmCallError,
        UnsupportedVllmConfigError,
        UnsupportedVllmVersionError,
        VllmStateMismatchError,
    )
    from pagedkv.integrations.vllm.events import to_vllm_events
    from pagedkv.integrations.vllm.kv_cache_manager import PagedKVCacheManager
    from pagedkv.integrations.vllm.scheduler import PagedKVAsyncScheduler, PagedKVScheduler, async_variant
    from pagedkv.integrations.vllm.versions import SUPPORTED_VLLM_RELEASES, check_supported_version

__all__ = [
    "SUPPORTED_VLLM_RELEASES",
    "CoordinatorView",
    "DecodeDeferral",
    "GroupManagerView",
    "PagedKVBlocks",
    "PagedKVAsyncScheduler",
    "PagedKVCacheManager",
    "PagedKVScheduler",
    "UnsupportedVllmCallError",
    "UnsupportedVllmConfigError",
    "UnsupportedVllmVersionError",
    "VllmStateMismatchError",
    "async_variant",
    "check_supported_config",
    "check_supported_version",
    "to_vllm_events",
]
