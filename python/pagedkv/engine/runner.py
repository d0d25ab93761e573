"""Model runner: turns a :class:`~pagedkv.engine.scheduler.ScheduledBatch` into kernel inputs,
applies the block plans (swap out, swap in, copy-on-write) and runs the forward pass.

Owns the KV cache tensors: the device cache ``[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_size]`` and, for swap preemption, a CPU cache of ``num_cpu_blocks`` blocks of
the same per-block shape (pinned when CUDA is present).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedkv import kernels
from pagedkv.tensors import dense_block_table

from .model import AttentionMetadata, LlamaForCausalLM
from .resources import guard_allocation
from .rope import rope_lengths
from .scheduler import ScheduledBatch

__all__ = ["ModelRunner"]


class ModelRunner:
    """Runs scheduled batches on a :class:`LlamaForCausalLM`.

    Args:
        model: the model (its device and dtype are the cache's).
        num_blocks: device KV blocks, null block included.
        block_size: tokens per block.
        num_cpu_blocks: CPU swap blocks (0 disables the CPU cache).

    Raises:
        KVCacheTooLargeError: allocating either cache failed (names blocks and bytes).
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 num_cpu_blocks: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        per_block = model.kv_bytes_per_block(block_size)
        self.kv_cache = guard_allocation("KV cache", num_blocks, per_block,
                                         lambda: model.allocate_kv_cache(num_blocks, block_size))
        self.cpu_cache = (guard_allocation(
            "CPU swap pool", num_cpu_blocks, per_block,
            lambda: model.allocate_kv_cache(num_cpu_blocks, block_size, device="cpu", pin_memory=True))
            if num_cpu_blocks > 0 else None)
        self.device = model.device
        # "auto" dispatch runs the Triton kernel on CUDA when Triton is installed; it needs no plan.
        self._triton_attention = self.device.type == "cuda" and kernels.triton_available()

    def _plan(self, plan: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(plan, dtype=np.int64)).reshape(-1, 2)

    def apply_block_plans(self, batch: ScheduledBatch) -> None:
        """Swap out (device -> CPU), then swap in (CPU -> device), then copy-on-write copies,
        in that order: a block freed by a swap-out may be reused by the later plans."""
        if batch.swap_out is not None and len(batch.swap_out):
            assert self.cpu_cache is not None, "swap-out planned without a CPU cache"
            event = kernels.swap_blocks(self.kv_cache, self.cpu_cache, self._plan(batch.swap_out))
            if event is not None:
                event.synchronize()
        if batch.swap_in is not None and len(batch.swap_in):
            assert self.cpu_cache is not None, "swap-in planned without a CPU cache"
            event = kernels.swap_blocks(self.cpu_cache, self.kv_cache, self._plan(batch.swap_in))
            if event is not None:
                event.synchronize()
        if batch.copies is not None and len(batch.copies):
            kernels.copy_blocks(self.kv_cache, self._plan(batch.copies).to(self.device))

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step.

        Returns:
            fp32 ``[L, vocab]`` logits, one row per sequence with ``batch.sample[i]`` set, in
            batch order.
        """
        self.apply_block_plans(batch)
        if not batch.seqs:
            return torch.zeros(0, self.model.vocab_size)
        dev = self.device
        ids: list[int] = []
        positions: list[np.ndarray] = []
        for seq, start, q in zip(batch.seqs, batch.num_computed_before, batch.query_lens.tolist()):
            ids.extend(seq.token_ids[start:start + q])
            positions.append(np.arange(start, start + q, dtype=np.int64))
        rope_lens = None
        if self.model.rope.length_dependent:  # frequencies per token from its own sequence
            rope_lens = torch.from_numpy(np.concatenate([
                rope_lengths(seq.num_prompt_tokens, pos) for seq, pos in zip(batch.seqs, positions)]))
        qsl = np.zeros(len(batch.seqs) + 1, dtype=np.int32)
        np.cumsum(batch.query_lens, out=qsl[1:])
        block_table = dense_block_table(batch.block_table_indptr, batch.block_table_indices, device=dev)
        seq_lens = torch.from_numpy(batch.seq_lens).to(dev)
        query_start_loc = torch.from_numpy(qsl).to(dev)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(batch.slot_mapping).to(dev),
            block_table=block_table,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=int(batch.query_lens.max()),
            max_seq_len=int(batch.seq_lens.max()),
            # Built once here, used by every layer: the reference attention's per-step work.
            attn_plan=None if self._triton_attention else kernels.plan_paged_attention(
                block_table, seq_lens, query_start_loc, cache_shape=tuple(self.kv_cache.shape[2:]),
                num_q_heads=self.model.num_heads, sliding_window=self.model.sliding_window),
        )
        rows = [int(qsl[i + 1]) - 1 for i, s in enumerate(batch.sample) if s]
        return self.model.forward(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.from_numpy(np.concatenate(positions)).to(dev),
            self.kv_cache, meta,
            torch.tensor(rows, dtype=torch.int64, device=dev),
            rope_lens,
        )

    def kv_cache_bytes(self) -> int:
        """Bytes of the device KV cache."""
        return self.kv_cache.numel() * self.kv_cache.element_size()

