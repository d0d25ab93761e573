"""Which vLLM configurations the pagedkv scheduler serves, checked before anything is built.

pagedkv manages one pool of equally sized pages for full-attention, sliding-window and
chunked-local KV cache groups (of one block size or several), and it schedules only
tokens whose ids are known (it hashes them as it allocates). Everything in vLLM that breaks one
of those two assumptions is refused here, with the setting named, instead of being served
subtly wrong later: Mamba layers outside vLLM's ``align`` / ``none`` cache modes and the setups
of ``_check_mamba_group`` / ``_check_mamba_none_group`` (align-mode Mamba groups are served as
pagedkv state groups, mode-none ones as groups out of the prefix cache), cross
attention, KV connectors that keep vLLM's own block pool (see
:mod:`pagedkv.integrations.vllm.connectors`), context
parallelism (blocks sharded across ranks), lookahead block hashes and multi-module MTP's prefill
lookahead (EAGLE / EAGLE-3 / MTP drafters are served otherwise: their lookahead slots and the
last-block drop of prefix hits, see ``_check_drafter``), diffusion decoding (a canvas rewritten
in place), prompt embeddings (no token ids to hash), block sizes whose hits vLLM places
otherwise (see ``_check_block_sizes``), and the metrics / aux-output hooks that read vLLM's own
block pool.
"""

from __future__ import annotations

import math
from typing import Any

from pagedkv.integrations.vllm.connectors import check_kv_transfer_config, check_kv_transfer_config_with_state_groups
from pagedkv.integrations.vllm.errors import UnsupportedVllmConfigError

__all__ = ["UnsupportedVllmConfigError", "check_supported_config"]


def _refuse(field: str, value: Any, reason: str) -> UnsupportedVllmConfigError:
    return UnsupportedVllmConfigError(
        f"PagedKVScheduler does not support {field}={value!s}: {reason}",
        field=field,
        value=str(value),
        reason=reason,
    )


def _attr(obj: Any, name: str, default: Any = None) -> Any:
    return getattr(obj, name, default) if obj is not None else default


def _mamba_outside_align(groups: list[Any]) -> bool:
    """Whether a ``MambaSpec`` group is in a cache mode other than ``align``."""
    return any(
        type(g.kv_cache_spec).__name__ == "MambaSpec" and _attr(g.kv_cache_spec, "mamba_cache_mode") != "align"
        for g in groups
    )


def _check_block_sizes(groups: list[Any], block_size: int, hash_block_size: int | None, vllm_config: Any) -> None:
    """Refuses block sizes whose prefix hits pagedkv would place other than vLLM.

    vLLM 0.33's rules (``resolve_kv_cache_block_sizes``, ``HybridKVCacheCoordinator``): with
    one group the scheduler block size is the group's and ``hash_block_size`` equals it while
    prefix caching is on; with several, the scheduler block size is the LCM of the groups'
    block sizes, ``hash_block_size`` divides every group's (their GCD by default), and without
    Mamba layers every prefix hit is a multiple of the scheduler block size, found per group at
    the group's own block size. pagedkv's hits are multiples of the same LCM (its hit unit).
    """
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    sizes = [int(_attr(group.kv_cache_spec, "block_size")) for group in groups]
    lcm = math.lcm(*sizes)
    if len(groups) == 1 and sizes[0] != block_size:
        raise _refuse(
            "kv_cache_spec.block_size",
            sizes[0],
            f"must equal the scheduler block size {block_size} (one KV cache group)",
        )
    if block_size != lcm:
        raise _refuse(
            "block_size",
            block_size,
            f"the scheduler block size must be the least common multiple {lcm} of the KV cache "
            f"groups' block sizes {sizes} (vLLM's rule): prefix hits are multiples of it",
        )
    for g, (group, bs) in enumerate(zip(groups, sizes, strict=True)):
        if isinstance(group.kv_cache_spec, ChunkedLocalAttentionSpec) and bs != block_size:
            raise _refuse(
                f"kv_cache_config.kv_cache_groups[{g}].kv_cache_spec.block_size",
                bs,
                f"a chunked-local group's block size must equal the scheduler block size {block_size} "
                "(vLLM does not serve chunked-local groups of another block size either)",
            )
    if hash_block_size is None:
        return
    caching = bool(_attr(_attr(vllm_config, "cache_config"), "enable_prefix_caching", False))
    if hash_block_size == block_size and not caching and _mamba_outside_align(groups):
        # vLLM keeps the hashes at the scheduler block size when nothing reads them.
        return
    if hash_block_size <= 0 or any(bs % hash_block_size for bs in sizes):
        raise _refuse(
            "hash_block_size",
            hash_block_size,
            f"must divide every KV cache group's block size {sizes}",
        )
    if len(groups) == 1 and caching and hash_block_size != block_size:
        raise _refuse(
            "hash_block_size",
            hash_block_size,
            f"with one KV cache group and prefix caching on, prefix hits are whole blocks: "
            f"must equal block_size {block_size} (as vLLM requires)",
        )


def check_supported_config(
    vllm_config: Any,
    kv_cache_config: Any,
    block_size: int,
    hash_block_size: int | None = None,
) -> None:
    """Raise :class:`UnsupportedVllmConfigError` for the first setting pagedkv cannot serve.

    Args:
        vllm_config: the engine's ``vllm.config.VllmConfig``.
        kv_cache_config: the ``vllm.v1.kv_cache_interface.KVCacheConfig`` the scheduler gets.
        block_size: the scheduler's block size in tokens.
        hash_block_size: the prefix-hash granularity in tokens (None = ``block_size``).

    Async scheduling is served (two batches in flight), except with pipeline parallelism.
    Accepted: KV cache groups whose specs are plain ``FullAttentionSpec`` /
    ``MLAAttentionSpec`` (no window), ``SlidingWindowSpec``, ``SlidingWindowMLASpec`` (with
    ``bounded_replay``: out of the prefix cache, a hit's last window replayed, vLLM's
    ``prefix_replay_tokens``) or ``ChunkedLocalAttentionSpec``,
    of one block size, or of several when the scheduler block size is their least common
    multiple (vLLM's rule; a chunked-local group at the scheduler block size), with
    ``hash_block_size`` dividing every group's block size (equal to it for one group with
    prefix caching on); :class:`PagedKVCacheManager` serves them all. ``MambaSpec`` groups are
    served in vLLM's ``align`` cache mode beside full-attention groups, as state groups, and in
    its ``none`` mode (prefix caching off) as groups out of the prefix cache;
    ``_check_mamba_group`` names what it refuses with them. A cache of mixed precision
    (``needs_kv_cache_zeroing``) is served: new blocks are handed out for zeroing. Decoder-only
    model, a KV connector only as
    :func:`~pagedkv.integrations.vllm.connectors.check_kv_transfer_config` accepts it, no
    context parallelism, model-based drafters only as ``_check_drafter`` accepts them (EAGLE /
    EAGLE-3 / single-module MTP with legacy block hashes or prefix caching off; n-gram and other
    proposers are served), no diffusion decoding (``diffusion_config``), no
    prompt embeddings, no KV-cache metrics sampling, no aux-output connector. Prefix caching on or
    off, chunked prefill, FCFS and priority policies, LoRA, multimodal inputs, cache salts, KV
    events, the watermark and speculative decoding with scheduled draft tokens are all
    supported.
    """
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    groups = list(_attr(kv_cache_config, "kv_cache_groups", []))
    if not groups:
        raise _refuse("kv_cache_config.kv_cache_groups", "0 groups", "at least one KV cache group is needed")
    windowed = (SlidingWindowSpec, ChunkedLocalAttentionSpec)
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            _check_mamba_group(vllm_config, groups, g, spec, block_size, hash_block_size)
            continue
        if type(spec) not in (FullAttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec, *windowed):
            raise _refuse(
                "kv_cache_spec",
                type(spec).__name__,
                "only FullAttentionSpec / MLAAttentionSpec / SlidingWindowSpec / "
                "SlidingWindowMLASpec / ChunkedLocalAttentionSpec groups are supported",
            )
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            for window in ("sliding_window", "attention_chunk_size"):
                if _attr(spec, window) is not None:
                    raise _refuse(
                        f"kv_cache_spec.{window}",
                        _attr(spec, window),
                        "a windowed FullAttentionSpec (vLLM's hybrid KV cache manager disabled) "
                        "keeps every block in vLLM, which pagedkv does not model",
                    )
        if (_attr(spec, "extra_retained_tokens", 0) or 0) > 0:
            raise _refuse(
                f"kv_cache_config.kv_cache_groups[{g}].kv_cache_spec.extra_retained_tokens",
                _attr(spec, "extra_retained_tokens"),
                "trailing tokens kept below the sliding window without being attended "
                "(multi-module MTP re-prefill) are not modelled: pagedkv would release their "
                "blocks before vLLM does",
            )
    _check_block_sizes(groups, block_size, hash_block_size, vllm_config)
    has_mamba = any(isinstance(group.kv_cache_spec, MambaSpec) for group in groups)
    if _attr(kv_cache_config, "has_mamba_layers", False) and not has_mamba:
        raise _refuse(
            "kv_cache_config.has_mamba_layers",
            True,
            "Mamba layers inside a group of another spec (a uniform-type spec) are not managed",
        )
    # A cache of mixed precision (has_mixed_precision_kv_cache): new blocks are recorded for
    # the worker to zero (PagedKVCacheManager.take_new_block_ids).
    if _attr(kv_cache_config, "hisparse_host_num_blocks") is not None:
        raise _refuse(
            "kv_cache_config.hisparse_host_num_blocks",
            _attr(kv_cache_config, "hisparse_host_num_blocks"),
            "host-resident sparse KV is not managed",
        )

    model = _attr(vllm_config, "model_config")
    if _attr(model, "is_encoder_decoder", False):
        raise _refuse(
            "model_config.is_encoder_decoder",
            True,
            "cross-attention blocks (encoder-decoder models) are not managed",
        )
    if _attr(model, "enable_prompt_embeds", False):
        raise _refuse(
            "model_config.enable_prompt_embeds",
            True,
            "prompt embeddings carry no token ids to hash blocks by",
        )
    check_kv_transfer_config(_attr(vllm_config, "kv_transfer_config"))
    parallel = _attr(vllm_config, "parallel_config")
    for cp in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if (_attr(parallel, cp, 1) or 1) > 1:
            raise _refuse(
                f"parallel_config.{cp}",
                _attr(parallel, cp),
                "context parallelism shards each block across ranks",
            )
    pp = _attr(parallel, "pipeline_parallel_size", 1) or 1
    if pp > 1 and _attr(_attr(vllm_config, "scheduler_config"), "async_scheduling", False):
        raise _refuse(
            "parallel_config.pipeline_parallel_size",
            pp,
            "with async scheduling on, pipeline parallelism keeps more than two batches in "
            "flight, which the plug-in's placeholder slots are not tested with "
            "(use --no-async-scheduling)",
        )
    _check_drafter(vllm_config, groups)
    diffusion = _attr(vllm_config, "diffusion_config")
    if diffusion is not None:
        raise _refuse(
            "diffusion_config",
            type(diffusion).__name__,
            "diffusion decoding rewrites a canvas of tokens in place and schedules steps of "
            "no new token; pagedkv's sequences only grow",
        )
    observability = _attr(vllm_config, "observability_config")
    if _attr(observability, "kv_cache_metrics", False):
        raise _refuse(
            "observability_config.kv_cache_metrics",
            True,
            "block residency sampling reads vLLM's own block pool",
        )
    aux = _attr(vllm_config, "aux_output_config")
    if _attr(aux, "enabled", False):
        raise _refuse("aux_output_config.enabled", True, "the aux-output connector is not supported")


def _check_drafter(vllm_config: Any, groups: list[Any]) -> None:
    """Model-based drafters (EAGLE, EAGLE-3, MTP): lookahead slots (``num_lookahead_tokens``),
    lookahead block hashes (``num_hash_lookahead_tokens``, vLLM's default for EAGLE-family
    drafters with prefix caching: pagedkv's ``hash_lookahead_tokens``) and EAGLE's last-block
    drop of prefix hits (with ``disable_lookahead_block_hashes``) are served; refused, naming
    the setting: lookahead block hashes with KV cache events (vLLM's events then carry the
    lookahead tokens, pagedkv's do not), multi-module MTP's prefill lookahead
    (``num_prefill_lookahead_tokens > 1``: its re-prefillable tokens are not managed), lookahead
    slots with a KV connector, the last-block drop on a chunked-local group (vLLM refuses
    it too) and with a bounded-replay sliding-window MLA group."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    hashes = _attr(vllm_config, "num_hash_lookahead_tokens", 0) or 0
    if hashes > 0 and _attr(_attr(vllm_config, "kv_events_config"), "enable_kv_cache_events", False):
        raise _refuse(
            "num_hash_lookahead_tokens",
            hashes,
            "lookahead block hashes with KV cache events are not served (the events would need "
            "each block's lookahead tokens); set speculative_config "
            "disable_lookahead_block_hashes=true or turn the events off",
        )
    prefill = _attr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0
    if prefill > 1:
        raise _refuse(
            "num_prefill_lookahead_tokens",
            prefill,
            "multi-module MTP's re-prefillable prefill tokens are not managed (at most 1: "
            "EAGLE-family drafters, single-module MTP)",
        )
    lookahead = _attr(vllm_config, "num_lookahead_tokens", 0) or 0
    if lookahead > 0 and _attr(vllm_config, "kv_transfer_config") is not None:
        raise _refuse(
            "num_lookahead_tokens",
            lookahead,
            "lookahead slots with a KV connector are not managed",
        )
    spec = _attr(vllm_config, "speculative_config")
    use_drop = bool(spec is not None and getattr(spec, "use_eagle_block_drop", lambda: False)())
    caching = bool(_attr(_attr(vllm_config, "cache_config"), "enable_prefix_caching", False))
    if use_drop and caching:
        for g, group in enumerate(groups):
            if (_attr(group.kv_cache_spec, "prefix_replay_tokens", 0) or 0) > 0:
                raise _refuse(
                    f"kv_cache_config.kv_cache_groups[{g}].kv_cache_spec.bounded_replay",
                    True,
                    "EAGLE's last-block drop of prefix hits with a bounded-replay sliding-window "
                    "group (the hit's window recomputed) is not served",
                )
        flagged = [g for g, group in enumerate(groups) if getattr(group, "is_eagle_group", False)]
        for g in flagged or range(len(groups)):
            group = groups[g]
            if isinstance(group.kv_cache_spec, ChunkedLocalAttentionSpec):
                raise _refuse(
                    f"kv_cache_config.kv_cache_groups[{g}].kv_cache_spec",
                    type(group.kv_cache_spec).__name__,
                    "EAGLE's last-block drop on a chunked-local attention group is not served",
                )


def _check_mamba_group(
    vllm_config: Any, groups: list[Any], g: int, spec: Any, block_size: int, hash_block_size: int | None
) -> None:
    """A Mamba / linear-attention group (``MambaSpec``: Mamba-2, GDN...) is served as a pagedkv
    state group in vLLM's ``align`` cache mode only: one state per block-aligned step end,
    the live state at block ``(n - 1) // block_size`` (the table vLLM's model runner reads),
    published to the prefix cache once the step that wrote it completed (under async
    scheduling too: a slot whose token is not known yet is a placeholder slot whose state is
    kept). Refused, naming the setting: the ``"all"`` cache mode, a group's mode other than the
    cache config's, prefix caching off, speculative decoding other than ``_check_mamba_speculation`` serves (an MTP /
    EAGLE drafter with ``num_speculative_blocks > 0`` on every Mamba group, synchronous
    scheduling; docs/design/vllm-mamba.md, "Speculative decoding"), prefill checkpoint
    blocks, shared-prefix checkpoints, a Mamba block size other than the scheduler block size,
    prefix hashes finer than the block (vLLM's partial state hits), groups other than full
    attention beside it, KV connectors other than NIXL / Mooncake P/D (and a MultiConnector
    of them): an offloading or store connector keeps Mamba states vLLM caches at allocation.
    The P/D connectors are served (an async load's live state is staged until the load
    completed, docs/design/vllm-mamba.md, "KV connectors"). Mode ``"none"`` is checked by
    ``_check_mamba_none_group``."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    field = f"kv_cache_config.kv_cache_groups[{g}].kv_cache_spec"
    cache = _attr(vllm_config, "cache_config")
    modes = (
        (f"{field}.mamba_cache_mode", _attr(spec, "mamba_cache_mode")),
        ("cache_config.mamba_cache_mode", _attr(cache, "mamba_cache_mode", "none")),
    )
    if all(mode == "none" for _, mode in modes):
        _check_mamba_none_group(vllm_config, groups, g, spec, block_size)
        return
    for where, mode in modes:
        if mode not in ("align", "none"):
            raise _refuse(
                where,
                mode,
                "only vLLM's 'align' and 'none' Mamba cache modes are served (states kept at "
                "block-aligned positions, or one state per request out of the prefix cache); "
                "'all' keeps a state per block of every step, which pagedkv does not model",
            )
    (spec_field, spec_mode), (_, cache_mode) = modes
    if spec_mode != cache_mode:
        raise _refuse(
            spec_field,
            spec_mode,
            f"a Mamba group's cache mode must be the cache config's ({cache_mode!r})",
        )
    if not _attr(cache, "enable_prefix_caching", False):
        raise _refuse(
            "cache_config.enable_prefix_caching",
            False,
            "Mamba 'align' mode needs prefix caching on (vLLM's model runner requires it)",
        )
    if (_attr(spec, "num_prefill_checkpoint_blocks", 0) or 0) > 0:
        raise _refuse(
            f"{field}.num_prefill_checkpoint_blocks",
            _attr(spec, "num_prefill_checkpoint_blocks"),
            "prefill checkpoint blocks (internal Mamba checkpoints) are not managed",
        )
    _check_mamba_speculation(vllm_config, groups, field, spec)
    if _attr(cache, "enable_mamba_shared_prefix_checkpoint", False):
        raise _refuse(
            "cache_config.enable_mamba_shared_prefix_checkpoint",
            True,
            "shared-prefix Mamba checkpoints (sub-block states) are not managed",
        )
    if int(spec.block_size) != block_size:
        raise _refuse(
            f"{field}.block_size",
            spec.block_size,
            f"a Mamba group's block size must equal the scheduler block size {block_size}",
        )
    if hash_block_size is not None and hash_block_size != block_size:
        raise _refuse(
            "hash_block_size",
            hash_block_size,
            f"with Mamba layers prefix hashes must be whole blocks ({block_size} tokens): "
            "vLLM's partial (sub-block) state hits are not managed",
        )
    for h, other in enumerate(groups):
        if not isinstance(other.kv_cache_spec, (MambaSpec, FullAttentionSpec, MLAAttentionSpec)) or type(
            other.kv_cache_spec
        ) not in (MambaSpec, FullAttentionSpec, MLAAttentionSpec):
            raise _refuse(
                f"kv_cache_config.kv_cache_groups[{h}].kv_cache_spec",
                type(other.kv_cache_spec).__name__,
                "beside Mamba groups only full-attention groups are served",
            )
    transfer = _attr(vllm_config, "kv_transfer_config")
    check_kv_transfer_config_with_state_groups(transfer)
    if transfer is not None and int(_attr(spec, "num_speculative_blocks", 0) or 0) > 0:
        raise _refuse(
            f"{field}.num_speculative_blocks",
            spec.num_speculative_blocks,
            "speculative state blocks are not managed with a KV connector (a loaded state's "
            "speculative blocks are not laid out; serve the drafter without the connector)",
        )


def _check_mamba_speculation(vllm_config: Any, groups: list[Any], field: str, spec: Any) -> None:
    """Speculative decoding beside a Mamba group: served with a drafter (EAGLE, EAGLE-3, MTP,
    n-gram...; vLLM gives every Mamba group ``num_speculative_blocks = k`` for any of them)
    whose Mamba groups carry ``k`` speculative state blocks (pagedkv's ``spare_blocks`` on its
    state groups), at most ``k`` drafts a step, synchronous scheduling. Refused, naming the
    setting: a drafter without speculative state blocks (a hand-built config, or vLLM's
    ReplaySSM) or state blocks without a drafter, Mamba groups of different ``num_speculative_blocks``, more
    than 16 of them or more drafts than blocks, and async scheduling with drafts
    (docs/design/vllm-mamba.md, "Speculative decoding")."""
    from vllm.v1.kv_cache_interface import MambaSpec

    blocks = int(_attr(spec, "num_speculative_blocks", 0) or 0)
    drafter = _attr(vllm_config, "speculative_config")
    lookahead = _attr(vllm_config, "num_lookahead_tokens", 0) or 0
    if blocks == 0:
        if drafter is not None or lookahead:
            raise _refuse(
                "speculative_config",
                type(drafter).__name__,
                "speculative decoding with Mamba layers needs vLLM's speculative state blocks "
                "(num_speculative_blocks > 0 on every Mamba group, what an MTP / EAGLE drafter "
                "sets): drafts advance the state in place, see docs/design/vllm-mamba.md",
            )
        return
    name = f"{field}.num_speculative_blocks"
    if drafter is None:
        raise _refuse(
            name,
            blocks,
            "speculative state blocks are served with a drafter (speculative_config) only: "
            "they hold the states its drafts write",
        )
    others = {
        int(_attr(o.kv_cache_spec, "num_speculative_blocks", 0) or 0)
        for o in groups
        if isinstance(o.kv_cache_spec, MambaSpec)
    }
    if len(others) > 1:
        raise _refuse(name, sorted(others), "every Mamba group must carry the same number of speculative state blocks")
    if blocks > 16:
        raise _refuse(name, blocks, "at most 16 speculative state blocks are managed")
    drafts = int(_attr(drafter, "num_speculative_tokens", 0) or 0)
    if drafts > blocks:
        raise _refuse(
            "speculative_config.num_speculative_tokens",
            drafts,
            f"a verify step writes one state per draft into the {blocks} speculative state "
            "block(s): at most that many drafts",
        )
    if _attr(_attr(vllm_config, "scheduler_config"), "async_scheduling", False):
        raise _refuse(
            "scheduler_config.async_scheduling",
            True,
            "speculative decoding with Mamba layers is served with synchronous scheduling only "
            "(use --no-async-scheduling): under async scheduling the drafts are placeholders "
            "whose accepted count reaches the scheduler a step later",
        )


def _check_mamba_none_group(vllm_config: Any, groups: list[Any], g: int, spec: Any, block_size: int) -> None:
    """A Mamba group in vLLM's ``"none"`` cache mode (what vLLM sets whenever prefix caching is
    off): one state per request, out of the prefix cache, in blocks of ``mamba_block_size``
    tokens (the context length by default, so one block holds the whole request), plus
    ``num_speculative_blocks`` blocks for the drafts' states (MTP / EAGLE). Served as a pagedkv
    group out of the prefix cache with that many spare blocks
    (``kv_cache_manager.group_spec_of``), synchronous or async scheduling, with or without a
    drafter, with the KV connectors ``check_kv_transfer_config`` accepts (an external load
    fills the group's blocks as vLLM's does). Refused, naming the setting: prefix caching on
    (vLLM's Mamba manager requires ``align`` mode then), a Mamba block size above pagedkv's
    ``MAX_UNCACHED_BLOCK_SIZE``, a scheduler block size (the LCM of the groups') above
    ``2**32 - 1``, groups other than full attention beside it and shared-prefix checkpoints."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    from pagedkv import _core

    field = f"kv_cache_config.kv_cache_groups[{g}].kv_cache_spec"
    cache = _attr(vllm_config, "cache_config")
    if _attr(cache, "enable_prefix_caching", False):
        raise _refuse(
            "cache_config.enable_prefix_caching",
            True,
            "Mamba cache mode 'none' keeps states out of the prefix cache (vLLM's Mamba manager "
            "needs mode 'align' with prefix caching on)",
        )
    limit = int(_core.MAX_UNCACHED_BLOCK_SIZE)
    if int(spec.block_size) > limit:
        raise _refuse(
            f"{field}.block_size",
            spec.block_size,
            f"a Mamba block (mamba_block_size, the context length by default) of at most {limit} "
            "tokens is served in cache mode 'none'",
        )
    if block_size > 2**32 - 1:
        raise _refuse(
            "block_size",
            block_size,
            "the scheduler block size (the LCM of the groups' block sizes) must fit in 32 bits",
        )
    if _attr(cache, "enable_mamba_shared_prefix_checkpoint", False):
        raise _refuse(
            "cache_config.enable_mamba_shared_prefix_checkpoint",
            True,
            "shared-prefix Mamba checkpoints (sub-block states) are not managed",
        )
    for h, other in enumerate(groups):
        if type(other.kv_cache_spec) not in (MambaSpec, FullAttentionSpec, MLAAttentionSpec):
            raise _refuse(
                f"kv_cache_config.kv_cache_groups[{h}].kv_cache_spec",
                type(other.kv_cache_spec).__name__,
                "beside Mamba groups only full-attention groups are served",
            )
