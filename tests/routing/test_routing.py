"""Routing policies on hand-computed cases, the Router over a KVIndexer, and vLLM's KV event
wire format (msgpack batches) into the indexer."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import pagedkv
from pagedkv.routing import (
    DEFAULT_MAX_IMBALANCE,
    KVAwarePolicy,
    LeastLoadedPolicy,
    NotAKVEventError,
    NoWorkerError,
    RoundRobinPolicy,
    Router,
    RoutingError,
    UnknownWorkerError,
    WireFormatError,
    WorkerLoad,
    load_bound,
    policy_by_name,
    wire,
)
from pagedkv.routing.policy import IMBALANCE_MEMORY

msgspec = pytest.importorskip("msgspec")

L = WorkerLoad


def test_kv_aware_cost_by_hand() -> None:
    # n = 10 blocks; overlaps 8 / 2 / 0; loads 4 / 0 / 2 requests (mean 2).
    p = KVAwarePolicy(overlap_weight=1.0, load_weight=1.0, kv_weight=0.0, max_imbalance=None)
    loads = {0: L(4), 1: L(0), 2: L(1, 1)}
    costs = p.costs([0, 1, 2], {0: 8, 1: 2}, 10, loads)
    # worker 0: 2/10 + 4/3 = 1.5333; worker 1: 8/10 + 0 = 0.8; worker 2: 10/10 + 2/3 = 1.6667
    assert costs == pytest.approx({0: 0.2 + 4 / 3, 1: 0.8, 2: 1.0 + 2 / 3})
    assert p.choose([0, 1, 2], {0: 8, 1: 2}, 10, loads) == 1
    # Weighting the overlap 3x flips it to the worker holding the prefix:
    # worker 0: 0.6 + 1.333 = 1.933; worker 1: 2.4; worker 2: 3.667.
    assert KVAwarePolicy(3.0, 1.0, max_imbalance=None).choose([0, 1, 2], {0: 8, 1: 2}, 10, loads) == 0


def test_kv_aware_imbalance_cap_and_kv_usage() -> None:
    # Loads 9 / 1 / 2: bound 1.25 * (12 + 1) / 3 = 5.42, so only workers that hold at most 5 after
    # taking the request (loads <= 4) are candidates: worker 0 is out despite its full overlap.
    loads = {0: L(9), 1: L(1), 2: L(2)}
    p = KVAwarePolicy(overlap_weight=10.0, load_weight=0.0, max_imbalance=1.25)
    assert set(p.costs([0, 1, 2], {0: 4}, 4, loads)) == {1, 2}
    assert p.choose([0, 1, 2], {0: 4, 2: 1}, 4, loads) == 2
    # KV usage breaks an otherwise equal choice: 90 % vs 10 % used.
    kv = {0: L(1, kv_blocks_used=90, kv_blocks_total=100), 1: L(1, kv_blocks_used=10, kv_blocks_total=100)}
    assert KVAwarePolicy(kv_weight=1.0).choose([0, 1], {}, 4, kv) == 1
    # Queued prefill tokens: 900 vs 100 (mean 500): 0.5 * 900/501 > 1/4 + 0.5 * 100/501 -> worker 1
    # despite worker 0 holding 1 of the 4 blocks more.
    pf = {0: L(1, num_prefill_tokens=900), 1: L(1, num_prefill_tokens=100)}
    assert KVAwarePolicy(1.0, 0.0, prefill_weight=0.5).choose([0, 1], {0: 1}, 4, pf) == 1
    assert KVAwarePolicy(1.0, 0.0, prefill_weight=0.0).choose([0, 1], {0: 1}, 4, pf) == 0
    # Exact ties: fewer requests, then the lower id.
    assert KVAwarePolicy(load_weight=0.0, prefill_weight=0.0).choose([3, 1, 2], {}, 4, {3: L(0), 1: L(2), 2: L(0)}) == 2


def test_baselines() -> None:
    rr = RoundRobinPolicy()
    assert [rr.choose([2, 0, 1], {0: 9}, 9, {}) for _ in range(4)] == [0, 1, 2, 0]
    ll = LeastLoadedPolicy()
    loads = {0: L(3), 1: L(1, 1), 2: L(1, 1, kv_blocks_used=5, kv_blocks_total=10)}
    assert ll.choose([0, 1, 2], {0: 9}, 9, loads) == 1
    assert policy_by_name("least_loaded").name == "least_loaded"
    assert policy_by_name("kv_aware", load_weight=2.0).load_weight == 2.0  # type: ignore[attr-defined]


def test_a_router_refuses_what_is_not_an_indexer_or_a_policy() -> None:
    """Checked at construction: before, ``Router(indexer, policy=5)`` failed with an
    AttributeError at the first route."""
    indexer = pagedkv.KVIndexer(block_size=4)
    for args, kwargs, match in (
        ((indexer,), {"policy": 5}, "policy must be a routing policy"),
        ((indexer,), {"policy": "kv_aware"}, "policy must be a routing policy"),
        ((object(),), {}, "indexer must be a pagedkv.KVIndexer"),
    ):
        with pytest.raises(pagedkv.InvalidArgumentError, match=match) as ei:
            Router(*args, **kwargs)
        assert isinstance(ei.value, ValueError)
    assert isinstance(Router(indexer, policy=LeastLoadedPolicy()).policy, LeastLoadedPolicy)


def test_bad_policy_arguments() -> None:
    """Every bad argument is a pagedkv error that is also the builtin ValueError."""
    cases: list[tuple[Any, type[pagedkv.PagedKVError], str]] = [
        (lambda: KVAwarePolicy(overlap_weight=-1), pagedkv.InvalidConfigError, "overlap_weight"),
        (lambda: KVAwarePolicy(load_weight=True), pagedkv.InvalidConfigError, "load_weight"),
        (lambda: KVAwarePolicy(max_imbalance=0.5), pagedkv.InvalidConfigError, "max_imbalance"),
        (lambda: policy_by_name("random"), pagedkv.InvalidArgumentError, "unknown routing policy"),
        (lambda: policy_by_name("round_robin", load_weight=1.0), pagedkv.InvalidArgumentError, "takes no weights"),
        (lambda: policy_by_name("kv_aware", load_wieght=1.0), pagedkv.InvalidArgumentError, "no weights"),
        (lambda: WorkerLoad(num_running=-1), pagedkv.InvalidArgumentError, "num_running"),
        (lambda: LeastLoadedPolicy().choose([], {}, 0, {}), pagedkv.InvalidArgumentError, "no worker"),
        (lambda: KVAwarePolicy().choose([], {}, 0, {}), pagedkv.InvalidArgumentError, "no worker"),
    ]
    for call, cls, match in cases:
        with pytest.raises(cls, match=match) as info:
            call()
        assert isinstance(info.value, ValueError)


def test_routing_errors_are_pagedkv_errors_and_the_builtins() -> None:
    router = Router(pagedkv.KVIndexer(4))
    with pytest.raises(UnknownWorkerError, match="unknown worker 5") as unknown:
        router.report_load(5, WorkerLoad())
    assert isinstance(unknown.value, KeyError) and unknown.value.worker_id == 5
    with pytest.raises(UnknownWorkerError):
        router.load(5)
    with pytest.raises(NoWorkerError, match="no live worker") as none:
        router.route([1, 2, 3])
    assert isinstance(none.value, RuntimeError)
    router.add_worker(0)
    router.route([1] * 9, request_id="a")
    with pytest.raises(pagedkv.InvalidArgumentError, match="already routed"):
        router.route([1] * 9, request_id="a")
    with pytest.raises(WireFormatError) as bad_payload:
        wire.decode_event_batch(b"\xc1")
    assert isinstance(bad_payload.value, ValueError)
    with pytest.raises(NotAKVEventError) as not_event:
        wire.events_to_wire([object()])  # type: ignore[list-item]
    assert isinstance(not_event.value, TypeError)
    for cls in (UnknownWorkerError, NoWorkerError, WireFormatError, NotAKVEventError):
        assert issubclass(cls, RoutingError) and issubclass(cls, pagedkv.PagedKVError)


def test_bad_router_calls_are_typed_errors_and_change_nothing() -> None:
    """``route`` took ``len(token_ids)`` before validating them and ``set(exclude)`` as given,
    so an int, None or an iterator of tokens and an int ``exclude`` were bare TypeErrors;
    ``report_load`` stored any object as a load, breaking every later ``route`` with an
    AttributeError. Each is now an ``InvalidArgumentError`` (a ValueError) naming the argument,
    and the router is unchanged after it."""
    router = Router(pagedkv.KVIndexer(4))
    router.add_worker(0)
    router.add_worker(1)
    router.report_load(1, WorkerLoad(3))
    router.route([1] * 9, request_id="a")

    def snapshot() -> tuple[Any, ...]:
        return (router.workers, [router.load(w) for w in router.workers], sorted(router._inflight))

    before = snapshot()
    cases: list[tuple[Any, str]] = [
        (lambda: router.route(5), "token_ids"),
        (lambda: router.route(None), "token_ids"),
        (lambda: router.route(iter(range(9)), request_id="b"), "token_ids"),
        (lambda: router.route([1] * 9, exclude=5), "exclude"),
        (lambda: router.route([1] * 9, exclude=None, request_id="b"), "exclude"),
        (lambda: router.report_load(1, "busy"), "load"),
        (lambda: router.report_load(1, None), "load"),
    ]
    for call, arg in cases:
        with pytest.raises(pagedkv.InvalidArgumentError, match=arg) as info:
            call()
        assert isinstance(info.value, ValueError) and info.value.arg == arg
        assert snapshot() == before
    assert router.route([2] * 9).worker == 0  # still routes


def test_bad_wire_inputs_are_typed_errors() -> None:
    """The wire helpers let builtins escape: ``decode_zmq_frames`` of a non-list or of str
    frames (TypeError), ``events_to_wire`` / ``encode_event_batch`` of a non-iterable
    (TypeError) and ``encode_event_batch(ts="x")`` (ValueError from float())."""
    ok = wire.encode_event_batch([], ts=1.0)
    for frames in (5, None, ["t", "12345678", ok], [b"t", 7, ok]):
        with pytest.raises(WireFormatError) as bad_frames:
            wire.decode_zmq_frames(frames)  # type: ignore[arg-type]
        assert isinstance(bad_frames.value, ValueError)
    assert wire.decode_zmq_frames([b"t", (7).to_bytes(8, "big"), ok])[0] == 7
    assert wire.decode_zmq_frames((bytearray((7).to_bytes(8, "big")), ok))[0] == 7
    for events in (None, 5):
        for call in (wire.events_to_wire, wire.encode_event_batch):
            with pytest.raises(NotAKVEventError) as not_events:
                call(events)  # type: ignore[operator]
            assert isinstance(not_events.value, TypeError)
    for kw in ({"ts": "x"}, {"ts": True}, {"data_parallel_rank": "0"}, {"data_parallel_rank": 1.5}):
        with pytest.raises(pagedkv.InvalidArgumentError, match=next(iter(kw))) as bad_arg:
            wire.encode_event_batch([], **kw)  # type: ignore[arg-type]
        assert isinstance(bad_arg.value, ValueError)
    assert wire.decode_event_batch(wire.encode_event_batch([], ts=2, data_parallel_rank=3)).ts == 2.0


@settings(max_examples=300, deadline=None)
@given(
    loads=st.lists(st.integers(0, 40), min_size=1, max_size=17),
    holder=st.integers(0, 16),
    imbalance=st.sampled_from([1.0, 1.1, 1.25, 1.5, 2.0]),
)
def test_the_chosen_worker_never_passes_the_load_bound(loads: list[int], holder: int, imbalance: float) -> None:
    """Bounded loads: whatever the overlaps (here one worker holds the whole prompt), the chosen
    worker holds at most floor(max(c * (Q + 1) / n, min q + 1)) requests after admission."""
    workers = list(range(len(loads)))
    overlaps = {holder % len(loads): 8}
    p = KVAwarePolicy(overlap_weight=100.0, max_imbalance=imbalance)
    w = p.choose(workers, overlaps, 8, {i: L(q) for i, q in enumerate(loads)})
    n, total = len(loads), sum(loads)
    bound = max(imbalance * (total + 1) / n, min(loads) + 1)
    assert load_bound(loads, imbalance) == pytest.approx(bound)
    assert loads[w] + 1 <= bound + 1e-9
    assert loads[w] + 1 <= max(imbalance * (total + 1) / n, min(loads) + 1) + 1e-9


def test_the_load_bound_has_no_additive_slack() -> None:
    """80 requests all cached on worker 0 of 8 (no departures): worker 0 fills to 1.25 x the mean
    and no further (12 at mean 10; the earlier bound, q <= 1.25 * mean + 1, let it reach 13), and
    the others take the rest least-loaded first."""
    loads = [0] * 8
    p = KVAwarePolicy(overlap_weight=100.0, load_weight=0.0, prefill_weight=0.0, max_imbalance=1.25)
    for _ in range(80):
        w = p.choose(list(range(8)), {0: 8}, 8, {i: L(q) for i, q in enumerate(loads)})
        loads[w] += 1
        mean = sum(loads) / 8
        assert max(loads) <= max(1.25 * mean, min(loads) + 1) + 1e-9
    assert loads[0] == 12 and sum(loads) == 80 and max(loads[1:]) - min(loads[1:]) <= 1
    # At a low mean the least loaded worker may always take one: 8 requests, 8 idle workers.
    loads = [0] * 8
    for _ in range(8):
        w = p.choose(list(range(8)), {0: 8}, 8, {i: L(q) for i, q in enumerate(loads)})
        loads[w] += 1
    assert loads == [1] * 8


def test_target_imbalance_tightens_the_bound_only_while_the_mean_is_above_it() -> None:
    """37 requests on 8 workers: the bound after admission is floor(1.3 x 4.75) = 6 but
    floor(1.25 x 4.75) = 5. Worker 0 (load 5) holds the prompt: with no excess recorded it may
    go to 6; after a history above the target (excess > 0) it may not, and the request goes to
    a worker at 4. ``costs`` records nothing; ``choose`` adds max/mean - target (5 / 4.625 -
    1.25) to the excess."""
    workers = list(range(8))
    loads = {w: L(q) for w, q in enumerate([5, 5, 5, 5, 5, 4, 4, 4])}
    p = KVAwarePolicy(overlap_weight=100.0, max_imbalance=1.3, target_imbalance=1.25)
    assert p.imbalance() == 1.3 and 0 in p.costs(workers, {0: 8}, 8, loads)
    assert p.imbalance_excess == 0.0
    assert p.choose(workers, {0: 8}, 8, loads) == 0
    assert p.imbalance_excess == pytest.approx(5 / 4.625 - 1.25)
    p.imbalance_excess = 1.0  # the recent loads ran above 1.25x the mean
    assert p.imbalance() == 1.25 and 0 not in p.costs(workers, {0: 8}, 8, loads)
    assert p.choose(workers, {0: 8}, 8, loads) in (5, 6, 7)
    assert p.imbalance_excess == pytest.approx(1.0 + 5 / 4.625 - 1.25)
    # Credit is clipped (a balanced spell: max/mean 1 < 1.25 each time), debt is not.
    p.imbalance_excess = 0.0
    for _ in range(100):
        p.choose(workers, {}, 8, {w: L(5) for w in workers})
    assert p.imbalance_excess == -IMBALANCE_MEMORY
    p.imbalance_excess = 0.0
    for _ in range(100):
        p.choose(workers, {}, 8, {0: L(40)})
    assert p.imbalance_excess == pytest.approx(100 * (8 - 1.25))
    free = KVAwarePolicy(overlap_weight=100.0, max_imbalance=None)
    free.imbalance_excess = 5.0
    assert free.imbalance() is None and free.choose(workers, {0: 8}, 8, {0: L(40)}) == 0
    assert KVAwarePolicy(max_imbalance=1.2, target_imbalance=1.5).imbalance() == 1.2
    with pytest.raises(pagedkv.InvalidConfigError, match="target_imbalance"):
        KVAwarePolicy(target_imbalance=0.9)
    assert policy_by_name("kv_aware", target_imbalance=None).imbalance() == DEFAULT_MAX_IMBALANCE  # type: ignore[attr-defined]


def _mean_imbalance(policy: KVAwarePolicy, in_flight: int, steps: int = 3000) -> float:
    """Mean over arrivals of max/mean load (before each arrival) when every request's prompt is
    cached on worker 0 only: 8 workers, one departure (uniform over the requests in flight) per
    arrival once ``in_flight`` are in flight."""
    import random

    rng = random.Random(7)
    loads = [0] * 8
    ratios = []
    for _ in range(steps):
        if sum(loads) >= in_flight:
            k = rng.randrange(sum(loads))
            w = next(i for i in range(8) if (k := k - loads[i]) < 0)
            loads[w] -= 1
        if sum(loads) > 0:
            ratios.append(max(loads) / (sum(loads) / 8))
        loads[policy.choose(list(range(8)), {0: 8}, 8, {i: L(q) for i, q in enumerate(loads)})] += 1
    return sum(ratios) / len(ratios)


@pytest.mark.parametrize("in_flight", [37, 44])
def test_target_imbalance_holds_the_mean_max_over_mean_at_the_target(in_flight: int) -> None:
    """The guarantee of the feedback rule: with every request pulled to one worker, the hard
    bound 1.3 alone lets the mean max/mean settle above 1.25 (whole requests: 6 at a mean of
    4.6, 7 at 5.5); with the target 1.25 the mean stays at it (the excess, the sum of
    max/mean - 1.25, ends within a few decisions' worth of 0)."""
    hard = _mean_imbalance(KVAwarePolicy(overlap_weight=100.0, max_imbalance=1.3, target_imbalance=None), in_flight)
    steered = _mean_imbalance(KVAwarePolicy(overlap_weight=100.0, max_imbalance=1.3, target_imbalance=1.25), in_flight)
    assert hard > 1.26
    assert steered <= 1.25 + 1e-3


def _engine_like(block_size: int = 4) -> pagedkv.KVCacheManager:
    return pagedkv.KVCacheManager(pagedkv.CacheConfig(64, block_size, enable_events=True))


def test_router_follows_the_prefix_then_the_load() -> None:
    managers = {w: _engine_like() for w in (0, 1)}
    router = Router(pagedkv.KVIndexer(4), KVAwarePolicy(1.0, 1.0, prefill_weight=0.0, max_imbalance=None))
    for w in managers:
        router.add_worker(w)
    shared = list(range(100, 116))  # 4 blocks
    managers[1].add_sequence(1, shared + [1])
    managers[1].allocate_slots(1, 17)
    assert router.apply_events(1, 0, managers[1].take_events()) == "applied"
    d = router.route(shared + [7, 7])
    assert (d.worker, d.overlap_blocks, d.num_blocks) == (1, 4, 4)
    # Same prompt, worker 1 now runs 3 requests vs 0: cost 0 + 3/2.5 = 1.2 > 1 + 0 -> worker 0.
    router.report_load(1, WorkerLoad(3))
    assert router.route(shared + [7, 7]).worker == 0
    assert router.route(shared + [7, 7], exclude=[0]).worker == 1
    assert router.remove_worker(1)
    assert router.workers == [0]
    assert router.route(shared + [7]).overlap_blocks == 0
    assert router.apply_events(1, 1, []) == "stale"  # a dead worker's late batch
    with pytest.raises(RuntimeError, match="no live worker"):
        router.route(shared, exclude=[0])
    with pytest.raises(KeyError):
        router.report_load(5, WorkerLoad())


def test_wire_roundtrip_of_pagedkv_events() -> None:
    m = _engine_like()
    m.add_sequence(1, list(range(13)))
    m.allocate_slots(1, 13)
    events = m.take_events()
    payload = wire.encode_event_batch(events, ts=12.5, data_parallel_rank=3)
    batch = wire.decode_event_batch(payload)
    assert (batch.ts, batch.data_parallel_rank) == (12.5, 3)
    assert batch.events[0][0] == "BlockStored" and batch.events[0][1] == events[0].block_hashes
    a, b = pagedkv.KVIndexer(4), pagedkv.KVIndexer(4)
    a.apply(0, 0, events)
    assert wire.apply_payload(b, 0, 0, payload) == "applied"
    assert a.worker_hashes(0) == b.worker_hashes(0) and len(a.worker_hashes(0)) == 3
    seq, again = wire.decode_zmq_frames([b"kv", (41).to_bytes(8, "big"), payload])
    assert seq == 41 and again == batch


def test_wire_batches_carry_the_hash_root_and_foreign_ones_are_refused() -> None:
    """A pagedkv replica's batch names its hash root (its cache identity); an indexer of
    another identity refuses it (nothing applied) instead of holding unmatchable hashes."""
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(64, 4, hash_seed=b"model-a", enable_events=True))
    m.add_sequence(1, list(range(13)))
    m.allocate_slots(1, 13)
    events = m.take_events()
    payload = wire.encode_event_batch(events, ts=1.0)
    batch = wire.decode_event_batch(payload)
    mine, theirs = pagedkv.KVIndexer(4, hash_seed=b"model-a"), pagedkv.KVIndexer(4, hash_seed=b"model-b")
    assert batch.hash_root == events[0].hash_root == mine.hash_root and batch.data_parallel_rank is None
    assert wire.apply_payload(mine, 0, 0, payload) == "applied" and mine.overlap(list(range(13))) == {0: 3}
    with pytest.raises(pagedkv.InvalidArgumentError, match="hash root"):
        wire.apply_payload(theirs, 0, 0, payload)
    assert theirs.worker_ids() == []
    router = Router(pagedkv.KVIndexer(4, hash_seed=b"model-b"))
    router.add_worker(0)
    with pytest.raises(pagedkv.InvalidArgumentError, match="hash root"):
        router.apply_events(0, 0, batch.events, hash_root=batch.hash_root)
    # A batch without BlockStored names no root (and keeps vLLM's three items).
    assert msgspec.msgpack.decode(wire.encode_event_batch([], ts=2.0)) == [2.0, []]
    assert wire.decode_event_batch(wire.encode_event_batch([], ts=2.0)).hash_root is None
    other = pagedkv.KVCacheManager(pagedkv.CacheConfig(64, 4, enable_events=True))
    other.add_sequence(1, list(range(5)))
    other.allocate_slots(1, 5)
    with pytest.raises(pagedkv.InvalidArgumentError, match="hash roots"):
        wire.encode_event_batch(events + other.take_events())
    with pytest.raises(wire.WireFormatError, match="hash_root"):
        wire.decode_event_batch(msgspec.msgpack.encode([1.0, [], None, b"short"]))
    with pytest.raises(pagedkv.InvalidArgumentError, match="32 bytes"):
        mine.apply(0, 1, [], hash_root=b"short")


class _VStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _VRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _VCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _VBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_VStored | _VRemoved | _VCleared]
    data_parallel_rank: int | None = None


def test_vllm_style_payloads_with_int_hashes_are_rehashed_from_tokens() -> None:
    """A vLLM-like worker: 64-bit int hashes of its own; the indexer rehashes its blocks from the
    token ids so that prompt queries (pagedkv hashes) match it."""
    enc = msgspec.msgpack.Encoder()
    ix = pagedkv.KVIndexer(4)
    ix.add_worker(9, hash_source="tokens")
    toks = list(range(1, 13))
    b1 = enc.encode(_VBatch(1.0, [_VStored([11, 12], None, toks[:8], 4, None, "GPU")]))
    b2 = enc.encode(
        _VBatch(
            2.0,
            [_VStored([13], 12, toks[8:12], 4, None, "GPU"), _VStored([2**64 - 1], None, [9, 9, 9, 9], 4, 7, "GPU")],
        )
    )
    assert wire.apply_payload(ix, 9, 0, b1) == "applied"
    assert wire.apply_payload(ix, 9, 1, b2) == "applied"
    assert ix.overlap(toks + [0]) == {9: 3}
    assert ix.overlap([9, 9, 9, 9, 0]) == {9: 0}  # stored under LoRA 7
    assert ix.overlap([9, 9, 9, 9, 0], adapter_id="7") == {9: 1}
    wire.apply_payload(ix, 9, 2, enc.encode(_VBatch(3.0, [_VRemoved([12], "GPU")])))
    assert ix.overlap(toks + [0]) == {9: 1}
    wire.apply_payload(ix, 9, 3, enc.encode(_VBatch(4.0, [_VCleared()])))
    assert ix.worker_status(9)["num_blocks"] == 0  # type: ignore[index]


class _MStored(msgspec.Struct, tag="BlockStored"):  # vLLM 0.33's events: maps tagged by "type"
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class _MRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _MCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _MBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_MStored | _MRemoved | _MCleared]
    data_parallel_rank: int | None = None


def test_vllm_map_events_decode_to_the_array_form_and_apply() -> None:
    """vLLM 0.33 sends each event as a map tagged by "type" (its structs are not array-like):
    decoded to the array form, they index exactly like the array-form batches above."""
    enc = msgspec.msgpack.Encoder()
    toks = list(range(1, 13))
    b1 = enc.encode(_MBatch(1.0, [_MStored([11, 12], None, toks[:8], 4, None, "GPU")], 0))
    decoded = wire.decode_event_batch(b1)
    assert decoded.events == [["BlockStored", [11, 12], None, toks[:8], 4, None, "GPU", *[None] * 9]]
    assert (decoded.ts, decoded.data_parallel_rank, decoded.hash_root) == (1.0, 0, None)
    ix = pagedkv.KVIndexer(4)
    ix.add_worker(9, hash_source="tokens")
    assert wire.apply_payload(ix, 9, 0, b1) == "applied"
    b2 = enc.encode(_MBatch(2.0, [_MStored([13], 12, toks[8:12], 4, 7, "GPU")]))
    assert wire.apply_payload(ix, 9, 1, b2) == "applied"
    assert ix.overlap(toks + [0]) == {9: 2}  # the third block was stored under LoRA 7
    assert wire.decode_event_batch(enc.encode(_MBatch(3.0, [_MRemoved([12], "GPU")]))).events == [
        ["BlockRemoved", [12], "GPU", None, None, None]
    ]
    assert wire.apply_payload(ix, 9, 2, enc.encode(_MBatch(3.0, [_MRemoved([12], "GPU")]))) == "applied"
    assert ix.overlap(toks + [0]) == {9: 1}
    assert wire.apply_payload(ix, 9, 3, enc.encode(_MBatch(4.0, [_MCleared()]))) == "applied"
    assert ix.worker_status(9)["num_blocks"] == 0  # type: ignore[index]
    for bad, match in (
        ({"type": "BlockMoved", "block_hashes": [1]}, "type 'BlockMoved'"),
        ({"block_hashes": [1]}, "type None"),
        ({"type": "BlockStored", "block_hashes": [1], "block_size": 4}, r"lacks \['token_ids'\]"),
        ({"type": "BlockRemoved"}, r"lacks \['block_hashes'\]"),
    ):
        with pytest.raises(wire.WireFormatError, match=match):
            wire.decode_event_batch(msgspec.msgpack.encode([1.0, [bad]]))
    assert ix.worker_status(9)["next_seq"] == 4  # type: ignore[index]


def test_vllm_cache_salt_and_lora_name_key_the_rehashed_chain() -> None:
    """vLLM names a request's cache salt in its first block's extra keys only (the chain carries
    it) and its LoRA name in every block's: a "tokens" worker's salted blocks, stored over two
    batches, match a query with that salt and adapter on every block, and nothing else."""
    enc = msgspec.msgpack.Encoder()
    toks = list(range(1, 17))
    ix = pagedkv.KVIndexer(4)
    ix.add_worker(9, hash_source="tokens")
    first = _MStored([11, 12], None, toks[:8], 4, 3, "GPU", "sql", [("sql", "tenant-a"), ("sql",)])
    decoded = wire.decode_event_batch(enc.encode(_MBatch(1.0, [first])))
    assert decoded.events[0][7:9] == ["sql", [["sql", "tenant-a"], ["sql"]]]
    assert wire.apply_payload(ix, 9, 0, enc.encode(_MBatch(1.0, [first]))) == "applied"
    later = _MStored([13, 14], 12, toks[8:16], 4, 3, "GPU", "sql", [("sql",), ("sql",)])
    assert wire.apply_payload(ix, 9, 1, enc.encode(_MBatch(2.0, [later]))) == "applied"
    query = toks + [0]
    assert ix.overlap(query, cache_salt="tenant-a", adapter_id="sql") == {9: 4}
    # The LoRA name is the adapter key (not str(lora_id)); the salt keys every block.
    assert ix.overlap(query, cache_salt="tenant-a", adapter_id="3") == {9: 0}
    assert ix.overlap(query, adapter_id="sql") == {9: 0}
    assert ix.overlap(query, cache_salt="tenant-b", adapter_id="sql") == {9: 0}
    assert ix.overlap(query) == {9: 0}
    # Without a LoRA the salt is the only string of the first block.
    plain = _MStored([21, 22], None, toks[:8], 4, None, "GPU", None, [("tenant-a",), None])
    assert wire.apply_payload(ix, 9, 2, enc.encode(_MBatch(3.0, [plain]))) == "applied"
    assert ix.overlap(toks[:8] + [0], cache_salt="tenant-a") == {9: 2}
    assert ix.overlap(toks[:8] + [0]) == {9: 0}


def test_vllm_extra_keys_that_disagree_with_the_event_are_never_matched() -> None:
    """A "tokens" worker's event whose extra keys do not fit its blocks is refused (one entry per
    block, a str lora_name) with nothing applied; a LoRA event's block without the LoRA name
    first (None, or another name, here hiding a salt) is cut there: under-reporting, never a
    match for a query vLLM would not hit."""
    toks = list(range(1, 9))
    query = toks + [0]

    def stored(lora_name: Any, extra_keys: Any) -> list[Any]:
        return ["BlockStored", [11, 12], None, toks, 4, None, "GPU", lora_name, extra_keys]

    ix = pagedkv.KVIndexer(4)
    ix.add_worker(9, hash_source="tokens")
    for lora_name, extra_keys, match in (
        (None, [("s",)], "1 entries for 2 blocks"),
        (None, [None, None, None], "3 entries for 2 blocks"),
        (None, [], "0 entries for 2 blocks"),
        (5, None, "lora_name must be a str or None, got int"),
    ):
        with pytest.raises(pagedkv.InvalidArgumentError, match=match):
            ix.apply(9, 0, [["BlockStored", [1], None, toks[:4], 4], stored(lora_name, extra_keys)])
        assert ix.worker_status(9) == {
            "worker_id": 9,
            "incarnation": 1,
            "hash_source": "tokens",
            "num_blocks": 0,
            "next_seq": None,
            "num_pending": 0,
            "needs_resync": False,
            "gaps": 0,
        }
    # The salt "tenant" where the LoRA name "sql" belongs: nothing is indexed (it was read as
    # the name and dropped, so an unsalted "sql" query matched blocks vLLM keyed by the salt).
    assert ix.apply(9, 0, [stored("sql", [("tenant",), ("sql",)])]) == "applied"
    assert ix.worker_status(9)["num_blocks"] == 0  # type: ignore[index]
    assert ix.overlap(query, adapter_id="sql") == {9: 0}
    # A LoRA event's second block without the name was hashed without the LoRA: cut there.
    assert ix.apply(9, 1, [stored("sql", [("sql", "tenant"), None])]) == "applied"
    assert ix.worker_status(9)["num_blocks"] == 1  # type: ignore[index]
    assert ix.overlap(query, adapter_id="sql", cache_salt="tenant") == {9: 1}
    assert ix.overlap(query, adapter_id="sql") == {9: 0}


def test_vllm_blocks_with_multimodal_or_embedding_keys_are_not_indexed() -> None:
    """A block whose vLLM extra keys hold a multimodal item or prompt-embedding digest cannot be
    rehashed as a query would hash it: it and the rest of its event are left out (the index
    under-reports), while the blocks before it are indexed."""
    enc = msgspec.msgpack.Encoder()
    toks = list(range(1, 13))
    ix = pagedkv.KVIndexer(4)
    ix.add_worker(9, hash_source="tokens")
    mm = _MStored([11, 12, 13], None, toks, 4, None, "GPU", None, [None, (("img-0", 2),), None])
    assert wire.apply_payload(ix, 9, 0, enc.encode(_MBatch(1.0, [mm]))) == "applied"
    assert ix.worker_status(9)["num_blocks"] == 1  # type: ignore[index]
    assert ix.overlap(toks + [0]) == {9: 1}
    emb = _MStored([21, 22], None, toks[:8], 4, None, "GPU", None, [(b"\x01" * 32,), None])
    assert wire.apply_payload(ix, 9, 1, enc.encode(_MBatch(2.0, [emb]))) == "applied"
    assert ix.worker_status(9)["num_blocks"] == 1  # type: ignore[index]
    # A malformed extra_keys field is refused and changes nothing.
    bad = _MStored([31], None, toks[:4], 4, None, "GPU", None, None)
    payload = enc.encode(_MBatch(3.0, [bad]))
    obj = msgspec.msgpack.decode(payload)
    obj[1][0]["extra_keys"] = "tenant-a"
    with pytest.raises(pagedkv.InvalidArgumentError, match="extra_keys"):
        wire.apply_payload(ix, 9, 2, msgspec.msgpack.encode(obj))
    assert ix.worker_status(9)["num_blocks"] == 1  # type: ignore[index]
    assert ix.worker_status(9)["next_seq"] == 2  # type: ignore[index]


def test_vllm_blocks_hashed_with_lookahead_tokens_are_not_indexed() -> None:
    """vLLM can hash a block together with tokens after it (``lookahead_token_ids``): a query
    hashing the block's own tokens would match where vLLM would not, so from the first such block
    on the event is left out; a malformed field is refused with nothing applied."""
    toks = list(range(1, 13))
    ix = pagedkv.KVIndexer(4)
    ix.add_worker(9, hash_source="tokens")
    ev = {
        "type": "BlockStored",
        "block_hashes": [11, 12, 13],
        "parent_block_hash": None,
        "token_ids": toks,
        "block_size": 4,
        "lookahead_token_ids": [[], [9], [10]],
    }
    payload = msgspec.msgpack.encode([1.0, [ev]])
    assert wire.decode_event_batch(payload).events[0][15] == [[], [9], [10]]
    assert wire.apply_payload(ix, 9, 0, payload) == "applied"
    assert ix.overlap(toks + [0]) == {9: 1}
    for bad in ("x", [[]], [[], 5, []]):
        with pytest.raises(pagedkv.InvalidArgumentError, match="lookahead_token_ids"):
            wire.apply_payload(ix, 9, 1, msgspec.msgpack.encode([1.0, [{**ev, "lookahead_token_ids": bad}]]))
    assert ix.worker_status(9)["num_blocks"] == 1  # type: ignore[index]
    assert ix.worker_status(9)["next_seq"] == 1  # type: ignore[index]
    off = {**ev, "block_hashes": [21, 22, 23], "lookahead_token_ids": None}
    assert wire.apply_payload(ix, 9, 1, msgspec.msgpack.encode([1.0, [off]])) == "applied"
    assert ix.overlap(toks + [0]) == {9: 3}


def test_only_the_first_kv_cache_group_of_a_vllm_worker_is_indexed() -> None:
    """A hybrid model publishes each block once per KV cache group (``group_idx``) under the
    same hash; a sliding-window group frees early blocks the full-attention group still holds.
    Events of groups other than the first change nothing; a malformed ``group_idx`` is refused
    with nothing applied, whatever the group."""
    toks = list(range(1, 13))
    ix = pagedkv.KVIndexer(4)
    ix.add_worker(9, hash_source="tokens")
    stored = {
        "type": "BlockStored",
        "block_hashes": [11, 12, 13],
        "parent_block_hash": None,
        "token_ids": toks,
        "block_size": 4,
    }

    def send(seq: int, *events: dict[str, object]) -> str:
        return wire.apply_payload(ix, 9, seq, msgspec.msgpack.encode([1.0, list(events)]))

    assert send(0, {**stored, "group_idx": 1}) == "applied"  # another group only: not indexed
    assert ix.overlap(toks + [0]) == {9: 0} and ix.worker_status(9)["next_seq"] == 1  # type: ignore[index]
    assert send(1, {**stored, "group_idx": 0}, {**stored, "group_idx": 1}) == "applied"
    assert ix.overlap(toks + [0]) == {9: 3}
    removed = {"type": "BlockRemoved", "block_hashes": [11, 12], "medium": "GPU", "group_idx": 1}
    assert wire.decode_event_batch(msgspec.msgpack.encode([1.0, [removed]])).events[0][3] == 1
    assert send(2, removed) == "applied"  # the sliding-window group let go of them, group 0 did not
    assert ix.overlap(toks + [0]) == {9: 3}
    for bad in ("1", 1.5, True, -1):
        for ev in ({**stored, "group_idx": bad}, {**removed, "group_idx": bad}):
            with pytest.raises(pagedkv.InvalidArgumentError, match="group_idx"):
                send(3, ev)
    with pytest.raises(pagedkv.InvalidArgumentError):  # malformed tokens in another group's event
        send(3, {**stored, "group_idx": 2, "token_ids": "x"})
    assert ix.worker_status(9)["next_seq"] == 3  # type: ignore[index]
    assert send(3, {**removed, "group_idx": None}) == "applied"  # None: the only group
    assert ix.overlap(toks + [0]) == {9: 0}


def test_malformed_payloads() -> None:
    with pytest.raises(wire.WireFormatError, match="not msgpack"):
        wire.decode_event_batch(b"\xc1")
    with pytest.raises(wire.WireFormatError, match=r"\[ts, \[events"):
        wire.decode_event_batch(msgspec.msgpack.encode({"ts": 1}))
    with pytest.raises(wire.WireFormatError, match="event 0"):
        wire.decode_event_batch(msgspec.msgpack.encode([1.0, [[1, 2]]]))
    with pytest.raises(wire.WireFormatError, match="timestamp"):
        wire.decode_event_batch(msgspec.msgpack.encode(["x", []]))
    with pytest.raises(wire.WireFormatError, match="8 bytes"):
        wire.decode_zmq_frames([b"kv", b"\x00", b""])
    with pytest.raises(TypeError, match="not a pagedkv KV event"):
        wire.encode_event_batch([object()])  # type: ignore[list-item]


def test_router_predicts_blocks_of_routed_requests_until_finished() -> None:
    """Two requests with one prefix arriving together go to one worker before any event."""
    router = Router(pagedkv.KVIndexer(4), KVAwarePolicy(1.0, 1.0, prefill_weight=0.0, max_imbalance=None))
    for w in (0, 1):
        router.add_worker(w)
    prefix = list(range(50, 62))  # 3 blocks
    assert router.route(prefix + [1, 2], request_id="a").worker == 0
    router.report_load(0, WorkerLoad(1))
    d = router.route(prefix + [3, 4], request_id="b")  # cost 0 + 1/1.5 < 1 + 0
    assert (d.worker, d.overlap_blocks) == (0, 3)
    router.report_load(0, WorkerLoad(2))
    assert router.route([9] * 14).worker == 1  # unrelated prompt: the idle worker
    with pytest.raises(ValueError, match="already routed"):
        router.route(prefix, request_id="a")
    assert router.finished("a") and router.finished("b") and not router.finished("b")
    router.report_load(0, WorkerLoad(0))
    assert router.route(prefix + [5]).overlap_blocks == 0  # predictions gone, no event came


def test_readme_routing_example_runs_and_prints_what_it_says() -> None:
    import re
    import subprocess
    import sys
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = text.split("## Past one engine", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "README's 'Past one engine' section lost its Python example"
    res = subprocess.run([sys.executable, "-c", code.group(1)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "RoutingDecision(worker=0, overlap_blocks=6, num_blocks=6)"


def test_router_refuses_a_re_added_workers_old_incarnation() -> None:
    """A replica restarted under its id: its old incarnation's late batch is stale; the new
    incarnation's batches from 0 apply."""
    router = Router(pagedkv.KVIndexer(4))
    old = router.add_worker(0)
    m = _engine_like()
    m.add_sequence(1, list(range(13)))
    m.allocate_slots(1, 13)
    assert router.apply_events(0, 0, m.take_events(), incarnation=old) == "applied"
    router.remove_worker(0)
    new = router.add_worker(0)
    assert new > old
    m.free(1)
    m.add_sequence(2, list(range(100, 113)))
    m.allocate_slots(2, 13)
    late = m.take_events()
    assert router.apply_events(0, 1, late, incarnation=old) == "stale"
    fresh = _engine_like()
    fresh.add_sequence(1, list(range(50, 63)))
    fresh.allocate_slots(1, 13)
    assert router.apply_events(0, 0, fresh.take_events(), incarnation=new) == "applied"
    assert router.route(list(range(50, 63))).overlap_blocks == 3
    assert router.route(list(range(100, 113))).overlap_blocks == 0


def test_events_keep_their_group_on_the_wire() -> None:
    """A manager's events of several KV cache groups (an engine on a model with sliding-window
    layers; each names its ``group``) encode with their group in ``group_idx`` (field 9 / 3), so an indexer registered
    with the worker's groups counts only the full-attention group; without it a receiver could
    not tell the sliding-window group 0's blocks from prefix blocks (llm-d-router #2362)."""
    groups = [pagedkv.KVCacheGroupSpec("sliding_window", 4, 8, window=8), pagedkv.KVCacheGroupSpec("full", 4, 8)]
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(65, groups=groups, layer_groups=[0, 1], enable_events=True))
    prompt = list(range(1, 18))
    m.add_sequence(1, prompt)
    m.step([1], 17).raise_for_error()
    m.free(1)
    m.add_sequence(2, list(range(1000, 1128)))  # evicts the first prompt's blocks
    m.step([2], 128).raise_for_error()
    events = m.take_events()
    batch = wire.decode_event_batch(wire.encode_event_batch(events, ts=1.0))
    assert {e.group for e in events} == {0, 1}
    assert [(ev[0], ev[9] if ev[0] == "BlockStored" else ev[3]) for ev in batch.events] == [
        (type(e).__name__, e.group) for e in events
    ]
    assert batch.hash_root is not None and batch.hash_root == events[0].hash_root
    ix = pagedkv.KVIndexer(4)
    ix.add_worker(1, groups=groups)
    stored = [ev for ev in batch.events if ev[0] == "BlockStored"]
    assert ix.apply(1, 0, stored[:2], hash_root=batch.hash_root) == "applied"  # prompt 1, both groups
    assert ix.overlap(prompt + [99]) == {1: 4}
    sliding_removed = [ev for ev in batch.events if ev[0] == "BlockRemoved" and ev[3] == 0]
    assert sliding_removed and ix.apply(1, 1, sliding_removed) == "applied"
    assert ix.overlap(prompt + [99]) == {1: 4}
    with pytest.raises(NotAKVEventError, match="not a pagedkv KV event"):
        wire.encode_event_batch([(1, events[0])])  # events carry their group: no (group, event) pairs
