"""Async scheduling: vLLM's ``AsyncScheduler`` stock vs the plug-in, step by step with two
batches in flight (each step schedules the next batch before the previous one's output is
consumed, as the engine core's batch queue does).

A running request is scheduled again before the token of its step in flight is known (vLLM's
output placeholders): pagedkv must give that slot a block without hashing anything for it,
cache each block in the step vLLM caches it, and leave nothing held or cached for a request
finished, aborted or preempted with placeholders outstanding. (vLLM's ``EngineCore`` with async
scheduling is in test_vllm_seam.py, with the no-model executor.)

Runs only where vLLM is installed (``make test-vllm`` runs it under each supported release).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from pagedkv.integrations.vllm import (  # noqa: E402
    PagedKVAsyncScheduler,
    PagedKVCacheManager,
    PagedKVScheduler,
)
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    GEMMA3_GROUPS,
    AsyncDriver,
    build_scheduler,
    fake_token,
    make_hybrid_kv_cache_config,
    make_request,
    make_vllm_config,
)

BS = 16
# A Llama 4 style mix: full attention, chunked-local attention, and a short sliding window.
CHUNKED_GROUPS = (("full", None), ("chunked_local", 64), ("chunked_local", 64), ("sliding_window", 48))


class PerRequestPagedKVScheduler(PagedKVScheduler):
    """The plug-in without its batched decode path (one allocate_slots call per request)."""

    batch_decode = False


def _pair(paged_cls: type = PagedKVScheduler, **config: Any) -> tuple[AsyncDriver, AsyncDriver]:
    stock = AsyncDriver(build_scheduler(AsyncScheduler, make_vllm_config(async_scheduling=True, **config)))
    paged = AsyncDriver(build_scheduler(paged_cls, make_vllm_config(async_scheduling=True, **config)))
    return stock, paged


def _lockstep(
    stream: dict[int, list[Any]],
    *,
    strict: bool = True,
    max_steps: int = 2000,
    actions: dict[int, Any] | None = None,
    paged_cls: type = PagedKVScheduler,
    **config: Any,
) -> tuple[AsyncDriver, AsyncDriver, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Feeds ``stream`` (step -> request factories) to both schedulers in lockstep; with
    ``strict`` every step's record (scheduled tokens, prefix hits, resumed and preempted
    requests, new tokens, finished requests, blocks held) and the KV cache usage after it must
    be equal."""
    stock, paged = _pair(paged_cls, **config)
    records = []
    for step, a, b in _drive_in_lockstep(stock, paged, stream, max_steps, actions):
        if strict:
            assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
            usage = (stock.scheduler.kv_cache_manager.usage, paged.scheduler.kv_cache_manager.usage)
            assert usage[1] == pytest.approx(usage[0]), f"step {step}: usage {usage}"
        records.append((a, b))
    paged.scheduler.kv_cache_manager.manager.check_invariants()
    return stock, paged, records


def _drive_in_lockstep(
    stock: AsyncDriver,
    paged: AsyncDriver,
    stream: dict[int, list[Any]],
    max_steps: int = 2000,
    actions: dict[int, Any] | None = None,
) -> Any:
    """Yields ``(step, stock_record, paged_record)`` of both schedulers driven in lockstep:
    each step's arrivals from ``stream`` (step -> request factories), then ``actions[step]``
    (called with each driver), then one step of each; stops once stock has no work left after
    the last arrival (the plug-in must have none either). Raises ``AssertionError`` when the
    streams do not finish within ``max_steps``."""
    last_arrival = max(stream) if stream else 0
    for step in range(max_steps):
        for factory in stream.get(step, []):
            stock.add(factory())
            paged.add(factory())
        if actions and step in actions:
            actions[step](stock)
            actions[step](paged)
        if step > last_arrival and not stock.has_work():
            assert not paged.has_work()
            return
        yield step, stock.step(), paged.step()
    raise AssertionError("streams did not finish")


def _check_no_leak(stock: AsyncDriver, paged: AsyncDriver) -> None:
    """Both pools are empty once every request is done (cached blocks count as free), and no
    placeholder is left in pagedkv."""
    for d in (stock, paged):
        assert not d.has_work()
        assert d.scheduler.kv_cache_manager.usage == 0.0
    manager = paged.scheduler.kv_cache_manager
    assert not manager._unknown
    kvm = manager.manager
    kvm.check_invariants()
    assert kvm.num_sequences == 0
    stats = kvm.stats()
    assert stats.used == 0 and stats.free == stats.num_blocks - 1


def _req(rid: str, prompt: list[int], max_tokens: int, **kw: Any) -> Any:
    return lambda: make_request(rid, prompt, max_tokens, block_size=BS, **kw)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 4000) for _ in range(n)]


# ---- one name, both modes --------------------------------------------------------------------


def test_scheduler_cls_builds_the_async_variant_when_async_scheduling_is_on() -> None:
    sync = build_scheduler(PagedKVScheduler, make_vllm_config(num_blocks=32))
    on = build_scheduler(PagedKVScheduler, make_vllm_config(num_blocks=32, async_scheduling=True))
    assert type(sync) is PagedKVScheduler and not isinstance(sync, AsyncScheduler)
    assert type(on) is PagedKVAsyncScheduler and isinstance(on, AsyncScheduler)
    assert isinstance(on, PagedKVScheduler) and isinstance(on.kv_cache_manager, PagedKVCacheManager)
    assert on.kv_cache_manager.async_scheduling and not sync.kv_cache_manager.async_scheduling
    # A subclass gets an async variant of its own (built once), keeping its settings.
    sub = build_scheduler(PerRequestPagedKVScheduler, make_vllm_config(num_blocks=32, async_scheduling=True))
    again = build_scheduler(PerRequestPagedKVScheduler, make_vllm_config(num_blocks=32, async_scheduling=True))
    assert isinstance(sub, PerRequestPagedKVScheduler) and isinstance(sub, AsyncScheduler)
    assert type(sub) is type(again) and not sub.kv_cache_manager.defer_decodes
    # The async class built directly with async scheduling off stays what it is.
    direct = build_scheduler(PagedKVAsyncScheduler, make_vllm_config(num_blocks=32, async_scheduling=True))
    assert type(direct) is PagedKVAsyncScheduler
    assert not isinstance(build_scheduler(Scheduler, make_vllm_config(num_blocks=32)), AsyncScheduler)


# ---- differential: stock AsyncScheduler vs the plug-in ---------------------------------------


@pytest.mark.parametrize("paged_cls", [PagedKVScheduler, PerRequestPagedKVScheduler])
def test_shared_prefixes_chunked_prefill_match_step_by_step(paged_cls: type) -> None:
    rng = random.Random(1)
    systems = [_tokens(rng, 64), _tokens(rng, 40)]
    stream: dict[int, list[Any]] = {}
    for i in range(16):
        prompt = systems[i % 2] + _tokens(rng, rng.randrange(1, 70))
        stream.setdefault(rng.randrange(0, 20), []).append(_req(f"r{i}", prompt, rng.randrange(1, 36)))
    stream.setdefault(3, []).append(_req("long", systems[0] + _tokens(rng, 300), 8))
    stock, paged, records = _lockstep(
        stream, num_blocks=512, max_num_batched_tokens=128, long_prefill_token_threshold=64, paged_cls=paged_cls
    )
    assert stock.outputs == paged.outputs
    assert stock.prefix_cache_stats == paged.prefix_cache_stats
    hits = [h for _, b in records for h in b["new_prefix_hits"].values()]
    assert max(hits) >= 64, "shared system prompts must produce prefix hits"
    manager = paged.scheduler.kv_cache_manager
    if paged_cls is PagedKVScheduler:
        assert manager.num_batched_allocations > 100, "the batched decode path must carry the decodes"
    else:
        assert manager.num_batched_allocations == 0
    for rid, out in paged.outputs.items():
        assert out, rid
    _check_no_leak(stock, paged)


def test_outputs_follow_the_fake_model() -> None:
    prompt = list(range(200, 240))
    stock, paged, _ = _lockstep({0: [_req("a", prompt, 20)]}, num_blocks=64)
    want = [fake_token("a", len(prompt) + i) for i in range(20)]
    assert paged.outputs["a"] == stock.outputs["a"] == want
    _check_no_leak(stock, paged)


def test_blocks_filled_by_in_flight_tokens_are_cached_when_vllm_caches_them() -> None:
    # "a" decodes across several block boundaries; "b" and "c", arriving later, share a's
    # prompt and its first outputs (the fake model's tokens), so their hits show when each of
    # a's blocks was cached: never before its tokens were known, never later than stock.
    prompt = list(range(300, 300 + 2 * BS - 3))
    outputs = [fake_token("a", len(prompt) + i) for i in range(40)]
    stream = {
        0: [_req("a", prompt, 40)],
        7: [_req("b", prompt + outputs[:10] + [5, 6], 3)],
        23: [_req("c", prompt + outputs[:30] + [7], 3)],
    }
    stock, paged, _ = _lockstep(stream, num_blocks=64)
    assert paged.prefix_hits == stock.prefix_hits
    assert paged.prefix_hits["b"] == 2 * BS and paged.prefix_hits["c"] == 3 * BS
    assert paged.outputs == stock.outputs
    _check_no_leak(stock, paged)


def test_stop_tokens_finish_with_placeholders_outstanding() -> None:
    rng = random.Random(4)
    prompts = [_tokens(rng, 12 + 5 * i) for i in range(6)]
    stream: dict[int, list[Any]] = {0: []}
    for i, p in enumerate(prompts):
        # Requests 0..2 stop on their 4th output (their next step is already in flight).
        stop = [fake_token(f"s{i}", len(p) + 3)] if i < 3 else []
        stream[0].append(_req(f"s{i}", p, 20, stop_token_ids=stop))
    stream[3] = [_req("later", prompts[0] + [9] * 30, 2)]
    stock, paged, _ = _lockstep(stream, num_blocks=128)
    assert paged.outputs == stock.outputs and paged.finish_reasons == stock.finish_reasons
    for i in range(3):
        assert paged.finish_reasons[f"s{i}"] == "stop" and len(paged.outputs[f"s{i}"]) == 4
    _check_no_leak(stock, paged)


def test_aborts_with_placeholders_outstanding() -> None:
    rng = random.Random(5)
    stream = {0: [_req(f"a{i}", _tokens(rng, 40 + i), 30) for i in range(8)]}
    stream[1] = [_req("waiting", _tokens(rng, 300), 5)]

    def abort(driver: AsyncDriver) -> None:
        driver.abort(["a1", "a5", "waiting"])

    stock, paged, _ = _lockstep(stream, num_blocks=128, max_num_batched_tokens=64, actions={6: abort, 7: abort})
    assert paged.outputs == stock.outputs
    assert paged.finish_reasons["a1"] == "abort" and len(paged.outputs["a1"]) < 30
    _check_no_leak(stock, paged)


@pytest.mark.parametrize("paged_cls", [PagedKVScheduler, PerRequestPagedKVScheduler])
def test_preemption_with_a_step_in_flight_matches_step_by_step(paged_cls: type) -> None:
    # 24 usable blocks, 6 requests growing to 5 blocks each: decode runs out of blocks and
    # vLLM preempts requests whose previous step is still in flight.
    rng = random.Random(7)
    stream = {0: [_req(f"p{i}", _tokens(rng, 40), 40) for i in range(6)]}
    stock, paged, records = _lockstep(stream, num_blocks=25, max_num_batched_tokens=256, paged_cls=paged_cls)
    assert any(a["preempted"] for a, _ in records), "the pool must force preemption"
    assert paged.outputs == stock.outputs
    _check_no_leak(stock, paged)


def test_eviction_pressure_same_outputs_no_leak() -> None:
    # Shared prefixes in a pool too small to keep them: which free cached block is evicted
    # first differs by design (pagedkv's free list vs vLLM's LRU queue), so only outputs and
    # the final state are compared.
    rng = random.Random(9)
    systems = [_tokens(rng, 48) for _ in range(3)]
    stream: dict[int, list[Any]] = {}
    for i in range(20):
        prompt = systems[i % 3] + _tokens(rng, rng.randrange(5, 40))
        stream.setdefault(rng.randrange(0, 30), []).append(_req(f"e{i}", prompt, rng.randrange(4, 30)))
    stock, paged, records = _lockstep(stream, strict=False, num_blocks=40, max_num_batched_tokens=128)
    assert paged.outputs == stock.outputs
    assert paged.finish_reasons == stock.finish_reasons
    assert any(a["preempted"] for a, _ in records) or paged.scheduler.kv_cache_manager.manager.stats().evictions > 0
    _check_no_leak(stock, paged)


def test_async_scheduling_with_pipeline_parallelism_is_refused_naming_it() -> None:
    from pagedkv.integrations.vllm import UnsupportedVllmConfigError

    cfg = make_vllm_config(num_blocks=32, async_scheduling=True)
    # vLLM's V1 model runner refuses this pair itself; its V2 runner keeps pp + 1 batches in
    # flight. Set after construction (the config's own check would need several devices).
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(UnsupportedVllmConfigError, match="pipeline_parallel_size") as info:
        build_scheduler(PagedKVScheduler, cfg)
    assert info.value.field == "parallel_config.pipeline_parallel_size"


# ---- hybrid models (several KV cache groups) --------------------------------------------------


@pytest.mark.parametrize("groups", [GEMMA3_GROUPS, CHUNKED_GROUPS], ids=["gemma3", "chunked_local"])
def test_hybrid_groups_match_stock_step_by_step(groups: Any) -> None:
    # Windowed groups release out-of-window blocks as requests decode past the window while
    # their previous token is in flight; per group, table lengths must match stock's hybrid
    # coordinator every step, and real blocks too but for the one difference by design
    # (dense retention, as in test_vllm_hybrid.py).
    rng = random.Random(13)
    prefix = _tokens(rng, 100)
    stream: dict[int, list[Any]] = {}
    for i in range(6):
        prompt = prefix + _tokens(rng, rng.randrange(5, 90))
        stream.setdefault(rng.randrange(0, 10), []).append(_req(f"h{i}", prompt, rng.randrange(40, 90)))
    drivers = []
    for cls in (AsyncScheduler, PagedKVScheduler):
        kv = make_hybrid_kv_cache_config(160, groups, BS, retention_interval=None)
        cfg = make_vllm_config(num_blocks=160, async_scheduling=True, max_num_batched_tokens=128)
        drivers.append(AsyncDriver(build_scheduler(cls, cfg, kv_cache_config=kv)))
    stock, paged = drivers
    assert isinstance(paged.scheduler.kv_cache_manager, PagedKVCacheManager)
    assert paged.scheduler.kv_cache_manager.num_kv_cache_groups == len(groups)
    early_release = [0]
    for step, a, b in _drive_in_lockstep(stock, paged, stream):
        held_a, held_b = a.pop("blocks_held"), b.pop("blocks_held")
        assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
        # Table lengths equal; real blocks equal, except that pagedkv may already have
        # released window blocks of a request whose prefill chunk is in flight (vLLM releases
        # by processed tokens, pagedkv by computed ones; the GPU runs the steps in order).
        assert held_b.keys() == held_a.keys()
        for rid in held_a:
            for (len_a, real_a), (len_b, real_b) in zip(held_a[rid], held_b[rid], strict=True):
                assert len_b == len_a and real_b <= real_a, f"step {step} {rid}: {held_a[rid]} vs {held_b[rid]}"
            early_release[0] += held_b[rid] != held_a[rid]
        assert paged.scheduler.kv_cache_manager.usage <= stock.scheduler.kv_cache_manager.usage + 1e-9
    if groups is GEMMA3_GROUPS:
        assert early_release[0] == 0, "no prefill chunk reaches past Gemma 3's 512-token window"
    assert paged.outputs == stock.outputs
    kvm = paged.scheduler.kv_cache_manager.manager
    kvm.check_invariants()
    assert kvm.num_sequences == 0 and paged.scheduler.kv_cache_manager.usage == 0.0
    assert not paged.scheduler.kv_cache_manager._unknown


def test_kv_events_and_cached_blocks_never_include_unknown_tokens() -> None:
    # Prompts of 2 * 16 - 1 tokens: the first decode slot opens block 2 while its token is in
    # flight (a placeholder lookahead slot in pagedkv). Requests are aborted, preempted and
    # stopped with such slots outstanding. The KV events of the run (blocks stored with their
    # tokens, blocks removed) equal stock vLLM's, every stored block holds known tokens only,
    # and nothing stays held.
    events: dict[str, list[Any]] = {"stock": [], "paged": []}

    def record(name: str, driver: AsyncDriver) -> None:
        manager = driver.scheduler.kv_cache_manager
        take = manager.take_events

        def take_events() -> list[Any]:
            got = take()
            events[name].extend(got)
            return got

        manager.take_events = take_events

    rng = random.Random(17)
    prompts = [_tokens(rng, 2 * BS - 1) for _ in range(6)]
    stream: dict[int, list[Any]] = {0: []}
    for i, p in enumerate(prompts):
        stop = [fake_token(f"k{i}", len(p) + 1)] if i == 2 else []
        stream[0].append(_req(f"k{i}", p, 24, stop_token_ids=stop))
    stream[5] = [_req("again", prompts[0] + [fake_token("k0", 2 * BS - 1 + j) for j in range(20)], 2)]

    def abort(driver: AsyncDriver) -> None:
        driver.abort(["k1"])

    stock, paged = _pair(num_blocks=16, kv_events=True)
    record("stock", stock)
    record("paged", paged)
    for step in range(400):
        for factory in stream.get(step, []):
            stock.add(factory())
            paged.add(factory())
        if step == 2:
            abort(stock)
            abort(paged)
        if step > 5 and not stock.has_work():
            assert not paged.has_work()
            break
        a, b = stock.step(), paged.step()
        assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
    assert paged.finish_reasons["k1"] == "abort"
    assert paged.finish_reasons["k2"] == "stop"

    def summary(evs: list[Any]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for e in evs:
            if type(e).__name__ == "BlockStored":
                out.append(("stored", tuple(e.token_ids)))
            elif type(e).__name__ == "BlockRemoved":
                out.append(("removed", len(e.block_hashes)))
        return out

    stored = [t for kind, t in summary(events["paged"]) if kind == "stored"]
    assert stored, "blocks must be stored"
    # The same blocks stored (which cached block is evicted first, and so when a block is
    # removed and stored again, differs by design: pagedkv's free list vs vLLM's LRU queue).
    stock_stored = [t for kind, t in summary(events["stock"]) if kind == "stored"]
    assert set(stored) == set(stock_stored)
    # No placeholder id (pagedkv's 0, vLLM's -1) in any stored block.
    flat = [tok for toks in stored for tok in toks]
    assert -1 not in flat and 0 not in flat
    _check_no_leak(stock, paged)


# ---- speculative decoding under async scheduling ----------------------------------------------


@pytest.mark.parametrize("k", [2, 5])
def test_ngram_placeholder_drafts_match_stock_step_by_step(k: int) -> None:
    # vLLM's placeholder drafts: each decode schedules 1 + k slots whose token ids are unknown
    # (the drafter runs on the device); rejections roll vLLM's counts back a step later.
    # Shared prefixes and a pool small enough to preempt.
    from pagedkv.testing.vllm_scheduler import ngram_speculative_config

    rng = random.Random(19 + k)
    system = _tokens(rng, 40)
    stream: dict[int, list[Any]] = {}
    prompts = {f"s{i}": system + _tokens(rng, rng.randrange(3, 40)) for i in range(8)}
    for rid, prompt in prompts.items():
        stream.setdefault(rng.randrange(0, 8), []).append(_req(rid, prompt, rng.randrange(10, 40)))
    drivers = []
    for cls in (AsyncScheduler, PagedKVScheduler):
        cfg = make_vllm_config(num_blocks=22, async_scheduling=True, max_num_batched_tokens=256)
        cfg.speculative_config = ngram_speculative_config(cfg, k)
        drivers.append(AsyncDriver(build_scheduler(cls, cfg), num_drafts=k))
    stock, paged = drivers
    records = []
    for step, a, b in _drive_in_lockstep(stock, paged, stream):
        assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
        assert paged.scheduler.kv_cache_manager.usage == pytest.approx(stock.scheduler.kv_cache_manager.usage)
        records.append(a)
    assert paged.outputs == stock.outputs
    # The greedy verifier's tokens are the fake model's: those of decoding without drafts.
    for rid, out in paged.outputs.items():
        assert out == [fake_token(rid, len(prompts[rid]) + i) for i in range(len(out))]
    assert any(r["preempted"] for r in records), "the pool must force preemption"
    assert paged.drafts_scheduled == stock.drafts_scheduled > 0
    assert 0 < paged.drafts_accepted == stock.drafts_accepted < paged.drafts_scheduled
    _check_no_leak(stock, paged)


@pytest.mark.parametrize(
    "groups", [None, (("full", None), ("sliding_window", 32)), CHUNKED_GROUPS], ids=["one_group", "sw", "chunked_local"]
)
@pytest.mark.parametrize("k", [2, 3])
def test_padded_verify_step_of_a_prefix_hit_under_async_scheduling(groups: Any, k: int) -> None:
    # With speculation on, vLLM pads a request admitted with one token left to compute (a
    # 2 * 16 + 1 token prompt sent again while another request decodes) to a verify step of
    # 1 + k tokens whose k placeholder drafts are async output placeholders: the next step is
    # scheduled before vLLM rolls them back, with num_computed_tokens counting them. They must
    # not be taken for accepted drafts (pagedkv then held more computed tokens than known ones
    # and the next allocation raised InvalidArgumentError inside schedule()).
    from pagedkv.testing.vllm_scheduler import ngram_speculative_config

    rng = random.Random(29 + k)
    prompt = _tokens(rng, 2 * BS + 1)
    other = _tokens(rng, 2 * BS + 1)
    stream = {0: [_req("first", prompt, 12)], 1: [_req("decoding", other, 30)], 5: [_req("again", prompt, 12)]}
    drivers = []
    for cls in (AsyncScheduler, PagedKVScheduler):
        cfg = make_vllm_config(num_blocks=64, async_scheduling=True, max_num_batched_tokens=128)
        cfg.speculative_config = ngram_speculative_config(cfg, k)
        kv = None if groups is None else make_hybrid_kv_cache_config(64, groups, BS, retention_interval=None)
        drivers.append(AsyncDriver(build_scheduler(cls, cfg, kv_cache_config=kv), num_drafts=k))
    stock, paged = drivers
    for step, a, b in _drive_in_lockstep(stock, paged, stream, 500):
        if groups is not None:
            a.pop("blocks_held"), b.pop("blocks_held")
        assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
    assert paged.prefix_hits["again"] == stock.prefix_hits["again"] == 2 * BS
    assert paged.outputs == stock.outputs
    assert paged.outputs["again"] == [fake_token("again", len(prompt) + i) for i in range(12)]
    manager = paged.scheduler.kv_cache_manager
    assert not manager._unknown and not manager._drafts_pending
    kvm = manager.manager
    kvm.check_invariants()
    assert kvm.num_sequences == 0 and manager.usage == 0.0


@pytest.mark.parametrize("groups", [None, (("full", None), ("sliding_window", 32))], ids=["one_group", "sw"])
@pytest.mark.parametrize(("k", "abort_step"), [(0, 6), (2, 6), (3, 7)])
def test_abort_of_a_padded_request_with_placeholders_outstanding(groups: Any, k: int, abort_step: int) -> None:
    # 'again' (a 2 * 16 + 1 token prompt sent again, hit 32) is admitted at step 5, with
    # speculation padded to 1 + k slots whose ids are in flight; it is aborted one or two
    # steps later, its placeholders outstanding. Step by step equal to stock AsyncScheduler,
    # the same blocks stored in KV events, none holding a placeholder id, nothing left held
    # or pending.
    from pagedkv.testing.vllm_scheduler import ngram_speculative_config

    rng = random.Random(5)
    prompt, other = _tokens(rng, 2 * BS + 1), _tokens(rng, 2 * BS + 1)
    stream = {0: [_req("first", prompt, 12)], 1: [_req("decoding", other, 30)], 5: [_req("again", prompt, 12)]}
    events: list[list[Any]] = [[], []]
    drivers = []
    for i, cls in enumerate((AsyncScheduler, PagedKVScheduler)):
        cfg = make_vllm_config(num_blocks=64, async_scheduling=True, max_num_batched_tokens=128, kv_events=True)
        if k:
            cfg.speculative_config = ngram_speculative_config(cfg, k)
        kv = None if groups is None else make_hybrid_kv_cache_config(64, groups, BS, retention_interval=None)
        driver = AsyncDriver(build_scheduler(cls, cfg, kv_cache_config=kv), num_drafts=k)
        manager = driver.scheduler.kv_cache_manager

        def take_events(take: Any = manager.take_events, sink: list[Any] = events[i]) -> list[Any]:
            got = take()
            sink.extend(got)
            return got

        manager.take_events = take_events
        drivers.append(driver)
    stock, paged = drivers
    abort = {abort_step: lambda d: d.abort(["again"])}
    for step, a, b in _drive_in_lockstep(stock, paged, stream, 500, abort):
        if groups is not None:
            a.pop("blocks_held"), b.pop("blocks_held")
        assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
    assert paged.finish_reasons["again"] == "abort"
    assert paged.outputs == stock.outputs

    def stored(evs: list[Any]) -> set[tuple[int, ...]]:
        return {tuple(e.token_ids) for e in evs if type(e).__name__ == "BlockStored"}

    assert stored(events[1]) == stored(events[0]) != set()
    assert not any(t in (-1, 0) for toks in stored(events[1]) for t in toks)
    manager = paged.scheduler.kv_cache_manager
    assert not manager._unknown and not manager._drafts_pending
    kvm = manager.manager
    kvm.check_invariants()
    assert kvm.num_sequences == 0 and manager.usage == 0.0


@pytest.mark.parametrize(("k", "num_blocks", "seed"), [(2, 18, 11), (3, 16, 16), (4, 20, 14)])
def test_ngram_drafts_prefix_hits_preemption_and_aborts_match_stock(k: int, num_blocks: int, seed: int) -> None:
    # Shared 32-token prefixes (some prompts 2 * 16 + 1 tokens: padded verify steps when sent
    # again or resumed), a pool small enough to preempt, aborts with placeholders outstanding.
    from pagedkv.testing.vllm_scheduler import ngram_speculative_config

    rng = random.Random(seed)
    prefix = _tokens(rng, 2 * BS)
    stream: dict[int, list[Any]] = {}
    prompts = {}
    for i in range(8):
        prompts[f"h{i}"] = prefix + _tokens(rng, rng.choice([1, 17, 33, rng.randrange(1, 60)]))
        stream.setdefault(rng.randrange(0, 12), []).append(_req(f"h{i}", prompts[f"h{i}"], rng.randrange(5, 60)))
    stream.setdefault(14, []).append(_req("again", prompts["h0"], 10))
    aborts = {6: ["h1"], 9: ["h3", "again"], 15: ["again"]}
    drivers = []
    for cls in (AsyncScheduler, PagedKVScheduler):
        cfg = make_vllm_config(num_blocks=num_blocks, async_scheduling=True, max_num_batched_tokens=128)
        cfg.speculative_config = ngram_speculative_config(cfg, k)
        drivers.append(AsyncDriver(build_scheduler(cls, cfg), num_drafts=k))
    stock, paged = drivers
    preempted = 0
    actions = {st: lambda d, ids=ids: d.abort(ids) for st, ids in aborts.items()}
    for step, a, b in _drive_in_lockstep(stock, paged, stream, 3000, actions):
        assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
        assert paged.scheduler.kv_cache_manager.usage == pytest.approx(stock.scheduler.kv_cache_manager.usage)
        preempted += bool(a["preempted"])
    assert preempted, "the pool must force preemption"
    assert paged.outputs == stock.outputs
    _check_no_leak(stock, paged)
    assert not paged.scheduler.kv_cache_manager._drafts_pending


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("groups", [None, GEMMA3_GROUPS], ids=["one_group", "gemma3"])
def test_placeholder_drafts_of_resumed_requests_match_stock(groups: Any, k: int) -> None:
    # A request resumed on its cached blocks with one token left is padded to a verify-sized
    # step (1 + k slots, k placeholder drafts) on its first allocation; under async scheduling
    # vLLM counts those slots computed before the step reports, so they are unknown tokens, not
    # a verify step to read back at the next allocation (which raised on a negative token
    # count on KV cache groups). Shared prefixes, a pool small enough to preempt.
    from pagedkv.testing.vllm_scheduler import ngram_speculative_config

    rng = random.Random(29 + k)
    system = _tokens(rng, 40)
    stream: dict[int, list[Any]] = {}
    prompts = {f"s{i}": system + _tokens(rng, rng.randrange(3, 40)) for i in range(8)}
    for rid, prompt in prompts.items():
        stream.setdefault(rng.randrange(0, 8), []).append(_req(rid, prompt, rng.randrange(10, 40)))
    # Six groups share the pool of the hybrid config, so it needs more blocks to preempt alike.
    num_blocks = 22 if groups is None else 60
    drivers = []
    for cls in (AsyncScheduler, PagedKVScheduler):
        cfg = make_vllm_config(num_blocks=num_blocks, async_scheduling=True, max_num_batched_tokens=256)
        cfg.speculative_config = ngram_speculative_config(cfg, k)
        kv = None if groups is None else make_hybrid_kv_cache_config(num_blocks, groups, BS, retention_interval=None)
        sched = build_scheduler(cls, cfg) if kv is None else build_scheduler(cls, cfg, kv_cache_config=kv)
        drivers.append(AsyncDriver(sched, num_drafts=k))
    stock, paged = drivers
    records = []
    for step, a, b in _drive_in_lockstep(stock, paged, stream):
        held_a, held_b = a.pop("blocks_held"), b.pop("blocks_held")
        assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
        if groups is None:
            assert held_b == held_a, f"step {step}: {held_a} vs {held_b}"
        else:
            # Per group: equal table lengths, real blocks at most stock's (see the hybrid test).
            assert held_b.keys() == held_a.keys()
            for rid in held_a:
                for (len_a, real_a), (len_b, real_b) in zip(held_a[rid], held_b[rid], strict=True):
                    assert len_b == len_a and real_b <= real_a, f"step {step} {rid}"
        records.append(a)
    assert paged.outputs == stock.outputs
    for rid, out in paged.outputs.items():
        assert out == [fake_token(rid, len(prompts[rid]) + i) for i in range(len(out))]
    assert any(r["preempted"] for r in records), "the pool must force preemption"
    assert paged.drafts_scheduled == stock.drafts_scheduled > 0
    manager = paged.scheduler.kv_cache_manager
    assert not manager._unknown and not manager._drafts_pending
    kvm = manager.manager
    kvm.check_invariants()
    assert kvm.num_sequences == 0 and manager.usage == 0.0


def _drain(driver: AsyncDriver) -> None:
    """Consumes every batch in flight (the engine drained: no step in flight before the next
    schedule), recording the outputs as :meth:`AsyncDriver.step` does."""
    while driver._in_flight:
        out, model_out = driver._in_flight.pop(0)
        for eco in driver.scheduler.update_from_output(out, model_out).values():
            for o in eco.outputs:
                driver.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    driver.finish_reasons[o.request_id] = str(o.finish_reason)


def test_decodes_after_the_engine_drained_match_stock() -> None:
    # A decode whose slot opened a block while its token was unknown (a placeholder slot), then
    # the engine drained (no step in flight): the next decode is scheduled without output
    # placeholders, and pagedkv settles the placeholder first (found by vLLM's offloading
    # connector tests, whose runner drains between phases).
    rng = random.Random(5)
    stream = {0: [_req(f"r{i}", _tokens(rng, 17 + 9 * i), 40) for i in range(4)]}
    actions = {step: _drain for step in range(4, 120, 3)}
    stock, paged, _ = _lockstep(stream, actions=actions, num_blocks=64)
    assert paged.outputs == stock.outputs and paged.finish_reasons == stock.finish_reasons
    assert all(len(out) == 40 for out in stock.outputs.values()) and len(stock.outputs) == 4
    for rid, out in stock.outputs.items():
        prompt = 17 + 9 * int(rid[1:])
        assert out == [fake_token(rid, prompt + i) for i in range(40)]
    _check_no_leak(stock, paged)
