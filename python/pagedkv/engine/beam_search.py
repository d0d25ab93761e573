"""Beam search bookkeeping for one request, step for step the algorithm of transformers'
``GenerationMixin._beam_search`` (v4.50+ vectorised form), so results match ``generate(
num_beams=k, do_sample=False)``.

Per step, with ``k`` running beams of scores ``s_b`` and next-token log-probs ``lp_b``:

1. candidates: the top ``K = max(2, 1 + n_eos) * k`` of ``s_b + lp_b[t]`` over all beams and
   tokens (beam-major order, as transformers flattens them);
2. a candidate *hits a stop* if its token is EOS, it reaches ``max_tokens`` or its decoded
   text contains a stop string (the ``stop`` check; transformers' ``StoppingCriteria`` applied
   to the same candidates, as with ``generate(stop_strings=...)``); among the first ``k``
   candidates, those that stop become finished hypotheses with score
   ``s / generated_len ** length_penalty``, kept in a k-slot list of the best ones;
3. the next running beams are the best ``k`` candidates that did not stop. ``K`` leaves room
   for every EOS token, not for stop strings, which may match many tokens: when fewer than
   ``k`` of the ``K`` candidates go on, the pool is widened (doubling) until ``k`` do. Otherwise
   running beams would be padded with stopped candidates at score -1e9; transformers does so,
   so results may differ from its only in that case;
4. the request ends when no candidate can continue, when ``early_stopping is True`` and all
   k slots are finished, or when the best running beam cannot beat the worst finished one
   (transformers' heuristic, which also depends on ``early_stopping`` and the length penalty).

The engine maps beams to manager sequences: a beam continued by several candidates is forked
(blocks shared, copy-on-write on the next append), a beam with no continuation is freed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

__all__ = ["BeamSearch", "BeamStep"]

_NEG = -1.0e9


@dataclass
class BeamStep:
    """The outcome of one beam step.

    Attributes:
        parents: for each new running beam, the index of the beam it continues.
        tokens: for each new running beam, the token appended.
        done: True when the search has ended (``parents`` / ``tokens`` then unused).
    """

    parents: list[int]
    tokens: list[int]
    done: bool


class BeamSearch:
    """State of one beam search (see the module docs).

    Args:
        width: number of beams ``k`` (>= 2).
        max_tokens: generated-length limit.
        eos_token_ids: tokens that end a hypothesis (empty when ignoring EOS).
        length_penalty: exponent of the length normalisation.
        early_stopping: ``True``, ``False`` or ``"never"`` (transformers' meaning).
        stop: optional check of a candidate's generated tokens (prompt excluded, the new token
            included): True when its decoded text contains a stop string, which ends it like
            EOS. Called once per candidate per step.
    """

    def __init__(
        self,
        width: int,
        max_tokens: int,
        eos_token_ids: Sequence[int],
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        stop: Callable[[list[int]], bool] | None = None,
    ) -> None:
        self.k = width
        self.max_tokens = max_tokens
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.int64)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.keep = max(2, 1 + len(self.eos)) * width
        self.stop = stop
        self._eos_set = frozenset(self.eos.tolist())
        self.gen_len = 0  # tokens generated so far by every running beam
        self.running_scores = torch.zeros(1)  # one real beam until the first step
        self.running_tokens: list[list[int]] = [[]]
        self.finished_scores = torch.full((width,), _NEG)
        self.finished_tokens: list[list[int] | None] = [None] * width
        self.finished_flags = torch.zeros(width, dtype=torch.bool)
        self.improvable = True

    def step(self, logprobs: torch.Tensor) -> BeamStep:
        """Advance by one token.

        Args:
            logprobs: fp32 ``[num_running_beams, vocab]`` log-softmax of each running beam's
                next-token logits, in running-beam order.

        Returns:
            the new running beams (parent index and token each) or ``done``.
        """
        nb, vocab = logprobs.shape
        scores = (logprobs.float() + self.running_scores[:, None]).reshape(-1)
        if nb < self.k:
            # transformers keeps k beams from the start, the extra ones at -1e9; pad likewise.
            pad = torch.full(((self.k - nb) * vocab,), _NEG) + logprobs[0].float().repeat(self.k - nb)
            scores = torch.cat((scores, pad))
        new_len = self.gen_len + 1
        keep = self.keep
        checked: dict[tuple[int, ...], bool] = {}  # stop check per candidate text, across widenings
        while True:
            top_scores, top_idx = torch.topk(scores, k=keep)
            beam_idx = (top_idx // vocab).tolist()
            tokens = (top_idx % vocab).tolist()
            hits = torch.tensor(
                [self._hits(b, t, new_len, checked) for b, t in zip(beam_idx, tokens)], dtype=torch.bool
            )
            # Widen only for stop strings (EOS always leaves k candidates, see the module docs).
            if (
                self.stop is None
                or int((~hits).sum()) >= self.k
                or keep == scores.numel()
                or new_len >= self.max_tokens
            ):
                break
            keep = min(2 * keep, scores.numel())

        # next running beams: best k that did not stop
        running_pick = torch.topk(top_scores + hits.float() * _NEG, k=self.k)[1].tolist()

        # finished hypotheses
        cand = top_scores / (new_len**self.length_penalty)
        if bool(self.finished_flags.all()) and self.early_stopping is True:
            cand = cand + _NEG
        if not self.improvable:
            cand = cand + _NEG
        top_k_mask = torch.arange(keep) < self.k
        cand = cand + (~(hits & top_k_mask)).float() * _NEG
        merged_scores = torch.cat((self.finished_scores, cand))
        merged_flags = torch.cat((self.finished_flags, hits & top_k_mask))
        merged_tokens = self.finished_tokens + [self._tokens_of(beam_idx[j]) + [tokens[j]] for j in range(keep)]
        pick = torch.topk(merged_scores, k=self.k)[1].tolist()
        self.finished_scores = merged_scores[pick]
        self.finished_flags = merged_flags[pick]
        self.finished_tokens = [merged_tokens[i] for i in pick]

        parents = [beam_idx[j] for j in running_pick]
        new_tokens = [tokens[j] for j in running_pick]
        self.running_scores = (top_scores + hits.float() * _NEG)[running_pick]
        self.running_tokens = [self._tokens_of(p) + [t] for p, t in zip(parents, new_tokens)]
        self.gen_len = new_len

        # stop rules (transformers' _check_early_stop_heuristic / _beam_search_has_unfinished_sequences)
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_tokens
        else:
            best_len = self.gen_len
        best_possible = self.running_scores[0] / (best_len**self.length_penalty)
        worst = torch.where(self.finished_flags, self.finished_scores.min(), torch.tensor(_NEG))
        self.improvable = self.improvable and bool((best_possible > worst).any())
        all_done = bool(self.finished_flags.all()) and self.early_stopping is True
        done = (not self.improvable) or all_done or bool(hits.all())
        return BeamStep(parents, new_tokens, done)

    def _hits(self, beam: int, token: int, new_len: int, checked: dict[tuple[int, ...], bool]) -> bool:
        """Whether the candidate ``beam + token`` stops: EOS, length, or a stop string (each
        distinct candidate checked once per step, memoised in ``checked``)."""
        if token in self._eos_set or new_len >= self.max_tokens:
            return True
        if self.stop is None:
            return False
        key = (*self._tokens_of(beam), token)
        if key not in checked:
            checked[key] = self.stop(list(key))
        return checked[key]

    def _tokens_of(self, beam: int) -> list[int]:
        return list(self.running_tokens[beam]) if beam < len(self.running_tokens) else []

    def best(self, n: int) -> list[tuple[list[int], float]]:
        """The ``n`` best finished hypotheses, best first: ``(generated tokens, score)``."""
        out = []
        for i in range(min(n, self.k)):
            toks = self.finished_tokens[i]
            if toks is not None:
                out.append((toks, float(self.finished_scores[i])))
        return out
