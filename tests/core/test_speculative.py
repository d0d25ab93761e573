"""Speculative decoding through the Python API: lookahead slots for draft tokens in
``allocate_slots`` / ``step``, ``accept_drafts``, and bad input refused with a typed error and
the state unchanged. Exact values throughout (block size 4, LIFO fresh blocks)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv import errors as E


def manager() -> pagedkv.KVCacheManager:
    cfg = pagedkv.CacheConfig(16, 4, enable_events=True, num_cpu_blocks=4)
    m = pagedkv.KVCacheManager(cfg)
    m.add_sequence(1, [0, 1, 2, 3, 4, 5])
    m.allocate_slots(1, 6)
    m.take_events()
    return m


def state(m: pagedkv.KVCacheManager) -> tuple[Any, ...]:
    p = m.pool
    return (
        [p.ref_count(b) for b in range(p.num_blocks)],
        [p.block_hash(b) for b in range(p.num_blocks)],
        p.free_queue().tolist(),
        m.token_ids(1).tolist(),
        m.num_computed_tokens(1),
        m.block_table(1).tolist(),
        m.num_draft_tokens(1),
    )


def test_verify_step_then_partial_acceptance() -> None:
    m = manager()
    table = m.block_table(1).tolist()
    out = m.step([1], 1, np.array([100]), draft_token_ids=[[101, 102, 103, 104, 105, 106]])
    out.raise_for_error()
    assert out.num_draft_tokens.tolist() == [6]
    assert out.input_ids.tolist() == [100, 101, 102, 103, 104, 105, 106]
    assert out.query_start_loc.tolist() == [0, 7] and out.seq_lens.tolist() == [13]
    t = m.block_table(1).tolist()
    assert t[:2] == table and len(t) == 4
    assert out.slot_mapping.tolist() == [t[p // 4] * 4 + p % 4 for p in range(6, 13)]
    assert m.num_draft_tokens(1) == 6 and m.num_computed_tokens(1) == 7
    assert m.take_events() == [], "nothing announced for drafts"
    (released,) = m.accept_drafts(1, 2)  # one group
    assert released.dtype == np.int32 and released.tolist() == [t[3]]
    assert m.token_ids(1).tolist() == [0, 1, 2, 3, 4, 5, 100, 101, 102]
    assert m.num_computed_tokens(1) == 9 and m.num_draft_tokens(1) == 0
    (ev,) = m.take_events()
    assert isinstance(ev, pagedkv.BlockStored) and list(ev.token_ids) == [4, 5, 100, 101]
    m.check_invariants()


def test_allocate_slots_with_drafts_and_a_plain_step_has_zero_drafts() -> None:
    m = manager()
    m.append_tokens(1, [9])
    a = m.allocate_slots(1, 1, np.array([7, 8], dtype=np.int64))
    assert (a.num_scheduled_tokens, a.num_draft_tokens, a.num_context_tokens) == (1, 2, 6)
    t = m.block_table(1).tolist()
    assert len(t) == 3  # 9 slots
    assert [r.tolist() for r in m.accept_drafts(1, 0)] == [[t[2]]]  # 7 tokens: the third block held drafts only
    out = m.step([1], 1, [[3]])
    assert out.num_draft_tokens.tolist() == [0]
    m.check_invariants()


@pytest.mark.parametrize(
    ("call", "cls", "fields"),
    [
        (lambda m: m.accept_drafts(1, 0), E.InvalidSequenceStateError, {"seq_id": 1}),
        (lambda m: m.accept_drafts(1, -1), E.InvalidArgumentError, {"arg": "num_accepted"}),
        (lambda m: m.accept_drafts(1, 1.5), E.InvalidArgumentError, {"arg": "num_accepted"}),
        (lambda m: m.accept_drafts(99, 0), E.UnknownSequenceError, {"seq_id": 99}),
        (lambda m: m.allocate_slots(1, 1, [-1]), E.InvalidArgumentError, {"arg": "draft_token_ids"}),
        (lambda m: m.allocate_slots(1, 1, [1, 2]), E.InvalidArgumentError, {"arg": "draft_tokens"}),
    ],
)
def test_bad_input_without_drafts_is_typed_and_changes_nothing(call: Any, cls: type, fields: dict[str, Any]) -> None:
    m = manager()
    m.append_tokens(1, [7, 8])  # two uncomputed tokens: drafts after one of them are refused
    before = state(m)
    with pytest.raises(cls) as info:
        call(m)
    assert isinstance(info.value, pagedkv.PagedKVError)
    for k, v in fields.items():
        assert getattr(info.value, k) == v
    assert state(m) == before


def test_bad_input_with_drafts_pending_is_typed_and_changes_nothing() -> None:
    m = manager()
    m.append_tokens(1, [7])
    m.allocate_slots(1, 1, [1, 2, 3])
    before = state(m)
    with pytest.raises(E.InvalidArgumentError) as info:
        m.accept_drafts(1, 4)
    assert isinstance(info.value, ValueError) and info.value.arg == "num_accepted"
    for call in (
        lambda: m.append_tokens(1, [5]),
        lambda: m.allocate_slots(1, 1),
        lambda: m.fork(1, 2),
        lambda: m.swap_out([1]),
    ):
        with pytest.raises(E.InvalidSequenceStateError):
            call()
    out = m.step([1], 1, [[5]])
    assert isinstance(out.error, E.InvalidSequenceStateError) and out.num_scheduled == 0
    assert state(m) == before
    m.check_invariants()


def test_step_draft_rows_must_match_the_sequences() -> None:
    m = manager()
    before = state(m)
    with pytest.raises(E.InvalidArgumentError) as info:
        m.step([1], 1, [[7]], draft_token_ids=[[1], [2]])
    assert info.value.arg == "draft_token_ids"
    assert state(m) == before


def test_release_blocks_false_keeps_the_rejected_blocks_as_spares() -> None:
    m = manager()
    m.step([1], 1, [[100]], draft_token_ids=[[101, 102, 103, 104, 105, 106]])
    t = m.block_table(1).tolist()
    assert [r.tolist() for r in m.accept_drafts(1, 1, release_blocks=False)] == [[]]
    assert m.block_table(1).tolist() == t and m.num_computed_tokens(1) == 8
    out = m.step([1], 1, [[7]], draft_token_ids=[[8, 9, 10, 11, 12]])
    assert out.new_block_ids.tolist() == [] and out.seq_lens.tolist() == [14]
    with pytest.raises(E.InvalidArgumentError):
        m.accept_drafts(1, 0, release_blocks=1)
    m.check_invariants()
