"""Model runner of the virtual KV layout (``kv_layout="virtual"``): the same step inputs as
:class:`~pagedkv.engine.runner.ModelRunner` (token ids, positions, lengths from
:meth:`pagedkv.tensors.BatchTensors.from_steps`), but each layer writes and reads K/V in the
sequence's contiguous range of a :class:`~pagedkv.engine.virtual.layout.VirtualKVLayout`; no
block table reaches the attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

import pagedkv
from pagedkv.tensors import BatchTensors, BlockTable

from ..models.model import PagedCausalLM
from ..models.rope import rope_lengths
from ..scheduler import ScheduledBatch
from .layout import VirtualKVLayout

__all__ = ["VirtualModelRunner", "ContiguousStep"]


@dataclass
class ContiguousStep:
    """The attention inputs of one step on the virtual layout: what the model's attention reads
    (``meta`` of :meth:`PagedCausalLM.forward`; it calls :meth:`contiguous_attend` per layer).

    Attributes:
        layout: the layout holding every sequence's K/V.
        seqs: per scheduled sequence ``(seq_id, q_start, q_end, context_len)``.
    """

    layout: VirtualKVLayout
    seqs: list[tuple[int, int, int, int]]
    attn_plan: Any = None

    def contiguous_attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float
    ) -> torch.Tensor:
        """Layer ``layer``'s cache write and attention (:meth:`VirtualKVLayout.attend`)."""
        return self.layout.attend(layer, q, k, v, self.seqs, softmax_scale)


class VirtualModelRunner:
    """Runs scheduled batches with K/V in a virtual layout.

    Args:
        model: the model (full attention only: the engine refuses sliding-window layers here).
        layout: the layout (its pages are committed by the manager before each step).
        manager: the bookkeeping :class:`pagedkv.KVCacheManager` whose step outputs the batches
            carry.
    """

    def __init__(self, model: PagedCausalLM, layout: VirtualKVLayout, *, manager: pagedkv.KVCacheManager) -> None:
        self.model = model
        self.layout = layout
        self.block_tables = BlockTable(manager)  # from_steps' bookkeeping; attention never reads it
        self.device = model.device
        self.kv_cache = None
        self.cpu_cache = None

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step; returns fp32 logits as :meth:`ModelRunner.execute
        <pagedkv.engine.runner.ModelRunner.execute>` does."""
        if not batch.seqs:
            return torch.zeros(0, self.model.vocab_size)
        steps = [getattr(s, "inner", s) for s in batch.steps]
        bt = BatchTensors.from_steps(steps, self.device, block_tables=self.block_tables)
        qsl = bt.query_start_loc_host
        ctx = bt.context_lens_host.tolist()
        starts = qsl.tolist()
        seqs = [(s.seq_id, starts[i], starts[i + 1], ctx[i]) for i, s in enumerate(batch.seqs)]
        rope_lens = None
        if self.model.rope.length_dependent:
            pos = bt.positions_host
            rope_lens = torch.from_numpy(
                np.concatenate(
                    [rope_lengths(s.num_prompt_tokens, pos[qsl[i] : qsl[i + 1]]) for i, s in enumerate(batch.seqs)]
                )
            )
        rows = [
            row
            for end, want, drafts in zip(starts[1:], batch.sample, batch.drafts)
            if want
            for row in range(end - 1 - len(drafts), end)
        ]
        return self.model.forward(
            bt.input_ids,
            bt.positions,
            None,  # type: ignore[arg-type]  # no paged cache: attention reads the layout
            ContiguousStep(self.layout, seqs),  # type: ignore[arg-type]
            torch.tensor(rows, dtype=torch.int64, device=self.device),
            rope_lens,
        )

    def kv_cache_bytes(self) -> int:
        """The layout's physical budget in bytes (committed on demand)."""
        return self.layout.budget_bytes
