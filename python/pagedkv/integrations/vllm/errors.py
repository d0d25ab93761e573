"""Errors of the vLLM plug-in, each a :class:`pagedkv.PagedKVError` and the builtin a caller of
vLLM would catch.

=============================== ====================== ============================================
class                           also a                 raised when
=============================== ====================== ============================================
UnsupportedVllmConfigError      ValueError             a vLLM setting pagedkv cannot serve exactly
                                                       (``PagedKVScheduler`` is being built)
UnsupportedVllmVersionError     ValueError             the installed vLLM is outside the supported
                                                       releases (``PagedKVScheduler`` is being
                                                       built)
UnsupportedVllmCallError        NotImplementedError    vLLM called a manager method that only a
                                                       refused feature uses (KV connectors)
VllmStateMismatchError          RuntimeError           pagedkv's record of a request disagrees with
                                                       vLLM's (a bug; raised instead of serving a
                                                       wrong block table)
=============================== ====================== ============================================
"""

from __future__ import annotations

from pagedkv.errors import InvalidConfigError, PagedKVError

__all__ = [
    "UnsupportedVllmCallError",
    "UnsupportedVllmConfigError",
    "UnsupportedVllmVersionError",
    "VllmStateMismatchError",
]


class UnsupportedVllmConfigError(InvalidConfigError):
    """A vLLM setting the pagedkv scheduler does not support (also a ``ValueError``).

    Raised by :func:`pagedkv.integrations.vllm.check_supported_config` when ``PagedKVScheduler``
    is built, before any state exists. Attributes: ``field`` (the vLLM setting, e.g.
    ``"speculative_config"``), ``value`` (its value, as text) and ``reason``.
    """


class UnsupportedVllmVersionError(UnsupportedVllmConfigError):
    """The installed vLLM release is not one the plug-in supports (also a ``ValueError``).

    The plug-in reads vLLM's scheduler internals, which change between minor releases, so it is
    built only under the releases its differential suite runs against. Raised by
    :func:`pagedkv.integrations.vllm.check_supported_version` when ``PagedKVScheduler`` is built.

    Attributes: ``field`` (``"vllm.__version__"``), ``value`` (the installed version),
    ``reason``, and ``supported`` (the supported ``major.minor`` releases, e.g.
    ``("0.32", "0.33")``).
    """

    _fields = ("field", "value", "reason", "supported")  # type: ignore[assignment]  # one field more
    supported: tuple[str, ...]


class UnsupportedVllmCallError(PagedKVError, NotImplementedError):
    """vLLM called a ``PagedKVCacheManager`` method that only a feature the plug-in refuses uses
    (KV connectors: adopting, truncating or evicting blocks through vLLM's own block pool).
    Never raised under a configuration :func:`check_supported_config` accepts; nothing changed.

    Attributes: ``operation`` (the method name), ``feature`` (the refused feature).
    """

    _fields = ("operation", "feature")
    operation: str
    feature: str


class VllmStateMismatchError(PagedKVError, RuntimeError):
    """pagedkv's record of a request disagrees with vLLM's: a computed-token count, or the blocks
    a batched decode took. Always a bug (in the plug-in, or a vLLM release behaving differently
    from the supported ones); raised rather than hand vLLM's model runner a wrong block table.

    Attributes: ``request_id`` (the vLLM request, ``""`` for a batch), ``quantity`` (what
    disagrees, e.g. ``"num_computed_tokens"``), ``expected`` (vLLM's value) and ``got``
    (pagedkv's), both as text.
    """

    _fields = ("request_id", "quantity", "expected", "got")
    request_id: str
    quantity: str
    expected: str
    got: str
