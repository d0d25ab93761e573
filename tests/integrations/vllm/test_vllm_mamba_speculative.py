"""Speculative decoding (MTP / EAGLE drafters) with align-mode Mamba / linear-attention groups:
refused by the plug-in; this file pins why, and what serving it would have to reproduce.

1. The refusal, on the configs vLLM builds for the deployments in question (Qwen3-Next with its
   MTP drafter, EAGLE / MTP on a Nemotron-H-shaped hybrid): ``num_speculative_blocks = k`` on
   every Mamba group plus the drafter's ``speculative_config``, and a drafter without state
   blocks. Each is an ``UnsupportedVllmConfigError`` naming the setting.
2. Stock vLLM's runner-facing layout of a state group under speculative decoding, measured
   step by step with a fake worker whose greedy verifier accepts a varying number of drafts
   (``fake_drafts``: about one draft in three is wrong). These are the columns vLLM's model
   runner reads and writes (``preprocess_mamba`` / the align post-processing copy), so a
   plug-in serving this config must give the runner exactly these columns. See
   docs/design/vllm-mamba.md, "Speculative decoding (refused)".

Runs only where vLLM is installed (``make test-vllm``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import DraftTokenIds  # noqa: E402

from pagedkv.integrations.vllm import PagedKVScheduler, UnsupportedVllmConfigError  # noqa: E402
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    NEMOTRON_H_GROUPS,
    QWEN3_NEXT_GROUPS,
    build_scheduler,
    eagle_speculative_config,
    fake_drafts,
    fake_model_output,
    make_mamba_kv_cache_config,
    make_request,
    make_vllm_config,
    ngram_speculative_config,
)

BS = 16
SHAPES = pytest.mark.parametrize("groups", [QWEN3_NEXT_GROUPS, NEMOTRON_H_GROUPS], ids=["qwen3-next", "nemotron-h"])


def _config(num_blocks: int, k: int, method: str = "mtp", **kw: Any) -> Any:
    """An align-mode ``VllmConfig`` with a model-based drafter of ``k`` drafts (``method``;
    ``"ngram"``: a prompt-lookup one, no lookahead slots)."""
    base = make_vllm_config(num_blocks=num_blocks, block_size=BS, **kw)
    if method == "ngram":
        spec = ngram_speculative_config(base, k)
    else:
        spec = eagle_speculative_config(base, k, method)
    vc = make_vllm_config(num_blocks=num_blocks, block_size=BS, speculative_config=spec, **kw)
    vc.cache_config.mamba_cache_mode = "align"
    return vc


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@SHAPES
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("method", ["mtp", "eagle"])
def test_drafter_with_speculative_state_blocks_is_refused(groups: Any, k: int, method: str) -> None:
    # The deployment's config: k speculative state blocks per Mamba group and the drafter.
    kv = make_mamba_kv_cache_config(64, groups, BS, num_speculative_blocks=k)
    with pytest.raises(UnsupportedVllmConfigError) as err:
        build_scheduler(PagedKVScheduler, _config(64, k, method), kv_cache_config=kv, block_size=BS, hash_block_size=BS)
    assert err.value.field == "kv_cache_config.kv_cache_groups[0].kv_cache_spec.num_speculative_blocks"
    assert "speculative state blocks" in str(err.value)


@SHAPES
@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_drafter_without_state_blocks_is_refused(groups: Any, method: str) -> None:
    # A drafter whose Mamba groups carry no speculative state blocks (an n-gram proposer, or
    # a hand-built config): refused by the speculative_config check.
    kv = make_mamba_kv_cache_config(64, groups, BS)
    with pytest.raises(UnsupportedVllmConfigError) as err:
        build_scheduler(PagedKVScheduler, _config(64, 2, method), kv_cache_config=kv, block_size=BS, hash_block_size=BS)
    assert err.value.field == "speculative_config"


def _state_blocks(sched: Any, rid: str, g: int) -> list[Any]:
    """vLLM's own block objects of ``rid`` in group ``g`` (hash state included)."""
    return sched.kv_cache_manager.coordinator.single_type_managers[g].req_to_blocks[rid]


@SHAPES
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("pressure", [False, True], ids=["roomy", "pressure"])
def test_stock_speculative_state_layout(groups: Any, k: int, pressure: bool) -> None:
    """Stock vLLM 0.33 / 0.32, align mode with ``k`` speculative state blocks and an MTP
    drafter of ``k`` drafts, shared-prefix stream with varying acceptance, in a roomy pool and
    in a 40-block one that preempts (a resumed request's first allocation is checked as a new
    one's, and everything is freed at the end). At every step, for
    every scheduled request of ``n`` computed tokens after ``schedule()`` (drafts included)
    and every state group:

    - the table has ``cdiv(n, bs) + k`` columns: the live (running) state at
      ``c = cdiv(n, bs) - 1`` and the ``k`` speculative blocks right after it, all real,
      distinct and never hashed; the state groups agree column by column on which are null;
    - below ``c`` the only real column (past a first allocation, whose prefix hit's state
      shows there) is the one the live state last moved out of, kept while the computed
      tokens have not passed its end: with drafts, until accepted tokens cross it;
    - ``n`` only grows step to step (a rejected draft rolls ``num_computed_tokens`` back, but
      the next verify step reaches past the previous end), so the table never shrinks;
    - the runner's post-step copy of an aligned state (the accepted tokens cross a boundary
      ``A``; it writes column ``A / bs - 1``) always lands on a real block: the live column,
      or the previous live column when the drafts ran past ``A`` (counted: those are steps
      where a state group that frees the previous live block when the live state moves, as
      pagedkv's do, would have the runner write into a freed block);
    - a state is hashed at allocation only between the computed and the known tokens (the
      step's known end, hashed before the step writes it as without drafts, or the computed
      count when the previous step's accepted tokens ended exactly there): never a
      speculative block, never a state only drafts reached, and not a state the accepted
      tokens ran past within one step (the runner wrote it, vLLM frees its column before an
      allocation hashes it; counted).

    Nothing is left held at the end."""
    rng = random.Random(11 + k)
    prefix = [rng.randrange(100, 4000) for _ in range(70)]
    num_blocks = 40 if pressure else 800
    vc = _config(num_blocks, k, max_num_batched_tokens=64, max_num_seqs=8)
    kv = make_mamba_kv_cache_config(num_blocks, groups, BS, num_speculative_blocks=k)
    sched = build_scheduler(Scheduler, vc, kv_cache_config=kv, block_size=BS, hash_block_size=BS)
    state = [g for g, kind in enumerate(groups) if kind != "full"]
    arrivals = {2 * i: f"r{i}" for i in range(8)}
    live_before: dict[str, int] = {}
    moved_from: dict[str, int] = {}
    hashed_at: dict[str, set[int]] = {}
    written: dict[str, set[int]] = {}
    tables_before: dict[str, list[list[int]]] = {}
    end_before: dict[str, int] = {}
    figures = {
        "preemptions": 0,
        "hit_tokens": 0,
        "verify_steps": 0,
        "aligned_copies": 0,
        "into_previous_live": 0,
        "drafts": 0,
        "accepted": 0,
    }
    for step in range(2000):
        if step in arrivals:
            prompt = prefix + [rng.randrange(100, 4000) for _ in range(rng.randrange(1, 50))]
            sched.add_request(make_request(arrivals[step], prompt, rng.randrange(20, 60), block_size=BS))
        if step > max(arrivals) and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        first = {r.req_id for r in out.scheduled_new_reqs} | set(out.scheduled_cached_reqs.resumed_req_ids)
        figures["preemptions"] += len(out.preempted_req_ids or ())
        figures["hit_tokens"] += sum(r.num_computed_tokens for r in out.scheduled_new_reqs)
        spec = out.scheduled_spec_decode_tokens
        cached = out.scheduled_cached_reqs
        new_ids = dict(zip(cached.req_ids, cached.new_block_ids, strict=True))
        model_out = fake_model_output(sched, out)
        for rid, num in out.num_scheduled_tokens.items():
            request = sched.requests[rid]
            n = request.num_computed_tokens  # after schedule(): the drafts included
            # vLLM hashes a state at allocation, only between the computed tokens and the
            # known ones: the state at the step's known end (written by this step), or at the
            # computed count (the previous step's accepted tokens ended exactly there).
            now = {(j + 1) * BS for j, b in enumerate(_state_blocks(sched, rid, state[0])) if b.block_hash is not None}
            for end in now - hashed_at.setdefault(rid, set()):
                assert n - num <= end <= min(n, request.num_tokens), f"step {step} {rid}: state at {end} hashed"
            hashed_at[rid] |= now
            live = _cdiv(n, BS) - 1
            assert n > end_before.get(rid, 0) or rid in first, f"step {step} {rid}: end {n} went back"
            if rid in first:
                moved_from.pop(rid, None)
                # A first allocation takes the live block and the k speculative blocks; a
                # prefix hit's state shows at its column (the runner's copy source).
                hit = request.num_computed_tokens - num
                for g in state:
                    table = sched.kv_cache_manager.get_block_ids(rid)[g]
                    hit_col = [hit // BS - 1] if hit else []
                    assert [j for j, b in enumerate(table) if b != 0] == hit_col + list(range(live, live + 1 + k))
            else:
                # What the runner appends to its table: the table's new columns; a move of the
                # live state takes exactly one fresh block (the others are speculative blocks
                # moved to the end), no move none.
                added = new_ids.get(rid)
                for g in state:
                    got = list(added[g]) if added is not None else []
                    table = sched.kv_cache_manager.get_block_ids(rid)[g]
                    assert got == table[len(table) - len(got) :]
                    fresh = [b for b in got if b != 0 and b not in tables_before[rid][g][live_before[rid] + 1 :]]
                    moved = live != live_before[rid]
                    assert len(fresh) == int(moved), f"step {step} {rid}: new {got}, live {live}"
                if live != live_before[rid]:
                    moved_from[rid] = live_before[rid]
            tables = [sched.kv_cache_manager.get_block_ids(rid)[g] for g in state]
            nulls = [[b == 0 for b in t] for t in tables]
            assert all(x == nulls[0] for x in nulls), f"step {step} {rid}: state groups differ {tables}"
            for g, table in zip(state, tables, strict=True):
                assert len(table) == live + 1 + k, f"step {step} {rid} group {g}: {table} for n={n}"
                spec_cols = table[live:]
                assert 0 not in spec_cols and len(set(spec_cols)) == k + 1, f"step {step} {rid}: {table}"
                blocks = _state_blocks(sched, rid, g)
                assert all(b.block_hash is None for b in blocks[live + 1 :]), f"step {step} {rid}: hashed spec block"
                below = [j for j in range(live) if table[j] != 0]
                if rid not in first:
                    # vLLM keeps the column the live state last moved out of until the
                    # computed tokens pass its end (a post-step copy may still write there).
                    prev = moved_from.get(rid, -1)
                    keep = 0 <= prev < live and n - num <= (prev + 1) * BS
                    assert below == ([prev] if keep else []), f"step {step} {rid}: real {below}, live {live}"
            drafts = len(spec.get(rid, ()))
            if drafts and rid not in first:
                figures["verify_steps"] += 1
                accepted = len(model_out.sampled_token_ids[model_out.req_id_to_index[rid]]) - 1
                figures["drafts"] += drafts
                figures["accepted"] += accepted
                running = n - drafts  # the state after the step's one known token
                new_computed = running + accepted
                aligned = new_computed // BS * BS
                if aligned >= running:
                    dest = aligned // BS - 1
                    figures["aligned_copies"] += 1
                    written.setdefault(rid, set()).add(aligned)
                    assert dest in (live, live - 1)
                    for g in state:
                        table = sched.kv_cache_manager.get_block_ids(rid)[g]
                        assert table[dest] != 0, f"step {step} {rid}: aligned copy into null column {dest}"
                    if dest == live - 1:
                        figures["into_previous_live"] += 1
            live_before[rid] = live
            tables_before[rid] = [list(t) for t in sched.kv_cache_manager.get_block_ids(rid)]
            end_before[rid] = n
        sched.update_from_output(out, model_out)
        # Only accepted tokens are hashed: every hashed state sits at or below the known tokens.
        for rid in out.num_scheduled_tokens:
            request = sched.requests.get(rid)
            if request is None or request.is_finished():
                continue
            for g in state:
                for j, b in enumerate(_state_blocks(sched, rid, g)):
                    if b.block_hash is not None and not b.is_null:
                        assert (j + 1) * BS <= request.num_tokens, f"step {step} {rid}: draft state hashed"
        running_ids = [r.request_id for r in sched.running if not r.is_finished()]
        sched.update_draft_token_ids(
            DraftTokenIds(running_ids, [fake_drafts(r, sched.requests[r].num_tokens, k) for r in running_ids])
        )
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError("stream did not finish")
    assert sched.kv_cache_manager.usage == 0.0
    assert figures["accepted"] < figures["drafts"], "some drafts must be rejected"
    if not pressure:
        assert figures["hit_tokens"] > 0, "the shared prefix's state must be hit"
        assert figures["into_previous_live"] > 0, "the stream must cross a boundary inside the drafts"
    # The small pool preempts (a resumed request's first allocation is checked as a new one's).
    assert (figures["preemptions"] > 0) == pressure
    # States the runner wrote at an aligned end that vLLM never hashed: the accepted tokens
    # ran past the end within one step, so the column was freed before an allocation could
    # hash it (a plug-in publishing every written state would hit where vLLM misses).
    figures["written_never_hashed"] = sum(len(w - hashed_at.get(rid, set())) for rid, w in written.items())
    # One draft cannot run past an end within a step; a state its acceptance ends on is hashed
    # by the request's next allocation, unless it is preempted or finishes first (the pool).
    if not pressure:
        assert (figures["written_never_hashed"] > 0) == (k > 1)
    print(f"{groups} k={k}: {figures}")
