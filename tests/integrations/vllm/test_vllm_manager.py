"""``PagedKVCacheManager`` / ``PagedKVScheduler`` on their own: refused configurations, bad
input, request identity (multimodal items) against vLLM's own ``KVCacheManager``, KV events.

Runs only where vLLM is installed (``make test-vllm``).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

import msgspec  # noqa: E402
import torch  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.integrations.vllm import (  # noqa: E402
    PagedKVCacheManager,
    PagedKVScheduler,
    UnsupportedVllmConfigError,
    VllmStateMismatchError,
    check_supported_config,
)
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    Driver,
    build_scheduler,
    make_kv_cache_config,
    make_request,
    make_vllm_config,
)

BS = 16


def _build(vllm_config: Any, kv_cache_config: Any, **kw: Any) -> Any:
    return PagedKVScheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BS,
        **kw,
    )


# ---- refused configurations ---------------------------------------------------------------


def _spec(**kw: Any) -> Any:
    return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32, **kw)


def test_two_kv_cache_groups_build_the_hybrid_manager() -> None:
    # Several groups were refused before the groups manager; now the one facade serves them over
    # it (tests/integrations/vllm/test_vllm_hybrid.py covers it in depth).
    cfg = make_vllm_config(num_blocks=64)
    kv = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["a"], _spec()), KVCacheGroupSpec(["b"], _spec())],
    )
    sched = _build(cfg, kv)
    assert isinstance(sched.kv_cache_manager, PagedKVCacheManager)
    assert sched.kv_cache_manager.num_kv_cache_groups == sched.kv_cache_manager.manager.num_groups == 2


def test_one_sliding_window_group_builds_the_hybrid_manager_windowed_full_spec_refused() -> None:
    cfg = make_vllm_config(num_blocks=64)
    sw = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=128)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], sw)])
    windowed = _build(cfg, kv).kv_cache_manager
    assert isinstance(windowed, PagedKVCacheManager)
    assert [g.kind for g in windowed.manager.groups] == ["sliding_window"]
    kv2 = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["a"], _spec(sliding_window=64))],
    )
    with pytest.raises(UnsupportedVllmConfigError, match="sliding_window") as err:
        _build(cfg, kv2)
    assert err.value.field == "kv_cache_spec.sliding_window"


def test_hash_block_size_refused() -> None:
    cfg = make_vllm_config(num_blocks=64)
    with pytest.raises(UnsupportedVllmConfigError, match="hash_block_size"):
        _build(cfg, make_kv_cache_config(64), hash_block_size=8)


class _Stand:
    """A stand-in sub-config carrying one attribute (the check reads attributes only)."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        # EAGLE / MTP lookahead slots and lookahead block hashes are served (with KV events
        # the hashes are not: test_vllm_eagle.py); multi-module MTP's prefill lookahead is not.
        ("num_prefill_lookahead_tokens", 2, "num_prefill_lookahead_tokens"),
        (
            "kv_transfer_config",
            _Stand(
                kv_connector="SimpleCPUOffloadConnector", kv_connector_module_path=None, kv_connector_extra_config={}
            ),
            "kv_transfer_config.kv_connector",
        ),
        ("model_config", _Stand(is_encoder_decoder=True), "is_encoder_decoder"),
        ("model_config", _Stand(enable_prompt_embeds=True), "enable_prompt_embeds"),
        ("parallel_config", _Stand(decode_context_parallel_size=2), "decode_context_parallel_size"),
        ("parallel_config", _Stand(prefill_context_parallel_size=2), "prefill_context_parallel_size"),
        ("observability_config", _Stand(kv_cache_metrics=True), "kv_cache_metrics"),
        ("aux_output_config", _Stand(enabled=True), "aux_output_config.enabled"),
        # Found by vLLM's own scheduler tests (scripts/run_vllm_scheduler_tests.py): accepted
        # before, it failed mid-step with "num_new_tokens = 0" from allocate_slots.
        ("diffusion_config", _Stand(canvas_length=8), "diffusion_config"),
    ],
)
def test_unsupported_settings_are_named(field: str, value: Any, named: str) -> None:
    real = make_vllm_config(num_blocks=64)
    check_supported_config(real, make_kv_cache_config(64), BS)  # the base config is accepted
    fields = {f: getattr(real, f) for f in ("model_config", "parallel_config", "observability_config")}
    fields.update(
        speculative_config=None,
        kv_transfer_config=None,
        aux_output_config=None,
        diffusion_config=None,
        num_lookahead_tokens=0,
    )
    fields[field] = value
    stand = _Stand(**fields)
    with pytest.raises(UnsupportedVllmConfigError, match=named) as err:
        check_supported_config(stand, make_kv_cache_config(64), BS)
    assert named.split(".")[-1] in err.value.field


def test_refused_before_vllm_builds_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    monkeypatch.setattr(Scheduler, "__init__", lambda self, *a, **k: built.append(1))
    cfg = make_vllm_config(num_blocks=64)
    with pytest.raises(UnsupportedVllmConfigError):
        _build(cfg, make_kv_cache_config(64), hash_block_size=8)
    assert built == []


def test_scheduler_cls_by_name_resolves() -> None:
    cfg = make_vllm_config(num_blocks=64, scheduler_cls="pagedkv.integrations.vllm.PagedKVScheduler")
    cls = cfg.scheduler_config.get_scheduler_cls()
    assert cls is PagedKVScheduler
    sched = build_scheduler(cls, cfg)
    assert isinstance(sched.kv_cache_manager, PagedKVCacheManager)


# ---- bad input ----------------------------------------------------------------------------


def _sched(num_blocks: int = 64, **kw: Any) -> Any:
    return build_scheduler(PagedKVScheduler, make_vllm_config(num_blocks=num_blocks, **kw))


def test_unknown_request_typed_error_changes_nothing() -> None:
    sched = _sched()
    driver = Driver(sched)
    driver.add(make_request("a", list(range(100, 140)), 3))
    driver.step()
    kv = sched.kv_cache_manager
    before = kv.manager.stats()
    with pytest.raises(pagedkv.UnknownSequenceError):
        kv.get_block_ids("nope")
    with pytest.raises(KeyError):
        kv.get_blocks("nope")
    assert kv.manager.stats() == before


def test_double_free_typed_error() -> None:
    sched = _sched()
    driver = Driver(sched)
    req = make_request("a", list(range(100, 140)), 2)
    driver.add(req)
    driver.run()
    assert req.is_finished() and req.num_computed_tokens > 0
    before = sched.kv_cache_manager.manager.stats()
    with pytest.raises(pagedkv.UnknownSequenceError, match="already freed"):
        sched.kv_cache_manager.free(req)
    assert sched.kv_cache_manager.manager.stats() == before


def test_free_of_never_allocated_request_is_a_noop() -> None:
    # vLLM frees requests aborted while waiting; they never held blocks.
    sched = _sched()
    req = make_request("w", list(range(100, 140)), 2)
    req.status = RequestStatus.FINISHED_ABORTED
    sched.kv_cache_manager.free(req)
    assert sched.kv_cache_manager.usage == 0.0


def test_zero_token_allocation_refused() -> None:
    sched = _sched()
    req = make_request("z", list(range(100, 140)), 2)
    with pytest.raises(pagedkv.InvalidArgumentError, match="num_new_tokens"):
        sched.kv_cache_manager.allocate_slots(req, 0)
    with pytest.raises(pagedkv.InvalidArgumentError, match="num_lookahead_tokens"):
        sched.kv_cache_manager.allocate_slots(req, 4, num_lookahead_tokens=-1)
    assert sched.kv_cache_manager.manager.num_sequences == 0


def test_streaming_input_request_refused() -> None:
    sched = _sched()
    req = make_request("s", list(range(100, 140)), 2)
    req.resumable = True
    with pytest.raises(pagedkv.InvalidArgumentError, match="resumable"):
        sched.add_request(req)
    assert "s" not in sched.requests and not sched.has_unfinished_requests()


def test_unknown_hash_algo_refused() -> None:
    with pytest.raises(pagedkv.InvalidConfigError, match="prefix_caching_hash_algo"):
        PagedKVCacheManager(make_kv_cache_config(64, BS), hash_algo="md5")


# ---- multimodal identity, against vLLM's own manager --------------------------------------


def _mm(identifier: str, offset: int, length: int) -> Any:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


def _hit(manager: Any, rid: str, prompt: list[int], features: list[Any]) -> int:
    req = make_request(rid, prompt, 4)
    req.mm_features = features
    if isinstance(manager, KVCacheManager):
        # Re-hash with the features (the engine core hashes after attaching them).
        req.block_hashes.clear()
        req.update_block_hashes()
    _, hit, _ = manager.get_computed_blocks(req)
    new = manager.allocate_slots(req, req.num_tokens - hit, hit, manager.get_computed_blocks(req)[0])
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return hit


@pytest.mark.parametrize("which", ["stock", "paged"])
def test_multimodal_items_key_the_blocks_they_cover(which: str) -> None:
    kv_cfg = make_kv_cache_config(256)
    # Both built alike: pagedkv's facade takes vLLM's manager's constructor arguments.
    kind: Any = KVCacheManager if which == "stock" else PagedKVCacheManager
    manager = kind(kv_cfg, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS)
    prompt = list(range(1000, 1000 + 96))  # 6 blocks; an image in tokens 40..71
    assert _hit(manager, "m0", prompt, [_mm("img-A", 40, 32)]) == 0
    # Same image, same place: everything but the last block is served from cache.
    assert _hit(manager, "m1", prompt, [_mm("img-A", 40, 32)]) == 80
    # Another image in the same place: only the blocks before it are shared.
    assert _hit(manager, "m2", prompt, [_mm("img-B", 40, 32)]) == 32
    # The same image moved by one token: from its first block on nothing is shared.
    assert _hit(manager, "m3", prompt, [_mm("img-A", 41, 32)]) == 32


# ---- KV events ----------------------------------------------------------------------------


def _capture_events(sched: Any) -> list[Any]:
    """Records what ``take_events`` hands to vLLM's publisher (update_from_output calls it)."""
    events: list[Any] = []
    original = sched.kv_cache_manager.take_events

    def capture() -> list[Any]:
        got = original()
        events.extend(got)
        return got

    sched.kv_cache_manager.take_events = capture
    return events


@pytest.mark.parametrize("int_hashes", ["1", "0"])
def test_events_are_vllm_objects_on_the_wire(monkeypatch: pytest.MonkeyPatch, int_hashes: str) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", int_hashes)
    sched = _sched(num_blocks=24, kv_events=True)
    driver = Driver(sched)
    prompt = list(range(2000, 2064))
    driver.add(make_request("e0", prompt, 3, cache_salt="t"))
    events = _capture_events(sched)
    driver.run()
    stored = [e for e in events if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    if int_hashes == "1":
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
    else:
        assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    # 64 prompt tokens + 2 computed outputs: 4 full blocks, each announced once.
    assert len(hashes) == len(set(hashes)) == 4
    assert stored[0].parent_block_hash is None and stored[0].block_size == BS
    assert stored[0].extra_keys is not None and stored[0].extra_keys[0] == ("t",)
    assert stored[0].token_ids[:BS] == prompt[:BS]
    assert stored[0].group_idx == 0 and stored[0].medium == "GPU"
    # vLLM's own msgpack encoder / decoder round-trips them unchanged.
    batch = KVEventBatch(ts=1.0, events=events)
    wire = msgspec.msgpack.Encoder().encode(batch)
    back = msgspec.msgpack.Decoder(type=KVEventBatch).decode(wire)
    assert back.events == events
    # A router reads that payload with pagedkv.routing.wire (vLLM's events arrive as maps) and
    # indexes the worker's 4 blocks, rehashed from their token ids.
    from pagedkv.routing import wire as pagedkv_wire

    decoded = pagedkv_wire.decode_event_batch(wire)
    assert [ev[0] for ev in decoded.events] == [type(ev).__name__ for ev in events]
    assert decoded.events[0][1:5] == [
        stored[0].block_hashes,
        stored[0].parent_block_hash,
        stored[0].token_ids,
        stored[0].block_size,
    ]
    indexer = pagedkv.KVIndexer(BS)
    indexer.add_worker(3, hash_source="tokens")
    assert pagedkv_wire.apply_payload(indexer, 3, 0, wire) == "applied"
    assert indexer.worker_status(3)["num_blocks"] == 4
    # The request's cache salt keys them: a salted query matches all 4, an unsalted one none.
    assert indexer.overlap(prompt + [0], cache_salt="t") == {3: 4}
    assert indexer.overlap(prompt + [0]) == {3: 0}


def test_stock_vllm_salted_events_index_under_the_salt() -> None:
    """vLLM's own scheduler (stock KVCacheManager) publishing a salted request's blocks over
    several steps (the prompt, then decode blocks chained to it): a router's indexer rehashes them
    so a query with the same cache salt matches every block and a query without it matches none,
    while an unsalted request's blocks match only unsalted queries."""
    from pagedkv.routing import wire as pagedkv_wire

    sched = build_scheduler(Scheduler, make_vllm_config(num_blocks=64, kv_events=True))
    driver = Driver(sched)
    salted, plain = list(range(3000, 3040)), list(range(4000, 4040))
    driver.add(make_request("s", salted, 30, cache_salt="tenant-a"))
    driver.add(make_request("p", plain, 3))
    events = _capture_events(sched)  # what update_from_output hands vLLM's publisher
    payloads = []
    while sched.has_unfinished_requests():
        driver.step()
        if events:
            payloads.append(msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=list(events))))
            events.clear()
    assert len(payloads) >= 2  # the salted chain continues in a later batch
    indexer = pagedkv.KVIndexer(BS)
    indexer.add_worker(5, hash_source="tokens")
    for seq, payload in enumerate(payloads):
        assert pagedkv_wire.apply_payload(indexer, 5, seq, payload) == "applied"
    out_s = driver.outputs["s"]
    full_s = salted + out_s
    blocks_s = (len(full_s) - 1) // BS  # the last token is never computed into the cache
    assert blocks_s == 4
    assert indexer.overlap(full_s, cache_salt="tenant-a") == {5: blocks_s}
    assert indexer.overlap(full_s) == {5: 0}
    assert indexer.overlap(full_s, cache_salt="tenant-b") == {5: 0}
    assert indexer.overlap(plain + [0]) == {5: 2}
    assert indexer.overlap(plain + [0], cache_salt="tenant-a") == {5: 0}


def _resolvable(manager: Any, chain: dict[bytes, tuple[bytes | None, list[int]]], hashes: set[bytes]) -> set[bytes]:
    """The ``hashes`` pagedkv's prefix cache resolves: each one's tokens (its ancestors' blocks
    then its own, from the ``BlockStored`` events in ``chain``) looked up as a probe sequence
    of ``manager`` (a ``pagedkv.KVCacheManager``), served whole."""
    out = set()
    for n, h in enumerate(sorted(hashes)):
        blocks: list[list[int]] = []
        at: bytes | None = h
        while at is not None:
            at, tokens = chain[at][0], chain[at][1]
            blocks.append(tokens)
        tokens = [t for block in reversed(blocks) for t in block]
        probe = 1_000_000 + n
        manager.add_sequence(probe, tokens + [0])
        if manager.lookup_prefix(probe) >= len(tokens):
            out.add(h)
        manager.free(probe)
    return out


def test_events_have_set_semantics_under_eviction(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer that adds BlockStored hashes and drops BlockRemoved ones holds exactly the
    hashes pagedkv resolves, after every step; a stored block's parent is in the set."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    sched = _sched(num_blocks=24, kv_events=True, max_num_batched_tokens=128)
    driver = Driver(sched)
    events = _capture_events(sched)
    system = list(range(5000, 5032))
    for i in range(10):
        driver.add(make_request(f"s{i}", system + list(range(6000 + 97 * i, 6000 + 97 * i + 40)), 6))
    consumer: set[bytes] = set()
    seen: set[bytes] = set()
    chain: dict[bytes, tuple[bytes | None, list[int]]] = {}
    removed_any = False
    while sched.has_unfinished_requests():
        driver.step()
        for ev in events:
            if isinstance(ev, BlockStored):
                assert ev.parent_block_hash is None or ev.parent_block_hash in consumer
                parent = ev.parent_block_hash
                for k, h in enumerate(ev.block_hashes):
                    assert h not in consumer, "stored twice"
                    consumer.add(h)
                    seen.add(h)
                    chain[h] = (parent, list(ev.token_ids[k * BS : (k + 1) * BS]))
                    parent = h
            elif isinstance(ev, BlockRemoved):
                removed_any = True
                for h in ev.block_hashes:
                    assert h in consumer, "removed without being stored"
                    consumer.discard(h)
            else:
                consumer.clear()
        events.clear()
        assert consumer == _resolvable(sched.kv_cache_manager.manager, chain, seen)
    assert removed_any, "the pool must be small enough to evict"
    assert sched.reset_prefix_cache()
    sched.kv_cache_manager.take_events = type(sched.kv_cache_manager).take_events.__get__(sched.kv_cache_manager)
    assert [type(e) for e in sched.kv_cache_manager.take_events()] == [AllBlocksCleared]


def test_events_off_returns_nothing() -> None:
    sched = _sched()
    driver = Driver(sched)
    driver.add(make_request("x", list(range(100, 164)), 2))
    driver.run()
    assert sched.kv_cache_manager.take_events() == []


def test_prefix_cache_stats_like_vllm() -> None:
    stock = Driver(build_scheduler(Scheduler, make_vllm_config(num_blocks=128)))
    paged = Driver(build_scheduler(PagedKVScheduler, make_vllm_config(num_blocks=128)))
    prompt = list(range(500, 580))
    for d in (stock, paged):
        d.add(make_request("a", prompt, 2))
        d.run()
        d.add(make_request("b", prompt, 2))
        d.run()
    assert paged.prefix_cache_stats == stock.prefix_cache_stats
    assert paged.prefix_cache_stats == {"requests": 2, "queries": 160, "hits": 64}


def _decoding(kv: Any, rid: str, first: int) -> Any:
    """A request whose 16-token prompt is allocated and computed and that just sampled one
    token (the state vLLM's running loop sees a decode in)."""
    req = make_request(rid, list(range(first, first + BS)), 8)
    assert kv.allocate_slots(req, BS) is not None
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = BS
    req.append_output_token_ids(7)
    return req


def test_deferred_decodes_flush_in_order_and_stop_where_the_pool_runs_out() -> None:
    # 3 usable blocks: a and b hold one each; the decode of each opens a new block.
    kv = PagedKVCacheManager(make_kv_cache_config(4, BS))
    a, b = _decoding(kv, "a", 100), _decoding(kv, "b", 200)
    seq_a = kv.seq_id("a")
    got_a = kv.allocate_slots(a, 1)
    # Answered without calling into Rust: pagedkv has not seen a's token yet.
    assert kv.decodes.pending_seqs == [seq_a]
    assert kv._kvm.num_computed_tokens(seq_a) == BS
    # b needs a block too, but a's decode was counted against the last free one: b takes the
    # per-request path, which flushes a first, then fails as vLLM's own manager would.
    assert kv.allocate_slots(b, 1) is None
    assert kv.num_batch_stops == 1 and kv.num_batched_allocations == 1
    assert not kv.decodes.pending_seqs and kv._kvm.num_free_blocks == 0
    (ids_a,) = got_a.get_block_ids()
    assert kv.get_block_ids("a") == ([kv.get_block_ids("a")[0][0], ids_a[0]],) and len(ids_a) == 1
    # a's sampled token went in with its slot: 17 tokens, all computed.
    assert kv._kvm.num_computed_tokens(seq_a) == BS + 1
    assert kv._kvm.num_uncomputed_tokens([seq_a]).tolist() == [0]


def _decode(kv: Any, req: Any) -> Any:
    """One decode of ``req`` as vLLM's loop runs it: allocate, compute, sample."""
    got = kv.allocate_slots(req, 1)
    assert got is not None
    req.num_computed_tokens += 1
    req.append_output_token_ids(8 + req.num_tokens % 50)
    return got


def test_decodes_inside_the_tail_block_lag_until_one_fills_it() -> None:
    kv = PagedKVCacheManager(make_kv_cache_config(8, BS))
    a = _decoding(kv, "a", 100)
    seq = kv.seq_id("a")
    _decode(kv, a)  # slot 16 opens block 2 (deferred)
    assert kv.flush_decodes() == 1
    # pagedkv holds 17 computed tokens: slots 17..30 lie in its tail block without filling it.
    assert kv.decodes.lag_window == {"a": (17, 31)}
    free = kv._kvm.num_free_blocks
    for pos in range(17, 31):  # slots 17..30: inside block 2, none fills it
        got = _decode(kv, a)
        assert got.get_block_ids(allow_none=True) is None
        # Nothing pending, nothing sent to pagedkv: only the end of vLLM's slots is kept.
        assert not kv.decodes.pending_seqs and kv.decodes.lag == {"a": pos + 1}
        assert kv._kvm.num_computed_tokens(seq) == 17
    assert kv._kvm.num_free_blocks == free and kv.usage == 1.0 - free / 7
    # Slot 31 fills block 2: deferred with the 14 lagging tokens, so the block is cached
    # in the step that fills it, as vLLM caches it.
    _decode(kv, a)
    assert not kv.decodes.lag and kv.decodes.pending_tokens == [a.all_token_ids[17:32]]
    assert kv.flush_decodes() == 15
    assert kv._kvm.num_computed_tokens(seq) == 32
    assert kv._kvm.num_tokens(seq) == 32
    b = make_request("b", a.all_token_ids[:32] + [9], 4)
    assert kv.get_computed_blocks(b)[1] == 32


def test_lagging_decodes_reach_pagedkv_before_preemption_inspection_or_another_path() -> None:
    kv = PagedKVCacheManager(make_kv_cache_config(8, BS))
    a = _decoding(kv, "a", 100)
    seq = kv.seq_id("a")
    for _ in range(4):  # slot 16 opens block 2, slots 17..19 lag
        _decode(kv, a)
    assert kv.decodes.lag == {"a": 20}
    # Inspection through ``manager`` brings everything in.
    assert kv.manager.num_computed_tokens(seq) == 20 and not kv.decodes.lag
    _decode(kv, a)
    assert kv.decodes.lag == {"a": 21}
    # A preemption (free while RUNNING) gives pagedkv the tokens before releasing the blocks.
    kv.free(a)
    assert not kv.decodes.lag and kv._kvm.num_tokens(seq) == 21
    assert kv._kvm.num_computed_tokens(seq) == 0
    # Resumed as vLLM resumes it: the whole of its tokens again, from its prefix hit.
    a.num_computed_tokens = 0
    a.status = RequestStatus.PREEMPTED
    blocks, hit, _ = kv.get_computed_blocks(a)
    assert hit == 16
    assert kv.allocate_slots(a, a.num_tokens - hit, hit, blocks) is not None
    a.status = RequestStatus.RUNNING
    a.num_computed_tokens = a.num_tokens
    a.append_output_token_ids(9)
    _decode(kv, a)  # slot 22 inside block 2
    assert kv.decodes.lag == {"a": 23}
    # A call the deferred path does not take (two tokens: here a forged one) catches up first.
    a.append_output_token_ids(10)
    assert kv.allocate_slots(a, 2) is not None
    assert not kv.decodes.lag and kv._kvm.num_computed_tokens(seq) == 25
    # A finished request is freed without catching up (its partial block is never cached).
    a.num_computed_tokens += 2
    a.append_output_token_ids(11)
    _decode(kv, a)
    assert kv.decodes.lag == {"a": 26}
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    assert not kv.decodes.lag and kv.manager.num_sequences == 0 and kv.usage == 0.0


# ---- typed errors when pagedkv and vLLM disagree ------------------------------------------


def test_prefix_hit_block_ids_before_allocation_is_a_typed_error() -> None:
    kv = PagedKVCacheManager(make_kv_cache_config(64, BS))
    prompt = list(range(500, 540))
    first = make_request("first", prompt, 2)
    assert kv.allocate_slots(first, first.num_tokens) is not None
    second = make_request("second", prompt, 2)
    hit, tokens, _ = kv.get_computed_blocks(second)
    assert tokens == 32
    with pytest.raises(pagedkv.InvalidSequenceStateError, match="after allocate_slots") as err:
        hit.get_block_ids()
    assert isinstance(err.value, RuntimeError) and isinstance(err.value, pagedkv.PagedKVError)
    assert err.value.seq_id == kv.seq_id("second") and err.value.operation == "get_block_ids"
    # Nothing changed: the hit is still taken by allocate_slots.
    new = kv.allocate_slots(second, second.num_tokens - tokens, tokens, hit)
    assert new is not None and kv.get_block_ids("second")[0][:2] == kv.get_block_ids("first")[0][:2]


def test_computed_token_mismatch_is_a_typed_error() -> None:
    # The caller claims a shorter prefix hit than pagedkv takes: pagedkv's computed-token count
    # then differs from vLLM's, which must never be served as a block table.
    kv = PagedKVCacheManager(make_kv_cache_config(64, BS))
    prompt = list(range(600, 640))
    assert kv.allocate_slots(make_request("a", prompt, 2), len(prompt)) is not None
    b = make_request("b", prompt, 2)
    hit, tokens, _ = kv.get_computed_blocks(b)
    assert tokens == 32
    with pytest.raises(VllmStateMismatchError) as err:
        kv.allocate_slots(b, b.num_tokens - 16, 16, hit)
    e = err.value
    assert isinstance(e, RuntimeError) and isinstance(e, pagedkv.PagedKVError)
    assert (e.request_id, e.quantity, e.expected, e.got) == ("b", "num_computed_tokens", "16", "32")


def test_deferred_and_lagging_decode_mismatches_are_typed_errors() -> None:
    kv = PagedKVCacheManager(make_kv_cache_config(8, BS))
    a = _decoding(kv, "a", 100)
    assert kv.allocate_slots(a, 1) is not None  # slot 16 opens a block: deferred
    assert kv.decodes.pending_context == [BS]
    kv.decodes.pending_context[0] += 1  # the deferral's record no longer matches pagedkv's
    with pytest.raises(VllmStateMismatchError, match="deferred decodes") as err:
        kv.flush_decodes()
    assert err.value.quantity == "num_computed_tokens" and isinstance(err.value, RuntimeError)
    assert (err.value.expected, err.value.got) == (f"[{BS + 1}]", f"[{BS}]")

    b = _decoding(kv, "b", 300)
    _decode(kv, b)  # slot 16 opens block 2 (deferred)
    kv.flush_decodes()
    _decode(kv, b)  # slot 17 lags inside it
    assert kv.decodes.lag == {"b": BS + 2}
    kv._num_known["b"] -= 1  # forget one token pagedkv holds: the catch-up would re-send it
    with pytest.raises(VllmStateMismatchError, match="lagging decodes") as err:
        kv.decodes.catch_up(["b"])
    assert err.value.request_id == "b" and isinstance(err.value, pagedkv.PagedKVError)
