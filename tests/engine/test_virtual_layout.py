"""The virtual KV layout (``kv_layout="virtual"``, vAttention-style): reserved virtual memory
with pages committed on demand and returned to the OS, the page accounting the scheduler sees,
and token-identical outputs to the paged layout on the engine's prompts."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import assert_no_leak

import pagedkv
from pagedkv.engine import LLMEngine, SamplingParams
from pagedkv.engine.errors import EngineConfigError, InvalidRequestError, RequestTooLargeError
from pagedkv.engine.manager_protocol import EngineKVManager, ManagerPool, StepResult
from pagedkv.engine.virtual.layout import VirtualKVLayout
from pagedkv.engine.virtual.manager import VirtualKVManager
from pagedkv.engine.virtual.memory import OS_PAGE, PAGE_SIZES, SharedPages, VirtualArena, minor_faults

MiB = 1024 * 1024


# ---- virtual memory ------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGE_SIZES[:2])
def test_arena_commit_faults_pages_in_and_release_returns_them_to_the_os(page):
    arena = VirtualArena(256 * MiB, page)
    assert arena.resident_bytes() == 0  # reserved, nothing committed
    before = minor_faults()
    arena.commit(0, 8 * MiB)
    assert minor_faults() - before >= 8 * MiB // OS_PAGE // 16  # faults happened (fault-around may batch)
    assert arena.committed_bytes == 8 * MiB
    assert arena.resident_bytes() >= 8 * MiB
    arena.bytes[: 8 * MiB].fill_(7)
    arena.release(0, 8 * MiB)
    assert arena.committed_bytes == 0
    assert arena.resident_bytes() == 0  # the OS took the pages back
    assert int(arena.bytes[:OS_PAGE].max()) == 0  # and they read as zeros afterwards
    arena.close()


def test_arena_two_mib_pages_are_huge_pages_when_the_kernel_allows():
    try:
        arena = VirtualArena(64 * MiB, 2 * MiB)
    except EngineConfigError as e:  # HugePagesUnavailableError: THP set to never
        pytest.skip(str(e))
    arena.commit(2 * MiB, 4 * MiB)
    assert arena.resident_bytes() == 4 * MiB
    arena.release(2 * MiB, 4 * MiB)
    assert arena.resident_bytes() == 0
    arena.close()


@pytest.mark.parametrize("bad", [0, 1000, 8192, 4096.0, True, "64k", None])
def test_bad_page_size_is_a_typed_error(bad):
    with pytest.raises(EngineConfigError, match="page_size"):
        VirtualArena(MiB, bad)
    with pytest.raises(EngineConfigError, match="page_size"):
        pagedkv.engine.EngineConfig(kv_layout="virtual", page_size=bad)


def test_arena_refuses_ranges_that_are_not_whole_pages():
    # A pagedkv error that is also the builtin ValueError (it was a bare ValueError).
    arena = VirtualArena(MiB, 65536)
    with pytest.raises(pagedkv.errors.InvalidArgumentError, match="whole pages"):
        arena.commit(4096, 65536)
    with pytest.raises(pagedkv.errors.InvalidArgumentError, match="whole pages"):
        arena.commit(0, 2 * MiB)
    with pytest.raises(pagedkv.errors.InvalidArgumentError, match="whole pages"):
        arena.release(-65536, 65536)
    assert isinstance(pytest.raises(ValueError, arena.commit, 1, 65536).value, pagedkv.PagedKVError)
    assert (arena.committed_bytes, arena.commits, arena.releases) == (0, 0, 0)
    arena.close()


def test_shared_pages_are_one_physical_copy_and_private_mappings_copy_on_write():
    pages = SharedPages(4, 65536)
    m1, a = pages.map(0, 2)
    m2, b = pages.map(0, 2)
    m3, c = pages.map(0, 2, copy_on_write=True)
    a[:100] = 9
    assert int(b[99]) == 9 and int(c[99]) == 9  # one physical page seen through three mappings
    assert pages.resident_bytes() == OS_PAGE  # only the page written is backed, once
    c[0] = 1  # copy-on-write: the private mapping's OS page is copied, the shared one unchanged
    assert int(a[0]) == 9 and int(c[0]) == 1
    del a, b, c
    for m in (m1, m2, m3):
        m.close()
    pages.close()


# ---- the layout's accounting -------------------------------------------------------------------


def _layout(budget_pages: int, page: int = 4096, **kw) -> VirtualKVLayout:
    # 2 layers x 2 KV heads x 16 dims fp32: 128 bytes per token per segment, 32 tokens a 4 KiB page
    return VirtualKVLayout(
        num_layers=2,
        num_kv_heads=2,
        head_size=16,
        dtype=torch.float32,
        page_size=page,
        budget_bytes=budget_pages * page,
        max_seqs=kw.get("max_seqs", 4),
        max_seq_len=kw.get("max_seq_len", 256),
        device=kw.get("device"),
    )


def test_layout_commits_whole_pages_per_segment_all_or_nothing():
    lay = _layout(12)  # 12 pages = 3 pages in each of the 4 segments
    assert lay.pages_for(1) == 4 and lay.pages_for(32) == 4 and lay.pages_for(33) == 8
    assert lay.ensure(1, 33)
    assert lay.pages_held(1) == 8 and lay.num_free_pages == 4
    assert not lay.ensure(2, 33)  # needs 8, 4 free: nothing changes
    assert lay.num_free_pages == 4 and lay.pages_held(2) == 0 and lay.seq_ids() == [1]
    assert lay.ensure(2, 32)
    st = lay.stats()
    assert st.committed_bytes == 12 * 4096 and st.token_bytes == (33 + 32) * 128 * 4
    assert st.resident_bytes >= 12 * 4096
    assert lay.release(1) and not lay.release(1)  # idempotent
    assert lay.release(2)
    assert lay.stats().committed_bytes == 0 and lay.stats().resident_bytes == 0
    lay.close()


def test_layout_budget_below_one_page_per_segment_is_a_typed_error():
    with pytest.raises(EngineConfigError, match="budget_bytes"):
        _layout(3)  # 4 segments need 4 pages for one token
    with pytest.raises(EngineConfigError, match="max_seqs"):
        _layout(8, max_seqs=0)


def test_both_managers_answer_the_engines_protocol():
    # What the scheduler and the engine ask of a manager (EngineKVManager): the real
    # KVCacheManager (one group and several) and the virtual layout's manager both answer it,
    # and so do their step outputs (StepResult) and pools; mypy checks the same statically.
    lay = _layout(16)
    config = pagedkv.CacheConfig(num_blocks=64, block_size=16, enable_prefix_caching=False)
    paged, virtual = pagedkv.KVCacheManager(config), VirtualKVManager(pagedkv.KVCacheManager(config), lay)
    specs = [pagedkv.KVCacheGroupSpec("full", 16, 8), pagedkv.KVCacheGroupSpec("sliding_window", 16, 8, window=32)]
    hybrid = pagedkv.KVCacheManager(pagedkv.CacheConfig(64, groups=specs, layer_groups=[0, 1]))
    # 40 tokens: 3 blocks of 16 per group; 2 pages x 4 segments of the layout
    for m, needed, held in ((paged, (3, 0), [3]), (hybrid, (6, 0), [3, 3]), (virtual, (8, 0), [3])):
        assert isinstance(m, EngineKVManager) and isinstance(m.pool, ManagerPool)
        m.add_sequence(1, list(range(40)))
        assert m.num_blocks_needed(1, 40) == needed
        out = m.step([1], [40])
        assert isinstance(out, StepResult) and out.num_scheduled == 1 and out.error is None
        assert out.host_stores.shape == out.host_loads.shape == (0, 3)
        assert m.num_blocks_held(1) == held
    assert [g.kind for g in virtual.groups] == ["full"] and virtual.num_free_blocks == 8
    virtual.add_sequence(2, list(range(120)))  # 4 pages x 4 segments: more than the 8 free
    cut = virtual.step([2], [120])
    assert isinstance(cut, StepResult) and cut.num_scheduled == 0
    assert isinstance(cut.error, pagedkv.OutOfBlocksError) and cut.seq_lens.shape == (0,)
    virtual.free(1)
    virtual.free(2)
    assert virtual.num_free_blocks == 16
    lay.close()


def test_manager_preemption_and_free_return_pages():
    lay = _layout(16)
    inner = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=256, block_size=16, enable_prefix_caching=False))
    mgr = VirtualKVManager(inner, lay)
    for s in (1, 2, 3):
        mgr.add_sequence(s, list(range(40)))
    out = mgr.step([1, 2, 3], [40, 40, 40], [[], [], []])
    # 40 tokens hold 2 pages x 4 segments = 8 pages: two fit the 16-page budget, the third does not
    assert out.num_scheduled == 2 and isinstance(out.error, pagedkv.OutOfBlocksError)
    assert mgr.pool.num_free == 0 and mgr.num_blocks_owed([3]) == 8
    mgr.preempt([2])
    assert mgr.pool.num_free == 8 and lay.pages_held(2) == 0
    assert mgr.step([3], [40], [[]]).error is None
    mgr.free(1)
    mgr.free(3)
    assert mgr.pool.num_free == 16 and lay.stats().resident_bytes == 0
    lay.close()


# ---- the engine --------------------------------------------------------------------------------


def test_engine_config_errors_before_the_model_loads():
    for kw, match in [
        (dict(kv_layout="vaddr"), "kv_layout"),
        (dict(kv_layout="virtual", page_size=12345), "page_size"),
        (dict(kv_layout="virtual", preemption="swap"), "preemption"),
    ]:
        with pytest.raises(EngineConfigError, match=match):
            LLMEngine("/nonexistent/model", **kw)


def _prompts(n: int = 6) -> list[list[int]]:
    return [[3 + (7 * i + 5 * j) % 500 for j in range(5 + 9 * i)] for i in range(n)]


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(page_size=65536),
        dict(num_kv_blocks=13, block_size=8),  # a small budget: admissions wait, preemptions happen
        dict(max_tokens_per_step=8, block_size=4),  # chunked prefill over a context
        dict(speculative="ngram", num_speculative_tokens=3),
    ],
    ids=["4k", "64k", "small-budget", "chunked", "speculative"],
)
def test_virtual_layout_outputs_equal_paged_and_memory_goes_back(tiny, kw):
    kw = {"num_kv_blocks": 64, "block_size": 16, "page_size": 4096, **kw}
    page_size = kw.pop("page_size")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    paged = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, enable_prefix_caching=False, **kw)
    want = [list(o.token_ids) for o in paged.generate(_prompts(), params)]
    engine = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, kv_layout="virtual", page_size=page_size, **kw)
    got = [list(o.token_ids) for o in engine.generate(_prompts(), params)]
    assert got == want
    st = engine.layout.stats()
    assert st.peak_committed_bytes > 0 and st.page_faults > 0
    assert st.committed_bytes == 0 and st.sequences == 0 and engine.manager.pool.num_free == engine.layout.total_pages
    # the prefix cache holds the finished sequences' full page groups, each page once; the rest went back
    assert st.resident_bytes == st.cached_pages * page_size
    engine.manager.reset_prefix_cache()
    st = engine.layout.stats()
    assert st.resident_bytes == 0 and st.cached_pages == 0  # every page went back to the OS
    assert st.pages_committed == st.pages_released
    assert_no_leak(engine)


def test_virtual_layout_small_budget_preempts_and_returns_pages(tiny):
    # 2 layers x 2 heads x 16 dims fp32: a 4 KiB page holds 32 tokens per segment (4 segments);
    # 12 usable blocks of 8 tokens = 12 * 8 * 512 B = 12 pages: two 20-token prompts are admitted
    # (4 pages each, plus a page of headroom), and growing past 32 tokens takes 4 more each.
    engine = LLMEngine(
        tiny.hf, tokenizer=tiny.tokenizer, kv_layout="virtual", page_size=4096, num_kv_blocks=13, block_size=8
    )
    assert engine.layout.total_pages == 12
    prompts = [[3 + (7 * i + j) % 500 for j in range(20)] for i in range(4)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    assert engine.stats().preemptions > 0  # 20 + 30 tokens cross a page: someone is preempted
    assert sum(o.num_preemptions for o in outs) > 0
    st = engine.layout.stats()
    assert st.committed_bytes == 0 and st.resident_bytes == st.cached_pages * 4096  # the prefix cache's
    assert st.prefix_hit_tokens > 0  # a preempted request resumed on its own cached pages
    engine.manager.reset_prefix_cache()
    assert engine.layout.stats().resident_bytes == 0
    paged = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, num_kv_blocks=64, enable_prefix_caching=False)
    assert [o.token_ids for o in outs] == [
        o.token_ids for o in paged.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    ]


def test_virtual_layout_resumes_are_not_prefix_lookups_as_on_the_paged_layout(tiny):
    # Distinct prompts (no shared prefix) and a budget that preempts: the resumes hit their own
    # cached pages, yet both layouts report 0 hit tokens of the 80 prompt tokens queried.
    prompts = [[3 + (7 * i + j) % 500 for j in range(20)] for i in range(4)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    counters = []
    for kw in (dict(kv_layout="virtual", page_size=4096), dict()):
        engine = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, num_kv_blocks=13, block_size=8, **kw)
        engine.generate(prompts, params)
        assert engine.stats().preemptions > 0
        st, m = engine.stats(), engine.metrics()
        counters.append((st.prefix_hits_tokens, st.prefix_queries_tokens, m.prefix_hit_tokens, m.prefix_hit_rate))
    assert engine.stats().prefix_hits_tokens == 0  # the paged layout: a resume is not a lookup
    assert counters == [(0, 80, 0, 0.0), (0, 80, 0, 0.0)]


def test_virtual_layout_refuses_requests_that_never_fit_and_forks_without_sharing(tiny):
    engine = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, kv_layout="virtual", page_size=4096, num_kv_blocks=9)
    with pytest.raises(RequestTooLargeError, match="pages"):
        engine.add_request([5] * 40, SamplingParams(max_tokens=200))
    # 8 usable blocks of 16 tokens x 512 B = 16 pages; 39 tokens hold 2 pages in each of the 4
    # segments, and a 30-token prompt has no full page to share: 3 samples need 3 x 8 > 16
    assert engine.layout.total_pages == 16
    with pytest.raises(RequestTooLargeError, match="pages"):
        engine.add_request([5] * 30, SamplingParams(max_tokens=10, n=3))
    assert not engine.has_unfinished()
    (out,) = engine.generate([[5] * 30], SamplingParams(max_tokens=10, n=2, ignore_eos=True))  # 2 x 8 fits
    assert [len(c.token_ids) for c in out.outputs] == [10, 10]
    lay = _layout(16)  # no sharing (what a CUDA device gets): forks are refused
    inner = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=64, block_size=16, enable_prefix_caching=False))
    mgr = VirtualKVManager(inner, lay)
    mgr.add_sequence(1, [1, 2, 3])
    with pytest.raises(InvalidRequestError, match="does not fork"):
        mgr.fork(1, 2)
    lay.close()


@pytest.mark.slow
def test_virtual_layout_token_identical_on_smollm2(smol):
    from test_engine_smollm import MAX_NEW, PROMPTS

    ids = [list(smol.tokenizer(p)["input_ids"]) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_NEW)
    paged = LLMEngine(smol.hf, tokenizer=smol.tokenizer, num_kv_blocks=256)
    want = [list(o.token_ids) for o in paged.generate(ids, params)]
    for kw in (dict(page_size=65536), dict(page_size=4096, num_kv_blocks=17, block_size=8, max_tokens_per_step=8)):
        engine = LLMEngine(smol.hf, tokenizer=smol.tokenizer, kv_layout="virtual", **{"num_kv_blocks": 256, **kw})
        assert [list(o.token_ids) for o in engine.generate(ids, params)] == want
        st = engine.layout.stats()
        assert st.committed_bytes == 0 and st.resident_bytes == st.cached_pages * kw["page_size"]
        engine.manager.reset_prefix_cache()
        assert engine.layout.stats().resident_bytes == 0
    # Prefix caching with 768-byte tokens in 4 KiB pages: every page boundary falls inside a token,
    # so each hit ends in a page that is copied before the first private write.
    engine = LLMEngine(smol.hf, tokenizer=smol.tokenizer, kv_layout="virtual", page_size=4096, num_kv_blocks=256)
    assert [list(o.token_ids) for o in engine.generate(ids, params)] == want
    again = engine.generate(ids, params)
    assert [list(o.token_ids) for o in again] == want
    bpt = engine.layout.bytes_per_token
    assert bpt == 3 * 64 * 4
    hits = [_expected_hit(len(p), 4096, bpt) for p in ids]
    assert [o.num_cached_tokens for o in again] == hits and sum(hits) > 0
    straddling = sum(1 for h in hits if h and h * bpt % 4096)
    assert straddling > 0 and engine.layout.stats().cow_pages == engine.layout.num_segments * straddling
    forks = SamplingParams(max_tokens=8, n=2)
    paged_n2 = [[list(c.token_ids) for c in o.outputs] for o in paged.generate(ids[:3], forks)]
    assert [[list(c.token_ids) for c in o.outputs] for o in engine.generate(ids[:3], forks)] == paged_n2
    engine.manager.reset_prefix_cache()
    assert engine.layout.stats().resident_bytes == 0


def test_cuda_arena_without_a_gpu_is_a_clear_typed_error():
    from pagedkv.engine.errors import DeviceUnavailableError
    from pagedkv.engine.virtual.memory_cuda import CudaVirtualArena

    if torch.cuda.is_available():  # pragma: no cover - written on a machine without a GPU
        arena = CudaVirtualArena(64 * MiB, 2 * MiB)
        arena.commit(0, 4 * MiB)
        arena.bytes[: 4 * MiB].fill_(3)
        assert int(arena.bytes[4 * MiB - 1]) == 3 and arena.resident_bytes() == 4 * MiB
        arena.release(0, 4 * MiB)
        arena.close()
        return
    with pytest.raises(DeviceUnavailableError, match="GPU|cuda-python"):
        CudaVirtualArena(64 * MiB, 2 * MiB)
    with pytest.raises(DeviceUnavailableError):
        _layout(16, device="cuda")


def test_virtual_layout_refuses_a_host_tier_and_sliding_windows():
    from types import SimpleNamespace

    from pagedkv.engine.virtual.manager import build_virtual_manager

    full, windowed = SimpleNamespace(layer_windows=(None, None)), SimpleNamespace(layer_windows=(None, 512))
    with pytest.raises(EngineConfigError, match="host tier"):
        build_virtual_manager(full, SimpleNamespace(num_host_blocks=8), hash_seed=None, enable_events=False)
    with pytest.raises(EngineConfigError, match="sliding-window"):
        build_virtual_manager(windowed, SimpleNamespace(num_host_blocks=None), hash_seed=None, enable_events=False)


# ---- sharing: page accounting, prefix caching, forks (issue 27, item 2) ----------------------------


def test_arenas_refuse_a_double_commit_and_releasing_what_is_not_committed():
    from pagedkv.engine.virtual.memory import PageStateError

    # VirtualArena committed a page twice without noticing (its count went above the range)
    arena = VirtualArena(MiB, 65536)
    arena.commit(0, 2 * 65536)
    with pytest.raises(PageStateError, match="page 1 .*already committed"):
        arena.commit(65536, 2 * 65536)
    with pytest.raises(PageStateError, match="page 2 .*not committed"):
        arena.release(0, 4 * 65536)
    assert isinstance(PageStateError("x", arg="range", value="v", reason="r"), ValueError)
    assert (arena.committed_bytes, arena.commits, arena.releases) == (2 * 65536, 2, 0)  # nothing moved
    arena.release(0, 2 * 65536)
    arena.close()


def test_cuda_arena_checks_ranges_before_any_driver_call():
    # CudaVirtualArena passed any offset to cuMemMap; the check runs before the driver is touched,
    # so an arena without a driver (None) shows it on a machine without a GPU.
    from pagedkv.engine.virtual.memory import PageStateError, _PageLedger
    from pagedkv.engine.virtual.memory_cuda import CudaVirtualArena

    arena = CudaVirtualArena.__new__(CudaVirtualArena)
    arena._cu, arena.page_size, arena.size = None, 2 * MiB, 8 * MiB
    arena._ledger = _PageLedger(arena.size, arena.page_size)
    with pytest.raises(pagedkv.errors.InvalidArgumentError, match="whole pages"):
        arena.commit(6 * MiB, 4 * MiB)  # past the reservation
    with pytest.raises(pagedkv.errors.InvalidArgumentError, match="whole pages"):
        arena.commit(MiB, 2 * MiB)  # not page-aligned
    with pytest.raises(PageStateError, match="not committed"):
        arena.release(0, 2 * MiB)
    arena._ledger.mark(range(0, 1), True)  # as if page 0 were mapped
    with pytest.raises(PageStateError, match="already committed"):
        arena.commit(0, 2 * MiB)


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_shared_arena_maps_one_physical_page_in_two_places_and_punches_it_out_at_refcount_zero(page):
    from pagedkv.engine.virtual.memory import PageStateError, SharedArena

    arena = SharedArena(16 * page, page, num_frames=4)
    assert arena.resident_bytes() == 0
    arena.commit(0, 2 * page)
    frames = [arena.frame_at(0), arena.frame_at(page)]
    arena.map_frames(8 * page, frames)  # the same two frames, eight pages further on
    assert [arena.refcount(f) for f in frames] == [2, 2]
    assert arena.resident_bytes() == 2 * page and arena.committed_bytes == 2 * page  # once, not twice
    arena.bytes[page + 5] = 77  # write through one view ...
    assert int(arena.bytes[9 * page + 5]) == 77  # ... read through the other
    arena.bytes[8 * page] = 11
    assert int(arena.bytes[0]) == 11
    with pytest.raises(PageStateError, match="already committed"):
        arena.map_frames(page, frames[:1])
    with pytest.raises(pagedkv.OutOfBlocksError):
        arena.commit(4 * page, 3 * page)  # 2 frames free
    arena.release(0, 2 * page)  # one view gone: the frames live on in the other
    assert arena.resident_bytes() == 2 * page and int(arena.bytes[9 * page + 5]) == 77
    arena.release(8 * page, 2 * page)  # refcount 0: holes punched, memory back to the OS
    assert arena.resident_bytes() == 0 and arena.committed_bytes == 0
    assert (arena.commits, arena.releases, arena.num_free_frames) == (2, 2, 4)
    arena.commit(0, page)  # a reused frame reads zeros
    assert int(arena.bytes[:page].max()) == 0
    arena.release(0, page)
    arena.close()


def _odd_layout(budget_pages: int = 64, **kw) -> VirtualKVLayout:
    # 1 layer x 2 KV heads x 12 dims fp32: 96 bytes per token, a 4 KiB page holds 42.67 tokens,
    # so page boundaries fall inside tokens (as SmolLM2's 768-byte tokens in 4 KiB pages)
    return VirtualKVLayout(
        num_layers=1,
        num_kv_heads=2,
        head_size=12,
        dtype=torch.float32,
        page_size=4096,
        budget_bytes=budget_pages * 4096,
        max_seqs=4,
        max_seq_len=512,
        sharing=True,
        **kw,
    )


def test_prefix_hit_maps_whole_pages_and_copies_the_page_straddling_the_hit():
    lay = _odd_layout()
    bpt, page = lay.bytes_per_token, lay.page_size
    tokens = list(range(1000, 1300))
    assert lay.ensure(1, 200, start=0)
    for seg in lay.segments(1):
        seg[:200] = torch.arange(200 * 24, dtype=torch.float32).view(200, 2, 12)
    added = lay.register(1, tokens, 200, b"root")
    assert added == 200 * bpt // page == 4  # full pages of 200 tokens
    prompt = tokens[:150] + [7] * 30  # shares 150 tokens
    # page p is decided by tokens [0, ceil((p + 1) * page / bpt)): 43, 86, 128, 171 -> 3 pages match
    full_pages = sum(1 for p in range(10) if -(-(p + 1) * page // bpt) <= 150)
    want = full_pages * page // bpt
    assert (full_pages, want) == (3, 128)
    assert lay.lookup(prompt, b"other root") == (0, [])  # another salt: nothing
    assert lay.share_prefix(2, prompt, b"root") == want
    s1, s2 = lay.segments(1), lay.segments(2)
    assert torch.equal(s2[0][:want], s1[0][:want]) and torch.equal(s2[1][:want], s1[1][:want])
    arena = lay.arena
    # the same physical pages: a write through sequence 1's view shows through sequence 2's
    s1[0][5, 0, 0] = -1.0
    assert float(s2[0][5, 0, 0]) == -1.0
    s1[0][5, 0, 0] = 5 * 24.0
    # token 128 starts inside page 2 (128 * 96 = 12288 = 3 pages exactly: no straddle here);
    # a hit of 85 tokens would end inside page 1: check the straddling case on a shorter prompt
    assert lay.ensure(2, 180, start=want)
    assert lay.stats().cow_pages == 0  # page-aligned hit: nothing to copy
    lay.release(2)
    short = tokens[:100] + [9] * 20  # pages 0, 1 match: hit floor(2 * 4096 / 96) = 85 tokens
    hit = lay.share_prefix(3, short, b"root")
    assert hit == 2 * page // bpt == 85
    before = [arena.frame_at(lay._offset(lay._slot[3], 0, p)) for p in (0, 1)]
    assert before == [arena.frame_at(lay._offset(lay._slot[1], 0, p)) for p in (0, 1)]
    assert lay.ensure(3, 120, start=hit)  # token 85 is written into page 1: copied first
    after = [arena.frame_at(lay._offset(lay._slot[3], 0, p)) for p in (0, 1)]
    assert after[0] == before[0] and after[1] != before[1]  # page 0 still shared, page 1 private
    assert lay.stats().cow_pages == lay.num_segments
    s3 = lay.segments(3)
    assert torch.equal(s3[0][:hit], s1[0][:hit]) and torch.equal(s3[1][:hit], s1[1][:hit])  # the copy holds the prefix
    s3[0][85:120] = 0.5  # the private writes leave the cached page alone
    assert torch.equal(s1[0][85:86], torch.full((1, 2, 12), 85 * 24.0) + torch.arange(24.0).view(1, 2, 12))
    for s in (1, 3):
        lay.release(s)
    st = lay.stats()
    assert st.committed_bytes == 0 and st.resident_bytes == st.cached_pages * page == 4 * lay.num_segments * page
    lay.reset_cache()
    assert lay.stats().resident_bytes == 0
    lay.close()


def test_manager_counts_a_recompute_resume_as_no_new_prefix_lookup():
    # A 100-token prompt decodes to 110 tokens, is preempted (recompute) and resumes on its own
    # cached pages: the resume maps them again, but the hit-rate counters count each sequence's
    # first lookup only, as the paged manager's CacheStats do (before: 85 hits of 210 queried).
    lay = _odd_layout()
    inner = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=256, block_size=16, enable_prefix_caching=False))
    mgr = VirtualKVManager(inner, lay, prefix_caching=True)
    prompt = list(range(1000, 1100))
    mgr.add_sequence(1, prompt)
    assert mgr.lookup_prefix(1) == 0
    assert mgr.step([1], [100], [[2000]]).error is None
    for t in range(2001, 2010):
        assert mgr.step([1], [1], [[t]]).error is None
    assert inner.num_tokens(1) == 110
    mgr.preempt([1])
    hit = mgr.lookup_prefix(1)
    assert hit == 2 * lay.page_size // lay.bytes_per_token == 85  # the resume maps its own pages
    assert mgr.step([1], [110 - hit], [[]]).num_cached_tokens[0] == hit
    st = mgr.stats()
    assert (st.prefix_hits_tokens, st.prefix_queries_tokens, st.prefix_hit_rate) == (0, 100, 0.0)
    assert lay.stats().prefix_hit_tokens == 85  # the layout's own count: every mapped hit
    # a new request with the same prompt is a first lookup: it counts, hit and query
    mgr.add_sequence(2, prompt)
    assert mgr.lookup_prefix(2) == 85
    st = mgr.stats()
    assert (st.prefix_hits_tokens, st.prefix_queries_tokens) == (85, 200)
    # a fork of it (n > 1, beams) is no new request either: its resume is not counted
    assert mgr.step([2], [100 - 85], [[3000]]).error is None
    mgr.fork(2, 3)
    mgr.preempt([3])
    assert mgr.lookup_prefix(3) == 85
    st = mgr.stats()
    assert (st.prefix_hits_tokens, st.prefix_queries_tokens) == (85, 200)
    for s in (1, 2, 3):
        mgr.free(s)
    lay.reset_cache()
    assert lay.stats().resident_bytes == 0
    lay.close()


def test_fork_shares_the_prompt_pages_and_each_copies_the_page_it_diverges_in():
    lay = _odd_layout()
    page = lay.page_size
    assert lay.ensure(1, 100, start=0)  # 100 tokens: pages 0, 1 full, page 2 partly (9600 bytes)
    lay.segments(1)[0][:100] = 1.0
    assert lay.fork(1, 2, 100) == 3
    assert lay.stats().resident_bytes == 3 * lay.num_segments * page  # shared, once
    assert lay.num_free_pages == 64 - 3 * lay.num_segments
    assert lay.ensure(1, 101, start=100)  # the parent writes token 100 into page 2: copy-on-write
    assert lay.ensure(2, 101, start=100)  # the child is the last holder: writes in place
    assert lay.stats().cow_pages == lay.num_segments
    assert lay.stats().resident_bytes == 4 * lay.num_segments * page
    lay.segments(1)[0][100] = 3.0
    lay.segments(2)[0][100] = 4.0
    assert float(lay.segments(2)[0][100, 0, 0]) == 4.0 and float(lay.segments(1)[0][99, 0, 0]) == 1.0
    assert float(lay.segments(2)[0][99, 0, 0]) == 1.0
    lay.release(1)
    assert lay.stats().resident_bytes == 3 * lay.num_segments * page  # the child keeps the shared ones
    lay.release(2)
    assert lay.stats().resident_bytes == 0 and lay.num_free_pages == 64
    lay.close()


def test_cached_pages_are_evicted_when_the_budget_needs_them():
    lay = _odd_layout(budget_pages=8)  # 4 page groups (K and V)
    tokens = list(range(400))
    assert lay.ensure(1, 170, start=0)
    lay.register(1, tokens, 170, b"r")
    lay.release(1)
    assert lay.stats().cached_pages == 2 * 3 and lay.num_free_pages == 8  # cached but evictable
    assert lay.ensure(2, 170, start=0)  # 4 pages x 2 segments: all 8 frames: the cache is evicted
    assert lay.stats().cached_pages == 0
    lay.release(2)
    lay.close()


def _repeat_prompts() -> list[list[int]]:
    return [[3 + (11 * i + 7 * j) % 500 for j in range(n)] for i, n in enumerate((40, 70, 100, 33))]


def _expected_hit(n: int, page: int, bytes_per_token: int) -> int:
    """Tokens a repeated n-token prompt skips: the pages decided by prompt tokens only
    (ceil((p + 1) * page / bytes_per_token) <= n), as whole tokens, at most n - 1."""
    full = sum(1 for p in range(n) if -(-(p + 1) * page // bytes_per_token) <= n)
    return min(full * page // bytes_per_token, n - 1)


@pytest.mark.parametrize("page_size", [4096, 65536])
def test_prefix_caching_repeated_prompts_equal_paged_and_hit_the_page_aligned_prefix(tiny, page_size):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = _repeat_prompts()
    paged = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, num_kv_blocks=64, block_size=16)
    want = [list(o.token_ids) for o in paged.generate(prompts, params)]
    assert [list(o.token_ids) for o in paged.generate(prompts, params)] == want
    engine = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, kv_layout="virtual", page_size=page_size, num_kv_blocks=64)
    first = engine.generate(prompts, params)
    assert [list(o.token_ids) for o in first] == want
    assert all(o.num_cached_tokens == 0 for o in first)
    second = engine.generate(prompts, params)
    assert [list(o.token_ids) for o in second] == want
    bpt = engine.layout.bytes_per_token
    assert bpt == 128  # 2 KV heads x 16 dims x fp32
    hits = [_expected_hit(len(p), page_size, bpt) for p in prompts]
    assert hits == ([32, 64, 96, 32] if page_size == 4096 else [0, 0, 0, 0])  # 64 KiB = 512 tokens a page
    assert [o.num_cached_tokens for o in second] == hits
    st = engine.layout.stats()
    assert st.prefix_hit_tokens == sum(hits) == engine.metrics().prefix_hit_tokens  # the engine's metrics count them
    assert engine.metrics().prefix_hit_rate == pytest.approx(sum(hits) / (2 * sum(map(len, prompts))))
    assert st.shared_pages == engine.layout.num_segments * sum(-(-h * bpt // page_size) for h in hits)
    assert st.committed_bytes == 0 and st.resident_bytes == st.cached_pages * page_size
    engine.manager.reset_prefix_cache()
    assert engine.layout.stats().resident_bytes == 0
    assert_no_leak(engine)


@pytest.mark.parametrize("caching", [True, False])
def test_forks_share_the_prompt_pages_and_equal_paged(tiny, caching):
    prompts = _repeat_prompts()
    params = SamplingParams(max_tokens=10, n=3, temperature=0.8, seed=7, ignore_eos=True)
    paged = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, num_kv_blocks=128, enable_prefix_caching=caching)
    want = [[list(c.token_ids) for c in o.outputs] for o in paged.generate(prompts, params)]
    assert any(len({tuple(c) for c in w}) > 1 for w in want)  # the samples diverge
    engine = LLMEngine(
        tiny.hf,
        tokenizer=tiny.tokenizer,
        kv_layout="virtual",
        page_size=4096,
        num_kv_blocks=128,
        enable_prefix_caching=caching,
    )
    got = [[list(c.token_ids) for c in o.outputs] for o in engine.generate(prompts, params)]
    assert got == want
    st = engine.layout.stats()
    bpt, nseg = engine.layout.bytes_per_token, engine.layout.num_segments
    # each of the 2 children maps every page holding a prompt token
    assert st.shared_pages == nseg * 2 * sum(-(-len(p) * bpt // 4096) for p in prompts)
    # the prompts' last pages are partial (40, 70, 100, 33 tokens of 32 a page): each diverging
    # write into one copies it, 2 of the 3 holders copy, the last writes in place
    assert st.cow_pages == nseg * 2 * len(prompts)
    assert st.committed_bytes == 0 and st.resident_bytes == st.cached_pages * 4096
    if not caching:
        assert st.cached_pages == 0 and st.resident_bytes == 0
    assert_no_leak(engine)


def test_beam_search_on_the_virtual_layout_equals_paged(tiny):
    prompts = _repeat_prompts()[:2]
    params = SamplingParams(max_tokens=8, beam_width=3, n=2)
    paged = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, num_kv_blocks=128)
    want = [[list(c.token_ids) for c in o.outputs] for o in paged.generate(prompts, params)]
    engine = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, kv_layout="virtual", page_size=4096, num_kv_blocks=128)
    assert [[list(c.token_ids) for c in o.outputs] for o in engine.generate(prompts, params)] == want
    assert engine.layout.stats().shared_pages > 0 and engine.layout.stats().committed_bytes == 0
    assert_no_leak(engine)


def test_cli_virtual_layout_reports_prefix_caching_and_its_hits(tiny, tmp_path, capsys):
    import json

    from pagedkv.engine.cli import main

    words = " ".join(f"w{10 + i % 7}" for i in range(60))
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": f"r{i}", "prompt": words}) + "\n" for i in range(2)))
    out = tmp_path / "r.jsonl"
    args = ["--model", str(tiny.path), "--prompts", str(f), "--no-chat-template", "--max-tokens", "4"]
    rc = main([*args, "--kv-layout", "virtual", "--page-size", "4096", "--max-num-seqs", "1", "--no-progress"]
              + ["--output", str(out)])  # fmt: skip
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    shown = capsys.readouterr().out
    assert "prefix caching" in shown and "/ on" in shown
    hit = rows[1]["cached_prompt_tokens"]  # the second waits for the first (one sequence at a time)
    assert hit > 0 and hit % 32 == 0  # whole 4 KiB pages of 128-byte tokens
    flat = " ".join(shown.replace("│", " ").split())
    assert f"{hit} prefix-hit tokens" in flat, flat
