"""State groups (Mamba / linear-attention recurrent states) through the Python API: the live
state's moves as copy rows, fresh states as zero rows, prefix hits on committed states only
(the commit fence, ``KVCacheManager.commit_computed``), and typed refusals that change nothing
(docs/design.md, "KV cache groups", state groups)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import BlockStored, CacheConfig, KVCacheGroupSpec, KVCacheManager, KVIndexer
from pagedkv.errors import (
    InvalidArgumentError,
    InvalidConfigError,
    InvalidSequenceStateError,
    UnknownSequenceError,
)

BS = 4
FULL, STATE = 0, 1


def make(num_blocks: int = 32, **kwargs: object) -> KVCacheManager:
    """One full-attention group and one state group of 4-token blocks (32-byte pages)."""
    groups = [KVCacheGroupSpec("full", BS, 8), KVCacheGroupSpec("state", BS, 8)]
    return KVCacheManager(CacheConfig(num_blocks, groups=groups, layer_groups=[0, 1, 1], **kwargs))  # type: ignore[arg-type]


def toks(n: int, salt: int = 0) -> list[int]:
    return [i * 7 + salt * 1000 + 1 for i in range(n)]


def state_row(m: KVCacheManager, seq: int) -> list[int]:
    return [int(b) for b in m.block_tables(seq)[STATE]]


def test_spec_kind_and_state_bytes() -> None:
    g = KVCacheGroupSpec("state", 4, 8, state_bytes=32)
    assert g.kind == "state"
    assert (g.block_size, g.bytes_per_token, g.page_bytes) == (4, 8, 32)
    assert g.window is None and g.chunk is None
    with pytest.raises(InvalidConfigError, match="fit in one page"):
        KVCacheGroupSpec("state", 4, 8, state_bytes=33)
    with pytest.raises(InvalidConfigError, match="at least one byte"):
        KVCacheGroupSpec("state", 4, 8, state_bytes=0)
    with pytest.raises(InvalidConfigError, match="takes no state_bytes"):
        KVCacheGroupSpec("full", 4, 8, state_bytes=8)
    with pytest.raises(InvalidConfigError, match="takes no window"):
        KVCacheGroupSpec("state", 4, 8, window=4)
    with pytest.raises(InvalidConfigError, match="same size"):
        CacheConfig(8, groups=[KVCacheGroupSpec("full", 4, 8), KVCacheGroupSpec("state", 4, 16)], layer_groups=[0, 1])


def test_worked_example_tables_copies_and_zero_rows() -> None:
    m = make()
    m.add_sequence(1, toks(10))
    a = m.allocate_slots(1, 8)
    ind = a.new_block_indptr
    s1 = int(a.new_block_ids[ind[STATE]])
    assert ind.tolist() == [0, 2, 3]
    assert a.zero_blocks.tolist() == [[STATE, s1]]
    assert a.copies.shape == (0, 3)
    assert state_row(m, 1) == [0, s1]
    a = m.allocate_slots(1, 2)
    s2 = int(a.new_block_ids[a.new_block_indptr[STATE]])
    assert a.copies.tolist() == [[STATE, s1, s2]]
    assert a.zero_blocks.shape == (0, 2)
    assert state_row(m, 1) == [0, s1, s2]  # the state after 8 waits for its commit
    m.append_tokens(1, [5])
    a = m.allocate_slots(1, 1)  # 10 -> 11: in place
    assert a.copies.shape == (0, 3) and a.new_block_ids.tolist() == []
    assert m.commit_computed(1, 11) == 1
    assert state_row(m, 1) == [0, 0, s2]
    assert m.commit_computed(1, 11) == 0
    m.check_invariants()


def test_step_output_zero_blocks_copies_and_slot_rows() -> None:
    m = make()
    m.add_sequence(1, toks(10))
    out = m.step([1], [8])
    out.raise_for_error()
    live = state_row(m, 1)[1]
    assert out.zero_blocks.dtype == np.int32
    assert out.zero_blocks.tolist() == [[STATE, live]]
    assert out.slot_mappings[STATE].tolist() == [-1] * 8
    assert out.slot_mappings[FULL].tolist() == [int(m.block_tables(1)[FULL][i // 4]) * 4 + i % 4 for i in range(8)]
    out = m.step([1], [2])
    new = state_row(m, 1)[2]
    assert out.copies.tolist() == [[STATE, live, new]]
    assert out.zero_blocks.shape == (0, 2)
    m.check_invariants()


def test_no_hit_before_the_commit_and_a_hit_after() -> None:
    m = make(enable_events=True)
    m.add_sequence(1, toks(10))
    m.allocate_slots(1, 8)
    m.allocate_slots(1, 2)
    state8 = state_row(m, 1)[1]
    m.add_sequence(2, toks(10))
    assert m.lookup_prefix_group(2, FULL, 10) == 8
    assert m.lookup_prefix(2) == 0
    stored = [(e.group, len(e.block_hashes)) for e in m.take_events() if isinstance(e, BlockStored)]
    assert stored == [(FULL, 2)]  # the full group's blocks only
    assert m.commit_computed(1, 10) == 1
    stored = [(e.group, len(e.block_hashes)) for e in m.take_events() if isinstance(e, BlockStored)]
    assert stored == [(STATE, 1)]
    assert m.lookup_prefix(2) == 8
    a = m.allocate_slots(2, 2)
    assert a.num_cached_tokens == 8
    live = int(a.new_block_ids[a.new_block_indptr[STATE]])
    assert a.copies.tolist() == [[STATE, state8, live]]
    assert a.zero_blocks.shape == (0, 2)
    assert state_row(m, 2) == [0, 0, live]
    m.check_invariants()


def test_free_and_preempt_before_commit_leave_nothing_matchable() -> None:
    m = make()
    m.add_sequence(1, toks(10))
    m.allocate_slots(1, 8)
    m.allocate_slots(1, 2)
    assert m.free(1)
    m.add_sequence(2, toks(10))
    assert m.lookup_prefix(2) == 0
    m.allocate_slots(2, 8)
    m.preempt([2])
    assert m.status(2) == "preempted"
    a = m.allocate_slots(2, 10)
    assert a.num_cached_tokens == 0
    assert a.zero_blocks.tolist() == [[STATE, state_row(m, 2)[2]]]
    m.check_invariants()


def test_commit_errors_and_refusals_change_nothing() -> None:
    m = make()
    m.add_sequence(1, toks(10))
    m.allocate_slots(1, 8)
    before = [t.tolist() for t in m.block_tables(1)]
    free = m.stats().free

    def unchanged() -> None:
        assert [t.tolist() for t in m.block_tables(1)] == before
        assert m.num_computed_tokens(1) == 8
        assert m.stats().free == free
        m.check_invariants()

    with pytest.raises(InvalidArgumentError, match="num_tokens"):
        m.commit_computed(1, 9)
    unchanged()
    with pytest.raises(UnknownSequenceError):
        m.commit_computed(99, 0)
    with pytest.raises(InvalidArgumentError, match="speculative decoding"):
        m.allocate_slots(1, 2, num_lookahead_slots=2)
    unchanged()
    with pytest.raises(InvalidArgumentError, match="state groups"):
        m.fork(1, 2)
    unchanged()
    m.add_sequence(3, toks(10, 1))
    m.allocate_external(3, 8, staged=True)
    loading = [t.tolist() for t in m.block_tables(3)]
    used = m.stats().used
    # A load of a recurrent state commits in full or not at all.
    for v in (0, 4, 7):
        with pytest.raises(InvalidArgumentError, match="num_valid_tokens"):
            m.commit_external(3, v)
        assert m.status(3) == "loading" and m.num_staged_tokens(3) == 8
        assert [t.tolist() for t in m.block_tables(3)] == loading
        assert m.stats().used == used
    assert m.free(3)
    unchanged()


def test_staged_load_state_is_published_only_by_its_full_commit() -> None:
    m = make()
    m.add_sequence(1, toks(10))
    m.allocate_external(1, 8, staged=True)
    live = state_row(m, 1)[1]
    assert state_row(m, 1)[0] == 0  # null
    m.add_sequence(2, toks(10))
    assert m.commit_all_computed([1]) == 0
    assert m.lookup_prefix(2) == 0
    assert m.commit_external(1, 8) == 3  # two full blocks and the state after 8
    assert m.lookup_prefix(2) == 8
    a = m.allocate_slots(2, 2)
    assert a.copies.tolist() == [[STATE, live, state_row(m, 2)[2]]]
    m.check_invariants()
    # An aborted load's state never becomes a hit.
    m.add_sequence(3, toks(12, 5))
    m.allocate_external(3, 8, staged=True)
    assert m.free(3)
    m.add_sequence(4, toks(12, 5))
    assert m.lookup_prefix(4) == 0
    m.check_invariants()


def test_commit_without_state_groups_is_zero() -> None:
    m = KVCacheManager(CacheConfig(16, 4))
    m.add_sequence(1, toks(9))
    m.allocate_slots(1, 8)
    assert m.commit_computed(1, 8) == 0
    with pytest.raises(InvalidArgumentError):
        m.commit_computed(1, 9)


def test_indexer_indexes_the_full_group_and_ignores_state_events() -> None:
    m = make(enable_events=True)
    m.add_sequence(1, toks(9))
    m.allocate_slots(1, 8)
    assert m.commit_computed(1, 8) == 1
    events = m.take_events()
    stored = {e.group: list(e.block_hashes) for e in events if isinstance(e, BlockStored)}
    assert set(stored) == {FULL, STATE}
    ix = KVIndexer(BS)
    ix.add_worker(1, groups=["full", "state"])
    ix.apply(1, 0, events)
    assert ix.worker_hashes(1) == sorted(stored[FULL])


def test_commit_all_computed_is_commit_computed_per_sequence() -> None:
    batched, single = make(), make()
    for m in (batched, single):
        for seq, salt in ((1, 0), (2, 1), (3, 2)):
            m.add_sequence(seq, toks(10, salt))
        m.step([1, 2, 3], [8, 8, 6]).raise_for_error()
    # Sequences 1 and 2 ended a step at 8 (aligned): one state each; 3 ended at 6: none.
    assert batched.commit_all_computed(np.asarray([1, 2, 3], dtype=np.uint64)) == 2
    assert sum(single.commit_computed(seq, single.num_computed_tokens(seq)) for seq in (1, 2, 3)) == 2
    for seq in (1, 2, 3):
        assert state_row(batched, seq) == state_row(single, seq)
    assert batched.commit_all_computed([1, 2, 3]) == 0  # nothing new
    for m in (batched, single):
        m.add_sequence(4, toks(8) + [99, 98])
        assert m.lookup_prefix(4) == 8  # the committed state after 8 tokens hits
        m.check_invariants()


def test_commit_all_computed_unknown_id_changes_nothing() -> None:
    m = make()
    m.add_sequence(1, toks(10))
    m.step([1], [8]).raise_for_error()
    with pytest.raises(UnknownSequenceError):
        m.commit_all_computed([1, 7])
    m.add_sequence(2, toks(10))
    assert m.lookup_prefix(2) == 0  # sequence 1's state was not published
    assert m.commit_all_computed([]) == 0
    assert make_full_only().commit_all_computed([]) == 0


def make_full_only() -> KVCacheManager:
    m = KVCacheManager(CacheConfig(16, 4))
    m.add_sequence(1, toks(8))
    m.step([1], [8]).raise_for_error()
    assert m.commit_all_computed([1]) == 0  # no state group: nothing to publish
    return m


def test_placeholder_slots_move_the_state_and_are_never_rejected() -> None:
    # An async scheduler's slot for a token not known yet is a draft slot: with a state group
    # the live state moves over it, the placeholder is settled keeping its blocks, and the
    # token, once appended, is computed into them; the state after the aligned end waits
    # for its commit. Rejecting a placeholder while giving its blocks back is refused.
    m = make()
    t = toks(9, 0)
    m.add_sequence(1, t[:8])
    m.allocate_slots(1, 8)
    out = m.allocate_slots(1, 0, draft_token_ids=[0])
    state = out.new_block_ids[out.new_block_indptr[1] : out.new_block_indptr[2]].tolist()
    assert len(state) == 1 and m.block_table(1, 1).tolist()[-1] == state[0]
    m.check_invariants()
    before = [x.tolist() for x in m.block_tables(1)]
    with pytest.raises(InvalidArgumentError, match="placeholder"):
        m.accept_drafts(1, 0)
    assert [x.tolist() for x in m.block_tables(1)] == before and m.num_draft_tokens(1) == 1
    m.accept_drafts(1, 0, release_blocks=False)
    m.add_sequence(2, t)
    assert m.lookup_prefix(2) == 0, "the state after 8 is not committed"
    m.append_tokens(1, t[8:])
    again = m.allocate_slots(1, 1)
    assert len(again.new_block_ids) == 0 and len(again.copies) == 0
    assert m.commit_computed(1, 8) == 1
    assert m.lookup_prefix(2) == 8
    m.check_invariants()


def test_state_from_load_takes_the_attention_hit_and_refuses_bad_input() -> None:
    """A load that brings the state (vLLM's divergent hits): the first allocation takes the
    longest prefix the other groups serve, its state group no hit block; allocating without
    external tokens, setting it on a held or unknown sequence: typed errors, nothing changed."""
    m = make()
    m.add_sequence(1, toks(14))
    m.allocate_slots(1, 4)
    m.allocate_slots(1, 9)
    assert m.commit_computed(1, 13) == 1  # the state after 4 tokens only
    m.add_sequence(2, toks(20))
    assert m.lookup_prefix(2) == 4
    m.set_state_from_load(2, True)
    assert m.lookup_prefix(2) == 12
    used = m.stats().used
    with pytest.raises(InvalidArgumentError, match="num_external_tokens"):
        m.allocate_slots(2, 4)
    # The block-count queries still answer (an admission check asks what the whole sequence
    # needs, loaded tokens counted as new ones, before the external allocation).
    assert m.num_blocks_needed(2, 8) == m.num_blocks_needed_external(2, 8, 0)
    for bad in (1, None, "yes"):
        with pytest.raises(InvalidArgumentError, match="expected a bool"):
            m.set_state_from_load(2, bad)  # type: ignore[arg-type]
    assert all(len(t) == 0 for t in m.block_tables(2)) and m.stats().used == used
    assert m.lookup_prefix(2) == 12  # still set
    with pytest.raises(UnknownSequenceError):
        m.set_state_from_load(99, True)
    with pytest.raises(InvalidSequenceStateError):
        m.set_state_from_load(1, True)
    a = m.allocate_external(2, 7, staged=True)
    assert (a.num_cached_tokens, a.num_context_tokens) == (12, 19)
    assert state_row(m, 2) == [0, 0, 0, 0, state_row(m, 2)[4]] and a.copies.shape == (0, 3)
    assert m.commit_external(2, 19) == 1  # the full block 12..16 (19 is unaligned)
    m.check_invariants()
