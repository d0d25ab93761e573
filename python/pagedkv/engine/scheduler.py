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

With prompt-lookup speculation on (``num_speculative_tokens > 0``), each greedy decoding
sequence also gets up to ``k`` draft tokens (:func:`.speculative.propose_ngram`) from the
budget left after every running sequence's own tokens, as lookahead slots of the same
``manager.step`` call; when the pool runs dry, the drafts are dropped before anyone is
preempted.

The result of a step is a :class:`ScheduledBatch`: the scheduled sequences in batch order, the
manager's step outputs and the block copies to run before the forward pass (swap plans and,
with the prefix cache's host tier, host stores and loads; :attr:`ScheduledBatch.transfers`),
which :meth:`pagedkv.tensors.BatchTensors.from_steps` turns into kernel inputs. The scheduler
keeps no copy of what the manager owns (computed tokens, blocks held, swap state): it asks the
manager.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedkv import OutOfBlocksError, OutOfSwapSpaceError

from .errors import EngineConfigError, InvalidRequestError, RequestTooLargeError
from .manager_protocol import EngineKVManager, StepResult
from .request import Request, Sequence
from .sampling import SamplingParams
from .speculative import propose_ngram

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
            headroom fits, and keep those blocks reserved (the anti-thrash guard of the module docs). ``False``
            admits on the first chunk alone, as naive schedulers do; for experiments only.
        num_speculative_tokens: most draft tokens per decoding sequence and step (prompt
            lookup, :mod:`.speculative`); 0 turns speculation off.
    """

    max_tokens_per_step: int = 1024
    max_num_seqs: int = 256
    preemption: str = "recompute"
    max_model_len: int = 8192
    reserve_prefill: bool = True
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens_per_step < 1:
            raise EngineConfigError(f"max_tokens_per_step={self.max_tokens_per_step} must be >= 1")
        if self.max_num_seqs < 1:
            raise EngineConfigError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.preemption not in ("recompute", "swap"):
            raise EngineConfigError(f"preemption={self.preemption!r} must be 'recompute' or 'swap'")
        if self.num_speculative_tokens < 0:
            raise EngineConfigError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 0")


@dataclass
class ScheduledBatch:
    """What one step runs.

    Attributes:
        seqs: scheduled sequences in batch order (``S`` of them).
        requests: the request of each scheduled sequence.
        sample: per sequence, whether its last scheduled token produces logits to sample from
            (its prefill is complete).
        drafts: per sequence, the draft tokens scheduled after its last token (``[]`` for
            none); a sequence with ``k`` drafts samples from its last ``k + 1`` query rows.
        steps: the ``manager.step`` outputs whose scheduled parts make the batch, in order.
        swap_out: ``int32[K, 2]`` (device block, CPU block) pairs to copy *first* (victims
            swapped out this step), or ``None``.
        swap_in: ``int32[K, 2]`` (CPU block, device block) pairs to copy after ``swap_out``,
            or ``None``.
        transfers: every block copy between the device pool and host memory this step, in
            the order to run them (before copy-on-write and the forward pass): per
            ``manager.step`` call, its ``("host_store", int32[n, 3] (group, device, host))``
            plan (the stores of the calls since the previous step call included), then the
            ``("swap_out", ...)`` and ``("swap_in", ...)`` plans made since the previous step
            call, then its ``("host_load", int32[n, 3] (group, host, device))`` plan: the host
            tier's order (stores, swap out, swap in, loads) per call, calls in order, so a host block
            a call loads from is read before a later call may store over it. Without a host
            tier: ``swap_out`` then ``swap_in``, as the two fields above.
        num_prefill_tokens: scheduled tokens that are not a decode of a sampled token: prompt
            tokens not served from the prefix cache (either tier), and everything a recompute
            resume prefills again.
    """

    seqs: list[Sequence] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    steps: list[Any] = field(default_factory=list)  # StepResult: a pagedkv.StepOutput (paged layout)
    swap_out: np.ndarray | None = None
    swap_in: np.ndarray | None = None
    transfers: list[tuple[str, np.ndarray]] = field(default_factory=list)
    num_prefill_tokens: int = 0


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


#: Blocks one sequence holds at most in a state group (see :meth:`Scheduler.max_blocks`).
STATE_BLOCKS_PER_SEQ = 3

_Item = tuple[Request, Sequence, int]  # (request, sequence, tokens to schedule)


class Scheduler:
    """FCFS continuous-batching scheduler (see the module docs).

    Args:
        manager: the KV cache manager (owns the block pool and every sequence's KV state;
            :class:`~pagedkv.engine.manager_protocol.EngineKVManager`): a
            ``pagedkv.KVCacheManager`` of one KV cache group or of a hybrid model's several (of
            one block size; admission then asks it for each group's blocks, the windowed
            groups' releases included: see :meth:`max_blocks` and :meth:`prefill_owed`).
        config: limits and preemption mode.
    """

    def __init__(self, manager: EngineKVManager, config: SchedulerConfig) -> None:
        self.manager = manager
        self.config = config
        groups = manager.groups
        self.block_size = int(groups[0].block_size)
        self.prefix_caching = bool(manager.enable_prefix_caching)
        #: Each KV cache group's sliding window (None: full attention), in group order.
        self.group_windows: tuple[int | None, ...] = tuple(g.window for g in groups)
        self._windowed = any(w is not None for w in self.group_windows)
        #: Whether each group is a state group (recurrent layers' states, not K/V).
        self.group_states: tuple[bool, ...] = tuple(getattr(g, "kind", None) == "state" for g in groups)
        #: A model with state groups: prefill chunks end at multiples of the block size where
        #: they can (:meth:`_aligned_take`), so the states of prompts' aligned prefixes get cached.
        self._state_align = self.block_size if any(self.group_states) else 0
        self.usable_blocks = int(manager.num_blocks) - 1  # block 0 is the null block
        self.running: list[Request] = []  # arrival order
        self.waiting: list[Request] = []  # arrival order (new, recompute-preempted, swapped)
        self._swap_out: list[np.ndarray] = []
        # Block copies of the step being scheduled (ScheduledBatch.transfers), and the swap
        # plans made since the last manager.step call (they run after that call's host stores).
        self._transfers: list[tuple[str, np.ndarray]] = []
        self._pending_swaps: list[tuple[str, np.ndarray]] = []
        self._host_tier = bool(manager.num_host_blocks)

    # ---- queue -------------------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse a request that can never run.

        Raises:
            RequestTooLargeError: the prompt does not fit the model context, or prompt +
                ``max_tokens`` needs more blocks than the pool's usable blocks (message names
                the sizes in tokens and blocks).
            InvalidRequestError: ``n > 1`` or beam search on a model with state groups (its
                sequences would fork, and a recurrent state cannot be shared block by block).
        """
        width = max(params.n, params.beam_width)
        if width > 1 and any(self.group_states):
            raise InvalidRequestError(
                f"n={params.n}, beam_width={params.beam_width}: several sequences per request are not "
                "served on a model with recurrent (state) layers (forks cannot share a state)"
            )
        if num_prompt_tokens >= self.config.max_model_len:
            raise RequestTooLargeError(
                f"prompt of {num_prompt_tokens} tokens does not fit the model context of "
                f"{self.config.max_model_len} tokens (at least one token must be generated)"
            )
        need = self.max_blocks(num_prompt_tokens, params.max_tokens, width)
        if need > self.usable_blocks:
            raise RequestTooLargeError(
                f"request needs {need} KV blocks ({num_prompt_tokens} prompt tokens + "
                f"max_tokens={params.max_tokens}"
                + (f", {width} sequences" if width > 1 else "")
                + f", block_size={self.block_size}) but the pool has only {self.usable_blocks} "
                f"usable blocks; it can never fit"
            )

    def max_blocks(self, num_prompt_tokens: int, max_tokens: int, width: int = 1) -> int:
        """Blocks a request of ``width`` sequences holds at most when it runs alone, over every
        KV cache group.

        A state group holds at most :data:`STATE_BLOCKS_PER_SEQ` blocks per sequence (the live
        state, the one it moves from until the step's commit, a prefix hit's source). A
        full-attention group holds :func:`blocks_for_request` (times ``width`` without prefix
        caching: a group resumed by recompute cannot share its prompt blocks). A sliding-window
        group of window ``W`` holds, after an allocation of ``q <= max_tokens_per_step`` tokens
        at context ``c``, the blocks from ``first_read(c) = c - W + 1`` to ``c + q``: at most
        ``ceil((max_tokens_per_step + W - 1) / block_size) + 1`` per sequence (the manager
        releases the rest; docs/design.md, "KV cache groups"), and never more than full
        attention would.
        """
        bs = self.block_size
        full = blocks_for_request(num_prompt_tokens, max_tokens, width, bs)
        if width > 1 and not self.prefix_caching:
            full = width * blocks_for_request(num_prompt_tokens, max_tokens, 1, bs)
        q = min(self.config.max_tokens_per_step, num_prompt_tokens + max_tokens - 1)
        return sum(
            min(full, width * STATE_BLOCKS_PER_SEQ)
            if state
            else full
            if w is None
            else min(full, width * (-(-(q + w - 1) // bs) + 1))
            for w, state in zip(self.group_windows, self.group_states)
        )

    def prefill_owed(self, seqs: list[Sequence]) -> int:
        """Free blocks the remaining prefill of one request's sequences still takes (what
        admission reserves, see the module docs).

        The manager's ``num_blocks_owed`` (exact: the rest allocated at once, every group's
        takes and out-of-window releases, a group's own sharing counted once) when no group has
        a window or the rest fits one step's budget; a longer rest is prefilled in chunks of at
        most ``max_tokens_per_step`` tokens, so a sliding-window group never holds more than the
        window of a chunk's context plus the chunk, and the owed figure is, per group and
        sequence, the most it will hold (:meth:`max_blocks`' window rule, or every block for
        full attention) less what it holds now (an upper bound: it counts prefix hits as
        taken).
        """
        ids = [s.seq_id for s in seqs]
        todo = self._uncomputed(seqs)
        if not self._windowed or sum(todo) <= self.config.max_tokens_per_step:
            return int(self.manager.num_blocks_owed(ids))
        bs, q = self.block_size, self.config.max_tokens_per_step
        owed = 0
        for seq, rest in zip(seqs, todo):
            if rest == 0:
                continue
            total = len(seq.token_ids)
            start = total - rest  # context of the next allocation
            for w, held in zip(self.group_windows, self.manager.num_blocks_held(seq.seq_id)):
                most = -(-total // bs)
                if w is not None:
                    most = min(most - max(0, start - w + 1) // bs, -(-(q + w - 1) // bs) + 1)
                owed += max(0, most - held)
        return owed

    def num_free_blocks(self) -> int:
        """Free blocks of the device pool now (uncached and evictable cached ones)."""
        return int(self.manager.num_free_blocks)

    def num_used_blocks(self) -> int:
        """Blocks of the device pool in use now (reference count > 0)."""
        return int(self.manager.pool.num_used)

    def add(self, req: Request) -> None:
        """Queue a request (its sequences already registered in the manager)."""
        keys = [r.arrival_index for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, req.arrival_index), req)

    def finish(self, req: Request) -> None:
        """Drop a finished or aborted request from the queues, wherever it is (its sequences
        are freed by the engine)."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        """True while any request is running or waiting."""
        return bool(self.running or self.waiting)

    def is_swapped(self, req: Request) -> bool:
        """True when ``req``'s KV sits in CPU swap blocks (the manager's status)."""
        return bool(req.seqs) and self.manager.status(req.seqs[0].seq_id) == "swapped"

    def _uncomputed(self, seqs: list[Sequence]) -> list[int]:
        """Tokens of each sequence without KV, its pending sampled tokens included (one
        batched query to the manager)."""
        core = self.manager.num_uncomputed_tokens([s.seq_id for s in seqs]).tolist()
        return [n + len(s.pending) for n, s in zip(core, seqs)]

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Pick this step's tokens and allocate their slots (see the module docs).

        Returns:
            the batch (possibly empty only when nothing is running or waiting).
        """
        budget = self.config.max_tokens_per_step
        batch = ScheduledBatch()
        self._swap_out = []
        self._transfers, self._pending_swaps = [], []
        items: list[_Item] = []
        complete: list[bool] = []  # per item: it schedules all the sequence's remaining tokens
        live = [(r, s) for r in self.running for s in r.seqs]  # 1. running requests, oldest first
        for (req, seq), todo in zip(live, self._uncomputed([s for _, s in live])):
            if budget == 0 or len(items) >= self.config.max_num_seqs:
                break
            if todo > 0:
                items.append((req, seq, self._aligned_take(seq, todo, min(todo, budget))))
                complete.append(todo <= budget)
                budget -= items[-1][2]
        if self.config.num_speculative_tokens:
            budget -= self._propose_drafts(items, complete, budget)
        budget += self._run_step(items, batch, allow_preempt=True)
        admitted, swap_in = self._admit(budget, len(batch.seqs))  # 2. waiting requests
        self._run_step(admitted, batch, allow_preempt=False)
        if self._pending_swaps and self._host_tier:
            # A swap made after the last step call may have evicted cached blocks: the empty
            # call hands over their host stores, which must run before the swap overwrites them.
            self._collect(self.manager.step([], []))
        self._transfers += self._pending_swaps
        batch.swap_out = np.concatenate(self._swap_out) if self._swap_out else None
        batch.swap_in = np.concatenate(swap_in) if swap_in else None
        batch.transfers = self._transfers
        return batch

    def _collect(self, out: StepResult) -> None:
        """Append one ``manager.step`` output's block copies to the step's transfers: its host
        stores, the swaps made since the previous call, its host loads (the host tier's order).
        Host rows carry their group first (``(group, src, dst)``)."""
        if self._host_tier and len(out.host_stores):
            self._transfers.append(("host_store", out.host_stores))
        self._transfers += self._pending_swaps
        self._pending_swaps = []
        if self._host_tier and len(out.host_loads):
            self._transfers.append(("host_load", out.host_loads))

    def _propose_drafts(self, items: list[_Item], complete: list[bool], budget: int) -> int:
        """Set ``seq.drafts`` of each item (prompt-lookup drafts, oldest request first, from
        the token ``budget`` left); returns the draft tokens proposed.

        Only a greedy single-sequence request (temperature 0, ``n == 1``, no beam search) whose
        item schedules all its remaining tokens and has an output token gets drafts; ``k`` is
        capped so that the ``k + 1`` tokens a verify step can emit stay within ``max_tokens``
        and the model context.
        """
        used = 0
        for (req, seq, _), whole in zip(items, complete):
            k = min(self.config.num_speculative_tokens, budget - used)
            p = req.params
            out = len(seq.token_ids) - seq.num_prompt_tokens
            if k <= 0 or not whole or out == 0 or not p.greedy or p.n != 1 or p.use_beam_search:
                continue
            k = min(k, p.max_tokens - out - 1, self.config.max_model_len - len(seq.token_ids) - 1)
            seq.drafts = propose_ngram(seq.token_ids, k)
            used += len(seq.drafts)
        return used

    def _admit(self, budget: int, num_seqs: int) -> tuple[list[_Item], list[np.ndarray]]:
        """Move waiting requests to running, oldest first, while the budget, the sequence
        limit and the free blocks allow; returns their items and the swap-in plans."""
        admitted: list[_Item] = []
        swap_in: list[np.ndarray] = []
        if not self.waiting:  # steady-state decode: no crossing into the core for admission
            return admitted, swap_in
        free = self.num_free_blocks() - self._reserved_blocks()
        guard = self.config.reserve_prefill
        headroom = sum(len(r.seqs) for r in self.running) if guard else 0
        for req in list(self.waiting):
            if budget == 0 or num_seqs + len(req.seqs) > self.config.max_num_seqs:
                break
            # Estimates below may over-count blocks shared inside a group; when nothing else
            # runs, the oldest request is admitted anyway (check_fits guarantees it fits alone).
            idle = not self.running and not num_seqs
            ids = [s.seq_id for s in req.seqs]
            if self.is_swapped(req):
                need = self.manager.num_blocks_owed(ids)  # its distinct swapped blocks
                if need + headroom > free and not idle:
                    break
                try:
                    plan = self.manager.swap_in(ids)
                except OutOfBlocksError:
                    break
                swap_in.append(plan)
                self._pending_swaps.append(("swap_in", plan))
                free -= len(plan)
            else:
                # the whole remaining prefill (guard) or just this step's chunk (no guard)
                need = (
                    self.prefill_owed(req.seqs)
                    if guard
                    else sum(self._chunk_blocks(s.seq_id, min(len(s.token_ids), budget)) for s in req.seqs)
                )
                if need + headroom > free and not idle:
                    break
                free -= need
                req.prefill_reserved = guard
            self.waiting.remove(req)
            bisect.insort(self.running, req, key=lambda r: r.arrival_index)
            headroom += len(req.seqs) if guard else 0
            for seq, todo in zip(req.seqs, self._uncomputed(req.seqs)):
                if budget == 0:
                    break
                if todo == len(seq.token_ids):  # nothing computed: the prefix hits come first
                    todo -= self.manager.lookup_prefix(seq.seq_id)
                take = self._aligned_take(seq, todo, min(todo, budget))
                if take == 0:  # a swapped-in beam that has its logprobs waits for its siblings
                    continue
                admitted.append((req, seq, take))
                budget -= take
                num_seqs += 1
        return admitted, swap_in

    def _aligned_take(self, seq: Sequence, todo: int, take: int) -> int:
        """``take`` tokens of ``seq`` (``todo`` still uncomputed), cut on a model with state
        groups so that the step ends at the last multiple of the block size it crosses: only a
        state that ends a step at an aligned prefix is published to the prefix cache, so a
        prompt of 27 tokens with 8-token blocks is prefilled as 24 + 3 (the state after 24
        tokens cached) rather than 27 (nothing cached). Decodes are never cut."""
        align = self._state_align
        if not align:
            return take
        ctx = len(seq.token_ids) - todo
        aligned = (ctx + take) // align * align
        return aligned - ctx if ctx < aligned < ctx + take else take

    def _chunk_blocks(self, seq_id: int, num_new_tokens: int) -> int:
        """Free blocks the next allocation of ``num_new_tokens`` takes (the manager's ``take -
        release``: it succeeds exactly when that fits the free pool)."""
        take, release = self.manager.num_blocks_needed(seq_id, num_new_tokens)
        return int(take) - int(release)

    def _reserved_blocks(self) -> int:
        """Blocks still to be allocated for admitted prefills (reserved, see the module docs)."""
        return sum(self.prefill_owed(r.seqs) for r in self.running if r.prefill_reserved)

    def _run_step(self, items: list[_Item], batch: ScheduledBatch, *, allow_preempt: bool) -> int:
        """Allocate slots for ``items`` with batched ``manager.step`` calls; on running out of
        blocks preempt victims (if allowed) and retry the rest. Returns the token budget given
        back by items that were not scheduled."""
        unused = 0
        while items:
            drafts = [s.drafts for _, s, _ in items] if any(s.drafts for _, s, _ in items) else None
            ids, counts, pending = (
                [s.seq_id for _, s, _ in items],
                [t for _, _, t in items],
                [s.pending for _, s, _ in items],
            )
            if drafts is None:
                out = self.manager.step(ids, counts, pending)
            else:
                out = self.manager.step(ids, counts, pending, draft_token_ids=drafts)
            self._collect(out)
            n = int(out.num_scheduled)
            self._record(items[:n], out, batch)
            items = items[n:]
            if out.error is None:
                break
            if not isinstance(out.error, OutOfBlocksError):
                raise out.error
            if drafts is not None and any(s.drafts for _, s, _ in items):
                # Drafts are an optimisation: drop them before preempting anyone for their blocks.
                for _, s, _ in items:
                    unused += len(s.drafts)
                    s.drafts = []
                continue
            victim = self._pick_victim(scheduled={id(r) for r in batch.requests}) if allow_preempt else None
            if victim is None:
                # Nothing may be preempted now: the rest waits for the next step (requests
                # admitted this step stay running and are scheduled first next time).
                unused += sum(t + len(s.drafts) for _, s, t in items)
                for _, s, _ in items:
                    s.drafts = []
                break
            self.preempt(victim)
            unused += sum(t + len(s.drafts) for r, s, t in items if r is victim)
            for s in victim.seqs:
                s.drafts = []
            items = [it for it in items if it[0] is not victim]
        return unused

    def _record(self, items: list[_Item], out: StepResult, batch: ScheduledBatch) -> None:
        """Add the scheduled prefix ``items`` of step output ``out`` to the batch."""
        if not items:
            return
        batch.steps.append(out)
        lens = out.seq_lens.tolist()
        cached = out.num_cached_tokens.tolist()
        num_drafts = out.num_draft_tokens.tolist()
        for (req, seq, todo), seq_len, hit, k in zip(items, lens, cached, num_drafts):
            batch.num_prefill_tokens += todo - len(seq.pending)
            seq.pending.clear()  # handed to the manager by this step
            if req.num_cached_tokens is None:
                req.num_cached_tokens = hit
            batch.seqs.append(seq)
            batch.requests.append(req)
            batch.sample.append(seq_len - k == len(seq.token_ids))
            batch.drafts.append(seq.drafts[:k])
            seq.drafts = []
        for r in {id(r): r for r, _, _ in items}.values():
            if r.prefill_reserved and not any(self._uncomputed(r.seqs)):
                r.prefill_reserved = False

    def _pick_victim(self, scheduled: set[int]) -> Request | None:
        """Newest running request with nothing scheduled this step; requests still in their
        reserved prefill only when there is no other."""
        candidates = [r for r in self.running if id(r) not in scheduled]
        if not candidates:
            return None
        plain = [r for r in candidates if not r.prefill_reserved]
        return (plain or candidates)[-1]

    def preempt(self, req: Request) -> None:
        """Preempt a running request (all its sequences at once) by the configured mode and
        queue it again. Pending sampled tokens are handed to the manager first, so a recompute
        resume prefills prompt + every generated token."""
        ids = [s.seq_id for s in req.seqs]
        for s in req.seqs:
            if s.pending:
                self.manager.append_tokens(s.seq_id, s.pending)
                s.pending.clear()
        swapped = False
        if self.config.preemption == "swap":
            try:
                self._swap_out.append(self.manager.swap_out(ids))
                self._pending_swaps.append(("swap_out", self._swap_out[-1]))
                swapped = True
            except OutOfSwapSpaceError:
                swapped = False
        if not swapped:
            self.manager.preempt(ids)
            for s in req.seqs:
                s.logprobs = None  # recomputed on resume (swapped beams keep theirs)
        self.running.remove(req)
        req.prefill_reserved = False
        req.num_preemptions += 1
        self.add(req)
