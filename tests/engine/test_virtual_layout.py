"""The virtual KV layout (``kv_layout="virtual"``, vAttention-style): reserved virtual memory
with pages committed on demand and returned to the OS, the page accounting the scheduler sees,
and token-identical outputs to the paged layout on the engine's prompts."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_no_leak

import pagedkv
from pagedkv.engine import LLMEngine, SamplingParams
from pagedkv.engine.errors import EngineConfigError, InvalidRequestError, RequestTooLargeError
from pagedkv.engine.virtual_layout import VirtualKVLayout
from pagedkv.engine.virtual_manager import VirtualKVManager
from pagedkv.engine.virtual_memory import OS_PAGE, PAGE_SIZES, SharedPages, VirtualArena, minor_faults

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
    assert st.resident_bytes == 0  # every page went back to the OS
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
    assert engine.layout.stats().committed_bytes == 0 and engine.layout.stats().resident_bytes == 0
    paged = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, num_kv_blocks=64, enable_prefix_caching=False)
    assert [o.token_ids for o in outs] == [
        o.token_ids for o in paged.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    ]


def test_virtual_layout_refuses_forks_and_requests_that_never_fit(tiny):
    engine = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, kv_layout="virtual", page_size=4096, num_kv_blocks=9)
    with pytest.raises(InvalidRequestError, match="forks"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, n=2))
    with pytest.raises(RequestTooLargeError, match="pages"):
        engine.add_request([5] * 40, SamplingParams(max_tokens=200))
    assert not engine.has_unfinished()


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
        assert engine.layout.stats().resident_bytes == 0


def test_cuda_arena_without_a_gpu_is_a_clear_typed_error():
    from pagedkv.engine.errors import DeviceUnavailableError
    from pagedkv.engine.virtual_memory_cuda import CudaVirtualArena

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

    from pagedkv.engine.virtual_manager import build_virtual_manager

    full, windowed = SimpleNamespace(layer_windows=(None, None)), SimpleNamespace(layer_windows=(None, 512))
    with pytest.raises(EngineConfigError, match="host tier"):
        build_virtual_manager(full, SimpleNamespace(num_host_blocks=8), hash_seed=None, enable_events=False)
    with pytest.raises(EngineConfigError, match="sliding-window"):
        build_virtual_manager(windowed, SimpleNamespace(num_host_blocks=None), hash_seed=None, enable_events=False)
