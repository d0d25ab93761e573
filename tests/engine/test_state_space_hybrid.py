"""A state-space hybrid served end to end: a tiny random Nemotron-H (Mamba-2, attention,
Mamba-2, MLP layers) on the CPU, greedy-token-identical to transformers' ``generate``.

- The Mamba-2 mixer (:mod:`pagedkv.engine.models.mamba2`, pagedkv's own recurrence) matches
  transformers' layer on the same weights, the sequence cut into steps anywhere.
- The engine keeps each Mamba-2 layer's conv + SSM state in state blocks of the paged pool (a
  manager group of kind ``"state"`` per state group): copy rows move a state to its new live
  block, zero rows start a fresh one, the forward pass updates it in place, and the commit
  fence (``manager.commit_computed`` after the forward pass) publishes states at aligned
  prefixes. Greedy tokens equal transformers' under batching, chunked prefill, both
  preemption modes and prefix hits on a state; without the commit no state is ever hit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.engine import TINY_NEMOTRON_H_LAYERS, TINY_VOCAB, ModelBundle, assert_no_leak, hf_greedy, tiny_nemotron_h

from pagedkv.engine import EngineConfigError, LLMEngine, SamplingParams
from pagedkv.engine.kv_groups import KVCacheGroup

MAX_NEW = 16
BS = 8  # the smallest block size whose page (2048 bytes) holds a Mamba-2 layer's state (1792)
PROMPT_LENS = (3, 8, 9, 27, 40, 61)  # within one block, exactly one, just past, several


@pytest.fixture(scope="module")
def nemo(tmp_path_factory) -> ModelBundle:
    return tiny_nemotron_h(tmp_path_factory.mktemp("tiny-nemotron-h"))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _cut(toks: list[int]) -> list[int]:
    return toks[: toks.index(1) + 1] if 1 in toks else toks


@pytest.fixture(scope="module")
def refs(nemo) -> list[list[int]]:
    return [_cut(hf_greedy(nemo, p, MAX_NEW)) for p in _prompts()]


# ---------------------------------------------------------------- the mixer


@pytest.mark.parametrize("cuts", [(21,), (5, 6, 21), (1, 2, 3, 8, 16, 21)])
def test_mamba2_mixer_matches_transformers_layer(nemo, cuts):
    # transformers' layer over the whole sequence (its chunked scan, 8-token chunks) against
    # pagedkv's recurrence over the same tokens fed in steps ending at `cuts`, the state
    # carried in one flat row between steps.
    from pagedkv.engine.models.mamba2 import Mamba2Weights, mamba2_mix

    sd = nemo.hf.state_dict()
    for layer in (0, 2):
        m = Mamba2Weights.from_state_dict(
            nemo.hf.config, sd, f"model.layers.{layer}.mixer.", device="cpu", dtype=torch.float32
        )
        assert m.state_numel == 3 * 64 + 4 * 8 * 8  # conv (K - 1) x conv_dim + SSM H x P x N
        x = torch.randn(1, 21, 64, generator=torch.Generator().manual_seed(layer))
        with torch.no_grad():
            want = nemo.hf.model.layers[layer].mixer(x)[0]
        state = torch.zeros(m.state_numel)
        got, start = [], 0
        for end in cuts:
            got.append(mamba2_mix(m, x[0, start:end], state))
            start = end
        torch.testing.assert_close(torch.cat(got), want, rtol=1e-5, atol=1e-5)
        assert want.abs().max() > 0.1  # the outputs compared are not all tiny
        # The carried state matters: the last step restarted from a zero state differs.
        if len(cuts) > 1:
            fresh = mamba2_mix(m, x[0, cuts[-2] :], torch.zeros(m.state_numel))
            assert not torch.allclose(fresh, want[cuts[-2] :], atol=1e-3)


def test_mamba2_mixer_batched_decode_equals_one_sequence_at_a_time(nemo):
    # The engine runs every one-token sequence of a step in one batched scan step, its states
    # strided rows of the step's pages: the same outputs and states as one at a time.
    from pagedkv.engine.models.mamba2 import Mamba2Weights, mamba2_mix

    m = Mamba2Weights.from_state_dict(
        nemo.hf.config, nemo.hf.state_dict(), "model.layers.2.mixer.", device="cpu", dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(3)
    pages = torch.zeros(3, m.state_numel + 10)
    for i in range(3):  # three different histories
        mamba2_mix(m, torch.randn(4 + i, 64, generator=gen), pages[i, 5 : 5 + m.state_numel])
    x = torch.randn(3, 1, 64, generator=gen)
    one = pages.clone()
    want = torch.stack([mamba2_mix(m, x[i], one[i, 5 : 5 + m.state_numel]) for i in range(3)])
    got = mamba2_mix(m, x, pages[:, 5 : 5 + m.state_numel])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pages, one, rtol=1e-6, atol=1e-6)
    assert not torch.equal(pages[0], pages[1])


# ---------------------------------------------------------------- the engine


def _engine(nemo: ModelBundle, **kw: Any) -> LLMEngine:
    return LLMEngine(nemo.hf, tokenizer=nemo.tokenizer, **({"block_size": BS, "num_kv_blocks": 256} | kw))


def test_tiny_nemotron_h_is_a_state_space_hybrid(nemo):
    engine = _engine(nemo, num_kv_blocks=64)
    m = engine.model
    assert type(m).__name__ == "NemotronHForCausalLM"
    assert m.layer_kinds == TINY_NEMOTRON_H_LAYERS
    # One layer per group (1 attention layer, 2 Mamba-2 layers); the MLP layer in none.
    assert m.kv_groups == (
        KVCacheGroup(None, (0,), "state"),
        KVCacheGroup(None, (1,)),
        KVCacheGroup(None, (2,), "state"),
    )
    assert m.num_kv_slots == 1 and m.state_bytes == 448 * 4
    assert [g.kind for g in engine.manager.groups] == ["state", "full", "state"]
    assert tuple(engine.runner.kv_cache.shape) == (1, 2, 64, BS, 2, 16)


REGIMES = {
    "one-batch": dict(),
    "chunked-prefill": dict(max_tokens_per_step=5),
    "chunked-prefill-aligned": dict(max_tokens_per_step=16),
    # 21 usable blocks: the longest request (76 tokens) needs 10 attention blocks and one or
    # two state blocks per state group, all six requests at once more (one preemption each).
    "recompute-preemption": dict(num_kv_blocks=22, max_tokens_per_step=8),
    "swap-preemption": dict(num_kv_blocks=22, max_tokens_per_step=8, preemption="swap"),
    "block-size-16": dict(block_size=16, num_kv_blocks=64),
    "batch-size-1": dict(max_num_seqs=1),
    "no-prefix-caching": dict(enable_prefix_caching=False),
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_tiny_nemotron_h_greedy_token_identical_to_transformers(nemo, refs, regime):
    engine = _engine(nemo, **REGIMES[regime])
    outs = engine.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW))
    for prompt_len, out, want in zip(PROMPT_LENS, outs, refs):
        assert list(out.token_ids) == want, (regime, prompt_len)
    if regime.endswith("preemption"):
        assert engine.stats().preemptions > 0
    assert_no_leak(engine)


def test_prefix_hit_on_a_committed_state(nemo):
    # The first request's 27-token prompt is prefilled as 24 + 3 (the chunk cut at the block
    # boundary), so the state after 24 tokens ends a step and is published by its commit. The
    # second request shares those 24 tokens: its attention layer reads the cached K/V, its
    # Mamba-2 layers start from a copy of the cached state, and its tokens are transformers'.
    base = _prompts()[3]
    assert len(base) == 27
    tail = [5, 6, 7, 8, 9]
    want = _cut(hf_greedy(nemo, base + tail, MAX_NEW))
    engine = _engine(nemo, num_kv_blocks=64)
    engine.generate([base], SamplingParams(max_tokens=1))
    out = engine.generate([base + tail], SamplingParams(max_tokens=MAX_NEW))[0]
    assert out.num_cached_tokens == 24
    assert list(out.token_ids) == want
    # A third request sharing 40 tokens of the second one's prompt + output: the state after
    # 40 tokens ended a decode step (positions 39 -> 40) and was published by its commit.
    assert len(out.token_ids) == MAX_NEW
    longer = (base + tail + list(out.token_ids))[:43]
    want3 = _cut(hf_greedy(nemo, longer, MAX_NEW))
    out3 = engine.generate([longer], SamplingParams(max_tokens=MAX_NEW))[0]
    assert out3.num_cached_tokens == 40
    assert list(out3.token_ids) == want3
    assert_no_leak(engine)


def test_no_state_hit_without_the_commit(nemo, monkeypatch):
    # Without the commit fence no state is ever published: the attention layer's blocks are
    # cached as before, but no prefix hit can start a Mamba-2 layer, so nothing is hit, and
    # the tokens are still transformers'. The pending states are released uncached.
    base = _prompts()[3]
    tail = [5, 6, 7, 8, 9]
    want = _cut(hf_greedy(nemo, base + tail, MAX_NEW))
    engine = _engine(nemo, num_kv_blocks=64)
    monkeypatch.setattr(engine, "_commit_step", lambda batch: None)
    engine.generate([base], SamplingParams(max_tokens=1))
    out = engine.generate([base + tail], SamplingParams(max_tokens=MAX_NEW))[0]
    assert out.num_cached_tokens == 0
    assert list(out.token_ids) == want
    assert_no_leak(engine)


def test_preemption_mid_generation_recomputes_the_state(nemo):
    # Preempt (recompute) a request after a few decode steps: its states are dropped, the
    # resumed prefill recomputes them from zero rows (or from its own committed states), and
    # the tokens stay transformers'.
    prompt = _prompts()[4]
    want = _cut(hf_greedy(nemo, prompt, 24))
    engine = _engine(nemo, num_kv_blocks=64)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=24))
    req = engine.requests.get(rid)
    for _ in range(6):
        engine.step()
    assert len(req.seqs[0].token_ids) > len(prompt) + 2
    engine.scheduler.preempt(req)
    assert engine.manager.num_computed_tokens(req.seqs[0].seq_id) == 0
    outs = engine.run()
    assert list(outs[0].token_ids) == want
    assert engine.stats().preemptions == 1
    assert_no_leak(engine)


def test_state_models_refuse_what_the_engine_does_not_serve(nemo):
    from pagedkv.engine import InvalidRequestError

    engine = _engine(nemo, num_kv_blocks=16)
    for params in (SamplingParams(max_tokens=4, n=2, temperature=1.0), SamplingParams(max_tokens=4, beam_width=2)):
        with pytest.raises(InvalidRequestError, match="recurrent"):
            engine.add_request([5, 6, 7], params)
    assert not engine.has_unfinished()
    with pytest.raises(EngineConfigError, match="block_size >= 7"):
        _engine(nemo, block_size=4)
    with pytest.raises(EngineConfigError, match="speculative='ngram'"):
        _engine(nemo, speculative="ngram")
    with pytest.raises(EngineConfigError, match="kv_layout='virtual'"):
        _engine(nemo, kv_layout="virtual")


def test_moe_layers_are_refused(tmp_path):
    bundle = tiny_nemotron_h(
        tmp_path / "moe",
        layers_block_type=["linear_attention", "full_attention", "moe"],
        n_routed_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
    )
    with pytest.raises(EngineConfigError, match="layer 2 has type 'moe'"):
        LLMEngine(bundle.hf, tokenizer=bundle.tokenizer, block_size=BS, num_kv_blocks=16)


def test_the_hit_state_is_what_the_tokens_need(nemo, monkeypatch):
    # The prefix-hit check above can fail: with the state groups' copy rows dropped, the second
    # request's Mamba-2 layers start from whatever their fresh live blocks held instead of the
    # cached state after 24 tokens, and its tokens are no longer transformers'.
    base = _prompts()[3]
    tail = [5, 6, 7, 8, 9]
    want = _cut(hf_greedy(nemo, base + tail, MAX_NEW))
    engine = _engine(nemo, num_kv_blocks=64)
    engine.generate([base], SamplingParams(max_tokens=1))
    states = [g for g, grp in enumerate(engine.model.kv_groups) if grp.is_state]
    apply = engine.runner.apply_block_plans
    dropped = []

    def without_state_copies(bt: Any) -> None:
        keep = torch.tensor([int(g) not in states for g in bt.copies[:, 0].tolist()], dtype=torch.bool)
        dropped.append(int((~keep).sum()))
        bt.copies = bt.copies[keep]
        apply(bt)

    monkeypatch.setattr(engine.runner, "apply_block_plans", without_state_copies)
    out = engine.generate([base + tail], SamplingParams(max_tokens=MAX_NEW))[0]
    assert out.num_cached_tokens == 24 and dropped[0] == len(states)  # the hit's copy rows
    assert list(out.token_ids) != want
