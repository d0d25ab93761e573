"""Table-driven bad-input tests: every row is one wrong call, the exact exception class it must
raise, and substrings its message must contain (the bad value, and the argument's name where
the API has one). For calls on a live manager or pool, a full snapshot taken before the call
must equal one taken after (a failed call changes nothing), no event may be emitted, and the
object must keep working afterwards (allocate, step, free everything, pool whole again).

Rows cover: configuration (block size 0 / negative / huge / non-int, 0 or 1 blocks, too many
blocks, unknown hash algorithm, negative CPU blocks), token arrays of the wrong dtype, shape,
type, or with negative / too-large ids, unknown and duplicate sequence ids, negative token
counts, malformed steps and groups, states that forbid the call, freeing blocks whose ref count
is 0 (also a double free inside one call), the null block and out-of-range ids, plus, where
those packages are importable, kernel inputs (dtype, shape, device, type) and engine inputs
(sampling settings, prompts files, model paths).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv import errors as E

Row = tuple[str, Callable[..., Any], type[BaseException], tuple[str, ...]]


# ---------------------------------------------------------------------------------------------
# Configuration: nothing to snapshot; the process must still build a working manager after.
# ---------------------------------------------------------------------------------------------
CONFIG_ROWS: list[Row] = [
    ("block_size=0", lambda: pagedkv.CacheConfig(10, 0), E.InvalidConfigError, ("block_size", "0")),
    ("block_size=-1", lambda: pagedkv.CacheConfig(10, -1), E.InvalidConfigError, ("block_size", "-1")),
    ("block_size=4097", lambda: pagedkv.CacheConfig(10, 4097), E.InvalidConfigError, ("block_size", "4097")),
    ("block_size=2**40", lambda: pagedkv.CacheConfig(10, 2**40), E.InvalidConfigError, ("block_size", str(2**40))),
    ("block_size=4.0", lambda: pagedkv.CacheConfig(10, 4.0), E.InvalidConfigError, ("block_size", "4.0")),  # type: ignore[arg-type]
    ("block_size=True", lambda: pagedkv.CacheConfig(10, True), E.InvalidConfigError, ("block_size", "True")),
    ("num_blocks=0", lambda: pagedkv.CacheConfig(0, 4), E.InvalidConfigError, ("num_blocks", "0")),
    ("num_blocks=1", lambda: pagedkv.CacheConfig(1, 4), E.InvalidConfigError, ("num_blocks", "1")),
    ("num_blocks=-3", lambda: pagedkv.CacheConfig(-3, 4), E.InvalidConfigError, ("num_blocks", "-3")),
    (
        "num_blocks=MAX_BLOCKS+1",
        lambda: pagedkv.CacheConfig(pagedkv.MAX_BLOCKS + 1, 4),
        E.InvalidConfigError,
        ("num_blocks", str(pagedkv.MAX_BLOCKS + 1)),
    ),
    ("num_blocks=2**40", lambda: pagedkv.CacheConfig(2**40, 4), E.InvalidConfigError, ("num_blocks", str(2**40))),
    ("hash_algo=md5", lambda: pagedkv.CacheConfig(10, 4, hash_algo="md5"), E.InvalidConfigError, ("hash_algo", "md5")),
    # wrong types are pagedkv errors naming the field, not bare TypeErrors
    ("hash_algo=5", lambda: pagedkv.CacheConfig(10, 4, hash_algo=5), E.InvalidConfigError, ("hash_algo", "5", "str")),  # type: ignore[arg-type]
    ("hash_seed=str", lambda: pagedkv.CacheConfig(10, 4, hash_seed="s"), E.InvalidConfigError, ("hash_seed", "bytes")),  # type: ignore[arg-type]
    (
        "enable_events=1",
        lambda: pagedkv.CacheConfig(10, 4, enable_events=1),
        E.InvalidConfigError,
        ("enable_events", "bool"),
    ),  # type: ignore[arg-type]
    (
        "manager of a non-config",
        lambda: pagedkv.KVCacheManager("cfg"),
        E.InvalidArgumentError,
        ("config", "CacheConfig"),
    ),  # type: ignore[arg-type]
    (
        "num_cpu_blocks=-1",
        lambda: pagedkv.CacheConfig(10, 4, num_cpu_blocks=-1),
        E.InvalidConfigError,
        ("num_cpu_blocks", "-1"),
    ),
    ("BlockPool(0)", lambda: pagedkv.BlockPool(0), E.InvalidConfigError, ("num_blocks", "0")),
    ("BlockPool(1)", lambda: pagedkv.BlockPool(1), E.InvalidConfigError, ("num_blocks", "1")),
    ("BlockPool(-1)", lambda: pagedkv.BlockPool(-1), E.InvalidConfigError, ("num_blocks", "-1")),
]


def check_raises(call: Callable[[], Any], exc: type[BaseException], needles: tuple[str, ...]) -> BaseException:
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc, f"raised {type(info.value).__name__}, expected {exc.__name__}"
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"message {msg!r} does not name {needle!r}"
    return info.value


@pytest.mark.parametrize("name,call,exc,needles", CONFIG_ROWS, ids=[r[0] for r in CONFIG_ROWS])
def test_bad_config(name: str, call: Callable[[], Any], exc: type[BaseException], needles: tuple[str, ...]) -> None:
    check_raises(call, exc, needles)
    # The process keeps working: a valid manager right after.
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(4, 2))
    m.add_sequence(0, [1, 2, 3])
    assert m.allocate_slots(0, 8).num_scheduled_tokens == 3
    m.check_invariants()


def test_invalid_config_error_is_a_value_error() -> None:
    # Callers that catch the builtin keep working.
    with pytest.raises(ValueError):
        pagedkv.CacheConfig(10, 0)


# ---------------------------------------------------------------------------------------------
# A live manager with state: seq 1 (10 tokens, fully allocated, 3 blocks), seq 2 (6 tokens, not
# allocated), seq 3 = fork of seq 1, seq 4 (200 tokens: never fits in 11 usable blocks).
# ---------------------------------------------------------------------------------------------
def make_manager() -> pagedkv.KVCacheManager:
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(12, 4, enable_events=True))
    m.add_sequence(1, list(range(10)))
    m.allocate_slots(1, 100)
    m.add_sequence(2, [7, 8, 9, 10, 11, 12])
    m.fork(1, 3)
    m.add_sequence(4, list(range(1000, 1200)))
    m.take_events()
    return m


def manager_snapshot(m: pagedkv.KVCacheManager) -> tuple[Any, ...]:
    p = m.pool
    seqs: list[tuple[Any, ...]] = []
    for i in range(0, 8):
        try:
            seqs.append((i, m.block_table(i).tolist(), m.token_ids(i).tolist(), m.num_computed_tokens(i), m.status(i)))
        except E.UnknownSequenceError:
            seqs.append((i, None))
    return (
        [p.ref_count(b) for b in range(p.num_blocks)],
        [p.block_hash(b) for b in range(p.num_blocks)],
        p.free_queue().tolist(),
        p.num_free,
        p.num_cached_free,
        p.counters(),
        m.num_sequences,
        m.stats().as_dict(),
        seqs,
    )


U32_MAX = 2**32 - 1
MANAGER_ROWS: list[Row] = [
    # token arrays: dtype, shape, type, values
    (
        "prompt float64 array",
        lambda m: m.add_sequence(5, np.array([1.0, 2.0])),
        E.InvalidArgumentError,
        ("prompt_token_ids", "float64"),
    ),
    ("prompt float list", lambda m: m.add_sequence(5, [1, 2.5]), E.InvalidArgumentError, ("prompt_token_ids", "2.5")),
    (
        "prompt 2-D array",
        lambda m: m.add_sequence(5, np.array([[1, 2], [3, 4]])),
        E.InvalidArgumentError,
        ("prompt_token_ids", "[2, 2]"),
    ),
    ("prompt str", lambda m: m.add_sequence(5, "hello"), E.InvalidArgumentError, ("prompt_token_ids", "'hello'")),
    ("prompt None", lambda m: m.add_sequence(5, None), E.InvalidArgumentError, ("prompt_token_ids", "None")),
    (
        "prompt negative id (list)",
        lambda m: m.add_sequence(5, [1, -2, 3]),
        E.InvalidArgumentError,
        ("prompt_token_ids", "-2"),
    ),
    (
        "prompt negative id (int64 array)",
        lambda m: m.add_sequence(5, np.array([4, -7], dtype=np.int64)),
        E.InvalidArgumentError,
        ("prompt_token_ids", "-7"),
    ),
    (
        "prompt id > u32",
        lambda m: m.add_sequence(5, [U32_MAX + 1]),
        E.InvalidArgumentError,
        ("prompt_token_ids", str(U32_MAX + 1)),
    ),
    ("prompt empty", lambda m: m.add_sequence(5, []), E.InvalidArgumentError, ("prompt",)),
    (
        "prompt empty array",
        lambda m: m.add_sequence(5, np.array([], dtype=np.int32)),
        E.InvalidArgumentError,
        ("prompt",),
    ),
    (
        "append float array",
        lambda m: m.append_tokens(1, np.array([0.5])),
        E.InvalidArgumentError,
        ("token_ids", "float64"),
    ),
    ("append negative id", lambda m: m.append_tokens(1, [3, -1]), E.InvalidArgumentError, ("token_ids", "-1")),
    # sequence ids
    ("duplicate seq id", lambda m: m.add_sequence(1, [1, 2]), E.SequenceExistsError, ("1",)),
    ("negative seq id", lambda m: m.add_sequence(-5, [1, 2]), E.InvalidArgumentError, ("seq_id", "-5")),
    ("seq id > u64", lambda m: m.add_sequence(2**64, [1]), E.InvalidArgumentError, ("seq_id", str(2**64))),
    ("allocate unknown seq", lambda m: m.allocate_slots(99, 4), E.UnknownSequenceError, ("99",)),
    ("append unknown seq", lambda m: m.append_tokens(98, [1]), E.UnknownSequenceError, ("98",)),
    ("lookup unknown seq", lambda m: m.lookup_prefix(97), E.UnknownSequenceError, ("97",)),
    ("block_table unknown seq", lambda m: m.block_table(96), E.UnknownSequenceError, ("96",)),
    ("fork unknown parent", lambda m: m.fork(95, 6), E.UnknownSequenceError, ("95",)),
    ("fork onto existing child", lambda m: m.fork(1, 2), E.SequenceExistsError, ("2",)),
    ("preempt unknown seq", lambda m: m.preempt([1, 94]), E.UnknownSequenceError, ("94",)),
    ("preempt duplicate ids", lambda m: m.preempt([1, 1]), E.InvalidArgumentError, ("seq_ids", "1")),
    ("swap_out duplicate ids", lambda m: m.swap_out([3, 3]), E.InvalidArgumentError, ("seq_ids", "3")),
    ("swap_in unknown seq", lambda m: m.swap_in([93]), E.UnknownSequenceError, ("93",)),
    # token counts
    ("allocate negative count", lambda m: m.allocate_slots(2, -1), E.InvalidArgumentError, ("num_new_tokens", "-1")),
    ("allocate zero tokens", lambda m: m.allocate_slots(2, 0), E.InvalidArgumentError, ("num_new_tokens", "0")),
    ("allocate float count", lambda m: m.allocate_slots(2, 1.5), E.InvalidArgumentError, ("num_new_tokens", "1.5")),
    ("allocate fully computed seq", lambda m: m.allocate_slots(1, 1), E.InvalidArgumentError, ("num_new_tokens", "1")),
    (
        "num_blocks_needed negative",
        lambda m: m.num_blocks_needed(2, -3),
        E.InvalidArgumentError,
        ("num_new_tokens", "-3"),
    ),
    # capacity and state
    ("allocate more than the pool", lambda m: m.allocate_slots(4, 200), E.OutOfBlocksError, ("50", "8")),
    ("swap_out without swap space", lambda m: m.swap_out([1]), E.OutOfSwapSpaceError, ("3", "0")),
    ("swap_in a running seq", lambda m: m.swap_in([1]), E.InvalidSequenceStateError, ("1", "running")),
    ("reset while blocks in use", lambda m: m.reset_prefix_cache(), E.CacheInUseError, ("3",)),
    # multimodal items / extra keys / salts
    (
        "mm item len 0",
        lambda m: m.add_sequence(5, [1, 2], mm_items=[(b"img", 0, 0)]),
        E.InvalidArgumentError,
        ("mm_items", "len=0"),
    ),
    (
        "mm item negative start",
        lambda m: m.add_sequence(5, [1, 2], mm_items=[(b"img", -1, 2)]),
        E.InvalidArgumentError,
        ("mm_items", "-1"),
    ),
    (
        "extra key value not bytes",
        lambda m: m.add_sequence(5, [1], extra_keys=[("lora", "x")]),
        E.InvalidArgumentError,
        ("extra_keys", "'lora'"),
    ),
    (
        "cache_salt not str",
        lambda m: m.add_sequence(5, [1], cache_salt=5),
        E.InvalidArgumentError,
        ("cache_salt", "5", "str"),
    ),
    # batched step: malformed requests change nothing and raise nothing; error is reported
    (
        "step num_new length mismatch",
        lambda m: m.step([1, 2], [1]).raise_for_error(),
        E.InvalidArgumentError,
        ("num_new_tokens",),
    ),
    (
        "step appends length mismatch",
        lambda m: m.step([2], [1], [[1], [2]]).raise_for_error(),
        E.InvalidArgumentError,
        ("append_token_ids",),
    ),
    (
        "step negative num_new",
        lambda m: m.step([2], [-1]).raise_for_error(),
        E.InvalidArgumentError,
        ("num_new_tokens", "-1"),
    ),
    ("step unknown seq", lambda m: m.step([92], [1]).raise_for_error(), E.UnknownSequenceError, ("92",)),
    (
        "step negative appended id",
        lambda m: m.step([2], [1], [[-4]]).raise_for_error(),
        E.InvalidArgumentError,
        ("-4",),
    ),
    (
        "step 2-D seq ids",
        lambda m: m.step(np.array([[2]]), [1]).raise_for_error(),
        E.InvalidArgumentError,
        ("seq_ids", "[1, 1]"),
    ),
    # array-likes only: 1-D integer arrays or lists / tuples of ints, nothing coerced
    (
        "step seq ids from a generator",
        lambda m: m.step((s for s in [2]), [1]),
        E.InvalidArgumentError,
        ("seq_ids", "generator"),
    ),
    ("step seq ids as a set", lambda m: m.step({2}, [1]), E.InvalidArgumentError, ("seq_ids", "set")),
    ("step float seq id array", lambda m: m.step(np.array([2.0]), [1]), E.InvalidArgumentError, ("seq_ids", "float64")),
    (
        "step 2-D appends array",
        lambda m: m.step([2], [1], np.array([[5]])),
        E.InvalidArgumentError,
        ("append_token_ids", "[1, 1]"),
    ),
    ("step appends as a str", lambda m: m.step([2], [1], "x"), E.InvalidArgumentError, ("append_token_ids", "str")),
    ("tokens as bytes", lambda m: m.append_tokens(2, b"ab"), E.InvalidArgumentError, ("token_ids", "bytes")),
    (
        "extra_keys as a dict",
        lambda m: m.add_sequence(5, [1], extra_keys={"lora": b"x"}),
        E.InvalidArgumentError,
        ("extra_keys", "dict"),
    ),
    (
        "adapter_id not str",
        lambda m: m.add_sequence(5, [1], adapter_id=b"a"),
        E.InvalidArgumentError,
        ("adapter_id", "bytes"),
    ),
    ("num_uncomputed_tokens unknown seq", lambda m: m.num_uncomputed_tokens([1, 91]), E.UnknownSequenceError, ("91",)),
    ("num_blocks_owed duplicate ids", lambda m: m.num_blocks_owed([1, 1]), E.InvalidArgumentError, ("seq_ids", "1")),
    # the manager's pool is a read-only view
    ("free through the manager's pool", lambda m: m.pool.free([1]), E.ReadOnlyPoolError, ("read-only", "free")),
    (
        "step duplicate seq id",
        lambda m: m.step([2, 2], [4, 4]).raise_for_error(),
        E.InvalidArgumentError,
        ("seq_ids", "sequence 2 appears more than once"),
    ),
    ("pool ref_count out of range", lambda m: m.pool.ref_count(99), E.InvalidBlockError, ("99",)),
    ("pool block_hash out of range", lambda m: m.pool.block_hash(99), E.InvalidBlockError, ("99",)),
]


def test_manager_rows_are_many() -> None:
    assert len(MANAGER_ROWS) >= 40


@pytest.mark.parametrize("name,call,exc,needles", MANAGER_ROWS, ids=[r[0] for r in MANAGER_ROWS])
def test_bad_manager_call(
    name: str, call: Callable[..., Any], exc: type[BaseException], needles: tuple[str, ...]
) -> None:
    m = make_manager()
    before = manager_snapshot(m)
    err = check_raises(lambda: call(m), exc, needles)
    assert manager_snapshot(m) == before, f"{name}: the failed call changed the state"
    assert m.take_events() == [], f"{name}: the failed call emitted events"
    m.check_invariants()
    if isinstance(err, E.PagedKVError):
        assert err.message == str(err)
    keeps_working(m)


def keeps_working(m: pagedkv.KVCacheManager) -> None:
    """After the failure the manager serves new work and frees back to a whole pool."""
    out = m.step([2], [16])
    assert out.error is None and out.num_scheduled == 1 and int(out.seq_lens[0]) == 6
    m.add_sequence(6, list(range(10)) + [50, 51])
    a = m.allocate_slots(6, 100)
    assert a.num_cached_tokens == 8  # two full blocks of seq 1's prompt
    m.check_invariants()
    for i in range(8):
        m.free(i)
    assert m.pool.num_free == m.pool.num_usable
    m.reset_prefix_cache()
    m.check_invariants()


def test_failed_step_keeps_earlier_allocations() -> None:
    """A step failing at its second sequence keeps the first one's allocation and leaves the
    failing one (including its appended tokens) untouched."""
    m = make_manager()
    out = m.step([2, 4], [16, 200], [[20], [21]])
    assert out.num_scheduled == 1
    assert isinstance(out.error, E.OutOfBlocksError)
    assert m.token_ids(2).tolist() == [7, 8, 9, 10, 11, 12, 20]
    assert m.num_tokens(4) == 200 and m.block_table(4).tolist() == []
    m.check_invariants()


# ---------------------------------------------------------------------------------------------
# Standalone BlockPool: blocks 1, 2 allocated (ref 1), 3 allocated twice (ref 2), rest free.
# ---------------------------------------------------------------------------------------------
def make_pool() -> pagedkv.BlockPool:
    p = pagedkv.BlockPool(8)
    assert p.allocate(3).tolist() == [1, 2, 3]
    p.incref([3])
    return p


def pool_snapshot(p: pagedkv.BlockPool) -> tuple[Any, ...]:
    return (
        [p.ref_count(b) for b in range(p.num_blocks)],
        [p.block_hash(b) for b in range(p.num_blocks)],
        p.free_queue().tolist(),
        p.num_free,
        p.num_used,
        p.counters(),
    )


POOL_ROWS: list[Row] = [
    ("free a block with ref 0", lambda p: p.free([5]), E.RefCountUnderflowError, ("5", "freed more times")),
    ("double free in one call", lambda p: p.free([1, 1]), E.RefCountUnderflowError, ("block 1 is freed more times",)),
    ("free ref-2 block three times", lambda p: p.free([3, 3, 3]), E.RefCountUnderflowError, ("3",)),
    ("free valid then ref 0", lambda p: p.free([2, 6]), E.RefCountUnderflowError, ("6",)),
    ("free the null block", lambda p: p.free([0]), E.InvalidBlockError, ("0", "null")),
    ("free out of range", lambda p: p.free([8]), E.InvalidBlockError, ("8",)),
    ("free negative id", lambda p: p.free([-1]), E.InvalidArgumentError, ("-1",)),
    ("free float ids", lambda p: p.free(np.array([1.0])), E.InvalidArgumentError, ("float64",)),
    ("incref a free block", lambda p: p.incref([4]), E.InvalidArgumentError, ("4",)),
    ("incref the null block", lambda p: p.incref([0]), E.InvalidBlockError, ("0",)),
    ("touch an unhashed block", lambda p: p.touch([1]), E.InvalidArgumentError, ("1",)),
    ("touch out of range", lambda p: p.touch([100]), E.InvalidBlockError, ("100",)),
    ("allocate negative", lambda p: p.allocate(-1), E.InvalidArgumentError, ("-1",)),
    ("allocate more than free", lambda p: p.allocate(5), E.OutOfBlocksError, ("5", "4")),
    ("cache a free block", lambda p: p.cache_block(4, bytes(32)), E.InvalidArgumentError, ("4",)),
    ("cache with a short hash", lambda p: p.cache_block(1, b"short"), E.InvalidArgumentError, ("hash", "5 bytes")),
    ("cache with a str hash", lambda p: p.cache_block(1, "h" * 32), E.InvalidArgumentError, ("hash", "str")),
    ("lookup with an int hash", lambda p: p.lookup(5), E.InvalidArgumentError, ("hash", "int")),
    ("cache the null block", lambda p: p.cache_block(0, bytes(32)), E.InvalidBlockError, ("0",)),
    ("reset while in use", lambda p: p.reset_prefix_cache(), E.CacheInUseError, ("3",)),
    ("allocate_list more than free", lambda p: p.allocate_list(5), E.OutOfBlocksError, ("5", "4")),
    ("allocate_list negative", lambda p: p.allocate_list(-1), E.InvalidArgumentError, ("-1",)),
    ("free_table with a ref-0 block", lambda p: p.free_table([1, 2, 5]), E.RefCountUnderflowError, ("5",)),
    (
        "free_table double free",
        lambda p: p.free_table(np.array([2, 2], dtype=np.int32)),
        E.RefCountUnderflowError,
        ("2",),
    ),
    ("free_table out of range", lambda p: p.free_table([1, 8]), E.InvalidBlockError, ("8",)),
    ("free_table a str", lambda p: p.free_table("12"), E.InvalidArgumentError, ("table", "str")),
    ("free bools", lambda p: p.free([True]), E.InvalidArgumentError, ("bool",)),
    ("free numpy scalars", lambda p: p.free([np.int64(1), np.float64(2.0)]), E.InvalidArgumentError, ("float64",)),
    ("free an id above u32", lambda p: p.free([1, 2**40]), E.InvalidArgumentError, (str(2**40),)),
    ("free negative int32", lambda p: p.free(np.array([1, -3], dtype=np.int32)), E.InvalidArgumentError, ("-3",)),
    (
        "free uint64 above u32",
        lambda p: p.free(np.array([2**33], dtype=np.uint64)),
        E.InvalidArgumentError,
        (str(2**33),),
    ),
    ("free a 2-D array", lambda p: p.free(np.array([[1, 2]], dtype=np.int32)), E.InvalidArgumentError, ("1-D",)),
    ("free a long list with a repeat", lambda p: p.free([3, 3, 2] + [1] * 14), E.RefCountUnderflowError, ("1",)),
]


@pytest.mark.parametrize("name,call,exc,needles", POOL_ROWS, ids=[r[0] for r in POOL_ROWS])
def test_bad_pool_call(name: str, call: Callable[..., Any], exc: type[BaseException], needles: tuple[str, ...]) -> None:
    p = make_pool()
    before = pool_snapshot(p)
    check_raises(lambda: call(p), exc, needles)
    assert pool_snapshot(p) == before, f"{name}: the failed call changed the pool"
    p.check_invariants()
    # Keeps working: release everything, the pool is whole.
    p.free([3, 3, 2, 1])
    assert p.num_free == p.num_usable == 7
    assert p.allocate(7).tolist() == [1, 2, 3, 4, 5, 6, 7]
    p.check_invariants()


def test_ref_zero_error_carries_block_id() -> None:
    p = make_pool()
    with pytest.raises(E.RefCountUnderflowError) as info:
        p.free([6])
    assert info.value.block_id == 6
    assert isinstance(info.value, ValueError)


# ---------------------------------------------------------------------------------------------
# Kernels (need torch): dtype, shape, device and type of each op's inputs.
# ---------------------------------------------------------------------------------------------
def _kernel_rows() -> list[Row]:
    torch = pytest.importorskip("torch")
    from pagedkv.kernels import reference as R

    L, NB, BS, H, D = 1, 6, 4, 2, 8

    def cache() -> Any:
        return torch.zeros(L, 2, NB, BS, H, D)

    def kv(T: int = 3) -> tuple[Any, Any]:
        return torch.randn(T, H, D), torch.randn(T, H, D)

    def write(**over: Any) -> Any:
        c = cache()
        k, v = kv()
        args = dict(
            key=k,
            value=v,
            key_cache=c[0, 0],
            value_cache=c[0, 1],
            slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int64),
        )
        args.update(over)
        return R.reshape_and_cache(**args)

    def attend(**over: Any) -> Any:
        c = cache()
        args = dict(
            query=torch.randn(2, H, D),
            key_cache=c[0, 0],
            value_cache=c[0, 1],
            block_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
            seq_lens=torch.tensor([5, 3], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
            softmax_scale=D**-0.5,
        )
        args.update(over)
        return R.paged_attention(**args)

    return [
        (
            "cache write: int64 key",
            lambda: write(key=torch.ones(3, H, D, dtype=torch.int64)),
            E.KernelInputError,
            ("key", "torch.int64"),
        ),
        (
            "cache write: int32 slot_mapping",
            lambda: write(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32)),
            E.KernelInputError,
            ("slot_mapping", "torch.int32"),
        ),
        (
            "cache write: slot_mapping too short",
            lambda: write(slot_mapping=torch.tensor([0], dtype=torch.int64)),
            E.KernelInputError,
            ("slot_mapping",),
        ),
        (
            "cache write: key wrong head count",
            lambda: write(key=torch.randn(3, H + 1, D)),
            E.KernelInputError,
            ("key",),
        ),
        ("cache write: key not a tensor", lambda: write(key=[[0.0]]), E.KernelInputError, ("key", "list")),
        (
            "cache write: key on meta device",
            lambda: write(key=torch.randn(3, H, D, device="meta")),
            E.KernelInputError,
            ("key", "meta"),
        ),
        (
            "attention: int64 block_table",
            lambda: attend(block_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int64)),
            E.KernelInputError,
            ("block_table", "torch.int64"),
        ),
        (
            "attention: 1-D block_table",
            lambda: attend(block_table=torch.tensor([1, 2], dtype=torch.int32)),
            E.KernelInputError,
            ("block_table",),
        ),
        (
            "attention: seq_lens float",
            lambda: attend(seq_lens=torch.tensor([5.0, 3.0])),
            E.KernelInputError,
            ("seq_lens", "float32"),
        ),
        (
            "attention: query head size mismatch",
            lambda: attend(query=torch.randn(2, H, D + 1)),
            E.KernelInputError,
            ("query",),
        ),
        (
            "copy_blocks: float mapping",
            lambda: R.copy_blocks(cache(), torch.tensor([[1.0, 2.0]])),
            E.KernelInputError,
            ("block_mapping", "float32"),
        ),
        (
            "copy_blocks: mapping shape [1, 3]",
            lambda: R.copy_blocks(cache(), torch.tensor([[1, 2, 3]])),
            E.KernelInputError,
            ("block_mapping",),
        ),
    ]


def test_kernel_bad_inputs() -> None:
    rows = _kernel_rows()
    for name, call, exc, needles in rows:
        try:
            check_raises(call, exc, needles)
        except AssertionError as e:  # name the row that failed
            raise AssertionError(f"{name}: {e}") from None
    assert len(rows) == 12


# ---------------------------------------------------------------------------------------------
# Engine (needs torch / transformers): sampling settings, prompts files, model paths.
# ---------------------------------------------------------------------------------------------
def _engine_rows(tmp_path: Path) -> list[Row]:
    pytest.importorskip("torch")
    from pagedkv.engine import errors as EE
    from pagedkv.engine.inputs import read_prompts
    from pagedkv.engine.models.loader import resolve_model_path
    from pagedkv.engine.sampling import SamplingParams

    malformed = tmp_path / "bad.jsonl"
    malformed.write_text('{"prompt": "ok"}\n{not json\n')
    no_prompt = tmp_path / "noprompt.jsonl"
    no_prompt.write_text(json.dumps({"text": "x"}) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    wrong_suffix = tmp_path / "prompts.csv"
    wrong_suffix.write_text("a\n")
    return [
        ("sampling n=0", lambda: SamplingParams(n=0), EE.InvalidRequestError, ("n", "0")),
        ("sampling top_p=1.5", lambda: SamplingParams(top_p=1.5), EE.InvalidRequestError, ("top_p", "1.5")),
        (
            "sampling temperature=-1",
            lambda: SamplingParams(temperature=-1.0),
            EE.InvalidRequestError,
            ("temperature", "-1"),
        ),
        (
            "prompts file missing",
            lambda: read_prompts(tmp_path / "missing.jsonl"),
            EE.PromptFileError,
            ("missing.jsonl",),
        ),
        ("prompts file malformed JSON", lambda: read_prompts(malformed), EE.PromptFileError, ("bad.jsonl:2",)),
        ("prompts file without prompt", lambda: read_prompts(no_prompt), EE.PromptFileError, ("noprompt.jsonl:1",)),
        ("prompts file empty", lambda: read_prompts(empty), EE.PromptFileError, ("empty.jsonl",)),
        ("prompts file wrong suffix", lambda: read_prompts(wrong_suffix), EE.PromptFileError, (".csv",)),
        (
            "model path missing",
            lambda: resolve_model_path(tmp_path / "no-model.gguf"),
            EE.ModelNotFoundError,
            ("no-model.gguf",),
        ),
    ]


def test_engine_bad_inputs(tmp_path: Path) -> None:
    rows = _engine_rows(tmp_path)
    for name, call, exc, needles in rows:
        try:
            check_raises(call, exc, needles)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    assert len(rows) == 9
