"""The prefix cache's host tier through the Python API (docs/design.md, "Host tier").

Exact values throughout: block ids are deterministic (fresh blocks in ascending order, the
uncached free blocks LIFO, then the device LRU front), host blocks are handed out from 0 up.
"""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
from pagedkv import errors as E

A = list(range(1, 10))  # two full blocks of 4 tokens, then one token
B = list(range(11, 20))


def manager(num_blocks: int = 4, host: int = 8, min_seen: int = 1) -> pagedkv.KVCacheManager:
    cfg = pagedkv.CacheConfig(num_blocks, 4, num_host_blocks=host, host_admission_min_seen=min_seen, enable_events=True)
    return pagedkv.KVCacheManager(cfg)


def empty_step(m: pagedkv.KVCacheManager) -> tuple[list[list[int]], list[list[int]]]:
    """An empty step (the executor ran the previous plans); its host stores and loads
    (``(group, src, dst)`` rows)."""
    out = m.step([], [])
    assert out.error is None
    return out.host_stores.tolist(), out.host_loads.tolist()


def a_evicted_to_host(m: pagedkv.KVCacheManager) -> list[list[int]]:
    """A computed and freed, then B computed: B evicts A's two cached blocks (2, then 1).
    Returns the host stores of B's step (``(group, device, host)`` rows)."""
    m.add_sequence(1, A)
    m.step([1], [9])
    empty_step(m)
    m.free(1)
    m.add_sequence(2, B)
    stores: list[list[int]] = m.step([2], [9]).host_stores.tolist()
    assert m.block_table(2).tolist() == [3, 2, 1]
    m.free(2)
    m.check_invariants()
    return stores


def test_an_evicted_prefix_comes_back_as_host_loads() -> None:
    m = manager()
    # A's deepest block (device 2) went to host block 0, its first (device 1) to host 1, in
    # the output of the step whose allocation evicted them.
    assert a_evicted_to_host(m) == [[0, 2, 0], [0, 1, 1]]
    assert empty_step(m) == ([], [])
    m.add_sequence(3, A)
    assert m.lookup_prefix(3) == 8
    assert m.num_blocks_needed(3, 9) == (3, 0)  # two loads + one fresh block
    assert m.num_blocks_owed([3]) == 3
    out = m.step([3], [9])
    assert out.num_cached_tokens.tolist() == [8]
    assert out.context_lens.tolist() == [8] and out.seq_lens.tolist() == [9]
    assert out.new_block_ids.tolist() == [1, 2, 3]
    assert out.host_loads.dtype == np.int32
    # Host 1 (A's first block) into device 1, host 0 into device 2; B's evicted blocks are
    # stored to host 2 and 3 in the same output, ahead of the loads.
    assert out.host_loads.tolist() == [[0, 1, 1], [0, 0, 2]]
    assert out.host_stores.tolist() == [[0, 2, 2], [0, 3, 3]]
    assert out.slot_mapping.tolist() == [3 * 4]  # the one recomputed token, in block 3
    s = m.stats()
    assert (s.host_hits_tokens, s.prefix_hits_tokens, s.host_loads_blocks, s.host_stores_blocks) == (8, 8, 2, 4)
    assert (s.num_host_blocks, s.host_used) == (8, 4)
    d = s.as_dict()
    assert {k: d[k] for k in ("host_hits_tokens", "host_used", "num_host_blocks")} == {
        "host_hits_tokens": 8,
        "host_used": 4,
        "num_host_blocks": 8,
    }
    m.check_invariants()


def test_events_name_the_tier() -> None:
    m = manager()
    a_evicted_to_host(m)
    h = pagedkv.KVIndexer(4).block_hashes(A)
    events = m.take_events()
    host_stored = [e for e in events if isinstance(e, pagedkv.BlockStored) and e.tier == "host"]
    # Deepest first (the device LRU's order), each with its parent and tokens.
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in host_stored] == [
        ([h[1]], h[0], A[4:8]),
        ([h[0]], None, A[:4]),
    ]
    removed = [e for e in events if isinstance(e, pagedkv.BlockRemoved)]
    assert [(e.block_hashes, e.tier) for e in removed] == [([h[1], h[0]], "device")]
    assert all(e.tier == "device" for e in events if isinstance(e, pagedkv.BlockStored) and e not in host_stored)
    m.reset_prefix_cache()
    assert [type(e) for e in m.take_events()] == [pagedkv.AllBlocksCleared]


def test_host_eviction_is_lru_and_announced() -> None:
    # Two host blocks: A's two blocks fill them; B's evicted blocks then replace A's
    # (least recently stored first: A's deepest block went in first).
    m = manager(host=2)
    assert a_evicted_to_host(m) == [[0, 2, 0], [0, 1, 1]]
    m.take_events()
    m.add_sequence(3, [30, 31, 32, 33, 34])
    empty_step(m)
    out = m.step([3], [5])  # takes block 1 (uncached), then evicts B's deepest block 2
    assert m.block_table(3).tolist() == [1, 2]
    assert out.host_stores.tolist() == [[0, 2, 0]]
    hb = pagedkv.KVIndexer(4).block_hashes(B)
    ha = pagedkv.KVIndexer(4).block_hashes(A)
    ev = m.take_events()
    assert [(e.block_hashes, e.tier) for e in ev if isinstance(e, pagedkv.BlockRemoved)] == [
        ([hb[1]], "device"),
        ([ha[1]], "host"),
    ]
    # A's first block is still on host, its second is gone: the lookup stops after one block.
    m.add_sequence(4, A)
    assert m.lookup_prefix(4) == 4
    m.check_invariants()


def run_once(m: pagedkv.KVCacheManager, seq: int, prompt: list[int]) -> None:
    """``prompt`` computed in one step, the executor runs the step's plans, then freed."""
    m.add_sequence(seq, prompt)
    assert m.step([seq], [len(prompt)]).error is None
    empty_step(m)
    m.free(seq)


@pytest.mark.parametrize(("eviction", "hit_after_scan"), [("lru", 0), ("arc", 8)])
def test_a_one_off_scan_flushes_a_reused_prefix_under_lru_only(eviction: str, hit_after_scan: int) -> None:
    # Four host blocks. A goes to host (evicted by B) and comes back (loaded: used twice);
    # then six one-off prompts of two full blocks each pass through, 12 blocks stored.
    cfg = pagedkv.CacheConfig(4, 4, num_host_blocks=4, host_admission_min_seen=1, host_eviction=eviction)
    m = pagedkv.KVCacheManager(cfg)
    run_once(m, 1, A)
    run_once(m, 2, B)
    m.add_sequence(3, A)
    assert m.lookup_prefix(3) == 8
    assert m.step([3], [9]).host_loads.shape == (2, 3)
    empty_step(m)
    m.free(3)
    for i in range(6):
        run_once(m, 10 + i, [1000 * (i + 1) + j for j in range(9)])
    # LRU evicted A's blocks to the scan; ARC kept them in T2 (the scan cycles through T1).
    m.add_sequence(99, A)
    assert m.lookup_prefix(99) == hit_after_scan
    assert m.stats().host_used == 4
    m.check_invariants()


def test_host_hits_count_first_lookups_and_loads_count_every_copy() -> None:
    # host_hits_tokens is part of prefix_hits_tokens (a sequence's first lookup only, so a
    # recompute preemption does not inflate the hit rate, vLLM #25780); host_loads_blocks
    # counts every copy planned, a resume's included.
    m = manager()
    a_evicted_to_host(m)
    m.add_sequence(3, A)
    assert m.step([3], [9]).host_loads.tolist() == [[0, 1, 1], [0, 0, 2]]
    empty_step(m)
    s = m.stats()
    assert (s.host_hits_tokens, s.prefix_hits_tokens, s.host_loads_blocks) == (8, 8, 2)
    m.preempt([3])
    run_once(m, 4, list(range(21, 30)))  # evicts A's blocks from the device again
    out = m.step([3], [9])  # the resume finds A on host and loads it again
    assert out.host_loads.tolist() == [[0, 1, 1], [0, 0, 2]] and out.num_cached_tokens.tolist() == [8]
    empty_step(m)
    s = m.stats()
    assert (s.host_hits_tokens, s.prefix_hits_tokens, s.host_loads_blocks) == (8, 8, 4)
    assert s.prefix_queries_tokens == 4 * 9  # A, B, A, C: the resume is not a new query
    m.check_invariants()


def test_stores_only_after_the_admission_count() -> None:
    m = manager(min_seen=2)
    assert a_evicted_to_host(m) == []  # A was used once: not admitted
    m.add_sequence(3, A)
    assert m.lookup_prefix(3) == 0
    m.step([3], [9])  # A computed again: seen twice
    empty_step(m)
    m.free(3)
    m.add_sequence(4, B)
    # A's two blocks are stored now; B (computed once before) is not.
    assert m.step([4], [9]).host_stores.tolist() == [[0, 2, 0], [0, 1, 1]]
    m.add_sequence(5, A)
    assert m.lookup_prefix(5) == 8


def test_a_pool_that_fits_one_request_with_its_loads_runs_it() -> None:
    m = manager()
    a_evicted_to_host(m)
    empty_step(m)
    m.add_sequence(3, A)
    m.add_sequence(4, [50, 51])
    m.step([4], [2])
    before = (m.stats(), m.pool.free_queue().tolist(), m.block_table(3).tolist())
    assert m.num_blocks_needed(3, 9) == (3, 0) and m.stats().free == 2
    out = m.step([3], [9])
    assert isinstance(out.error, E.OutOfBlocksError)
    assert (out.error.requested, out.error.available) == (3, 2)
    assert (m.stats(), m.pool.free_queue().tolist(), m.block_table(3).tolist()) == before
    assert empty_step(m) == ([], [])
    m.check_invariants()
    m.free(4)
    assert m.num_blocks_needed(3, 9) == (m.stats().free, 0) == (3, 0)
    out = m.step([3], [9])
    out.raise_for_error()
    assert out.num_cached_tokens.tolist() == [8]
    m.check_invariants()


def test_a_host_block_being_loaded_is_pinned_until_the_next_step_returns() -> None:
    m = manager(num_blocks=6, host=1)
    c = list(range(100, 120))
    m.add_sequence(1, A[:5])
    m.step([1], [5])
    empty_step(m)
    m.free(1)
    m.add_sequence(2, c)
    assert m.step([2], [20]).host_stores.tolist() == [[0, 1, 0]]  # A's first block -> host 0
    m.free(2)
    m.add_sequence(3, A[:5])
    m.add_sequence(4, [60, 61, 62, 63, 64])
    out = m.step([3, 4], [5, 5])
    # The load pins host block 0: the evictions of this step store nothing.
    assert (out.host_stores.tolist(), out.host_loads.tolist()) == ([], [[0, 0, 1]])
    m.free(4)
    m.add_sequence(5, [70, 71, 72, 73, 74])
    out = m.step([5], [5])
    assert out.host_stores.tolist() == []  # pinned until this step returned
    m.free(5)
    m.add_sequence(6, [80, 81, 82, 83, 84])
    assert m.step([6], [5]).host_stores.tolist() == [[0, 4, 0]]
    m.check_invariants()


def test_take_host_transfers_serves_callers_outside_step() -> None:
    m = manager()
    m.add_sequence(1, A)
    m.allocate_slots(1, 9)
    empty_step(m)
    m.free(1)
    m.add_sequence(2, B)
    m.allocate_slots(2, 9)  # evicts A's blocks outside step
    m.free(2)
    stores, loads = m.take_host_transfers()
    assert (stores.tolist(), loads.tolist()) == ([[0, 2, 0], [0, 1, 1]], [])
    assert stores.dtype == np.int32 and loads.shape == (0, 3)
    m.add_sequence(3, A)
    a = m.allocate_slots(3, 9)
    assert (a.num_cached_tokens, a.new_block_ids.tolist()) == (8, [1, 2, 3])
    stores, loads = m.take_host_transfers()
    assert loads.tolist() == [[0, 1, 1], [0, 0, 2]]
    assert m.take_host_transfers()[1].shape == (0, 3)


def test_reset_clears_the_host_tier_and_waits_for_planned_loads() -> None:
    m = manager()
    a_evicted_to_host(m)
    empty_step(m)
    m.add_sequence(3, A)
    m.allocate_slots(3, 9)
    m.free(3)
    with pytest.raises(E.CacheInUseError):
        m.reset_prefix_cache()  # the two load destinations are held until handed out
    m.take_host_transfers()
    m.reset_prefix_cache()
    m.add_sequence(4, A)
    assert m.lookup_prefix(4) == 0
    # No host block holds a cached block; the two being loaded stay pinned until the next
    # step returns, then they are free too.
    assert m.stats().host_used == 2
    m.check_invariants()
    empty_step(m)
    assert m.stats().host_used == 0
    m.check_invariants()


def test_config_fields_and_bad_values() -> None:
    c = pagedkv.CacheConfig(8, 4, num_host_blocks=16, host_admission_min_seen=3)
    assert (c.num_host_blocks, c.host_admission_min_seen, c.host_eviction) == (16, 3, "lru")
    assert 'num_host_blocks=16, host_admission_min_seen=3, host_eviction="lru"' in repr(c)
    a = pagedkv.CacheConfig(8, 4, num_host_blocks=16, host_eviction="arc")
    assert a.host_eviction == "arc" and 'host_eviction="arc"' in repr(a)
    assert a != pagedkv.CacheConfig(8, 4, num_host_blocks=16)
    with pytest.raises(E.InvalidConfigError, match='expected one of "lru", "arc"'):
        pagedkv.CacheConfig(8, 4, num_host_blocks=4, host_eviction="LRU")
    d = pagedkv.CacheConfig(8, 4)
    assert (d.num_host_blocks, d.host_admission_min_seen, d.host_eviction) == (0, 2, "lru")
    assert "host" not in repr(d)
    for kwargs, field in [
        ({"num_host_blocks": 4, "host_eviction": "fifo"}, "host_eviction"),
        ({"num_host_blocks": 4, "host_eviction": 1}, "host_eviction"),
        ({"num_host_blocks": 4, "host_admission_min_seen": 0}, "host_admission_min_seen"),
        ({"num_host_blocks": 4, "enable_prefix_caching": False}, "num_host_blocks"),
        ({"num_host_blocks": -1}, "num_host_blocks"),
        ({"num_host_blocks": 2**28 + 1}, "num_host_blocks"),
    ]:
        with pytest.raises(E.InvalidConfigError) as err:
            pagedkv.CacheConfig(8, 4, **kwargs)
        assert isinstance(err.value, ValueError)
        assert field in str(err.value), (kwargs, str(err.value))


def test_without_a_host_tier_nothing_changes() -> None:
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(4, 4))
    m.add_sequence(1, A)
    m.step([1], [9])
    m.free(1)
    m.add_sequence(2, B)
    out = m.step([2], [9])
    assert out.host_stores.shape == (0, 3) and out.host_loads.shape == (0, 3)
    s = m.stats()
    assert (s.num_host_blocks, s.host_used, s.host_hits_tokens, s.host_stores_blocks) == (0, 0, 0, 0)


def test_indexer_reports_host_residency_apart() -> None:
    m = manager()
    a_evicted_to_host(m)
    ix = pagedkv.KVIndexer(4)
    ix.apply(7, 0, m.take_events())
    # A is only in worker 7's host tier now: no device overlap, two blocks in any tier.
    assert ix.overlap(A) == {7: 0}
    assert ix.overlap_by_tier(A) == {7: (0, 2)}
    assert ix.overlap_by_tier(B) == {7: (2, 2)}
    # vLLM's wire events: medium "CPU" is the host tier.
    h = ix.block_hashes([1, 2, 3, 4, 0])
    ix.apply(8, 0, [["BlockStored", h, None, [1, 2, 3, 4], 4, None, "CPU"]])
    assert ix.overlap_by_tier([1, 2, 3, 4, 0])[8] == (0, 1)
