"""Admission's block bound is exact: the last sampled token never gets a KV slot, so a sequence
holds at most ``prompt + max_tokens - 1`` tokens of KV. A request that needs exactly the usable
pool is admitted and runs to the end with no preemption and the tokens it gets on a large pool;
one token more is refused before anything is queued. Sampling, ``n > 1`` and beam search."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.engine import assert_no_leak

from pagedkv.engine import LLMEngine, RequestTooLargeError, SamplingParams
from pagedkv.engine.scheduler import blocks_for_request

BLOCK = 16
USABLE = 4  # num_kv_blocks = 5: block 0 is the null block


def _prompt(n: int, seed: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def _engine(tiny: Any, num_kv_blocks: int) -> LLMEngine:
    return LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, block_size=BLOCK, num_kv_blocks=num_kv_blocks)


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[tuple[int, ...]], int]:
    out = engine.generate([prompt], params)[0]
    return [tuple(c.token_ids) for c in out.outputs], out.num_preemptions


def test_blocks_for_request_counts_kv_slots_not_sampled_tokens():
    assert blocks_for_request(64, 1, 1, 16) == 4  # 64 slots: the one sampled token has none
    assert blocks_for_request(64, 2, 1, 16) == 5
    assert blocks_for_request(41, 24, 1, 16) == 4  # 41 + 23 = 64
    assert blocks_for_request(41, 25, 1, 16) == 5
    assert blocks_for_request(32, 17, 2, 16) == 4  # 2 shared + 2 x ceil(16 / 16)
    assert blocks_for_request(32, 18, 2, 16) == 6  # 2 shared + 2 x ceil(17 / 16)
    assert blocks_for_request(5, 1, 3, 4) == 1 + 3 * 1


CASES = {
    # name: (prompt length, exactly-fitting params, one-token-over params)
    "greedy-prompt-fills-pool": (64, dict(max_tokens=1), dict(max_tokens=2)),
    "greedy-output-fills-pool": (41, dict(max_tokens=24), dict(max_tokens=25)),
    "sampling-n2": (
        32,
        dict(max_tokens=17, n=2, temperature=1.0, seed=7),
        dict(max_tokens=18, n=2, temperature=1.0, seed=7),
    ),
    "beam-width2": (32, dict(max_tokens=17, beam_width=2), dict(max_tokens=18, beam_width=2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_exactly_fitting_request_runs_and_one_more_token_is_refused(tiny, name):
    n_prompt, fits, over = CASES[name]
    prompt = _prompt(n_prompt)
    fits_params = SamplingParams(ignore_eos=True, **fits)
    engine = _engine(tiny, USABLE + 1)
    got, preemptions = _run(engine, prompt, fits_params)
    assert preemptions == 0
    assert all(len(tokens) == fits["max_tokens"] for tokens in got)
    want, _ = _run(_engine(tiny, 64), prompt, fits_params)
    assert got == want  # same tokens as on a pool with room to spare
    assert_no_leak(engine)

    with pytest.raises(RequestTooLargeError, match=f"only {USABLE} usable"):
        engine.add_request(prompt, SamplingParams(ignore_eos=True, **over))
    assert engine.manager.num_sequences == 0 and not engine.has_unfinished()
