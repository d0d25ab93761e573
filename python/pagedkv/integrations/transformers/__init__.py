"""pagedkv as the KV cache of Hugging Face transformers' continuous batching.

::

    from pagedkv.integrations.transformers import use_pagedkv

    with use_pagedkv(model) as kv:
        outputs = model.generate_batch(prompt_ids, generation_config=gen_config)
    kv.stats().prefix_hits_tokens

or :func:`install` / :func:`uninstall`. While installed, every continuous-batching cache
transformers builds (``generate_batch``, ``init_continuous_batching`` /
``continuous_batching_context_manager`` for streaming) is a :class:`PagedKVAttentionCache`: one
:class:`pagedkv.KVCacheManager` for all of the model's attention groups (full attention,
sliding window) decides every block; transformers keeps its memory sizing, cache tensor,
scheduler and attention. Supported releases: :data:`SUPPORTED_TRANSFORMERS_RELEASES`, others are
refused by name. docs/design.md, "transformers seam".

Importing this package does not import transformers (an unsupported release is refused by
:func:`install`, by name); the cache classes import it on first use.
"""

from __future__ import annotations

from typing import Any

from pagedkv.integrations.transformers.errors import (
    AlreadyInstalledError,
    CacheStateMismatchError,
    CacheTooSmallError,
    UnsupportedAttentionTypeError,
    UnsupportedTransformersConfigError,
    UnsupportedTransformersVersionError,
)
from pagedkv.integrations.transformers.install import Installation, install, is_installed, uninstall, use_pagedkv
from pagedkv.integrations.transformers.layer_types import SERVED_LAYER_TYPES, check_layer_types
from pagedkv.integrations.transformers.versions import SUPPORTED_TRANSFORMERS_RELEASES, check_supported_version

__all__ = [
    "SERVED_LAYER_TYPES",
    "SUPPORTED_TRANSFORMERS_RELEASES",
    "AlreadyInstalledError",
    "CacheStateMismatchError",
    "CacheTooSmallError",
    "Installation",
    "PagedKVAttentionCache",
    "PagedKVFullAttentionAllocator",
    "PagedKVSlidingAttentionAllocator",
    "UnsupportedAttentionTypeError",
    "UnsupportedTransformersConfigError",
    "UnsupportedTransformersVersionError",
    "check_layer_types",
    "check_supported_version",
    "install",
    "is_installed",
    "uninstall",
    "use_pagedkv",
]

_CACHE_NAMES = ("PagedKVAttentionCache", "PagedKVFullAttentionAllocator", "PagedKVSlidingAttentionAllocator")


def __getattr__(name: str) -> Any:
    """The cache classes, imported (with transformers) on first access."""
    if name in _CACHE_NAMES:
        from pagedkv.integrations.transformers import cache

        return getattr(cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
