"""Speculative decoding's verify steps on ``pagedkv.KVCacheManager`` with KV cache groups (docs/design.md,
"Speculative decoding" and "KV cache groups").

A sliding-window group must keep the block that a verify step's first query row reads past the
window of its last row (vLLM #44082): the release rule uses the committed context only, never
the lookahead positions, and a rejection never leaves the next step's window short. Every case
checks, from the step's own arrays, that each position a query row reads is backed by a live
block of that group's table, and which blocks each table holds.
"""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
from pagedkv import CacheConfig, KVCacheGroupSpec, KVCacheManager

BS = 16


def _manager(window: int, num_blocks: int = 64) -> KVCacheManager:
    groups = [KVCacheGroupSpec("full", BS, 8), KVCacheGroupSpec("sliding_window", BS, 8, window=window)]
    return KVCacheManager(CacheConfig(num_blocks, groups=groups, layer_groups=[0, 1, 1]))


def _first_read(group: KVCacheGroupSpec, p: int) -> int:
    if group.kind == "sliding_window":
        assert group.window is not None
        return max(0, p + 1 - group.window)
    return 0


def _tokens(n: int, salt: int) -> list[int]:
    return [i * 7 + salt * 1000 + 1 for i in range(n)]


def _assert_reads_backed(m: KVCacheManager, out: pagedkv.StepOutput) -> None:
    """Every position each query row reads is in a live block of its group's table, and each
    row's slot lies in the block its table names."""
    out.raise_for_error()
    qsl, ctx = out.query_start_loc, out.context_lens
    for k in range(out.num_scheduled):
        for g, group in enumerate(m.groups):
            row = out.block_tables[g, k]
            for i in range(int(qsl[k + 1] - qsl[k])):
                p = int(ctx[k]) + i
                read = np.arange(_first_read(group, p), p + 1)
                assert (row[read // BS] != 0).all(), f"group {g}: row {i} (position {p}) reads a released block"
                assert out.slot_mappings[g, qsl[k] + i] == row[p // BS] * BS + p % BS


def _live(m: KVCacheManager, seq: int, g: int) -> tuple[int, int]:
    """(first live entry, table length) of group ``g``'s table: null before, real after."""
    t = m.block_tables(seq)[g]
    first = int(np.argmax(t != 0)) if (t != 0).any() else len(t)
    assert (t[first:] != 0).all(), t
    return first, len(t)


def test_verify_step_keeps_the_block_its_first_row_reads() -> None:
    """Window 32, context 110, k = 4: the query is 110..114; row 0 reads from 79 (block 4), row 4
    from 83 (block 5). Releasing by the lookahead end would free block 4 under row 0."""
    m = _manager(32)
    m.add_sequence(1, _tokens(110, 1))
    m.step([1], 512).raise_for_error()
    out = m.step([1], 1, [[5]], draft_token_ids=[[6, 7, 8, 9]], block_table=True)
    _assert_reads_backed(m, out)
    assert out.num_draft_tokens.tolist() == [4]
    assert out.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert out.context_lens.tolist() == [110] and out.seq_lens.tolist() == [115]
    window = m.block_tables(1)[1]
    assert len(window) == 8 and (window[:4] == 0).all() and window[4] != 0
    assert m.num_blocks_held(1) == [8, 4]
    m.check_invariants()
    # Every draft rejected: each group's lookahead block (112..114) goes; the window stays.
    lookahead = [int(m.block_tables(1)[g][7]) for g in range(2)]
    released = m.accept_drafts(1, 0)
    assert [r.tolist() for r in released] == [[lookahead[0]], [lookahead[1]]]
    assert m.num_computed_tokens(1) == m.num_tokens(1) == 111
    assert _live(m, 1, 1) == (4, 7)
    m.check_invariants()
    # The next verify reads from 80: block 4 goes at that step, not before.
    out = m.step([1], 1, [[10]], draft_token_ids=[[11, 12, 13]], block_table=True)
    _assert_reads_backed(m, out)
    assert _live(m, 1, 1) == (5, 8)
    m.accept_drafts(1, 3)
    assert m.num_computed_tokens(1) == 115
    assert m.free(1)
    m.check_invariants()
    assert m.num_free_blocks == 63


@pytest.mark.parametrize("window", [32, 40])
@pytest.mark.parametrize("k", [3, 5])
def test_every_offset_and_acceptance_keeps_reads_backed(window: int, k: int) -> None:
    group = KVCacheGroupSpec("sliding_window", BS, 8, window=window)
    for accepted in sorted({0, k // 2, k}):
        for n in range(64, 64 + BS):
            m = _manager(window)
            m.add_sequence(1, _tokens(n, 2))
            m.step([1], 512).raise_for_error()
            drafts = list(range(100, 100 + k))
            _assert_reads_backed(m, m.step([1], 1, [[99]], draft_token_ids=[drafts], block_table=True))
            assert _live(m, 1, 1) == (_first_read(group, n) // BS, -(-(n + 1 + k) // BS))
            free = m.num_free_blocks
            released = m.accept_drafts(1, accepted)
            end = n + 1 + accepted
            gone = -(-(n + 1 + k) // BS) - -(-end // BS)
            assert [len(r) for r in released] == [gone, gone]
            assert m.num_free_blocks == free + 2 * gone
            assert _live(m, 1, 1)[0] == _first_read(group, n) // BS  # nothing left the window
            m.check_invariants()
            out = m.step([1], 1, [[98]], draft_token_ids=[drafts], block_table=True)
            assert out.context_lens.tolist() == [end]
            _assert_reads_backed(m, out)
            assert _live(m, 1, 1)[0] == _first_read(group, end) // BS
            m.accept_drafts(1, 0)
            assert m.free(1)
            m.check_invariants()
            assert m.num_free_blocks == 63


def test_a_batch_mixes_verify_steps_decodes_and_a_prefill() -> None:
    m = _manager(40)
    for seq, n in ((1, 70), (2, 93), (3, 30)):
        m.add_sequence(seq, _tokens(n, seq))
    m.step([1, 2], 512).raise_for_error()
    out = m.step([1, 2, 3], [1, 1, 512], [[5], [6], []], draft_token_ids=[[7, 8, 9], [], []], block_table=True)
    _assert_reads_backed(m, out)
    assert out.num_draft_tokens.tolist() == [3, 0, 0]
    assert np.diff(out.query_start_loc).tolist() == [4, 1, 30]
    assert [m.num_draft_tokens(s) for s in (1, 2, 3)] == [3, 0, 0]
    m.check_invariants()
    m.accept_drafts(1, 2)
    out = m.step([1, 2, 3], 1, [[4], [4], [4]], draft_token_ids=[[1], [2, 3], [5, 6, 7, 8]], block_table=True)
    _assert_reads_backed(m, out)
    for s, k in ((1, 1), (2, 2), (3, 4)):
        m.accept_drafts(s, k)
    m.check_invariants()


def test_kept_lookahead_blocks_are_filled_first() -> None:
    m = _manager(32)
    m.add_sequence(1, _tokens(110, 4))
    m.step([1], 512).raise_for_error()
    m.step([1], 1, [[5]], draft_token_ids=[[6, 7, 8, 9]]).raise_for_error()
    tables = [t.copy() for t in m.block_tables(1)]
    assert [len(r) for r in m.accept_drafts(1, 0, release_blocks=False)] == [0, 0]
    assert all((a == b).all() for a, b in zip(m.block_tables(1), tables))
    m.check_invariants()
    free = m.num_free_blocks
    out = m.step([1], 1, [[10]], draft_token_ids=[[11]], block_table=True)
    _assert_reads_backed(m, out)
    assert out.new_block_ids.tolist() == []  # the kept block 7 takes slot 112
    assert m.num_free_blocks == free + 1  # block 4 left the window
    m.accept_drafts(1, 1)
    m.check_invariants()


def test_bad_acceptances_and_drafts_are_typed_errors_and_change_nothing() -> None:
    m = _manager(32)
    m.add_sequence(1, _tokens(40, 5))
    with pytest.raises(pagedkv.InvalidSequenceStateError):
        m.accept_drafts(1, 0)
    out = m.step([1], 8, draft_token_ids=[[1, 2]])  # drafts must follow the last token
    assert isinstance(out.error, pagedkv.InvalidArgumentError) and out.num_scheduled == 0
    assert m.num_computed_tokens(1) == 0 and m.num_free_blocks == 63
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.step([1], 64, draft_token_ids=[[1], [2]])  # one row per sequence
    assert m.num_blocks_needed_with_drafts(1, 64, 3) == (6, 0)
    m.step([1], 64, draft_token_ids=[[1, 2, 3]]).raise_for_error()
    tables = [t.copy() for t in m.block_tables(1)]
    for bad in (4, -1, 1.5):
        with pytest.raises(pagedkv.InvalidArgumentError) as err:
            m.accept_drafts(1, bad)  # type: ignore[arg-type]
        assert isinstance(err.value, ValueError)
    with pytest.raises(pagedkv.InvalidSequenceStateError):
        m.append_tokens(1, [3])
    with pytest.raises(pagedkv.InvalidSequenceStateError):
        m.fork(1, 2)
    assert all((a == b).all() for a, b in zip(m.block_tables(1), tables))
    assert m.num_draft_tokens(1) == 3 and m.num_tokens(1) == 40
    m.check_invariants()
    m.preempt([1])  # drops the drafts with the rest
    assert m.num_draft_tokens(1) == 0
    m.check_invariants()
