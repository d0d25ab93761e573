"""KV connectors beside align-mode Mamba groups: stock vLLM vs ``PagedKVScheduler`` in lockstep.

Fake KV cache configs shaped like Qwen3-Next (three Gated DeltaNet state groups, one full
attention group) and Nemotron-H (two Mamba-2 state groups, one full attention group), with a
NIXL consumer (remote prefill: async loads of a request's prompt KV and states), a NIXL
producer (remote decode: blocks kept until sent) and Mooncake P/D. The fake worker of
``test_vllm_connectors.py`` completes, delays and fails the loads; with several KV cache
groups vLLM takes only whole-request failures (``failed_recving``; block-level
``invalid_block_ids`` raise in its scheduler), so this worker reports no invalid blocks.

Every step both schedulers must agree on the scheduled tokens, prefix hits, the connector's
external tokens, loads, sends, finished and failed transfers, requests waiting for KV,
preemptions, outputs, and per group each scheduled request's table length; the columns
of each load's table the worker is sent (which are null, per group) are equal; attention
groups hold equal blocks and a state group at most one fewer in pagedkv (the previous state
released in the allocation that moves it, docs/design/vllm-mamba.md). pagedkv's invariants
(a loading sequence's staged blocks, its live state among them, are private and never
registered) are checked after every step, and no state of a failed or aborted load is ever
a hit: the hits are stock's, and a re-sent request whose load failed hits only what was
computed locally. Also: divergent local hits (NIXL restores the state under a deeper attention
hit, Mooncake does not), async scheduling (outputs, finish reasons and hits against stock's
``AsyncScheduler``), a partial load end refused without a change, and offloading beside Mamba
groups refused by name.

Runs only where vLLM is installed (``make test-vllm``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from helpers.vllm_streams import assert_blocks_held  # noqa: E402
from test_vllm_connectors import (  # noqa: E402
    ConnectorDriver,
    FakeWorker,
    _req,
    _Transfer,
    kv_transfer_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from pagedkv.errors import InvalidArgumentError  # noqa: E402
from pagedkv.integrations.vllm import (  # noqa: E402
    PagedKVCacheManager,
    PagedKVScheduler,
    UnsupportedVllmConfigError,
)
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    NEMOTRON_H_GROUPS,
    QWEN3_NEXT_GROUPS,
    build_scheduler,
    make_mamba_kv_cache_config,
    make_vllm_config,
)

BS = 16
SHAPES = [pytest.param(QWEN3_NEXT_GROUPS, id="qwen3-next"), pytest.param(NEMOTRON_H_GROUPS, id="nemotron-h")]


class MambaWorker(FakeWorker):
    """:class:`FakeWorker` reporting whole-request load failures only, and recording per
    NIXL load the null pattern of every group's local block ids (the runner's columns)."""

    columns: dict[str, tuple[tuple[bool, ...], ...]]

    def _start(self, meta: Any) -> tuple[dict[str, int], dict[str, int]]:
        self.columns = {}
        if isinstance(meta, NixlConnectorMetadata):
            for rid, rm in meta.reqs_to_recv.items():
                self.columns[rid] = tuple(tuple(b != 0 for b in g) for g in rm.local_block_ids)
        return super()._start(meta)

    def _start_load(self, rid: str, blocks: tuple[int, ...], loads: dict[str, int]) -> None:
        """As :class:`FakeWorker`'s, but the delay and the failure are drawn from the request
        and its attempt, not the step: under async scheduling a load may start a step later in
        the plug-in (a sibling's wait), and must meet the same fate."""
        attempts = self.__dict__.setdefault("attempts", {})
        attempts[rid] = attempts.get(rid, 0) + 1
        loads[rid] = loads.get(rid, 0) + len(blocks)
        self.load_blocks[rid] = blocks
        key = f"recv:{rid}:attempt{attempts[rid]}"
        fail = self._rng(key + ":fail").random() < self.p_fail
        self.pending.append(_Transfer(self.step + self._delay(key), fail=fail, recv_req=rid, blocks=blocks))

    def report(self, sched_output: Any, num_connectors: int) -> KVConnectorOutput:
        out = super().report(sched_output, num_connectors)
        out.invalid_block_ids = set()
        self.last["num_invalid_blocks"] = 0
        self.last["columns"] = self.columns
        return out


def _driver(cls: type, groups: Any, kind: str, worker: FakeWorker, num_blocks: int, **config: Any) -> ConnectorDriver:
    vc = make_vllm_config(
        num_blocks=num_blocks,
        block_size=BS,
        kv_transfer_config=kv_transfer_config(kind, config.pop("policy", "recompute")),
        **config,
    )
    vc.cache_config.mamba_cache_mode = "align"
    kv = make_mamba_kv_cache_config(num_blocks, groups, BS)
    d = ConnectorDriver(build_scheduler(cls, vc, kv_cache_config=kv, block_size=BS, hash_block_size=BS), worker)
    # The columns a finished request hands the connector (a producer's blocks to send, the
    # live state column among them): per group, which are null.
    d.sent_columns = {}  # type: ignore[attr-defined]
    finished = d.scheduler.connector.request_finished

    def record(request: Any, block_ids: Any) -> Any:
        d.sent_columns[request.request_id] = tuple(tuple(b != 0 for b in g) for g in block_ids)  # type: ignore[attr-defined]
        return finished(request, block_ids)

    d.scheduler.connector.request_finished = record
    return d


def _stream(seed: int, kind: str, n: int = 10) -> dict[int, list[Any]]:
    """Remote-prefill (consumer) or remote-decode (producer) requests, half of them sharing a
    48-token system prompt (local hits before the external ones), and a few plain ones."""
    rng = random.Random(seed)
    system = [rng.randrange(100, 4000) for _ in range(48)]
    flavor = "mooncake" if kind.startswith("mooncake") else "nixl"
    role = "remote-prefill" if kind.endswith("consumer") else "remote-decode"
    stream: dict[int, list[Any]] = {}
    for i in range(n):
        prompt = (system if i % 2 else []) + [rng.randrange(100, 4000) for _ in range(rng.randrange(5, 70))]
        transfer = role if i % 4 != 3 else None
        max_tokens = 1 if transfer == "remote-decode" else rng.randrange(2, 12)
        stream.setdefault(rng.randrange(0, 12), []).append(_req(f"m{i}", prompt, max_tokens, transfer, flavor))
    return stream


def _lockstep(
    groups: Any, kind: str, stream: dict[int, list[Any]], *, p_fail: float, num_blocks: int = 400, **config: Any
) -> tuple[ConnectorDriver, ConnectorDriver, dict[str, int]]:
    """Stock and the plug-in in lockstep (see the module docs); returns both drivers and the
    figures: ``steps``, ``state_diff`` (request-steps where a state group held one block fewer
    in pagedkv), ``loads`` (NIXL / Mooncake loads started)."""
    drivers = [
        _driver(cls, groups, kind, MambaWorker(seed=7, max_delay=3, p_fail=p_fail), num_blocks, **dict(config))
        for cls in (Scheduler, PagedKVScheduler)
    ]
    stock, paged = drivers
    kvm = paged.scheduler.kv_cache_manager
    assert isinstance(kvm, PagedKVCacheManager)
    state = [g for g, k in enumerate(groups) if k != "full"]
    fig = {"steps": 0, "state_diff": 0, "loads": 0}
    last = max(stream)
    for step in range(600):
        for factory in stream.get(step, []):
            for d in drivers:
                d.add(factory())
        busy = [bool(d.scheduler.requests) or bool(d.worker.pending) for d in drivers]
        if step > last and not any(busy):
            break
        assert busy[0] == busy[1], f"step {step}: one side is done, the other is not"
        a, b = stock.step(), paged.step()
        kvm.manager.check_invariants()
        fig["steps"] += 1
        fig["loads"] += len(a["loads"])
        held_a, held_b = a.pop("blocks_held"), b.pop("blocks_held")
        a.pop("blocks_in_use"), b.pop("blocks_in_use")
        assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
        # No lower bound on the state blocks here (min_state=0), as this suite had it.
        fig["state_diff"] += len(assert_blocks_held(step, held_a, held_b, state, min_state=0))
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError("requests stuck")
    assert paged.outputs == stock.outputs and paged.finish_reasons == stock.finish_reasons
    assert paged.external == stock.external
    assert paged.prefix_hits == stock.prefix_hits
    assert paged.sent_columns == stock.sent_columns  # type: ignore[attr-defined]
    kvm.manager.check_invariants()
    assert kvm.manager.num_sequences == 0 and kvm.usage == 0.0
    assert stock.scheduler.kv_cache_manager.usage == 0.0
    return stock, paged, fig


@pytest.mark.parametrize("groups", SHAPES)
@pytest.mark.parametrize("kind", ["nixl-consumer", "mooncake-consumer", "nixl-producer", "mooncake-producer"])
def test_connector_with_mamba_groups_matches_stock_step_by_step(groups: Any, kind: str) -> None:
    stock, _paged, fig = _lockstep(groups, kind, _stream(3, kind), p_fail=0.0, max_num_batched_tokens=96)
    assert len(stock.outputs) == 10
    if kind.endswith("consumer"):
        assert fig["loads"] > 0
        assert sum(stock.external.values()) > 0
    print(f"{groups} {kind}: {fig}")


@pytest.mark.parametrize("groups", SHAPES)
@pytest.mark.parametrize("kind", ["nixl-consumer", "mooncake-consumer"])
def test_divergent_local_hits_match_stock(groups: Any, kind: str) -> None:
    """A plain request computes a 48-token system prompt and more in one chunk: the
    attention group caches the prompt's blocks, the state groups only the chunk ends' states
    (an earlier request left the one after 16 tokens of the system prompt cached). A
    remote-prefill sibling sharing the system prompt then has an attention hit (48) deeper
    than its state hit (16). NIXL restores the state itself (vLLM's divergent local hybrid
    hits): the local hit is the attention one and the load covers the rest (39 tokens of
    87); Mooncake does not: the hit every group serves (16), 71 loaded. Both as stock, step
    by step."""
    rng = random.Random(1)
    system = [rng.randrange(100, 4000) for _ in range(48)]
    flavor = "mooncake" if kind.startswith("mooncake") else "nixl"
    stream = {
        # A0 leaves the state after 16 tokens of the system prompt cached (a state hit of 16
        # under the attention hit of 48: vLLM's state group then holds its own hit block).
        0: [_req("A0", system[:16] + [rng.randrange(100, 4000) for _ in range(5)], 2)],
        2: [_req("A", system + [rng.randrange(100, 4000) for _ in range(60)], 3)],
        6: [_req("B", system + [rng.randrange(100, 4000) for _ in range(40)], 3, "remote-prefill", flavor)],
        8: [_req("C", system + [rng.randrange(100, 4000) for _ in range(70)], 2, "remote-prefill", flavor)],
    }
    stock, _paged, _fig = _lockstep(groups, kind, stream, p_fail=0.0, max_num_batched_tokens=128)
    assert stock.prefix_hits["A"] == 16
    if flavor == "nixl":
        assert stock.external == {"B": 39, "C": 69}
    else:
        assert stock.external == {"B": 71, "C": 101}


@pytest.mark.parametrize("groups", SHAPES)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_loads_with_mamba_groups_match_stock(groups: Any, policy: str) -> None:
    """Loads failed by the worker (whole-request failures): with ``recompute`` the request is
    freed and scheduled again from its local hit, with ``fail`` it finishes with an error;
    both as stock, and no state of a failed load is ever a hit."""
    stock, paged, fig = _lockstep(
        groups, "nixl-consumer", _stream(5, "nixl-consumer", 12), p_fail=0.5, policy=policy, max_num_batched_tokens=96
    )
    assert stock.worker.failed and paged.worker.failed == stock.worker.failed
    print(f"{groups} {policy}: {fig}, failed {stock.worker.failed}")


@pytest.mark.parametrize("groups", SHAPES)
def test_resent_request_after_failed_or_aborted_load_hits_only_local_states(groups: Any) -> None:
    """A request whose load failed, and one aborted mid-load, are sent again with the same
    prompt as plain requests: their hits (equal to stock's) come from states computed
    locally, never from the staged states of the failed or aborted loads."""
    rng = random.Random(11)
    p1 = [rng.randrange(100, 4000) for _ in range(70)]
    p2 = [rng.randrange(100, 4000) for _ in range(66)]
    stream = {
        0: [_req("fail", p1, 3, "remote-prefill"), _req("slow", p2, 3, "remote-prefill")],
        8: [_req("again-fail", p1, 3), _req("again-slow", p2, 3)],
    }
    drivers = []
    for cls in (Scheduler, PagedKVScheduler):
        w = MambaWorker(seed=7, max_delay=0)
        w._delay = lambda key: 3 if key.startswith("recv:slow") else 0  # type: ignore[method-assign]
        orig = w._start_load

        def start(rid: str, blocks: Any, loads: Any, _o: Any = orig, _w: Any = w) -> None:
            _w.p_fail = 1.0 if rid == "fail" else 0.0  # "fail"'s load fails, the others do not
            _o(rid, blocks, loads)

        w._start_load = start  # type: ignore[method-assign]
        drivers.append(_driver(cls, groups, "nixl-consumer", w, 200, policy="fail"))
    # "fail" fails at once (policy fail: finished with an error), "slow" is aborted in step 1.
    kvm = drivers[1].scheduler.kv_cache_manager
    last = max(stream)
    for step in range(100):
        for factory in stream.get(step, []):
            for d in drivers:
                d.add(factory())
        if step == 1:
            for d in drivers:
                d.abort(["slow"])
        busy = [bool(d.scheduler.requests) or bool(d.worker.pending) for d in drivers]
        if step > last and not any(busy):
            break
        a, b = (d.step() for d in drivers)
        kvm.manager.check_invariants()
        for r in (a, b):
            r.pop("blocks_held"), r.pop("blocks_in_use")
        assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
    for d in drivers:
        assert d.finish_reasons["slow"] == "abort"
        assert d.finish_reasons["fail"] != "length"
        # Nothing of the two loads was ever computed locally: no hit for the re-sent prompts.
        assert d.prefix_hits["again-fail"] == 0 and d.prefix_hits["again-slow"] == 0
        assert len(d.outputs["again-fail"]) == 3 and len(d.outputs["again-slow"]) == 3
    assert drivers[1].outputs == drivers[0].outputs
    assert kvm.manager.num_sequences == 0 and kvm.usage == 0.0


@pytest.mark.parametrize("groups", SHAPES)
@pytest.mark.parametrize(
    ("kind", "field"),
    [
        ("offloading", "kv_transfer_config.kv_connector"),
        ("offloading-pagedkv", "kv_transfer_config.kv_connector"),
        ("multi", "kv_transfer_config.kv_connector.connectors[1]"),
    ],
)
def test_offloading_connectors_beside_mamba_groups_are_refused(groups: Any, kind: str, field: str) -> None:
    """Offloading beside Mamba groups is refused, naming the connector: it stores and loads
    Mamba states through blocks vLLM caches at allocation (stock offloads the states, the
    plug-in would offload none and could load attention KV without its state)."""
    vc = make_vllm_config(num_blocks=200, block_size=BS, kv_transfer_config=kv_transfer_config(kind))
    vc.cache_config.mamba_cache_mode = "align"
    kv = make_mamba_kv_cache_config(200, groups, BS)
    with pytest.raises(UnsupportedVllmConfigError) as e:
        build_scheduler(PagedKVScheduler, vc, kv_cache_config=kv, block_size=BS, hash_block_size=BS)
    assert e.value.field == field
    assert "MultiConnector of them" in e.value.reason
    # Stock builds it.
    build_scheduler(Scheduler, vc, kv_cache_config=make_mamba_kv_cache_config(200, groups, BS), block_size=BS)


def test_multi_connector_of_p_d_connectors_beside_mamba_groups_is_served() -> None:
    """A MultiConnector whose members are all P/D connectors is accepted."""
    from test_vllm_connectors import _mooncake, _nixl
    from vllm.config import KVTransferConfig

    cfg = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_consumer",
        kv_connector_extra_config={"connectors": [_nixl("kv_consumer"), _mooncake("kv_consumer")]},
    )
    vc = make_vllm_config(num_blocks=200, block_size=BS, kv_transfer_config=cfg)
    vc.cache_config.mamba_cache_mode = "align"
    kv = make_mamba_kv_cache_config(200, QWEN3_NEXT_GROUPS, BS)
    sched = build_scheduler(PagedKVScheduler, vc, kv_cache_config=kv, block_size=BS, hash_block_size=BS)
    assert sched.connector is not None


def test_partial_load_commit_with_mamba_groups_is_refused_and_changes_nothing() -> None:
    """A load end with fewer valid tokens than loaded (vLLM reports only whole-request
    failures with several groups): ``InvalidArgumentError``, the request still loading and
    its staged state unpublished; the full end then commits."""
    worker = MambaWorker(seed=7, max_delay=5)
    worker._delay = lambda key: 5  # type: ignore[method-assign]
    d = _driver(PagedKVScheduler, QWEN3_NEXT_GROUPS, "nixl-consumer", worker, 200)
    rng = random.Random(3)
    d.add(_req("r", [rng.randrange(100, 4000) for _ in range(70)], 2, "remote-prefill")())
    d.step()
    kvm = d.scheduler.kv_cache_manager
    request = d.scheduler.requests["r"]
    seq = kvm._seq_of["r"]
    assert kvm.manager.status(seq) == "loading"
    end = int(kvm.manager.num_computed_tokens(seq))
    assert end == request.num_computed_tokens > 0
    tables = [t.tolist() for t in kvm.manager.block_tables(seq)]
    with pytest.raises(InvalidArgumentError, match="ended with"):
        kvm.cache_blocks(request, end - BS)
    assert kvm.manager.status(seq) == "loading" and "r" in kvm._loading
    assert [t.tolist() for t in kvm.manager.block_tables(seq)] == tables
    kvm.manager.check_invariants()
    kvm.cache_blocks(request, end)
    assert kvm.manager.status(seq) == "running"
    kvm.manager.check_invariants()


def _async_driver(cls: type, groups: Any, worker: MambaWorker) -> Any:
    """An :class:`AsyncDriver` (two batches in flight) whose batches carry the fake worker's
    connector output: the worker starts a batch's transfers when it is scheduled and its
    report rides on that batch's model output."""
    from pagedkv.testing.vllm_scheduler import AsyncDriver

    vc = make_vllm_config(
        num_blocks=400,
        block_size=BS,
        kv_transfer_config=kv_transfer_config("nixl-consumer"),
        async_scheduling=True,
        max_num_batched_tokens=96,
    )
    vc.cache_config.mamba_cache_mode = "align"
    kv = make_mamba_kv_cache_config(400, groups, BS)
    sched = build_scheduler(cls, vc, kv_cache_config=kv, block_size=BS, hash_block_size=BS)
    d = AsyncDriver(sched)
    reports: dict[int, Any] = {}
    schedule, update = sched.schedule, sched.update_from_output

    def scheduled(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        reports[id(out)] = worker.report(out, 1)
        return out

    def updated(out: Any, model_out: Any) -> Any:
        model_out.kv_connector_output = reports.pop(id(out))
        return update(out, model_out)

    sched.schedule, sched.update_from_output = scheduled, updated
    d.worker = worker  # type: ignore[attr-defined]
    return d


@pytest.mark.parametrize("groups", SHAPES)
@pytest.mark.parametrize("p_fail", [0.0, 0.5])
def test_async_scheduling_with_nixl_and_mamba_groups_matches_stock_outputs(groups: Any, p_fail: float) -> None:
    """Async scheduling (vLLM's default on GPUs), NIXL consumer, loads delayed and failed:
    the plug-in's async scheduler gives stock ``AsyncScheduler``'s outputs, finish reasons and
    prefix hits; pagedkv's invariants hold after every step (a loading sequence's staged
    state private and unregistered), nothing is held at the end. Steps may differ where the
    plug-in keeps a sibling waiting for a state whose step is in flight
    (docs/design/vllm-mamba.md, "Async scheduling")."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from pagedkv.integrations.vllm import PagedKVAsyncScheduler

    drivers = [
        _async_driver(cls, groups, MambaWorker(seed=7, max_delay=3, p_fail=p_fail))
        for cls in (AsyncScheduler, PagedKVAsyncScheduler)
    ]
    stream = _stream(9, "nixl-consumer", 12)
    kvm = drivers[1].scheduler.kv_cache_manager
    last = max(stream)
    for step in range(800):
        for factory in stream.get(step, []):
            for d in drivers:
                d.add(factory())
        busy = [d.has_work() or bool(d.worker.pending) for d in drivers]
        if step > last and not any(busy):
            break
        for d in drivers:
            if d.has_work() or d.worker.pending:
                d.step()
        kvm.manager.check_invariants()
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError("requests stuck")
    stock, paged = drivers
    assert len(stock.outputs) == 12
    assert paged.outputs == stock.outputs and paged.finish_reasons == stock.finish_reasons
    assert paged.prefix_hits == stock.prefix_hits
    assert paged.worker.failed == stock.worker.failed
    if p_fail:
        assert stock.worker.failed
    assert kvm.manager.num_sequences == 0 and kvm.usage == 0.0
