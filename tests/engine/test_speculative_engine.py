"""Prompt-lookup (n-gram) speculative decoding in the engine, on the tiny model: greedy outputs
identical to plain decoding under every scheduling regime (prefix caching, chunked prefill,
preemption by recompute and swap under a small pool), max_tokens / stop string / EOS cut
points, the prefix cache after verify steps, acceptance counters, the proposer, the CLI and bad
configuration."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.engine import assert_no_leak

from pagedkv.engine import LLMEngine, SamplingParams
from pagedkv.engine.cli import main
from pagedkv.engine.errors import EngineConfigError
from pagedkv.engine.speculative import num_accepted, propose_ngram

MAX_NEW = 40
K = 4


def _prompts() -> list[list[int]]:
    """Repetitive prompts (the tiny model repeats their token, so drafts get accepted: [12]*12
    yields 12s only, [13]*12 a 221/22 cycle), a periodic one, and random ones (drafts mostly
    rejected)."""
    g = torch.Generator().manual_seed(0)
    rand = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 33, 1, 48)]
    return [[12] * 12, [13] * 12, [38] * 12, [5, 6, 7, 8, 9] * 6, *rand]


def _engine(tiny, **kw: Any) -> LLMEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 512)
    return LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, **kw)


def _speculative(tiny, **kw: Any) -> LLMEngine:
    return _engine(tiny, speculative="ngram", num_speculative_tokens=K, **kw)


@pytest.fixture(scope="module")
def plain(tiny) -> list[list[int]]:
    """Plain greedy decoding of the prompts (no speculation)."""
    return [list(o.token_ids) for o in _engine(tiny).generate(_prompts(), SamplingParams(max_tokens=MAX_NEW))]


REGIMES = {
    "prefix-caching-on": (dict(), lambda st: True),
    "prefix-caching-off": (dict(enable_prefix_caching=False), lambda st: st.prefix_hits_tokens == 0),
    "recompute-preemption": (dict(num_kv_blocks=40), lambda st: st.preemptions > 0),
    "swap-preemption": (dict(num_kv_blocks=40, preemption="swap"), lambda st: st.swaps_out_blocks > 0),
    "chunked-prefill": (dict(max_tokens_per_step=16), lambda st: True),
    "block-size-16": (dict(block_size=16, num_kv_blocks=64), lambda st: True),
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_outputs_identical_to_plain_decoding(tiny, plain, regime):
    kw, proof = REGIMES[regime]
    engine = _speculative(tiny, **kw)
    outs = engine.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW))
    assert [list(o.token_ids) for o in outs] == plain
    m = engine.metrics()
    assert m.spec_accepted_tokens > 0, m
    assert proof(engine.stats()), engine.stats()
    engine.manager.check_invariants()
    assert_no_leak(engine)


def test_drafts_are_dropped_before_anyone_is_preempted(tiny, plain):
    # Small pool: when a step's drafts do not fit, the scheduler retries without drafts before it
    # preempts a request for their blocks.
    engine = _speculative(tiny, num_kv_blocks=40)
    manager, events = engine.manager, []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(manager, name)

        def step(self, *a: Any, **kw: Any) -> Any:
            out = manager.step(*a, **kw)
            events.append(("step", kw.get("draft_token_ids") is not None, out.error is not None))
            return out

        def preempt(self, ids: Any) -> None:
            events.append(("preempt", False, False))
            manager.preempt(ids)

    engine.scheduler.manager = Spy()  # type: ignore[assignment]
    outs = engine.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW))
    assert [list(o.token_ids) for o in outs] == plain
    failed_with_drafts = [i for i, e in enumerate(events) if e == ("step", True, True)]
    assert failed_with_drafts, "the pool never ran dry on a verify step"
    assert all(events[i + 1][:2] == ("step", False) for i in failed_with_drafts), events
    assert any(e[0] == "preempt" for e in events)
    assert_no_leak(engine)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 6, 9])
def test_max_tokens_cuts_exactly(tiny, max_tokens):
    prompts = [[12] * 12, [13] * 12]
    params = SamplingParams(max_tokens=max_tokens)
    want = [list(o.token_ids) for o in _engine(tiny).generate(prompts, params)]
    engine = _speculative(tiny)
    outs = engine.generate(prompts, params)
    assert [list(o.token_ids) for o in outs] == want
    assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in outs)
    assert_no_leak(engine)


@pytest.mark.parametrize("stop", ["w235", "w22 w221", "w12 w12 w12"])
def test_stop_strings_cut_exactly(tiny, stop):
    # [13]*12 decodes 221 x7, 235, 221, 22, 221, 22...: each stop ends inside accepted drafts or at
    # a bonus token; the outputs (tokens, text, reason) must equal plain decoding's.
    prompts = [[13] * 12, [12] * 12]
    params = SamplingParams(max_tokens=MAX_NEW, stop=(stop,))
    want = _engine(tiny).generate(prompts, params)
    engine = _speculative(tiny)
    outs = engine.generate(prompts, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == [
        (o.token_ids, o.text, o.finish_reason) for o in want
    ]
    assert any(o.finish_reason == "stop" for o in outs)
    assert engine.metrics().spec_accepted_tokens > 0
    assert_no_leak(engine)


def test_eos_cuts_exactly(tiny):
    # Random prompts of which some end on EOS (token 1) within 64 tokens.
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 33, 1, 64, 100, 16, 48)]
    params = SamplingParams(max_tokens=64)
    want = _engine(tiny).generate(prompts, params)
    outs = _speculative(tiny).generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(o.token_ids, o.finish_reason) for o in want]
    assert any(o.finish_reason == "eos" for o in want)


def test_prefix_cache_after_verify_steps_hits_as_without_speculation(tiny):
    # A second turn whose prompt is the first turn's prompt + output hits the blocks filled by
    # accepted drafts exactly as it hits those filled by plain decode steps.
    def two_turns(engine: LLMEngine) -> tuple[list[int], int]:
        first = engine.generate([[12] * 12], SamplingParams(max_tokens=30))[0]
        second = engine.generate([[12] * 12 + list(first.token_ids)], SamplingParams(max_tokens=8))[0]
        return list(first.token_ids) + list(second.token_ids), second.num_cached_tokens

    want, want_hit = two_turns(_engine(tiny))
    engine = _speculative(tiny)
    got, hit = two_turns(engine)
    assert got == want and hit == want_hit
    assert hit >= 36, hit  # 41 prompt tokens: the whole blocks before the last token
    assert engine.metrics().spec_accepted_tokens > 0
    assert_no_leak(engine)


def test_acceptance_counters_in_metrics(tiny):
    engine = _speculative(tiny)
    out = engine.generate([[12] * 12], SamplingParams(max_tokens=MAX_NEW))[0]
    m = engine.metrics()
    # [12]*12 decodes 12s only: after the first token every draft is accepted.
    assert m.spec_draft_tokens > 0 and m.spec_accepted_tokens == m.spec_draft_tokens
    assert m.spec_acceptance_rate == 1.0
    assert m.spec_tokens_per_verify == pytest.approx(1 + m.spec_accepted_tokens / m.spec_verifies)
    # One prefill step, then verify steps of K drafts each emit K + 1 tokens.
    assert m.num_steps == 1 + -(-(MAX_NEW - 1) // (K + 1)), m.num_steps
    assert len(out.token_ids) == MAX_NEW
    assert "speculative drafts: accepted / proposed" in dict(m.table_rows())
    off = _engine(tiny)
    off.generate([[12] * 12], SamplingParams(max_tokens=MAX_NEW))
    mo = off.metrics()
    assert (mo.spec_verifies, mo.spec_draft_tokens, mo.spec_acceptance_rate) == (0, 0, 0.0)
    assert mo.num_steps == MAX_NEW


def test_random_sampling_falls_back_to_plain_decoding(tiny):
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=3)
    want = _engine(tiny).generate([[12] * 12], params)[0]
    engine = _speculative(tiny)
    got = engine.generate([[12] * 12], params)[0]
    assert got.token_ids == want.token_ids
    assert engine.metrics().spec_verifies == 0


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(speculative="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(speculative="ngram", num_speculative_tokens=-1), "num_speculative_tokens"),
        (dict(speculative="ngram", num_speculative_tokens=True), "num_speculative_tokens"),
        (dict(speculative="ngram", num_speculative_tokens=2.0), "num_speculative_tokens"),
        (dict(speculative="eagle"), "speculative='eagle'"),
        (dict(num_speculative_tokens=3), "unless speculative is set"),
    ],
)
def test_bad_speculative_config_is_a_typed_error(tiny, kw, needle):
    with pytest.raises(EngineConfigError, match=needle) as info:
        _engine(tiny, **kw)
    assert isinstance(info.value, ValueError)


def test_propose_ngram_longest_suffix_most_recent_occurrence():
    # The 3-gram (1, 2, 3) occurred at 0 and 5: the most recent (5) wins; its continuation is 9, 1.
    assert propose_ngram([1, 2, 3, 4, 0, 1, 2, 3, 9, 1, 2, 3], 4) == [9, 1, 2, 3]
    assert propose_ngram([1, 2, 3, 4, 0, 1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    # No 3-gram or 2-gram match: the 1-gram (7) matches at 1.
    assert propose_ngram([5, 7, 8, 6, 7], 3) == [8, 6, 7]
    assert propose_ngram([5, 6, 7], 3) == []
    # A match followed by k tokens wins over a more recent one too close to the end.
    assert propose_ngram([4, 4, 4, 4, 4, 4, 4], 3) == [4, 4, 4]
    assert propose_ngram([1, 2, 8, 9, 5, 1, 2, 7, 1, 2], 4) == [8, 9, 5, 1]
    # Every match too close to the end: the earliest, with the longest continuation.
    assert propose_ngram([4, 4, 4, 4], 3) == [4]
    assert propose_ngram([3, 3, 3, 3, 3], 3) == [3, 3]
    assert propose_ngram([4, 4], 0) == [] and propose_ngram([4], 3) == []


def test_num_accepted_is_the_matching_prefix():
    assert num_accepted([1, 2, 3], [1, 2, 3, 4]) == 3
    assert num_accepted([1, 2, 3], [1, 5, 3, 4]) == 1
    assert num_accepted([1], [2, 1]) == 0
    assert num_accepted([], [7]) == 0


def test_cli_speculative_run_and_refusals(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the stats table on one line per row
    f = tmp_path / "p.txt"
    f.write_text(" ".join(["w12"] * 12) + "\n")
    base = ["--model", str(tiny.path), "--prompts", str(f), "--no-progress", "--no-chat-template", "--max-tokens", "9"]
    assert main([*base, "--speculative", "ngram", "--num-speculative-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding" in out and "accepted / proposed" in out
    assert main([*base, "--speculative", "ngram", "--temperature", "0.7"]) == 2
    assert "greedy decoding only" in capsys.readouterr().err
    assert main([*base, "--num-speculative-tokens", "2"]) == 2
    assert "needs --speculative ngram" in capsys.readouterr().err
