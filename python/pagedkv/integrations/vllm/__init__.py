"""pagedkv as the KV cache manager of vLLM's V1 scheduler.

Use it from the command line::

    vllm serve MODEL --scheduler-cls pagedkv.integrations.vllm.PagedKVScheduler

or from code, ``SchedulerConfig(scheduler_cls=PagedKVScheduler, ...)``. The scheduler is vLLM's
own (same admission, chunked prefill, preemption and output handling); only its
``kv_cache_manager`` is replaced by :class:`PagedKVCacheManager`, whose block pool, prefix
cache (chained SHA-256 block hashes computed in Rust) and block tables are pagedkv's.

Needs the optional extra ``pagedkv[vllm]`` (the vLLM release range in ``pyproject.toml``); without
vLLM, importing it raises :class:`pagedkv.MissingDependencyError` naming that extra.
Configurations the adapter cannot serve exactly raise :class:`UnsupportedVllmConfigError`
naming the setting when the scheduler is built (see :func:`check_supported_config`).
"""

from __future__ import annotations

from pagedkv._optional import optional_imports

# Every module of the plug-in (this package's __init__ runs before any of them) needs vLLM.
with optional_imports("pagedkv.integrations.vllm", "vllm"):
    import vllm  # noqa: F401

    from pagedkv.integrations.vllm.config_check import (
        UnsupportedVllmConfigError,
        check_supported_config,
    )
    from pagedkv.integrations.vllm.events import to_vllm_events
    from pagedkv.integrations.vllm.kv_cache_manager import PagedKVBlocks, PagedKVCacheManager
    from pagedkv.integrations.vllm.scheduler import PagedKVScheduler

__all__ = [
    "PagedKVBlocks",
    "PagedKVCacheManager",
    "PagedKVScheduler",
    "UnsupportedVllmConfigError",
    "check_supported_config",
    "to_vllm_events",
]
