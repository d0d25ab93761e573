"""One engine replica: a :class:`pagedkv.engine.LLMEngine` that publishes its KV events and load.

Plain Python; :class:`pagedkv.cluster.cluster.ReplicaCluster` runs it as a Ray actor. The router
drives it: each :meth:`EngineReplica.run` call adds the requests routed to it, runs up to
``max_steps`` engine steps, and returns what finished, the KV events of those steps as one
batch numbered ``seq = 0, 1, 2, ...`` (only non-empty batches take a number), and the load.
The replica mirrors its own resolvable hash set from the events it publishes (set semantics), so
it can answer a snapshot request after the router reports a gap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.block_identity import HashScheme, SequenceSpec
from pagedkv.routing.policy import WorkerLoad

__all__ = ["EngineReplica", "ReplicaStep"]


@dataclass(frozen=True)
class ReplicaStep:
    """What one :meth:`EngineReplica.run` call returns.

    Attributes:
        outputs: finished ``RequestOutput``\\ s.
        failed: ``(request_id, message)`` of requests the engine refused (bad or too large).
        events: ``(seq, payload)``: the KV events as one msgpack batch, or None when none.
        load: running requests (added, not finished) and KV blocks in use.
    """

    outputs: list[Any]
    failed: list[tuple[str, str]]
    events: tuple[int, bytes] | None
    load: WorkerLoad


class EngineReplica:
    """An LLMEngine with KV events on, for a router.

    Args:
        replica_id: the worker id the router knows it by.
        model: as for :class:`pagedkv.engine.LLMEngine` (a path, or None for the default).
        engine_kwargs: other ``LLMEngine`` keyword arguments (``num_kv_blocks``, ``block_size``,
            ``hash_algo``, ``device``, ``dtype``, ...).
        torch_threads: torch CPU threads in this process (None: leave torch's default).
    """

    def __init__(
        self,
        replica_id: int,
        model: Any = None,
        engine_kwargs: dict[str, Any] | None = None,
        torch_threads: int | None = 1,
    ) -> None:
        import torch  # noqa: PLC0415

        from pagedkv.engine import LLMEngine  # noqa: PLC0415
        from pagedkv.engine.errors import EngineError  # noqa: PLC0415

        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self.replica_id = replica_id
        # An engine refusing its settings (model path, device, block size) is re-raised by
        # `info`, the first call the cluster makes: an error raised here reaches the driver as
        # Ray's ActorDiedError, which keeps the engine's error only as remote traceback text.
        self._startup_error: EngineError | None = None
        try:
            self.engine = LLMEngine(model, enable_kv_events=True, **(engine_kwargs or {}))
        except EngineError as e:
            self._startup_error = e
            return
        self._seq = 0
        # The KV cache groups' attention kinds (a model with sliding-window layers has several;
        # each event names its group): the router registers them, and only the first
        # full-attention group's blocks serve a prefix.
        self._group_kinds: list[str] = [str(g.kind) for g in self.engine.manager.groups]
        self._prefix_group = self._group_kinds.index("full") if "full" in self._group_kinds else None
        self._held: set[bytes] = set()  # resolvable hashes, mirrored from the published events
        self._hash_root: bytes | None = None  # the root the published BlockStored events carry
        self._inflight: set[str] = set()
        # A chat template is applied only when the tokenizer has one (as the engine CLI does).
        self._has_chat_template = getattr(self.engine.tokenizer, "chat_template", None) is not None

    def info(self) -> dict[str, Any]:
        """``replica_id``, ``hash_scheme`` (the engine's :class:`pagedkv.HashScheme`: block
        size, hash algorithm, and its cache identity digest as the seed), ``cache_identity``
        (that digest, hex), ``num_kv_blocks`` (the pool, null block included), ``kv_groups``
        (the attention kinds of its KV cache groups in its manager's order, ``"full"`` /
        ``"sliding_window"``: the ``groups`` of ``Router.add_worker``), ``pid``. Raises the
        engine's ``EngineError`` when it refused its settings."""
        import os  # noqa: PLC0415

        if self._startup_error is not None:
            raise self._startup_error
        manager = self.engine.manager
        # The scheme comes from the engine, whose cache identity seeds its manager's hashes
        # (whatever its layout).
        scheme = HashScheme(
            self.engine.config.block_size, self.engine.config.hash_algo, self.engine.cache_identity.seed
        )
        return {
            "replica_id": self.replica_id,
            "hash_scheme": scheme,
            "cache_identity": self.engine.cache_identity.digest,
            "num_kv_blocks": int(manager.stats().num_blocks),
            "kv_groups": list(self._group_kinds),
            "pid": os.getpid(),
        }

    def prompt_specs(self, requests: list[tuple[Any, bool, str | None]]) -> list[tuple[list[int], SequenceSpec] | None]:
        """For each ``(prompt, chat_template, cache_salt)``: the token ids and
        :class:`pagedkv.SequenceSpec` the engine will register for it
        (:meth:`pagedkv.engine.LLMEngine.prompt_spec`), which the router hashes; ``None`` for
        a prompt the engine refuses (:meth:`run` then reports the engine's error)."""
        from pagedkv.engine import EngineError  # noqa: PLC0415

        out: list[tuple[list[int], SequenceSpec] | None] = []
        for prompt, chat, salt in requests:
            try:
                out.append(self.engine.prompt_spec(prompt, cache_salt=salt, chat_template=self._chat(chat)))
            except EngineError:
                out.append(None)
        return out

    def _chat(self, chat_template: bool) -> bool:
        """A chat template is applied only when the tokenizer has one (as the engine CLI does)."""
        return chat_template and self._has_chat_template

    def _mirror(self, events: list[Any]) -> None:
        import pagedkv  # noqa: PLC0415

        for ev in events:
            if isinstance(ev, pagedkv.AllBlocksCleared):
                self._held.clear()
            elif ev.group != self._prefix_group:
                continue  # a sliding-window group's blocks serve no prefix (not in a snapshot)
            elif isinstance(ev, pagedkv.BlockStored):
                self._held.update(ev.block_hashes)
                self._hash_root = ev.hash_root
            elif isinstance(ev, pagedkv.BlockRemoved):
                self._held.difference_update(ev.block_hashes)

    def load(self) -> WorkerLoad:
        """Requests added and not finished; KV blocks in use / usable."""
        st = self.engine.manager.stats()
        return WorkerLoad(
            num_running=len(self._inflight), kv_blocks_used=int(st.used), kv_blocks_total=int(st.num_blocks) - 1
        )

    def run(self, requests: list[tuple[str, Any, Any, bool, str | None]], max_steps: int = 1) -> ReplicaStep:
        """Adds ``requests`` (``(request_id, prompt, SamplingParams, chat_template, cache_salt)``), runs up to
        ``max_steps`` engine steps, and returns a :class:`ReplicaStep`."""
        from pagedkv.engine import EngineError  # noqa: PLC0415
        from pagedkv.routing.wire import encode_event_batch  # noqa: PLC0415

        failed: list[tuple[str, str]] = []
        for rid, prompt, params, chat, salt in requests:
            try:
                self.engine.add_request(prompt, params, request_id=rid, cache_salt=salt, chat_template=self._chat(chat))
            except EngineError as e:
                failed.append((rid, f"{type(e).__name__}: {e}"))
            else:
                self._inflight.add(rid)
        outputs: list[Any] = []
        for _ in range(max_steps):
            if not self.engine.has_unfinished():
                break
            outputs.extend(self.engine.step())
        for out in outputs:
            self._inflight.discard(out.request_id)
        events = self.engine.manager.take_events()
        batch = None
        if events:
            self._mirror(events)
            batch = (self._seq, encode_event_batch(events))
            self._seq += 1
        return ReplicaStep(outputs, failed, batch, self.load())

    def snapshot(self) -> tuple[int, list[bytes], bytes | None]:
        """``(seq, hashes, hash_root)``: every resolvable hash, as of a new batch number, and
        the root of their hash chains (None before the first stored block): the arguments of a
        router's ``KVIndexer.apply_snapshot`` after a gap. Drains pending events first."""
        events = self.engine.manager.take_events()
        self._mirror(events)
        seq = self._seq
        self._seq += 1
        return seq, sorted(self._held), self._hash_root

    def pid(self) -> int:
        """The process id (tests kill replicas by it)."""
        import os  # noqa: PLC0415

        return os.getpid()
