"""Engine configuration: :class:`EngineConfig` (checked before the model loads) and the dtypes
the engine runs."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

import pagedkv

from .errors import EngineConfigError
from .scheduler import SchedulerConfig
from .virtual.memory import PAGE_SIZES

__all__ = ["EngineConfig", "torch_dtype", "DEFAULT_NUM_SPECULATIVE_TOKENS"]

#: Draft tokens per step with ``speculative="ngram"`` and no ``num_speculative_tokens``.
DEFAULT_NUM_SPECULATIVE_TOKENS = 3


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Engine configuration: the KV pool, scheduling limits and seed of an
    :class:`~pagedkv.engine.LLMEngine` (its keyword arguments of the same names). Every field
    is keyword-only (``EngineConfig(block_size=16, max_num_seqs=64)``): with this many sizes
    and limits, a positional call could swap two of them silently.

    Attributes:
        num_kv_blocks: KV pool size in blocks, the null block included (usable =
            ``num_kv_blocks - 1``). Default: from ``kv_bytes``, else 1024. A block holds
            ``block_size`` tokens of every layer, or on a model with sliding-window layers
            (a ``pagedkv.KVCacheManager`` of one group per KV cache group) of one group's layers
            only (3 of Gemma 3 270M's 18): the same bytes hold that many more blocks.
        kv_bytes: KV pool size in bytes (all layers, K and V); ignored if ``num_kv_blocks``.
        block_size: tokens per block.
        max_tokens_per_step: token budget per step; longer prefills are chunked.
        max_num_seqs: most sequences per step.
        preemption: ``"recompute"`` or ``"swap"``.
        num_cpu_blocks: CPU swap blocks (default: ``num_kv_blocks`` with swap, else 0).
        enable_prefix_caching: share KV of identical prompt prefixes across requests.
        hash_algo: ``"sha256"`` (default) or ``"xxh3_128"`` for prefix hashes.
        seed: engine seed, an integer in ``[-2**63, 2**64)`` (torch's generator seed range);
            requests without a seed derive theirs from it.
        speculative: ``None`` (default, off) or ``"ngram"``: prompt-lookup speculative
            decoding (:mod:`~pagedkv.engine.speculative`). It applies to greedy requests
            (temperature 0, ``n == 1``, no beam search), whose outputs it leaves unchanged;
            other requests are decoded one token per step as without it.
        num_speculative_tokens: most draft tokens per sequence and step, >= 1 (default 3
            with ``speculative="ngram"``); only with ``speculative``.
        host_cache_bytes: size in bytes of the prefix cache's host-memory tier (cached blocks
            evicted from the device pool are copied there and loaded back instead of
            recomputed; docs/design.md, "Host tier"); ``None`` (default): no host tier.
            ``num_host_blocks = host_cache_bytes // KV bytes per block``.
        num_host_blocks: host tier size in blocks; wins over ``host_cache_bytes``; 0: none.
        host_admission_min_seen: the host tier stores an evicted block only when its hash was
            used (registered or looked up) at least this many times, >= 1 (default 2: a prompt
            used once does not push reused blocks out; 1 stores every evicted block).
        host_eviction: the host tier's eviction policy, a name the core accepts: ``"lru"``
            (default) or ``"arc"`` (ARC, Megiddo and Modha, FAST'03; docs/design.md, "Host
            tier"); without a host tier it has no effect.
        kv_layout: ``"paged"`` (default: blocks and block tables) or ``"virtual"`` (each
            sequence's K/V contiguous in reserved virtual memory, pages committed on demand,
            vAttention; :mod:`~pagedkv.engine.virtual.layout`). ``"virtual"`` has the paged
            pool's bytes as its physical budget, runs without cross-request prefix caching,
            and refuses swap preemption (here), ``n > 1`` / beam search (per request) and
            sliding-window models (at load).
        page_size: the virtual layout's commit granularity in bytes: 4096, 65536 (default)
            or 2097152 (transparent huge pages); checked with either layout.

    Raises:
        EngineConfigError: a field of the wrong type or out of range; the message names it.
            (Upper bounds of the pool and block sizes are the core's, checked by
            :meth:`check_core_limits` and :class:`pagedkv.CacheConfig`.)
    """

    num_kv_blocks: int | None = None
    kv_bytes: int | None = None
    block_size: int = 16
    max_tokens_per_step: int = 1024
    max_num_seqs: int = 256
    preemption: str = "recompute"
    num_cpu_blocks: int | None = None
    enable_prefix_caching: bool = True
    hash_algo: str = "sha256"
    seed: int = 0
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    kv_layout: str = "paged"
    page_size: int = 65536
    host_cache_bytes: int | None = None
    num_host_blocks: int | None = None
    host_admission_min_seen: int = 2
    host_eviction: str = "lru"

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, want: str) -> None:
            if not ok:
                raise EngineConfigError(f"{name}={getattr(self, name)!r} is invalid: expected {want}")

        def at_least(v: object, low: int) -> bool:  # bool is an int subclass, never a count
            return isinstance(v, int) and not isinstance(v, bool) and v >= low

        check(
            self.num_kv_blocks is None or at_least(self.num_kv_blocks, 2),
            "num_kv_blocks",
            "None or an integer >= 2 blocks (block 0 is the null block)",
        )
        check(
            self.kv_bytes is None
            or (
                isinstance(self.kv_bytes, (int, float))
                and not isinstance(self.kv_bytes, bool)
                and math.isfinite(self.kv_bytes)
                and self.kv_bytes > 0
            ),
            "kv_bytes",
            "None or a number of bytes > 0",
        )
        check(at_least(self.block_size, 1), "block_size", "an integer >= 1 (tokens per block)")
        check(at_least(self.max_tokens_per_step, 1), "max_tokens_per_step", "an integer >= 1 (tokens)")
        check(at_least(self.max_num_seqs, 1), "max_num_seqs", "an integer >= 1 (sequences)")
        check(self.preemption in ("recompute", "swap"), "preemption", "'recompute' or 'swap'")
        check(
            self.num_cpu_blocks is None or at_least(self.num_cpu_blocks, 0),
            "num_cpu_blocks",
            "None or an integer >= 0 blocks",
        )
        check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "True or False")
        check(self.hash_algo in ("sha256", "xxh3_128"), "hash_algo", "'sha256' or 'xxh3_128'")
        # torch.Generator.manual_seed takes a 64-bit seed (signed or unsigned); a wider one
        # failed only at LLMEngine construction, after the model had loaded.
        check(
            isinstance(self.seed, int) and not isinstance(self.seed, bool) and -(2**63) <= self.seed < 2**64,
            "seed",
            "an integer in [-2**63, 2**64)",
        )
        check(self.speculative in (None, "ngram"), "speculative", "None or 'ngram' (prompt lookup)")
        check(
            self.num_speculative_tokens is None or at_least(self.num_speculative_tokens, 1),
            "num_speculative_tokens",
            "None or an integer >= 1 (draft tokens per step)",
        )
        check(
            self.num_speculative_tokens is None or self.speculative is not None,
            "num_speculative_tokens",
            "None unless speculative is set (speculative='ngram')",
        )
        check(
            self.host_cache_bytes is None or at_least(self.host_cache_bytes, 1),
            "host_cache_bytes",
            "None or an integer number of bytes >= 1",
        )
        check(
            self.num_host_blocks is None or at_least(self.num_host_blocks, 0),
            "num_host_blocks",
            "None or an integer >= 0 blocks",
        )
        check(at_least(self.host_admission_min_seen, 1), "host_admission_min_seen", "an integer >= 1 (uses)")
        check(isinstance(self.host_eviction, str), "host_eviction", "a str (a policy name)")
        try:  # the core holds the list of policies (its message names them)
            pagedkv.CacheConfig(num_blocks=2, block_size=1, host_eviction=self.host_eviction)
        except pagedkv.InvalidConfigError as e:
            raise EngineConfigError(f"host_eviction={self.host_eviction!r} is invalid: {e.reason}") from None
        check(self.kv_layout in ("paged", "virtual"), "kv_layout", "'paged' or 'virtual'")
        check(
            isinstance(self.page_size, int) and not isinstance(self.page_size, bool) and self.page_size in PAGE_SIZES,
            "page_size",
            "4096, 65536 or 2097152 bytes (4 KiB, 64 KiB, 2 MiB)",
        )
        check(
            self.kv_layout == "paged" or self.preemption == "recompute",
            "preemption",
            "'recompute' with kv_layout='virtual' (swap preemption is paged-only)",
        )
        if self.num_host_blocks or (self.num_host_blocks is None and self.host_cache_bytes is not None):
            # The host tier is the prefix cache's second tier: nothing to keep without the first.
            name = "num_host_blocks" if self.num_host_blocks else "host_cache_bytes"
            check(self.enable_prefix_caching, name, "no host tier (None or 0) with enable_prefix_caching=False")
            check(self.kv_layout == "paged", name, "no host tier (None or 0) with kv_layout='virtual'")

    def check_host_memory(self, available_bytes: int) -> None:
        """Check the host tier asked for in bytes fits the host memory available now
        (``available_bytes``, e.g. :func:`pagedkv.engine.resources.available_memory` of the
        CPU). Run before the model load; the host tier sized in blocks is checked with the
        other pools after it (:func:`pagedkv.engine.resources.check_kv_fits`).

        Raises:
            EngineConfigError: ``host_cache_bytes`` above ``available_bytes``; names both.
        """
        if (
            self.num_host_blocks is None
            and self.host_cache_bytes is not None
            and self.host_cache_bytes > available_bytes
        ):
            raise EngineConfigError(
                f"host_cache_bytes={self.host_cache_bytes} is invalid: the host tier of {self.host_cache_bytes} "
                f"bytes ({self.host_cache_bytes / 2**30:.2f} GiB) is larger than the {available_bytes} bytes "
                f"({available_bytes / 2**30:.2f} GiB) of host memory available; lower --host-cache-bytes"
            )

    def check_core_limits(self) -> None:
        """Check the sizes given explicitly (``block_size``, ``num_kv_blocks``,
        ``num_cpu_blocks``, ``num_host_blocks``) against the core's upper bounds, asking
        :class:`pagedkv.CacheConfig` (the one validator). Run before the model load, so that a
        block size the core refuses is not first reported as a KV cache that does not fit.

        Raises:
            EngineConfigError: a size above the core's limit; names the field and value.
        """
        try:
            pagedkv.CacheConfig(
                num_blocks=self.num_kv_blocks or 2,
                block_size=self.block_size,
                num_cpu_blocks=self.num_cpu_blocks or 0,
                num_host_blocks=self.num_host_blocks or 0,
            )
        except pagedkv.InvalidConfigError as e:
            name = {"num_blocks": "num_kv_blocks"}.get(e.field, e.field)
            raise EngineConfigError(f"{name}={getattr(self, name)!r} is invalid: {e.reason}") from None

    def resolved(self, kv_bytes_per_block: int) -> EngineConfig:
        """This config with both pool sizes set for a model whose KV takes
        ``kv_bytes_per_block`` bytes per block: the device pool from ``num_kv_blocks``, else
        ``kv_bytes``, else 1024 blocks; the swap pool from ``num_cpu_blocks``, else as many
        blocks as the device pool with swap preemption, else 0.

        The host tier gets ``num_host_blocks``, else ``host_cache_bytes // kv_bytes_per_block``,
        else 0.

        Raises:
            EngineConfigError: ``kv_bytes`` holds fewer than 2 blocks, or ``host_cache_bytes``
                less than one block.
        """
        num_kv_blocks = self.num_kv_blocks
        if num_kv_blocks is None and self.kv_bytes is not None:
            num_kv_blocks = int(self.kv_bytes) // kv_bytes_per_block
            if num_kv_blocks < 2:
                raise EngineConfigError(
                    f"kv_bytes={self.kv_bytes} is invalid: it holds {num_kv_blocks} blocks of "
                    f"{kv_bytes_per_block} bytes; need at least 2 (one is the null block)"
                )
        num_kv_blocks = 1024 if num_kv_blocks is None else num_kv_blocks
        num_cpu_blocks = self.num_cpu_blocks
        if num_cpu_blocks is None:
            num_cpu_blocks = num_kv_blocks if self.preemption == "swap" else 0
        num_host_blocks = self.num_host_blocks
        if num_host_blocks is None:
            num_host_blocks = 0
            if self.host_cache_bytes is not None:
                num_host_blocks = int(self.host_cache_bytes) // kv_bytes_per_block
                if num_host_blocks < 1:
                    raise EngineConfigError(
                        f"host_cache_bytes={self.host_cache_bytes} is invalid: it holds no block of "
                        f"{kv_bytes_per_block} bytes; need at least one block"
                    )
        return dataclasses.replace(
            self, num_kv_blocks=num_kv_blocks, num_cpu_blocks=num_cpu_blocks, num_host_blocks=num_host_blocks
        )

    def cache_config(
        self,
        *,
        enable_events: bool = False,
        hash_seed: bytes | None = None,
        groups: list[pagedkv.KVCacheGroupSpec] | None = None,
        layer_groups: list[int] | None = None,
    ) -> pagedkv.CacheConfig:
        """The KV cache manager's configuration (call on a :meth:`resolved` config);
        ``enable_events`` buffers its KV events (for a router's :class:`pagedkv.KVIndexer`);
        ``hash_seed`` is the chain seed of the prefix hashes (the engine's cache identity,
        :attr:`~pagedkv.engine.models.identity.CacheIdentity.seed`; ``None``: empty).
        ``groups`` / ``layer_groups``: a model's KV cache groups (``pagedkv.KVCacheGroupSpec``
        each, of ``block_size`` tokens) and each layer's group index
        (:func:`pagedkv.engine.kv_groups.group_specs`); ``None``: one full-attention group of
        ``block_size`` tokens.

        Raises:
            pagedkv.InvalidConfigError: a size above the core's limits, or groups the core
                refuses (names the field).
        """
        num_kv_blocks, num_cpu_blocks = self.pools()
        return pagedkv.CacheConfig(
            num_blocks=num_kv_blocks,
            block_size=self.block_size,
            groups=groups,
            layer_groups=layer_groups,
            enable_prefix_caching=self.enable_prefix_caching,
            hash_algo=self.hash_algo,
            num_cpu_blocks=num_cpu_blocks,
            enable_events=bool(enable_events),
            hash_seed=hash_seed,
            num_host_blocks=self.num_host_blocks or 0,
            host_admission_min_seen=self.host_admission_min_seen,
            host_eviction=self.host_eviction,
        )

    def pools(self) -> tuple[int, int]:
        """``(num_kv_blocks, num_cpu_blocks)`` of a :meth:`resolved` config."""
        assert self.num_kv_blocks is not None and self.num_cpu_blocks is not None, "resolve the pool sizes first"
        return self.num_kv_blocks, self.num_cpu_blocks

    @property
    def draft_tokens_per_step(self) -> int:
        """Most draft tokens per sequence and step: 0 with speculation off."""
        if self.speculative is None:
            return 0
        return DEFAULT_NUM_SPECULATIVE_TOKENS if self.num_speculative_tokens is None else self.num_speculative_tokens

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's limits for a model of ``max_model_len`` tokens of context."""
        return SchedulerConfig(
            self.max_tokens_per_step,
            self.max_num_seqs,
            self.preemption,
            max_model_len,
            num_speculative_tokens=self.draft_tokens_per_step,
        )


#: The weight / activation / KV dtypes the engine runs, by name.
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(dtype: Any) -> torch.dtype:
    """``dtype`` as a torch dtype; accepts the dtype, its name (``"bfloat16"``) or ``None``
    (float32).

    Raises:
        EngineConfigError: any other value (message names it).
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.removeprefix("torch."), dtype)
    if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES.values():
        raise EngineConfigError(
            f"dtype={dtype!r} is invalid: expected torch.float32, torch.float16 or "
            f"torch.bfloat16, or one of the names {', '.join(_DTYPES)}"
        )
    return dtype
