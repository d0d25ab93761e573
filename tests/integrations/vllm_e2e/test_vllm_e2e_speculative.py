"""``vllm.LLM`` with n-gram (prompt lookup) speculative decoding on a real model, stock vs
``PagedKVScheduler`` (issue 25, item 4).

vLLM's CPU build runs n-gram speculation (``speculative_config={"method": "ngram", ...}``: the
proposer is numba on the CPU, the verify step is the model runner's ordinary path; no draft
model). Two engines, stock first, then the plug-in (one alive at a time), each with ``K = 4``
drafts from 3..1-token matches and the same scenarios: greedy chat on prompts that copy text
(so drafts are proposed and some accepted) and plain questions, a repeated long prompt, and
long stories on the small pool (so requests are preempted while they speculate). Compared:
every output token, vLLM's acceptance counters (``vllm:spec_decode_*``), prefix hits,
preemptions, and KV usage back at 0.

Against decoding without speculation: each greedy output is fed back as a prompt with
``prompt_logprobs``, and every output token must be the model's top-1 choice at its position
(what decoding without drafts emits), in the same engine rather than a third model load. The
engines run in float32 so that this check does not hinge on bfloat16 rounding of near ties.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm-e2e runs this suite)")

from e2e_helpers import (  # noqa: E402
    BLOCK_SIZE,
    ENGINE_ARGS,
    NUM_BLOCKS,
    chat,
    counts_since,
    metric_value,
    outputs_data,
    shut_down,
    skip_unless_vllm_runs_models,
    spec_decode_counts,
    vllm_children,
)

skip_unless_vllm_runs_models()

from vllm import LLM, SamplingParams  # noqa: E402

from pagedkv.integrations.vllm import PagedKVScheduler  # noqa: E402

#: Drafts per verify step.
K = 4
SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ARGS = {**ENGINE_ARGS, "dtype": "float32"}

FRUIT = "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango"
#: Prompts whose answers repeat their own text (n-gram drafts get accepted), then questions.
PROMPTS = [
    f"Repeat this list three times: {FRUIT}",
    "Copy this sentence exactly twice: The quick brown fox jumps over the lazy dog near the river bank.",
    "Write the numbers from 1 to 40, separated by commas.",
    "Repeat this code: def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b",
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
]
#: A system prompt of several blocks, for the repeated request.
SYSTEM = "You are a careful assistant. " + " ".join(
    f"Rule {i}: quote the user's words exactly when asked to repeat them." for i in range(1, 40)
)
#: Eight long stories on the 20-block pool: each holds 3 blocks by its 300th token, before any
#: can finish (400 tokens), so some are preempted however unevenly speculation speeds them up.
TOPICS = ["astronomy", "gardening", "cooking", "chess", "history of Rome", "sailing", "volcanoes", "trains"]


def _scenarios(llm: LLM) -> dict[str, Any]:
    out: dict[str, Any] = {}
    greedy = SamplingParams(temperature=0.0, max_tokens=96)

    def usage() -> float:
        return metric_value(llm, "vllm:kv_cache_usage_perc")

    def fresh() -> None:
        assert llm.reset_prefix_cache() is True

    fresh()
    c0 = spec_decode_counts(llm)
    results = llm.chat([chat(p) for p in PROMPTS], greedy, use_tqdm=False)
    out["greedy"] = outputs_data(results)
    out["greedy_counts"] = counts_since(c0, spec_decode_counts(llm))
    out["greedy_usage"] = usage()
    # Teacher-forced: each output as a prompt; the rank of every output token at its position.
    forced = llm.generate(
        [{"prompt_token_ids": list(r.prompt_token_ids) + list(r.outputs[0].token_ids)} for r in results],
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    out["ranks"] = [
        [f.prompt_logprobs[len(r.prompt_token_ids) + i][t].rank for i, t in enumerate(r.outputs[0].token_ids)]
        for r, f in zip(results, forced)
    ]

    fresh()
    prompt = chat("Repeat exactly: " + FRUIT, SYSTEM)
    runs = [outputs_data(llm.chat([prompt], greedy, use_tqdm=False))[0] for _ in range(2)]
    out["repeat"] = {"runs": runs, "usage": usage()}

    fresh()
    before, c0 = metric_value(llm, "vllm:num_preemptions"), spec_decode_counts(llm)
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    stories = [chat(f"Write a long story about {t}, with many characters and places.") for t in TOPICS]
    started = time.monotonic()
    out["preempt"] = outputs_data(llm.chat(stories, long, use_tqdm=False))
    out["preempt_s"] = time.monotonic() - started
    out["preemptions"] = metric_value(llm, "vllm:num_preemptions") - before
    out["preempt_counts"] = counts_since(c0, spec_decode_counts(llm))
    out["preempt_usage"] = usage()
    return out


def _run(model_dir: Path, **extra: Any) -> dict[str, Any]:
    """Builds one engine with n-gram speculation, runs the scenarios, shuts it down."""
    started = time.monotonic()
    llm = LLM(model=str(model_dir), **ARGS, speculative_config=SPECULATIVE_CONFIG, **extra)
    ready_s = time.monotonic() - started
    try:
        results = _scenarios(llm)
    finally:
        shut_down(llm)
        del llm
        gc.collect()
    assert vllm_children() == [], "an engine process outlived its LLM"
    results["ready_s"] = ready_s
    return results


def _rate(c: dict[str, Any]) -> str:
    return (
        f"{c['accepted']:.0f} of {c['draft_tokens']:.0f} draft tokens accepted "
        f"({c['accepted'] / max(c['draft_tokens'], 1):.1%}) over {c['drafts']:.0f} verifies, "
        f"per position {[int(x) for x in c['accepted_per_position']]}"
    )


@pytest.fixture(scope="module")
def runs(model_dir: Path) -> Iterator[dict[str, dict[str, Any]]]:
    """``{"stock": results, "pagedkv": results}``, built one after the other."""
    started = time.monotonic()
    stock = _run(model_dir)
    pagedkv = _run(model_dir, scheduler_cls=PagedKVScheduler)
    print(
        f"\nvLLM e2e (n-gram speculation, K={K}): stock ready in {stock['ready_s']:.0f} s, pagedkv in "
        f"{pagedkv['ready_s']:.0f} s; both engines with their scenarios {time.monotonic() - started:.0f} s\n"
        f"greedy chat: {_rate(pagedkv['greedy_counts'])}\n"
        f"preemption: {_rate(pagedkv['preempt_counts'])}; {pagedkv['preemptions']:.0f} preemptions, "
        f"stock {stock['preempt_s']:.1f} s, pagedkv {pagedkv['preempt_s']:.1f} s"
    )
    yield {"stock": stock, "pagedkv": pagedkv}


def test_greedy_outputs_and_acceptance_are_identical(runs: dict[str, dict[str, Any]]):
    stock, plug = runs["stock"], runs["pagedkv"]
    assert [r["samples"] for r in plug["greedy"]] == [r["samples"] for r in stock["greedy"]]
    assert plug["greedy_counts"] == stock["greedy_counts"]
    c = plug["greedy_counts"]
    # Drafts were proposed, some accepted and some rejected (both paths of the verify step).
    assert 0 < c["accepted"] < c["draft_tokens"] <= K * c["drafts"]
    assert len(c["accepted_per_position"]) == K and sum(c["accepted_per_position"]) == c["accepted"]
    assert "Paris" in plug["greedy"][4]["samples"][0][1]
    assert plug["greedy_usage"] == stock["greedy_usage"] == 0


def test_outputs_equal_decoding_without_speculation(runs: dict[str, dict[str, Any]]):
    for name in ("stock", "pagedkv"):
        ranks = runs[name]["ranks"]
        assert [len(r) for r in ranks] == [len(r["samples"][0][0]) for r in runs[name]["greedy"]]
        for prompt, r in zip(PROMPTS, ranks):
            wrong = [i for i, rank in enumerate(r) if rank != 1]
            assert not wrong, f"{name}: {prompt[:40]!r}: output tokens {wrong} are not the greedy choice"


def test_a_repeated_request_hits_every_full_prompt_block(runs: dict[str, dict[str, Any]]):
    stock, plug = runs["stock"]["repeat"], runs["pagedkv"]["repeat"]
    assert plug == stock
    first, again = plug["runs"]
    assert first["num_cached_tokens"] == 0
    assert first["num_prompt_tokens"] > 3 * BLOCK_SIZE
    assert again["num_cached_tokens"] == (again["num_prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert first["samples"] == again["samples"]
    assert plug["usage"] == 0


def test_preemption_while_speculating_keeps_outputs_and_leaks_nothing(runs: dict[str, dict[str, Any]]):
    stock, plug = runs["stock"], runs["pagedkv"]
    need = sum(-(-(r["num_prompt_tokens"] + 300) // BLOCK_SIZE) for r in plug["preempt"])
    assert need > NUM_BLOCKS  # held at once before any request can finish: it must preempt
    assert plug["preemptions"] == stock["preemptions"] > 0
    assert [r["samples"] for r in plug["preempt"]] == [r["samples"] for r in stock["preempt"]]
    assert plug["preempt_counts"] == stock["preempt_counts"]
    assert plug["preempt_counts"]["accepted"] > 0
    for r in plug["preempt"]:
        tokens, _, reason = r["samples"][0]
        assert len(tokens) == 400 and reason == "length"
    assert plug["preempt_usage"] == stock["preempt_usage"] == 0
