"""pagedkv's own forward pass of Nemotron-H, a state-space hybrid: Mamba-2 layers carrying a
recurrent state, a few attention layers over the paged KV cache, and MLP layers.

Architecture (transformers' ``NemotronHForCausalLM``): token embedding -> N x [RMSNorm -> one
mixer -> residual] -> RMSNorm -> LM head, each layer's mixer given by ``config.layer_types``:

- ``"linear_attention"``: a Mamba-2 mixer (:mod:`pagedkv.engine.models.mamba2`);
- ``"full_attention"``: grouped-query attention without positional encoding (no RoPE), scale
  ``head_dim ** -0.5``, through the paged attention of
  :class:`~pagedkv.engine.models.model.PagedCausalLM`;
- ``"mlp"``: ``down(relu(up(x)) ** 2)``.
(``"moe"`` layers are refused.)

KV cache groups (:mod:`pagedkv.engine.kv_groups`): the attention layers form full-attention
groups, the Mamba-2 layers *state* groups (:attr:`KVCacheGroup.kind` ``"state"``, a manager
group of kind ``"state"``), all of equal layer counts and pages; MLP layers hold nothing. A
state group's block holds, in its page, the conv and SSM state of each of its layers
(:mod:`pagedkv.engine.state_pages`, layer slot ``j`` at offset ``j * state_numel``). Per step,
after the runner applied the manager's copy rows (a state moved to a new live block, or copied
from a prefix hit) and zero rows (a fresh state), each scheduled sequence's live block
``block_tables[g, s, (seq_len - 1) // block_size]`` is read, every Mamba-2 layer of the group
scans the sequence's new tokens from it, and the updated state is written back in place; the
engine then commits the step (``manager.commit_computed``), which publishes states that ended
at an aligned prefix to the prefix cache.

The numbers follow transformers' model op for op where it matters for greedy tokens (fp32
norms, the same gated grouped norm); the scan is the recurrence (transformers' prefill uses the
chunked form), which differs by float roundings only. The time step is clamped below at
``time_step_min`` in every step, as transformers' multi-token scan does (its one-token decode
does not clamp: the two agree where no time step falls below the floor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch
    import torch.nn.functional as F

from pagedkv import kernels

from ..errors import EngineConfigError
from ..kv_groups import STATE, KVCacheGroup, StepTensors, layers_per_group
from ..state_pages import live_state_blocks, page_numel, read_pages, write_pages
from .gemma3 import StaticRope
from .mamba2 import Mamba2Weights, mamba2_mix
from .model import PagedCausalLM, linear
from .rope import context_length

__all__ = ["NemotronHForCausalLM"]

MAMBA = "linear_attention"
ATTENTION = "full_attention"
MLP = "mlp"


class NemotronHForCausalLM(PagedCausalLM):
    """Nemotron-H whose attention layers use the paged KV cache and whose Mamba-2 layers keep
    their recurrent state in state blocks of the same pool (see the module docs).

    Plain tensors, no ``nn.Module``: inference only. Construct with :meth:`from_hf`.

    Attributes:
        config: the transformers config (``NemotronHConfig``).
        layer_kinds: each layer's mixer, ``"linear_attention"`` / ``"full_attention"`` / ``"mlp"``.
        num_layers, num_heads, num_kv_heads, head_size, vocab_size, hidden_size: model sizes.
        max_model_len: context length in tokens (``max_position_embeddings``).
        kv_groups, layer_group, layer_slot, num_kv_slots: see
            :class:`~pagedkv.engine.models.model.PagedCausalLM` (an MLP layer's entries are 0:
            it is in no group).
        state_numel: numbers of one Mamba-2 layer's state; state_bytes: bytes of a state
            group's state (its layers' states, in the cache's dtype).
        rope: no RoPE (:class:`~pagedkv.engine.models.gemma3.StaticRope`).
        dtype, device: of weights, activations and the KV cache.
    """

    def __init__(
        self, config: Any, weights: dict[str, torch.Tensor], *, device: Any = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        """Build from a transformers Nemotron-H config and a state dict named as in
        transformers' ``NemotronHForCausalLM``. Weights are moved to ``device``/``dtype``.

        Raises:
            KeyError: a required weight is missing (names it).
            EngineConfigError: a configuration this implementation does not cover: a ``"moe"``
                or unknown layer type, a sliding window, an MLP activation other than
                ``relu2``, a Mamba-2 activation other than SiLU (the message names it), or no
                attention layer (the pool's page is an attention layer's).
        """
        kinds = tuple(str(k) for k in config.layer_types)
        for i, kind in enumerate(kinds):
            if kind not in (MAMBA, ATTENTION, MLP):
                raise EngineConfigError(
                    f"Nemotron-H layer {i} has type {kind!r}, which the engine does not implement "
                    f"(it implements {MAMBA!r}, {ATTENTION!r} and {MLP!r})"
                )
        if ATTENTION not in kinds:
            raise EngineConfigError("Nemotron-H config without a full_attention layer is not implemented")
        if getattr(config, "sliding_window", None) is not None:
            raise EngineConfigError(f"Nemotron-H config sets sliding_window={config.sliding_window!r}, not implemented")
        if MLP in kinds and getattr(config, "mlp_hidden_act", "relu2") != "relu2":
            raise EngineConfigError(f"Nemotron-H mlp_hidden_act={config.mlp_hidden_act!r} is not implemented (relu2)")
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.layer_kinds = kinds
        self.num_layers = len(kinds)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_size = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = context_length(config)
        self.eps = float(config.layer_norm_epsilon)
        self.scale = self.head_size**-0.5
        self.layer_windows = tuple(None for _ in kinds)  # attention layers: full attention
        self.rope = StaticRope()

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return weights[name].to(device=self.device, dtype=dtype)

        def opt_bias(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        self.embed = w("model.embeddings.weight")
        self.norms = [w(f"model.layers.{i}.norm.weight").float().contiguous() for i in range(self.num_layers)]
        self.mixers: list[Any] = []
        for i, kind in enumerate(kinds):
            p = f"model.layers.{i}.mixer."
            if kind == MAMBA:
                self.mixers.append(Mamba2Weights.from_state_dict(config, weights, p, device=self.device, dtype=dtype))
            elif kind == ATTENTION:
                qkv = torch.cat([w(p + f"{x}_proj.weight") for x in "qkv"]).t().contiguous()
                self.mixers.append((qkv, w(p + "o_proj.weight").t().contiguous()))
            else:
                self.mixers.append(
                    (
                        w(p + "up_proj.weight").t().contiguous(),
                        opt_bias(p + "up_proj.bias"),
                        w(p + "down_proj.weight").t().contiguous(),
                        opt_bias(p + "down_proj.bias"),
                    )
                )
        self.final_norm = w("model.norm_f.weight").float().contiguous()
        tied = bool(getattr(config, "tie_word_embeddings", False)) or "lm_head.weight" not in weights
        self.lm_head = self.embed if tied else w("lm_head.weight")
        mamba = [m for m in self.mixers if isinstance(m, Mamba2Weights)]
        self.state_numel = mamba[0].state_numel if mamba else 0
        self._init_kv_groups()
        elem = torch.tensor([], dtype=dtype).element_size()
        self.state_bytes = max((len(g.layers) for g in self.kv_groups if g.is_state), default=0) * (
            self.state_numel * elem
        )

    @classmethod
    def from_hf(cls, hf_model: Any, *, device: Any = "cpu", dtype: torch.dtype | None = None) -> NemotronHForCausalLM:
        """Build from a loaded transformers ``NemotronHForCausalLM`` (shares its tensors when
        device and dtype match). ``dtype`` defaults to the model's."""
        sd = hf_model.state_dict()
        return cls(hf_model.config, sd, device=device, dtype=dtype or next(iter(sd.values())).dtype)

    # ---- KV cache groups ---------------------------------------------------------------------

    def _init_kv_groups(self) -> None:
        """Attention layers and Mamba-2 layers in groups of equal layer counts (of
        :func:`~pagedkv.engine.kv_groups.layers_per_group`), in order of their first layer."""
        cached = [(i, k) for i, k in enumerate(self.layer_kinds) if k != MLP]
        size = layers_per_group([0 if k == ATTENTION else 1 for _, k in cached])
        groups: list[KVCacheGroup] = []
        for kind in (ATTENTION, MAMBA):
            layers = [i for i, k in cached if k == kind]
            for at in range(0, len(layers), size):
                part = tuple(layers[at : at + size])
                groups.append(KVCacheGroup(None, part, STATE) if kind == MAMBA else KVCacheGroup(None, part))
        self.kv_groups = tuple(sorted(groups, key=lambda g: g.layers[0]))
        group, slot = [0] * self.num_layers, [0] * self.num_layers
        for g, grp in enumerate(self.kv_groups):
            for j, li in enumerate(grp.layers):
                group[li], slot[li] = g, j
        self.layer_group = tuple(group)
        self.layer_slot = tuple(slot)
        self.num_kv_slots = max(len(g.layers) for g in self.kv_groups)

    @property
    def is_hybrid(self) -> bool:
        """Always: the model's state groups need a manager group each (one block table each)."""
        return True

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one block's page (see :class:`PagedCausalLM`).

        Raises:
            EngineConfigError: a state group's state does not fit one page of ``block_size``
                tokens (names the state's bytes and the smallest block size that fits).
        """
        page = super().kv_bytes_per_block(block_size)
        if self.state_bytes > page:
            per_token = self.num_kv_slots * self.kv_bytes_per_token()
            need = -(-self.state_bytes // per_token)
            raise EngineConfigError(
                f"block_size={block_size} is too small for this model: a state block holds "
                f"{self.state_bytes} bytes of Mamba-2 state but a page of {block_size} tokens has "
                f"{page} bytes; use block_size >= {need}"
            )
        return page

    # ---- forward -----------------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # fp32 x * rsqrt(mean(x^2) + eps), times the fp32 weight, cast back.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (weight * h).to(x.dtype)

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
        plans: Sequence[kernels.AttentionPlan | None] | None = None,
    ) -> torch.Tensor:
        """Run the flat token batch and return next-token logits for selected tokens.

        Args:
            input_ids: int64 ``[T]`` token ids of the scheduled tokens, sequence after sequence.
            positions: int64 ``[T]`` positions (unused: no RoPE; the state carries the order).
            kv_cache: ``[num_kv_slots, 2, num_blocks, block_size, num_kv_heads, head_size]``:
                attention layers write their K/V at their group's slot mapping, each state
                group's live blocks are read and rewritten (in place).
            meta: this step's kernel inputs, one block table and slot mapping per group (after
                the step's copies and zeroing were applied to ``kv_cache``).
            logits_indices: int64 ``[L]`` rows of the batch whose logits are wanted.
            rope_lens: unused; accepted for the runner's call.
            plans: :meth:`plan_attention`'s plans, one per group (``None`` for a state group).

        Returns:
            fp32 ``[L, vocab_size]`` logits.
        """
        del positions, rope_lens
        inputs = self._group_inputs(meta, plans if plans is not None else getattr(meta, "attn_plan", None))
        assert inputs is not None, "Nemotron-H runs on the paged layout only"
        t = input_ids.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        qsl = [int(v) for v in meta.query_start_loc_host]
        seq_lens = torch.as_tensor(meta.context_lens_host).long() + torch.diff(torch.as_tensor(qsl))
        block_size = int(kv_cache.shape[3])
        states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # group -> (live blocks, pages)
        for g, grp in enumerate(self.kv_groups):
            if grp.is_state:
                blocks = live_state_blocks(inputs[g][1], seq_lens.to(inputs[g][1].device), block_size)
                assert bool((blocks > 0).all()), "a scheduled sequence without a live state block"
                states[g] = (blocks, read_pages(kv_cache, blocks))
        numel = self.state_numel
        assert not states or numel * self.num_kv_slots <= page_numel(kv_cache)
        one = [s for s in range(len(qsl) - 1) if qsl[s + 1] - qsl[s] == 1]
        longer = [s for s in range(len(qsl) - 1) if qsl[s + 1] - qsl[s] > 1]
        decodes = torch.tensor(one, dtype=torch.int64, device=kv_cache.device)
        decode_rows = torch.tensor([qsl[s] for s in one], dtype=torch.int64, device=kv_cache.device)
        x = self.embed[input_ids]  # [T, hidden]
        for li, (kind, mixer) in enumerate(zip(self.layer_kinds, self.mixers)):
            h = self._norm(x, self.norms[li])
            if kind == MAMBA:
                pages = states[self.layer_group[li]][1]
                at = self.layer_slot[li] * numel
                out = torch.empty_like(x)
                if decodes.numel():  # every one-token sequence in one batched scan step
                    rows = pages[decodes, at : at + numel]
                    out[decode_rows] = mamba2_mix(mixer, h[decode_rows, None], rows)[:, 0]
                    pages[decodes, at : at + numel] = rows
                for s in longer:
                    out[qsl[s] : qsl[s + 1]] = mamba2_mix(mixer, h[qsl[s] : qsl[s + 1]], pages[s, at : at + numel])
            elif kind == ATTENTION:
                qkv_t, o_t = mixer
                q, k, v = linear(h, qkv_t).split([hq * d, hkv * d, hkv * d], dim=-1)
                o = self._attend(
                    li,
                    q.reshape(t, hq, d),
                    k.reshape(t, hkv, d),
                    v.reshape(t, hkv, d),
                    kv_cache,
                    meta,
                    self.scale,
                    inputs,
                )
                out = linear(o.reshape(t, hq * d), o_t)
            else:
                up, up_b, down, down_b = mixer
                out = linear(torch.relu(linear(h, up, up_b)).square(), down, down_b)
            x = x + out
        for blocks, pages in states.values():
            write_pages(kv_cache, blocks, pages)
        x = self._norm(x[logits_indices], self.final_norm)
        return F.linear(x, self.lm_head).float()
