"""Bad input to the external-KV calls of ``pagedkv.KVCacheManager`` (``allocate_external``,
``num_blocks_needed_external``, ``commit_external``, ``rollback``, ``evict_blocks``,
``free_deferred`` / ``preempt_deferred`` / ``release_deferred`` / ``deferred_blocks``): wrong
types, out-of-range values, unknown sequences and calls in the wrong state. Each refused call
raises the documented ``pagedkv.PagedKVError`` subclass with a message naming the argument or
state, and leaves everything as it was: ref counts, hashes, the free queue, every table, the
computed and staged counts, pending deferred releases, the statistics and the KV events. One
full-attention group and a full + sliding-window layout.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest

from pagedkv import CacheConfig, KVCacheGroupSpec, KVCacheManager
from pagedkv import errors as E

BS = 4
WINDOW = 8
LAYOUTS = ["one", "hybrid"]

# The fixture's sequences: RUN running (24 tokens computed), LOAD loading (16 staged tokens,
# no local hit), NEW added without blocks, SWAP swapped out, PRE preempted by recompute.
RUN, LOAD, NEW, SWAP, PRE = 1, 2, 3, 4, 5
SEQS = [RUN, LOAD, NEW, SWAP, PRE]
UNKNOWN = 99


def toks(n: int, salt: int) -> list[int]:
    return [i * 7 + salt * 1000 + 1 for i in range(n)]


def make(layout: str, num_blocks: int = 64, **kw: Any) -> KVCacheManager:
    """One full group (``"one"``) or full + sliding window 8 (``"hybrid"``), events on."""
    if layout == "one":
        return KVCacheManager(CacheConfig(num_blocks, BS, enable_events=True, **kw))
    groups = [KVCacheGroupSpec("full", BS, 8), KVCacheGroupSpec("sliding_window", BS, 8, window=WINDOW)]
    return KVCacheManager(CacheConfig(num_blocks, groups=groups, layer_groups=[0, 1], enable_events=True, **kw))


def populated(layout: str) -> KVCacheManager:
    """A manager holding a sequence in each state (see ``SEQS``), events drained."""
    m = make(layout, num_cpu_blocks=16)
    m.add_sequence(RUN, toks(24, 1))
    m.allocate_slots(RUN, 24)
    m.add_sequence(LOAD, toks(24, 2))
    m.allocate_external(LOAD, 16, staged=True)
    m.add_sequence(NEW, toks(24, 3))
    m.add_sequence(SWAP, toks(8, 4))
    m.allocate_slots(SWAP, 8)
    m.swap_out([SWAP])
    m.add_sequence(PRE, toks(8, 5))
    m.allocate_slots(PRE, 8)
    m.preempt([PRE])
    m.take_events()
    m.take_host_transfers()
    return m


def state(m: KVCacheManager, seqs: list[int] = SEQS) -> tuple[Any, ...]:
    """Everything a refused call must leave unchanged."""
    p = m.pool
    per_seq: list[tuple[Any, ...]] = []
    for s in seqs:
        try:
            per_seq.append(
                (
                    s,
                    m.status(s),
                    m.num_tokens(s),
                    m.num_computed_tokens(s),
                    m.num_staged_tokens(s),
                    m.num_draft_tokens(s),
                    [t.tolist() for t in m.block_tables(s)],
                )
            )
        except E.UnknownSequenceError:
            per_seq.append((s, None))
    return (
        per_seq,
        [p.ref_count(b) for b in range(p.num_blocks)],
        [p.block_hash(b) for b in range(p.num_blocks)],
        p.free_queue().tolist(),
        p.counters(),
        m.num_free_blocks,
        m.num_deferred_blocks(),
        m.num_sequences,
        m.stats().as_dict(),
    )


def refused(
    m: KVCacheManager, call: Callable[[], Any], exc: type[E.PagedKVError], *needles: str, seqs: list[int] = SEQS
) -> E.PagedKVError:
    """Runs ``call``, which must raise exactly ``exc`` naming every needle and change nothing."""
    before = state(m, seqs)
    with pytest.raises(exc) as info:
        call()
    err = info.value
    assert type(err) is exc, f"raised {type(err).__name__}, expected {exc.__name__}"
    msg = str(err)
    for needle in needles:
        assert needle in msg, f"message {msg!r} does not name {needle!r}"
    assert state(m, seqs) == before
    assert m.take_events() == []
    stores, loads = m.take_host_transfers()
    assert stores.shape == (0, 3) and loads.shape == (0, 3)
    m.check_invariants()
    return err


# Calls take the manager as Any: they pass wrong types on purpose.
Bad = tuple[str, Callable[[Any], Any], type[E.PagedKVError], tuple[str, ...]]

# Wrong types and out-of-range values: InvalidArgumentError naming the argument and the value.
WRONG_VALUES: list[Bad] = [
    ("E float", lambda m: m.allocate_external(NEW, 4.0), E.InvalidArgumentError, ("num_external_tokens", "4.0", "int")),
    ("E str", lambda m: m.allocate_external(NEW, "4"), E.InvalidArgumentError, ("num_external_tokens", "str")),
    ("E None", lambda m: m.allocate_external(NEW, None), E.InvalidArgumentError, ("num_external_tokens", "None")),
    ("E bool", lambda m: m.allocate_external(NEW, True), E.InvalidArgumentError, ("num_external_tokens", "bool")),
    (
        "E numpy float",
        lambda m: m.allocate_external(NEW, np.float64(4)),
        E.InvalidArgumentError,
        ("num_external_tokens", "float64"),
    ),
    ("E negative", lambda m: m.allocate_external(NEW, -1), E.InvalidArgumentError, ("num_external_tokens", "-1")),
    ("E past the end", lambda m: m.allocate_external(NEW, 25), E.InvalidArgumentError, ("num_external_tokens", "25")),
    ("E 2**40", lambda m: m.allocate_external(NEW, 2**40), E.InvalidArgumentError, ("num_external_tokens", str(2**40))),
    (
        "E 2**70",
        lambda m: m.allocate_external(NEW, 2**70),
        E.InvalidArgumentError,
        ("num_external_tokens", "out of range"),
    ),
    ("n negative", lambda m: m.allocate_external(NEW, 4, -1), E.InvalidArgumentError, ("num_new_tokens", "-1")),
    ("n float", lambda m: m.allocate_external(NEW, 4, 1.5), E.InvalidArgumentError, ("num_new_tokens", "1.5")),
    (
        "n with staged",
        lambda m: m.allocate_external(NEW, 4, 1, staged=True),
        E.InvalidArgumentError,
        ("num_new_tokens", "staged"),
    ),
    ("nothing to allocate", lambda m: m.allocate_external(NEW, 0, 0), E.InvalidArgumentError, ("num_new_tokens", "0")),
    ("staged int", lambda m: m.allocate_external(NEW, 4, staged=1), E.InvalidArgumentError, ("staged", "1", "bool")),
    ("staged str", lambda m: m.allocate_external(NEW, 4, staged="yes"), E.InvalidArgumentError, ("staged", "'yes'")),
    (
        "reserve negative",
        lambda m: m.allocate_external(NEW, 4, reserve_blocks=-1),
        E.InvalidArgumentError,
        ("reserve_blocks", "-1"),
    ),
    (
        "reserve float",
        lambda m: m.allocate_external(NEW, 4, reserve_blocks=1.0),
        E.InvalidArgumentError,
        ("reserve_blocks", "float"),
    ),
    (
        "reserve 2**70",
        lambda m: m.allocate_external(NEW, 4, reserve_blocks=2**70),
        E.InvalidArgumentError,
        ("reserve_blocks",),
    ),
    ("reserve 2**40", lambda m: m.allocate_external(NEW, 4, reserve_blocks=2**40), E.OutOfBlocksError, ("requested",)),
    ("seq negative", lambda m: m.allocate_external(-1, 4), E.InvalidArgumentError, ("seq_id", "-1")),
    ("seq 2**64", lambda m: m.allocate_external(2**64, 4), E.InvalidArgumentError, ("seq_id", str(2**64))),
    ("seq float", lambda m: m.allocate_external(3.0, 4), E.InvalidArgumentError, ("seq_id", "float")),
    (
        "needed E negative",
        lambda m: m.num_blocks_needed_external(NEW, -4),
        E.InvalidArgumentError,
        ("num_external_tokens",),
    ),
    (
        "needed E past end",
        lambda m: m.num_blocks_needed_external(NEW, 25),
        E.InvalidArgumentError,
        ("num_external_tokens",),
    ),
    (
        "needed E float",
        lambda m: m.num_blocks_needed_external(NEW, 1.0),
        E.InvalidArgumentError,
        ("num_external_tokens",),
    ),
    ("commit negative", lambda m: m.commit_external(LOAD, -1), E.InvalidArgumentError, ("num_valid_tokens", "-1")),
    (
        "commit past load",
        lambda m: m.commit_external(LOAD, 17),
        E.InvalidArgumentError,
        ("num_valid_tokens", "17", "[0, 16]"),
    ),
    ("commit float", lambda m: m.commit_external(LOAD, 8.0), E.InvalidArgumentError, ("num_valid_tokens", "float")),
    ("commit bool", lambda m: m.commit_external(LOAD, True), E.InvalidArgumentError, ("num_valid_tokens", "bool")),
    (
        "commit 2**70",
        lambda m: m.commit_external(LOAD, 2**70),
        E.InvalidArgumentError,
        ("num_valid_tokens", "out of range"),
    ),
    (
        "rollback up",
        lambda m: m.rollback(RUN, 25, poisoned=True),
        E.InvalidArgumentError,
        ("num_computed_tokens", "25", "24"),
    ),
    (
        "rollback negative",
        lambda m: m.rollback(RUN, -1, poisoned=True),
        E.InvalidArgumentError,
        ("num_computed_tokens", "-1"),
    ),
    (
        "rollback float",
        lambda m: m.rollback(RUN, 8.0, poisoned=True),
        E.InvalidArgumentError,
        ("num_computed_tokens", "float"),
    ),
    (
        "rollback new up",
        lambda m: m.rollback(NEW, 1, poisoned=False),
        E.InvalidArgumentError,
        ("num_computed_tokens", "0 computed"),
    ),
    ("poisoned int", lambda m: m.rollback(RUN, 8, poisoned=1), E.InvalidArgumentError, ("poisoned", "1", "bool")),
    ("poisoned str", lambda m: m.rollback(RUN, 8, poisoned="x"), E.InvalidArgumentError, ("poisoned", "'x'")),
    ("poisoned None", lambda m: m.rollback(RUN, 8, poisoned=None), E.InvalidArgumentError, ("poisoned", "None")),
    ("evict null block", lambda m: m.evict_blocks([0]), E.InvalidBlockError, ("0", "null block")),
    ("evict num_blocks", lambda m: m.evict_blocks([m.num_blocks]), E.InvalidBlockError, ("64",)),
    ("evict negative", lambda m: m.evict_blocks([-1]), E.InvalidArgumentError, ("block_ids", "-1")),
    ("evict 2**40", lambda m: m.evict_blocks([2**40]), E.InvalidArgumentError, ("block_ids", str(2**40))),
    ("evict float", lambda m: m.evict_blocks([1.5]), E.InvalidArgumentError, ("block_ids", "1.5")),
    ("evict float array", lambda m: m.evict_blocks(np.array([1.0])), E.InvalidArgumentError, ("block_ids", "float64")),
    ("evict 2-D", lambda m: m.evict_blocks(np.array([[1, 2]])), E.InvalidArgumentError, ("block_ids", "1-D")),
    ("evict int", lambda m: m.evict_blocks(3), E.InvalidArgumentError, ("block_ids", "int")),
    ("evict str", lambda m: m.evict_blocks("12"), E.InvalidArgumentError, ("block_ids", "str")),
    ("evict None", lambda m: m.evict_blocks(None), E.InvalidArgumentError, ("block_ids", "None")),
    (
        "evict valid then invalid",
        lambda m: m.evict_blocks([int(m.block_table(RUN, 0)[0]), m.num_blocks]),
        E.InvalidBlockError,
        ("64",),
    ),
    ("release unknown handle", lambda m: m.release_deferred(12345), E.InvalidArgumentError, ("handle", "12345")),
    ("release negative handle", lambda m: m.release_deferred(-1), E.InvalidArgumentError, ("handle", "-1")),
    ("release float handle", lambda m: m.release_deferred(1.0), E.InvalidArgumentError, ("handle", "float")),
    ("blocks of unknown handle", lambda m: m.deferred_blocks(999), E.InvalidArgumentError, ("handle", "999")),
    ("preempt_deferred dup", lambda m: m.preempt_deferred([RUN, RUN]), E.InvalidArgumentError, ("seq_ids", "twice")),
    ("preempt_deferred float", lambda m: m.preempt_deferred([1.0]), E.InvalidArgumentError, ("seq_ids", "float")),
    ("preempt_deferred int", lambda m: m.preempt_deferred(RUN), E.InvalidArgumentError, ("seq_ids", "int")),
    ("preempt_deferred None", lambda m: m.preempt_deferred(None), E.InvalidArgumentError, ("seq_ids", "None")),
    ("staged count of -1", lambda m: m.num_staged_tokens(-1), E.InvalidArgumentError, ("seq_id", "-1")),
]

# Unknown sequences: UnknownSequenceError naming the id.
UNKNOWN_SEQS: list[Bad] = [
    ("allocate_external", lambda m: m.allocate_external(UNKNOWN, 4), E.UnknownSequenceError, ("99",)),
    ("needed_external", lambda m: m.num_blocks_needed_external(UNKNOWN, 4), E.UnknownSequenceError, ("99",)),
    ("commit_external", lambda m: m.commit_external(UNKNOWN, 0), E.UnknownSequenceError, ("99",)),
    ("rollback", lambda m: m.rollback(UNKNOWN, 0, poisoned=True), E.UnknownSequenceError, ("99",)),
    ("free_deferred", lambda m: m.free_deferred(UNKNOWN), E.UnknownSequenceError, ("99",)),
    ("preempt_deferred", lambda m: m.preempt_deferred([RUN, UNKNOWN]), E.UnknownSequenceError, ("99",)),
    ("num_staged_tokens", lambda m: m.num_staged_tokens(UNKNOWN), E.UnknownSequenceError, ("99",)),
]

# Calls in the wrong state: InvalidSequenceStateError naming the state and the call.
WRONG_STATES: list[Bad] = [
    (
        "allocate_external running",
        lambda m: m.allocate_external(RUN, 0, 1),
        E.InvalidSequenceStateError,
        ("running", "allocate_external"),
    ),
    (
        "allocate_external loading",
        lambda m: m.allocate_external(LOAD, 4, staged=True),
        E.InvalidSequenceStateError,
        ("loading",),
    ),
    ("allocate_external swapped", lambda m: m.allocate_external(SWAP, 0, 1), E.InvalidSequenceStateError, ("swapped",)),
    (
        "needed_external loading",
        lambda m: m.num_blocks_needed_external(LOAD, 0, 1),
        E.InvalidSequenceStateError,
        ("loading",),
    ),
    (
        "commit running",
        lambda m: m.commit_external(RUN, 24),
        E.InvalidSequenceStateError,
        ("running", "commit_external"),
    ),
    ("commit new", lambda m: m.commit_external(NEW, 0), E.InvalidSequenceStateError, ("running", "loading")),
    ("commit swapped", lambda m: m.commit_external(SWAP, 8), E.InvalidSequenceStateError, ("swapped",)),
    ("commit preempted", lambda m: m.commit_external(PRE, 0), E.InvalidSequenceStateError, ("preempted",)),
    (
        "allocate_slots loading",
        lambda m: m.allocate_slots(LOAD, 4),
        E.InvalidSequenceStateError,
        ("loading", "commit_external"),
    ),
    ("step loading", lambda m: m.step([LOAD], 4).raise_for_error(), E.InvalidSequenceStateError, ("loading",)),
    ("append loading", lambda m: m.append_tokens(LOAD, [5]), E.InvalidSequenceStateError, ("loading",)),
    ("accept loading", lambda m: m.accept_drafts(LOAD, 0), E.InvalidSequenceStateError, ("loading",)),
    ("fork loading", lambda m: m.fork(LOAD, 10), E.InvalidSequenceStateError, ("loading", "fork")),
    ("swap_out loading", lambda m: m.swap_out([RUN, LOAD]), E.InvalidSequenceStateError, ("loading", "swap_out")),
    ("swap_in loading", lambda m: m.swap_in([LOAD]), E.InvalidSequenceStateError, ("loading", "swap_in")),
    (
        "rollback loading",
        lambda m: m.rollback(LOAD, 0, poisoned=False),
        E.InvalidSequenceStateError,
        ("loading", "rollback"),
    ),
    ("rollback swapped", lambda m: m.rollback(SWAP, 0, poisoned=True), E.InvalidSequenceStateError, ("swapped",)),
    ("rollback preempted", lambda m: m.rollback(PRE, 0, poisoned=True), E.InvalidSequenceStateError, ("preempted",)),
    (
        "free_deferred swapped",
        lambda m: m.free_deferred(SWAP),
        E.InvalidSequenceStateError,
        ("swapped", "free_deferred"),
    ),
    (
        "preempt_deferred swapped",
        lambda m: m.preempt_deferred([RUN, LOAD, SWAP]),
        E.InvalidSequenceStateError,
        ("swapped", "preempt_deferred needs it running, loading or preempted"),
    ),
    (
        "preempt swapped",
        lambda m: m.preempt([RUN, LOAD, SWAP]),
        E.InvalidSequenceStateError,
        ("swapped", "preempt needs it running, loading or preempted"),
    ),
]


def _ids(rows: list[Bad]) -> list[str]:
    return [r[0] for r in rows]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,call,exc,needles", WRONG_VALUES, ids=_ids(WRONG_VALUES))
def test_wrong_values_are_refused_unchanged(
    layout: str, name: str, call: Callable[[KVCacheManager], Any], exc: type[E.PagedKVError], needles: tuple[str, ...]
) -> None:
    m = populated(layout)
    refused(m, lambda: call(m), exc, *needles)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,call,exc,needles", UNKNOWN_SEQS, ids=_ids(UNKNOWN_SEQS))
def test_unknown_sequences_are_refused_unchanged(
    layout: str, name: str, call: Callable[[KVCacheManager], Any], exc: type[E.PagedKVError], needles: tuple[str, ...]
) -> None:
    m = populated(layout)
    refused(m, lambda: call(m), exc, *needles)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,call,exc,needles", WRONG_STATES, ids=_ids(WRONG_STATES))
def test_wrong_states_are_refused_unchanged(
    layout: str, name: str, call: Callable[[KVCacheManager], Any], exc: type[E.PagedKVError], needles: tuple[str, ...]
) -> None:
    m = populated(layout)
    refused(m, lambda: call(m), exc, *needles)


def test_every_refusal_is_a_pagedkv_error_and_a_builtin() -> None:
    # Callers catching the builtin keep working: ValueError for bad values, KeyError for
    # unknown ids, RuntimeError for wrong states, MemoryError for a reservation too large.
    m = populated("one")
    with pytest.raises(ValueError):
        m.rollback(RUN, 8, poisoned=1)  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        m.commit_external(UNKNOWN, 0)
    with pytest.raises(RuntimeError):
        m.commit_external(RUN, 24)
    with pytest.raises(MemoryError):
        m.allocate_external(NEW, 4, reserve_blocks=m.num_free_blocks)
    assert m.status(NEW) == "running" and m.num_blocks_held(NEW) == [0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flags_take_bools_only(layout: str) -> None:
    # numpy.bool_ is a bool; None means the default for the optional flag.
    m = populated(layout)
    m.allocate_external(NEW, 8, staged=np.bool_(True))  # type: ignore[arg-type]
    assert m.status(NEW) == "loading" and m.num_staged_tokens(NEW) == 8
    table = m.block_table(RUN, 0).tolist()
    assert m.rollback(RUN, 20, poisoned=np.bool_(False)) == 0  # type: ignore[arg-type]
    assert m.num_computed_tokens(RUN) == 20 and m.block_table(RUN, 0).tolist() == table
    m.add_sequence(6, toks(24, 6))
    a = m.allocate_external(6, 8, staged=None)  # type: ignore[arg-type]
    assert m.status(6) == "running" and a.num_context_tokens == 8
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_new_tokens_are_capped_at_the_tokens_left(layout: str) -> None:
    # As allocate_slots: num_new_tokens past the end schedules what is left (documented);
    # num_external_tokens past the end is refused (above).
    for n in (20, 21, 2**40):
        m = populated(layout)
        assert m.num_blocks_needed_external(NEW, 4, n) == m.num_blocks_needed_external(NEW, 4, 20)
        a = m.allocate_external(NEW, 4, n)
        assert (a.num_cached_tokens, a.num_context_tokens, a.num_scheduled_tokens) == (0, 4, 20)
        assert m.num_computed_tokens(NEW) == 24
        m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_of_blocks_loads_change_nothing(layout: str) -> None:
    m = populated(layout)
    take, release = m.num_blocks_needed_external(NEW, 24)
    assert release == 0
    m.add_sequence(7, toks(400, 7))
    too_many, _ = m.num_blocks_needed_external(7, 400)
    assert too_many > m.num_free_blocks
    for staged in (False, True):
        refused(
            m,
            partial(m.allocate_external, 7, 400, staged=staged),
            E.OutOfBlocksError,
            "out of KV cache blocks",
        )
    reserve = m.num_free_blocks - take + 1
    err = refused(
        m,
        lambda: m.allocate_external(NEW, 24, staged=True, reserve_blocks=reserve),
        E.OutOfBlocksError,
        str(take + reserve),
    )
    assert isinstance(err, MemoryError)
    m.allocate_external(NEW, 24, staged=True, reserve_blocks=reserve - 1)
    assert m.num_free_blocks == reserve - 1
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_evicting_unregistered_blocks_is_a_no_op(layout: str) -> None:
    # Free blocks, staged blocks and an empty list: nothing registered, nothing to drop.
    m = populated(layout)
    free_block = m.num_blocks - 1
    assert m.pool.ref_count(free_block) == 0 and m.pool.block_hash(free_block) is None
    staged = [int(b) for t in m.block_tables(LOAD) for b in t if b != 0]
    before = state(m)
    assert m.evict_blocks([free_block]) == 0
    assert m.evict_blocks(staged) == 0
    assert m.evict_blocks([]) == 0
    assert m.evict_blocks(np.array([], dtype=np.int64)) == 0
    assert state(m) == before
    assert m.take_events() == []
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_evicting_a_block_twice_in_one_call_counts_it_once(layout: str) -> None:
    m, once = populated(layout), populated(layout)
    b = int(m.block_table(RUN, 0)[2])
    assert m.evict_blocks([b, b]) == once.evict_blocks([b]) == 4  # logical blocks 2..5 of group 0
    assert state(m) == state(once)
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_release_deferred_twice_is_refused(layout: str) -> None:
    m = populated(layout)
    held = sum(m.num_blocks_held(RUN))
    h = m.free_deferred(RUN)
    assert m.num_deferred_blocks() == held
    assert m.release_deferred(h) == held
    assert m.num_deferred_blocks() == 0
    refused(m, lambda: m.release_deferred(h), E.InvalidArgumentError, "handle", str(h), "released already")
    refused(m, lambda: m.deferred_blocks(h), E.InvalidArgumentError, "handle", str(h))
    refused(m, lambda: m.free_deferred(RUN), E.UnknownSequenceError, str(RUN))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_free_deferred_of_a_loading_sequence_keeps_staged_blocks_unregistered(layout: str) -> None:
    # An abort mid-load on a consumer with asynchronous scheduling: the staged blocks stay
    # held (a worker may still write them) but never become prefix hits, and are freed as
    # plain (uncached) blocks by release_deferred.
    m = make(layout)
    m.add_sequence(1, toks(8, 1))
    m.allocate_slots(1, 8)
    assert m.free(1)
    prompt = toks(8, 1) + toks(16, 2)
    m.add_sequence(2, prompt)
    a = m.allocate_external(2, 12, staged=True)
    assert (a.num_cached_tokens, a.num_context_tokens) == (8, 20)
    staged = [int(b) for b in m.block_table(2, 0)[2:]]
    m.take_events()
    h = m.free_deferred(2)
    kept = m.deferred_blocks(h).tolist()
    assert set(staged) <= set(kept)
    assert [m.pool.block_hash(b) for b in staged] == [None] * 3
    assert all(m.pool.ref_count(b) == 1 for b in staged)
    m.check_invariants()
    m.add_sequence(2, prompt)
    assert m.lookup_prefix(2) == 8, "staged blocks are never a hit"
    assert m.take_events() == [], "nothing announced: the staged blocks were never stored"
    assert m.release_deferred(h) == len(kept)
    assert all(m.pool.ref_count(b) == 0 and m.pool.block_hash(b) is None for b in staged)
    assert m.lookup_prefix(2) == 8
    m.check_invariants()


def test_hybrid_rollback_into_released_window_is_refused() -> None:
    # Decoded one token at a time, the windowed group released the blocks out of its window:
    # a rollback whose window would read them is refused (preempt to recompute instead).
    m = make("hybrid")
    m.add_sequence(1, toks(24, 1))
    m.allocate_slots(1, 24)
    for i in range(16):
        m.append_tokens(1, [5 + i])
        m.allocate_slots(1, 1)
    assert m.block_table(1, 1).tolist()[:8] == [0] * 8
    m.take_events()
    for n in (0, 8, 20, 32, 36):
        refused(
            m,
            partial(m.rollback, 1, n, poisoned=True),
            E.InvalidArgumentError,
            "num_computed_tokens",
            str(n),
            "group 1",
            seqs=[1],
        )
    assert m.rollback(1, 39, poisoned=False) == 0
    assert m.num_computed_tokens(1) == 39
    m.check_invariants()


@pytest.mark.parametrize("hit", [0, 16])
def test_hybrid_partial_commit_below_the_window_is_refused(hit: int) -> None:
    # The staged load took no windowed block below the window of H + E: a commit at a point
    # whose window reads those positions is refused, and the full commit still works.
    m = make("hybrid")
    prompt = toks(40, 1)
    if hit:
        m.add_sequence(9, prompt[:hit])
        m.allocate_slots(9, hit)
        assert m.free(9)
    m.add_sequence(1, prompt)
    a = m.allocate_external(1, 32 - hit, staged=True)
    assert (a.num_cached_tokens, a.num_context_tokens) == (hit, 32)
    assert m.block_table(1, 1).tolist()[:6] == [0] * 6
    m.take_events()
    for v in range(hit, 32, 4):
        refused(
            m,
            partial(m.commit_external, 1, v),
            E.InvalidArgumentError,
            "num_valid_tokens",
            str(v),
            "group 1",
            seqs=[1],
        )
    for v in (hit - 4, 33):
        if v >= 0:
            refused(m, partial(m.commit_external, 1, v), E.InvalidArgumentError, f"[{hit}, 32]", seqs=[1])
    m.commit_external(1, 32)
    assert m.status(1) == "running" and m.num_computed_tokens(1) == 32
    m.check_invariants()
