"""The engine on the real default model, SmolLM2-135M-Instruct (fp32, CPU), against
transformers' own ``generate`` on the same weights. Marked ``slow`` (minutes on 2 cores)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.engine import assert_no_leak, hf_greedy

from pagedkv.engine import LLMEngine, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first humans to walk on the Moon were",
    "A good recipe for pancakes needs flour, eggs and",
    "The quick brown fox",
]
MAX_NEW = 32


def _cut(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module")
def prompt_ids(smol) -> list[list[int]]:
    return [list(smol.tokenizer(p)["input_ids"]) for p in PROMPTS]


@pytest.fixture(scope="module")
def refs(smol, prompt_ids) -> list[list[int]]:
    return [_cut(hf_greedy(smol, p, MAX_NEW), smol.tokenizer.eos_token_id) for p in prompt_ids]


def test_smoke_capital_of_france(smol):
    engine = LLMEngine(smol.hf, tokenizer=smol.tokenizer, num_kv_blocks=64)
    out = engine.generate(["The capital of France is"], SamplingParams(max_tokens=1))[0]
    assert out.text == " Paris"
    assert_no_leak(engine)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # prefix caching on, all in one batch
        dict(enable_prefix_caching=False),
        dict(num_kv_blocks=17, block_size=8),  # 16 usable blocks of 8 -> recompute preemption
        dict(num_kv_blocks=17, block_size=8, preemption="swap"),
        dict(max_tokens_per_step=8, block_size=4),  # chunked prefill
        dict(max_num_seqs=1),  # batch size 1
    ],
    ids=["prefix-on", "prefix-off", "recompute", "swap", "chunked", "batch-1"],
)
def test_greedy_token_identical_to_transformers(smol, prompt_ids, refs, kw):
    kw = {"num_kv_blocks": 256, "block_size": 16, **kw}
    engine = LLMEngine(smol.hf, tokenizer=smol.tokenizer, **kw)
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_NEW))
    assert [list(o.token_ids) for o in outs] == refs
    st = engine.stats()
    if kw["num_kv_blocks"] == 17:
        assert st.preemptions > 0
        if kw.get("preemption") == "swap":
            assert st.swaps_in_blocks > 0
    assert_no_leak(engine)


def test_s10_cached_prompt_gives_identical_tokens(smol, prompt_ids, refs):
    engine = LLMEngine(smol.hf, tokenizer=smol.tokenizer, num_kv_blocks=64, block_size=4)
    p = prompt_ids[1]
    a = engine.generate([p], SamplingParams(max_tokens=MAX_NEW))[0]
    b = engine.generate([p], SamplingParams(max_tokens=MAX_NEW))[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == (len(p) - 1) // 4 * 4 > 0
    assert list(a.token_ids) == list(b.token_ids) == refs[1]
    assert_no_leak(engine)


def test_beam_search_equals_transformers(smol, prompt_ids):
    engine = LLMEngine(smol.hf, tokenizer=smol.tokenizer, num_kv_blocks=256)
    outs = engine.generate(prompt_ids[:3], SamplingParams(max_tokens=16, beam_width=3))
    eos = smol.tokenizer.eos_token_id
    for p, o in zip(prompt_ids[:3], outs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = smol.hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                num_beams=3,
                do_sample=False,
                max_new_tokens=16,
                early_stopping=False,
                pad_token_id=eos,
            )
        assert list(o.token_ids) == _cut(ref[0, len(p) :].tolist(), eos)
    assert_no_leak(engine)


def test_chat_template_prompt_gives_sensible_answer(smol):
    engine = LLMEngine(smol.hf, tokenizer=smol.tokenizer, num_kv_blocks=128)
    out = engine.generate(["What is the capital of France?"], SamplingParams(max_tokens=24), chat_template=True)[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("eos", "length")
    assert_no_leak(engine)
