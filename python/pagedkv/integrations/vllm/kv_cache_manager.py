"""``PagedKVCacheManager``: the object vLLM's V1 scheduler calls as ``kv_cache_manager``.

A facade, as vLLM's own ``KVCacheManager`` is one over its coordinator, and built as vLLM builds
its own (from the scheduler's ``KVCacheConfig``, with the same constructor arguments): it offers
the methods and attributes vLLM's ``Scheduler`` and engine core use on
``vllm.v1.core.kv_cache_manager.KVCacheManager`` (lookup, slot allocation, free, block ids,
usage, prefix-cache stats, reset, events, the per-step hooks, and ``coordinator``: the
read-only view in :mod:`pagedkv.integrations.vllm.coordinator`), with pagedkv's
``KVCacheManager`` (Rust) as the block pool, prefix cache and block tables of every KV
cache group: one group of full attention, or several (hybrid models: full attention, sliding
window, chunked local; of one block size, or of several whose least common multiple is the
scheduler block size, as vLLM's hybrid coordinator serves them; vLLM's align-mode Mamba groups
beside full attention, as pagedkv state groups: docs/design.md, "Mamba state groups in
vLLM"). The decode fast path lives
in :mod:`pagedkv.integrations.vllm.decode_deferral`, the ``KVCacheBlocks`` results in
:mod:`pagedkv.integrations.vllm.blocks`.

How vLLM's request maps onto a pagedkv sequence:

- each ``Request`` becomes one sequence (an int id) on its first lookup or allocation; its
  finalized tokens (``request.all_token_ids``) are appended to it lazily, right before the next
  allocation, so pagedkv hashes exactly the tokens vLLM would;
- decodes of running requests are answered in Python (``allocate_slots``, through
  :class:`~pagedkv.integrations.vllm.decode_deferral.DecodeDeferral`): with only
  full-attention groups, one inside pagedkv's tail block that does not fill it only records
  where vLLM's slots end (the sequence lags: no block, hash or event would change); the others
  are deferred (with the tokens they lagged by), and the deferred ones reach pagedkv in one
  batched call (``flush_decodes``) before anything else reads or changes pagedkv;
- request identity becomes pagedkv's typed extra keys, mixed into every block hash: the cache
  salt (``cache_salt``), the LoRA adapter (``adapter_id`` = the LoRA name), and each multimodal
  feature (``mm_items``: the feature's identifier with its placeholder position and length), so
  two requests share cached blocks only when vLLM would let them;
- a request preempted by the scheduler (``free`` while still ``RUNNING``) is preempted by
  recompute in pagedkv (blocks released, tokens and memoised hashes kept); a finished one is
  freed and forgotten.

Prefix hits, block counts and the all-or-nothing allocation follow vLLM's ``KVCacheManager``
(the last prompt token is always recomputed; hits are whole blocks). With several groups:

- groups may have different block sizes (vLLM 0.33: the scheduler block size is their LCM,
  ``hash_block_size`` their GCD or a divisor of it): a hit is a multiple of the LCM (vLLM's
  hit alignment without Mamba layers; pagedkv's hit unit), each group holding its own blocks
  of it; vLLM's ``Request.block_hashes`` at ``hash_block_size`` are left to KV connectors
  (pagedkv hashes each group's blocks itself); every allocation takes the per-request path;

- ``KVCacheBlocks`` results carry one id list per group; a released sliding-window or
  chunked-local entry is the null block 0, as vLLM's own null block;
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

Two differences, by design: which free cached block is evicted first (pagedkv's free list vs
vLLM's LRU queue), so block ids and hits can differ once blocks are evicted; and, when one
block's contents are cached twice, vLLM's hit takes the first cached copy even if it is free
while pagedkv's takes the copy in use, so vLLM can hold one block more for the same hits, and
under pressure admission and preemption can diverge later (hits and outputs do not).

Invariant checked on every allocation (and on every flush or catch-up of deferred and lagging
decodes): pagedkv's computed-token count for the request equals ``request.num_computed_tokens``
plus the prefix hit; a mismatch raises :class:`~pagedkv.integrations.vllm.VllmStateMismatchError`
(a ``RuntimeError``) rather than serving a wrong block table.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pagedkv
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError
from pagedkv.integrations.vllm.blocks import PagedKVBlocks, PrefixHit
from pagedkv.integrations.vllm.coordinator import CoordinatorView
from pagedkv.integrations.vllm.decode_deferral import NO_WINDOW, DecodeDeferral
from pagedkv.integrations.vllm.errors import VllmStateMismatchError
from pagedkv.integrations.vllm.events import to_vllm_events
from pagedkv.integrations.vllm.manager_interface import (
    UNWRITTEN_TOKEN,
    SharedManagerCalls,
    caches_finished_drafts,
    pagedkv_hash_algo,
)
from pagedkv.integrations.vllm.pool_view import BlockPoolView, DeferredFree, block_view

__all__ = ["PagedKVCacheManager", "group_spec_of", "request_sequence_spec"]

logger = logging.getLogger(__name__)


def request_sequence_spec(request: Any, lora_ids: dict[str, int]) -> pagedkv.SequenceSpec | None:
    """The block identity of a vLLM ``Request`` as a ``pagedkv.SequenceSpec``: its cache salt,
    LoRA adapter (its name; ``lora_ids`` records name -> ``lora_int_id`` for KV events),
    multimodal features (identifier, placeholder offset, length), and, for a request that must
    not read the prefix cache, a key of its own that nothing else can hit. ``None`` for a
    request with none of them (its blocks hash by their tokens alone, as under the empty
    spec; nothing is built for the common case)."""
    lora = request.lora_request
    if (
        lora is None
        and request.cache_salt is None
        and not request.mm_features
        and not request.skip_reading_prefix_cache
    ):
        return None
    adapter = None
    if lora is not None:
        adapter = lora.lora_name
        lora_ids[adapter] = lora.lora_int_id
    mm_items = [
        (str(f.identifier).encode(), f.mm_position.offset, f.mm_position.length) for f in request.mm_features or ()
    ]
    extra_keys: list[tuple[str, bytes]] = []
    if request.skip_reading_prefix_cache:
        # vLLM must not read the cache for this request (prompt logprobs, pooling); pagedkv
        # always reads on a first allocation, so the request gets keys of its own.
        extra_keys = [("no_prefix_read", request.request_id.encode())]
    return pagedkv.SequenceSpec(request.cache_salt, adapter, extra_keys, mm_items)


def group_spec_of(spec: Any, page_bytes: int) -> pagedkv.KVCacheGroupSpec:
    """pagedkv's ``KVCacheGroupSpec`` for one vLLM KV cache group spec.

    ``FullAttentionSpec`` / ``MLAAttentionSpec`` (without a window) -> ``"full"``,
    ``SlidingWindowSpec`` -> ``"sliding_window"`` (its ``sliding_window``),
    ``SlidingWindowMLASpec`` -> ``"sliding_window"``, out of the prefix cache
    (``prefix_cacheable=False``) with ``bounded_replay`` (vLLM's ``prefix_cacheable``),
    ``ChunkedLocalAttentionSpec`` -> ``"chunked_local"`` (its ``attention_chunk_size``),
    ``MambaSpec`` in ``align`` mode -> ``"state"`` (one recurrent state per aligned block),
    with the spec's ``num_speculative_blocks`` as ``spare_blocks`` (the speculative state
    blocks an MTP / EAGLE drafter's drafts write, after the live state's block); in ``none``
    mode (prefix caching off) -> ``"sliding_window"`` of 2 tokens out of the prefix cache, with
    the spec's ``num_speculative_blocks`` as ``spare_blocks`` (vLLM's Mamba manager there: the
    blocks of ``num_tokens + k * block_size`` slots, those before the block of the last
    computed token freed). ``page_bytes`` is the common page size given to every group
    (pagedkv checks pages are equal; the plug-in does not use their size otherwise), a
    multiple of the block size.
    Raises ``InvalidConfigError`` for any other spec.
    """
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    bs = int(spec.block_size)
    bpt = page_bytes // bs
    kind = type(spec)
    if kind is SlidingWindowSpec:
        return pagedkv.KVCacheGroupSpec("sliding_window", bs, bpt, window=int(spec.sliding_window))
    if kind is SlidingWindowMLASpec:
        return pagedkv.KVCacheGroupSpec(
            "sliding_window",
            bs,
            bpt,
            window=int(spec.sliding_window),
            prefix_cacheable=bool(spec.prefix_cacheable),
        )
    if kind is ChunkedLocalAttentionSpec:
        return pagedkv.KVCacheGroupSpec("chunked_local", bs, bpt, chunk=int(spec.attention_chunk_size))
    if kind is MambaSpec and getattr(spec, "mamba_cache_mode", None) == "align":
        # One recurrent state per block-aligned position (vLLM's align mode), and the drafts'
        # speculative state blocks after the live state's block.
        return pagedkv.KVCacheGroupSpec(
            "state", bs, bpt, spare_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0)
        )
    if kind is MambaSpec and getattr(spec, "mamba_cache_mode", None) == "none":
        # One state per request out of the prefix cache (vLLM's mode "none", prefix caching
        # off): a query after n tokens reads only the state after token n - 1, the rule of a
        # 2-token window, in blocks of mamba_block_size tokens (the context length by default),
        # plus the drafts' speculative state blocks after the slots.
        return pagedkv.KVCacheGroupSpec(
            "sliding_window",
            bs,
            bpt,
            window=2,
            prefix_cacheable=False,
            spare_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0),
        )
    if kind in (FullAttentionSpec, MLAAttentionSpec) and getattr(spec, "sliding_window", None) is None:
        if getattr(spec, "attention_chunk_size", None) is None:
            return pagedkv.KVCacheGroupSpec("full", bs, bpt)
    raise pagedkv.InvalidConfigError(
        f"KV cache group spec {kind.__name__} has no pagedkv equivalent",
        field="kv_cache_spec",
        value=kind.__name__,
        reason="full attention, sliding window, chunked local attention or Mamba in the align / none cache modes only",
    )


def _skipped_tokens(spec: pagedkv.KVCacheGroupSpec, num_computed: int) -> int:
    """Tokens before the first one a query after ``num_computed`` computed tokens reads."""
    if spec.window is not None:
        return max(0, num_computed - spec.window + 1)
    if spec.chunk is not None:
        return num_computed // spec.chunk * spec.chunk
    return 0


def _config_error(field: str, value: Any, reason: str) -> pagedkv.InvalidConfigError:
    return pagedkv.InvalidConfigError(
        f"{field}={value!s} is not supported by PagedKVCacheManager: {reason}",
        field=field,
        value=str(value),
        reason=reason,
    )


class PagedKVCacheManager(SharedManagerCalls):
    """vLLM V1 ``kv_cache_manager`` backed by ``pagedkv.KVCacheManager`` (every KV cache
    group of the scheduler's ``KVCacheConfig`` in one block pool).

    Takes the constructor arguments of vLLM's ``KVCacheManager`` (0.32 / 0.33), plus
    ``hash_algo``:

    Args:
        kv_cache_config: the scheduler's ``vllm.v1.kv_cache_interface.KVCacheConfig`` (at least
            one group; ``num_blocks`` GPU blocks incl. the null block 0).
        max_model_len: the scheduler's ``max_model_len`` in tokens (``None``: no admission cap
            for windowed groups).
        scheduler_block_size: the scheduler block size in tokens (``None``: the LCM of the
            groups' block sizes); must be that LCM.
        hash_block_size: vLLM's prefix-hash granularity (``None``: the scheduler block size);
            must divide every group's block size, or, with prefix caching off and Mamba groups
            in cache mode none, equal the scheduler block size (vLLM's value there). pagedkv
            does not hash at it.
        max_in_flight_tokens: tokens scheduled but not yet settled (vLLM's
            ``VllmConfig.max_in_flight_tokens``), for the windowed groups' admission cap;
            ``None``: ``max_model_len``.
        enable_caching: vLLM's ``enable_prefix_caching``.
        use_eagle: vLLM's ``use_eagle_block_drop`` (EAGLE / EAGLE-3 / MTP drafters with legacy
            block hashes): prefix hits of the groups holding the drafter's layers
            (``is_eagle_group``; all groups when none is marked) drop their last matched block,
            by vLLM's rules (see ``get_computed_blocks``).
        num_prefill_lookahead: vLLM's ``num_prefill_lookahead_tokens``: 0 or 1 (EAGLE-family
            drafters; the scheduler keeps prefill chunks out of it); more (multi-module MTP)
            raises.
        num_hash_lookahead_tokens: vLLM's lookahead block hashes (0 or 1: 1 by default for
            EAGLE-family drafters with prefix caching): each block's prefix-cache key also
            covers the tokens after it (pagedkv's ``CacheConfig.hash_lookahead_tokens``), so a
            block is cached once they are known and a hit needs them; vLLM then drops no block
            of a hit (``use_eagle`` is off). Refused with ``enable_kv_cache_events``.
        dcp_world_size, pcp_world_size, metrics_collector: only their defaults (1, 1,
            ``None``) are served (``check_supported_config`` refuses what needs others).
        log_stats: keep ``PrefixCacheStats`` for ``make_prefix_cache_stats``.
        enable_kv_cache_events: record KV events for ``take_events``.
        watermark: fraction of blocks kept free when admitting waiting / preempted requests.
        enable_mamba_shared_prefix_checkpoint: accepted and unused (shared-prefix Mamba
            checkpoints are refused by ``check_supported_config``).
        hash_algo: vLLM's ``prefix_caching_hash_algo`` (``sha256*`` -> SHA-256, ``xxhash*`` ->
            xxh3-128).

    Raises ``InvalidConfigError`` (nothing built) for a group spec with no pagedkv equivalent,
    a scheduler block size other than the LCM of the groups' block sizes, a
    ``hash_block_size`` not dividing every group's block size, an unknown hash algorithm or an argument
    above other than its default. Other errors are pagedkv's typed errors
    (``pagedkv.errors``, ``pagedkv.integrations.vllm.errors``); a failing call changes nothing,
    except ``VllmStateMismatchError``: raised once pagedkv's record of a request is found to
    differ from vLLM's (after the allocation that showed it), it means the two no longer agree
    and the manager must not serve further steps.
    """

    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int | None = None,
        scheduler_block_size: int | None = None,
        hash_block_size: int | None = None,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        *,
        hash_algo: str = "sha256",
    ) -> None:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind
        from vllm.v1.metrics.stats import PrefixCacheStats
        from vllm.v1.request import RequestStatus

        algo = pagedkv_hash_algo(hash_algo)
        groups = list(kv_cache_config.kv_cache_groups)
        if not groups:
            raise _config_error("kv_cache_config.kv_cache_groups", "[]", "at least one KV cache group")
        sizes = [int(g.kv_cache_spec.block_size) for g in groups]
        lcm = math.lcm(*sizes)
        block_size = lcm if scheduler_block_size is None else int(scheduler_block_size)
        if block_size != lcm:
            # vLLM's hits are multiples of the scheduler block size, pagedkv's of the LCM.
            raise pagedkv.InvalidConfigError(
                f"scheduler block size {block_size} is not the least common multiple {lcm} of the "
                f"KV cache groups' block sizes {sizes}",
                field="kv_cache_spec.block_size",
                value=str(block_size),
                reason=f"must equal {lcm}",
            )
        # vLLM keeps hash_block_size at the scheduler block size (the LCM) when nothing reads
        # the block hashes (prefix caching off) and with Mamba groups outside align mode.
        hashes_unread = not enable_caching and any(
            getattr(g.kv_cache_spec, "mamba_cache_mode", "align") != "align" for g in groups
        )
        if hash_block_size == block_size and hashes_unread:
            pass
        elif hash_block_size is not None and (hash_block_size <= 0 or any(bs % hash_block_size for bs in sizes)):
            raise _config_error("hash_block_size", hash_block_size, f"must divide every group's block size {sizes}")
        for name, value, default in (
            ("dcp_world_size", dcp_world_size, 1),
            ("pcp_world_size", pcp_world_size, 1),
            ("metrics_collector", metrics_collector, None),
        ):
            if value is not None and value != default:
                raise _config_error(name, value, f"only {default} is served")
        lookahead_hashes = int(num_hash_lookahead_tokens or 0)
        if lookahead_hashes not in (0, 1):
            raise _config_error("num_hash_lookahead_tokens", lookahead_hashes, "0 or 1 is served")
        if lookahead_hashes and enable_kv_cache_events:
            raise _config_error(
                "num_hash_lookahead_tokens",
                lookahead_hashes,
                "lookahead block hashes with KV cache events are not served",
            )
        if lookahead_hashes and not enable_caching:
            lookahead_hashes = 0  # vLLM's hashes only key the prefix cache
        if num_prefill_lookahead > 1:
            raise _config_error(
                "num_prefill_lookahead",
                num_prefill_lookahead,
                "at most 1 is served (multi-module MTP's re-prefillable tokens are not)",
            )
        # Every group's page is block_size (the LCM) "bytes": pagedkv checks pages are equal.
        self._specs = [group_spec_of(g.kv_cache_spec, block_size) for g in groups]
        # EAGLE / MTP (vLLM's coordinator): the groups holding the drafter's layers
        # (is_eagle_group), all of them when none is marked; with use_eagle their prefix hits
        # drop the last matched block (the drafter needs its hidden states recomputed).
        flagged = {i for i, g in enumerate(groups) if getattr(g, "is_eagle_group", False)}
        if use_eagle and not flagged:
            flagged = set(range(len(groups)))
        #: KV cache groups holding an EAGLE / MTP drafter's layers (vLLM's ``eagle_group_ids``).
        self.eagle_group_ids: set[int] = flagged
        self.use_eagle = bool(use_eagle)
        self._drop_groups = flagged if use_eagle and enable_caching else set()
        if self._drop_groups and any(self._specs[g].kind == "chunked_local" for g in self._drop_groups):
            raise _config_error(
                "use_eagle", True, "EAGLE's last-block drop on a chunked-local group is not served (nor by vLLM)"
            )
        # vLLM's hit lookup groups KV cache groups of equal specs (full attention first): per
        # such group, (its first group id, full attention?, drops the last block?).
        spec_groups: list[tuple[Any, list[int]]] = []
        for i, g in enumerate(groups):
            if not self._specs[i].prefix_cacheable:
                continue  # takes no part in the hit (vLLM's coordinator skips it too)
            for spec, ids in spec_groups:
                if spec == g.kv_cache_spec:
                    ids.append(i)
                    break
            else:
                spec_groups.append((g.kv_cache_spec, [i]))
        self._hit_groups = sorted(
            (
                (ids[0], self._specs[ids[0]].kind == "full", any(i in self._drop_groups for i in ids))
                for _, ids in spec_groups
            ),
            key=lambda t: not t[1],
        )
        layer_groups = [i for i, g in enumerate(groups) for _ in (g.layer_names or [None])]
        num_blocks = int(kv_cache_config.num_blocks)
        # vLLM's None (dense) and 0 (replay boundary + shared-prefix junctions) are both dense
        # here: pagedkv pins no junction, and caching only the latest replayable point would
        # lose every sibling's hit on a shared prompt that vLLM's junction serves.
        interval = int(getattr(kv_cache_config, "prefix_cache_retention_interval", None) or 0)
        # Speculative state blocks: the state groups' spare blocks (one value for all:
        # config_check and pagedkv's CacheConfig refuse others).
        self._state_spare_blocks = next((s.spare_blocks for s in self._specs if s.kind == "state"), 0)
        self._kvm = pagedkv.KVCacheManager(
            pagedkv.CacheConfig(
                num_blocks,
                groups=self._specs,
                layer_groups=layer_groups,
                enable_prefix_caching=enable_caching,
                retention_interval=interval,
                hash_algo=algo,
                enable_events=enable_kv_cache_events,
                hash_lookahead_tokens=lookahead_hashes,
            )
        )
        #: Tokens after each block its prefix-cache key covers (vLLM's
        #: ``num_hash_lookahead_tokens``; 0 without prefix caching).
        self.num_hash_lookahead_tokens = lookahead_hashes
        self._PrefixCacheStats = PrefixCacheStats
        self._waiting_states = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        self._RUNNING = RequestStatus.RUNNING

        #: The scheduler block size: the LCM of the groups' block sizes, the hit unit.
        self.block_size = block_size
        #: Tokens vLLM recomputes at the end of a prefix hit to rebuild the groups out of the
        #: prefix cache (bounded-replay sliding-window MLA: their window; 0: none).
        self.prefix_replay_tokens = max(
            (int(getattr(g.kv_cache_spec, "prefix_replay_tokens", 0) or 0) for g in groups), default=0
        )
        # Replaying requests: request id -> the end of their hit, up to which pagedkv holds
        # them computed while vLLM's count runs behind over the replayed tokens.
        self._replay_end: dict[str, int] = {}
        #: vLLM's prefix-hash granularity (``Request.block_hashes``, kept for connectors);
        #: pagedkv hashes each group's blocks itself.
        self.hash_block_size = block_size if hash_block_size is None else int(hash_block_size)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = len(groups)
        #: Tokens per block of each KV cache group (read by the coordinator view).
        self.group_block_sizes = tuple(s.block_size for s in self._specs)
        # The finest block boundary of any group (the block size when all groups share one).
        self._unit = math.gcd(*self.group_block_sizes)
        self._mixed = len(set(self.group_block_sizes)) > 1
        #: State groups (vLLM's align-mode Mamba groups): their states are published by
        #: ``commit_steps`` once vLLM reports the step that wrote them, never at allocation.
        self._state_groups = tuple(g for g, s in enumerate(self._specs) if s.kind == "state")
        self._attention_groups = tuple(g for g, s in enumerate(self._specs) if s.kind != "state")
        # Request id -> {state group: (table index, block)}: the copy source of a first
        # allocation's state hit, shown in the request's table until its next allocation
        # (vLLM's model runner copies the hit state from that column; pagedkv released it).
        self._state_sources: dict[str, dict[int, tuple[int, int]]] = {}
        # (request id, aligned end, step it was noted in, step that writes it, the request's
        # holding) of states vLLM caches at allocation and lets no other request hit before
        # its next step; under async scheduling a state written by a step in flight stays
        # unpublished until that step's commit, so hits on it wait until then.
        self._step_states: list[tuple[str, int, int, int, int]] = []
        # Steps scheduled so far (``new_step_starts``) and the latest one committed.
        self._step_no = 0
        self._committed_step = 0
        # Requests whose prefix hit vLLM would take from a state of the current step: their
        # first allocation waits a step, as vLLM's Mamba manager makes it wait.
        self._wait_a_step: set[str] = set()
        # Request id -> how many times it was freed or preempted: a step's ends are committed
        # only for the holding of the request that the step ran (``commit_steps``).
        self._releases: dict[str, int] = {}
        # New attention blocks since the last take_new_block_ids (zeroed by vLLM's worker when
        # Mamba layers share the pool).
        self._new_attention_ids: list[int] = []
        # vLLM 0.32 marks a state hit at the prompt's last aligned boundary as cached in the
        # step (0.33 does not).
        self._recache_prompt_hit = not caches_finished_drafts()
        #: pagedkv's retention interval in tokens (0: dense).
        self.retention_interval = interval
        self.watermark_blocks = int(watermark * num_blocks)
        # A PagedKVBlocks, so the scheduler's per-request ``get_block_ids(allow_none=True)`` on
        # it is one check (vLLM's own KVCacheBlocks walks its groups).
        self.empty_kv_cache_blocks = PagedKVBlocks(tuple([] for _ in groups))
        #: The scheduler's ``KVCacheConfig``, its first group's ``KVCacheSpec`` and its
        #: ``max_model_len``.
        self.kv_cache_config = kv_cache_config
        self.kv_cache_spec = groups[0].kv_cache_spec
        self.max_model_len = max_model_len
        #: Each group's kind for ``BlockStored.kv_cache_spec_kind``.
        self.spec_kinds = [get_kv_cache_spec_kind(g.kv_cache_spec).value for g in groups]
        self.medium = "GPU"
        #: Mamba shared-prefix checkpoints: never (refused by the config check).
        self.mamba_shared_prefix_checkpoint = False
        # Per group, vLLM's recycling-aware admission cap in blocks (None: no cap).
        in_flight = max_in_flight_tokens if max_in_flight_tokens is not None else (max_model_len or 0)
        self._admission_caps: list[int | None] = []
        for g, spec in zip(groups, self._specs, strict=True):
            cap = None
            if spec.kind == "state":
                # vLLM's align-mode Mamba manager takes at most one state block per allocation
                # (a first one: also the speculative state blocks).
                cap = 1 + self._state_spare_blocks
            elif g.kv_cache_spec.__class__.__name__ == "MambaSpec":
                pass  # mode none: vLLM caps no Mamba group
            elif spec.kind != "full" and max_model_len is not None:
                cap = int(g.kv_cache_spec.max_admission_blocks_per_request(in_flight, max_model_len))
            self._admission_caps.append(cap)
        self._coordinator = CoordinatorView(self)

        self._num_usable = num_blocks - 1
        # request id -> pagedkv sequence id, and how many of its tokens pagedkv holds (read
        # by the batched decode path).
        self._seq_of: dict[str, int] = {}
        self._num_known: dict[str, int] = {}
        self._next_seq_id = 0
        self._lora_ids: dict[str, int] = {}
        # Live requests by id (their token lists feed the catch-up of lagging decodes).
        self._requests: dict[str, Any] = {}
        #: The decode fast path: lagging and deferred decodes (see ``allocate_slots``).
        #: Decodes lag only when no group releases blocks as the sequence grows.
        self.decodes = DecodeDeferral(
            self._kvm,
            self._unit,
            len(groups),
            all(s.kind == "full" for s in self._specs),
            self._seq_of,
            self._num_known,
            self._requests,
            self.empty_kv_cache_blocks,
            self._RUNNING,
        )
        # Groups of different block sizes: every allocation takes the per-request path (the
        # batched decode path assumes one block boundary for every group).
        #: Newly allocated blocks are handed to the worker for zeroing (vLLM's
        #: ``needs_kv_cache_zeroing`` without state groups: caches of mixed precision, where a
        #: block reused across groups would decode stale bytes): every allocation then takes
        #: the per-request path, which records its new blocks (``take_new_block_ids``). With
        #: state groups the attention groups' new blocks are recorded as they are taken.
        self.zeroing = bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False)) and not self._state_groups
        # Mamba groups outside align mode: vLLM zeroes attention blocks only.
        self._never_zeroed: frozenset[int] = frozenset(
            g for g, grp in enumerate(groups) if type(grp.kv_cache_spec).__name__ == "MambaSpec"
        )
        # Groups whose new blocks an async KV load writes (not zeroed: it would race the load).
        self._skip_zeroing: frozenset[int] = frozenset()
        self.decodes.enabled = not self._mixed and not self._state_groups and not self.zeroing
        # The fast path's state, read inline by allocate_slots once per decode (the same
        # dicts as the deferral's), its defer and its pre-call sync.
        self._lag = self.decodes.lag
        self._lag_window = self.decodes.lag_window
        self._defer = self.decodes.defer
        self._sync = self.decodes.sync
        # Speculative decoding: request id -> (the computed count its draft tokens start at,
        # the drafts) for a verify step whose acceptance vLLM has not reported yet. vLLM
        # reports it by rolling num_computed_tokens back over the rejected drafts; the
        # request's next allocation (or free) reads it from there.
        self._drafts_pending: dict[str, tuple[int, list[int]]] = {}
        # Speculative state blocks: request id -> the accepted end its last verify step's
        # drafts reached (published as they were resolved), until its next allocation notes it.
        self._accepted_ends: dict[str, int] = {}
        self._diverged: set[str] = set()
        self._unwritten: dict[str, int] = {}
        # vLLM 0.33 caches the blocks a request's last verify step completed before freeing
        # it; 0.32 does not (pagedkv follows the installed release).
        self._cache_finished_drafts = caches_finished_drafts()
        #: Async scheduling (set by ``PagedKVAsyncScheduler``): slots past a request's known
        #: tokens are for tokens whose ids a step in flight has not reported yet.
        self.async_scheduling = False
        # Async scheduling: request id -> end of the slots pagedkv holds for it, for a request
        # whose unknown tokens took lookahead slots (placeholder drafts, never hashed); its
        # next allocation, cache_blocks or free settles them.
        self._unknown: dict[str, int] = {}
        # KV connectors: requests whose external KV is loading asynchronously (pagedkv
        # sequence "loading": staged blocks, registered at cache_blocks).
        self._loading: set[str] = set()
        #: vLLM's ``block_pool`` for KV connectors and vLLM's tests: a read-only live view of
        #: pagedkv's pool (:class:`~pagedkv.integrations.vllm.pool_view.BlockPoolView`).
        self.block_pool = BlockPoolView(self)
        #: The null block 0's one view (vLLM compares table entries with its null block by
        #: identity).
        self.null_block_view = block_view(self._kvm.pool, 0)

    # ---- properties vLLM reads -------------------------------------------------------------

    @property
    def defer_decodes(self) -> bool:
        """Defer plain decodes of running requests and allocate them in one batched call
        (``flush_decodes``); off: one call into Rust per ``allocate_slots``. Always off with
        KV cache groups of different block sizes and with block zeroing (setting it on changes
        nothing then)."""
        return self.decodes.enabled

    @defer_decodes.setter
    def defer_decodes(self, on: bool) -> None:
        self.decodes.enabled = bool(on) and not self._mixed and not self._state_groups and not self.zeroing

    @property
    def num_batched_allocations(self) -> int:
        """Decode slots carried into pagedkv by the batched path so far (a lagging run of
        decodes counts each of its tokens)."""
        return self.decodes.num_batched_allocations

    @property
    def num_batch_stops(self) -> int:
        """Decodes not deferred because the free blocks could not cover them (they took the
        per-request path, where vLLM's loop preempts)."""
        return self.decodes.num_batch_stops

    @property
    def state_speculative_blocks(self) -> int:
        """Speculative state blocks per state group (vLLM's ``num_speculative_blocks`` of its
        align-mode Mamba groups; 0: none): the state groups' ``KVCacheGroupSpec.spare_blocks``
        (read-only)."""
        return self._state_spare_blocks

    @property
    def manager(self) -> pagedkv.KVCacheManager:
        """The underlying ``pagedkv.KVCacheManager`` (inspection, invariant checks), with
        every deferred and lagging decode brought in first, so its token and computed-token
        counts are vLLM's."""
        self._sync()
        if self._lag:
            self.decodes.catch_up(list(self._lag))
        return self._kvm

    @property
    def usage(self) -> float:
        """KV cache usage in [0, 1]: ``1 - free / (num_blocks - 1)``, as vLLM's block pool
        (free includes evictable cached blocks)."""
        if not self._num_usable:
            return 0.0
        self._sync()
        return 1.0 - self._kvm.num_free_blocks / self._num_usable

    def pool_now(self) -> Any:
        """pagedkv's ``BlockPool`` with every deferred decode in (read by the pool view)."""
        self._sync()
        return self._kvm.pool

    def num_free_blocks_now(self) -> int:
        """Free blocks, evictable cached ones included, with every deferred decode in."""
        self._sync()
        return int(self._kvm.num_free_blocks)

    def held_block_views(self, group: int) -> dict[str, list[Any]]:
        """Request id -> live block views of group ``group``'s blocks it holds, for every
        request holding blocks (``GroupManagerView.req_to_blocks``)."""
        self._sync()
        pool = self._kvm.pool
        out: dict[str, list[Any]] = {}
        for rid, seq in self._seq_of.items():
            ids = self._kvm.block_table(seq, group).tolist()
            if ids:
                null = self.null_block_view
                out[rid] = [null if b == 0 else block_view(pool, b) for b in ids]
        return out

    # ---- request registration --------------------------------------------------------------

    def _register(self, request: Any) -> int:
        """The sequence of ``request``, created on first use; new finalized tokens appended."""
        rid = request.request_id
        seq = self._seq_of.get(rid)
        if seq is None:
            seq = self._next_seq_id
            spec = request_sequence_spec(request, self._lora_ids)
            self._kvm.add_sequence(seq, request._all_token_ids, spec=spec)
            self._next_seq_id += 1
            self._seq_of[rid] = seq
            self._requests[rid] = request
            self._num_known[rid] = request.num_tokens
            return seq
        if rid in self._lag:
            self.decodes.catch_up([rid])
        if self._unknown and rid in self._unknown:
            self._settle_unknown(rid, seq)
        if self._drafts_pending and rid in self._drafts_pending:
            self._accept_drafts(request, seq, strict=True)
        known = self._num_known[rid]
        n = request.num_tokens
        if n > known:
            self._kvm.append_tokens(seq, request.all_token_ids[known:])
            self._num_known[rid] = n
            self.decodes.close_window(rid)
        return seq

    def _settle_unknown(self, rid: str, seq: int) -> None:
        """Async scheduling: drops the placeholder drafts of ``rid``'s unknown tokens, keeping
        their lookahead blocks (vLLM's model runner holds them); the tokens, once known, are
        appended and computed into those blocks by the next allocation."""
        end = self._unknown.pop(rid)
        self._kvm.accept_drafts(seq, 0, release_blocks=False)
        self.decodes.keep_lookahead(rid, end)

    def _accept_drafts(self, request: Any, seq: int, *, strict: bool) -> None:
        """Resolves the request's verify step: vLLM rolled ``num_computed_tokens`` back over
        the rejected drafts, so the accepted ones are those still counted as computed. Their
        blocks stay in the tables (vLLM's model runner only appends to them); the rejected
        slots are written again by the next step.

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
            tokens = request.all_token_ids[base : base + len(drafts)]
            limit = max(0, min(request.num_computed_tokens - base, len(tokens)))
            accepted = 0
            while accepted < limit and tokens[accepted] == drafts[accepted]:
                accepted += 1
        self._kvm.accept_drafts(seq, accepted, release_blocks=False)
        self._num_known[rid] += accepted
        if self._state_spare_blocks and strict and accepted:
            # The state at the accepted end (when aligned; the runner copied it into its own
            # column after the step): published now, as vLLM hashes it by this allocation.
            end = base + accepted
            self._kvm.commit_computed(seq, end)
            self._accepted_ends[rid] = end
        # The blocks of the rejected drafts' slots stay: decodes that open them take none.
        self.decodes.keep_lookahead(rid, base + len(drafts))
        if unwritten:
            # Positions vLLM counts as computed past the drafts: computed by the next allocation.
            self._kvm.append_tokens(seq, [UNWRITTEN_TOKEN] * unwritten)
            self._num_known[rid] += unwritten
            self._unwritten[rid] = unwritten

    # ---- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None) -> tuple[Any, int, int]:
        """Prefix hit of a waiting request: ``(blocks, hit tokens, 0)``, the hit being the
        longest prefix every group serves.

        Hit tokens are whole blocks, capped at ``num_tokens - 1`` (the last token is always
        recomputed for its logits). ``blocks`` is an opaque token for ``allocate_slots``. Raises
        ``InvalidArgumentError`` for a ``max_cache_hit_length`` below the hit (pagedkv takes the
        whole hit when it allocates), changing nothing.

        With EAGLE's last-block drop (``use_eagle``) the hit is vLLM's: one group, the hit
        above less one block; several groups, vLLM's reconciliation of the groups (each
        drafter group matches one block past the candidate, capped at the request's full
        blocks, and drops it; see :meth:`_eagle_hit`). The allocation takes exactly it.
        """
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        self._sync()
        seq = self._register(request)
        if self._state_groups:
            self._kvm.set_state_from_load(seq, False)  # a divergent hit's, now reconciled
        if self._drop_groups:
            hit = self._eagle_hit(request, seq)
        else:
            if self.prefix_replay_tokens:
                self._kvm.set_hit_limit(seq, None)  # an ignored hit's cap (see _allocate)
            hit = self._kvm.lookup_prefix(seq)
        self._check_hit_cap(hit, max_cache_hit_length)
        boundary = 0
        if self._state_groups:
            limit = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
            longest, pending = self._pending_state_hit(request, seq, hit, limit)
            self._wait_a_step.discard(request.request_id)
            if pending:
                self._wait_a_step.add(request.request_id)
            # vLLM's shared-prefix boundary: an attention group's longer hit (the scheduler
            # ends a prefill chunk there, so the state at it gets cached).
            boundary = longest if longest > max(hit, pending) else 0
        if hit == 0:
            return self.empty_kv_cache_blocks, 0, boundary
        return PrefixHit(hit, [hit // bs for bs in self.group_block_sizes], seq), hit, boundary

    def _eagle_hit(self, request: Any, seq: int) -> int:
        """The prefix hit vLLM's coordinator gives ``request`` with EAGLE's last-block drop,
        which then caps ``seq``'s first allocation (``set_hit_limit``).

        One group: the longest cached prefix of at most ``num_tokens - 1`` tokens, less one
        block. Several: vLLM's fixed point over the groups of equal specs, full attention
        first, from ``num_tokens - 1``: a group holding drafter layers looks up to one block
        past the candidate (at most ``num_tokens // block_size`` blocks) and drops its last
        matched block (a windowed one needs its window cached at both the hit and one block
        past it); other groups take the longest hit up to the candidate; any shrink restarts
        the pass (one pass for one full-attention group plus one other)."""
        kvm = self._kvm
        bs = self.block_size
        n = request.num_tokens
        kvm.set_hit_limit(seq, None)
        if self.num_kv_cache_groups == 1:
            hit = max(kvm.lookup_prefix(seq) - bs, 0)
        else:
            hit = self._hybrid_eagle_hit(seq, n)
        kvm.set_hit_limit(seq, hit)
        return int(kvm.lookup_prefix(seq))

    def _hybrid_eagle_hit(self, seq: int, num_tokens: int) -> int:
        """vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit`` with drafter groups, on
        pagedkv's per-group lookups (``lookup_prefix_group``)."""
        kvm = self._kvm
        bs = self.block_size
        cap = num_tokens // bs * bs
        groups = self._hit_groups
        simple = len(groups) == 2 and groups[0][1]

        def window(g: int, limit: int, drop: bool) -> int:
            p = int(kvm.lookup_prefix_group(seq, g, limit))
            if not drop:
                return p
            # The window cached at p and at p - bs: vLLM's one extra contiguous block.
            while p > 0:
                if kvm.lookup_prefix_group(seq, g, p - bs) == p - bs:
                    return p - bs
                p = int(kvm.lookup_prefix_group(seq, g, p - bs))
            return 0

        hit_length = num_tokens - 1
        by_group: dict[int, int] = {}
        verified: set[int] = set()
        while True:
            curr = hit_length
            for idx, (g, full, eagle) in enumerate(groups):
                if full and idx in by_group:
                    curr = min(curr, by_group[idx])
                    continue
                drop = eagle and idx not in verified
                # A state group's finder never drops (vLLM: drafters have no Mamba layers),
                # nor looks past the candidate; its drop still counts as verified.
                state = self._specs[g].kind == "state"
                limit = min(curr + bs, cap) if drop and not state else curr
                if full:
                    h = int(kvm.lookup_prefix_group(seq, g, limit))
                    if drop and h > 0:
                        h -= bs
                else:
                    h = window(g, limit, drop and not state)
                if drop:
                    verified.add(idx)
                elif h < curr:
                    verified.clear()
                curr = h
                by_group[idx] = h
            if curr >= hit_length:
                break
            hit_length = curr
            if simple:
                break
        return max(hit_length, 0) // bs * bs

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens of ``request`` covered by blocks registered in the prefix cache (every group
        caches its blocks full of computed tokens as they fill, so whole computed blocks)."""
        seq = self._seq_of.get(request.request_id)
        if seq is None or not self.enable_caching:
            return 0
        self._sync()
        computed = self._lag.get(request.request_id)
        if computed is None:
            computed = self._kvm.num_computed_tokens(seq)
        computed = int(min(computed, request.num_tokens))
        return computed - computed % self.block_size

    # ---- allocation ------------------------------------------------------------------------

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

        As vLLM: blocks for ``num_computed + hit + num_new_tokens`` tokens, all or nothing;
        out-of-window blocks are given back in the same call and count as free for it;
        waiting / preempted requests also leave ``watermark_blocks`` free when others are
        scheduled; ``full_sequence_must_fit`` admits a request only if all its tokens fit (a
        windowed group counted up to its admission cap). Every full block of computed tokens
        is registered in the prefix cache.

        Speculative decoding: the tokens scheduled past the request's known ones are its
        drafts (``request.spec_token_ids``); they get lookahead slots in every group in the
        same call and are never hashed. vLLM reports their verification by rolling
        ``num_computed_tokens`` back over the rejected ones; the request's next allocation
        reads the accepted count from there (``accept_drafts(..., release_blocks=False)``:
        vLLM's model runner keeps the blocks, so pagedkv does too, and the next steps fill
        them). So do the tokens scheduled past the known ones and the drafts (vLLM's
        placeholder drafts when it pads a new or resumed request with one token left to a
        verify-sized step), as drafts of ``UNWRITTEN_TOKEN`` ids; vLLM rolls them back.

        A plain decode of a running request (one token, no other option) is answered without
        calling into Rust (``defer_decodes``, see
        :class:`~pagedkv.integrations.vllm.decode_deferral.DecodeDeferral`): with only
        full-attention groups, inside pagedkv's tail block without filling it, it returns the
        shared empty result and only records where vLLM's slots end (a lagging decode);
        otherwise it is deferred to the next ``flush_decodes``.

        KV connectors: ``num_external_computed_tokens`` / ``delay_cache_blocks`` take the
        external path (:meth:`_allocate_external`: a sync load computed at once, an async one
        staged until :meth:`cache_blocks`). With state groups (align-mode Mamba) the load's
        live state column is the table's last, as vLLM lays it out; an async load's state is
        staged (never a hit) until the load completed in full, then published.

        EAGLE / MTP: ``num_lookahead_tokens`` slots past the scheduled tokens (and drafts), capped
        at ``max_model_len``, get blocks in every group in the same call, held as spare
        lookahead blocks (never hashed) that the next allocations fill first, as vLLM holds
        them.

        Raises ``InvalidArgumentError`` for ``num_new_tokens <= 0`` (0 only with
        ``delay_cache_blocks``), ``num_lookahead_tokens < 0`` or a feature the config check
        refuses (encoder tokens, lookahead slots with external tokens), and
        ``VllmStateMismatchError`` (a ``RuntimeError``) if pagedkv's computed-token count
        disagrees with the request's.
        """
        if num_new_tokens == 1 and not (
            (self._drafts_pending and request.request_id in self._drafts_pending)
            or (self._unwritten and request.request_id in self._unwritten)
            # Async scheduling: a placeholder slot whose step was settled with no step in
            # flight since (the engine drained); the per-request path settles it.
            or (self._unknown and not request.num_output_placeholders and request.request_id in self._unknown)
            or num_lookahead_tokens
            or num_new_computed_tokens
            or (self._replay_end and request.request_id in self._replay_end)
            or full_sequence_must_fit
            or reserved_blocks
            or num_external_computed_tokens
            or num_encoder_tokens
            or delay_cache_blocks
        ):
            # Runs once per decoding request per step, so the lagging decode is checked
            # inline: its slot lies in the window of positions inside pagedkv's tail block
            # that do not fill it (the window exists only while pagedkv holds every token
            # before it as computed, only with defer_decodes on, and only when no group
            # releases blocks as the sequence grows).
            rid = request.request_id
            pos = request.num_computed_tokens
            windows = self._lag_window  # empty unless every group is full attention
            if not request.num_output_placeholders:
                if windows:
                    first, end = windows.get(rid, NO_WINDOW)
                    if first <= pos < end and len(request._all_token_ids) == pos + 1:
                        self._lag[rid] = pos + 1
                        return self.empty_kv_cache_blocks
                if self.decodes.enabled:
                    blocks = self._defer(request, rid, pos)
                    if blocks is not None:
                        return blocks
            elif len(request._all_token_ids) == pos and self.decodes.enabled:
                # Async scheduling: the slot's token is the one the step in flight samples.
                # pagedkv computes the last known token (slot pos - 1) as a plain decode; the
                # slot pos lies in the same block, or opens one: then it gets a placeholder
                # lookahead slot in the same batched step.
                if self._unknown and rid in self._unknown:
                    # The previous slot's placeholder: its token is known now. The block stays.
                    self._settle_unknown(rid, self._seq_of[rid])
                elif windows:
                    first, end = windows.get(rid, NO_WINDOW)
                    if first < pos <= end:
                        self._lag[rid] = pos
                        return self.empty_kv_cache_blocks
                placeholder = not pos % self.block_size
                blocks = self._defer(request, rid, pos - 1, placeholder)
                if blocks is not None:
                    if placeholder:
                        self._unknown[rid] = pos + 1
                    return blocks
        if self.zeroing and skip_zeroing_group_ids and delay_cache_blocks:
            self._skip_zeroing = frozenset(skip_zeroing_group_ids)
            try:
                return self._allocate(
                    request,
                    num_new_tokens,
                    num_new_computed_tokens,
                    num_lookahead_tokens,
                    num_external_computed_tokens,
                    delay_cache_blocks,
                    num_encoder_tokens,
                    full_sequence_must_fit,
                    reserved_blocks,
                    has_scheduled_reqs,
                )
            finally:
                self._skip_zeroing = frozenset()
        return self._allocate(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
        )

    def _full_sequence_demand(
        self,
        request: Any,
        hit: int,
        num_new_tokens: int,
        per_group: list[tuple[int, int]],
        held: list[int] | None = None,
    ) -> int:
        """Blocks vLLM's admission gate asks free for the whole request (per group its blocks
        for every token, a windowed group at most its admission cap, less the hit's blocks,
        plus the hit blocks that leave the free pool). ``per_group``: pagedkv's
        ``num_blocks_needed_per_group`` for the ``num_new_tokens`` scheduled. ``held``: per
        group, the blocks a request already holds (one promoted after its KV loaded), which
        vLLM's gate subtracts instead of a hit."""
        total = min(request.num_tokens, self.max_model_len or request.num_tokens)
        demand = 0
        for g, spec in enumerate(self._specs):
            bs = spec.block_size
            required = -(-total // bs)
            cap = self._admission_caps[g]
            if cap is not None:
                required = min(required, cap)
            if spec.kind != "state":
                required += spec.spare_blocks  # a state group's: within its cap (1 + k)
            if held is not None:
                demand += max(required - held[g], 0)
                continue
            if not spec.prefix_cacheable:
                # No hit blocks (vLLM's manager gets none for it): fresh ones from the window on.
                demand += max(required - _skipped_tokens(spec, hit) // bs, 0)
                continue
            hit_blocks = hit // bs
            if spec.kind == "state" and self._state_spare_blocks:
                # vLLM's align-mode count with speculative blocks: every column up to the
                # sequence's last one plus the k spares, less the hit's, at most 1 + k.
                k = self._state_spare_blocks
                # The core's take counts the hit's state block when it is free (evictable).
                evictable = max(0, per_group[g][0] - (1 + k))
                demand += min(max(-(-total // bs) + k - hit_blocks, 0), 1 + k) + evictable
                continue
            fresh_now = -(-(hit + num_new_tokens) // bs) - hit_blocks
            evictable_hits = max(0, per_group[g][0] - fresh_now)
            demand += max(required - max(_skipped_tokens(spec, hit) // bs, hit_blocks), 0) + evictable_hits
        return demand

    def _allocate_one(self, seq: int, num_tokens: int, drafts: list[int] | None, lookahead: int = 0) -> Any:
        """One sequence's ``allocate_slots`` in every group (``num_tokens`` known tokens
        computed, ``drafts`` given lookahead slots, then ``lookahead`` slots of tokens not
        known yet, EAGLE / MTP's): the ``pagedkv.SlotAllocation``, or None when the pool cannot
        hold it (nothing changed). The per-request call, cheaper than a one-sequence ``step``
        (no batch arrays are built)."""
        if self._state_groups:
            # State groups' table lengths before the call: their new entries (the null
            # columns and the new live state block) are vLLM's new block ids.
            self._pre_lens = (seq, [len(self._kvm.block_table(seq, g)) for g in self._state_groups])
        try:
            if lookahead:
                return self._kvm.allocate_slots(seq, num_tokens, drafts, lookahead)
            return self._kvm.allocate_slots(seq, num_tokens, drafts)
        except OutOfBlocksError:
            return None

    def _new_blocks(self, alloc: Any) -> Any:
        """The new blocks of one sequence's allocation (a ``SlotAllocation``: its
        ``new_block_ids`` group-major, ``new_block_indptr`` ``[G + 1]``) as one
        ``KVCacheBlocks`` (per group)."""
        if self._state_groups:
            return self._new_blocks_with_states(alloc)
        ids = alloc.new_block_ids.tolist()
        if not ids:
            return self.empty_kv_cache_blocks
        if self.num_kv_cache_groups == 1:
            if self.zeroing and not self._skip_zeroing and not self._never_zeroed:
                self._new_attention_ids.extend(ids)
            return PagedKVBlocks((ids,))
        indptr = alloc.new_block_indptr.tolist()
        per_group = tuple(ids[indptr[g] : indptr[g + 1]] for g in range(self.num_kv_cache_groups))
        if self.zeroing:
            for g, group_ids in enumerate(per_group):
                if g not in self._skip_zeroing and g not in self._never_zeroed:
                    self._new_attention_ids.extend(group_ids)
        return PagedKVBlocks(per_group)

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Records ``request_id``'s blocks from token ``start_token`` on (block-aligned in every
        group) for zeroing again: the blocks a failed async KV load left unwritten. A no-op
        without zeroing. Raises ``InvalidArgumentError`` for a ``start_token`` not on every
        group's block boundary, and ``UnsupportedVllmCallError`` with state groups (a failed
        load's Mamba states are not zeroed again)."""
        if self._state_groups:
            super().record_blocks_for_zeroing(request_id, start_token)
        if not self.zeroing:
            return
        if any(start_token % bs for bs in self.group_block_sizes):
            raise InvalidArgumentError(
                f"start_token {start_token} is not on every KV cache group's block boundary "
                f"{list(self.group_block_sizes)}",
                arg="start_token",
                value=str(start_token),
                reason="zeroing a partially valid block would wipe its valid prefix",
            )
        for g, ids in enumerate(self.get_block_ids(request_id)):
            if g not in self._never_zeroed:
                self._new_attention_ids.extend(ids[start_token // self.group_block_sizes[g] :])

    def _new_blocks_with_states(self, alloc: Any) -> Any:
        """``_new_blocks`` with state groups: a state group's entries are its table's new
        columns (null ``0`` for skipped positions, then the new live state block), as vLLM's
        align-mode Mamba manager returns them, so the model runner's append-only table stays
        positional; the attention groups' new blocks are also kept for
        ``take_new_block_ids`` (vLLM zeroes them when Mamba layers share the pool)."""
        seq, before = self._pre_lens
        ids = alloc.new_block_ids.tolist()
        indptr = alloc.new_block_indptr.tolist()
        groups = [ids[indptr[g] : indptr[g + 1]] for g in range(self.num_kv_cache_groups)]
        for g in self._attention_groups:
            self._new_attention_ids.extend(groups[g])
        for g, n in zip(self._state_groups, before, strict=True):
            groups[g] = self._kvm.block_table(seq, g).tolist()[n:]
        if not any(groups):
            return self.empty_kv_cache_blocks
        return PagedKVBlocks(tuple(groups))

    def _note_state_step(
        self, rid: str, out: Any, first: bool, ctx: int, end: int, written_before: bool = False
    ) -> None:
        """Records what an allocation did to ``rid``'s state groups: a first allocation's hit
        state (its copy source, shown in the table until the next allocation) and an aligned
        step end (a state vLLM caches at allocation, so hits on it wait a step); ``ctx`` /
        ``end``: the step's first position and the end of the tokens this allocation made
        known and computed (the step's end in synchronous scheduling; under async scheduling
        the known tokens' end, 0 when none became known; ``written_before``: the state there
        was written by the request's previous step, not this one)."""
        bs = self.block_size
        if first and out.num_cached_tokens:
            hit = int(out.num_cached_tokens)
            idx = (hit - 1) // self.block_size
            sources = {int(g): (idx, int(src)) for g, src, _ in out.copies.tolist() if int(g) in self._state_groups}
            if sources:
                self._state_sources[rid] = sources
        step = self._step_no
        holding = self._releases.get(rid, 0)
        if self._recache_prompt_hit and 0 < ctx == (self._requests[rid].num_prompt_tokens - 1) // bs * bs:
            # vLLM 0.32 caches the state at the prompt's last aligned boundary again when a
            # step starts there (a hit or the previous chunk's end, written by an earlier
            # step; 0.33 does not), so its siblings wait a step for it.
            self._step_states.append((rid, ctx, step, step - 1, holding))
        if end and end % bs == 0:
            # Written by this step, or (async scheduling, a decode whose input token just
            # became known) by the request's previous one.
            self._step_states.append((rid, end, step, step - 1 if written_before else step, holding))

    def _attention_hit(self, seq: int, g: int, limit: int) -> int:
        """Attention group ``g``'s own hit for ``seq`` of at most ``limit`` tokens, as vLLM's
        hybrid coordinator's first pass finds it: a group holding EAGLE / MTP drafter layers
        matches one block past ``limit`` (at most the sequence's full blocks) and drops its
        last matched block."""
        if g not in self._drop_groups:
            return int(self._kvm.lookup_prefix_group(seq, g, limit))
        bs = self.block_size
        cap = int(self._kvm.num_tokens(seq)) // bs * bs
        return max(int(self._kvm.lookup_prefix_group(seq, g, min(limit + bs, cap))) - bs, 0)

    def _pending_state_hit(self, request: Any, seq: int, hit: int, limit: int) -> tuple[int, int]:
        """vLLM's view of a waiting request's hit with state groups: ``(longest, pending)``:
        the longest prefix an attention group alone serves (at most ``limit``; vLLM's
        shared-prefix boundary when longer than the hit) and the longest aligned end at or
        past ``hit`` (at most ``longest``) whose state a request wrote in the current step
        under the same token prefix (0: none; vLLM 0.32 also counts a hit at the prompt's
        last aligned boundary taken in this step). vLLM caches such a state at allocation and
        makes the request wait a step; pagedkv publishes it once the step completed
        (``commit_steps``)."""
        longest = max((self._attention_hit(seq, g, limit) for g in self._attention_groups), default=0)
        pending = 0
        if self._step_states:
            tokens = request.all_token_ids
            key = _identity(request)
            for rid, end, noted, written, holding in self._step_states:
                other = self._requests.get(rid)
                # vLLM keys its cached-this-step set by hash: a state of this step at the hit
                # itself (the same prefix) makes the request wait as well.
                if other is None or rid == request.request_id or not (max(pending, hit, 1) <= end <= longest):
                    continue
                if noted != self._step_no and (
                    written <= self._committed_step or self._releases.get(rid, 0) != holding
                ):
                    continue  # committed by now (published), or its writer was preempted
                if other.all_token_ids[:end] == tokens[:end] and _identity(other) == key:
                    pending = end
        return longest, pending

    def _allocate(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        delay_cache_blocks: bool,
        num_encoder_tokens: int,
        full_sequence_must_fit: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
    ) -> Any:
        """``allocate_slots`` through one call into Rust (the per-request path)."""
        self._sync()
        rid = request.request_id
        if num_external_computed_tokens or delay_cache_blocks:
            return self._allocate_external(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                num_lookahead_tokens,
                num_external_computed_tokens,
                delay_cache_blocks,
                num_encoder_tokens,
                full_sequence_must_fit,
                reserved_blocks,
                has_scheduled_reqs,
            )
        base = request.num_computed_tokens
        # Prefix replay: a first allocation adopting a hit may schedule no token past it (the
        # step recomputes only replayed tokens of the hit).
        adopt_only = num_new_tokens == 0 and base == 0 and num_new_computed_tokens > 0 and self.prefix_replay_tokens
        self._check_allocation_args(
            rid,
            1 if adopt_only else num_new_tokens,
            num_lookahead_tokens,
            num_external_computed_tokens,
            num_encoder_tokens,
            delay_cache_blocks,
        )
        seq = self._register(request)
        if self._replay_end and rid in self._replay_end:
            # vLLM recomputes the replayed tokens of the hit, which pagedkv holds computed
            # (their slots exist): only the slots past the hit's end are new.
            end = self._replay_end[rid]
            if base + num_new_tokens <= end:
                return self.empty_kv_cache_blocks
            del self._replay_end[rid]
            if base < end:
                num_new_tokens -= end - base
                base = end
        first = base == 0
        if self._state_groups:
            self._state_sources.pop(rid, None)
            if rid in self._wait_a_step:
                # vLLM's hit would read a state written in this step: it waits a step.
                self._wait_a_step.discard(rid)
                return None
        if self.async_scheduling and not first:
            return self._allocate_async(
                request, seq, num_new_tokens, full_sequence_must_fit, reserved_blocks, num_lookahead_tokens, base
            )
        hit = num_new_computed_tokens if first else 0
        if first and not hit and self.prefix_replay_tokens and self.enable_caching:
            # vLLM ignores a hit no longer than the replayed window (recomputed in full anyway):
            # none is taken (reset by the next get_computed_blocks).
            self._kvm.set_hit_limit(seq, 0)
        # Positions vLLM counts as computed that pagedkv holds uncomputed (see _accept_drafts).
        unwritten = self._unwritten.get(rid, 0)
        # A verify step (speculative decoding): the tokens past the request's known ones are
        # its draft tokens (request.spec_token_ids), given lookahead slots and never hashed.
        num_drafts = 0
        drafts: list[int] | None = None
        spec = getattr(request, "spec_token_ids", None)
        past = base + hit + num_new_tokens - request.num_tokens
        if spec and not first:
            num_drafts = max(0, min(len(spec), past))
            # Grammar-invalidated drafts arrive as -1; they are never accepted.
            drafts = [max(int(t), 0) for t in spec[:num_drafts]] or None
        # vLLM's placeholder drafts of a padded verify step: pagedkv has no ids for them; as
        # drafts, vLLM's rollback of them is read like any verify step's.
        extra = self._placeholder_drafts(request, past, num_drafts)
        # Under async scheduling they are output placeholders too: the next step is scheduled
        # before vLLM rolls them back (its num_computed_tokens counts them), so they are
        # unknown slots settled like any token in flight, never read as accepted drafts.
        unknown = extra if extra and self.async_scheduling else 0
        if extra:
            drafts = (drafts or []) + [0 if unknown else UNWRITTEN_TOKEN] * extra
            num_drafts += extra
        num_known_new = num_new_tokens - num_drafts + unwritten
        # EAGLE / MTP: slots past the scheduled tokens for the drafter's tokens (vLLM caps them
        # at max_model_len); pagedkv holds their blocks as spare lookahead blocks.
        lookahead = num_lookahead_tokens
        if lookahead and self.max_model_len is not None:
            end = base + hit + num_new_tokens
            lookahead = max(0, min(lookahead, self.max_model_len - end))
        watermark = self.watermark_blocks if has_scheduled_reqs and request.status in self._waiting_states else 0
        if full_sequence_must_fit or watermark or reserved_blocks:
            free = self._kvm.num_free_blocks
            per_group = None
            if full_sequence_must_fit:
                per_group = self._kvm.num_blocks_needed_per_group(seq, num_new_tokens)
            if lookahead:
                take, release = self._kvm.num_blocks_needed_with_drafts(seq, num_known_new, num_drafts, lookahead)
            elif num_drafts:
                take, release = self._kvm.num_blocks_needed_with_drafts(seq, num_known_new, num_drafts)
            elif per_group is not None and num_known_new == num_new_tokens:
                # The admission's one planning call: the groups' parts sum to the total.
                take, release = sum(t for t, _ in per_group), sum(r for _, r in per_group)
            else:
                take, release = self._kvm.num_blocks_needed(seq, num_known_new)
            if (
                per_group is not None
                and self._full_sequence_demand(
                    request, hit, num_new_tokens, per_group, None if first else self._kvm.num_blocks_held(seq)
                )
                + watermark
                > free + release
            ):
                return None
            if take + watermark > free + release - reserved_blocks:
                return None
        out = self._allocate_one(seq, num_known_new, drafts, lookahead)
        if out is None:
            return None
        if unwritten:
            del self._unwritten[rid]
        expected = base + hit
        got = out.num_context_tokens + unwritten
        if got != expected:
            raise VllmStateMismatchError(
                f"request {rid!r}: pagedkv holds {got - unwritten} computed tokens, vLLM expects "
                f"{expected} (num_computed_tokens={request.num_computed_tokens}, prefix hit {hit})",
                request_id=rid,
                quantity="num_computed_tokens",
                expected=str(expected),
                got=str(got - unwritten),
            )
        computed = expected + num_new_tokens
        if first and hit and self.prefix_replay_tokens and not num_new_tokens:
            # vLLM's count is the hit less its replay until the replayed tokens are computed.
            self._replay_end[rid] = hit
        if self._state_groups:
            # The step's known end (drafts excluded): vLLM hashes a state there at allocation.
            self._note_state_step(rid, out, first, expected, computed - num_drafts)
            accepted_end = self._accepted_ends.pop(rid, 0)
            if accepted_end and accepted_end == expected and accepted_end % self.block_size == 0:
                # vLLM hashes the state the previous step's accepted drafts ended on in this
                # allocation (pagedkv published it as the drafts were resolved): siblings wait.
                self._step_states.append((rid, accepted_end, self._step_no, self._step_no, self._releases.get(rid, 0)))
        if unknown:
            self._unknown[rid] = computed
            self.decodes.close_window(rid)
        elif drafts:
            self._drafts_pending[rid] = (computed - num_drafts, drafts)
        elif num_lookahead_tokens:
            self.decodes.close_window(rid)
        elif computed == self._num_known[rid]:
            self.decodes.set_window(rid, computed)
        return self._new_blocks(out)

    def _allocate_external(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        delay_cache_blocks: bool,
        num_encoder_tokens: int,
        full_sequence_must_fit: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
    ) -> Any:
        """``allocate_slots`` of a new or resumed request with ``E =
        num_external_computed_tokens`` tokens a KV connector supplies after the prefix hit
        ``H``: pagedkv's ``allocate_external``. A synchronous load (``delay_cache_blocks``
        false) takes slots for ``H + E + num_new_tokens`` tokens, the first ``H + E`` computed
        and their full blocks registered at once (as vLLM caches a sync load's blocks at
        allocation). An asynchronous one (``delay_cache_blocks``, ``num_new_tokens == 0``)
        stages the blocks past ``H``: never matched, hashed or announced until
        :meth:`cache_blocks` commits the load. None when the blocks do not fit (with the
        watermark, ``reserved_blocks`` of in-flight loads and ``full_sequence_must_fit`` as
        for any allocation; nothing changed). Raises ``InvalidArgumentError`` for a request
        that is not at its first allocation, ``num_new_tokens`` other than 0 with a delayed
        load (or 0 without), and lookahead / encoder tokens."""
        rid = request.request_id
        if delay_cache_blocks != (num_new_tokens == 0) or num_new_tokens < 0:
            raise InvalidArgumentError(
                f"request {rid!r}: num_new_tokens={num_new_tokens} with delay_cache_blocks={delay_cache_blocks}",
                arg="num_new_tokens",
                value=str(num_new_tokens),
                reason="an async load (delay_cache_blocks) schedules 0 tokens, a sync one at least 1",
            )
        self._check_allocation_args(rid, 1, num_lookahead_tokens, 0, num_encoder_tokens, False)
        if num_lookahead_tokens:
            raise InvalidArgumentError(
                f"request {rid!r}: num_lookahead_tokens={num_lookahead_tokens} with external tokens",
                arg="num_lookahead_tokens",
                value=str(num_lookahead_tokens),
                reason="lookahead slots with a KV connector's external tokens are not served",
            )
        if request.num_computed_tokens:
            raise InvalidArgumentError(
                f"request {rid!r}: external tokens for a request with {request.num_computed_tokens} computed tokens",
                arg="num_external_computed_tokens",
                value=str(num_external_computed_tokens),
                reason="external tokens come only at a request's first allocation",
            )
        seq = self._register(request)
        hit = num_new_computed_tokens
        ext = num_external_computed_tokens
        watermark = self.watermark_blocks if has_scheduled_reqs and request.status in self._waiting_states else 0
        if full_sequence_must_fit or watermark or reserved_blocks:
            free = self._kvm.num_free_blocks
            take, release = self._kvm.num_blocks_needed_external(seq, ext, num_new_tokens)
            if full_sequence_must_fit:
                per_group = self._kvm.num_blocks_needed_per_group(seq, ext + num_new_tokens)
                if (
                    self._full_sequence_demand(request, hit, ext + num_new_tokens, per_group) + watermark
                    > free + release
                ):
                    return None
            if take + watermark > free + release - reserved_blocks:
                return None
        if self._state_groups:
            self._state_sources.pop(rid, None)
            if rid in self._wait_a_step:
                # vLLM's hit would read a state written in this step: it waits a step.
                self._wait_a_step.discard(rid)
                return None
            self._pre_lens = (seq, [len(self._kvm.block_table(seq, g)) for g in self._state_groups])
        try:
            out = self._kvm.allocate_external(seq, ext, num_new_tokens, staged=delay_cache_blocks)
        except OutOfBlocksError:
            return None
        if out.num_cached_tokens != hit or out.num_context_tokens != hit + ext:
            raise VllmStateMismatchError(
                f"request {rid!r}: pagedkv's prefix hit is {out.num_cached_tokens} tokens "
                f"(context {out.num_context_tokens}), vLLM's {hit} (+{ext} external)",
                request_id=rid,
                quantity="prefix hit",
                expected=str(hit),
                got=str(out.num_cached_tokens),
            )
        if self._state_groups:
            # The hit state shown at its column; a sync load's aligned step end is cached by
            # vLLM at allocation (siblings wait a step), an async load's at its commit.
            end = 0 if delay_cache_blocks else hit + ext + num_new_tokens
            self._note_state_step(rid, out, True, hit, end)
        if delay_cache_blocks:
            self._loading.add(rid)
            self.decodes.close_window(rid)
        elif hit + ext + num_new_tokens == self._num_known[rid]:
            self.decodes.set_window(rid, hit + ext + num_new_tokens)
        return self._new_blocks(out)

    def sync_computed(self, request: Any, *, poisoned: bool) -> int:
        """Brings pagedkv's computed count for ``request`` down to vLLM's
        ``request.num_computed_tokens`` after vLLM lowered it (a failed external load's invalid
        blocks, ``poisoned``: their blocks and dependents leave the prefix cache; the rewind of
        a fully loaded prompt to recompute its last token, not poisoned). The blocks stay (vLLM's
        model runner keeps the block table); the next allocation recomputes into them. A no-op
        when pagedkv holds no more than vLLM counts or the request is loading or unknown.
        Returns blocks unregistered."""
        rid = request.request_id
        if rid not in self._seq_of or rid in self._loading:
            return 0
        self._sync()
        seq = self._register(request)
        target = request.num_computed_tokens
        if self._kvm.num_computed_tokens(seq) <= target:
            return 0
        self.decodes.close_window(rid)
        return int(self._kvm.rollback(seq, target, poisoned=poisoned))

    def begin_replay(self, request: Any) -> None:
        """vLLM rewound ``request``'s computed count after its KV load ended, to recompute the
        hit's last window for the groups out of the prefix cache (bounded prefix replay):
        pagedkv keeps the hit computed, its slots held, and the allocations that follow take
        slots only past it. A no-op for an unknown request or when pagedkv holds no more than
        vLLM counts."""
        rid = request.request_id
        seq = self._seq_of.get(rid)
        if seq is None or rid in self._loading:
            return
        held = int(self._kvm.num_computed_tokens(seq))
        if held > request.num_computed_tokens:
            self.decodes.close_window(rid)
            self._replay_end[rid] = held

    def _allocate_async(
        self,
        request: Any,
        seq: int,
        num_new_tokens: int,
        full_sequence_must_fit: bool,
        reserved_blocks: int,
        num_lookahead_tokens: int = 0,
        base: int | None = None,
    ) -> Any:
        """``_allocate`` of a running or resumed request under async scheduling (``base``: its
        computed count, vLLM's unless a prefix replay runs behind pagedkv's).

        vLLM's slots end at ``num_computed_tokens + num_new_tokens``; the tokens known by now
        (``request.num_tokens``) are computed in pagedkv (hashed and cached as their blocks
        fill; windowed groups release by that computed count, vLLM's processed one), and the
        slots past them, whose token ids a step in flight has not reported (output
        placeholders, placeholder drafts), get placeholder lookahead slots in every group only
        where the blocks pagedkv holds end before them (never hashed; settled by the next
        allocation). With ``num_lookahead_tokens`` (EAGLE / MTP) the slots run that much further
        (capped at ``max_model_len``): the unknown slots then always take placeholder drafts
        and the lookahead ones spare blocks, unless the blocks pagedkv holds (spare ones
        included) cover them all. With state groups (align-mode Mamba) every unknown slot is a
        placeholder slot (the live state moves over it; settled keeping its blocks), and the
        aligned state the newly known tokens reach is noted for vLLM's wait (a decode's: the
        one its previous step wrote, published at that step's commit). Raises
        ``VllmStateMismatchError`` when pagedkv holds more computed tokens than vLLM counts.
        """
        rid = request.request_id
        computed = request.num_computed_tokens if base is None else base
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
        lookahead = num_lookahead_tokens
        if lookahead and self.max_model_len is not None:
            lookahead = max(0, min(lookahead, self.max_model_len - end))
        if self._state_groups:
            # A state group's live state moves with vLLM's slots: every unknown slot is a
            # placeholder slot (its state is kept when it is settled, and the block a slot
            # opens is the one the runner writes the state to).
            num_unknown = end - known_end
        elif num_lookahead_tokens:
            # Every slot's block is in pagedkv's tables (spare lookahead blocks included).
            covered = min(len(self._kvm.block_table(seq, g)) * b for g, b in enumerate(self.group_block_sizes))
            num_unknown = end - known_end if num_known_new or end + lookahead > covered else 0
        else:
            # Slots every group's blocks cover (each group's blocks end on its own boundary).
            covered = max(
                min(-(-known_end // b) * b for b in self.group_block_sizes), self.decodes.held_end.get(rid, 0)
            )
            num_unknown = end - known_end if end > covered else 0
        if full_sequence_must_fit or reserved_blocks:
            free = self._kvm.num_free_blocks
            take, release = self._kvm.num_blocks_needed(seq, max(request.num_tokens - held, 1))
            if full_sequence_must_fit and take > free + release:
                return None
            if (
                reserved_blocks
                and sum(-(-(end + lookahead) // b) - -(-held // b) for b in self.group_block_sizes)
                > free - reserved_blocks
            ):
                return None
        if num_known_new == 0 and num_unknown == 0:
            # Every slot lies in blocks pagedkv holds already.
            return self.empty_kv_cache_blocks
        out = self._allocate_one(seq, num_known_new, [0] * num_unknown if num_unknown else None, lookahead)
        if out is None:
            return None
        if self._state_groups:
            # vLLM caches the states its known tokens reach (a decode's: the one the step in
            # flight writes, once its input token is known), so a hit on one waits a step.
            self._note_state_step(rid, out, False, computed, known_end if num_known_new else 0, known_end < end)
            prompt = request.num_prompt_tokens
            if self._recache_prompt_hit and computed == known_end == prompt and end > known_end:
                # vLLM 0.32 under async scheduling also marks the state at the prompt's last
                # aligned boundary again at the first decode (its input token not known yet).
                boundary = (prompt - 1) // self.block_size * self.block_size
                if boundary:
                    step = self._step_no
                    self._step_states.append((rid, boundary, step, step - 1, self._releases.get(rid, 0)))
        if num_unknown:
            self._unknown[rid] = end
            self.decodes.close_window(rid)
        elif num_lookahead_tokens:
            self.decodes.close_window(rid)
        elif known_end == self._num_known[rid]:
            self.decodes.set_window(rid, known_end)
        else:
            self.decodes.close_window(rid)
        return self._new_blocks(out)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """vLLM's ``update_from_output`` hook: ``request``'s first ``num_computed_tokens`` are
        computed and known. Under async scheduling, a block they fill that pagedkv has not
        cached yet (the request's tokens arrived after its last allocation) is cached now, as
        vLLM caches it. With lookahead block hashes (synchronous scheduling; vLLM calls this
        under speculative decoding), the blocks whose next token was just sampled are cached
        now, as vLLM caches them (``KVCacheManager.cache_computed``); otherwise a no-op
        (pagedkv caches blocks as it allocates them).

        For a request whose external KV was loading (an async KV connector load), the load's
        end: its first ``num_computed_tokens`` tokens (at most the loaded range; vLLM lowers the
        count past a failed block) are computed and their full blocks registered now
        (``commit_external``); the blocks past them are recomputed in place."""
        if self._loading and request.request_id in self._loading:
            self._commit_load(request, num_computed_tokens)
            return
        if not self.async_scheduling:
            if self.num_hash_lookahead_tokens and request.request_id in self._seq_of:
                self._sync()
                self._kvm.cache_computed(self._register(request))
            return
        # Runs once per decoding request per step: the common case (no block completed past
        # what pagedkv holds) is two dict lookups and a comparison.
        rid = request.request_id
        known = self._lag.get(rid)
        if known is None:
            known = self._num_known.get(rid)
            if known is None:
                return
        bs = self._unit  # the finest block boundary of any group
        if num_computed_tokens // bs <= known // bs:
            return
        target = min(num_computed_tokens, request.num_tokens)
        if target // bs <= known // bs:
            return
        self._sync()
        seq = self._register(request)
        held = self._kvm.num_computed_tokens(seq)
        if target // bs <= held // bs:
            return
        end = target - target % bs
        self._compute_held(rid, seq, end - held, end)
        if end == self._num_known[rid]:
            self.decodes.set_window(rid, end)
        else:
            self.decodes.close_window(rid)

    def _compute_held(self, rid: str, seq: int, num_tokens: int, end: int) -> None:
        """Computes ``num_tokens`` known tokens of ``rid`` (up to ``end``) into slots pagedkv
        already holds for them (vLLM computed them and holds their blocks). Raises
        ``VllmStateMismatchError`` if that took a new block (the two sides disagree on what
        is held)."""
        out = self._kvm.allocate_slots(seq, num_tokens)
        if len(out.new_block_ids):
            raise VllmStateMismatchError(
                f"request {rid!r}: computing its tokens up to {end} in held slots took "
                f"{len(out.new_block_ids)} new block(s); vLLM holds them already",
                request_id=rid,
                quantity="new blocks",
                expected="0",
                got=str(len(out.new_block_ids)),
            )

    def _commit_load(self, request: Any, num_computed_tokens: int) -> None:
        """Ends ``request``'s async load with ``num_computed_tokens`` valid tokens."""
        rid = request.request_id
        seq = self._seq_of[rid]
        end = self._kvm.num_computed_tokens(seq)
        hit = end - self._kvm.num_staged_tokens(seq)
        if self._state_groups and num_computed_tokens < end:
            # vLLM reports only whole-request failures with several KV cache groups (freed).
            raise InvalidArgumentError(
                f"request {rid!r}: its KV load of tokens {hit}..{end} ended with {num_computed_tokens} valid tokens",
                arg="num_computed_tokens",
                value=str(num_computed_tokens),
                reason="with Mamba groups a load (its recurrent state) is valid in full or not at "
                "all: free or preempt the request to recompute it",
            )
        self._loading.discard(rid)
        valid = max(num_computed_tokens, hit)
        self._kvm.commit_external(seq, valid)
        if self._state_groups and valid % self.block_size == 0:
            # vLLM caches the loaded state when the load ends (in schedule()): a sibling's
            # hit on it waits until the next step, as for a state cached at allocation.
            step = self._step_no
            self._step_states.append((rid, valid, step, step - 1, self._releases.get(rid, 0)))
        if num_computed_tokens < valid:
            # A block of the local hit was reported invalid too: recomputed from there.
            self._kvm.rollback(seq, num_computed_tokens, poisoned=True)

    def flush_decodes(self) -> int:
        """Allocates the deferred decodes in one call into Rust
        (:meth:`DecodeDeferral.flush`); returns how many decode slots went in. Raises
        ``VllmStateMismatchError`` if pagedkv disagrees with vLLM (never expected)."""
        return self.decodes.flush()

    def free(self, request: Any) -> None:
        """Releases ``request``'s blocks in every group (tail first, so deep blocks are
        evicted first).

        A finished request is forgotten; one still ``RUNNING`` is being preempted by the
        scheduler and keeps its tokens (preemption by recompute), unless its pagedkv tokens are
        not vLLM's (unverified drafts: then it is forgotten too, and re-registered from vLLM's
        tokens on resume). A request never allocated is a no-op, as in vLLM. Raises
        ``UnknownSequenceError`` for a request freed before that still claims computed tokens
        (a double free), changing nothing.

        A request whose external KV is loading (aborted mid-load, or its load failed with
        nothing valid) releases its staged blocks unregistered.
        """
        self._release(request, defer=False)

    def pop_blocks_for_free(self, request: Any) -> Any:
        """vLLM's deferred free (an in-flight step or connector may still write the blocks):
        ``request`` is freed or preempted as by :meth:`free`, but its blocks stay referenced
        (counted in use, hashes kept) until ``block_pool.free_blocks`` receives the returned
        :class:`~pagedkv.integrations.vllm.pool_view.DeferredFree` (vLLM's scheduler passes
        it reversed). ``[]`` for a request holding no blocks. Raises as :meth:`free`."""
        handle = self._release(request, defer=True)
        if handle is None:
            return []
        ids = self._kvm.deferred_blocks(handle).tolist()
        if not ids:
            self._kvm.release_deferred(handle)
            return []
        pool = self._kvm.pool
        return DeferredFree(handle, [block_view(pool, b) for b in ids])

    def release_deferred(self, deferred: DeferredFree) -> int:
        """Releases the blocks of a deferred free (``block_pool.free_blocks``), tail first;
        returns how many. Raises ``InvalidArgumentError`` for one already released."""
        self._sync()
        n = int(self._kvm.release_deferred(deferred.handle))
        deferred.released = True
        return n

    def _release(self, request: Any, *, defer: bool) -> int | None:
        """``free`` (``defer`` false; returns None) or ``pop_blocks_for_free`` (returns the
        deferred release's handle, None when the request holds no sequence)."""
        self._sync()
        rid = request.request_id
        seq = self._seq_of.get(rid)
        if self._cache_finished_drafts and seq is not None and request.is_finished() and rid in self._drafts_pending:
            # The verify step that finished it (vLLM 0.33 caches the blocks it completed): its
            # accepted drafts that became tokens of the request are computed, so the blocks
            # they fill are cached before the free. Tokens past a stop are not there.
            self._accept_drafts(request, seq, strict=False)
        # Other pending drafts go with the recompute preemption; a preempted request's
        # accepted tokens reach pagedkv as known tokens on resume. Placeholder drafts of
        # unknown tokens (async scheduling) go with the free or preemption too.
        self._drafts_pending.pop(rid, None)
        self._accepted_ends.pop(rid, None)
        if self._unknown:
            self._unknown.pop(rid, None)
        self._unwritten.pop(rid, None)
        if self._replay_end:
            self._replay_end.pop(rid, None)
        if self._state_groups:
            self._state_sources.pop(rid, None)
            self._wait_a_step.discard(rid)
            if request.is_finished():
                self._releases.pop(rid, None)
            else:
                self._releases[rid] = self._releases.get(rid, 0) + 1
        if seq is None:
            self._check_unallocated_free(request)
            return None
        self._loading.discard(rid)
        handle = None
        if request.is_finished() or self._forget_if_diverged(request):
            # Lagging tokens need not reach pagedkv: they sit in a partial block, which is
            # never cached.
            if defer:
                handle = int(self._kvm.free_deferred(seq))
            else:
                self._kvm.free(seq)
            del self._seq_of[rid]
            del self._num_known[rid]
            del self._requests[rid]
            self.decodes.forget(rid)
            self._diverged.discard(rid)
        else:
            if rid in self._lag:
                self.decodes.catch_up([rid])
            if defer:
                handle = int(self._kvm.preempt_deferred([seq]))
            else:
                self._kvm.preempt([seq])
            self.decodes.close_window(rid)
            self.decodes.drop_lookahead(rid)
        return handle

    def evict_blocks(self, block_ids: Any) -> int:
        """vLLM's ``evict_blocks`` (a KV connector reported these blocks' KV invalid): each
        registered block leaves the prefix cache with every block registered after it in a
        chain (their KV was computed from it); held blocks stay held. Unregistered ids are
        ignored, the null block 0 among them (as vLLM's pool ignores it). Returns blocks
        unregistered. Raises ``InvalidBlockError`` for an id outside the pool, changing
        nothing."""
        self._sync()
        ids = sorted(b for b in (int(x) for x in block_ids) if b != 0)
        if not ids:
            return 0
        return int(self._kvm.evict_blocks(ids))

    def get_computed_blocks_for_connector(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[Any, int, int, bool]:
        """``get_computed_blocks`` plus ``hit_diverged``, for a connector that restores Mamba
        states itself (vLLM asks this of one whose ``supports_divergent_local_hybrid_hits``,
        NIXL's). Without state groups, or when no attention group's hit runs deeper than a
        state group's (the first full-attention group's hit at most every group's): the hit
        every group serves, ``False``. Otherwise vLLM's divergent hit: the first
        full-attention group's hit ``H`` (whole blocks), boundary 0, ``True``; the request's
        first allocation then takes ``H`` with no state hit (pagedkv's
        ``set_state_from_load``), and only with external tokens: the scheduler falls back to
        :meth:`get_computed_blocks` when the connector finds none (which clears it)."""
        blocks, hit, boundary = self.get_computed_blocks(request, max_cache_hit_length)
        if not self._state_groups or not self.prefix_cache_lookup_enabled(request) or not self._attention_groups:
            return blocks, hit, boundary, False
        seq = self._seq_of[request.request_id]
        limit = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
        kvm = self._kvm
        fa = int(kvm.lookup_prefix_group(seq, self._attention_groups[0], limit))
        per_group = [int(kvm.lookup_prefix_group(seq, g, limit)) for g in range(self.num_kv_cache_groups)]
        if any(h > fa for h in per_group) or min(per_group) >= fa:
            return blocks, hit, boundary, False
        kvm.set_state_from_load(seq, True)
        self._wait_a_step.discard(request.request_id)
        return PrefixHit(fa, [fa // bs for bs in self.group_block_sizes], seq), fa, 0, True

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        """The lookup result cut at ``num_computed_tokens``: pagedkv's hits are multiples of
        the scheduler block size (no partial hash hits without Mamba layers), so vLLM asks this
        only for the whole hit, which is returned unchanged. Raises ``InvalidArgumentError`` for a shorter cut (pagedkv
        takes its whole hit when it allocates)."""
        hit = blocks.num_tokens if isinstance(blocks, PrefixHit) else 0
        if num_computed_tokens != hit:
            raise InvalidArgumentError(
                f"truncating a prefix hit of {hit} tokens to {num_computed_tokens}",
                arg="num_computed_tokens",
                value=str(num_computed_tokens),
                reason=f"pagedkv takes its whole hit ({hit} tokens)",
            )
        return blocks

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Releases the request's out-of-window blocks for queries from
        ``processed_computed_tokens`` on: vLLM's scheduler calls it on the settled-token basis
        before it hands a finishing request's table to a KV connector, so the connector is
        given no block the window has left. The allocation that moves a window releases them
        as well; this does it early. Full attention keeps everything; ``num_prompt_tokens`` is
        not used. A request without a running pagedkv sequence is left as it is."""
        self._sync()
        seq = self._seq_of.get(request_id)
        if seq is None or self._kvm.status(seq) != "running":
            return
        self._kvm.release_skipped_blocks(seq, max(0, processed_computed_tokens))

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
        tables = tuple(t.tolist() for t in self._kvm.block_tables(self.seq_id(request_id)))
        sources = self._state_sources.get(request_id) if self._state_sources else None
        if sources:
            for g, (idx, block) in sources.items():
                if idx < len(tables[g]) and tables[g][idx] == 0:
                    tables[g][idx] = block
        return tables

    def table_lengths(self, request_id: str) -> list[int]:
        """Per group, the length of the request's block table (released entries included), as
        ``len`` of each list of :meth:`get_block_ids` without building the lists. Raises
        ``UnknownSequenceError``."""
        self._sync()
        return [len(t) for t in self._kvm.block_tables(self.seq_id(request_id))]

    def get_blocks(self, request_id: str) -> Any:
        """The request's block tables as one ``KVCacheBlocks``. Raises
        ``UnknownSequenceError``."""
        tables = self.get_block_ids(request_id)
        if not any(tables):
            return self.empty_kv_cache_blocks
        blocks = PagedKVBlocks(tables)
        # Live block views and the unhashed ids (a connector loads only into those).
        blocks.pool = self._kvm.pool
        return blocks

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        """Each group's first ``ceil(num_computed_tokens / block_size)`` ids (none for a
        request that holds no sequence: one aborted before its first allocation, as vLLM)."""
        if request_id not in self._seq_of:
            return tuple([] for _ in self.group_block_sizes)
        return tuple(
            ids[: -(-num_computed_tokens // bs)]
            for ids, bs in zip(self.get_block_ids(request_id), self.group_block_sizes, strict=True)
        )

    # ---- per-step hooks --------------------------------------------------------------------

    def new_step_starts(self) -> None:
        """A new ``schedule()`` starts: the states noted by the previous step's allocations
        no longer make a hit wait (vLLM clears its cached-this-step set here), except, under
        async scheduling, those written by a step not committed yet (pagedkv publishes a state
        only at its step's commit, so a hit on it waits until then)."""
        self._step_no += 1
        if self._step_states:
            committed = self._committed_step
            self._step_states = [e for e in self._step_states if e[3] > committed]

    def take_new_block_ids(self) -> list[int]:
        """The attention groups' blocks taken since the last call (prefix-hit blocks
        excluded), for vLLM's worker to zero when Mamba layers share the pool or the cache
        mixes precisions (``needs_kv_cache_zeroing``; less the groups an async KV load
        writes, ``skip_zeroing_group_ids``); ``[]`` without zeroing."""
        ids, self._new_attention_ids = self._new_attention_ids, []
        return ids

    @property
    def step_no(self) -> int:
        """How many ``schedule()`` calls started so far (``new_step_starts``): the number of
        the step being scheduled, given back to :meth:`commit_steps`."""
        return self._step_no

    def step_holdings(self, request_ids: Any) -> dict[str, int]:
        """Per request id, which holding of it (how many times it was freed or preempted
        before) a step scheduled now runs: given back to :meth:`commit_steps` with the step's
        ends, so a request preempted and resumed while the step was in flight commits
        nothing of it."""
        releases = self._releases
        return {rid: releases.get(rid, 0) for rid in request_ids}

    def commit_steps(self, ends: dict[str, int], holdings: dict[str, int] | None = None, step: int = 0) -> int:
        """The commit fence: the step that brought each request id of ``ends`` to its end
        position (tokens) has completed, so pagedkv publishes the aligned states it wrote
        (``KVCacheManager.commit_computed``). Requests no longer held (finished, preempted)
        are skipped, and with ``holdings`` (:meth:`step_holdings` when the step was
        scheduled) those preempted since, even if resumed. ``step``: the step's number
        (:attr:`step_no` when it was scheduled): hits waiting for its states stop waiting.
        Returns the states published. Called by the scheduler's ``update_from_output``, in
        step order, never at allocation (with speculative state blocks, the state at a verify
        step's accepted end is published as the drafts are resolved, at the request's next
        allocation: that step has completed by then, and vLLM hashes it there).

        Under async scheduling a step's end can lie past the tokens pagedkv holds computed
        (the request was not scheduled again since its last input token became known): the
        tokens vLLM knows by now are appended and computed into the slots the step held (no
        block is taken) before the commit, so the state's prefix key covers known tokens only.
        Raises ``VllmStateMismatchError`` if that would take a block."""
        if not self._state_groups:
            return 0
        self._committed_step = max(self._committed_step, step)
        self._sync()
        published = 0
        whole: list[int] = []
        for rid, end in ends.items():
            seq = self._seq_of.get(rid)
            if seq is None or self._kvm.status(seq) != "running":
                continue
            if holdings is not None and self._releases.get(rid, 0) != holdings.get(rid, 0):
                continue  # preempted (and resumed) since the step was scheduled
            held = int(self._kvm.num_computed_tokens(seq))
            if held < end and self.async_scheduling:
                held = self._fill_known(rid, seq, end)
            if held <= end:
                whole.append(seq)
            else:
                # Computed past the reported step (never in synchronous scheduling).
                published += int(self._kvm.commit_computed(seq, int(end)))
        if whole:
            # Every computed token of these: one call (one lock) for the step.
            published += int(self._kvm.commit_all_computed(whole))
        return published

    def _fill_known(self, rid: str, seq: int, end: int) -> int:
        """Async scheduling, at a commit: ``rid``'s tokens known by now, up to ``end``, are
        appended and computed into the slots pagedkv holds for them (its placeholders
        settled first). Returns pagedkv's computed count after."""
        request = self._requests[rid]
        self._register(request)
        held = int(self._kvm.num_computed_tokens(seq))
        target = min(end, request.num_tokens)
        if target > held:
            self._compute_held(rid, seq, target - held, target)
            held = target
            self.decodes.close_window(rid)
        return held

    def take_events(self) -> list[Any]:
        """KV events since the last call as ``vllm.distributed.kv_events`` objects, each
        naming its group (``group_idx``) and that group's spec kind."""
        if not self.enable_kv_cache_events:
            return []
        self._sync()
        return to_vllm_events(
            self._kvm.take_events(), lora_ids=self._lora_ids, spec_kinds=self.spec_kinds, medium=self.medium
        )


def _identity(request: Any) -> tuple[Any, ...]:
    """What besides its tokens keys a vLLM ``Request``'s blocks (``request_sequence_spec``'s
    inputs): equal token prefixes of equal identities share blocks."""
    lora = request.lora_request
    mm = tuple((str(f.identifier), f.mm_position.offset, f.mm_position.length) for f in request.mm_features or ())
    own = request.request_id if request.skip_reading_prefix_cache else None
    return (request.cache_salt, lora.lora_name if lora is not None else None, mm, own)
