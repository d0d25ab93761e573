"""The ``kv_cache_manager`` calls the vLLM facade answers alike for one KV cache group and for
several (``pagedkv.integrations.vllm.manager_interface``): it names its class in its errors,
answers per KV cache group, and a refused call changes nothing.

Runs only where vLLM is installed (``make test-vllm``).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from pagedkv.errors import InvalidArgumentError, UnknownSequenceError  # noqa: E402
from pagedkv.integrations.vllm import (  # noqa: E402
    PagedKVCacheManager,
)
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    make_hybrid_kv_cache_config,
    make_kv_cache_config,
    make_request,
)

BS = 16
GROUPS = (("full", None), ("sliding_window", 48))


def _manager(kind: str) -> Any:
    if kind == "one_group":
        return PagedKVCacheManager(make_kv_cache_config(64, BS))
    return PagedKVCacheManager(make_hybrid_kv_cache_config(64, GROUPS, BS))


KINDS = ("one_group", "hybrid")


@pytest.mark.parametrize("kind", KINDS)
def test_zeroing_calls_are_no_ops_on_a_uniform_precision_cache(kind: str) -> None:
    # vLLM zeroes new blocks only for caches of mixed precision (or with Mamba groups): here
    # record_blocks_for_zeroing records nothing and take_new_block_ids stays empty.
    m = _manager(kind)
    assert not m.zeroing
    req = make_request("z", list(range(1, 41)), 4, block_size=BS)
    m.get_computed_blocks(req)
    assert m.allocate_slots(req, 40) is not None
    m.record_blocks_for_zeroing("z", 0)
    assert m.take_new_block_ids() == []


@pytest.mark.parametrize("kind", KINDS)
def test_refused_allocation_options_name_the_manager_and_change_nothing(kind: str) -> None:
    m = _manager(kind)
    req = make_request("r", list(range(1, 41)), 4, block_size=BS)
    free_before = m.usage
    with pytest.raises(InvalidArgumentError) as err:
        m.allocate_slots(req, 40, num_encoder_tokens=5)
    assert str(err.value) == f"num_encoder_tokens=5 is not supported by {type(m).__name__}"
    assert err.value.arg == "num_encoder_tokens"
    # EAGLE / MTP lookahead slots are served; a negative count is refused.
    with pytest.raises(InvalidArgumentError, match=r"num_lookahead_tokens must be >= 0 \(got -1\) for request 'r'"):
        m.allocate_slots(req, 40, num_lookahead_tokens=-1)
    # An async KV load schedules no token: 40 with delay_cache_blocks is refused.
    with pytest.raises(InvalidArgumentError) as err:
        m.allocate_slots(req, 40, num_external_computed_tokens=16, delay_cache_blocks=True)
    assert str(err.value) == "request 'r': num_new_tokens=40 with delay_cache_blocks=True"
    assert err.value.arg == "num_new_tokens"
    with pytest.raises(InvalidArgumentError, match=r"num_new_tokens must be >= 1 \(got 0\) for request 'r'"):
        m.allocate_slots(req, 0)
    # Refused before the request was registered: pagedkv still knows nothing of it.
    with pytest.raises(UnknownSequenceError, match="unknown request id 'r'"):
        m.seq_id("r")
    assert m.usage == free_before == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_per_group_answers(kind: str) -> None:
    m = _manager(kind)
    groups = 1 if kind == "one_group" else len(GROUPS)
    assert m.get_num_common_prefix_blocks("any") == [0] * groups
    assert len(m.coordinator.single_type_managers) == groups
    assert m.take_kv_cache_block_copies() == ([], [])
    assert m.take_new_block_ids() == []
    assert m.take_boundary_state_offloads() == {}


@pytest.mark.parametrize("kind", KINDS)
def test_capped_hit_and_double_free_are_refused(kind: str) -> None:
    m = _manager(kind)
    prompt = list(range(1, 65))
    first = make_request("a", prompt, 4, block_size=BS)
    m.get_computed_blocks(first)
    assert m.allocate_slots(first, len(prompt)) is not None
    second = make_request("b", prompt, 4, block_size=BS)
    _, hit, _ = m.get_computed_blocks(second)
    assert hit == 48  # whole blocks, the last prompt token recomputed
    with pytest.raises(InvalidArgumentError) as err:
        m.get_computed_blocks(second, max_cache_hit_length=hit - BS)
    assert str(err.value) == (
        f"max_cache_hit_length {hit - BS} is below the prefix hit of {hit} tokens; capping hits is not supported"
    )
    # A request never allocated is freed as a no-op; one that claims computed tokens is a
    # double free.
    m.free(make_request("never", prompt, 4, block_size=BS))
    ghost = make_request("ghost", prompt, 4, block_size=BS)
    ghost.num_computed_tokens = 16
    with pytest.raises(UnknownSequenceError) as err2:
        m.free(ghost)
    assert str(err2.value) == "request 'ghost' holds no KV blocks (already freed?) but claims 16 computed tokens"
