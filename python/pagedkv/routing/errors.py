"""Exceptions raised by :mod:`pagedkv.routing`.

Each derives from :class:`RoutingError` (so from the package root :class:`pagedkv.PagedKVError`)
and from the builtin callers already catch. Bad arguments (a negative weight, an empty worker
list, a ``request_id`` already routed, an unknown policy name) raise the package's
:class:`pagedkv.InvalidConfigError` / :class:`pagedkv.InvalidArgumentError` (both ``ValueError``).

==================== ============== ==========================================================
class                also a         raised when
==================== ============== ==========================================================
UnknownWorkerError   KeyError       a worker id the router does not know (never added, removed)
NoWorkerError        RuntimeError   no live worker is left to route a request to
WireFormatError      ValueError     a payload or ZMQ frame list that is not a KV event batch
NotAKVEventError     TypeError      ``events_to_wire`` / ``encode_event_batch`` got an item that
                                    is not a pagedkv KV event
==================== ============== ==========================================================

A call that raises any of these has changed no state.
"""

from __future__ import annotations

from pagedkv.errors import PagedKVError

__all__ = ["NoWorkerError", "NotAKVEventError", "RoutingError", "UnknownWorkerError", "WireFormatError"]


class RoutingError(PagedKVError):
    """Base class of the errors of :mod:`pagedkv.routing`."""


class UnknownWorkerError(RoutingError, KeyError):
    """The router knows no worker with this id (never added, or removed).

    Attributes:
        worker_id: the unknown id.
    """

    _fields = ("worker_id",)
    worker_id: int


class NoWorkerError(RoutingError, RuntimeError):
    """No live worker is left to route to (all removed or excluded)."""


class WireFormatError(RoutingError, ValueError):
    """A payload or frame list that is not a KV event batch (the message says what is wrong)."""


class NotAKVEventError(RoutingError, TypeError):
    """An item to encode that is not a pagedkv ``BlockStored`` / ``BlockRemoved`` /
    ``AllBlocksCleared`` event."""
