"""Model runner: turns a :class:`~pagedkv.engine.scheduler.ScheduledBatch` into kernel inputs
(:meth:`pagedkv.tensors.BatchTensors.from_steps`, the one allocator-to-kernel path, for every
model's ``pagedkv.KVCacheManager``, of one KV cache group or several, the block tables kept
from the steps' table deltas by a :class:`pagedkv.tensors.BlockTable`), applies the
block plans (host stores, swap out, swap in, host loads, copy-on-write and state copy rows,
then the zero rows of fresh state blocks) and runs the forward pass.

Owns the KV cache tensors: the device cache ``[num_kv_slots, 2, num_blocks, block_size,
num_kv_heads, head_size]`` (:meth:`PagedCausalLM.kv_cache_shape
<pagedkv.engine.models.model.PagedCausalLM.kv_cache_shape>`: one slot per layer of a model with one
KV cache group; on a hybrid model one slot per layer of a group, every group's pages in one
pool), for swap preemption a CPU cache of ``num_cpu_blocks`` blocks of the same per-block
shape, and for the prefix cache's host tier a host cache of ``num_host_blocks`` blocks (both
pinned when CUDA is present, so their copies are asynchronous). A block id belongs to one KV
cache group at a time, so a copy-on-write row ``(group, src, dst)``, a host row and a swap row
are still one :func:`pagedkv.kernels.copy_blocks` / :func:`pagedkv.kernels.swap_blocks` call over
every slot.
"""

from __future__ import annotations

import numpy as np

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

import pagedkv
from pagedkv import kernels
from pagedkv.tensors import BatchTensors, BlockTable

from .models.model import PagedCausalLM
from .models.rope import rope_lengths
from .resources import guard_allocation
from .scheduler import ScheduledBatch
from .state_pages import zero_pages

__all__ = ["ModelRunner"]


class ModelRunner:
    """Runs scheduled batches on a model of the engine (:class:`~pagedkv.engine.models.model.PagedCausalLM`).

    Args:
        model: the model (its device and dtype are the cache's).
        num_blocks: device KV blocks, null block included.
        block_size: tokens per block.
        num_cpu_blocks: CPU swap blocks (0 disables the CPU cache).
        manager: the ``pagedkv.KVCacheManager`` whose step outputs the batches carry; the
            runner keeps its block tables (every group's) across steps from the steps' table
            deltas (:class:`pagedkv.tensors.BlockTable`).
        num_host_blocks: blocks of the prefix cache's host tier (0: none); a tensor of its own,
            apart from the swap pool, as the manager numbers host blocks apart from swap blocks.

    Raises:
        KVCacheTooLargeError: allocating a cache failed (names blocks and bytes).
    """

    def __init__(
        self,
        model: PagedCausalLM,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        *,
        manager: pagedkv.KVCacheManager,
        num_host_blocks: int = 0,
    ) -> None:
        self.model = model
        self.block_tables = BlockTable(manager)
        per_block = model.kv_bytes_per_block(block_size)
        self.kv_cache = guard_allocation(
            "KV cache", num_blocks, per_block, lambda: model.allocate_kv_cache(num_blocks, block_size)
        )
        self.cpu_cache = (
            guard_allocation(
                "CPU swap pool",
                num_cpu_blocks,
                per_block,
                lambda: model.allocate_kv_cache(num_cpu_blocks, block_size, device="cpu", pin_memory=True),
            )
            if num_cpu_blocks > 0
            else None
        )
        self.host_cache = (
            guard_allocation(
                "host tier",
                num_host_blocks,
                per_block,
                lambda: model.allocate_kv_cache(num_host_blocks, block_size, device="cpu", pin_memory=True),
            )
            if num_host_blocks > 0
            else None
        )
        self.device = model.device
        # "auto" dispatch runs the Triton kernel on CUDA when Triton is installed; it needs no plan.
        self._triton_attention = self.device.type == "cuda" and kernels.triton_available()

    def prepare(self, batch: ScheduledBatch) -> BatchTensors:
        """The kernel inputs of ``batch`` on the model's device, with the reference attention's
        per-step plans (one per KV cache group) attached where that kernel runs."""
        # Host stores and loads interleaved with the swaps (without a host tier: swap_out then
        # swap_in). A host row is (group, src, dst); a block id belongs to one group at a time
        # and every group's pages share the cache's slots, so copying every slot of it copies
        # that group's layers (swap rows are (src, dst) already).
        transfers = (
            [(kind, np.ascontiguousarray(plan[:, -2:])) for kind, plan in batch.transfers]
            if self.host_cache is not None and batch.transfers
            else None
        )
        bt = BatchTensors.from_steps(
            batch.steps,
            self.device,
            block_tables=self.block_tables,
            swap_out=batch.swap_out,
            swap_in=batch.swap_in,
            transfers=transfers,
        )
        if self._triton_attention or not batch.seqs:
            return bt
        # One plan per KV cache group; each checks the slot mapping once, not every layer's write.
        bt.attn_plan = self.model.plan_attention(bt, tuple(self.kv_cache.shape[2:]))
        return bt

    def apply_block_plans(self, bt: BatchTensors) -> None:
        """The step's device <-> host copies in the order given (``bt.transfers``: per manager
        call its host stores, the swaps since the previous call, its host loads; see
        :attr:`ScheduledBatch.transfers <pagedkv.engine.scheduler.ScheduledBatch.transfers>`),
        then the copy-on-write copies. A store reads a device block before a swap-in or load
        overwrites it, a swap-out reads a victim's block before a load reuses it. Each plan is
        one batched :func:`pagedkv.kernels.swap_blocks` (asynchronous on CUDA, on the current
        stream, which the copies and the forward pass share)."""
        for kind, plan in bt.transfers:
            src, dst = {
                "host_store": (self.kv_cache, self.host_cache),
                "swap_out": (self.kv_cache, self.cpu_cache),
                "swap_in": (self.cpu_cache, self.kv_cache),
                "host_load": (self.host_cache, self.kv_cache),
            }[kind]
            assert src is not None and dst is not None, f"{kind} planned without its host cache"
            for part in _without_repeated_targets(plan):
                event = kernels.swap_blocks(src, dst, part)
                if event is not None and kind.startswith("swap"):
                    event.synchronize()  # as before: swap plans complete before the step goes on
        if len(bt.copies):
            # A row is (group, src, dst); src belongs to that group alone, so copying every
            # slot of it copies exactly that group's layers. Every row reads its source as it
            # was before the step's copies (a state group's old live block, released by the
            # manager call that planned the move, may be another row's fresh destination).
            plan = bt.copies[:, 1:]
            if _sources_overwritten(plan):
                self.kv_cache[:, :, plan[:, 1].long()] = self.kv_cache[:, :, plan[:, 0].long()].clone()
            else:
                kernels.copy_blocks(self.kv_cache, plan.contiguous())

    def zero_state_blocks(self, batch: ScheduledBatch) -> None:
        """Zero the fresh state blocks of the step's manager calls (their ``zero_blocks`` rows
        ``(group, block)``: a state group's block that starts a sequence's state, or restarts it
        after a recompute preemption), after the copies and before the forward pass, which
        then updates each live state in place (:mod:`pagedkv.engine.state_pages`)."""
        rows = [np.asarray(z) for out in batch.steps if (z := getattr(out, "zero_blocks", None)) is not None]
        rows = [r for r in rows if r.size]
        if rows:
            blocks = torch.from_numpy(np.concatenate(rows)[:, 1].astype(np.int64)).to(self.device)
            zero_pages(self.kv_cache, blocks)

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step.

        Returns:
            fp32 ``[L, vocab]`` logits in batch order: per sequence with ``batch.sample[i]``
            set, ``k + 1`` rows for its ``k = len(batch.drafts[i])`` drafts (a verify step: the
            logits after its last token and after each draft; one row without drafts).
        """
        bt = self.prepare(batch)
        self.apply_block_plans(bt)
        self.zero_state_blocks(batch)
        if not batch.seqs:
            return torch.zeros(0, self.model.vocab_size)
        rope_lens = None
        if self.model.rope.length_dependent:  # frequencies per token from its own sequence
            qsl, pos = bt.query_start_loc_host, bt.positions_host
            rope_lens = torch.from_numpy(
                np.concatenate(
                    [rope_lengths(s.num_prompt_tokens, pos[qsl[i] : qsl[i + 1]]) for i, s in enumerate(batch.seqs)]
                )
            )
        ends = bt.query_start_loc_host[1:].tolist()
        rows = [
            row
            for end, want, drafts in zip(ends, batch.sample, batch.drafts)
            if want
            for row in range(end - 1 - len(drafts), end)
        ]
        return self.model.forward(
            bt.input_ids,
            bt.positions,
            self.kv_cache,
            bt,
            torch.tensor(rows, dtype=torch.int64, device=self.device),
            rope_lens,
        )

    def kv_cache_bytes(self) -> int:
        """Bytes of the device KV cache."""
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def host_cache_bytes(self) -> int:
        """Bytes of the host tier's cache (0 without a host tier)."""
        c = self.host_cache
        return 0 if c is None else c.numel() * c.element_size()


def _sources_overwritten(plan: torch.Tensor) -> bool:
    """Whether a block of copy plan ``plan`` (``int[K, 2]`` (src, dst) rows) is both a source
    and a destination: then every source must be read before any destination is written
    (the batched copy kernel refuses such plans)."""
    rows = plan.tolist()
    return bool({src for src, _ in rows} & {dst for _, dst in rows})


def _without_repeated_targets(plan: torch.Tensor) -> list[torch.Tensor]:
    """``plan`` (``int[K, 2]`` (src, dst) rows, to run in order) cut into consecutive parts
    whose destinations are distinct: one batched copy scatters a part at once, and a block
    stored twice in one plan (a host block reused within one manager call) must end with the
    later row's contents. Almost always one part, ``plan`` itself."""
    dst = plan[:, 1].tolist()
    if len(set(dst)) == len(dst):
        return [plan]
    parts: list[torch.Tensor] = []
    start, seen = 0, set[int]()
    for i, d in enumerate(dst):
        if d in seen:
            parts.append(plan[start:i])
            start, seen = i, set()
        seen.add(d)
    parts.append(plan[start:])
    return parts
