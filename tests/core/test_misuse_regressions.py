"""Regressions for misuse of the block-table consumers and the host block pool: calls out of
order, outputs fed twice, wrong arguments. Each failed before its fix."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
from pagedkv import CacheConfig, KVCacheGroupSpec, KVCacheManager
from pagedkv.tensors import BlockTable


def _hybrid() -> KVCacheManager:
    groups = [KVCacheGroupSpec("full", 4, 8), KVCacheGroupSpec("sliding_window", 4, 8, window=8)]
    return KVCacheManager(CacheConfig(64, groups=groups, layer_groups=[0, 1]))


def _decode_past_window(m: KVCacheManager) -> list[pagedkv.StepOutput]:
    """A prefill (a whole report) then decodes whose window releases change the tables."""
    m.add_sequence(1, list(range(10)))
    steps = [m.step([1], [10])]
    steps += [m.step([1], [1], [[7]]) for _ in range(2)]
    assert int(steps[0].table_start.sum()) == 0  # the first report is whole
    assert m.block_tables(1)[1].tolist()[0] == 0  # the window released its first block since
    return steps


@pytest.mark.parametrize("order", [(0, 1, 2, 0), (2, 0), (1, 0), (0, 2, 1, 0)])
def test_group_block_tables_ignore_a_stale_whole_report(order: tuple[int, ...]) -> None:
    """An older whole report fed again or out of order must not overwrite newer tables (it
    used to bring back the released window entries)."""
    m = _hybrid()
    steps = _decode_past_window(m)
    tables = BlockTable(m)
    for i in order:
        out = tables.update(steps[i])
    want = m.block_tables(1)
    for g in range(m.num_groups):
        np.testing.assert_array_equal(out[g, 0, : len(want[g])], want[g])
        assert not out[g, 0, len(want[g]) :].any()


def test_group_block_tables_reread_another_managers_whole_report() -> None:
    """A whole report of the same sequence id from another manager, after this manager's
    newer one: read whole from this manager rather than applied."""
    m = _hybrid()
    steps = _decode_past_window(m)
    other = _hybrid()
    other.add_sequence(1, list(range(50, 90)))
    foreign = other.step([1], [40])
    tables = BlockTable(m)
    tables.update(steps[-1])
    out = tables.update(foreign)
    want = m.block_tables(1)
    for g in range(m.num_groups):
        np.testing.assert_array_equal(out[g, 0, : len(want[g])], want[g])


def test_block_table_ignores_a_stale_whole_report() -> None:
    """The one-group ``BlockTable``: the prefill's whole report fed again after decodes
    opened a block must not shorten the kept table."""
    from pagedkv.tensors import BlockTable

    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(64, 4))
    m.add_sequence(1, list(range(10)))
    steps = [m.step([1], [10])]
    steps += [m.step([1], [1], [[7]]) for _ in range(3)]
    tables = BlockTable(m)
    for s in steps:
        tables.update(s)
    out = tables.update(steps[0])
    assert out.shape[0] == 1 and out[0, 0].tolist() == m.block_table(1).tolist() and len(m.block_table(1)) == 4


def test_host_block_pool_names_the_accepted_policies() -> None:
    with pytest.raises(pagedkv.InvalidConfigError, match='expected one of "lru", "arc"'):
        pagedkv.HostBlockPool(4, eviction="fifo")


def test_kv_layout_help_says_the_virtual_layout_shares_pages() -> None:
    """``--kv-layout``'s help said the virtual layout had no prefix caching and one sequence
    per request, which page sharing (prefix caching, n > 1, beam search on the CPU) ended."""
    pytest.importorskip("torch")
    from pagedkv.engine.cli import build_parser

    (action,) = [a for a in build_parser()._actions if "--kv-layout" in a.option_strings]
    text = action.help or ""
    assert "no prefix caching" not in text and "one sequence per request" not in text
    assert "prefix caching" in text and "share pages" in text and "no host tier" in text


@pytest.mark.parametrize("success", ["no", 0, 1.0])
def test_host_block_pool_complete_store_refuses_a_non_bool_success(success: object) -> None:
    """``success`` must be a bool: anything else is an ``InvalidArgumentError`` (it was
    pyo3's bare ``TypeError``), with the store still in flight."""
    p = pagedkv.HostBlockPool(4)
    p.prepare_store([b"a"])
    before = (p.state(b"a"), p.num_held, p.counters())
    with pytest.raises(pagedkv.InvalidArgumentError, match="success"):
        p.complete_store([b"a"], success)  # type: ignore[arg-type]
    assert (p.state(b"a"), p.num_held, p.counters()) == before == (1, 1, before[2])
    p.complete_store([b"a"], False)
    assert p.state(b"a") == 0
    p.check_invariants()
