"""The KV cache manager the scheduler sees under ``kv_layout="virtual"``: the paged
:class:`pagedkv.KVCacheManager` keeps the token bookkeeping (computed tokens, pending tokens,
drafts, preemption state), while capacity is the virtual layout's, in *pages*.

The scheduler is unchanged (same FCFS admission, prefill reservation, decode headroom,
victim choice and retry loop); only the units of its capacity questions change:

==========================  ==========================================================
scheduler asks              answered here
==========================  ==========================================================
``pool.num_free``           pages of the budget not committed
``num_blocks_owed(ids)``    pages still to commit for the whole remaining prefill
``num_blocks_needed(s, n)`` pages to commit for ``n`` more tokens
``step(...)``               commits pages sequence by sequence, in order, all or nothing
                            each; at the first that does not fit, the ones before are
                            stepped and the output carries ``OutOfBlocksError``, as the
                            paged pool's ``step`` stops at the first sequence it cannot
                            schedule
``preempt`` / ``free``      pages returned to the OS, then the paged bookkeeping
==========================  ==========================================================

The decode headroom of admission (one block per running sequence in the paged layout) is one
unit of ``pool.num_free`` per running sequence here, i.e. one page: the scheduler's formula is
kept as it is. :class:`VirtualScheduler` sizes the "can never fit" check in pages.

Not supported with this layout (refused with a typed error): swap preemption, ``n > 1`` and
beam search (a fork would copy the parent's range: sharing whole pages needs the shared
mappings of :class:`~pagedkv.engine.virtual_memory.SharedPages`, not wired into the engine),
and cross-request prefix caching (the bookkeeping manager runs with it off: a prefix hit's KV
would sit in paged blocks that do not exist).
"""

from __future__ import annotations

from typing import Any

import pagedkv
from pagedkv import OutOfBlocksError

from .errors import InvalidRequestError, RequestTooLargeError
from .sampling import SamplingParams
from .scheduler import Scheduler
from .virtual_layout import VirtualKVLayout

__all__ = ["VirtualKVManager", "VirtualScheduler"]


class _PagePool:
    """``manager.pool`` in pages (what the scheduler and the engine read of it)."""

    def __init__(self, layout: VirtualKVLayout) -> None:
        self._layout = layout

    @property
    def num_free(self) -> int:
        return self._layout.num_free_pages

    @property
    def num_used(self) -> int:
        return self._layout.used_pages


class _CutStep:
    """A step output cut at the first sequence whose pages did not fit: the scheduled prefix's
    output (``inner``, None when nothing was scheduled) with ``error`` set."""

    def __init__(self, inner: Any, error: OutOfBlocksError) -> None:
        self.inner = inner
        self.error = error
        self.num_scheduled = 0 if inner is None else inner.num_scheduled

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class VirtualKVManager:
    """A :class:`pagedkv.KVCacheManager` (``inner``, bookkeeping only: its pool never runs
    out) whose capacity is ``layout``'s pages (see the module docs). Every other method is the
    inner manager's.

    Args:
        inner: the bookkeeping manager, prefix caching off, a pool larger than the layout's
            budget can fill.
        layout: the :class:`~pagedkv.engine.virtual_layout.VirtualKVLayout`.
    """

    def __init__(self, inner: pagedkv.KVCacheManager, layout: VirtualKVLayout) -> None:
        self.inner = inner
        self.layout = layout
        self.pool = _PagePool(layout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def num_blocks_owed(self, seq_ids: Any) -> int:
        """Pages still to commit for the whole token list of each sequence (its remaining prefill)."""
        return sum(self.layout.pages_to_grow(int(s), self.inner.num_tokens(int(s))) for s in seq_ids)

    def num_blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """Pages to commit for ``num_new_tokens`` more computed tokens."""
        target = self.inner.num_computed_tokens(seq_id) + num_new_tokens
        return self.layout.pages_to_grow(seq_id, min(target, self.inner.num_tokens(seq_id)))

    def step(
        self,
        seq_ids: list[int],
        num_new_tokens: list[int],
        append_token_ids: list[list[int]] | None = None,
        *,
        draft_token_ids: list[list[int]] | None = None,
    ) -> Any:
        """Commit pages for each sequence's tokens after this step (computed + new + drafts),
        in order, then the bookkeeping step of those that fit (see the module docs)."""
        fit = 0
        for i, (s, n) in enumerate(zip(seq_ids, num_new_tokens)):
            drafts = len(draft_token_ids[i]) if draft_token_ids is not None else 0
            target = self.inner.num_computed_tokens(s) + n + drafts
            if not self.layout.ensure(s, target):
                break
            fit += 1
        if fit == len(seq_ids):
            return self.inner.step(seq_ids, num_new_tokens, append_token_ids, draft_token_ids=draft_token_ids)
        s, n = seq_ids[fit], num_new_tokens[fit]
        want = self.layout.pages_to_grow(s, self.inner.num_computed_tokens(s) + n)
        error = OutOfBlocksError(
            f"virtual KV layout: sequence {s} needs {want} more pages, {self.layout.num_free_pages} free",
            requested=want,
            available=self.layout.num_free_pages,
        )
        if fit == 0:
            return _CutStep(None, error)
        appends = None if append_token_ids is None else append_token_ids[:fit]
        draft_ids = None if draft_token_ids is None else draft_token_ids[:fit]
        out = self.inner.step(seq_ids[:fit], num_new_tokens[:fit], appends, draft_token_ids=draft_ids)
        return out if out.error is not None else _CutStep(out, error)

    def preempt(self, seq_ids: Any) -> None:
        """Return the sequences' pages, then preempt them (recompute) in the bookkeeping."""
        for s in seq_ids:
            self.layout.release(int(s))
        self.inner.preempt(seq_ids)

    def free(self, seq_id: int) -> bool:
        """Return the sequence's pages, then free it (idempotent, as the paged manager's)."""
        self.layout.release(seq_id)
        return bool(self.inner.free(seq_id))

    def fork(self, parent_id: int, child_id: int) -> None:
        """Refused: see the module docs."""
        raise InvalidRequestError("kv_layout='virtual' does not fork sequences (n > 1, beam search)")


class VirtualScheduler(Scheduler):
    """The engine's :class:`~pagedkv.engine.scheduler.Scheduler` over a
    :class:`VirtualKVManager`: every policy is inherited; :meth:`check_fits` counts pages."""

    manager: Any

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse a request that can never run under the virtual layout.

        Raises:
            RequestTooLargeError: the prompt does not fit the model context, or prompt +
                ``max_tokens - 1`` tokens need more pages than the budget holds.
            InvalidRequestError: ``n > 1`` or beam search (not supported by this layout).
        """
        if num_prompt_tokens >= self.config.max_model_len:
            raise RequestTooLargeError(
                f"prompt of {num_prompt_tokens} tokens does not fit the model context of "
                f"{self.config.max_model_len} tokens (at least one token must be generated)"
            )
        if params.n > 1 or params.beam_width > 1:
            raise InvalidRequestError(
                f"n={params.n}, beam_width={params.beam_width}: kv_layout='virtual' serves one sequence per "
                "request (forks are not supported)"
            )
        layout: VirtualKVLayout = self.manager.layout
        tokens = min(num_prompt_tokens + params.max_tokens - 1, self.config.max_model_len)
        need = layout.pages_for(tokens)
        if need > layout.total_pages:
            raise RequestTooLargeError(
                f"request needs {need} KV pages of {layout.page_size} bytes ({num_prompt_tokens} prompt tokens + "
                f"max_tokens={params.max_tokens}) but the virtual layout's budget holds only {layout.total_pages}; "
                "it can never fit"
            )


def build_virtual_manager(
    model: Any, config: Any, *, hash_seed: bytes | None, enable_events: bool
) -> tuple[VirtualKVManager, VirtualKVLayout]:
    """The manager and layout of an engine with ``kv_layout="virtual"``: a budget of the paged
    pool's usable bytes (``(num_kv_blocks - 1)`` blocks), one slot per ``max_num_seqs``, each
    reserved for ``model.max_model_len`` tokens, and a bookkeeping pool its pages can never
    outgrow.

    Args:
        model: the engine's :class:`~pagedkv.engine.model.PagedCausalLM`.
        config: the engine's resolved :class:`~pagedkv.engine.config.EngineConfig`.
        hash_seed, enable_events: as for the paged manager.

    Raises:
        EngineConfigError: a model with sliding-window layers (not supported by this layout), a
            host tier of the prefix cache, a budget below one page per layer's K and V, a bad
            page size.
        HugePagesUnavailableError: 2 MiB pages without transparent huge pages.
    """
    import dataclasses

    from .errors import EngineConfigError

    if any(w is not None for w in model.layer_windows):
        raise EngineConfigError(
            "kv_layout='virtual' is invalid for this model: it has sliding-window layers, which the "
            "virtual layout does not support (use kv_layout='paged')"
        )
    if getattr(config, "num_host_blocks", None) or getattr(config, "host_cache_bytes", None):
        raise EngineConfigError(
            "kv_layout='virtual' is invalid with a host tier of the prefix cache: the virtual layout "
            "runs without prefix caching (use kv_layout='paged')"
        )
    per_block = model.kv_bytes_per_block(config.block_size)
    budget = (config.num_kv_blocks - 1) * per_block
    layout = VirtualKVLayout(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_size=model.head_size,
        dtype=model.dtype,
        page_size=config.page_size,
        budget_bytes=budget,
        max_seqs=config.max_num_seqs,
        max_seq_len=model.max_model_len,
        device=model.device,
    )
    # Tokens the budget can hold, in blocks, plus a partial block per sequence: the bookkeeping
    # pool never runs out before the layout's pages do.
    tokens = budget // (per_block // config.block_size)
    blocks = min(tokens // config.block_size + config.max_num_seqs + 2, pagedkv.MAX_BLOCKS)
    bookkeeping = dataclasses.replace(config, num_kv_blocks=blocks, enable_prefix_caching=False)
    inner = pagedkv.KVCacheManager(bookkeeping.cache_config(enable_events=enable_events, hash_seed=hash_seed))
    return VirtualKVManager(inner, layout), layout
