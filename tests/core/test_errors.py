"""Every exception type: raised by the right call, with a message naming the bad value, as a
subclass of the builtin callers already catch, and with the manager's state unchanged."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv import errors

Snapshot = dict[str, Any]


def snapshot(m: pagedkv.KVCacheManager, seq_ids: list[int]) -> Snapshot:
    """Everything observable about the manager: stats, free queue, every ref count and hash,
    and per sequence its tokens, computed count, status and block table."""
    pool = m.pool
    seqs = {}
    for s in seq_ids:
        try:
            seqs[s] = (m.token_ids(s).tolist(), m.num_computed_tokens(s), m.status(s), m.block_table(s).tolist())
        except pagedkv.UnknownSequenceError:
            seqs[s] = None
    return {
        "stats": m.stats().as_dict(),
        "free_queue": pool.free_queue().tolist(),
        "refs": [pool.ref_count(b) for b in range(pool.num_blocks)],
        "hashes": [pool.block_hash(b) for b in range(pool.num_blocks)],
        "seqs": seqs,
        "num_sequences": m.num_sequences,
    }


@pytest.fixture
def busy() -> pagedkv.KVCacheManager:
    """A manager in a non-trivial state: 7 usable blocks of 4 tokens, CPU swap space of 2,
    seq 1 (9 tokens, 3 blocks, 2 cached), seq 2 forked from 1, seq 3 swapped out, seq 4 added
    with no blocks."""
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(8, 4, num_cpu_blocks=2))
    m.add_sequence(1, list(range(9)))
    m.allocate_slots(1, 100)
    m.fork(1, 2)
    m.add_sequence(3, [7, 7, 7])
    m.allocate_slots(3, 100)
    m.swap_out([3])
    m.add_sequence(4, list(range(50, 70)))
    m.check_invariants()
    return m


SEQS = [1, 2, 3, 4, 5]

# (name, call, exception class, builtin base, message regex, attributes)
CASES: list[tuple[str, Callable[[pagedkv.KVCacheManager], object], type, type, str, dict[str, object]]] = [
    (
        "out of blocks",
        lambda m: m.allocate_slots(4, 100),
        errors.OutOfBlocksError,
        MemoryError,
        r"out of KV cache blocks: requested 5 block\(s\), 4 available",
        {"requested": 5, "available": 4},
    ),
    (
        "out of swap space",
        lambda m: m.swap_out([1, 2]),
        errors.OutOfSwapSpaceError,
        MemoryError,
        r"out of CPU swap blocks: requested 3 block\(s\), 1 available",
        {"requested": 3, "available": 1},
    ),
    (
        "unknown sequence",
        lambda m: m.allocate_slots(42, 1),
        errors.UnknownSequenceError,
        KeyError,
        r"^unknown sequence id 42$",
        {"seq_id": 42},
    ),
    (
        "unknown parent",
        lambda m: m.fork(43, 44),
        errors.UnknownSequenceError,
        KeyError,
        r"unknown sequence id 43",
        {"seq_id": 43},
    ),
    (
        "unknown in group",
        lambda m: m.preempt([1, 45]),
        errors.UnknownSequenceError,
        KeyError,
        r"unknown sequence id 45",
        {"seq_id": 45},
    ),
    (
        "duplicate add",
        lambda m: m.add_sequence(1, [1]),
        errors.SequenceExistsError,
        ValueError,
        r"sequence id 1 already exists",
        {"seq_id": 1},
    ),
    (
        "fork onto existing",
        lambda m: m.fork(1, 2),
        errors.SequenceExistsError,
        ValueError,
        r"sequence id 2 already exists",
        {"seq_id": 2},
    ),
    (
        "allocate swapped",
        lambda m: m.allocate_slots(3, 1),
        errors.InvalidSequenceStateError,
        RuntimeError,
        r"sequence 3 is swapped",
        {"seq_id": 3, "state": "swapped"},
    ),
    (
        "fork swapped",
        lambda m: m.fork(3, 9),
        errors.InvalidSequenceStateError,
        RuntimeError,
        r"sequence 3 is swapped",
        {"seq_id": 3},
    ),
    (
        "swap in running",
        lambda m: m.swap_in([1]),
        errors.InvalidSequenceStateError,
        RuntimeError,
        r"sequence 1 is running",
        {"seq_id": 1, "state": "running"},
    ),
    (
        "reset while in use",
        lambda m: m.reset_prefix_cache(),
        errors.CacheInUseError,
        RuntimeError,
        r"cannot reset the prefix cache: 3 block\(s\) still in use",
        {"blocks_in_use": 3},
    ),
    (
        "free via the pool view",
        lambda m: m.pool.free([1]),
        errors.ReadOnlyPoolError,
        RuntimeError,
        r"^BlockPool\.free: this pool belongs to a KVCacheManager and is a read-only view",
        {"operation": "free"},
    ),
    (
        "duplicate step id",
        lambda m: m.step([1, 1], [4, 4]).raise_for_error(),
        errors.InvalidArgumentError,
        ValueError,
        r"invalid argument seq_ids = 1: sequence 1 appears more than once in one step",
        {"arg": "seq_ids", "value": "1"},
    ),
    (
        "empty prompt",
        lambda m: m.add_sequence(5, []),
        errors.InvalidArgumentError,
        ValueError,
        r"invalid argument prompt = \[\]",
        {"arg": "prompt"},
    ),
    (
        "negative token",
        lambda m: m.add_sequence(5, [1, -3]),
        errors.InvalidArgumentError,
        ValueError,
        r"prompt_token_ids = -3 at index 1: values must be in 0\.\.=4294967295",
        {"arg": "prompt_token_ids"},
    ),
    (
        "token too large",
        lambda m: m.append_tokens(1, np.array([2**32], dtype=np.int64)),
        errors.InvalidArgumentError,
        ValueError,
        r"token_ids = 4294967296 at index 0",
        {"arg": "token_ids"},
    ),
    (
        "float tokens",
        lambda m: m.add_sequence(5, np.array([1.0, 2.0])),
        errors.InvalidArgumentError,
        ValueError,
        r"prompt_token_ids = array of dtype float64: expected an integer dtype",
        {"arg": "prompt_token_ids"},
    ),
    (
        "2-D tokens",
        lambda m: m.add_sequence(5, np.zeros((2, 2), dtype=np.int32)),
        errors.InvalidArgumentError,
        ValueError,
        r"prompt_token_ids = array of shape \[2, 2\]: expected a 1-D array",
        {"arg": "prompt_token_ids"},
    ),
    (
        "str tokens",
        lambda m: m.add_sequence(5, "abc"),
        errors.InvalidArgumentError,
        ValueError,
        r"prompt_token_ids = 'abc': expected a 1-D integer array or a list of ints, got str",
        {"arg": "prompt_token_ids"},
    ),
    (
        "bool token",
        lambda m: m.append_tokens(1, [True]),
        errors.InvalidArgumentError,
        ValueError,
        r"token_ids = True at index 0: expected ints, got bool",
        {"arg": "token_ids"},
    ),
    (
        "negative seq id",
        lambda m: m.add_sequence(-1, [1]),
        errors.InvalidArgumentError,
        ValueError,
        r"seq_id = -1: must be >= 0",
        {"arg": "seq_id"},
    ),
    (
        "huge seq id",
        lambda m: m.num_tokens(2**64),
        errors.InvalidArgumentError,
        ValueError,
        r"seq_id = 18446744073709551616: out of range",
        {"arg": "seq_id"},
    ),
    (
        "non-int seq id",
        lambda m: m.free("1"),
        errors.InvalidArgumentError,
        ValueError,
        r"seq_id = '1': expected an int, got str",
        {"arg": "seq_id"},
    ),
    (
        "negative token count",
        lambda m: m.allocate_slots(4, -2),
        errors.InvalidArgumentError,
        ValueError,
        r"num_new_tokens = -2: must be >= 0",
        {"arg": "num_new_tokens"},
    ),
    (
        "zero tokens",
        lambda m: m.allocate_slots(4, 0),
        errors.InvalidArgumentError,
        ValueError,
        r"num_new_tokens = 0: must schedule at least one token",
        {"arg": "num_new_tokens"},
    ),
    (
        "nothing to compute",
        lambda m: m.allocate_slots(1, 1),
        errors.InvalidArgumentError,
        ValueError,
        r"num_new_tokens = 1: sequence 1 has no uncomputed token \(all 9 computed\)",
        {"arg": "num_new_tokens"},
    ),
    (
        "duplicate in group",
        lambda m: m.preempt([1, 1]),
        errors.InvalidArgumentError,
        ValueError,
        r"seq_ids = 1: sequence listed twice in one group",
        {"arg": "seq_ids", "value": "1"},
    ),
    (
        "bad extra key",
        lambda m: m.add_sequence(5, [1], extra_keys=[("k", 3)]),
        errors.InvalidArgumentError,
        ValueError,
        r"extra_keys = \('k', 3\) at index 0: expected \(tag: str, value: bytes\)",
        {"arg": "extra_keys"},
    ),
    (
        "bad mm item",
        lambda m: m.add_sequence(5, [1], mm_items=[(b"h", -1, 2)]),
        errors.InvalidArgumentError,
        ValueError,
        r"mm_items = \(b'h', -1, 2\) at index 0",
        {"arg": "mm_items"},
    ),
    (
        "empty mm item",
        lambda m: m.add_sequence(5, [1, 2], mm_items=[(b"h", 0, 0)]),
        errors.InvalidArgumentError,
        ValueError,
        r"mm_items = start=0 len=0",
        {"arg": "mm_items"},
    ),
    (
        "step lengths",
        lambda m: m.step([1, 2], [1, 1, 1]),
        errors.InvalidArgumentError,
        ValueError,
        r"num_new_tokens = 3 entries: expected one per sequence \(2\)",
        {"arg": "num_new_tokens"},
    ),
    (
        "step appends",
        lambda m: m.step([1, 2], 1, append_token_ids=[[1]]),
        errors.InvalidArgumentError,
        ValueError,
        r"append_token_ids = 1 entries: expected one per sequence \(2\)",
        {"arg": "append_token_ids"},
    ),
]


@pytest.mark.parametrize(
    ("call", "cls", "builtin", "message", "attrs"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_error_type_message_and_state_unchanged(
    busy: pagedkv.KVCacheManager,
    call: Callable[[pagedkv.KVCacheManager], object],
    cls: type,
    builtin: type,
    message: str,
    attrs: dict[str, object],
) -> None:
    before = snapshot(busy, SEQS)
    with pytest.raises(cls, match=message) as info:
        call(busy)
    err = info.value
    assert type(err) is cls
    assert isinstance(err, pagedkv.PagedKVError) and isinstance(err, builtin)
    for name, value in attrs.items():
        assert getattr(err, name) == value, name
    assert snapshot(busy, SEQS) == before
    busy.check_invariants()
    # The process keeps working: a valid call still succeeds afterwards.
    busy.add_sequence(99, [1, 2, 3])
    assert busy.allocate_slots(99, 1).num_scheduled_tokens == 1


def test_step_error_leaves_failed_sequence_unchanged(busy: pagedkv.KVCacheManager) -> None:
    before = snapshot(busy, SEQS)
    out = busy.step([4], [100], append_token_ids=[[1, 2]])
    assert out.num_scheduled == 0 and isinstance(out.error, errors.OutOfBlocksError)
    assert snapshot(busy, SEQS) == before


# ---------------------------------------------------------------------------------------------
# Config errors


@pytest.mark.parametrize(
    ("kwargs", "message", "field"),
    [
        (
            {"num_blocks": 8, "block_size": 0},
            r"invalid configuration: block_size = 0: must be in 1\.\.=4096",
            "block_size",
        ),
        ({"num_blocks": 8, "block_size": 4097}, r"block_size = 4097", "block_size"),
        ({"num_blocks": 8, "block_size": -16}, r"block_size = -16: expected an int in 1\.\.=4096 tokens", "block_size"),
        ({"num_blocks": 8, "block_size": -1}, r"block_size = -1: expected an int in 1\.\.=4096 tokens", "block_size"),
        ({"num_blocks": 8, "block_size": 2**40}, r"block_size = 1099511627776", "block_size"),
        ({"num_blocks": 8, "block_size": 1.5}, r"block_size = 1\.5", "block_size"),
        ({"num_blocks": 1, "block_size": 16}, r"num_blocks = 1: need at least 2 blocks", "num_blocks"),
        ({"num_blocks": 0, "block_size": 16}, r"num_blocks = 0", "num_blocks"),
        (
            {"num_blocks": -5, "block_size": 16},
            r"num_blocks = -5: expected an int in 2\.\.=268435456 blocks",
            "num_blocks",
        ),
        (
            {"num_blocks": 10**12, "block_size": 16},
            r"num_blocks = 1000000000000: expected an int in 2\.\.=268435456 blocks",
            "num_blocks",
        ),
        ({"num_blocks": 2**29, "block_size": 16}, r"num_blocks = 536870912: at most 268435456 blocks", "num_blocks"),
        ({"num_blocks": 8, "block_size": 4, "hash_algo": "md5"}, r"hash_algo = \"md5\"", "hash_algo"),
        ({"num_blocks": 8, "block_size": 4, "num_cpu_blocks": -1}, r"num_cpu_blocks = -1", "num_cpu_blocks"),
    ],
)
def test_invalid_config(kwargs: dict[str, Any], message: str, field: str) -> None:
    with pytest.raises(errors.InvalidConfigError, match=message) as info:
        pagedkv.CacheConfig(**kwargs)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field


@pytest.mark.parametrize("n", [0, 1, -1, 2**28 + 1])
def test_invalid_pool_size(n: int) -> None:
    with pytest.raises(errors.InvalidConfigError, match=f"num_blocks = {n}"):
        pagedkv.BlockPool(n)


# ---------------------------------------------------------------------------------------------
# Pool errors (block ids, ref counts)


def pool_snapshot(p: pagedkv.BlockPool) -> tuple[object, ...]:
    return (
        p.free_queue().tolist(),
        [p.ref_count(b) for b in range(p.num_blocks)],
        p.num_free,
        p.num_used,
        p.counters(),
    )


@pytest.mark.parametrize(
    ("call", "cls", "message", "attrs"),
    [
        (
            lambda p: p.free([1, 0]),
            errors.InvalidBlockError,
            r"invalid block id 0: valid ids are 1\.\.=7 \(0 is the null block\)",
            {"block_id": 0, "num_blocks": 8},
        ),
        (lambda p: p.free([9]), errors.InvalidBlockError, r"invalid block id 9", {"block_id": 9}),
        (lambda p: p.incref([9]), errors.InvalidBlockError, r"invalid block id 9", {"block_id": 9}),
        (
            lambda p: p.incref([1, 5]),
            errors.InvalidArgumentError,
            r"ids = 5: block 5 has ref count 0; incref needs a referenced block",
            {"arg": "ids", "value": "5"},
        ),
        (
            lambda p: p.touch([5]),
            errors.InvalidArgumentError,
            r"ids = 5: block 5 does not carry a hash, so it is not a prefix-cache hit",
            {"arg": "ids"},
        ),
        (
            lambda p: p.free([5]),
            errors.RefCountUnderflowError,
            r"reference count underflow: block 5 is freed more times than it is referenced",
            {"block_id": 5},
        ),
        (lambda p: p.free([2, 2]), errors.RefCountUnderflowError, r"block 2", {"block_id": 2}),
        (
            lambda p: p.allocate(7),
            errors.OutOfBlocksError,
            r"requested 7 block\(s\), 4 available",
            {"requested": 7, "available": 4},
        ),
        (lambda p: p.reset_prefix_cache(), errors.CacheInUseError, r"3 block\(s\) still in use", {"blocks_in_use": 3}),
        (lambda p: p.free([-1]), errors.InvalidArgumentError, r"ids = -1 at index 0", {"arg": "ids"}),
        (lambda p: p.allocate(-1), errors.InvalidArgumentError, r"n = -1: must be >= 0", {"arg": "n"}),
        (
            lambda p: p.cache_block(1, b"short"),
            errors.InvalidArgumentError,
            r"hash = <5 bytes>: a block hash is exactly 32 bytes",
            {"arg": "hash"},
        ),
    ],
)
def test_pool_errors_leave_pool_unchanged(
    call: Callable[[pagedkv.BlockPool], object], cls: type, message: str, attrs: dict[str, object]
) -> None:
    p = pagedkv.BlockPool(8)
    p.allocate(3)  # blocks 1, 2, 3 in use
    before = pool_snapshot(p)
    with pytest.raises(cls, match=message) as info:
        call(p)
    for name, value in attrs.items():
        assert getattr(info.value, name) == value
    assert pool_snapshot(p) == before
    p.check_invariants()


# ---------------------------------------------------------------------------------------------
# The hierarchy itself


def test_every_exception_class_is_covered_by_a_case() -> None:
    raised = {case[2] for case in CASES} | {
        errors.InvalidConfigError,
        errors.InvalidBlockError,
        errors.RefCountUnderflowError,
    }
    # Not raised by the allocator: the engine's base class and the kernels' input error (tested
    # below), the invariant check's error (needs a bug to trigger; its handle is checked at
    # import, see test_a_missing_error_class_fails_the_import) and the optional parts' missing
    # package error (tests/test_integrations_optional.py).
    elsewhere = {"PagedKVError", "EngineError", "KernelInputError", "InvariantViolationError", "MissingDependencyError"}
    assert raised == {getattr(errors, n) for n in errors.__all__ if n not in elsewhere}


def test_one_root_for_engine_and_kernel_errors() -> None:
    torch = pytest.importorskip("torch")
    from pagedkv.engine import errors as engine_errors
    from pagedkv.kernels import reference

    builtins = {
        "ModelNotFoundError": FileNotFoundError,
        "EngineConfigError": ValueError,
        "PromptFileError": ValueError,
        "InvalidRequestError": ValueError,
        "RequestTooLargeError": ValueError,
        "DeviceUnavailableError": ValueError,
        "KVCacheTooLargeError": MemoryError,
    }
    assert engine_errors.EngineError is errors.EngineError
    for name, builtin in builtins.items():
        cls = getattr(engine_errors, name)
        assert issubclass(cls, errors.EngineError) and issubclass(cls, builtin), name
        err = cls("bad value 3")
        assert str(err) == "bad value 3" and isinstance(err, errors.PagedKVError)
    assert issubclass(errors.InvariantViolationError, AssertionError)
    from pagedkv.engine.scheduler import SchedulerConfig

    with pytest.raises(engine_errors.EngineConfigError, match="max_num_seqs=0 must be >= 1"):
        SchedulerConfig(max_num_seqs=0)
    cache = torch.zeros(4, 2, 1, 8)
    with pytest.raises(errors.KernelInputError, match="slot_mapping has dtype torch.float32") as info:
        reference.reshape_and_cache(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), cache, cache.clone(), torch.zeros(2))
    assert isinstance(info.value, ValueError)


def test_a_missing_error_class_fails_the_import() -> None:
    """The bindings bind their exception classes when ``pagedkv._core`` is imported: an errors
    module without one of them fails the import instead of the first error."""
    import subprocess
    import sys
    from pathlib import Path

    pkg = Path(pagedkv.__file__).parent
    code = f"""
import sys, types
pkg = types.ModuleType("pagedkv"); pkg.__path__ = [{str(pkg)!r}]
sys.modules["pagedkv"] = pkg
errs = types.ModuleType("pagedkv.errors")
exec(open({str(pkg / "errors.py")!r}).read(), errs.__dict__)
del errs.InvariantViolationError
sys.modules["pagedkv.errors"] = errs
try:
    import pagedkv._core
except AttributeError as e:
    print("import failed:", e)
else:
    print("imported")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("import failed:") and "InvariantViolationError" in out.stdout


def test_hierarchy() -> None:
    assert issubclass(errors.OutOfSwapSpaceError, errors.OutOfBlocksError)
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.PagedKVError) and issubclass(cls, Exception)
        assert getattr(pagedkv, name) is cls


def test_exceptions_pickle_with_attributes() -> None:
    err = errors.OutOfBlocksError("out of KV cache blocks: requested 3 block(s), 1 available", requested=3, available=1)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is errors.OutOfBlocksError
    assert (str(back), back.requested, back.available) == (str(err), 3, 1)


def test_key_error_message_is_not_quoted() -> None:
    err = errors.UnknownSequenceError("unknown sequence id 5", seq_id=5)
    assert str(err) == "unknown sequence id 5"
    assert err.message == "unknown sequence id 5"


def test_constructor_requires_the_fields() -> None:
    with pytest.raises(TypeError, match=r"missing \['available'\]"):
        errors.OutOfBlocksError("x", requested=1)
    with pytest.raises(TypeError, match=r"unknown \['bogus'\]"):
        errors.UnknownSequenceError("x", seq_id=1, bogus=2)
