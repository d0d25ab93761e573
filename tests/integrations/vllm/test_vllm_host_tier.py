"""The prefix cache's host tier against stock vLLM's CPU offloading, on one request stream.

(a) vLLM's own ``Scheduler`` with its ``OffloadingConnector`` (scheduler role, its
``CPUOffloadingManager``). vLLM's worker side refuses a non-CUDA platform, so a fake worker
stands in: each step it reports every load and store job of the step's connector metadata as
completed and the requests of the load jobs as ``finished_recving`` (without that a request
with an offloaded hit waits in ``WAITING_FOR_REMOTE_KVS`` for ever).

(b) pagedkv's host tier (``CacheConfig(num_host_blocks=...)``), driven on a
``pagedkv.KVCacheManager`` the way a scheduler drives it: one ``step`` per forward pass, the
sampled token appended by the next. Not ``PagedKVScheduler``: the plug-in refuses a
``kv_transfer_config``; vLLM reaches pagedkv's tier through its own ``OffloadingConnector``
with ``PagedKVCPUOffloadingSpec``, compared with vLLM's CPU spec in
``test_vllm_offloading_manager.py``. This file compares the tier inside pagedkv's own manager.

Stream: conversations whose histories together overflow a small device pool, one turn at a
time, each turn's prompt the whole history plus new user tokens; a turn runs to completion
before the next arrives. Both sides sample with the suite's fake model (the token depends on
the request id and position only), so outputs must be identical. The split of a turn's prompt
into device hits, host hits and recomputed tokens differs by design: vLLM stores each block
as it is computed and loads asynchronously (the request waits at least one step), pagedkv
stores a block when the device pool evicts it and loads within the step. What must hold on
both: with a host tier large enough, every history token a device-only cache recomputes is
served from the host tier instead.
"""

from __future__ import annotations

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
except ImportError:  # pragma: no cover - depends on the installed vLLM
    OffloadingWorkerMetadata = None

BS = 16
NUM_BLOCKS = 12  # device pool, null block included, on both sides
NUM_CONVERSATIONS = 3
NUM_TURNS = 3
USER_TOKENS = 40
MAX_TOKENS = 4


def _user_tokens(conv: int, turn: int) -> list[int]:
    base = 100 + 1000 * conv + 100 * turn
    return list(range(base, base + USER_TOKENS))


def _turns() -> list[tuple[str, int, int]]:
    """(request id, conversation, turn), round robin over the conversations."""
    return [(f"c{c}t{t}", c, t) for t in range(NUM_TURNS) for c in range(NUM_CONVERSATIONS)]


class _Result:
    """Per request: device-hit tokens, host-hit tokens, prompt length and output tokens."""

    def __init__(self) -> None:
        self.device: dict[str, int] = {}
        self.host: dict[str, int] = {}
        self.prompt_len: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}

    def recomputed(self, rid: str) -> int:
        return self.prompt_len[rid] - self.device[rid] - self.host[rid]


def _ideal_hits(prompt_len: int, history_len: int) -> int:
    """Tokens a cache that never forgets serves: the history's computed tokens (its last
    sampled token was never fed back) in full blocks, capped before the prompt's last token."""
    computed = max(history_len - 1, 0)
    return min(computed, prompt_len - 1) // BS * BS


def _run_conversations(serve: Any) -> tuple[_Result, dict[str, int]]:
    """Feeds the stream to ``serve(rid, prompt) -> (device hits, host hits, outputs)``;
    returns the result and each request's ideal hit count."""
    result = _Result()
    ideal: dict[str, int] = {}
    history: dict[int, list[int]] = {c: [] for c in range(NUM_CONVERSATIONS)}
    for rid, conv, turn in _turns():
        prompt = history[conv] + _user_tokens(conv, turn)
        ideal[rid] = _ideal_hits(len(prompt), len(history[conv]))
        device, host, outputs = serve(rid, prompt)
        result.device[rid], result.host[rid], result.prompt_len[rid] = device, host, len(prompt)
        result.outputs[rid] = outputs
        history[conv] = prompt + outputs
    return result, ideal


# --- (a) stock vLLM with the OffloadingConnector and a fake worker -------------------------


def _fake_worker(transfers: dict[str, int]) -> Any:
    """The fake model's output plus what a worker that finished every transfer of the step
    reports; counts the blocks stored and loaded into ``transfers``."""
    fake_model = vs.fake_model_output

    def output(scheduler: Any, sched_output: Any) -> Any:
        out = fake_model(scheduler, sched_output)
        meta = sched_output.kv_connector_metadata
        done = OffloadingWorkerMetadata()
        for job_id, job in meta.store_jobs.items():
            transfers["stored"] += len(job.dst_spec.block_ids)
            done.mark_completed(job_id)
        for job_id, job in meta.load_jobs.items():
            transfers["loaded"] += len(job.src_spec.block_ids)
            done.mark_completed(job_id)
        loaded = {job.req_id for job in meta.load_jobs.values()}
        out.kv_connector_output = KVConnectorOutput(finished_recving=loaded or None, kv_connector_worker_meta=done)
        return out

    return output


def _vllm_serve(monkeypatch: pytest.MonkeyPatch, *, offload: bool) -> tuple[Any, dict[str, int], dict[str, int]]:
    """A ``serve`` callable over one stock vLLM scheduler (with the OffloadingConnector when
    ``offload``), the steps each request spent waiting for its load, and the blocks stored
    and loaded."""
    kw: dict[str, Any] = {}
    transfers = {"stored": 0, "loaded": 0}
    if offload:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 26},
        )
        monkeypatch.setattr(vs, "fake_model_output", _fake_worker(transfers))
    sched = vs.build_scheduler(Scheduler, vs.make_vllm_config(num_blocks=NUM_BLOCKS, block_size=BS, **kw))
    driver = vs.Driver(sched)
    external: dict[str, int] = {}
    waits: dict[str, int] = {}
    if offload:
        matched = sched.connector.get_num_new_matched_tokens

        def record(request: Any, num_computed_tokens: int) -> Any:
            n, is_async = matched(request, num_computed_tokens)
            if n is not None:  # None: the connector asks to be asked again later
                external.setdefault(request.request_id, n)
            return n, is_async

        sched.connector.get_num_new_matched_tokens = record

    def serve(rid: str, prompt: list[int]) -> tuple[int, int, list[int]]:
        driver.add(vs.make_request(rid, prompt, MAX_TOKENS, block_size=BS))
        steps = 0
        while sched.has_unfinished_requests():
            assert steps < 50, f"{rid} never finished"
            driver.step()
            steps += 1
            if rid not in driver.prefix_hits:
                waits[rid] = waits.get(rid, 0) + 1
        host = external.get(rid, 0)
        return driver.prefix_hits[rid] - host, host, driver.outputs[rid]

    return serve, waits, transfers


# --- (b) pagedkv's KVCacheManager with its host tier --------------------------------------


def _pagedkv_serve(num_host_blocks: int) -> tuple[Any, pagedkv.KVCacheManager]:
    cfg = pagedkv.CacheConfig(NUM_BLOCKS, BS, num_host_blocks=num_host_blocks, host_admission_min_seen=1)
    m = pagedkv.KVCacheManager(cfg)
    seq_ids = iter(range(1, 1000))

    def serve(rid: str, prompt: list[int]) -> tuple[int, int, list[int]]:
        sid = next(seq_ids)
        m.add_sequence(sid, prompt)
        before = m.stats().host_hits_tokens
        out = m.step([sid], [int(m.num_uncomputed_tokens([sid])[0])])
        assert out.error is None
        cached = int(out.num_cached_tokens[0])
        host = m.stats().host_hits_tokens - before
        outputs = [vs.fake_token(rid, len(prompt))]
        while len(outputs) < MAX_TOKENS:
            out = m.step([sid], [1], [[outputs[-1]]])
            assert out.error is None
            outputs.append(vs.fake_token(rid, len(prompt) + len(outputs)))
        m.free(sid)
        m.check_invariants()
        return cached - host, host, outputs

    return serve, m


# --- the comparison --------------------------------------------------------------------------


RIDS = [rid for rid, _, _ in _turns()]
# Hits a cache that never forgets gives each turn: turn 0 has no history; turn 1 the 2 full
# blocks of turn 0's 43 computed tokens; turn 2 the 5 full blocks of 87.
IDEAL = [0, 0, 0, 32, 32, 32, 80, 80, 80]
# A device-only cache of 11 usable blocks: c0 and c1 come back to their turn 0 in time; c2t1
# finds its history evicted by c0t1 and c1t1, and every turn 2 finds its own evicted too.
DEVICE_ONLY = [0, 0, 0, 32, 32, 0, 0, 0, 0]


def test_host_tiers_serve_what_a_device_only_cache_recomputes(monkeypatch: pytest.MonkeyPatch) -> None:
    if OffloadingWorkerMetadata is None:
        pytest.skip("this vLLM has no OffloadingWorkerMetadata (its offloading API differs)")
    stock_serve, _, _ = _vllm_serve(monkeypatch, offload=False)
    stock, ideal = _run_conversations(stock_serve)
    offload_serve, waits, transfers = _vllm_serve(monkeypatch, offload=True)
    offload, _ = _run_conversations(offload_serve)
    paged_dev_serve, _ = _pagedkv_serve(0)
    paged_dev, _ = _run_conversations(paged_dev_serve)
    paged_serve, m = _pagedkv_serve(64)
    paged, _ = _run_conversations(paged_serve)
    assert [ideal[r] for r in RIDS] == IDEAL

    # The fake model's outputs: identical everywhere.
    for r in (offload, paged_dev, paged):
        assert r.outputs == stock.outputs
    # Device-only caches: the same hits on both sides (one request at a time, same pool).
    assert [stock.device[r] for r in RIDS] == [paged_dev.device[r] for r in RIDS] == DEVICE_ONLY
    assert all(stock.host[r] == paged_dev.host[r] == 0 for r in RIDS)
    # With the tier, on both sides: the device hits are the device-only ones, and exactly what
    # the device-only cache recomputed of the history comes from the host tier.
    for r in (offload, paged):
        assert [r.device[rid] for rid in RIDS] == DEVICE_ONLY
        assert [r.host[rid] for rid in RIDS] == [i - d for i, d in zip(IDEAL, DEVICE_ONLY)]
        assert sum(r.recomputed(rid) for rid in RIDS) == sum(stock.recomputed(rid) for rid in RIDS) - 272
    # By design: vLLM stores each full block once, as it is computed: all 24 distinct blocks
    # of the stream (8 per conversation: 131 computed tokens of its last turn). pagedkv stores
    # a block when the device pool evicts it: 21, since c2t2's 3 fresh blocks are still on the
    # device at the end. Both load the same 17 blocks (2 for c2t1, 5 for each turn 2), but
    # vLLM's loading request waits one step in WAITING_FOR_REMOTE_KVS, pagedkv's loads are
    # planned in the step that schedules the request (no wait).
    assert transfers == {"stored": 24, "loaded": 17}
    assert waits == {"c2t1": 1, "c0t2": 1, "c1t2": 1, "c2t2": 1}
    stats = m.stats()
    assert (stats.host_stores_blocks, stats.host_loads_blocks, stats.host_hits_tokens) == (21, 17, 272)
