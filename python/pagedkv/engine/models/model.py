"""pagedkv's own forward pass of a Llama-family decoder over a paged KV cache.

Architecture (Llama 2/3, SmolLM, Qwen2, Mistral): token embedding -> N x [RMSNorm -> attention
with RoPE and grouped-query heads (GQA) -> residual -> RMSNorm -> SwiGLU MLP -> residual] ->
RMSNorm -> LM head (tied to the embedding when the config says so). RoPE frequencies, static
or length-dependent (``dynamic``, ``longrope``), come from :mod:`pagedkv.engine.models.rope`.

The batch is one flat varlen token list (no padding): prefills, chunked prefills, prefills
over a cached prefix and decodes of many sequences together, ``T`` tokens in all. Per layer the
new K/V rows are written into their cache slots by ``slot_mapping``
(:func:`pagedkv.kernels.reshape_and_cache`) and each query attends to its own sequence's cached
tokens through the block table (:func:`pagedkv.kernels.paged_attention`; the torch reference on
CPU, Triton on CUDA) -- PagedAttention, Kwon et al., SOSP'23.

KV cache: one tensor ``[num_kv_slots, 2, num_blocks, block_size, num_kv_heads, head_size]``
(index 0 = K, 1 = V). Layers are grouped into KV cache groups of equal layer counts by
attention kind (:mod:`pagedkv.engine.kv_groups`); layer ``i`` keeps its K/V in slot
``layer_slot[i]`` (its index within its group) and reads its group's block table, slot mapping
and window, through its group's attention plan (:class:`PagedCausalLM`, the part every model of
the engine shares). A block id belongs to one group at a time, so ``kv_cache[:, :, b]`` is the
page of block ``b`` in every layer of its group: copy-on-write copies and swaps stay one call
for all layers and groups. A model without sliding-window layers has one group of every layer
(``num_kv_slots == num_layers``, layer ``i`` in slot ``i``); Gemma 3 270M has six groups of 3
layers (``num_kv_slots == 3``), so a block costs 3 layers' pages, not 18.

The weights come from transformers' own model (see :mod:`pagedkv.engine.models.loader`), so the same
numbers feed both this model and the transformers oracle in the tests. They are stored for the
GEMM, not as transformers keeps them: every projection transposed (``[in_features,
out_features]``, contiguous; :func:`linear` computes ``x @ weight_t``), because MKL's fp32 GEMM
runs that layout 1.1-1.45x faster than ``F.linear``'s ``[out, in]`` at decode batch sizes (4 to
64 rows) and as fast at prefill sizes, and each RMSNorm's weight folded into the rows of the
projection that reads its output (``rmsnorm(x) * w @ W^T == rmsnorm_unit(x) @ (w[:, None] *
W^T)``), which spares a full pass over the activations per norm. The fold changes roundings
by about one float ulp, not the results: the engine's greedy tokens stay those of transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch
    import torch.nn.functional as F

from pagedkv import kernels

from ..kv_groups import (
    KVCacheGroup,
    StepTensors,
    group_block_table,
    group_slot_mapping,
    kv_cache_groups,
    layer_windows,
    plan_groups,
)
from .rope import RotaryEmbedding, context_length

__all__ = ["PagedCausalLM", "LlamaForCausalLM", "linear", "rope_rotate_half"]


def linear(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight_t (+ bias) (+ residual)``: the engine's one GEMM (every projection and the
    LM head).

    Args:
        x: ``[M, in_features]``, unit stride along the features (rows may be strided).
        weight_t: ``[in_features, out_features]``, contiguous (a transposed ``nn.Linear``
            weight; see the module docs for why this layout).
        bias: optional ``[out_features]``.
        residual: optional ``[M, out_features]`` that the product is added to *in place*
            (the GEMM accumulates into it, ``beta = 1``: no temporary and no separate pass
            for a residual add).

    Returns:
        ``[M, out_features]``: ``residual`` itself when given, else a fresh tensor.

    The model looks this function up at call time, so a benchmark can wrap it to time the
    engine's GEMMs (``benchmarks/engine_roofline.py`` does).
    """
    if residual is not None:
        residual.addmm_(x, weight_t)
        return residual if bias is None else residual.add_(bias)
    if bias is None:
        return torch.mm(x, weight_t)
    return torch.addmm(bias, x, weight_t)


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half convention (GPT-NeoX / transformers): ``x * cos + cat(-x2, x1) *
    sin`` for ``x`` ``[T, H, D]`` and ``cos``/``sin`` ``[T, 1, D]``; a fresh tensor.

    Written as ``x * cos`` then ``-= x2 * sin`` / ``+= x1 * sin`` per half: the same roundings
    as transformers' formula (bit-identical) with two fewer full-size temporaries."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    out[..., :half] -= x2 * sin[..., :half]
    out[..., half:] += x1 * sin[..., half:]
    return out


def _interleave_rotary_halves(weight_t: torch.Tensor, num_heads: int, head_size: int) -> torch.Tensor:
    """Reorder the output columns of ``num_heads`` leading heads of ``weight_t`` ``[in, out]``
    (or of a bias ``[out]``) from rotate-half order ``(x_0..x_{D/2-1}, x_{D/2}..x_{D-1})`` to
    pairs ``(x_0, x_{D/2}, x_1, x_{D/2+1}, ...)``, so that RoPE is one complex multiply per
    pair. Applied to q and k alike it leaves every q.k (hence attention) unchanged."""
    half = head_size // 2
    per_head = torch.arange(head_size).view(2, half).t().reshape(-1)  # 0, h, 1, h+1, ...
    cols = (torch.arange(num_heads)[:, None] * head_size + per_head).reshape(-1)
    rest = torch.arange(num_heads * head_size, weight_t.shape[-1])
    return weight_t.index_select(-1, torch.cat([cols, rest]).to(weight_t.device)).contiguous()


def _projection(weight: torch.Tensor, norm: torch.Tensor | None = None) -> torch.Tensor:
    """``nn.Linear`` weight ``[out, in]`` -> contiguous ``[in, out]`` for :func:`linear`, with an
    RMSNorm weight ``[in]`` folded into its rows (product taken in fp32, then cast back)."""
    w = weight.t()
    if norm is not None:
        w = (w.float() * norm.float()[:, None]).to(weight.dtype)
    return w.contiguous()


@dataclass
class _Layer:
    """Weights of one decoder layer in :func:`linear`'s layout ``[in, out]``: q/k/v and
    gate/up fused along the output dim, the input norm's weight folded into ``qkv`` and the
    post-attention norm's into ``gate_up``."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor


class PagedCausalLM:
    """What every model of the engine shares: the KV cache layout and sizes, the KV cache
    groups of its layers, and one layer's paged attention (cache write, then attention through
    its group's block table, window and plan).

    A subclass sets, before using these: ``num_layers``, ``num_heads``, ``num_kv_heads``,
    ``head_size``, ``dtype``, ``device`` and ``layer_windows`` (each layer's sliding window in
    tokens, ``None`` for full attention), then calls :meth:`_init_kv_groups`; and what the
    engine reads: ``config`` (the transformers config), ``vocab_size``, ``max_model_len``
    (tokens), ``rope`` (``length_dependent`` and ``prefix_cache_tag(num_prompt_tokens)``, as
    :class:`~pagedkv.engine.models.rope.RotaryEmbedding` has them) and :meth:`forward`.

    Attributes:
        layer_windows: each layer's sliding window, or ``None``.
        kv_groups: the :class:`~pagedkv.engine.kv_groups.KVCacheGroup` s (layers sharing a
            window, equal layer counts), in order of their first layer.
        layer_group: index into ``kv_groups`` of each layer's group.
        layer_slot: each layer's slot in the KV cache tensor (its index within its group).
        num_kv_slots: layer slots of the KV cache tensor (the largest group's layer count).
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    device: torch.device
    layer_windows: tuple[int | None, ...]
    config: Any
    vocab_size: int
    max_model_len: int
    rope: Any

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
        """Next-token fp32 logits ``[L, vocab_size]`` of the rows ``logits_indices`` of a flat
        token batch (see :meth:`LlamaForCausalLM.forward` for the arguments)."""
        raise NotImplementedError

    #: Whether a model with sliding-window layers gets one block table per KV cache group (a
    #: ``pagedkv.KVCacheManager`` of one group per KV cache group, blocks behind a window
    #: released). ``False`` (set on the class before building a model) gives it one block table
    #: for every layer instead (the manager's one full-attention group: the full-attention
    #: allocation, for comparisons).
    per_group_tables: bool = True

    def _init_kv_groups(self) -> None:
        hybrid = self.is_hybrid
        self.kv_groups: tuple[KVCacheGroup, ...] = kv_cache_groups(self.layer_windows, split=hybrid)
        group, slot = [0] * self.num_layers, list(range(self.num_layers))
        for g, grp in enumerate(self.kv_groups):
            for j, li in enumerate(grp.layers):
                group[li] = g
                if hybrid:  # slot j of the group's pages; one table: every layer its own slot
                    slot[li] = j
        self.layer_group: tuple[int, ...] = tuple(group)
        self.layer_slot: tuple[int, ...] = tuple(slot)
        self.num_kv_slots = max(len(g.layers) for g in self.kv_groups) if hybrid else self.num_layers

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer has a sliding window (and :attr:`per_group_tables`): the engine
        then drives a ``pagedkv.KVCacheManager`` of one group per KV cache group (one block
        table each) and the windowed groups' blocks behind the window are released."""
        return self.per_group_tables and any(w is not None for w in self.layer_windows)

    # ---- KV cache ----------------------------------------------------------------------------

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """``(num_kv_slots, 2, num_blocks, block_size, num_kv_heads, head_size)``."""
        return (self.num_kv_slots, 2, num_blocks, block_size, self.num_kv_heads, self.head_size)

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V take in one layer (``2 * num_kv_heads * head_size * dtype
        bytes``)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_kv_heads * self.head_size * elem

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block occupies, K and V, in every layer slot (all layers of a model with
        one KV cache group; one group's layers of a hybrid model)."""
        return self.num_kv_slots * block_size * self.kv_bytes_per_token()

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, *, device: Any = None, pin_memory: bool = False
    ) -> torch.Tensor:
        """A zeroed KV cache tensor (see the module docs for the layout)."""
        dev = torch.device(device) if device is not None else self.device
        return torch.zeros(
            self.kv_cache_shape(num_blocks, block_size),
            dtype=self.dtype,
            device=dev,
            pin_memory=pin_memory and dev.type == "cpu" and torch.cuda.is_available(),
        )

    # ---- attention ---------------------------------------------------------------------------

    def plan_attention(
        self, meta: StepTensors, cache_shape: tuple[int, ...]
    ) -> tuple[kernels.AttentionPlan | None, ...]:
        """The step's attention plans for the torch reference attention, one per KV cache group
        (``plans`` of :meth:`forward`; :func:`pagedkv.engine.kv_groups.plan_groups`).
        ``cache_shape``: the per-layer cache shape ``(num_blocks, block_size, num_kv_heads,
        head_size)``."""
        return plan_groups(self.kv_groups, meta, cache_shape=cache_shape, num_q_heads=self.num_heads)

    def _group_inputs(
        self, meta: StepTensors, plans: Sequence[kernels.AttentionPlan | None] | None
    ) -> tuple[tuple[kernels.AttentionPlan | None, torch.Tensor, torch.Tensor], ...] | None:
        """Per KV cache group of the model, ``(plan, block table, slot mapping)`` of this step
        (the plan None without ``plans``; one table and slot mapping for all groups or one per
        group, see :func:`~pagedkv.engine.kv_groups.group_block_table`), read once per forward
        pass rather than once per layer; None for the virtual layout's steps (no block
        table)."""
        if getattr(meta, "contiguous_attend", None) is not None:
            return None
        if plans is not None:  # the group's plan holds the group's table (and slots)
            return tuple(
                (None, group_block_table(meta, g), group_slot_mapping(meta, g))  # a state group: no plan
                if p is None
                else (p, p.block_table, p.slot_mapping if p.slot_mapping is not None else group_slot_mapping(meta, g))
                for g, p in enumerate(plans)
            )
        return tuple(
            (None, group_block_table(meta, g), group_slot_mapping(meta, g)) for g in range(len(self.kv_groups))
        )

    def _attend(
        self,
        li: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: StepTensors,
        softmax_scale: float,
        inputs: Sequence[tuple[kernels.AttentionPlan | None, torch.Tensor, torch.Tensor]] | None,
    ) -> torch.Tensor:
        """Layer ``li``: write ``k``/``v`` ``[T, num_kv_heads, head_size]`` at its group's slots,
        then attend ``q`` ``[T, num_heads, head_size]`` over its group's block table and window
        (``inputs``: :meth:`_group_inputs` of the step, the group's plan when there is one).
        Returns ``[T, num_heads, head_size]``."""
        if inputs is None:  # the virtual KV layout: contiguous K/V, no block table
            return meta.contiguous_attend(li, q, k, v, softmax_scale)  # type: ignore[attr-defined, no-any-return]
        slot = self.layer_slot[li]
        key_cache, value_cache = kv_cache[slot, 0], kv_cache[slot, 1]
        plan, table, slots = inputs[self.layer_group[li]]
        kernels.reshape_and_cache(k, v, key_cache, value_cache, slots, plan=plan)
        return kernels.paged_attention(
            q,
            key_cache,
            value_cache,
            table,
            meta.seq_lens,
            meta.query_start_loc,
            softmax_scale=softmax_scale,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            sliding_window=self.layer_windows[li],
            plan=plan,
        )


class LlamaForCausalLM(PagedCausalLM):
    """A Llama-family causal LM whose attention reads and writes a paged KV cache.

    Plain tensors, no ``nn.Module``: inference only. Construct with :meth:`from_hf`.

    Attributes:
        config: the transformers config.
        num_layers, num_heads, num_kv_heads, head_size, vocab_size: model sizes.
        max_model_len: context length in tokens (``max_position_embeddings``; times the
            scaling factor for ``dynamic`` RoPE, see :func:`pagedkv.engine.models.rope.context_length`).
        rope: the :class:`~pagedkv.engine.models.rope.RotaryEmbedding` (cos/sin tables; per-token
            frequencies for the length-dependent ``dynamic`` / ``longrope`` types).
        dtype, device: of weights, activations and the KV cache.
    """

    def __init__(
        self, config: Any, weights: dict[str, torch.Tensor], *, device: Any = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        """Build from a transformers config and a state dict named as in transformers'
        ``LlamaForCausalLM`` (``model.layers.{i}.self_attn.q_proj.weight``...). Weights are
        moved to ``device``/``dtype``; q/k/v and gate/up projections are fused (fewer GEMMs).

        Raises:
            KeyError: a required weight is missing (names it).
            ValueError: a RoPE type transformers does not know (names it).
            EngineConfigError: a layer attention type the engine does not implement (see
                :func:`pagedkv.engine.kv_groups.layer_windows`).
        """
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = int(config.num_hidden_layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_size = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = context_length(config)
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_size**-0.5
        # Per layer: Mistral windows every layer, Qwen2 the layers from max_window_layers on.
        self.layer_windows = layer_windows(config)
        self._init_kv_groups()

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return weights[name].to(device=self.device, dtype=dtype)

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        self.embed = w("model.embed_tokens.weight")
        self.layers: list[_Layer] = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            biases = [opt(a + f"{x}_proj.bias") for x in "qkv"]
            self.layers.append(
                _Layer(
                    qkv=_projection(
                        torch.cat([w(a + f"{x}_proj.weight") for x in "qkv"]), w(p + "input_layernorm.weight")
                    ),
                    qkv_bias=torch.cat([b for b in biases if b is not None])
                    if all(b is not None for b in biases)
                    else None,  # Qwen2 has q/k/v biases
                    o=_projection(w(a + "o_proj.weight")),
                    o_bias=opt(a + "o_proj.bias"),
                    gate_up=_projection(
                        torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                        w(p + "post_attention_layernorm.weight"),
                    ),
                    down=_projection(w(p + "mlp.down_proj.weight")),
                )
            )
        # fp32: RoPE as one in-place complex multiply (see _rope_complex), for which q and k
        # heads are stored with their rotary halves interleaved. Other dtypes (complex32 is
        # barely supported) keep transformers' rotate-half layout.
        self.interleaved_rope = dtype == torch.float32 and self.head_size % 2 == 0
        if self.interleaved_rope:
            qk_heads = self.num_heads + self.num_kv_heads
            for layer in self.layers:
                layer.qkv = _interleave_rotary_halves(layer.qkv, qk_heads, self.head_size)
                if layer.qkv_bias is not None:
                    layer.qkv_bias = _interleave_rotary_halves(layer.qkv_bias, qk_heads, self.head_size)
        self.norm = w("model.norm.weight")
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in weights
        # The LM head in linear()'s layout. A tied head is a transposed copy of the embedding
        # (the gather needs the [vocab, hidden] rows) on the CPU, where the layout pays; on other
        # devices a tied head stays the embedding itself, run through F.linear (no second copy).
        head = self.embed if tied else w("lm_head.weight")
        transpose_head = not tied or self.device.type == "cpu"
        self.lm_head_t: torch.Tensor | None = _projection(head) if transpose_head else None
        self.lm_head: torch.Tensor | None = None if transpose_head else head
        # cos/sin for every position, computed exactly as transformers does (fp32, then cast).
        self.rope = RotaryEmbedding(config, self.head_size, self.max_model_len, device=self.device, dtype=dtype)
        self.cos, self.sin = self.rope.cos, self.rope.sin
        # cos + i sin of every position's rotary pairs (both halves of cos/sin are equal).
        self.rope_cis = self._cis(self.cos, self.sin) if self.interleaved_rope else None

    @classmethod
    def from_hf(cls, hf_model: Any, *, device: Any = "cpu", dtype: torch.dtype | None = None) -> LlamaForCausalLM:
        """Build from a loaded transformers causal LM (shares its tensors when device and dtype
        match). ``dtype`` defaults to the model's."""
        sd = hf_model.state_dict()
        return cls(hf_model.config, sd, device=device, dtype=dtype or next(iter(sd.values())).dtype)

    # ---- forward -----------------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        # RMSNorm (Zhang & Sennrich 2019) in fp32 like transformers' LlamaRMSNorm; ``weight``
        # None when it is folded into the next projection.
        if x.dtype == torch.float32:
            if weight is not None:
                return F.rms_norm(x, x.shape[-1:], weight, self.eps)
            # Two passes over x (a norm, then one scale) instead of rms_norm's four on CPU;
            # the mean square comes from the norm, about one ulp from transformers' x.pow(2).mean().
            ms: torch.Tensor = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1])
            return x * ms.add_(self.eps).rsqrt_()
        xf = x.float()
        xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return xf if weight is None else weight * xf

    _rope = staticmethod(rope_rotate_half)

    @staticmethod
    def _cis(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """complex64 ``cos + i sin`` of the rotary pairs from ``[..., D]`` rotate-half tables."""
        half = cos.shape[-1] // 2
        return torch.complex(cos[..., :half].float().contiguous(), sin[..., :half].float().contiguous())

    @staticmethod
    def _rope_complex(x: torch.Tensor, cis: torch.Tensor) -> None:
        # x: [T, H, D] fp32 with interleaved rotary pairs (a view into the QKV output, fresh
        # each layer), rotated in place: (x1 + i x2) * (cos + i sin) gives transformers'
        # x1 cos - x2 sin and x2 cos + x1 sin in one pass, no temporaries.
        xc = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
        xc.mul_(cis)

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
            meta: this step's kernel inputs (block tables, lengths, slot mappings): a
                :class:`~pagedkv.tensors.BatchTensors` of one table for every KV cache group
                (a manager of one group) or of one per group.
            logits_indices: int64 ``[L]`` rows of the batch whose logits are wanted (the last
                scheduled token of each sequence that samples this step).
            rope_lens: int64 ``[T]`` rope length of each token (any device;
                :func:`pagedkv.engine.models.rope.rope_lengths`), which picks its RoPE frequencies;
                needed only when ``self.rope.length_dependent``, ignored otherwise.
            plans: :meth:`plan_attention`'s plans (one per KV cache group) for the torch
                reference attention; default ``meta.attn_plan`` where ``meta`` has one, else
                none (each attention call plans for itself; what the Triton kernel wants).

        Returns:
            fp32 ``[L, vocab_size]`` logits.

        Raises:
            ValueError: ``rope_lens`` missing or misshaped for a length-dependent RoPE type.
        """
        t = input_ids.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        inputs = self._group_inputs(meta, plans if plans is not None else getattr(meta, "attn_plan", None))
        cis = None
        if self.rope.length_dependent:
            cos, sin = self.rope.lookup(positions, rope_lens)
            if self.interleaved_rope:
                cis = self._cis(cos, sin)
        elif self.rope_cis is not None:  # the common case: one gather from a precomputed table
            cis = self.rope_cis[positions]
        else:
            cos, sin = self.cos[positions], self.sin[positions]
        if cis is not None:
            cis = cis.unsqueeze(1)  # [T, 1, D/2]
        else:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
        x = self.embed[input_ids]  # [T, hidden]
        for li, layer in enumerate(self.layers):
            qkv = linear(self._rms_norm(x), layer.qkv, layer.qkv_bias)  # input norm's weight folded in
            qk, v = qkv.split([(hq + hkv) * d, hkv * d], dim=-1)
            qk = qk.view(t, hq + hkv, d)
            if cis is not None:
                self._rope_complex(qk, cis)  # q and k heads in one go, in place
            else:
                qk = self._rope(qk, cos, sin)
            q, k = qk.split([hq, hkv], dim=1)
            o = self._attend(li, q, k, v.reshape(t, hkv, d), kv_cache, meta, self.scale, inputs)
            # x is this forward's own tensor (from the embedding gather): the residual adds are
            # the GEMMs' own accumulation into it, and SwiGLU runs in place in the gate half of
            # the gate/up output (no fresh [T, *] buffers: page faults at large T).
            linear(o.view(t, hq * d), layer.o, layer.o_bias, residual=x)
            gate, up = linear(self._rms_norm(x), layer.gate_up).chunk(2, dim=-1)  # post-norm weight folded in
            linear(F.silu(gate, inplace=True).mul_(up), layer.down, residual=x)
        x = self._rms_norm(x[logits_indices], self.norm)
        if self.lm_head_t is not None:
            return linear(x, self.lm_head_t).float()
        assert self.lm_head is not None  # a tied head off the CPU: the embedding itself
        return F.linear(x, self.lm_head).float()
