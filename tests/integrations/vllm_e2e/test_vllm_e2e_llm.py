"""``vllm.LLM`` on a real model, stock vs ``PagedKVScheduler``: the same scenarios on both, the
results compared request by request.

One engine of each is built for the module (vLLM's default multiprocess engine core, as users
run it), stock first; it runs every scenario, is shut down, and only then is the plug-in's built
(one vLLM engine alive at a time: about 6.5 GB each). The KV pool is fixed at
``NUM_BLOCKS`` blocks of ``BLOCK_SIZE`` tokens so that one scenario (and only that one) runs out
of blocks and preempts. Each scenario starts from an empty prefix cache (``reset_prefix_cache``),
so which cached block either scheduler would evict first (the known difference) never decides a
hit. Scenarios: greedy chat (12 prompts, token-identical, and the text makes sense), prefix hits
on a batch sharing a system prompt, parallel sampling (``n=3``, seeded), aborted running
requests, ``reset_prefix_cache``, and preemption (equal outputs and preemption counts). After
each, the KV cache usage vLLM reports is 0: nothing leaked.
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
    metric_value,
    outputs_data,
    shut_down,
    skip_unless_vllm_runs_models,
    vllm_children,
)

skip_unless_vllm_runs_models()

from vllm import LLM, SamplingParams  # noqa: E402

from pagedkv.integrations.vllm import PagedKVScheduler  # noqa: E402

#: Questions with one right answer a 135M chat model gets, and a word its answer must hold.
FACTS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What color is the sky on a clear day?", "blue"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
]
#: Open prompts: the answer must be English prose (checked loosely, see _looks_like_english).
OPEN = [
    "Write a haiku about the sea.",
    "Give me three tips for staying focused while studying.",
    "Explain what a computer is to a child.",
    "Describe a sunset in two sentences.",
    "What are the benefits of drinking water?",
    "Tell me a short story about a cat.",
    "Why do leaves change color in autumn?",
]
#: A shared system prompt longer than three blocks of 128 tokens once templated.
SYSTEM = "You are a patient and precise assistant for a public library. " + " ".join(
    f"Rule {i}: answer politely, cite the shelf where a book on the topic can be found, "
    f"and keep every answer short and friendly."
    for i in range(1, 21)
)
TOPICS = ["astronomy", "gardening", "cooking", "chess", "history of Rome", "sailing"]


def _looks_like_english(text: str) -> bool:
    """At least five words, mostly letters: not empty, not a special token, not byte noise."""
    words = text.split()
    letters = sum(ch.isalpha() or ch.isspace() for ch in text)
    return len(words) >= 5 and letters >= 0.8 * len(text) and "<|" not in text


def _scenarios(llm: LLM) -> dict[str, Any]:
    """Runs every scenario on ``llm`` in a fixed order; returns their plain-data results."""
    out: dict[str, Any] = {}
    greedy = SamplingParams(temperature=0.0, max_tokens=40)

    def usage() -> float:
        return metric_value(llm, "vllm:kv_cache_usage_perc")

    def fresh() -> None:
        assert llm.reset_prefix_cache() is True  # nothing running: the reset is done

    fresh()
    prompts = [chat(q) for q, _ in FACTS] + [chat(p) for p in OPEN]
    out["greedy"] = outputs_data(llm.chat(prompts, greedy, use_tqdm=False))
    out["greedy_usage"] = usage()

    fresh()
    first = outputs_data(llm.chat([chat("Which shelf has books on painting?", SYSTEM)], greedy, use_tqdm=False))
    batch = outputs_data(
        llm.chat([chat(f"Which shelf has books on {t}?", SYSTEM) for t in TOPICS], greedy, use_tqdm=False)
    )
    out["prefix"] = {"first": first, "batch": batch, "usage": usage()}

    fresh()
    sampled = SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=1234, max_tokens=32)
    out["parallel"] = outputs_data(llm.chat([chat(OPEN[0]), chat(OPEN[5])], sampled, use_tqdm=False))
    out["parallel_usage"] = usage()

    fresh()
    out["abort"] = _abort_scenario(llm, usage)

    fresh()
    prompt = chat("Name three famous painters and one painting by each.", SYSTEM)
    runs = [outputs_data(llm.chat([prompt], greedy, use_tqdm=False))[0]]
    runs.append(outputs_data(llm.chat([prompt], greedy, use_tqdm=False))[0])
    reset_idle = llm.reset_prefix_cache()
    runs.append(outputs_data(llm.chat([prompt], greedy, use_tqdm=False))[0])
    out["reset"] = {"runs": runs, "reset_idle": reset_idle}

    fresh()
    before = metric_value(llm, "vllm:num_preemptions")
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    stories = [chat(f"Write a long story about {t}, with many characters and places.") for t in TOPICS]
    started = time.monotonic()
    out["preempt"] = outputs_data(llm.chat(stories, long, use_tqdm=False))
    out["preempt_s"] = time.monotonic() - started
    out["preemptions"] = metric_value(llm, "vllm:num_preemptions") - before
    out["preempt_usage"] = usage()
    return out


def _abort_scenario(llm: LLM, usage: Any) -> dict[str, Any]:
    """Two long requests (the shared system prompt, then each its own question) run until each
    holds at least 8 output tokens (and so its KV blocks), then both are aborted; their prompts
    are sent again: the blocks the aborted requests computed stay cached."""
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    ids = []
    for topic in ("rivers", "mountains"):
        x = tok.apply_chat_template(
            chat(f"Write a long essay about {topic}.", SYSTEM), add_generation_prompt=True, tokenize=True
        )
        ids.append(list(x["input_ids"]) if hasattr(x, "keys") else list(x))  # a BatchEncoding or ids
    long = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for i, prompt_ids in enumerate(ids):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": prompt_ids}, long)
    seen: dict[str, list[int]] = {}
    deadline = time.monotonic() + 120
    while min(len(seen.get(f"abort-{i}", [])) for i in range(2)) < 8:
        assert time.monotonic() < deadline, "the requests to abort produced no tokens"
        for r in engine.step():
            seen[r.request_id] = list(r.outputs[0].token_ids)
    engine.abort_request(["abort-0", "abort-1"])
    while engine.has_unfinished_requests():
        engine.step()
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    after = outputs_data(llm.generate([{"prompt_token_ids": x} for x in ids], greedy, use_tqdm=False))
    return {"aborted": [seen["abort-0"], seen["abort-1"]], "after": after, "usage": usage()}


def _run(model_dir: Path, **extra: Any) -> dict[str, Any]:
    """Builds one engine, runs the scenarios, shuts it down (and checks it is gone)."""
    started = time.monotonic()
    llm = LLM(model=str(model_dir), **ENGINE_ARGS, **extra)
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


@pytest.fixture(scope="module")
def runs(model_dir: Path) -> Iterator[dict[str, dict[str, Any]]]:
    """``{"stock": results, "pagedkv": results}``, built one after the other."""
    started = time.monotonic()
    stock = _run(model_dir)
    pagedkv = _run(model_dir, scheduler_cls=PagedKVScheduler)
    print(
        f"\nvLLM e2e (LLM): stock ready in {stock['ready_s']:.0f} s, pagedkv in {pagedkv['ready_s']:.0f} s; "
        f"both engines with their scenarios {time.monotonic() - started:.0f} s; preemptions "
        f"{stock['preemptions']:.0f} / {pagedkv['preemptions']:.0f}, prefix hits of the batch "
        f"{[r['num_cached_tokens'] for r in pagedkv['prefix']['batch']]}"
    )
    yield {"stock": stock, "pagedkv": pagedkv}


def test_greedy_chat_is_token_identical_and_makes_sense(runs: dict[str, dict[str, Any]]):
    stock, plug = runs["stock"]["greedy"], runs["pagedkv"]["greedy"]
    assert len(plug) == len(FACTS) + len(OPEN) >= 10
    assert [r["samples"] for r in plug] == [r["samples"] for r in stock]
    for (question, answer), r in zip(FACTS, plug):
        text = r["samples"][0][1]
        assert answer.lower() in text.lower(), (question, text)
    for prompt, r in zip(OPEN, plug[len(FACTS) :]):
        assert _looks_like_english(r["samples"][0][1]), (prompt, r["samples"][0][1])
    assert all(r["num_cached_tokens"] == 0 for r in plug)  # distinct prompts, empty cache
    assert runs["stock"]["greedy_usage"] == runs["pagedkv"]["greedy_usage"] == 0


def test_batch_sharing_a_system_prompt_gets_equal_prefix_hits(runs: dict[str, dict[str, Any]]):
    stock, plug = runs["stock"]["prefix"], runs["pagedkv"]["prefix"]
    assert plug == stock
    assert plug["first"][0]["num_cached_tokens"] == 0
    # The system prompt fills at least three blocks; every later request hits them all.
    assert plug["batch"][0]["num_prompt_tokens"] > 3 * BLOCK_SIZE
    for r in plug["batch"]:
        assert r["num_cached_tokens"] >= 3 * BLOCK_SIZE and r["num_cached_tokens"] % BLOCK_SIZE == 0
        assert r["num_cached_tokens"] < r["num_prompt_tokens"]
    for topic, r in zip(TOPICS, plug["batch"]):
        assert _looks_like_english(r["samples"][0][1]), (topic, r["samples"][0][1])
    assert plug["usage"] == 0


def test_parallel_sampling_n3_matches(runs: dict[str, dict[str, Any]]):
    stock, plug = runs["stock"]["parallel"], runs["pagedkv"]["parallel"]
    assert plug == stock
    for r in plug:
        texts = [s[1] for s in r["samples"]]
        assert len(texts) == 3 and len(set(texts)) == 3, texts  # three seeded, distinct samples
        assert all(_looks_like_english(t) for t in texts), texts
    assert runs["pagedkv"]["parallel_usage"] == 0


def test_aborted_requests_free_their_blocks_and_leave_their_prompt_cached(runs: dict[str, dict[str, Any]]):
    stock, plug = runs["stock"]["abort"], runs["pagedkv"]["abort"]
    for a, b in zip(stock["aborted"], plug["aborted"]):
        n = min(len(a), len(b))
        assert n >= 8 and a[:n] == b[:n]  # when the abort lands differs; the tokens before it do not
    assert all(len(t) < 1000 for t in plug["aborted"])
    assert [r["samples"] for r in plug["after"]] == [r["samples"] for r in stock["after"]]
    cached = [r["num_cached_tokens"] for r in plug["after"]]
    assert cached == [r["num_cached_tokens"] for r in stock["after"]]
    for r in plug["after"]:  # every full prompt block of the aborted requests stayed cached
        assert r["num_cached_tokens"] == (r["num_prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
        assert _looks_like_english(r["samples"][0][1])
    assert plug["usage"] == stock["usage"] == 0  # the aborted requests' blocks were freed


def test_reset_prefix_cache_forgets_the_cached_prompt(runs: dict[str, dict[str, Any]]):
    stock, plug = runs["stock"]["reset"], runs["pagedkv"]["reset"]
    assert plug == stock
    first, again, after_reset = plug["runs"]
    assert plug["reset_idle"] is True
    assert first["num_cached_tokens"] == 0
    assert again["num_cached_tokens"] == (again["num_prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    assert after_reset["num_cached_tokens"] == 0
    assert first["samples"] == again["samples"] == after_reset["samples"]
    assert _looks_like_english(first["samples"][0][1])


def test_a_small_pool_preempts_equally_with_equaloutputs_data(runs: dict[str, dict[str, Any]]):
    stock, plug = runs["stock"], runs["pagedkv"]
    need = sum(-(-(r["num_prompt_tokens"] + 400) // BLOCK_SIZE) for r in plug["preempt"])
    assert need > NUM_BLOCKS  # the scenario cannot fit without preempting
    assert plug["preemptions"] == stock["preemptions"] > 0
    assert [r["samples"] for r in plug["preempt"]] == [r["samples"] for r in stock["preempt"]]
    for r in plug["preempt"]:
        tokens, text, reason = r["samples"][0]
        assert len(tokens) == 400 and reason == "length"
        assert _looks_like_english(text[:300]), text[:300]
    assert plug["preempt_usage"] == stock["preempt_usage"] == 0
    print(f"\npreemption scenario: stock {stock['preempt_s']:.1f} s, pagedkv {plug['preempt_s']:.1f} s")
