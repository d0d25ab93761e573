"""Mamba / linear-attention layers (vLLM's ``MambaSpec`` in ``align`` cache mode) as pagedkv
state groups: stock vLLM vs ``PagedKVScheduler`` in lockstep, on fake KV cache configs shaped
like Qwen3-Next (three Gated DeltaNet state groups and one full-attention group) and
Nemotron-H / Granite-4.0-H (Mamba-2 state groups and one full-attention group).

Step by step both schedulers must agree on scheduled tokens (vLLM's block-aligned prefill
split runs in both), prefix hits of new and resumed requests, preemptions, finished requests
and new tokens, and, per group, each scheduled request's table length; the attention groups'
real blocks are equal, a state group's may be one fewer in pagedkv: vLLM keeps the previous
state block one step after the live state moved on, pagedkv releases it in the allocation
that moves it (docs/design.md, "Mamba state groups in vLLM"). The runner-facing columns are
checked too: the live state at ``(n - 1) // block_size`` is a real block, and a new request's
hit state sits at ``hit // block_size - 1``.

Runs only where vLLM is installed (``make test-vllm``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from helpers.vllm_streams import assert_blocks_held, random_tokens, shared_prefix_stream  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from pagedkv.integrations.vllm import (  # noqa: E402
    PagedKVCacheManager,
    PagedKVScheduler,
    UnsupportedVllmConfigError,
)
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    NEMOTRON_H_GROUPS,
    QWEN3_NEXT_GROUPS,
    Driver,
    build_scheduler,
    make_mamba_kv_cache_config,
    make_request,
    make_vllm_config,
)

BS = 16


def _config(num_blocks: int, **config: Any) -> Any:
    vc = make_vllm_config(num_blocks=num_blocks, block_size=BS, **config)
    vc.cache_config.mamba_cache_mode = "align"
    return vc


def _lockstep(
    groups: Any,
    stream: dict[int, list[tuple[str, list[int], int]]],
    *,
    num_blocks: int,
    strict: bool = True,
    **config: Any,
) -> tuple[Driver, Driver, list[tuple[dict[str, Any], dict[str, Any]]], dict[str, int]]:
    """Feeds ``stream`` (step -> (id, prompt, max_tokens)) to stock vLLM and the plug-in in
    lockstep. Returns both drivers, the step records and the state-group block figures:
    ``steps`` compared, ``state_diff`` (request-steps where pagedkv's state group held fewer
    real blocks), ``stock_state`` / ``paged_state`` (real state blocks summed over those)."""
    drivers = []
    for cls in (Scheduler, PagedKVScheduler):
        kv = make_mamba_kv_cache_config(num_blocks, groups, BS)
        sched = build_scheduler(
            cls, _config(num_blocks, **config), kv_cache_config=kv, block_size=BS, hash_block_size=BS
        )
        drivers.append(Driver(sched))
    stock, paged = drivers
    kvm = paged.scheduler.kv_cache_manager
    assert isinstance(kvm, PagedKVCacheManager)
    state = [g for g, kind in enumerate(groups) if kind != "full"]
    assert [s.kind for s in kvm._specs] == ["state" if k != "full" else "full" for k in groups]
    figures = {"steps": 0, "state_diff": 0, "stock_state": 0, "paged_state": 0}
    records = []
    last = max(stream)
    for step in range(5000):
        for rid, prompt, max_tokens in stream.get(step, []):
            stock.add(make_request(rid, prompt, max_tokens, block_size=BS))
            paged.add(make_request(rid, prompt, max_tokens, block_size=BS))
        if step > last and not stock.scheduler.has_unfinished_requests():
            if strict:
                assert not paged.scheduler.has_unfinished_requests()
            if not paged.scheduler.has_unfinished_requests():
                break
        a, b = stock.step(), paged.step()
        figures["steps"] += 1
        held_a, held_b = a.pop("blocks_held"), b.pop("blocks_held")
        if strict:
            assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
            for real_a, real_b in assert_blocks_held(step, held_a, held_b, state):
                figures["state_diff"] += 1
                figures["stock_state"] += real_a
                figures["paged_state"] += real_b
        records.append((a, b))
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError("streams did not finish")
    manager = kvm.manager
    manager.check_invariants()
    assert manager.num_sequences == 0
    assert stock.scheduler.kv_cache_manager.usage == 0.0
    assert kvm.usage == 0.0
    return stock, paged, records, figures


@pytest.mark.parametrize("groups", [QWEN3_NEXT_GROUPS, NEMOTRON_H_GROUPS], ids=["qwen3-next", "nemotron-h"])
def test_mamba_shared_prefix_matches_stock_step_by_step(groups: Any) -> None:
    rng = random.Random(7)
    prefix = random_tokens(rng, 150)
    stream = shared_prefix_stream(rng, prefix, 12, (1, 120), 12)
    stock, paged, records, fig = _lockstep(groups, stream, num_blocks=600, max_num_batched_tokens=80, max_num_seqs=16)
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits
    assert paged.prefix_cache_stats == stock.prefix_cache_stats
    hits = [h for h in paged.prefix_hits.values() if h]
    assert hits and all(h % BS == 0 for h in hits)
    assert max(hits) >= 144, "the shared prefix's states must be hit"
    # The live state block moved at least once with the previous state still held by vLLM.
    assert fig["state_diff"] > 0 and fig["paged_state"] < fig["stock_state"]
    print(f"{groups}: {fig}")


@pytest.mark.parametrize("groups", [QWEN3_NEXT_GROUPS, NEMOTRON_H_GROUPS], ids=["qwen3-next", "nemotron-h"])
def test_mamba_runner_columns(groups: Any) -> None:
    # What vLLM's model runner reads in align mode: the live state at (n - 1) // block_size of
    # a request with n tokens after the step is a real block of every state group, every
    # other column of a running request is null (released) or a pending aligned state, and a
    # new request's hit state sits at hit // block_size - 1 of the table it is sent.
    rng = random.Random(11)
    prefix = random_tokens(rng, 100)
    kv = make_mamba_kv_cache_config(400, groups, BS)
    sched = build_scheduler(
        PagedKVScheduler,
        _config(400, max_num_batched_tokens=64, max_num_seqs=8),
        kv_cache_config=kv,
        block_size=BS,
        hash_block_size=BS,
    )
    driver = Driver(sched)
    driver.add(make_request("a", prefix + [7, 8, 9], 4, block_size=BS))
    state = [g for g, kind in enumerate(groups) if kind != "full"]
    full = groups.index("full")
    zeroed: list[int] = []
    for _ in range(4):
        out = sched.schedule()
        zeroed += out.new_block_ids_to_zero or []
        for rid in out.num_scheduled_tokens:
            end = sched.requests[rid].num_computed_tokens
            tables = sched.kv_cache_manager.get_block_ids(rid)
            for g in state:
                assert tables[g][(end - 1) // BS] != 0
                assert len(tables[g]) == -(-end // BS)
        sched.update_from_output(out, _fake(sched, out))
    # vLLM's worker zeroes the attention blocks taken new (Mamba layers share the pool): the
    # full-attention group's blocks, each once, and no state block.
    assert sorted(zeroed) == sorted(sched.kv_cache_manager.get_block_ids("a")[full])
    driver.add(make_request("b", prefix + [1, 2], 3, block_size=BS))
    out = sched.schedule()
    (new,) = out.scheduled_new_reqs
    hit = new.num_computed_tokens
    assert hit == 96
    # The hit's attention blocks hold cached KV: not zeroed.
    assert sorted(out.new_block_ids_to_zero or []) == sorted(new.block_ids[full][hit // BS :])
    for g in state:
        table = new.block_ids[g]
        assert table[hit // BS - 1] != 0, "the hit state is the runner's copy source"
        assert table[(hit + out.num_scheduled_tokens["b"] - 1) // BS] != 0
        assert sum(1 for b in table if b) == 2


def _fake(sched: Any, out: Any) -> Any:
    from pagedkv.testing.vllm_scheduler import fake_model_output

    return fake_model_output(sched, out)


def test_mamba_states_publish_only_after_the_step_completed() -> None:
    # The commit fence: a state written by step N is hit only once vLLM reported step N.
    kv = make_mamba_kv_cache_config(200, NEMOTRON_H_GROUPS, BS)
    sched = build_scheduler(
        PagedKVScheduler,
        _config(200, max_num_batched_tokens=64, max_num_seqs=8),
        kv_cache_config=kv,
        block_size=BS,
        hash_block_size=BS,
    )
    prompt = list(range(100, 180))
    sched.add_request(make_request("a", prompt, 2, block_size=BS))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 64}
    kvm = sched.kv_cache_manager
    probe = make_request("probe", prompt + [5], 1, block_size=BS)
    _, hit, _ = kvm.get_computed_blocks(probe)
    assert hit == 0, "the state after 64 tokens is not published while its step runs"
    kvm.free(probe)
    sched.update_from_output(out, _fake(sched, out))
    probe2 = make_request("probe2", prompt + [5], 1, block_size=BS)
    _, hit, _ = kvm.get_computed_blocks(probe2)
    assert hit == 64
    kvm.free(probe2)


def test_mamba_under_memory_pressure_outputs_match() -> None:
    # A small pool: admission waits and running requests are preempted. pagedkv holds one
    # state block fewer per request whose live state just moved (see the module docs), so
    # free blocks and then admission / preemption may diverge; outputs must agree.
    rng = random.Random(3)
    prefix = random_tokens(rng, 64)
    stream = shared_prefix_stream(rng, prefix, 12, (40, 200), 6)
    stock, paged, records, _ = _lockstep(
        NEMOTRON_H_GROUPS, stream, num_blocks=60, strict=False, max_num_batched_tokens=128, max_num_seqs=16
    )
    assert paged.outputs == stock.outputs
    assert paged.finish_reasons == stock.finish_reasons
    pre_a = sum(len(a["preempted"]) for a, _ in records)
    pre_b = sum(len(b["preempted"]) for _, b in records)
    same = sum(1 for a, b in records if a["scheduled"] == b["scheduled"])
    assert pre_a > 0, "the small pool must preempt"
    print(
        f"pressure: preemptions stock {pre_a} pagedkv {pre_b}; steps stock {len(records)}, "
        f"equal schedules {same}; hit tokens stock {sum(stock.prefix_hits.values())} "
        f"pagedkv {sum(paged.prefix_hits.values())}"
    )


def _build(groups: Any = NEMOTRON_H_GROUPS, *, vc: Any = None, **kv: Any) -> Any:
    config = make_mamba_kv_cache_config(64, groups, BS, **kv)
    return build_scheduler(
        PagedKVScheduler, vc or _config(64), kv_cache_config=config, block_size=BS, hash_block_size=BS
    )


@pytest.mark.parametrize(
    ("kv", "field"),
    [
        ({"mamba_cache_mode": "all"}, "mamba_cache_mode"),
        ({"mamba_cache_mode": "none"}, "mamba_cache_mode"),
        ({"num_speculative_blocks": 1}, "num_speculative_blocks"),
        ({"num_prefill_checkpoint_blocks": 1}, "num_prefill_checkpoint_blocks"),
    ],
)
def test_mamba_refusals_name_the_setting(kv: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedVllmConfigError) as err:
        _build(**kv)
    assert field in err.value.field


def test_mamba_cache_mode_refusals_name_the_offending_value() -> None:
    # The group's mode is 'all': that field, that value.
    with pytest.raises(UnsupportedVllmConfigError) as err:
        _build(mamba_cache_mode="all")
    assert err.value.field.endswith("kv_cache_spec.mamba_cache_mode") and err.value.value == "all"
    # A supported mode ('none') that differs from the cache config's ('align'): named as such.
    with pytest.raises(UnsupportedVllmConfigError) as err:
        _build(mamba_cache_mode="none")
    assert err.value.field.endswith("kv_cache_spec.mamba_cache_mode") and err.value.value == "none"
    assert "must be the cache config's ('align')" in err.value.reason
    assert "only vLLM's" not in err.value.reason


def test_mamba_serves_async_scheduling_and_refuses_partial_hashes() -> None:
    # Async scheduling is served (test_vllm_mamba_async.py runs it against stock).
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    sched = _build(vc=_config(64, async_scheduling=True))
    assert isinstance(sched, AsyncScheduler) and sched.kv_cache_manager.async_scheduling
    vc = _config(64)
    vc.cache_config.mamba_cache_mode = "all"
    with pytest.raises(UnsupportedVllmConfigError) as err:
        _build(vc=vc)
    assert err.value.field == "cache_config.mamba_cache_mode"
    config = make_mamba_kv_cache_config(64, NEMOTRON_H_GROUPS, BS)
    with pytest.raises(UnsupportedVllmConfigError) as err:
        build_scheduler(PagedKVScheduler, _config(64), kv_cache_config=config, block_size=BS, hash_block_size=8)
    assert err.value.field == "hash_block_size"


def test_mamba_cache_salts_and_aborts_match_stock() -> None:
    # Same prompts under two cache salts arriving together (a salted request never hits or
    # waits for an unsalted one's states), and requests aborted mid-prefill (their pending
    # states are released unpublished; stock's are cached and freed): step by step equal.
    rng = random.Random(5)
    prefix = random_tokens(rng, 120)
    drivers = []
    for cls in (Scheduler, PagedKVScheduler):
        kv = make_mamba_kv_cache_config(500, QWEN3_NEXT_GROUPS, BS)
        config = _config(500, max_num_batched_tokens=64, max_num_seqs=16)
        drivers.append(Driver(build_scheduler(cls, config, kv_cache_config=kv, block_size=BS, hash_block_size=BS)))
    records = []
    for step in range(200):
        for d in drivers:
            if step in (0, 3):
                for i in range(4):
                    salt = "s" if i % 2 else None
                    rid = f"q{step}-{i}"
                    d.add(make_request(rid, prefix + [7 + i, step], 6, block_size=BS, cache_salt=salt))
            if step == 2:
                d.abort(["q0-1"])
        if step > 3 and not drivers[0].scheduler.has_unfinished_requests():
            break
        a, b = (d.step() for d in drivers)
        assert b == a or {k: v for k, v in b.items() if k != "blocks_held"} == {
            k: v for k, v in a.items() if k != "blocks_held"
        }, f"step {step}:\nstock {a}\npaged {b}"
        records.append(b)
    stock, paged = drivers
    assert paged.outputs == stock.outputs and paged.prefix_hits == stock.prefix_hits
    assert paged.finish_reasons["q0-1"] == stock.finish_reasons["q0-1"] == "abort"
    # The second wave hits its own salt's states only.
    hits = {rid: h for rid, h in paged.prefix_hits.items() if rid.startswith("q3")}
    assert all(h >= 112 for h in hits.values()), hits
    kvm = paged.scheduler.kv_cache_manager
    kvm.manager.check_invariants()
    assert kvm.manager.num_sequences == 0


@pytest.mark.parametrize("seed", [1, 4, 10, 21])
def test_mamba_random_streams_match_stock(seed: int) -> None:
    # Random prompt lengths, shared prefixes, token budgets, long-prefill thresholds (below the
    # block size too: vLLM's split then advances a block in several sub-block chunks) and
    # running-request caps: equal step by step.
    rng = random.Random(seed)
    groups = (QWEN3_NEXT_GROUPS, NEMOTRON_H_GROUPS)[seed % 2]
    prefix = random_tokens(rng, rng.randrange(0, 200))
    stream = shared_prefix_stream(rng, prefix, rng.randrange(4, 14), (1, rng.randrange(2, 150)), rng.randrange(1, 15))
    stock, paged, _, _ = _lockstep(
        groups,
        stream,
        num_blocks=1000,
        max_num_batched_tokens=rng.choice([32, 48, 64, 80, 128, 256]),
        max_num_seqs=rng.choice([2, 4, 16]),
        long_prefill_token_threshold=rng.choice([0, 8, 24, 40]),
    )
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits
