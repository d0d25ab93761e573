"""Mamba / linear-attention layers (vLLM's align-mode ``MambaSpec`` groups, pagedkv state
groups) under async scheduling: vLLM's ``AsyncScheduler`` stock vs the plug-in's async
scheduler in lockstep, two batches in flight (each step schedules the next batch before the
previous one's output is consumed, as the engine core's batch queue does), on fake KV cache
configs shaped like Qwen3-Next and Nemotron-H.

A decode is scheduled before its input token is known: the live state moves over a
placeholder slot, and the state at a block-aligned end is keyed by tokens pagedkv learns one
step later. Step by step both schedulers must agree on scheduled tokens, prefix hits (state
hits of shared prefixes included), preemptions, finished requests and new tokens, and per
group on each scheduled request's table length (a state group may hold one real block fewer
in pagedkv, as in synchronous scheduling: docs/design/vllm-mamba.md). Every state pagedkv
publishes is checked against the commit fence: published only inside ``commit_steps`` of the
step that wrote it, never at allocation, never for a step whose output was not processed.

Runs only where vLLM is installed (``make test-vllm``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from helpers.vllm_streams import assert_blocks_held, random_tokens, shared_prefix_stream  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402

from pagedkv.integrations.vllm import PagedKVCacheManager, PagedKVScheduler  # noqa: E402
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    NEMOTRON_H_GROUPS,
    QWEN3_NEXT_GROUPS,
    AsyncDriver,
    build_scheduler,
    make_mamba_kv_cache_config,
    make_request,
    make_vllm_config,
)

BS = 16
SHAPES = pytest.mark.parametrize("groups", [QWEN3_NEXT_GROUPS, NEMOTRON_H_GROUPS], ids=["qwen3-next", "nemotron-h"])


class FenceChecker:
    """Watches the plug-in's state groups for the commit fence: a state block is published
    (hashed) only inside ``commit_steps``, only for an aligned end at or below the end of the
    step being committed (the step whose output ``update_from_output`` is processing). Counts
    the states published."""

    def __init__(self, scheduler: Any) -> None:
        self.kvm: PagedKVCacheManager = scheduler.kv_cache_manager
        self.published = 0
        # (request, group, column, block) of the states the commits published.
        self.committed: set[tuple[str, int, int, int]] = set()
        commit = self.kvm.commit_steps

        def checked_commit(ends: dict[str, int], holdings: dict[str, int] | None = None, step: int = 0) -> int:
            before = self.states()
            n = commit(ends, holdings, step)
            pool = self.kvm._kvm.pool
            for (rid, g, j), (block, digest) in before.items():
                if digest is None and pool.block_hash(block) is not None:
                    self.committed.add((rid, g, j, block))
                    assert (j + 1) * BS <= ends[rid], (
                        f"{rid} group {g}: the state after {(j + 1) * BS} tokens published by the "
                        f"commit of a step ending at {ends.get(rid)}"
                    )
            self.published += n
            return n

        self.kvm.commit_steps = checked_commit  # type: ignore[method-assign]

    def states(self) -> dict[tuple[str, int, int], tuple[int, Any]]:
        """(request, group, column) -> (block, its hash or None) of every state block held."""
        kvm = self.kvm
        pool = kvm._kvm.pool
        out = {}
        for rid, seq in kvm._seq_of.items():
            for g in kvm._state_groups:
                for j, block in enumerate(kvm._kvm.block_table(seq, g).tolist()):
                    if block:
                        out[(rid, g, j)] = (block, pool.block_hash(block))
        return out

    def hashed(self) -> set[tuple[str, int, int, int]]:
        """(request, group, column, block) of every state block a request holds published."""
        return {(*key, block) for key, (block, digest) in self.states().items() if digest is not None}


class FencedDriver(AsyncDriver):
    """An ``AsyncDriver`` whose schedule() and the vLLM part of update_from_output publish no
    state (checked around each step against the plug-in's state tables)."""

    def __init__(self, scheduler: Any) -> None:
        super().__init__(scheduler)
        self.fence = FenceChecker(scheduler)
        sched = scheduler
        schedule = sched.schedule

        def checked_schedule(*args: Any, **kwargs: Any) -> Any:
            before = self.fence.hashed()
            out = schedule(*args, **kwargs)
            assert self.fence.hashed() <= before, "a state was published at allocation"
            return out

        sched.schedule = checked_schedule
        update = sched.update_from_output

        def checked_update(*args: Any, **kwargs: Any) -> Any:
            before = self.fence.hashed()
            out = update(*args, **kwargs)
            assert self.fence.hashed() - before <= self.fence.committed, "a state was published outside a commit"
            return out

        sched.update_from_output = checked_update


class FenceWaitingAsyncScheduler(AsyncScheduler):
    """Stock ``AsyncScheduler`` whose Mamba managers keep a state written by a step in its
    cached-this-step set until that step's output is processed (stock clears the set at the
    next ``schedule()``, so a sibling may hit a state whose step is still in flight; pagedkv
    publishes it only at the step's commit, and a hit on it waits until then). With it the
    plug-in must match step by step; against plain stock only the wait differs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._written: dict[int, set[Any]] = {}
        managers = self.kv_cache_manager.coordinator.single_type_managers
        self._mamba = [m for m in managers if hasattr(m, "cached_blocks_this_step")]
        for m in self._mamba:
            clear = m.new_step_starts

            def new_step_starts(m: Any = m, clear: Any = clear) -> None:
                clear()
                for hashes in self._written.values():
                    m.cached_blocks_this_step |= hashes

            m.new_step_starts = new_step_starts

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)
        written = set()
        for rid in out.num_scheduled_tokens:
            request = self.requests[rid]
            end = request.num_computed_tokens
            if end % BS or end > request.num_tokens:
                continue  # no aligned state, or a decode's (written over an unknown token)
            for m in self._mamba:
                blocks = m.req_to_blocks.get(rid, [])
                if len(blocks) >= end // BS and blocks[end // BS - 1].block_hash is not None:
                    written.add(blocks[end // BS - 1].block_hash)
        self._written[id(out)] = written
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        self._written.pop(id(scheduler_output), None)
        return super().update_from_output(scheduler_output, model_runner_output)


def _pair(
    groups: Any, num_blocks: int, *, fence_stock: bool = False, **config: Any
) -> tuple[AsyncDriver, FencedDriver]:
    drivers: list[Any] = []
    stock_cls = FenceWaitingAsyncScheduler if fence_stock else AsyncScheduler
    for cls, driver in ((stock_cls, AsyncDriver), (PagedKVScheduler, FencedDriver)):
        vc = make_vllm_config(num_blocks=num_blocks, block_size=BS, async_scheduling=True, **config)
        vc.cache_config.mamba_cache_mode = "align"
        kv = make_mamba_kv_cache_config(num_blocks, groups, BS)
        drivers.append(driver(build_scheduler(cls, vc, kv_cache_config=kv, block_size=BS, hash_block_size=BS)))
    stock, paged = drivers
    assert isinstance(stock.scheduler, AsyncScheduler) and isinstance(paged.scheduler, AsyncScheduler)
    assert paged.scheduler.kv_cache_manager.async_scheduling
    return stock, paged


def _lockstep(
    groups: Any,
    stream: dict[int, list[tuple[str, list[int], int]]],
    *,
    num_blocks: int,
    strict: bool = True,
    fence_stock: bool = False,
    actions: dict[int, Any] | None = None,
    **config: Any,
) -> tuple[AsyncDriver, FencedDriver, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Feeds ``stream`` (step -> (id, prompt, max_tokens)) to both schedulers in lockstep,
    ``actions[step]`` called with each driver before the step; with ``strict`` every step's
    record must be equal (a state group's real blocks may be one fewer in pagedkv).
    ``fence_stock``: stock is :class:`FenceWaitingAsyncScheduler`. Checks nothing is left
    held or pending at the end."""
    stock, paged = _pair(groups, num_blocks, fence_stock=fence_stock, **config)
    state = [g for g, kind in enumerate(groups) if kind != "full"]
    records = []
    last = max(stream)
    for step in range(5000):
        for rid, prompt, max_tokens in stream.get(step, []):
            stock.add(make_request(rid, prompt, max_tokens, block_size=BS))
            paged.add(make_request(rid, prompt, max_tokens, block_size=BS))
        if actions and step in actions:
            actions[step](stock)
            actions[step](paged)
        if step > last and not stock.has_work():
            if strict:
                assert not paged.has_work()
            if not paged.has_work():
                break
        a, b = stock.step(), paged.step()
        held_a, held_b = a.pop("blocks_held"), b.pop("blocks_held")
        if strict:
            assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
            assert_blocks_held(step, held_a, held_b, state)
        records.append((a, b))
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError("streams did not finish")
    kvm = paged.scheduler.kv_cache_manager
    assert not kvm._unknown and not kvm._state_sources and not kvm._wait_a_step
    assert not paged.scheduler._step_ends
    manager = kvm.manager
    manager.check_invariants()
    assert manager.num_sequences == 0
    stats = manager.stats()
    assert stats.used == 0 and stats.free == stats.num_blocks - 1
    assert stock.scheduler.kv_cache_manager.usage == 0.0
    return stock, paged, records


@SHAPES
def test_mamba_async_shared_prefix_matches_stock_step_by_step(groups: Any) -> None:
    rng = random.Random(7)
    prefix = random_tokens(rng, 150)
    stream = shared_prefix_stream(rng, prefix, 12, (1, 120), 12)
    stock, paged, records = _lockstep(groups, stream, num_blocks=600, max_num_batched_tokens=80, max_num_seqs=16)
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits
    hits = [h for h in paged.prefix_hits.values() if h]
    assert hits and all(h % BS == 0 for h in hits)
    assert max(hits) >= 144, "the shared prefix's states must be hit"
    assert paged.fence.published > 0


@SHAPES
def test_mamba_async_decoded_states_are_hit_once_committed(groups: Any) -> None:
    # "a" decodes across block boundaries (its states at aligned ends are written by steps
    # scheduled before their input tokens were known); "b" and "c" arrive later with a's
    # prompt and first outputs as their prompt, so their hits show when each decoded state
    # was published: as stock caches it, never before the step that wrote it completed.
    from pagedkv.testing.vllm_scheduler import fake_token

    prompt = list(range(300, 300 + 2 * BS - 3))
    outputs = [fake_token("a", len(prompt) + i) for i in range(40)]
    stream = {
        0: [("a", prompt, 40)],
        7: [("b", prompt + outputs[:10] + [5, 6], 3)],
        12: [("d", prompt + outputs[:14] + [5], 3)],
        23: [("c", prompt + outputs[:30] + [7], 3)],
    }
    stock, paged, _ = _lockstep(groups, stream, num_blocks=200, max_num_batched_tokens=64)
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits
    # The states after 32 and 48 tokens were written by decodes (a's prompt is 29 tokens).
    assert paged.prefix_hits["b"] == paged.prefix_hits["d"] == 2 * BS, paged.prefix_hits
    assert paged.prefix_hits["c"] == 3 * BS, paged.prefix_hits


@pytest.mark.parametrize("seed", [1, 4, 10, 21, 33, 46])
def test_mamba_async_random_streams_match_stock(seed: int) -> None:
    # Random prompt lengths, shared prefixes, token budgets, long-prefill thresholds (below
    # the block size too) and running-request caps. Against stock whose hits on a state of a
    # step in flight wait for its output, as pagedkv's: equal step by step. Against plain
    # stock (it hits such a state at once): the same outputs and prefix hits, some requests
    # admitted a step later.
    rng = random.Random(seed)
    groups = (QWEN3_NEXT_GROUPS, NEMOTRON_H_GROUPS)[seed % 2]
    prefix = random_tokens(rng, rng.randrange(0, 200))
    stream = shared_prefix_stream(rng, prefix, rng.randrange(4, 14), (1, rng.randrange(2, 150)), rng.randrange(1, 15))
    config = {
        "max_num_batched_tokens": rng.choice([32, 48, 64, 80, 128, 256]),
        "max_num_seqs": rng.choice([2, 4, 16]),
        "long_prefill_token_threshold": rng.choice([0, 8, 24, 40]),
    }
    stock, paged, _ = _lockstep(groups, stream, num_blocks=1000, fence_stock=True, **config)
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits
    plain, paged, records = _lockstep(groups, stream, num_blocks=1000, strict=False, **config)
    assert paged.outputs == plain.outputs and paged.finish_reasons == plain.finish_reasons
    assert paged.prefix_hits == plain.prefix_hits
    same = sum(1 for a, b in records if a["scheduled"] == b["scheduled"])
    print(
        f"seed {seed}: {same} of {len(records)} steps schedule as plain stock; hits {sum(plain.prefix_hits.values())}"
    )


@SHAPES
def test_mamba_async_aborts_match_stock(groups: Any) -> None:
    # Requests aborted mid-prefill and mid-decode, with steps in flight (their pending
    # states are released unpublished, their placeholders settled): step by step equal.
    rng = random.Random(5)
    prefix = random_tokens(rng, 120)
    stream = {0: [(f"q{i}", prefix + random_tokens(rng, 20 + 9 * i), 30) for i in range(6)]}
    stream[4] = [(f"w{i}", prefix + random_tokens(rng, 5 + i), 12) for i in range(3)]

    def abort(ids: list[str]) -> Any:
        return lambda d: d.abort(ids)

    actions = {2: abort(["q1"]), 6: abort(["q2", "w0"]), 11: abort(["q4"]), 14: abort(["w2"])}
    stock, paged, records = _lockstep(
        groups, stream, num_blocks=500, actions=actions, fence_stock=True, max_num_batched_tokens=64, max_num_seqs=16
    )
    assert paged.outputs == stock.outputs and paged.prefix_hits == stock.prefix_hits
    assert paged.finish_reasons == stock.finish_reasons
    assert sum(1 for r in paged.finish_reasons.values() if r == "abort") == 5


@SHAPES
@pytest.mark.parametrize("num_blocks", [60, 90])
def test_mamba_async_under_memory_pressure(groups: Any, num_blocks: int) -> None:
    # A small pool: admission waits and running requests are preempted with steps in flight.
    # As in synchronous scheduling pagedkv frees a moved-out state a step earlier, so once the
    # pool is full admission and preemption may diverge (docs/design/vllm-mamba.md); outputs
    # and finish reasons must agree, and nothing may leak.
    rng = random.Random(3)
    prefix = random_tokens(rng, 64)
    stream = shared_prefix_stream(rng, prefix, 12, (40, 200), 6)
    stock, paged, records = _lockstep(
        groups, stream, num_blocks=num_blocks, strict=False, max_num_batched_tokens=128, max_num_seqs=16
    )
    assert paged.outputs == stock.outputs
    assert paged.finish_reasons == stock.finish_reasons
    pre_a = sum(len(a["preempted"]) for a, _ in records)
    pre_b = sum(len(b["preempted"]) for _, b in records)
    same = sum(1 for a, b in records if a["scheduled"] == b["scheduled"])
    assert pre_b > 0, "the small pool must preempt"
    print(
        f"async pressure {num_blocks} blocks: preemptions stock {pre_a} pagedkv {pre_b}; steps "
        f"{len(records)}, equal schedules {same}; hit tokens stock {sum(stock.prefix_hits.values())} "
        f"pagedkv {sum(paged.prefix_hits.values())}"
    )
