"""Exceptions raised by the reference engine (:mod:`pagedkv.engine`).

Each subclasses the builtin callers already catch, and its message names the offending value.
Allocator errors (out of blocks, unknown sequence...) come from :mod:`pagedkv.errors`.

========================= ===================== ==============================================
class                     also a                raised when
========================= ===================== ==============================================
ModelNotFoundError        FileNotFoundError     no model at the given path / default missing
PromptFileError           ValueError            a prompts or trace file is unreadable/malformed
InvalidRequestError       ValueError            empty prompt, bad sampling parameter...
RequestTooLargeError      InvalidRequestError   prompt + max_tokens can never fit (context or
                                                KV pool); names the sizes in tokens and blocks
========================= ===================== ==============================================
"""

from __future__ import annotations

__all__ = [
    "EngineError",
    "ModelNotFoundError",
    "PromptFileError",
    "InvalidRequestError",
    "RequestTooLargeError",
]


class EngineError(Exception):
    """Base class of every engine error."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """The model file or folder does not exist, or the default model package is missing."""


class PromptFileError(EngineError, ValueError):
    """A prompts / trace file cannot be read or a line of it is malformed (message names the
    file and the 1-based line)."""


class InvalidRequestError(EngineError, ValueError):
    """A request argument is out of range (empty prompt, ``n < 1``, ``top_p > 1``...)."""


class RequestTooLargeError(InvalidRequestError):
    """A request can never be served: its prompt exceeds the model context, or its prompt plus
    ``max_tokens`` needs more KV blocks than the whole pool holds. Rejected at admission; the
    engine keeps serving the other requests."""
