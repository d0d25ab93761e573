"""Tests of the benchmark helpers that the figures depend on: the first-fit contiguous allocator,
the reservation policies, Mooncake token expansion and the operation-trace builder."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import common  # noqa: E402
import op_trace  # noqa: E402
from contiguous import FirstFitAllocator, next_pow2, reservation  # noqa: E402


def test_first_fit_places_lowest_hole_and_coalesces():
    a = FirstFitAllocator(100)
    assert [a.allocate(30), a.allocate(30), a.allocate(30)] == [0, 30, 60]
    assert a.allocate(20) is None  # 10 free, in one hole
    a.free_range(30, 30)
    assert (a.free, a.largest_hole) == (40, 30)
    assert a.allocate(40) is None  # 40 free but split 30 + 10: external fragmentation
    assert a.allocate(25) == 30  # first fit: the lowest hole that fits
    a.free_range(0, 30)
    a.free_range(30, 25)
    a.free_range(60, 30)
    assert (a._starts, a._lens, a.allocated) == ([0], [100], 0)


def test_first_fit_rejects_double_free_and_bad_ranges():
    a = FirstFitAllocator(10)
    s = a.allocate(4)
    a.free_range(s, 4)
    with pytest.raises(ValueError, match="overlaps"):
        a.free_range(s, 4)
    with pytest.raises(ValueError, match="bad range"):
        a.free_range(8, 5)
    with pytest.raises(ValueError, match="size must be positive"):
        a.allocate(0)


def test_first_fit_random_ops_tile_the_address_space():
    rng = random.Random(1)
    a = FirstFitAllocator(1000)
    live: list[tuple[int, int]] = []
    for _ in range(3000):
        if live and rng.random() < 0.5:
            s, n = live.pop(rng.randrange(len(live)))
            a.free_range(s, n)
        else:
            n = rng.randint(1, 120)
            s = a.allocate(n)
            if s is not None:
                live.append((s, n))
        spans = sorted(live + list(zip(a._starts, a._lens)))
        assert spans[0][0] == 0 and spans[-1][0] + spans[-1][1] == 1000
        assert all(x[0] + x[1] == y[0] for x, y in zip(spans, spans[1:]))
        assert a.allocated == sum(n for _, n in live)


def test_reservation_policies():
    assert next_pow2(1) == 1 and next_pow2(25) == 32 and next_pow2(32) == 32
    assert reservation("max", 10, 25, 2048) == 2048
    assert reservation("pow2", 10, 25, 2048) == 42
    assert reservation("oracle", 10, 25, 2048) == 34
    assert reservation("pow2", 2000, 100, 2048) == 2099  # capped at max_len, never below the need
    with pytest.raises(ValueError, match="policy"):
        reservation("half", 1, 1, 8)


def test_expand_hash_ids_shares_exactly_equal_ids():
    a = common.expand_hash_ids([0, 1, 2], 1500)
    b = common.expand_hash_ids([0, 1, 7], 1100)
    assert a.shape == (1500,) and b.shape == (1100,)
    assert np.array_equal(a[:1024], b[:1024])
    assert not np.array_equal(a[1024:1100], b[1024:1100])
    assert np.array_equal(common.expand_hash_ids([5], 512), common.expand_hash_ids([5, 6], 512))
    with pytest.raises(ValueError, match="exceeds"):
        common.expand_hash_ids([0], 513)


def test_lognormal_lengths_match_the_mean():
    x = common.lognormal_lengths(np.random.default_rng(0), 20000, 161.31, 1.0, 1024)
    assert abs(x.mean() - 161.31) <= 0.01 * 161.31
    assert x.min() >= 1 and x.max() <= 1024


def test_op_trace_counts_and_lifetimes():
    w = common.Workload("t", np.array([20, 40, 5, 16]), np.array([3, 1, 2, 4]), np.zeros(4))
    # A huge load makes every later request arrive before step 1; at most 2 run at once.
    tr = op_trace.build(w, num_steps=7, block_size=16, max_running=2, load=1000.0)
    assert tr.admit == [[0, 1], [2], [], [3], [], [], []]
    assert tr.finish == [[1], [], [0, 2], [], [], [], [3]]
    # KV tokens written: 20+3-1=22 -> 2 blocks, 40 -> 3, 5+1=6 -> 1, 16+3=19 -> 2; each x2 (get + release).
    assert tr.block_ops == 2 * (2 + 3 + 1 + 2)
    admit, finish = op_trace.schedule(tr)
    assert all(finish[r] - admit[r] + 1 == w.output_lens[r] for r in range(4))


def test_contiguous_simulation_breakdown_exact():
    import memory_efficiency as me

    w = common.Workload("t", np.array([4, 4, 4]), np.array([2, 2, 2]), np.zeros(3))
    # oracle: reservations of 5 slots; two fit in 10, the third waits for both to finish.
    b = me.simulate_contiguous(w, "oracle", budget=10, max_len=16)
    assert (b.saturated_steps, b.total_steps) == (2, 4)
    assert (b.token_states, b.reservation, b.internal_frag, b.external_other) == (0.9, 0.1, 0.0, 0.0)
    assert b.concurrency == 2.0
    # max: 6-slot reservations, one at a time in 10 slots (4 slots never usable).
    b = me.simulate_contiguous(w, "max", budget=10, max_len=6)
    assert (b.saturated_steps, b.total_steps) == (4, 6)
    assert (b.token_states, b.reservation, b.internal_frag, b.external_other) == (0.45, 0.05, 0.1, 0.4)
    assert b.concurrency == 1.0


def test_paged_simulation_through_pagedkv_exact():
    pytest.importorskip("pagedkv._core")
    import memory_efficiency as me

    w = common.Workload("t", np.array([4, 4, 4, 4]), np.array([2, 2, 2, 2]), np.zeros(4))
    # 3 usable blocks of 4 tokens: three prompts fill them; the next decode needs 3 new blocks,
    # so the two newest are preempted (recompute) and resume later with prompt + 1 token.
    b = me.simulate_paged(w, block_size=4, budget=12)
    assert (b.saturated_steps, b.total_steps, b.preemptions) == (3, 5, 2)
    assert b.token_states == 22 / 36
    assert b.internal_frag == 6 / 36
    assert b.external_other == 8 / 36
    assert b.concurrency == 5 / 3


def test_op_trace_tokens_file_is_prompt_then_output_per_request(tmp_path):
    w = common.load_workload("mooncake", None).head(40)
    tr = op_trace.build(w, num_steps=12, block_size=16, max_running=8, seed=3)
    path = tmp_path / "tokens.bin"
    tr.save_tokens(path)
    flat = np.fromfile(path, dtype="<u4")
    assert flat.size == sum(tr.prompt_lens) + sum(tr.output_lens)
    at = 0
    for r in range(len(tr.prompt_lens)):
        p, o = tr.prompt_lens[r], tr.output_lens[r]
        assert np.array_equal(flat[at : at + p], tr.prompt_tokens(r))
        assert np.array_equal(flat[at + p : at + p + o], tr.output_tokens(r))
        at += p + o


def test_pagedkv_pool_adapter_frees_tail_first():
    import replay_pagedkv  # noqa: PLC0415

    pool = replay_pagedkv.PagedKVReplayer("sha256").pool_adapter(16)
    prompt = pool.allocate(3)
    decode = pool.items(pool.allocate(2))
    decode_tail, prompt_reversed = pool.concat_reversed([prompt, *decode])
    assert [*decode_tail, *prompt_reversed.tolist()] == [decode[1], decode[0], *prompt.tolist()[::-1]]
    pool.free((decode_tail, prompt_reversed))
    # The free stack is LIFO: the block freed last (the prompt's first) comes back first.
    assert pool.allocate(5).tolist() == [*prompt.tolist(), decode[0], decode[1]]
    only_prompt = pool.concat_reversed([prompt])
    assert only_prompt[0] == [] and only_prompt[1].tolist() == prompt.tolist()[::-1]


def test_run_all_rewrites_the_readme_allocator_table_from_the_run(tmp_path):
    import json

    import run_all  # noqa: PLC0415

    machine = {"pagedkv_commit": "0123456789abcdef", "when": "2026-11-30T12:00:00", "cpus": 2}

    def res(ns):
        return {"best": {"ns_per_block_op": ns}, "version": {"version": "vllm 0.33.0"}}

    results = {
        "pagedkv (sha256)": res(100.0),
        "vLLM V1 KVCacheManager": res(2500.0),
        "nano-vllm BlockManager": res(600.0),
        "pagedkv BlockPool": res(20.0),
        "vLLM BlockPool": res(110.0),
        "core alone, Rust (sha256)": res(80.0),
        "core BlockPool, Rust": res(10.0),
    }
    (tmp_path / "allocator_speed.json").write_text(
        json.dumps({"machine": machine, "traces": {"mooncake": {"results": results}}})
    )
    table = run_all.readme_allocator_table(tmp_path, "5.0 / 5.1 / 4.2")
    assert table is not None and "load average 5.0 / 5.1 / 4.2" in table
    assert "| Mooncake | 100 | 2,500 (25.0×) | 600 (6.0×) | 20.0 | 110 (5.5×) | 80.0 / 10.0 | 1.25 / 2.00 |" in table
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{run_all.TABLE_START}\nold\n{run_all.TABLE_END}\nrest\n")
    assert run_all.write_readme_table(table, readme)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("\nrest\n") and "old" not in text and "2,500" in text
    # Without the vLLM baseline the published table is left alone.
    del results["vLLM V1 KVCacheManager"]
    (tmp_path / "allocator_speed.json").write_text(
        json.dumps({"machine": machine, "traces": {"mooncake": {"results": results}}})
    )
    assert run_all.readme_allocator_table(tmp_path, "1.0 / 1.0 / 1.0") is None
