"""Which KV connectors ``PagedKVScheduler`` accepts (``kv_transfer_config``), the reasons it
refuses the others, the read-only block-pool view connectors get, and bad transfer reports.

Runs only where vLLM is installed (``make test-vllm`` builds that environment).
"""

from __future__ import annotations

import logging
import sys
import textwrap
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from pagedkv.errors import InvalidArgumentError, InvalidBlockError  # noqa: E402
from pagedkv.integrations.vllm import PagedKVScheduler, UnsupportedVllmConfigError  # noqa: E402
from pagedkv.integrations.vllm.connectors import (  # noqa: E402
    REFUSED_CONNECTORS,
    check_built_connector,
    check_kv_transfer_config,
    connector_leaves,
)
from pagedkv.integrations.vllm.pool_view import ReadOnlyPoolError  # noqa: E402
from pagedkv.testing.vllm_scheduler import build_scheduler, make_request, make_vllm_config  # noqa: E402

OFFLOAD_CPU = {"cpu_bytes_to_use": 1 << 26}
OFFLOAD_PAGEDKV = {
    "cpu_bytes_to_use": 1 << 26,
    "spec_name": "PagedKVCPUOffloadingSpec",
    "spec_module_path": "pagedkv.integrations.vllm.offloading",
}


def _cfg(name: str, role: str = "kv_both", extra: dict[str, Any] | None = None, **kw: Any) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=name, kv_role=role, kv_connector_extra_config=extra or {}, **kw)


def _multi(*members: dict[str, Any]) -> KVTransferConfig:
    return _cfg("MultiConnector", "kv_both", {"connectors": list(members)})


ACCEPTED = {
    "nixl-consumer": lambda: _cfg("NixlConnector", "kv_consumer"),
    "nixl-producer": lambda: _cfg("NixlConnector", "kv_producer"),
    "nixl-both": lambda: _cfg("NixlConnector", "kv_both"),
    "offloading-cpu-spec": lambda: _cfg("OffloadingConnector", extra=OFFLOAD_CPU),
    "offloading-pagedkv-spec": lambda: _cfg("OffloadingConnector", extra=OFFLOAD_PAGEDKV),
    "mooncake-pd": lambda: _cfg("MooncakeConnector", "kv_consumer"),
    "lmcache-native": lambda: _cfg("LMCacheConnectorV1", extra={"use_native": True}),
    "multi-nixl-offloading": lambda: _multi(
        {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": OFFLOAD_PAGEDKV},
    ),
}


@pytest.mark.parametrize("kind", sorted(ACCEPTED))
def test_accepted_connectors_pass_the_check(kind: str) -> None:
    check_kv_transfer_config(ACCEPTED[kind]())


def test_no_connector_passes() -> None:
    check_kv_transfer_config(None)


@pytest.mark.parametrize("name", sorted(REFUSED_CONNECTORS))
def test_each_refused_connector_is_named_with_its_reason(name: str) -> None:
    with pytest.raises(UnsupportedVllmConfigError) as info:
        check_kv_transfer_config(_cfg(name))
    err = info.value
    assert err.field == "kv_transfer_config.kv_connector"
    assert err.value == name
    assert err.reason == REFUSED_CONNECTORS[name]
    assert name in str(err) and "vLLM's" in err.reason


def test_lmcache_without_the_native_adapter_is_refused() -> None:
    with pytest.raises(UnsupportedVllmConfigError) as info:
        check_kv_transfer_config(_cfg("LMCacheConnectorV1"))
    assert info.value.value == "LMCacheConnectorV1"
    assert "use_native" in info.value.reason


def test_a_refused_member_of_a_multi_connector_is_named_by_position() -> None:
    cfg = _multi(
        {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
        {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both"},
    )
    with pytest.raises(UnsupportedVllmConfigError) as info:
        check_kv_transfer_config(cfg)
    assert info.value.field == "kv_transfer_config.kv_connector.connectors[1]"
    assert info.value.value == "SimpleCPUOffloadConnector"
    assert info.value.reason == REFUSED_CONNECTORS["SimpleCPUOffloadConnector"]


def test_an_empty_multi_connector_is_refused() -> None:
    with pytest.raises(UnsupportedVllmConfigError, match="needs connectors"):
        check_kv_transfer_config(_multi())


@pytest.mark.parametrize(
    "connectors,field,value",
    [
        (["NixlConnector"], "kv_transfer_config.kv_connector.connectors[0]", "'NixlConnector'"),
        (
            {"kv_connector": "NixlConnector"},
            "kv_transfer_config.kv_connector.connectors",
            "{'kv_connector': 'NixlConnector'}",
        ),
    ],
    ids=["member-not-a-dict", "connectors-not-a-list"],
)
def test_a_malformed_multi_connector_is_refused_typed(connectors: Any, field: str, value: str) -> None:
    # vLLM's own config validation trips on these first (AttributeError); the check called
    # directly names the field instead.
    with pytest.raises(UnsupportedVllmConfigError) as info:
        check_kv_transfer_config(_cfg("MultiConnector", extra={"connectors": connectors}))
    assert (info.value.field, info.value.value) == (field, value)


def test_an_unknown_connector_name_is_refused() -> None:
    with pytest.raises(UnsupportedVllmConfigError, match="cannot be resolved"):
        check_kv_transfer_config(_cfg("NoSuchConnector"))


_CUSTOM = textwrap.dedent(
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    class PoolKeeper(KVConnectorBase_V1):
        def bind_gpu_block_pool(self, gpu_block_pool):
            self.pool = gpu_block_pool

    class ManagerKeeper(KVConnectorBase_V1):
        def bind_kv_cache_manager(self, kv_cache_manager):
            self.manager = kv_cache_manager

    class Plain(KVConnectorBase_V1):
        pass
    """
)


@pytest.fixture
def custom_module(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "pagedkv_test_custom_connectors.py").write_text(_CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "pagedkv_test_custom_connectors"
    sys.modules.pop("pagedkv_test_custom_connectors", None)


@pytest.mark.parametrize("cls", ["PoolKeeper", "ManagerKeeper"])
def test_a_custom_connector_overriding_the_bind_hooks_is_refused(custom_module: str, cls: str) -> None:
    with pytest.raises(UnsupportedVllmConfigError) as info:
        check_kv_transfer_config(_cfg(cls, kv_connector_module_path=custom_module))
    assert info.value.value == cls
    assert "bind_gpu_block_pool / bind_kv_cache_manager" in info.value.reason


def test_a_custom_connector_without_bind_hooks_is_accepted(custom_module: str) -> None:
    check_kv_transfer_config(_cfg("Plain", kv_connector_module_path=custom_module))


def test_an_offloading_connector_bounded_by_vllms_coordinator_is_refused() -> None:
    leaf = SimpleNamespace(_bounding_group_ids=(1,))
    multi = SimpleNamespace(_connectors=[SimpleNamespace(_bounding_group_ids=()), leaf])
    assert connector_leaves(multi) == multi._connectors
    with pytest.raises(UnsupportedVllmConfigError, match=r"groups \[1\]"):
        check_built_connector(multi)
    check_built_connector(SimpleNamespace(_bounding_group_ids=()))
    check_built_connector(None)


def test_the_scheduler_refuses_before_building() -> None:
    vllm_config = make_vllm_config(num_blocks=16, kv_transfer_config=_cfg("SimpleCPUOffloadConnector"))
    with pytest.raises(UnsupportedVllmConfigError, match="SimpleCPUOffloadConnector"):
        build_scheduler(PagedKVScheduler, vllm_config)


def _nixl_scheduler(role: str = "kv_consumer") -> Any:
    return build_scheduler(
        PagedKVScheduler, make_vllm_config(num_blocks=16, kv_transfer_config=_cfg("NixlConnector", role))
    )


def test_the_connector_is_bound_to_pagedkvs_manager_and_sees_a_read_only_pool() -> None:
    sched = _nixl_scheduler()
    manager = sched.kv_cache_manager
    assert sched.connector._kv_cache_manager is manager
    pool = manager.block_pool
    assert pool.num_gpu_blocks == 16
    assert pool.get_num_free_blocks() == pool.free_block_queue.num_free_blocks == 15
    assert len(pool.cached_block_hash_to_block) == 0
    for write in ("touch", "get_new_blocks", "cache_full_blocks", "evict_blocks"):
        with pytest.raises(ReadOnlyPoolError):
            getattr(pool, write)([])
    with pytest.raises(ReadOnlyPoolError):
        pool.free_blocks([pool.blocks[3]])
    block = pool.blocks[3]
    assert block.block_id == 3 and block.ref_cnt == 0 and block.block_hash is None and not block.is_null
    assert pool.blocks[0].is_null
    with pytest.raises(ReadOnlyPoolError):
        block.ref_cnt = 2
    with pytest.raises(IndexError):
        pool.blocks[16]


def test_block_views_are_live_and_hashes_kept_with_a_connector() -> None:
    sched = _nixl_scheduler()
    req = make_request("r", list(range(100, 140)), 3, block_size=16)
    sched.add_request(req)
    assert req.block_hashes, "a connector keys its transfers by request.block_hashes"
    sched.schedule()
    manager = sched.kv_cache_manager
    (ids,) = manager.get_block_ids("r")
    views = manager.coordinator.single_type_managers[0].req_to_blocks["r"]
    assert [v.block_id for v in views] == ids and len(ids) == 3
    assert [v.ref_cnt for v in views] == [1, 1, 1]
    # The two full prompt blocks are registered as computed; the third is partial.
    assert [v.block_hash is not None for v in views] == [True, True, False]
    assert manager.get_blocks("r").get_unhashed_block_ids() == [ids[2]]
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    assert manager.coordinator.single_type_managers[0].num_cached_block == {"r": 2}
    before = [(v.ref_cnt, v.block_hash) for v in views]
    with pytest.raises(InvalidBlockError):
        manager.evict_blocks({ids[1], 16})
    assert [(v.ref_cnt, v.block_hash) for v in views] == before, "nothing evicted"
    assert manager.evict_blocks({0}) == 0, "the null block is ignored, as vLLM's pool ignores it"
    assert manager.evict_blocks({0, ids[0]}) == 2, "an evicted block takes its dependent with it"
    assert [v.block_hash for v in views] == [None, None, None]
    assert views[0].ref_cnt == 1, "a held block stays held"


def test_unmatched_transfer_reports_are_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    sched = _nixl_scheduler()
    req = make_request("plain", list(range(100, 140)), 3, block_size=16)
    sched.add_request(req)
    sched.schedule()
    before = sched.kv_cache_manager.usage
    out = KVConnectorOutput(finished_recving={"never-seen", "plain"}, finished_sending={"ghost"})
    with caplog.at_level(logging.WARNING, logger="pagedkv.integrations.vllm.scheduler"):
        sched._update_from_kv_xfer_finished(out)
    assert "never-seen" in caplog.text and "plain" in caplog.text and "ghost" in caplog.text
    assert "plain" in sched.requests and not sched.finished_recving_kv_req_ids
    assert sched.kv_cache_manager.usage == before


def test_async_load_of_a_request_not_at_its_first_allocation_is_refused() -> None:
    sched = _nixl_scheduler()
    req = make_request("r", list(range(100, 140)), 3, block_size=16)
    sched.add_request(req)
    sched.schedule()
    req.num_computed_tokens = 40
    with pytest.raises(InvalidArgumentError, match="external tokens for a request with 40 computed tokens"):
        sched.kv_cache_manager.allocate_slots(req, 0, num_external_computed_tokens=16, delay_cache_blocks=True)
    with pytest.raises(InvalidArgumentError, match="delay_cache_blocks"):
        sched.kv_cache_manager.allocate_slots(req, 4, num_external_computed_tokens=16, delay_cache_blocks=True)


def test_a_deferred_free_keeps_blocks_until_released() -> None:
    sched = _nixl_scheduler()
    manager = sched.kv_cache_manager
    req = make_request("s", list(range(200, 240)), 3, block_size=16)
    sched.add_request(req)
    sched.schedule()
    assert round(manager.usage * 15) == 3
    req.status = RequestStatus.FINISHED_ABORTED
    deferred = manager.pop_blocks_for_free(req)
    assert len(deferred) == 3 and round(manager.usage * 15) == 3, "kept in use until released"
    assert "s" not in manager.coordinator.single_type_managers[0].req_to_blocks
    manager.block_pool.free_blocks(reversed(deferred))
    assert manager.usage == 0.0
    with pytest.raises(InvalidArgumentError):
        manager.block_pool.free_blocks(deferred)


def test_in_flight_load_reservations_apply_the_windowed_admission_cap() -> None:
    # vLLM reserves the blocks in-flight loads still need with apply_admission_cap=True: a
    # windowed group counts at most its recycling-aware cap (its spec's
    # max_admission_blocks_per_request), full attention every block.
    from pagedkv.integrations.vllm import PagedKVCacheManager
    from pagedkv.testing.vllm_scheduler import GEMMA3_GROUPS, make_hybrid_kv_cache_config

    config = make_hybrid_kv_cache_config(256, GEMMA3_GROUPS, 16)
    manager = PagedKVCacheManager(config, max_model_len=4096, max_in_flight_tokens=256)
    view = manager.coordinator
    n = 2000
    caps = [
        g.kv_cache_spec.max_admission_blocks_per_request(256, 4096) if g.kv_cache_spec.sliding_window else None
        for g in config.kv_cache_groups
    ]
    assert any(c is not None and c < -(-n // 16) for c in caps), "the window must cap"
    uncapped = view.get_num_blocks_to_allocate("loading", n)
    capped = view.get_num_blocks_to_allocate("loading", n, apply_admission_cap=True)
    assert uncapped == len(caps) * -(-n // 16)
    assert capped == sum(-(-n // 16) if c is None else min(c, -(-n // 16)) for c in caps) < uncapped
