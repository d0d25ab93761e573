"""``CacheConfig(hash_lookahead_tokens=k)`` through the binding: each block's prefix-cache key
also covers the ``k`` tokens after it, so a block is cached once they are known and a hit of
``p`` tokens needs ``p + k`` known tokens; ``k = 0`` (default) keeps today's keys."""

from __future__ import annotations

import pytest

import pagedkv
from pagedkv import CacheConfig, KVCacheManager

BS = 16


def _hits(k: int) -> tuple[int, int, int]:
    """Hits of three prompts against a 48-token computed prompt: its first 32 tokens, its
    first 33, and its first 32 plus a different 33rd token."""
    m = KVCacheManager(CacheConfig(64, BS, hash_lookahead_tokens=k))
    prompt = list(range(300, 348))
    m.add_sequence(0, prompt)
    m.allocate_slots(0, 48)
    m.add_sequence(1, prompt[:32])
    m.add_sequence(2, prompt[:33])
    m.add_sequence(3, prompt[:32] + [9])
    m.check_invariants()
    return m.lookup_prefix(1), m.lookup_prefix(2), m.lookup_prefix(3)


def test_config_round_trips_and_default_is_zero() -> None:
    assert CacheConfig(8, BS).hash_lookahead_tokens == 0
    c = CacheConfig(8, BS, hash_lookahead_tokens=1)
    assert c.hash_lookahead_tokens == 1
    assert "hash_lookahead_tokens=1" in repr(c)
    assert c != CacheConfig(8, BS)
    assert "hash_lookahead_tokens" not in repr(CacheConfig(8, BS))


def test_hits_need_the_successor_token() -> None:
    assert _hits(0) == (16, 32, 32)  # the default cap (num_tokens - 1) stops the first at 16
    assert _hits(1) == (16, 32, 16)  # the 33rd token must be known and match


def test_a_block_registers_once_its_next_token_is_known() -> None:
    m = KVCacheManager(CacheConfig(64, BS, hash_lookahead_tokens=1))
    m.add_sequence(0, list(range(400, 432)))
    m.allocate_slots(0, 32)
    table = m.block_table(0, 0)
    assert [m.pool.block_hash(int(b)) is not None for b in table] == [True, False]
    m.append_tokens(0, [5])
    m.allocate_slots(0, 1)
    assert m.pool.block_hash(int(table[1])) is not None
    m.check_invariants()


@pytest.mark.parametrize(
    "kw",
    [
        {"hash_lookahead_tokens": 65},
        {"hash_lookahead_tokens": -1},
        {"hash_lookahead_tokens": "1"},
        {"hash_lookahead_tokens": 1, "enable_prefix_caching": False},
        {"hash_lookahead_tokens": 1, "enable_events": True},
        {"hash_lookahead_tokens": 1, "num_host_blocks": 4},
    ],
)
def test_bad_lookahead_settings_name_the_field(kw: dict[str, object]) -> None:
    with pytest.raises(pagedkv.InvalidConfigError) as err:
        CacheConfig(8, BS, **kw)  # type: ignore[arg-type]
    assert err.value.field == "hash_lookahead_tokens"


def test_cache_computed_registers_without_allocating() -> None:
    m = KVCacheManager(CacheConfig(64, BS, hash_lookahead_tokens=1))
    m.add_sequence(0, list(range(500, 532)))
    m.allocate_slots(0, 32)
    table = m.block_table(0, 0)
    m.append_tokens(0, [5])
    free = m.pool.num_free
    m.cache_computed(0)
    assert m.pool.block_hash(int(table[1])) is not None
    assert m.pool.num_free == free and m.num_computed_tokens(0) == 32
    with pytest.raises(pagedkv.UnknownSequenceError):
        m.cache_computed(7)
