"""Tests of the benchmark helpers that the figures depend on: the first-fit contiguous allocator,
the reservation policies, Mooncake token expansion and the operation-trace builder."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

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
    decode = list(pool.allocate_items(2))
    assert all(type(b) is int for b in decode)
    pool.free_request([prompt, *decode])  # decode blocks last-first, then the prompt from its end
    # The free stack is LIFO: the block freed last (the prompt's first) comes back first.
    assert pool.allocate(5).tolist() == [*prompt.tolist(), decode[0], decode[1]]
    last = pool.allocate(2)
    pool.free_request([last])  # a request with no decode block: its last block first
    assert pool.allocate(2).tolist() == last.tolist()


def _write(d, name, payload):
    import json  # noqa: PLC0415

    (d / f"{name}.json").write_text(json.dumps(payload))


def _allocator_fixture(d, with_vllm=True):
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
    if not with_vllm:
        del results["vLLM V1 KVCacheManager"]
    _write(
        d,
        "allocator_speed",
        {
            "machine": {"pagedkv_commit": "0123456789abcdef", "when": "2026-11-30T12:00:00", "cpus": 2},
            "load_average": [5.0, 5.1, 4.2],
            "traces": {"mooncake": {"results": results}},
        },
    )


def _summary_fixtures(d):
    """Small JSONs in the layouts the benchmarks write (values chosen so ratios are exact)."""
    machine = {"pagedkv_commit": "abcdef0123456789", "when": "2026-11-30T12:00:00", "cpus": 2}
    mem = [
        {"workload": w, "system": s, "token_states": v}
        for w, s, v in [
            ("sharegpt_like", "pagedkv bs=16", 0.975),
            ("sharegpt_like", "contiguous max", 0.2),
            ("sharegpt_like", "contiguous oracle", 0.5),
            ("azure_conv", "pagedkv bs=16", 0.99),
            ("azure_conv", "contiguous oracle", 0.75),
        ]
    ]
    _write(d, "memory_efficiency", {"machine": machine, "results": mem})
    sharing = [{"mode": "beam search", "k": k, "saving": v} for k, v in ((2, 0.375), (4, 0.5))]
    sharing += [
        {"mode": "parallel sampling", "k": 2, "saving": 0.2, "prompt_tokens_mean": 40.0, "output_tokens_mean": 50.0},
        {"mode": "parallel sampling, simulated lengths", "k": 2, "saving": 0.034},
    ]
    _write(d, "sharing", {"machine": machine, "settings": {"block_size": 16}, "results": sharing})
    _write(
        d,
        "engine_throughput",
        {
            "machine": {"threads": 1},
            "slo": {"ttft_s": 10.0, "tpot_s": 0.5},
            "workloads": {
                "trace": {
                    "requests": 16,
                    "output_tokens": 320,
                    "speedup_vs_hf-static": 1.6,
                    "speedup_vs_hf-cb": 2.0,
                    "systems": {
                        "pagedkv": {
                            "wall_s": 16.0,
                            "output_tokens_per_s": 20.0,
                            "goodput_share": 0.75,
                            "goodput_requests_per_s": 0.75,
                        },
                        "hf-static": {
                            "wall_s": 25.6,
                            "output_tokens_per_s": 12.5,
                            "goodput_share": 0.25,
                            "goodput_requests_per_s": 0.15625,
                        },
                        "hf-cb": {"wall_s": 32.0, "output_tokens_per_s": 10.0},
                    },
                }
            },
        },
    )
    _write(d, "engine_roofline", {"staged_schedule_gemm_s": 12.0, "measured_walls_s": {"pagedkv": 16.0}})


def test_readme_summary_table_quotes_each_json_with_ratios_and_targets(tmp_path):
    import readme_tables as rt  # noqa: PLC0415

    _summary_fixtures(tmp_path)
    md = rt.readme_blocks(tmp_path, None, {})["summary"]
    assert md.startswith(rt.BLOCKS["summary"][0]) and md.endswith(rt.BLOCKS["summary"][1])
    assert "no run record" in md and "2 CPUs" in md
    assert (
        "| KV memory holding token states, ShareGPT-like lengths, block 16 | 97.5% | contiguous max-length "
        "20.0%, oracle-length 50.0% | paper Fig. 2: 96.3% vs 20.4–38.2% | 2026-11-30 12:00, `abcdef01` |"
    ) in md
    assert "| same, Azure conversation traces, block 16 | 99.0% | contiguous oracle 75.0% |" in md
    assert "| 37.5 / 50.0% | | paper Fig. 15: 37.56 / 53.13% |" in md
    assert "| 20.0% | Alpaca-like lengths (19 prompt / 58 output tokens, simulated): 3.4% |" in md
    assert "~40 tokens = 2 full shared blocks vs ~50 output tokens" in md
    # Engine: tokens/s, each baseline's ratio and its target verdict, and the GEMM floor share.
    assert "| 20.0 (16.0 s) | static `generate` 12.5 (25.6 s): 1.60×; `generate_batch` 10.0 (32.0 s): 2.00× |" in md
    assert "≥ 1.5× static `generate`: met; ≥ 3× `generate_batch`: not met" in md
    assert "this wall is 1.33× the staged schedule's GEMM time (12.0 s, `engine_roofline.py`), i.e. 75% of" in md
    assert "target ≥ 90%: not met" in md
    assert (
        "| goodput, same workload (TTFT ≤ 10 s and TPOT ≤ 0.5 s) | 75% (0.75 req/s) "
        "| static `generate` 25% (0.16 req/s) |" in md
    )
    # prefix_caching.json is missing: a "not run" row, never old figures.
    assert "| Mooncake prefix-cache hit rate | not run (`benchmarks/prefix_caching.py`) |" in md


def test_readme_tables_show_failed_stale_and_unrun_benchmarks(tmp_path):
    import readme_tables as rt  # noqa: PLC0415

    _summary_fixtures(tmp_path)
    run = {
        "started": "2026-11-30T13:00:00",
        "commit": "feedfacecafe0000",
        "cpus": 2,
        "load_average_end": [3.0, 2.5, 2.0],
    }
    jobs = {
        "memory_efficiency": {"rc": 1},
        "sharing": {"rc": 0, "wrote_json": False},
        "engine_throughput": {"rc": None},
        "engine_roofline": {"rc": 0, "wrote_json": True, "json_when": "2026-11-30T13:05:00"},
    }
    md = rt.readme_blocks(tmp_path, run, jobs)["summary"]
    assert "run started 2026-11-30 13:00:00 at commit `feedfacecafe`, 2 CPUs, load average 3.0 / 2.5 / 2.0" in md
    assert "| KV memory holding token states | failed (exit 1) (`benchmarks/memory_efficiency.py`) |" in md
    assert "stale: its run wrote no new JSON (`benchmarks/sharing.py`)" in md
    assert "| engine output tokens/s | timed out (`benchmarks/engine_throughput.py`) |" in md
    for old in ("97.5%", "37.5", "20.0 (16.0 s)"):
        assert old not in md
    # A JSON from before the run that no job of the run produced is not quoted either.
    src = rt.load_source(tmp_path, "memory_efficiency", run, {})
    assert not src.ok and src.problem.startswith("not run in this run (its JSON is from 2026-11-30T12:00:00")
    # A job of the run that rewrote its JSON is quoted with the run record's time.
    assert rt.load_source(tmp_path, "engine_roofline", run, jobs).stamp() == "2026-11-30 13:05"


def test_readme_allocator_vllm_and_cluster_blocks(tmp_path):
    import readme_tables as rt  # noqa: PLC0415

    _allocator_fixture(tmp_path)
    _write(
        tmp_path,
        "vllm_scheduler",
        {
            "machine": {"when": "2026-11-30T12:10:00", "cpus": 2},
            "vllm": "0.33.0",
            "steps": 200,
            "repeats": 3,
            "sample_runs": 6,
            "load_average_1_5_15min": {"start": [5.0, 4, 4], "end": [5.5, 4, 4]},
            "results": {
                "decode256": {
                    "vLLM stock": {
                        "schedule_us": 2000.0,
                        "update_us": 1000.0,
                        "total_us": 3000.0,
                        "kv_share": 0.5,
                        "kv_us": 1500.0,
                        "samples": 1000,
                    },
                    "pagedkv": {
                        "schedule_us": 1000.0,
                        "update_us": 500.0,
                        "total_us": 1500.0,
                        "kv_share": 0.125,
                        "kv_us": 187.5,
                        "samples": 600,
                    },
                    "pagedkv per-request": {
                        "schedule_us": 1500.0,
                        "update_us": 500.0,
                        "total_us": 2000.0,
                        "kv_share": 0.3,
                        "kv_us": 600.0,
                    },
                }
            },
        },
    )
    _write(
        tmp_path,
        "cluster_sim",
        {
            "machine": {"when": "2026-11-30T12:20:00"},
            "params": {"kv_tokens_per_replica": 1048576, "rate_per_replica": 1.0},
            "workload": {"requests": 2500},
            "rows": [
                {
                    "policy": "kv_aware",
                    "replicas": 8,
                    "hit_rate": 0.24,
                    "ttft_p50_s": 0.4,
                    "ttft_p99_s": 3.0,
                    "load_max_over_mean": 1.2,
                },
                {
                    "policy": "round_robin",
                    "replicas": 8,
                    "hit_rate": 0.08,
                    "ttft_p50_s": 0.7,
                    "ttft_p99_s": 6.0,
                    "load_max_over_mean": 1.6,
                },
                {
                    "policy": "one_big_cache",
                    "replicas": 8,
                    "hit_rate": 0.25,
                    "ttft_p50_s": 0.3,
                    "ttft_p99_s": 1.0,
                    "load_max_over_mean": None,
                },
            ],
        },
    )
    blocks = rt.readme_blocks(tmp_path, None, {})
    alloc = blocks["allocator"]
    assert "load average 5.0 / 5.1 / 4.2" in alloc
    assert "| Mooncake | 100 | 2,500 (25.0×) | 600 (6.0×) | 20.0 | 110 (5.5×) | 80.0 / 10.0 | 1.25 / 2.00 |" in alloc
    assert "Cost against scale: not run (`benchmarks/scaling.py`)." in alloc
    # The same steps also writing per-token arrays, when measured, in brackets after pagedkv's figure.
    spd = json.loads((tmp_path / "allocator_speed.json").read_text())
    spd["traces"]["mooncake"]["results"]["pagedkv (sha256) + per-token arrays"] = {"best": {"ns_per_block_op": 130.0}}
    _write(tmp_path, "allocator_speed", spd)
    assert "| Mooncake | 100 (130) | 2,500 (25.0×) |" in rt.readme_blocks(tmp_path, None, {})["allocator"]
    vs = blocks["vllm_scheduler"]
    assert "| 256 decoding requests | vLLM 0.33.0 stock | 2,000 | 1,000 | 3,000 | 50.0% (1,500) |" in vs
    assert "| | `PagedKVScheduler` | 1,000 | 500 | 1,500 (2.00×) | 12.5% (188), 4.0× lower |" in vs
    assert "1-minute load average 5.0–5.5; 600–1,000 CPU-time samples per row" in vs
    assert "the total is 2,000 µs (1.50×) and the KV share 30.0%" in vs
    cl = blocks["cluster"]
    assert "| 8 | kv-aware | 24.0% | 96.0% | 0.40 s | 3.00 s | 1.20 |" in cl
    assert "| 8 | one-big-cache | 25.0% | 100.0% | 0.30 s | 1.00 s | — |" in cl
    assert "1M tokens of KV" in cl and "8 replicas: met" in cl
    # Without the vLLM baseline the published allocator table is left alone.
    _allocator_fixture(tmp_path, with_vllm=False)
    assert rt.readme_blocks(tmp_path, None, {})["allocator"] is None


def test_write_readme_replaces_only_between_the_markers(tmp_path):
    import readme_tables as rt  # noqa: PLC0415

    s0, e0 = rt.BLOCKS["summary"]
    s1, e1 = rt.BLOCKS["allocator"]
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{s0}\nold summary\n{e0}\nprose between\n{s1}\nold alloc\n{e1}\nrest\n")
    done = rt.write_readme(
        {
            "summary": f"{s0}\nNEW\n{e0}",
            "allocator": None,
            "cluster": "<!-- BENCH_CLUSTER_TABLE_START -->\nX\n<!-- BENCH_CLUSTER_TABLE_END -->",
        },
        readme,
    )
    assert done == {"summary": "rewritten", "allocator": "left as it is", "cluster": "markers not found"}
    assert readme.read_text() == f"intro\n{s0}\nNEW\n{e0}\nprose between\n{s1}\nold alloc\n{e1}\nrest\n"
    # Markers out of order are refused, and the file is left as it was.
    readme.write_text(f"{e0}\nbody\n{s0}\n")
    assert rt.write_readme({"summary": f"{s0}\nNEW\n{e0}"}, readme) == {"summary": "markers not found"}
    assert readme.read_text() == f"{e0}\nbody\n{s0}\n"


def test_run_all_summary_only_rewrites_every_readme_block_from_the_committed_results(tmp_path, monkeypatch):
    import json  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    import run_all  # noqa: PLC0415

    # The JSON layouts the benchmarks really write (benchmarks/results/), one of them removed.
    names = [n for n in run_all.readme_tables.SOURCES if (common.RESULTS_DIR / f"{n}.json").exists()]
    for n in names:
        shutil.copy(common.RESULTS_DIR / f"{n}.json", tmp_path / f"{n}.json")
    (tmp_path / "prefix_caching.json").unlink(missing_ok=True)
    readme = tmp_path / "README.md"
    readme.write_text("\n\nprose\n\n".join(f"{a}\nold\n{b}" for a, b in run_all.readme_tables.BLOCKS.values()))
    monkeypatch.setattr(run_all, "README", readme)
    run_all.main(["--summary-only", "--results-dir", str(tmp_path)])
    text = readme.read_text()
    assert "\nold\n" not in text and text.count("\n\nprose\n\n") == len(run_all.readme_tables.BLOCKS) - 1
    assert "layout not understood" not in text
    assert "| Mooncake prefix-cache hit rate | not run (`benchmarks/prefix_caching.py`) |" in text
    if "allocator_speed" in names:
        spd = json.loads((tmp_path / "allocator_speed.json").read_text())
        ns = spd["traces"]["mooncake"]["results"]["pagedkv (sha256)"]["best"]["ns_per_block_op"]
        assert f"| Mooncake | {run_all.readme_tables._n(ns)} " in text
    assert (tmp_path / "SUMMARY.md").exists()


def test_cluster_sim_holds_a_turn_until_its_previous_turn_finishes():
    """A conversation's next turn (``parents``) whose trace time falls before its previous turn
    finished arrives when that turn finishes: it then hits the previous prompt and reply, and
    its TTFT counts from that arrival. Without ``parents`` the same trace sends it while the
    previous turn is still being prefilled, so it hits the prompt alone."""
    import cluster_sim  # noqa: PLC0415

    bs = 4
    first = np.arange(100, 116, dtype=np.int64)  # 16 tokens, 4 blocks
    reply = common.unique_tokens(0, 8)  # what the simulated engine decodes for request 0
    second = np.concatenate([first, reply, np.arange(500, 504, dtype=np.int64)])
    tm = cluster_sim.TimeModel(0.01, 0.0, 0.0, 4)  # 4 prefill tokens per step
    args = (np.array([8, 2]), [first, second], np.array([0.0, 0.005]), 1, "kv_aware", 64, bs, tm, "xxh3_128")
    held = cluster_sim.simulate(*args, parents=np.array([-1, 0]))
    free = cluster_sim.simulate(*args)
    # Held: the 16 prompt and 8 reply tokens hit (6 full blocks). Not held: the turn comes while
    # request 0 is still prefilling and hits its 4 prompt blocks only.
    assert held["hit_rate"] == pytest.approx(24 / 44)
    assert free["hit_rate"] == pytest.approx(16 / 44)
    # Request 0: 4 prefill steps of 10 ms (TTFT 0.04 s), then 7 decode steps; the held turn
    # arrives when it finishes and prefills its 4 uncached tokens in one step (TTFT 0.01 s).
    assert held["ttft_mean_s"] == pytest.approx((0.04 + 0.01) / 2)


def _hybrid_stream(n: int, shared: bool) -> common.Workload:
    """``n`` requests of 600-2,100 prompt tokens (past Gemma 3's 512 window); with ``shared``,
    Mooncake-style hash ids whose first two 512-token blocks are common to every request."""
    rng = np.random.default_rng(7)
    prompt = rng.integers(600, 2100, n).astype(np.int64)
    output = rng.integers(1, 40, n).astype(np.int64)
    hash_ids = [[0, 1] + [1000 * r + k for k in range(2, -(-int(p) // 512))] for r, p in enumerate(prompt)]
    return common.Workload(
        "synthetic_shared" if shared else "synthetic_unique",
        prompt,
        output,
        np.zeros(n),
        hash_ids if shared else None,
        "test",
    )


def test_hybrid_benchmark_quick_invariants():
    """benchmarks/hybrid.py on tiny synthetic streams: a full-attention-only request holds
    exactly ceil(tokens / 16) blocks of 18 layers; a hybrid one no more than its full group's
    blocks plus 5 windows of blocks; hybrid <= full-only bytes and >= its concurrency in the same
    pool; hit rates in [0, 1], dense retention serving the shared 1,024-token prefix."""
    import hybrid  # noqa: PLC0415

    unique, shared = _hybrid_stream(40, False), _hybrid_stream(40, True)
    payload = hybrid.run([unique, shared], 64 * 2**20, use_vllm=False)
    assert payload["hybrid_num_blocks"] == 64 * 2**20 // (3 * 16 * 1024)
    assert payload["full_num_blocks"] == 64 * 2**20 // (18 * 16 * 1024)
    tokens = unique.prompt_lens + unique.output_lens - 1
    full_blocks = -(-tokens // 16)
    res = payload["results"]["synthetic_unique"]["systems"]
    assert res["vLLM hybrid"] is None  # not requested: its row is skipped
    assert res["pagedkv full-only"]["kv_bytes_mean"] == pytest.approx(full_blocks.mean() * 18 * 16 * 1024)
    window_blocks = -(-511 // 16) + 2
    # A request with one output token leaves right after its prefill (one chunk), which wrote
    # every prompt block of every group; later ones have released what fell out of the window.
    sliding = np.where(unique.output_lens == 1, full_blocks, np.minimum(full_blocks, window_blocks))
    bound = (full_blocks + 5 * sliding) * 3 * 16 * 1024
    for name in ("pagedkv hybrid r=0", "pagedkv hybrid r=512", "pagedkv hybrid r=1024"):
        assert res[name]["kv_bytes_p99"] <= np.percentile(bound, 99)
        assert res[name]["kv_bytes_mean"] <= bound.mean()
    for r in payload["results"].values():
        systems = r["systems"]
        full = systems["pagedkv full-only"]
        for name in ("pagedkv hybrid r=0", "pagedkv hybrid r=512", "pagedkv hybrid r=1024"):
            h = systems[name]
            assert h["kv_bytes_mean"] <= full["kv_bytes_mean"]
            assert h["kv_bytes_p99"] <= full["kv_bytes_p99"]
            assert h["max_concurrent"] >= full["max_concurrent"]
            assert 0.0 <= h["hit_rate"] <= 1.0 and h["ns_per_block_op"] > 0
        assert 0.0 <= full["hit_rate"] <= 1.0
    assert payload["results"]["synthetic_unique"]["systems"]["pagedkv hybrid r=0"]["hit_rate"] == 0.0
    # 39 of the 40 requests can hit the 1,024 shared tokens (the first computes them).
    dense = payload["results"]["synthetic_shared"]["systems"]["pagedkv hybrid r=0"]["hit_rate"]
    assert dense >= 0.9 * 39 * 1024 / shared.prompt_lens.sum()
    assert hybrid.goal(payload) == {"synthetic_unique": None, "synthetic_shared": None}
