"""Stop strings inside beam search: a candidate whose decoded text contains a stop string
becomes a finished hypothesis like an EOS one (output text cut before the stop string,
finish_reason "stop"). Oracle: transformers' own beam search with a stopping criterion that
applies the same text check to the same candidates."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from helpers.engine import assert_no_leak

from pagedkv.engine import LLMEngine, SamplingParams
from pagedkv.engine.beam_search import BeamSearch

K, N, MAX_NEW = 3, 2, 12


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 33)]


def _hf_beam_with_stop(tiny, prompt: list[int], stop: str) -> list[list[int]]:
    """transformers' beam search (k=3, 2 returned, 12 new tokens) where a candidate stops when
    its generated text (special tokens skipped) contains ``stop``. Rows as transformers returns
    them: a row that ended early is filled with the EOS id 1 up to the longest."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class TextContains(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor(
                [
                    stop in tiny.tokenizer.decode(row[len(prompt) :].tolist(), skip_special_tokens=True)
                    for row in input_ids
                ]
            )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = tiny.hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            num_beams=K,
            num_return_sequences=N,
            do_sample=False,
            max_new_tokens=MAX_NEW,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([TextContains()]),
        )
    return out[:, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "prompt_index,stop_at,best_reason",
    [
        (0, 2, "stop"),  # the best hypothesis ends on the stop string
        (1, 7, "stop"),
        (1, 4, "length"),  # a hypothesis that stops early scores worse than two that run on
    ],
)
def test_beam_candidate_containing_stop_string_finishes(tiny, prompt_index, stop_at, best_reason):
    prompt = _prompts()[prompt_index]
    engine = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, block_size=4, num_kv_blocks=512)
    free = SamplingParams(max_tokens=MAX_NEW, beam_width=K, n=N)
    unconstrained = list(engine.generate([prompt], free)[0].token_ids)
    assert len(unconstrained) == MAX_NEW
    stop = tiny.tokenizer.decode([unconstrained[stop_at]])
    # a whole word of the tiny vocabulary that no other word contains, not seen before
    assert len(stop) == 4 and unconstrained[stop_at] not in unconstrained[:stop_at]

    out = engine.generate([prompt], SamplingParams(max_tokens=MAX_NEW, beam_width=K, n=N, stop=[stop]))[0]
    got = [list(c.token_ids) for c in out.outputs]
    want = _hf_beam_with_stop(tiny, prompt, stop)
    assert [g + [1] * (len(w) - len(g)) for g, w in zip(got, want)] == want
    assert out.outputs[0].finish_reason == best_reason
    for c in out.outputs:
        text = tiny.tokenizer.decode(list(c.token_ids), skip_special_tokens=True)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == unconstrained[stop_at]  # ended by the token completing it
            assert c.text == text[: text.index(stop)] and stop not in c.text
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == MAX_NEW and c.text == text
            assert stop not in text
        assert math.isfinite(c.score) and c.score > -100
    if best_reason == "stop":
        assert got[0] == unconstrained[: stop_at + 1]  # it stops exactly where the free run had it
    assert_no_leak(engine)


def test_stop_strings_never_leave_fewer_than_k_running_beams():
    """k=2, no EOS: transformers' pool of K = 4 candidates would all hit the stop (tokens 0-3),
    leaving no live beam. The pool widens until 2 candidates go on (tokens 4 and 5)."""
    calls: list[list[int]] = []

    def stop(tokens: list[int]) -> bool:
        calls.append(tokens)
        return tokens[-1] in (0, 1, 2, 3)

    bs = BeamSearch(2, max_tokens=4, eos_token_ids=[], length_penalty=2.0, early_stopping="never", stop=stop)
    logprobs = torch.tensor([[-0.1, -0.2, -0.3, -0.4, -1.0, -2.0]])
    step = bs.step(logprobs)
    assert not step.done
    assert step.parents == [0, 0] and step.tokens == [4, 5]
    assert bs.running_scores.tolist() == [-1.0, -2.0]
    assert [(t, round(s, 6)) for t, s in bs.best(2)] == [([0], -0.1), ([1], -0.2)]  # the top-k hits
    # each distinct candidate checked once (the real beam's 6 tokens; padding beams repeat them)
    assert sorted(map(tuple, calls)) == [(t,) for t in range(6)]

    # Without a stop check the same logprobs keep transformers' pool and rule (all 4 go on).
    plain = BeamSearch(2, max_tokens=4, eos_token_ids=[], length_penalty=2.0, early_stopping="never")
    assert plain.step(logprobs).tokens == [0, 1]
