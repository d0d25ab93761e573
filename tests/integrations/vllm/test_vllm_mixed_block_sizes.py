"""KV cache groups of different block sizes, and a prefix-hash granularity finer than a block:
stock vLLM's hybrid coordinator vs ``PagedKVScheduler`` in lockstep.

vLLM 0.33 (``resolve_kv_cache_block_sizes``): with several groups the scheduler block size is
the LCM of the groups' block sizes and ``hash_block_size`` their GCD (or
``cache_config.prefix_match_unit``, any divisor of every group's block size); without Mamba
layers every prefix hit is a multiple of the scheduler block size. The engine core passes both
to the scheduler; requests carry block hashes at ``hash_block_size``. Step by step both
schedulers must agree on scheduled tokens, prefix hits of new and resumed requests,
preemptions, finished requests, new tokens and, per group, each scheduled request's table
length and real blocks.

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
    AsyncDriver,
    Driver,
    build_scheduler,
    make_hybrid_kv_cache_config,
    make_request,
    make_vllm_config,
)

# gpt-oss style: full attention at 16 tokens per block, a 128-token sliding window at 32.
FULL16_SW32 = (("full", None, 16), ("sliding_window", 128, 32))
# A coarser window group: 64 tokens per block (hit unit 64).
FULL16_SW64 = (("full", None, 16), ("sliding_window", 96, 64), ("sliding_window", 96, 64))
# One block size (32) and prefix hashes at 16 (vLLM's prefix_match_unit).
FULL32_SW32 = (("full", None, 32), ("sliding_window", 80, 32))


def _sizes(groups: Any) -> tuple[int, int]:
    sizes = [g[2] for g in groups]
    return math.lcm(*sizes), math.gcd(*sizes)


def _lockstep(
    groups: Any,
    stream: dict[int, list[tuple[str, list[int], int]]],
    *,
    num_blocks: int,
    hash_block_size: int | None = None,
    strict: bool = True,
    async_scheduling: bool = False,
    **config: Any,
) -> tuple[Driver, Driver, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Feeds ``stream`` (step -> (id, prompt, max_tokens)) to stock vLLM and the plug-in in
    lockstep, both built as the engine core builds them for ``groups``."""
    lcm, gcd = _sizes(groups)
    hbs = gcd if hash_block_size is None else hash_block_size
    drivers = []
    for cls in (AsyncScheduler, PagedKVAsyncScheduler) if async_scheduling else (Scheduler, PagedKVScheduler):
        kv = make_hybrid_kv_cache_config(num_blocks, groups)
        vc = make_vllm_config(num_blocks=num_blocks, block_size=gcd, async_scheduling=async_scheduling, **config)
        sched = build_scheduler(cls, vc, kv_cache_config=kv, block_size=lcm, hash_block_size=hbs)
        drivers.append((AsyncDriver if async_scheduling else Driver)(sched))
    stock, paged = drivers
    kvm = paged.scheduler.kv_cache_manager
    assert isinstance(kvm, PagedKVCacheManager)
    assert kvm.group_block_sizes == tuple(g[2] for g in groups)
    assert (kvm.block_size, kvm.coordinator.hash_block_size, kvm.block_pool.hash_block_size) == (lcm, hbs, hbs)
    stock_coord = stock.scheduler.kv_cache_manager.coordinator
    assert (stock_coord.scheduler_block_size, stock_coord.hash_block_size) == (lcm, hbs)
    records = []
    last = max(stream)
    for step in range(5000):
        for rid, prompt, max_tokens in stream.get(step, []):
            # The engine core hashes requests at hash_block_size.
            stock.add(make_request(rid, prompt, max_tokens, block_size=hbs))
            paged.add(make_request(rid, prompt, max_tokens, block_size=hbs))
        if step > last and not stock.scheduler.has_unfinished_requests():
            assert not paged.scheduler.has_unfinished_requests()
            break
        a, b = stock.step(), paged.step()
        if strict and async_scheduling:
            # Real blocks may be fewer: pagedkv releases window blocks of a request whose
            # prefill chunk is in flight by computed tokens, vLLM by processed ones (the
            # difference by design of test_vllm_async.py); table lengths are equal.
            held_a, held_b = a.pop("blocks_held"), b.pop("blocks_held")
            assert held_b.keys() == held_a.keys()
            for rid in held_a:
                for (len_a, real_a), (len_b, real_b) in zip(held_a[rid], held_b[rid], strict=True):
                    assert len_b == len_a and real_b <= real_a, f"step {step} {rid}: {held_a[rid]} vs {held_b[rid]}"
        if strict:
            assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
        records.append((a, b))
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError("streams did not finish")
    manager = kvm.manager
    manager.check_invariants()
    assert manager.num_sequences == 0
    assert stock.scheduler.kv_cache_manager.usage == 0.0
    assert kvm.usage == 0.0
    return stock, paged, records


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 4000) for _ in range(n)]


def _shared_prefix_stream(rng: random.Random, prefix: list[int], n: int, tail: tuple[int, int], spread: int) -> Any:
    stream: dict[int, list[tuple[str, list[int], int]]] = {}
    for i in range(n):
        prompt = prefix + _tokens(rng, rng.randrange(*tail))
        stream.setdefault(rng.randrange(0, spread), []).append((f"r{i}", prompt, rng.randrange(1, 40)))
    return stream


@pytest.mark.parametrize("groups", [FULL16_SW32, FULL16_SW64], ids=["full16-sw32", "full16-sw64x2"])
def test_mixed_block_sizes_match_stock_step_by_step(groups: Any) -> None:
    rng = random.Random(7)
    prefix = _tokens(rng, 300)
    stream = _shared_prefix_stream(rng, prefix, 12, (1, 200), 10)
    stock, paged, records = _lockstep(groups, stream, num_blocks=800, max_num_batched_tokens=128)
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits
    lcm, _ = _sizes(groups)
    hits = [h for h in paged.prefix_hits.values() if h]
    assert hits and all(h % lcm == 0 for h in hits), "hits are multiples of the scheduler block size"
    assert max(hits) >= 256, "the shared prefix past the window must hit"
    # Each group's table has its own length (ceil(slots / its block size)), and the window
    # groups released blocks out of the window.
    assert any(held[0][0] > held[1][0] for _, b in records for held in b["blocks_held"].values())
    assert any(real < length for _, b in records for h in b["blocks_held"].values() for length, real in h[1:])


def test_mixed_block_sizes_under_preemption_match_stock() -> None:
    # A pool too small for the stream: admission waits and a running request is preempted.
    # Prompts share no prefix, so no block is cached twice (see the next test).
    rng = random.Random(3)
    stream = _shared_prefix_stream(rng, [], 12, (40, 300), 6)
    stock, paged, records = _lockstep(FULL16_SW32, stream, num_blocks=48, max_num_batched_tokens=128)
    assert paged.outputs == stock.outputs
    assert [b["preempted"] for _, b in records] == [a["preempted"] for a, _ in records]
    assert any(b["preempted"] for _, b in records), "the small pool must preempt"


def test_mixed_block_sizes_shared_prefix_under_pressure_outputs_match() -> None:
    # Shared prefixes in a small pool: a request whose window group missed recomputes blocks
    # its full-attention group had cached; vLLM keeps both copies, pagedkv one (the
    # documented "cached twice" difference), so free blocks, then admission and hits,
    # diverge later. Outputs and finish reasons must agree.
    rng = random.Random(3)
    prefix = _tokens(rng, 150)
    stream = _shared_prefix_stream(rng, prefix, 12, (40, 200), 6)
    stock, paged, _ = _lockstep(FULL16_SW32, stream, num_blocks=48, strict=False, max_num_batched_tokens=128)
    assert paged.outputs == stock.outputs
    assert paged.finish_reasons == stock.finish_reasons
    print(f"pressure: hit tokens stock {sum(stock.prefix_hits.values())}, pagedkv {sum(paged.prefix_hits.values())}")


def test_hash_block_size_finer_than_the_block_matches_stock() -> None:
    # Block size 32 in both groups, prefix hashes at 16 (prefix_match_unit=16): hits stay
    # multiples of 32; the requests' 16-token hashes are vLLM's.
    rng = random.Random(9)
    prefix = _tokens(rng, 200)
    stream = _shared_prefix_stream(rng, prefix, 10, (1, 120), 8)
    stock, paged, _ = _lockstep(FULL32_SW32, stream, num_blocks=400, hash_block_size=16, max_num_batched_tokens=96)
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits
    assert sum(paged.prefix_hits.values()) > 0 and all(h % 32 == 0 for h in paged.prefix_hits.values())


def test_mixed_block_sizes_async_scheduling_match_stock() -> None:
    rng = random.Random(13)
    prefix = _tokens(rng, 200)
    stream = _shared_prefix_stream(rng, prefix, 10, (1, 150), 8)
    stock, paged, _ = _lockstep(FULL16_SW32, stream, num_blocks=600, async_scheduling=True, max_num_batched_tokens=96)
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits


def _build(groups: Any, block_size: int, hash_block_size: int, **config: Any) -> Any:
    kv = make_hybrid_kv_cache_config(64, groups)
    vc = make_vllm_config(num_blocks=64, **config)
    return build_scheduler(
        PagedKVScheduler, vc, kv_cache_config=kv, block_size=block_size, hash_block_size=hash_block_size
    )


@pytest.mark.parametrize(
    ("groups", "block_size", "hash_block_size", "field"),
    [
        # A scheduler block size that is a multiple of the LCM but not the LCM.
        (FULL16_SW32, 64, 16, "block_size"),
        # A hash granularity that does not divide every group's block size.
        (FULL16_SW32, 32, 32, "hash_block_size"),
        # A chunked-local group below the scheduler block size (vLLM asserts on it too).
        ((("full", None, 32), ("chunked_local", 64, 16)), 32, 16, "kv_cache_config.kv_cache_groups[1]"),
        # One group, prefix caching on: vLLM requires hash_block_size == block_size.
        ((("full", None, 32),), 32, 16, "hash_block_size"),
    ],
)
def test_layouts_vllm_places_otherwise_are_refused_by_name(
    groups: Any, block_size: int, hash_block_size: int, field: str
) -> None:
    with pytest.raises(UnsupportedVllmConfigError) as err:
        _build(groups, block_size, hash_block_size)
    assert err.value.field.startswith(field)


def test_one_group_with_finer_hashes_and_no_prefix_caching_is_served() -> None:
    sched = _build((("full", None, 32),), 32, 16, enable_prefix_caching=False)
    assert sched.kv_cache_manager.coordinator.hash_block_size == 16
