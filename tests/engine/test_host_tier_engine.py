"""The prefix cache's host tier in the engine (issue 26 items 2 and 3): the runner's device <->
host copies in the manager's order, ``host_cache_bytes`` / ``num_host_blocks`` and their
errors, and served outputs identical with and without the tier while host hits replace
recomputation by exactly the amounts the stats report (the tiny model, and SmolLM2 on a
multi-turn chat, marked ``slow``)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from helpers.engine import assert_no_leak

import pagedkv
from pagedkv.engine import LLMEngine, SamplingParams, resources
from pagedkv.engine.cli import main
from pagedkv.engine.cli_options import host_evictions
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.errors import EngineConfigError
from pagedkv.engine.runner import ModelRunner
from pagedkv.tensors import BatchTensors

try:
    pagedkv.CacheConfig(num_blocks=4, block_size=4, num_host_blocks=2)
    HAS_HOST_TIER = True
except TypeError:
    HAS_HOST_TIER = False
needs_host_tier = pytest.mark.skipif(not HAS_HOST_TIER, reason="the core has no host tier yet")


def _engine(bundle, **kw: Any) -> LLMEngine:
    kw.setdefault("block_size", 4)
    return LLMEngine(bundle.hf, tokenizer=bundle.tokenizer, **kw)


# ---- the runner: copies in the given order ----------------------------------------------------


def _plan(rows: list[list[int]]) -> np.ndarray:
    return np.asarray(rows, dtype=np.int32).reshape(-1, 2)


def test_runner_runs_host_copies_per_call_in_order(tiny):
    """Host block 0 is stored, loaded, stored over and loaded again within one step (a host
    block a call loads from may be reused by a later call once its pin is released): each load
    must read what the store before it wrote. Merging all stores before all loads (the single
    step order) would load block 3's contents into device block 2."""
    eng = _engine(tiny, num_kv_blocks=8)
    runner = ModelRunner(eng.model, 8, 4, 2, manager=eng.manager, num_host_blocks=2)
    for b in range(8):
        runner.kv_cache[:, :, b] = float(b)
    transfers = [
        ("host_store", _plan([[1, 0]])),
        ("host_load", _plan([[0, 2]])),
        ("host_store", _plan([[3, 0], [5, 1], [6, 1]])),  # host block 1 stored twice: the later wins
        ("swap_out", _plan([[2, 1]])),  # device block 2 as loaded above
        ("swap_in", _plan([[1, 7]])),
        ("host_load", _plan([[0, 4], [1, 5]])),
    ]
    bt = BatchTensors.from_steps([], "cpu", block_tables=runner.block_tables, transfers=transfers)
    assert [k for k, _ in bt.transfers] == [k for k, _ in transfers]
    runner.apply_block_plans(bt)
    kv, host, cpu = runner.kv_cache, runner.host_cache, runner.cpu_cache
    assert host is not None and cpu is not None
    value = {b: float(kv[0, 0, b, 0, 0, 0]) for b in range(8)}
    assert value == {0: 0.0, 1: 1.0, 2: 1.0, 3: 3.0, 4: 3.0, 5: 6.0, 6: 6.0, 7: 1.0}
    assert float(host[0, 0, 0, 0, 0, 0]) == 3.0 and float(host[0, 0, 1, 0, 0, 0]) == 6.0
    assert float(cpu[0, 0, 1, 0, 0, 0]) == 1.0
    assert torch.equal(kv[:, :, 4], kv[:, :, 3]) and torch.equal(host[:, :, 1], kv[:, :, 6])


def test_batch_tensors_default_transfers_are_the_swaps():
    """Without an explicit order, ``transfers`` is swap out then swap in (as before)."""
    eng_free = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=8, block_size=4))
    from pagedkv.tensors import BlockTable

    out, inn = _plan([[1, 0]]), _plan([[0, 2]])
    bt = BatchTensors.from_steps([], None, block_tables=BlockTable(eng_free), swap_out=out, swap_in=inn)
    assert [k for k, _ in bt.transfers] == ["swap_out", "swap_in"]
    assert bt.transfers[0][1] is out and bt.transfers[1][1] is inn
    assert BatchTensors.from_steps([], None, block_tables=BlockTable(eng_free)).transfers == ()


# ---- configuration -------------------------------------------------------------------------------


def test_host_cache_bytes_larger_than_memory_is_refused_before_the_load(tmp_path):
    """The check runs before the model load: a missing model is not reported first."""
    too_big = resources.available_memory(torch.device("cpu")) + (1 << 30)
    with pytest.raises(EngineConfigError, match=rf"host_cache_bytes={too_big}.*larger than the \d+ bytes"):
        LLMEngine(str(tmp_path / "no-model"), host_cache_bytes=too_big)
    with pytest.raises(EngineConfigError, match="host_cache_bytes=4096 is invalid.*larger than the 1000 bytes"):
        EngineConfig(host_cache_bytes=4096).check_host_memory(1000)
    EngineConfig(host_cache_bytes=1000).check_host_memory(1000)  # fits exactly


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(host_cache_bytes=0), "host_cache_bytes=0 is invalid"),
        (dict(host_cache_bytes=-5), "host_cache_bytes=-5 is invalid"),
        (dict(host_cache_bytes=True), "host_cache_bytes=True is invalid"),
        (dict(host_cache_bytes=1.5), "host_cache_bytes=1.5 is invalid"),
        (dict(num_host_blocks=-1), "num_host_blocks=-1 is invalid"),
        (dict(num_host_blocks=4, host_admission_min_seen=0), "host_admission_min_seen=0 is invalid"),
        (dict(num_host_blocks=4, enable_prefix_caching=False), "num_host_blocks=4 is invalid.*prefix_caching"),
        (dict(host_cache_bytes=1 << 20, enable_prefix_caching=False), "host_cache_bytes=1048576 is invalid"),
        (dict(num_host_blocks=4, kv_layout="virtual"), "num_host_blocks=4 is invalid.*virtual"),
    ],
)
def test_bad_host_tier_config(kw, needle):
    with pytest.raises(EngineConfigError, match=needle):
        EngineConfig(**kw)


def test_host_eviction_config():
    assert EngineConfig().host_eviction == "lru"
    assert EngineConfig(num_host_blocks=4, host_eviction="arc").resolved(1000).cache_config().host_eviction == "arc"
    assert EngineConfig(num_host_blocks=4).resolved(1000).cache_config().host_eviction == "lru"
    # The names come from the core's refusal (the engine keeps no list of its own).
    with pytest.raises(
        EngineConfigError, match=re.escape('host_eviction=\'fifo\' is invalid: expected one of "lru", "arc"')
    ):
        EngineConfig(host_eviction="fifo")
    # --host-eviction's choices are the core's names, each accepted by the core's config.
    assert host_evictions() == list(pagedkv.HOST_EVICTIONS) == ["lru", "arc"]
    for name in pagedkv.HOST_EVICTIONS:
        assert pagedkv.CacheConfig(num_blocks=2, block_size=1, host_eviction=name).host_eviction == name
    for bad in (None, 1, "ARC"):
        with pytest.raises(EngineConfigError, match=f"host_eviction={bad!r} is invalid"):
            EngineConfig(host_eviction=bad)  # type: ignore[arg-type]


def test_a_manager_of_several_groups_takes_the_host_eviction():
    from pagedkv.engine.kv_groups import KVCacheGroup, group_specs

    groups = [KVCacheGroup(None, (0,)), KVCacheGroup(8, (1,))]
    specs, layer_groups = group_specs(groups, 2, block_size=4, bytes_per_token=64)
    assert layer_groups == [0, 1]
    assert [(g.kind, g.block_size, g.window) for g in specs] == [("full", 4, None), ("sliding_window", 4, 8)]
    config = EngineConfig(num_kv_blocks=16, block_size=4, num_host_blocks=8, host_eviction="arc").resolved(512)
    manager = pagedkv.KVCacheManager(config.cache_config(groups=specs, layer_groups=layer_groups))
    assert (manager.num_groups, manager.num_host_blocks, manager.config.host_eviction) == (2, 8, "arc")
    with pytest.raises(pagedkv.InvalidConfigError, match="host_eviction") as e:
        pagedkv.CacheConfig(16, groups=specs, layer_groups=layer_groups, num_host_blocks=8, host_eviction="fifo")
    assert e.value.field == "host_eviction"


def test_host_tier_size_from_bytes():
    per_block = 1000
    assert EngineConfig(host_cache_bytes=10_999).resolved(per_block).num_host_blocks == 10
    assert EngineConfig().resolved(per_block).num_host_blocks == 0
    assert EngineConfig(host_cache_bytes=10_000, num_host_blocks=3).resolved(per_block).num_host_blocks == 3
    with pytest.raises(EngineConfigError, match="host_cache_bytes=999 is invalid: it holds no block of 1000 bytes"):
        EngineConfig(host_cache_bytes=999).resolved(per_block)
    # Prefix caching off without a tier stays valid.
    EngineConfig(num_host_blocks=0, enable_prefix_caching=False)


def test_host_cache_bytes_below_one_block_is_refused(tiny):
    per_block = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, num_kv_blocks=8).model.kv_bytes_per_block(16)
    with pytest.raises(EngineConfigError, match=f"host_cache_bytes={per_block - 1} is invalid.*{per_block} bytes"):
        _engine(tiny, block_size=16, num_kv_blocks=8, host_cache_bytes=per_block - 1)


def test_available_memory_reads_memavailable_without_psutil(tmp_path, monkeypatch):
    """Without psutil the host's free memory is Linux's MemAvailable, which counts the page
    cache the kernel reclaims; free pages alone (MemFree) were a small part of it."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684084 kB\nMemFree:          522248 kB\nMemAvailable:   22824276 kB\n")
    monkeypatch.setitem(__import__("sys").modules, "psutil", None)
    monkeypatch.setattr(resources, "MEMINFO", str(meminfo))
    assert resources.available_memory(torch.device("cpu")) == 22824276 * 1024
    monkeypatch.setattr(resources, "MEMINFO", str(tmp_path / "missing"))
    assert resources.available_memory(torch.device("cpu")) > 0  # os.sysconf's free pages


# ---- the tier at work (tiny model) ------------------------------------------------------------


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 1) -> list[list[int]]:
    return [list(o.token_ids) for o in engine.generate(prompts, SamplingParams(max_tokens=max_tokens))]


@needs_host_tier
def test_host_hit_replaces_recompute_by_exact_amounts(tiny):
    """X (8 full blocks + 1 token) is seen twice, then evicted by Y (the pool's 12 usable
    blocks), then asked again: with a host tier its 8 blocks (32 tokens) come back from host
    memory, without one they are recomputed. Y's blocks, seen once, are not admitted."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(5, 512, (33,), generator=g).tolist()
    y = torch.randint(5, 512, (45,), generator=g).tolist()
    runs = {}
    for tier in (0, 16):
        eng = _engine(tiny, num_kv_blocks=13, num_host_blocks=tier or None)
        outs = [_run(eng, [p]) for p in (x, x, y, x)]
        runs[tier] = (eng, outs, eng.metrics())
    (_, plain_outs, pm), (tiered, tier_outs, tm) = runs[0], runs[16]
    assert plain_outs == tier_outs
    st = tiered.stats()
    assert (st.host_hits_tokens, st.host_stores_blocks, st.host_loads_blocks) == (32, 8, 8)
    assert tm.host_hit_tokens == 32 and tm.host_stored_blocks == 8 and tm.host_loaded_blocks == 8
    assert tm.prefix_hit_tokens - pm.prefix_hit_tokens == 32
    assert pm.prefill_tokens - tm.prefill_tokens == 32
    assert pm.prefill_tokens == 33 + 1 + 45 + 33  # the second X hits 32 tokens on the device
    assert_no_leak(tiered)
    tiered.manager.check_invariants()


@needs_host_tier
@pytest.mark.parametrize("min_seen, hits", [(1, 32), (2, 0)])
def test_admission_threshold(tiny, min_seen, hits):
    """X used once, then evicted by Y, then asked again: only a tier storing blocks used once
    serves it (8 blocks, 32 tokens); the default threshold of two uses stores nothing."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(5, 512, (33,), generator=g).tolist()
    y = torch.randint(5, 512, (45,), generator=g).tolist()
    eng = _engine(tiny, num_kv_blocks=13, num_host_blocks=16, host_admission_min_seen=min_seen)
    for p in (x, y, x):
        _run(eng, [p])
    st = eng.stats()
    assert eng.manager.config.host_admission_min_seen == min_seen
    assert st.host_hits_tokens == hits and st.host_loads_blocks == hits // 4
    assert eng.metrics().prefill_tokens == 33 + 45 + 33 - hits


def _conversations(vocab: int, n: int, seed: int, lengths: tuple[int, int] = (6, 20)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(5, vocab, (int(torch.randint(*lengths, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def _multi_turn(
    engine: LLMEngine, convs: int, turns: int, vocab: int, max_tokens: int, lengths: tuple[int, int]
) -> list[list[int]]:
    """``convs`` conversations, ``turns`` turns each, served turn by turn (each request alone):
    turn t's prompt is turn t-1's prompt + its answer + a new user message of ``lengths``
    (low, high) tokens."""
    user = _conversations(vocab, convs * turns, seed=3, lengths=lengths)
    history: list[list[int]] = [[] for _ in range(convs)]
    outs = []
    for t in range(turns):
        for c in range(convs):
            prompt = history[c] + user[t * convs + c]
            answer = _run(engine, [prompt], max_tokens)[0]
            history[c] = prompt + answer
            outs.append(answer)
    return outs


def _compare_tiers(
    bundle, *, convs: int, turns: int, max_tokens: int, lengths: tuple[int, int] = (6, 20), **kw: Any
) -> None:
    vocab = bundle.hf.config.vocab_size
    got = {}
    for name, tier in (("plain", None), ("tier", 4096)):
        eng = _engine(bundle, num_host_blocks=tier, **kw)
        outs = _multi_turn(eng, convs, turns, vocab, max_tokens, lengths)
        got[name] = (outs, eng.metrics(), eng)
    (po, pm, _), (to, tm, teng) = got["plain"], got["tier"]
    assert po == to, "outputs differ with the host tier"
    assert tm.host_hit_tokens > 0 and tm.host_loaded_blocks * teng.config.block_size == tm.host_hit_tokens
    # Each request runs alone, so the device pool evolves alike and the host hits are the difference.
    assert tm.prefix_hit_tokens - pm.prefix_hit_tokens == tm.host_hit_tokens
    assert pm.prefill_tokens - tm.prefill_tokens == tm.host_hit_tokens
    assert_no_leak(teng)
    teng.manager.check_invariants()


@needs_host_tier
def test_multi_turn_outputs_identical_with_and_without_host_tier_tiny(tiny):
    _compare_tiers(tiny, convs=6, turns=4, max_tokens=6, num_kv_blocks=40)


@needs_host_tier
def test_arc_host_eviction_outputs_identical_to_lru_and_no_tier(tiny):
    """A host tier far below the reuse set (8 blocks) so that its eviction policy runs: ARC's
    answers equal LRU's and those without a tier, and ARC still hits."""
    vocab = tiny.hf.config.vocab_size
    outs, hits = {}, {}
    for policy, tier in (("none", None), ("lru", 8), ("arc", 8)):
        kw: dict[str, Any] = {} if tier is None else dict(num_host_blocks=tier, host_eviction=policy)
        eng = _engine(tiny, num_kv_blocks=24, host_admission_min_seen=1, **kw)
        if tier is not None:
            assert eng.manager.config.host_eviction == policy
        outs[policy] = _multi_turn(eng, 4, 3, vocab, 4, (6, 14))
        hits[policy] = eng.metrics().host_hit_tokens
        assert_no_leak(eng)
        eng.manager.check_invariants()
    assert outs["arc"] == outs["lru"] == outs["none"]
    assert hits["none"] == 0 and hits["lru"] > 0 and hits["arc"] > 0
    assert eng.stats().host_stores_blocks > 8, "the 8-block ARC tier never evicted"


@needs_host_tier
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_batched_with_preemption_outputs_match_a_large_pool(tiny, preemption):
    """Many requests at once on a small pool (preemption, swaps between host stores and
    loads in one step) give the outputs of a pool that never evicts."""
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(5, 512, (24,), generator=g).tolist()
    prompts = [
        shared + torch.randint(5, 512, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 30, (24,), generator=g)
    ]
    ref_engine = _engine(tiny, num_kv_blocks=1024)
    eng = _engine(tiny, num_kv_blocks=48, num_host_blocks=256, preemption=preemption, max_tokens_per_step=64)
    kinds: list[set[str]] = []
    run_plans = eng.runner.apply_block_plans

    def recording(bt: Any) -> None:
        kinds.append({k for k, _ in bt.transfers})
        run_plans(bt)

    eng.runner.apply_block_plans = recording  # type: ignore[method-assign]
    for _ in range(3):  # seen twice (admitted to the host tier), evicted, then loaded back
        assert _run(eng, prompts, 12) == _run(ref_engine, prompts, 12)
    st = eng.stats()
    assert st.preemptions > 0 and st.host_loads_blocks > 0
    if preemption == "swap":  # steps whose swaps sit between host copies
        assert st.swaps_out_blocks > 0
        assert any("host_store" in k and ("swap_in" in k or "swap_out" in k) for k in kinds)
    assert_no_leak(eng)
    eng.manager.check_invariants()


@needs_host_tier
@pytest.mark.parametrize(("eviction", "shown"), [([], "lru"), (["--host-eviction", "arc"], "arc")])
def test_cli_host_cache_bytes(tiny, tmp_path, capsys, eviction, shown):
    f = tmp_path / "p.txt"
    f.write_text("w7 w8 w9 w10 w11\nw7 w8 w9 w10 w12\n")
    metrics = tmp_path / "m.json"
    rc = main(
        [
            "--model",
            str(tiny.path),
            "--prompts",
            str(f),
            "--host-cache-bytes",
            "1M",
            "--host-min-seen",
            "1",
            *eviction,
            "--max-tokens",
            "4",
            "--no-progress",
            "--metrics-json",
            str(metrics),
        ]  # fmt: skip
    )
    assert rc == 0
    import json

    m = json.loads(metrics.read_text())
    per_block = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, num_kv_blocks=8).model.kv_bytes_per_block(16)
    assert m["host_blocks"] == (1 << 20) // per_block
    out = capsys.readouterr().out
    assert "prefix cache host tier" in out and f"used >= 1 times, {shown} eviction" in out


# ---- SmolLM2 -------------------------------------------------------------------------------------


@needs_host_tier
@pytest.mark.slow
def test_smollm2_multi_turn_outputs_identical_with_and_without_host_tier(smol):
    """The real model, a device pool too small for six conversations' histories: token-identical
    answers with and without the host tier, host hits exactly replacing recomputed tokens."""
    _compare_tiers(
        smol,
        convs=6,
        turns=3,
        max_tokens=8,
        lengths=(40, 80),
        num_kv_blocks=24,
        block_size=16,
        host_admission_min_seen=1,
    )
