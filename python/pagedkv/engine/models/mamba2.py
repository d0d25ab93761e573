"""pagedkv's own Mamba-2 mixer (state-space duality layer), a recurrent torch reference.

One mixer layer maps a sequence's new tokens ``x`` ``[q, hidden]`` (already normed) to
``[q, hidden]``, carrying a *recurrent state* from one step to the next instead of K/V:

- ``in_proj`` splits each token into a gate ``z`` ``[I]``, the convolution input ``xBC``
  ``[I + 2 G N]`` and the time step ``dt`` ``[H]`` (``I = H * P``: ``H`` heads of ``P``
  channels; ``G`` groups of ``N``-dimensional B/C, each shared by ``H / G`` heads);
- a depthwise causal convolution of width ``K`` over ``xBC`` then SiLU: its *conv state* is the
  last ``K - 1`` inputs ``[K - 1, I + 2 G N]`` (zeros before the first token);
- the selective scan per head ``h``: ``dt = max(softplus(dt + dt_bias), dt_min)``,
  ``S_h <- exp(dt A_h) S_h + dt x_h B^T`` (the *SSM state* ``S`` ``[H, P, N]``,
  ``A = -exp(A_log)``), ``y_h = S_h C + D_h x_h``;
- ``y * silu(z)``, an RMS norm over each of ``G`` channel groups (weight ``[I]``), ``out_proj``.

The scan runs token by token (the recurrence itself, no chunked form): exact and simple, and
fast enough for the small models the engine's tests serve on the CPU. The state of one layer
is :attr:`Mamba2Weights.state_numel` numbers, the conv state then the SSM state, flattened;
:mod:`pagedkv.engine.state_pages` keeps it in a page of the paged pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch
    import torch.nn.functional as F

from ..errors import EngineConfigError

__all__ = ["Mamba2Weights", "mamba2_mix"]


@dataclass
class Mamba2Weights:
    """One Mamba-2 mixer's weights and sizes (see the module docs for the symbols).

    Attributes:
        in_proj: ``[hidden, I + conv_dim + H]`` (transposed for ``x @ in_proj``).
        in_bias, out_bias: optional biases of the two projections.
        conv_weight: ``[conv_dim, K]``; conv_bias: ``[conv_dim]`` or ``None``.
        dt_bias, neg_a, d: fp32 ``[H]`` (``neg_a = -exp(A_log)``).
        norm: the grouped RMS norm's weight ``[I]``; eps: its epsilon.
        out_proj: ``[I, hidden]``.
        num_heads, head_dim, num_groups, state_size, conv_kernel: ``H, P, G, N, K``.
        dt_min: the lower clamp of the time step (``time_step_limit[0]`` of the config).
    """

    in_proj: torch.Tensor
    in_bias: torch.Tensor | None
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor
    neg_a: torch.Tensor
    d: torch.Tensor
    norm: torch.Tensor
    eps: float
    out_proj: torch.Tensor
    out_bias: torch.Tensor | None
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    dt_min: float

    @property
    def inner(self) -> int:
        """``I = H * P``: channels of the scan."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: ``I + 2 G N``."""
        return self.inner + 2 * self.num_groups * self.state_size

    @property
    def conv_numel(self) -> int:
        """Numbers in the conv state: ``(K - 1) * conv_dim``."""
        return (self.conv_kernel - 1) * self.conv_dim

    @property
    def state_numel(self) -> int:
        """Numbers in the layer's whole recurrent state: conv state + SSM state ``H P N``."""
        return self.conv_numel + self.num_heads * self.head_dim * self.state_size

    @classmethod
    def from_state_dict(
        cls, config: Any, weights: dict[str, torch.Tensor], prefix: str, *, device: Any, dtype: torch.dtype
    ) -> Mamba2Weights:
        """The mixer under ``prefix`` (``model.layers.{i}.mixer.``) of a transformers state dict
        whose config names ``mamba_num_heads``, ``mamba_head_dim``, ``n_groups``,
        ``ssm_state_size``, ``conv_kernel``, ``layer_norm_epsilon`` and ``time_step_limit``.

        Raises:
            KeyError: a weight is missing (names it).
            EngineConfigError: an activation other than SiLU, or heads not divisible by groups.
        """

        def w(name: str, *, fp32: bool = False) -> torch.Tensor:
            if prefix + name not in weights:
                raise KeyError(f"weight {prefix + name!r} missing from the checkpoint")
            return weights[prefix + name].to(device=device, dtype=torch.float32 if fp32 else dtype)

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if prefix + name in weights else None

        act = getattr(config, "mamba_hidden_act", "silu")
        if act != "silu":
            raise EngineConfigError(f"Mamba-2 mixer activation {act!r} is not implemented (only 'silu')")
        heads, groups = int(config.mamba_num_heads), int(config.n_groups)
        if heads % groups:
            raise EngineConfigError(f"mamba_num_heads={heads} is not a multiple of n_groups={groups}")
        limit = getattr(config, "time_step_limit", (0.0, float("inf"))) or (0.0, float("inf"))
        return cls(
            in_proj=w("in_proj.weight").t().contiguous(),
            in_bias=opt("in_proj.bias"),
            conv_weight=w("conv1d.weight").squeeze(1).contiguous(),
            conv_bias=opt("conv1d.bias"),
            dt_bias=w("dt_bias", fp32=True),
            neg_a=-torch.exp(w("A_log", fp32=True)),
            d=w("D", fp32=True),
            norm=w("norm.weight"),
            eps=float(config.layer_norm_epsilon),
            out_proj=w("out_proj.weight").t().contiguous(),
            out_bias=opt("out_proj.bias"),
            num_heads=heads,
            head_dim=int(config.mamba_head_dim),
            num_groups=groups,
            state_size=int(config.ssm_state_size),
            conv_kernel=int(config.conv_kernel),
            dt_min=max(float(limit[0]), float(getattr(config, "time_step_min", 0.0) or 0.0)),
        )


def mamba2_mix(m: Mamba2Weights, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Run sequences' new tokens through the mixer, updating their recurrent states in place.

    Args:
        m: the mixer.
        x: ``[q, hidden]`` one sequence's new tokens (normed), ``q >= 1``; or ``[B, q, hidden]``,
            ``B`` sequences of ``q`` new tokens each (decodes: ``q = 1``).
        state: ``[m.state_numel]`` the layer's state after the sequence's previous tokens (all
            zeros before its first token): the conv state ``[K - 1, conv_dim]`` then the SSM
            state ``[H, P, N]``, flattened; ``[B, m.state_numel]`` for a batch (rows may be
            strided, elements of a row contiguous). Overwritten with the state after the new
            tokens (stored in its dtype; the scan runs in fp32).

    Returns:
        ``x``'s shape, ``hidden`` features, in ``x``'s dtype.
    """
    if x.dim() == 2:
        return _mix(m, x[None], state[None])[0]
    return _mix(m, x, state)


def _mix(m: Mamba2Weights, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """:func:`mamba2_mix` of ``B`` sequences: ``x`` ``[B, q, hidden]``, ``state`` ``[B, numel]``."""
    bsz, q = x.shape[0], x.shape[1]
    h, p, g, n, k = m.num_heads, m.head_dim, m.num_groups, m.state_size, m.conv_kernel
    inner, conv_dim = m.inner, m.conv_dim
    proj = x @ m.in_proj if m.in_bias is None else x @ m.in_proj + m.in_bias
    gate, xbc, dt = proj.split([inner, conv_dim, h], dim=-1)

    # Depthwise causal convolution over (previous K - 1 inputs, new inputs).
    conv_state = state[:, : m.conv_numel].unflatten(1, (k - 1, conv_dim))
    window = torch.cat([conv_state.to(xbc.dtype), xbc], dim=1)  # [B, K - 1 + q, conv_dim]
    taps = window.unfold(1, k, 1)  # [B, q, conv_dim, K]: token t sees inputs t .. t + K - 1
    conv = (taps * m.conv_weight).sum(-1)
    if m.conv_bias is not None:
        conv = conv + m.conv_bias
    conv = F.silu(conv)
    conv_state.copy_(window[:, q:].to(state.dtype))

    xs, b, c = conv.float().split([inner, g * n, g * n], dim=-1)
    xs = xs.unflatten(-1, (h, p))  # [B, q, H, P]
    per_group = h // g
    b = b.unflatten(-1, (g, n)).repeat_interleave(per_group, dim=2)  # [B, q, H, N]: head h reads group h // (H/G)
    c = c.unflatten(-1, (g, n)).repeat_interleave(per_group, dim=2)
    step = F.softplus(dt.float() + m.dt_bias).clamp(min=m.dt_min)  # [B, q, H]
    decay = torch.exp(step * m.neg_a)

    ssm_view = state[:, m.conv_numel :].unflatten(1, (h, p, n))
    s = ssm_view.float()
    ys = []
    for t in range(q):
        s = s * decay[:, t, :, None, None] + (step[:, t, :, None] * xs[:, t])[..., None] * b[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", s, c[:, t]))
    ssm_view.copy_(s.to(state.dtype))
    y = torch.stack(ys, dim=1) + m.d[:, None] * xs  # [B, q, H, P]

    # Gate, then RMS norm per channel group, then the output projection.
    y = y.reshape(bsz, q, inner) * F.silu(gate.float())
    grouped = y.unflatten(-1, (g, inner // g))
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + m.eps)
    y = m.norm * grouped.flatten(-2).to(x.dtype)
    out: torch.Tensor = y @ m.out_proj
    return out if m.out_bias is None else out + m.out_bias
