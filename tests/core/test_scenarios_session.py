"""Regression scenario S4 (double free, docs/design.md "Regression scenarios") on
``pagedkv.HostBlockPool``, the host tier behind vLLM's offloading interface: a store rolled back
twice is refused with nothing changed, and a rolled-back block is handed out again exactly once,
never while a load pins another key's block, under both eviction policies."""

from __future__ import annotations

import pytest

import pagedkv
from pagedkv import HostBlockPool


def key(i: int) -> bytes:
    """A vLLM-style offload key: 32-byte block hash + 4-byte group 0."""
    return bytes([i]) * 32 + bytes(4)


def snapshot(p: HostBlockPool, keys: list[bytes]) -> tuple[object, ...]:
    return (p.num_used, p.num_held, tuple(p.state(k) for k in keys), tuple(sorted(p.counters().items())))


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_s4_host_pool_double_rollback_is_refused_and_no_block_is_handed_out_twice(eviction: str) -> None:
    p = HostBlockPool(3, eviction=eviction)
    keys = [key(i) for i in range(6)]
    out = p.prepare_store([key(0), key(1)])
    assert out is not None
    to_store, ids, evicted = out
    assert to_store == [key(0), key(1)] and evicted == [] and len(set(ids.tolist())) == 2
    p.complete_store([key(0)], success=False)  # key 0's block goes back, unstored
    before = snapshot(p, keys)
    assert before[:3] == (1, 1, (0, 1, 0, 0, 0, 0))
    with pytest.raises(pagedkv.InvalidArgumentError, match="no store"):
        p.complete_store([key(0)], success=False)
    assert snapshot(p, keys) == before
    p.complete_store([key(1)])
    held = int(ids[1])
    # Two more keys take the two free blocks (key 0's among them), each once.
    out = p.prepare_store([key(2), key(3)])
    assert out is not None
    again = out[1].tolist()
    assert len(set(again)) == 2 and held not in again and out[2] == []
    p.complete_store(out[0])
    # Key 1 pinned by a load: two new keys evict keys 2 and 3, never key 1's block.
    assert p.prepare_load([key(1)]).tolist() == [held]
    out = p.prepare_store([key(4), key(5)])
    assert out is not None
    assert sorted(out[1].tolist()) == sorted(again) and sorted(out[2]) == [key(2), key(3)]
    p.complete_store(out[0])
    assert (p.num_used, p.num_held) == (3, 1)  # key 1 still pinned
    p.check_invariants()
    p.complete_load([key(1)])
    assert p.num_held == 0
    with pytest.raises(pagedkv.InvalidArgumentError, match="no load"):
        p.complete_load([key(1)])
    p.check_invariants()
