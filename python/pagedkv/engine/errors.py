"""Exceptions raised by the reference engine (:mod:`pagedkv.engine`).

Each derives from :class:`pagedkv.errors.EngineError` (so from the package root
:class:`pagedkv.PagedKVError`) and from the builtin callers already catch; its message names the
offending value. Allocator and kernel errors come from :mod:`pagedkv.errors`.

========================= ===================== ==============================================
class                     also a                raised when
========================= ===================== ==============================================
ModelNotFoundError        FileNotFoundError     no model at the given path / default missing
EngineConfigError         ValueError            a bad ``LLMEngine`` argument (size, mode, dtype)
                                                or ``ServiceLevelObjective`` target
PromptFileError           ValueError            a prompts or trace file is unreadable/malformed
InvalidRequestError       ValueError            empty prompt, bad sampling parameter...
RequestTooLargeError      InvalidRequestError   prompt + max_tokens can never fit (context or
                                                KV pool); names the sizes in tokens and blocks
DeviceUnavailableError    ValueError            ``device="cuda"`` without a usable CUDA GPU
KVCacheTooLargeError      MemoryError           the KV pool (or CPU swap pool) does not fit the
                                                free memory; names blocks and bytes
========================= ===================== ==============================================
"""

from __future__ import annotations

from pagedkv.errors import EngineError

__all__ = [
    "EngineError",
    "ModelNotFoundError",
    "EngineConfigError",
    "PromptFileError",
    "InvalidRequestError",
    "RequestTooLargeError",
    "DeviceUnavailableError",
    "KVCacheTooLargeError",
]


class ModelNotFoundError(EngineError, FileNotFoundError):
    """The model file or folder does not exist, or the default model package is missing."""


class EngineConfigError(EngineError, ValueError):
    """An :class:`~pagedkv.engine.LLMEngine` argument is invalid (``max_num_seqs=0``, an unknown
    ``preemption`` mode or ``dtype``...) or a goodput target of
    :class:`~pagedkv.engine.goodput.ServiceLevelObjective` is not a finite number > 0. Raised
    before the model is loaded where the check does not need the model."""


class PromptFileError(EngineError, ValueError):
    """A prompts / trace file cannot be read or a line of it is malformed (message names the
    file and the 1-based line)."""


class InvalidRequestError(EngineError, ValueError):
    """A request argument is out of range (empty prompt, ``n < 1``, ``top_p > 1``...)."""


class RequestTooLargeError(InvalidRequestError):
    """A request can never be served: its prompt exceeds the model context, or its prompt plus
    ``max_tokens`` needs more KV blocks than the whole pool holds. Rejected at admission; the
    engine keeps serving the other requests."""


class DeviceUnavailableError(EngineError, ValueError):
    """The requested torch device cannot be used (e.g. ``"cuda"`` on a machine without a GPU).
    Raised before the model is loaded."""


class KVCacheTooLargeError(EngineError, MemoryError):
    """The requested KV pool (device) or swap pool (CPU) is larger than the memory available
    for it, or allocating it failed. The message names the pool size in blocks and bytes and
    the free memory seen."""
