"""Random request streams for the vLLM lockstep tests of Mamba layouts (sync and async)."""

from __future__ import annotations

import random

# Arrival step -> (request id, prompt token ids, max new tokens).
Stream = dict[int, list[tuple[str, list[int], int]]]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` token ids drawn from 100..3999."""
    return [rng.randrange(100, 4000) for _ in range(n)]


def shared_prefix_stream(rng: random.Random, prefix: list[int], n: int, tail: tuple[int, int], spread: int) -> Stream:
    """``n`` requests ``r0..`` whose prompts are ``prefix`` plus a random tail of
    ``randrange(*tail)`` tokens, arriving at steps ``0..spread - 1``, each asking 1-39 tokens."""
    stream: Stream = {}
    for i in range(n):
        prompt = prefix + random_tokens(rng, rng.randrange(*tail))
        stream.setdefault(rng.randrange(0, spread), []).append((f"r{i}", prompt, rng.randrange(1, 40)))
    return stream


def assert_blocks_held(
    step: int,
    stock: dict[str, list[tuple[int, int]]],
    paged: dict[str, list[tuple[int, int]]],
    state: set[int] | list[int],
    *,
    min_state: int = 1,
) -> list[tuple[int, int]]:
    """Compares the blocks each request holds after one step, stock vLLM vs the plug-in:
    ``{request id: [(table length, real blocks) per group]}``. Table lengths are equal in
    every group and real blocks in every attention group; in a state group (indices
    ``state``) pagedkv may hold one block fewer than stock right after a move, and at least
    ``min_state``. Returns the ``(stock, paged)`` real-block pairs of the state groups where
    they differ (the by-design difference, for the tests' figures). Raises AssertionError
    naming the step, request and group."""
    assert paged.keys() == stock.keys(), f"step {step}: requests {sorted(stock)} vs {sorted(paged)}"
    fewer = []
    for rid, groups in stock.items():
        pairs = zip(groups, paged[rid], strict=True)
        for g, ((len_a, real_a), (len_b, real_b)) in enumerate(pairs):
            where = f"step {step} {rid} group {g}: {groups} vs {paged[rid]}"
            assert len_b == len_a, where
            if g in state:
                assert min_state <= real_b <= real_a <= real_b + 1, where
                if real_b < real_a:
                    fewer.append((real_a, real_b))
            else:
                assert real_b == real_a, where
    return fewer
