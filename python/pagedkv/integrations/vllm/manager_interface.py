"""The parts of vLLM's ``KVCacheManager`` interface that depend on neither the KV cache groups
nor block allocation.

:class:`~pagedkv.integrations.vllm.PagedKVCacheManager` allocates, frees and reports blocks; what
does not touch the block tables is written here and inherited (:class:`SharedManagerCalls`): the request-id lookup,
the prefix-cache stats, the checks of a capped hit, of refused ``allocate_slots`` options and of
a double free, the no-op hooks (zeroing, copy-on-write, Mamba boundary states) and
the refused KV-connector calls, the resolution of a verify step whose accepted tokens are not
its drafts; plus the two constructor facts it reads (:func:`pagedkv_hash_algo`,
:func:`caches_finished_drafts`).
"""

from __future__ import annotations

import logging
from typing import Any

import pagedkv
from pagedkv.errors import InvalidArgumentError, UnknownSequenceError
from pagedkv.integrations.vllm.coordinator import CoordinatorView
from pagedkv.integrations.vllm.errors import UnsupportedVllmCallError, VllmStateMismatchError

__all__ = ["UNWRITTEN_TOKEN", "SharedManagerCalls", "caches_finished_drafts", "pagedkv_hash_algo"]

logger = logging.getLogger("pagedkv.integrations.vllm")

#: pagedkv's token id for a position whose KV no token of the request was computed for: one
#: vLLM counts as computed though no KV was written there (a verify step that accepted more
#: tokens than it had drafts), or vLLM's placeholder drafts of a padded verify step. No vLLM token id
#: is this large, so no request hits a block that holds it.
UNWRITTEN_TOKEN = 2**32 - 1

# vLLM's prefix_caching_hash_algo -> pagedkv's hash. pagedkv hashes its own canonical byte
# encoding (not vLLM's pickle / CBOR), so only the family matters.
_HASH_ALGOS = {
    "sha256": "sha256",
    "sha256_cbor": "sha256",
    "xxhash": "xxh3_128",
    "xxhash_cbor": "xxh3_128",
}


def pagedkv_hash_algo(hash_algo: str) -> str:
    """pagedkv's block hash for vLLM's ``prefix_caching_hash_algo``: ``sha256*`` -> ``"sha256"``,
    ``xxhash*`` -> ``"xxh3_128"``. Raises ``InvalidConfigError`` for anything else."""
    algo = _HASH_ALGOS.get(hash_algo)
    if algo is None:
        raise pagedkv.InvalidConfigError(
            f"prefix_caching_hash_algo {hash_algo!r} has no pagedkv equivalent (supported: {sorted(_HASH_ALGOS)})",
            field="prefix_caching_hash_algo",
            value=str(hash_algo),
            reason=f"supported: {sorted(_HASH_ALGOS)}",
        )
    return algo


def caches_finished_drafts() -> bool:
    """Whether the installed vLLM caches the blocks a request's last verify step completed
    before freeing it: 0.33 does, 0.32 does not (the managers follow the installed release)."""
    import vllm

    release = tuple(int(x) for x in str(vllm.__version__).split(".")[:2] if x.isdigit())
    return release >= (0, 33)


class SharedManagerCalls:
    """The ``kv_cache_manager`` calls that touch no block table (inherited by
    ``PagedKVCacheManager``; not a manager by itself).

    Reads the attributes the manager sets in ``__init__``: ``_seq_of`` (request id -> pagedkv
    sequence id), ``_coordinator``, ``enable_caching``, ``log_stats``, ``prefix_cache_stats``,
    ``_PrefixCacheStats`` (vLLM's stats class), ``num_kv_cache_groups``, ``block_size``,
    ``_diverged`` and ``_unwritten``. Errors name the concrete manager class.
    """

    _seq_of: dict[str, int]
    _coordinator: CoordinatorView
    _PrefixCacheStats: Any
    enable_caching: bool
    log_stats: bool
    prefix_cache_stats: Any
    num_kv_cache_groups: int
    block_size: int
    #: Verify steps whose accepted tokens differed from the drafts the model runner was fed or
    #: outnumbered them, and those tokens (see :meth:`_check_accepted_drafts`).
    num_draft_mismatches: int = 0
    num_mismatched_draft_tokens: int = 0
    #: Requests whose pagedkv tokens are not vLLM's (drafts vLLM replaced, unwritten positions);
    #: one preempted is forgotten (see :meth:`_forget_if_diverged`).
    _diverged: set[str]
    #: Request id -> unwritten positions appended but not yet allocated (its next allocation
    #: computes them with the scheduled tokens).
    _unwritten: dict[str, int]

    @property
    def coordinator(self) -> CoordinatorView:
        """vLLM's ``kv_cache_manager.coordinator`` as a read-only view of this manager: one
        ``GroupManagerView`` per KV cache group (``single_type_managers[g].block_size /
        .kv_cache_spec``, ``kv_cache_config``, ``get_num_blocks_to_allocate``...), what vLLM's
        engine core and scheduler read through it (docs/design.md, "vLLM seam")."""
        return self._coordinator

    def seq_id(self, request_id: str) -> int:
        """The pagedkv sequence id of ``request_id``. Raises ``UnknownSequenceError``."""
        seq = self._seq_of.get(request_id)
        if seq is None:
            raise UnknownSequenceError(
                f"unknown request id {request_id!r} (never looked up or allocated, or freed)",
                seq_id=-1,
            )
        return seq

    # ---- prefix cache ----------------------------------------------------------------------

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        """Whether a prefix-cache lookup runs for ``request`` (caching on, reads allowed)."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """Counts one admitted request's lookup (tokens queried, tokens hit) when logging."""
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def make_prefix_cache_stats(self) -> Any:
        """The prefix-cache stats since the last call (then reset), or None without logging."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = self._PrefixCacheStats()
        return stats

    @staticmethod
    def _check_hit_cap(hit: int, max_cache_hit_length: int | None) -> None:
        """Raises ``InvalidArgumentError`` for a ``max_cache_hit_length`` below the prefix hit
        of ``hit`` tokens (pagedkv takes the whole hit when it allocates)."""
        if max_cache_hit_length is not None and hit > max_cache_hit_length:
            raise InvalidArgumentError(
                f"max_cache_hit_length {max_cache_hit_length} is below the prefix hit of "
                f"{hit} tokens; capping hits is not supported",
                arg="max_cache_hit_length",
                value=str(max_cache_hit_length),
                reason="capping hits is not supported",
            )

    # ---- allocation ------------------------------------------------------------------------

    def _check_allocation_args(
        self,
        request_id: str,
        num_new_tokens: int,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        num_encoder_tokens: int,
        delay_cache_blocks: bool,
    ) -> None:
        """Raises ``InvalidArgumentError`` for ``num_new_tokens <= 0``, ``num_lookahead_tokens <
        0`` or an ``allocate_slots`` option the config check refuses (external / encoder
        tokens, delayed caching)."""
        if num_lookahead_tokens < 0:
            raise InvalidArgumentError(
                f"num_lookahead_tokens must be >= 0 (got {num_lookahead_tokens}) for request {request_id!r}",
                arg="num_lookahead_tokens",
                value=str(num_lookahead_tokens),
                reason="a count of slots",
            )
        if num_new_tokens <= 0:
            raise InvalidArgumentError(
                f"num_new_tokens must be >= 1 (got {num_new_tokens}) for request {request_id!r}",
                arg="num_new_tokens",
                value=str(num_new_tokens),
                reason="must schedule at least one token",
            )
        for name, value in (
            ("num_external_computed_tokens", num_external_computed_tokens),
            ("num_encoder_tokens", num_encoder_tokens),
            ("delay_cache_blocks", int(delay_cache_blocks)),
        ):
            if value:
                raise InvalidArgumentError(
                    f"{name}={value} is not supported by {type(self).__name__}",
                    arg=name,
                    value=str(value),
                    reason="refused by check_supported_config",
                )

    @staticmethod
    def _check_unallocated_free(request: Any) -> None:
        """The free of a request that holds no pagedkv sequence: a no-op, as in vLLM, unless the
        request still claims computed tokens (freed before: a double free), which raises
        ``UnknownSequenceError``."""
        if request.num_computed_tokens > 0:
            raise UnknownSequenceError(
                f"request {request.request_id!r} holds no KV blocks (already freed?) but claims "
                f"{request.num_computed_tokens} computed tokens",
                seq_id=-1,
            )

    # ---- speculative decoding --------------------------------------------------------------

    def _check_accepted_drafts(self, rid: str, base: int, drafts: list[int], request: Any) -> tuple[int, int]:
        """The verify step of ``rid`` (drafts at positions ``base ..``) as vLLM resolved it, read
        from its rollback of ``num_computed_tokens``: ``(drafts accepted, positions counted as
        computed past the drafts)``.

        A model runner or drafter that does not verify (vLLM counts accepted drafts from the
        length of what the runner returns and appends those tokens) can leave accepted tokens
        other than the drafts, or more accepted than proposed, whose positions vLLM then counts
        as computed though the step wrote no KV there. Either is logged with counts and the
        request marked diverged; the caller keeps the drafts' ids for the accepted positions
        (their KV was computed for them) and :data:`UNWRITTEN_TOKEN` past them, so pagedkv
        never hashes, caches or announces a block under tokens its KV was not computed for.
        Raises ``VllmStateMismatchError`` for a rollback past the first draft (a negative
        count: pagedkv cannot tell which slots vLLM keeps).
        """
        accepted = request.num_computed_tokens - base
        if accepted < 0:
            raise VllmStateMismatchError(
                f"request {rid!r}: {accepted} draft token(s) accepted of {len(drafts)} proposed at position {base}",
                request_id=rid,
                quantity="accepted_draft_tokens",
                expected=f">= 0 of {len(drafts)}",
                got=str(accepted),
            )
        past = max(accepted - len(drafts), 0)
        accepted -= past
        tokens = list(request.all_token_ids[base : base + accepted])
        differ = sum(1 for t, d in zip(tokens, drafts, strict=False) if t != d)
        if differ or past:
            self.num_draft_mismatches += 1
            self.num_mismatched_draft_tokens += differ + past
            self._diverged.add(rid)
            logger.warning(
                "request %r: the verify step at position %d accepted %d token(s) for %d draft(s): "
                "%d differ from their draft (tokens %s vs drafts %s), %d have none; pagedkv keeps "
                "the ids the KV was computed for and caches no block under other tokens "
                "(%d such verify step(s), %d token(s) so far)",
                rid,
                base,
                accepted + past,
                len(drafts),
                differ,
                tokens,
                drafts[:accepted],
                past,
                self.num_draft_mismatches,
                self.num_mismatched_draft_tokens,
            )
        return accepted, past

    def _placeholder_drafts(self, request: Any, past: int, num_drafts: int) -> int:
        """How many of the tokens scheduled ``past`` the request's known ones, beyond its
        ``num_drafts`` drafts, are vLLM's placeholder drafts: a new or resumed request with one
        token left is padded to a verify-sized step of ``1 + k`` tokens, the ``k`` placeholders
        in no ``spec_token_ids``. The caller gives them lookahead slots as drafts of
        :data:`UNWRITTEN_TOKEN` ids, so vLLM's rollback of them is read like any verify step's
        (a runner that "accepts" one leaves an id no request hits), and where they reach past
        the block of the request's last token the request holds the blocks vLLM's own manager
        gives them (the model runner writes their KV there). Async scheduling's output
        placeholders are not counted here."""
        n = past - num_drafts
        if n <= 0 or request.num_output_placeholders:
            return 0
        return n

    def _forget_if_diverged(self, request: Any) -> bool:
        """Whether ``request``, preempted, must be forgotten rather than kept for recompute:
        its pagedkv tokens are not vLLM's (see :meth:`_check_accepted_drafts`), and vLLM
        recomputes its own tokens on resume (a kept sequence would cache that KV under the
        other tokens' hashes). It re-registers from vLLM's tokens on resume."""
        return request.request_id in self._diverged

    # ---- block tables ----------------------------------------------------------------------

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """``[0]`` per KV cache group: cascade attention is gone from vLLM; kept for schedulers
        that still ask."""
        return [0] * self.num_kv_cache_groups

    # ---- per-step hooks --------------------------------------------------------------------

    def new_step_starts(self) -> None:
        """No per-step state to reset."""

    def take_new_block_ids(self) -> list[int]:
        """``[]``: no block zeroing (managers with Mamba state groups override it)."""
        return []

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """``([], [])``: vLLM requests never share a partially filled block, so pagedkv plans no
        copy-on-write for them."""
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """``{}``: no Mamba boundary states."""
        return {}

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        """``[]``: no Mamba boundary states."""
        return []

    # ---- Mamba state zeroing (refused) -----------------------------------------------------

    def record_blocks_for_zeroing(self, *args: Any, **kwargs: Any) -> None:
        """Zeroing a Mamba group's blocks after a failed KV load (Mamba layers are refused):
        raises ``UnsupportedVllmCallError``."""
        raise UnsupportedVllmCallError(
            f"{type(self).__name__}.record_blocks_for_zeroing zeroes Mamba state blocks, which "
            "PagedKVScheduler refuses",
            operation="record_blocks_for_zeroing",
            feature="Mamba layers",
        )
