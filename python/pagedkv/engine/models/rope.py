"""Rotary position embeddings (RoPE) of the engine's model: inverse frequencies and the cos/sin
of every token of a flat varlen batch.

RoPE rotates each query/key head by angles ``position * inv_freq`` (RoFormer, Su et al. 2021).
The frequencies come from the config's ``rope_type``; except for ``default`` they are computed
by transformers' own ``ROPE_INIT_FUNCTIONS``, so they equal transformers' bit for bit.

Two kinds of types:

- *Static* (``default``, ``linear``, ``llama3``, ``yarn``...): one frequency set, so cos/sin of
  every position are precomputed once and a step is one table lookup.
- *Length-dependent* (``dynamic`` = dynamic NTK scaling, bloc97/emozilla 2023; ``longrope`` =
  LongRoPE, Ding et al. 2024, as in Phi-3): the frequencies depend on the sequence length.
  transformers (``dynamic_rope_update``) picks them per forward call from ``max(position_ids)
  + 1``: ``dynamic`` recomputes them for that length once it exceeds
  ``max_position_embeddings``; ``longrope`` uses ``long_factor`` once it exceeds
  ``original_max_position_embeddings``, else ``short_factor``, with the same attention
  scaling of cos/sin either way.

Which length, in this engine: the *rope length* of a token at position ``p`` of a sequence with
a ``P``-token prompt is ``max(P, p + 1)`` (:func:`rope_lengths`). That is exactly the length
transformers' forward call has when it computes that token in batch-1 ``generate``: the prompt
is prefilled in one call of length ``P``, and each later token at position ``p`` is decoded in
a call of length ``p + 1``. Deciding per token this way (rather than per step) makes a token's
K/V a function of its sequence alone:

- independent of the batch: a sequence's output never depends on what else runs in the step.
  transformers decides once for the whole (padded) batch from its longest row, so with batch
  > 1 and mixed lengths its shorter rows get the longer row's frequencies; here they do not
  (the one deliberate difference; batch-1 results are identical);
- independent of chunked prefill (a prompt's first chunk already uses the prompt's length, as
  transformers' single prefill call does), of recompute preemption (prompt + generated tokens
  recomputed get the same frequencies they had the first time) and of swapping.

Prefix caching: the K of a prompt token then depends on the prompt's length once that length is
past the threshold, so requests sharing a prefix may share KV blocks only when they agree on it;
:meth:`RotaryEmbedding.prefix_cache_tag` gives the value the engine adds to a prompt's block
hashes as a typed extra key (its own kind, never mixed into the user's cache salt).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

from ..errors import EngineConfigError

__all__ = [
    "LENGTH_DEPENDENT_ROPE",
    "RotaryEmbedding",
    "rope_inv_freq",
    "rope_lengths",
    "rope_parameters",
    "context_length",
]

#: RoPE types whose frequencies depend on the sequence length (see the module docs).
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as one dict (transformers >= 5 ``rope_parameters``, or the
    older ``rope_theta`` + ``rope_scaling`` pair), with ``rope_type`` always set."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _init_function(rope_type: str) -> Any:
    with optional_imports("pagedkv.engine", "engine"):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise EngineConfigError(
            f"rope_type {rope_type!r} is not supported; known types: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}"
        )
    return ROPE_INIT_FUNCTIONS[rope_type]


def rope_inv_freq(config: Any, head_size: int) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ``fp32 [head_size // 2]`` and the cos/sin scaling factor, as a
    freshly built transformers model holds them.

    ``default`` is computed here (``1 / theta^(2i/d)``); every other type goes through
    transformers' ``ROPE_INIT_FUNCTIONS``. For the length-dependent types these are the
    frequencies of short sequences: ``dynamic`` unscaled (lengths up to
    ``max_position_embeddings``), ``longrope`` with ``short_factor`` (and its attention factor).

    Raises:
        ValueError: ``rope_type`` unknown to transformers (names it).
    """
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        theta = float(params.get("rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
        return inv, 1.0
    inv, scaling = _init_function(rope_type)(config, torch.device("cpu"))
    return inv.float(), float(scaling)


def context_length(config: Any) -> int:
    """The model's context in tokens: ``max_position_embeddings``, times ``factor`` for
    ``dynamic`` RoPE (dynamic NTK exists to run past the trained context, and ``factor`` is the
    stretch the config asks for; ``longrope`` configs already state the extended context)."""
    max_pos = int(config.max_position_embeddings)
    params = rope_parameters(config)
    if params["rope_type"] == "dynamic":
        return int(max_pos * float(params["factor"]))
    return max_pos


def rope_lengths(num_prompt_tokens: int, positions: np.ndarray) -> np.ndarray:
    """The rope length ``max(P, p + 1)`` of each token (see the module docs): int64, same shape
    as ``positions`` (0-based positions, in tokens, of tokens of one sequence whose prompt has
    ``P = num_prompt_tokens`` tokens)."""
    return np.asarray(np.maximum(positions, num_prompt_tokens - 1) + 1, dtype=np.int64)


def _cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    # Exactly transformers' op order: fp32 angles, cat halves, cos/sin, scale, then cast.
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


class RotaryEmbedding:
    """cos/sin of the tokens of a flat batch for one model (see the module docs).

    Args:
        config: the transformers config (its RoPE parameters and ``max_position_embeddings``).
        head_size: rotated dimensions per head.
        num_positions: table size in positions (the model's context, tokens).
        device, dtype: of the returned cos/sin.

    Attributes:
        rope_type: the config's type (``"default"``, ``"dynamic"``, ``"longrope"``...).
        length_dependent: True for ``dynamic`` and ``longrope``.
        threshold: length in tokens past which the length-dependent frequencies change
            (``max_position_embeddings`` for ``dynamic``, ``original_max_position_embeddings``
            for ``longrope``); ``None`` for static types.
        cos, sin: ``[rows, head_size]`` tables in ``dtype`` of the static (short / unscaled)
            frequencies; the whole story for static types (``rows = num_positions``). For the
            length-dependent types ``rows = min(num_positions, threshold)``: a token with a
            rope length up to the threshold has a position below it.

    Raises:
        ValueError: unknown ``rope_type``.
    """

    def __init__(
        self,
        config: Any,
        head_size: int,
        num_positions: int,
        *,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        params = rope_parameters(config)
        self.rope_type: str = params["rope_type"]
        self.length_dependent = self.rope_type in LENGTH_DEPENDENT_ROPE
        inv_freq, self.scaling = rope_inv_freq(config, head_size)
        self.threshold: int | None = None
        if self.rope_type == "dynamic":
            self.threshold = int(config.max_position_embeddings)
        elif self.rope_type == "longrope":
            # The init call above made transformers standardize the config's parameters.
            self.threshold = int(rope_parameters(config)["original_max_position_embeddings"])
        rows = num_positions if self.threshold is None else min(num_positions, self.threshold)
        cos, sin = _cos_sin(torch.arange(rows, dtype=torch.int64), inv_freq, self.scaling, dtype)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        self._dynamic_inv_freq: dict[int, torch.Tensor] = {}
        if self.rope_type == "longrope":
            # transformers computes the long set with a length just past the threshold and keeps
            # the attention scaling of its init call for both sets (it depends on neither).
            long_len = int(rope_parameters(config)["original_max_position_embeddings"]) + 1
            long_inv, _ = _init_function("longrope")(config, torch.device("cpu"), seq_len=long_len)
            long_cos, long_sin = _cos_sin(
                torch.arange(num_positions, dtype=torch.int64), long_inv.float(), self.scaling, dtype
            )
            # Short rows, then long rows: a token's row is ``p + rows * is_long``, one gather.
            self._longrope_cos = torch.cat((self.cos, long_cos.to(self.device)))
            self._longrope_sin = torch.cat((self.sin, long_sin.to(self.device)))

    def lookup(
        self, positions: torch.Tensor, rope_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, head_size]`` (``dtype``, on ``device``) of ``T`` tokens.

        Args:
            positions: int64 ``[T]`` 0-based positions (on ``device``).
            rope_lens: int64 ``[T]`` rope length of each token (:func:`rope_lengths`, so
                above its position; any device); required for length-dependent types, ignored
                by static ones.

        Complexity: a gather for static types and ``longrope``; ``dynamic`` also computes
        ``T' x head_size`` cos/sin for the ``T'`` tokens past the threshold, plus one
        transformers init call per rope length not seen before (cached for the model's life).

        Raises:
            ValueError: ``rope_lens`` missing for a length-dependent type, of another shape
                than ``positions``, or not above a token's position.
        """
        if not self.length_dependent:
            return self.cos[positions], self.sin[positions]
        if rope_lens is None or rope_lens.shape != positions.shape:
            raise ValueError(
                f"rope_type {self.rope_type!r} needs rope_lens shaped like positions "
                f"{tuple(positions.shape)}, got "
                f"{None if rope_lens is None else tuple(rope_lens.shape)}"
            )
        assert self.threshold is not None
        lens = rope_lens.to(positions.device)
        if bool((lens <= positions).any()):
            bad = int((lens <= positions).nonzero()[0, 0])
            raise ValueError(
                f"rope_lens[{bad}]={int(lens[bad])} must exceed the token's position {int(positions[bad])}"
            )
        short_rows = self.cos.shape[0]
        if self.rope_type == "longrope":
            rows = positions + (lens > self.threshold).to(torch.int64) * short_rows
            return self._longrope_cos[rows], self._longrope_sin[rows]
        # Positions from the threshold on always have longer rope lengths, so they are
        # overwritten below; clamp keeps their placeholder gather in range.
        clamped = positions.clamp(max=short_rows - 1)
        cos, sin = self.cos[clamped], self.sin[clamped]  # fresh tensors: safe to overwrite
        lens_cpu = rope_lens.cpu()
        over = (lens_cpu > self.threshold).nonzero().squeeze(1)
        if over.numel():
            unique, inverse = torch.unique(lens_cpu[over], return_inverse=True)
            inv = torch.stack([self._dynamic_freq(n) for n in unique.tolist()])[inverse]
            rows = over.to(positions.device)
            cos[rows], sin[rows] = _cos_sin(positions[rows], inv.to(positions.device), self.scaling, self.dtype)
        return cos, sin

    def _dynamic_freq(self, length: int) -> torch.Tensor:
        """Dynamic-NTK inverse frequencies for a ``length``-token sequence, computed as
        transformers' forward does (the length as an int64 tensor, so in fp32 arithmetic)."""
        inv = self._dynamic_inv_freq.get(length)
        if inv is None:
            inv, _ = _init_function("dynamic")(
                self.config, torch.device("cpu"), seq_len=torch.tensor(length, dtype=torch.int64)
            )
            inv = inv.float()
            self._dynamic_inv_freq[length] = inv
        return inv

    def prefix_cache_tag(self, num_prompt_tokens: int) -> str | None:
        """What, besides the tokens, a request's cached K/V depends on; ``None`` when nothing.

        With a rope length ``max(P, p + 1)`` per token, a prompt of ``P`` tokens up to the
        threshold gives every token frequencies set by its position alone. Past it, ``longrope``
        prompt tokens all take the long set (tag ``"longrope:long"``) and ``dynamic`` prompt
        tokens take frequencies of the prompt's exact length (tag ``"dynamic:<P>"``).
        Requests may share cached blocks only with equal tags.
        """
        if not self.length_dependent or self.threshold is None or num_prompt_tokens <= self.threshold:
            return None
        if self.rope_type == "longrope":
            return "longrope:long"
        return f"dynamic:{num_prompt_tokens}"
