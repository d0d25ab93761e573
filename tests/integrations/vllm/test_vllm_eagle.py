"""Model-based drafters (EAGLE, EAGLE-3, MTP) through vLLM's real V1 Scheduler, stock vs
``PagedKVScheduler``.

Both schedulers get a speculative config vLLM reads as an EAGLE / MTP drafter's
(``pagedkv.testing.vllm_scheduler.eagle_speculative_config``): every running request's
allocation asks ``num_lookahead_tokens`` slots past its scheduled tokens (the drafter's KV), and
prefix hits drop their last block (``use_eagle_block_drop``, legacy block hashes). The drafts
come from ``fake_drafts`` (about one in three wrong). Where no block is cached twice and no
cached block is evicted, every step must agree: scheduled tokens with the drafts, prefix hits,
preemptions, new tokens and blocks held per request (the lookahead blocks included). Under
memory pressure the known by-design difference (which copy of a block cached twice a hit takes:
EAGLE's drop recomputes a hit's last block, so copies are common) lets the pools drift; there
outputs must still equal decoding without drafts and nothing may leak.

Runs only where vLLM is installed (``make test-vllm`` builds that environment).
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from pagedkv.integrations.vllm import PagedKVScheduler, UnsupportedVllmConfigError  # noqa: E402
from pagedkv.integrations.vllm.config_check import check_supported_config  # noqa: E402
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    Driver,
    build_scheduler,
    eagle_speculative_config,
    make_hybrid_kv_cache_config,
    make_kv_cache_config,
    make_request,
    make_vllm_config,
)

BS = 16
HYBRID = (("full", None), ("sliding_window", 32))


class PerRequestPagedKVScheduler(PagedKVScheduler):
    """The plug-in without its batched decode path."""

    batch_decode = False


def _config(k: int, method: str = "eagle", lookahead_hashes: bool = False, **kw: Any) -> Any:
    base = make_vllm_config(**kw)
    if not k:
        return base
    spec = eagle_speculative_config(base, k, method, lookahead_block_hashes=lookahead_hashes)
    return make_vllm_config(speculative_config=spec, **kw)


def _needs_lookahead_hashes() -> None:
    if not hasattr(make_vllm_config(num_blocks=64), "num_hash_lookahead_tokens"):
        pytest.skip("vLLM 0.32 has no lookahead block hashes")


def _kv(num_blocks: int, groups: Any, drafter_group: int | None) -> Any:
    if groups is None:
        return make_kv_cache_config(num_blocks, BS)
    kv = make_hybrid_kv_cache_config(num_blocks, groups, BS)
    if drafter_group is not None:
        kv.kv_cache_groups[drafter_group].is_eagle_group = True
    return kv


def _stream(seed: int, n: int = 12, la: int = 0) -> dict[int, list[Any]]:
    """Requests by arrival step; ``la``: the lookahead block hashes their hashers cover."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 4000) for _ in range(m)] for m in (40, 64)]
    stream: dict[int, list[Any]] = {}
    for i in range(n):
        prompt = systems[i % 2] + [rng.randrange(100, 4000) for _ in range(rng.randrange(1, 50))]
        max_tokens = rng.randrange(5, 60)
        stream.setdefault(rng.randrange(0, 14), []).append(
            lambda i=i, prompt=prompt, max_tokens=max_tokens: make_request(
                f"r{i}", prompt, max_tokens, block_size=BS, num_hash_lookahead_tokens=la
            )
        )
    # A repeat of an earlier request's prompt (a resend: its whole prompt is cached).
    first = systems[0] + [7] * 24
    stream.setdefault(0, []).append(
        lambda: make_request("first", first, 3, block_size=BS, num_hash_lookahead_tokens=la)
    )
    stream.setdefault(20, []).append(
        lambda: make_request("resend", first, 3, block_size=BS, num_hash_lookahead_tokens=la)
    )
    return stream


def _lockstep(
    paged_cls: type,
    k: int,
    stream: dict[int, list[Any]],
    *,
    strict: bool,
    groups: Any = None,
    drafter_group: int | None = None,
    method: str = "eagle",
    lookahead_hashes: bool = False,
    **kw: Any,
) -> tuple[Driver, Driver, list[dict[str, Any]]]:
    num_blocks = kw["num_blocks"]
    stock = Driver(
        build_scheduler(
            Scheduler,
            _config(k, method, lookahead_hashes, **kw),
            kv_cache_config=_kv(num_blocks, groups, drafter_group),
        ),
        num_drafts=k,
    )
    paged = Driver(
        build_scheduler(
            paged_cls,
            _config(k, method, lookahead_hashes, **kw),
            kv_cache_config=_kv(num_blocks, groups, drafter_group),
        ),
        num_drafts=k,
    )
    records = []
    last = max(stream)
    for step in range(3000):
        for factory in stream.get(step, []):
            stock.add(factory())
            paged.add(factory())
        if step > last and not stock.scheduler.has_unfinished_requests():
            assert not paged.scheduler.has_unfinished_requests()
            break
        a, b = stock.step(), paged.step()
        if strict:
            assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
        records.append(b)
        paged.scheduler.kv_cache_manager.manager.check_invariants()
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError("stream did not finish")
    return stock, paged, records


def _check_done(paged: Driver) -> None:
    kvm = paged.scheduler.kv_cache_manager.manager
    kvm.check_invariants()
    assert kvm.num_sequences == 0 and kvm.stats().used == 0


def _plain_outputs(stream: dict[int, list[Any]], num_blocks: int, groups: Any = None) -> dict[str, list[int]]:
    d = Driver(
        build_scheduler(
            Scheduler,
            _config(0, num_blocks=num_blocks, max_num_batched_tokens=128),
            kv_cache_config=_kv(num_blocks, groups, None),
        )
    )
    last = max(stream)
    for step in range(3000):
        for factory in stream.get(step, []):
            d.add(factory())
        if step > last and not d.scheduler.has_unfinished_requests():
            break
        d.step()
    return dict(d.outputs)


@pytest.mark.parametrize(("k", "method"), [(1, "eagle"), (3, "eagle3"), (2, "mtp")])
@pytest.mark.parametrize("paged_cls", [PagedKVScheduler, PerRequestPagedKVScheduler])
def test_full_attention_steps_match_stock(k: int, method: str, paged_cls: type) -> None:
    stream = _stream(k)
    stock, paged, records = _lockstep(
        paged_cls, k, stream, strict=True, method=method, num_blocks=1024, max_num_batched_tokens=128
    )
    assert paged.scheduler.num_lookahead_tokens == k and paged.scheduler.use_eagle_block_drop
    assert paged.outputs == stock.outputs == _plain_outputs(stream, 1024)
    assert 0 < paged.drafts_accepted < paged.drafts_scheduled
    hits = paged.prefix_hits
    assert hits == stock.prefix_hits
    # The resend's 64-token prompt is cached whole; the hit stops at 63 tokens (48 aligned)
    # and EAGLE drops one more block.
    assert hits["resend"] == 32
    assert max(hits.values()) >= 32
    _check_done(paged)


@pytest.mark.parametrize("drafter_group", [None, 0])
def test_sliding_window_hybrid_steps_match_stock(drafter_group: int | None) -> None:
    # None: no group marked (vLLM then drops in every group); 0: the drafter's layers are in
    # the full-attention group (is_eagle_group), the sliding-window group keeps whole hits.
    stream = _stream(5)
    stock, paged, _ = _lockstep(
        PagedKVScheduler,
        3,
        stream,
        strict=True,
        groups=HYBRID,
        drafter_group=drafter_group,
        num_blocks=1024,
        max_num_batched_tokens=128,
    )
    assert paged.outputs == stock.outputs == _plain_outputs(stream, 1024, HYBRID)
    assert paged.prefix_hits == stock.prefix_hits
    assert paged.prefix_hits["resend"] > 0
    _check_done(paged)


def test_drafter_layers_in_their_own_group_match_stock() -> None:
    # The drafter's full-attention layers form their own KV cache group (marked is_eagle_group)
    # next to the target's full-attention and sliding-window groups.
    groups = (("full", None), ("sliding_window", 32), ("full", None))
    stream = _stream(9)
    stock, paged, _ = _lockstep(
        PagedKVScheduler,
        2,
        stream,
        strict=True,
        groups=groups,
        drafter_group=2,
        num_blocks=1024,
        max_num_batched_tokens=128,
    )
    assert paged.scheduler.kv_cache_manager.eagle_group_ids == {2}
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits
    _check_done(paged)


@pytest.mark.parametrize("lookahead_hashes", [False, True])
@pytest.mark.parametrize("groups", [None, HYBRID])
def test_preemption_under_memory_pressure_keeps_outputs_and_leaks_nothing(groups: Any, lookahead_hashes: bool) -> None:
    if lookahead_hashes:
        _needs_lookahead_hashes()
    stream = _stream(7, n=10, la=int(lookahead_hashes))
    # Without the drop fewer blocks are cached twice: a smaller pool to preempt.
    num_blocks = (24 if lookahead_hashes else 30) if groups is None else 60
    stock, paged, records = _lockstep(
        PagedKVScheduler,
        3,
        stream,
        # With lookahead hashes no block is cached twice: step by step, preemptions and
        # resumes included (a block whose next token was just sampled is cached by
        # update_from_output, before a preemption in the next step).
        strict=lookahead_hashes,
        groups=groups,
        lookahead_hashes=lookahead_hashes,
        num_blocks=num_blocks,
        max_num_batched_tokens=128,
    )
    assert any(r["preempted"] for r in records), "the pool must be small enough to preempt"
    assert paged.outputs == stock.outputs == _plain_outputs(stream, num_blocks, groups)
    _check_done(paged)


def test_lookahead_slots_take_the_blocks_vllm_takes() -> None:
    # A 30-token prompt with 3 lookahead slots: stock and plug-in both hold blocks for 33
    # positions (3 blocks) after the prefill, and the next decode (1 + 3 drafts + 3 lookahead,
    # up to position 37) takes none.
    held = {}
    for cls in (Scheduler, PagedKVScheduler):
        d = Driver(build_scheduler(cls, _config(3, num_blocks=64)), num_drafts=3)
        d.add(make_request("a", list(range(500, 530)), 8, block_size=BS))
        held[cls] = [d.step()["blocks_held"]["a"] for _ in range(3)]
    assert held[PagedKVScheduler] == held[Scheduler]
    assert held[Scheduler][0] == 3


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_eagle_family_configs_are_accepted(method: str) -> None:
    kv = make_kv_cache_config(64)
    cfg = _config(3, method, num_blocks=64)
    assert cfg.num_lookahead_tokens == 3 and cfg.num_prefill_lookahead_tokens == 1
    check_supported_config(cfg, kv, BS)
    # Prefix caching off: lookahead block hashes are off too, nothing to drop.
    base = make_vllm_config(num_blocks=64, enable_prefix_caching=False)
    spec = eagle_speculative_config(base, 3, method, lookahead_block_hashes=True)
    off = make_vllm_config(num_blocks=64, enable_prefix_caching=False, speculative_config=spec)
    assert getattr(off, "num_hash_lookahead_tokens", 0) == 0  # vLLM 0.32 has no lookahead hashes
    check_supported_config(off, kv, BS)
    build_scheduler(PagedKVScheduler, off)


def test_lookahead_block_hashes_are_served_and_refused_with_kv_events() -> None:
    _needs_lookahead_hashes()
    cfg = _config(3, num_blocks=64, lookahead_hashes=True)
    assert cfg.num_hash_lookahead_tokens == 1  # vLLM's default for EAGLE with prefix caching
    check_supported_config(cfg, make_kv_cache_config(64), BS)
    sched = build_scheduler(PagedKVScheduler, cfg)
    assert sched.num_hash_lookahead_tokens == 1 and not sched.use_eagle_block_drop
    kvm = sched.kv_cache_manager
    assert kvm.num_hash_lookahead_tokens == 1 and not kvm._drop_groups
    assert kvm.manager.config.hash_lookahead_tokens == 1
    # With KV cache events the lookahead hashes are refused by name.
    with pytest.raises(UnsupportedVllmConfigError) as err:
        check_supported_config(
            _Override(cfg, kv_events_config=SimpleNamespace(enable_kv_cache_events=True)),
            make_kv_cache_config(64),
            BS,
        )
    assert err.value.field == "num_hash_lookahead_tokens" and "disable_lookahead_block_hashes" in err.value.reason


@pytest.mark.parametrize(("k", "method"), [(1, "eagle"), (3, "eagle3"), (2, "mtp")])
@pytest.mark.parametrize("paged_cls", [PagedKVScheduler, PerRequestPagedKVScheduler])
def test_lookahead_hashes_full_attention_steps_match_stock(k: int, method: str, paged_cls: type) -> None:
    # vLLM's default EAGLE configuration with prefix caching: lookahead block hashes, no
    # last-block drop. Shared system prompts and a resend: hits agree at every step.
    _needs_lookahead_hashes()
    stream = _stream(k, la=1)
    stock, paged, _ = _lockstep(
        paged_cls,
        k,
        stream,
        strict=True,
        method=method,
        lookahead_hashes=True,
        num_blocks=1024,
        max_num_batched_tokens=128,
    )
    assert paged.scheduler.num_hash_lookahead_tokens == 1 and not paged.scheduler.use_eagle_block_drop
    assert paged.outputs == stock.outputs == _plain_outputs(stream, 1024)
    hits = paged.prefix_hits
    assert hits == stock.prefix_hits
    # The resend's 64-token prompt is cached whole; the hit stops at 63 tokens (48 aligned),
    # and no block is dropped (the lookahead hash proves token 48).
    assert hits["resend"] == 48
    _check_done(paged)


@pytest.mark.parametrize("drafter_group", [None, 0])
def test_lookahead_hashes_sliding_window_hybrid_steps_match_stock(drafter_group: int | None) -> None:
    _needs_lookahead_hashes()
    stream = _stream(5, la=1)
    stock, paged, _ = _lockstep(
        PagedKVScheduler,
        3,
        stream,
        strict=True,
        groups=HYBRID,
        drafter_group=drafter_group,
        lookahead_hashes=True,
        num_blocks=1024,
        max_num_batched_tokens=128,
    )
    assert paged.outputs == stock.outputs == _plain_outputs(stream, 1024, HYBRID)
    assert paged.prefix_hits == stock.prefix_hits
    assert paged.prefix_hits["resend"] > 0
    _check_done(paged)


def test_lookahead_hashes_a_block_is_cached_once_its_next_token_is_known() -> None:
    # A 32-token prompt: after its prefill, block 1's next token (position 32) is not sampled
    # yet, so a second request with the same 32 tokens plus one more hits block 0 only on
    # both schedulers; once the first request decodes that token, a request whose 33rd token
    # matches it hits both blocks.
    _needs_lookahead_hashes()
    prompt = list(range(600, 632))
    hits: dict[type, list[int]] = {}
    for cls in (Scheduler, PagedKVScheduler):
        d = Driver(build_scheduler(cls, _config(1, num_blocks=64, lookahead_hashes=True)), num_drafts=1)
        d.add(make_request("a", prompt, 6, block_size=BS, num_hash_lookahead_tokens=1))
        d.step()
        d.add(make_request("b", prompt + [5], 2, block_size=BS, num_hash_lookahead_tokens=1))
        d.step()
        d.run()
        nxt = d.outputs["a"][0]
        d.add(make_request("c", prompt + [nxt], 2, block_size=BS, num_hash_lookahead_tokens=1))
        d.run()
        hits[cls] = [d.prefix_hits["b"], d.prefix_hits["c"]]
        if cls is PagedKVScheduler:
            _check_done(d)
    assert hits[PagedKVScheduler] == hits[Scheduler] == [16, 32]


class _Override:
    """``cfg`` with some of its properties read as other values."""

    def __init__(self, cfg: Any, **values: Any) -> None:
        self._cfg = cfg
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)


def test_multi_module_mtp_and_lookahead_with_a_connector_are_refused_by_name() -> None:
    cfg = _config(3, "mtp", num_blocks=64)
    with pytest.raises(UnsupportedVllmConfigError) as err:
        check_supported_config(_Override(cfg, num_prefill_lookahead_tokens=3), make_kv_cache_config(64), BS)
    assert err.value.field == "num_prefill_lookahead_tokens" and "multi-module MTP" in err.value.reason
    from vllm.config import KVTransferConfig

    connector = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    check_supported_config(
        _Override(_config(0, num_blocks=64), kv_transfer_config=connector), make_kv_cache_config(64), BS
    )
    with pytest.raises(UnsupportedVllmConfigError) as err:
        check_supported_config(_Override(cfg, kv_transfer_config=connector), make_kv_cache_config(64), BS)
    assert err.value.field == "num_lookahead_tokens" and "KV connector" in err.value.reason


def test_eagle_drop_on_a_chunked_local_group_is_refused_by_name() -> None:
    kv = make_hybrid_kv_cache_config(64, (("full", None), ("chunked_local", 32)), BS)
    with pytest.raises(UnsupportedVllmConfigError) as err:
        check_supported_config(_config(3, num_blocks=64), kv, BS)
    assert "chunked-local" in err.value.reason
    # Without prefix caching nothing is dropped: served.
    check_supported_config(_config(3, num_blocks=64, enable_prefix_caching=False), kv, BS)


def _live_blocks_apart(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``record`` without the sliding-window group's live block counts, and those counts."""
    held = record["blocks_held"]
    rest = dict(record, blocks_held={rid: (g[0], g[1][0]) for rid, g in held.items()})
    return rest, {rid: g[1][1] for rid, g in held.items()}


@pytest.mark.parametrize("lookahead_hashes", [False, True])
@pytest.mark.parametrize("groups", [None, HYBRID])
def test_async_scheduling_steps_match_stock(groups: Any, lookahead_hashes: bool) -> None:
    # vLLM's default on a GPU: the next step is scheduled while the previous one runs, so the
    # slots of in-flight tokens and the drafter's lookahead slots come before their ids. With a
    # sliding-window group, speculative decoding under async scheduling releases out-of-window
    # blocks at other steps than vLLM (pagedkv by its committed context, vLLM by its processed
    # count, which lags while a step is in flight; it differs without a drafter too, method
    # "ngram_gpu", so it is not the drafter's): there the window group's live block counts are
    # left out; everything else (its table lengths included) must agree. ``lookahead_hashes``:
    # vLLM's default EAGLE config with prefix caching (no drop; a block is cached once the
    # in-flight token after it is known).
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from pagedkv.testing.vllm_scheduler import AsyncDriver

    if lookahead_hashes:
        _needs_lookahead_hashes()
    stream = _stream(11, la=int(lookahead_hashes))
    kw = dict(num_blocks=1024, max_num_batched_tokens=128, async_scheduling=True)
    drivers = [
        AsyncDriver(
            build_scheduler(cls, _config(2, "eagle", lookahead_hashes, **kw), kv_cache_config=_kv(1024, groups, None)),
            num_drafts=2,
        )
        for cls in (AsyncScheduler, PagedKVScheduler)
    ]
    stock, paged = drivers
    last = max(stream)
    for step in range(3000):
        for factory in stream.get(step, []):
            for d in drivers:
                d.add(factory())
        if step > last and not stock.has_work():
            assert not paged.has_work()
            break
        a, b = stock.step(), paged.step()
        if groups is None:
            assert b == a, f"step {step} differs:\nstock {a}\npaged {b}"
            continue
        (a_rest, a_live), (b_rest, b_live) = _live_blocks_apart(a), _live_blocks_apart(b)
        assert b_rest == a_rest, f"step {step} differs:\nstock {a}\npaged {b}"
        assert b_live.keys() == a_live.keys()
    else:  # pragma: no cover - a hang is a failure
        raise AssertionError("stream did not finish")
    assert paged.outputs == stock.outputs
    assert paged.prefix_hits == stock.prefix_hits and paged.prefix_hits["resend"] > 0
    _check_done(paged)
