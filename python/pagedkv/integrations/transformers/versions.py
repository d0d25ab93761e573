"""The transformers releases the integration supports, checked by ``install``.

The integration replaces the KV cache of transformers' continuous batching
(``transformers.generation.continuous_batching.cache.PagedAttentionCache`` and the allocators
of its ``ATTN_TYPE_TO_ALLOCATOR`` table), internals that change between releases. The supported
releases are those whose continuous-batching source was read for every call the cache and its
allocators receive (docs/design.md, "transformers seam") and that the tests under
tests/integrations/transformers run against.
"""

from __future__ import annotations

import re

from pagedkv._optional import optional_imports
from pagedkv.integrations.transformers.errors import UnsupportedTransformersVersionError

__all__ = ["SUPPORTED_TRANSFORMERS_RELEASES", "check_supported_version"]

#: ``major.minor`` of every supported transformers release (any patch release, any ``.devN``).
SUPPORTED_TRANSFORMERS_RELEASES: tuple[str, ...] = ("5.24",)

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:[.+\-a-z]|$)", re.IGNORECASE)


def check_supported_version(version: str | None = None) -> str:
    """Return the ``major.minor`` release of ``version`` (default: the installed
    ``transformers.__version__``) if the integration supports it.

    Raises :class:`UnsupportedTransformersVersionError` (a ``ValueError``) naming the version and
    :data:`SUPPORTED_TRANSFORMERS_RELEASES` when it is outside them or cannot be read.
    """
    if version is None:
        with optional_imports("pagedkv.integrations.transformers", "transformers"):
            import transformers

        version = str(getattr(transformers, "__version__", "unknown"))
    match = _RELEASE.match(version)
    release = f"{int(match.group(1))}.{int(match.group(2))}" if match else None
    if release not in SUPPORTED_TRANSFORMERS_RELEASES:
        supported = ", ".join(SUPPORTED_TRANSFORMERS_RELEASES)
        reason = f"pagedkv's continuous-batching KV cache supports transformers {supported} (any patch release)"
        raise UnsupportedTransformersVersionError(
            f"transformers {version} is not supported: {reason}; install one of them, e.g. "
            f'pip install "transformers=={SUPPORTED_TRANSFORMERS_RELEASES[-1]}.*"',
            field="transformers.__version__",
            value=version,
            reason=reason,
            supported=SUPPORTED_TRANSFORMERS_RELEASES,
        )
    return release
