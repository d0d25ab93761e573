"""Hybrid models in vLLM's real V1 Scheduler: stock vLLM's hybrid KV cache coordinator (its own
``KVCacheManager`` over a ``KVCacheConfig`` of several groups) vs ``PagedKVScheduler`` (backed by
``pagedkv.KVCacheManager`` with its groups) on the same request streams.

Both run with the fake model of ``pagedkv.testing.vllm_scheduler``. Step by step they must agree
on the scheduled tokens, prefix hits of new and resumed requests, preemptions, finished
requests, new tokens, and, per KV cache group, each scheduled request's table length and the
real (non-null) blocks in it: the blocks released out of the window as the sequence grows.
That holds with dense retention (vLLM's ``prefix_cache_retention_interval=None``, pagedkv's 0).
vLLM's sparse retention (its default ``0``, or an interval) keeps other window blocks than
pagedkv's (vLLM pins shared-prefix junctions, pagedkv keeps each sequence's latest replayable
point and holds about one block more per window group), so there the outputs must agree and
both hit counts are asserted and printed.

Runs only where vLLM is installed (``make test-vllm``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

import torch  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from pagedkv.integrations.vllm import (  # noqa: E402
    PagedKVCacheManager,
    PagedKVScheduler,
    UnsupportedVllmConfigError,
)
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    GEMMA3_GROUPS,
    Driver,
    build_scheduler,
    make_hybrid_kv_cache_config,
    make_request,
    make_vllm_config,
    ngram_speculative_config,
)

BS = 16
# A Llama 4 style mix: full attention, chunked-local attention, and a short sliding window.
CHUNKED_GROUPS = (("full", None), ("chunked_local", 64), ("chunked_local", 64), ("sliding_window", 48))


def _pair(groups: Any, num_blocks: int, retention: int | None = None, **config: Any) -> tuple[Driver, Driver]:
    drivers = []
    for cls in (Scheduler, PagedKVScheduler):
        kv = make_hybrid_kv_cache_config(num_blocks, groups, BS, retention_interval=retention)
        drivers.append(
            Driver(build_scheduler(cls, make_vllm_config(num_blocks=num_blocks, **config), kv_cache_config=kv))
        )
    return drivers[0], drivers[1]


def _lockstep(
    groups: Any,
    stream: dict[int, list[tuple[str, list[int], int]]],
    *,
    num_blocks: int,
    strict: bool = True,
    retention: int | None = None,
    **config: Any,
) -> tuple[Driver, Driver, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Feeds ``stream`` (step -> (id, prompt, max_tokens)) to both schedulers in lockstep."""
    stock, paged = _pair(groups, num_blocks, retention, **config)
    assert isinstance(paged.scheduler.kv_cache_manager, PagedKVCacheManager)
    assert paged.scheduler.kv_cache_manager.num_kv_cache_groups == len(groups)
    records = []
    last = max(stream)
    for step in range(5000):
        for rid, prompt, max_tokens in stream.get(step, []):
            stock.add(make_request(rid, prompt, max_tokens, block_size=BS))
            paged.add(make_request(rid, prompt, max_tokens, block_size=BS))
        if step > last and not stock.scheduler.has_unfinished_requests():
            assert not paged.scheduler.has_unfinished_requests()
            break
        a, b = stock.step(), paged.step()
        if strict:
            assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
        records.append((a, b))
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError("streams did not finish")
    assert not paged.scheduler.has_unfinished_requests()
    kvm = paged.scheduler.kv_cache_manager.manager
    kvm.check_invariants()
    assert kvm.num_sequences == 0
    assert stock.scheduler.kv_cache_manager.usage == 0.0
    assert paged.scheduler.kv_cache_manager.usage == 0.0
    return stock, paged, records


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 4000) for _ in range(n)]


def _shared_prefix_stream(rng: random.Random, prefix: list[int], n: int, tail: tuple[int, int], spread: int) -> Any:
    stream: dict[int, list[tuple[str, list[int], int]]] = {}
    for i in range(n):
        prompt = prefix + _tokens(rng, rng.randrange(*tail))
        stream.setdefault(rng.randrange(0, spread), []).append((f"r{i}", prompt, rng.randrange(1, 40)))
    return stream


def test_gemma3_pattern_prompts_past_the_window_match_stock_step_by_step() -> None:
    # Gemma 3: 1 full + 5 sliding-window groups (W = 512); prompts of 600-1100 tokens behind a
    # 560-token shared prefix, chunked at 256 tokens per step.
    rng = random.Random(11)
    prefix = _tokens(rng, 560)
    stream = _shared_prefix_stream(rng, prefix, 8, (40, 540), 12)
    stock, paged, records = _lockstep(GEMMA3_GROUPS, stream, num_blocks=2048, max_num_batched_tokens=256)
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits
    assert max(paged.prefix_hits.values()) >= 544, "the shared prefix past the window must hit"
    # Out-of-window blocks were released: some sliding-window table held null entries.
    released = [
        g
        for _, b in records
        for held in b["blocks_held"].values()
        for g, (length, real) in enumerate(held)
        if real < length
    ]
    assert released and set(released) <= {1, 2, 3, 4, 5}, "only sliding-window groups release blocks"
    # A sliding-window group never holds more than the window's blocks plus the chunk's.
    for _, b in records:
        for held in b["blocks_held"].values():
            assert all(real <= -(-(511 + 256) // BS) + 1 for _, real in held[1:])


def test_chunked_local_and_sliding_groups_match_stock_step_by_step() -> None:
    rng = random.Random(5)
    prefix = _tokens(rng, 100)
    stream = _shared_prefix_stream(rng, prefix, 14, (1, 200), 10)
    stock, paged, records = _lockstep(CHUNKED_GROUPS, stream, num_blocks=400, max_num_batched_tokens=128)
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits
    assert sum(paged.prefix_hits.values()) > 0
    # Chunked-local groups release whole chunks behind the query.
    assert any(real < length for _, b in records for h in b["blocks_held"].values() for length, real in h[1:3])


def test_chunked_local_and_sliding_groups_under_preemption() -> None:
    # 60 blocks for 14 requests: admission fails and running requests are preempted. When two
    # requests computed the same prefix block in one step, it is cached twice; vLLM's hit takes
    # the first cached copy even if it is free, pagedkv's the copy in use, so vLLM can take one
    # block more for the same hit and admission diverges later (a documented difference of the
    # one-group plug-in too): outputs and finish reasons must still agree.
    rng = random.Random(5)
    prefix = _tokens(rng, 100)
    stream = _shared_prefix_stream(rng, prefix, 14, (1, 200), 10)
    stock, paged, records = _lockstep(CHUNKED_GROUPS, stream, num_blocks=60, strict=False, max_num_batched_tokens=128)
    assert paged.outputs == stock.outputs
    assert paged.finish_reasons == stock.finish_reasons
    for side in (0, 1):
        assert any(r[side]["preempted"] for r in records), "the small pool must preempt"
    print(f"preemption: hit tokens stock {sum(stock.prefix_hits.values())}, pagedkv {sum(paged.prefix_hits.values())}")


@pytest.mark.parametrize("groups", [(("sliding_window", 64),), (("chunked_local", 64),)])
def test_one_windowed_group_matches_stock_step_by_step(groups: Any) -> None:
    # A model of sliding-window (or chunked-local) layers only: one group, served by the
    # groups manager (vLLM's tests of in-flight window freeing build this; it was refused).
    rng = random.Random(3)
    prefix = _tokens(rng, 120)
    stream = _shared_prefix_stream(rng, prefix, 10, (1, 150), 8)
    stock, paged, records = _lockstep(groups, stream, num_blocks=300, max_num_batched_tokens=96)
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits
    assert any(real < length for _, b in records for ((length, real),) in b["blocks_held"].values())


def test_eviction_pressure_many_prefixes() -> None:
    # More distinct prefixes than the pool caches: cached blocks of every group are evicted.
    rng = random.Random(8)
    prefixes = [_tokens(rng, 96) for _ in range(6)]
    stream: dict[int, list[tuple[str, list[int], int]]] = {}
    for i in range(30):
        prompt = prefixes[rng.randrange(6)] + _tokens(rng, rng.randrange(1, 80))
        stream.setdefault(i * 2, []).append((f"e{i}", prompt, rng.randrange(1, 20)))
    stock, paged, _ = _lockstep(CHUNKED_GROUPS, stream, num_blocks=80, strict=False, max_num_batched_tokens=128)
    assert paged.outputs == stock.outputs
    hits_stock, hits_paged = sum(stock.prefix_hits.values()), sum(paged.prefix_hits.values())
    print(f"eviction pressure: prefix-hit tokens stock {hits_stock}, pagedkv {hits_paged}")
    assert hits_stock > 0 and hits_paged > 0


@pytest.mark.parametrize("retention", [0, 256])
def test_sparse_retention_hits_reported(retention: int) -> None:
    # vLLM's sparse retention (0, its default: the replay boundary and the shared-prefix
    # junctions it detects; 256: also every 256 tokens) against pagedkv's (0: dense, as vLLM's
    # None; 256: every 256 tokens plus each sequence's latest replayable point).
    rng = random.Random(21)
    prefix = _tokens(rng, 600)
    first = prefix + _tokens(rng, 30)
    stream: dict[int, list[tuple[str, list[int], int]]] = {0: [("first", first, 8)]}
    for i in range(6):
        stream.setdefault(40 + i * 3, []).append((f"s{i}", prefix + _tokens(rng, rng.randrange(20, 300)), 8))
    # The same turn extended: the first request's prompt plus more.
    stream.setdefault(70, []).append(("extend", first + _tokens(rng, 40), 8))
    stock, paged, _ = _lockstep(
        GEMMA3_GROUPS, stream, num_blocks=2048, retention=retention, strict=False, max_num_batched_tokens=256
    )
    assert paged.outputs == stock.outputs
    print(f"retention {retention}: prefix hits stock {stock.prefix_hits}, pagedkv {paged.prefix_hits}")
    assert paged.scheduler.kv_cache_manager.retention_interval == retention
    siblings = [f"s{i}" for i in range(6)]
    assert stock.prefix_hits["first"] == paged.prefix_hits["first"] == 0
    assert stock.prefix_hits["extend"] == paged.prefix_hits["extend"] == 624
    # pagedkv serves every sibling the 592 tokens of the shared prefix (37 blocks)...
    assert [paged.prefix_hits[s] for s in siblings] == [592] * 6
    if retention == 0:
        # ...vLLM only once the first sibling has pinned the junction: the first sibling
        # recomputes it (vLLM kept only the first request's replay boundary).
        assert [stock.prefix_hits[s] for s in siblings] == [0] + [592] * 5
    else:
        # ...and so does vLLM with a 256-token interval.
        assert [stock.prefix_hits[s] for s in siblings] == [592] * 6


def test_dense_retention_hits_equal_stock() -> None:
    rng = random.Random(21)
    prefix = _tokens(rng, 600)
    stream: dict[int, list[tuple[str, list[int], int]]] = {0: [("first", prefix + _tokens(rng, 30), 8)]}
    for i in range(4):
        stream.setdefault(40 + i * 3, []).append((f"s{i}", prefix + _tokens(rng, rng.randrange(20, 300)), 8))
    stock, paged, _ = _lockstep(GEMMA3_GROUPS, stream, num_blocks=2048, max_num_batched_tokens=256)
    assert paged.prefix_hits == stock.prefix_hits
    assert all(paged.prefix_hits[f"s{i}"] == 592 for i in range(4))


def test_block_ids_per_group_and_released_entries_are_null() -> None:
    kv = make_hybrid_kv_cache_config(256, (("full", None), ("sliding_window", 32)), BS)
    sched = build_scheduler(PagedKVScheduler, make_vllm_config(num_blocks=256), kv_cache_config=kv)
    driver = Driver(sched)
    driver.add(make_request("a", list(range(200, 300)), 30, block_size=BS))
    for _ in range(20):
        driver.step()
    full, window = sched.kv_cache_manager.get_block_ids("a")
    n = sched.requests["a"].num_computed_tokens
    assert len(full) == len(window) == -(-n // BS)
    assert 0 not in full
    # A query after n computed tokens reads from n - 31: blocks before that one are null.
    first = (n - 31) // BS
    assert window[:first] == [0] * first and 0 not in window[first:]
    assert not set(full) & set(window[first:]), "groups never share a page"


def _build(kv: Any, **vllm_kw: Any) -> Any:
    cfg = make_vllm_config(num_blocks=kv.num_blocks, **vllm_kw)
    return PagedKVScheduler(
        vllm_config=cfg,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BS,
    )


def test_mamba_group_outside_align_mode_refused_by_name() -> None:
    # vLLM's default Mamba cache mode ("none": one state per request, outside the prefix
    # cache) is served with prefix caching off (test_vllm_mamba_none.py); with prefix caching
    # on (vLLM switches to align mode then) it is refused naming the setting; align mode is
    # served (test_vllm_mamba.py).
    attn = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    mamba = MambaSpec(block_size=BS, shapes=((2, 4),), dtypes=(torch.float32,))
    kv = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["a"], attn), KVCacheGroupSpec(["m"], mamba)],
    )
    with pytest.raises(UnsupportedVllmConfigError, match="Mamba") as err:
        _build(kv)
    assert err.value.field == "cache_config.enable_prefix_caching"
    assert err.value.value == "True"
    assert "'none'" in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("k", [2, 4])
def test_speculative_decoding_with_windowed_groups_matches_stock(k: int) -> None:
    # n-gram speculation on a hybrid model (refused before the groups manager took drafts):
    # drafts get lookahead slots in every group; stock and plug-in agree step by step, and the
    # outputs equal decoding without drafts.
    rng = random.Random(9)
    prefix = _tokens(rng, 70)
    stream = _shared_prefix_stream(rng, prefix, 8, (1, 100), 6)
    runs = []
    for cls in (Scheduler, PagedKVScheduler):
        base = make_vllm_config(num_blocks=400, max_num_batched_tokens=128)
        cfg = make_vllm_config(
            num_blocks=400, max_num_batched_tokens=128, speculative_config=ngram_speculative_config(base, k)
        )
        kv = make_hybrid_kv_cache_config(400, CHUNKED_GROUPS, BS)
        d = Driver(build_scheduler(cls, cfg, kv_cache_config=kv), num_drafts=k)
        records = []
        for step in range(3000):
            for rid, prompt, max_tokens in stream.get(step, []):
                d.add(make_request(rid, prompt, max_tokens, block_size=BS))
            if step > max(stream) and not d.scheduler.has_unfinished_requests():
                break
            records.append(d.step())
        runs.append((d, records))
    (stock, a), (paged, b) = runs
    assert b == a
    assert paged.drafts_accepted == stock.drafts_accepted > 0
    kvm = paged.scheduler.kv_cache_manager.manager
    kvm.check_invariants()
    assert kvm.num_sequences == 0
    plain, _ = _pair(CHUNKED_GROUPS, 400, max_num_batched_tokens=128)
    for step in range(3000):
        for rid, prompt, max_tokens in stream.get(step, []):
            plain.add(make_request(rid, prompt, max_tokens, block_size=BS))
        if step > max(stream) and not plain.scheduler.has_unfinished_requests():
            break
        plain.step()
    assert paged.outputs == plain.outputs


def test_kv_events_name_their_group_and_kind() -> None:
    from vllm.distributed.kv_events import BlockStored

    groups = (("full", None), ("sliding_window", 32))
    kv = make_hybrid_kv_cache_config(256, groups, BS)
    sched = build_scheduler(PagedKVScheduler, make_vllm_config(num_blocks=256, kv_events=True), kv_cache_config=kv)
    sched.add_request(make_request("a", list(range(200, 264)), 2, block_size=BS))
    sched.schedule()  # allocates and caches; update_from_output would publish the events
    stored = [e for e in sched.kv_cache_manager.take_events() if isinstance(e, BlockStored)]
    by_group = {e.group_idx: e for e in stored}
    assert set(by_group) == {0, 1}
    assert by_group[0].kv_cache_spec_kind == "full_attention"
    assert by_group[1].kv_cache_spec_kind == "sliding_window"
    # The 64 prompt tokens fill 4 blocks of 16 in each group (dense retention caches every
    # one); both groups announce the same plain chain hashes (hashes name the tokens).
    for g in (0, 1):
        assert sum(len(e.block_hashes) for e in stored if e.group_idx == g) == 4
    assert [h for e in stored if e.group_idx == 0 for h in e.block_hashes] == [
        h for e in stored if e.group_idx == 1 for h in e.block_hashes
    ]


class _CountingManager:
    """A ``pagedkv.KVCacheManager`` wrapper counting its allocating calls into Rust (``step``:
    a batch, ``allocate_slots``: one request)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.steps = 0

    def step(self, *args: Any, **kwargs: Any) -> Any:
        self.steps += 1
        return self._inner.step(*args, **kwargs)

    def allocate_slots(self, *args: Any, **kwargs: Any) -> Any:
        self.steps += 1
        return self._inner.allocate_slots(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _PerRequestDecodes(PagedKVScheduler):
    batch_decode = False


def _run_counted(cls: type, stream: Any, num_blocks: int, **config: Any) -> tuple[Driver, list[Any], list[int]]:
    """``stream`` on ``cls`` alone: the records, and per scheduler step the ``step`` calls."""
    kv = make_hybrid_kv_cache_config(num_blocks, GEMMA3_GROUPS, BS)
    d = Driver(build_scheduler(cls, make_vllm_config(num_blocks=num_blocks, **config), kv_cache_config=kv))
    kvm = d.scheduler.kv_cache_manager
    counter = _CountingManager(kvm._kvm)
    kvm._kvm = kvm.decodes._kvm = counter
    records, crossings = [], []
    for step in range(5000):
        for rid, prompt, max_tokens in stream.get(step, []):
            d.add(make_request(rid, prompt, max_tokens, block_size=BS))
        if step > max(stream) and not d.scheduler.has_unfinished_requests():
            break
        before = counter.steps
        records.append(d.step())
        crossings.append(counter.steps - before)
    kvm._kvm = kvm.decodes._kvm = counter._inner
    kvm.manager.check_invariants()
    assert kvm.manager.num_sequences == 0
    return d, records, crossings


def test_batched_decodes_match_per_request_decodes_in_one_call_per_step() -> None:
    # 24 requests past the window decoding together (Gemma 3's groups): the batched path gives
    # the records of the per-request path (itself stock's) step by step, with one allocating
    # call into Rust per decode-only step instead of one per request.
    rng = random.Random(17)
    prefix = _tokens(rng, 530)
    stream = _shared_prefix_stream(rng, prefix, 24, (1, 200), 3)
    batched, b_records, b_cross = _run_counted(PagedKVScheduler, stream, 4096, max_num_batched_tokens=1024)
    per_req, p_records, p_cross = _run_counted(_PerRequestDecodes, stream, 4096, max_num_batched_tokens=1024)
    assert b_records == p_records
    assert batched.outputs == per_req.outputs
    kvm = batched.scheduler.kv_cache_manager
    assert kvm.num_batched_allocations > 0 and per_req.scheduler.kv_cache_manager.num_batched_allocations == 0
    decode_only = [
        i for i, r in enumerate(b_records) if r["scheduled"] and all(n == 1 for n in r["scheduled"].values())
    ]
    assert len(decode_only) > 10
    assert all(b_cross[i] == 1 for i in decode_only)
    assert [p_cross[i] for i in decode_only] == [len(b_records[i]["scheduled"]) for i in decode_only]
    print(f"allocating calls into Rust: batched {sum(b_cross)}, per request {sum(p_cross)}")


def test_batched_decodes_under_pressure_stop_where_blocks_run_out() -> None:
    # A pool too small for every decode to open its blocks: the free count stops deferring
    # (num_batch_stops) and those decodes take the per-request path, where vLLM preempts as
    # stock: step by step equal to stock.
    rng = random.Random(23)
    prefix = _tokens(rng, 40)
    stream = _shared_prefix_stream(rng, prefix, 10, (1, 60), 4)
    for reqs in stream.values():
        reqs[:] = [(rid, prompt, 200) for rid, prompt, _ in reqs]
    stock, paged, records = _lockstep(GEMMA3_GROUPS, stream, num_blocks=400, max_num_batched_tokens=256)
    assert paged.outputs == stock.outputs
    assert any(b["preempted"] for _, b in records)
    kvm = paged.scheduler.kv_cache_manager
    assert kvm.num_batched_allocations > 0 and kvm.num_batch_stops > 0
