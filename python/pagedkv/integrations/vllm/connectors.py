"""Which vLLM KV connectors ``PagedKVScheduler`` serves, decided from ``kv_transfer_config``.

A connector's scheduler side talks to the KV cache manager through the scheduler's calls
(``get_num_new_matched_tokens``, ``update_state_after_alloc`` with the request's blocks,
``request_finished``), which :class:`~pagedkv.integrations.vllm.PagedKVCacheManager` answers.
Some connectors go further and keep vLLM's GPU block pool or coordinator to take references on
blocks, touch or free them, or walk the prefix-cache index; pagedkv's pool lives in Rust and
the plug-in hands connectors only a read-only view of it, so those are refused, each by name
with the reason (:data:`REFUSED_CONNECTORS`). The rule for any other connector (a registered
one or a ``kv_connector_module_path`` class): refused if it overrides
``bind_gpu_block_pool`` or ``bind_kv_cache_manager`` (the hooks through which a connector
keeps the pool), accepted otherwise. ``MultiConnector`` is accepted when each of its
connectors is.

Accepted today: NIXL (``NixlConnector``, pull and push, both roles), Mooncake P/D
(``MooncakeConnector``), ``OffloadingConnector`` (vLLM's CPU spec, pagedkv's
``PagedKVCPUOffloadingSpec``), LMCache's native in-process adapter
(``LMCacheConnectorV1`` with ``use_native``), ``LMCacheMPConnector``, and ``MultiConnector`` of
these. An ``OffloadingConnector`` that leaves a prefix-cacheable group un-offloaded reads
vLLM's coordinator to bound its loads; that configuration is refused once the connector is built
(:func:`check_built_connector`). Beside align-mode Mamba groups only the P/D connectors
(NIXL, Mooncake, ``MultiConnector`` of them) are served
(:func:`check_kv_transfer_config_with_state_groups`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from pagedkv.integrations.vllm.errors import UnsupportedVllmConfigError

__all__ = [
    "REFUSED_CONNECTORS",
    "STATE_GROUP_CONNECTORS",
    "check_built_connector",
    "check_kv_transfer_config",
    "check_kv_transfer_config_with_state_groups",
    "connector_leaves",
]

#: Connector class name -> why ``PagedKVScheduler`` refuses it.
REFUSED_CONNECTORS: dict[str, str] = {
    "SimpleCPUOffloadConnector": (
        "keeps vLLM's GPU block pool and touches, references and reads its blocks "
        "(its CPU tier is a second coordinator over that pool)"
    ),
    "MooncakeStoreConnector": "takes references on vLLM's GPU blocks while it saves them (vLLM's block pool)",
    "HiSparseConnector": "reads vLLM's KV cache coordinator internals and defers block frees in vLLM's pool",
    "UMBPStoreConnector": "reads cached blocks from vLLM's per-group block pools and touches / frees them",
}

_LMCACHE_REASON = (
    "LMCache's external adapter (use_native unset) is handed the connector and may offload "
    "lazily from vLLM's block pool; only the native in-process adapter (use_native=True) is served"
)
_BIND_REASON = (
    "overrides bind_gpu_block_pool / bind_kv_cache_manager, so it keeps vLLM's block pool or "
    "manager; PagedKVScheduler gives connectors a read-only view only"
)


def _refuse(field: str, value: str, reason: str) -> UnsupportedVllmConfigError:
    return UnsupportedVllmConfigError(
        f"PagedKVScheduler does not support {field}={value}: {reason}",
        field=field,
        value=value,
        reason=reason,
    )


def _connector_class(name: str, module_path: str | None) -> type:
    """The connector class vLLM's factory would build for ``name`` (and ``module_path``)."""
    if module_path:
        return getattr(importlib.import_module(module_path), name)  # type: ignore[no-any-return]
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.get_connector_class_by_name(name)  # type: ignore[no-any-return]


def _overrides_bind_hooks(cls: type) -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return any(
        getattr(cls, hook, None) is not getattr(KVConnectorBase_V1, hook)
        for hook in ("bind_gpu_block_pool", "bind_kv_cache_manager")
    )


def _check_one(field: str, name: str | None, module_path: str | None, extra: dict[str, Any]) -> None:
    if not name:
        raise _refuse(field, "None", "no connector named (kv_connector)")
    if name in REFUSED_CONNECTORS:
        raise _refuse(field, name, REFUSED_CONNECTORS[name])
    try:
        cls = _connector_class(name, module_path)
    except (ImportError, AttributeError, ValueError) as e:
        raise _refuse(field, name, f"the connector class cannot be resolved ({e})") from e
    if cls.__name__ in REFUSED_CONNECTORS:
        raise _refuse(field, name, REFUSED_CONNECTORS[cls.__name__])
    if cls.__name__ == "MultiConnector":
        subs = extra.get("connectors")
        if not subs:
            raise _refuse(f"{field}.connectors", "[]", "MultiConnector needs connectors")
        if not isinstance(subs, (list, tuple)):
            raise _refuse(f"{field}.connectors", repr(subs), "MultiConnector needs a list of connector configs")
        for i, sub in enumerate(subs):
            if not isinstance(sub, Mapping):
                raise _refuse(
                    f"{field}.connectors[{i}]", repr(sub), "a MultiConnector member is a dict (kv_connector, ...)"
                )
            _check_one(
                f"{field}.connectors[{i}]",
                sub.get("kv_connector"),
                sub.get("kv_connector_module_path"),
                dict(sub.get("kv_connector_extra_config") or {}),
            )
        return
    if cls.__name__ == "LMCacheConnectorV1" and not extra.get("use_native", False):
        raise _refuse(field, name, _LMCACHE_REASON)
    if _overrides_bind_hooks(cls):
        raise _refuse(field, name, _BIND_REASON)


def check_kv_transfer_config(kv_transfer_config: Any) -> None:
    """Raise :class:`UnsupportedVllmConfigError` for a connector ``PagedKVScheduler`` does not
    serve (see the module docs); ``None`` (no connector) passes.

    The error's ``field`` is ``kv_transfer_config.kv_connector`` (with ``.connectors[i]`` for a
    ``MultiConnector`` member), ``value`` the connector's name, ``reason`` why. Nothing is
    built; the class is only resolved (imported) as vLLM's factory resolves it.
    """
    if kv_transfer_config is None:
        return
    _check_one(
        "kv_transfer_config.kv_connector",
        kv_transfer_config.kv_connector,
        kv_transfer_config.kv_connector_module_path,
        dict(kv_transfer_config.kv_connector_extra_config or {}),
    )


#: Connectors served beside align-mode Mamba groups (state groups): P/D connectors whose
#: loads write a request's own blocks, the live state column among them.
#: Matched against the connector class and its bases (NIXL's pull and push connectors share
#: ``NixlBaseConnector``).
STATE_GROUP_CONNECTORS = frozenset({"NixlConnector", "NixlBaseConnector", "MooncakeConnector"})

_STATE_GROUP_REASON = (
    "beside Mamba layers only the P/D connectors (NixlConnector, MooncakeConnector, and a "
    "MultiConnector of them) are served: an offloading or store connector keeps and loads "
    "Mamba states through blocks vLLM caches at allocation, which pagedkv publishes only at "
    "the step's commit (so it would store no state and could load attention KV without one)"
)


def check_kv_transfer_config_with_state_groups(kv_transfer_config: Any) -> None:
    """Raise :class:`UnsupportedVllmConfigError` for a connector ``PagedKVScheduler`` does not
    serve beside align-mode Mamba groups: any connector other than those of
    :data:`STATE_GROUP_CONNECTORS` (a ``MultiConnector`` is checked member by member). The
    error's ``field`` is ``kv_transfer_config.kv_connector`` (``.connectors[i]`` for a member),
    ``value`` the connector's name. ``None`` passes. Call it after
    :func:`check_kv_transfer_config` (which refuses what is refused without Mamba layers)."""
    if kv_transfer_config is None:
        return
    _check_state_leaf(
        "kv_transfer_config.kv_connector",
        kv_transfer_config.kv_connector,
        kv_transfer_config.kv_connector_module_path,
        dict(kv_transfer_config.kv_connector_extra_config or {}),
    )


def _check_state_leaf(field: str, name: str | None, module_path: str | None, extra: dict[str, Any]) -> None:
    try:
        cls = _connector_class(str(name), module_path)
    except (ImportError, AttributeError, ValueError) as e:
        raise _refuse(field, str(name), f"the connector class cannot be resolved ({e})") from e
    if cls.__name__ == "MultiConnector":
        for i, sub in enumerate(extra.get("connectors") or ()):
            _check_state_leaf(
                f"{field}.connectors[{i}]",
                sub.get("kv_connector"),
                sub.get("kv_connector_module_path"),
                dict(sub.get("kv_connector_extra_config") or {}),
            )
        return
    if not any(c.__name__ in STATE_GROUP_CONNECTORS for c in cls.__mro__):
        raise _refuse(field, str(name), _STATE_GROUP_REASON)


def connector_leaves(connector: Any) -> list[Any]:
    """The connectors inside ``connector`` (a ``MultiConnector``'s members, recursively), or
    ``[connector]``; ``[]`` for ``None``."""
    if connector is None:
        return []
    members = getattr(connector, "_connectors", None)
    if members is None:
        return [connector]
    return [leaf for m in members for leaf in connector_leaves(m)]


def check_built_connector(connector: Any) -> None:
    """Raise :class:`UnsupportedVllmConfigError` for a built scheduler-side connector that reads
    vLLM's coordinator: an ``OffloadingConnector`` whose prefix-cacheable groups are not all
    offloaded (it bounds its loads by vLLM's per-group hits)."""
    for leaf in connector_leaves(connector):
        bounding = getattr(leaf, "_bounding_group_ids", ())
        if bounding:
            raise _refuse(
                "kv_transfer_config.kv_connector",
                type(leaf).__name__,
                f"KV cache groups {list(bounding)} are prefix-cacheable and not offloaded, so the "
                "connector bounds its loads by vLLM's own coordinator's per-group hits",
            )
