"""Errors of the transformers integration, each a :class:`pagedkv.PagedKVError` and the builtin a
caller of transformers would catch.

==================================== ===================== ============================================
class                                also a                raised when
==================================== ===================== ============================================
UnsupportedTransformersVersionError  ValueError            the installed transformers is outside the
                                                           supported releases (``install``)
UnsupportedTransformersConfigError   ValueError            a continuous-batching setting pagedkv does not
                                                           serve (async batching, CPU offloading, tensor
                                                           parallelism), when the cache is built
UnsupportedAttentionTypeError        ValueError            a model layer type pagedkv does not serve
                                                           (``install`` and when the cache is built)
CacheTooSmallError                   MemoryError           one request needs more KV blocks than the
                                                           whole cache holds, with every other request
                                                           gone (raised while scheduling)
AlreadyInstalledError                RuntimeError          ``install`` while installed (nothing changed)
CacheStateMismatchError              RuntimeError          pagedkv's record of a request disagrees with
                                                           transformers' (a bug; raised instead of
                                                           serving a wrong cache index)
==================================== ===================== ============================================
"""

from __future__ import annotations

from pagedkv.errors import InvalidConfigError, PagedKVError

__all__ = [
    "AlreadyInstalledError",
    "CacheStateMismatchError",
    "CacheTooSmallError",
    "UnsupportedAttentionTypeError",
    "UnsupportedTransformersConfigError",
    "UnsupportedTransformersVersionError",
]


class UnsupportedTransformersConfigError(InvalidConfigError):
    """A continuous-batching setting the integration does not serve (also a ``ValueError``).

    Attributes: ``field`` (the ``ContinuousBatchingConfig`` field, e.g. ``"cpu_offload_space"``),
    ``value`` (its value, as text) and ``reason``.
    """


class UnsupportedTransformersVersionError(UnsupportedTransformersConfigError):
    """The installed transformers release is not one the integration supports (also a
    ``ValueError``).

    The integration replaces continuous batching's KV cache (``PagedAttentionCache`` and its
    allocators), an internal API that changes between releases, so it installs only under the
    releases its tests run against. Attributes: ``field`` (``"transformers.__version__"``),
    ``value`` (the installed version), ``reason`` and ``supported`` (the supported
    ``major.minor`` releases).
    """

    _fields = ("field", "value", "reason", "supported")  # type: ignore[assignment]  # one field more
    supported: tuple[str, ...]


class UnsupportedAttentionTypeError(UnsupportedTransformersConfigError):
    """A layer type of the model (``config.layer_types``) pagedkv does not serve (also a
    ``ValueError``); pagedkv serves ``"full_attention"`` and ``"sliding_attention"``.

    Attributes: ``field`` (``"layer_types"``), ``value`` (the refused layer type), ``reason``.
    """


class CacheTooSmallError(PagedKVError, MemoryError):
    """One request needs more KV blocks than the cache can ever give it (every other request
    gone). Nothing was allocated for it.

    Attributes:
        request_id: transformers' request id.
        num_tokens: tokens the request needed KV for (cached + scheduled).
        requested: pagedkv blocks the allocation needed.
        num_blocks: usable pagedkv blocks of the whole cache (one per cache sector).
    """

    _fields = ("request_id", "num_tokens", "requested", "num_blocks")
    request_id: str
    num_tokens: int
    requested: int
    num_blocks: int


class AlreadyInstalledError(PagedKVError, RuntimeError):
    """``install`` was called while the integration is installed; nothing changed.

    Attributes: ``installed_by`` (what installed it, as text).
    """

    _fields = ("installed_by",)
    installed_by: str


class CacheStateMismatchError(PagedKVError, RuntimeError):
    """pagedkv's record of a request disagrees with what transformers asks of it (a bug in the
    integration or a transformers release it does not support); raised instead of handing the
    attention a wrong cache index.

    Attributes: ``request_id`` (transformers' request id) and ``reason``.
    """

    _fields = ("request_id", "reason")
    request_id: str
    reason: str
