"""pagedkv's own forward pass of Gemma 3 (text) over a paged KV cache: a hybrid model whose
sliding-window and full-attention layers form KV cache groups of equal layer counts
(five sliding-window groups and one full-attention group of 3 layers each in the 270M model).

Architecture (Gemma Team, "Gemma 3 Technical Report", 2025), per decoder layer::

    h = x + post_attention_norm(attention(input_norm(x)))
    x = h + post_feedforward_norm(GeGLU(pre_feedforward_norm(h)))

- RMSNorm scales by ``1 + w`` (the weights are stored as offsets from 1), in fp32;
- the token embedding is multiplied by ``sqrt(hidden_size)`` (in the weights' dtype); the LM
  head is the (unscaled) embedding;
- attention: GQA (the 270M model: 4 query heads, 1 KV head of 256), an RMSNorm over the head
  dimension of every query and key head (QK-norm) before RoPE, scores scaled by
  ``query_pre_attn_scalar ** -0.5``;
- each layer is ``sliding_attention`` (window ``sliding_window``, RoPE base 10k in the 270M
  model) or ``full_attention`` (RoPE base 1M) as ``config.layer_types`` lists them (5 local
  layers to 1 global one, the ``sliding_window_pattern``); each kind has its own RoPE
  parameters (``config.rope_parameters[layer_type]``);
- MLP: GeGLU, ``gelu_tanh(gate) * up`` then ``down``;
- optional final logit soft-capping ``cap * tanh(logits / cap)``.

The numbers follow transformers' ``Gemma3ForCausalLM`` op for op (fp32 norms, the same RoPE
angles, the embedding scale in the weights' dtype), so the engine's greedy tokens are those
of transformers on the same weights. Unlike :class:`~pagedkv.engine.models.model.LlamaForCausalLM`,
no norm weight is folded into a projection and RoPE keeps the rotate-half layout: a norm here
often sits after a projection, where nothing can be folded, and exactness is worth more than
the few percent on this small model.

Weights come from transformers' model (a GGUF file through :mod:`pagedkv.engine.models.loader`), named
as in its state dict (``model.layers.{i}.self_attn.q_norm.weight``...).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch
    import torch.nn.functional as F

from pagedkv import kernels

from ..errors import EngineConfigError
from ..kv_groups import FULL_ATTENTION, SLIDING_ATTENTION, StepTensors, layer_windows
from .model import PagedCausalLM, _projection, linear, rope_rotate_half
from .rope import LENGTH_DEPENDENT_ROPE, context_length

__all__ = ["Gemma3ForCausalLM", "StaticRope"]


@dataclass(frozen=True)
class StaticRope:
    """What the engine asks of a model's RoPE when every layer's RoPE is static (position-only):
    nothing depends on the sequence length, so no cached block needs a RoPE tag."""

    length_dependent: bool = False

    def prefix_cache_tag(self, num_prompt_tokens: int) -> str | None:
        """Always ``None``: a token's K depends on its position alone."""
        del num_prompt_tokens
        return None


@dataclass
class _GemmaLayer:
    """One decoder layer's weights: projections in :func:`~pagedkv.engine.models.model.linear`'s
    ``[in, out]`` layout (q/k/v and gate/up fused), norms as fp32 ``1 + w``."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    post_feedforward_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor


def _rope_inv_freq(config: Any, layer_type: str, head_size: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``fp32 [head_size // 2]`` and the cos/sin scale of one layer type.

    ``default``: ``1 / theta^(2i/d)``; other static types through transformers'
    ``ROPE_INIT_FUNCTIONS`` with the layer type, as its Gemma 3 model calls them.

    Raises:
        EngineConfigError: no RoPE parameters for the layer type, or a length-dependent or
            unknown RoPE type (names it).
    """
    params = dict((getattr(config, "rope_parameters", None) or {}).get(layer_type) or {})
    if not params:
        raise EngineConfigError(f"Gemma 3 config.rope_parameters has no entry for layer type {layer_type!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = float(params.get("rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
        return inv, 1.0
    if rope_type in LENGTH_DEPENDENT_ROPE:
        raise EngineConfigError(
            f"Gemma 3 {layer_type} layers use rope_type {rope_type!r}; the engine implements only "
            "position-only RoPE types for Gemma 3"
        )
    with optional_imports("pagedkv.engine", "engine"):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise EngineConfigError(f"rope_type {rope_type!r} of Gemma 3 {layer_type} layers is not supported")
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](copy.deepcopy(config), torch.device("cpu"), layer_type=layer_type)
    return inv.float(), float(scale)


class Gemma3ForCausalLM(PagedCausalLM):
    """Gemma 3 (text) whose attention reads and writes a paged KV cache (see the module docs).

    Plain tensors, no ``nn.Module``: inference only. Construct with :meth:`from_hf`.

    Attributes:
        config: the transformers config (``Gemma3TextConfig``).
        num_layers, num_heads, num_kv_heads, head_size, vocab_size, hidden_size: model sizes.
        max_model_len: context length in tokens (``max_position_embeddings``).
        layer_windows, kv_groups, layer_group, layer_slot, num_kv_slots: see
            :class:`~pagedkv.engine.models.model.PagedCausalLM` (the 270M model: six groups of 3
            layers, five of sliding-window layers with window 512 and one of the 3
            full-attention layers).
        rope: :class:`StaticRope` (no length-dependent RoPE).
        scale: the attention softmax scale, ``query_pre_attn_scalar ** -0.5``.
        dtype, device: of weights, activations and the KV cache.
    """

    def __init__(
        self, config: Any, weights: dict[str, torch.Tensor], *, device: Any = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        """Build from a transformers Gemma 3 text config and a state dict named as in
        transformers' ``Gemma3ForCausalLM``. Weights are moved to ``device``/``dtype``.

        Raises:
            KeyError: a required weight is missing (names it).
            EngineConfigError: a configuration this implementation does not cover: attention
                logit soft-capping, bidirectional attention, an activation other than tanh
                GELU, a length-dependent RoPE type, a layer type other than full and sliding
                attention (the message names it).
        """
        for name, bad in (
            ("attn_logit_softcapping", getattr(config, "attn_logit_softcapping", None) is not None),
            ("use_bidirectional_attention", bool(getattr(config, "use_bidirectional_attention", False))),
        ):
            if bad:
                raise EngineConfigError(
                    f"Gemma 3 config sets {name}={getattr(config, name)!r}, which the engine does not implement"
                )
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise EngineConfigError(
                f"Gemma 3 config has hidden_activation={act!r}, expected 'gelu_pytorch_tanh' (tanh GELU)"
            )
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = int(config.num_hidden_layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_size = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = context_length(config)
        self.eps = float(config.rms_norm_eps)
        self.scale = float(getattr(config, "query_pre_attn_scalar", None) or self.head_size) ** -0.5
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.layer_windows = layer_windows(config)
        self._init_kv_groups()
        self.rope = StaticRope()

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return weights[name].to(device=self.device, dtype=dtype)

        def norm(name: str) -> torch.Tensor:
            # transformers' Gemma3RMSNorm: x_normed * (1 + w), both in fp32.
            return (1.0 + w(name).float()).contiguous()

        self.embed = w("model.embed_tokens.weight")
        # transformers keeps sqrt(hidden) as an fp32 tensor and casts it to the weights' dtype.
        self.embed_scale = torch.tensor(self.hidden_size**0.5).to(device=self.device, dtype=dtype)
        self.layers: list[_GemmaLayer] = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(
                _GemmaLayer(
                    qkv=_projection(torch.cat([w(a + f"{x}_proj.weight") for x in "qkv"])),
                    o=_projection(w(a + "o_proj.weight")),
                    gate_up=_projection(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])),
                    down=_projection(w(p + "mlp.down_proj.weight")),
                    input_norm=norm(p + "input_layernorm.weight"),
                    post_attention_norm=norm(p + "post_attention_layernorm.weight"),
                    pre_feedforward_norm=norm(p + "pre_feedforward_layernorm.weight"),
                    post_feedforward_norm=norm(p + "post_feedforward_layernorm.weight"),
                    q_norm=norm(a + "q_norm.weight"),
                    k_norm=norm(a + "k_norm.weight"),
                )
            )
        self.norm = norm("model.norm.weight")
        # The LM head is the embedding (tied in every Gemma 3), run through F.linear: a
        # transposed copy of a 262k-token vocabulary would cost as much memory as the model.
        self.lm_head = w("lm_head.weight") if "lm_head.weight" in weights and not config.tie_word_embeddings else None
        types = {SLIDING_ATTENTION if win is not None else FULL_ATTENTION for win in self.layer_windows}
        self._inv_freq = {}
        for layer_type in types:
            inv, s = _rope_inv_freq(config, layer_type, self.head_size)
            self._inv_freq[layer_type] = (inv.to(self.device), s)
        self._layer_type = [SLIDING_ATTENTION if win is not None else FULL_ATTENTION for win in self.layer_windows]

    @classmethod
    def from_hf(cls, hf_model: Any, *, device: Any = "cpu", dtype: torch.dtype | None = None) -> Gemma3ForCausalLM:
        """Build from a loaded transformers ``Gemma3ForCausalLM`` (shares its tensors when device
        and dtype match). ``dtype`` defaults to the model's."""
        sd = hf_model.state_dict()
        return cls(hf_model.config, sd, device=device, dtype=dtype or next(iter(sd.values())).dtype)

    # ---- forward -----------------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Gemma3RMSNorm: fp32 x * rsqrt(mean(x^2) + eps) * (1 + w), cast back to x's dtype.
        # torch's rms_norm in fp32 gives the same roundings (bit-identical).
        if x.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], weight, self.eps)
        return F.rms_norm(x.float(), x.shape[-1:], weight, self.eps).to(x.dtype)

    def _cos_sin(self, positions: torch.Tensor, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_size]`` of one layer type, in transformers' op order (fp32
        angles, both halves, scale, cast)."""
        inv, s = self._inv_freq[layer_type]
        freqs = positions.float()[:, None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * s).to(self.dtype).unsqueeze(1), (emb.sin() * s).to(self.dtype).unsqueeze(1)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: StepTensors,
        logits_indices: torch.Tensor,
        rope_lens: torch.Tensor | None = None,
        *,
        plans: Sequence[kernels.AttentionPlan] | None = None,
    ) -> torch.Tensor:
        """Run the flat token batch and return next-token logits for selected tokens.

        Args:
            input_ids: int64 ``[T]`` token ids of the scheduled tokens, sequence after sequence.
            positions: int64 ``[T]`` position of each token in its sequence (0-based).
            kv_cache: ``[num_kv_slots, 2, num_blocks, block_size, num_kv_heads, head_size]``
                (layer ``i`` in slot ``layer_slot[i]``); the new K/V of every token is written at
                its group's slot mapping (in place).
            meta: this step's kernel inputs: a :class:`~pagedkv.tensors.BatchTensors` of one
                block table and slot mapping per KV cache group (a manager of one group per KV
                cache group) or of one for every group (a manager of one group).
            logits_indices: int64 ``[L]`` rows of the batch whose logits are wanted.
            rope_lens: unused (Gemma 3's RoPE is position-only); accepted for the runner's call.
            plans: :meth:`plan_attention`'s plans, one per group (default ``meta.attn_plan``
                where ``meta`` has one; none: each attention call plans for itself).

        Returns:
            fp32 ``[L, vocab_size]`` logits.
        """
        del rope_lens
        inputs = self._group_inputs(meta, plans if plans is not None else getattr(meta, "attn_plan", None))
        t = input_ids.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        rot = {lt: self._cos_sin(positions, lt) for lt in self._inv_freq}
        x = self.embed[input_ids] * self.embed_scale  # [T, hidden]
        for li, layer in enumerate(self.layers):
            qkv = linear(self._norm(x, layer.input_norm), layer.qkv)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            cos, sin = rot[self._layer_type[li]]
            q = rope_rotate_half(self._norm(q.view(t, hq, d), layer.q_norm), cos, sin)
            k = rope_rotate_half(self._norm(k.view(t, hkv, d), layer.k_norm), cos, sin)
            o = self._attend(li, q, k, v.reshape(t, hkv, d), kv_cache, meta, self.scale, inputs)
            x = x + self._norm(linear(o.view(t, hq * d), layer.o), layer.post_attention_norm)
            gate, up = linear(self._norm(x, layer.pre_feedforward_norm), layer.gate_up).chunk(2, dim=-1)
            mlp = linear(F.gelu(gate, approximate="tanh") * up, layer.down)
            x = x + self._norm(mlp, layer.post_feedforward_norm)
        x = self._norm(x[logits_indices], self.norm)
        logits = F.linear(x, self.lm_head if self.lm_head is not None else self.embed).float()
        if self.final_softcap is not None:
            cap = float(self.final_softcap)
            logits = torch.tanh(logits / cap) * cap
        return logits
