"""Decode deferral: vLLM's one-token decodes answered in Python, batched into one call into Rust.

vLLM's scheduler calls ``kv_cache_manager.allocate_slots(request, 1)`` once per running request
per step. ``PagedKVCacheManager`` answers most of those calls here, without calling into pagedkv,
for any number of KV cache groups (every group has the scheduler's block size, so a decode that
opens a block opens one in every group):

- a *lagging* decode (only when every group is full attention: no block is released as the
  sequence grows): its slot lies inside pagedkv's tail block of the request and does not fill
  it. No block, hash or event would change, so only the end of vLLM's slots is recorded
  (:attr:`DecodeDeferral.lag`); pagedkv gets those tokens with the decode that fills or opens a
  block, or before anything else reads or changes the sequence (:meth:`DecodeDeferral.catch_up`).
- a *deferred* decode: its slot fills the tail block or opens a new one (with a windowed group:
  any decode, as each one can move a window). It is queued with the tokens it lagged by; the
  queue goes to pagedkv in one ``KVCacheManager.step`` call (:meth:`DecodeDeferral.flush`),
  in call order, before anything else reads or changes pagedkv (:meth:`DecodeDeferral.sync`), at
  the latest when ``PagedKVScheduler.schedule`` returns, so pagedkv's state is what one call per
  decode would have made (the blocks a window releases go back in that step). A decode opening
  a block is counted against the pool's free blocks (one per group) when it is deferred, so the
  flush cannot run out; the count ignores the blocks windows release in the same step, so it
  can only under-count: with none left the decode is not deferred and the per-request path fails
  where vLLM's own manager fails, so vLLM preempts exactly where stock vLLM preempts.

Every flush and catch-up checks that pagedkv's computed-token counts and new blocks equal what
the deferral recorded (vLLM's), and raises :class:`VllmStateMismatchError` otherwise.

The request table (request id -> pagedkv sequence, tokens pagedkv holds, the live ``Request``)
is the facade's; the deferral reads it and advances the token counts it sends.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import pagedkv
from pagedkv.integrations.vllm.blocks import DeferredBlocks
from pagedkv.integrations.vllm.errors import VllmStateMismatchError

__all__ = ["NO_WINDOW", "DecodeDeferral"]

#: The lag window of a request that has none: no slot ``pos`` satisfies ``1 <= pos < 0``.
NO_WINDOW = (1, 0)


class DecodeDeferral:
    """Lagging and deferred decodes of one ``PagedKVCacheManager`` (see the module docs).

    Args:
        kvm: the facade's ``pagedkv.KVCacheManager``.
        block_size: tokens per block (every group's).
        num_groups: KV cache groups (a decode opening a block takes one in each).
        lags: decodes inside the tail block may lag (every group is full attention, so no
            decode releases a block); off: every decode is deferred.
        seq_of: request id -> pagedkv sequence id (the facade's, shared).
        num_known: request id -> how many of its tokens pagedkv holds or has been sent (shared;
            advanced here as decodes are deferred or caught up).
        requests: request id -> the live vLLM ``Request`` (shared; their token lists feed the
            catch-up).
        empty_blocks: the facade's empty ``KVCacheBlocks`` result (returned for decodes that take
            no new block).
        running: vLLM's ``RequestStatus.RUNNING``.

    Attributes:
        enabled: defer decodes (off: every ``allocate_slots`` goes to pagedkv on its own).
        lags: see Args.
        lag: request id -> end of the slots vLLM holds for a lagging request.
        lag_window: request id -> ``(first, end)``, the slots ``first <= pos < end`` its next
            decodes may take while lagging (two ints: the per-decode check is two comparisons).
        pending_seqs, pending_tokens, pending_context: the deferred decodes not yet in pagedkv,
            in call order: sequence, tokens to append (the lagging ones and the decoded one),
            the computed-token count pagedkv must report for it.
        num_batched_allocations: decode slots carried into pagedkv by :meth:`flush` and
            :meth:`catch_up` so far (a lagging run counts each of its tokens).
        num_batch_stops: decodes not deferred because no free block was left for them.
        held_end: request id -> end of the slots its blocks in pagedkv cover when that is past
            its tokens: lookahead blocks a verify step kept (speculative decoding,
            ``accept_drafts(release_blocks=False)``); a decode opening such a block takes none.
    """

    def __init__(
        self,
        kvm: pagedkv.KVCacheManager,
        block_size: int,
        num_groups: int,
        lags: bool,
        seq_of: dict[str, int],
        num_known: dict[str, int],
        requests: dict[str, Any],
        empty_blocks: Any,
        running: Any,
    ) -> None:
        self._kvm = kvm
        self._block_size = block_size
        self._num_groups = num_groups
        self.lags = lags
        self._seq_of = seq_of
        self._num_known = num_known
        self._requests = requests
        self._empty = empty_blocks
        self._running = running
        self.enabled = True
        self.lag: dict[str, int] = {}
        self.lag_window: dict[str, tuple[int, int]] = {}
        self.pending_seqs: list[int] = []
        self.pending_tokens: list[list[int]] = []
        self.pending_context: list[int] = []
        # Indices (into pending_*) of the deferred decodes whose next slot, whose token is in
        # flight, opens a block (async scheduling): a placeholder draft 0 follows their token.
        self.pending_placeholders: list[int] = []
        # Some deferred decode carries more than its own token (lagged ones): rows, not one
        # token per sequence, go into the step.
        self._multi = False
        # (index into pending_*, DeferredBlocks) of the deferred decodes that take a new block.
        self._pending_new: list[tuple[int, Any]] = []
        # Free blocks left for deferred decodes (None: read the pool on next need).
        self._deferred_free: int | None = None
        self.num_batched_allocations = 0
        self.num_batch_stops = 0
        self.held_end: dict[str, int] = {}

    def set_window(self, rid: str, num_tokens: int) -> None:
        """pagedkv holds the first ``num_tokens`` tokens of ``rid``, all computed: its next
        decodes lag while their slots stay inside the tail block without filling it."""
        bs = self._block_size
        end = num_tokens - num_tokens % bs + bs - 1  # the slot that fills the tail block
        if self.enabled and self.lags and num_tokens % bs and num_tokens < end:
            self.lag_window[rid] = (num_tokens, end)
        else:
            self.lag_window.pop(rid, None)

    def close_window(self, rid: str) -> None:
        """``rid``'s tokens changed other than by decodes: no decode of it lags until the next
        :meth:`set_window`."""
        self.lag_window.pop(rid, None)

    def forget(self, rid: str) -> None:
        """``rid`` finished: drop its lag (its lagging tokens sit in a partial block, which is
        never cached, so they need not reach pagedkv) and its window."""
        self.lag.pop(rid, None)
        self.lag_window.pop(rid, None)
        self.held_end.pop(rid, None)

    def keep_lookahead(self, rid: str, slots_end: int) -> None:
        """A verify step of ``rid`` had slots up to ``slots_end`` and pagedkv kept their blocks
        (vLLM's model runner keeps them too): decodes opening one of them take no new block."""
        bs = self._block_size
        self.held_end[rid] = max(self.held_end.get(rid, 0), -(-slots_end // bs) * bs)

    def drop_lookahead(self, rid: str) -> None:
        """``rid`` released its blocks (preemption by recompute): no lookahead block is kept."""
        self.held_end.pop(rid, None)

    def defer(self, request: Any, rid: str, pos: int, placeholder: bool = False) -> Any:
        """A plain decode at slot ``pos`` that fills or opens a block (or lags outside a known
        window), deferred to the next :meth:`flush` with the tokens it lagged by: returns the
        ``KVCacheBlocks`` result (empty, or a :class:`DeferredBlocks` for a new block), or None
        when it is no plain decode or no free block is left for it (the per-request path
        decides then). ``placeholder`` (async scheduling): the decode fills its block and the
        next slot, whose token is in flight, opens one: it gets a placeholder lookahead slot
        (a draft ``0``, never hashed) in the same flush and the new block is returned."""
        synced = self._num_known.get(rid)
        tokens = request._all_token_ids
        if synced is None or not synced <= pos == len(tokens) - 1 or request.status is not self._running:
            return None
        bs = self._block_size
        new_end = pos + 1  # vLLM's slots for the request once this decode is placed
        offset = new_end % bs  # tokens in the tail block after it (0: the block is full)
        start = new_end - (offset or bs)  # first slot of the block ``pos`` lies in
        if placeholder:
            if offset or synced <= start:
                return None
            blocks = self._take_block()
            if blocks is None:
                return None
        elif synced > start:
            # pagedkv holds that block.
            if offset and self.lags:
                self.lag[rid] = new_end
                return self._empty
            # The token fills it (pagedkv gets it this step, so the block is cached, with its
            # event, in the step vLLM caches it), or may move a window.
            blocks = self._empty
        elif synced > start - bs and self.held_end and self.held_end.get(rid, 0) > start:
            # It opens a lookahead block a verify step kept: pagedkv and vLLM hold it already.
            blocks = self._empty
        elif synced > start - bs:
            # It opens a new block: its id is known after the flush (a DeferredBlocks), taken
            # only while the pool still has a free block for it (counted here, so the flush
            # cannot run out); with none left the per-request path fails and vLLM preempts,
            # exactly as stock.
            blocks = self._take_block()
            if blocks is None:
                return None
        else:
            return None
        if placeholder:
            self.pending_placeholders.append(len(self.pending_seqs))
        self.pending_seqs.append(self._seq_of[rid])
        if new_end - synced != 1:
            self._multi = True
        self.pending_tokens.append(tokens[synced:new_end])
        self.pending_context.append(synced)
        self._num_known[rid] = new_end
        if self.lag:
            self.lag.pop(rid, None)
        # set_window(rid, new_end), inline: pagedkv will hold every token up to new_end.
        if offset and offset < bs - 1 and self.lags:
            self.lag_window[rid] = (new_end, new_end - offset + bs - 1)
        elif self.lag_window:
            self.lag_window.pop(rid, None)
        return blocks

    def _take_block(self) -> Any:
        """A :class:`DeferredBlocks` for the new blocks (one per group) of the decode being
        deferred, counted against the pool's free blocks; None (a batch stop) when they are
        not all left."""
        free = self._deferred_free
        if free is None:
            free = self._kvm.num_free_blocks
        need = self._num_groups
        if free < need:
            self._deferred_free = free
            self.num_batch_stops += 1
            return None
        self._deferred_free = free - need
        blocks = DeferredBlocks(self)
        self._pending_new.append((len(self.pending_seqs), blocks))
        return blocks

    def flush(self) -> int:
        """Allocates the deferred decodes (appending each one's tokens: those it lagged by and
        the decoded one) in one call into Rust (``pagedkv.KVCacheManager.step``), in the order
        they were deferred, and fills in the ids of their new blocks. Returns how many decode
        slots went in. Raises :class:`VllmStateMismatchError` if pagedkv refuses one or
        disagrees on a computed-token count (the deferral's bookkeeping would be wrong; never
        expected)."""
        seqs = self.pending_seqs
        if not seqs:
            return 0
        rows, context, new = self.pending_tokens, self.pending_context, self._pending_new
        drafts: list[list[int]] | None = None
        if self.pending_placeholders:
            drafts = [[] for _ in seqs]
            for i in self.pending_placeholders:
                drafts[i] = [0]
        flat = not self._multi
        self.pending_seqs, self.pending_tokens, self.pending_context, self._pending_new = [], [], [], []
        self.pending_placeholders, self._multi = [], False
        self._deferred_free = None
        n = len(seqs)
        got = self._step(seqs, rows, drafts, flat)
        if got is not None:
            got_context, ids, bounds = got
        else:
            # A request decoded twice between flushes (a caller driving the manager without
            # the scheduler, whose schedule() flushes every step): one step per run of
            # distinct sequences, in order.
            got_context, ids, bounds = [], [], [0]
            start = 0
            while start < n:
                end, seen = start, set()
                while end < n and seqs[end] not in seen:
                    seen.add(seqs[end])
                    end += 1
                run = self._step(seqs[start:end], rows[start:end], drafts and drafts[start:end], flat)
                assert run is not None
                run_context, run_ids, run_bounds = run
                got_context += run_context
                bounds += [len(ids) + x for x in run_bounds[1:]]
                ids += run_ids
                start = end
        if got_context != context:
            raise _mismatch("deferred decodes", "num_computed_tokens", context, got_context)
        g = self._num_groups
        if len(ids) != g * len(new):
            raise _mismatch("deferred decodes", "new blocks", g * len(new), len(ids))
        for i, blocks in new:
            base = i * g
            lo = bounds[base]
            if bounds[base + g] - lo != g:
                raise _mismatch("deferred decodes", "new blocks", g, bounds[base + g] - lo)
            # One new block per group (one group: a one-element list, no walk).
            if g == 1:
                blocks._groups = ([ids[lo]],)
            else:
                blocks._groups = tuple(ids[bounds[base + k] : bounds[base + k + 1]] for k in range(g))
        slots = sum(map(len, rows))
        self.num_batched_allocations += slots
        return slots

    def catch_up(self, request_ids: list[str]) -> None:
        """Brings the lagging decodes of ``request_ids`` (each must be in :attr:`lag`) into
        pagedkv in one ``step``: their tokens are appended and given the slots vLLM holds for
        them, inside blocks pagedkv already holds. Flushes the deferred decodes first. Raises
        :class:`VllmStateMismatchError` as :meth:`flush`."""
        self.sync()
        seqs, rows, context = [], [], []
        for rid in request_ids:
            end = self.lag.pop(rid)
            synced = self._num_known[rid]
            seqs.append(self._seq_of[rid])
            rows.append(self._requests[rid]._all_token_ids[synced:end])
            context.append(synced)
            self._num_known[rid] = end
            self.set_window(rid, end)
        got = self._step(seqs, rows)
        if got is None or got[0] != context or got[1]:
            reported = "refused" if got is None else f"{got[0]} computed tokens, {len(got[1])} new blocks"
            rid = request_ids[0] if len(request_ids) == 1 else ""
            raise _mismatch("lagging decodes", "num_computed_tokens", f"{context}, 0 new blocks", reported, rid)
        self.num_batched_allocations += sum(map(len, rows))

    def sync(self) -> None:
        """Brings pagedkv up to date before any other call reads or changes it: flushes the
        deferred decodes and forgets the free-block count they were counted against."""
        if self.pending_seqs:
            self.flush()
        self._deferred_free = None

    def _step(
        self, seqs: list[int], rows: list[list[int]], drafts: list[list[int]] | None = None, flat: bool = False
    ) -> tuple[list[int], list[int], list[int]] | None:
        """One ``step`` appending ``rows[i]`` to ``seqs[i]`` and allocating their slots (and
        the placeholder ``drafts[i]`` after them): (context lengths, new block ids, their CSR
        offsets per decode and group), or None when ``seqs`` repeats a sequence (the step refuses that as a whole,
        changing nothing). ``flat``: every row is one token (passed as one array). Raises
        :class:`VllmStateMismatchError` if pagedkv refuses anything else."""
        # vLLM reads only the new blocks: no dense tables, slot mappings or token ids.
        if flat and not drafts:
            one = np.array([r[0] for r in rows], dtype=np.int64)
            out = self._kvm.step(seqs, 1, one, block_table=False, token_arrays=False)
        elif drafts:
            out = self._kvm.step(
                seqs, [len(r) for r in rows], rows, draft_token_ids=drafts, block_table=False, token_arrays=False
            )
        else:
            out = self._kvm.step(seqs, [len(r) for r in rows], rows, block_table=False, token_arrays=False)
        if out.num_scheduled == 0 and len(set(seqs)) != len(seqs):
            return None
        if out.num_scheduled != len(seqs):
            raise _mismatch(f"deferred decodes ({out.error!r})", "scheduled decodes", len(seqs), out.num_scheduled)
        ids = out.new_block_ids
        bounds = out.new_block_indptr.tolist()
        return out.context_lens.tolist(), ids.tolist(), bounds


def _mismatch(what: str, quantity: str, expected: Any, got: Any, request_id: str = "") -> VllmStateMismatchError:
    return VllmStateMismatchError(
        f"{what}: pagedkv's {quantity} ({got}) differ from vLLM's ({expected})",
        request_id=request_id,
        quantity=quantity,
        expected=str(expected),
        got=str(got),
    )
