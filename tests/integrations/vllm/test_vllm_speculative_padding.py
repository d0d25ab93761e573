"""Tokens vLLM schedules that the KV cache manager has no ids for, stock vs ``PagedKVScheduler``.

With a speculative config, vLLM pads a request admitted with one token left to compute (a prompt
of ``m * block_size + 1`` tokens sent again, or a preempted request resumed with its blocks
still cached) to a verify-sized step: ``1 + k`` scheduled tokens, the ``k`` past its known ones
being placeholder drafts (``-1``) that are not in ``request.spec_token_ids``. Both pagedkv
managers give the placeholders lookahead slots as drafts (of ids no request has) and read vLLM's
rollback of them; the hybrid one raised ``InvalidArgumentError`` inside ``schedule()`` before,
and with ``k >= block_size`` both held one block less than stock. Every step must agree with stock vLLM
(scheduled tokens, hits, preemptions, tokens, blocks held per group) and the outputs must equal
decoding without drafts.

The other tokens vLLM schedules without ids: a running request's drafts (``spec_token_ids``,
given lookahead slots; ``test_vllm_speculative.py``), grammar-invalidated drafts (``-1``, never
accepted) and async scheduling's output placeholders (``num_output_placeholders``, the async
scheduler's own tests).

Runs only where vLLM is installed (``make test-vllm``).
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from pagedkv.integrations.vllm import PagedKVScheduler  # noqa: E402
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    Driver,
    build_scheduler,
    make_hybrid_kv_cache_config,
    make_kv_cache_config,
    make_request,
    make_vllm_config,
    ngram_speculative_config,
)

BS = 16
FULL_AND_WINDOW = (("full", None), ("sliding_window", 32))


class PerRequestPagedKVScheduler(PagedKVScheduler):
    """The plug-in without its batched decode path."""

    batch_decode = False


def _driver(cls: type, k: int, groups: Any, num_blocks: int, **kw: Any) -> Driver:
    base = make_vllm_config(num_blocks=num_blocks, **kw)
    cfg = base
    if k:
        cfg = make_vllm_config(num_blocks=num_blocks, speculative_config=ngram_speculative_config(base, k), **kw)
    if groups is None:
        kv = make_kv_cache_config(num_blocks, BS)
    else:
        kv = make_hybrid_kv_cache_config(num_blocks, groups, BS)
    return Driver(build_scheduler(cls, cfg, kv_cache_config=kv), num_drafts=k)


def _lockstep(
    cls: type,
    k: int,
    groups: Any,
    stream: dict[int, list[tuple[str, list[int], int]]],
    num_blocks: int,
    preempt_before: dict[int, str] | None = None,
    **kw: Any,
) -> tuple[Driver, Driver, list[dict[str, Any]]]:
    """Feeds ``stream`` (step -> (id, prompt, max_tokens)) to stock vLLM and ``cls`` in
    lockstep, preempting ``preempt_before[step]`` in both before that step; every step must
    agree. Returns both drivers and stock's records."""
    stock, paged = _driver(Scheduler, k, groups, num_blocks, **kw), _driver(cls, k, groups, num_blocks, **kw)
    records = []
    for step in range(3000):
        for rid, prompt, max_tokens in stream.get(step, []):
            stock.add(make_request(rid, prompt, max_tokens, block_size=BS))
            paged.add(make_request(rid, prompt, max_tokens, block_size=BS))
        if preempt_before and step in preempt_before:
            _preempt(stock, preempt_before[step])
            _preempt(paged, preempt_before[step])
        if step > max(stream) and not stock.scheduler.has_unfinished_requests():
            assert not paged.scheduler.has_unfinished_requests()
            break
        a, b = stock.step(), paged.step()
        assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
        paged.scheduler.kv_cache_manager.manager.check_invariants()
        records.append(a)
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError("stream did not finish")
    kvm = paged.scheduler.kv_cache_manager.manager
    kvm.check_invariants()
    assert kvm.num_sequences == 0
    assert paged.scheduler.kv_cache_manager.usage == 0.0
    return stock, paged, records


def _plain_outputs(groups: Any, stream: dict[int, list[tuple[str, list[int], int]]], num_blocks: int, **kw: Any):
    d = _driver(Scheduler, 0, groups, num_blocks, **kw)
    for step in range(3000):
        for rid, prompt, max_tokens in stream.get(step, []):
            d.add(make_request(rid, prompt, max_tokens, block_size=BS))
        if step > max(stream) and not d.scheduler.has_unfinished_requests():
            return d.outputs
        d.step()
    raise AssertionError("stream did not finish")  # pragma: no cover


@pytest.mark.parametrize("k", [1, 5, BS])
@pytest.mark.parametrize("groups", [FULL_AND_WINDOW, None], ids=["full+window", "one-group"])
@pytest.mark.parametrize("cls", [PagedKVScheduler, PerRequestPagedKVScheduler])
def test_a_repeated_prompt_with_one_token_left_is_padded_as_by_stock(k: int, groups: Any, cls: type) -> None:
    # The reproduction: a 33-token prompt cached once, one request decoding, the same
    # prompt sent again: its prefix hit leaves one token, which vLLM pads with k placeholders.
    # With k = block_size the last placeholder lies in the next block, which stock allocates
    # (the model runner writes its KV there) and so must pagedkv (it held one block less).
    rng = random.Random(36)
    prompt = [rng.randrange(100, 4000) for _ in range(2 * BS + 1)]
    other = [rng.randrange(100, 4000) for _ in range(20)]
    stream = {0: [("first", prompt, 3)], 6: [("decoding", other, 40)], 9: [("again", prompt, 8)]}
    stock, paged, records = _lockstep(cls, k, groups, stream, 64)
    padded = [r["scheduled"]["again"] for r in records if "again" in r["new_prefix_hits"]]
    assert padded == [1 + k], "the repeated prompt must be admitted as a padded verify step"
    assert stock.prefix_hits["again"] == paged.prefix_hits["again"] == 2 * BS
    assert paged.outputs == stock.outputs == _plain_outputs(groups, stream, 64)


def _preempt(d: Driver, rid: str) -> None:
    """Preempts running request ``rid`` between steps as vLLM's scheduler does when it runs out
    of blocks (recompute: back to the waiting queue, its blocks freed and still cached)."""
    sched = d.scheduler
    request = sched.requests[rid]
    sched.running.remove(request)
    sched._preempt_request(request, time.monotonic())


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("groups", [FULL_AND_WINDOW, None], ids=["full+window", "one-group"])
@pytest.mark.parametrize("cls", [PagedKVScheduler, PerRequestPagedKVScheduler])
def test_a_preempted_request_resumed_on_its_cached_blocks_is_padded_as_by_stock(k: int, groups: Any, cls: type) -> None:
    # "a" (32 prompt tokens) holds 33 tokens after its prefill, 32 computed in two cached
    # blocks; preempted then, it resumes on them with one token left, which vLLM pads.
    rng = random.Random(7)
    prompt = [rng.randrange(100, 4000) for _ in range(2 * BS)]
    other = [rng.randrange(100, 4000) for _ in range(20)]
    stream = {0: [("a", prompt, 10), ("decoding", other, 30)]}
    stock, paged, records = _lockstep(cls, k, groups, stream, 64, preempt_before={1: "a"})
    assert records[1]["resumed"] == {"a": 2 * BS}
    assert records[1]["scheduled"]["a"] == 1 + k
    assert paged.outputs == stock.outputs == _plain_outputs(groups, stream, 64)
