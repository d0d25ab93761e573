"""The KV cache manager the scheduler sees under ``kv_layout="virtual"``: the paged
:class:`pagedkv.KVCacheManager` keeps the token bookkeeping (computed tokens, pending tokens,
drafts, preemption state), while capacity is the virtual layout's, in *pages*.

The scheduler is unchanged (same FCFS admission, prefill reservation, decode headroom,
victim choice and retry loop); only the units of its capacity questions change:

==========================  ==========================================================
scheduler asks              answered here
==========================  ==========================================================
``pool.num_free``,          pages of the budget not committed
``num_free_blocks``
``num_blocks_owed(ids)``    pages still to commit for the whole remaining prefill
``num_blocks_needed(s, n)`` ``(pages to commit for n more tokens, 0)``
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

Sharing (a layout built with ``sharing=True``, the engine's on the CPU): prefix caching and
forks map page groups (:mod:`pagedkv.engine.virtual.layout`), the bookkeeping manager runs with
its own prefix caching off. ``lookup_prefix`` maps the cached groups of a new sequence's
longest cached prefix and returns the hit ``H``; the next ``step`` schedules those ``H`` tokens
in the bookkeeping (``allocate_slots``, no KV computed) before the step, reports them as the
sequence's ``num_cached_tokens`` and computes only the rest. A sequence's full page groups are
registered at each step, at preemption and at free. ``fork`` maps the parent's pages into the
child; the first write into a page either still shares is a copy (copy-on-write).

Not supported with this layout (refused with a typed error): swap preemption, a host tier, and
on a CUDA device ``n > 1``, beam search and prefix caching (shared mappings are CPU only).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

import pagedkv
from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, OutOfBlocksError, PagedKVError

from ..errors import InvalidRequestError, RequestTooLargeError
from ..manager_protocol import EngineKVManager, StepResult
from ..sampling import SamplingParams
from ..scheduler import Scheduler, SchedulerConfig
from .layout import VirtualKVLayout

__all__ = ["VirtualKVManager", "VirtualScheduler", "FORK_SLOTS"]

#: Slots per ``max_num_seqs`` of a sharing layout (forks of ``n > 1`` / beams may outnumber it).
FORK_SLOTS = 8


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


_NO_ROWS = np.zeros(0, np.int32)
_NO_HOST_ROWS = np.zeros((0, 3), np.int32)


class _CutStep:
    """A step output as the scheduler sees it (a
    :class:`~pagedkv.engine.manager_protocol.StepResult`): the bookkeeping output (``inner``,
    None when nothing was scheduled) with ``error`` set when it was cut at the first sequence
    whose pages did not fit, and ``num_cached_tokens`` counting the layout's prefix hits. The
    runner builds the kernel inputs from ``inner``."""

    def __init__(
        self, inner: pagedkv.StepOutput | None, error: OutOfBlocksError | None, cached: np.ndarray | None = None
    ) -> None:
        self.inner = inner
        self.error: PagedKVError | None = error if error is not None else (None if inner is None else inner.error)
        self.num_scheduled = 0 if inner is None else int(inner.num_scheduled)
        self.seq_lens: npt.NDArray[np.int32] = _NO_ROWS if inner is None else inner.seq_lens
        self.num_draft_tokens: npt.NDArray[np.int32] = _NO_ROWS if inner is None else inner.num_draft_tokens
        self.num_cached_tokens: npt.NDArray[np.int32] = (
            cached if cached is not None else _NO_ROWS if inner is None else inner.num_cached_tokens
        )
        self.host_stores: npt.NDArray[np.int32] = _NO_HOST_ROWS if inner is None else inner.host_stores
        self.host_loads: npt.NDArray[np.int32] = _NO_HOST_ROWS if inner is None else inner.host_loads


class _VirtualStats:
    """The bookkeeping manager's :class:`pagedkv.CacheStats` with the prefix-cache counters of
    the layout (the bookkeeping runs with its own prefix caching off)."""

    def __init__(self, inner: Any, hits: int, queries: int) -> None:
        self._inner = inner
        self.prefix_hits_tokens = hits
        self.prefix_queries_tokens = queries
        self.prefix_hit_rate = hits / queries if queries else 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _root(spec: Any) -> bytes:
    """The hash root of a sequence's page groups: what its KV depends on besides the tokens
    (cache salt, adapter, extra keys of its :class:`pagedkv.SequenceSpec`)."""
    if spec is None:
        return b"pagedkv-virtual-root"
    parts = repr((spec.cache_salt, spec.adapter_id, [(t, bytes(v)) for t, v in spec.extra_keys]))
    return hashlib.blake2b(parts.encode(), digest_size=16).digest()


class VirtualKVManager:
    """A :class:`pagedkv.KVCacheManager` (``inner``, bookkeeping only: its pool never runs
    out) whose capacity is ``layout``'s pages (see the module docs). It answers every question
    of :class:`~pagedkv.engine.manager_protocol.EngineKVManager`: the capacity ones in pages,
    the rest by the inner manager.

    Args:
        inner: the bookkeeping manager, prefix caching off, a pool larger than the layout's
            budget can fill.
        layout: the :class:`~pagedkv.engine.virtual.layout.VirtualKVLayout`.
        prefix_caching: share cached page groups with new sequences (needs a sharing layout).
    """

    def __init__(self, inner: pagedkv.KVCacheManager, layout: VirtualKVLayout, *, prefix_caching: bool = False) -> None:
        self.inner = inner
        self.layout = layout
        self.pool = _PagePool(layout)
        self.prefix_caching = bool(prefix_caching) and layout.sharing
        self._roots: dict[int, bytes] = {}  # seq id -> hash root of its page groups
        self._hits: dict[int, int] = {}  # seq id -> hit mapped, not yet in the bookkeeping
        self._unreported: dict[int, int] = {}  # seq id -> hit not yet in a scheduled step output
        # The hit-rate counters count a sequence's first lookup only: a recompute resume maps its
        # own cached pages again but is not a new prefix query (as the paged manager's CacheStats).
        self._looked_up: set[int] = set()  # seq ids whose first lookup is counted
        self._queried_tokens = 0  # prompt tokens of first lookups
        self._hit_tokens = 0  # tokens those first lookups found cached

    # ---- configuration and capacity (pages) ---------------------------------------------------

    @property
    def config(self) -> pagedkv.CacheConfig:
        """The bookkeeping manager's configuration (its hash scheme is the engine's; its prefix
        caching is off, the layout's is :attr:`prefix_caching`)."""
        return self.inner.config

    @property
    def groups(self) -> Sequence[pagedkv.KVCacheGroupSpec]:
        """The bookkeeping's one full-attention group (the layout serves full attention only)."""
        return self.inner.groups

    @property
    def num_blocks(self) -> int:
        """Blocks of the bookkeeping pool (the null block included)."""
        return self.inner.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Pages of the budget not committed (:attr:`pool`'s ``num_free``)."""
        return self.layout.num_free_pages

    @property
    def num_host_blocks(self) -> int:
        """0: the virtual layout has no host tier."""
        return self.inner.num_host_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        """The bookkeeping's prefix caching (off; the layout's own is :attr:`prefix_caching`)."""
        return self.inner.enable_prefix_caching

    @property
    def num_sequences(self) -> int:
        """Sequences registered in the bookkeeping."""
        return self.inner.num_sequences

    # ---- questions answered by the bookkeeping ---------------------------------------------------

    def status(self, seq_id: int) -> str:
        """The sequence's status in the bookkeeping (``"running"``, ``"preempted"``...)."""
        return self.inner.status(seq_id)

    def num_computed_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence with KV computed (the bookkeeping's count)."""
        return self.inner.num_computed_tokens(seq_id)

    def num_uncomputed_tokens(self, seq_ids: Any) -> npt.NDArray[np.int32]:
        """``int32[n]`` tokens of each sequence without KV (the bookkeeping's count)."""
        return self.inner.num_uncomputed_tokens(seq_ids)

    def num_blocks_held(self, seq_id: int) -> list[int]:
        """Blocks the bookkeeping holds for the sequence (one group: ``[n]``)."""
        return self.inner.num_blocks_held(seq_id)

    def append_tokens(self, seq_id: int, token_ids: Any) -> None:
        """Append sampled tokens to the sequence in the bookkeeping."""
        self.inner.append_tokens(seq_id, token_ids)

    def accept_drafts(self, seq_id: int, num_accepted: int) -> Any:
        """Keep the first ``num_accepted`` drafts of the sequence's verify step (bookkeeping;
        the layout's pages past them stay committed until the next step grows into them)."""
        return self.inner.accept_drafts(seq_id, num_accepted)

    def swap_out(self, seq_ids: Any) -> npt.NDArray[np.int32]:
        """The bookkeeping's swap-out (the engine refuses swap preemption with this layout)."""
        return self.inner.swap_out(seq_ids)

    def swap_in(self, seq_ids: Any) -> npt.NDArray[np.int32]:
        """The bookkeeping's swap-in (the engine refuses swap preemption with this layout)."""
        return self.inner.swap_in(seq_ids)

    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The bookkeeping's buffered KV events (with ``enable_events``)."""
        return self.inner.take_events()

    def check_invariants(self) -> None:
        """The bookkeeping manager's invariant check."""
        self.inner.check_invariants()

    # ---- sequences -------------------------------------------------------------------------------

    def add_sequence(self, seq_id: int, prompt_token_ids: Any, *, spec: Any = None) -> None:
        """Register a sequence in the bookkeeping; its page groups hash under ``spec``."""
        self.inner.add_sequence(seq_id, prompt_token_ids, spec=spec)
        self._roots[seq_id] = _root(spec)

    def lookup_prefix(self, seq_id: int) -> int:
        """Tokens of a new or resumed sequence served by cached page groups, which are mapped
        into its range now (the scheduler asks once, at admission, then steps it). 0 without
        prefix caching or once it has computed tokens. Only a sequence's first lookup enters
        :meth:`stats`' hit-rate counters; a resume after a recompute preemption is not a new
        query."""
        if seq_id in self._hits:
            return self._hits[seq_id]
        if not self.prefix_caching or self.inner.num_computed_tokens(seq_id) or self.layout.pages_held(seq_id):
            return 0
        token_ids = self.inner.token_ids(seq_id)
        hit = self.layout.share_prefix(seq_id, token_ids, self._roots.get(seq_id, _root(None)))
        if seq_id not in self._looked_up:
            self._looked_up.add(seq_id)
            self._queried_tokens += len(token_ids)
            self._hit_tokens += hit
        if hit:
            self._hits[seq_id] = hit
        return hit

    def _register(self, seq_id: int) -> None:
        """Put the sequence's full page groups in the layout's prefix cache."""
        if self.prefix_caching and seq_id in self._roots:
            computed = self.inner.num_computed_tokens(seq_id)
            if self.layout.needs_register(seq_id, computed):
                self.layout.register(seq_id, self.inner.token_ids(seq_id), computed, self._roots[seq_id])

    def stats(self) -> Any:
        """The bookkeeping's cache stats with the prefix hits and queries of each sequence's
        first lookup in the layout (a resume's hit counts in the layout's own
        ``prefix_hit_tokens`` only)."""
        return _VirtualStats(self.inner.stats(), self._hit_tokens, self._queried_tokens)

    def reset_prefix_cache(self) -> None:
        """Drop the bookkeeping's and the layout's prefix caches."""
        self.inner.reset_prefix_cache()
        self.layout.reset_cache()

    def num_blocks_owed(self, seq_ids: Any) -> int:
        """Pages still to commit for the whole token list of each sequence (its remaining prefill)."""
        return sum(self.layout.pages_to_grow(int(s), self.inner.num_tokens(int(s))) for s in seq_ids)

    def num_blocks_needed(self, seq_id: int, num_new_tokens: int) -> tuple[int, int]:
        """``(pages, 0)``: pages to commit for ``num_new_tokens`` more computed tokens (the
        layout releases none while a sequence grows)."""
        target = self.inner.num_computed_tokens(seq_id) + self._hits.get(seq_id, 0) + num_new_tokens
        return self.layout.pages_to_grow(seq_id, min(target, self.inner.num_tokens(seq_id))), 0

    def step(
        self,
        seq_ids: list[int],
        num_new_tokens: list[int],
        append_token_ids: list[list[int]] | None = None,
        *,
        draft_token_ids: list[list[int]] | None = None,
    ) -> StepResult:
        """Commit pages for each sequence's tokens after this step (computed + new + drafts),
        in order, then the bookkeeping step of those that fit (see the module docs). A prefix
        hit mapped by :meth:`lookup_prefix` enters the bookkeeping first; full page groups of
        earlier steps are registered in the prefix cache."""
        for s in seq_ids:
            hit = self._hits.pop(s, 0)
            if hit:
                self.inner.allocate_slots(s, hit)  # the hit's tokens: computed, no KV to write
                self._unreported[s] = hit
            self._register(s)
        fit = 0
        for i, (s, n) in enumerate(zip(seq_ids, num_new_tokens)):
            drafts = len(draft_token_ids[i]) if draft_token_ids is not None else 0
            computed = self.inner.num_computed_tokens(s)
            if not self.layout.ensure(s, computed + n + drafts, start=computed):
                break
            fit += 1
        if fit == len(seq_ids):
            out = self.inner.step(seq_ids, num_new_tokens, append_token_ids, draft_token_ids=draft_token_ids)
            return self._report(out, seq_ids, None)
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
        return self._report(out, seq_ids[:fit], None if out.error is not None else error)

    def _report(self, out: pagedkv.StepOutput, seq_ids: list[int], error: OutOfBlocksError | None) -> StepResult:
        """``out`` as the scheduler sees it: cut with ``error``, prefix hits not yet reported
        in ``num_cached_tokens``."""
        if not self._unreported or not any(s in self._unreported for s in seq_ids[: out.num_scheduled]):
            return out if error is None else _CutStep(out, error)
        cached = np.array(out.num_cached_tokens, dtype=np.int32, copy=True)
        for i, s in enumerate(seq_ids[: out.num_scheduled]):
            cached[i] += self._unreported.pop(s, 0)
        return _CutStep(out, error, cached)

    def preempt(self, seq_ids: Any) -> None:
        """Register the sequences' full page groups, return their pages, then preempt them
        (recompute) in the bookkeeping."""
        for s in seq_ids:
            self._register(int(s))
            self.layout.release(int(s))
            self._hits.pop(int(s), None)
            self._unreported.pop(int(s), None)
        self.inner.preempt(seq_ids)

    def free(self, seq_id: int) -> bool:
        """Register the sequence's full page groups, return its pages, then free it
        (idempotent, as the paged manager's)."""
        self._register(seq_id)  # a sequence freed already has no root: nothing to register
        self.layout.release(seq_id)
        self._hits.pop(seq_id, None)
        self._unreported.pop(seq_id, None)
        self._roots.pop(seq_id, None)
        self._looked_up.discard(seq_id)
        return bool(self.inner.free(seq_id))

    def fork(self, parent_id: int, child_id: int) -> None:
        """Fork in the bookkeeping, then map the parent's computed pages into the child
        (copy-on-write at the first divergent write).

        Raises:
            InvalidRequestError: a layout without sharing (a CUDA device).
        """
        if not self.layout.sharing:
            raise InvalidRequestError(
                "kv_layout='virtual' on this device does not fork sequences (n > 1, beam search): "
                "forks need shared pages"
            )
        self.layout.fork(parent_id, child_id, self.inner.num_computed_tokens(parent_id))
        try:
            self.inner.fork(parent_id, child_id)
        except BaseException:
            self.layout.release(child_id)
            raise
        self._roots[child_id] = self._roots.get(parent_id, _root(None))
        if parent_id in self._looked_up:  # a fork is no new request: its resumes are no lookups
            self._looked_up.add(child_id)


class VirtualScheduler(Scheduler):
    """The engine's :class:`~pagedkv.engine.scheduler.Scheduler` over a
    :class:`VirtualKVManager`: every policy is inherited; :meth:`check_fits` counts pages."""

    manager: VirtualKVManager

    def __init__(self, manager: VirtualKVManager, config: SchedulerConfig) -> None:
        super().__init__(manager, config)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse a request that can never run under the virtual layout.

        Raises:
            RequestTooLargeError: the prompt does not fit the model context, or prompt +
                ``max_tokens - 1`` tokens need more pages than the budget holds (``n`` or
                ``beam_width`` sequences: the prompt's full pages once, the rest each).
            InvalidRequestError: ``n > 1`` or beam search on a layout without sharing (CUDA).
        """
        if num_prompt_tokens >= self.config.max_model_len:
            raise RequestTooLargeError(
                f"prompt of {num_prompt_tokens} tokens does not fit the model context of "
                f"{self.config.max_model_len} tokens (at least one token must be generated)"
            )
        layout: VirtualKVLayout = self.manager.layout
        width = max(params.n, params.beam_width)
        if width > 1 and not layout.sharing:
            raise InvalidRequestError(
                f"n={params.n}, beam_width={params.beam_width}: kv_layout='virtual' on this device serves one "
                "sequence per request (forks are not supported without shared pages)"
            )
        tokens = min(num_prompt_tokens + params.max_tokens - 1, self.config.max_model_len)
        shared = layout.num_segments * (num_prompt_tokens * layout.bytes_per_token // layout.page_size)
        need = layout.pages_for(tokens) + (width - 1) * (layout.pages_for(tokens) - shared)
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
    pool's usable bytes (``(num_kv_blocks - 1)`` blocks), slots each reserved for
    ``model.max_model_len`` tokens (one per ``max_num_seqs``; on the CPU a sharing layout with
    :data:`FORK_SLOTS` times as many, address space only, as forks may outnumber
    ``max_num_seqs``), the engine's prefix caching on that layout, and a bookkeeping pool its
    pages can never outgrow.

    Args:
        model: the engine's :class:`~pagedkv.engine.models.model.PagedCausalLM`.
        config: the engine's resolved :class:`~pagedkv.engine.config.EngineConfig`.
        hash_seed, enable_events: as for the paged manager.

    Raises:
        EngineConfigError: a model with sliding-window layers (not supported by this layout), a
            host tier of the prefix cache, a budget below one page per layer's K and V, a bad
            page size.
        HugePagesUnavailableError: 2 MiB pages without transparent huge pages.
    """
    import dataclasses

    from ..errors import EngineConfigError

    if any(w is not None for w in model.layer_windows):
        raise EngineConfigError(
            "kv_layout='virtual' is invalid for this model: it has sliding-window layers, which the "
            "virtual layout does not support (use kv_layout='paged')"
        )
    if getattr(config, "num_host_blocks", None) or getattr(config, "host_cache_bytes", None):
        raise EngineConfigError(
            "kv_layout='virtual' is invalid with a host tier of the prefix cache: the virtual layout's "
            "prefix cache keeps pages in memory only (use kv_layout='paged')"
        )
    per_block = model.kv_bytes_per_block(config.block_size)
    budget = (config.num_kv_blocks - 1) * per_block
    sharing = getattr(model.device, "type", "cpu") == "cpu"
    max_seqs = config.max_num_seqs
    if sharing:  # address space only: at most 1 TiB of reservation
        seg = -(-model.max_model_len * model.kv_bytes_per_token() // (2 * model.num_layers) // config.page_size)
        slot = 2 * model.num_layers * (seg + 1) * config.page_size
        max_seqs = max(max_seqs, min(FORK_SLOTS * max_seqs, 2**40 // slot))
    layout = VirtualKVLayout(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_size=model.head_size,
        dtype=model.dtype,
        page_size=config.page_size,
        budget_bytes=budget,
        max_seqs=max_seqs,
        max_seq_len=model.max_model_len,
        device=model.device,
        sharing=sharing,
    )
    # Tokens the budget can hold, in blocks, plus a partial block per sequence: the bookkeeping
    # pool never runs out before the layout's pages do.
    tokens = budget // (per_block // config.block_size)
    blocks = min(tokens // config.block_size + config.max_num_seqs + 2, pagedkv.MAX_BLOCKS)
    bookkeeping = dataclasses.replace(config, num_kv_blocks=blocks, enable_prefix_caching=False)
    inner = pagedkv.KVCacheManager(bookkeeping.cache_config(enable_events=enable_events, hash_seed=hash_seed))
    return VirtualKVManager(inner, layout, prefix_caching=config.enable_prefix_caching), layout


if TYPE_CHECKING:  # pragma: no cover - mypy checks that both managers answer the engine's questions

    def _answers_the_engine(paged: pagedkv.KVCacheManager, virtual: VirtualKVManager) -> list[EngineKVManager]:
        return [paged, virtual]
