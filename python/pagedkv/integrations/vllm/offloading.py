"""pagedkv's host tier behind vLLM's ``OffloadingConnector`` (issue 26, item 4).

vLLM's offloading connector keeps a second tier of the prefix cache in host memory. Its
scheduler side asks an ``OffloadingManager`` which blocks are offloaded (``lookup``), pins
blocks for loads (``prepare_load`` / ``complete_load``) and allocates host blocks for stores
(``prepare_store`` / ``complete_store``); its worker side copies the KV between the GPU and
the host buffer. An ``OffloadingSpec`` builds both. :class:`PagedKVCPUOffloadingSpec` is vLLM's
CPU spec (host buffer, GPU <-> CPU transfer workers, sizing from ``cpu_bytes_to_use``) whose
scheduler-side manager is :class:`PagedKVOffloadingManager`, a :class:`pagedkv.HostBlockPool`
(the core's host tier: admission, eviction, pins) behind vLLM's interface. Stock vLLM uses it
with one config entry::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "PagedKVCPUOffloadingSpec",
            "spec_module_path": "pagedkv.integrations.vllm.offloading",
            "cpu_bytes_to_use": 8000000000}}'

Extra config read besides vLLM's CPU spec's own: ``host_admission_min_seen`` (offers a block
needs before it is stored; default vLLM's ``store_threshold`` when it is at least 2, else 1:
store every offered block) and ``eviction_policy`` (the core tier's policy name, default
``"lru"``; a name the core does not know raises ``InvalidConfigError``).

Eviction order, as vLLM's LRU manager once a request has finished: the keys a request loaded
or offered are used again when it finishes, tail first, so a full tier evicts a chain's tail
before its head. While a request runs, its stores enter the order when they complete (vLLM
0.33 ranks them by the request's start). Needs vLLM 0.32 or 0.33 (the releases whose
offloading interface this was written and tested against); importing it under a vLLM without
that interface raises :class:`UnsupportedVllmVersionError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

from pagedkv._core import HostBlockPool
from pagedkv.errors import InvalidConfigError
from pagedkv.integrations.vllm.errors import UnsupportedVllmVersionError
from pagedkv.integrations.vllm.versions import SUPPORTED_VLLM_RELEASES, check_supported_version

try:
    from vllm.v1.kv_offload.base import (
        LoadStoreSpec,
        LookupResult,
        Medium,
        OffloadingEvent,
        OffloadingManager,
        OffloadKey,
        PrepareStoreOutput,
        ReqContext,
        RequestOffloadingContext,
    )
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError as exc:  # pragma: no cover - depends on the installed vLLM
    import vllm

    _version = str(getattr(vllm, "__version__", "unknown"))
    _reason = f"this vLLM has no offloading interface pagedkv implements ({exc})"
    raise UnsupportedVllmVersionError(
        f"vLLM {_version}: {_reason}; pagedkv's offloading spec supports vLLM {', '.join(SUPPORTED_VLLM_RELEASES)}",
        field="vllm.__version__",
        value=_version,
        reason=_reason,
        supported=SUPPORTED_VLLM_RELEASES,
    ) from exc

__all__ = ["PagedKVCPUOffloadingSpec", "PagedKVOffloadingManager"]

_LOOKUP = (LookupResult.MISS, LookupResult.HIT_PENDING, LookupResult.HIT)
# vLLM 0.33 marks a failed store's removal as bookkeeping only (no public eviction).
_HAS_METADATA_ONLY = "metadata_only" in {f.name for f in dataclasses.fields(OffloadingEvent)}


def _chain_order(keys: Iterable[OffloadKey], req_context: ReqContext) -> list[OffloadKey]:
    """``keys`` head to tail by the end-token positions the connector recorded on the request
    (it passes some key collections as sets), else as given."""
    keys = list(keys)
    position = req_context.get_offload_key_position
    ends = [position(k) for k in keys]
    if len(keys) < 2 or any(e is None for e in ends):
        return keys
    return [k for _, k in sorted(zip(ends, keys))]


@dataclasses.dataclass
class _RequestKeys:
    """The keys one request loaded or offered for store, head to tail (an ordered set)."""

    owner: object
    generation: int
    keys: dict[OffloadKey, None] = dataclasses.field(default_factory=dict)
    finished: bool = False


class PagedKVOffloadingManager(OffloadingManager):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's scheduler-side ``OffloadingManager`` over a :class:`pagedkv.HostBlockPool`.

    ``num_blocks``: host blocks (vLLM's CPU spec's ``num_chunks``: one per offloaded chunk of
    ``blocks_per_chunk`` GPU blocks); ``admission_min_seen``, ``eviction``: as
    ``HostBlockPool``; ``enable_events``: collect vLLM ``OffloadingEvent`` s (medium CPU) for
    ``take_events``; ``config_info``: the labels of vLLM's ``kv_offload_config_info`` metric.

    Lookups answer ``HIT`` (stored), ``HIT_PENDING`` (a store in flight) or ``MISS``; loads pin
    their blocks until ``complete_load``; ``prepare_store`` returns ``None`` when the admitted
    blocks do not fit (every other block storing or pinned), as vLLM's CPU manager does. A
    call vLLM's contract forbids (loading a block that is not stored, completing a load or
    store that is not in flight) raises ``pagedkv.InvalidArgumentError`` (a ``ValueError``)
    with nothing changed. Single-threaded (vLLM's default no-op ``lock``).
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        admission_min_seen: int = 1,
        eviction: str = "lru",
        enable_events: bool = False,
        config_info: dict[str, Any] | None = None,
    ) -> None:
        self.medium = Medium.CPU
        self._pool = HostBlockPool(num_blocks, admission_min_seen=admission_min_seen, eviction=eviction)
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._generation = 0
        self._config_info = dict(config_info or {})

    @property
    def pool(self) -> HostBlockPool:
        """The host block pool (counters, invariants)."""
        return self._pool

    def _record(self, req_context: ReqContext, keys: Iterable[OffloadKey]) -> None:
        state = req_context.get_state(_RequestKeys)
        if state is None or state.owner is not self or state.generation != self._generation:
            state = _RequestKeys(self, self._generation)
            req_context.set_state(state)
        for key in keys:
            state.keys[key] = None

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Starts the request's key record; blocks are offloaded chunk by chunk."""
        self._record(req_context, ())
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """``HIT`` when ``key`` is stored, ``HIT_PENDING`` while its store is in flight, else
        ``MISS``. No side effects."""
        return _LOOKUP[self._pool.state(key)]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """Every hit comes from host memory."""
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pins the stored blocks of ``keys`` and returns their host blocks (a
        ``CPULoadStoreSpec``, one id per key, in order)."""
        keys = list(keys)
        ids = self._pool.prepare_load(keys)
        self._record(req_context, keys)
        return CPULoadStoreSpec(ids)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Marks the stored, unpinned blocks of ``keys`` used (tail first)."""
        self._pool.touch(_chain_order(keys, req_context))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Releases one load pin per key."""
        self._pool.complete_load(_chain_order(keys, req_context))

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Allocates host blocks for the admitted keys of ``keys`` not on host yet (evicting
        unpinned stored blocks when full); ``None`` when they do not fit."""
        keys = list(keys)
        out = self._pool.prepare_store(keys)
        if out is None:
            return None
        to_store, ids, evicted = out
        self._record(req_context, keys)
        if evicted and self._events is not None:
            self._events.append(OffloadingEvent(keys=evicted, medium=self.medium, removed=True))
        return PrepareStoreOutput(keys_to_store=to_store, store_spec=CPULoadStoreSpec(ids), evicted_keys=evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """Makes the stored ``keys`` readable (``success``) or drops them and frees their
        blocks."""
        keys = _chain_order(keys, req_context)
        self._pool.complete_store(keys, success)
        if self._events is None or not keys:
            return
        if success:
            self._events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=False))
        elif _HAS_METADATA_ONLY:
            self._events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=True, metadata_only=True))

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Uses the request's loaded and offered blocks again, tail first (the recency vLLM's
        LRU manager commits when a request finishes)."""
        state = req_context.get_state(_RequestKeys)
        if state is None or state.owner is not self or state.generation != self._generation or state.finished:
            return
        state.finished = True
        self._pool.touch(_chain_order(state.keys, req_context))

    def take_events(self) -> Iterator[OffloadingEvent]:
        """The events collected since the last call (none unless ``enable_events``)."""
        if self._events is None:
            return
        events, self._events = self._events, []
        yield from events

    def reset_cache(self) -> None:
        """Drops every block; the completions of jobs in flight are not reported afterwards
        (vLLM's connector discards them)."""
        self._pool.reset()
        self._generation += 1

    def config_info(self) -> Sequence[dict[str, Any]]:
        """The labels of vLLM's offloading info metric."""
        return [self._config_info]


class PagedKVCPUOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's CPU offloading spec with :class:`PagedKVOffloadingManager` as its scheduler-side
    manager. The host buffer, its sizing (``cpu_bytes_to_use``) and the GPU <-> CPU transfer
    workers are vLLM's; the spec adds ``host_admission_min_seen`` and passes
    ``eviction_policy`` to the core tier (see the module docs). Raises
    :class:`UnsupportedVllmVersionError` under a vLLM release other than 0.32 / 0.33 and
    ``pagedkv.InvalidConfigError`` (a ``ValueError``) naming the extra-config key when
    ``cpu_bytes_to_use`` holds no chunk, ``host_admission_min_seen`` / ``store_threshold`` is
    not an int (or the former below 1) or ``eviction_policy`` is not a core policy's name.
    """

    _manager: OffloadingManager | None

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """None: the manager reports no Prometheus metrics of its own."""
        return {}

    def __init__(self, config: OffloadingConfig) -> None:
        check_supported_version()
        super().__init__(config)

    def get_manager(self) -> OffloadingManager:
        """The scheduler-side manager (built once)."""
        if self._manager is None:
            if self.num_chunks < 1:
                raise InvalidConfigError(
                    f"cpu_bytes_to_use = {self.extra_config.get('cpu_bytes_to_use')!r} holds no offloading "
                    f"chunk of {self.kv_bytes_per_chunk} bytes: the host tier needs at least one",
                    field="cpu_bytes_to_use",
                    value=str(self.extra_config.get("cpu_bytes_to_use")),
                    reason="smaller than one chunk",
                )
            extra = self.extra_config
            threshold = _int_option(extra, "store_threshold", 0)
            min_seen = _int_option(extra, "host_admission_min_seen", threshold if threshold >= 2 else 1)
            info = getattr(self, "cpu_info", None)
            try:
                manager = PagedKVOffloadingManager(
                    self.num_chunks,
                    admission_min_seen=min_seen,
                    eviction=str(self.eviction_policy),
                    enable_events=self.kv_events_config.enable_kv_cache_events,
                    config_info=dict(info.as_config_info()) if info is not None else None,
                )
            except InvalidConfigError as e:
                # Name the extra-config key the user wrote, not the core tier's field.
                key = {"host_eviction": "eviction_policy"}.get(e.field, e.field)
                raise InvalidConfigError(
                    f"kv_connector_extra_config {key} = {e.value}: {e.reason}",
                    field=key,
                    value=e.value,
                    reason=e.reason,
                ) from e
            self._manager = manager
        return self._manager


def _int_option(extra: dict[str, Any], key: str, default: int) -> int:
    """``extra[key]`` as an int (an int, or a str of one: JSON or CLI config), else
    ``default``; anything else (a bool, a float, other text) raises ``InvalidConfigError``
    naming ``key``."""
    value = extra.get(key, default)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        return value
    raise InvalidConfigError(
        f"kv_connector_extra_config {key} = {value!r}: expected an int",
        field=key,
        value=repr(value),
        reason="expected an int",
    )
