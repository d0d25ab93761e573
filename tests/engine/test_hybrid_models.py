"""Hybrid models and the architecture check, on tiny random models (fast).

- A tiny random Gemma 3 (sliding-window and full-attention layers, window 8, QK-norm, GeGLU,
  two RoPE bases) is served greedy-token-identical to transformers' ``generate``, on prompts
  shorter and much longer than its window, under chunked prefill, preemption and prefix
  caching; with the window ignored it is not (so the window is what the check checks).
- Each layer's window comes from the config (``layer_types``, Gemma's
  ``sliding_window_pattern``, Mistral's model-wide window, Qwen2's ``max_window_layers``).
- A model of an architecture the engine does not implement is refused with
  ``EngineConfigError`` naming it (before, a Qwen3 or Gemma 3 loaded as a Llama and generated
  garbage).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers.engine import TINY_GEMMA3_WINDOW, TINY_VOCAB, ModelBundle, assert_no_leak, hf_greedy, tiny_gemma3

from pagedkv.engine import EngineConfigError, LLMEngine, SamplingParams
from pagedkv.engine.kv_groups import KVCacheGroup, kv_cache_groups, layer_windows

WINDOW = TINY_GEMMA3_WINDOW
MAX_NEW = 16
PROMPT_LENS = (3, 7, 8, 9, 30, 61)  # shorter than, equal to, just past and far past the window


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> ModelBundle:
    return tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def refs(gemma) -> list[list[int]]:
    out = []
    for p in _prompts():
        toks = hf_greedy(gemma, p, MAX_NEW)
        out.append(toks[: toks.index(1) + 1] if 1 in toks else toks)
    return out


def test_tiny_gemma3_is_a_hybrid_model(gemma):
    import pagedkv

    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, num_kv_blocks=64, block_size=4)
    m = engine.model
    assert type(m).__name__ == "Gemma3ForCausalLM"
    # 3 sliding layers and 1 full one: groups of 1 layer (equal layer counts), one KV slot.
    assert m.kv_groups == tuple(KVCacheGroup(w, (i,)) for i, w in enumerate((WINDOW, None, WINDOW, WINDOW)))
    assert (m.layer_group, m.layer_slot, m.num_kv_slots) == ((0, 1, 2, 3), (0, 0, 0, 0), 1)
    assert m.scale == 24**-0.5
    assert type(engine.manager) is pagedkv.KVCacheManager and engine.manager.num_groups == 4
    assert [(g.kind, g.window) for g in engine.manager.groups] == [
        ("sliding_window", WINDOW), ("full", None), ("sliding_window", WINDOW), ("sliding_window", WINDOW)
    ]  # fmt: skip
    assert engine.manager.layer_groups == [0, 1, 2, 3]
    assert tuple(engine.runner.kv_cache.shape) == (1, 2, 64, 4, 2, 16)


REGIMES = {
    "one-batch": dict(),
    "chunked-prefill": dict(max_tokens_per_step=5),
    # Pages of one group's layer (4 groups of 1 layer). In 8-token chunks a sliding-window
    # group holds at most 5 blocks, so 40 pages hold the longest request (76 tokens: 19 blocks
    # of full attention, 3 x 5 windowed) but not every request at once.
    "recompute-preemption": dict(num_kv_blocks=40, max_tokens_per_step=8),
    "swap-preemption": dict(num_kv_blocks=40, max_tokens_per_step=8, preemption="swap"),
    "block-size-16": dict(block_size=16, num_kv_blocks=32),
    "batch-size-1": dict(max_num_seqs=1),
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_tiny_gemma3_greedy_token_identical_to_transformers(gemma, refs, regime):
    kw = dict(block_size=4, num_kv_blocks=256) | REGIMES[regime]
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, **kw)
    outs = engine.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW))
    for prompt_len, out, want in zip(PROMPT_LENS, outs, refs):
        assert list(out.token_ids) == want, (regime, prompt_len)
    if regime.endswith("preemption"):
        assert engine.stats().preemptions > 0
    assert_no_leak(engine)


def test_tiny_gemma3_prefix_hit_past_the_window(gemma):
    # The second request shares the first one's 60-token prompt: its sliding layers read the
    # cached K/V of the last WINDOW positions of the hit, its full layer every position.
    base = _prompts()[-1]
    tail = [5, 6, 7, 8]
    want = hf_greedy(gemma, base + tail, MAX_NEW)
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, block_size=4, num_kv_blocks=128)
    engine.generate([base], SamplingParams(max_tokens=1))
    out = engine.generate([base + tail], SamplingParams(max_tokens=MAX_NEW))[0]
    assert engine.stats().prefix_hits_tokens >= 56
    assert list(out.token_ids) == want[: len(out.token_ids)] and len(out.token_ids) == len(want)


def test_tiny_gemma3_differs_when_the_window_is_ignored(gemma, refs, monkeypatch):
    # The check above can fail: with every layer on full attention the prompts past the window
    # get other tokens than transformers gives.
    import pagedkv.engine.models.gemma3 as gemma3

    monkeypatch.setattr(gemma3, "layer_windows", lambda config: (None,) * config.num_hidden_layers)
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, block_size=4, num_kv_blocks=256)
    assert not engine.model.is_hybrid
    outs = engine.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW))
    differ = [n for n, out, want in zip(PROMPT_LENS, outs, refs) if list(out.token_ids) != want]
    assert differ and min(differ) > WINDOW


def test_gemma3_configs_the_engine_does_not_implement_are_refused(tmp_path):
    for overrides, needle in (
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ):
        bundle = tiny_gemma3(tmp_path / needle, **overrides)
        with pytest.raises(EngineConfigError, match=needle):
            LLMEngine(bundle.hf, tokenizer=bundle.tokenizer, num_kv_blocks=16)


# ---------------------------------------------------------------- layer windows from configs


def _cfg(**kw: Any) -> SimpleNamespace:
    return SimpleNamespace(num_hidden_layers=kw.pop("n", 4), **kw)


def test_layer_windows_from_each_config_form():
    assert layer_windows(_cfg(sliding_window=None)) == (None,) * 4  # Llama
    assert layer_windows(_cfg(sliding_window=32)) == (32,) * 4  # Mistral: every layer
    assert layer_windows(_cfg(sliding_window=32, use_sliding_window=False)) == (None,) * 4
    assert layer_windows(_cfg(n=6, sliding_window=5, sliding_window_pattern=3)) == (5, 5, None, 5, 5, None)
    types = ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]  # Qwen2
    assert layer_windows(_cfg(sliding_window=7, layer_types=types)) == (None, None, 7, 7)
    # Groups of equal layer counts (the smallest kind's), in order of their first layer.
    assert kv_cache_groups((7, None, 7, 9)) == (
        KVCacheGroup(7, (0,)),
        KVCacheGroup(None, (1,)),
        KVCacheGroup(7, (2,)),
        KVCacheGroup(9, (3,)),
    )
    assert kv_cache_groups((7, None, 7, 9), split=False) == (
        KVCacheGroup(7, (0, 2)),
        KVCacheGroup(None, (1,)),
        KVCacheGroup(9, (3,)),
    )
    gemma = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))  # Gemma 3 270M
    assert [(g.sliding_window, g.layers) for g in kv_cache_groups(gemma)] == [
        (512, (0, 1, 2)), (512, (3, 4, 6)), (None, (5, 11, 17)), (512, (7, 8, 9)),
        (512, (10, 12, 13)), (512, (14, 15, 16)),
    ]  # fmt: skip
    # Kinds within 25 % of each other share one size (the larger: the smaller kind's one group
    # padded); Mistral-like (one kind) gets one group of every layer.
    assert [len(g.layers) for g in kv_cache_groups((None,) * 5 + (5,) * 6)] == [5, 6]
    assert kv_cache_groups((32,) * 4) == (KVCacheGroup(32, (0, 1, 2, 3)),)


def test_qwen2_window_only_from_max_window_layers():
    from transformers import Qwen2Config

    cfg = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert layer_windows(cfg) == (None, None, 16, 16)


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(layer_types=["full_attention", "chunked_attention", "full_attention", "full_attention"]),
         "layer 1 has attention type 'chunked_attention'"),
        (dict(layer_types=["full_attention"] * 3), "layer_types has 3 entries, expected num_hidden_layers=4"),
        (dict(sliding_window=0, layer_types=["sliding_attention"] * 4), "sliding_window is 0"),
        (dict(sliding_window=None, layer_types=["sliding_attention"] * 4), "sliding_window is None"),
    ],
)  # fmt: skip
def test_layer_windows_refuse_what_the_engine_does_not_implement(kw, needle):
    with pytest.raises(EngineConfigError, match=needle):
        layer_windows(_cfg(**kw))


# ---------------------------------------------------------------- architecture check


def test_unsupported_architecture_is_refused_naming_it(tiny, tmp_path):
    # Qwen3's weights carry Llama's names (plus a QK-norm): without the check it loaded as a
    # Llama and generated garbage.
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg).eval()
    with pytest.raises(EngineConfigError, match=r"architecture 'Qwen3ForCausalLM' \(model_type 'qwen3'\)"):
        LLMEngine(model, tokenizer=tiny.tokenizer, num_kv_blocks=16)
    # A headless model is no causal LM either, whatever its weights.
    with pytest.raises(EngineConfigError, match="architecture 'LlamaModel'"):
        LLMEngine(tiny.hf.model, tokenizer=tiny.tokenizer, num_kv_blocks=16)
    # From a folder too: refused after the load, before any KV allocation.
    folder = tmp_path / "qwen3"
    model.save_pretrained(str(folder))
    tiny.tokenizer.save_pretrained(str(folder))
    with pytest.raises(EngineConfigError, match="Qwen3ForCausalLM"):
        LLMEngine(str(folder), num_kv_blocks=16)


# ---------------------------------------------------------------- per-group block tables


def test_gemma3_runs_on_per_group_block_tables_of_a_hybrid_manager(gemma):
    # The model on the steps of a manager of one group per KV cache group (one table and slot
    # mapping per group, dense from each step):
    # the sliding-window group releases its blocks behind the window (table entries -> the
    # null block, poisoned with NaN here), the full-attention group keeps them all, and the
    # greedy tokens are transformers'. Chunked prefill in 16-token chunks, then decodes.
    import numpy as np

    import pagedkv
    from pagedkv.engine.models.gemma3 import Gemma3ForCausalLM
    from pagedkv.tensors import BatchTensors

    model = Gemma3ForCausalLM.from_hf(gemma.hf)
    bs, num_blocks = 4, 64
    per_token = 2 * model.num_kv_heads * model.head_size * 4
    specs = [
        pagedkv.KVCacheGroupSpec("full", bs, per_token)
        if g.sliding_window is None
        else pagedkv.KVCacheGroupSpec("sliding_window", bs, per_token, window=g.sliding_window)
        for g in model.kv_groups
    ]
    manager = pagedkv.KVCacheManager(
        pagedkv.CacheConfig(num_blocks, groups=specs, layer_groups=list(model.layer_group))
    )
    kv_cache = model.allocate_kv_cache(num_blocks, bs)
    kv_cache[:, :, 0] = float("nan")  # the null block: released entries point here
    prompt = _prompts()[-1]
    want = hf_greedy(gemma, prompt, MAX_NEW)
    manager.add_sequence(1, prompt)
    got: list[int] = []
    done = 0
    cache_shape = tuple(kv_cache.shape[2:])

    def next_token(meta: BatchTensors, plans: Any) -> int:
        last = torch.tensor([meta.input_ids.shape[0] - 1])
        logits = model.forward(meta.input_ids, meta.positions, kv_cache, meta, last, plans=plans)
        assert torch.isfinite(logits).all()
        return int(logits[0].argmax())

    while not got or (len(got) < len(want) and got[-1] != 1):
        if done < len(prompt):  # chunked prefill, 16 tokens a step
            n = min(16, len(prompt) - done)
            out = manager.step([1], [n], block_table=True)
            done += n
        else:
            out = manager.step([1], [1], [np.array([got[-1]])], block_table=True)
        out.raise_for_error()
        meta = BatchTensors.from_steps(out)
        assert meta.block_tables.shape[0] == meta.slot_mappings.shape[0] == len(model.kv_groups) == 4
        before = kv_cache.clone()
        tok = next_token(meta, model.plan_attention(meta, cache_shape))  # one plan per group
        kv_cache.copy_(before)  # the same step without plans: the Triton path's calls
        assert next_token(meta, None) == tok
        if done == len(prompt):
            got.append(tok)
    assert got == want
    held = manager.num_blocks_held(1)
    total = manager.num_tokens(1)
    for g, grp in enumerate(model.kv_groups):
        if grp.sliding_window is None:
            assert held[g] == -(-total // bs)  # full attention: every block
        else:
            assert held[g] <= -(-WINDOW // bs) + 1 < -(-total // bs)  # bounded by the window
            table = manager.block_tables(1)[g]
            assert (table[: (total - WINDOW) // bs] == 0).all()  # released: the (poisoned) null block
    manager.free(1)
    manager.check_invariants()
    assert manager.num_free_blocks == num_blocks - 1  # every block back (block 0 is the null block)


def test_tiny_gemma3_without_plans_as_the_triton_path_calls(gemma, refs):
    # On CUDA the runner attaches no plans (the Triton kernel reads the metadata itself): each
    # layer then passes its group's table and window on every call. Same tokens.
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, block_size=4, num_kv_blocks=256, max_tokens_per_step=16)
    engine.runner._triton_attention = True  # what prepare() checks: no plan per group
    outs = engine.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW))
    assert [list(o.token_ids) for o in outs] == refs


# ---------------------------------------------------------------- the engine on the hybrid manager


def _held_while_decoding(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[tuple[int, list[int]]]:
    """Serve one request step by step; after each step of its decode, (computed tokens, blocks
    held per KV cache group)."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    seq = engine.requests.get(rid).seqs[0].seq_id
    seen = []
    while engine.has_unfinished():
        engine.step()
        if engine.has_unfinished() and engine.manager.num_computed_tokens(seq) >= len(prompt):
            seen.append((engine.manager.num_computed_tokens(seq), list(engine.manager.num_blocks_held(seq))))
    return seen


def test_window_groups_hold_only_the_window(gemma):
    # A 61-token prompt decoding 30 tokens past it (window 8, 4-token blocks): each sliding
    # group holds exactly the blocks from the window of the last context on,
    # ceil(n / 4) - floor((n - 8) / 4) <= ceil(8 / 4) + 1 = 3, the full group every block; the
    # full-attention allocation of the same model (one table for every layer) holds every
    # block of all 4 layers.
    bs = 4
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, block_size=bs, num_kv_blocks=256)
    seen = _held_while_decoding(engine, _prompts()[-1], 30)
    assert len(seen) >= 25
    # Right after the prefill (one allocation at context 0) every group holds the prompt's
    # 16 blocks: the manager releases at the next allocation, from the window of its context.
    assert seen[0] == (61, [16, 16, 16, 16])
    groups = engine.model.kv_groups
    for n, held in seen[1:]:
        for g, grp in zip(held, groups):
            want = -(-n // bs) if grp.sliding_window is None else -(-n // bs) - (n - WINDOW) // bs
            assert g == want, (n, held)
            assert grp.sliding_window is None or g <= -(-WINDOW // bs) + 1
    page = engine.model.kv_bytes_per_block(bs)  # one layer slot: one group's page
    n, held = seen[-1]
    hybrid_bytes = sum(held) * page
    assert sum(held) == -(-n // bs) + 3 * 3 and hybrid_bytes == (23 + 9) * 4 * 2 * 2 * 16 * 4
    assert_no_leak(engine)


def test_full_attention_allocation_of_the_same_model_keeps_every_block(gemma, refs, monkeypatch):
    # The comparison allocation: PagedCausalLM.per_group_tables = False serves the hybrid model
    # through one block table (the manager's one full-attention group): same tokens, every block
    # of every layer held.
    from pagedkv.engine.models.model import PagedCausalLM

    monkeypatch.setattr(PagedCausalLM, "per_group_tables", False)
    bs = 4
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, block_size=bs, num_kv_blocks=256)
    assert not engine.model.is_hybrid and engine.model.num_kv_slots == 4
    seen = []
    rid = engine.add_request(_prompts()[-1], SamplingParams(max_tokens=30))
    seq = engine.requests.get(rid).seqs[0].seq_id
    while engine.has_unfinished():
        engine.step()
        if engine.has_unfinished():
            seen.append((engine.manager.num_computed_tokens(seq), len(engine.manager.block_table(seq))))
    n, blocks = seen[-1]
    assert blocks == -(-n // bs) == 23  # x 4 layers a block: 92 layer pages, against 32 hybrid
    outs = engine.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW))
    assert [list(o.token_ids) for o in outs] == refs


def test_admission_fits_a_pool_that_full_attention_allocation_cannot(gemma):
    # 72 pages of one layer: a 61-token prompt + 16 tokens needs 19 blocks x 4 layers = 76 pages
    # under full-attention allocation (refused: it can never fit), but in 8-token chunks only
    # 19 full-attention blocks + 3 x 5 window blocks = 34 pages on the hybrid manager, so two
    # such requests run at once. Admission reserves what the hybrid manager predicts, not the
    # full-attention figure (else it would admit one at a time, or hang; vLLM #39734).
    from pagedkv.engine import RequestTooLargeError
    from pagedkv.engine.models.model import PagedCausalLM

    bs, pages = 4, 72
    prompts = [_prompts()[-1], _prompts()[-1][::-1], _prompts()[-1][1:] + [9], _prompts()[-1][2:] + [9, 9]]
    want = [hf_greedy(gemma, p, MAX_NEW) for p in prompts]
    want = [w[: w.index(1) + 1] if 1 in w else w for w in want]
    engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, block_size=bs, num_kv_blocks=pages, max_tokens_per_step=8)
    assert engine.scheduler.max_blocks(61, MAX_NEW) == 34
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=MAX_NEW))
    most, outs = 0, {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = list(o.token_ids)
        most = max(most, len(engine.scheduler.running))
    assert [outs[str(i)] for i in range(4)] == want
    assert most >= 2
    assert_no_leak(engine)
    # The same bytes as a full-attention allocation of the same model: 18 blocks of 4 layers.
    kv_bytes = pages * engine.model.kv_bytes_per_block(bs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PagedCausalLM, "per_group_tables", False)
        full = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, block_size=bs, kv_bytes=kv_bytes, max_tokens_per_step=8)
        assert full.config.num_kv_blocks == pages // 4
        with pytest.raises(RequestTooLargeError, match="needs 19 KV blocks"):
            full.add_request(prompts[0], SamplingParams(max_tokens=MAX_NEW))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forks_and_beams_copy_on_write_per_group(gemma, monkeypatch, prefix_caching):
    # n > 1 samples and beam search fork the prompt's sequence: every group's blocks are
    # shared and a shared partial last block is copied per group (one (group, src, dst) row
    # each, one copy call). Same outputs as on the full-attention allocation of the model.
    from pagedkv.engine.models.model import PagedCausalLM

    prompts = [_prompts()[2], _prompts()[-1]]
    params = [
        SamplingParams(max_tokens=MAX_NEW, n=3, temperature=0.9, seed=5),
        SamplingParams(max_tokens=MAX_NEW, beam_width=3),
    ]
    kw = dict(tokenizer=gemma.tokenizer, block_size=4, num_kv_blocks=256, enable_prefix_caching=prefix_caching)

    def run() -> tuple[list[list[list[int]]], Any]:
        engine = LLMEngine(gemma.hf, **kw)
        got = [[list(o.token_ids) for o in r.outputs] for p in params for r in engine.generate(prompts, p)]
        assert_no_leak(engine)
        return got, engine.stats()

    hybrid, stats = run()
    assert stats.copies > 0
    monkeypatch.setattr(PagedCausalLM, "per_group_tables", False)
    assert run()[0] == hybrid


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"num_kv_blocks": 130},  # preempts by recompute
        {"num_kv_blocks": 130, "preemption": "swap"},
        {"max_tokens_per_step": 16},
    ],
    ids=["large-pool", "recompute-preemption", "swap-preemption", "chunked-prefill"],
)
def test_speculative_decoding_on_a_hybrid_model_equals_plain_decoding(gemma, kw):
    """Prompt-lookup speculation on the tiny Gemma 3 (window 8, block size 4): drafts get
    lookahead slots in every KV cache group and each verify row attends through its group's
    window; greedy outputs equal plain decoding, with drafts accepted."""
    gen = torch.Generator().manual_seed(0)
    prompts = [[12] * 12, [13] * 20, [5, 6, 7, 8, 9] * 8]
    prompts += [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 17, 33, 61)]

    def run(**extra: Any) -> tuple[LLMEngine, list[list[int]]]:
        args = {"block_size": 4, "num_kv_blocks": 512, **extra}
        engine = LLMEngine(gemma.hf, tokenizer=gemma.tokenizer, **args)
        outs = engine.generate(prompts, SamplingParams(max_tokens=40))
        return engine, [list(o.token_ids) for o in outs]

    _, plain = run()
    engine, spec = run(speculative="ngram", num_speculative_tokens=4, **kw)
    assert spec == plain
    assert engine.metrics().spec_accepted_tokens > 0
    if "num_kv_blocks" in kw:
        assert engine.stats().preemptions > 0
    engine.manager.check_invariants()
    assert_no_leak(engine)


def test_a_model_without_windows_keeps_the_one_group_manager(tiny):
    # Llama (SmolLM2's architecture): one KV cache group of every layer, one manager group, one
    # slot per layer in the cache, BatchTensors with the persistent BlockTable.
    import pagedkv

    engine = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, num_kv_blocks=32, block_size=4)
    m = engine.model
    assert not m.is_hybrid and type(engine.manager) is pagedkv.KVCacheManager and engine.manager.num_groups == 1
    assert engine.manager.layer_groups == []  # the one-group config: CacheConfig(num_blocks, block_size)
    assert m.kv_groups == (KVCacheGroup(None, tuple(range(m.num_layers))),)
    assert m.layer_slot == tuple(range(m.num_layers)) and m.num_kv_slots == m.num_layers
    assert engine.runner.block_tables is not None
    assert tuple(engine.runner.kv_cache.shape[:3]) == (m.num_layers, 2, 32)
