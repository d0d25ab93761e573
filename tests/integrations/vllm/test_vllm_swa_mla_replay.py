"""A DeepSeek-V4-shaped KV cache (MLA full attention plus a sliding-window MLA group with
bounded prefix replay, ``SlidingWindowMLASpec(bounded_replay=True)``): stock vLLM vs
``PagedKVScheduler`` in lockstep.

The window group is not prefix-cacheable: a prefix hit comes from the full group alone, and
vLLM recomputes the hit's last window (``prefix_replay_tokens``) to rebuild the window group,
which gets fresh blocks for it while the full group keeps its cached ones. Step by step both
schedulers must agree on scheduled tokens, each new request's computed count and replay start,
preemptions, outputs, the number of blocks handed out for zeroing (the two groups' precisions
differ, so vLLM zeroes new blocks), and per group each scheduled request's table length and
real blocks.

Runs only where vLLM is installed (``make test-vllm``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

import torch  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)

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
    eagle_speculative_config,
    make_request,
    make_vllm_config,
)

BLOCK = 16
WINDOW = 128


def _dsv4_config(num_blocks: int, *, window: int = WINDOW, bounded_replay: bool = True) -> KVCacheConfig:
    """MLA full attention (float32 latent) and a bfloat16 sliding-window MLA group."""
    full = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32)
    swa = SlidingWindowMLASpec(
        block_size=BLOCK,
        num_kv_heads=1,
        head_size=64,
        dtype=torch.bfloat16,
        sliding_window=window,
        bounded_replay=bounded_replay,
    )
    groups = [
        KVCacheGroupSpec([f"layers.{i}.attn" for i in range(0, 4)], full),
        KVCacheGroupSpec([f"layers.{i}.attn" for i in range(4, 8)], swa),
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def _capture(scheduler: Any) -> list[Any]:
    """Every ``SchedulerOutput`` ``scheduler.schedule`` returns, in order."""
    outs: list[Any] = []
    schedule = scheduler.schedule

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        outs.append(out)
        return out

    scheduler.schedule = wrapped
    return outs


def _replay_view(out: Any) -> dict[str, Any]:
    return {
        "new": {r.req_id: (r.num_computed_tokens, r.replay_start) for r in out.scheduled_new_reqs},
        "zeroed": len(out.new_block_ids_to_zero or ()),
    }


def _lockstep(
    stream: dict[int, list[tuple[str, list[int], int]]],
    *,
    num_blocks: int,
    async_scheduling: bool = False,
    **config: Any,
) -> tuple[Driver, Driver, list[dict[str, Any]]]:
    drivers = []
    captures = []
    classes = (AsyncScheduler, PagedKVAsyncScheduler) if async_scheduling else (Scheduler, PagedKVScheduler)
    for cls in classes:
        vc = make_vllm_config(num_blocks=num_blocks, block_size=BLOCK, async_scheduling=async_scheduling, **config)
        sched = build_scheduler(cls, vc, kv_cache_config=_dsv4_config(num_blocks), block_size=BLOCK)
        assert sched.prefix_replay_tokens == WINDOW
        assert sched.needs_kv_cache_zeroing
        captures.append(_capture(sched))
        drivers.append((AsyncDriver if async_scheduling else Driver)(sched))
    stock, paged = drivers
    assert isinstance(paged.scheduler.kv_cache_manager, PagedKVCacheManager)
    records = []
    last = max(stream)
    for step in range(5000):
        for rid, prompt, max_tokens in stream.get(step, []):
            stock.add(make_request(rid, prompt, max_tokens, block_size=BLOCK))
            paged.add(make_request(rid, prompt, max_tokens, block_size=BLOCK))
        if step > last and not stock.scheduler.has_unfinished_requests():
            assert not paged.scheduler.has_unfinished_requests()
            break
        a, b = stock.step(), paged.step()
        if async_scheduling:
            # Real blocks may be fewer: pagedkv releases window blocks of a request whose
            # prefill chunk is in flight by computed tokens, vLLM by processed ones (the
            # difference by design of test_vllm_async.py); table lengths are equal.
            held_a, held_b = a.pop("blocks_held"), b.pop("blocks_held")
            assert held_b.keys() == held_a.keys()
            for rid in held_a:
                for (len_a, real_a), (len_b, real_b) in zip(held_a[rid], held_b[rid], strict=True):
                    assert len_b == len_a and real_b <= real_a, f"step {step} {rid}: {held_a[rid]} vs {held_b[rid]}"
        a["replay"] = [_replay_view(o) for o in captures[0]]
        b["replay"] = [_replay_view(o) for o in captures[1]]
        captures[0].clear()
        captures[1].clear()
        assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
        records.append(b)
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError("streams did not finish")
    manager = paged.scheduler.kv_cache_manager.manager
    manager.check_invariants()
    assert manager.num_sequences == 0
    assert stock.scheduler.kv_cache_manager.usage == 0.0
    assert paged.scheduler.kv_cache_manager.usage == 0.0
    return stock, paged, records


def _stream(seed: int, prefix_len: int, n: int, spread: int) -> dict[int, list[tuple[str, list[int], int]]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 4000) for _ in range(prefix_len)]
    stream: dict[int, list[tuple[str, list[int], int]]] = {}
    for i in range(n):
        prompt = prefix + [rng.randrange(100, 4000) for _ in range(rng.randrange(1, 120))]
        stream.setdefault(rng.randrange(0, spread), []).append((f"r{i}", prompt, rng.randrange(1, 30)))
    return stream


def _replays(records: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [v for r in records for o in r["replay"] for v in o["new"].values() if v[1]]


@pytest.mark.parametrize("chunk", [512, 48], ids=["whole-prefill", "chunked-below-window"])
def test_shared_prefixes_replay_the_window_as_stock(chunk: int) -> None:
    stock, paged, records = _lockstep(
        _stream(5, 300, 12, 10), num_blocks=600, max_num_batched_tokens=chunk, max_num_seqs=16
    )
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits
    replays = _replays(records)
    # Hits past the window replay it: the computed count starts a window before the hit's end.
    assert replays, "shared prefixes past the window must hit and replay"
    assert all(computed == start and start % BLOCK == 0 for computed, start in replays)
    assert max(start for _, start in replays) >= 288 - WINDOW
    # Every step hands the worker its new blocks to zero.
    assert sum(o["zeroed"] for r in records for o in r["replay"]) > 0


def test_short_shared_prefixes_are_not_taken() -> None:
    # A shared prefix no longer than the window would be replayed whole: no hit is taken.
    stock, paged, records = _lockstep(_stream(11, 100, 8, 6), num_blocks=400)
    assert paged.outputs == stock.outputs
    assert not _replays(records)
    assert all(h == 0 for h in paged.prefix_hits.values())


def test_replay_under_preemption_matches_stock() -> None:
    stock, paged, records = _lockstep(_stream(3, 260, 12, 4), num_blocks=90, max_num_batched_tokens=128)
    assert paged.outputs == stock.outputs
    assert any(r["preempted"] for r in records), "the small pool must preempt"
    assert _replays(records)


def test_replay_async_scheduling_matches_stock() -> None:
    stock, paged, records = _lockstep(
        _stream(17, 300, 10, 8), num_blocks=600, async_scheduling=True, max_num_batched_tokens=96
    )
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits
    assert _replays(records)


def test_window_group_never_registers_a_block() -> None:
    vc = make_vllm_config(num_blocks=200, block_size=BLOCK)
    sched = build_scheduler(PagedKVScheduler, vc, kv_cache_config=_dsv4_config(200), block_size=BLOCK)
    kvm = sched.kv_cache_manager
    assert [g.prefix_cacheable for g in kvm.manager.config.groups] == [True, False]
    driver = Driver(sched)
    prompt = list(range(100, 400))
    driver.add(make_request("a", prompt, 8, block_size=BLOCK))
    driver.step()
    driver.add(make_request("b", prompt + [7], 8, block_size=BLOCK))
    driver.step()
    pool = kvm.manager.pool
    full_a, window_a = kvm.get_block_ids("a")
    full_b, window_b = kvm.get_block_ids("b")
    # The full group's 18 prompt blocks are cached and shared; the window group's are its own.
    assert all(pool.block_hash(b) is not None for b in full_a[:18])
    assert full_b[:18] == full_a[:18]
    assert all(pool.block_hash(b) is None for b in window_a + window_b if b)
    assert not {b for b in window_a if b} & {b for b in window_b if b}
    # b replays the hit's last window: blocks below it are null, the window's are fresh.
    assert window_b[: (288 - WINDOW + 1) // BLOCK] == [0] * ((288 - WINDOW + 1) // BLOCK)


def test_eagle_block_drop_with_bounded_replay_is_refused_by_name() -> None:
    base = make_vllm_config(num_blocks=64, block_size=BLOCK)
    vc = make_vllm_config(num_blocks=64, block_size=BLOCK, speculative_config=eagle_speculative_config(base, 2))
    with pytest.raises(UnsupportedVllmConfigError) as err:
        build_scheduler(PagedKVScheduler, vc, kv_cache_config=_dsv4_config(64), block_size=BLOCK)
    assert err.value.field == "kv_cache_config.kv_cache_groups[1].kv_cache_spec.bounded_replay"
    # Without prefix caching the drop never applies: served.
    off = make_vllm_config(
        num_blocks=64,
        block_size=BLOCK,
        enable_prefix_caching=False,
        speculative_config=eagle_speculative_config(base, 2),
    )
    sched = build_scheduler(PagedKVScheduler, off, kv_cache_config=_dsv4_config(64), block_size=BLOCK)
    assert sched.prefix_replay_tokens == WINDOW


def test_window_mla_without_bounded_replay_is_a_cached_window() -> None:
    vc = make_vllm_config(num_blocks=64, block_size=BLOCK)
    sched = build_scheduler(
        PagedKVScheduler, vc, kv_cache_config=_dsv4_config(64, bounded_replay=False), block_size=BLOCK
    )
    kvm = sched.kv_cache_manager
    assert sched.prefix_replay_tokens == 0 and kvm.prefix_replay_tokens == 0
    assert [(g.kind, g.window, g.prefix_cacheable) for g in kvm.manager.config.groups] == [
        ("full", None, True),
        ("sliding_window", WINDOW, True),
    ]
