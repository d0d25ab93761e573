"""``PagedKVCPUOffloadingSpec``'s own extra-config keys: a malformed value raises
``pagedkv.InvalidConfigError`` naming the key the user wrote (it used to be a bare
``ValueError`` from ``int()``, a float truncated, a bool taken as an int, or the core tier's
field name)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.testing import vllm_scheduler as vs  # noqa: E402

try:
    from pagedkv.integrations.vllm.offloading import PagedKVOffloadingManager
except ImportError:  # pragma: no cover - depends on the installed vLLM
    PagedKVOffloadingManager = None

pytestmark = pytest.mark.skipif(PagedKVOffloadingManager is None, reason="this vLLM has no offloading interface")

SPEC = {"spec_name": "PagedKVCPUOffloadingSpec", "spec_module_path": "pagedkv.integrations.vllm.offloading"}


def _build(extra: dict[str, Any]) -> Any:
    kv = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22, **SPEC, **extra},
    )
    return vs.build_scheduler(Scheduler, vs.make_vllm_config(num_blocks=12, block_size=16, kv_transfer_config=kv))


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"host_admission_min_seen": "abc"}, "host_admission_min_seen"),
        ({"host_admission_min_seen": 2.7}, "host_admission_min_seen"),
        ({"host_admission_min_seen": True}, "host_admission_min_seen"),
        ({"host_admission_min_seen": 0}, "host_admission_min_seen"),
        ({"store_threshold": "x"}, "store_threshold"),
        ({"eviction_policy": "fifo"}, "eviction_policy"),
    ],
)
def test_a_malformed_extra_config_value_names_its_key(extra: dict[str, Any], key: str) -> None:
    with pytest.raises(pagedkv.InvalidConfigError, match=f"kv_connector_extra_config {key}") as e:
        _build(extra)
    assert e.value.field == key and isinstance(e.value, ValueError)


def test_well_formed_values_reach_the_pool() -> None:
    scheduler = _build({"host_admission_min_seen": "3", "eviction_policy": "arc"})
    pool = scheduler.connector.connector_scheduler.manager.pool
    assert (pool.admission_min_seen, pool.eviction) == (3, "arc")
