"""pagedkv inside transformers' continuous batching, the way users run it: ``generate_batch``
and the streaming manager, stock transformers vs ``use_pagedkv(model)``, greedy outputs
token-identical, and nothing held by pagedkv afterwards (docs/design.md, "transformers seam").

The tiny random Llama and Gemma 3 (sliding window 8, so every prompt runs past it) run in every
test run; SmolLM2-135M and Gemma 3 270M (window 512) are marked ``slow``. Each scenario is
chosen so the path it names is taken, and the test checks that from pagedkv's own counters:
prefix hits, copy-on-write copies (forks), preemptions.
"""

from __future__ import annotations

import pytest
from helpers.transformers_cb import Run, generate_batch, stream_with_cancel

from pagedkv.integrations.transformers import is_installed

PREAMBLE = "w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22 w23 w24 w25 w26 w27 w28 w29"


def _tiny_prompts(bundle, n: int = 4) -> list[list[int]]:
    """Prompts sharing a 20-token preamble (prefix hits) and running past the tiny Gemma's
    8-token window, plus one short unrelated prompt."""
    tok = bundle.tokenizer
    prompts = [f"{PREAMBLE} w{40 + 3 * i} w{41 + 5 * i} w{42 + 7 * i}" for i in range(n - 1)]
    return [tok(p)["input_ids"] for p in prompts] + [tok("w300 w301 w302")["input_ids"]]


def assert_released(run: Run) -> None:
    """pagedkv holds nothing after the run: no sequence, no block in use, invariants hold."""
    assert run.kv is not None and not is_installed()
    st = run.kv.stats()
    assert st.used == 0, st
    assert st.free == st.num_blocks - 1, st
    assert run.kv.manager.num_sequences == 0
    run.kv.manager.check_invariants()


def assert_same(stock: Run, paged: Run) -> None:
    assert stock.errors == {} and paged.errors == {}
    assert set(paged.tokens) == set(stock.tokens)
    for rid, want in stock.tokens.items():
        assert paged.tokens[rid] == want, rid
    assert all(len(t) > 0 for t in stock.tokens.values())


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gemma"])
def test_generate_batch_token_identical_with_prefix_hits(model, request):
    bundle = request.getfixturevalue(model)
    prompts = _tiny_prompts(bundle)
    stock = generate_batch(bundle.hf, prompts, pagedkv=False, num_blocks=128)
    paged = generate_batch(bundle.hf, prompts, pagedkv=True, num_blocks=128)
    assert_same(stock, paged)
    assert paged.kv.stats().prefix_hits_tokens > 0
    assert paged.kv.manager.num_groups == (2 if model == "tiny_gemma" else 1)
    assert_released(paged)
    # The stock path after uninstalling: transformers' own cache again, same outputs.
    again = generate_batch(bundle.hf, prompts, pagedkv=False, num_blocks=128)
    assert again.tokens == stock.tokens


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gemma"])
def test_forks_for_num_return_sequences_copy_on_write(model, request):
    bundle = request.getfixturevalue(model)
    prompts = _tiny_prompts(bundle, 3)
    stock = generate_batch(bundle.hf, prompts, pagedkv=False, n=3, num_blocks=128)
    paged = generate_batch(bundle.hf, prompts, pagedkv=True, n=3, num_blocks=128)
    assert len(stock.tokens) == 9
    assert_same(stock, paged)
    assert paged.kv.stats().copies > 0  # a fork wrote into the shared partial block
    assert_released(paged)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gemma"])
def test_cache_too_small_for_the_batch_preempts(model, request):
    bundle = request.getfixturevalue(model)
    prompts = _tiny_prompts(bundle, 6)
    stock = generate_batch(bundle.hf, prompts, pagedkv=False, max_new_tokens=24, num_blocks=24)
    paged = generate_batch(bundle.hf, prompts, pagedkv=True, max_new_tokens=24, num_blocks=24)
    assert_same(stock, paged)
    assert paged.kv.stats().preemptions > 0
    assert_released(paged)


def test_streaming_with_a_request_cancelled_mid_flight(tiny_gemma):
    prompts = _tiny_prompts(tiny_gemma)
    stock = stream_with_cancel(tiny_gemma.hf, prompts, pagedkv=False, cancel_after=3, num_blocks=128)
    paged = stream_with_cancel(tiny_gemma.hf, prompts, pagedkv=True, cancel_after=3, num_blocks=128)
    assert len(stock.tokens["stream0"]) == 3
    assert paged.tokens == stock.tokens
    assert_released(paged)


def test_cache_too_small_for_one_request_fails_it_by_name(tiny_llama):
    prompt = tiny_llama.tokenizer(PREAMBLE)["input_ids"]  # 20 tokens, 5 pages of 4
    paged = generate_batch(tiny_llama.hf, [prompt], pagedkv=True, max_new_tokens=8, num_blocks=5)
    (rid,) = paged.tokens
    msg = paged.errors[rid]
    assert f"request {rid!r} needs" in msg and "the cache has 5 blocks" in msg
    assert_released(paged)


def test_a_request_that_never_fits_fails_alone(tiny_llama):
    """Only the request too large for the whole cache fails, once the others are done; the
    requests that fit are served as by stock transformers (its loop fails every request in
    flight when the cache raises, so pagedkv waits until the oversized one is alone)."""
    tok = tiny_llama.tokenizer
    long = tok(" ".join(f"w{i}" for i in range(10, 60)))["input_ids"]
    short = [tok("w10 w11 w12 w13 w14 w15")["input_ids"], tok("w10 w11 w12 w13 w20")["input_ids"]]
    stock = generate_batch(tiny_llama.hf, [long, *short], pagedkv=False, max_new_tokens=4, num_blocks=6)
    paged = generate_batch(tiny_llama.hf, [long, *short], pagedkv=True, max_new_tokens=4, num_blocks=6)
    assert set(stock.errors) == set(paged.errors) == {"req_0"}
    assert "request 'req_0' needs" in paged.errors["req_0"] and "the cache has 6 blocks" in paged.errors["req_0"]
    served = {rid: toks for rid, toks in stock.tokens.items() if rid != "req_0"}
    assert all(len(toks) == 4 for toks in served.values())
    assert {rid: paged.tokens[rid] for rid in served} == served
    assert_released(paged)


# ------------------------------------------------------------------ real models (slow)


def _smol_prompts(smol) -> list[list[int]]:
    system = "You are a helpful assistant. Answer briefly and precisely, in one sentence. "
    qs = ["What is 2+2?", "Name a colour of the sky.", "Who wrote Hamlet?", "What is the capital of Italy?"]
    return [smol.tokenizer(system + q)["input_ids"] for q in qs] + [
        smol.tokenizer("The capital of France is")["input_ids"]
    ]


@pytest.mark.slow
def test_smollm2_generate_batch_prefix_hits_and_forks(smol):
    prompts = _smol_prompts(smol)
    cb = dict(page_size=8, num_blocks=256, max_new_tokens=16, n=2)
    stock = generate_batch(smol.hf, prompts, pagedkv=False, **cb)
    paged = generate_batch(smol.hf, prompts, pagedkv=True, **cb)
    assert_same(stock, paged)
    st = paged.kv.stats()
    assert st.prefix_hits_tokens > 0 and st.copies > 0
    assert_released(paged)


@pytest.mark.slow
def test_smollm2_small_cache_and_streaming_cancel(smol):
    prompts = _smol_prompts(smol)
    cb = dict(page_size=8, num_blocks=16, max_new_tokens=24)
    stock = generate_batch(smol.hf, prompts, pagedkv=False, **cb)
    paged = generate_batch(smol.hf, prompts, pagedkv=True, **cb)
    assert_same(stock, paged)
    assert paged.kv.stats().preemptions > 0
    assert_released(paged)
    stock = stream_with_cancel(smol.hf, prompts[:3], pagedkv=False, cancel_after=2, page_size=8, num_blocks=64)
    paged = stream_with_cancel(smol.hf, prompts[:3], pagedkv=True, cancel_after=2, page_size=8, num_blocks=64)
    assert paged.tokens == stock.tokens
    assert_released(paged)


def _travel_log(days: int) -> str:
    return " ".join(
        f"Day {d}: we walked to the old harbour, counted {d * 7} boats and wrote the numbers down."
        for d in range(1, days + 1)
    )


@pytest.mark.slow
def test_gemma3_prompts_past_the_sliding_window(gemma):
    window = gemma.hf.config.get_text_config().sliding_window
    doc = _travel_log(30)
    prompts = [gemma.tokenizer(doc + q)["input_ids"] for q in (" Summarise day 3.", " Which day had most boats?")]
    prompts.append(gemma.tokenizer("The capital of France is")["input_ids"])
    assert window == 512 and min(len(p) for p in prompts[:2]) > window + 100
    cb = dict(page_size=16, num_blocks=200, max_batch_tokens=256, max_new_tokens=8, n=2)
    stock = generate_batch(gemma.hf, prompts, pagedkv=False, **cb)
    paged = generate_batch(gemma.hf, prompts, pagedkv=True, **cb)
    assert_same(stock, paged)
    kv = paged.kv
    assert [g.kind for g in kv.manager.groups] == ["sliding_window", "full"]
    st = kv.stats()
    assert st.prefix_hits_tokens > window  # the second prompt reuses the first's window
    assert st.copies > 0  # the forks past the window wrote into shared partial blocks
    assert_released(paged)


@pytest.mark.slow
def test_gemma3_small_cache_and_streaming_cancel(gemma):
    qs = ["Name three rivers of Europe.", "What is a harbour?", "Count from one to five.", "Say hello politely."]
    prompts = [gemma.tokenizer(_travel_log(2) + " " + q)["input_ids"] for q in qs]
    cb = dict(page_size=8, num_blocks=16, max_new_tokens=32)
    stock = generate_batch(gemma.hf, prompts, pagedkv=False, **cb)
    paged = generate_batch(gemma.hf, prompts, pagedkv=True, **cb)
    assert_same(stock, paged)
    assert paged.kv.stats().preemptions > 0
    assert_released(paged)
    stock = stream_with_cancel(gemma.hf, prompts[:3], pagedkv=False, cancel_after=2, page_size=16, num_blocks=64)
    paged = stream_with_cancel(gemma.hf, prompts[:3], pagedkv=True, cancel_after=2, page_size=16, num_blocks=64)
    assert paged.tokens == stock.tokens
    assert_released(paged)
