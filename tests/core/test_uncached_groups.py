"""A KV cache group out of the prefix cache (``KVCacheGroupSpec(..., prefix_cacheable=False)``):
a sliding window rebuilt by replaying a hit's last window (vLLM's bounded-replay sliding-window
MLA). It never registers a block and takes no part in hit lookup; a hit found by the other
groups gives it fresh blocks for the hit's window, null below it. A first allocation of no
token adopts the hit only."""

from __future__ import annotations

import pytest

import pagedkv

BS = 16
WINDOW = 32


def _manager(num_blocks: int = 64) -> pagedkv.KVCacheManager:
    full = pagedkv.KVCacheGroupSpec("full", BS, 1)
    window = pagedkv.KVCacheGroupSpec("sliding_window", BS, 1, window=WINDOW, prefix_cacheable=False)
    return pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks, groups=[full, window], layer_groups=[0, 1]))


def test_spec_flag_and_repr() -> None:
    spec = pagedkv.KVCacheGroupSpec("sliding_window", BS, 1, window=WINDOW, prefix_cacheable=False)
    assert spec.prefix_cacheable is False
    assert "prefix_cacheable=False" in repr(spec)
    assert pagedkv.KVCacheGroupSpec("chunked_local", BS, 1, chunk=64, prefix_cacheable=False).prefix_cacheable is False
    plain = pagedkv.KVCacheGroupSpec("sliding_window", BS, 1, window=WINDOW)
    assert plain.prefix_cacheable is True and "prefix_cacheable" not in repr(plain)
    assert spec != plain


@pytest.mark.parametrize("kind", ["full", "state"])
def test_only_windowed_groups_can_be_uncached(kind: str) -> None:
    with pytest.raises(pagedkv.InvalidConfigError) as err:
        pagedkv.KVCacheGroupSpec(kind, BS, 1, prefix_cacheable=False)
    assert err.value.field == "prefix_cacheable"


def test_a_config_needs_one_cacheable_group() -> None:
    window = pagedkv.KVCacheGroupSpec("sliding_window", BS, 1, window=WINDOW, prefix_cacheable=False)
    with pytest.raises(pagedkv.InvalidConfigError) as err:
        pagedkv.KVCacheManager(pagedkv.CacheConfig(16, groups=[window], layer_groups=[0]))
    assert err.value.field == "prefix_cacheable"


def test_hit_comes_from_the_full_group_and_the_window_gets_fresh_blocks() -> None:
    m = _manager()
    prompt = list(range(1, 101))  # 6 full blocks, hit 96
    m.add_sequence(0, prompt)
    m.allocate_slots(0, 100)
    full_a, window_a = m.block_tables(0)
    assert all(m.pool.block_hash(int(b)) is not None for b in full_a[:6])
    assert all(m.pool.block_hash(int(b)) is None for b in window_a if b)

    m.add_sequence(1, prompt)
    assert m.lookup_prefix(1) == 96
    assert m.lookup_prefix_group(1, 0, 100) == 96
    assert m.lookup_prefix_group(1, 1, 100) == 0
    free_before = m.num_free_blocks
    # No token past the hit: the hit alone is adopted.
    out = m.allocate_slots(1, 0)
    assert (out.num_cached_tokens, out.num_context_tokens) == (96, 96)
    assert m.num_computed_tokens(1) == 96
    full_b, window_b = m.block_tables(1)
    assert full_b.tolist() == full_a[:6].tolist()
    # Window of the hit's next token: positions 65..96, blocks 4 and 5; null below.
    skipped = (96 - WINDOW + 1) // BS
    assert window_b[:skipped].tolist() == [0] * skipped
    fresh = window_b[skipped:].tolist()
    assert len(fresh) == 6 - skipped and 0 not in fresh
    assert not set(fresh) & set(int(b) for b in window_a)
    assert out.new_block_ids.tolist() == fresh
    assert m.num_free_blocks == free_before - len(fresh)
    # The rest of the prompt: one block more in each group, nothing of the window cached.
    out = m.allocate_slots(1, 4)
    assert out.new_block_indptr.tolist() == [0, 1, 2]
    assert all(m.pool.block_hash(int(b)) is None for b in m.block_tables(1)[1] if b)
    m.check_invariants()


def test_adopting_without_a_hit_is_refused_and_changes_nothing() -> None:
    m = _manager()
    m.add_sequence(0, list(range(1, 41)))
    free = m.num_free_blocks
    with pytest.raises(pagedkv.InvalidArgumentError) as err:
        m.allocate_slots(0, 0)
    assert err.value.arg == "num_new_tokens"
    assert m.num_free_blocks == free and m.num_computed_tokens(0) == 0
    m.allocate_slots(0, 40)
    # Past the first allocation 0 tokens stays refused.
    m.append_tokens(0, [5])
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.allocate_slots(0, 0)
    m.check_invariants()


def test_spare_blocks_of_a_group_out_of_the_prefix_cache() -> None:
    # vLLM's Mamba groups in cache mode none: one block of the context length (6000 tokens,
    # above MAX_BLOCK_SIZE, served with prefix caching off) plus k = 2 spare blocks.
    spec = pagedkv.KVCacheGroupSpec("sliding_window", 6000, 1, window=2, prefix_cacheable=False, spare_blocks=2)
    assert spec.spare_blocks == 2 and "spare_blocks=2" in repr(spec)
    assert pagedkv.KVCacheGroupSpec("full", BS, 1).spare_blocks == 0
    with pytest.raises(pagedkv.InvalidConfigError) as err:
        pagedkv.KVCacheGroupSpec("sliding_window", BS, 1, window=2, spare_blocks=1)
    assert err.value.field == "spare_blocks"
    with pytest.raises(pagedkv.InvalidConfigError) as err:
        pagedkv.KVCacheGroupSpec("full", BS, 1, spare_blocks=1)
    assert err.value.field == "spare_blocks"
    full = pagedkv.KVCacheGroupSpec("full", BS, 375)
    config = pagedkv.CacheConfig(64, groups=[full, spec], layer_groups=[0, 1], enable_prefix_caching=False)
    m = pagedkv.KVCacheManager(config)
    free = m.num_free_blocks
    m.add_sequence(0, list(range(1, 41)))
    m.allocate_slots(0, 40)
    assert [len(t) for t in m.block_tables(0)] == [3, 3]
    assert free - m.num_free_blocks == 6
    m.free(0)
    assert m.num_free_blocks == free
    # Above MAX_BLOCK_SIZE only with prefix caching off.
    assert pagedkv.MAX_UNCACHED_BLOCK_SIZE > 6000 > pagedkv.MAX_BLOCK_SIZE
    with pytest.raises(pagedkv.InvalidConfigError) as err:
        pagedkv.KVCacheManager(pagedkv.CacheConfig(64, groups=[full, spec], layer_groups=[0, 1]))
    assert err.value.field == "block_size"


def test_an_lcm_over_32_bits_with_prefix_caching_off_names_that_limit() -> None:
    """With prefix caching off the groups' block sizes may reach ``MAX_UNCACHED_BLOCK_SIZE``;
    their LCM must still fit in 32 bits, and the refusal names that bound, not the cached one."""
    big = pagedkv.KVCacheGroupSpec("sliding_window", 2**24, 4093, window=2, prefix_cacheable=False)
    full = pagedkv.KVCacheGroupSpec("full", 4093, 2**24)
    with pytest.raises(pagedkv.InvalidConfigError, match=f"exceeds {2**32 - 1} tokens") as err:
        pagedkv.CacheConfig(8, groups=[full, big], layer_groups=[0, 1], enable_prefix_caching=False)
    assert err.value.field == "groups"
