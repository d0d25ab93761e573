"""vLLM's real V1 Scheduler, stock vs ``PagedKVScheduler``, on the same request streams.

Both run with the deterministic fake model of ``pagedkv.testing.vllm_scheduler`` (a
sampled token depends only on the request id and its position). Where no cached block is
evicted, every step must agree:
scheduled request ids and token counts, prefix-hit tokens of new and resumed requests,
preempted and finished requests, new tokens, and blocks held per scheduled request. Under
eviction pressure the two free-queue orders differ by design (pagedkv's free list vs vLLM's LRU
queue), so there every request must still finish with the same output and no block may leak.
The other difference by design, which copy a hit takes when one block is cached twice, is shown
step by step by its own test.

Runs only where vLLM is installed (``make test-vllm`` builds that environment).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from pagedkv.integrations.vllm import PagedKVScheduler  # noqa: E402
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    Driver,
    build_scheduler,
    fake_token,
    make_request,
    make_vllm_config,
)

BS = 16


class PerRequestPagedKVScheduler(PagedKVScheduler):
    """The plug-in without its batched decode path (one allocate_slots call per request)."""

    batch_decode = False


def _pair(paged_cls: type = PagedKVScheduler, **config: Any) -> tuple[Driver, Driver]:
    stock = Driver(build_scheduler(Scheduler, make_vllm_config(**config)))
    paged = Driver(build_scheduler(paged_cls, make_vllm_config(**config)))
    return stock, paged


def _check_no_leak(stock: Driver, paged: Driver) -> None:
    """Both pools are empty once every request is done (cached blocks count as free)."""
    assert not stock.scheduler.has_unfinished_requests()
    assert not paged.scheduler.has_unfinished_requests()
    assert stock.scheduler.kv_cache_manager.usage == 0.0
    assert paged.scheduler.kv_cache_manager.usage == 0.0
    kvm = paged.scheduler.kv_cache_manager.manager
    kvm.check_invariants()
    assert kvm.num_sequences == 0
    stats = kvm.stats()
    assert stats.used == 0 and stats.free == stats.num_blocks - 1


def _lockstep(
    stream: dict[int, list[Any]],
    *,
    strict: bool = True,
    max_steps: int = 2000,
    actions: dict[int, Any] | None = None,
    paged_cls: type = PagedKVScheduler,
    **config: Any,
) -> tuple[Driver, Driver, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Feeds ``stream`` (step -> request factories) to both schedulers in lockstep.

    ``actions`` (step -> callable(driver)) run on both drivers before that step's
    ``schedule()``. With ``strict`` every step record must be equal.
    """
    stock, paged = _pair(paged_cls, **config)
    records = []
    last_arrival = max(stream) if stream else 0
    for step in range(max_steps):
        for factory in stream.get(step, []):
            stock.add(factory())
            paged.add(factory())
        if actions and step in actions:
            actions[step](stock)
            actions[step](paged)
        if step > last_arrival and not stock.scheduler.has_unfinished_requests():
            assert not paged.scheduler.has_unfinished_requests()
            break
        a, b = stock.step(), paged.step()
        if strict:
            assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
        records.append((a, b))
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError("streams did not finish")
    paged.scheduler.kv_cache_manager.manager.check_invariants()
    return stock, paged, records


def _req(rid: str, prompt: list[int], max_tokens: int, **kw: Any) -> Any:
    return lambda: make_request(rid, prompt, max_tokens, block_size=BS, **kw)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 4000) for _ in range(n)]


@pytest.mark.parametrize("paged_cls", [PagedKVScheduler, PerRequestPagedKVScheduler])
def test_staggered_arrivals_shared_system_prompts_chunked_prefill(paged_cls: type) -> None:
    rng = random.Random(1)
    systems = [_tokens(rng, 64), _tokens(rng, 40)]
    stream: dict[int, list[Any]] = {}
    for i in range(24):
        prompt = systems[i % 2] + _tokens(rng, rng.randrange(1, 90))
        stream.setdefault(rng.randrange(0, 30), []).append(_req(f"r{i}", prompt, rng.randrange(1, 40)))
    # A long prompt that needs several chunks at 128 tokens per step.
    stream.setdefault(3, []).append(_req("long", systems[0] + _tokens(rng, 500), 8))
    stock, paged, records = _lockstep(
        stream,
        num_blocks=1024,
        max_num_batched_tokens=128,
        long_prefill_token_threshold=64,
        paged_cls=paged_cls,
    )
    assert stock.outputs == paged.outputs
    batched = paged.scheduler.kv_cache_manager.num_batched_allocations
    if paged_cls is PagedKVScheduler:
        assert batched > 100, "the batched decode path must carry the decodes"
    else:
        assert batched == 0
    hits = [h for _, b in records for h in b["new_prefix_hits"].values()]
    assert max(hits) >= 64, "shared system prompts must produce prefix hits"
    chunked = [s["scheduled"].get("long", 0) for s, _ in records if "long" in s["scheduled"]]
    assert len(chunked) > 4 and max(chunked) <= 128
    _check_no_leak(stock, paged)


def test_outputs_follow_the_fake_model() -> None:
    prompt = list(range(200, 240))
    stock, paged, _ = _lockstep({0: [_req("a", prompt, 5)]}, num_blocks=64)
    want = [fake_token("a", len(prompt) + i) for i in range(5)]
    assert paged.outputs["a"] == stock.outputs["a"] == want
    assert paged.finish_reasons["a"] == stock.finish_reasons["a"] == "length"


def test_cache_salts_and_lora_identities_do_not_share() -> None:
    rng = random.Random(2)
    prompt = _tokens(rng, 70)
    stream = {
        0: [_req("plain", prompt, 3)],
        4: [
            _req("plain-again", prompt, 3),
            _req("salt-a", prompt, 3, cache_salt="tenant-a"),
            _req("lora-x", prompt, 3, lora=("adapter-x", 1)),
        ],
        8: [
            _req("salt-a-again", prompt, 3, cache_salt="tenant-a"),
            _req("salt-b", prompt, 3, cache_salt="tenant-b"),
            _req("lora-x-again", prompt, 3, lora=("adapter-x", 1)),
            _req("lora-y", prompt, 3, lora=("adapter-y", 2)),
        ],
    }
    stock, paged, _ = _lockstep(stream, num_blocks=256, max_loras=2)
    assert paged.prefix_hits == stock.prefix_hits
    assert paged.prefix_hits["plain-again"] == 64
    assert paged.prefix_hits["salt-a"] == 0 and paged.prefix_hits["lora-x"] == 0
    assert paged.prefix_hits["salt-a-again"] == 64 and paged.prefix_hits["salt-b"] == 0
    assert paged.prefix_hits["lora-x-again"] == 64 and paged.prefix_hits["lora-y"] == 0
    _check_no_leak(stock, paged)


def test_parallel_sampling_children_share_the_prompt() -> None:
    # vLLM fans n > 1 out into n child requests with the same prompt ("{i}_{parent}").
    rng = random.Random(3)
    prompt = _tokens(rng, 100)
    stream = {0: [_req(f"{i}_parent", prompt, 12) for i in range(4)], 2: [_req("0_late", prompt, 4)]}
    stock, paged, _ = _lockstep(stream, num_blocks=256)
    assert paged.outputs == stock.outputs
    assert len({tuple(v) for k, v in paged.outputs.items() if k.endswith("_parent")}) == 4
    assert paged.prefix_hits["0_late"] == 96
    _check_no_leak(stock, paged)


def test_stop_tokens_and_max_tokens() -> None:
    rng = random.Random(4)
    prompts = [_tokens(rng, 30 + 7 * i) for i in range(6)]
    stream: dict[int, list[Any]] = {0: []}
    for i, p in enumerate(prompts):
        # Requests 0..2 stop on the token the fake model samples at their 4th output position.
        stop = [fake_token(f"s{i}", len(p) + 3)] if i < 3 else []
        stream[0].append(_req(f"s{i}", p, 20, stop_token_ids=stop))
    stock, paged, _ = _lockstep(stream, num_blocks=256)
    assert paged.outputs == stock.outputs
    assert paged.finish_reasons == stock.finish_reasons
    for i in range(3):
        assert paged.finish_reasons[f"s{i}"] == "stop" and len(paged.outputs[f"s{i}"]) == 4
    for i in range(3, 6):
        assert paged.finish_reasons[f"s{i}"] == "length" and len(paged.outputs[f"s{i}"]) == 20
    _check_no_leak(stock, paged)


def test_aborts_waiting_and_running() -> None:
    rng = random.Random(5)
    stream = {0: [_req(f"a{i}", _tokens(rng, 50), 30) for i in range(8)]}
    stream[1] = [_req("waiting", _tokens(rng, 300), 5)]

    def abort(driver: Driver) -> None:
        driver.abort(["a1", "a5", "waiting"])

    stock, paged, _ = _lockstep(stream, num_blocks=128, max_num_batched_tokens=64, actions={3: abort})
    assert paged.outputs == stock.outputs
    assert paged.finish_reasons["a1"] == "abort" and len(paged.outputs["a1"]) < 30
    _check_no_leak(stock, paged)


def test_reset_prefix_cache_busy_then_idle() -> None:
    rng = random.Random(6)
    prompt = _tokens(rng, 80)
    results: dict[str, list[bool]] = {"stock": [], "paged": []}

    def reset(driver: Driver) -> None:
        key = "paged" if isinstance(driver.scheduler, PagedKVScheduler) else "stock"
        results[key].append(driver.scheduler.reset_prefix_cache())

    stream = {0: [_req("first", prompt, 4)], 12: [_req("after-reset", prompt, 4)]}
    stock, paged, _ = _lockstep(stream, num_blocks=128, actions={2: reset, 10: reset})
    # Busy (a request holds blocks): refused by both; idle: done by both.
    assert results["paged"] == results["stock"] == [False, True]
    assert paged.prefix_hits["after-reset"] == stock.prefix_hits["after-reset"] == 0
    _check_no_leak(stock, paged)


@pytest.mark.parametrize("paged_cls", [PagedKVScheduler, PerRequestPagedKVScheduler])
def test_preemption_without_eviction_matches_step_by_step(paged_cls: type) -> None:
    # 24 usable blocks, 6 requests growing to 5 blocks each: decode runs out of blocks and
    # vLLM preempts the newest running request; prompts are distinct (nothing to evict
    # differently), so every step still matches.
    rng = random.Random(7)
    stream = {0: [_req(f"p{i}", _tokens(rng, 40), 40) for i in range(6)]}
    stock, paged, records = _lockstep(stream, num_blocks=25, max_num_batched_tokens=256, paged_cls=paged_cls)
    assert any(a["preempted"] for a, _ in records), "the pool must force preemption"
    assert paged.outputs == stock.outputs
    if paged_cls is PagedKVScheduler:
        # The batched step ran out of blocks part-way; vLLM's loop preempted from there.
        assert paged.scheduler.kv_cache_manager.num_batch_stops > 0
    _check_no_leak(stock, paged)


def _cached_prefix(manager: Any, tokens: list[int]) -> int:
    """Tokens of ``tokens`` (whole blocks) that ``manager``'s (a ``pagedkv.KVCacheManager``)
    prefix cache serves, looked up through a probe sequence that is dropped again."""
    probe = 1_000_000
    manager.add_sequence(probe, tokens + [0])
    try:
        return int(manager.lookup_prefix(probe))
    finally:
        manager.free(probe)


def test_pagedkv_holds_vllms_tokens_after_every_step_lagging_decodes_brought_in() -> None:
    # Staggered arrivals, prompts of every length modulo the block size, a pool small enough
    # to preempt: after each step, pagedkv (with the lagging decodes brought in, as
    # ``manager`` does) holds exactly each running request's computed tokens and its block
    # table is vLLM's view of the request's blocks.
    rng = random.Random(11)
    stream: dict[int, list[Any]] = {}
    for i in range(10):
        stream.setdefault(2 * i, []).append(_req(f"k{i}", _tokens(rng, 17 + 7 * i), 30 + 3 * i))
    stock, paged = _pair(num_blocks=40, max_num_batched_tokens=96)
    kv = paged.scheduler.kv_cache_manager
    lagged = preempted = 0
    for step in range(400):
        for factory in stream.get(step, []):
            stock.add(factory())
            paged.add(factory())
        if step > max(stream) and not stock.scheduler.has_unfinished_requests():
            break
        a, b = stock.step(), paged.step()
        assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
        lagged += len(kv.decodes.lag)
        preempted += len(a["preempted"])
        manager = kv.manager
        for request in paged.scheduler.running:
            seq = kv.seq_id(request.request_id)
            computed = request.num_computed_tokens
            assert manager.num_computed_tokens(seq) == computed <= manager.num_tokens(seq)
            # pagedkv hashed the request's full blocks from its own tokens: they resolve from
            # vLLM's (a tail token pagedkv held wrong would fail here once its block fills).
            assert _cached_prefix(manager, request.all_token_ids[:computed]) == computed - computed % BS
            assert len(kv.get_block_ids(request.request_id)[0]) == -(-computed // BS)
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError("streams did not finish")
    assert lagged > 100 and preempted > 0, "the stream must lag decodes and preempt"
    assert paged.outputs == stock.outputs
    _check_no_leak(stock, paged)


def test_priority_policy_and_watermark_match_step_by_step() -> None:
    # Priority scheduling preempts the lowest-priority running request (possibly one already
    # scheduled this step); the watermark keeps 10% of the pool free when admitting.
    rng = random.Random(9)
    stream: dict[int, list[Any]] = {}
    for i in range(12):
        stream.setdefault(i // 3, []).append(_req(f"w{i}", _tokens(rng, 30 + 5 * i), 30, priority=rng.randrange(0, 3)))
    stock, paged, records = _lockstep(
        stream, num_blocks=30, max_num_batched_tokens=256, policy="priority", watermark=0.1
    )
    assert any(a["preempted"] for a, _ in records), "the pool must force preemption"
    assert paged.outputs == stock.outputs
    _check_no_leak(stock, paged)


def test_a_block_cached_twice_vllm_hits_the_first_copy_pagedkv_the_copy_in_use() -> None:
    # The second known difference, by design: "a" caches blocks 0 and 1 of a 32-token prompt
    # and finishes; "b", the same prompt, hits block 0 and recomputes block 1 (the last prompt
    # token is always computed), so block 1's contents are cached twice: a's copy, now free,
    # and b's, in use. "c" extends the prompt and hits both blocks. vLLM's hit takes the first
    # cached copy (a's, out of the free queue), pagedkv's takes the copy in use (b's, shared),
    # so vLLM holds one block more for the same hits, blocks per request and outputs.
    prompt = list(range(1000, 1032))
    stock, paged = _pair(num_blocks=64)
    records = []
    for arrivals in (
        [_req("a", prompt, 2)],
        [_req("b", prompt, 40)],
        [],
        [],
        [_req("c", prompt + list(range(2000, 2008)), 4)],
    ):
        for factory in arrivals:
            stock.add(factory())
            paged.add(factory())
        records.append((stock.step(), paged.step()))
        assert records[-1][0] == records[-1][1], f"step {len(records) - 1} differs"
    assert stock.finish_reasons == paged.finish_reasons == {"a": "length"}
    assert stock.prefix_hits == paged.prefix_hits == {"a": 0, "b": 16, "c": 32}
    vkv, pkv = stock.scheduler.kv_cache_manager, paged.scheduler.kv_cache_manager
    a_copy = 2  # a's block 1: both pools hand out blocks 1, 2, 3... in order here
    assert vkv.get_block_ids("b")[0][:2] == pkv.get_block_ids("b")[0][:2] == [1, 4]
    assert vkv.get_block_ids("c")[0][:2] == [1, a_copy]  # vLLM: the first cached copy, free
    assert pkv.get_block_ids("c")[0][:2] == [1, 4]  # pagedkv: b's copy, in use
    usable = 63
    assert round(vkv.usage * usable) == round(pkv.usage * usable) + 1 == 5
    stock.run()
    paged.run()
    assert stock.outputs == paged.outputs
    _check_no_leak(stock, paged)


def test_eviction_pressure_same_outputs_no_leaks() -> None:
    rng = random.Random(8)
    systems = [_tokens(rng, 48) for _ in range(4)]
    stream: dict[int, list[Any]] = {}
    for i in range(40):
        prompt = systems[i % 4] + _tokens(rng, rng.randrange(5, 60))
        stream.setdefault(i // 2, []).append(_req(f"e{i}", prompt, rng.randrange(5, 50)))
    stock, paged, records = _lockstep(stream, strict=False, num_blocks=40, max_num_batched_tokens=128)
    assert any(b["preempted"] for _, b in records) and any(a["preempted"] for a, _ in records)
    assert paged.outputs == stock.outputs
    assert paged.finish_reasons == stock.finish_reasons
    assert set(paged.outputs) == {f"e{i}" for i in range(40)}
    assert paged.scheduler.kv_cache_manager.manager.stats().evictions > 0
    hits_stock, hits_paged = sum(stock.prefix_hits.values()), sum(paged.prefix_hits.values())
    same = sum(a == b for a, b in records)
    print(
        f"under eviction pressure: prefix-hit tokens vLLM {hits_stock}, pagedkv {hits_paged}; "
        f"{same} of {len(records)} steps identical"
    )
    assert hits_paged > 0
    _check_no_leak(stock, paged)


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_random_streams_match(enable_prefix_caching: bool) -> None:
    for seed in range(3):
        rng = random.Random(100 + seed)
        systems = [_tokens(rng, rng.randrange(16, 80)) for _ in range(3)]
        stream: dict[int, list[Any]] = {}
        for i in range(20):
            prompt = rng.choice(systems) + _tokens(rng, rng.randrange(1, 70))
            kw: dict[str, Any] = {}
            if rng.random() < 0.3:
                kw["cache_salt"] = rng.choice(["s1", "s2"])
            stream.setdefault(rng.randrange(0, 40), []).append(_req(f"q{seed}-{i}", prompt, rng.randrange(1, 30), **kw))
        stock, paged, _ = _lockstep(
            stream,
            num_blocks=512,
            max_num_batched_tokens=96,
            enable_prefix_caching=enable_prefix_caching,
        )
        assert paged.outputs == stock.outputs
        _check_no_leak(stock, paged)


@st.composite
def _streams(draw: Any) -> dict[str, Any]:
    """A random request stream: shared prefixes, salts, LoRA identities, stop tokens, aborts,
    prefix-cache resets, pool sizes from roomy to preempting."""
    n = draw(st.integers(4, 14))
    systems = [list(range(1000 + 100 * k, 1000 + 100 * k + draw(st.integers(8, 70)))) for k in range(3)]
    stream: dict[int, list[Any]] = {}
    for i in range(n):
        prompt = systems[draw(st.integers(0, 2))] + [
            draw(st.integers(100, 3999)) for _ in range(draw(st.integers(1, 40)))
        ]
        kw: dict[str, Any] = {}
        if draw(st.booleans()):
            kw["cache_salt"] = draw(st.sampled_from(["s1", "s2"]))
        if draw(st.integers(0, 3)) == 0:
            kw["lora"] = draw(st.sampled_from([("la", 1), ("lb", 2)]))
        max_tokens = draw(st.integers(1, 24))
        if draw(st.integers(0, 3)) == 0:
            kw["stop_token_ids"] = [fake_token(f"h{i}", len(prompt) + draw(st.integers(0, 5)))]
        stream.setdefault(draw(st.integers(0, 12)), []).append(_req(f"h{i}", prompt, max_tokens, **kw))
    aborts = {draw(st.integers(1, 15)): [f"h{draw(st.integers(0, n - 1))}"] for _ in range(draw(st.integers(0, 2)))}
    resets = set(draw(st.lists(st.integers(1, 20), max_size=2)))
    return {
        "stream": stream,
        "aborts": aborts,
        "resets": resets,
        "num_blocks": draw(st.sampled_from([24, 40, 256])),
        "budget": draw(st.sampled_from([32, 96, 512])),
    }


@settings(max_examples=30, deadline=None)
@given(case=_streams())
def test_property_random_streams(case: dict[str, Any]) -> None:
    """Outputs and finish reasons always equal stock vLLM's, nothing leaks, and where pagedkv
    evicted no cached block every step is identical."""
    resets_done: dict[str, list[bool]] = {"stock": [], "paged": []}

    def action_for(step: int) -> Any:
        def act(driver: Driver) -> None:
            for rid in case["aborts"].get(step, []):
                if rid in driver.scheduler.requests:
                    driver.abort([rid])
            if step in case["resets"]:
                key = "paged" if isinstance(driver.scheduler, PagedKVScheduler) else "stock"
                resets_done[key].append(driver.scheduler.reset_prefix_cache())

        return act

    steps = set(case["aborts"]) | case["resets"]
    stock, paged, records = _lockstep(
        case["stream"],
        strict=False,
        actions={s: action_for(s) for s in steps},
        num_blocks=case["num_blocks"],
        max_num_batched_tokens=case["budget"],
        max_num_seqs=16,
        max_loras=2,
    )
    assert paged.outputs == stock.outputs
    assert paged.finish_reasons == stock.finish_reasons
    assert resets_done["paged"] == resets_done["stock"]
    if paged.scheduler.kv_cache_manager.manager.stats().evictions == 0:
        for a, b in records:
            assert a == b
    _check_no_leak(stock, paged)
