"""Regression scenarios (docs/design.md, "Regression scenarios") on what the engine gained:
S1, S2, S4 and S7 on the virtual KV layout's page sharing (``VirtualKVLayout(sharing=True)``:
a refused write into a shared page, an evicted page group's key, release twice, copy-on-write
at page granularity after a fork), and S5 / S6 / S9 on a hybrid model with the host tier (swap
preemption with the KV back block for block; no preemption thrash; host blocks are no device
capacity)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.virtual.layout import VirtualKVLayout

PAGE = 4096
#: 1 layer x 2 KV heads x 12 dims fp32: 96 bytes per token, so page boundaries fall inside
#: tokens unless the token count is a multiple of 128 (3 pages).
BYTES_PER_TOKEN = 96


def _layout(budget_pages: int = 64) -> VirtualKVLayout:
    return VirtualKVLayout(
        num_layers=1,
        num_kv_heads=2,
        head_size=12,
        dtype=torch.float32,
        page_size=PAGE,
        budget_bytes=budget_pages * PAGE,
        max_seqs=4,
        max_seq_len=512,
        sharing=True,
    )


@pytest.mark.parametrize("write_child", [False, True])
@pytest.mark.parametrize("alen", [1, 16, 129])
@pytest.mark.parametrize("plen", [1, 16, 128, 129])
def test_s7_fork_copies_one_page_per_segment_iff_the_fork_point_is_inside_a_page(
    plen: int, alen: int, write_child: bool
) -> None:
    lay = _layout()
    segs = lay.num_segments
    assert lay.ensure(1, plen, start=0)
    for s, seg in enumerate(lay.segments(1)):
        seg[:plen] = torch.arange(plen, dtype=torch.float32).view(-1, 1, 1) + 1000 * s
    want = [seg[:plen].clone() for seg in lay.segments(1)]
    pages = -(-plen * BYTES_PER_TOKEN // PAGE)
    assert lay.fork(1, 2, plen) == pages
    assert lay.num_free_pages == 64 - segs * pages  # shared, once
    writer, other = (2, 1) if write_child else (1, 2)
    assert lay.ensure(writer, plen + alen, start=plen)
    for seg in lay.segments(writer):
        seg[plen : plen + alen] = -1.0
    straddles = plen * BYTES_PER_TOKEN % PAGE != 0
    assert lay.stats().cow_pages == segs * straddles
    grown = -(-(plen + alen) * BYTES_PER_TOKEN // PAGE) - pages
    assert lay.num_free_pages == 64 - segs * (pages + grown + straddles)
    # Neither side's prompt changed; the other side never sees the writer's tokens.
    for s in range(segs):
        assert torch.equal(lay.segments(other)[s][:plen], want[s])
        assert torch.equal(lay.segments(writer)[s][:plen], want[s])
        # The rest of the other side's straddling page (positions past its committed pages
        # must not be read) kept its zeros.
        end = min(plen + alen, pages * PAGE // BYTES_PER_TOKEN)
        assert not bool((lay.segments(other)[s][plen:end] == -1.0).any())
    assert lay.release(1) and lay.release(2)
    assert lay.stats().resident_bytes == 0 and lay.num_free_pages == 64
    lay.close()


def test_s4_release_twice_or_unknown_changes_nothing() -> None:
    lay = _layout()
    assert lay.ensure(1, 100, start=0)
    assert lay.fork(1, 2, 100) == 3
    assert lay.release(1)
    held = (lay.num_free_pages, lay.stats().resident_bytes, lay.seq_ids())
    assert held[0] == 64 - 3 * lay.num_segments  # the child keeps the shared pages
    assert not lay.release(1)
    assert not lay.release(42)
    assert (lay.num_free_pages, lay.stats().resident_bytes, lay.seq_ids()) == held
    assert lay.release(2)
    assert not lay.release(2)
    assert lay.stats().resident_bytes == 0 and lay.num_free_pages == 64
    lay.close()


def test_s1_a_refused_write_into_a_shared_page_changes_nothing() -> None:
    """S1 on the virtual layout: the copy-on-write page counts in the capacity check. 8 pages
    (4 per segment); a 100-token parent (3 pages per segment) forked: 2 pages free. The parent
    writing tokens 100..130 needs its shared page 2 copied (2 pages) and page 3 (2 more):
    refused with every page, mapping and byte as before; the child's one-token write (the copy
    alone) fits exactly."""
    lay = _layout(budget_pages=8)
    segs = lay.num_segments
    assert segs == 2
    assert lay.ensure(1, 100, start=0)
    for seg in lay.segments(1):
        seg[:100] = 7.0
    assert lay.fork(1, 2, 100) == 3
    assert lay.num_free_pages == 2

    def state() -> tuple[object, ...]:
        st = lay.stats()
        data = tuple(bool((seg[:100] == 7.0).all()) for q in (1, 2) for seg in lay.segments(q))
        return (lay.num_free_pages, st.cow_pages, st.resident_bytes, lay.pages_held(1), lay.pages_held(2), data)

    before = state()
    assert not lay.can_hold(1, 131, start=100)
    assert not lay.ensure(1, 131, start=100)
    assert state() == before
    assert lay.ensure(2, 101, start=100)  # the copy alone: 2 pages
    assert (lay.num_free_pages, lay.stats().cow_pages) == (0, segs)
    # The parent's page 2 is its own now; growing still needs 2 pages: refused, unchanged.
    before = state()
    assert not lay.ensure(1, 131, start=100)
    assert state() == before
    assert lay.release(2)
    assert lay.ensure(1, 131, start=100)
    assert lay.stats().cow_pages == segs
    assert lay.release(1) and lay.num_free_pages == 8
    lay.close()


def test_s2_an_evicted_page_group_is_never_matched_by_its_old_key() -> None:
    """S2 on the virtual layout's prefix cache: 8 pages. A (170 tokens, 4 pages per segment)
    caches its 3 full page groups and is released; B (85 tokens, 2 pages per segment) needs 4
    frames of which 2 are free: the deepest cached group (A's page 2) is evicted and its frames
    reused for B. A's prompt then hits only pages 0 and 1 (85 whole tokens), mapped with A's
    bytes, never B's."""
    lay = _layout(budget_pages=8)
    tokens = list(range(3, 400))
    assert lay.ensure(1, 170, start=0)
    for s, seg in enumerate(lay.segments(1)):
        seg[:170] = torch.arange(170, dtype=torch.float32).view(-1, 1, 1) + 1000 * s
    assert lay.register(1, tokens, 170, b"r") == 3
    assert lay.lookup(tokens[:171], b"r")[0] == 3 * PAGE // BYTES_PER_TOKEN  # 128
    assert lay.release(1)
    assert (lay.stats().cached_pages, lay.num_free_pages) == (6, 8)
    assert lay.ensure(2, 85, start=0)
    for seg in lay.segments(2):
        seg[:85] = -5.0
    assert lay.stats().cached_pages == 4
    hit, keys = lay.lookup(tokens[:171], b"r")
    assert (hit, len(keys)) == (2 * PAGE // BYTES_PER_TOKEN, 2)  # 85 tokens, pages 0 and 1
    assert lay.release(2)
    assert lay.share_prefix(3, tokens[:171], b"r") == 85
    for s, seg in enumerate(lay.segments(3)):
        want = torch.arange(85, dtype=torch.float32).view(-1, 1, 1) + 1000 * s
        assert torch.equal(seg[:85], want.expand_as(seg[:85]))
    assert lay.release(3)
    lay.close()


# ---- S5 on a hybrid model with the host tier ---------------------------------------------------


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from helpers.engine import tiny_gemma3

    return tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-scenarios"))


def _waves(vocab: int) -> list[list[list[int]]]:
    """Three waves of four concurrent prompts: the first and last share a 24-token prefix per
    prompt (so the last hits what the middle wave's prompts pushed out to the host)."""
    g = torch.Generator().manual_seed(11)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    prefixes = [rand(24) for _ in range(4)]
    first = [p + rand(6) for p in prefixes]
    middle = [rand(30) for _ in range(4)]
    last = [p + rand(5) for p in prefixes]
    return [first, middle, last]


@pytest.mark.parametrize("host_eviction", ["lru", "arc"])
def test_s5_swap_preemption_with_host_tier_on_a_hybrid_model_equals_the_unpreempted_run(gemma, host_eviction):
    """Tiny Gemma 3 (window 8 and full attention, one block table per group): four concurrent
    requests per wave on a pool that forces swap preemption, with a host tier the last wave
    hits: every answer equals the run on a pool large enough for everything, without a host
    tier."""
    from helpers.engine import assert_no_leak

    from pagedkv.engine import LLMEngine, SamplingParams
    from pagedkv.engine import runner as runner_module
    from pagedkv.engine.runner import ModelRunner

    vocab = gemma.hf.config.vocab_size
    params = SamplingParams(max_tokens=24)

    def run(**kw):
        eng = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, block_size=4, max_tokens_per_step=16, **kw)
        outs = [[list(o.token_ids) for o in eng.generate(w, params)] for w in _waves(vocab)]
        return outs, eng

    want, ref = run(num_kv_blocks=512)
    assert ref.stats().preemptions == 0
    # Block for block: a swap-out copies the victim's KV as it was, a swap-in brings it back
    # (the tiny model's greedy tokens alone may not notice a wrong block).
    saved: dict[int, torch.Tensor] = {}
    checked: list[int] = []
    runners: list[ModelRunner] = []
    plans, copy = ModelRunner.apply_block_plans, runner_module.kernels.swap_blocks

    def note_runner(runner, bt):
        runners[:] = [runner]
        plans(runner, bt)

    def checked_copy(src, dst, part):
        r = runners[0]
        rows = part.tolist()
        out = src is r.kv_cache and dst is r.cpu_cache
        before = {gpu: src[:, :, gpu].clone() for gpu, _ in rows} if out else {}
        event = copy(src, dst, part)
        for gpu, cpu in rows if out else []:
            assert torch.equal(dst[:, :, cpu], before[gpu])
            saved[cpu] = before[gpu]
        if src is r.cpu_cache and dst is r.kv_cache:
            for cpu, gpu in rows:
                assert torch.equal(dst[:, :, gpu], saved[cpu]), (cpu, gpu)
                checked.append(gpu)
        return event

    ModelRunner.apply_block_plans = note_runner  # type: ignore[method-assign]
    runner_module.kernels.swap_blocks = checked_copy
    try:
        got, eng = run(
            num_kv_blocks=64,
            preemption="swap",
            num_host_blocks=2048,
            host_admission_min_seen=1,
            host_eviction=host_eviction,
        )
    finally:
        ModelRunner.apply_block_plans = plans  # type: ignore[method-assign]
        runner_module.kernels.swap_blocks = copy
    st = eng.stats()
    assert len(checked) == st.swaps_in_blocks > 0
    assert st.preemptions > 0 and st.swaps_in_blocks > 0, st
    assert st.host_loads_blocks > 0 and st.host_hits_tokens > 0, st
    assert got == want
    assert st.cpu_used == 0
    assert_no_leak(eng)
    eng.manager.check_invariants()


# ---- S6 on a hybrid model with the host tier ---------------------------------------------------


def test_s6_hybrid_model_with_host_tier_long_prompt_is_not_preempted_repeatedly(gemma):
    """Tiny Gemma 3 with a host tier: a 100-token prompt behind two growing requests on a
    60-block pool, 8 tokens per step. The resume waits until its whole remaining prefill fits,
    so the long prompt is preempted once; admitting on the first chunk alone preempts it again
    and again. Answers equal a pool large enough for everything."""
    import dataclasses

    from helpers.engine import assert_no_leak

    from pagedkv.engine import LLMEngine, SamplingParams

    vocab = gemma.hf.config.vocab_size
    g = torch.Generator().manual_seed(5)
    long_prompt = torch.randint(3, vocab, (100,), generator=g).tolist()
    a, b = [torch.randint(3, vocab, (4,), generator=g).tolist() for _ in range(2)]
    params = [SamplingParams(max_tokens=60), SamplingParams(max_tokens=60), SamplingParams(max_tokens=20)]

    def run(reserve_prefill: bool, **kw):
        eng = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, block_size=4, max_tokens_per_step=8, **kw)
        eng.scheduler.config = dataclasses.replace(eng.scheduler.config, reserve_prefill=reserve_prefill)
        outs = eng.generate([a, b, long_prompt], params)
        assert_no_leak(eng)
        return [list(o.token_ids) for o in outs], [o.num_preemptions for o in outs]

    want, none = run(True, num_kv_blocks=512)
    assert none == [0, 0, 0]
    tier = dict(num_kv_blocks=60, num_host_blocks=512, host_admission_min_seen=1)
    got, preemptions = run(True, **tier)
    assert got == want
    assert preemptions == [0, 0, 1]
    got, thrash = run(False, **tier)
    assert got == want
    assert thrash[2] >= 3


# ---- S9 on a hybrid model with the host tier ---------------------------------------------------


def test_s9_hybrid_model_host_blocks_are_no_device_capacity(gemma):
    """Tiny Gemma 3, 29 usable device blocks and a 512-block host tier: a request whose prompt
    and output need 39 blocks (in 8-token chunks) is refused at admission naming the sizes (the
    host tier holds no KV a query reads); one needing exactly 29 is served, as is a small one
    after the refusal."""
    from helpers.engine import assert_no_leak

    from pagedkv.engine import LLMEngine, RequestTooLargeError, SamplingParams

    eng = LLMEngine(
        gemma.hf,
        tokenizer=gemma.tokenizer,
        block_size=4,
        num_kv_blocks=30,
        max_tokens_per_step=8,
        num_host_blocks=512,
        host_admission_min_seen=1,
    )
    assert (eng.scheduler.max_blocks(40, 16), eng.scheduler.max_blocks(80, 16)) == (29, 39)
    with pytest.raises(RequestTooLargeError, match=r"needs 39 KV blocks \(80 prompt tokens \+ max_tokens=16.*only 29"):
        eng.add_request(list(range(3, 83)), SamplingParams(max_tokens=16))
    outs = eng.generate([list(range(3, 43)), list(range(5, 15))], SamplingParams(max_tokens=16, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [16, 16]
    assert_no_leak(eng)
