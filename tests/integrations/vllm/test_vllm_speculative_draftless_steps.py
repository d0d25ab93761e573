"""Speculative decoding with steps that have no drafts, stock vs ``PagedKVScheduler``.

An n-gram proposer finds no match for many steps, so a request alternates between verify steps
and plain one-token decodes. After a verify step whose drafts are rejected, pagedkv and vLLM both
keep the blocks of the rejected slots (``accept_drafts(release_blocks=False)``); a later plain
decode that opens such a block takes no new one. The plug-in's decode deferral counted one there
and stopped the engine with ``VllmStateMismatchError: deferred decodes: pagedkv's new blocks (0)
differ from vLLM's (1)`` (found end to end on vLLM's CPU build with n-gram speculation,
``tests/integrations/vllm_e2e/test_vllm_e2e_speculative.py``).

Runs only where vLLM is installed (``make test-vllm`` builds that environment).
"""

from __future__ import annotations

import random
import zlib
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from pagedkv.integrations.vllm import PagedKVScheduler  # noqa: E402
from pagedkv.testing import vllm_scheduler  # noqa: E402
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    Driver,
    build_scheduler,
    make_request,
    make_vllm_config,
    ngram_speculative_config,
)

BS = 16
_FAKE_DRAFTS = vllm_scheduler.fake_drafts


class PerRequestPagedKVScheduler(PagedKVScheduler):
    """The plug-in without its batched decode path."""

    batch_decode = False


def _drafts_or_none(request_id: str, position: int, k: int) -> list[int]:
    """The harness's drafts, except that about every second step proposes none (no n-gram
    match), deterministically per request and position."""
    if zlib.crc32(f"none:{request_id}@{position}".encode()) % 2 == 0:
        return []
    return _FAKE_DRAFTS(request_id, position, k)


def _run(cls: type, k: int, monkeypatch: pytest.MonkeyPatch) -> tuple[Driver, list[dict[str, Any]]]:
    kw: dict[str, Any] = {"num_blocks": 1024, "max_num_batched_tokens": 256}
    cfg = make_vllm_config(**kw)
    if k:
        cfg = make_vllm_config(speculative_config=ngram_speculative_config(cfg, k), **kw)
    monkeypatch.setattr(vllm_scheduler, "fake_drafts", _drafts_or_none)
    d = Driver(build_scheduler(cls, cfg), num_drafts=k)
    rng = random.Random(25)  # the same requests for every k
    for i in range(6):
        prompt = [rng.randrange(100, 4000) for _ in range(rng.randrange(5, 40))]
        d.add(make_request(f"r{i}", prompt, 120, block_size=BS))
    records = []
    while d.scheduler.has_unfinished_requests():
        records.append(d.step())
        if cls is not Scheduler:
            d.scheduler.kv_cache_manager.manager.check_invariants()
        assert len(records) < 3000, "the run did not finish"
    return d, records


@pytest.mark.parametrize("k", [3, 5])
@pytest.mark.parametrize("paged_cls", [PagedKVScheduler, PerRequestPagedKVScheduler])
def test_plain_decodes_between_verify_steps_match_stock(k: int, paged_cls: type, monkeypatch: pytest.MonkeyPatch):
    stock, a = _run(Scheduler, k, monkeypatch)
    paged, b = _run(paged_cls, k, monkeypatch)
    for step, (x, y) in enumerate(zip(a, b)):
        assert y == x, f"step {step} differs:\nstock {x}\npaged {y}"
    assert len(a) == len(b)
    plain, _ = _run(Scheduler, 0, monkeypatch)
    assert paged.outputs == plain.outputs == stock.outputs
    # Both kinds of step happened: verify steps with rejections, and plain decodes.
    assert 0 < paged.drafts_accepted < paged.drafts_scheduled
    plain_decodes = sum(1 for r in b for n in r["scheduled"].values() if n == 1)
    assert plain_decodes > 100
    kvm = paged.scheduler.kv_cache_manager.manager
    kvm.check_invariants()
    assert kvm.num_sequences == 0 and kvm.stats().used == 0
