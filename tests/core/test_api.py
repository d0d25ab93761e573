"""Every public call of pagedkv's allocator API, with exact expected values.

Block ids come out of a fresh pool in ascending order (1, 2, 3, ...); a freed block without a
hash goes to the front of the free queue (reused first), a freed cached block to the back.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv import BlockPool, CacheConfig, KVCacheManager


def make(num_blocks: int = 16, block_size: int = 4, **kw: object) -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_blocks, block_size, **kw))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# CacheConfig


def test_cache_config_defaults_and_fields() -> None:
    c = CacheConfig(64, 16)
    assert (c.num_blocks, c.block_size) == (64, 16)
    assert c.enable_prefix_caching is True
    assert c.hash_algo == "sha256"
    assert c.hash_seed == b""
    assert c.num_cpu_blocks == 0
    assert c.enable_events is False
    assert repr(c) == (
        'CacheConfig(num_blocks=64, block_size=16, enable_prefix_caching=True, hash_algo="sha256", '
        "hash_seed=<0 bytes>, num_cpu_blocks=0, enable_events=False)"
    )


def test_cache_config_options_equality_and_frozen() -> None:
    c = CacheConfig(
        8, 2, enable_prefix_caching=False, hash_algo="xxh3_128", hash_seed=b"s", num_cpu_blocks=4, enable_events=True
    )
    assert (c.enable_prefix_caching, c.hash_algo, c.hash_seed, c.num_cpu_blocks, c.enable_events) == (
        False,
        "xxh3_128",
        b"s",
        4,
        True,
    )
    assert c == CacheConfig(
        8, 2, enable_prefix_caching=False, hash_algo="xxh3_128", hash_seed=b"s", num_cpu_blocks=4, enable_events=True
    )
    assert c != CacheConfig(8, 2)
    with pytest.raises(AttributeError):
        c.block_size = 4  # type: ignore[misc]
    m = KVCacheManager(c)
    assert m.config == c


def test_module_constants() -> None:
    assert pagedkv.NULL_BLOCK == 0
    assert pagedkv.MAX_BLOCK_SIZE == 4096
    assert pagedkv.MAX_BLOCKS == 2**28
    assert pagedkv.__version__ == "0.1.0"


# ---------------------------------------------------------------------------------------------
# Sequences, allocation, prefix caching


def test_add_sequence_and_token_accessors() -> None:
    m = make()
    m.add_sequence(7, np.array([5, 6, 7], dtype=np.int64))
    assert m.num_sequences == 1
    assert m.num_tokens(7) == 3
    assert m.num_computed_tokens(7) == 0
    assert m.status(7) == "running"
    m.append_tokens(7, [8, 9])
    tok = m.token_ids(7)
    assert tok.dtype == np.int64 and tok.tolist() == [5, 6, 7, 8, 9]
    assert m.block_table(7).tolist() == []


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64])
def test_token_arrays_of_every_integer_dtype(dtype: type) -> None:
    m = make()
    m.add_sequence(1, np.array([1, 2, 3], dtype=dtype))
    m.append_tokens(1, np.array([4], dtype=dtype))
    assert m.token_ids(1).tolist() == [1, 2, 3, 4]


def test_allocate_slots_prefill_and_decode() -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(10)))
    a = m.allocate_slots(1, 100)
    assert (a.num_scheduled_tokens, a.num_cached_tokens, a.num_context_tokens) == (10, 0, 0)
    assert a.new_block_ids.dtype == np.int32 and a.new_block_ids.tolist() == [1, 2, 3]
    assert a.copies.dtype == np.int32 and a.copies.shape == (0, 3)
    assert a.new_block_indptr.tolist() == [0, 3]
    assert m.block_table(1).tolist() == [1, 2, 3]
    assert m.num_computed_tokens(1) == 10
    m.append_tokens(1, [10, 11, 12])
    assert m.num_blocks_needed(1, 1) == (0, 0)
    b = m.allocate_slots(1, 1)  # token 10 fills slot 2 of block 3
    assert (b.num_scheduled_tokens, b.num_context_tokens, b.new_block_ids.tolist()) == (1, 10, [])
    c = m.allocate_slots(1, 2)  # tokens 11 (block 3) and 12 (new block 4)
    assert (c.num_scheduled_tokens, c.new_block_ids.tolist()) == (2, [4])
    assert m.block_table(1).tolist() == [1, 2, 3, 4]
    m.check_invariants()


def test_chunked_prefill() -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(10)))
    assert m.allocate_slots(1, 3).new_block_ids.tolist() == [1]
    assert m.allocate_slots(1, 3).new_block_ids.tolist() == [2]
    last = m.allocate_slots(1, 100)
    assert (last.num_scheduled_tokens, last.num_context_tokens, last.new_block_ids.tolist()) == (4, 6, [3])
    assert m.num_computed_tokens(1) == 10


def test_prefix_cache_hits_and_prediction() -> None:
    m = make(16, 4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    m.add_sequence(1, prompt)
    m.allocate_slots(1, 100)
    m.add_sequence(2, prompt + [1, 2, 3])
    assert m.lookup_prefix(2) == 8
    assert m.num_blocks_needed(2, 100) == (2, 0)  # blocks 3.. for tokens 8..12; hits are shared
    a = m.allocate_slots(2, 100)
    assert (a.num_cached_tokens, a.num_context_tokens, a.num_scheduled_tokens) == (8, 8, 5)
    assert a.new_block_ids.tolist() == [4, 5]
    assert m.block_table(2).tolist() == [1, 2, 4, 5]
    assert [m.pool.ref_count(b) for b in (1, 2, 3, 4, 5)] == [2, 2, 1, 1, 1]
    # The last token is always recomputed: an identical prompt hits at most num_tokens - 1.
    m.add_sequence(3, prompt[:8])
    assert m.lookup_prefix(3) == 4
    m.check_invariants()


def test_prefix_hit_on_freed_cached_blocks_consumes_capacity() -> None:
    m = make(8, 4)
    m.add_sequence(1, list(range(9)))
    m.allocate_slots(1, 100)  # blocks 1, 2 full (cached), 3 partial
    assert m.free(1) is True
    assert m.pool.free_queue().tolist() == [3, 4, 5, 6, 7, 2, 1]
    assert m.pool.num_cached_free == 2
    m.add_sequence(2, list(range(9)))
    assert m.num_blocks_needed(2, 100) == (3, 0)  # 2 cached hits on free blocks + 1 fresh
    a = m.allocate_slots(2, 100)
    assert a.num_cached_tokens == 8 and a.new_block_ids.tolist() == [3]
    assert m.block_table(2).tolist() == [1, 2, 3]


def test_prefix_caching_off_never_hits() -> None:
    m = make(16, 4, enable_prefix_caching=False)
    m.add_sequence(1, list(range(9)))
    m.allocate_slots(1, 100)
    m.add_sequence(2, list(range(9)))
    assert m.lookup_prefix(2) == 0
    assert m.allocate_slots(2, 100).num_cached_tokens == 0
    assert m.pool.block_hash(1) is None


@pytest.mark.parametrize(
    ("first", "second", "shared"),
    [
        ({}, {}, True),
        ({"cache_salt": "a"}, {"cache_salt": "a"}, True),
        ({"cache_salt": "a"}, {"cache_salt": "b"}, False),
        ({"cache_salt": "a"}, {}, False),
        ({"adapter_id": "lora1"}, {"adapter_id": "lora2"}, False),
        ({"adapter_id": "x"}, {"cache_salt": "x"}, False),
        ({"extra_keys": [("model", b"m1")]}, {"extra_keys": [("model", b"m1")]}, True),
        ({"extra_keys": [("model", b"m1")]}, {"extra_keys": [("model", b"m2")]}, False),
        ({"mm_items": [(b"img1", 1, 2)]}, {"mm_items": [(b"img1", 1, 2)]}, True),
        ({"mm_items": [(b"img1", 1, 2)]}, {"mm_items": [(b"img2", 1, 2)]}, False),
    ],
)
def test_cache_isolation_keys(first: dict[str, object], second: dict[str, object], shared: bool) -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(9)), **first)  # type: ignore[arg-type]
    m.allocate_slots(1, 100)
    m.add_sequence(2, list(range(9)), **second)  # type: ignore[arg-type]
    assert m.lookup_prefix(2) == (8 if shared else 0)


def test_fork_and_copy_on_write() -> None:
    m = make(16, 4)
    m.add_sequence(1, [1, 2, 3, 4, 5, 6])
    m.allocate_slots(1, 100)  # blocks [1, 2]; block 2 half full
    m.fork(1, 2)
    assert m.block_table(2).tolist() == [1, 2]
    assert [m.pool.ref_count(b) for b in (1, 2)] == [2, 2]
    assert m.num_computed_tokens(2) == 6 and m.token_ids(2).tolist() == [1, 2, 3, 4, 5, 6]
    m.append_tokens(2, [9])
    assert m.num_blocks_needed(2, 1) == (1, 0)
    a = m.allocate_slots(2, 1)
    assert a.copies.tolist() == [[0, 2, 3]] and a.new_block_ids.tolist() == [3]
    assert m.block_table(2).tolist() == [1, 3]
    assert [m.pool.ref_count(b) for b in (1, 2, 3)] == [2, 1, 1]
    m.append_tokens(1, [8])  # the parent now owns block 2 alone: no copy
    assert m.allocate_slots(1, 1).copies.shape == (0, 3)
    assert m.stats().copies == 1
    m.check_invariants()


def test_free_is_idempotent_and_tail_first() -> None:
    m = make(8, 4, enable_prefix_caching=False)
    m.add_sequence(1, list(range(10)))
    m.allocate_slots(1, 100)  # [1, 2, 3]
    assert m.free(1) is True
    assert m.free(1) is False
    assert m.free(12345) is False
    # Uncached blocks return to the front, tail first: 1 was freed last, so it is reused first.
    assert m.pool.free_queue().tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert m.num_sequences == 0
    m.check_invariants()


def test_preempt_recompute_then_resume_hits_own_prefix() -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(9)))
    m.allocate_slots(1, 100)
    m.append_tokens(1, [50])
    m.preempt([1])
    assert m.status(1) == "preempted"
    assert m.block_table(1).tolist() == []
    assert (m.num_tokens(1), m.num_computed_tokens(1)) == (10, 0)
    assert m.stats().preemptions == 1
    a = m.allocate_slots(1, 100)  # resumed prefill: prompt + generated token
    assert (a.num_cached_tokens, a.num_scheduled_tokens) == (8, 2)
    assert m.status(1) == "running"
    m.check_invariants()


def test_swap_out_and_in_plans() -> None:
    m = make(16, 4, num_cpu_blocks=8)
    m.add_sequence(1, [1, 2, 3, 4, 5, 6])
    m.allocate_slots(1, 100)  # GPU [1, 2]
    m.fork(1, 2)  # the group shares both blocks
    out = m.swap_out([1, 2])
    assert out.dtype == np.int32 and out.tolist() == [[1, 0], [2, 1]]
    assert (m.status(1), m.status(2)) == ("swapped", "swapped")
    assert m.block_table(1).tolist() == [0, 1] == m.block_table(2).tolist()
    st = m.stats()
    assert (st.used, st.cpu_used, st.swaps_out_blocks, st.preemptions) == (0, 2, 2, 2)
    back = m.swap_in([1, 2])
    assert back.dtype == np.int32 and back[:, 0].tolist() == [0, 1]
    gpu = back[:, 1].tolist()
    assert m.block_table(1).tolist() == gpu == m.block_table(2).tolist()
    assert [m.pool.ref_count(b) for b in gpu] == [2, 2]
    assert m.stats().cpu_used == 0
    m.check_invariants()


def test_reset_prefix_cache_and_events() -> None:
    m = make(8, 4, enable_events=True)
    m.add_sequence(1, list(range(9)), cache_salt="tenant")
    m.allocate_slots(1, 100)
    events = m.take_events()
    assert len(events) == 1 and isinstance(events[0], pagedkv.BlockStored)
    ev = events[0]
    assert ev.block_size == 4
    assert ev.parent_block_hash is None
    assert ev.token_ids == list(range(8))
    assert [len(h) for h in ev.block_hashes] == [32, 32]
    assert ev.block_hashes == [m.pool.block_hash(1), m.pool.block_hash(2)]
    assert ev.extra_keys == [("cache_salt", "tenant")]
    assert m.take_events() == []
    m.free(1)
    m.reset_prefix_cache()
    assert [type(e) for e in m.take_events()] == [pagedkv.AllBlocksCleared]
    assert m.pool.num_cached_free == 0 and m.pool.block_hash(1) is None


def test_eviction_emits_block_removed() -> None:
    m = make(4, 2, enable_events=True)  # 3 usable blocks
    m.add_sequence(1, [1, 2, 3, 4, 5])
    m.allocate_slots(1, 100)  # blocks 1, 2 cached; 3 partial
    stored = m.take_events()[0]
    m.free(1)
    m.add_sequence(2, [9, 9, 9, 9, 9, 9])
    m.allocate_slots(2, 100)  # needs all 3 blocks: evicts 2, then 1
    removed = [e for e in m.take_events() if isinstance(e, pagedkv.BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(stored.block_hashes)
    assert m.stats().evictions == 2


def test_no_events_when_disabled() -> None:
    m = make()
    m.add_sequence(1, list(range(9)))
    m.allocate_slots(1, 100)
    assert m.take_events() == []


# ---------------------------------------------------------------------------------------------
# The batched step


def test_step_decode_batch() -> None:
    m = make(32, 4)
    for s in (1, 2, 3):
        m.add_sequence(s, [s] * 4)
        m.allocate_slots(s, 100)  # s -> block s, full
    out = m.step(np.array([1, 2, 3], dtype=np.uint64), 1, append_token_ids=np.array([7, 8, 9]), block_table=True)
    assert out.error is None and out.num_scheduled == 3
    assert out.query_start_loc.tolist() == [0, 1, 2, 3]
    assert out.seq_lens.tolist() == [5, 5, 5]
    assert out.context_lens.tolist() == [4, 4, 4]
    assert out.num_cached_tokens.tolist() == [0, 0, 0]
    assert out.new_block_indptr.tolist() == [0, 1, 2, 3]
    assert out.new_block_ids.tolist() == [4, 5, 6]
    assert out.slot_mapping.dtype == np.int64 and out.slot_mapping.tolist() == [16, 20, 24]
    assert out.block_table.tolist() == [[1, 4], [2, 5], [3, 6]]
    assert out.copies.shape == (0, 3)
    for arr in (
        out.query_start_loc,
        out.seq_lens,
        out.context_lens,
        out.block_table,
        out.new_block_indptr,
        out.new_block_ids,
        out.num_cached_tokens,
        out.copies,
    ):
        assert arr.dtype == np.int32
    out.raise_for_error()
    assert [m.token_ids(s).tolist()[-1] for s in (1, 2, 3)] == [7, 8, 9]


def test_step_without_token_arrays() -> None:
    """``token_arrays=False``: the same blocks, lengths and table deltas as a full step, the
    per-token arrays empty (``num_tokens`` still counts the scheduled tokens), and kernel inputs
    refuse such a step without touching the block tables."""
    full, lean = make(32, 4), make(32, 4)
    for m in (full, lean):
        m.add_sequence(1, list(range(10)))
        m.add_sequence(2, list(range(6)))  # its first block is a prefix hit on seq 1's
    outs = []
    for m, token_arrays in ((full, True), (lean, False)):
        prefill = m.step([1], 10, token_arrays=token_arrays)
        hit = m.step([2], 6, token_arrays=token_arrays)
        decode = m.step([1, 2], 1, [[10], [6]], token_arrays=token_arrays)
        outs.append((prefill, hit, decode))
    for a, b in zip(*outs):
        assert b.error is None and b.num_scheduled == a.num_scheduled
        assert b.num_tokens == a.num_tokens == a.slot_mapping.size
        assert b.slot_mapping.size == 0 and b.input_ids.size == 0 and b.slot_mapping.dtype == np.int64
        for name in (
            "num_cached_tokens",
            "query_start_loc",
            "seq_lens",
            "context_lens",
            "new_block_ids",
            "table_delta",
        ):
            assert getattr(b, name).tolist() == getattr(a, name).tolist(), name
    assert [o.num_tokens for o in outs[1]] == [10, 2, 2]
    assert outs[1][1].num_cached_tokens.tolist() == [4]
    assert "num_tokens=10" in repr(outs[1][0])
    for s in (1, 2):
        assert lean.block_table(s).tolist() == full.block_table(s).tolist()
    assert repr(lean.stats()) == repr(full.stats())

    from pagedkv.tensors import BatchTensors, BlockTable

    table = BlockTable(lean)
    with pytest.raises(pagedkv.InvalidArgumentError, match="token_arrays=False"):
        BatchTensors.from_steps(outs[1][2], block_tables=table)
    assert table.num_rows == 0


def test_step_prefill_with_lists_and_per_seq_limits() -> None:
    m = make(32, 4)
    m.add_sequence(10, list(range(6)))
    m.add_sequence(11, list(range(100, 103)))
    out = m.step([10, 11], [4, 8], append_token_ids=[[], [103]])
    assert out.num_scheduled == 2 and out.error is None
    assert out.query_start_loc.tolist() == [0, 4, 8]
    assert out.seq_lens.tolist() == [4, 4] and out.context_lens.tolist() == [0, 0]
    assert out.slot_mapping.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert out.new_block_ids.tolist() == [1, 2]
    assert m.num_computed_tokens(10) == 4 and m.num_tokens(11) == 4


def test_step_stops_at_first_failure_and_reports_it() -> None:
    m = make(4, 4)  # 3 usable blocks
    m.add_sequence(1, [1] * 4)
    m.add_sequence(2, [2] * 9)  # needs 3 blocks
    m.add_sequence(3, [3] * 2)
    out = m.step([1, 2, 3], [100, 100, 100])
    assert out.num_scheduled == 1
    assert isinstance(out.error, pagedkv.OutOfBlocksError)
    assert (out.error.requested, out.error.available) == (3, 2)
    assert out.seq_lens.tolist() == [4]
    assert m.block_table(2).tolist() == [] and m.block_table(3).tolist() == []
    with pytest.raises(pagedkv.OutOfBlocksError):
        out.raise_for_error()


def test_step_unknown_sequence_reported() -> None:
    m = make()
    m.add_sequence(1, [1, 2])
    out = m.step([1, 99], [10, 10], append_token_ids=[[3], [4]])
    assert out.num_scheduled == 1
    assert isinstance(out.error, pagedkv.UnknownSequenceError) and out.error.seq_id == 99
    assert m.token_ids(1).tolist() == [1, 2, 3]


def test_step_batch_tensors_match_python() -> None:
    m = make(64, 4)
    rng = np.random.default_rng(0)
    lens = [5, 1, 13, 8]
    for s, n in enumerate(lens):
        m.add_sequence(s, rng.integers(0, 1000, n))
    out = m.step(list(range(len(lens))), 6)
    bt = pagedkv.tensors.BatchTensors.from_steps(out, device=None, block_tables=pagedkv.tensors.BlockTable(m))
    tables = [m.block_table(s).tolist() for s in range(len(lens))]
    width = max(len(t) for t in tables)
    assert bt.block_table.tolist() == [t + [0] * (width - len(t)) for t in tables]
    q = [min(6, n) for n in lens]
    assert bt.seq_lens.tolist() == q and bt.context_lens.tolist() == [0, 0, 0, 0]
    assert bt.query_start_loc.tolist() == [0, 5, 6, 12, 18]
    want_slots = [tables[s][p // 4] * 4 + p % 4 for s in range(len(lens)) for p in range(q[s])]
    assert bt.slot_mapping.tolist() == want_slots
    assert (bt.max_query_len, bt.max_seq_len, bt.num_seqs, bt.num_tokens) == (6, 6, 4, 18)


# ---------------------------------------------------------------------------------------------
# Stats


def test_a_lone_request_preempted_and_resumed_reports_no_prefix_hits() -> None:
    # vLLM #25780: the recompute resume finds the request's own blocks again; that is not a new
    # lookup, so a request sharing nothing reports 0 %, however often it is preempted.
    m = make(64, 4)
    m.add_sequence(1, list(range(10)))
    m.allocate_slots(1, 10)
    for t in range(20):
        m.append_tokens(1, [100 + t])
        m.allocate_slots(1, 1)
        if t % 7 == 6:
            m.preempt([1])
            assert m.allocate_slots(1, 100).num_cached_tokens > 0  # it still reuses them
    s = m.stats()
    assert s.preemptions == 2 and (s.prefix_queries_tokens, s.prefix_hits_tokens) == (10, 0)
    assert s.prefix_hit_rate == 0.0


def test_reset_drops_the_prefix_hashes_of_swapped_out_blocks() -> None:
    # The swapped-out KV predates the reset: swapped back in, it is neither registered nor
    # announced, and a new request with the same prompt does not hit it.
    m = make(16, 4, num_cpu_blocks=8, enable_events=True)
    m.add_sequence(1, list(range(10)))
    m.allocate_slots(1, 10)
    m.swap_out([1])
    m.reset_prefix_cache()
    m.take_events()
    m.swap_in([1])
    assert m.take_events() == []
    m.add_sequence(2, list(range(10)))
    assert m.lookup_prefix(2) == 0 and m.allocate_slots(2, 10).num_cached_tokens == 0
    m.check_invariants()


def test_stats_snapshot_values() -> None:
    m = make(16, 4)
    m.add_sequence(1, list(range(9)))
    m.allocate_slots(1, 100)
    m.add_sequence(2, list(range(9)))
    m.allocate_slots(2, 100)
    s = m.stats()
    assert (s.num_blocks, s.block_size, s.used, s.free, s.cached_free) == (16, 4, 4, 11, 0)
    assert s.usage == pytest.approx(4 / 15)
    assert (s.prefix_queries_tokens, s.prefix_hits_tokens) == (18, 8)
    assert s.prefix_hit_rate == pytest.approx(8 / 18)
    # Distinct blocks 1, 2 (full, shared), 3 and 4 (one token each): 10 of 16 slots hold tokens.
    assert s.kv_utilization == pytest.approx(10 / 16)
    d = s.as_dict()
    assert d["used"] == 4 and d["prefix_hit_rate"] == pytest.approx(8 / 18)
    assert set(d) >= {
        "evictions",
        "copies",
        "swaps_out_blocks",
        "swaps_in_blocks",
        "preemptions",
        "num_cpu_blocks",
        "cpu_used",
    }
    assert m.stats() == s
    m.free(1)
    assert m.stats() != s


# ---------------------------------------------------------------------------------------------
# BlockPool


def test_block_pool_standalone() -> None:
    p = BlockPool(8)
    assert (p.num_blocks, p.num_usable, p.num_free, p.num_used) == (8, 7, 7, 0)
    ids = p.allocate(3)
    assert ids.dtype == np.int32 and ids.tolist() == [1, 2, 3]
    assert (p.num_free, p.num_used) == (4, 3)
    p.incref(ids[:1])
    assert [p.ref_count(i) for i in (0, 1, 2, 3, 4, 7)] == [0, 2, 1, 1, 0, 0]
    for bad in (8, 99):  # out of range, as free() reports it
        with pytest.raises(pagedkv.InvalidBlockError, match=f"{bad}") as info:
            p.ref_count(bad)
        assert (info.value.block_id, info.value.num_blocks) == (bad, 8)
    h = bytes(range(32))
    p.cache_block(2, h)
    assert p.block_hash(2) == h and p.lookup(h) == 2 and p.lookup(bytes(32)) is None
    p.free(np.array([3, 2, 1], dtype=np.int64))  # tail first
    # 3 (uncached) -> front; 2 (cached) -> LRU back; 1 still referenced once.
    assert p.free_queue().tolist() == [3, 4, 5, 6, 7, 2]
    assert p.num_cached_free == 1
    p.touch([2])  # prefix hit on a free cached block
    assert p.ref_count(2) == 1 and p.num_free == 5
    p.free([2, 1])
    assert p.counters() == {"evictions": 0, "allocations": 3, "frees": 5, "prefix_touches": 1}
    p.check_invariants()
    p.reset_prefix_cache()
    assert p.block_hash(2) is None and p.num_cached_free == 0
    assert p.num_free == 7


def test_block_pool_eviction_order() -> None:
    p = BlockPool(4)
    ids = p.allocate(3).tolist()
    for i, b in enumerate(ids):
        p.cache_block(b, bytes([i + 1]) * 32)
    p.free(ids[::-1])  # LRU front = 3 (freed first)
    assert p.free_queue().tolist() == [3, 2, 1]
    assert p.allocate(1).tolist() == [3]
    assert p.block_hash(3) is None and p.lookup(bytes([3]) * 32) is None
    assert p.counters()["evictions"] == 1


def test_block_pool_allocate_list_and_free_table() -> None:
    p, q = BlockPool(9), BlockPool(9)
    ids = p.allocate_list(3)
    assert type(ids) is list and ids == [1, 2, 3] and all(type(b) is int for b in ids)
    assert p.allocate_list(0) == [] and p.num_used == 3
    assert q.allocate(3).tolist() == ids
    for pool in (p, q):
        for b in (1, 2):
            pool.cache_block(b, bytes([b]) * 32)
    table = ids + p.allocate(2).tolist()  # [1, 2, 3, 4, 5]
    assert q.allocate(2).tolist() == [4, 5]
    p.free_table(np.array(table, dtype=np.int32))
    q.free(table[::-1])
    # Tail first: 5, 4, 3 (uncached) to the front, LIFO; then 2, 1 (cached) to the LRU back.
    assert p.free_queue().tolist() == q.free_queue().tolist() == [3, 4, 5, 6, 7, 8, 2, 1]
    assert p.counters() == q.counters() == {"evictions": 0, "allocations": 5, "frees": 5, "prefix_touches": 0}
    assert p.allocate_list(8) == [3, 4, 5, 6, 7, 8, 2, 1]  # the last two evicted (LRU first)
    assert p.counters()["evictions"] == 2 and p.block_hash(2) is None
    p.check_invariants()
    q.check_invariants()


@pytest.mark.parametrize(
    "ids",
    [
        [3, 1, 2],
        (3, 1, 2),
        np.array([3, 1, 2], dtype=np.int32),
        np.array([3, 1, 2], dtype=np.int64),
        np.array([3, 1, 2], dtype=np.uint32),
        np.array([3, 1, 2], dtype=np.uint64),
        np.array([3, 1, 2], dtype=np.int16),
        np.array([3, 1, 2], dtype=">i4"),  # byte-swapped: not read in place
        np.array([1, 2, 3], dtype=np.int32)[[2, 0, 1]],  # fancy-indexed copy
        np.array([2, 9, 1, 9, 3], dtype=np.int64)[::-2],  # negative stride, every other item
        np.array([[3, 1, 2]], dtype=np.int32)[0],  # a row of a 2-D array
    ],
    ids=lambda ids: type(ids).__name__ + ("-" + str(ids.dtype) + str(ids.strides) if hasattr(ids, "dtype") else ""),
)
def test_block_pool_reads_every_form_of_ids_alike(ids: Any) -> None:
    p = BlockPool(6)
    p.allocate(4)
    p.free(ids)  # 3, then 1, then 2 to the front
    assert p.free_queue().tolist() == [2, 1, 3, 5]  # 4 still held
    assert p.ref_count(4) == 1 and p.counters()["frees"] == 3
    p.allocate(3)
    p.free_table(ids)  # 2, then 1, then 3
    assert p.free_queue().tolist() == [3, 1, 2, 5]


def test_manager_pool_view_is_read_only() -> None:
    m = make()
    view = m.pool
    assert view.num_free == 15
    for call in (
        lambda: view.allocate(1),
        lambda: view.allocate_list(1),
        lambda: view.free([1]),
        lambda: view.free_table([1]),
        lambda: view.incref([1]),
        lambda: view.touch([1]),
        lambda: view.cache_block(1, bytes(32)),
        lambda: view.reset_prefix_cache(),
    ):
        with pytest.raises(pagedkv.ReadOnlyPoolError, match="read-only view") as info:
            call()
        assert isinstance(info.value, RuntimeError)
    assert view.num_free == 15
    with pytest.raises(pagedkv.ReadOnlyPoolError) as info:
        view.free([1])
    assert info.value.operation == "free"
    assert str(info.value).startswith("BlockPool.free: this pool belongs to a KVCacheManager")
    view.check_invariants()


# ---------------------------------------------------------------------------------------------
# Package surface


def test_all_exports_resolve() -> None:
    for name in pagedkv.__all__:
        assert getattr(pagedkv, name) is not None, name


def test_public_names_have_docstrings() -> None:
    for name in pagedkv.__all__:
        obj = getattr(pagedkv, name)
        if isinstance(obj, type):
            assert obj.__doc__ and obj.__doc__.strip(), name
            fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
            for attr, value in vars(obj).items():
                if attr in fields:  # a dataclass field (its default value here): named in the class docs
                    assert f"``{attr}``" in obj.__doc__ or f"{attr}:" in obj.__doc__, f"{name}.{attr} is undocumented"
                elif not attr.startswith("_"):
                    assert getattr(value, "__doc__", None), f"{name}.{attr} has no docstring"


def test_import_without_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None      # any `import torch` now raises ImportError
        sys.modules["triton"] = None
        import pagedkv
        from pagedkv import tensors
        m = pagedkv.KVCacheManager(pagedkv.CacheConfig(8, 4))
        m.add_sequence(1, [1, 2, 3])
        out = m.step([1], [8])
        bt = tensors.BatchTensors.from_steps(out, device=None, block_tables=tensors.BlockTable(m))
        assert bt.block_table.tolist() == [[1]], bt
        print("ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


# ---------------------------------------------------------------------------------------------
# One manager for every layout: the config's two forms, the one-group spelling of the results


def _two_groups() -> list[pagedkv.KVCacheGroupSpec]:
    return [pagedkv.KVCacheGroupSpec("full", 4, 8), pagedkv.KVCacheGroupSpec("sliding_window", 4, 8, window=8)]


def test_cache_config_one_group_form_implies_one_full_group() -> None:
    c = CacheConfig(16, 4)
    assert (c.num_groups, c.layer_groups, c.retention_interval, c.block_size) == (1, [], 0, 4)
    (g,) = c.groups
    assert (g.kind, g.block_size, g.window) == ("full", 4, None)
    # the groups form of the same group is another config (it names its layers)
    same = CacheConfig(16, groups=[g], layer_groups=[0])
    assert same != c and same.layer_groups == [0] and same.block_size == 4
    assert same == CacheConfig(16, 4, groups=(g,), layer_groups=(0,))


def test_cache_config_groups_form_fields_and_refusals() -> None:
    groups = _two_groups()
    c = CacheConfig(16, groups=groups, layer_groups=[1, 0, 1], retention_interval=8)
    assert (c.num_groups, c.layer_groups, c.retention_interval, c.block_size) == (2, [1, 0, 1], 8, 4)
    assert c.groups == groups and "num_groups=2" in repr(c)
    assert c != CacheConfig(16, groups=groups, layer_groups=[1, 0, 1])  # every field compared
    refusals = [
        (lambda: CacheConfig(16), "block_size"),
        (lambda: CacheConfig(16, 4, layer_groups=[0]), "layer_groups"),
        (lambda: CacheConfig(16, groups=groups), "layer_groups"),
        (lambda: CacheConfig(16, 8, groups=groups, layer_groups=[0, 1]), "block_size"),
        (lambda: CacheConfig(16, groups=groups[0], layer_groups=[0]), "groups"),
        (lambda: CacheConfig(16, groups=groups, layer_groups=[0]), "layer_groups"),
        (lambda: CacheConfig(16, groups=groups, layer_groups=[0, 1], retention_interval=6), "retention_interval"),
    ]
    for build, field in refusals:
        with pytest.raises(pagedkv.InvalidConfigError) as info:
            build()
        assert info.value.field == field, (field, info.value)


def test_one_class_answers_for_every_layout() -> None:
    one = make(16, 4)
    two = KVCacheManager(CacheConfig(16, groups=_two_groups(), layer_groups=[0, 1]))
    for m, g in ((one, 1), (two, 2)):
        assert type(m) is KVCacheManager and m.num_groups == g == len(m.groups)
        m.add_sequence(1, list(range(10)))
        a = m.allocate_slots(1, 10)
        assert a.new_block_indptr.tolist() == [3 * k for k in range(g + 1)]
        assert a.new_block_ids.tolist() == [b for t in m.block_tables(1) for b in t.tolist()]
        assert m.block_table(1, g - 1).tolist() == m.block_tables(1)[g - 1].tolist()
        m.append_tokens(1, [5])
        # the 11th token fits the third block of every group; the window (2, 10] still reads block 0
        assert m.num_blocks_needed_per_group(1, 1) == [(0, 0)] * g and m.num_blocks_needed(1, 1) == (0, 0)
        out = m.step([1], 1)
        assert (out.num_groups, out.slot_mappings.shape, out.block_tables.shape) == (g, (g, 1), (g, 1, 0))
        assert out.table_start.shape == (1, g) and out.new_block_indptr.size == g + 1
        with pytest.raises(pagedkv.InvalidArgumentError, match="group"):
            m.block_table(1, g)
    out = one.step([1], 1, [[6]], block_table=True)
    assert out.slot_mapping.tolist() == out.slot_mappings[0].tolist() == [one.block_table(1)[2] * 4 + 3]
    assert np.shares_memory(out.slot_mapping, out.slot_mappings) and np.shares_memory(out.block_table, out.block_tables)
    assert out.block_table.tolist() == [one.block_table(1).tolist()]
    out = two.step([1], 1, [[6]], block_table=True)
    for name in ("slot_mapping", "block_table"):
        with pytest.raises(pagedkv.InvalidArgumentError, match=f"2 KV cache groups: use {name}s\\[g\\]"):
            getattr(out, name)


def test_hybrid_kv_cache_manager_is_a_deprecated_alias() -> None:
    groups = _two_groups()
    with pytest.warns(DeprecationWarning, match="HybridKVCacheManager is deprecated"):
        m = pagedkv.HybridKVCacheManager(groups, [0, 1], 16, retention_interval=8, enable_events=True)
    assert type(m) is KVCacheManager
    assert m.config == CacheConfig(16, groups=groups, layer_groups=[0, 1], retention_interval=8, enable_events=True)
