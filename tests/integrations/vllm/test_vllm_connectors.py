"""vLLM's scheduler with a KV connector's scheduler side, stock vs ``PagedKVScheduler``.

Connectors: NIXL as consumer (prefill/decode disaggregation, the decode node loads a request's
prompt KV from a remote prefill node) and as producer (the prefill node keeps a finished
request's blocks until the remote decode node has read them), Mooncake P/D
(``MooncakeConnector``, the same two roles; its scheduler side needs no transfer engine), ``OffloadingConnector`` with
vLLM's CPU spec (a host tier: blocks stored as they fill, host hits loaded back), and
``MultiConnector`` of the two. The connectors' worker side needs a GPU and NIXL, so a seeded
fake worker (:class:`FakeWorker`) stands in: it reads each step's connector metadata and
completes every transfer it starts after a delay of 0 to ``max_delay`` steps drawn from the
seed and the transfer (the same on both sides), and fails NIXL and Mooncake loads with the
probability it is given (``failed_recving`` plus the load's blocks as ``invalid_block_ids``, as
their workers report a failed read). vLLM's offloading worker has no failed transfers (it asserts success),
so offloading loads and stores are only delayed.

Each scenario runs stock alone first (the harness and the fake worker proven: every request
finishes with the fake model's tokens, loads, stores and failures happened, nothing is held at
the end), then stock and the plug-in in lockstep: every step's schedule, prefix hits (local +
external), connector-reported external tokens, loads, stores, finished transfers, requests
waiting for KV and blocks in use must be equal; no request waits for its KV longer than its
transfer takes; nothing is held at the end. Bad input: a ``finished_recving`` for a request id
the scheduler never had or for a running request that never loaded (stock vLLM asserts; the
plug-in must drop it and carry on exactly as without it), an abort while the load is in flight,
a failed load (invalid blocks) reported after its request was preempted.


Runs only where vLLM is installed (``make test-vllm`` builds that environment).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (  # noqa: E402
    MooncakeConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: E402
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from pagedkv.integrations.vllm import PagedKVScheduler  # noqa: E402
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    Driver,
    build_scheduler,
    fake_token,
    make_request,
    make_vllm_config,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
        OffloadingConnectorMetadata,
        OffloadingWorkerMetadata,
    )
except ImportError:  # pragma: no cover - depends on the installed vLLM
    OffloadingConnectorMetadata = OffloadingWorkerMetadata = None

BS = 16
HOST_BYTES = 1 << 26

needs_offloading = pytest.mark.skipif(
    OffloadingWorkerMetadata is None, reason="this vLLM has no OffloadingWorkerMetadata (its offloading API differs)"
)


# --- connector configurations --------------------------------------------------------------


def _nixl(role: str) -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": role}


def _mooncake(role: str) -> dict[str, Any]:
    return {"kv_connector": "MooncakeConnector", "kv_role": role}


def _offloading(spec: str = "cpu") -> dict[str, Any]:
    """``spec``: ``"cpu"`` (vLLM's CPU spec) or ``"pagedkv"`` (``PagedKVCPUOffloadingSpec``,
    pagedkv's host tier behind vLLM's connector)."""
    extra: dict[str, Any] = {"cpu_bytes_to_use": HOST_BYTES}
    if spec == "pagedkv":
        extra.update(spec_name="PagedKVCPUOffloadingSpec", spec_module_path="pagedkv.integrations.vllm.offloading")
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def kv_transfer_config(kind: str, policy: str = "recompute") -> KVTransferConfig:
    """The ``KVTransferConfig`` of connector ``kind``: ``nixl-consumer``, ``nixl-producer``,
    ``mooncake-consumer``, ``mooncake-producer``, ``offloading`` (vLLM's CPU spec),
    ``offloading-pagedkv`` (pagedkv's host tier) or ``multi`` (MultiConnector of a NIXL consumer
    and the offloading connector); ``policy`` is ``kv_load_failure_policy``."""
    if kind == "nixl-consumer":
        one = _nixl("kv_consumer")
    elif kind == "nixl-producer":
        one = _nixl("kv_producer")
    elif kind == "mooncake-consumer":
        one = _mooncake("kv_consumer")
    elif kind == "mooncake-producer":
        one = _mooncake("kv_producer")
    elif kind == "offloading":
        one = _offloading()
    elif kind == "offloading-pagedkv":
        one = _offloading("pagedkv")
    elif kind == "multi":
        one = {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"connectors": [_nixl("kv_consumer"), _offloading()]},
        }
    else:
        raise ValueError(f"unknown connector kind {kind!r}")
    return KVTransferConfig(kv_load_failure_policy=policy, **one)


# --- the fake worker -------------------------------------------------------------------------


@dataclass
class _Transfer:
    due: int  # step at whose end it is reported
    fail: bool = False
    recv_req: str | None = None  # async load: the request reported in finished_recving
    job: tuple[int, int] | None = None  # offloading job: (connector index, job id)
    send_req: str | None = None  # NIXL / Mooncake send: the request reported in finished_sending
    blocks: tuple[int, ...] = ()  # the load's local blocks (invalid if it fails)


@dataclass
class FakeWorker:
    """The worker side of the connectors: completes, delays and fails the transfers each
    step's connector metadata starts (see the module docstring). ``extra`` (step -> dict of
    ``finished_recving`` / ``invalid_block_ids`` sets) adds bad or late reports."""

    seed: int
    max_delay: int = 3
    p_fail: float = 0.0
    extra: dict[int, dict[str, set[Any]]] = field(default_factory=dict)
    step: int = 0
    pending: list[_Transfer] = field(default_factory=list)
    #: Per request: the blocks of every NIXL / Mooncake load started for it (for late reports).
    load_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)

    def _rng(self, key: str) -> random.Random:
        return random.Random(f"{self.seed}:{key}")

    def _delay(self, key: str) -> int:
        return self._rng(key).randrange(self.max_delay + 1)

    def _start(self, meta: Any) -> tuple[dict[str, int], dict[str, int]]:
        """Registers the transfers ``meta`` starts; returns blocks loaded and stored per
        request."""
        loads: dict[str, int] = {}
        stores: dict[str, int] = {}
        metas = meta.metadata if isinstance(meta, MultiKVConnectorMetadata) else (meta,)
        for idx, m in enumerate(metas):
            if isinstance(m, NixlConnectorMetadata):
                for rid, rm in m.reqs_to_recv.items():
                    self._start_load(rid, tuple(rm.local_block_ids[0]), loads)
                for rid in m.reqs_to_send:
                    self._start_send(rid)
            elif isinstance(m, MooncakeConnectorMetadata):
                for pulls in m.reqs_to_recv.values():
                    for rid, pull in pulls.items():
                        blocks = tuple(pull.local_block_ids[0]) if pull.local_block_ids else ()
                        if blocks:  # no blocks: only a notice to the prefill node, no load
                            self._start_load(rid, blocks, loads)
                for rid, (_transfer_id, block_ids) in m.reqs_to_send.items():
                    # An empty entry (when the prefill is scheduled) only readies the sender.
                    if any(block_ids):
                        self._start_send(rid)
            elif OffloadingConnectorMetadata is not None and isinstance(m, OffloadingConnectorMetadata):
                for job_id, job in m.store_jobs.items():
                    stores[job.req_id] = stores.get(job.req_id, 0) + len(job.dst_spec.block_ids)
                    key = f"store:{idx}:{job_id}"
                    self.pending.append(_Transfer(self.step + self._delay(key), job=(idx, job_id)))
                for job_id, job in m.load_jobs.items():
                    loads[job.req_id] = loads.get(job.req_id, 0) + len(job.src_spec.block_ids)
                    # A sync load (0.33) is waited for within the step; 0.32's are all async.
                    if getattr(job, "sync", False):
                        self.pending.append(_Transfer(self.step, job=(idx, job_id)))
                    else:
                        key = f"load:{idx}:{job_id}"
                        self.pending.append(
                            _Transfer(self.step + self._delay(key), job=(idx, job_id), recv_req=job.req_id)
                        )
                for job_id in m.jobs_to_flush or ():
                    for t in self.pending:
                        if t.job == (idx, job_id):
                            t.due = self.step
            elif m is not None:  # pragma: no cover - a connector this worker does not know
                raise AssertionError(f"no fake worker for {type(m).__name__}")
        return loads, stores

    def _start_load(self, rid: str, blocks: tuple[int, ...], loads: dict[str, int]) -> None:
        """A remote load of ``blocks`` for ``rid``: delayed, failed with ``p_fail``."""
        loads[rid] = loads.get(rid, 0) + len(blocks)
        self.load_blocks[rid] = blocks
        key = f"recv:{rid}:{self.step}"
        fail = self._rng(key + ":fail").random() < self.p_fail
        self.pending.append(_Transfer(self.step + self._delay(key), fail=fail, recv_req=rid, blocks=blocks))

    def _start_send(self, rid: str) -> None:
        """A finished request's blocks read by the remote decode node: delayed."""
        self.pending.append(_Transfer(self.step + self._delay(f"send:{rid}"), send_req=rid))

    def report(self, sched_output: Any, num_connectors: int) -> KVConnectorOutput:
        """Starts this step's transfers and reports those due at its end."""
        loads, stores = self._start(sched_output.kv_connector_metadata)
        due = [t for t in self.pending if t.due <= self.step]
        self.pending = [t for t in self.pending if t.due > self.step]
        recving: set[str] = set()
        failed: set[str] = set()
        sending: set[str] = set()
        invalid: set[int] = set()
        done: dict[int, Any] = {}
        for t in due:
            if t.job is not None:
                idx, job_id = t.job
                done.setdefault(idx, OffloadingWorkerMetadata()).mark_completed(job_id)
            if t.recv_req is not None:
                recving.add(t.recv_req)
                if t.fail:
                    failed.add(t.recv_req)
                    invalid.update(t.blocks)
                    self.failed.append(t.recv_req)
            if t.send_req is not None:
                sending.add(t.send_req)
        extra = self.extra.get(self.step, {})
        recving |= extra.get("finished_recving", set())
        invalid |= extra.get("invalid_block_ids", set())
        worker_meta: Any = None
        if done:
            if num_connectors > 1:
                worker_meta = MultiKVConnectorWorkerMetadata(metadata=tuple(done.get(i) for i in range(num_connectors)))
            else:
                worker_meta = done[0]
        self.last = {
            "loads": loads,
            "stores": stores,
            "finished_recving": sorted(recving),
            "failed_recving": sorted(failed),
            "finished_sending": sorted(sending),
            "num_invalid_blocks": len(invalid),
        }
        self.step += 1
        return KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            failed_recving=failed,
            invalid_block_ids=invalid,
            kv_connector_worker_meta=worker_meta,
        )


class ConnectorDriver(Driver):
    """:class:`Driver` with a :class:`FakeWorker` answering for the connector; each step's
    record also holds the worker's report, the external tokens the connector matched, the
    requests waiting for KV and the blocks in use."""

    def __init__(self, scheduler: Any, worker: FakeWorker) -> None:
        super().__init__(scheduler, model_output=self._model_output)
        self.worker = worker
        self.external: dict[str, int] = {}
        self._step_external: dict[str, int] = {}
        #: Per request: steps spent in WAITING_FOR_REMOTE_KVS.
        self.waits: dict[str, int] = {}
        connectors = getattr(scheduler.connector, "_connectors", None)
        self.num_connectors = len(connectors) if connectors is not None else 1
        matched = scheduler.connector.get_num_new_matched_tokens

        def record(request: Any, num_computed_tokens: int) -> Any:
            n, is_async = matched(request, num_computed_tokens)
            if n:
                self._step_external[request.request_id] = n
                self.external[request.request_id] = self.external.get(request.request_id, 0) + n
            return n, is_async

        scheduler.connector.get_num_new_matched_tokens = record

    def _model_output(self, scheduler: Any, sched_output: Any) -> Any:
        from pagedkv.testing.vllm_scheduler import fake_model_output

        out = fake_model_output(scheduler, sched_output)
        out.kv_connector_output = self.worker.report(sched_output, self.num_connectors)
        return out

    def step(self) -> dict[str, Any]:
        """One step (see :meth:`Driver.step`) plus the connector's view of it."""
        self._step_external = {}
        record = super().step()
        sched = self.scheduler
        waiting = sorted(
            r.request_id for r in sched.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        )
        for rid in waiting:
            self.waits[rid] = self.waits.get(rid, 0) + 1
        num_blocks = sched.kv_cache_config.num_blocks - 1
        record.update(self.worker.last)
        record["external"] = dict(self._step_external)
        record["waiting_for_kvs"] = waiting
        # Finished requests whose blocks the scheduler still keeps (a producer's, until sent).
        record["kept_after_finish"] = sorted(r.request_id for r in sched.requests.values() if r.is_finished())
        record["blocks_in_use"] = round(sched.kv_cache_manager.usage * num_blocks)
        return record


# --- streams and running them ------------------------------------------------------------------


Factory = Any


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 4000) for _ in range(n)]


def _req(rid: str, prompt: list[int], max_tokens: int, transfer: str | None = None, flavor: str = "nixl") -> Factory:
    """A request factory; ``transfer``: ``"remote-prefill"`` (a consumer loads its prompt's
    KV) or ``"remote-decode"`` (a producer keeps its blocks for the decode node), with the
    ``kv_transfer_params`` a router gives ``flavor``'s connector (``"nixl"``, ``"mooncake"``)."""

    def make() -> Any:
        r = make_request(rid, prompt, max_tokens, block_size=BS)
        if flavor == "mooncake" and transfer is not None:
            r.kv_transfer_params = dict(
                do_remote_prefill=transfer == "remote-prefill",
                do_remote_decode=transfer == "remote-decode",
                transfer_id=f"xfer-{rid}",
            )
            if transfer == "remote-prefill":
                r.kv_transfer_params.update(
                    remote_engine_id="prefill-engine", remote_bootstrap_addr="prefill-host:8998"
                )
        elif transfer == "remote-prefill":
            r.kv_transfer_params = dict(
                do_remote_prefill=True,
                do_remote_decode=False,
                remote_engine_id="prefill-engine",
                remote_request_id=f"prefill-{rid}",
                remote_block_ids=list(range(-(-len(prompt) // BS))),
                remote_host="prefill-host",
                remote_port=1234,
                tp_size=1,
            )
        elif transfer == "remote-decode":
            r.kv_transfer_params = dict(do_remote_prefill=False, do_remote_decode=True)
        return r

    return make


def consumer_stream(seed: int, n: int = 10, flavor: str = "nixl") -> dict[int, list[Factory]]:
    """Remote-prefill requests (some sharing a system prompt, so local hits come first) and
    a few plain ones, staggered (``flavor``: see :func:`_req`)."""
    rng = random.Random(seed)
    system = _prompt(rng, 48)
    stream: dict[int, list[Factory]] = {}
    for i in range(n):
        prompt = (system if i % 2 else []) + _prompt(rng, rng.randrange(5, 70))
        transfer = "remote-prefill" if i % 4 != 3 else None
        stream.setdefault(rng.randrange(0, 12), []).append(
            _req(f"c{i}", prompt, rng.randrange(2, 12), transfer, flavor)
        )
    return stream


def producer_stream(seed: int, n: int = 10, flavor: str = "nixl") -> dict[int, list[Factory]]:
    """Remote-decode requests (one token, blocks kept until sent) and a few plain ones
    (``flavor``: see :func:`_req`)."""
    rng = random.Random(seed)
    stream: dict[int, list[Factory]] = {}
    for i in range(n):
        prompt = _prompt(rng, rng.randrange(20, 90))
        if i % 3 == 2:
            stream.setdefault(rng.randrange(0, 10), []).append(_req(f"p{i}", prompt, rng.randrange(2, 10)))
        else:
            stream.setdefault(rng.randrange(0, 10), []).append(_req(f"p{i}", prompt, 1, "remote-decode", flavor))
    return stream


def conversation_stream(seed: int, conversations: int = 3, turns: int = 3, gap: int = 14) -> dict[int, list[Factory]]:
    """Multi-turn conversations: turn ``t`` arrives at step ``gap * t`` with the whole
    history (prompt and the fake model's outputs) plus new user tokens."""
    rng = random.Random(seed)
    stream: dict[int, list[Factory]] = {}
    for c in range(conversations):
        history: list[int] = []
        for t in range(turns):
            rid = f"conv{c}t{t}"
            prompt = history + _prompt(rng, 40)
            max_tokens = 4
            stream.setdefault(gap * t + c, []).append(_req(rid, prompt, max_tokens))
            history = prompt + [fake_token(rid, len(prompt) + i) for i in range(max_tokens)]
    return stream


def _merge(*streams: dict[int, list[Factory]]) -> dict[int, list[Factory]]:
    out: dict[int, list[Factory]] = {}
    for s in streams:
        for step, fs in s.items():
            out.setdefault(step, []).extend(fs)
    return out


def _driver(cls: type, kind: str, worker: FakeWorker, *, policy: str, **config: Any) -> ConnectorDriver:
    vllm_config = make_vllm_config(kv_transfer_config=kv_transfer_config(kind, policy), **config)
    return ConnectorDriver(build_scheduler(cls, vllm_config), worker)


def run_stream(
    drivers: list[ConnectorDriver],
    stream: dict[int, list[Factory]],
    *,
    actions: dict[int, Any] | None = None,
    max_steps: int = 400,
) -> list[list[dict[str, Any]]]:
    """Feeds ``stream`` to every driver in lockstep (``actions``: step -> callable(driver),
    run before that step); with two drivers every step's records must be equal. Returns
    each driver's records."""
    records: list[list[dict[str, Any]]] = [[] for _ in drivers]
    last = max(stream)
    for step in range(max_steps):
        for factory in stream.get(step, []):
            for d in drivers:
                d.add(factory())
        for d in drivers:
            if actions and step in actions:
                actions[step](d)
        # Busy while a request is known (kept after finishing too) or a transfer runs.
        busy = [bool(d.scheduler.requests) or bool(d.worker.pending) for d in drivers]
        if step > last and not any(busy):
            break
        assert len(set(busy)) == 1, f"step {step}: one side is done, the other is not"
        recs = [d.step() for d in drivers]
        for r, rec in zip(records, recs):
            r.append(rec)
        if len(drivers) == 2:
            assert recs[1] == recs[0], f"step {step} differs:\nstock {recs[0]}\npaged {recs[1]}"
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError(f"requests stuck after {max_steps} steps")
    return records


def _expected_outputs(driver: ConnectorDriver, prompts: dict[str, int]) -> dict[str, list[int]]:
    """The fake model's tokens for each request's outputs so far."""
    return {rid: [fake_token(rid, prompts[rid] + i) for i in range(len(out))] for rid, out in driver.outputs.items()}


def check_nothing_held(driver: ConnectorDriver) -> None:
    """No request, no transfer in flight, no block in use."""
    sched = driver.scheduler
    assert not sched.has_unfinished_requests()
    assert not sched.requests, f"requests kept: {sorted(sched.requests)}"
    assert not sched.finished_recving_kv_req_ids and not sched.failed_recving_kv_req_ids
    assert not driver.worker.pending
    assert sched.kv_cache_manager.usage == 0.0
    if isinstance(sched, PagedKVScheduler):
        kvm = sched.kv_cache_manager.manager
        kvm.check_invariants()
        assert kvm.num_sequences == 0
        stats = kvm.stats()
        assert stats.used == 0 and stats.free == stats.num_blocks - 1
    else:
        pool = sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


def check_no_request_stuck(driver: ConnectorDriver) -> None:
    """No request waited for its KV longer than its transfer took (``max_delay`` steps) plus
    the step that promotes it."""
    limit = driver.worker.max_delay + 2
    stuck = {rid: n for rid, n in driver.waits.items() if n > limit}
    assert not stuck, f"waited more than {limit} steps for KV: {stuck}"


# --- scenarios --------------------------------------------------------------------------------


@dataclass
class Scenario:
    """One connector setup (``kind``, ``policy``, scheduler ``config``), its stream, and the
    fake worker's delays and failure rate."""

    kind: str
    stream: Any  # () -> stream
    config: dict[str, Any]
    max_delay: int = 3
    p_fail: float = 0.0
    policy: str = "recompute"


SCENARIOS = {
    "nixl-consumer": Scenario(
        "nixl-consumer", lambda: consumer_stream(1), dict(num_blocks=48, max_num_batched_tokens=96), p_fail=0.3
    ),
    "nixl-consumer-fail-policy": Scenario(
        "nixl-consumer",
        lambda: consumer_stream(2),
        dict(num_blocks=48, max_num_batched_tokens=96),
        p_fail=0.3,
        policy="fail",
    ),
    "nixl-producer": Scenario(
        "nixl-producer", lambda: producer_stream(3), dict(num_blocks=24, max_num_batched_tokens=128), max_delay=4
    ),
    "mooncake-consumer": Scenario(
        "mooncake-consumer",
        lambda: consumer_stream(8, flavor="mooncake"),
        dict(num_blocks=48, max_num_batched_tokens=96),
        p_fail=0.3,
    ),
    "mooncake-producer": Scenario(
        "mooncake-producer",
        lambda: producer_stream(9, flavor="mooncake"),
        dict(num_blocks=24, max_num_batched_tokens=128),
        max_delay=4,
    ),
    "offloading": Scenario(
        "offloading", lambda: conversation_stream(4), dict(num_blocks=14, max_num_batched_tokens=256)
    ),
    # pagedkv's host tier through vLLM's OffloadingConnector, on both sides.
    "offloading-pagedkv": Scenario(
        "offloading-pagedkv", lambda: conversation_stream(4), dict(num_blocks=14, max_num_batched_tokens=256)
    ),
    "multi": Scenario(
        "multi",
        lambda: _merge(conversation_stream(5), consumer_stream(6, n=6)),
        dict(num_blocks=24, max_num_batched_tokens=128),
        p_fail=0.2,
    ),
}


def _prompt_lengths(stream: dict[int, list[Factory]]) -> dict[str, int]:
    return {(r := f()).request_id: r.num_prompt_tokens for fs in stream.values() for f in fs}


def _max_tokens(stream: dict[int, list[Factory]]) -> dict[str, int]:
    return {(r := f()).request_id: r.max_tokens for fs in stream.values() for f in fs}


def _run_stock(name: str) -> tuple[ConnectorDriver, list[dict[str, Any]], dict[int, list[Factory]]]:
    sc = SCENARIOS[name]
    worker = FakeWorker(seed=7, max_delay=sc.max_delay, p_fail=sc.p_fail)
    d = _driver(Scheduler, sc.kind, worker, policy=sc.policy, **sc.config)
    stream = sc.stream()
    (records,) = run_stream([d], stream)
    return d, records, stream


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_stock_runs_through(name: str) -> None:
    """The harness on stock vLLM alone: transfers happen, every request finishes with the
    fake model's tokens (a failed load recomputed, or the request ended with an error under
    the "fail" policy), no request is stuck, nothing is held."""
    sc = SCENARIOS[name]
    if sc.kind in ("offloading", "offloading-pagedkv", "multi") and OffloadingWorkerMetadata is None:
        pytest.skip("this vLLM has no OffloadingWorkerMetadata (its offloading API differs)")
    d, records, stream = _run_stock(name)
    prompts, max_tokens = _prompt_lengths(stream), _max_tokens(stream)
    outputs = _expected_outputs(d, prompts)
    assert d.outputs == outputs
    assert set(d.outputs) == set(prompts)
    loads = sum(n for r in records for n in r["loads"].values())
    producer = sc.kind.endswith("-producer")
    assert (loads > 0) == (not producer), "consumers load KV, the producer only sends"
    if sc.p_fail:
        assert d.worker.failed, "the stream must fail loads"
    errored = {rid for rid, reason in d.finish_reasons.items() if reason == "error"}
    if sc.policy == "fail":
        assert errored and errored <= set(d.worker.failed)
    else:
        assert not errored
    for rid in set(prompts) - errored:  # a failed load recomputed: the request still runs out
        assert d.finish_reasons[rid] == "length" and len(d.outputs[rid]) == max_tokens[rid]
    if sc.kind in ("offloading", "offloading-pagedkv", "multi"):
        assert sum(n for r in records for n in r["stores"].values()) > 0
        host_hits = {rid: n for rid, n in d.external.items() if rid.startswith("conv")}
        assert host_hits, "the small device pool must send turns to the host tier"
    if producer:
        # Every remote-decode request (p0, p1, p3, ...) is sent once, after it finished.
        remote_decode = sorted(rid for rid in prompts if int(rid[1:]) % 3 != 2)
        sent = [rid for r in records for rid in r["finished_sending"]]
        assert sorted(sent) == remote_decode
        # Their blocks are kept after they finish until sent; the plain ones' are not.
        kept = {rid for r in records for rid in r["kept_after_finish"]}
        assert kept == set(remote_decode)
    check_no_request_stuck(d)
    check_nothing_held(d)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_lockstep_of_stock_with_itself_is_exact(name: str) -> None:
    """Two stock schedulers with their own fake workers in lockstep: every record equal (the
    records and the worker are deterministic, so a difference against the plug-in is real)."""
    sc = SCENARIOS[name]
    if sc.kind in ("offloading", "offloading-pagedkv", "multi") and OffloadingWorkerMetadata is None:
        pytest.skip("this vLLM has no OffloadingWorkerMetadata (its offloading API differs)")
    drivers = [
        _driver(
            Scheduler,
            sc.kind,
            FakeWorker(seed=7, max_delay=sc.max_delay, p_fail=sc.p_fail),
            policy=sc.policy,
            **sc.config,
        )
        for _ in range(2)
    ]
    a, b = run_stream(drivers, sc.stream())
    assert a == b and len(a) > 10
    assert drivers[0].external == drivers[1].external


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_plugin_matches_stock_step_by_step(name: str) -> None:
    """Stock and the plug-in in lockstep with the same connector and fake worker: every
    step's record equal, nothing stuck, nothing held."""
    sc = SCENARIOS[name]
    if sc.kind in ("offloading", "offloading-pagedkv", "multi") and OffloadingWorkerMetadata is None:
        pytest.skip("this vLLM has no OffloadingWorkerMetadata (its offloading API differs)")
    drivers = [
        _driver(
            cls, sc.kind, FakeWorker(seed=7, max_delay=sc.max_delay, p_fail=sc.p_fail), policy=sc.policy, **sc.config
        )
        for cls in (Scheduler, PagedKVScheduler)
    ]
    run_stream(drivers, sc.stream())
    stock, paged = drivers
    assert paged.outputs == stock.outputs and paged.finish_reasons == stock.finish_reasons
    assert paged.external == stock.external
    for d in drivers:
        check_no_request_stuck(d)
        check_nothing_held(d)


# --- bad input ----------------------------------------------------------------------------------


def _abort_mid_load_stream() -> dict[int, list[Factory]]:
    rng = random.Random(11)
    return {
        0: [_req("slow", _prompt(rng, 60), 4, "remote-prefill"), _req("fast", _prompt(rng, 30), 4, "remote-prefill")],
        1: [_req("plain", _prompt(rng, 40), 6)],
    }


def _abort(rids: list[str]) -> Any:
    def act(driver: ConnectorDriver) -> None:
        driver.abort([r for r in rids if r in driver.scheduler.requests])

    return act


def _abort_worker() -> FakeWorker:
    # "slow"'s load (started in step 0) takes 3 steps; it is aborted before step 2.
    w = FakeWorker(seed=7, max_delay=0)
    w._delay = lambda key: 3 if key.startswith("recv:slow") else 0  # type: ignore[method-assign]
    return w


def test_stock_abort_while_loading_frees_after_the_load() -> None:
    d = _driver(Scheduler, "nixl-consumer", _abort_worker(), policy="recompute", num_blocks=32)
    (records,) = run_stream([d], _abort_mid_load_stream(), actions={2: _abort(["slow"])})
    assert d.finish_reasons["slow"] == "abort" and d.outputs["slow"] == []
    # Aborted in step 2 while its load ran; its blocks stay held until the load reports done
    # at the end of step 3, then they are freed.
    assert records[1]["waiting_for_kvs"] == ["slow"]
    assert "slow" in records[3]["finished_recving"]
    assert len(d.outputs["fast"]) == 4 and len(d.outputs["plain"]) == 6
    check_nothing_held(d)


def test_plugin_abort_while_loading_matches_stock() -> None:
    drivers = [
        _driver(cls, "nixl-consumer", _abort_worker(), policy="recompute", num_blocks=32)
        for cls in (Scheduler, PagedKVScheduler)
    ]
    run_stream(drivers, _abort_mid_load_stream(), actions={2: _abort(["slow"])})
    for d in drivers:
        check_nothing_held(d)


# A finished_recving the scheduler cannot match: an id it never had, and a running request
# that never loaded (a connector reporting a load it never matched), at the step given.
BOGUS_RECVS = [pytest.param("never-seen", 1, id="unknown-id"), pytest.param("plain", 2, id="never-loaded")]


@pytest.mark.parametrize(("rid", "at"), BOGUS_RECVS)
def test_stock_asserts_on_a_finished_recving_it_cannot_match(rid: str, at: int) -> None:
    # Stock vLLM trusts its worker: the report is an AssertionError raised from
    # update_from_output (the plug-in must instead drop it, see below).
    w = FakeWorker(seed=7, extra={at: {"finished_recving": {rid}}})
    d = _driver(Scheduler, "nixl-consumer", w, policy="recompute", num_blocks=32)
    with pytest.raises(AssertionError):
        run_stream([d], _abort_mid_load_stream())
    assert w.step == at + 1, "raised on the bogus report"


@pytest.mark.parametrize(("rid", "at"), BOGUS_RECVS)
def test_plugin_drops_a_finished_recving_it_cannot_match(rid: str, at: int) -> None:
    # The plug-in ignores the report and runs exactly as stock does without it.
    stock = _driver(Scheduler, "nixl-consumer", FakeWorker(seed=7), policy="recompute", num_blocks=32)
    bad = FakeWorker(seed=7, extra={at: {"finished_recving": {rid}}})
    paged = _driver(PagedKVScheduler, "nixl-consumer", bad, policy="recompute", num_blocks=32)
    (want,) = run_stream([stock], _abort_mid_load_stream())
    (got,) = run_stream([paged], _abort_mid_load_stream())
    got[at]["finished_recving"] = [r for r in got[at]["finished_recving"] if r != rid]
    assert got == want
    check_nothing_held(paged)


def _preempt_stream() -> dict[int, list[Factory]]:
    # Three plain requests, then "x", which loads its prompt (3 blocks) and decodes: their
    # growth overflows the small pool, so decoding preempts the newest running request, "x".
    rng = random.Random(13)
    stream: dict[int, list[Factory]] = {0: [_req(f"q{i}", _prompt(rng, 40), 40) for i in range(3)]}
    stream[1] = [_req("x", _prompt(rng, 40), 40, "remote-prefill")]
    return stream


def _late_invalid_worker(at_step: int, blocks: set[int]) -> FakeWorker:
    return FakeWorker(seed=7, max_delay=0, extra={at_step: {"invalid_block_ids": blocks}})


def _find_preemption(records: list[dict[str, Any]], rid: str) -> int:
    for i, r in enumerate(records):
        if rid in r["preempted"]:
            return i
    raise AssertionError(f"{rid} was never preempted")


def test_stock_failed_load_reported_after_preemption() -> None:
    # A dry run finds the step that preempts "x" and the blocks its load went to; the real
    # run reports those blocks invalid one step after the preemption ("fail" policy, so stock
    # evicts them): no running request is affected, and the run completes with the fake
    # model's outputs, nothing held.
    dry = _driver(Scheduler, "nixl-consumer", FakeWorker(seed=7, max_delay=0), policy="fail", num_blocks=16)
    (records,) = run_stream([dry], _preempt_stream())
    at = _find_preemption(records, "x") + 1
    blocks = set(dry.worker.load_blocks["x"])
    d = _driver(Scheduler, "nixl-consumer", _late_invalid_worker(at, blocks), policy="fail", num_blocks=16)
    stream = _preempt_stream()
    (records,) = run_stream([d], stream)
    assert records[at]["num_invalid_blocks"] == len(blocks) == 3
    assert "error" not in d.finish_reasons.values()
    assert d.outputs == _expected_outputs(d, _prompt_lengths(stream))
    assert all(len(d.outputs[rid]) == 40 for rid in d.outputs)
    check_nothing_held(d)


def test_plugin_failed_load_reported_after_preemption_matches_stock() -> None:
    dry = _driver(Scheduler, "nixl-consumer", FakeWorker(seed=7, max_delay=0), policy="fail", num_blocks=16)
    (records,) = run_stream([dry], _preempt_stream())
    at = _find_preemption(records, "x") + 1
    blocks = set(dry.worker.load_blocks["x"])
    stock = _driver(Scheduler, "nixl-consumer", _late_invalid_worker(at, blocks), policy="fail", num_blocks=16)
    # pagedkv's block ids for "x"'s load are its own: found by the same dry run on the plug-in.
    pdry = _driver(PagedKVScheduler, "nixl-consumer", FakeWorker(seed=7, max_delay=0), policy="fail", num_blocks=16)
    (precords,) = run_stream([pdry], _preempt_stream())
    assert _find_preemption(precords, "x") + 1 == at
    paged = _driver(
        PagedKVScheduler,
        "nixl-consumer",
        _late_invalid_worker(at, set(pdry.worker.load_blocks["x"])),
        policy="fail",
        num_blocks=16,
    )
    run_stream([stock, paged], _preempt_stream())
    for d in (stock, paged):
        check_nothing_held(d)


@needs_offloading
@pytest.mark.parametrize("seed", [4, 5, 6])
def test_plugin_with_pagedkv_host_tier_matches_stock_with_vllms_cpu_spec(seed: int) -> None:
    """pagedkv's scheduler with pagedkv's own host tier (``PagedKVCPUOffloadingSpec`` behind the
    ``OffloadingConnector``) against stock vLLM with vLLM's CPU spec, on multi-turn chats that
    overflow a small device pool: every step's record equal (host hits, loads, stores, usage),
    the fake model's outputs, nothing held."""
    config = dict(num_blocks=14, max_num_batched_tokens=256)
    stock = _driver(Scheduler, "offloading", FakeWorker(seed=7), policy="recompute", **config)
    paged = _driver(PagedKVScheduler, "offloading-pagedkv", FakeWorker(seed=7), policy="recompute", **config)
    stream = conversation_stream(seed)
    records, _ = run_stream([stock, paged], stream)
    assert sum(n for r in records for n in r["loads"].values()) > 0, "turns must come back from the host tier"
    assert paged.external == stock.external and paged.external
    assert paged.outputs == stock.outputs == _expected_outputs(stock, _prompt_lengths(stream))
    for d in (stock, paged):
        check_nothing_held(d)


# --- Mamba groups in vLLM's cache mode none (prefix caching off) --------------------------------


def _mamba_none_driver(cls: type, kind: str, worker: FakeWorker, groups: Any, **config: Any) -> ConnectorDriver:
    """A scheduler over a hybrid config whose Mamba groups are in cache mode none (blocks of the
    context length, 512 tokens; prefix caching off), with ``kind``'s connector."""
    import math

    from pagedkv.testing.vllm_scheduler import make_mamba_kv_cache_config

    ctx = 512
    num_blocks = config.pop("num_blocks")
    vllm_config = make_vllm_config(
        kv_transfer_config=kv_transfer_config(kind),
        num_blocks=num_blocks,
        max_model_len=ctx,
        enable_prefix_caching=False,
        **config,
    )
    vllm_config.cache_config.mamba_cache_mode = "none"
    vllm_config.cache_config.mamba_block_size = ctx
    kv = make_mamba_kv_cache_config(num_blocks, groups, BS, mamba_cache_mode="none", mamba_block_size=ctx)
    lcm = math.lcm(BS, ctx)
    return ConnectorDriver(
        build_scheduler(cls, vllm_config, kv_cache_config=kv, block_size=lcm, hash_block_size=lcm), worker
    )


@pytest.mark.parametrize(
    "groups", [("gdn", "gdn", "gdn", "full"), ("mamba2", "mamba2", "full")], ids=["qwen3-next", "nemotron-h"]
)
@pytest.mark.parametrize(
    ("kind", "stream", "num_blocks", "p_fail"),
    [
        # No failed loads: the fake worker reports them by block (invalid_block_ids), which
        # vLLM refuses with several KV cache groups.
        ("nixl-consumer", lambda: consumer_stream(1), 60, 0.0),
        ("nixl-producer", lambda: producer_stream(3), 40, 0.0),
    ],
    ids=["nixl-consumer", "nixl-producer"],
)
def test_plugin_matches_stock_with_mamba_none_groups(
    groups: Any, kind: str, stream: Any, num_blocks: int, p_fail: float
) -> None:
    """NIXL consumer (remote prefills loading into the Mamba groups' blocks too) and producer
    with Mamba groups in cache mode none: stock and the plug-in in lockstep, every step's
    record equal (blocks in use included), nothing stuck, nothing held."""
    drivers = [
        _mamba_none_driver(
            cls,
            kind,
            FakeWorker(seed=7, max_delay=3, p_fail=p_fail),
            groups,
            num_blocks=num_blocks,
            max_num_batched_tokens=96,
        )
        for cls in (Scheduler, PagedKVScheduler)
    ]
    # Per driver: each step's NIXL loads, per request the number of local blocks per group.
    loads: list[list[dict[str, list[int]]]] = [[], []]
    for d, seen in zip(drivers, loads, strict=True):
        schedule = d.scheduler.schedule

        def wrapped(schedule: Any = schedule, seen: list[dict[str, list[int]]] = seen) -> Any:
            out = schedule()
            meta = out.kv_connector_metadata
            recv = getattr(meta, "reqs_to_recv", {}) or {}
            seen.append({rid: [len(g) for g in m.local_block_ids] for rid, m in recv.items()})
            return out

        d.scheduler.schedule = wrapped
    records = run_stream(drivers, stream())
    assert loads[0] == loads[1]
    stock, paged = drivers
    assert paged.outputs == stock.outputs and paged.finish_reasons == stock.finish_reasons
    assert paged.external == stock.external
    if kind == "nixl-consumer":
        assert sum(len(r["external"]) for r in records[0]) > 0
        # Every load writes the Mamba groups' blocks too.
        assert any(len(step) for step in loads[0])
        assert all(all(n > 0 for n in per_group) for step in loads[0] for per_group in step.values())
    for d in drivers:
        check_no_request_stuck(d)
        check_nothing_held(d)
