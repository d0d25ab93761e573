"""Sampling parameters and the token sampler: greedy, temperature / top-k / top-p (nucleus,
Holtzman et al. 2020) with a per-sequence seeded ``torch.Generator``, and the log-probs beam
search needs.

Reproducibility: sample ``i`` of a request with seed ``s`` draws from a generator seeded with
``s * 1_000_003 + i``, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

from .errors import InvalidRequestError

__all__ = ["SamplingParams", "sample_tokens", "make_generator"]

EarlyStopping = bool | str


@dataclass(frozen=True)
class SamplingParams:
    """How to generate the continuation of one prompt.

    Attributes:
        max_tokens: most tokens to generate per sample (>= 1).
        temperature: 0 for greedy (argmax), else the softmax temperature (> 0).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        n: number of independent samples (>= 1). They share the prompt's KV blocks (fork plus
            copy-on-write). With beam search, the number of best beams returned (<= beam_width).
        seed: seed of the request's generators; ``None`` takes one from the engine's seed.
        stop: a string or list of strings that end generation (``None``: none); the output text
            is cut before the first one. In beam search a candidate whose text contains one
            finishes like an EOS candidate.
        ignore_eos: keep generating after the end-of-sequence token (a bool).
        beam_width: > 1 turns on beam search with that many beams. Beam search does not sample:
            ``temperature``, ``top_p`` and ``top_k`` must keep their defaults.
        length_penalty: beam search score = sum log-prob / generated_len ** length_penalty (a
            finite number).
        early_stopping: beam search stop rule as in transformers (``True``, ``False`` or
            ``"never"``).

    Raises:
        InvalidRequestError (a ``ValueError``): any value out of range or of the wrong type
            (``bool`` is not accepted as a number); the message names the field and value.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False

    def __post_init__(self) -> None:
        def bad(name: str, value: object, want: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name}={value!r} is invalid: expected {want}")

        # bool is an int subclass; True is never meant as a count or a probability.
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_real(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not is_real(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "a finite number >= 0")
        if not is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", self.top_p, "a number with 0 < top_p <= 1")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0 (0 disables top-k)")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", self.seed, "an integer or None")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "True or False")
        if not is_int(self.beam_width) or self.beam_width < 1:
            raise bad("beam_width", self.beam_width, "an integer >= 1")
        if not is_real(self.length_penalty):
            raise bad("length_penalty", self.length_penalty, "a finite number")
        if self.beam_width > 1:
            # Beam search ranks candidates by log-prob: nothing is drawn, so sampling knobs
            # would be silently ignored.
            no_sampling = "beam search (beam_width > 1) is deterministic and does not sample"
            if self.temperature != 0:
                raise bad("temperature", self.temperature, f"0 with beam search: {no_sampling}")
            if self.top_p != 1.0:
                raise bad("top_p", self.top_p, f"1.0 with beam search: {no_sampling}")
            if self.top_k != 0:
                raise bad("top_k", self.top_k, f"0 with beam search: {no_sampling}")
            if self.n > self.beam_width:
                raise bad("n", self.n, f"<= beam_width ({self.beam_width}) with beam search")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise bad("early_stopping", self.early_stopping, "True, False or 'never'")
        if self.stop is None:  # as in vLLM: no stop strings
            object.__setattr__(self, "stop", ())
        elif isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        else:
            raise bad("stop", self.stop, "a string, a list of strings or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "non-empty strings")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def use_beam_search(self) -> bool:
        """True when ``beam_width > 1``."""
        return self.beam_width > 1


def make_generator(seed: int, sample_index: int) -> torch.Generator:
    """CPU generator for sample ``sample_index`` of a request seeded with ``seed``."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + sample_index) % (2**63 - 1))
    return g


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p nucleus to -inf (``logits``: fp32 ``[V]``)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """One next token per row of ``logits``.

    Args:
        logits: fp32 ``[L, vocab_size]`` on any device.
        params: sampling parameters of each row (length ``L``).
        generators: each row's generator (``None`` allowed for greedy rows).

    Returns:
        ``L`` token ids. Greedy rows take the argmax (ties -> lowest id, as ``torch.argmax``);
        others sample from ``softmax(logits / temperature)`` restricted to top-k / top-p.
    """
    if logits.shape[0] == 0:
        return []
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _filter_top_k_top_p(logits[i].float().cpu() / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
