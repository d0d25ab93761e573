"""A block's cache identity as values: what, besides its tokens and its parent, decides a block's
prefix-cache hash.

Two values, one per level at which they are fixed:

- :class:`HashScheme` -- per engine (``CacheConfig``) or index (``KVIndexer``): block size, hash
  algorithm and chain seed (for :class:`pagedkv.engine.LLMEngine` the seed is its model's cache
  identity digest). Engines and indexers with unequal schemes never share a hash.
- :class:`SequenceSpec` -- per request: cache salt, LoRA adapter, typed extra keys (an engine's
  derived keys, such as the RoPE variant of a length-dependent RoPE) and multimodal items; the
  Python face of the core's ``SequenceSpec`` (``rust/core/src/request.rs``), which hashes them
  into every block (:meth:`SequenceSpec.block_keys` there).

A request's spec is derived once, by whoever owns the request (the engine's
:meth:`pagedkv.engine.LLMEngine.sequence_spec`, the vLLM plug-in from vLLM's ``Request``), and
the same value is what the manager registers (``add_sequence(..., spec=spec)``) and what a
router hashes (:meth:`pagedkv.routing.Router.route`, ``KVIndexer.block_hashes(..., spec=spec)``),
so the two cannot disagree. The binding reads a spec through :meth:`SequenceSpec.keywords`, in
one place (``call_spec`` in ``rust/python/src/manager.rs``).

Room for KV cache groups (hybrid models) and speculative decoding: :meth:`SequenceSpec.for_group`
derives the spec of one group's blocks; group 0 hashes exactly like the request itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import InvalidArgumentError

__all__ = ["KV_GROUP_TAG", "HashScheme", "SequenceSpec"]

#: Tag of the typed extra key a KV cache group other than 0 adds (value: the group id, 4 bytes
#: little-endian), so blocks of two groups with equal tokens never share a hash.
KV_GROUP_TAG = "kv_group"


def _bad(arg: str, value: Any, reason: str) -> InvalidArgumentError:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return InvalidArgumentError(f"{arg}={text} is invalid: {reason}", arg=arg, value=text, reason=reason)


def _optional_str(arg: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _bad(arg, value, "expected a str or None")
    return value


def _as_tuple(arg: str, value: Any, reason: str) -> tuple[Any, ...]:
    # A non-iterable (None, an int) is a typed error naming the field, not a bare TypeError.
    try:
        return tuple(value)
    except TypeError:
        raise _bad(arg, value, reason) from None


def _extra_keys(value: Iterable[Any]) -> tuple[tuple[str, bytes], ...]:
    if isinstance(value, (str, bytes)):
        raise _bad("extra_keys", value, "expected a sequence of (tag: str, value: bytes) tuples")
    keys = _as_tuple("extra_keys", value, "expected a sequence of (tag: str, value: bytes) tuples")
    for key in keys:
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and isinstance(key[1], bytes)):
            raise _bad("extra_keys", key, "expected (tag: str, value: bytes) tuples")
    return keys


def _mm_items(value: Iterable[Any]) -> tuple[tuple[bytes, int, int], ...]:
    if isinstance(value, (str, bytes)):
        raise _bad("mm_items", value, "expected a sequence of (item_hash, start_token, num_tokens) tuples")
    items = _as_tuple("mm_items", value, "expected a sequence of (item_hash, start_token, num_tokens) tuples")
    for item in items:
        ok = isinstance(item, tuple) and len(item) == 3 and isinstance(item[0], bytes)
        ok = ok and all(isinstance(n, int) and not isinstance(n, bool) for n in item[1:])
        if not ok or item[1] < 0 or item[2] < 1:
            raise _bad("mm_items", item, "expected (item_hash: bytes, start_token: int >= 0, num_tokens: int >= 1)")
    return items


@dataclass(frozen=True)
class SequenceSpec:
    """The per-request part of a block's cache identity: what ``KVCacheManager.add_sequence``,
    ``KVIndexer.block_hashes`` and ``KVIndexer.overlap`` mix into every block hash (pass it as
    their ``spec=``).

    Args:
        cache_salt: prefix-cache salt (tenant isolation), or ``None``.
        adapter_id: LoRA adapter name, or ``None`` (base model).
        extra_keys: typed ``(tag, value)`` keys (str, bytes), in order; any sequence, kept as
            a tuple.
        mm_items: multimodal items ``(item_hash: bytes, start_token, num_tokens)``, token
            positions in the prompt; kept as a tuple.
        kv_group: the KV cache group the blocks belong to (0: the first or only one); see
            :meth:`for_group`.

    Equal specs give equal hashes for equal tokens (under one :class:`HashScheme`); specs
    differing in any field give disjoint hash chains. Frozen and hashable.

    Raises:
        pagedkv.InvalidArgumentError: a field of the wrong type or range (names it).
    """

    cache_salt: str | None = None
    adapter_id: str | None = None
    extra_keys: Sequence[tuple[str, bytes]] = ()
    mm_items: Sequence[tuple[bytes, int, int]] = ()
    kv_group: int = 0

    def __post_init__(self) -> None:
        _optional_str("cache_salt", self.cache_salt)
        _optional_str("adapter_id", self.adapter_id)
        object.__setattr__(self, "extra_keys", _extra_keys(self.extra_keys))
        object.__setattr__(self, "mm_items", _mm_items(self.mm_items))
        g = self.kv_group
        if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < 2**32:
            raise _bad("kv_group", g, "expected an int in 0..2**32")

    def keywords(self) -> dict[str, Any]:
        """The keyword arguments of ``add_sequence`` / ``block_hashes`` / ``overlap`` that hash
        exactly this spec (a group other than 0 adds its :data:`KV_GROUP_TAG` key last)."""
        extra = list(self.extra_keys)
        if self.kv_group:
            extra.append((KV_GROUP_TAG, self.kv_group.to_bytes(4, "little")))
        return {
            "cache_salt": self.cache_salt,
            "adapter_id": self.adapter_id,
            "extra_keys": extra or None,
            "mm_items": list(self.mm_items) or None,
        }

    def for_group(self, kv_group: int) -> SequenceSpec:
        """This spec for the blocks of KV cache group ``kv_group`` (hybrid models keep one
        block table per group). Raises ``InvalidArgumentError`` for a bad group id."""
        return SequenceSpec(self.cache_salt, self.adapter_id, self.extra_keys, self.mm_items, kv_group)

    def with_extra_keys(self, keys: Iterable[tuple[str, bytes]]) -> SequenceSpec:
        """This spec with ``keys`` appended to its typed extra keys (an engine adding the keys
        it derives to a request's own). Raises ``InvalidArgumentError`` for keys that are not
        such tuples."""
        keys = _extra_keys(keys)
        return SequenceSpec(self.cache_salt, self.adapter_id, (*self.extra_keys, *keys), self.mm_items, self.kv_group)


@dataclass(frozen=True)
class HashScheme:
    """The per-engine part of a block's cache identity: ``block_size`` (tokens), ``hash_algo``
    (``"sha256"`` or ``"xxh3_128"``) and ``hash_seed`` (the chain seed, bytes). A router's
    :class:`pagedkv.KVIndexer` must have its engines' scheme to match their hashes.

    Raises:
        pagedkv.InvalidArgumentError: a field of the wrong type (``block_size`` not an int >= 1,
            ``hash_algo`` not a str, ``hash_seed`` not bytes).
    """

    block_size: int
    hash_algo: str = "sha256"
    hash_seed: bytes = b""

    def __post_init__(self) -> None:
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise _bad("block_size", bs, "expected an int >= 1")
        if not isinstance(self.hash_algo, str):
            raise _bad("hash_algo", self.hash_algo, "expected a str")
        if not isinstance(self.hash_seed, bytes):
            raise _bad("hash_seed", self.hash_seed, "expected bytes")

    @classmethod
    def of(cls, source: Any) -> HashScheme:
        """The scheme of a ``CacheConfig``, a ``KVIndexer`` or a ``KVCacheManager`` (its
        config). Raises ``InvalidArgumentError`` for anything else."""
        source = getattr(source, "config", source)
        try:
            return cls(int(source.block_size), str(source.hash_algo), bytes(source.hash_seed))
        except AttributeError:
            raise _bad("source", source, "expected a CacheConfig, KVIndexer or KVCacheManager") from None

    def indexer(self, *, max_pending: int = 0) -> Any:
        """A new, empty :class:`pagedkv.KVIndexer` with this scheme. Raises
        ``InvalidArgumentError`` for a ``hash_algo`` the core does not know."""
        from pagedkv import KVIndexer  # noqa: PLC0415

        return KVIndexer(self.block_size, hash_algo=self.hash_algo, hash_seed=self.hash_seed, max_pending=max_pending)
