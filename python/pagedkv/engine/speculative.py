"""Prompt-lookup (n-gram) speculative decoding: propose draft tokens by copying what followed an
earlier occurrence of the sequence's last n tokens, and verify them greedily.

Speculative decoding (Leviathan et al., ICML'23) scores the last token plus ``k`` draft tokens in
one forward pass; prompt lookup (Saxena, "Prompt Lookup Decoding", 2023; vLLM's ``ngram``
method) takes the drafts from the sequence itself, so it needs no draft model. It pays where
the output repeats its context (code edits, summaries quoting the input, lists) and costs a
verify step of ``k + 1`` query tokens where it does not.

Greedy verification: with target tokens ``t_0 .. t_k`` (the argmax at each of the ``k + 1``
positions), the longest prefix ``m`` of the drafts equal to ``t_0 .. t_{m-1}`` is accepted and
``t_m`` is the bonus token, so the ``m + 1`` emitted tokens are exactly what ``m + 1`` greedy
decode steps would have produced.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["propose_ngram", "num_accepted", "MAX_NGRAM", "MIN_NGRAM"]

#: Longest and shortest suffix lengths the lookup tries, longest first.
MAX_NGRAM = 3
MIN_NGRAM = 1


def propose_ngram(token_ids: Sequence[int], k: int, *, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM) -> list[int]:
    """Up to ``k`` draft tokens for a sequence whose tokens (prompt + output) are ``token_ids``.

    For ``n`` from ``max_n`` down to ``min_n``: find the most recent earlier occurrence of the
    last ``n`` tokens followed by ``k`` tokens and return those; when every occurrence is too
    close to the end for that, the earliest (longest continuation) gives its fewer tokens. The
    first ``n`` that matches wins. No match (or ``k <= 0``, or too few tokens): ``[]``.

    Args:
        token_ids: the sequence's tokens, oldest first.
        k: most drafts wanted (tokens).
        max_n, min_n: suffix lengths tried (tokens), ``max_n >= min_n >= 1``.

    Returns:
        the drafts (token ids), ``0 .. k`` of them.
    """
    size = len(token_ids)
    if k <= 0:
        return []
    toks = list(token_ids)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = toks[size - n :]
        short = -1  # leftmost match seen whose continuation is shorter than k
        # Starts j < size - n, right to left (j + n <= size - 1: a token follows the match).
        for j in range(size - n - 1, -1, -1):
            if toks[j : j + n] == suffix:
                if j + n + k <= size:
                    return toks[j + n : j + n + k]
                short = j
        if short >= 0:
            return toks[short + n : short + n + k]
    return []


def num_accepted(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """Greedy acceptance: the length of the longest prefix of ``drafts`` equal to ``targets``
    (the target model's argmax at each draft position; ``len(targets) >= len(drafts)``)."""
    m = 0
    for d, t in zip(drafts, targets):
        if d != t:
            break
        m += 1
    return m
