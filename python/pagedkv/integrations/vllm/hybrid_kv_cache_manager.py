"""``HybridPagedKVCacheManager``: vLLM's ``kv_cache_manager`` for hybrid models, backed by
``pagedkv.HybridKVCacheManager`` (several KV cache groups in one block pool).

``PagedKVScheduler`` builds it when the scheduler's ``KVCacheConfig`` has more than one KV cache
group (full attention, sliding window, chunked local; see
:func:`~pagedkv.integrations.vllm.check_supported_config`). It answers the calls of
:class:`~pagedkv.integrations.vllm.PagedKVCacheManager` with one block table per group:

- ``KVCacheBlocks`` results carry one id list per group (:data:`GroupedBlocks`); a released
  sliding-window or chunked-local entry is the null block 0, as vLLM's own null block;
- a prefix hit is the longest prefix every group serves (pagedkv's ``lookup_prefix``: full
  attention scanned left to right, a sliding-window group needing the blocks of its window
  before the hit point);
- blocks that no future query can read are released as the sequence grows, inside the
  allocation that moves the window (vLLM frees them in ``allocate_slots`` too, before it counts
  the blocks it needs), so ``remove_skipped_blocks`` has nothing left to do;
- admission (``full_sequence_must_fit``) counts, per windowed group, at most vLLM's own
  recycling-aware cap (the spec's ``max_admission_blocks_per_request``), so requests vLLM admits
  are admitted here.

Retention: vLLM's ``KVCacheConfig.prefix_cache_retention_interval`` ``None`` (dense: every
full block of every group cached) and ``0`` (vLLM's default: only the replay boundary and the
shared-prefix junctions it detects at lookup, its ``shared_prefix_boundary``) map to pagedkv's
``retention_interval=0`` (dense): pagedkv detects no junction, and keeping only each sequence's
latest replayable point would lose the hits of every sibling of a shared prompt. A positive
interval ``N`` maps to pagedkv's ``N`` (hits at multiples of ``N`` plus each sequence's latest
replayable point). Hits under vLLM's sparse retention therefore differ by design
(``tests/integrations/vllm/test_vllm_hybrid.py`` asserts and reports both).

Speculative decoding with scheduled draft tokens (n-gram) is served as by
``PagedKVCacheManager``: the drafts get lookahead slots in every group in the same ``step``
call, and vLLM's rollback of ``num_computed_tokens`` resolves them at the request's next
allocation (``accept_drafts(release_blocks=False)``). Refused when the scheduler is built:
Mamba groups and group block sizes other than the scheduler's.

Batched decode (``defer_decodes``, on under ``PagedKVScheduler``): vLLM calls
``allocate_slots(request, 1)`` once per running request per step. Such a plain decode is
answered in Python and deferred: one inside the tail block takes no block in any group and
returns the empty result; one opening a block takes one in every group (all groups share the
block size), counted against the pool's free blocks, and returns a
:class:`~pagedkv.integrations.vllm.blocks.DeferredGroupedBlocks`. The deferred decodes reach
pagedkv in one ``HybridKVCacheManager.step``, in call order, before anything else reads or
changes pagedkv (every other call flushes first), at the latest when ``schedule`` returns, so
pagedkv's state is what one call per decode would have made: the blocks a sliding-window
group releases as the window moves go back in that step, and nothing reads the pool before.
The free count ignores those releases, so it can only under-count: a decode it cannot cover,
and any decode of a request whose verify steps kept lookahead blocks (speculative decoding),
takes the per-request path, which fails where vLLM's own manager fails, so vLLM preempts where
stock vLLM preempts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import pagedkv
from pagedkv.errors import OutOfBlocksError
from pagedkv.integrations.vllm.blocks import DeferredGroupedBlocks, GroupedBlocks, PrefixHit
from pagedkv.integrations.vllm.coordinator import CoordinatorView
from pagedkv.integrations.vllm.errors import VllmStateMismatchError
from pagedkv.integrations.vllm.kv_cache_manager import request_sequence_spec
from pagedkv.integrations.vllm.manager_interface import (
    UNWRITTEN_TOKEN,
    SharedManagerCalls,
    caches_finished_drafts,
    pagedkv_hash_algo,
)

__all__ = ["HybridPagedKVCacheManager", "group_spec_of"]


def group_spec_of(spec: Any, page_bytes: int) -> pagedkv.KVCacheGroupSpec:
    """pagedkv's ``KVCacheGroupSpec`` for one vLLM KV cache group spec.

    ``FullAttentionSpec`` / ``MLAAttentionSpec`` (without a window) -> ``"full"``,
    ``SlidingWindowSpec`` -> ``"sliding_window"`` (its ``sliding_window``),
    ``ChunkedLocalAttentionSpec`` -> ``"chunked_local"`` (its ``attention_chunk_size``).
    ``page_bytes`` is the common page size given to every group (pagedkv checks pages are
    equal; the plug-in does not use their size otherwise), a multiple of the block size.
    Raises ``InvalidConfigError`` for any other spec.
    """
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    bs = int(spec.block_size)
    bpt = page_bytes // bs
    kind = type(spec)
    if kind is SlidingWindowSpec:
        return pagedkv.KVCacheGroupSpec("sliding_window", bs, bpt, window=int(spec.sliding_window))
    if kind is ChunkedLocalAttentionSpec:
        return pagedkv.KVCacheGroupSpec("chunked_local", bs, bpt, chunk=int(spec.attention_chunk_size))
    if kind in (FullAttentionSpec, MLAAttentionSpec) and getattr(spec, "sliding_window", None) is None:
        if getattr(spec, "attention_chunk_size", None) is None:
            return pagedkv.KVCacheGroupSpec("full", bs, bpt)
    raise pagedkv.InvalidConfigError(
        f"KV cache group spec {kind.__name__} has no pagedkv equivalent",
        field="kv_cache_spec",
        value=kind.__name__,
        reason="full attention, sliding window or chunked local attention only",
    )


def _skipped_tokens(spec: pagedkv.KVCacheGroupSpec, num_computed: int) -> int:
    """Tokens before the first one a query after ``num_computed`` computed tokens reads."""
    if spec.window is not None:
        return max(0, num_computed - spec.window + 1)
    if spec.chunk is not None:
        return num_computed // spec.chunk * spec.chunk
    return 0


class HybridPagedKVCacheManager(SharedManagerCalls):
    """vLLM V1 ``kv_cache_manager`` backed by ``pagedkv.HybridKVCacheManager`` (several KV cache
    groups sharing one pool).

    Args:
        kv_cache_config: the scheduler's ``vllm.v1.kv_cache_interface.KVCacheConfig`` (at least
            one group; every group's ``block_size`` equal to ``block_size``).
        block_size: the scheduler's block size in tokens.
        enable_caching: vLLM's ``enable_prefix_caching``.
        hash_algo: vLLM's ``prefix_caching_hash_algo`` (``sha256*`` -> SHA-256, ``xxhash*`` ->
            xxh3-128).
        log_stats: keep ``PrefixCacheStats`` for ``make_prefix_cache_stats``.
        enable_kv_cache_events: record KV events for ``take_events``.
        watermark: fraction of blocks kept free when admitting waiting / preempted requests.
        max_model_len: the scheduler's ``max_model_len`` in tokens.
        max_in_flight_tokens: tokens scheduled but not yet settled (vLLM's
            ``VllmConfig.max_in_flight_tokens``), for the windowed groups' admission cap;
            ``None``: ``max_model_len``.

    Raises ``InvalidConfigError`` (nothing built) for a group spec with no pagedkv equivalent,
    a group block size other than ``block_size``, or an unknown hash algorithm. Other errors are
    pagedkv's typed errors; a failing call changes nothing, except ``VllmStateMismatchError``
    (pagedkv's record of a request disagrees with vLLM's: a bug, the manager must not serve on).
    """

    def __init__(
        self,
        kv_cache_config: Any,
        block_size: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        watermark: float = 0.0,
        max_model_len: int | None = None,
        max_in_flight_tokens: int | None = None,
    ) -> None:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind
        from vllm.v1.metrics.stats import PrefixCacheStats
        from vllm.v1.request import RequestStatus

        algo = pagedkv_hash_algo(hash_algo)
        groups = list(kv_cache_config.kv_cache_groups)
        for g in groups:
            if g.kv_cache_spec.block_size != block_size:
                raise pagedkv.InvalidConfigError(
                    f"KV cache group block size {g.kv_cache_spec.block_size} differs from the "
                    f"scheduler block size {block_size}",
                    field="kv_cache_spec.block_size",
                    value=str(g.kv_cache_spec.block_size),
                    reason=f"must equal {block_size}",
                )
        self._specs = [group_spec_of(g.kv_cache_spec, block_size) for g in groups]
        layer_groups = [i for i, g in enumerate(groups) for _ in (g.layer_names or [None])]
        num_blocks = int(kv_cache_config.num_blocks)
        # vLLM's None (dense) and 0 (replay boundary + shared-prefix junctions) are both dense
        # here: pagedkv pins no junction, and caching only the latest replayable point would
        # lose every sibling's hit on a shared prompt that vLLM's junction serves.
        interval = int(getattr(kv_cache_config, "prefix_cache_retention_interval", None) or 0)
        self._kvm = pagedkv.HybridKVCacheManager(
            self._specs,
            layer_groups,
            num_blocks,
            enable_prefix_caching=enable_caching,
            retention_interval=interval,
            hash_algo=algo,
            enable_events=enable_kv_cache_events,
        )
        self._PrefixCacheStats = PrefixCacheStats
        self._waiting_states = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = len(groups)
        #: Tokens per block of each KV cache group (read by the coordinator view).
        self.group_block_sizes = tuple(s.block_size for s in self._specs)
        #: pagedkv's retention interval in tokens (0: dense).
        self.retention_interval = interval
        self.watermark_blocks = int(watermark * num_blocks)
        self.empty_kv_cache_blocks = GroupedBlocks(tuple([] for _ in groups))
        self.kv_cache_config = kv_cache_config
        self.kv_cache_spec = groups[0].kv_cache_spec
        self.max_model_len = max_model_len
        self.spec_kinds = [get_kv_cache_spec_kind(g.kv_cache_spec).value for g in groups]
        self.medium = "GPU"
        self.mamba_shared_prefix_checkpoint = False
        #: Defer plain decodes of running requests and allocate them in one batched call
        #: (``flush_decodes``); off: one call into Rust per ``allocate_slots``.
        self.defer_decodes = False
        #: Decode slots carried into pagedkv by the batched path so far.
        self.num_batched_allocations = 0
        #: Decodes not deferred because the free count could not cover their blocks.
        self.num_batch_stops = 0
        self._RUNNING = RequestStatus.RUNNING
        # The deferred decodes not yet in pagedkv, in call order: sequence, its decoded token,
        # the computed-token count pagedkv must report for it; (index, result) of those that
        # open a block; their request ids; the free blocks left for them (None: read the pool).
        self._pending_seqs: list[int] = []
        self._pending_tokens: list[int] = []
        self._pending_context: list[int] = []
        self._pending_new: list[tuple[int, Any]] = []
        self._pending_rids: set[str] = set()
        self._deferred_free: int | None = None
        # Requests that had a verify step: their tables may hold lookahead blocks past their
        # tokens, so their decodes take the per-request path.
        self._had_drafts: set[str] = set()
        # Per group, vLLM's recycling-aware admission cap in blocks (None: no cap).
        in_flight = max_in_flight_tokens if max_in_flight_tokens is not None else (max_model_len or 0)
        self._admission_caps: list[int | None] = []
        for g, spec in zip(groups, self._specs, strict=True):
            cap = None
            if spec.kind != "full" and max_model_len is not None:
                cap = int(g.kv_cache_spec.max_admission_blocks_per_request(in_flight, max_model_len))
            self._admission_caps.append(cap)
        self._coordinator = CoordinatorView(self)
        self._num_usable = num_blocks - 1
        self._seq_of: dict[str, int] = {}
        self._num_known: dict[str, int] = {}
        self._next_seq_id = 0
        self._lora_ids: dict[str, int] = {}
        # Speculative decoding: request id -> (the computed count its drafts start at, the
        # drafts) until vLLM reports the verification (see PagedKVCacheManager).
        self._drafts_pending: dict[str, tuple[int, list[int]]] = {}
        self._diverged: set[str] = set()
        self._unwritten: dict[str, int] = {}
        self._cache_finished_drafts = caches_finished_drafts()
        #: Async scheduling (set by ``PagedKVAsyncScheduler``; see ``PagedKVCacheManager``).
        self.async_scheduling = False
        # Async scheduling: requests whose unknown tokens hold placeholder lookahead slots.
        self._unknown: set[str] = set()

    # ---- properties vLLM reads -------------------------------------------------------------

    @property
    def manager(self) -> pagedkv.HybridKVCacheManager:
        """The underlying ``pagedkv.HybridKVCacheManager`` (inspection, invariant checks), with
        the deferred decodes brought in first."""
        self._sync()
        return self._kvm

    @property
    def usage(self) -> float:
        """KV cache usage in [0, 1]: ``1 - free / (num_blocks - 1)`` (free includes evictable
        cached blocks), as vLLM's block pool."""
        if not self._num_usable:
            return 0.0
        self._sync()
        return 1.0 - self._kvm.num_free_blocks / self._num_usable

    # ---- batched decode --------------------------------------------------------------------

    def _defer_decode(self, request: Any) -> Any:
        """A plain one-token decode of a running request, deferred to the next
        :meth:`flush_decodes`: the empty result (no block taken) or a ``DeferredGroupedBlocks``
        (a block in every group); None when it is no plain decode, its request had a verify
        step or is already deferred, or the free count cannot cover it (the per-request path
        decides then)."""
        rid = request.request_id
        pos = request.num_computed_tokens
        tokens = request._all_token_ids
        if (
            self._num_known.get(rid) != pos
            or len(tokens) != pos + 1
            or request.num_output_placeholders
            or request.status is not self._RUNNING
            or rid in self._pending_rids
            or rid in self._drafts_pending
            or rid in self._had_drafts
            or rid in self._unknown
        ):
            return None
        if pos % self.block_size:
            blocks = self.empty_kv_cache_blocks
        else:
            # The token opens a block in every group; the pool must hold one for each (the
            # blocks a window releases in the same step are not counted: an under-count).
            free = self._deferred_free
            if free is None:
                free = self._kvm.num_free_blocks
            need = self.num_kv_cache_groups
            if free < need:
                self._deferred_free = free
                self.num_batch_stops += 1
                return None
            self._deferred_free = free - need
            blocks = DeferredGroupedBlocks(self.flush_decodes)
            self._pending_new.append((len(self._pending_seqs), blocks))
        self._pending_seqs.append(self._seq_of[rid])
        self._pending_tokens.append(int(tokens[pos]))
        self._pending_context.append(pos)
        self._pending_rids.add(rid)
        self._num_known[rid] = pos + 1
        return blocks

    def flush_decodes(self) -> int:
        """Allocates the deferred decodes (appending each one's token) in one call into Rust
        (``HybridKVCacheManager.step``), in the order they were deferred, and fills in the
        new blocks of those that opened one. Returns how many decode slots went in. Raises
        ``VllmStateMismatchError`` if pagedkv refuses one or disagrees on a computed-token
        count or the blocks taken (the deferral's bookkeeping would be wrong; never
        expected)."""
        seqs = self._pending_seqs
        self._deferred_free = None
        if not seqs:
            return 0
        tokens, context, new = self._pending_tokens, self._pending_context, self._pending_new
        self._pending_seqs, self._pending_tokens, self._pending_context, self._pending_new = [], [], [], []
        self._pending_rids.clear()
        n = len(seqs)
        # vLLM reads only the new blocks: no dense tables, slot mappings or token ids.
        out = self._kvm.step(seqs, 1, np.array(tokens, dtype=np.int64), block_table=False, token_arrays=False)
        if out.error is not None or out.num_scheduled != n:
            raise _mismatch("deferred decodes", "scheduled decodes", n, f"{out.num_scheduled} ({out.error!r})")
        got = out.context_lens.tolist()
        if got != context:
            raise _mismatch("deferred decodes", "num_computed_tokens", context, got)
        g = self.num_kv_cache_groups
        indptr = out.new_block_indptr.tolist()
        ids = out.new_block_ids.tolist()
        opened = [i for i in range(n) if indptr[(i + 1) * g] > indptr[i * g]]
        if opened != [i for i, _ in new] or len(ids) != g * len(new):
            raise _mismatch("deferred decodes", "decodes taking blocks", [i for i, _ in new], opened)
        for i, blocks in new:
            blocks._groups = tuple(ids[indptr[i * g + k] : indptr[i * g + k + 1]] for k in range(g))
        self.num_batched_allocations += n
        return n

    def _sync(self) -> None:
        """Brings pagedkv up to date before any other call reads or changes it (flushes the
        deferred decodes, forgets the free count they were counted against)."""
        if self._pending_seqs:
            self.flush_decodes()
        self._deferred_free = None

    # ---- request registration --------------------------------------------------------------

    def _register(self, request: Any) -> int:
        rid = request.request_id
        seq = self._seq_of.get(rid)
        if seq is None:
            seq = self._next_seq_id
            spec = request_sequence_spec(request, self._lora_ids)
            self._kvm.add_sequence(seq, request.all_token_ids[:], spec=spec)
            self._next_seq_id += 1
            self._seq_of[rid] = seq
            self._num_known[rid] = request.num_tokens
            return seq
        if self._unknown and rid in self._unknown:
            # Async scheduling: the placeholders go, their lookahead blocks stay (filled next).
            self._unknown.discard(rid)
            self._kvm.accept_drafts(seq, 0, release_blocks=False)
        if rid in self._drafts_pending:
            self._accept_drafts(request, seq, strict=True)
        known = self._num_known[rid]
        n = request.num_tokens
        if n > known:
            self._kvm.append_tokens(seq, request.all_token_ids[known:])
            self._num_known[rid] = n
        return seq

    def _accept_drafts(self, request: Any, seq: int, *, strict: bool) -> None:
        """Resolves the request's verify step from vLLM's rollback of ``num_computed_tokens``
        (as ``PagedKVCacheManager``: blocks kept, ``accept_drafts(release_blocks=False)``).
        ``strict``: a negative count raises ``VllmStateMismatchError``, accepted tokens other
        than the drafts, or past them, are logged and the ids the KV was computed for kept
        (:meth:`SharedManagerCalls._check_accepted_drafts`); otherwise (a finished request,
        whose stop may cut the verify short) only the drafts that became its tokens are
        accepted."""
        rid = request.request_id
        base, drafts = self._drafts_pending.pop(rid)
        unwritten = 0
        if strict:
            accepted, unwritten = self._check_accepted_drafts(rid, base, drafts, request)
        else:
            tokens = list(request.all_token_ids[base : base + len(drafts)])
            limit = max(0, min(request.num_computed_tokens - base, len(tokens)))
            accepted = 0
            while accepted < limit and tokens[accepted] == drafts[accepted]:
                accepted += 1
        self._kvm.accept_drafts(seq, accepted, release_blocks=False)
        self._num_known[rid] += accepted
        if unwritten:
            # Positions vLLM counts as computed past the drafts: computed by the next allocation.
            self._kvm.append_tokens(seq, [UNWRITTEN_TOKEN] * unwritten)
            self._num_known[rid] += unwritten
            self._unwritten[rid] = unwritten

    # ---- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None) -> tuple[Any, int, int]:
        """Prefix hit of a waiting request: ``(blocks, hit tokens, 0)``, the hit being the
        longest prefix every group serves (whole blocks, at most ``num_tokens - 1``).
        ``blocks`` is an opaque token for ``allocate_slots``. Raises ``InvalidArgumentError``
        for a ``max_cache_hit_length`` below the hit, changing nothing."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        self._sync()
        seq = self._register(request)
        hit = self._kvm.lookup_prefix(seq)
        self._check_hit_cap(hit, max_cache_hit_length)
        if hit == 0:
            return self.empty_kv_cache_blocks, 0, 0
        return PrefixHit(hit, [hit // bs for bs in self.group_block_sizes], seq), hit, 0

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens of ``request`` covered by whole computed blocks (every group caches its
        full blocks as they fill, so the shortest group prefix is the computed one)."""
        seq = self._seq_of.get(request.request_id)
        if seq is None or not self.enable_caching:
            return 0
        self._sync()
        computed = min(self._kvm.num_computed_tokens(seq), request.num_tokens)
        return int(computed - computed % self.block_size)

    # ---- allocation ------------------------------------------------------------------------

    def _full_sequence_demand(self, request: Any, seq: int, hit: int, num_new_tokens: int) -> int:
        """Blocks vLLM's admission gate asks free for the whole request (per group its blocks
        for every token, a windowed group at most its admission cap, less the hit's blocks,
        plus the hit blocks that leave the free pool)."""
        total = min(request.num_tokens, self.max_model_len or request.num_tokens)
        per_group = self._kvm.num_blocks_needed_per_group(seq, num_new_tokens)
        demand = 0
        for g, spec in enumerate(self._specs):
            bs = spec.block_size
            required = -(-total // bs)
            cap = self._admission_caps[g]
            if cap is not None:
                required = min(required, cap)
            hit_blocks = hit // bs
            fresh_now = -(-(hit + num_new_tokens) // bs) - hit_blocks
            evictable_hits = max(0, per_group[g][0] - fresh_now)
            demand += max(required - max(_skipped_tokens(spec, hit) // bs, hit_blocks), 0) + evictable_hits
        return demand

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Any:
        """Slots for ``num_new_tokens`` more tokens of ``request`` in every group (prefix hit
        first for a new or resumed request); returns the newly taken blocks per group, or None
        when they do not fit (nothing changed then).

        As vLLM: all or nothing; out-of-window blocks are given back in the same call and
        count as free for it; waiting / preempted requests also leave ``watermark_blocks``
        free when others are scheduled; ``full_sequence_must_fit`` admits a request only if
        all its tokens fit (a windowed group counted up to its admission cap).

        A verify step's draft tokens (``request.spec_token_ids``, scheduled past the known
        tokens) get lookahead slots in every group and are never hashed. So do the tokens
        scheduled past the known ones and the drafts (vLLM's placeholder drafts when it pads a
        new or resumed request with one token left to a verify-sized step), as drafts of
        ``UNWRITTEN_TOKEN`` ids; vLLM rolls them back.

        Raises ``InvalidArgumentError`` for ``num_new_tokens <= 0`` or a feature the config
        check refuses (lookahead slots, external / encoder tokens, delayed caching), and
        ``VllmStateMismatchError`` (a ``RuntimeError``) if pagedkv's computed-token count
        disagrees with the request's.

        A plain decode of a running request (one token, no other option) is deferred to the
        next ``flush_decodes`` when ``defer_decodes`` is on (see the module docs).
        """
        if (
            num_new_tokens == 1
            and self.defer_decodes
            and not (
                num_new_computed_tokens
                or num_lookahead_tokens
                or full_sequence_must_fit
                or reserved_blocks
                or num_external_computed_tokens
                or num_encoder_tokens
                or delay_cache_blocks
            )
        ):
            blocks = self._defer_decode(request)
            if blocks is not None:
                return blocks
        self._sync()
        rid = request.request_id
        self._check_allocation_args(
            rid,
            num_new_tokens,
            num_lookahead_tokens,
            num_external_computed_tokens,
            num_encoder_tokens,
            delay_cache_blocks,
        )
        first = request.num_computed_tokens == 0
        hit = num_new_computed_tokens if first else 0
        seq = self._register(request)
        if self.async_scheduling and not first:
            return self._allocate_async(request, seq, num_new_tokens, full_sequence_must_fit, reserved_blocks)
        # Positions vLLM counts as computed that pagedkv holds uncomputed (see _accept_drafts).
        unwritten = self._unwritten.get(rid, 0)
        # A verify step (speculative decoding): the tokens past the request's known ones are
        # its drafts (request.spec_token_ids), given lookahead slots in every group.
        num_drafts = 0
        drafts: list[int] | None = None
        spec = getattr(request, "spec_token_ids", None)
        past = request.num_computed_tokens + hit + num_new_tokens - request.num_tokens
        if past > 0 and spec and not first:
            num_drafts = min(past, len(spec))
            # Grammar-invalidated drafts arrive as -1; they are never accepted.
            drafts = [max(int(t), 0) for t in spec[:num_drafts]]
        # Scheduled tokens past the known ones and the drafts are vLLM's placeholders (a new or
        # resumed request with one token left, padded to a verify-sized step): pagedkv has no
        # ids for them; as drafts, vLLM's rollback of them is read like any verify step's.
        # Only real drafts, or placeholders past the last token's block, leave lookahead blocks
        # that keep the request's decodes off the batched path.
        lookahead_blocks = num_drafts > 0
        extra = self._placeholder_drafts(request, past, num_drafts)
        # Under async scheduling they are output placeholders too: the next step is scheduled
        # before vLLM rolls them back (its num_computed_tokens counts them), so they are
        # unknown slots settled like any token in flight, never read as accepted drafts.
        unknown = bool(extra) and self.async_scheduling
        if extra:
            last = request.num_tokens - 1
            lookahead_blocks = lookahead_blocks or (last + extra) // self.block_size != last // self.block_size
            drafts = (drafts or []) + [0 if unknown else UNWRITTEN_TOKEN] * extra
            num_drafts += extra
        watermark = self.watermark_blocks if has_scheduled_reqs and request.status in self._waiting_states else 0
        if full_sequence_must_fit or watermark or reserved_blocks:
            free = self._kvm.num_free_blocks
            take, release = self._kvm.num_blocks_needed(seq, num_new_tokens - num_drafts + unwritten)
            if (
                full_sequence_must_fit
                and self._full_sequence_demand(request, seq, hit, num_new_tokens) + watermark > free + release
            ):
                return None
            if take + watermark > free + release - reserved_blocks:
                return None
        # vLLM reads only the new blocks and the context: no dense tables or per-token arrays.
        if drafts:
            out = self._kvm.step(
                [seq],
                [num_new_tokens - num_drafts + unwritten],
                draft_token_ids=[drafts],
                block_table=False,
                token_arrays=False,
            )
        else:
            out = self._kvm.step([seq], [num_new_tokens + unwritten], block_table=False, token_arrays=False)
        if out.error is not None:
            if isinstance(out.error, OutOfBlocksError):
                return None
            out.raise_for_error()
        if unwritten:
            del self._unwritten[rid]
        expected = request.num_computed_tokens + hit
        got = int(out.context_lens[0]) + unwritten
        if got != expected:
            raise VllmStateMismatchError(
                f"request {rid!r}: pagedkv holds {got} computed tokens, vLLM expects {expected} "
                f"(num_computed_tokens={request.num_computed_tokens}, prefix hit {hit})",
                request_id=rid,
                quantity="num_computed_tokens",
                expected=str(expected),
                got=str(got),
            )
        if unknown:
            self._unknown.add(rid)
        elif drafts:
            self._drafts_pending[rid] = (expected + num_new_tokens - num_drafts, drafts)
            if lookahead_blocks:
                self._had_drafts.add(rid)
        indptr = out.new_block_indptr.tolist()
        ids = out.new_block_ids.tolist()
        if indptr[-1] == 0:
            return self.empty_kv_cache_blocks
        return GroupedBlocks(tuple(ids[indptr[g] : indptr[g + 1]] for g in range(self.num_kv_cache_groups)))

    def _allocate_async(
        self, request: Any, seq: int, num_new_tokens: int, full_sequence_must_fit: bool, reserved_blocks: int
    ) -> Any:
        """``allocate_slots`` of a running or resumed request under async scheduling (as
        ``PagedKVCacheManager``): the known tokens are computed, the slots of tokens whose ids
        a step in flight has not reported get placeholder lookahead slots in every group where
        the blocks held end before them. Windowed groups release by pagedkv's computed count,
        vLLM's processed one (its computed tokens less those in flight). Raises
        ``VllmStateMismatchError`` when pagedkv holds more computed tokens than vLLM counts."""
        rid = request.request_id
        bs = self.block_size
        computed = request.num_computed_tokens
        held = self._kvm.num_computed_tokens(seq)
        if held > computed:
            raise VllmStateMismatchError(
                f"request {rid!r}: pagedkv holds {held} computed tokens, vLLM counts {computed}",
                request_id=rid,
                quantity="num_computed_tokens",
                expected=f"<= {computed}",
                got=str(held),
            )
        end = computed + num_new_tokens
        known_end = min(end, request.num_tokens)
        num_known_new = known_end - held
        num_unknown = end - known_end if -(-end // bs) > -(-known_end // bs) else 0
        if num_known_new == 0 and num_unknown == 0:
            return self.empty_kv_cache_blocks
        if full_sequence_must_fit or reserved_blocks:
            free = self._kvm.num_free_blocks
            take, release = self._kvm.num_blocks_needed(seq, max(num_known_new, 1))
            if take > free + release - reserved_blocks:
                return None
        out = self._kvm.step(
            [seq],
            [num_known_new],
            draft_token_ids=[[0] * num_unknown] if num_unknown else None,
            block_table=False,
            token_arrays=False,
        )
        if out.error is not None:
            if isinstance(out.error, OutOfBlocksError):
                return None
            out.raise_for_error()
        if num_unknown:
            self._unknown.add(rid)
        indptr = out.new_block_indptr.tolist()
        ids = out.new_block_ids.tolist()
        if indptr[-1] == 0:
            return self.empty_kv_cache_blocks
        return GroupedBlocks(tuple(ids[indptr[g] : indptr[g + 1]] for g in range(self.num_kv_cache_groups)))

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """vLLM's ``update_from_output`` hook (as ``PagedKVCacheManager.cache_blocks``): under
        async scheduling, the blocks filled by ``request``'s first ``num_computed_tokens``
        (computed and known) are cached now if pagedkv has not cached them yet."""
        if not self.async_scheduling:
            return
        rid = request.request_id
        seq = self._seq_of.get(rid)
        if seq is None:
            return
        target = min(num_computed_tokens, request.num_tokens)
        bs = self.block_size
        self._sync()
        held = self._kvm.num_computed_tokens(seq)
        if target // bs <= held // bs:
            return
        seq = self._register(request)
        end = target - target % bs
        out = self._kvm.step([seq], [end - held], block_table=False, token_arrays=False)
        if out.error is not None:
            out.raise_for_error()
        if len(out.new_block_ids):
            raise VllmStateMismatchError(
                f"request {rid!r}: caching its computed tokens up to {end} took "
                f"{len(out.new_block_ids)} new block(s); vLLM holds them already",
                request_id=rid,
                quantity="new blocks",
                expected="0",
                got=str(len(out.new_block_ids)),
            )

    def free(self, request: Any) -> None:
        """Releases ``request``'s blocks in every group. A finished request is forgotten; one
        still ``RUNNING`` is being preempted by the scheduler and keeps its tokens (preemption
        by recompute), unless its pagedkv tokens are not vLLM's (unverified drafts: forgotten
        too, re-registered from vLLM's tokens on resume). A request never allocated is a no-op, as in vLLM. Raises
        ``UnknownSequenceError`` for a request freed before that still claims computed
        tokens, changing nothing."""
        self._sync()
        rid = request.request_id
        seq = self._seq_of.get(rid)
        if seq is not None and request.is_finished() and rid in self._drafts_pending and self._cache_finished_drafts:
            # vLLM 0.33 caches the blocks a request's last verify step completed.
            self._accept_drafts(request, seq, strict=False)
        self._drafts_pending.pop(rid, None)
        # Placeholder lookahead slots (async scheduling) go with the free or preemption.
        self._unknown.discard(rid)
        self._unwritten.pop(rid, None)
        if seq is None:
            self._check_unallocated_free(request)
            return
        if request.is_finished() or self._forget_if_diverged(request):
            self._kvm.free(seq)
            del self._seq_of[rid]
            del self._num_known[rid]
            self._had_drafts.discard(rid)
            self._diverged.discard(rid)
        else:
            self._kvm.preempt([seq])

    def remove_skipped_blocks(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        """No-op: pagedkv releases out-of-window blocks in the allocation that moves the
        window, before it counts the blocks it needs (as vLLM's ``allocate_slots``)."""

    def reset_prefix_cache(self) -> bool:
        """Drops every group's prefix-cache entries; False (nothing changed) while any block is
        in use."""
        self._sync()
        try:
            self._kvm.reset_prefix_cache()
        except pagedkv.CacheInUseError:
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    # ---- block tables ----------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """One id list per group (0 for released entries). Raises ``UnknownSequenceError``."""
        self._sync()
        return tuple(t.tolist() for t in self._kvm.block_tables(self.seq_id(request_id)))

    def get_blocks(self, request_id: str) -> Any:
        """The request's block tables as one ``KVCacheBlocks``. Raises
        ``UnknownSequenceError``."""
        tables = self.get_block_ids(request_id)
        return GroupedBlocks(tables) if any(tables) else self.empty_kv_cache_blocks

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        """Each group's first ``ceil(num_computed_tokens / block_size)`` ids."""
        return tuple(
            ids[: -(-num_computed_tokens // bs)]
            for ids, bs in zip(self.get_block_ids(request_id), self.group_block_sizes, strict=True)
        )

    # ---- per-step hooks --------------------------------------------------------------------

    def take_events(self) -> list[Any]:
        """KV events since the last call as ``vllm.distributed.kv_events`` objects, each
        naming its group (``group_idx``) and that group's spec kind."""
        if not self.enable_kv_cache_events:
            return []
        self._sync()
        from pagedkv.integrations.vllm.events import to_vllm_events

        out: list[Any] = []
        for group, event in self._kvm.take_events():
            kind = None if group is None else self.spec_kinds[group]
            out.extend(
                to_vllm_events(
                    [event],
                    lora_ids=self._lora_ids,
                    spec_kind=kind,
                    medium=self.medium,
                    group_idx=0 if group is None else group,
                )
            )
        return out


def _mismatch(what: str, quantity: str, expected: Any, got: Any) -> VllmStateMismatchError:
    return VllmStateMismatchError(
        f"{what}: pagedkv's {quantity} ({got}) differ from vLLM's ({expected})",
        request_id="",
        quantity=quantity,
        expected=str(expected),
        got=str(got),
    )
