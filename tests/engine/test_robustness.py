"""Robustness of the reference engine on the tiny random Llama (see conftest.py): a step that
fails (model error, beam search error, ``KeyboardInterrupt``) leaves the engine consistent and
usable; bad sampling parameters, prompts and engine arguments raise typed errors naming the
value before anything is queued or loaded."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from helpers.engine import assert_no_leak

import pagedkv
from pagedkv.engine import (
    EngineConfigError,
    InvalidRequestError,
    LLMEngine,
    SamplingParams,
)
from pagedkv.engine.beam_search import BeamSearch

GREEDY = SamplingParams(max_tokens=8)
SHARED = list(range(100, 112))  # 3 full blocks of 4: hashed for the prefix cache at prefill


def _engine(tiny, **kw: Any) -> LLMEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 128)
    return LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, **kw)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    tails = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 9, 6)]
    return [SHARED + tails[0], SHARED + tails[1], tails[2] + SHARED]


def _params() -> list[SamplingParams]:
    return [GREEDY, SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=3), GREEDY]


def _summary(outs) -> list[tuple]:
    """Everything a fresh engine must reproduce, prefix-cache hits included (not the request
    ids: they are arrival numbers)."""
    return [([c.token_ids for c in o.outputs], [c.finish_reason for c in o.outputs], o.num_cached_tokens) for o in outs]


def _assert_clean(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.stats().cpu_used == 0
    assert_no_leak(engine)


def _fail_on_call(k: int, real, exc: BaseException):
    """``real`` wrapped to raise ``exc`` at its k-th call (1-based)."""
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            raise exc
        return real(*args, **kwargs)

    return wrapper


def _then_serves_like_a_fresh_engine(tiny, engine: LLMEngine, **kw: Any) -> None:
    """The same prompts again (they would hit any block hashed by the failed step) and new
    ones: identical to a fresh engine, prefix-cache hits included."""
    prompts = _prompts() + [[7, 8, 9, 10, 11]]
    params = _params() + [GREEDY]
    got = engine.generate(prompts, params)
    want = _engine(tiny, **kw).generate(prompts, params)
    assert _summary(got) == _summary(want)
    _assert_clean(engine)


# ---- 1. a failed step ------------------------------------------------------------------------


@pytest.mark.parametrize("exc", [RuntimeError("device lost"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
@pytest.mark.parametrize("k", [1, 2, 4])  # 1: mid-prefill (blocks hashed, KV never written)
def test_forward_failing_mid_generate_aborts_its_requests_and_engine_stays_usable(tiny, exc, k):
    engine = _engine(tiny)
    real = engine.model.forward
    engine.model.forward = _fail_on_call(k, real, exc)
    with pytest.raises(type(exc)) as info:
        engine.generate(_prompts(), _params())
    assert any("aborted requests" in n for n in getattr(info.value, "__notes__", []))
    engine.model.forward = real
    _assert_clean(engine)
    _then_serves_like_a_fresh_engine(tiny, engine)


def test_beam_search_error_mid_step_aborts_and_engine_stays_usable(tiny, monkeypatch):
    # the new user's repro: a TypeError inside beam processing left every later generate stuck
    engine = _engine(tiny)
    monkeypatch.setattr(BeamSearch, "step", _fail_on_call(2, BeamSearch.step, TypeError("beam bug")))
    with pytest.raises(TypeError, match="beam bug"):
        engine.generate([_prompts()[0], [5, 6, 7]], [SamplingParams(max_tokens=8, beam_width=3), GREEDY])
    monkeypatch.undo()
    _assert_clean(engine)
    _then_serves_like_a_fresh_engine(tiny, engine)


def test_failure_between_a_beam_fork_and_its_bookkeeping_frees_the_child(tiny):
    # beam_width 4: the first beam step forks the prompt's sequence 3 times; fail at the 2nd fork,
    # after the 1st child is registered in the manager but before the request lists it.
    engine = _engine(tiny)
    registry = engine.requests
    registry.new_sequence = _fail_on_call(3, registry.new_sequence, RuntimeError("fork failed"))
    with pytest.raises(RuntimeError, match="fork failed"):
        engine.generate([_prompts()[1]], SamplingParams(max_tokens=6, beam_width=4))
    del registry.new_sequence
    _assert_clean(engine)
    _then_serves_like_a_fresh_engine(tiny, engine)


def test_failure_in_a_step_that_swaps_out_aborts_the_victim_too(tiny):
    # a 40-block pool forces swap preemption; the step planning the first swap-out fails before
    # the copy to CPU ran, so the victim's CPU blocks hold nothing: it must be aborted as well.
    engine = _engine(tiny, num_kv_blocks=40, preemption="swap")
    real = engine.runner.execute
    swapped = []

    def execute(batch):
        if batch.swap_out is not None:
            swapped.append(len(batch.swap_out))
            raise RuntimeError("failed with a swap-out planned")
        return real(batch)

    engine.runner.execute = execute
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 33, 1, 64, 100, 16, 48)]
    with pytest.raises(RuntimeError, match="swap-out planned"):
        engine.generate(prompts, SamplingParams(max_tokens=32))
    assert swapped
    engine.runner.execute = real
    _assert_clean(engine)
    _then_serves_like_a_fresh_engine(tiny, engine, num_kv_blocks=40, preemption="swap")


def test_swapped_beam_group_resumes_with_a_beam_that_already_has_its_logprobs(tiny):
    # Found while interrupting generate at random points: a beam request swapped out while one
    # beam had its next-token logprobs (waiting for its siblings) was swapped in with a 0-token
    # slot request for that beam, which the manager refuses (InvalidArgumentError).
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 33, 1, 64, 40, 16, 48)]
    params = [
        SamplingParams(max_tokens=24),
        SamplingParams(max_tokens=16, n=2, temperature=1.0, seed=1),
        SamplingParams(max_tokens=12, beam_width=3),
    ] * 2 + [SamplingParams(max_tokens=20)] * 2
    engine = _engine(tiny, num_kv_blocks=60, preemption="swap")
    got = engine.generate(prompts, params)
    assert engine.stats().swaps_out_blocks > 0
    want = _engine(tiny, num_kv_blocks=200).generate(prompts, params)  # no preemption
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    _assert_clean(engine)


def test_waiting_request_without_kv_survives_a_failed_step(tiny):
    # step() API, one sequence per step: A runs (and fails), B waits with no KV and is kept.
    engine = _engine(tiny, max_num_seqs=1)
    a, b = _prompts()[0], _prompts()[2]
    engine.add_request(a, GREEDY, request_id="A")
    engine.add_request(b, GREEDY, request_id="B")
    real = engine.model.forward
    engine.model.forward = _fail_on_call(1, real, RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom") as info:
        engine.step()
    assert "aborted requests ['A']" in info.value.__notes__[0]
    engine.model.forward = real
    assert engine.has_unfinished() and [r.request_id for r in engine.scheduler.waiting] == ["B"]
    assert engine.stats().used == 0
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    want = _engine(tiny, max_num_seqs=1).generate([b], GREEDY)[0]
    assert [o.request_id for o in outs] == ["B"] and outs[0].token_ids == want.token_ids
    _assert_clean(engine)


def test_interrupted_generate_aborts_only_its_own_requests(tiny):
    # Ctrl-C between two steps: this call's requests are dropped (never served later), a request
    # queued before with add_request stays and completes normally.
    engine = _engine(tiny)
    engine.add_request([9, 8, 7, 6], GREEDY, request_id="mine")
    engine.step = _fail_on_call(3, engine.step, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        engine.generate(_prompts(), _params())
    del engine.step
    assert [r.request_id for r in engine.scheduler.running + engine.scheduler.waiting] == ["mine"]
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["mine"]
    assert outs[0].token_ids == _engine(tiny).generate([[9, 8, 7, 6]], GREEDY)[0].token_ids
    _assert_clean(engine)
    got = engine.generate(_prompts(), _params())  # the prefix cache is intact here: tokens only
    want = _engine(tiny).generate(_prompts(), _params())
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    _assert_clean(engine)


# ---- 2. SamplingParams -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(length_penalty=None), "length_penalty=None"),
        (dict(length_penalty="1.0"), "length_penalty='1.0'"),
        (dict(length_penalty=math.nan), "length_penalty=nan"),
        (dict(length_penalty=math.inf), "length_penalty=inf"),
        (dict(stop=5), "stop=5"),
        (dict(stop=["ok", 3]), r"stop=\('ok', 3\)"),
        (dict(stop={"a": 1}), r"stop=\{'a': 1\}"),
        (dict(temperature=True), "temperature=True"),
        (dict(top_p=True), "top_p=True"),
        (dict(n=True), "n=True"),
        (dict(max_tokens=True), "max_tokens=True"),
        (dict(top_k=False), "top_k=False"),
        (dict(beam_width=True), "beam_width=True"),
        (dict(ignore_eos="no"), "ignore_eos='no'"),
        (dict(ignore_eos=1), "ignore_eos=1"),
        (dict(early_stopping=1), "early_stopping=1"),
        (dict(beam_width=2, top_p=0.9), "top_p=0.9 .*deterministic and does not sample"),
        (dict(beam_width=2, top_k=5), "top_k=5 .*deterministic and does not sample"),
        (dict(beam_width=2, temperature=0.5), "temperature=0.5 .*deterministic and does not sample"),
    ],
)
def test_bad_sampling_params_name_field_and_value(kwargs, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        SamplingParams(**kwargs)


def test_stop_none_means_no_stop_strings(tiny):
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b") and SamplingParams(stop="a").stop == ("a",)
    engine = _engine(tiny)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=5, stop=None, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    _assert_clean(engine)


def test_stop_string_output_keeps_its_tokens_but_cuts_the_text(tiny):
    # documented on CompletionOutput.token_ids (vLLM does the same)
    engine = _engine(tiny)
    full = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    stop = tiny.tokenizer.decode([full[2]])
    decode = tiny.tokenizer.decode
    end = next(j for j in range(1, len(full) + 1) if stop in decode(list(full[:j])))
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True, stop=stop))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full[:end]  # up to and including the token that completed the stop string
    text = decode(list(full[:end]))
    assert stop not in out.text and out.text == text[: text.index(stop)]


# ---- 3. request inputs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,needle",
    [
        (lambda e: e.generate([[5]], {"max_tokens": 3}), r"params=\{'max_tokens': 3\} is invalid.*dict"),
        (lambda e: e.generate([[5]], [{"max_tokens": 3}]), r"params=\{'max_tokens': 3\} is invalid"),
        (lambda e: e.add_request([5], {}), r"params=\{\} is invalid"),
        (lambda e: e.generate(None), "prompts=None is invalid"),
        (lambda e: e.generate(5), "prompts=5 is invalid"),
        (lambda e: e.generate(b"w5 w6"), "prompts=b'w5 w6' is invalid"),
        (lambda e: e.generate([None]), "prompt None is invalid"),
        (lambda e: e.add_request(None), "prompt None is invalid"),
        (lambda e: e.add_request(7), "prompt 7 is invalid.*got int"),
        (lambda e: e.add_request(b"w5 w6"), "prompt b'w5 w6' is invalid.*got bytes"),
        (lambda e: e.add_request([5, 1.7]), "token id 1.7 is invalid.*got float"),
        (lambda e: e.add_request([5, "6"]), "token id '6' is invalid.*got str"),
        (lambda e: e.add_request([True, 5]), "token id True is invalid.*got bool"),
        (lambda e: e.add_request(np.array([5.0, 6.0])), "token id 5.0 is invalid"),
        (lambda e: e.add_request({"prompt": [5, 2.5]}), "token id 2.5 is invalid"),
        (lambda e: e.add_request({"messages": "hi"}), r"prompt \{'messages': 'hi'\} has malformed 'messages'"),
        (lambda e: e.add_request({"messages": []}), "has malformed 'messages'"),
        (lambda e: e.add_request({"messages": [{"role": "user"}]}), "has malformed 'messages'"),
        (lambda e: e.add_request({"messages": [{"role": "user", "content": 5}]}), "has malformed 'messages'"),
        (lambda e: e.add_request({"messages": ["hi"]}), "has malformed 'messages'"),
        (lambda e: e.add_request({"prompt": "w5", "system": 3}), "has an invalid 'system'"),
        (lambda e: e.add_request([5], cache_salt=5), "cache_salt=5 is invalid"),
        (lambda e: e.add_request({"prompt": [5], "cache_salt": b"x"}), "cache_salt=b'x' is invalid"),
        (lambda e: e.generate([[5]], cache_salt=["t"]), r"cache_salt=\['t'\] is invalid"),
        (lambda e: e.generate([[5]], system_prompt=1), "system_prompt=1 is invalid"),
        (lambda e: e.generate([{"id": "x", "prompt": [5]}, {"id": "x", "prompt": [6]}]), "'x' appears twice"),
        (
            lambda e: e.add_request({"prompt": "w5", "messages": [{"role": "user", "content": "w6"}]}),
            "has both 'prompt' and 'messages'",
        ),
        (
            lambda e: e.add_request([5], request_id=[1]),
            r"request_id=\[1\] is invalid: expected a non-empty str or an int",
        ),
        (lambda e: e.add_request([5], request_id=""), "request_id='' is invalid"),
        (lambda e: e.generate([{"prompt": [5], "id": 1.5}]), "request_id=1.5 is invalid"),
        (lambda e: e.generate([{"prompt": [5], "id": True}]), "request_id=True is invalid"),
        (lambda e: e.add_request({"prompt": [5], "max_tokens": 0}), "max_tokens=0 is invalid"),
        (lambda e: e.generate([{"prompt": [5], "max_tokens": "3"}]), "max_tokens='3' is invalid"),
    ],
)
def test_bad_request_inputs_raise_invalid_request_and_queue_nothing(tiny, call, needle):
    engine = _engine(tiny)
    with pytest.raises(InvalidRequestError, match=needle):
        call(engine)
    _assert_clean(engine)


def test_prompt_dict_max_tokens_overrides_the_params_as_in_a_prompts_file(tiny):
    engine = _engine(tiny)
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    outs = engine.generate([{"prompt": [5, 6], "max_tokens": 3}, {"prompt": [5, 6]}], params)
    assert [len(o.token_ids) for o in outs] == [3, 7]
    assert [o.finish_reason for o in outs] == ["length", "length"]
    rid = engine.add_request({"prompt": [5, 6], "max_tokens": 2, "id": 41}, params)
    assert rid == "41"
    (out,) = engine.run()
    assert out.request_id == "41" and len(out.token_ids) == 2
    _assert_clean(engine)


def test_chat_template_error_becomes_invalid_request(tiny):
    engine = _engine(tiny)
    engine.prompts.tokenizer = type(tiny.tokenizer).from_pretrained(str(tiny.path))
    engine.prompts.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequestError, match="chat template rejected.*roles must alternate"):
        engine.add_request({"messages": [{"role": "user", "content": "w5"}]})
    _assert_clean(engine)


def test_accepted_prompt_forms_give_the_same_tokens(tiny):
    engine = _engine(tiny)
    ids = [5, 6, 7, 8]
    want = engine.generate([ids], GREEDY)[0].token_ids
    outs = engine.generate([tuple(ids), np.array(ids), torch.tensor(ids), range(5, 9), {"prompt": ids}], (GREEDY,) * 5)
    assert [o.token_ids for o in outs] == [want] * 5
    single = engine.generate("w5 w6 w7", GREEDY)  # one text prompt, not one prompt per character
    assert len(single) == 1 and single[0].prompt == "w5 w6 w7"
    _assert_clean(engine)


# ---- 4. engine arguments ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(preemption="x"), "preemption='x' is invalid"),
        (dict(max_num_seqs=0), "max_num_seqs=0 is invalid"),
        (dict(max_num_seqs=True), "max_num_seqs=True is invalid"),
        (dict(max_tokens_per_step=0), "max_tokens_per_step=0 is invalid"),
        (dict(kv_bytes=-1), "kv_bytes=-1 is invalid"),
        (dict(kv_bytes="1G"), "kv_bytes='1G' is invalid"),
        (dict(num_kv_blocks=1), "num_kv_blocks=1 is invalid"),
        (dict(block_size=0), "block_size=0 is invalid"),
        (dict(num_cpu_blocks=-2), "num_cpu_blocks=-2 is invalid"),
        (dict(hash_algo="md5"), "hash_algo='md5' is invalid"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching='yes' is invalid"),
        (dict(seed=1.5), "seed=1.5 is invalid"),
        (dict(dtype="float64"), "dtype='float64' is invalid"),
        (dict(dtype=torch.int64), "dtype=torch.int64 is invalid"),
        (dict(dtype="fp32"), "dtype='fp32' is invalid"),
        # the core's upper bounds, asked of pagedkv.CacheConfig before the load
        (dict(block_size=pagedkv.MAX_BLOCK_SIZE + 1), f"block_size={pagedkv.MAX_BLOCK_SIZE + 1} is invalid"),
        (dict(num_kv_blocks=pagedkv.MAX_BLOCKS + 1), f"num_kv_blocks={pagedkv.MAX_BLOCKS + 1} is invalid"),
        (dict(num_cpu_blocks=2**32), f"num_cpu_blocks={2**32} is invalid"),
    ],
)
def test_bad_engine_arguments_raise_before_the_model_load(tmp_path, kwargs, needle):
    # the model path does not exist: any check done after the load would raise ModelNotFoundError
    with pytest.raises(EngineConfigError, match=needle) as info:
        LLMEngine(tmp_path / "missing.gguf", **kwargs)
    assert isinstance(info.value, ValueError)


def test_engine_config_errors_that_need_the_model(tiny):
    with pytest.raises(EngineConfigError, match="tokenizer=None is invalid"):
        LLMEngine(tiny.hf)
    per_block = _engine(tiny).model.kv_bytes_per_block(4)
    with pytest.raises(EngineConfigError, match=f"kv_bytes={per_block} is invalid: it holds 1 blocks"):
        _engine(tiny, num_kv_blocks=None, kv_bytes=per_block)


@pytest.mark.parametrize("name", ["float32", "torch.float32", None])
def test_dtype_accepts_torch_dtype_names(tiny, name):
    engine = _engine(tiny, dtype=name)
    assert engine.runner.kv_cache.dtype == torch.float32
    got = engine.generate([[5, 6, 7]], GREEDY)[0].token_ids
    assert got == _engine(tiny).generate([[5, 6, 7]], GREEDY)[0].token_ids


def test_dtype_name_selects_that_dtype(tiny):
    assert _engine(tiny, dtype="bfloat16", num_kv_blocks=8).runner.kv_cache.dtype == torch.bfloat16
