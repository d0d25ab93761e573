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
