"""How many host stores one step output plans (docs/design.md, "Host tier", Store).

An allocation that evicts more cached blocks than the host tier holds hands out at most one
store per host block: those the tier's eviction policy keeps. Before, every evicted block got
a store and later stores of the same output overwrote earlier ones (60 ``host_stores`` rows
onto 8 host blocks, 52 device-to-host copies wasted). One group and two, both eviction
policies.
"""

from __future__ import annotations

import pytest

import pagedkv
from pagedkv import KVCacheGroupSpec

BS = 4
HOST = 8


def toks(n: int, salt: int) -> list[int]:
    return [i * 7 + salt * 100_000 + 1 for i in range(n)]


@pytest.mark.parametrize("eviction", pagedkv.HOST_EVICTIONS)
def test_one_step_output_stores_at_most_the_host_blocks(eviction: str) -> None:
    cfg = pagedkv.CacheConfig(
        64, BS, num_host_blocks=HOST, host_admission_min_seen=1, host_eviction=eviction, enable_events=True
    )
    m = pagedkv.KVCacheManager(cfg)
    a = toks(60 * BS, 1)
    m.add_sequence(1, a)
    assert m.step([1], [60 * BS]).error is None  # 60 full blocks, all cached
    a_table = m.block_table(1).tolist()
    m.free(1)
    m.take_events()
    # Seq 2 takes all 63 usable blocks: 3 uncached, then A's 60 cached ones, tail first.
    m.add_sequence(2, toks(63 * BS, 2))
    out = m.step([2], [63 * BS])
    assert out.error is None
    m.check_invariants()
    offered = [e for e in m.take_events() if isinstance(e, pagedkv.BlockStored) and e.tier == "host"]
    assert sum(len(e.block_hashes) for e in offered) == 60  # the tier took each in turn
    stores = out.host_stores.tolist()
    # Before the fix: 60 rows onto 8 distinct host blocks.
    assert len(stores) == HOST
    assert {g for g, _, _ in stores} == {0}  # one group
    assert len({h for _, _, h in stores}) == HOST, "a host block stored twice in one output"
    # The policy keeps the last 8 offered: A's first 8 blocks (evicted tail first).
    assert [d for _, d, _ in stores] == a_table[:8][::-1]
    assert m.stats().host_stores_blocks == HOST
    # They come back as host hits of A, loaded from the host blocks they were stored to.
    m.free(2)
    m.add_sequence(3, a)
    assert m.lookup_prefix(3) == 8 * BS
    out = m.step([3], [60 * BS])
    assert [h for _, h, _ in out.host_loads.tolist()] == [h for _, _, h in stores][::-1]
    m.check_invariants()


@pytest.mark.parametrize("eviction", pagedkv.HOST_EVICTIONS)
def test_one_step_output_stores_at_most_the_host_blocks_two_groups(eviction: str) -> None:
    groups = [KVCacheGroupSpec("full", BS, 8), KVCacheGroupSpec("full", BS, 8)]
    cfg = pagedkv.CacheConfig(
        127,
        groups=groups,
        layer_groups=[0, 1],
        num_host_blocks=HOST,
        host_admission_min_seen=1,
        host_eviction=eviction,
    )
    m = pagedkv.KVCacheManager(cfg)
    m.add_sequence(1, toks(30 * BS, 1))
    assert m.step([1], [30 * BS]).error is None  # 30 cached blocks per group
    m.free(1)
    # Seq 2 takes 63 blocks per group: all 126 usable, evicting the 60 cached ones.
    m.add_sequence(2, toks(63 * BS, 2))
    out = m.step([2], [63 * BS])
    assert out.error is None
    m.check_invariants()
    stores = out.host_stores.tolist()
    # Before the fix: 60 rows onto 8 distinct host blocks.
    assert len(stores) == HOST
    assert len({h for _, _, h in stores}) == HOST, "a host block stored twice in one output"
    assert m.stats().host_stores_blocks == HOST
    m.free(2)
    m.check_invariants()
