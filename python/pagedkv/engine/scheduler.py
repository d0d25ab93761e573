"""Continuous-batching scheduler over :class:`pagedkv.KVCacheManager` (Orca-style iteration-
level scheduling, Yu et al., OSDI'22; PagedAttention's preemption, Kwon et al., SOSP'23 §4.5).

Every step, in FCFS order of arrival:

1. Running requests first: each live sequence gets its uncomputed tokens (1 for a decode, a
   chunk for an unfinished prefill) while the per-step token budget lasts. One batched
   ``manager.step`` call appends the tokens sampled last step and allocates the slots.
   When the pool runs dry (``OutOfBlocksError`` at some sequence), the sequences before it keep
   their slots and the *newest* running request not yet scheduled this step is preempted --
   by recompute (blocks freed, the prompt plus all generated tokens are prefilled again on
   resume, usually hitting its own cached prefix) or by swap (blocks copied to CPU swap space)
   -- and the rest is retried.
2. Then waiting requests (new, or preempted; oldest first) are admitted while the budget, the
   sequence limit and the free blocks allow. A request is admitted only if the pool can hold its
   *whole remaining prefill* plus one block per running sequence (decode headroom); those
   blocks stay reserved until its prefill completes, and a request still in its prefill is the
   last choice as a preemption victim. This is the guard against preemption thrash (a long
   prompt resumed chunk by chunk and preempted again before it finishes). Admission is strict
   FCFS: the first request that does not fit stops admission, so none starves.

A request that can never fit (its ``prompt + max_tokens - 1`` KV slots need more blocks than the
pool holds; the last sampled token is never fed back, so it needs no slot) is
refused by :meth:`Scheduler.check_fits` before it is queued; every other request fits an empty
pool, and since admission only waits on blocks held by running requests, the engine is never
idle while work waits.

The result of a step is a :class:`ScheduledBatch`: the scheduled sequences in batch order and
the merged manager arrays (slot mapping, block tables, lengths, copy and swap plans).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from pagedkv import KVCacheManager, OutOfBlocksError, OutOfSwapSpaceError

from .errors import RequestTooLargeError
from .request import Request, RequestStatus, Sequence

__all__ = ["SchedulerConfig", "ScheduledBatch", "Scheduler", "blocks_for_request"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits.

    Attributes:
        max_tokens_per_step: token budget of one step (prefill chunks + decodes), >= 1.
        max_num_seqs: most sequences in one step.
        preemption: ``"recompute"`` or ``"swap"`` (swap falls back to recompute when the CPU
            swap space is full).
        max_model_len: model context in tokens.
        reserve_prefill: admit a request only when its whole remaining prefill plus decode
            headroom fits, and keep those blocks reserved (the S6 anti-thrash guard). ``False``
            admits on the first chunk alone, as naive schedulers do; for experiments only.
    """

    max_tokens_per_step: int = 1024
    max_num_seqs: int = 256
    preemption: str = "recompute"
    max_model_len: int = 8192
    reserve_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens_per_step < 1:
            raise ValueError(f"max_tokens_per_step={self.max_tokens_per_step} must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.preemption not in ("recompute", "swap"):
            raise ValueError(f"preemption={self.preemption!r} must be 'recompute' or 'swap'")


@dataclass
class ScheduledBatch:
    """What one step runs.

    Attributes:
        seqs: scheduled sequences in batch order (``S`` of them).
        requests: the request of each scheduled sequence.
        num_computed_before: per sequence, tokens with KV before this step (``context_lens``).
        query_lens: int32 ``[S]`` tokens computed this step per sequence.
        seq_lens: int32 ``[S]`` context + query tokens.
        slot_mapping: int64 ``[T]`` cache slot of every scheduled token.
        block_table_indptr, block_table_indices: int32 CSR block tables of the ``S`` sequences.
        copies: int32 ``[C, 2]`` copy-on-write (src, dst) block pairs, to run before the forward.
        swap_out: int32 ``[K, 2]`` (device block, CPU block) pairs to copy *first* (victims
            swapped out this step).
        swap_in: int32 ``[K, 2]`` (CPU block, device block) pairs to copy after ``swap_out``.
        sample: per sequence, whether its last scheduled token produces logits to sample from.
    """

    seqs: list[Sequence] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    num_computed_before: list[int] = field(default_factory=list)
    query_lens: Any = None
    seq_lens: Any = None
    slot_mapping: Any = None
    block_table_indptr: Any = None
    block_table_indices: Any = None
    copies: Any = None
    swap_out: Any = None
    swap_in: Any = None
    sample: list[bool] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens scheduled this step."""
        return 0 if self.slot_mapping is None else int(self.slot_mapping.shape[0])


def blocks_for_request(num_prompt_tokens: int, max_tokens: int, num_seqs: int, block_size: int) -> int:
    """Blocks a request needs at most when it runs alone: the prompt's full blocks (shared by
    all sequences) plus, per sequence, the blocks of its partial prompt block and its output.

    The last sampled token of a sequence is never fed back through the model, so it never
    gets a KV slot: a sequence holds at most ``prompt + max_tokens - 1`` tokens of KV. For one
    sequence this is ``ceil((prompt + max_tokens - 1) / block_size)`` blocks.
    """
    shared = num_prompt_tokens // block_size
    per_seq = -(-((num_prompt_tokens % block_size) + max_tokens - 1) // block_size)
    return shared + num_seqs * per_seq


class Scheduler:
    """FCFS continuous-batching scheduler (see the module docs).

    Args:
        manager: the KV cache manager (owns the block pool).
        config: limits and preemption mode.
    """

    def __init__(self, manager: KVCacheManager, config: SchedulerConfig) -> None:
        self.manager = manager
        self.config = config
        self.block_size = int(manager.config.block_size)
        self.usable_blocks = int(manager.config.num_blocks) - 1  # block 0 is the null block
        self.running: list[Request] = []   # arrival order
        self.waiting: list[Request] = []   # arrival order (new, recompute-preempted, swapped)
        self._swap_out: list[np.ndarray] = []

    # ---- queue -------------------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, params: Any) -> None:
        """Refuse a request that can never run.

        Raises:
            RequestTooLargeError: the prompt does not fit the model context, or prompt +
                ``max_tokens`` needs more blocks than the pool's usable blocks (message names
                the sizes in tokens and blocks).
        """
        if num_prompt_tokens >= self.config.max_model_len:
            raise RequestTooLargeError(
                f"prompt of {num_prompt_tokens} tokens does not fit the model context of "
                f"{self.config.max_model_len} tokens (at least one token must be generated)"
            )
        width = max(params.n, params.beam_width)
        need = blocks_for_request(num_prompt_tokens, params.max_tokens, width, self.block_size)
        if width > 1 and not self.manager.config.enable_prefix_caching:
            # Without prefix caching a group resumed by recompute cannot share its prompt blocks.
            need = width * blocks_for_request(num_prompt_tokens, params.max_tokens, 1, self.block_size)
        if need > self.usable_blocks:
            raise RequestTooLargeError(
                f"request needs {need} KV blocks ({num_prompt_tokens} prompt tokens + "
                f"max_tokens={params.max_tokens}"
                + (f", {width} sequences" if width > 1 else "")
                + f", block_size={self.block_size}) but the pool has only {self.usable_blocks} "
                f"usable blocks; it can never fit"
            )

    def add(self, req: Request) -> None:
        """Queue a request (already registered in the manager)."""
        self._enqueue_waiting(req)

    def _enqueue_waiting(self, req: Request) -> None:
        keys = [r.arrival_index for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, req.arrival_index), req)

    def finish(self, req: Request) -> None:
        """Drop a finished or aborted request from the queues, wherever it is (its sequences
        are freed by the engine)."""
        req.status = RequestStatus.FINISHED
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        """True while any request is running or waiting."""
        return bool(self.running or self.waiting)

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Pick this step's tokens and allocate their slots (see the module docs).

        Returns:
            the batch (possibly empty only when nothing is running or waiting).
        """
        budget = self.config.max_tokens_per_step
        batch = ScheduledBatch()
        parts: list[Any] = []
        self._swap_out = []
        swap_in: list[np.ndarray] = []

        # 1. running requests, oldest first
        items: list[tuple[Request, Sequence, int]] = []
        for req in self.running:
            for seq in req.seqs:
                if budget == 0 or len(items) >= self.config.max_num_seqs:
                    break
                if seq.num_uncomputed > 0:
                    take = min(seq.num_uncomputed, budget)
                    items.append((req, seq, take))
                    budget -= take
        budget += self._run_step(items, batch, parts, allow_preempt=True)

        # 2. waiting requests, oldest first, while they fit
        admitted: list[tuple[Request, Sequence, int]] = []
        free = self.manager.pool.num_free - self._owed_blocks()
        guard = self.config.reserve_prefill
        headroom = sum(len(r.seqs) for r in self.running) if guard else 0
        num_seqs = len(batch.seqs)
        for req in list(self.waiting):
            if budget == 0 or num_seqs + len(req.seqs) > self.config.max_num_seqs:
                break
            # Estimates below may over-count blocks shared inside a group; when nothing else
            # runs, the oldest request is admitted anyway (check_fits guarantees it fits alone).
            idle = not self.running and not batch.seqs
            if req.status is RequestStatus.SWAPPED:
                need = sum(s.num_blocks for s in req.seqs)
                if need + headroom > free and not idle:
                    break
                try:
                    plan = self.manager.swap_in([s.seq_id for s in req.seqs])
                except OutOfBlocksError:
                    break
                swap_in.append(np.asarray(plan, dtype=np.int32).reshape(-1, 2))
                free -= len(plan)
            else:
                # the whole remaining prefill (guard) or just this step's chunk (no guard)
                need = sum(self.manager.num_blocks_needed(
                    s.seq_id, max(1, s.num_uncomputed if guard else min(s.num_uncomputed, budget)))
                    for s in req.seqs)
                if need + headroom > free and not idle:
                    break
                free -= need
                req.owed_prefill = guard
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.arrival_index)
            headroom += len(req.seqs) if guard else 0
            for seq in req.seqs:
                if budget == 0:
                    break
                if seq.num_computed == 0:
                    # uncomputed after the prefix hits the manager will take
                    seq_todo = len(seq.token_ids) - self.manager.lookup_prefix(seq.seq_id)
                else:
                    seq_todo = seq.num_uncomputed
                take = min(seq_todo, budget)
                if take == 0:  # a swapped-in beam that has its logprobs waits for its siblings
                    continue
                admitted.append((req, seq, take))
                budget -= take
                num_seqs += 1
        self._run_step(admitted, batch, parts, allow_preempt=False)

        self._merge(batch, parts)
        batch.swap_out = _stack(self._swap_out)
        batch.swap_in = _stack(swap_in)
        return batch

    def _owed_blocks(self) -> int:
        """Blocks still to be allocated for admitted prefills (reserved, see the module docs)."""
        owed = 0
        for req in self.running:
            if req.owed_prefill:
                for s in req.seqs:
                    owed += max(0, -(-len(s.token_ids) // self.block_size) - s.num_blocks)
        return owed

    def _run_step(self, items: list[tuple[Request, Sequence, int]], batch: ScheduledBatch,
                  parts: list[Any], *, allow_preempt: bool) -> int:
        """Allocate slots for ``items`` with batched ``manager.step`` calls; on running out of
        blocks preempt victims (if allowed) and retry the rest. Returns the token budget given
        back by items that were not scheduled."""
        unused = 0
        while items:
            out = self.manager.step(
                [s.seq_id for _, s, _ in items],
                [t for _, _, t in items],
                [s.pending for _, s, _ in items],
            )
            n = int(out.num_scheduled)
            self._record(items[:n], out, batch, parts)
            items = items[n:]
            if out.error is None:
                break
            if not isinstance(out.error, OutOfBlocksError):
                raise out.error
            victim = self._pick_victim(scheduled={id(r) for r in batch.requests}) if allow_preempt else None
            if victim is None:
                # Nothing may be preempted now: the rest waits for the next step (requests
                # admitted this step stay running and are scheduled first next time).
                unused += sum(t for _, _, t in items)
                break
            self.preempt(victim)
            unused += sum(t for r, _, t in items if r is victim)
            items = [it for it in items if it[0] is not victim]
        return unused

    def _record(self, items: list[tuple[Request, Sequence, int]], out: Any, batch: ScheduledBatch,
                parts: list[Any]) -> None:
        """Update sequence state from the scheduled prefix of a step output."""
        if not items:
            return
        parts.append(out)
        ctx = out.context_lens
        lens = out.seq_lens
        ip = out.block_table_indptr
        for i, (req, seq, _) in enumerate(items):
            seq.num_in_manager = len(seq.token_ids)
            batch.num_computed_before.append(int(ctx[i]))
            seq.num_computed = int(lens[i])
            seq.num_blocks = int(ip[i + 1] - ip[i])
            if req.num_cached_tokens is None:
                req.num_cached_tokens = int(out.num_cached_tokens[i])
            batch.seqs.append(seq)
            batch.requests.append(req)
            batch.sample.append(seq.num_computed == len(seq.token_ids))
        for r in {id(r): r for r, _, _ in items}.values():
            if r.owed_prefill and all(s.num_uncomputed == 0 for s in r.seqs):
                r.owed_prefill = False

    def _pick_victim(self, scheduled: set[int]) -> Optional[Request]:
        """Newest running request with nothing scheduled this step; requests still in their
        reserved prefill only when there is no other."""
        candidates = [r for r in self.running if id(r) not in scheduled]
        if not candidates:
            return None
        plain = [r for r in candidates if not r.owed_prefill]
        return (plain or candidates)[-1]

    def preempt(self, req: Request) -> None:
        """Preempt a running request (all its sequences at once) by the configured mode and
        queue it again. Pending sampled tokens are handed to the manager first, so a recompute
        resume prefills prompt + every generated token."""
        ids = [s.seq_id for s in req.seqs]
        for s in req.seqs:
            if s.pending:
                self.manager.append_tokens(s.seq_id, s.pending)
                s.num_in_manager = len(s.token_ids)
        swapped = False
        if self.config.preemption == "swap":
            try:
                plan = self.manager.swap_out(ids)
                self._swap_out.append(np.asarray(plan, dtype=np.int32).reshape(-1, 2))
                swapped = True
            except OutOfSwapSpaceError:
                swapped = False
        if not swapped:
            self.manager.preempt(ids)
            for s in req.seqs:
                s.num_computed = 0
                s.num_blocks = 0
                s.logprobs = None  # recomputed on resume (swapped beams keep theirs)
        self.running.remove(req)
        req.status = RequestStatus.SWAPPED if swapped else RequestStatus.WAITING
        req.owed_prefill = False
        req.num_preemptions += 1
        self._enqueue_waiting(req)

    @staticmethod
    def _merge(batch: ScheduledBatch, parts: list[Any]) -> None:
        """Concatenate the arrays of several ``manager.step`` outputs into one batch."""
        if not parts:
            batch.query_lens = np.zeros(0, np.int32)
            batch.seq_lens = np.zeros(0, np.int32)
            batch.slot_mapping = np.zeros(0, np.int64)
            batch.block_table_indptr = np.zeros(1, np.int32)
            batch.block_table_indices = np.zeros(0, np.int32)
            batch.copies = np.zeros((0, 2), np.int32)
            return
        batch.query_lens = np.concatenate([np.diff(p.query_start_loc) for p in parts]).astype(np.int32)
        batch.seq_lens = np.concatenate([p.seq_lens for p in parts]).astype(np.int32)
        batch.slot_mapping = np.concatenate([p.slot_mapping for p in parts]).astype(np.int64)
        lens = np.concatenate([np.diff(p.block_table_indptr) for p in parts])
        batch.block_table_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        batch.block_table_indices = np.concatenate([p.block_table_indices for p in parts]).astype(np.int32)
        batch.copies = _stack([np.asarray(p.copies, dtype=np.int32).reshape(-1, 2) for p in parts])


def _stack(plans: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(plans).astype(np.int32) if plans else np.zeros((0, 2), np.int32)
