"""vLLM's KV event batch wire format (msgpack), without importing vLLM.

vLLM V1 engines publish KV cache events over ZMQ (``--kv-events-config``): each message is the
frames ``[topic, seq (8-byte big-endian), payload]`` and ``payload`` is a msgpack array
``[ts: float, events: list, data_parallel_rank: int | None]`` (the last item may be absent).
Each event is an array whose first item names its type (msgspec tagged, array-like structs, as
older vLLM releases and pagedkv replicas send them):

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, ...]``
- ``["BlockRemoved", block_hashes, medium, ...]``
- ``["AllBlocksCleared"]``

or a map tagged by ``"type"`` (vLLM 0.33's structs are not array-like):
``{"type": "BlockStored", "block_hashes": ..., "parent_block_hash": ..., ...}``, which decoding
turns into the array form above (a missing optional field is None).

Block hashes are ints or bytes. Newer engines append fields; decoding keeps the leading ones it
knows. ``extra_keys`` (vLLM 0.33) is one untagged tuple or None per block: the LoRA name, then
``(mm_identifier, offset)`` pairs, the cache salt (a request's first block only) and
prompt-embedding digests. A ``"tokens"`` worker's blocks are rehashed with the LoRA name as the
adapter key and the salt as the cache salt of the whole chain, so a router query with the same
``cache_salt`` / ``adapter_id`` matches them and one without does not; a block with multimodal
or prompt-embedding keys (and the rest of its event) is not indexed, since a query could not
hash it alike. A block whose vLLM hash also covers the tokens after it (``lookahead_token_ids``)
is left out for the same reason, with the rest of its event. Only the events of a worker's first
full-attention KV cache group (``group_idx``; None is group 0; the worker's group kinds are given
to ``add_worker(..., groups=...)``, default one full-attention group) are indexed: a hybrid model
publishes each block once per group, and a sliding-window group holds only the last window of a
prefix and lets earlier blocks go while the full-attention group keeps them.

:meth:`pagedkv.KVIndexer.apply` takes decoded events as they are, so a router watches vLLM
workers with ``apply_payload(indexer, worker, seq, payload)`` (register them with
``hash_source="tokens"`` so prompt queries match), and pagedkv replicas publish with
:func:`encode_event_batch` (their 32-byte hashes as bytes).

Cache identity: a pagedkv replica's batch has a fourth item, the 32-byte ``hash_root`` of its
``BlockStored`` events (the root of its hash chains, from its hash algorithm and seed, which for
``LLMEngine`` is its cache identity): ``[ts, events, data_parallel_rank, hash_root]``. vLLM's
decoder ignores the extra trailing item; :func:`apply_payload` hands it to
:meth:`pagedkv.KVIndexer.apply`, which refuses an engine worker's batch whose root is not its
own (its block hashes belong to another model, tokenizer, chat template, adapter, KV dtype or
RoPE, and could never match a query).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv._optional import optional_imports
from pagedkv.routing.errors import NotAKVEventError, WireFormatError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, KVIndexer

    # A pagedkv event (KVCacheManager.take_events); BlockStored / BlockRemoved name their group.
    _Event = BlockStored | BlockRemoved | AllBlocksCleared

__all__ = [
    "EventBatch",
    "WireFormatError",
    "apply_payload",
    "decode_event_batch",
    "decode_zmq_frames",
    "encode_event_batch",
    "events_to_wire",
]


@dataclass(frozen=True)
class EventBatch:
    """A decoded batch: ``ts`` (seconds since the epoch, as the publisher stamped it),
    ``events`` (wire events, lists), ``data_parallel_rank`` (None when absent), ``hash_root``
    (32 bytes, the publisher's cache identity root; None when absent, as from vLLM)."""

    ts: float
    events: list[list[Any]]
    data_parallel_rank: int | None = None
    hash_root: bytes | None = None


def _msgpack() -> Any:
    with optional_imports("pagedkv.routing.wire (the KV event wire format)", "routing"):
        import msgspec.msgpack  # noqa: PLC0415
    return msgspec.msgpack


def events_to_wire(
    events: Iterable[_Event],
) -> list[list[Any]]:
    """pagedkv event objects (``KVCacheManager.take_events``) as wire events (hashes as
    32-byte bytes, ``lora_id`` and ``medium`` None). A ``BlockStored`` / ``BlockRemoved``
    event's KV cache group (``event.group``) goes in its ``group_idx`` field (vLLM's field 9 of
    a ``BlockStored``, 3 of a ``BlockRemoved``), so an indexer counts only a full-attention
    group's blocks of an engine on a model with sliding-window layers. Raises
    :class:`~pagedkv.routing.errors.NotAKVEventError` (a ``TypeError``) for anything else."""
    from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: PLC0415

    out: list[list[Any]] = []
    for ev in _event_list(events):
        if isinstance(ev, BlockStored):
            out.append(
                [
                    "BlockStored",
                    ev.block_hashes,
                    ev.parent_block_hash,
                    ev.token_ids,
                    ev.block_size,
                    None,
                    None,
                    None,
                    None,
                    ev.group,
                ]
            )
        elif isinstance(ev, BlockRemoved):
            out.append(["BlockRemoved", ev.block_hashes, None, ev.group])
        elif isinstance(ev, AllBlocksCleared):
            out.append(["AllBlocksCleared"])
        else:
            raise NotAKVEventError(f"not a pagedkv KV event: {ev!r}"[:200])
    return out


def _event_list(events: Any) -> list[Any]:
    try:
        return list(events)
    except TypeError:
        raise NotAKVEventError(f"expected an iterable of pagedkv KV events, got {type(events).__name__}") from None


def encode_event_batch(
    events: Iterable[_Event],
    *,
    ts: float | None = None,
    data_parallel_rank: int | None = None,
) -> bytes:
    """One msgpack payload in vLLM's batch format for pagedkv events (as
    :func:`events_to_wire`; ``ts`` defaults to now), with the ``BlockStored``
    events' ``hash_root`` as the batch's fourth item (see the module docs; absent when no
    event names one).

    Raises:
        pagedkv.routing.errors.NotAKVEventError: an item that is not a pagedkv event (a
            ``TypeError``).
        pagedkv.InvalidArgumentError: ``BlockStored`` events with different hash roots (events
            of two managers in one batch), a ``ts`` that is not a number or a
            ``data_parallel_rank`` that is not an int.
    """
    from pagedkv import BlockStored, InvalidArgumentError  # noqa: PLC0415

    events = _event_list(events)
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        raise InvalidArgumentError(
            f"ts is invalid: {ts!r}; expected seconds since the epoch (a number) or None",
            arg="ts",
            value=repr(ts),
            reason="expected a number or None",
        )
    if data_parallel_rank is not None and (
        isinstance(data_parallel_rank, bool) or not isinstance(data_parallel_rank, int)
    ):
        raise InvalidArgumentError(
            f"data_parallel_rank is invalid: {data_parallel_rank!r}; expected an int or None",
            arg="data_parallel_rank",
            value=repr(data_parallel_rank),
            reason="expected an int or None",
        )
    roots = {ev.hash_root for ev in events if isinstance(ev, BlockStored) and ev.hash_root is not None}
    if len(roots) > 1:
        shown = sorted(r.hex()[:16] for r in roots)
        raise InvalidArgumentError(
            f"events is invalid: BlockStored events with {len(roots)} hash roots {shown}; one batch "
            f"holds the events of one manager",
            arg="events",
            value=f"hash roots {shown}",
            reason="one batch holds the events of one manager",
        )
    batch: list[Any] = [time.time() if ts is None else float(ts), events_to_wire(events)]
    if data_parallel_rank is not None or roots:
        batch.append(None if data_parallel_rank is None else int(data_parallel_rank))
    if roots:
        batch.append(roots.pop())
    return bytes(_msgpack().encode(batch))


def decode_event_batch(payload: bytes) -> EventBatch:
    """Decodes one batch payload (events in the array form, maps converted). Raises
    :class:`WireFormatError` for bytes that are not msgpack or not ``[ts, [events...], rank?,
    hash_root?]`` with each event ``[type name, ...]`` or a map with a known ``"type"`` and its
    required fields."""
    mp = _msgpack()
    try:
        obj = mp.decode(payload)
    except Exception as e:  # msgspec.DecodeError; the message names the byte offset
        raise WireFormatError(f"KV event payload is not msgpack: {e}") from e
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise WireFormatError(
            f"KV event payload must be [ts, [events...], rank?], got {type(obj).__name__}"
            + (f" of length {len(obj)}" if isinstance(obj, list) else "")
        )
    ts, events = obj[0], obj[1]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise WireFormatError(f"KV event batch timestamp must be a number, got {ts!r}")
    for i, ev in enumerate(events):
        if isinstance(ev, dict):
            events[i] = ev = _event_from_map(i, ev)
        if not isinstance(ev, list) or not ev or not isinstance(ev[0], str):
            raise WireFormatError(f"event {i} is not [type name, fields...] or a map with a type: {ev!r}"[:200])
    rank = obj[2] if len(obj) > 2 else None
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise WireFormatError(f"data_parallel_rank must be an int or None, got {rank!r}")
    root = obj[3] if len(obj) > 3 else None
    if root is not None and not (isinstance(root, bytes) and len(root) == 32):
        raise WireFormatError(f"hash_root must be 32 bytes or None, got {root!r}"[:200])
    return EventBatch(float(ts), events, rank, root)


# Field order of the array form, per event type, and the fields a map must carry.
_MAP_FIELDS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "BlockStored": (
        (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
            "locality",
            "ownership",
            "session_id",
            "lookahead_token_ids",
        ),
        frozenset({"block_hashes", "token_ids", "block_size"}),
    ),
    "BlockRemoved": (("block_hashes", "medium", "group_idx", "locality", "ownership"), frozenset({"block_hashes"})),
    "AllBlocksCleared": ((), frozenset()),
}


def _event_from_map(i: int, ev: dict[Any, Any]) -> list[Any]:
    """The array form of event ``i`` sent as a map tagged by ``"type"`` (vLLM 0.33)."""
    kind = ev.get("type")
    if kind not in _MAP_FIELDS:
        raise WireFormatError(
            f"event {i} has type {kind!r}: expected BlockStored, BlockRemoved or AllBlocksCleared"[:200]
        )
    fields, required = _MAP_FIELDS[kind]
    missing = sorted(required - ev.keys())
    if missing:
        raise WireFormatError(f"event {i} ({kind}) lacks {missing}")
    return [kind, *(ev.get(f) for f in fields)]


def decode_zmq_frames(frames: Sequence[bytes]) -> tuple[int, EventBatch]:
    """``(seq, batch)`` from one ZMQ message ``[topic, seq (8 bytes, big-endian), payload]``
    (or ``[seq, payload]`` without a topic). Raises :class:`WireFormatError`."""
    if not isinstance(frames, (list, tuple)):
        raise WireFormatError(f"expected a list of ZMQ frames, got {type(frames).__name__}")
    if len(frames) not in (2, 3):
        raise WireFormatError(f"expected [topic,] seq, payload frames, got {len(frames)} frames")
    seq_b, payload = frames[-2], frames[-1]
    try:
        seq_b = bytes(memoryview(seq_b))  # bytes, or a zmq.Frame (buffer protocol)
    except TypeError:
        raise WireFormatError(f"sequence frame must be bytes, got {type(seq_b).__name__}") from None
    if len(seq_b) != 8:
        raise WireFormatError(f"sequence frame must be 8 bytes, got {len(seq_b)}")
    return int.from_bytes(seq_b, "big"), decode_event_batch(payload)


def apply_payload(
    indexer: KVIndexer, worker_id: int, seq: int, payload: bytes, *, incarnation: int | None = None
) -> str:
    """Decodes ``payload`` and applies it as batch ``seq`` of ``worker_id``'s registration
    ``incarnation`` (None: the current one); returns :meth:`KVIndexer.apply`'s outcome
    (``"applied"``, ``"buffered"``, ``"duplicate"``, ``"gap"``, ``"stale"``). Raises
    :class:`WireFormatError` for a malformed payload and ``pagedkv.InvalidArgumentError`` for a
    batch the indexer refuses (a hash root other than its own: another cache identity)."""
    batch = decode_event_batch(payload)
    return indexer.apply(worker_id, seq, batch.events, hash_root=batch.hash_root, incarnation=incarnation)
