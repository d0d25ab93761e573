"""Exceptions raised by pagedkv: one root, :class:`PagedKVError`, for the whole package.

Every error a caller of pagedkv can see (the allocator, the kernels, the reference engine)
is a :class:`PagedKVError`, so ``except pagedkv.PagedKVError`` catches them all, and each class
also subclasses the builtin exception that callers already catch, so code written against plain
Python keeps working. Errors of the Rust core map, through one exhaustive ``match`` in the
bindings (``rust/python/src/errors.rs``, class handles bound when ``pagedkv._core`` is imported),
to exactly one class below:

=========================== ============================ ==========================================
class                       also a                       raised when
=========================== ============================ ==========================================
OutOfBlocksError            MemoryError                  an all-or-nothing allocation lacks blocks
OutOfSwapSpaceError         OutOfBlocksError             a swap-out lacks CPU blocks
UnknownSequenceError        KeyError                     a sequence id is not registered
SequenceExistsError         ValueError                   a sequence id is registered twice
InvalidBlockError           ValueError                   a block id is outside 1 to ``num_blocks - 1``
RefCountUnderflowError      ValueError                   freeing a block whose ref count is 0
InvalidConfigError          ValueError                   a configuration value is out of range
InvalidArgumentError        ValueError                   a call argument is out of range
InvalidSequenceStateError   RuntimeError                 the sequence is in the wrong state
CacheInUseError             RuntimeError                 resetting the prefix cache while in use
ReadOnlyPoolError           RuntimeError                 mutating ``KVCacheManager.pool`` (a view)
InvariantViolationError     AssertionError               ``check_invariants`` found a broken rule
KernelInputError            ValueError                   a kernel argument has the wrong dtype,
                                                         shape, device or value (``pagedkv.kernels``)
MissingDependencyError      ModuleNotFoundError          an optional part (kernels, engine, vLLM
                                                         plug-in, cluster...) needs a package that
                                                         is not installed; names it and the extra
=========================== ============================ ==========================================

The reference engine's errors (:mod:`pagedkv.engine.errors`: bad requests, configuration,
prompt files, devices, model files) derive from :class:`EngineError`, itself a
:class:`PagedKVError`.

A call that raises any of these has changed no state. Messages name the offending values; for
the allocator's errors the values are also attributes (``requested``, ``available``,
``seq_id``, ``block_id``...).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PagedKVError",
    "OutOfBlocksError",
    "OutOfSwapSpaceError",
    "UnknownSequenceError",
    "SequenceExistsError",
    "InvalidBlockError",
    "RefCountUnderflowError",
    "InvalidConfigError",
    "InvalidArgumentError",
    "InvalidSequenceStateError",
    "CacheInUseError",
    "ReadOnlyPoolError",
    "InvariantViolationError",
    "KernelInputError",
    "MissingDependencyError",
    "EngineError",
]


class PagedKVError(Exception):
    """Base class of every pagedkv error.

    Subclasses take the message as their only positional argument and the offending values as
    keyword arguments, which become attributes. Instances pickle and compare by message.
    """

    _fields: tuple[str, ...] = ()

    def __init__(self, message: str, **fields: Any) -> None:
        missing = [f for f in self._fields if f not in fields]
        unknown = [f for f in fields if f not in self._fields]
        if missing or unknown:
            raise TypeError(
                f"{type(self).__name__}() needs keyword arguments {list(self._fields)}; "
                f"missing {missing}, unknown {unknown}"
            )
        super().__init__(message)
        for name, value in fields.items():
            setattr(self, name, value)

    @property
    def message(self) -> str:
        """The human-readable message (names the offending values)."""
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        # KeyError's __str__ would quote the message; keep it plain for every subclass.
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild with the keyword fields (the default pickling only passes `args`).
        fields = {f: getattr(self, f) for f in self._fields}
        return (_rebuild, (type(self), self.message, fields))


def _rebuild(cls: type[PagedKVError], message: str, fields: dict[str, Any]) -> PagedKVError:
    return cls(message, **fields)


class OutOfBlocksError(PagedKVError, MemoryError):
    """Not enough free KV cache blocks for an all-or-nothing allocation.

    Attributes:
        requested: blocks the call needed.
        available: free blocks (uncached + evictable cached) at the time of the call.
    """

    _fields = ("requested", "available")
    requested: int
    available: int


class OutOfSwapSpaceError(OutOfBlocksError):
    """Not enough free CPU (swap space) blocks for a swap-out. Units: blocks.

    Attributes:
        requested: CPU blocks the swap-out needed.
        available: free CPU blocks.
    """


class UnknownSequenceError(PagedKVError, KeyError):
    """The sequence id is not registered with the manager.

    Attributes:
        seq_id: the unknown id.
    """

    _fields = ("seq_id",)
    seq_id: int


class SequenceExistsError(PagedKVError, ValueError):
    """The sequence id is already registered.

    Attributes:
        seq_id: the duplicate id.
    """

    _fields = ("seq_id",)
    seq_id: int


class InvalidBlockError(PagedKVError, ValueError):
    """A block id outside 1 to ``num_blocks - 1`` (block 0, the null block, is never valid).

    Attributes:
        block_id: the bad id.
        num_blocks: the pool size (valid ids are 1 to ``num_blocks - 1`` inclusive).
    """

    _fields = ("block_id", "num_blocks")
    block_id: int
    num_blocks: int


class RefCountUnderflowError(PagedKVError, ValueError):
    """Freeing a block whose reference count is already 0 (a double free).

    Attributes:
        block_id: the block.
    """

    _fields = ("block_id",)
    block_id: int


class InvalidConfigError(PagedKVError, ValueError):
    """A configuration value is out of range, or fields that do not fit together
    (``CacheConfig``: ``layer_groups`` without ``groups``, a ``block_size`` unlike a group's,
    groups whose pages differ in size...).

    Attributes:
        field: the configuration field (``"block_size"``, ``"num_blocks"``, ``"groups"``,
            ``"layer_groups"``...).
        value: the rejected value, as text.
        reason: why it was rejected.
    """

    _fields = ("field", "value", "reason")
    field: str
    value: str
    reason: str


class InvalidArgumentError(PagedKVError, ValueError):
    """A call argument is out of range for the current state, or a question asked in the
    one-group spelling of a result with several KV cache groups (``StepOutput.slot_mapping``
    / ``block_table`` on an output with ``num_groups > 1``: use ``slot_mappings[g]`` /
    ``block_tables[g]``).

    Attributes:
        arg: the argument's name.
        value: the rejected value, as text.
        reason: why it was rejected.
    """

    _fields = ("arg", "value", "reason")
    arg: str
    value: str
    reason: str


class InvalidSequenceStateError(PagedKVError, RuntimeError):
    """The operation needs the sequence in another state (running, preempted, swapped).

    Attributes:
        seq_id: the sequence.
        state: its current state.
        operation: the refused operation.
        expected: the state the operation needs.
    """

    _fields = ("seq_id", "state", "operation", "expected")
    seq_id: int
    state: str
    operation: str
    expected: str


class CacheInUseError(PagedKVError, RuntimeError):
    """Resetting the prefix cache while blocks are still referenced.

    Attributes:
        blocks_in_use: blocks with a reference count above 0.
    """

    _fields = ("blocks_in_use",)
    blocks_in_use: int


class ReadOnlyPoolError(PagedKVError, RuntimeError):
    """A mutating ``BlockPool`` method was called on ``KVCacheManager.pool``, a read-only view.

    Raised by the bindings, not the core: changing the pool behind the manager's back would break
    the manager's bookkeeping, so use the manager's own methods instead. Nothing is changed.

    Attributes:
        operation: the refused ``BlockPool`` method (``"free"``, ``"allocate"``...).
    """

    _fields = ("operation",)
    operation: str


class InvariantViolationError(PagedKVError, AssertionError):
    """``KVCacheManager.check_invariants`` / ``BlockPool.check_invariants`` found a broken
    invariant (a bug in pagedkv, or a pool mutated behind the manager's back). The message
    names the first violation."""


class KernelInputError(PagedKVError, ValueError):
    """A :mod:`pagedkv.kernels` argument has the wrong type, dtype, shape, device or value,
    checked on the host before anything is launched. The message names the op, the tensor,
    what it got and what it expected, e.g. ``paged_attention: block_table has dtype
    torch.int64, expected torch.int32``."""


class MissingDependencyError(PagedKVError, ModuleNotFoundError):
    """An optional part of pagedkv needs a package that is not installed. ``import pagedkv``
    itself needs numpy only; the kernels, the engine, the vLLM plug-in, the cluster and the
    KV event wire format each need an extra of ``pyproject.toml``. The message names the part,
    the missing package and the command that installs it, e.g. ``pagedkv.kernels needs torch,
    which is not installed: pip install "pagedkv[torch]"``. Raised by
    :func:`pagedkv._optional.optional_imports`; ``except ImportError`` still catches it.

    Attributes:
        name: the missing top-level module (as ``ModuleNotFoundError.name``), e.g. ``"torch"``.
        feature: the pagedkv part that needs it, e.g. ``"pagedkv.kernels"``.
        extra: the ``pyproject.toml`` extra that installs it, e.g. ``"torch"``.
    """

    _fields = ("name", "feature", "extra")
    name: str
    feature: str
    extra: str


class EngineError(PagedKVError):
    """Base class of the reference engine's errors (:mod:`pagedkv.engine.errors`); each
    subclass also derives from the builtin callers catch (``ValueError``, ``MemoryError``,
    ``FileNotFoundError``)."""
