"""KV-aware routing over engines on a model with sliding-window layers (issue 24, item 6).

The tiny Gemma-3-like model of test_hybrid_models (layers sliding, full, sliding, sliding;
window 8) runs on a ``KVCacheManager`` of four KV cache groups: each of its KV events names its
group (``event.group``) and every group stores the same block hashes, so an indexer that
counted a sliding-window group (here group 0) would count residency that serves no prefix
(llm-d-router #2362). Ray-free: the replica is driven in-process, as ``ReplicaCluster``'s
actors run it.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers.engine import ModelBundle, tiny_gemma3

import pagedkv
from pagedkv.block_identity import HashScheme
from pagedkv.cluster.replica import EngineReplica
from pagedkv.engine import LLMEngine, SamplingParams
from pagedkv.routing import Router, wire

pytest.importorskip("msgspec")

BLOCK = 4
KW: dict[str, Any] = {"num_kv_blocks": 128, "block_size": BLOCK, "device": "cpu"}
KINDS = ["sliding_window", "full", "sliding_window", "sliding_window"]
PROMPT = list(range(10, 40))  # 30 tokens: 7 full blocks before the last prompt token
FULL_BLOCKS = 7


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> ModelBundle:
    return tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-routing"))


def test_engine_events_route_a_repeated_prompt_by_its_full_attention_blocks(gemma: ModelBundle) -> None:
    """An engine's events (each naming its group) fed to a router whose workers are registered
    with the model's groups: the worker holding the prompt's blocks in every group gets its whole
    prefix, one holding only its sliding-window groups' blocks none."""
    engine = LLMEngine(str(gemma.path), enable_kv_events=True, **KW)
    manager: Any = engine.manager
    assert type(manager) is pagedkv.KVCacheManager and manager.num_groups == 4
    assert [g.kind for g in manager.groups] == KINDS
    engine.generate([PROMPT], SamplingParams(max_tokens=1))
    events = manager.take_events()
    assert all(isinstance(e, pagedkv.BlockStored) for e in events)
    stored = {e.group: e.block_hashes for e in events}
    assert sorted(stored) == [0, 1, 2, 3] and len(stored[1]) == FULL_BLOCKS
    assert stored[0] == stored[1]  # equal hashes in every group: only the group tells them apart
    router = Router(HashScheme(BLOCK, "sha256", engine.cache_identity.seed).indexer())
    router.add_worker(0, groups=manager.groups)
    router.add_worker(1, groups=KINDS)
    assert router.apply_events(0, 0, events) == "applied"
    assert router.apply_events(1, 0, [e for e in events if KINDS[e.group] != "full"]) == "applied"
    tokens, spec = engine.prompt_spec(PROMPT)
    assert router.indexer.overlap(tokens, spec=spec) == {0: FULL_BLOCKS, 1: 0}
    d = router.route(tokens, spec=spec)
    assert (d.worker, d.overlap_blocks, d.num_blocks) == (0, FULL_BLOCKS, FULL_BLOCKS)


def test_hybrid_replica_publishes_its_groups_and_is_routed_to(gemma: ModelBundle) -> None:
    """``EngineReplica`` on the hybrid model: ``info`` (which read the one-group manager's
    config) gives its scheme, pool and groups; its wire batches keep each event's group, so a
    router registered with those groups sends the repeated prompt to it, not to a worker
    holding only the sliding-window blocks; its snapshot holds the full-attention blocks."""
    replica = EngineReplica(0, str(gemma.path), engine_kwargs=KW)
    info = replica.info()
    scheme = HashScheme(BLOCK, "sha256", replica.engine.cache_identity.seed)
    assert (info["hash_scheme"], info["num_kv_blocks"], info["kv_groups"]) == (scheme, 128, KINDS)
    router = Router(info["hash_scheme"].indexer())
    for w in (0, 1):
        router.add_worker(w, groups=info["kv_groups"])
    [(tokens, spec)] = replica.prompt_specs([(PROMPT, False, None)])  # type: ignore[misc]
    step = replica.run([("a", PROMPT, SamplingParams(max_tokens=1), False, None)], max_steps=4)
    assert [o.request_id for o in step.outputs] == ["a"] and step.load.kv_blocks_total == 127
    assert step.events is not None
    seq, payload = step.events
    batch = wire.decode_event_batch(payload)
    assert sorted(ev[9] for ev in batch.events) == [0, 1, 2, 3]  # one BlockStored per group
    assert router.apply_events(0, seq, batch.events, hash_root=batch.hash_root) == "applied"
    sliding = [ev for ev in batch.events if KINDS[ev[9]] != "full"]
    assert router.apply_events(1, seq, sliding, hash_root=batch.hash_root) == "applied"
    assert router.indexer.overlap(tokens, spec=spec) == {0: FULL_BLOCKS, 1: 0}
    d = router.route(tokens, spec=spec)
    assert (d.worker, d.overlap_blocks, d.num_blocks) == (0, FULL_BLOCKS, FULL_BLOCKS)

    snap_seq, hashes, root = replica.snapshot()
    assert hashes == router.indexer.worker_hashes(0) and len(hashes) == FULL_BLOCKS
    resynced = scheme.indexer()
    resynced.add_worker(0, groups=KINDS)
    assert resynced.apply_snapshot(0, snap_seq, hashes, hash_root=root) == "applied"
    assert resynced.overlap(tokens, spec=spec) == {0: FULL_BLOCKS}


@pytest.mark.slow
def test_a_hybrid_cluster_on_ray_sends_a_repeated_prompt_to_its_cached_prefix(
    gemma: ModelBundle, one_ray_cluster: None
) -> None:
    """Two Ray replicas of the hybrid model as a user runs them (``ReplicaCluster`` used to
    die in ``info``): the workers are registered with the model's groups, and a prompt
    extending an answered one goes to that replica with its 7 full-attention blocks cached."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ray = pytest.importorskip("ray")
    from pagedkv.cluster import ClusterRequest, ReplicaCluster

    started = not ray.is_initialized()
    if started:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cluster = ReplicaCluster(2, str(gemma.path), engine_kwargs=KW, steps_per_call=2)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        try:
            first = cluster.serve([ClusterRequest("a", PROMPT, params)])["a"]
            second = cluster.serve([ClusterRequest("b", PROMPT + [50, 51], params)])["b"]
            status = [cluster.router.indexer.worker_status(w) for w in (0, 1)]
        finally:
            cluster.shutdown()
    finally:
        if started:
            ray.shutdown()
    assert [cluster.infos[w]["kv_groups"] for w in (0, 1)] == [KINDS, KINDS]
    assert first.error is None and second.error is None
    assert (second.replica, second.overlap_blocks) == (first.replica, FULL_BLOCKS)
    assert second.output.num_cached_tokens == FULL_BLOCKS * BLOCK
    # Its index holds the full-attention group's blocks: a's 7 and b's 8th (tokens 28..31).
    assert [s["num_blocks"] for s in status if s is not None] == [8 if w == first.replica else 0 for w in (0, 1)]
