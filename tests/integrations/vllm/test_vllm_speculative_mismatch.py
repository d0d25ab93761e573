"""A verify step whose accepted tokens are not the proposed drafts, through vLLM's real Scheduler.

vLLM counts a verify step's accepted drafts from the length of what the model runner returns
and appends the returned tokens, whatever the drafts were; a model runner or drafter that does
not verify (vLLM's own randomized ``test_priority_scheduling_blast`` with speculation does this)
hands it tokens other than the drafts the KV was computed for, or more tokens than drafts (vLLM
then counts positions as computed that the step never wrote). Stock vLLM carries on (and caches
that KV under the returned tokens' hashes). The plug-in raised ``VllmStateMismatchError`` at the
request's next allocation, killing the engine core. Now it carries on as stock, logs a warning
with counts, and keeps the KV honest: pagedkv's sequence keeps the drafts' ids at those
positions, and a token id no vLLM token has at unwritten ones, so a block is cached and
announced only under the tokens its KV was computed for; a preempted request in that state is
forgotten and re-registered from vLLM's tokens on resume (its recomputed KV is vLLM's tokens').

Runs only where vLLM is installed (``make test-vllm``).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402

from pagedkv.integrations.vllm import PagedKVScheduler  # noqa: E402
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
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


def _scheduler(cls: type, groups: Any) -> Any:
    base = make_vllm_config(num_blocks=64, kv_events=True)
    cfg = make_vllm_config(num_blocks=64, kv_events=True, speculative_config=ngram_speculative_config(base, 2))
    kv = make_kv_cache_config(64, BS) if groups is None else make_hybrid_kv_cache_config(64, groups, BS)
    sched = build_scheduler(cls, cfg, kv_cache_config=kv)
    # The token ids of every block announced (BlockStored) as the scheduler publishes them.
    sched.announced = []
    take = sched.kv_cache_manager.take_events

    def recording_take_events() -> list[Any]:
        events = take()
        sched.announced.extend(list(e.token_ids) for e in events if type(e).__name__ == "BlockStored")
        return events

    sched.kv_cache_manager.take_events = recording_take_events
    return sched


def _step(sched: Any, sampled: list[int], drafts: list[int] | None = None) -> Any:
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["r"], {"r": 0}, sampled_token_ids=[sampled]))
    if drafts is not None:
        sched.update_draft_token_ids(DraftTokenIds(["r"], [drafts]))
    return out


_PROBES = iter(range(10**6))


def _hit(sched: Any, tokens: list[int]) -> int:
    """The prefix hit of a new request of ``tokens`` (looked up, then dropped)."""
    from vllm.v1.request import RequestStatus

    probe = make_request(f"probe{next(_PROBES)}", tokens + [9] * BS, 1, block_size=BS)
    hit = int(sched.kv_cache_manager.get_computed_blocks(probe)[1])
    probe.status = RequestStatus.FINISHED_ABORTED
    sched.kv_cache_manager.free(probe)
    return hit


@pytest.mark.parametrize("groups", [None, FULL_AND_WINDOW], ids=["one-group", "full+window"])
@pytest.mark.parametrize("cls", [PagedKVScheduler, PerRequestPagedKVScheduler])
def test_accepted_tokens_other_than_the_drafts_are_served_and_never_cached_as_theirs(
    cls: type, groups: Any, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = list(range(300, 314))  # 14 tokens: the first sample at 14, drafts at 15 and 16
    runs = {}
    for sched_cls in (Scheduler, cls):
        sched = _scheduler(sched_cls, groups)
        req = make_request("r", prompt, 30, block_size=BS)
        sched.add_request(req)
        _step(sched, [7], drafts=[51, 52])
        # The runner "accepts" one draft but returns 99 for it (then 100): vLLM counts one
        # accepted, rolls the other back and appends 99, 100. Position 15's KV is draft 51's.
        with caplog.at_level(logging.WARNING, logger="pagedkv.integrations.vllm"):
            out = _step(sched, [99, 100])
        assert out.scheduled_spec_decode_tokens["r"] == [51, 52]
        assert req.num_computed_tokens == 16 and list(req.all_token_ids[14:]) == [7, 99, 100]
        for t in range(101, 104):  # decodes go on as stock (the plug-in raised here before)
            _step(sched, [t])
        runs[sched_cls] = sched, req
    (stock, stock_req), (paged, req) = runs[Scheduler], runs[cls]
    assert list(req.all_token_ids) == list(stock_req.all_token_ids)
    assert paged.kv_cache_manager.get_block_ids("r") == stock.kv_cache_manager.get_block_ids("r")
    mgr = paged.kv_cache_manager
    assert (mgr.num_draft_mismatches, mgr.num_mismatched_draft_tokens) == (1, 1)
    warnings = [r.getMessage() for r in caplog.records if r.name == "pagedkv.integrations.vllm"]
    assert len(warnings) == 1, warnings
    assert "position 15 accepted 1 token(s) for 2 draft(s): 1 differ from their draft" in warnings[0]
    assert "tokens [99] vs drafts [51]), 0 have none" in warnings[0]
    # Block 0 (positions 0..15) holds the KV of the prompt, 7 and draft 51: cached and announced
    # under those tokens, never under vLLM's 99. Stock caches it under 99.
    real = list(req.all_token_ids[:BS])
    as_computed = prompt + [7, 51]
    assert _hit(stock, real) == BS
    assert _hit(paged, real) == 0
    assert _hit(paged, as_computed) == BS
    assert real in stock.announced
    assert as_computed in paged.announced and real not in paged.announced
    mgr.manager.check_invariants()

    # Preempted (all running requests, with a prefix-cache reset) and resumed: vLLM recomputes
    # its own tokens, so pagedkv re-registers the request from them; block 0 is then cached
    # under vLLM's tokens (their KV now), never under the drafts'.
    for sched, r in ((stock, stock_req), (paged, req)):
        assert sched.reset_prefix_cache(reset_running_requests=True)
        out = sched.schedule()
        assert "r" in out.scheduled_cached_reqs.resumed_req_ids
        n = out.num_scheduled_tokens["r"]
        assert n == r.num_tokens  # nothing cached: the whole request is recomputed
        sched.update_from_output(out, ModelRunnerOutput(["r"], {"r": 0}, sampled_token_ids=[[104]]))
    assert list(req.all_token_ids) == list(stock_req.all_token_ids)
    assert _hit(paged, real) == _hit(stock, real) == BS
    assert _hit(paged, as_computed) == 0
    while not req.is_finished():
        _step(paged, [200 + req.num_output_tokens])
    assert mgr.usage == 0.0
    kvm = mgr.manager
    kvm.check_invariants()
    assert kvm.num_sequences == 0


@pytest.mark.parametrize("groups", [None, FULL_AND_WINDOW], ids=["one-group", "full+window"])
@pytest.mark.parametrize("cls", [PagedKVScheduler, PerRequestPagedKVScheduler])
def test_more_tokens_accepted_than_drafted_are_served_and_never_cached(
    cls: type, groups: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # One draft, three tokens returned: vLLM counts two accepted (its stats allow up to
    # num_speculative_tokens = 2) and rolls back -1, so it counts position 16 as computed though
    # the step wrote no KV there.
    prompt = list(range(300, 314))
    runs = {}
    for sched_cls in (Scheduler, cls):
        sched = _scheduler(sched_cls, groups)
        req = make_request("r", prompt, 40, block_size=BS)
        sched.add_request(req)
        _step(sched, [7], drafts=[51])
        with caplog.at_level(logging.WARNING, logger="pagedkv.integrations.vllm"):
            _step(sched, [51, 60, 61])
        assert req.num_computed_tokens == 17 and req.num_tokens == 18
        for t in range(101, 117):
            _step(sched, [t])
        runs[sched_cls] = sched, req
    (stock, stock_req), (paged, req) = runs[Scheduler], runs[cls]
    assert list(req.all_token_ids) == list(stock_req.all_token_ids) and req.num_tokens == 34
    assert req.num_computed_tokens == stock_req.num_computed_tokens
    assert paged.kv_cache_manager.get_block_ids("r") == stock.kv_cache_manager.get_block_ids("r")
    mgr = paged.kv_cache_manager
    assert (mgr.num_draft_mismatches, mgr.num_mismatched_draft_tokens) == (1, 1)
    warnings = [r.getMessage() for r in caplog.records if r.name == "pagedkv.integrations.vllm"]
    assert len(warnings) == 1 and "0 differ from their draft" in warnings[0] and "1 have none" in warnings[0]
    real = list(req.all_token_ids[: 2 * BS])
    # Block 0 (the prompt, 7 and the verified draft 51) is honest and hit by both; block 1 holds
    # a position without KV: stock caches it under vLLM's tokens, pagedkv under none.
    assert _hit(stock, real) == 2 * BS
    assert _hit(paged, real) == BS
    mgr.manager.check_invariants()
    while not req.is_finished():
        _step(paged, [200 + req.num_output_tokens])
    assert mgr.usage == 0.0 and mgr.manager.num_sequences == 0


@pytest.mark.parametrize("groups", [None, FULL_AND_WINDOW], ids=["one-group", "full+window"])
@pytest.mark.parametrize("cls", [PagedKVScheduler, PerRequestPagedKVScheduler])
def test_accepted_placeholder_drafts_of_a_padded_step_are_served_and_never_cached(
    cls: type, groups: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # A one-token prompt admitted while another request decodes is padded with two placeholder
    # drafts (-1); a runner that "accepts" both (three tokens back) makes vLLM count positions
    # 1 and 2 as computed, their KV being the placeholders'. The hybrid manager raised
    # VllmStateMismatchError; the one-group one cached that KV under vLLM's tokens.
    runs = {}
    for sched_cls in (Scheduler, cls):
        sched = _scheduler(sched_cls, groups)
        sched.add_request(make_request("a", list(range(300, 320)), 40, block_size=BS))
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput(["a"], {"a": 0}, sampled_token_ids=[[7]]))
        req = make_request("r", [400], 40, block_size=BS)
        sched.add_request(req)
        out = sched.schedule()
        assert out.num_scheduled_tokens["r"] == 3 and out.scheduled_spec_decode_tokens["r"] == [-1, -1]
        with caplog.at_level(logging.WARNING, logger="pagedkv.integrations.vllm"):
            sched.update_from_output(
                out, ModelRunnerOutput(["a", "r"], {"a": 0, "r": 1}, sampled_token_ids=[[8], [500, 501, 502]])
            )
        assert req.num_computed_tokens == 3 and req.num_tokens == 4
        for t in range(20):
            out = sched.schedule()
            ids = list(out.num_scheduled_tokens)
            sched.update_from_output(
                out, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled_token_ids=[[600 + t]] * len(ids))
            )
        runs[sched_cls] = sched, req
    (stock, stock_req), (paged, req) = runs[Scheduler], runs[cls]
    assert list(req.all_token_ids) == list(stock_req.all_token_ids) and req.num_tokens == 24
    assert paged.kv_cache_manager.get_block_ids("r") == stock.kv_cache_manager.get_block_ids("r")
    mgr = paged.kv_cache_manager
    assert (mgr.num_draft_mismatches, mgr.num_mismatched_draft_tokens) == (1, 2)
    warnings = [r.getMessage() for r in caplog.records if r.name == "pagedkv.integrations.vllm"]
    assert len(warnings) == 1 and "accepted 2 token(s) for 2 draft(s): 2 differ" in warnings[0], warnings
    real = list(req.all_token_ids[:BS])
    assert _hit(stock, real) == BS
    assert _hit(paged, real) == 0
    assert real not in paged.announced
    mgr.manager.check_invariants()


@pytest.mark.parametrize("groups", [None, FULL_AND_WINDOW], ids=["one-group", "full+window"])
def test_an_accepted_count_outside_the_drafts_still_raises(groups: Any) -> None:
    # An accepted count outside 0..k is no token mismatch: pagedkv cannot tell which slots
    # vLLM keeps, so it refuses to serve on (as before).
    from pagedkv.integrations.vllm import VllmStateMismatchError

    sched = _scheduler(PagedKVScheduler, groups)
    req = make_request("r", list(range(300, 314)), 30, block_size=BS)
    sched.add_request(req)
    _step(sched, [7], drafts=[51, 52])
    _step(sched, [51, 52, 53])
    req.num_computed_tokens -= 3  # a rollback vLLM never makes: past the first draft
    with pytest.raises(VllmStateMismatchError) as err:
        sched.schedule()
    assert err.value.quantity == "accepted_draft_tokens" and err.value.got == "-1"
