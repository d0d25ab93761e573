"""The binding of the core calls a model-based drafter (EAGLE / MTP) needs:
``allocate_slots(..., num_lookahead_slots=L)`` (slots past the scheduled tokens whose tokens do
not exist yet, held as spare blocks), ``num_blocks_needed_with_drafts(..., L)``,
``lookup_prefix_group`` (one group's hit alone) and ``set_hit_limit`` (the hit cap)."""

from __future__ import annotations

import pytest

import pagedkv
from pagedkv import CacheConfig, KVCacheGroupSpec, KVCacheManager

BS = 16


def _manager(num_blocks: int = 64) -> KVCacheManager:
    groups = [KVCacheGroupSpec("full", BS, 8), KVCacheGroupSpec("sliding_window", BS, 8, window=32)]
    return KVCacheManager(CacheConfig(num_blocks, groups=groups, layer_groups=[0, 1]))


def test_lookahead_slots_take_spare_blocks_in_every_group() -> None:
    m = _manager()
    m.add_sequence(0, list(range(100, 140)))
    assert m.num_blocks_needed_with_drafts(0, 30, 0, 3) == (6, 0)  # 33 positions, 2 groups
    a = m.allocate_slots(0, 30, None, num_lookahead_slots=3)
    assert a.num_scheduled_tokens == 30
    assert [len(m.block_table(0, g)) for g in (0, 1)] == [3, 3]
    assert m.num_computed_tokens(0) == 30
    # The next chunk (to 40, + 3 lookahead) fills the spare blocks.
    a = m.allocate_slots(0, 10, None, num_lookahead_slots=3)
    assert len(a.new_block_ids) == 0
    m.check_invariants()
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.allocate_slots(0, 1, None, num_lookahead_slots=-1)


def test_hit_limit_and_per_group_lookup() -> None:
    m = _manager()
    prompt = list(range(200, 264))
    m.add_sequence(0, prompt)
    m.allocate_slots(0, 64)
    m.add_sequence(1, prompt)
    assert m.lookup_prefix(1) == 48
    assert m.lookup_prefix_group(1, 0, 64) == 64
    assert m.lookup_prefix_group(1, 1, 64) == 64
    m.set_hit_limit(1, 32)
    assert m.lookup_prefix(1) == 32
    assert m.allocate_slots(1, 64).num_cached_tokens == 32
    m.add_sequence(2, prompt)
    m.set_hit_limit(2, 0)
    assert m.lookup_prefix(2) == 0
    m.set_hit_limit(2, None)
    assert m.lookup_prefix(2) == 48
    with pytest.raises(pagedkv.UnknownSequenceError):
        m.set_hit_limit(9, None)
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.lookup_prefix_group(2, 2, 64)
    m.check_invariants()
