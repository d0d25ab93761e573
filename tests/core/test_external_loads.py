"""KV loaded by a KV connector through ``pagedkv.KVCacheManager``: ``allocate_external``
(synchronous, or staged for an asynchronous load), ``commit_external``, and the typed errors
of calls a loading sequence refuses. One full-attention group and a full + sliding-window
layout; every refused call leaves tables, statuses and the pool as they were.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv import CacheConfig, KVCacheGroupSpec, KVCacheManager

BS = 4
WINDOW = 8


def make(layout: str, num_blocks: int = 64, **kw: Any) -> KVCacheManager:
    """A manager of one full group (``"one"``) or full + sliding window 8 (``"hybrid"``)."""
    if layout == "one":
        cfg = CacheConfig(num_blocks, BS, enable_events=True, **kw)
    else:
        groups = [
            KVCacheGroupSpec("full", BS, 8),
            KVCacheGroupSpec("sliding_window", BS, 8, window=WINDOW),
        ]
        cfg = CacheConfig(num_blocks, groups=groups, layer_groups=[0, 1], enable_events=True, **kw)
    return KVCacheManager(cfg)


def toks(n: int, salt: int) -> list[int]:
    return [i * 7 + salt * 1000 + 1 for i in range(n)]


def stored(events: list[Any]) -> int:
    """Block hashes announced by the ``BlockStored`` events."""
    return sum(len(e.block_hashes) for e in events if isinstance(e, pagedkv.BlockStored))


def snapshot(m: KVCacheManager, seqs: list[int]) -> Any:
    """Everything a refused call must leave unchanged."""
    per_seq = [
        (
            s,
            m.status(s),
            m.num_computed_tokens(s),
            m.num_tokens(s),
            [t.tolist() for t in m.block_tables(s)],
        )
        for s in seqs
    ]
    pool = m.pool
    refs = [pool.ref_count(b) for b in range(1, m.num_blocks)]
    hashed = [pool.block_hash(b) for b in range(1, m.num_blocks)]
    return per_seq, m.num_free_blocks, refs, hashed


LAYOUTS = ["one", "hybrid"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_staged_blocks_stay_invisible_until_commit(layout: str) -> None:
    m = make(layout)
    m.add_sequence(1, toks(24, 1))
    m.add_sequence(2, toks(24, 1))
    a = m.allocate_external(1, 20, staged=True)
    assert (a.num_cached_tokens, a.num_context_tokens, a.num_scheduled_tokens) == (0, 20, 0)
    assert m.status(1) == "loading"
    assert m.num_staged_tokens(1) == 20
    tables = m.block_tables(1)
    held = [b for t in tables for b in t.tolist() if b != 0]
    assert all(m.pool.block_hash(b) is None for b in held)
    assert m.num_blocks - 1 - m.num_free_blocks == len(held)
    if layout == "hybrid":
        # Only blocks 3 and 4 hold the window of token 20 (tokens 13..19).
        assert tables[1].tolist()[:3] == [0, 0, 0]
    assert stored(m.take_events()) == 0
    assert m.lookup_prefix(2) == 0
    m.check_invariants()

    registered = m.commit_external(1, 20)
    assert registered == (5 if layout == "one" else 5 + 2)
    assert m.status(1) == "running"
    assert m.num_staged_tokens(1) == 0
    assert stored(m.take_events()) == registered
    assert m.lookup_prefix(2) == 20
    a = m.allocate_slots(1, 4)
    assert (a.num_context_tokens, a.num_scheduled_tokens) == (20, 4)
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_synchronous_load_registers_at_allocation(layout: str) -> None:
    m = make(layout)
    m.add_sequence(1, toks(8, 1))
    m.allocate_slots(1, 8)
    m.add_sequence(2, toks(8, 1) + toks(22, 3))
    need = m.num_blocks_needed_external(2, 17, 3)
    free = m.num_free_blocks
    a = m.allocate_external(2, 17, 3)
    assert free - m.num_free_blocks == need[0] - need[1]
    assert (a.num_cached_tokens, a.num_context_tokens, a.num_scheduled_tokens) == (8, 25, 3)
    assert m.status(2) == "running"
    assert m.num_computed_tokens(2) == 28
    # Full group: blocks 2..7 are new and registered now (seven full blocks in all).
    assert np.diff(a.new_block_indptr).tolist()[0] == 5
    assert all(m.pool.block_hash(int(b)) is not None for b in m.block_table(2, 0)[:7])
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_commit_and_spare_blocks(layout: str) -> None:
    m = make(layout)
    m.add_sequence(1, toks(24, 1))
    m.allocate_external(1, 20, staged=True)
    before = snapshot(m, [1])
    if layout == "hybrid":
        with pytest.raises(pagedkv.InvalidArgumentError, match="num_valid_tokens"):
            m.commit_external(1, 13)  # the window at 13 reads block 1, never loaded
        assert snapshot(m, [1]) == before
    valid = 13 if layout == "one" else 19
    registered = m.commit_external(1, valid)
    assert registered == (3 if layout == "one" else 4 + 1)
    assert m.num_computed_tokens(1) == valid
    a = m.allocate_slots(1, 24 - valid)
    assert np.diff(a.new_block_indptr).tolist()[0] == 1  # staged blocks are filled first
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loading_sequence_refuses_other_calls(layout: str) -> None:
    m = make(layout, num_cpu_blocks=16)
    m.add_sequence(1, toks(24, 1))
    m.allocate_external(1, 16, staged=True)
    before = snapshot(m, [1])
    state = pagedkv.InvalidSequenceStateError
    with pytest.raises(state, match="loading"):
        m.allocate_slots(1, 4)
    with pytest.raises(state):
        m.append_tokens(1, [5])
    with pytest.raises(state):
        m.fork(1, 9)
    with pytest.raises(state):
        m.swap_out([1])
    with pytest.raises(state):
        m.accept_drafts(1, 0)
    with pytest.raises(state):
        m.allocate_external(1, 4, staged=True)
    with pytest.raises(state):
        m.step([1], 4).raise_for_error()
    # What its remaining 8 tokens take once committed: the in-flight load's reservation.
    assert m.num_blocks_needed(1, 8)[0] == (2 if layout == "one" else 4)
    assert m.num_blocks_owed([1]) == (2 if layout == "one" else 4)
    assert snapshot(m, [1]) == before
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_abort_and_failed_load_release_staged_blocks(layout: str) -> None:
    m = make(layout)
    m.add_sequence(1, toks(8, 1))
    m.allocate_slots(1, 8)
    for s in (2, 3, 4):
        m.add_sequence(s, toks(8, 1) + toks(16, 2))
    m.allocate_external(2, 12, staged=True)
    m.allocate_external(3, 12, staged=True)
    m.take_events()
    hashed = sum(m.pool.block_hash(b) is not None for b in range(1, m.num_blocks))
    assert m.free(2)
    m.preempt([3])
    assert m.status(3) == "preempted"
    assert sum(m.pool.block_hash(b) is not None for b in range(1, m.num_blocks)) == hashed
    assert m.take_events() == []
    assert m.lookup_prefix(4) == 8
    m.allocate_external(3, 12, staged=True)
    assert m.status(3) == "loading"
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_external_allocations_change_nothing(layout: str) -> None:
    m = make(layout, num_blocks=7)
    m.add_sequence(1, toks(24, 1))
    m.add_sequence(2, toks(4, 2))
    m.allocate_slots(2, 4)
    before = snapshot(m, [1, 2])
    with pytest.raises(pagedkv.InvalidArgumentError, match="num_external_tokens"):
        m.allocate_external(1, 25, staged=True)
    with pytest.raises(pagedkv.InvalidArgumentError, match="num_new_tokens"):
        m.allocate_external(1, 8, 4, staged=True)
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.allocate_external(1, -1)
    with pytest.raises(pagedkv.InvalidSequenceStateError):
        m.allocate_external(2, 1, staged=True)
    with pytest.raises(pagedkv.InvalidSequenceStateError):
        m.commit_external(2, 4)
    with pytest.raises(pagedkv.UnknownSequenceError):
        m.allocate_external(7, 4)
    with pytest.raises(pagedkv.UnknownSequenceError):
        m.commit_external(7, 4)
    with pytest.raises(pagedkv.OutOfBlocksError):
        m.allocate_external(1, 23, 1)
    take, _ = m.num_blocks_needed_external(1, 8)
    reserve = m.num_free_blocks - take + 1
    with pytest.raises(pagedkv.OutOfBlocksError):
        m.allocate_external(1, 8, staged=True, reserve_blocks=reserve)
    assert snapshot(m, [1, 2]) == before
    m.allocate_external(1, 8, staged=True, reserve_blocks=reserve - 1)
    with pytest.raises(pagedkv.InvalidArgumentError, match="num_valid_tokens"):
        m.commit_external(1, 9)
    m.check_invariants()


def registered(m: KVCacheManager, blocks: Any) -> list[bool]:
    return [m.pool.block_hash(int(b)) is not None for b in blocks]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rewind_keeps_blocks_and_registrations(layout: str) -> None:
    m = make(layout)
    m.add_sequence(1, toks(24, 1))
    m.allocate_slots(1, 24)
    table = m.block_table(1, 0).tolist()
    m.take_events()
    assert m.rollback(1, 23, poisoned=False) == 0
    assert m.num_computed_tokens(1) == 23
    assert m.block_table(1, 0).tolist() == table
    assert all(registered(m, table))
    a = m.allocate_slots(1, 1)
    assert (a.num_context_tokens, a.num_scheduled_tokens) == (23, 1)
    assert len(a.new_block_ids) == 0 and len(a.copies) == 0
    assert m.take_events() == []
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_poisoned_rollback_unregisters_descendants(layout: str) -> None:
    m = make(layout, num_blocks=96)
    a = toks(24, 1)
    m.add_sequence(1, a)
    m.allocate_slots(1, 24)
    m.add_sequence(2, a[:16] + toks(8, 2))
    m.allocate_slots(2, 24)
    m.add_sequence(3, a + toks(8, 3))
    m.allocate_slots(3, 32)
    t1, t2, t3 = (m.block_table(s, 0).tolist() for s in (1, 2, 3))
    assert m.free(3)
    m.take_events()
    n = m.rollback(1, 8, poisoned=True)
    assert n >= 8
    assert registered(m, t1) == [True, True, False, False, False, False]
    assert registered(m, t2[4:6] + t3[6:8]) == [False] * 4
    assert [m.pool.ref_count(b) for b in t1[2:4]] == [2, 2]  # still held by seq 2
    assert [m.pool.ref_count(b) for b in t3[6:8]] == [0, 0]
    removed = [e for e in m.take_events() if isinstance(e, pagedkv.BlockRemoved)]
    assert sum(len(e.block_hashes) for e in removed) == n
    m.add_sequence(4, a)
    assert m.lookup_prefix(4) == 8
    m.check_invariants()
    m.allocate_slots(1, 16)  # recomputed in place, registered again
    assert all(registered(m, t1))
    assert m.lookup_prefix(4) == 20
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_evict_blocks(layout: str) -> None:
    m = make(layout)
    m.add_sequence(1, toks(24, 1))
    m.allocate_slots(1, 24)
    t = m.block_table(1, 0).tolist()
    before = snapshot(m, [1])
    with pytest.raises(pagedkv.InvalidBlockError):
        m.evict_blocks([t[0], 0])
    with pytest.raises(pagedkv.InvalidBlockError):
        m.evict_blocks(np.array([m.num_blocks], dtype=np.int32))
    assert snapshot(m, [1]) == before
    assert m.evict_blocks([t[3]]) == 3
    assert registered(m, t) == [True, True, True, False, False, False]
    m.add_sequence(2, toks(24, 1))
    assert m.lookup_prefix(2) == 12
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_rollbacks_change_nothing(layout: str) -> None:
    m = make(layout)
    m.add_sequence(1, toks(24, 1))
    m.allocate_slots(1, 24)
    m.add_sequence(2, toks(24, 2))
    m.allocate_external(2, 16, staged=True)
    before = snapshot(m, [1, 2])
    with pytest.raises(pagedkv.InvalidArgumentError, match="num_computed_tokens"):
        m.rollback(1, 25, poisoned=True)
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.rollback(1, -1, poisoned=True)
    with pytest.raises(pagedkv.InvalidSequenceStateError, match="loading"):
        m.rollback(2, 8, poisoned=True)
    with pytest.raises(pagedkv.UnknownSequenceError):
        m.rollback(9, 0, poisoned=False)
    with pytest.raises(TypeError):
        m.rollback(1, 8)  # type: ignore[call-arg]
    assert snapshot(m, [1, 2]) == before
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deferred_release_keeps_usage_then_frees_like_free(layout: str) -> None:
    m, plain = make(layout), make(layout)
    for x in (m, plain):
        x.add_sequence(1, toks(22, 1))
        x.allocate_slots(1, 22)
    used = m.pool.num_used
    last = int(m.block_table(1, 0)[-1])
    hashed = m.pool.num_hashed
    h = m.free_deferred(1)
    assert plain.free(1)
    assert m.num_sequences == 0
    assert m.pool.num_used == used
    assert m.num_deferred_blocks() == used
    kept = m.deferred_blocks(h)
    assert kept.dtype == np.int32 and len(kept) == used and int(kept[0]) == last
    assert m.pool.num_hashed == hashed
    _, ids = m.pool.cached_blocks()
    assert len(ids) == hashed
    m.add_sequence(2, toks(22, 1))
    assert m.lookup_prefix(2) == 20  # still registered
    m.check_invariants()
    assert m.release_deferred(h) == used
    assert m.pool.num_used == 0
    assert m.pool.free_queue().tolist() == plain.pool.free_queue().tolist()
    with pytest.raises(pagedkv.InvalidArgumentError, match="handle"):
        m.release_deferred(h)
    with pytest.raises(pagedkv.InvalidArgumentError, match="handle"):
        m.deferred_blocks(h + 1)
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deferred_preemption(layout: str) -> None:
    m = make(layout, num_cpu_blocks=8)
    m.add_sequence(1, toks(22, 1))
    m.allocate_slots(1, 22)
    m.add_sequence(2, toks(16, 2))
    m.allocate_external(2, 12, staged=True)
    m.add_sequence(3, toks(8, 3))
    m.allocate_slots(3, 8)
    m.swap_out([3])
    used = m.pool.num_used
    before = snapshot(m, [1, 2, 3])
    with pytest.raises(pagedkv.InvalidSequenceStateError):
        m.preempt_deferred([1, 3])
    with pytest.raises(pagedkv.InvalidSequenceStateError):
        m.free_deferred(3)
    with pytest.raises(pagedkv.UnknownSequenceError):
        m.free_deferred(9)
    assert snapshot(m, [1, 2, 3]) == before
    h = m.preempt_deferred([1, 2])
    assert (m.status(1), m.status(2)) == ("preempted", "preempted")
    assert m.pool.num_used == used
    a = m.allocate_slots(1, 22)
    assert a.num_cached_tokens == 20
    m.check_invariants()
    m.release_deferred(h)
    assert m.pool.num_used == sum(m.num_blocks_held(1))
    m.check_invariants()
