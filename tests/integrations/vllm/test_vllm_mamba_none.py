"""Mamba / linear-attention layers in vLLM's ``"none"`` cache mode (what vLLM sets whenever
prefix caching is off): stock vLLM vs ``PagedKVScheduler`` in lockstep, on fake KV cache
configs shaped like Qwen3-Next (three Gated DeltaNet groups and one full-attention group) and
Nemotron-H (two Mamba-2 groups and one full-attention group).

In mode none vLLM's Mamba manager keeps one state per request out of the prefix cache, in
blocks of ``mamba_block_size`` tokens (the context length by default: one block covers the
whole request), with ``num_speculative_blocks = k`` more blocks for the drafts' states (MTP /
EAGLE), and frees the blocks before the one of the last computed token. The plug-in serves the
group as a pagedkv group out of the prefix cache (a 2-token window) with ``k`` spare blocks.

Step by step both schedulers must agree on scheduled tokens (drafts included), preemptions,
finished requests and new tokens, and, per group, each scheduled request's table length, its
real (non-null) blocks, and the new block ids the model runner gets (how many per group, and
which are null); every request's blocks are checked distinct within the pool, and nothing is
held at the end. Synchronous and async scheduling, MTP with ``k`` = 1..3 and a greedy fake
verifier that rejects about one draft in three, memory pressure, aborts, and requests that run
up to the context length. Runs under vLLM 0.33 and 0.32.

Runs only where vLLM is installed (``make test-vllm``).
"""

from __future__ import annotations

import math
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
    UnsupportedVllmConfigError,
)
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    NEMOTRON_H_GROUPS,
    QWEN3_NEXT_GROUPS,
    AsyncDriver,
    Driver,
    build_scheduler,
    eagle_speculative_config,
    make_mamba_kv_cache_config,
    make_request,
    make_vllm_config,
)

BS = 16
SHAPES = pytest.mark.parametrize("groups", [QWEN3_NEXT_GROUPS, NEMOTRON_H_GROUPS], ids=["qwen3-next", "nemotron-h"])


def _config(num_blocks: int, max_model_len: int, k: int, async_scheduling: bool = False, **kw: Any) -> Any:
    """A prefix-caching-off ``VllmConfig`` in Mamba cache mode none (``k`` > 0: an MTP drafter
    of ``k`` drafts)."""
    common = dict(
        num_blocks=num_blocks,
        block_size=BS,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
        **kw,
    )
    if k:
        base = make_vllm_config(**common)
        common["speculative_config"] = eagle_speculative_config(base, k, "mtp")
    vc = make_vllm_config(**common)
    vc.cache_config.mamba_cache_mode = "none"
    vc.cache_config.mamba_block_size = max_model_len
    return vc


def _build(cls: type, groups: Any, num_blocks: int, max_model_len: int, k: int, **kw: Any) -> Any:
    kv = make_mamba_kv_cache_config(
        num_blocks, groups, BS, mamba_cache_mode="none", num_speculative_blocks=k, mamba_block_size=max_model_len
    )
    # vLLM's scheduler block size: the LCM of the groups' block sizes; its hashes stay at it
    # with prefix caching off.
    lcm = math.lcm(BS, max_model_len)
    is_async = cls in (AsyncScheduler, PagedKVAsyncScheduler)
    vc = _config(num_blocks, max_model_len, k, async_scheduling=is_async, **kw)
    return build_scheduler(cls, vc, kv_cache_config=kv, block_size=lcm, hash_block_size=lcm)


def _capture(sched: Any) -> list[Any]:
    """Records every ``SchedulerOutput`` the scheduler returns."""
    outs: list[Any] = []
    schedule = sched.schedule

    def wrapped() -> Any:
        out = schedule()
        outs.append(out)
        return out

    sched.schedule = wrapped
    return outs


def _new_ids(out: Any) -> dict[str, tuple[tuple[int, int], ...]]:
    """Per scheduled request, per group: how many block ids the runner got and how many of
    them are null (block 0)."""
    got: dict[str, Any] = {}
    for r in out.scheduled_new_reqs:
        got[r.req_id] = r.block_ids
    cached = out.scheduled_cached_reqs
    for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
        got[rid] = ids
    return {
        rid: tuple((len(g), sum(1 for b in g if b == 0)) for g in ids) if ids is not None else None
        for rid, ids in got.items()
    }


def _check_pool(sched: Any) -> None:
    """Every running request's real blocks are distinct across the pool."""
    seen: set[int] = set()
    for request in sched.running:
        for table in sched.kv_cache_manager.get_block_ids(request.request_id):
            for b in table:
                if b:
                    assert b not in seen, f"block {b} held twice"
                    seen.add(b)


def _lockstep(
    groups: Any,
    stream: dict[int, list[tuple[str, list[int], int]]],
    *,
    num_blocks: int,
    max_model_len: int = 3000,
    k: int = 0,
    async_scheduling: bool = False,
    aborts: dict[int, list[str]] | None = None,
    **kw: Any,
) -> dict[str, int]:
    """Feeds ``stream`` (step -> (id, prompt, max_tokens)) to stock vLLM and the plug-in in
    lockstep and compares every step. Returns figures: steps, preemptions, drafts scheduled and
    accepted, and the most Mamba blocks one request held in a group."""
    classes = (AsyncScheduler, PagedKVAsyncScheduler) if async_scheduling else (Scheduler, PagedKVScheduler)
    drivers = []
    captured = []
    for cls in classes:
        sched = _build(cls, groups, num_blocks, max_model_len, k, **kw)
        captured.append(_capture(sched))
        drivers.append(AsyncDriver(sched, num_drafts=k) if async_scheduling else Driver(sched, num_drafts=k))
    stock, paged = drivers
    kvm = paged.scheduler.kv_cache_manager
    assert isinstance(kvm, PagedKVCacheManager)
    mamba = [g for g, kind in enumerate(groups) if kind != "full"]
    for g in mamba:
        spec = kvm._specs[g]
        assert (spec.kind, spec.window, spec.prefix_cacheable, spec.spare_blocks) == ("sliding_window", 2, False, k)
        assert spec.block_size == max_model_len
    figures = {"steps": 0, "preemptions": 0, "max_mamba_blocks": 0}
    last = max(stream)
    step = 0
    while step <= last or any(
        d.has_work() if async_scheduling else d.scheduler.has_unfinished_requests() for d in drivers
    ):
        for rid, prompt, max_tokens in stream.get(step, ()):
            for d in drivers:
                d.add(make_request(rid, prompt, max_tokens, block_size=BS))
        to_abort = (aborts or {}).get(step, [])
        for d in drivers:
            d.abort([r for r in to_abort if r in d.scheduler.requests])
        n_before = [len(c) for c in captured]
        a, b = stock.step(), paged.step()
        ctx = f"step {step}"
        for key in ("scheduled", "preempted", "finished", "new_tokens", "resumed", "blocks_held"):
            assert a[key] == b[key], f"{ctx} {key}: stock {a[key]} pagedkv {b[key]}"
        new_a = [_new_ids(o) for o in captured[0][n_before[0] :]]
        new_b = [_new_ids(o) for o in captured[1][n_before[1] :]]
        assert new_a == new_b, f"{ctx} new block ids: stock {new_a} pagedkv {new_b}"
        for o_a, o_b in zip(captured[0][n_before[0] :], captured[1][n_before[1] :], strict=True):
            assert o_a.scheduled_spec_decode_tokens == o_b.scheduled_spec_decode_tokens, ctx
        _check_pool(paged.scheduler)
        figures["preemptions"] += len(a["preempted"])
        for held in a["blocks_held"].values():
            for g in mamba:
                figures["max_mamba_blocks"] = max(figures["max_mamba_blocks"], held[g][1])
        step += 1
        assert step < 5000, "did not drain"
    figures["steps"] = step
    assert stock.outputs == paged.outputs
    assert stock.finish_reasons == paged.finish_reasons
    assert (stock.drafts_scheduled, stock.drafts_accepted) == (paged.drafts_scheduled, paged.drafts_accepted)
    figures["drafts"] = paged.drafts_scheduled
    figures["accepted"] = paged.drafts_accepted
    assert kvm.num_free_blocks_now() == num_blocks - 1, "blocks leaked"
    assert stock.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1
    return figures


def _stream(
    seed: int, n: int, *, spread: int = 2, lo: int = 5, hi: int = 120, max_tokens: tuple[int, int] = (4, 40)
) -> Any:
    rng = random.Random(seed)
    out: dict[int, list[tuple[str, list[int], int]]] = {}
    for i in range(n):
        prompt = [rng.randrange(100, 4000) for _ in range(rng.randrange(lo, hi))]
        out.setdefault(rng.randrange(0, spread * n), []).append((f"r{i}", prompt, rng.randrange(*max_tokens)))
    return out


@SHAPES
@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_roomy_lockstep(groups: Any, k: int, async_scheduling: bool) -> None:
    """A roomy pool: each request's Mamba groups hold 1 + k blocks from its first allocation
    to its end, the attention group one per 16 tokens."""
    fig = _lockstep(
        groups, _stream(3 + k, 12), num_blocks=800, k=k, async_scheduling=async_scheduling, max_num_batched_tokens=96
    )
    assert fig["preemptions"] == 0
    assert fig["max_mamba_blocks"] == 1 + k
    if k and not async_scheduling:
        assert 0 < fig["accepted"] < fig["drafts"]


@SHAPES
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_memory_pressure_lockstep(groups: Any, k: int, async_scheduling: bool) -> None:
    """A pool that preempts: admission counts the 1 + k Mamba blocks per group as vLLM does,
    so the same requests are admitted and preempted at the same steps."""
    fig = _lockstep(
        groups,
        _stream(17 + k, 12, spread=1, lo=20, hi=90, max_tokens=(20, 60)),
        num_blocks=70,
        k=k,
        async_scheduling=async_scheduling,
        max_num_batched_tokens=128,
    )
    assert fig["preemptions"] > 0


@SHAPES
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_aborts_lockstep(groups: Any, async_scheduling: bool) -> None:
    """Aborts mid-prefill and mid-decode give every block back at the same step."""
    stream = _stream(5, 8, spread=1, lo=40, hi=200)
    _lockstep(
        groups,
        stream,
        num_blocks=400,
        k=2,
        async_scheduling=async_scheduling,
        aborts={3: ["r0", "r1"], 9: ["r2", "r5"]},
        max_num_batched_tokens=64,
    )


@SHAPES
@pytest.mark.parametrize("k", [1, 2, 3])
def test_context_length_edge_lockstep(groups: Any, k: int) -> None:
    """Requests that run to the context length (160 tokens here, the Mamba block size) with
    ``k`` drafts per step: equal step by step up to the length cap."""
    rng = random.Random(k)
    stream = {i: [(f"r{i}", [rng.randrange(100, 4000) for _ in range(100 + 5 * i)], 200)] for i in range(4)}
    fig = _lockstep(groups, stream, num_blocks=400, max_model_len=160, k=k, max_num_batched_tokens=64)
    # vLLM's scheduler keeps the slots within the context length here: 1 + k blocks to the
    # end (the rule for slots past the block is pinned by rust/core/tests/spare_blocks.rs).
    assert fig["max_mamba_blocks"] == 1 + k


@SHAPES
def test_refusals(groups: Any) -> None:
    """Mode none with prefix caching on and with a KV connector stay refused, each named."""
    kv = make_mamba_kv_cache_config(64, groups, BS, mamba_cache_mode="none", mamba_block_size=3000)
    vc = _config(64, 3000, 0)
    vc.cache_config.enable_prefix_caching = True
    with pytest.raises(UnsupportedVllmConfigError) as err:
        build_scheduler(PagedKVScheduler, vc, kv_cache_config=kv, block_size=6000, hash_block_size=6000)
    assert err.value.field == "cache_config.enable_prefix_caching"
    # A group in mode none beside a cache config in align mode: the modes must agree.
    vc = _config(64, 3000, 0)
    vc.cache_config.mamba_cache_mode = "align"
    with pytest.raises(UnsupportedVllmConfigError) as err:
        build_scheduler(PagedKVScheduler, vc, kv_cache_config=kv, block_size=6000, hash_block_size=6000)
    assert err.value.field.endswith("mamba_cache_mode")
