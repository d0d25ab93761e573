"""Engine replicas on Ray behind the KV-aware router, on the tiny random model.

One local Ray cluster for the module (4 logical CPUs, one per replica actor). Checks: two
replicas give the same greedy outputs as one engine, requests sharing a prefix go where it is
cached so each shared prefix is computed once; a replica killed mid-run loses no request and
answers none twice.
"""

from __future__ import annotations

import os
import signal
import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ray = pytest.importorskip("ray")

from helpers.engine import ModelBundle  # noqa: E402

from pagedkv.cluster import ReplicaCluster  # noqa: E402
from pagedkv.engine import LLMEngine, SamplingParams  # noqa: E402

BLOCK = 4
ENGINE_KW = {"num_kv_blocks": 96, "block_size": BLOCK, "device": "cpu", "max_tokens_per_step": 256}


@pytest.fixture(scope="module")
def ray_local(one_ray_cluster: None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ray.init(
            num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}
        )
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ray.shutdown()


def _cluster(tiny: ModelBundle, n: int):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ReplicaCluster(n, str(tiny.path), engine_kwargs=ENGINE_KW, steps_per_call=2)


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Two groups of token prompts; each group shares a 3-block (12-token) prefix. The second
    wave alternates the groups, so each replica takes one request of its group at a time (the
    KV-aware policy's load bound keeps two idle replicas within one request of each other)."""
    a, b = list(range(10, 22)), list(range(200, 212))
    first = [a + [30, 31], b + [40, 41]]
    second = [a + [32, 33, 34], b + [42, 43, 44], a + [35], b + [45]]
    return first, second


@pytest.mark.slow
def test_two_replicas_match_one_engine_and_compute_each_prefix_once(tiny: ModelBundle, ray_local: None) -> None:
    from pagedkv.cluster import ClusterRequest

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first, second = _prompts()
    # The reference: one engine, the same two waves.
    single = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, **ENGINE_KW)
    ref = single.generate(first, params) + single.generate(second, params)

    cluster = _cluster(tiny, 2)
    try:
        wave1 = cluster.serve([ClusterRequest(f"w1-{i}", p, params) for i, p in enumerate(first)])
        wave2 = cluster.serve([ClusterRequest(f"w2-{i}", p, params) for i, p in enumerate(second)])
    finally:
        cluster.shutdown()
    got = list(wave1.values()) + list(wave2.values())
    assert [r.output.outputs[0].token_ids for r in got] == [o.outputs[0].token_ids for o in ref]
    # Group a went to one replica and group b to the other, by load in wave 1 and by the
    # cached prefix (3 blocks) in wave 2.
    ra, rb = wave1["w1-0"].replica, wave1["w1-1"].replica
    assert ra != rb
    assert [wave2[f"w2-{i}"].replica for i in range(4)] == [ra, rb, ra, rb]
    assert [wave2[f"w2-{i}"].overlap_blocks for i in range(4)] == [3, 3, 3, 3]
    # Each shared prefix was computed once: every second-wave request found it cached, exactly
    # as on the single engine.
    assert [r.output.num_cached_tokens for r in got] == [o.num_cached_tokens for o in ref]
    assert [r.output.num_cached_tokens for r in wave2.values()] == [12, 12, 12, 12]
    assert all(r.attempts == 1 and r.error is None for r in got)


@pytest.mark.slow
def test_a_long_prompt_of_a_length_dependent_rope_model_is_routed_to_its_cached_blocks(
    tmp_path_factory: pytest.TempPathFactory, ray_local: None
) -> None:
    """Dynamic NTK RoPE past its 32-token threshold: the engine keys a 40-token prompt's blocks
    with its RoPE variant; the router hashes it with the same keys, so the second request for
    it goes where it is cached with an overlap of all 9 cacheable blocks (the router used to
    hash it without the RoPE key: overlap 0, placed by load)."""
    from helpers.engine import build_tiny_model

    from pagedkv.cluster import ClusterRequest

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dynamic = build_tiny_model(
            tmp_path_factory.mktemp("tiny-dynamic-cluster"),
            max_position_embeddings=32,
            rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0),
        )
        cluster = ReplicaCluster(2, str(dynamic.path), engine_kwargs=ENGINE_KW, steps_per_call=2)
    long_prompt = list(range(100, 140))  # 40 tokens: (40 - 1) // 4 = 9 cacheable blocks
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    try:
        first = cluster.serve([ClusterRequest("a", long_prompt, params)])["a"]
        again = cluster.serve([ClusterRequest("b", long_prompt, params)])["b"]
    finally:
        cluster.shutdown()
    assert first.overlap_blocks == 0 and first.output.num_cached_tokens == 0
    assert again.replica == first.replica
    assert again.overlap_blocks == 9
    assert again.output.num_cached_tokens == 36
    assert again.output.outputs[0].token_ids == first.output.outputs[0].token_ids


@pytest.mark.slow
def test_killed_replica_loses_no_request_and_answers_none_twice(tiny: ModelBundle, ray_local: None) -> None:
    from pagedkv.cluster import ClusterRequest

    cluster = _cluster(tiny, 2)
    pids = {i: ray.get(cluster.actor(i).pid.remote()) for i in cluster.live_replicas}
    # Short and long requests alternate; routed by load (no shared prefix) they alternate
    # between the replicas, so when the first short one is answered the other replica still
    # runs long ones.
    lengths = [2 if i % 2 == 0 else 30 for i in range(10)]
    reqs = [
        ClusterRequest(f"r{i}", [50 + i, 60 + i, 70 + i, 80 + i, 90], SamplingParams(max_tokens=n, ignore_eos=True))
        for i, n in enumerate(lengths)
    ]
    seen: list[str] = []
    killed: list[int] = []

    def on_result(res) -> None:  # type: ignore[no-untyped-def]
        seen.append(res.request_id)
        if not killed:
            busy = [i for i in cluster.live_replicas if i != res.replica and cluster.num_unanswered(i) > 0]
            if busy:
                os.kill(pids[busy[0]], signal.SIGKILL)
                killed.append(busy[0])

    try:
        results = cluster.serve(reqs, on_result=on_result)
    finally:
        cluster.shutdown()
    assert sorted(seen) == sorted(r.request_id for r in reqs)  # each answered exactly once
    assert set(results) == {r.request_id for r in reqs}
    assert killed and cluster.dead == killed
    retried = [r for r in results.values() if r.attempts > 1]
    assert retried, "the killed replica had requests in flight"
    assert all(r.replica != killed[0] for r in retried)
    assert [len(results[f"r{i}"].output.outputs[0].token_ids) for i in range(10)] == lengths
    assert killed[0] not in cluster.router.indexer.worker_ids()


def test_cli_rejects_bad_arguments_before_starting_ray(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from pagedkv.cluster.cli import main

    # Numeric flags use the engine CLI's argparse types: refused at parse time, exit status 2.
    for flag, value, said in [
        ("--replicas", "0", "--replicas: 0 must be >= 1"),
        ("--block-size", "0", "--block-size: 0 must be >= 1"),
        ("--steps-per-call", "0", "--steps-per-call: 0 must be >= 1"),
        ("--max-tokens", "-1", "--max-tokens: -1 must be >= 1"),
        ("--trace-scale", "0", "--trace-scale: 0.0 must be > 0"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main([flag, value, "--prompts", "examples/prompts.jsonl"])
        assert exit_info.value.code == 2
        assert said in capsys.readouterr().err
    missing = tmp_path / "none.jsonl"
    assert main(["--prompts", str(missing)]) == 2
    assert "none.jsonl" in capsys.readouterr().err
    assert main(["--prompts", "examples/prompts.jsonl", "--max-imbalance", "0.5"]) == 2
    assert "max_imbalance" in capsys.readouterr().err
