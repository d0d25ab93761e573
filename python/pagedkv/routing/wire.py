"""vLLM's KV event batch wire format (msgpack), without importing vLLM.

vLLM V1 engines publish KV cache events over ZMQ (``--kv-events-config``): each message is the
frames ``[topic, seq (8-byte big-endian), payload]`` and ``payload`` is a msgpack array
``[ts: float, events: list, data_parallel_rank: int | None]`` (the last item may be absent).
Each event is an array whose first item names its type (msgspec tagged, array-like structs):

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]``
- ``["BlockRemoved", block_hashes, medium, ...]``
- ``["AllBlocksCleared"]``

Block hashes are ints or bytes. Newer engines append fields; decoding keeps the leading ones it
knows. :meth:`pagedkv.KVIndexer.apply` takes decoded events as they are, so a router watches
vLLM workers with ``apply_payload(indexer, worker, seq, payload)`` (register them with
``hash_source="tokens"`` so prompt queries match), and pagedkv replicas publish with
:func:`encode_event_batch` (their 32-byte hashes as bytes).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv._optional import optional_imports

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, KVIndexer

__all__ = [
    "EventBatch",
    "WireFormatError",
    "apply_payload",
    "decode_event_batch",
    "decode_zmq_frames",
    "encode_event_batch",
    "events_to_wire",
]


class WireFormatError(ValueError):
    """A payload or frame list that is not a KV event batch."""


@dataclass(frozen=True)
class EventBatch:
    """A decoded batch: ``ts`` (seconds since the epoch, as the publisher stamped it),
    ``events`` (wire events, lists), ``data_parallel_rank`` (None when absent)."""

    ts: float
    events: list[list[Any]]
    data_parallel_rank: int | None = None


def _msgpack() -> Any:
    with optional_imports("pagedkv.routing.wire (the KV event wire format)", "routing"):
        import msgspec.msgpack  # noqa: PLC0415
    return msgspec.msgpack


def events_to_wire(
    events: Iterable[BlockStored | BlockRemoved | AllBlocksCleared],
) -> list[list[Any]]:
    """pagedkv event objects as wire events (hashes as 32-byte bytes, ``lora_id`` and
    ``medium`` None). Raises TypeError for anything else."""
    from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: PLC0415

    out: list[list[Any]] = []
    for ev in events:
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
                ]
            )
        elif isinstance(ev, BlockRemoved):
            out.append(["BlockRemoved", ev.block_hashes, None])
        elif isinstance(ev, AllBlocksCleared):
            out.append(["AllBlocksCleared"])
        else:
            raise TypeError(f"not a pagedkv KV event: {ev!r}")
    return out


def encode_event_batch(
    events: Iterable[BlockStored | BlockRemoved | AllBlocksCleared],
    *,
    ts: float | None = None,
    data_parallel_rank: int | None = None,
) -> bytes:
    """One msgpack payload in vLLM's batch format for pagedkv events (``ts`` defaults to now)."""
    batch: list[Any] = [time.time() if ts is None else float(ts), events_to_wire(events)]
    if data_parallel_rank is not None:
        batch.append(int(data_parallel_rank))
    return bytes(_msgpack().encode(batch))


def decode_event_batch(payload: bytes) -> EventBatch:
    """Decodes one batch payload. Raises :class:`WireFormatError` for bytes that are not
    msgpack or not ``[ts, [events...], rank?]`` with each event ``[type name, ...]``."""
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
        if not isinstance(ev, list) or not ev or not isinstance(ev[0], str):
            raise WireFormatError(f"event {i} is not [type name, fields...]: {ev!r}"[:200])
    rank = obj[2] if len(obj) > 2 else None
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise WireFormatError(f"data_parallel_rank must be an int or None, got {rank!r}")
    return EventBatch(float(ts), events, rank)


def decode_zmq_frames(frames: Sequence[bytes]) -> tuple[int, EventBatch]:
    """``(seq, batch)`` from one ZMQ message ``[topic, seq (8 bytes, big-endian), payload]``
    (or ``[seq, payload]`` without a topic). Raises :class:`WireFormatError`."""
    if len(frames) not in (2, 3):
        raise WireFormatError(f"expected [topic,] seq, payload frames, got {len(frames)} frames")
    seq_b, payload = frames[-2], frames[-1]
    if len(seq_b) != 8:
        raise WireFormatError(f"sequence frame must be 8 bytes, got {len(seq_b)}")
    return int.from_bytes(seq_b, "big"), decode_event_batch(payload)


def apply_payload(indexer: KVIndexer, worker_id: int, seq: int, payload: bytes) -> str:
    """Decodes ``payload`` and applies it as batch ``seq`` of ``worker_id``; returns
    :meth:`KVIndexer.apply`'s outcome (``"applied"``, ``"buffered"``, ``"duplicate"``,
    ``"gap"``)."""
    return indexer.apply(worker_id, seq, decode_event_batch(payload).events)
