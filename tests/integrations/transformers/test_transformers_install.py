"""Installing and uninstalling pagedkv in transformers' continuous batching: the version policy,
refused inputs (typed errors naming them, nothing patched), the stock objects back after
uninstall, and the index arithmetic of pagedkv blocks in transformers' cache tensor."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import transformers
from helpers.transformers_cb import generate_batch
from transformers.generation.continuous_batching import cache as cache_module
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache_allocators import (
    FullAttentionCacheAllocator,
    SlidingAttentionCacheAllocator,
)

from pagedkv.errors import InvalidArgumentError, InvalidConfigError, PagedKVError
from pagedkv.integrations.transformers import (
    SUPPORTED_TRANSFORMERS_RELEASES,
    AlreadyInstalledError,
    CacheTooSmallError,
    Installation,
    PagedKVAttentionCache,
    PagedKVFullAttentionAllocator,
    UnsupportedAttentionTypeError,
    UnsupportedTransformersConfigError,
    UnsupportedTransformersVersionError,
    check_supported_version,
    install,
    is_installed,
    uninstall,
    use_pagedkv,
)
from pagedkv.integrations.transformers.geometry import SECTOR_OF_BLOCK, GroupGeometry

STOCK_CACHE = continuous_api.PagedAttentionCache


def assert_stock() -> None:
    """transformers' own classes everywhere the install patches."""
    assert not is_installed()
    assert cache_module.ATTN_TYPE_TO_ALLOCATOR["full_attention"] is FullAttentionCacheAllocator
    assert cache_module.ATTN_TYPE_TO_ALLOCATOR["sliding_attention"] is SlidingAttentionCacheAllocator
    assert continuous_api.PagedAttentionCache is STOCK_CACHE is cache_module.PagedAttentionCache


def test_supported_releases_and_refused_ones():
    assert transformers.__version__.startswith(SUPPORTED_TRANSFORMERS_RELEASES)
    assert check_supported_version("5.24.0") == "5.24"
    assert check_supported_version("5.24.3.dev0") == "5.24"
    for version in ("5.23.1", "5.25.0", "4.57.1", "dev"):
        with pytest.raises(UnsupportedTransformersVersionError) as e:
            check_supported_version(version)
        assert e.value.value == version and e.value.supported == SUPPORTED_TRANSFORMERS_RELEASES
        assert f"transformers {version} is not supported" in str(e.value)
        assert isinstance(e.value, ValueError) and isinstance(e.value, InvalidConfigError)


def test_install_under_an_unsupported_release_patches_nothing(monkeypatch):
    # By dotted name: transformers may have put a new module object in sys.modules since this
    # file imported it (it does during continuous batching), and install() reads that one.
    monkeypatch.setattr("transformers.__version__", "5.25.0")
    with pytest.raises(UnsupportedTransformersVersionError, match="5.25.0"):
        install()
    assert_stock()


def test_unserved_attention_type_refused_by_name_before_any_patch():
    model = SimpleNamespace(
        config=SimpleNamespace(
            get_text_config=lambda: SimpleNamespace(layer_types=["full_attention", "chunked_attention"])
        )
    )
    with pytest.raises(UnsupportedAttentionTypeError) as e:
        install(model)
    assert e.value.value == "chunked_attention" and "'chunked_attention'" in str(e.value)
    assert_stock()


@pytest.mark.parametrize(
    "model",
    [
        "HuggingFaceTB/SmolLM2-135M",
        SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: SimpleNamespace(layer_types=None))),
    ],
    ids=["a-name", "no-cb-manager"],
)
def test_install_refuses_what_is_not_a_model_before_any_patch(model):
    with pytest.raises(InvalidArgumentError) as e, use_pagedkv(model):
        pass
    assert e.value.arg == "model" and e.value.value == type(model).__name__
    assert "needs a transformers model" in str(e.value) and isinstance(e.value, ValueError)
    assert_stock()


def test_install_uninstall_and_the_context_manager():
    kv = install()
    try:
        assert is_installed()
        assert cache_module.ATTN_TYPE_TO_ALLOCATOR["full_attention"] is PagedKVFullAttentionAllocator
        assert continuous_api.PagedAttentionCache is PagedKVAttentionCache
        with pytest.raises(AlreadyInstalledError):
            install()
        assert is_installed()
        with pytest.raises(LookupError):
            kv.manager  # noqa: B018  (no cache built yet)
    finally:
        uninstall()
    assert_stock()
    uninstall()  # a no-op when not installed
    with pytest.raises(RuntimeError, match="body"), use_pagedkv() as handle:
        assert isinstance(handle, Installation) and is_installed()
        raise RuntimeError("body")
    assert_stock()


@pytest.mark.parametrize(
    ("setting", "value"), [("cpu_offload_space", 1.0), ("use_async_batching", True)], ids=["offload", "async"]
)
def test_unserved_batching_settings_refused_when_the_cache_is_built(tiny_llama, setting, value):
    prompts = [tiny_llama.tokenizer("w10 w11 w12")["input_ids"]]
    with pytest.raises(UnsupportedTransformersConfigError) as e:
        generate_batch(tiny_llama.hf, prompts, pagedkv=True, num_blocks=32, **{setting: value})
    assert e.value.field == setting and setting in str(e.value)
    assert_stock()
    assert generate_batch(tiny_llama.hf, prompts, pagedkv=False, num_blocks=32).tokens["req_0"]


def test_error_classes():
    err = CacheTooSmallError("m", request_id="r", num_tokens=40, requested=10, num_blocks=5)
    assert isinstance(err, PagedKVError) and isinstance(err, MemoryError)
    assert (err.request_id, err.requested, err.num_blocks) == ("r", 10, 5)


def _reference_rows(geom: GroupGeometry, table: list[int], start: int, stop: int) -> list[int]:
    """Token by token: pagedkv block -> its sector -> the group's transformers block -> row."""
    rows = []
    for p in range(start, stop):
        block = table[p // geom.block_size]
        within = p % geom.block_size
        sector = block + SECTOR_OF_BLOCK
        tblock = sector * geom.blocks_per_sector + within // geom.page_size
        rows.append(tblock * geom.row_stride + within % geom.page_size)
    return rows


@pytest.mark.parametrize("bps", [1, 5])
def test_rows_and_page_tables_follow_the_sector_layout(bps):
    rng = np.random.default_rng(bps)
    geom = GroupGeometry("full_attention", page_size=4, blocks_per_sector=bps, row_stride=2 * 4 * 3, window=None)
    table = rng.permutation(np.arange(1, 40, dtype=np.int32))[:9]
    n = len(table) * geom.block_size
    for start, stop in [(0, n), (3, 17), (n - 5, n), (7, 8)]:
        assert geom.rows(table, start, stop).tolist() == _reference_rows(geom, table.tolist(), start, stop)
    pages = geom.page_table(table, 23, pages_stride=6)
    want = [((table[j // bps] + SECTOR_OF_BLOCK) * bps + j % bps) * 6 for j in range(-(-23 // 4))]
    assert pages.tolist() == want
    assert not geom.reads_released(table, 0, n) and geom.reads_released(table, 0, n + 1)


def test_sliding_window_reads_start_inside_the_window():
    geom = GroupGeometry("sliding_attention", page_size=4, blocks_per_sector=1, row_stride=2 * 4 * 3, window=8)
    assert [geom.first_read(p) for p in (0, 5, 7, 8, 20)] == [0, 0, 0, 1, 13]
    table = np.array([0, 0, 0, 7, 9, 11], dtype=np.int32)  # blocks before the window released
    assert geom.reads_released(table, 11, 24) and not geom.reads_released(table, 12, 24)
    assert geom.rows(table, 13, 24).tolist() == _reference_rows(geom, table.tolist(), 13, 24)


def test_cache_calls_answered_from_pagedkv(tiny_llama):
    """The cache transformers builds under pagedkv, driven call by call as its scheduler does:
    the kernel block table (decode fast path) names the same rows as the read indices, a request
    larger than the cache raises CacheTooSmallError and leaves nothing behind, frees empty it."""
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.requests import RequestState

    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=4, num_blocks=16, max_batch_tokens=64)
    with use_pagedkv(tiny_llama.hf) as kv:
        manager = tiny_llama.hf.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        try:
            manager.warmup()  # builds the cache; no generation thread
            cache = manager.batch_processor.cache
            assert isinstance(cache, PagedKVAttentionCache) and kv.manager is cache.manager
            (allocator,) = cache.cache_allocators.values()
            state = RequestState(request_id="a", initial_tokens=list(range(3, 40)))
            assert cache.can_store_request_tokens(state, 37)
            rows = allocator.get_read_indices("a", 0, 37)
            assert allocator.get_write_indices("a", 30, 7) == rows[30:]
            table = torch.full((12,), -1, dtype=torch.int32)
            allocator.fill_block_table("a", 0, 37, table)
            pages = table[table >= 0].to(torch.int64)
            ps = allocator.tokens_per_page
            assert ((pages[:, None] * ps + torch.arange(ps)).ravel()[:37]).tolist() == rows
            usable = cache.manager.num_blocks - 1
            big = RequestState(request_id="b", initial_tokens=[5] * (usable * ps + 1))
            held = kv.stats().used
            # "a" holds blocks: "b" waits (transformers' loop would fail "a" with it)
            assert not cache.can_store_request_tokens(big, len(big.initial_tokens))
            assert kv.stats().used == held and cache.manager.num_sequences == 2
            cache.free_blocks("a")
            with pytest.raises(CacheTooSmallError) as e:
                cache.can_store_request_tokens(big, len(big.initial_tokens))
            assert e.value.request_id == "b" and e.value.num_blocks == usable
            assert kv.stats().used == 0 and cache.manager.num_sequences == 0
        finally:
            manager.stop(block=True)
