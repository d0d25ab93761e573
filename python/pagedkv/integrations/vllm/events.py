"""pagedkv KV events as vLLM's own KV event objects.

vLLM's scheduler hands whatever ``kv_cache_manager.take_events()`` returns to its publisher
(``--kv-events-config``), which msgpack-encodes ``vllm.distributed.kv_events`` structs onto its
ZMQ socket. Returning those same structs keeps the wire format unchanged for routers.

The block hashes carried are pagedkv's (32-byte chained SHA-256 over the token ids and typed
extra keys, see ``pagedkv.CacheConfig``), not the Python hashes vLLM's engine core computes:
they are the keys pagedkv's prefix cache actually resolves. With
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` on (vLLM's default) they are published as 64-bit ints
like vLLM's own: the first 8 bytes, big-endian (SHA-256 fills all 32 bytes of a pagedkv hash,
xxh3-128 the first 16, so the first 8 are always significant). The set semantics are pagedkv's
event contract: a hash is announced by ``BlockStored`` when it becomes resolvable and by
``BlockRemoved`` when it stops being resolvable, at most once each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pagedkv

__all__ = ["publish_hash", "to_vllm_events", "vllm_extra_keys"]


def vllm_extra_keys(keys: Sequence[tuple[Any, ...]]) -> tuple[Any, ...] | None:
    """pagedkv's typed extra keys of one block in vLLM's untagged event order.

    vLLM publishes, per block, the LoRA name, then ``(mm_identifier, offset)`` pairs, then the
    cache salt; ``None`` when the block has none. ``keys`` are pagedkv event keys
    (``("adapter", name)``, ``("cache_salt", salt)``, ``("multimodal", hash, offset)``,
    ``("tagged", tag, value)``); multimodal hashes are the utf-8 of vLLM's identifier.
    """
    adapter: list[Any] = []
    mm: list[Any] = []
    salt: list[Any] = []
    tagged: list[Any] = []
    for key in keys:
        kind = key[0]
        if kind == "adapter":
            adapter.append(key[1])
        elif kind == "multimodal":
            ident = key[1]
            try:
                ident = ident.decode()
            except UnicodeDecodeError:
                ident = ident.hex()
            mm.append((ident, key[2]))
        elif kind == "cache_salt":
            salt.append(key[1])
        else:
            tagged.append((key[1], key[2]))
    out = tuple(adapter + mm + salt + tagged)
    return out or None


def publish_hash(block_hash: bytes) -> int:
    """A pagedkv block hash as the 64-bit int vLLM publishes with int block hashes on."""
    return int.from_bytes(block_hash[:8], "big")


def _as_bytes(block_hash: bytes) -> bytes:
    return block_hash


def to_vllm_events(
    events: Sequence[pagedkv.BlockStored | pagedkv.BlockRemoved | pagedkv.AllBlocksCleared],
    *,
    lora_ids: Mapping[str, int] | None = None,
    spec_kinds: Sequence[str] = (),
    medium: str = "GPU",
) -> list[Any]:
    """Converts pagedkv events (oldest first) to ``vllm.distributed.kv_events`` structs.

    Args:
        events: from ``pagedkv.KVCacheManager.take_events()``; a ``BlockStored`` /
            ``BlockRemoved`` names its KV cache group (``group``).
        lora_ids: LoRA name -> vLLM ``lora_int_id``, to fill the deprecated ``lora_id`` field.
        spec_kinds: per KV cache group, its kind as vLLM names it (``"full_attention"``...);
            a group past its end publishes no kind (``None``).
        medium: the ``medium`` field (``"GPU"``).

    Returns one vLLM event per pagedkv event: ``BlockStored`` (``group_idx`` = the event's
    group, ``kv_cache_spec_kind`` = that group's kind, one ``extra_keys`` entry per block),
    ``BlockRemoved`` (``group_idx``) or ``AllBlocksCleared``.
    """
    from vllm import envs
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    fold = publish_hash if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES else _as_bytes

    out: list[Any] = []
    for ev in events:
        if isinstance(ev, pagedkv.BlockStored):
            keys = ev.extra_keys
            lora_name = next((k[1] for k in keys if k[0] == "adapter"), None)
            per_block = vllm_extra_keys(keys)
            parent = ev.parent_block_hash
            hashes = ev.block_hashes
            group = ev.group
            out.append(
                BlockStored(
                    block_hashes=[fold(h) for h in hashes],
                    parent_block_hash=None if parent is None else fold(parent),
                    token_ids=list(ev.token_ids),
                    block_size=ev.block_size,
                    lora_id=None if lora_name is None else (lora_ids or {}).get(lora_name),
                    medium=medium,
                    lora_name=lora_name,
                    extra_keys=None if per_block is None else [per_block] * len(hashes),
                    group_idx=group,
                    kv_cache_spec_kind=spec_kinds[group] if group < len(spec_kinds) else None,
                )
            )
        elif isinstance(ev, pagedkv.BlockRemoved):
            out.append(
                BlockRemoved(
                    block_hashes=[fold(h) for h in ev.block_hashes],
                    medium=medium,
                    group_idx=ev.group,
                )
            )
        else:
            out.append(AllBlocksCleared())
    return out
