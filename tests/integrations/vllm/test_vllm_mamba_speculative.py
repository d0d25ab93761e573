"""Speculative decoding (MTP / EAGLE drafters) with align-mode Mamba / linear-attention groups:
served by the plug-in with pagedkv's speculative state blocks
(``spare_blocks = k`` on pagedkv's state groups).

1. What is served and what stays refused, on the configs vLLM builds for the deployments in
   question (Qwen3-Next with its MTP drafter, EAGLE / MTP on a Nemotron-H-shaped hybrid):
   ``num_speculative_blocks = k`` on every Mamba group plus a model-based drafter is served;
   a drafter without state blocks, state blocks without a model-based drafter, more drafts
   than blocks, Mamba groups of different ``k`` and async scheduling with drafts are each an
   ``UnsupportedVllmConfigError`` naming the setting.
2. Stock vLLM's runner-facing layout of a state group under speculative decoding, measured
   step by step with a fake worker whose greedy verifier accepts a varying number of drafts
   (``fake_drafts``: about one draft in three is wrong): the columns vLLM's model runner
   reads and writes (``preprocess_mamba`` / the align post-processing copy).
3. Stock vs plug-in in lockstep on that stream (both shapes, ``k`` = 1..3, vLLM 0.33 and 0.32):
   scheduled tokens, prefix hits, preemptions, outputs, blocks held per group (table length
   and real blocks), each state group's null columns, and the new block ids the runner
   appends, classified as null / a block moved from column ``j`` / fresh, are equal at every
   step; the runner's post-step copy of an aligned state always lands on a block the plug-in
   holds. In a 40-block pool the two diverge once their pools evict different cached blocks
   (figures in docs/design/vllm-mamba.md, "Speculative decoding").

Runs only where vLLM is installed (``make test-vllm``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import DraftTokenIds  # noqa: E402

from pagedkv.integrations.vllm import (  # noqa: E402
    PagedKVCacheManager,
    PagedKVScheduler,
    UnsupportedVllmConfigError,
)
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    NEMOTRON_H_GROUPS,
    QWEN3_NEXT_GROUPS,
    Driver,
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
def test_drafter_with_speculative_state_blocks_is_served(groups: Any, k: int, method: str) -> None:
    # The deployment's config: k speculative state blocks per Mamba group and the drafter.
    kv = make_mamba_kv_cache_config(64, groups, BS, num_speculative_blocks=k)
    sched = build_scheduler(
        PagedKVScheduler, _config(64, k, method), kv_cache_config=kv, block_size=BS, hash_block_size=BS
    )
    kvm = sched.kv_cache_manager
    assert isinstance(kvm, PagedKVCacheManager)
    assert kvm.state_speculative_blocks == k
    config = kvm.manager.config
    assert [g.spare_blocks for g in config.groups if g.kind == "state"] == [k] * sum(
        g.kind == "state" for g in config.groups
    )
    assert all(g.spare_blocks == 0 for g in config.groups if g.kind != "state")


def _refused(vc: Any, kv: Any) -> UnsupportedVllmConfigError:
    with pytest.raises(UnsupportedVllmConfigError) as err:
        build_scheduler(PagedKVScheduler, vc, kv_cache_config=kv, block_size=BS, hash_block_size=BS)
    return err.value


@SHAPES
def test_speculative_state_block_refusals_are_named(groups: Any) -> None:
    field = "kv_cache_config.kv_cache_groups[{}].kv_cache_spec.num_speculative_blocks"
    first = next(g for g, kind in enumerate(groups) if kind != "full")
    # State blocks without a drafter.
    kv = make_mamba_kv_cache_config(64, groups, BS, num_speculative_blocks=2)
    vc = make_vllm_config(num_blocks=64, block_size=BS)
    vc.cache_config.mamba_cache_mode = "align"
    err = _refused(vc, kv)
    assert err.field == field.format(first)
    assert "with a drafter" in str(err)
    # A prompt-lookup (n-gram) drafter with state blocks is served (no lookahead slots).
    sched = build_scheduler(
        PagedKVScheduler, _config(64, 2, "ngram"), kv_cache_config=kv, block_size=BS, hash_block_size=BS
    )
    assert sched.kv_cache_manager.state_speculative_blocks == 2
    # More drafts than state blocks.
    kv = make_mamba_kv_cache_config(64, groups, BS, num_speculative_blocks=1)
    err = _refused(_config(64, 2, "mtp"), kv)
    assert err.field == "speculative_config.num_speculative_tokens"
    # Mamba groups of different k.
    kv = make_mamba_kv_cache_config(64, groups, BS, num_speculative_blocks=2)
    last = max(g for g, kind in enumerate(groups) if kind != "full")
    object.__setattr__(kv.kv_cache_groups[last].kv_cache_spec, "num_speculative_blocks", 3)
    err = _refused(_config(64, 2, "mtp"), kv)
    assert "same number" in str(err)
    # Async scheduling with drafts.
    kv = make_mamba_kv_cache_config(64, groups, BS, num_speculative_blocks=2)
    vc = _config(64, 2, "mtp")
    vc.scheduler_config.async_scheduling = True
    err = _refused(vc, kv)
    assert err.field == "scheduler_config.async_scheduling"


@SHAPES
def test_speculative_state_blocks_with_a_kv_connector_are_refused(groups: Any) -> None:
    # A P/D connector is served beside align-mode Mamba groups, a drafter too, not both: an
    # external load lays out no speculative state blocks.
    from test_vllm_connectors import _nixl
    from vllm.config import KVTransferConfig

    first = next(g for g, kind in enumerate(groups) if kind != "full")
    transfer = KVTransferConfig(**_nixl("kv_consumer"))
    kv = make_mamba_kv_cache_config(64, groups, BS, num_speculative_blocks=2)
    err = _refused(_config(64, 2, "mtp", kv_transfer_config=transfer), kv)
    assert err.field == f"kv_cache_config.kv_cache_groups[{first}].kv_cache_spec.num_speculative_blocks"
    assert "KV connector" in str(err)


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


def _columns(new_ids: list[int], before: list[int]) -> list[Any]:
    """The runner-facing shape of a state group's new ids: null, a block moved from column
    ``j`` of the table before the step, or fresh."""
    where = {b: j for j, b in enumerate(before) if b != 0}
    return ["null" if b == 0 else ("moved", where[b]) if b in where else "fresh" for b in new_ids]


class _Capture:
    """Wraps a scheduler's ``schedule()`` to keep its last output (the new block ids)."""

    def __init__(self, sched: Any) -> None:
        self.out: Any = None
        orig = sched.schedule

        def schedule() -> Any:
            self.out = orig()
            return self.out

        sched.schedule = schedule


def _spec_lockstep(
    groups: Any, k: int, num_blocks: int, *, strict: bool, method: str = "mtp"
) -> tuple[Driver, Driver, dict[str, int]]:
    """Stock vLLM and the plug-in on the shared-prefix stream of
    ``test_stock_speculative_state_layout`` (8 requests sharing a 70-token prefix, MTP with
    ``k`` drafts and ``k`` speculative state blocks, ``fake_drafts`` rejecting about one in
    three), in lockstep. ``strict``: every step's record, blocks held, state-group null
    columns and new-id shapes equal (else only the figures are gathered). Returns both
    drivers and the figures (steps, steps equal, preemptions and hit tokens per side, the
    plug-in's aligned post-step copies and those into the column the live state left)."""
    rng = random.Random(11 + k)
    prefix = [rng.randrange(100, 4000) for _ in range(70)]
    arrivals = {
        2 * i: (
            f"r{i}",
            prefix + [rng.randrange(100, 4000) for _ in range(rng.randrange(1, 50))],
            rng.randrange(20, 60),
        )
        for i in range(8)
    }
    drivers, captures = [], []
    for cls in (Scheduler, PagedKVScheduler):
        kv = make_mamba_kv_cache_config(num_blocks, groups, BS, num_speculative_blocks=k)
        vc = _config(num_blocks, k, method, max_num_batched_tokens=64, max_num_seqs=8)
        sched = build_scheduler(cls, vc, kv_cache_config=kv, block_size=BS, hash_block_size=BS)
        captures.append(_Capture(sched))
        drivers.append(Driver(sched, num_drafts=k))
    stock, paged = drivers
    kvm = paged.scheduler.kv_cache_manager
    assert isinstance(kvm, PagedKVCacheManager)
    state = [g for g, kind in enumerate(groups) if kind != "full"]
    figures = {
        "steps": 0,
        "steps_equal": 0,
        "stock_preemptions": 0,
        "paged_preemptions": 0,
        "stock_hit_tokens": 0,
        "paged_hit_tokens": 0,
        "aligned_copies": 0,
        "into_left_column": 0,
    }
    before: list[dict[str, list[list[int]]]] = [{}, {}]
    for step in range(3000):
        if step in arrivals:
            rid, prompt, max_tokens = arrivals[step]
            for d in drivers:
                d.add(make_request(rid, prompt, max_tokens, block_size=BS))
        if step > max(arrivals) and not any(d.scheduler.has_unfinished_requests() for d in drivers):
            break
        # The verify step's drafts and its computed count, before the step (plug-in side).
        pending = {
            r.request_id: (r.num_computed_tokens, len(r.spec_token_ids or ()))
            for r in paged.scheduler.running
            if not r.is_finished()
        }
        recs = [d.step() for d in drivers]
        figures["steps"] += 1
        for side, rec in zip(("stock", "paged"), recs, strict=True):
            figures[f"{side}_preemptions"] += len(rec["preempted"])
            figures[f"{side}_hit_tokens"] += sum(rec["new_prefix_hits"].values())
        shapes = []
        for i, cap in enumerate(captures):
            out = cap.out
            cached = out.scheduled_cached_reqs
            added = dict(zip(cached.req_ids, cached.new_block_ids, strict=True))
            view: dict[str, Any] = {}
            for rid in out.num_scheduled_tokens:
                prev = before[i].get(rid)
                ids = added.get(rid)
                view[rid] = tuple(
                    _columns(list(ids[g]) if ids is not None else [], prev[g])
                    if prev is not None and rid not in cached.resumed_req_ids
                    else None
                    for g in state
                )
            shapes.append(view)
        held = [rec.pop("blocks_held") for rec in recs]
        a, b = recs
        same = a == b and held[0] == held[1] and shapes[0] == shapes[1]
        figures["steps_equal"] += same
        if strict:
            assert a == b, f"step {step} differs:\nstock {a}\npaged {b}"
            assert held[1] == held[0], f"step {step}: blocks held\nstock {held[0]}\npaged {held[1]}"
            assert shapes[1] == shapes[0], f"step {step}: new state columns\nstock {shapes[0]}\npaged {shapes[1]}"
        # The state groups' tables after the step's allocation (the runner's view): equal
        # null columns, and the aligned post-step copy of each verify step lands on a block
        # the plug-in holds.
        for i, d in enumerate(drivers):
            before[i] = {}
            for r in d.scheduler.running:
                if not r.is_finished():
                    before[i][r.request_id] = [
                        list(t) for t in d.scheduler.kv_cache_manager.get_block_ids(r.request_id)
                    ]
        for rid, (computed, drafts) in pending.items():
            if not drafts or rid not in b["scheduled"] or rid not in before[1]:
                continue
            request = paged.scheduler.requests.get(rid)
            if request is None or request.is_finished():
                continue
            known = computed + 1
            new_computed = request.num_computed_tokens
            aligned = new_computed // BS * BS
            if aligned >= known:
                figures["aligned_copies"] += 1
                dest = aligned // BS - 1
                live = _cdiv(known + drafts, BS) - 1
                figures["into_left_column"] += dest < live
                for g in state:
                    assert before[1][rid][g][dest] != 0, f"step {step} {rid}: aligned copy into null column {dest}"
        if strict:
            assert before[1].keys() == before[0].keys()
            for rid in before[1]:
                masks = [[[b == 0 for b in before[i][rid][g]] for g in state] for i in (0, 1)]
                assert masks[1] == masks[0], f"step {step} {rid}: null columns differ"
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError("streams did not finish")
    kvm.manager.check_invariants()
    assert kvm.manager.num_sequences == 0
    assert stock.scheduler.kv_cache_manager.usage == 0.0
    assert kvm.usage == 0.0
    # Outputs and finish reasons are equal in every case (a greedy verifier: decoding's tokens).
    assert paged.outputs == stock.outputs
    assert paged.finish_reasons == stock.finish_reasons
    return stock, paged, figures


@SHAPES
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_speculative_state_blocks_match_stock_step_by_step(groups: Any, k: int, method: str) -> None:
    # vLLM gives Mamba groups num_speculative_blocks = k for every drafter (n-gram too: its
    # drafts advance the state as a model's do), without lookahead slots for a prompt-lookup one.
    stock, paged, figures = _spec_lockstep(groups, k, 800, strict=True, method=method)
    assert paged.drafts_scheduled == stock.drafts_scheduled
    assert paged.drafts_accepted == stock.drafts_accepted < stock.drafts_scheduled
    assert figures["steps_equal"] == figures["steps"]
    assert figures["paged_hit_tokens"] == figures["stock_hit_tokens"] > 0
    assert figures["aligned_copies"] > 0
    # The runner's copies into the column the live state left: the plug-in holds it.
    assert figures["into_left_column"] > 0
    print(f"{groups} k={k}: {figures}, drafts {stock.drafts_accepted}/{stock.drafts_scheduled}")


@SHAPES
@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_state_blocks_under_memory_pressure(groups: Any, k: int) -> None:
    """A 40-block pool that preempts: outputs and finish reasons equal, nothing leaked, every
    aligned copy on a held block; the schedules diverge once the two pools evict different
    cached blocks (figures printed, quoted in the design doc)."""
    stock, paged, figures = _spec_lockstep(groups, k, 40, strict=False)
    assert figures["stock_preemptions"] > 0
    print(f"{groups} k={k}: {figures}")
