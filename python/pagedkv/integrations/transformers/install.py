"""Installing pagedkv as the KV cache of transformers' continuous batching, and taking it out.

:func:`install` checks the transformers release (and the model's layer types when given one),
then patches two names of transformers' continuous batching: the full- and sliding-attention
entries of ``cache.ATTN_TYPE_TO_ALLOCATOR`` (pagedkv's allocator subclasses) and the
``PagedAttentionCache`` that ``continuous_api`` builds (:class:`PagedKVAttentionCache`). Every
check runs before the first patch, so a refused install changes nothing. :func:`uninstall`
puts transformers' own objects back; :func:`use_pagedkv` is the pair as a context manager.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pagedkv
from pagedkv.errors import InvalidArgumentError
from pagedkv.integrations.transformers.errors import AlreadyInstalledError
from pagedkv.integrations.transformers.layer_types import check_layer_types
from pagedkv.integrations.transformers.versions import check_supported_version

if TYPE_CHECKING:
    from pagedkv.integrations.transformers.cache import PagedKVAttentionCache

__all__ = ["Installation", "install", "is_installed", "register_cache", "uninstall", "use_pagedkv"]


class Installation:
    """The handle :func:`install` returns: which caches were built while installed.

    Attributes:
        release: the transformers ``major.minor`` release installed into.
        managers: the pagedkv manager of every cache built while installed, oldest first (a
            ``generate_batch`` call builds one; the managers hold no tensors).
    """

    def __init__(self, release: str, model: Any) -> None:
        self.release = release
        self.managers: list[pagedkv.KVCacheManager] = []
        self._model = model

    @property
    def manager(self) -> pagedkv.KVCacheManager:
        """The manager of the latest cache built while installed.

        Raises:
            LookupError: no cache was built yet.
        """
        if not self.managers:
            raise LookupError("no continuous-batching cache was built while pagedkv was installed")
        return self.managers[-1]

    def stats(self) -> pagedkv.CacheStats:
        """``stats()`` of :attr:`manager` (prefix hits, preemptions, blocks in use...)."""
        return self.manager.stats()


_lock = threading.Lock()
_current: Installation | None = None
_saved: dict[str, Any] = {}


def _modules() -> tuple[Any, Any]:
    from transformers.generation.continuous_batching import cache as cache_module
    from transformers.generation.continuous_batching import continuous_api

    return cache_module, continuous_api


def is_installed() -> bool:
    """Whether pagedkv is installed as continuous batching's KV cache."""
    return _current is not None


def _not_a_model(model: Any, missing: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"install(model) needs a transformers model with continuous batching (a PreTrainedModel); "
        f"got {type(model).__name__}, which has no {missing}",
        arg="model",
        value=type(model).__name__,
        reason=f"no {missing}",
    )


def _text_config(model: Any) -> Any:
    """``model.config.get_text_config()``, or :class:`InvalidArgumentError` for a non-model."""
    get_text_config = getattr(getattr(model, "config", None), "get_text_config", None)
    if not callable(get_text_config):
        raise _not_a_model(model, "config.get_text_config()")
    return get_text_config()


def install(model: Any = None) -> Installation:
    """Install pagedkv as the KV cache of transformers' continuous batching (every model's,
    process-wide) until :func:`uninstall`.

    Args:
        model: optional model to check (its text config's ``layer_types``) and to drop a cached
            continuous-batching manager from (``persistent_manager=True`` keeps one, built with
            the stock cache).

    Returns:
        The :class:`Installation` handle (pagedkv's managers and stats).

    Raises:
        UnsupportedTransformersVersionError: the installed transformers is not supported.
        UnsupportedAttentionTypeError: ``model`` has a layer type pagedkv does not serve.
        InvalidArgumentError: ``model`` is not a transformers model (no ``config.get_text_config()``
            or no ``destroy_cached_continuous_batching_manager()``).
        AlreadyInstalledError: already installed.
        Nothing is patched when any of them is raised.
    """
    global _current
    release = check_supported_version()
    if model is not None:
        check_layer_types(_text_config(model))
        if not callable(getattr(model, "destroy_cached_continuous_batching_manager", None)):
            raise _not_a_model(model, "destroy_cached_continuous_batching_manager()")
    from pagedkv.integrations.transformers.cache import (
        PagedKVAttentionCache,
        PagedKVFullAttentionAllocator,
        PagedKVSlidingAttentionAllocator,
    )

    cache_module, continuous_api = _modules()
    from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION, SLIDING_ATTENTION

    with _lock:
        if _current is not None:
            raise AlreadyInstalledError(
                "pagedkv is already installed as transformers' continuous-batching KV cache; uninstall() first",
                installed_by=f"install() under transformers {_current.release}",
            )
        if model is not None:
            model.destroy_cached_continuous_batching_manager()
        table = cache_module.ATTN_TYPE_TO_ALLOCATOR
        _saved.update(
            full=table[FULL_ATTENTION],
            sliding=table[SLIDING_ATTENTION],
            cache=continuous_api.PagedAttentionCache,
        )
        table[FULL_ATTENTION] = PagedKVFullAttentionAllocator
        table[SLIDING_ATTENTION] = PagedKVSlidingAttentionAllocator
        continuous_api.PagedAttentionCache = PagedKVAttentionCache
        _current = Installation(release, model)
        return _current


def uninstall() -> None:
    """Put transformers' own KV cache back (a no-op when not installed). A model given to
    :func:`install` loses its cached continuous-batching manager (it holds a pagedkv cache); a
    manager kept with ``persistent_manager=True`` by a model not given to :func:`install` keeps
    its pagedkv cache until ``model.destroy_cached_continuous_batching_manager()``."""
    global _current
    with _lock:
        if _current is None:
            return
        cache_module, continuous_api = _modules()
        from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION, SLIDING_ATTENTION

        table = cache_module.ATTN_TYPE_TO_ALLOCATOR
        table[FULL_ATTENTION] = _saved.pop("full")
        table[SLIDING_ATTENTION] = _saved.pop("sliding")
        continuous_api.PagedAttentionCache = _saved.pop("cache")
        model, _current = _current._model, None
    if model is not None:
        model.destroy_cached_continuous_batching_manager()


@contextmanager
def use_pagedkv(model: Any = None) -> Iterator[Installation]:
    """``with use_pagedkv(model) as kv: model.generate_batch(...)``: :func:`install` on entry,
    :func:`uninstall` on exit (also when the body raises). Same arguments and errors as
    :func:`install`."""
    handle = install(model)
    try:
        yield handle
    finally:
        uninstall()


def register_cache(cache: PagedKVAttentionCache) -> None:
    """Record a cache built while installed (called by :class:`PagedKVAttentionCache`)."""
    with _lock:
        if _current is not None:
            _current.managers.append(cache.manager)
