"""Length-dependent RoPE (``dynamic`` NTK and ``longrope``) on tiny random Llamas whose
threshold is small (32 tokens), so generation crosses it: greedy outputs token-identical to
transformers' ``generate`` (batch 1, fp32, CPU) under several scheduling regimes, logits close at
the crossing step, a sequence's logits independent of its batch company, prefix caching kept
apart where cached K/V would differ, and the frequency tables equal transformers' own."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from helpers.engine import ModelBundle, assert_no_leak, build_tiny_model, hf_greedy
from hypothesis import given, settings

import pagedkv
from pagedkv.engine import LLMEngine, SamplingParams
from pagedkv.engine import runner as runner_module
from pagedkv.engine.models.rope import RotaryEmbedding, context_length, rope_inv_freq, rope_lengths

THRESHOLD = 32  # max_position_embeddings (dynamic) / original_max_position_embeddings (longrope)
CONFIGS = {
    # context = 32 x factor 2 = 64 tokens
    "dynamic": dict(
        max_position_embeddings=THRESHOLD, rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)
    ),
    # head_size 16 -> 8 factors each; factor 4 = 128 / 32 sets the attention scaling
    "longrope": dict(
        max_position_embeddings=128,
        rope_parameters=dict(
            rope_type="longrope",
            rope_theta=10000.0,
            original_max_position_embeddings=THRESHOLD,
            factor=4.0,
            short_factor=[1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0],
            long_factor=[1.0, 1.5, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0],
        ),
    ),
}
CONTEXT = {"dynamic": 64, "longrope": 128}
# 5 + 24 never crosses; 17, 25 and 31 cross while decoding (31: at the second decode step);
# 32 crosses at the first decode step; 40 starts past the threshold.
PROMPT_LENS = (5, 17, 25, 31, 32, 40)
MAX_NEW = 24


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _params(kind: str, prompts: list[list[int]]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=min(MAX_NEW, CONTEXT[kind] - len(p))) for p in prompts]


def _fresh_rope_state(hf: Any) -> None:
    """transformers' dynamic RoPE keeps the frequencies of its longest call across ``generate``
    calls (it only resets below the threshold); put them back to a freshly loaded model's."""
    rot = hf.model.rotary_emb
    rot.register_buffer("inv_freq", rot.original_inv_freq.clone(), persistent=False)
    rot.max_seq_len_cached = rot.original_max_seq_len
    if hasattr(rot, "long_inv_freq"):
        del rot.long_inv_freq


def _hf_greedy(bundle: ModelBundle, prompt: list[int], max_new: int) -> list[int]:
    """transformers' greedy batch-1 continuation, cut after the first EOS (id 1)."""
    _fresh_rope_state(bundle.hf)
    out = hf_greedy(bundle, prompt, max_new)
    return out[: out.index(1) + 1] if 1 in out else out


def _hf_step_logits(bundle: ModelBundle, prompt: list[int], max_new: int, *, switch: bool = True) -> torch.Tensor:
    """transformers' raw next-token logits ``[steps, vocab]`` of greedy batch-1 generate. With
    ``switch=False`` its rotary embedding skips the length-dependent update (its frequency
    update runs only for the ``dynamic`` / ``longrope`` types), so it keeps the short /
    unscaled frequencies at every length."""
    _fresh_rope_state(bundle.hf)
    rot = bundle.hf.model.rotary_emb
    rope_type = rot.rope_type
    if not switch:
        rot.rope_type = "default"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = bundle.hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
    finally:
        rot.rope_type = rope_type
    return torch.cat(out.logits).float()


@pytest.fixture(scope="module", params=list(CONFIGS))
def scaled(request, tmp_path_factory) -> tuple[str, ModelBundle, list[list[int]]]:
    """(kind, tiny model with that RoPE type, transformers' greedy outputs of the prompts)."""
    kind = request.param
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bundle = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{kind}"), **CONFIGS[kind])
    refs = [_hf_greedy(bundle, p, sp.max_tokens) for p, sp in zip(_prompts(), _params(kind, _prompts()))]
    return kind, bundle, refs


def _engine(bundle: ModelBundle, **kw: Any) -> LLMEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 256)
    return LLMEngine(bundle.hf, tokenizer=bundle.tokenizer, **kw)


def _capture_logits(engine: LLMEngine) -> list[torch.Tensor]:
    """Record the logits rows of every step (batch order)."""
    rows: list[torch.Tensor] = []
    original = engine.runner.execute

    def spy(batch):
        out = original(batch)
        rows.append(out.clone())
        return out

    engine.runner.execute = spy
    return rows


REGIMES = {
    "batch-many": dict(),
    "batch-size-1": dict(max_num_seqs=1),
    "chunked-prefill": dict(max_tokens_per_step=8),  # the 40-token prompt's first chunk is < 32
    "recompute-preemption": dict(num_kv_blocks=30),
    "swap-preemption": dict(num_kv_blocks=30, preemption="swap"),
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_token_identical_to_transformers_across_the_threshold(scaled, regime):
    kind, bundle, refs = scaled
    engine = _engine(bundle, **REGIMES[regime])
    assert engine.model.max_model_len == CONTEXT[kind] and engine.model.rope.threshold == THRESHOLD
    prompts = _prompts()
    outs = engine.generate(prompts, _params(kind, prompts))
    assert [list(o.token_ids) for o in outs] == refs
    assert all(len(p) + len(o.token_ids) > THRESHOLD for p, o in zip(prompts[1:], outs[1:]))
    if "preemption" in regime:
        assert engine.stats().preemptions > 0
    assert_no_leak(engine)


def test_frequencies_switch_exactly_at_the_crossing_step(scaled):
    """Batch 1, prompt of 31 tokens: step j (0 = prefill) has length 31 + j, so step 2 (length
    33) is the first past the threshold. Our logits match transformers' at every step; a
    transformers run that never switches frequencies matches ours before step 2 and misses
    at step 2."""
    kind, bundle, _ = scaled
    prompt = _prompts()[3]
    assert len(prompt) == 31
    want = _hf_step_logits(bundle, prompt, 6)
    engine = _engine(bundle)
    got_rows = _capture_logits(engine)
    engine.generate([prompt], SamplingParams(max_tokens=6))
    got = torch.cat(got_rows)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2], want[2], atol=1e-4, rtol=1e-4)  # the crossing step

    unswitched = _hf_step_logits(bundle, prompt, 6, switch=False)
    torch.testing.assert_close(got[:2], unswitched[:2], atol=1e-4, rtol=1e-4)
    assert float((got[2] - unswitched[2]).abs().max()) > 1e-2


def test_a_sequences_logits_do_not_depend_on_its_batch_company(scaled, monkeypatch):
    """A 20-token prompt decoding 8 tokens stays below the threshold; with a 40-token prompt in
    the same steps (past it), transformers' batch-wide choice would give both the long one's
    length (always 20 more). Ours keeps the short one's logits equal to its solo run's, step
    for step (up to GEMM rounding of a bigger batch), far from that batch-wide result."""
    kind, bundle, _ = scaled
    g = torch.Generator().manual_seed(3)
    short, long = (torch.randint(3, 512, (n,), generator=g).tolist() for n in (20, 40))
    params = SamplingParams(max_tokens=8)

    solo_engine = _engine(bundle)
    solo_rows = _capture_logits(solo_engine)
    solo_engine.generate([short], params)

    engine = _engine(bundle)
    steps: list[tuple[torch.Tensor, list[int]]] = []
    original = engine.runner.execute

    def spy(batch):
        out = original(batch)
        lens = [s.num_prompt_tokens for s, want in zip(batch.seqs, batch.sample) if want]
        steps.append((out.clone(), lens))
        return out

    engine.runner.execute = spy
    outs = engine.generate([short, long], [params, params])
    mixed = [logits[lens.index(20)] for logits, lens in steps if 20 in lens]
    assert len(mixed) == len(solo_rows) == 8
    assert all(40 in lens for _, lens in steps[:8])  # company past the threshold in every step
    for solo, row in zip(solo_rows, mixed):
        torch.testing.assert_close(row, solo[0], atol=1e-4, rtol=1e-4)
    assert list(outs[0].token_ids) == _hf_greedy(bundle, short, 8)
    assert list(outs[1].token_ids) == _hf_greedy(bundle, long, 8)
    assert_no_leak(engine)

    # Counterfactual: the short sequence alone but with the company's lengths (batch-wide rule).
    monkeypatch.setattr(runner_module, "rope_lengths", lambda n, pos: rope_lengths(n, pos) + 20)
    wide_engine = _engine(bundle)
    wide_rows = _capture_logits(wide_engine)
    wide_engine.generate([short], params)
    assert max(float((w - s).abs().max()) for w, s in zip(wide_rows, solo_rows)) > 1e-2


def test_prefix_cache_shared_only_where_cached_kv_agrees(scaled):
    """dynamic: prompt tokens past the threshold take the prompt length's frequencies, so a
    38-token prompt may not reuse a 40-token prompt's blocks; longrope: both use the long set
    and share. Prompts up to the threshold share with each other either way."""
    kind, bundle, _ = scaled
    g = torch.Generator().manual_seed(4)
    base = torch.randint(3, 512, (40,), generator=g).tolist()
    cut = base[:36] + [7, 8]  # 38 tokens, 36 shared (9 blocks of 4)
    small_a = base[:24] + [9, 10, 11, 12, 13, 14]  # 30 tokens, 24 shared
    small_b = base[:24] + [15, 16]  # 26 tokens
    engine = _engine(bundle, max_num_seqs=1)
    params = SamplingParams(max_tokens=4)
    outs = engine.generate([base, cut, base, small_a, small_b], params)
    assert [o.num_cached_tokens for o in outs] == [0, 0 if kind == "dynamic" else 36, 36, 0, 24]
    for p, o in zip([base, cut, base, small_a, small_b], outs):
        assert list(o.token_ids) == _hf_greedy(bundle, p, 4)
    assert_no_leak(engine)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_cos_sin_equal_transformers_rotary_for_each_length(kind):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    fields = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        **CONFIGS[kind],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = LlamaConfig(**fields)
    rope = RotaryEmbedding(cfg, 16, CONTEXT[kind])
    x = torch.zeros(1, 1, dtype=torch.float32)
    for length in (THRESHOLD - 1, THRESHOLD, THRESHOLD + 1, THRESHOLD + 9, CONTEXT[kind]):
        ref_cos, ref_sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(length)[None])  # one fresh call
        positions = torch.arange(length)
        cos, sin = rope.lookup(positions, torch.full((length,), length))
        assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0]), length
    # Past the threshold the tables really differ from the short/unscaled ones.
    cos, _ = rope.lookup(torch.arange(8), torch.full((8,), THRESHOLD + 1))
    assert not torch.equal(cos, rope.cos[:8])


def test_rope_helpers_and_errors():
    assert rope_lengths(10, np.arange(0, 10)).tolist() == [10] * 10  # a prefill: the prompt's length
    assert rope_lengths(10, np.arange(10, 13)).tolist() == [11, 12, 13]  # decodes: position + 1
    assert rope_lengths(10, np.arange(4, 12)).tolist() == [10] * 6 + [11, 12]  # recompute of both
    dyn = SimpleNamespace(max_position_embeddings=100, rope_parameters=dict(rope_type="dynamic", factor=2.5))
    assert context_length(dyn) == 250
    plain = SimpleNamespace(max_position_embeddings=100, rope_theta=500.0)
    assert context_length(plain) == 100
    inv, scale = rope_inv_freq(plain, 4)
    assert torch.equal(inv, 1.0 / (500.0 ** torch.tensor([0.0, 0.5]))) and scale == 1.0
    with pytest.raises(ValueError, match="rope_type 'bogus' is not supported"):
        rope_inv_freq(SimpleNamespace(rope_parameters=dict(rope_type="bogus")), 16)
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, **CONFIGS["dynamic"])
    rope = RotaryEmbedding(cfg, 16, 64)
    with pytest.raises(ValueError, match=r"rope_type 'dynamic' needs rope_lens shaped like positions \(3,\), got None"):
        rope.lookup(torch.arange(3))
    with pytest.raises(ValueError, match=r"rope_lens\[1\]=1 must exceed the token's position 1"):
        rope.lookup(torch.tensor([0, 1]), torch.tensor([2, 1]))
    assert rope.cos.shape == (THRESHOLD, 16)  # short table: positions below the threshold only
    static = RotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4), 16, 64)
    assert not static.length_dependent and static.prefix_cache_tag(1000) is None
    cos, _ = static.lookup(torch.tensor([3, 5]))
    assert torch.equal(cos, static.cos[[3, 5]])
    assert rope.prefix_cache_tag(32) is None and rope.prefix_cache_tag(33) == "dynamic:33"


# ---- engine-derived block identity never meets a user's cache salt ---------------------------

#: Salts a user might send that spell out the engine's own tag texts, with and without the
#: separator byte an ad-hoc string encoding would use.
TAG_LOOKALIKES = [
    "\x1fdynamic:40",
    "dynamic:40",
    "\x1f",
    "rope",
    "rope\x1fdynamic:40",
    "longrope:long",
    "\x1flongrope:long",
    "\x00",
    "\x1fdynamic:40\x1f",
]


@pytest.fixture(scope="module")
def dynamic_engine_factory(tmp_path_factory):
    """Builds fresh engines on one tiny dynamic-NTK Llama (threshold 32 tokens)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bundle = build_tiny_model(tmp_path_factory.mktemp("tiny-dynamic-salt"), **CONFIGS["dynamic"])
    return lambda **kw: _engine(bundle, max_num_seqs=1, **kw)


def test_a_salt_spelling_the_rope_tag_shares_nothing_with_a_tagged_prompt(dynamic_engine_factory):
    """An unsalted 40-token prompt (past the threshold: RoPE of length 40) runs first; a
    21-token prompt sharing its first 20 tokens, salted with the tag's own text, gets no cached
    token and the greedy output of a fresh engine."""
    g = torch.Generator().manual_seed(9)
    a = torch.randint(3, 512, (40,), generator=g).tolist()
    b = a[:20] + [7]
    params = SamplingParams(max_tokens=8)
    engine = dynamic_engine_factory()
    engine.generate([a], params)
    out = engine.generate([{"prompt": b, "cache_salt": "\x1fdynamic:40"}], params)[0]
    fresh = dynamic_engine_factory().generate([{"prompt": b, "cache_salt": "\x1fdynamic:40"}], params)[0]
    assert out.num_cached_tokens == 0
    assert list(out.token_ids) == list(fresh.token_ids)
    assert_no_leak(engine)


@settings(max_examples=200, deadline=None)
@given(
    salt_a=st.one_of(st.none(), st.sampled_from(TAG_LOOKALIKES), st.text(max_size=12)),
    salt_b=st.one_of(st.none(), st.sampled_from(TAG_LOOKALIKES), st.text(max_size=12)),
    len_a=st.sampled_from([24, 33, 40, 41]),
    len_b=st.sampled_from([21, 33, 40, 41]),
)
def test_no_salt_makes_engine_derived_keys_collide(dynamic_engine_factory, salt_a, salt_b, len_a, len_b):
    """With the engine's own derived keys (the RoPE tag of each prompt length), two prompts
    sharing their first 20 tokens share cached blocks exactly when their salts are equal and
    their RoPE tags are equal: no salt, control characters or tag texts included, stands in
    for a derived key."""
    eng = _derived_keys_engine(dynamic_engine_factory)
    base = list(range(100, 100 + max(len_a, len_b)))
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(64, 4))
    a, b = base[:len_a], base[:20] + [7] * (len_b - 20)
    m.add_sequence(1, a, spec=eng.sequence_spec(a, salt_a))
    m.allocate_slots(1, 64)
    m.add_sequence(2, b, spec=eng.sequence_spec(b, salt_b))
    same_identity = salt_a == salt_b and eng.model.rope.prefix_cache_tag(len_a) == eng.model.rope.prefix_cache_tag(
        len_b
    )
    assert m.lookup_prefix(2) == (20 if same_identity else 0)


_ENGINES: dict[int, LLMEngine] = {}


def _derived_keys_engine(factory) -> LLMEngine:
    """One engine per factory, reused across hypothesis examples (only its key derivation is used)."""
    return _ENGINES.setdefault(id(factory), factory())


def test_a_router_finds_a_long_prompts_blocks_with_the_engines_spec(dynamic_engine_factory):
    """Past the threshold the engine keys a prompt's blocks with its RoPE variant; the
    ``SequenceSpec`` it derives for a router (``prompt_spec``) carries that key, so the router
    finds all 9 cacheable blocks of a 40-token prompt on the engine that computed them. Hashed
    with the salt alone, as routers did before, the overlap is 0."""
    from pagedkv.routing import Router

    engine = dynamic_engine_factory(enable_kv_events=True)
    prompt = list(range(100, 140))
    engine.generate([{"prompt": prompt, "cache_salt": "tenant"}], SamplingParams(max_tokens=2))
    router = Router(pagedkv.HashScheme.of(engine.manager.config).indexer())
    router.add_worker(0)
    router.add_worker(1)
    assert router.apply_events(0, 0, engine.manager.take_events()) == "applied"
    tokens, spec = engine.prompt_spec({"prompt": prompt, "cache_salt": "tenant"})
    assert tokens == prompt
    assert spec == pagedkv.SequenceSpec(cache_salt="tenant", extra_keys=(("rope", b"dynamic:40"),))
    assert spec == engine.sequence_spec(prompt, "tenant")  # what add_request registered
    d = router.route(tokens, spec=spec)
    assert (d.worker, d.overlap_blocks, d.num_blocks) == (0, 9, 9)
    assert router.route(tokens, spec=pagedkv.SequenceSpec(cache_salt="tenant")).overlap_blocks == 0
    assert router.route(tokens, spec=engine.sequence_spec(prompt, "other")).overlap_blocks == 0
    # Up to the threshold there is no RoPE key: the spec is the salt alone.
    assert engine.prompt_spec(prompt[:32])[1] == pagedkv.SequenceSpec()
