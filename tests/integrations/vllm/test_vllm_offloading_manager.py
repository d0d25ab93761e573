"""pagedkv's offloading spec (``PagedKVCPUOffloadingSpec``) against vLLM's own CPU offloading
spec, differentially, under stock vLLM's ``Scheduler`` and ``OffloadingConnector``.

Both runs use the same scheduler, connector, device pool and request streams; only
``kv_connector_extra_config["spec_name"]`` differs, so the scheduler-side manager is vLLM's
``CPUOffloadingManager`` (LRU) in one and ``PagedKVOffloadingManager`` (a
``pagedkv.HostBlockPool``) in the other. vLLM's worker side refuses a non-CUDA platform, so a
fake worker stands in (as in ``test_vllm_host_tier.py``): each step it completes every load and
store job of the step's connector metadata and reports the load jobs' requests as
``finished_recving``. Every step records what the scheduler scheduled, each new request's
device and external (host) hit tokens, the keys the manager stored, loaded and evicted, the
stores it refused, and the sampled tokens; the records must be equal step by step.

Streams: multi-turn conversations (each turn's prompt the whole history plus new user tokens)
over a device pool smaller than their working set, one request at a time or all
conversations' turns at once, with a host tier that holds the whole stream and with one that
does not (evictions). With store admission after two offers (vLLM's ``store_threshold`` 2,
pagedkv's ``host_admission_min_seen`` 2) the seen counts age differently by design (vLLM: an
LRU table of 64,000 keys; pagedkv: TinyLFU halving), which these short streams never reach,
so they are compared step by step too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.testing import vllm_scheduler as vs  # noqa: E402

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
        OffloadingWorkerMetadata,
    )
    from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402

    from pagedkv.integrations.vllm.offloading import _HAS_METADATA_ONLY, PagedKVOffloadingManager  # noqa: E402
except ImportError:  # pragma: no cover - depends on the installed vLLM
    OffloadingWorkerMetadata = None

pytestmark = pytest.mark.skipif(
    OffloadingWorkerMetadata is None, reason="this vLLM has no OffloadingWorkerMetadata (its offloading API differs)"
)

BS = 16
NUM_BLOCKS = 12  # device pool, null block included
NUM_CONVERSATIONS = 3
NUM_TURNS = 3
USER_TOKENS = 40
MAX_TOKENS = 4
SPEC = {"spec_name": "PagedKVCPUOffloadingSpec", "spec_module_path": "pagedkv.integrations.vllm.offloading"}


def _user_tokens(conv: int, turn: int) -> list[int]:
    base = 100 + 1000 * conv + 100 * turn
    return list(range(base, base + USER_TOKENS))


@dataclasses.dataclass
class _Run:
    """One scheduler with the OffloadingConnector, its driver and what it recorded."""

    sched: Any
    driver: Any
    manager: Any
    steps: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    current: dict[str, Any] = dataclasses.field(default_factory=dict)


def _new_step_record() -> dict[str, Any]:
    return {"stored": [], "loaded": [], "evicted": [], "refused": 0, "external": {}, "jobs": [0, 0]}


def _chunk_bytes(monkeypatch: pytest.MonkeyPatch) -> int:
    """Bytes of one offloaded chunk for the suite's model and block size (vLLM's CPU spec
    sizes its tier as cpu_bytes_to_use // this)."""
    run = _build(monkeypatch, {"cpu_bytes_to_use": 1 << 20, **SPEC})
    return (1 << 20) // run.manager.pool.num_blocks


def _build(monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any]) -> _Run:
    """A stock vLLM scheduler whose OffloadingConnector gets ``extra`` as its extra config;
    the manager's prepare_store / prepare_load and the connector's external hits are
    recorded per step, and the fake worker completes every job."""
    kv = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    sched = vs.build_scheduler(
        Scheduler, vs.make_vllm_config(num_blocks=NUM_BLOCKS, block_size=BS, kv_transfer_config=kv)
    )
    manager = sched.connector.connector_scheduler.manager
    run = _Run(sched, vs.Driver(sched), manager, current=_new_step_record())

    prepare_store, prepare_load = manager.prepare_store, manager.prepare_load

    def record_store(keys: Any, ctx: Any) -> Any:
        out = prepare_store(keys, ctx)
        if out is None:
            run.current["refused"] += 1
        else:
            run.current["stored"] += list(out.keys_to_store)
            run.current["evicted"] += list(out.evicted_keys)
        return out

    def record_load(keys: Any, ctx: Any) -> Any:
        run.current["loaded"] += list(keys)
        return prepare_load(keys, ctx)

    manager.prepare_store, manager.prepare_load = record_store, record_load
    matched = sched.connector.get_num_new_matched_tokens

    def record_matched(request: Any, num_computed_tokens: int) -> Any:
        n, is_async = matched(request, num_computed_tokens)
        if n is not None:  # None: the connector asks again later
            run.current["external"][request.request_id] = n
        return n, is_async

    sched.connector.get_num_new_matched_tokens = record_matched
    return run


def _fake_worker(run_of: dict[int, _Run]) -> Any:
    """The fake model's output plus a worker that completed every job of the step."""
    fake_model = vs.fake_model_output

    def output(scheduler: Any, sched_output: Any) -> Any:
        out = fake_model(scheduler, sched_output)
        if id(scheduler) not in run_of:  # a run without the connector
            return out
        meta = sched_output.kv_connector_metadata
        done = OffloadingWorkerMetadata()
        jobs = run_of[id(scheduler)].current["jobs"]
        # Jobs complete in job id (creation) order.
        for job_id, job in sorted(meta.store_jobs.items()):
            jobs[0] += len(job.dst_spec.block_ids)
            done.mark_completed(job_id)
        for job_id, job in sorted(meta.load_jobs.items()):
            jobs[1] += len(job.src_spec.block_ids)
            done.mark_completed(job_id)
        loaded = {job.req_id for job in meta.load_jobs.values()}
        out.kv_connector_output = KVConnectorOutput(finished_recving=loaded or None, kv_connector_worker_meta=done)
        return out

    return output


def _serve(run: _Run, batches: list[list[tuple[str, int, int]]]) -> dict[str, list[int]]:
    """Feeds each batch of (request id, conversation, turn) at once and steps until it is
    done; returns each request's outputs."""
    history: dict[int, list[int]] = {c: [] for c in range(NUM_CONVERSATIONS)}
    for batch in batches:
        prompts = {}
        for rid, conv, turn in batch:
            prompts[rid] = history[conv] + _user_tokens(conv, turn)
            # Concurrent turns end in different steps (conversation c samples MAX_TOKENS + c):
            # requests finishing together reach the manager in set order, which varies
            # between processes (str hashing), and so would the eviction order.
            max_tokens = MAX_TOKENS + (conv if len(batch) > 1 else 0)
            run.driver.add(vs.make_request(rid, prompts[rid], max_tokens, block_size=BS))
        for _ in range(100):
            if not run.sched.has_unfinished_requests():
                break
            record = run.driver.step()
            record.update(run.current)
            record.pop("blocks_held")  # device block ids: the same on both sides, not the point
            run.steps.append(record)
            run.current = _new_step_record()
        else:
            raise AssertionError(f"batch {batch} never finished")
        for rid, conv, _ in batch:
            history[conv] = prompts[rid] + run.driver.outputs[rid]
    return run.driver.outputs


def _batches(concurrent: bool) -> list[list[tuple[str, int, int]]]:
    turns = [[(f"c{c}t{t}", c, t) for c in range(NUM_CONVERSATIONS)] for t in range(NUM_TURNS)]
    return turns if concurrent else [[r] for batch in turns for r in batch]


def _run_both(
    monkeypatch: pytest.MonkeyPatch, num_chunks: int, concurrent: bool, extra: dict[str, Any] | None = None
) -> tuple[_Run, _Run, dict[str, list[int]]]:
    """vLLM's CPU spec and pagedkv's on the same stream; returns both runs and the outputs."""
    cfg = {"cpu_bytes_to_use": num_chunks * _chunk_bytes(monkeypatch), **(extra or {})}
    stock, paged = _build(monkeypatch, cfg), _build(monkeypatch, {**cfg, **SPEC})
    assert isinstance(paged.manager, PagedKVOffloadingManager)
    assert not isinstance(stock.manager, PagedKVOffloadingManager)
    assert paged.manager.pool.num_blocks == num_chunks
    monkeypatch.setattr(vs, "fake_model_output", _fake_worker({id(stock.sched): stock, id(paged.sched): paged}))
    stock_out = _serve(stock, _batches(concurrent))
    paged_out = _serve(paged, _batches(concurrent))
    assert paged_out == stock_out
    paged.manager.pool.check_invariants()
    return stock, paged, stock_out


def _totals(run: _Run) -> dict[str, int]:
    """Blocks stored, loaded and evicted, refused prepare_store calls, and host-hit tokens
    (each request's external hit when it was scheduled)."""
    external: dict[str, int] = {}
    for s in run.steps:
        external.update(s["external"])  # a waiting request is asked again: the last answer
    return {
        "stored": sum(len(s["stored"]) for s in run.steps),
        "loaded": sum(len(s["loaded"]) for s in run.steps),
        "evicted": sum(len(s["evicted"]) for s in run.steps),
        "external": sum(external.values()),
        "refused": sum(s["refused"] for s in run.steps),
    }


def _no_offload_outputs(monkeypatch: pytest.MonkeyPatch, concurrent: bool) -> dict[str, list[int]]:
    sched = vs.build_scheduler(Scheduler, vs.make_vllm_config(num_blocks=NUM_BLOCKS, block_size=BS))
    run = _Run(sched, vs.Driver(sched), None, current=_new_step_record())
    return _serve(run, _batches(concurrent))


def _assert_counters_match(run: _Run) -> None:
    totals, counters = _totals(run), run.manager.pool.counters()
    assert counters["stores_completed"] == totals["stored"]
    assert counters["loads"] == totals["loaded"]
    assert counters["evictions"] == totals["evicted"]


# A host tier that holds the whole stream (64 chunks; 24 distinct full blocks are computed, 8
# per conversation, each stored once as it is computed): both managers make the same
# decisions, so every step is identical. Sequential: the host hits test_vllm_host_tier.py
# derives (2 blocks for c2t1, 5 for each turn 2: 17 loads, 272 tokens).
@pytest.mark.parametrize("concurrent", [False, True], ids=["sequential", "concurrent"])
def test_pagedkv_spec_matches_vllm_cpu_spec_step_by_step(monkeypatch: pytest.MonkeyPatch, concurrent: bool) -> None:
    stock, paged, outputs = _run_both(monkeypatch, 64, concurrent)
    assert outputs == _no_offload_outputs(monkeypatch, concurrent)
    for i, (s, p) in enumerate(zip(stock.steps, paged.steps)):
        assert p == s, f"step {i} differs"
    assert len(paged.steps) == len(stock.steps)
    totals = _totals(paged)
    assert totals["evicted"] == totals["refused"] == 0
    assert totals["stored"] == 24
    if not concurrent:
        assert totals == {"stored": 24, "loaded": 17, "evicted": 0, "external": 272, "refused": 0}
    _assert_counters_match(paged)


# A host tier of 6 chunks (a quarter of the stream's 24 blocks). The two managers agree until
# the first eviction and then differ by design in which blocks they evict: vLLM's LRU commits
# a request's recency one step after it finishes (the connector signals on_request_finished
# in the next step's build_connector_meta, after that step's stores) and, in 0.33, ranks a
# running request's stores by the request's start (so the just-finished conversation, not
# the oldest, is evicted first); pagedkv enters a store at the back of its LRU when it
# completes, tail first (in chain order, from the end-token positions the connector records:
# it completes a store job with its keys as a set). Outputs are identical; the totals of each
# side are pinned (vLLM's differ between 0.32 and 0.33, pagedkv's do not). "refused":
# prepare_store calls answered None (a turn's new blocks do not fit beside the blocks being
# stored or loaded), the same count on both.
SMALL_HOST_PAGEDKV = {
    False: {"stored": 22, "loaded": 6, "evicted": 16, "external": 96, "refused": 10},
    True: {"stored": 21, "loaded": 5, "evicted": 15, "external": 80, "refused": 11},
}
SMALL_HOST_VLLM = {
    ("0.33", False): {"stored": 21, "loaded": 6, "evicted": 15, "external": 96, "refused": 10},
    ("0.33", True): {"stored": 21, "loaded": 6, "evicted": 15, "external": 96, "refused": 11},
    ("0.32", False): {"stored": 21, "loaded": 5, "evicted": 15, "external": 80, "refused": 10},
    ("0.32", True): {"stored": 21, "loaded": 5, "evicted": 15, "external": 80, "refused": 11},
}


@pytest.mark.parametrize("concurrent", [False, True], ids=["sequential", "concurrent"])
def test_a_host_tier_too_small_for_the_stream(monkeypatch: pytest.MonkeyPatch, concurrent: bool) -> None:
    from pagedkv.integrations.vllm.versions import check_supported_version

    stock, paged, outputs = _run_both(monkeypatch, 6, concurrent)
    assert outputs == _no_offload_outputs(monkeypatch, concurrent)
    first_eviction = min(i for run in (stock, paged) for i, s in enumerate(run.steps) if s["evicted"])
    assert stock.steps[:first_eviction] == paged.steps[:first_eviction]
    assert _totals(paged) == SMALL_HOST_PAGEDKV[concurrent]
    assert _totals(stock) == SMALL_HOST_VLLM[(check_supported_version(), concurrent)]
    _assert_counters_match(paged)


def test_admission_after_two_offers_matches_store_threshold_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's store_threshold 2 and pagedkv's host_admission_min_seen 2 (taken from it): a
    block is stored at its second offer."""
    stock, paged, _ = _run_both(monkeypatch, 64, False, {"store_threshold": 2})
    assert paged.manager.pool.admission_min_seen == 2
    for i, (s, p) in enumerate(zip(stock.steps, paged.steps)):
        assert p == s, f"step {i} differs"
    assert _totals(paged) == _totals(stock)


# --- the manager on its own --------------------------------------------------------------


def _key(i: int) -> bytes:
    return bytes([i]) * 32 + (0).to_bytes(4, "big")


def test_manager_lookup_load_store_and_events() -> None:
    m = PagedKVOffloadingManager(3, enable_events=True)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    keys = [_key(i) for i in range(3)]
    out = m.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys and out.evicted_keys == []
    assert sorted(out.store_spec.block_ids.tolist()) == [0, 1, 2]
    assert [m.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 3
    # Every block is storing: a fourth store does not fit.
    assert m.prepare_store([_key(3)], ctx) is None
    m.complete_store(keys, ctx)
    assert [m.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 3
    assert m.lookup(_key(3), ctx) is LookupResult.MISS
    spec = m.prepare_load(keys[:1], ctx)
    assert spec.block_ids.tolist() == out.store_spec.block_ids.tolist()[:1]
    # A full tier evicts the chain's tail first, never the pinned head.
    out2 = m.prepare_store([_key(3)], ctx)
    assert out2 is not None and out2.evicted_keys == [keys[2]]
    m.complete_store([_key(3)], ctx, success=False)
    assert m.lookup(_key(3), ctx) is LookupResult.MISS
    m.complete_load(keys[:1], ctx)
    m.on_request_finished(ctx)
    events = [(e.removed, e.keys) for e in m.take_events()]
    # vLLM 0.33 reports a failed store's removal as bookkeeping (metadata_only); 0.32 does not.
    failed = [(True, [_key(3)])] if _HAS_METADATA_ONLY else []
    assert events == [(False, keys), (True, [keys[2]]), *failed]
    assert list(m.take_events()) == []
    m.pool.check_invariants()
    assert m.pool.counters() == {
        "stores_prepared": 4,
        "stores_completed": 3,
        "stores_failed": 1,
        "stores_refused": 1,
        "loads": 1,
        "evictions": 1,
    }
    m.reset_cache()
    assert m.lookup(keys[0], ctx) is LookupResult.MISS and m.pool.num_used == 0


def test_manager_refuses_calls_outside_vllms_contract() -> None:
    m = PagedKVOffloadingManager(2)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    out = m.prepare_store([_key(0)], ctx)
    assert out is not None
    with pytest.raises(pagedkv.InvalidArgumentError, match="not readable"):
        m.prepare_load([_key(0)], ctx)  # still storing
    with pytest.raises(pagedkv.InvalidArgumentError, match="no load"):
        m.complete_load([_key(0)], ctx)
    m.complete_store([_key(0)], ctx)
    with pytest.raises(pagedkv.InvalidArgumentError, match="no store"):
        m.complete_store([_key(0)], ctx)  # twice
    assert m.lookup(_key(0), ctx) is LookupResult.HIT
    m.pool.check_invariants()
    with pytest.raises(pagedkv.InvalidConfigError):
        PagedKVOffloadingManager(2, eviction="fifo")


def test_spec_refuses_a_host_tier_without_a_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config={"cpu_bytes_to_use": 1, **SPEC}
    )
    with pytest.raises(pagedkv.InvalidConfigError, match="cpu_bytes_to_use"):
        vs.build_scheduler(Scheduler, vs.make_vllm_config(num_blocks=NUM_BLOCKS, block_size=BS, kv_transfer_config=kv))


def test_spec_refuses_an_unsupported_vllm_release(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    from pagedkv.integrations.vllm import UnsupportedVllmVersionError

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    kv = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": 1 << 20, **SPEC},
    )
    with pytest.raises(UnsupportedVllmVersionError, match="0.31.2") as e:
        vs.build_scheduler(Scheduler, vs.make_vllm_config(num_blocks=NUM_BLOCKS, block_size=BS, kv_transfer_config=kv))
    assert e.value.supported == ("0.32", "0.33")
